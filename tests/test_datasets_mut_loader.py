"""Mutation-driven tests of cydnn.datasets.loader (DataLoader): every refusal with its exact
message naming the argument, the boundaries (64 channels accepted, 65 refused; 2**31 samples
refused), the defaults, the seeds and orders against numpy computed here, and which backend op
builds a colour batch.  CPU only, no real data."""

import types

import numpy as np
import pytest

import cydnn.ops
from cydnn.datasets import DataLoader
from cydnn.datasets import loader as L
from cydnn.ops.cpu import data as cpu_data


def _grey(n=5, h=3, w=4):
    return (np.arange(n * h * w) * 7 % 256).astype(np.uint8).reshape(n, h, w), np.arange(n) % 10


def _colour(n=5, c=3, h=3, w=4):
    return (np.arange(n * c * h * w) * 5 % 256).astype(np.uint8).reshape(n, c, h, w), np.arange(n) % 10


def _msg(error, *args, **kwargs):
    with pytest.raises(error) as e:
        DataLoader(*args, **kwargs)
    return str(e.value)


# ------------------------------------------------------------------ defaults and repr
def test_defaults_are_the_documented_ones():
    x, y = _grey(300, 2, 2)
    ld = DataLoader(x, y)
    assert ld.batch_size == 128 and len(ld) == 3
    assert ld.seed == 0 and ld.shuffle is True and ld.pad == 0 and ld.max_shift == 0
    assert ld.mean == 0.0 and ld.std == 1.0 and ld.flip is False and ld.drop_last is False
    assert ld.device == "cpu" and ld.channels == 1 and ld.num_samples == 300 and ld.epoch == 0
    want = np.random.default_rng(np.random.SeedSequence(0, spawn_key=(0, 0))).permutation(300)
    np.testing.assert_array_equal(ld.permutation(0), want)
    xb, yb = next(iter(ld))                      # mean 0, std 1: x = pixel / 255
    np.testing.assert_allclose(xb[:, 0], x[want[:128]].astype(np.float32) / np.float32(255), rtol=1e-6)
    np.testing.assert_array_equal(yb, y[want[:128]])


def test_repr_names_samples_batch_shuffle_device_epoch():
    x, y = _grey()
    ld = DataLoader(x, y, batch_size=2, shuffle=False)
    assert repr(ld) == "DataLoader(5 samples, batch_size=2, shuffle=False, device='cpu', epoch=0)"
    list(ld)
    assert repr(ld) == "DataLoader(5 samples, batch_size=2, shuffle=False, device='cpu', epoch=1)"


# ------------------------------------------------------------------ integer arguments
@pytest.mark.parametrize("name", ["batch_size", "seed", "pad", "max_shift"])
def test_integer_arguments_are_named_in_their_refusals(name):
    x, y = _grey()
    assert _msg(TypeError, x, y, **{name: 1.5}) == f"{name} must be an int, got 1.5"
    assert _msg(TypeError, x, y, **{name: "2"}) == f"{name} must be an int, got '2'"
    assert _msg(ValueError, x, y, **{name: -1}) == f"{name} must be >= 0, got -1"
    ld = DataLoader(x, y, **{name: np.int64(1)})    # numpy integers are ints
    assert getattr(ld, name) == 1 and type(getattr(ld, name)) is int


def test_batch_size_zero_is_refused_one_accepted():
    x, y = _grey()
    assert _msg(ValueError, x, y, batch_size=0) == "batch_size must be >= 1"
    assert len(DataLoader(x, y, batch_size=1)) == 5


def test_set_epoch_checks_and_names_its_argument():
    x, y = _grey()
    ld = DataLoader(x, y)
    with pytest.raises(ValueError) as e:
        ld.set_epoch(-1)
    assert str(e.value) == "epoch must be >= 0, got -1"
    with pytest.raises(TypeError) as e:
        ld.set_epoch(0.5)
    assert str(e.value) == "epoch must be an int, got 0.5"
    ld.set_epoch(np.int32(3))
    assert ld.epoch == 3


# ------------------------------------------------------------------ images and labels
def test_label_count_mismatch_names_the_dataloader():
    x, y = _grey()
    assert _msg(ValueError, x, y[:4]) == "DataLoader: 5 images but 4 labels"
    xc, yc = _colour()
    assert _msg(ValueError, xc, yc[:3]) == "DataLoader: 5 images but 3 labels"
    assert _msg(ValueError, x, y, num_classes=4) == (
        "DataLoader: labels must lie in [0, 4), found values from 0 to 4")
    assert _msg(ValueError, xc, yc, num_classes=3) == (
        "DataLoader: labels must lie in [0, 3), found values from 0 to 4")


