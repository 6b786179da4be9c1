"""Mutation-driven tests of cydnn.datasets.mnist (IDXDataset, MNIST, FashionMNIST, load_*), without
the real data: small IDX files the tests write, published through a test checksum table.

``Small`` has distinct train and test files (so a split swapped is seen), 12 classes (so the
loader's default of 10 is not enough) and 131 training images (so a batch size of 128 leaves a
second batch of 3).  ``load_mnist`` / ``load_fashion_mnist`` run on the real classes with their
tables replaced by one of these small files under MNIST's own names.
"""
import gzip
import hashlib
import os
import struct
import warnings

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DatasetDownloadError, FashionMNIST, IDXDataset, MNIST, load_fashion_mnist, load_mnist
from cydnn.datasets import mnist as M
from cydnn.datasets.download import _FileInfo

from faultkit import where_warnings_point  # noqa: E402

H, W = 4, 5
N_TRAIN, N_TEST = 131, 7


def _idx(array):
    return b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _split(seed, n, classes):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, H, W), dtype=np.uint8)
    labels = rng.integers(0, classes, n).astype(np.uint8)
    labels[-1] = classes - 1                      # the largest label is always there
    return images, labels


def _files(names, classes):
    """{name: raw IDX bytes} and {name: array} for the train and test split of ``names``."""
    (tri, trl), (tei, tel) = names["train"], names["test"]
    arrays = {}
    arrays[tri], arrays[trl] = _split(1, N_TRAIN, classes)
    arrays[tei], arrays[tel] = _split(2, N_TEST, classes)
    return {n: _idx(a) for n, a in arrays.items()}, arrays


def _table(raw):
    return {n: _FileInfo(len(b), hashlib.sha256(b).hexdigest(), len(gzip.compress(b, mtime=0)),
                         hashlib.sha256(gzip.compress(b, mtime=0)).hexdigest()) for n, b in raw.items()}


SPLITS = {"train": ("tr-img", "tr-lab"), "test": ("te-img", "te-lab")}
RAW, ARRAYS = _files(SPLITS, 12)


class Small(IDXDataset):
    name = "small"
    classes = [f"c{i}" for i in range(12)]
    mean, std = 0.25, 0.5
    default_mirrors = ()
    splits = SPLITS
    files = _table(RAW)


