"""IDX parsing and the DataLoader on grey (N, H, W) images: what it asks of the backend (a spy),
and its batches on the CPU backend (cydnn.ops.cpu.gather_batch).  No real data needed.

(Split from test_datasets.py, which keeps the download and cache tests on real MNIST.)
"""
import struct

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DataLoader, read_idx

# --------------------------------------------------------------------------
# IDX parsing
# --------------------------------------------------------------------------

def idx_bytes(dims, payload=None, dtype=0x08, zeros=b"\x00\x00"):
    if payload is None:
        payload = bytes(i % 256 for i in range(int(np.prod(dims))))
    return zeros + bytes([dtype, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + payload


def test_read_idx_parses_labels_and_images(tmp_path):
    labels = read_idx(idx_bytes((5,), bytes([3, 1, 4, 1, 5])))
    assert labels.dtype == np.uint8 and labels.tolist() == [3, 1, 4, 1, 5]

    images = read_idx(idx_bytes((2, 3, 4)))
    assert images.shape == (2, 3, 4) and images.dtype == np.uint8
    assert images.flags.writeable
    assert images[1, 2, 3] == 23

    path = tmp_path / "images-idx3-ubyte"
    path.write_bytes(idx_bytes((2, 3, 4)))
    np.testing.assert_array_equal(read_idx(path), images)
    np.testing.assert_array_equal(read_idx(str(path)), images)


@pytest.mark.parametrize("data, message", [
    (b"\x00\x00", "too short for the 4-byte IDX magic"),
    (idx_bytes((5,), zeros=b"\x12\x34"), r"bad magic number 0x12340801"),
    (idx_bytes((5,), dtype=0x0D), r"data type byte is 0x0D.*only 0x08"),
    (idx_bytes((4, 5)), r"rank 2 \(magic number 0x00000802\) is not supported"),
    (idx_bytes((1, 2, 2, 2)), r"rank 4 .* is not supported"),
    (idx_bytes((5,))[:6], "too short for the 8-byte header"),
    (idx_bytes((2, 3, 4))[:-1], r"need 24 data bytes after the header, but 23 follow \(truncated\)"),
    (idx_bytes((5,)) + b"\x00", r"need 5 data bytes after the header, but 6 follow \(trailing bytes\)"),
    (idx_bytes((2, 0, 4)), "rows and columns must be > 0"),
])
def test_read_idx_rejects_bad_files(data, message):
    with pytest.raises(ValueError, match=message):
        read_idx(data)


def test_read_idx_names_the_file(tmp_path):
    path = tmp_path / "broken"
    path.write_bytes(idx_bytes((5,), dtype=0x09))
    with pytest.raises(ValueError, match="broken"):
        read_idx(path)


def test_images_and_labels_counts_must_agree():
    images = np.zeros((10, 28, 28), np.uint8)
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        datasets.idx._check_pair(images, np.zeros(9, np.int32), 10)
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        DataLoader(images, np.zeros(9, np.int32))


# --------------------------------------------------------------------------
# DataLoader: what it asks of the backend (a spy backend, no real op)
# --------------------------------------------------------------------------

class SpyBackend:
    """Records the loader's calls to ``asarray`` and ``gather_batch``; returns the indices as x."""

    def __init__(self):
        self.uploads = []
        self.calls = []

    def asarray(self, array):
        self.uploads.append(array.copy())
        return np.asarray(array)

    def gather_batch(self, images, labels, indices, mean, std, pad=0, max_shift=0, seed=0):
        self.calls.append(dict(images=images, labels=labels, indices=indices.copy(), mean=mean,
                               std=std, pad=pad, max_shift=max_shift, seed=seed))
        return indices.copy(), labels[indices]


@pytest.fixture
def spy(monkeypatch):
    backend = SpyBackend()
    monkeypatch.setattr(datasets.loader.cydnn.ops, "backend", lambda device: backend)
    return backend


def test_loader_uploads_once_and_calls_gather_batch_once_per_batch(spy):
    images = np.zeros((10, 28, 28), np.uint8)
    labels = np.arange(10) % 10
    loader = DataLoader(images, labels, batch_size=4, seed=3, mean=0.5, std=0.25, pad=2,
                        max_shift=1, device="cuda")
    assert len(spy.uploads) == 2  # images and labels, once
    assert spy.uploads[0].dtype == np.uint8 and spy.uploads[0].flags.c_contiguous
    assert spy.uploads[1].dtype == np.int32

    for epoch in range(2):
        batches = list(loader)
        assert len(spy.uploads) == 3 + epoch  # one permutation upload per epoch
        perm = spy.uploads[-1]
        assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(10))
        calls = spy.calls[-3:]
        assert len(batches) == 3 and len(spy.calls) == 3 * (epoch + 1)
        assert [c["indices"].tolist() for c in calls] == [perm[0:4].tolist(), perm[4:8].tolist(),
                                                          perm[8:10].tolist()]
        for b, c in enumerate(calls):
            assert (c["mean"], c["std"], c["pad"], c["max_shift"]) == (0.5, 0.25, 2, 1)
            assert type(c["seed"]) is int and 0 <= c["seed"] < 2**63
            assert c["seed"] == loader.batch_seed(epoch, b)
    seeds = [c["seed"] for c in spy.calls]
    assert len(set(seeds)) == len(seeds)  # every batch of every epoch has its own seed


def test_loader_without_shuffle_uploads_its_order_once(spy):
    loader = DataLoader(np.zeros((5, 4, 4), np.uint8), np.arange(5), batch_size=2, shuffle=False)
    for _ in range(3):
        assert [x.tolist() for x, _ in loader] == [[0, 1], [2, 3], [4]]
    assert len(spy.uploads) == 3  # images, labels, the fixed order


def test_loader_validates_on_the_host_before_uploading(spy):
    images = np.zeros((4, 28, 28), np.uint8)
    for labels in ([0, 1, 2, 10], [0, -1, 2, 3]):
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
            DataLoader(images, np.array(labels))
    with pytest.raises(ValueError, match="uint8"):
        DataLoader(images.astype(np.float32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="integers"):
        DataLoader(images, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="seed must be >= 0"):
        DataLoader(images, np.zeros(4, np.int32), seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        DataLoader(images, np.zeros(4, np.int32), seed=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(images, np.zeros(4, np.int32), batch_size=0)
    with pytest.raises(ValueError, match="std > 0"):
        DataLoader(images, np.zeros(4, np.int32), std=0.0)
    assert spy.uploads == []


# --------------------------------------------------------------------------
# DataLoader on the CPU backend (cydnn.ops.cpu.gather_batch)
# --------------------------------------------------------------------------

MEAN, STD = 0.1307, 0.3081


def numbered_images(n, size=28):
    """Images whose centre pixel holds their index (n <= 256), labels = index % 10."""
    images = np.zeros((n, size, size), np.uint8)
    images[:, size // 2, size // 2] = np.arange(n)
    return images, np.arange(n) % 10


def decode(x, pad=0, size=28):
    """The index stored in each batch image's centre pixel."""
    centre = size // 2 + pad
    return np.rint((x[:, 0, centre, centre] * STD + MEAN) * 255).astype(int)


def epoch_ids(loader):
    return np.concatenate([decode(x, loader.pad) for x, _ in loader])


def test_cpu_batches_shapes_and_types():
    images, labels = numbered_images(250)
    loader = DataLoader(images, labels, batch_size=64, mean=MEAN, std=STD)
    assert len(loader) == 4 and loader.num_samples == 250
    batches = list(loader)
    assert [x.shape for x, _ in batches] == [(64, 1, 28, 28)] * 3 + [(58, 1, 28, 28)]
    assert [y.shape for _, y in batches] == [(64,)] * 3 + [(58,)]
    assert all(x.dtype == np.float32 and y.dtype == np.int32 for x, y in batches)

    dropping = DataLoader(images, labels, batch_size=64, mean=MEAN, std=STD, drop_last=True)
    assert len(dropping) == 3
    assert [x.shape[0] for x, _ in dropping] == [64, 64, 64]
    assert len(DataLoader(images, labels, batch_size=50, drop_last=True)) == 5


def test_cpu_batches_are_normalised():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(20, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=20)
    loader = DataLoader(images, labels, batch_size=8, shuffle=False, mean=MEAN, std=STD)
    x = np.concatenate([x for x, _ in loader])
    y = np.concatenate([y for _, y in loader])
    expected = (images.astype(np.float64) / 255 - MEAN) / STD
    np.testing.assert_allclose(x[:, 0], expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(y, labels)


def test_cpu_every_sample_exactly_once_per_epoch_with_its_label():
    images, labels = numbered_images(250)
    loader = DataLoader(images, labels, batch_size=32, mean=MEAN, std=STD, seed=7)
    for _ in range(3):
        ids, ys = [], []
        for x, y in loader:
            ids.append(decode(x))
            ys.append(y)
        ids, ys = np.concatenate(ids), np.concatenate(ys)
        assert sorted(ids.tolist()) == list(range(250))
        np.testing.assert_array_equal(ys, ids % 10)


def test_cpu_order_differs_between_epochs_and_repeats_with_the_seed():
    images, labels = numbered_images(250)

    def make(seed):
        return DataLoader(images, labels, batch_size=32, mean=MEAN, std=STD, seed=seed)
    a, b, c = make(0), make(0), make(1)
    a0, a1 = epoch_ids(a), epoch_ids(a)
    assert not np.array_equal(a0, a1)                   # a new order each epoch
    np.testing.assert_array_equal(epoch_ids(b), a0)     # same seed, same orders
    np.testing.assert_array_equal(epoch_ids(b), a1)
    assert not np.array_equal(epoch_ids(c), a0)         # another seed, another order
    assert a.epoch == 2
    a.set_epoch(1)                                      # replay an epoch
    np.testing.assert_array_equal(epoch_ids(a), a1)
    np.testing.assert_array_equal(a.permutation(0), a0)  # the ids are the indices


def test_cpu_pad_two_gives_32x32_with_a_background_border():
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, size=(6, 28, 28), dtype=np.uint8)
    labels = np.arange(6)
    plain = np.concatenate([x for x, _ in DataLoader(images, labels, shuffle=False, mean=MEAN, std=STD)])
    padded = np.concatenate([x for x, _ in DataLoader(images, labels, shuffle=False, mean=MEAN,
                                                      std=STD, pad=2)])
    assert padded.shape == (6, 1, 32, 32)
    np.testing.assert_array_equal(padded[:, :, 2:30, 2:30], plain)
    border = padded.copy()
    border[:, :, 2:30, 2:30] = np.nan
    border = border[~np.isnan(border)]
    np.testing.assert_allclose(border, -MEAN / STD, rtol=1e-6)


def test_cpu_max_shift_translates_images_and_keeps_pixel_mass():
    rng = np.random.default_rng(3)
    images = np.zeros((64, 28, 28), np.uint8)
    images[:, 10:18, 10:18] = rng.integers(1, 256, size=(64, 8, 8))  # empty borders, wider than the shift
    labels = np.zeros(64, np.int32)
    kw = dict(batch_size=16, shuffle=False, mean=MEAN, std=STD)
    plain = np.concatenate([x for x, _ in DataLoader(images, labels, **kw)])
    shifted = np.concatenate([x for x, _ in DataLoader(images, labels, max_shift=2, **kw)])
    again = np.concatenate([x for x, _ in DataLoader(images, labels, max_shift=2, **kw)])

    assert shifted.shape == plain.shape == (64, 1, 28, 28)
    np.testing.assert_array_equal(shifted, again)  # same seed, same shifts
    pixels = (shifted[:, 0].astype(np.float64) * STD + MEAN) * 255
    np.testing.assert_allclose(pixels.sum(axis=(1, 2)), images.sum(axis=(1, 2)), rtol=1e-5)

    shifts = []
    for k in range(64):
        found = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                 if np.allclose(shifted[k, 0], np.roll(plain[k, 0], (dy, dx), axis=(0, 1)), atol=1e-5)]
        assert found, f"image {k} is not a translation by at most 2 pixels"
        shifts.append(found[0])
    assert len(set(shifts)) > 5                         # shifts vary between images
    assert sum(s != (0, 0) for s in shifts) > 32        # most images moved