def test_bad_images_and_labels_messages():
    x, y = _grey()
    assert _msg(ValueError, x.astype(np.float32), y) == (
        "images must be a uint8 array (N, H, W) or (N, C, H, W), got float32 (5, 3, 4)")
    assert _msg(ValueError, x[0], y) == (
        "images must be a uint8 array (N, H, W) or (N, C, H, W), got uint8 (3, 4)")
    assert _msg(ValueError, x, y.astype(np.float64)) == "labels must be integers, got float64"


def test_channels_boundary_64_accepted_65_refused():
    y = np.zeros(2, np.int64)
    ld = DataLoader(np.zeros((2, 64, 1, 1), np.uint8), y)
    assert ld.channels == 64 and ld.mean == (0.0,) * 64
    assert _msg(ValueError, np.zeros((2, 65, 1, 1), np.uint8), y) == (
        "DataLoader: images must have 1 to 64 channels, got (2, 65, 1, 1)")
    assert _msg(ValueError, np.zeros((2, 0, 1, 1), np.uint8), y) == (
        "DataLoader: images must have 1 to 64 channels, got (2, 0, 1, 1)")


def test_grey_images_have_one_channel():
    x, y = _grey()
    assert DataLoader(x, y).channels == 1
    assert DataLoader(*_colour(c=2)).channels == 2


def test_flip_on_grey_images_is_refused_with_the_reason():
    x, y = _grey()
    assert _msg(ValueError, x, y, flip=True) == (
        "DataLoader: flip=True needs (N, C, H, W) images (a flipped digit is another digit); "
        "grey (N, H, W) images use max_shift")


def test_empty_dataset_refused_one_sample_accepted():
    assert _msg(ValueError, np.zeros((0, 2, 2), np.uint8), np.zeros(0, np.int64)) == (
        "DataLoader: the dataset is empty")
    assert _msg(ValueError, np.zeros((0, 3, 2, 2), np.uint8), np.zeros(0, np.int64)) == (
        "DataLoader: the dataset is empty")
    ld = DataLoader(np.full((1, 2, 2), 255, np.uint8), [3], batch_size=4)
    (xb, yb), = list(ld)
    assert xb.shape == (1, 1, 2, 2) and yb.tolist() == [3]
    np.testing.assert_array_equal(xb, 1.0)


def test_2_pow_31_samples_are_refused_before_anything_is_copied():
    # Zero-stride views: nothing of the 2 GiB is allocated; the label check reads them (~2 s).
    n = 2**31
    images = np.broadcast_to(np.zeros((1, 1, 1), np.uint8), (n, 1, 1))
    labels = np.broadcast_to(np.zeros(1, np.int8), (n,))
    assert _msg(ValueError, images, labels) == "DataLoader: at most 2**31 - 1 samples (indices are int32)"


# ------------------------------------------------------------------ mean and std
def test_mean_and_std_counts_are_named():
    xc, yc = _colour(c=3)
    assert _msg(ValueError, xc, yc, mean=[0.1, 0.2]) == (
        "DataLoader: mean must be a number or 3 numbers (one per channel), got [0.1, 0.2]")
    assert _msg(ValueError, xc, yc, std=[1.0, 2.0, 3.0, 4.0]) == (
        "DataLoader: std must be a number or 3 numbers (one per channel), got [1.0, 2.0, 3.0, 4.0]")
    x, y = _grey()
    assert _msg(ValueError, x, y, std=[[1.0]]) == (
        "DataLoader: std must be a number or 1 numbers (one per channel), got [[1.0]]")


