"""Mutation-driven tests of cydnn.datasets.download: the cache check, mirror URLs, the bounds,
where the temporaries live, which form a local mirror gives, the exact reasons, and every
DatasetCacheError, mostly through the private functions themselves.

The data is tests/tiny_idx.py's small IDX files; no network (HTTP is replaced by a recorder).
"""
import dataclasses
import errno
import gzip
import hashlib
import os
import sys
from pathlib import Path

import pytest

from cydnn import datasets
from cydnn.datasets import DatasetCacheError, DatasetDownloadError, download
from cydnn.datasets.download import _FileInfo
from cydnn.datasets.errors import _MirrorFailed

sys.path.insert(0, str(Path(__file__).parent))
from tiny_idx import FILES, IMAGES, Tiny  # noqa: E402

RAW, GZ = FILES[IMAGES]
INFO = Tiny.files[IMAGES]


@pytest.fixture(autouse=True)
def fresh():
    download._verified.clear()
    yield
    download._verified.clear()


def folder_mirror(path, gz=GZ, raw=None):
    path.mkdir(parents=True, exist_ok=True)
    if gz is not None:
        (path / f"{IMAGES}.gz").write_bytes(gz)
    if raw is not None:
        (path / IMAGES).write_bytes(raw)
    return path


def reason_of(mirror, folder, info=INFO, strict=False):
    with pytest.raises(_MirrorFailed) as e:
        download._fetch_from_mirror(mirror, IMAGES, info, folder, strict=strict)
    return str(e.value)


