"""Colour-image batches: ``gather_batch_chw`` (flip, random crop, per-channel normalisation) and the
DataLoader on (N, C, H, W) data.

The numpy twin is checked against a pixel-by-pixel loop written from the docstring's formula; the
GPU kernel (``@pytest.mark.gpu``) against the twin, bit for bit, randomness included.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cydnn.datasets import DataLoader
from cydnn.ops.cpu.data import flips, gather_batch, gather_batch_chw, shifts


def reference(images, indices, mean, std, pad, max_shift, flip, seed):
    """The contract, one pixel at a time: flip, then shift (zero fill), pad, normalise per channel."""
    batch = len(indices)
    _, c, h, w = images.shape
    sy, sx = shifts(seed, batch, max_shift)
    mirrored = flips(seed, batch) if flip else np.zeros(batch, bool)
    out = np.zeros((batch, c, h + 2 * pad, w + 2 * pad), np.float32)
    for b in range(batch):
        for ch in range(c):
            for oy in range(h + 2 * pad):
                for ox in range(w + 2 * pad):
                    iy, ix, v = oy - pad, ox - pad, np.float32(0)
                    if 0 <= iy < h and 0 <= ix < w:
                        ry, rx = iy - sy[b], ix - sx[b]
                        if 0 <= ry < h and 0 <= rx < w:
                            rx = w - 1 - rx if mirrored[b] else rx
                            v = np.float32(images[indices[b], ch, ry, rx]) / np.float32(255)
                    out[b, ch, oy, ox] = (v - np.float32(mean[ch])) / np.float32(std[ch])
    return out


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), c=st.integers(1, 4), h=st.integers(1, 6), w=st.integers(1, 6),
       batch=st.integers(1, 6), pad=st.integers(0, 2), max_shift=st.integers(0, 7), flip=st.booleans(),
       seed=st.integers(0, 2**64 - 1), data_seed=st.integers(0, 1000))
def test_twin_matches_the_pixel_loop(n, c, h, w, batch, pad, max_shift, flip, seed, data_seed):
    rng = np.random.default_rng(data_seed)
    images = rng.integers(0, 256, (n, c, h, w), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    indices = rng.integers(0, n, batch)
    mean = rng.uniform(-1, 1, c).tolist()
    std = rng.uniform(0.1, 2, c).tolist()
    x, y = gather_batch_chw(images, labels, indices, mean, std, pad, max_shift, flip, seed)
    np.testing.assert_array_equal(x, reference(images, indices, mean, std, pad, max_shift, flip, seed))
    np.testing.assert_array_equal(y, labels[indices])
    assert x.dtype == np.float32 and y.dtype == np.int32


def test_one_channel_is_gather_batch():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (20, 9, 11), dtype=np.uint8)
    idx = rng.permutation(20)
    a, _ = gather_batch_chw(images[:, None], None, idx, 0.13, 0.31, pad=2, max_shift=3, seed=77)
    b, _ = gather_batch(images, None, idx, 0.13, 0.31, pad=2, max_shift=3, seed=77)
    np.testing.assert_array_equal(a, b)


def test_flips_are_fair_and_actually_mirror():
    assert 0.45 < flips(123, 4000).mean() < 0.55
    images = np.arange(2 * 3 * 2 * 4, dtype=np.uint8).reshape(2, 3, 2, 4)
    mirrored = flips(5, 64)
    b = int(np.flatnonzero(mirrored)[0])
    idx = np.zeros(64, np.int64)
    x, _ = gather_batch_chw(images, None, idx, 0.0, 1.0, flip=True, seed=5)
    np.testing.assert_array_equal(x[b] * 255, images[0, :, :, ::-1].astype(np.float32))
    keep = int(np.flatnonzero(~mirrored)[0])
    np.testing.assert_array_equal(x[keep] * 255, images[0].astype(np.float32))


@pytest.mark.parametrize("call, error, words", [
    (lambda im: gather_batch_chw(im[:, :, :, :, None], None, [0], 0, 1), ValueError, ["rank 4"]),
    (lambda im: gather_batch_chw(im.astype(np.float32), None, np.arange(1), 0, 1), TypeError, ["uint8"]),
    (lambda im: gather_batch_chw(im, None, np.arange(1), [0, 0], 1), ValueError, ["mean", "3 numbers"]),
    (lambda im: gather_batch_chw(im, None, np.arange(1), 0, [1, 0, 1]), ValueError, ["std must be > 0"]),
    (lambda im: gather_batch_chw(im, None, np.arange(1), 0, 1, flip=1), TypeError, ["flip must be a bool"]),
    (lambda im: gather_batch_chw(im, None, np.array([4]), 0, 1), ValueError, ["indices[0] = 4", "[0, 4)"]),
    (lambda im: gather_batch_chw(np.zeros((1, 65, 2, 2), np.uint8), None, np.arange(1), 0, 1), ValueError,
     ["1 to 64 channels"]),
])
def test_bad_arguments_are_named(call, error, words):
    images = np.zeros((4, 3, 5, 5), np.uint8)
    with pytest.raises(error) as info:
        call(images)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "gather_batch_chw" in str(info.value)


def test_loader_on_colour_images_uses_per_channel_stats_and_its_seed():
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (37, 3, 8, 8), dtype=np.uint8)
    labels = rng.integers(0, 10, 37)
    mean, std = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)
    loader = DataLoader(images, labels, batch_size=16, seed=4, mean=mean, std=std, max_shift=4, flip=True)
    perm = loader.permutation(0)
    batches = list(loader)
    assert [x.shape for x, _ in batches] == [(16, 3, 8, 8), (16, 3, 8, 8), (5, 3, 8, 8)]
    for b, (x, y) in enumerate(batches):
        idx = perm[16 * b:16 * (b + 1)]
        want = reference(images, idx, mean, std, 0, 4, True, loader.batch_seed(0, b))
        np.testing.assert_array_equal(x, want)
        np.testing.assert_array_equal(y, labels[idx])


def test_loader_refuses_flip_for_grey_images_and_wrong_stats():
    grey = np.zeros((4, 8, 8), np.uint8)
    with pytest.raises(ValueError, match="flip=True needs"):
        DataLoader(grey, np.zeros(4, int), flip=True)
    with pytest.raises(ValueError, match="3 numbers"):
        DataLoader(np.zeros((4, 3, 8, 8), np.uint8), np.zeros(4, int), mean=(0.1, 0.2))
    with pytest.raises(ValueError, match="std > 0"):
        DataLoader(np.zeros((4, 3, 8, 8), np.uint8), np.zeros(4, int), std=(1, 1, 0))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        DataLoader(np.zeros((4, 3, 8, 8), np.uint8), np.array([0, 1, 2, 10]))


# ------------------------------------------------------------------ on the device
@pytest.mark.gpu
@pytest.mark.parametrize("pad, max_shift, flip", [(0, 0, False), (0, 4, True), (2, 3, True), (1, 40, False)])
def test_gpu_kernel_equals_the_twin_bit_for_bit(pad, max_shift, flip):
    import cydnn
    from cydnn.ops import cuda
    rng = np.random.default_rng(pad * 100 + max_shift)
    images = rng.integers(0, 256, (300, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, 300).astype(np.int32)
    indices = rng.permutation(300)[:129].astype(np.int32)
    mean, std = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)
    seed = int(rng.integers(0, 2**63))
    want_x, want_y = gather_batch_chw(images, labels, indices, mean, std, pad, max_shift, flip, seed)
    x, y = cuda.gather_batch_chw(cydnn.to_device(images), cydnn.to_device(labels), cydnn.to_device(indices),
                                 mean, std, pad, max_shift, flip, seed)
    np.testing.assert_array_equal(x.numpy(), want_x)     # the same shifts, flips and float operations
    np.testing.assert_array_equal(y.numpy(), want_y)
    host_x, host_y = cuda.gather_batch_chw(images, labels, indices, mean, std, pad, max_shift, flip, seed)
    np.testing.assert_array_equal(host_x, want_x)        # numpy in, numpy out


@pytest.mark.gpu
def test_gpu_loader_equals_cpu_loader_on_colour_images():
    rng = np.random.default_rng(9)
    images = rng.integers(0, 256, (70, 3, 16, 16), dtype=np.uint8)
    labels = rng.integers(0, 10, 70)
    kwargs = dict(batch_size=32, seed=11, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), max_shift=2, flip=True)
    cpu = list(DataLoader(images, labels, device="cpu", **kwargs))
    gpu = list(DataLoader(images, labels, device="cuda", **kwargs))
    assert len(cpu) == len(gpu) == 3
    for (xc, yc), (xg, yg) in zip(cpu, gpu):
        np.testing.assert_array_equal(xg.numpy(), xc)
        np.testing.assert_array_equal(yg.numpy(), yc)


@pytest.mark.gpu
def test_gpu_bad_device_index_reads_nothing():
    import cydnn
    from cydnn.ops import cuda
    images = cydnn.to_device(np.ones((5, 3, 4, 4), np.uint8))
    labels = cydnn.to_device(np.arange(5, dtype=np.int32))
    x, y = cuda.gather_batch_chw(images, labels, cydnn.to_device(np.array([1, 7, -3], np.int32)), 0.5, 0.5)
    x, y = x.numpy(), y.numpy()
    np.testing.assert_array_equal(y, [1, -1, -1])
    assert np.isnan(x[1:]).all() and np.isfinite(x[0]).all()
