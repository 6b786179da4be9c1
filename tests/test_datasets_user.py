"""A user's own data: ArrayDataset, from_npz (bounded, pickle-free) and ImageFolder (Pillow)."""
import io
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import ArrayDataset, DatasetError, ImageFolder, from_npz


# ------------------------------------------------------------------ ArrayDataset
def test_uint8_colour_images_and_measured_stats():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 3, 5, 4), dtype=np.uint8)
    ds = ArrayDataset(images, rng.integers(0, 4, 20))
    assert ds.images.shape == (20, 3, 5, 4) and ds.images.dtype == np.uint8
    assert ds.labels.dtype == np.int32 and ds.num_classes <= 4 and ds.classes == [str(i) for i in range(ds.num_classes)]
    scaled = images.astype(np.float64) / 255
    np.testing.assert_allclose(ds.mean, scaled.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.std, scaled.std(axis=(0, 2, 3)), rtol=1e-9)
    assert isinstance(ds.mean, tuple) and len(ds.mean) == 3


def test_one_channel_becomes_n_h_w_with_float_stats():
    images = np.arange(2 * 1 * 3 * 3, dtype=np.uint8).reshape(2, 1, 3, 3)
    ds = ArrayDataset(images, [0, 1], classes=["a", "b"])
    assert ds.images.shape == (2, 3, 3) and ds.classes == ["a", "b"] and ds.num_classes == 2
    assert isinstance(ds.mean, float)
    assert ds.mean == pytest.approx(images.mean() / 255)


def test_float_images_in_0_1_are_rounded_to_pixels():
    pixels = np.array([0, 1, 127, 128, 254, 255], np.uint8)
    images = (pixels / 255).reshape(1, 2, 3)
    ds = ArrayDataset(images, [0])
    np.testing.assert_array_equal(ds.images.ravel(), pixels)      # k / 255 gives back k
    np.testing.assert_array_equal(ArrayDataset(np.full((1, 2, 2), 0.5), [0]).images, 128)  # rint(127.5) = 128


@pytest.mark.parametrize("images, labels, kwargs, words", [
    (np.full((2, 3, 3), 1.5), [0, 1], {}, ["[0, 1]", "1.5"]),
    (np.full((2, 3, 3), np.nan), [0, 1], {}, ["NaN"]),
    (np.full((2, 3, 3), 300), [0, 1], {}, ["[0, 255]", "300"]),
    (np.zeros((2, 3), np.uint8), [0, 1], {}, ["(N, H, W) or (N, C, H, W)", "(2, 3)"]),
    (np.zeros((2, 3, 3), np.uint8), [0], {}, ["2 images but 1 labels"]),
    (np.zeros((2, 3, 3), np.uint8), [0, 5], {"num_classes": 3}, ["[0, 3)", "5"]),
    (np.zeros((2, 3, 3), np.uint8), [0, -1], {}, ["[0, 1)", "-1"]),
    (np.zeros((2, 3, 3), np.uint8), [0.0, 1.0], {}, ["integers", "float64"]),
    (np.zeros((2, 3, 3), np.uint8), [0, 1], {"classes": ["a"], "num_classes": 2}, ["num_classes=2", "1 class"]),
    (np.zeros((2, 3, 3), "U1"), [0, 1], {}, ["dtype <U1"]),
    (np.zeros((0, 3, 3), np.uint8), np.zeros(0, int), {"num_classes": 2}, ["no images"]),
])
def test_bad_arrays_are_refused_with_the_reason(images, labels, kwargs, words):
    with pytest.raises(DatasetError) as info:
        ArrayDataset(images, np.asarray(labels), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_loader_uses_the_dataset_stats():
    rng = np.random.default_rng(3)
    ds = ArrayDataset(rng.integers(0, 256, (10, 3, 4, 4), dtype=np.uint8), np.arange(10) % 3)
    x, y = next(iter(ds.loader(batch_size=10, shuffle=False)))
    want = (ds.images / np.float32(255)).astype(np.float32)
    want = (want - np.float32(ds.mean)[None, :, None, None]) / np.float32(ds.std)[None, :, None, None]
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)
    assert abs(float(x.mean())) < 1e-5


# ------------------------------------------------------------------ from_npz
def test_from_npz_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    images, labels = rng.integers(0, 256, (6, 3, 4, 4), dtype=np.uint8), np.array([0, 1, 2, 0, 1, 2])
    np.savez_compressed(tmp_path / "d.npz", images=images, labels=labels, classes=np.array(["x", "y", "z"]))
    ds = from_npz(tmp_path / "d.npz")
    np.testing.assert_array_equal(ds.images, images)
    np.testing.assert_array_equal(ds.labels, labels)
    assert ds.classes == ["x", "y", "z"]


def _npy(array):
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as z, warnings.catch_warnings():
        warnings.simplefilter("ignore")            # zipfile warns about a duplicate name: that is the point
        for name, data in members:
            z.writestr(name, data)
    return path


