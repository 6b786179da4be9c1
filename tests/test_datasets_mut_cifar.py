"""Mutation-driven tests of cydnn.datasets.cifar: small archives in CIFAR-10's binary layout that
the tests write, published through a test checksum table (``CIFAR10.archive``), read from local
mirror folders.  Exact messages naming the archive and the entry; the download's cache rules
(re-check, tampered cache, leftovers, the temporary's place); the argument plumbing of
``load_cifar10``.
"""
import errno
import gzip
import hashlib
import io
import os
import tarfile
import warnings

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import CIFAR10, DatasetCacheError, DatasetDownloadError, DatasetError, load_cifar10
from cydnn.datasets import cifar as C
from cydnn.datasets.cifar import MAX_MEMBERS, RECORD, _ArchiveInfo, _download_archive

from faultkit import where_warnings_point  # noqa: E402

RECORDS = 3
NAME = "cifar-10-binary.tar.gz"
BATCHES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
FOLDER = "cifar-10-batches-bin"


def _content():
    rng = np.random.default_rng(7)
    out = {}
    for name in BATCHES:
        labels = rng.integers(0, 10, RECORDS, dtype=np.uint8)
        labels[0] = 9
        images = rng.integers(0, 256, (RECORDS, 3, 32, 32), dtype=np.uint8)
        out[name] = (labels, images, np.column_stack([labels, images.reshape(RECORDS, -1)]).tobytes())
    return out


CONTENT = _content()


class Kind(bytes):
    """A tar entry type (tarfile.SYMTYPE, ...) for an entry that is not a file or folder."""