def mirror(folder, raw=RAW, gz=True):
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in raw.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data, mtime=0))
        else:
            (folder / name).write_bytes(data)
    return folder


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No cache outside tmp_path: $CYDNN_DATA and the working folder point at folders no test uses,
    so a root= that is lost on the way shows up as files in the wrong place."""
    datasets.download._verified.clear()
    monkeypatch.setenv("CYDNN_DATA", str(tmp_path / "env-root"))
    monkeypatch.chdir(tmp_path)


def _nothing_elsewhere(tmp_path):
    assert not (tmp_path / "env-root").exists() and not (tmp_path / "data").exists()


# ------------------------------------------------------------------ reading a split
@pytest.mark.parametrize("train", [True, False])
def test_each_split_reads_its_own_files(tmp_path, train):
    ds = Small(tmp_path / "c", train=train, mirrors=[mirror(tmp_path / "m")])
    images, labels = SPLITS["train" if train else "test"]
    np.testing.assert_array_equal(ds.images, ARRAYS[images])
    np.testing.assert_array_equal(ds.labels, ARRAYS[labels])
    assert ds.images.dtype == np.uint8 and ds.labels.dtype == np.int32
    assert ds.train is train and ds.root == tmp_path / "c" and ds.folder == tmp_path / "c" / "small"
    assert len(ds) == (N_TRAIN if train else N_TEST)
    assert sorted(os.listdir(ds.folder)) == sorted([images, labels])     # only this split was fetched
    image, label = ds[3]
    np.testing.assert_array_equal(image, ARRAYS[images][3])
    assert type(label) is int and label == int(ARRAYS[labels][3])
    _nothing_elsewhere(tmp_path)


def test_train_is_made_a_bool_and_root_defaults_to_cydnn_data(tmp_path):
    ds = Small(train=0, mirrors=[mirror(tmp_path / "m")])
    assert ds.train is False and ds.folder == tmp_path / "env-root" / "small"
    np.testing.assert_array_equal(ds.labels, ARRAYS["te-lab"])


def test_repr(tmp_path):
    m = mirror(tmp_path / "m")
    train, test = Small(tmp_path / "c", mirrors=[m]), Small(tmp_path / "c", train=False, mirrors=[m])
    assert repr(train) == f"Small(train, {N_TRAIN} samples, folder='{tmp_path / 'c' / 'small'}')"
    assert repr(test) == f"Small(test, {N_TEST} samples, folder='{tmp_path / 'c' / 'small'}')"


@pytest.mark.parametrize("change, message", [
    ("label", "Small tr-img: labels must lie in [0, 12), found values from 0 to 12"),
    ("count", f"Small tr-img: {N_TRAIN} images but {N_TRAIN - 1} labels"),
    ("rank", f"Small tr-img: images must have shape (N, rows, cols), got ({N_TRAIN * H * W},)"),
])
def test_files_that_do_not_belong_together_name_the_dataset_and_the_file(tmp_path, change, message):
    """The files pass their checksums (the table publishes them) but are not a dataset."""
    raw = dict(RAW)
    if change == "label":
        labels = ARRAYS["tr-lab"].copy()
        labels[5] = 12
        raw["tr-lab"] = _idx(labels)
    elif change == "count":
        raw["tr-lab"] = _idx(ARRAYS["tr-lab"][:-1])
    else:
        raw["tr-img"] = _idx(ARRAYS["tr-img"].reshape(-1))
    cls = type("Small", (Small,), {"files": _table(raw)})
    with pytest.raises(ValueError) as info:
        cls(tmp_path / "c", mirrors=[mirror(tmp_path / "m", raw)])
    assert str(info.value) == message


# ------------------------------------------------------------------ the cache
def test_a_verified_cache_is_used_without_a_mirror(tmp_path):
    Small(tmp_path / "c", train=False, mirrors=[mirror(tmp_path / "m")])
    datasets.download._verified.clear()                  # a new process: hashed again, and accepted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = Small(tmp_path / "c", train=False, download=False, mirrors=[])
    np.testing.assert_array_equal(ds.images, ARRAYS["te-img"])


@pytest.mark.parametrize("download", [True, False])
def test_a_tampered_cache_is_removed_with_a_warning(tmp_path, download):
    m = mirror(tmp_path / "m")
    Small(tmp_path / "c", train=False, mirrors=[m])
    path = tmp_path / "c" / "small" / "te-img"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1                                        # same size: only the hash can tell
    path.write_bytes(bytes(data))
    datasets.download._verified.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if download:
            ds = Small(tmp_path / "c", train=False, mirrors=[m])
            np.testing.assert_array_equal(ds.images, ARRAYS["te-img"])
            assert path.read_bytes() == RAW["te-img"]   # fetched again, the right bytes
        else:
            with pytest.raises(FileNotFoundError, match="Small: te-img is not in"):
                Small(tmp_path / "c", train=False, download=False, mirrors=[m])
            assert not path.exists()                    # removed, not kept poisoned
    assert [str(w.message) for w in caught] == [
        f"{path} failed its SHA-256 check and was removed" + ("; downloading it again" if download else "")]
    assert caught[0].category is UserWarning


def test_the_warning_points_at_the_line_that_made_the_dataset(tmp_path, monkeypatch):
    m = mirror(tmp_path / "m")
    Small(tmp_path / "c", train=False, mirrors=[m])
    (tmp_path / "c" / "small" / "te-lab").write_bytes(b"junk")
    datasets.download._verified.clear()
    where = where_warnings_point(monkeypatch, M)
    with pytest.warns(UserWarning, match="te-lab failed its SHA-256 check"):
        Small(tmp_path / "c", train=False, mirrors=[m])
    assert where == [__file__]


def test_missing_file_without_download_says_where_and_how(tmp_path):
    folder = tmp_path / "c" / "small"
    with pytest.raises(FileNotFoundError) as info:
        Small(tmp_path / "c", download=False, mirrors=["https://a.example/x/", tmp_path / "m2"])
    assert str(info.value) == (
        f"Small: tr-img is not in {folder}. Pass download=True to fetch it (mirrors: https://a.example/x/, "
        f"{tmp_path / 'm2'}), or point root= or $CYDNN_DATA at the folder that holds small/tr-img.")
    assert not folder.exists()


def test_every_mirror_failing_ends_with_the_offline_hint(tmp_path):
    (tmp_path / "empty").mkdir()
    folder = tmp_path / "c" / "small"
    with pytest.raises(DatasetDownloadError) as info:
        Small(tmp_path / "c", train=False, mirrors=[tmp_path / "empty"])
    gz = "te-img.gz, te-lab.gz, tr-img.gz, tr-lab.gz"
    assert str(info.value) == (
        f"could not download te-img.gz for Small from any mirror:\n"
        f"  - {tmp_path / 'empty'}: file not found: {tmp_path / 'empty' / 'te-img'}.gz (nor the decompressed te-img)\n"
        f"To train without a network, point to files you already have:\n"
        f"    python -m cydnn.train --mirror DIR_OR_URL\n"
        f"where DIR_OR_URL is a folder holding {gz} (or the same files decompressed: the checksums of both "
        f"are known), or a URL serving {gz}.  Or put the verified files in {folder} yourself, or set "
        f"$CYDNN_DATA to the folder that holds small/ (in Python: mirrors=[...], root=...).")
    assert info.value.dataset == "Small" and info.value.filename == "te-img"


def test_default_mirrors_are_strict_and_user_mirrors_are_not(tmp_path):
    """The same recompressed files: refused from one of the dataset's own mirrors (even when the
    caller names it: its .gz is not the published one), accepted from any other folder (the
    content's SHA-256 decides)."""
    folders = [tmp_path / "own", tmp_path / "user"]
    for m in folders:
        m.mkdir()
        for name, data in RAW.items():
            (m / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1, mtime=1))
    own = type("Small", (Small,), {"default_mirrors": (str(folders[0]),)})
    for mirrors in (None, [str(folders[0])]):
        with pytest.raises(DatasetDownloadError, match="the .gz is not the published one"):
            own(tmp_path / "c", train=False, mirrors=mirrors)
    ds = own(tmp_path / "c", train=False, mirrors=[str(folders[1])])
    np.testing.assert_array_equal(ds.images, ARRAYS["te-img"])


