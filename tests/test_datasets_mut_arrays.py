"""Mutation-driven tests of cydnn.datasets.arrays (ArrayDataset, channel_stats, from_npz): exact
messages naming the dataset (or the file), the pixel rules at their bounds, statistics against
numpy computed here (several chunks, a single pixel, a small or zero variance), and small .npz
files written by the tests."""

import numpy as np
import pytest

from cydnn.datasets import ArrayDataset, DatasetError, from_npz
from cydnn.datasets import arrays as A


def _msg(*args, **kwargs):
    with pytest.raises(DatasetError) as e:
        ArrayDataset(*args, **kwargs)
    return str(e.value)


def _imgs(n=3, *shape):
    shape = shape or (2, 2)
    return (np.arange(n * int(np.prod(shape))) * 3 % 256).astype(np.uint8).reshape(n, *shape)


# ------------------------------------------------------------------ images
def test_zero_sized_dimensions_are_refused_size_one_accepted():
    y = [0, 1]
    assert _msg(np.zeros((2, 0, 3), np.uint8), y) == (
        "ArrayDataset: images of shape (2, 0, 3): every size but N must be > 0")
    assert _msg(np.zeros((2, 3, 0), np.uint8), y) == (
        "ArrayDataset: images of shape (2, 3, 0): every size but N must be > 0")
    assert _msg(np.zeros((2, 0, 3, 3), np.uint8), y) == (
        "ArrayDataset: images of shape (2, 0, 3, 3): every size but N must be > 0")
    for shape in ((2, 1, 5), (2, 5, 1), (2, 1, 1), (2, 2, 1, 1)):
        assert ArrayDataset(np.ones(shape, np.uint8), y).images.shape == shape


def test_bad_shape_and_dtype_messages():
    assert _msg(np.zeros((2, 3), np.uint8), [0, 1]) == (
        "ArrayDataset: images must have shape (N, H, W) or (N, C, H, W), got (2, 3)")
    assert _msg(np.zeros((2, 2, 2), np.complex64), [0, 1]) == (
        "ArrayDataset: images have dtype complex64; expected uint8 (0..255) or float in [0, 1]")
    assert _msg(np.zeros((2, 2, 2), "U1"), [0, 1], what="mine") == (
        "mine: images have dtype <U1; expected uint8 (0..255) or float in [0, 1]")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_images_of_every_width_become_uint8(dtype):
    pixels = np.array([0, 1, 64, 128, 255, 200], np.uint8)
    images = (pixels.astype(np.float64) / 255).astype(dtype).reshape(1, 2, 3)
    ds = ArrayDataset(images, [0])
    assert ds.images.dtype == np.uint8 and ds.images.shape == (1, 2, 3)
    np.testing.assert_array_equal(ds.images, np.rint(images.astype(np.float64) * 255).astype(np.uint8))


def test_float_images_over_several_chunks():
    n = 2 * A._CHUNK + 60                  # three chunks, the last one partial
    pixels = (np.arange(n * 2) * 37 % 251 + 1).astype(np.uint8).reshape(n, 1, 2)
    ds = ArrayDataset(pixels.astype(np.float32) / 255, np.zeros(n, np.int64))
    assert ds.images.dtype == np.uint8
    np.testing.assert_array_equal(ds.images, pixels)


def test_float_bounds_and_messages():
    assert ArrayDataset(np.array([[[0.0, 1.0]]]), [0]).images.tolist() == [[[0, 255]]]
    assert _msg(np.array([[[0.0, 1.0001]]]), [0]) == (
        "ArrayDataset: float images must lie in [0, 1] (they become round(255 x)), found values from "
        "0.0 to 1.0001; scale them, or pass uint8 pixels 0..255")
    assert _msg(np.array([[[-0.5, 0.5]]]), [0]) == (
        "ArrayDataset: float images must lie in [0, 1] (they become round(255 x)), found values from "
        "-0.5 to 0.5; scale them, or pass uint8 pixels 0..255")
    assert _msg(np.array([[[0.5, np.inf]]]), [0]) == "ArrayDataset: float images hold NaN or infinity"


@pytest.mark.parametrize("dtype", [np.int16, np.int64, np.uint16])
def test_integer_bounds_0_and_255_accepted(dtype):
    images = np.array([[[0, 255], [1, 254]]], dtype)
    ds = ArrayDataset(images, [0])
    assert ds.images.dtype == np.uint8
    np.testing.assert_array_equal(ds.images, images)


def test_integer_out_of_range_messages():
    assert _msg(np.array([[[0, 256]]], np.int16), [0]) == (
        "ArrayDataset: integer images must lie in [0, 255], found values from 0 to 256")
    assert _msg(np.array([[[-1, 255]]], np.int64), [0]) == (
        "ArrayDataset: integer images must lie in [0, 255], found values from -1 to 255")