def tar_bytes(entries):
    """An uncompressed tar of ``entries``: (name, bytes) for files, (name, None) for folders,
    (name, Kind(tar type)) for other kinds."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(data, Kind):
                info.type, info.linkname = bytes(data), f"{FOLDER}/data_batch_1.bin"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def entries(replace=None, drop=(), extra=()):
    out = [(FOLDER, None)]
    for name in BATCHES:
        if name not in drop:
            out.append((f"{FOLDER}/{name}", (replace or {}).get(name, CONTENT[name][2])))
    return out + list(extra)


def archive(*args, **kwargs):
    return gzip.compress(tar_bytes(entries(*args, **kwargs)), mtime=0)


GOOD = archive()


def table(data, md5=True):
    return _ArchiveInfo(NAME, len(data), hashlib.sha256(data).hexdigest(),
                        hashlib.md5(data).hexdigest() if md5 else None)


@pytest.fixture(autouse=True)
def small_cifar(monkeypatch, tmp_path):
    """CIFAR10 expects GOOD (3 records per batch); no default mirror; $CYDNN_DATA and the working
    folder point at folders no test uses (so a lost root= shows up)."""
    monkeypatch.setattr(CIFAR10, "archive", table(GOOD))
    monkeypatch.setattr(CIFAR10, "records_per_batch", RECORDS)
    monkeypatch.setattr(CIFAR10, "default_mirrors", ())
    monkeypatch.setenv("CYDNN_DATA", str(tmp_path / "env-root"))
    monkeypatch.chdir(tmp_path)
    datasets.download._verified.clear()


def mirror(folder, data=GOOD):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / NAME).write_bytes(data)
    return folder


def publish(monkeypatch, data, md5=True):
    monkeypatch.setattr(CIFAR10, "archive", table(data, md5))
    return data


def expected(names):
    return (np.concatenate([CONTENT[n][0] for n in names]).astype(np.int32),
            np.concatenate([CONTENT[n][1] for n in names]))


# ------------------------------------------------------------------ load_cifar10 and the dataset
def _check_splits(train, test, root):
    assert train.train is True and test.train is False
    labels, images = expected(BATCHES[:5])
    np.testing.assert_array_equal(train.labels, labels)
    np.testing.assert_array_equal(train.images, images)
    labels, images = expected(BATCHES[5:])
    np.testing.assert_array_equal(test.labels, labels)
    np.testing.assert_array_equal(test.images, images)
    assert train.folder == test.folder == root / "cifar-10"
    assert train.images.dtype == np.uint8 and train.labels.dtype == np.int32


def test_load_both_splits(tmp_path):
    m = mirror(tmp_path / "m")
    train, test = load_cifar10(tmp_path / "c", [m])                      # download=True by default
    _check_splits(train, test, tmp_path / "c")
    assert os.listdir(tmp_path / "c" / "cifar-10") == [NAME]
    assert not (tmp_path / "env-root").exists() and not (tmp_path / "data").exists()
    assert (train.mean, train.std) == (CIFAR10.train_mean, CIFAR10.train_std)   # the published values,
    assert (test.mean, test.std) == (CIFAR10.train_mean, CIFAR10.train_std)     # not this data's
    train, test = load_cifar10(tmp_path / "c", mirrors=[], download=False)    # the cache alone
    _check_splits(train, test, tmp_path / "c")


def test_load_root_defaults_to_cydnn_data(tmp_path):
    train, test = load_cifar10(mirrors=[mirror(tmp_path / "m")])
    _check_splits(train, test, tmp_path / "env-root")


def test_load_without_mirrors_uses_the_default_ones(tmp_path, monkeypatch):
    with pytest.raises(DatasetDownloadError, match=r"from any mirror:\n  \(no mirror was given\)"):
        load_cifar10(tmp_path / "c")
    monkeypatch.setattr(CIFAR10, "default_mirrors", (str(mirror(tmp_path / "m")),))
    train, test = load_cifar10(tmp_path / "c")
    _check_splits(train, test, tmp_path / "c")


def _lose_the_archive_after_each_read(monkeypatch):
    """The cached archive disappears after each split has read it (another process cleaning the
    cache), so the test split must fetch it again: it needs the same mirrors and download=."""
    real = C._read_archive
    reads = []

    def read_then_lose(path, wanted, records):
        out = real(path, wanted, records)
        os.unlink(path)
        reads.append(wanted)
        return out
    monkeypatch.setattr(C, "_read_archive", read_then_lose)
    return reads


def test_load_passes_mirrors_and_download_to_both_splits(tmp_path, monkeypatch):
    m = mirror(tmp_path / "m")
    reads = _lose_the_archive_after_each_read(monkeypatch)
    train, test = load_cifar10(tmp_path / "c", mirrors=[m], download=True)
    _check_splits(train, test, tmp_path / "c")
    assert reads == [C.TRAIN_MEMBERS, C.TEST_MEMBERS]


def test_load_passes_download_false_to_both_splits(tmp_path, monkeypatch):
    m = mirror(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=f"CIFAR10: {NAME} is not in"):
        load_cifar10(tmp_path / "c", mirrors=[m], download=False)
    assert not (tmp_path / "c").exists()
    # The training split finds the archive, the test split does not: it must not download it.
    _lose_the_archive_after_each_read(monkeypatch)
    mirror(tmp_path / "c" / "cifar-10")
    with pytest.raises(FileNotFoundError, match=f"CIFAR10: {NAME} is not in"):
        load_cifar10(tmp_path / "c", mirrors=[m], download=False)


def test_repr_and_train_made_a_bool(tmp_path):
    m = mirror(tmp_path / "m")
    train, test = CIFAR10(1, root=tmp_path, mirrors=[m]), CIFAR10(0, root=tmp_path, mirrors=[m])
    assert train.train is True and test.train is False
    assert repr(train) == f"CIFAR10(train, {5 * RECORDS} samples, folder='{tmp_path / 'cifar-10'}')"
    assert repr(test) == f"CIFAR10(test, {RECORDS} samples, folder='{tmp_path / 'cifar-10'}')"


def test_an_empty_archive_names_the_dataset_and_the_file(tmp_path, monkeypatch):
    """Batches of 0 records (a table that says so): no label to check, no image: refused by the
    dataset, with the archive's path."""
    monkeypatch.setattr(CIFAR10, "records_per_batch", 0)
    data = publish(monkeypatch, archive({n: b"" for n in BATCHES}))
    with pytest.raises(DatasetError) as info:
        CIFAR10(False, root=tmp_path / "c", mirrors=[mirror(tmp_path / "m", data)])
    assert type(info.value) is DatasetError
    assert str(info.value) == f"CIFAR10 {tmp_path / 'c' / 'cifar-10' / NAME}: no images"


# ------------------------------------------------------------------ the cached archive
def _count_hashes(monkeypatch):
    hashed = []
    real = C._sha256_file
    monkeypatch.setattr(C, "_sha256_file", lambda p: hashed.append(os.path.basename(p)) or real(p))
    return hashed