# ------------------------------------------------------------------ the loader
def _expected_x(images, mean, std):
    return ((images.astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std))[:, None]


def test_loader_defaults(tmp_path):
    m = mirror(tmp_path / "m")
    train, test = Small(tmp_path / "c", mirrors=[m]), Small(tmp_path / "c", train=False, mirrors=[m])
    loader = train.loader()
    assert loader.batch_size == 128 and len(loader) == 2 and loader.shuffle is True
    assert (loader.mean, loader.std) == (0.25, 0.5)
    batches = list(loader)
    assert [len(y) for _, y in batches] == [128, N_TRAIN - 128]
    order = loader.permutation(0)
    y = np.concatenate([np.asarray(y) for _, y in batches])
    np.testing.assert_array_equal(y, ARRAYS["tr-lab"][order])          # labels up to 11 (12 classes)
    assert not np.array_equal(order, np.arange(N_TRAIN))
    x = np.concatenate([np.asarray(x) for x, _ in batches])
    np.testing.assert_allclose(x, _expected_x(ARRAYS["tr-img"][order], 0.25, 0.5), rtol=1e-6, atol=1e-6)

    loader = test.loader()
    assert loader.shuffle is False and len(loader) == 1
    (x, y), = list(loader)
    np.testing.assert_array_equal(np.asarray(y), ARRAYS["te-lab"])
    np.testing.assert_allclose(np.asarray(x), _expected_x(ARRAYS["te-img"], 0.25, 0.5), rtol=1e-6, atol=1e-6)