def test_bool_images_become_0_and_1():
    images = np.array([[[True, False], [False, True]]])
    ds = ArrayDataset(images, [0])
    assert ds.images.dtype == np.uint8
    assert ds.images.tolist() == [[[1, 0], [0, 1]]]


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float64, np.float32])
def test_empty_images_of_any_dtype_say_no_images(dtype):
    # No min()/max() of an empty array: the one refusal is "no images".
    assert _msg(np.zeros((0, 2, 2), dtype), np.zeros(0, np.int64), num_classes=2) == "ArrayDataset: no images"


# ------------------------------------------------------------------ labels and classes
def test_label_messages():
    x = _imgs(3)
    assert _msg(x, np.zeros((3, 1), np.int64)) == "ArrayDataset: labels must have shape (N,), got (3, 1)"
    assert _msg(x, [True, False, True]) == "ArrayDataset: labels must be integers, got bool"
    assert _msg(x, [0, 1]) == "ArrayDataset: 3 images but 2 labels"
    assert _msg(x, [0, 1, 2], num_classes=2.5) == "ArrayDataset: num_classes must be an int, got 2.5"
    assert _msg(x, [0, 1, 2], classes=["a", "b"], num_classes=3) == (
        "ArrayDataset: num_classes=3 but 2 class names")


def test_label_range_boundary():
    x = _imgs(3)
    assert ArrayDataset(x, [0, 1, 2], num_classes=3).num_classes == 3
    assert _msg(x, [0, 1, 3], num_classes=3) == (
        "ArrayDataset: labels must lie in [0, 3), found values from 0 to 3")
    assert _msg(x, [0, 1, 2], classes=["a", "b"]) == (
        "ArrayDataset: labels must lie in [0, 2), found values from 0 to 2")
    assert _msg(x, [-1, 0, 1]) == "ArrayDataset: labels must lie in [0, 2), found values from -1 to 1"


def test_num_classes_from_classes_labels_or_argument():
    x = _imgs(3)
    ds = ArrayDataset(x, [0, 1, 0], classes=["cat", "dog", "emu"])
    assert ds.num_classes == 3 and ds.classes == ["cat", "dog", "emu"]
    ds = ArrayDataset(x, [0, 4, 1])
    assert ds.num_classes == 5 and ds.classes == ["0", "1", "2", "3", "4"]
    ds = ArrayDataset(x, [0, 1, 0], num_classes=np.int64(4))
    assert ds.num_classes == 4 and type(ds.num_classes) is int and ds.classes == ["0", "1", "2", "3"]
    ds = ArrayDataset(x, [0, 1, 0], classes=(7, 8))
    assert ds.classes == ["7", "8"]


def test_an_empty_dataset_without_classes_says_so():
    empty = np.zeros((0, 2, 2), np.uint8), np.zeros(0, np.int64)
    assert _msg(*empty) == "ArrayDataset: no classes (an empty dataset needs num_classes or classes)"
    assert _msg(*empty, what="mine") == "mine: no classes (an empty dataset needs num_classes or classes)"
    assert _msg(*empty, num_classes=0) == "ArrayDataset: no classes (an empty dataset needs num_classes or classes)"
    assert _msg(*empty, classes=["a"]) == "ArrayDataset: no images"


def test_what_names_the_dataset_in_every_refusal():
    assert _msg(np.zeros((2, 3), np.uint8), [0, 1], what="train set") == (
        "train set: images must have shape (N, H, W) or (N, C, H, W), got (2, 3)")
    assert _msg(_imgs(2), [0], what="train set") == "train set: 2 images but 1 labels"


def test_labels_stored_as_int32_and_getitem():
    x = _imgs(3)
    ds = ArrayDataset(x, np.array([2, 0, 1], np.int64))
    assert ds.labels.dtype == np.int32 and len(ds) == 3
    image, label = ds[2]
    np.testing.assert_array_equal(image, x[2])
    assert label == 1 and type(label) is int
    assert ds[0][1] == 2


def test_repr():
    assert repr(ArrayDataset(_imgs(3, 4, 5), [0, 1, 0])) == "ArrayDataset(3 images of shape (4, 5), 2 classes)"
    assert repr(ArrayDataset(_imgs(2, 3, 4, 5), [0, 2])) == "ArrayDataset(2 images of shape (3, 4, 5), 3 classes)"

    class Mine(ArrayDataset):
        pass

    assert repr(Mine(_imgs(1), [0])) == "Mine(1 images of shape (2, 2), 1 classes)"


# ------------------------------------------------------------------ statistics
def _numpy_stats(images):
    scaled = images.astype(np.float64) / 255
    axes = (0, 1, 2) if images.ndim == 3 else (0, 2, 3)
    return scaled.mean(axis=axes), scaled.std(axis=axes)