def test_the_cache_is_verified_once_per_process_and_again_when_it_changes(tmp_path, monkeypatch):
    m = mirror(tmp_path / "m")
    hashed = _count_hashes(monkeypatch)
    CIFAR10(False, root=tmp_path / "c", mirrors=[m])
    assert len(hashed) == 1 and hashed[0].endswith(".part")            # the download, checked once
    cached = tmp_path / "c" / "cifar-10" / NAME
    assert C._verify_key(cached) in datasets.download._verified and None not in datasets.download._verified
    CIFAR10(False, root=tmp_path / "c", download=False)
    assert len(hashed) == 1                                            # known: not hashed again
    datasets.download._verified.clear()                               # a new process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = CIFAR10(False, root=tmp_path / "c", download=False)
    assert hashed[1:] == [NAME] and len(ds) == RECORDS                 # hashed, accepted, kept
    CIFAR10(False, root=tmp_path / "c", download=False)
    assert hashed[1:] == [NAME]
    os.utime(cached, ns=(1, 1))                                        # changed: hashed again
    CIFAR10(False, root=tmp_path / "c", download=False)
    assert hashed[1:] == [NAME, NAME]


@pytest.mark.parametrize("download", [True, False])
def test_a_tampered_cache_is_removed_with_a_warning(tmp_path, download):
    m = mirror(tmp_path / "m")
    CIFAR10(False, root=tmp_path / "c", mirrors=[m])
    cached = tmp_path / "c" / "cifar-10" / NAME
    data = bytearray(cached.read_bytes())
    data[-5] ^= 1
    cached.write_bytes(bytes(data))
    datasets.download._verified.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if download:
            ds = CIFAR10(False, root=tmp_path / "c", mirrors=[m])
            assert len(ds) == RECORDS and cached.read_bytes() == GOOD
        else:
            with pytest.raises(FileNotFoundError, match=f"CIFAR10: {NAME} is not in"):
                CIFAR10(False, root=tmp_path / "c", mirrors=[m], download=False)
            assert not cached.exists()
    assert [str(w.message) for w in caught] == [
        f"{cached} failed its checksum check and was removed" + ("; downloading it again" if download else "")]


def test_the_warning_points_at_the_line_that_made_the_dataset(tmp_path, monkeypatch):
    """Frames of mutmut's trampoline (a wrapper that exists only while mutation testing runs) are not
    counted, so the check means the same in both settings."""
    m = mirror(tmp_path / "m")
    CIFAR10(False, root=tmp_path / "c", mirrors=[m])
    (tmp_path / "c" / "cifar-10" / NAME).write_bytes(b"junk")
    where = where_warnings_point(monkeypatch, C)
    with pytest.warns(UserWarning, match="failed its checksum check"):
        CIFAR10(False, root=tmp_path / "c", mirrors=[m])
    assert where == [__file__]


def test_missing_archive_without_download_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        CIFAR10(root=tmp_path / "c", download=False, mirrors=["https://a.example/k/", tmp_path / "m2"])
    assert str(info.value) == (
        f"CIFAR10: {NAME} is not in {tmp_path / 'c' / 'cifar-10'}. Pass download=True to fetch it "
        f"(mirrors: https://a.example/k/, {tmp_path / 'm2'}), or point root= or $CYDNN_DATA at the "
        f"folder that holds cifar-10/{NAME}.")


def test_every_mirror_failing_lists_each_and_ends_with_the_offline_hint(tmp_path):
    (tmp_path / "empty").mkdir()
    bad = mirror(tmp_path / "bad", GOOD[:-1])
    folder = tmp_path / "c" / "cifar-10"
    with pytest.raises(DatasetDownloadError) as info:
        CIFAR10(root=tmp_path / "c", mirrors=[tmp_path / "empty", bad])
    assert str(info.value) == (
        f"could not download {NAME} for CIFAR10 from any mirror:\n"
        f"  - {tmp_path / 'empty'}: file not found: {tmp_path / 'empty' / NAME}\n"
        f"  - {bad}: archive is {len(GOOD) - 1} bytes, expected {len(GOOD)}\n"
        f"To train without a network, point to files you already have:\n"
        f"    python -m cydnn.train --dataset cifar10 --mirror DIR_OR_URL\n"
        f"where DIR_OR_URL is a folder holding {NAME} (the binary version), or a URL serving {NAME} "
        f"(the binary version).  Or put the verified files in {folder} yourself, or set $CYDNN_DATA to "
        f"the folder that holds cifar-10/ (in Python: mirrors=[...], root=...).")
    assert (info.value.dataset, info.value.filename) == ("CIFAR10", NAME)
    assert os.listdir(folder) == []


# ------------------------------------------------------------------ _download_archive
def test_an_unwritable_cache_folder_is_a_cache_error(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "cifar-10").write_bytes(b"a file where the folder should be")
    with pytest.raises(DatasetCacheError) as info:
        CIFAR10(root=tmp_path / "c", mirrors=[mirror(tmp_path / "m")])
    assert info.value.errno == errno.EEXIST
    assert str(info.value) == (f"[Errno {errno.EEXIST}] cannot write into the dataset cache folder "
                               f"'{tmp_path / 'c' / 'cifar-10'}': File exists (while writing {NAME})")


