"""Mutation-driven tests of cydnn.datasets.folder (ImageFolder): small image folders written by
the tests with Pillow (skipped with the reason when it is not installed), each refusal's exact
message naming the file or folder, the size argument (non-square, 1, refused values), the
colour modes converted (RGBA, LA, 1, grey mixed with colour), bilinear resizing, the
MAX_IMAGE_PIXELS boundary, and the repr."""

import sys

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DatasetError, ImageFolder
from cydnn.datasets import folder as F

_NO_PIL = "Pillow is not installed (pip install 'cydnn[images]')"


@pytest.fixture
def Image():
    return pytest.importorskip("PIL.Image", reason=_NO_PIL)


def _save(Image, path, array, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.fromarray(array)
    if mode is not None:
        im = im.convert(mode)
    im.save(path)
    return path


def _pixels(h, w, *c, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, *c), dtype=np.uint8)


# ------------------------------------------------------------------ Pillow missing
def test_missing_pillow_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError) as e:
        F._pillow()
    assert str(e.value) == ('ImageFolder reads images with Pillow, which is not installed: '
                            'pip install "cydnn[images]" (or pip install Pillow)')
    with pytest.raises(ImportError):
        ImageFolder(".")


# ------------------------------------------------------------------ size
@pytest.mark.parametrize("size, want", [(None, None), (3, (3, 3)), (1, (1, 1)), ((2, 5), (2, 5)),
                                        ([1, 4], (1, 4)), ((np.int64(2).item(), 1), (2, 1))])
def test_size_accepted(size, want):
    assert F._size(size) == want


@pytest.mark.parametrize("size", [True, 2.5, "ab", (2,), (2, 3, 4), (0, 3), (3, 0), (2, 2.0), (True, 2),
                                  (2, -1), []])
def test_size_refused_with_the_value(size):
    with pytest.raises(ValueError) as e:
        F._size(size)
    assert str(e.value) == f"ImageFolder: size must be an int or (height, width) of ints >= 1, got {size!r}"


def test_size_zero_int_is_refused_as_a_pair():
    with pytest.raises(ValueError) as e:
        F._size(0)
    assert str(e.value) == "ImageFolder: size must be an int or (height, width) of ints >= 1, got (0, 0)"


# ------------------------------------------------------------------ scanning
def test_hidden_and_non_image_entries_are_skipped(tmp_path, Image):
    _save(Image, tmp_path / "b" / "1.PNG", _pixels(2, 3))
    _save(Image, tmp_path / "a" / "x.png", _pixels(2, 3, seed=1))
    _save(Image, tmp_path / ".git" / "y.png", _pixels(2, 3, seed=2))
    _save(Image, tmp_path / "a" / ".z.png", _pixels(2, 3, seed=3))
    (tmp_path / "a" / "notes.txt").write_text("text")
    (tmp_path / "file.png").write_bytes(b"not a class folder")
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["a", "b"]
    assert ds.samples == [(str(tmp_path / "a" / "x.png"), 0), (str(tmp_path / "b" / "1.PNG"), 1)]
    np.testing.assert_array_equal(ds.images[0], _pixels(2, 3, seed=1))


def test_scan_refusals_name_the_folder(tmp_path, Image):
    with pytest.raises(FileNotFoundError) as e:
        ImageFolder(tmp_path / "nowhere")
    assert str(e.value) == f"ImageFolder: {tmp_path / 'nowhere'} is not a folder"
    (tmp_path / ".hidden").mkdir()
    with pytest.raises(DatasetError) as e:
        ImageFolder(tmp_path)
    assert str(e.value) == (f"ImageFolder: {tmp_path} has no class folders (expected one sub-folder per class, "
                            f"e.g. {tmp_path}/cat/001.png)")
    _save(Image, tmp_path / "a" / "x.png", _pixels(2, 2))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "readme.txt").write_text("no images here")
    with pytest.raises(DatasetError) as e:
        ImageFolder(tmp_path)
    assert str(e.value) == (f"ImageFolder: class folder {tmp_path / 'b'} holds no images "
                            f"(extensions read: .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp)")


# ------------------------------------------------------------------ reading
def test_a_corrupt_image_names_the_file_and_the_error(tmp_path, Image):
    _save(Image, tmp_path / "a" / "ok.png", _pixels(2, 2))
    bad = tmp_path / "a" / "bad.png"
    bad.write_bytes(b"this is no image at all")
    with pytest.raises(DatasetError) as e:
        ImageFolder(tmp_path)
    assert str(e.value) == (f"ImageFolder: cannot read image {bad}: UnidentifiedImageError: "
                            f"cannot identify image file '{bad}'")


def test_max_image_pixels_boundary(tmp_path, Image, monkeypatch):
    path = _save(Image, tmp_path / "a" / "p.png", _pixels(4, 5))
    monkeypatch.setattr(datasets, "MAX_IMAGE_PIXELS", 20)            # 5 x 4 = 20: accepted
    assert ImageFolder(tmp_path).images.shape == (1, 4, 5)
    monkeypatch.setattr(datasets, "MAX_IMAGE_PIXELS", 19)
    with pytest.raises(DatasetError) as e:
        ImageFolder(tmp_path)
    assert str(e.value) == (f"ImageFolder: {path} is 5x4 pixels, more than MAX_IMAGE_PIXELS (19); "
                            f"refusing to decode it")