def test_loader_arguments_pass_through(tmp_path):
    m = mirror(tmp_path / "m")
    train, test = Small(tmp_path / "c", mirrors=[m]), Small(tmp_path / "c", train=False, mirrors=[m])
    assert train.loader(shuffle=False).shuffle is False
    assert test.loader(shuffle=True).shuffle is True
    loader = test.loader(batch_size=3, shuffle=False, mean=0.0, std=1.0, pad=2, drop_last=True, seed=9,
                         max_shift=1)
    assert (loader.batch_size, loader.seed, loader.pad, loader.max_shift) == (3, 9, 2, 1)
    assert (loader.mean, loader.std, len(loader)) == (0.0, 1.0, N_TEST // 3)
    batches = list(loader)
    assert [np.asarray(x).shape for x, _ in batches] == [(3, 1, H + 4, W + 4)] * 2
    np.testing.assert_array_equal(np.concatenate([np.asarray(y) for _, y in batches]), ARRAYS["te-lab"][:6])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        test.loader(num_classes=5)                     # the caller's num_classes wins over len(classes)


# ------------------------------------------------------------------ load_mnist, load_fashion_mnist
REAL_SPLITS = M._MNIST_SPLITS


@pytest.fixture(params=[(MNIST, load_mnist), (FashionMNIST, load_fashion_mnist)], ids=["mnist", "fashion"])
def small_real(request, monkeypatch, tmp_path):
    """MNIST (or Fashion-MNIST) with its table replaced by small files under its own names; its
    default mirrors are an empty folder, so a lost ``mirrors=`` fails."""
    cls, load = request.param
    raw, arrays = _files(REAL_SPLITS, 10)
    monkeypatch.setattr(cls, "files", _table(raw))
    (tmp_path / "nowhere").mkdir()
    monkeypatch.setattr(cls, "default_mirrors", (str(tmp_path / "nowhere"),))
    return cls, load, mirror(tmp_path / "m", raw), arrays


def _check_pair_of_splits(train, test, cls, arrays, root):
    (tri, trl), (tei, tel) = REAL_SPLITS["train"], REAL_SPLITS["test"]
    assert type(train) is cls and type(test) is cls
    assert train.train is True and test.train is False
    np.testing.assert_array_equal(train.images, arrays[tri])
    np.testing.assert_array_equal(train.labels, arrays[trl])
    np.testing.assert_array_equal(test.images, arrays[tei])
    np.testing.assert_array_equal(test.labels, arrays[tel])
    assert train.folder == test.folder == root / cls.name


def test_load_both_splits(small_real, tmp_path):
    cls, load, m, arrays = small_real
    train, test = load(tmp_path / "c", mirrors=[m])                      # download=True by default
    _check_pair_of_splits(train, test, cls, arrays, tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c" / cls.name)) == sorted(n for p in REAL_SPLITS.values() for n in p)
    _nothing_elsewhere(tmp_path)
    train, test = load(tmp_path / "c", mirrors=[], download=False)       # from the cache alone
    _check_pair_of_splits(train, test, cls, arrays, tmp_path / "c")
    train, test = load(tmp_path / "d", [m], True)                        # positional: root, mirrors, download
    _check_pair_of_splits(train, test, cls, arrays, tmp_path / "d")


def test_load_passes_download_false_to_both_splits(small_real, tmp_path):
    cls, load, m, arrays = small_real
    with pytest.raises(FileNotFoundError, match=f"{cls.__name__}: train-images-idx3-ubyte is not in"):
        load(tmp_path / "c", mirrors=[m], download=False)
    for name in REAL_SPLITS["train"]:                                    # only the training split cached
        (tmp_path / "c" / cls.name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / cls.name / name).write_bytes(gzip.decompress((m / f"{name}.gz").read_bytes()))
    with pytest.raises(FileNotFoundError, match=f"{cls.__name__}: t10k-images-idx3-ubyte is not in"):
        load(tmp_path / "c", mirrors=[m], download=False)
    assert sorted(os.listdir(tmp_path / "c" / cls.name)) == sorted(REAL_SPLITS["train"])


def test_load_without_mirrors_uses_the_default_ones(small_real, tmp_path, monkeypatch):
    cls, load, m, arrays = small_real
    with pytest.raises(DatasetDownloadError, match=f"for {cls.__name__} from any mirror:\n  - {tmp_path / 'nowhere'}"):
        load(tmp_path / "c")
    monkeypatch.setattr(cls, "default_mirrors", (str(m),))
    train, test = load(tmp_path / "d")
    _check_pair_of_splits(train, test, cls, arrays, tmp_path / "d")


def test_load_root_defaults_to_cydnn_data(small_real, tmp_path):
    cls, load, m, arrays = small_real
    train, test = load(mirrors=[m])
    _check_pair_of_splits(train, test, cls, arrays, tmp_path / "env-root")


def test_the_real_tables_describe_the_real_files():
    """What the package expects of the real files: MNIST's sizes from the IDX headers (the .gz
    sizes as published), Fashion-MNIST's MD5s as Zalando publishes them."""
    sizes = {"train-images-idx3-ubyte": 47040016, "train-labels-idx1-ubyte": 60008,
             "t10k-images-idx3-ubyte": 7840016, "t10k-labels-idx1-ubyte": 10008}
    for cls in (MNIST, FashionMNIST):
        assert {n: i.idx_size for n, i in cls.files.items()} == sizes
        assert cls.splits == REAL_SPLITS and len(cls.classes) == 10
    assert [MNIST.files[n].gz_size for n in sizes] == [9912422, 28881, 1648877, 4542]
    assert (MNIST.mean, MNIST.std, FashionMNIST.mean, FashionMNIST.std) == (0.1307, 0.3081, 0.2860, 0.3530)
    assert MNIST.cli_name is None and FashionMNIST.cli_name == "fashion-mnist"
    assert FashionMNIST.classes[0] == "T-shirt/top" and FashionMNIST.classes[9] == "Ankle boot"
    assert all(i.gz_sha256 is None and len(i.gz_md5) == 32 for i in FashionMNIST.files.values())