def test_an_archive_another_process_just_installed_is_used(tmp_path):
    """The lock taken, the archive is there and right: nothing fetched (no mirror needed), and it
    counts as verified."""
    folder = mirror(tmp_path / "c")
    _download_archive(CIFAR10.archive, folder, [], hint=None)
    assert C._verify_key(folder / NAME) in datasets.download._verified
    assert None not in datasets.download._verified


def test_a_wrong_archive_in_place_is_replaced_and_leftovers_removed(tmp_path, monkeypatch):
    folder = mirror(tmp_path / "c", GOOD[:100])
    (folder / f".{NAME}.killed.part").write_bytes(b"left by a killed process")
    (folder / ".other.x.part").write_bytes(b"not ours")
    fetched = []
    real = C._fetch

    def fetch(mirror, name, dest, max_bytes):
        fetched.append((dest.parent, dest.name, os.listdir(dest.parent), max_bytes))
        return real(mirror, name, dest, max_bytes)
    monkeypatch.setattr(C, "_fetch", fetch)
    _download_archive(CIFAR10.archive, folder, [mirror(tmp_path / "m")], hint=None)
    assert (folder / NAME).read_bytes() == GOOD
    (parent, name, listing, max_bytes), = fetched
    assert parent == folder and name.startswith(f".{NAME}.") and name.endswith(".part")  # a hidden temporary
    assert sorted(listing) == sorted([NAME, ".other.x.part", name])    # the leftover was gone before
    assert max_bytes == len(GOOD)
    assert sorted(os.listdir(folder)) == sorted([NAME, ".other.x.part"])
    assert C._verify_key(folder / NAME) in datasets.download._verified
    assert None not in datasets.download._verified


def test_archive_md5_is_checked_too(tmp_path, monkeypatch):
    data = GOOD
    info = _ArchiveInfo(NAME, len(data), hashlib.sha256(data).hexdigest(), "0" * 32)
    path = mirror(tmp_path / "m") / NAME
    assert info.check(path) == f"checksum mismatch: archive MD5 {hashlib.md5(data).hexdigest()}, expected {'0' * 32}"
    assert table(data).check(path) is None and table(data, md5=False).check(path) is None
    sha = _ArchiveInfo(NAME, len(data), "f" * 64)
    assert sha.check(path) == f"checksum mismatch: archive SHA-256 {hashlib.sha256(data).hexdigest()}, expected {'f' * 64}"
    monkeypatch.setattr(CIFAR10, "archive", info)
    with pytest.raises(DatasetDownloadError) as e:
        CIFAR10(root=tmp_path / "c", mirrors=[tmp_path / "m"])
    assert e.value.failures == [(str(tmp_path / "m"), f"checksum mismatch: archive MD5 "
                                                      f"{hashlib.md5(data).hexdigest()}, expected {'0' * 32}")]
    assert os.listdir(tmp_path / "c" / "cifar-10") == []


# ------------------------------------------------------------------ _read_archive: the archive's structure
def _refused(tmp_path, monkeypatch, data, train=False):
    """The message of the DatasetError for a published (checksum-right) archive ``data``."""
    publish(monkeypatch, data)
    with pytest.raises(DatasetError) as info:
        CIFAR10(train, root=tmp_path / "c", mirrors=[mirror(tmp_path / "m", data)])
    return str(info.value)


def where(tmp_path):
    return f"CIFAR-10 archive {tmp_path / 'c' / 'cifar-10' / NAME}"


def test_entry_count_limit_boundary(tmp_path, monkeypatch):
    base = len(entries())                                              # folder + 6 batches
    ok = archive(extra=[(f"junk{i}", b"") for i in range(MAX_MEMBERS - base)])
    publish(monkeypatch, ok)
    ds = CIFAR10(False, root=tmp_path / "ok", mirrors=[mirror(tmp_path / "okm", ok)])    # exactly 64: read
    assert len(ds) == RECORDS
    over = archive(extra=[(f"junk{i}", b"") for i in range(MAX_MEMBERS - base + 1)])
    assert _refused(tmp_path, monkeypatch, over) == \
        f"{where(tmp_path)}: more than {MAX_MEMBERS} entries; not the CIFAR-10 archive"


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE])
def test_a_wanted_entry_that_is_not_a_regular_file(tmp_path, monkeypatch, kind):
    data = archive(drop=["test_batch.bin"], extra=[(f"{FOLDER}/test_batch.bin", Kind(kind))])
    assert _refused(tmp_path, monkeypatch, data) == \
        f"{where(tmp_path)}: entry '{FOLDER}/test_batch.bin' is not a regular file"