def test_stats_over_several_chunks_against_numpy():
    n = 2 * A._CHUNK + 7
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 2, 2, 3), dtype=np.uint8)
    images[: A._CHUNK] //= 4                     # chunks that differ: a sum of the last one alone is wrong
    mean, std = A.channel_stats(images)
    want_mean, want_std = _numpy_stats(images)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-12)
    np.testing.assert_allclose(std, want_std, rtol=1e-9)
    grey = images[:, 0]
    mean, std = A.channel_stats(grey)
    want_mean, want_std = _numpy_stats(grey)
    assert type(mean) is float and mean == pytest.approx(float(want_mean), rel=1e-12)
    assert std == pytest.approx(float(want_std), rel=1e-9)


def test_stats_of_one_pixel_and_of_a_small_variance():
    mean, std = A.channel_stats(np.full((1, 1, 1), 100, np.uint8))
    assert mean == pytest.approx(100 / 255, rel=1e-15) and std == 1.0        # constant: std 1
    mean, std = A.channel_stats(np.array([[[0, 1]]], np.uint8))              # variance 1/4 pixel^2
    assert mean == pytest.approx(0.5 / 255, rel=1e-15) and std == pytest.approx(0.5 / 255, rel=1e-12)


def test_a_constant_channel_gets_std_one():
    images = np.zeros((3, 2, 2, 2), np.uint8)
    images[:, 1] = np.arange(12).reshape(3, 2, 2)
    images[:, 0] = 9
    mean, std = A.channel_stats(images)
    assert mean[0] == pytest.approx(9 / 255, rel=1e-15) and std[0] == 1.0
    assert std[1] == pytest.approx(np.arange(12).std() / 255, rel=1e-12)


def test_given_stats_are_kept():
    ds = ArrayDataset(_imgs(2), [0, 1], stats=(0.25, 0.5))
    assert (ds.mean, ds.std) == (0.25, 0.5)


# ------------------------------------------------------------------ loader
def test_loader_defaults_and_arguments():
    x = _imgs(300, 2, 2)
    ds = ArrayDataset(x, np.arange(300) % 3)
    ld = ds.loader()
    assert ld.batch_size == 128 and ld.shuffle is True and len(ld) == 3
    assert ld.mean == ds.mean and ld.std == ds.std
    ld = ds.loader(batch_size=100, shuffle=False, mean=0.0, std=1.0)
    assert ld.batch_size == 100 and ld.shuffle is False and (ld.mean, ld.std) == (0.0, 1.0)
    _, yb = next(iter(ld))
    np.testing.assert_array_equal(yb, np.arange(100) % 3)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        ArrayDataset(x, np.arange(300) % 4, num_classes=4).loader(num_classes=3)


# ------------------------------------------------------------------ from_npz
def test_from_npz_num_classes_and_classes(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, images=_imgs(3), labels=np.array([0, 1, 0]))
    ds = from_npz(p)
    assert ds.num_classes == 2 and ds.classes == ["0", "1"]
    ds = from_npz(p, num_classes=5)
    assert ds.num_classes == 5 and ds.classes == ["0", "1", "2", "3", "4"]
    ds = from_npz(p, classes=["x", "y", "z"])
    assert ds.classes == ["x", "y", "z"] and ds.num_classes == 3

    q = tmp_path / "named.npz"
    np.savez(q, images=_imgs(3), labels=np.array([0, 1, 0]), classes=np.array(["cat", "dog"]))
    assert from_npz(q).classes == ["cat", "dog"]
    assert from_npz(q, classes=["a", "b", "c"]).classes == ["a", "b", "c"]   # the argument wins


def test_from_npz_refuses_bad_class_names(tmp_path):
    for name, classes in (("ints", np.array([0, 1])), ("grid", np.array([["a", "b"], ["c", "d"]])),
                          ("floats", np.array([0.5]))):
        p = tmp_path / f"{name}.npz"
        np.savez(p, images=_imgs(2), labels=np.array([0, 1]), classes=classes)
        with pytest.raises(DatasetError) as e:
            from_npz(p)
        assert str(e.value) == (f"{p}: member 'classes.npy' must be a 1-D array of strings, got "
                                f"{classes.dtype} {classes.shape}")


def test_from_npz_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez(p, images=_imgs(2), labels=np.array([0, 5]))
    with pytest.raises(DatasetError) as e:
        from_npz(p, num_classes=3)
    assert str(e.value) == f"{p}: labels must lie in [0, 3), found values from 0 to 5"
    q = tmp_path / "flat.npz"
    np.savez(q, images=np.zeros((2, 3), np.uint8), labels=np.array([0, 1]))
    with pytest.raises(DatasetError) as e:
        from_npz(str(q))
    assert str(e.value) == f"{q}: images must have shape (N, H, W) or (N, C, H, W), got (2, 3)"