def test_mixed_sizes_name_both_files_width_by_height(tmp_path, Image):
    first = _save(Image, tmp_path / "a" / "1.png", _pixels(2, 3))    # 3 wide, 2 high
    second = _save(Image, tmp_path / "a" / "2.png", _pixels(4, 4))
    with pytest.raises(DatasetError) as e:
        ImageFolder(tmp_path)
    assert str(e.value) == (f"ImageFolder: {second} is 4x4 but {first} is 3x2 (width x height); pass "
                            f"size=(height, width) to resize every image")


def test_non_square_size_resizes_a_square_image(tmp_path, Image):
    _save(Image, tmp_path / "a" / "sq.png", _pixels(5, 5))
    _save(Image, tmp_path / "b" / "wide.png", _pixels(3, 5, seed=1))  # already (3, 5)
    ds = ImageFolder(tmp_path, size=(3, 5))
    assert ds.images.shape == (2, 3, 5) and ds.images.dtype == np.uint8
    np.testing.assert_array_equal(ds.images[1], _pixels(3, 5, seed=1))   # not resized: unchanged


def test_resizing_is_bilinear(tmp_path, Image):
    grey = _pixels(4, 4, seed=7)
    colour = _pixels(4, 4, 3, seed=8)
    _save(Image, tmp_path / "g" / "0.png", grey)
    _save(Image, tmp_path / "c" / "0.png", colour)
    ds = ImageFolder(tmp_path, size=(3, 7))
    want = np.asarray(Image.fromarray(colour).resize((7, 3), Image.BILINEAR))
    other = np.asarray(Image.fromarray(colour).resize((7, 3), Image.BICUBIC))
    assert not np.array_equal(want, other)                 # the test can tell the filters apart
    assert ds.classes == ["c", "g"] and ds.images.shape == (2, 3, 3, 7)
    np.testing.assert_array_equal(ds.images[0], want.transpose(2, 0, 1))
    grey_rgb = np.asarray(Image.fromarray(grey).convert("RGB").resize((7, 3), Image.BILINEAR))
    np.testing.assert_array_equal(ds.images[1], grey_rgb.transpose(2, 0, 1))


def test_rgba_is_read_as_rgb(tmp_path, Image):
    rgba = _pixels(3, 2, 4)
    rgba[..., 3] = 255
    _save(Image, tmp_path / "a" / "x.png", rgba)
    ds = ImageFolder(tmp_path)
    assert ds.images.shape == (1, 3, 3, 2)
    np.testing.assert_array_equal(ds.images[0], rgba[..., :3].transpose(2, 0, 1))


def test_grey_modes_with_alpha_or_one_bit_are_read_as_grey(tmp_path, Image):
    grey = _pixels(3, 4)
    _save(Image, tmp_path / "a" / "la.png", grey, mode="LA")
    bits = np.where(_pixels(3, 4, seed=1) > 127, 255, 0).astype(np.uint8)
    _save(Image, tmp_path / "b" / "one.png", bits, mode="1")
    ds = ImageFolder(tmp_path)
    assert ds.images.shape == (2, 3, 4)
    np.testing.assert_array_equal(ds.images[0], grey)
    np.testing.assert_array_equal(ds.images[1], bits)


def test_grey_among_colour_files_is_replicated(tmp_path, Image):
    grey = _pixels(2, 2)
    colour = _pixels(2, 2, 3, seed=1)
    _save(Image, tmp_path / "a" / "g.png", grey)
    _save(Image, tmp_path / "a" / "h.png", colour)
    ds = ImageFolder(tmp_path)
    assert ds.images.shape == (2, 3, 2, 2) and ds.images.flags.c_contiguous
    np.testing.assert_array_equal(ds.images[0], np.repeat(grey[None], 3, axis=0))
    np.testing.assert_array_equal(ds.images[1], colour.transpose(2, 0, 1))


def test_labels_stats_and_repr(tmp_path, Image):
    _save(Image, tmp_path / "x" / "0.png", np.full((2, 2), 51, np.uint8))
    _save(Image, tmp_path / "y" / "0.png", np.full((2, 2), 102, np.uint8))
    _save(Image, tmp_path / "y" / "1.png", np.full((2, 2), 153, np.uint8))
    ds = ImageFolder(tmp_path)
    assert ds.labels.dtype == np.int32 and ds.labels.tolist() == [0, 1, 1]
    assert ds.mean == pytest.approx(102 / 255) and ds.std == pytest.approx(np.std([51, 102, 153]) / 255)
    assert repr(ds) == f"ImageFolder({str(tmp_path)!r}, 3 images of shape (2, 2), 2 classes)"
    assert ds.root == tmp_path