# ------------------------------------------------------------------ the cache check
def test_the_verification_key_is_the_resolved_path_size_and_mtime(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    st = os.stat(p)
    assert download._verify_key(tmp_path / "." / "f") == (str(p.resolve()), 3, st.st_mtime_ns)


def test_two_files_of_the_same_size_and_time_are_verified_apart(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(RAW)
    bad.write_bytes(RAW[:-1] + bytes([RAW[-1] ^ 1]))
    for p in (good, bad):
        os.utime(p, ns=(10**18, 10**18))
    assert download._cached_file_ok(good, INFO)
    assert not download._cached_file_ok(bad, INFO)


def test_a_verified_file_is_hashed_once(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_bytes(RAW)
    calls, real = [], download._sha256_file
    monkeypatch.setattr(download, "_sha256_file", lambda path: calls.append(path) or real(path))
    assert download._cached_file_ok(p, INFO) and download._cached_file_ok(p, INFO)
    assert calls == [p]
    assert download._verify_key(p) in download._verified


# ------------------------------------------------------------------ mirrors and bounds
@pytest.mark.parametrize("mirror", ["http://127.0.0.1:9/dataX", "http://127.0.0.1:9/dataX//"])
def test_an_http_mirror_gets_one_slash_before_the_name(tmp_path, monkeypatch, mirror):
    urls = []
    monkeypatch.setattr(download, "_download_http", lambda url, dest, max_bytes: urls.append((url, max_bytes)))
    download._fetch(mirror, "f.gz", tmp_path / "out", 123)
    assert urls == [("http://127.0.0.1:9/dataX/f.gz", 123)]


def test_the_bound_on_a_gz(tmp_path):
    assert download._max_gz_size(_FileInfo(100, "x")) == 2 * 100 + 65536
    assert download._max_gz_size(_FileInfo(100, "x", gz_size=10**6)) == 10**6
    assert download._max_gz_size(_FileInfo(100, "x", gz_size=1000)) == 65736


# ------------------------------------------------------------------ one mirror
def test_both_temporaries_are_in_the_cache_folder_while_fetching(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir()
    seen, real = [], download._fetch
    monkeypatch.setattr(download, "_fetch", lambda *a: seen.append(sorted(os.listdir(folder))) or real(*a))
    download._fetch_from_mirror(folder_mirror(tmp_path / "m"), IMAGES, INFO, folder)
    (names,) = seen
    gz = [n for n in names if n.startswith(f".{IMAGES}.gz.") and n.endswith(".part")]
    idx = [n for n in names if n.startswith(f".{IMAGES}.") and n.endswith(".part") and n not in gz]
    assert len(gz) == 1 and len(idx) == 1 and len(names) == 2, names
    assert os.listdir(folder) == [IMAGES]


def test_a_user_mirror_is_not_strict_by_default(tmp_path):
    other = gzip.compress(RAW, compresslevel=1, mtime=0)
    assert other != GZ
    folder = tmp_path / "cache"
    folder.mkdir()
    download._fetch_from_mirror(folder_mirror(tmp_path / "m", gz=other), IMAGES, INFO, folder)
    assert (folder / IMAGES).read_bytes() == RAW


def test_a_local_mirror_with_both_forms_gives_the_gz(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # the .gz is looked for in the mirror, not here
    folder = tmp_path / "cache"
    folder.mkdir()
    bad_raw = RAW[:-1] + bytes([RAW[-1] ^ 1])
    download._fetch_from_mirror(str(folder_mirror(tmp_path / "m", raw=bad_raw)), IMAGES, INFO, folder)
    assert (folder / IMAGES).read_bytes() == RAW


def test_a_decompressed_file_with_a_bad_header_is_named(tmp_path):
    (tmp_path / "cache").mkdir()
    mirror = folder_mirror(tmp_path / "m", gz=None, raw=b"\x00\x00\x09\x01" + RAW[4:])
    assert reason_of(str(mirror), tmp_path / "cache") == (
        f"{mirror / IMAGES}: not an unsigned-byte IDX file of rank 1 or 3 (it starts with b'\\x00\\x00\\t\\x01')")


def test_a_decompressed_file_is_checked_from_its_16_header_bytes(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    mirror = folder_mirror(tmp_path / "m", gz=None, raw=RAW)
    reads, real_open = [], open

    class Reads:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            reads.append(n)
            return self.f.read(n)

        def fileno(self):
            return self.f.fileno()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(download, "open", lambda *a, **k: Reads(real_open(*a, **k)), raising=False)
    download._fetch_from_mirror(str(mirror), IMAGES, INFO, tmp_path / "cache")
    assert reads == [16]                                 # the header only; the hash reads the rest
    assert (tmp_path / "cache" / IMAGES).read_bytes() == RAW


def test_a_decompressed_file_with_other_content_says_there_is_no_gz(tmp_path):
    (tmp_path / "cache").mkdir()
    bad = RAW[:-1] + bytes([RAW[-1] ^ 1])
    mirror = folder_mirror(tmp_path / "m", gz=None, raw=bad)
    assert reason_of(str(mirror), tmp_path / "cache", strict=True) == (
        f"checksum mismatch: decompressed SHA-256 {hashlib.sha256(bad).hexdigest()}, expected "
        f"{INFO.idx_sha256}; decompressed file: no .gz to check")


def test_an_http_failure_is_not_about_a_decompressed_file(tmp_path, monkeypatch):
    def fail(url, dest, max_bytes):
        raise _MirrorFailed(f"file not found: {url}")   # whatever the words, http has no other form
    monkeypatch.setattr(download, "_download_http", fail)
    (tmp_path / "cache").mkdir()
    assert reason_of("http://127.0.0.1:9/m", tmp_path / "cache") == f"file not found: http://127.0.0.1:9/m/{IMAGES}.gz"


def test_a_right_content_in_an_unpublished_gz_from_a_strict_mirror(tmp_path):
    (tmp_path / "cache").mkdir()
    other = gzip.compress(RAW, compresslevel=1, mtime=0)
    why = reason_of(str(folder_mirror(tmp_path / "m", gz=other)), tmp_path / "cache", strict=True)
    assert why == ("checksum mismatch: the decompressed data is right but the .gz is not the published one; "
                   f".gz is {len(other)} bytes with SHA-256 {hashlib.sha256(other).hexdigest()}, published "
                   f"{INFO.gz_size} bytes with SHA-256 {INFO.gz_sha256}")


# ------------------------------------------------------------------ the cache folder's errors
def test_a_final_name_that_cannot_be_replaced_is_a_cache_error(tmp_path):
    tmp = tmp_path / ".f.part"
    tmp.write_bytes(b"x")
    final = tmp_path / "c" / "f"
    (final / "inside").mkdir(parents=True)          # a non-empty folder in the way
    with pytest.raises(DatasetCacheError) as e:
        download._install(tmp, final)
    assert e.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert e.value.strerror == (f"cannot write into the dataset cache folder {str(tmp_path / 'c')!r}: "
                                f"{os.strerror(e.value.errno)} (while writing f)")


def test_a_cache_folder_that_cannot_be_made_is_a_cache_error(tmp_path):
    (tmp_path / "afile").write_bytes(b"")
    folder = tmp_path / "afile" / "tiny"
    with pytest.raises(DatasetCacheError) as e:
        download._download("tiny", IMAGES, INFO, folder, [])
    assert e.value.errno == errno.ENOTDIR
    assert e.value.strerror == (f"cannot write into the dataset cache folder {str(folder)!r}: Not a directory "
                                f"(while writing {IMAGES})")


def test_a_file_already_in_the_cache_is_not_fetched_again(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / IMAGES).write_bytes(RAW)
    download._download("tiny", IMAGES, INFO, folder, ["http://127.0.0.1:9/never/"])
    assert (folder / IMAGES).read_bytes() == RAW
    (folder / IMAGES).write_bytes(RAW[:-1])           # a wrong one is fetched: the mirror fails
    with pytest.raises(DatasetDownloadError):
        download._download("tiny", IMAGES, INFO, folder, [str(tmp_path / "nowhere")])


# ------------------------------------------------------------------ roots and mirror forms
def test_the_cache_root_expands_home_and_ignores_an_empty_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CYDNN_DATA", "~/env")
    assert download.data_root("~/arg") == tmp_path / "home" / "arg"
    assert download.data_root() == tmp_path / "home" / "env"
    monkeypatch.setenv("CYDNN_DATA", "")
    assert download.data_root() == tmp_path / "data"
    monkeypatch.delenv("CYDNN_DATA")
    assert download.data_root() == tmp_path / "data"


def test_mirror_forms_accepted_and_refused(tmp_path):
    assert download._check_mirror(tmp_path) == str(tmp_path)
    assert download._check_mirror("HTTPS://h/x") == "HTTPS://h/x" and download._check_mirror("rel/dir") == "rel/dir"
    assert not download._is_url(tmp_path) and download._is_url("file:///x") and not download._is_url("a:/b")
    with pytest.raises(TypeError) as e:
        download._check_mirror(42)
    assert str(e.value) == "a mirror must be a URL or a directory path, got 42"
    with pytest.raises(ValueError) as e:
        download._check_mirror("FTP://h/x")
    assert str(e.value) == ("mirror 'FTP://h/x': unsupported URL scheme 'ftp' "
                            "(use http://, https://, file:// or a directory path)")


def test_local_mirror_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert download._local_dir("~/m") == str(tmp_path / "m")
    assert download._local_dir("FILE:///srv/m%20x") == "/srv/m x"
    assert download._local_dir("https://h/m") is None


# ------------------------------------------------------------------ temporaries, leftovers, the lock
def test_a_temporary_that_cannot_be_made_names_the_folder_and_the_file(tmp_path, monkeypatch):
    def refuse(**kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(download.tempfile, "mkstemp", refuse)
    with pytest.raises(DatasetCacheError) as e:
        download._temp_file(tmp_path / "c", "f.gz")
    assert e.value.strerror == (f"cannot write into the dataset cache folder {str(tmp_path / 'c')!r}: "
                                f"Permission denied (while writing f.gz)")


def test_leftovers_of_the_file_are_removed_and_nothing_else(tmp_path, monkeypatch):
    names = [f".{IMAGES}.abc.part", f".{IMAGES}.gz.def.part", f".{IMAGES}.abc", f"{IMAGES}.x.part", ".other.a.part"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    download._remove_leftovers(tmp_path, IMAGES)
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
    # One that another process removed between the listing and the removal is no error.
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([self / f".{IMAGES}.gone.part"]))
    download._remove_leftovers(tmp_path, IMAGES)


class Clock:
    def __init__(self):
        self.now, self.sleeps = 50.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_an_explicit_lock_timeout_of_zero_polls_once_more(tmp_path, monkeypatch):
    import fcntl
    clock = Clock()
    monkeypatch.setattr(download, "time", clock)
    monkeypatch.setattr(datasets, "LOCK_TIMEOUT", 100)
    holder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(TimeoutError, match=r"for more than 0 s \(LOCK_TIMEOUT\)"):
            with download._FolderLock(tmp_path, timeout=0):
                pass
    finally:
        os.close(holder)
    assert clock.sleeps == [0.05]                 # at the limit it still waits; past it, it gives up


def test_a_lock_on_a_missing_folder_names_it(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(DatasetCacheError) as e:
        with download._FolderLock(missing, timeout=1):
            pass
    assert e.value.errno == errno.ENOENT
    assert e.value.strerror == (f"cannot write into the dataset cache folder {str(missing)!r}: "
                                f"No such file or directory (while writing .lock)")


def test_without_flock_the_lock_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)    # as on Windows: import fcntl fails
    lock = download._FolderLock(tmp_path, timeout=1)
    with lock as held:
        assert held is lock and lock.fd is None
    assert os.listdir(tmp_path) == []