def test_a_wanted_folder_is_not_a_regular_file(tmp_path, monkeypatch):
    data = archive(drop=["test_batch.bin"], extra=[(f"{FOLDER}/test_batch.bin", None)])
    assert _refused(tmp_path, monkeypatch, data) == \
        f"{where(tmp_path)}: entry '{FOLDER}/test_batch.bin' is not a regular file"


@pytest.mark.parametrize("size", [RECORDS * RECORD - 1, RECORDS * RECORD + 1, 0])
def test_a_wanted_entry_of_the_wrong_size(tmp_path, monkeypatch, size):
    data = archive({"data_batch_3.bin": b"\0" * size})
    assert _refused(tmp_path, monkeypatch, data, train=True) == (
        f"{where(tmp_path)}: entry '{FOLDER}/data_batch_3.bin' declares {size} bytes, expected "
        f"{RECORDS} records of {RECORD} = {RECORDS * RECORD}")


def test_an_entry_named_twice(tmp_path, monkeypatch):
    data = archive(extra=[(f"{FOLDER}/data_batch_1.bin", CONTENT["data_batch_1.bin"][2])])
    assert _refused(tmp_path, monkeypatch, data) == \
        f"{where(tmp_path)}: entry '{FOLDER}/data_batch_1.bin' appears twice"


def test_missing_entries_name_the_first_missing_and_those_seen(tmp_path, monkeypatch):
    data = archive(drop=["data_batch_2.bin", "data_batch_4.bin"], extra=[("zz", b"")])
    seen = sorted([FOLDER, "zz"] + [f"{FOLDER}/{n}" for n in BATCHES if n not in ("data_batch_2.bin",
                                                                               "data_batch_4.bin")])
    assert _refused(tmp_path, monkeypatch, data, train=True) == \
        f"{where(tmp_path)}: no entry '{FOLDER}/data_batch_2.bin' (entries: {seen})"


def test_a_label_outside_the_classes(tmp_path, monkeypatch):
    table_ = bytearray(CONTENT["data_batch_2.bin"][2])
    table_[2 * RECORD] = 200                                           # record 2 of batch 2: 3 + 2 overall
    data = archive({"data_batch_2.bin": bytes(table_)})
    assert _refused(tmp_path, monkeypatch, data, train=True) == \
        f"{where(tmp_path)}: record {RECORDS + 2} has label 200, outside [0, 10)"


@pytest.mark.parametrize("kind, detail", [
    ("plain-tar", "ReadError: not a gzip file"),
    ("cut-gzip", "ReadError: unexpected end of data"),
    ("cut-header", "ReadError: truncated header"),
])
def test_a_corrupt_archive_is_refused_naming_the_error(tmp_path, monkeypatch, kind, detail):
    """The checksum table matches these bytes (they are "published"): the parser itself refuses them.
    Only the gzip stream is read (a plain tar is refused), and a stream that ends early says so."""
    plain = tar_bytes(entries())
    if kind == "plain-tar":
        data = plain
    elif kind == "cut-gzip":
        data = gzip.compress(plain[:512 * 4 + 100], mtime=0)          # inside data_batch_1's bytes,
    else:                                                              # which the training split reads
        data = gzip.compress(plain[:100], mtime=0)                     # inside the first header
    assert _refused(tmp_path, monkeypatch, data, train=kind == "cut-gzip") == \
        f"{where(tmp_path)} is truncated or corrupt ({detail})"


def test_extra_entries_are_skipped_and_order_is_the_wanted_one(tmp_path, monkeypatch):
    """Batches stored in another order, with other files between: the result is in the order
    data_batch_1 ... data_batch_5."""
    shuffled = [(FOLDER, None), ("readme.html", b"<html>"), (f"{FOLDER}/batches.meta.txt", b"airplane\n")]
    shuffled += [(f"{FOLDER}/{n}", CONTENT[n][2]) for n in reversed(BATCHES)]
    data = publish(monkeypatch, gzip.compress(tar_bytes(shuffled), mtime=0))
    ds = CIFAR10(True, root=tmp_path / "c", mirrors=[mirror(tmp_path / "m", data)])
    labels, images = expected(BATCHES[:5])
    np.testing.assert_array_equal(ds.labels, labels)
    np.testing.assert_array_equal(ds.images, images)
    assert ds.images.flags.c_contiguous