def test_from_npz_refusals(tmp_path):
    images, labels = _npy(np.zeros((2, 3, 3), np.uint8)), _npy(np.array([0, 1]))
    cases = {
        "pickled": ([("images.npy", _npy(np.array([{"a": 1}], dtype=object))), ("labels.npy", labels)],
                    ["images.npy", "Python objects"]),
        "duplicate": ([("images.npy", images), ("labels.npy", labels), ("images.npy", images)],
                      ["'images.npy' appears twice"]),
        "missing": ([("images.npy", images)], ["no member 'labels.npy'"]),
        "lying header": ([("images.npy", _npy(np.zeros((2, 3, 3), np.uint8))[:-5]), ("labels.npy", labels)],
                         ["images.npy", "declares shape (2, 3, 3)"]),
        "not npy": ([("images.npy", b"hello world, not an array"), ("labels.npy", labels)], ["images.npy"]),
    }
    for name, (members, words) in cases.items():
        path = _zip(tmp_path / f"{name.replace(' ', '_')}.npz", members)
        with pytest.raises(DatasetError) as info:
            from_npz(path)
        for word in words + [str(path)]:
            assert word in str(info.value), (name, word, str(info.value))
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DatasetError, match="not an .npz"):
        from_npz(tmp_path / "junk.npz")


def test_from_npz_refuses_a_declared_size_over_the_limit_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_NPZ_MEMBER_BYTES", 1000)
    np.savez(tmp_path / "big.npz", images=np.zeros((10, 10, 10), np.uint8), labels=np.zeros(10, int))
    with pytest.raises(DatasetError, match=r"declares 1128 bytes uncompressed, more than the 1000-byte limit"):
        from_npz(tmp_path / "big.npz")


def test_from_npz_a_huge_header_claim_is_refused_within_a_small_memory_bound(tmp_path):
    """An .npy header declaring 2**40 bytes inside a zip whose directory declares the same: refused
    from the declared sizes, in a child limited to 512 MiB of address space over its start."""
    header = {"descr": "|u1", "fortran_order": False, "shape": (1 << 20, 1 << 10, 1 << 10)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("images.npy", buf.getvalue() + bytes(1000))
        z.writestr("labels.npy", _npy(np.zeros(2, int)))
    code = textwrap.dedent(f"""
        import resource
        from cydnn.datasets import from_npz, DatasetError
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20), resource.RLIM_INFINITY))
        try:
            from_npz({str(path)!r})
        except DatasetError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(datasets.__file__).parents[2])})
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "images.npy" in out.stdout, out.stdout


# ------------------------------------------------------------------ ImageFolder
PIL = pytest.importorskip("PIL.Image", reason="Pillow is not installed (pip install 'cydnn[images]')")


def _png(path, array, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.fromarray(array, mode).save(path)


def test_image_folder_reads_classes_in_order(tmp_path):
    rng = np.random.default_rng(5)
    pics = {("cat", "b.png"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
            ("cat", "a.png"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
            ("dog", "z.bmp"): rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)}
    for (cls, name), array in pics.items():
        _png(tmp_path / cls / name, array)
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    (tmp_path / "dog" / ".hidden.png").write_bytes(b"junk")
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2
    assert [Path(p).name for p, _ in ds.samples] == ["a.png", "b.png", "z.bmp"]
    np.testing.assert_array_equal(ds.labels, [0, 0, 1])
    assert ds.images.shape == (3, 3, 6, 5)
    np.testing.assert_array_equal(ds.images[0], pics[("cat", "a.png")].transpose(2, 0, 1))
    np.testing.assert_array_equal(ds.images[2], pics[("dog", "z.bmp")].transpose(2, 0, 1))


def test_image_folder_grey_and_resize(tmp_path):
    _png(tmp_path / "0" / "x.png", np.full((8, 8), 200, np.uint8))
    _png(tmp_path / "1" / "y.png", np.full((4, 6), 10, np.uint8))
    with pytest.raises(DatasetError) as info:
        ImageFolder(tmp_path)
    assert "y.png is 6x4" in str(info.value) and "x.png is 8x8" in str(info.value) and "size=" in str(info.value)
    ds = ImageFolder(tmp_path, size=5)
    assert ds.images.shape == (2, 5, 5)
    np.testing.assert_array_equal(ds.images[0], 200)
    np.testing.assert_array_equal(ds.images[1], 10)


def test_image_folder_errors_name_the_file_or_folder(tmp_path):
    _png(tmp_path / "a" / "ok.png", np.zeros((4, 4), np.uint8))
    (tmp_path / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    with pytest.raises(DatasetError, match=r"cannot read image .*broken\.png"):
        ImageFolder(tmp_path)
    (tmp_path / "a" / "broken.png").unlink()
    (tmp_path / "b").mkdir()
    with pytest.raises(DatasetError, match=r"class folder .*b holds no images"):
        ImageFolder(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "file.png").write_bytes(b"")
    with pytest.raises(DatasetError, match="has no class folders"):
        ImageFolder(empty)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        ImageFolder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="size must be"):
        ImageFolder(tmp_path, size=(0, 3))


def test_image_folder_refuses_a_huge_image_from_its_header(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_IMAGE_PIXELS", 100)
    _png(tmp_path / "a" / "big.png", np.zeros((20, 20), np.uint8))
    with pytest.raises(DatasetError, match=r"big\.png is 20x20 pixels, more than MAX_IMAGE_PIXELS"):
        ImageFolder(tmp_path)