def test_non_finite_or_non_positive_stats_are_refused_with_both_values():
    x, y = _grey()
    assert _msg(ValueError, x, y, mean=float("nan")) == "need a finite mean and a std > 0, got mean=nan, std=1.0"
    assert _msg(ValueError, x, y, std=float("inf")) == "need a finite mean and a std > 0, got mean=0.0, std=inf"
    assert _msg(ValueError, x, y, std=0) == "need a finite mean and a std > 0, got mean=0.0, std=0"
    assert _msg(ValueError, x, y, std=-2.0) == "need a finite mean and a std > 0, got mean=0.0, std=-2.0"
    # None becomes NaN as a float64: the same clear refusal, not a TypeError from numpy
    assert _msg(ValueError, x, y, mean=None) == "need a finite mean and a std > 0, got mean=None, std=1.0"
    xc, yc = _colour(c=2)
    assert _msg(ValueError, xc, yc, std=[1.0, 0.0]) == (
        "need a finite mean and a std > 0, got mean=0.0, std=[1.0, 0.0]")


def test_stats_are_floats_or_per_channel_tuples():
    x, y = _grey()
    ld = DataLoader(x, y, mean=1, std=2)
    assert ld.mean == 1.0 and type(ld.mean) is float and ld.std == 2.0 and type(ld.std) is float
    xc, yc = _colour(c=3)
    ld = DataLoader(xc, yc, mean=0.5, std=[1, 2, 4])
    assert ld.mean == (0.5, 0.5, 0.5) and ld.std == (1.0, 2.0, 4.0)
    assert all(type(v) is float for v in ld.mean + ld.std)


# ------------------------------------------------------------------ orders and seeds
def test_permutation_against_numpy_and_without_shuffle():
    x, y = _grey(7)
    ld = DataLoader(x, y, seed=5)
    for e in (0, 3):
        want = np.random.default_rng(np.random.SeedSequence(5, spawn_key=(0, e))).permutation(7)
        got = ld.permutation(e)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32
    fixed = DataLoader(x, y, shuffle=False).permutation(4)
    np.testing.assert_array_equal(fixed, np.arange(7))
    assert fixed.dtype == np.int32


def test_batch_seed_against_numpy():
    x, y = _grey()
    ld = DataLoader(x, y, seed=11)
    for e, b in ((0, 0), (2, 5), (7, 1)):
        state = np.random.SeedSequence(11, spawn_key=(1, e, b)).generate_state(1, dtype=np.uint64)[0]
        got = ld.batch_seed(e, b)
        assert type(got) is int and got == int(state) >> 1 and 0 <= got < 2**63


def test_unshuffled_batches_follow_the_dataset_order_every_epoch():
    x, y = _grey(5)
    ld = DataLoader(x, y, batch_size=2, shuffle=False)
    for _ in range(2):
        ys = np.concatenate([yb for _, yb in ld])
        np.testing.assert_array_equal(ys, y)


# ------------------------------------------------------------------ colour batches
def test_colour_batches_are_padded():
    xc, yc = _colour(n=3, c=2, h=3, w=4)
    ld = DataLoader(xc, yc, batch_size=3, shuffle=False, pad=2, mean=[0.0, 0.5], std=[1.0, 0.5])
    (xb, yb), = list(ld)
    assert xb.shape == (3, 2, 7, 8)
    want = np.zeros((3, 2, 7, 8), np.float32)
    want[:, :, 2:5, 2:6] = xc.astype(np.float32) / np.float32(255)
    want = (want - np.float32([0.0, 0.5])[None, :, None, None]) / np.float32([1.0, 0.5])[None, :, None, None]
    np.testing.assert_allclose(xb, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(yb, yc)


def test_gather_chw_takes_the_backends_op_else_the_cpu_twin():
    own = object()
    assert L._gather_chw(types.SimpleNamespace(gather_batch_chw=own)) is own
    assert L._gather_chw(types.SimpleNamespace()) is cpu_data.gather_batch_chw


def test_colour_batches_use_the_loaders_backend_op(monkeypatch):
    calls = []
    cpu = cydnn.ops.backend("cpu")

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return cpu_data.gather_batch_chw(*args, **kwargs)

    fake = types.SimpleNamespace(asarray=cpu.asarray, gather_batch=cpu.gather_batch,
                                 gather_batch_chw=recording)
    monkeypatch.setattr(cydnn.ops, "backend", lambda device: fake)
    xc, yc = _colour(n=5)
    ld = DataLoader(xc, yc, batch_size=2, pad=1, max_shift=1, flip=True, seed=3)
    batches = list(ld)
    assert len(batches) == 3 and len(calls) == 3
    assert [c["seed"] for c in calls] == [ld.batch_seed(0, b) for b in range(3)]
    assert all(c["pad"] == 1 and c["max_shift"] == 1 and c["flip"] is True for c in calls)
