"""Every verification rule of the dataset download, WITHOUT the real data (issue 18, item 2).

The files are tests/tiny_idx.py's small IDX files and their .gz; their sizes and SHA-256 are
published through ``Tiny.files``, the test mirror table, which the tests change to exercise each
rule: .gz size + hash, decompressed hash, both needed where both are known (from the dataset's
own mirrors), MD5-only .gz tables (Fashion-MNIST's), mirrors of decompressed files, the cache
re-check and a tampered cache.  Also: the offline hint, the cache files' mode, IDX files refused
from their header, and the download time limits with a counted clock.
"""
import dataclasses
import gzip
import hashlib
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DatasetDownloadError, FashionMNIST, MNIST
from cydnn.datasets import transfer
from cydnn.datasets.errors import _MirrorFailed

sys.path.insert(0, str(Path(__file__).parent))
import tiny_idx  # noqa: E402
from tiny_idx import FILES, IMAGES, LABELS, Tiny  # noqa: E402


@pytest.fixture(autouse=True)
def fresh():
    datasets.download._verified.clear()


def table(**changes):
    """Tiny's table with ``changes`` applied to the images file's entry."""
    files = dict(Tiny.files)
    files[IMAGES] = dataclasses.replace(files[IMAGES], **changes)
    return files


def load(tmp_path, mirror, files=None, own=False):
    """Tiny's test split from ``mirror``: a mirror of the dataset's own (``own``: its default
    mirrors, which serve the published .gz) or one the user names."""
    cls = type("T", (Tiny,), {"files": files or Tiny.files, "default_mirrors": (str(mirror),) if own else ()})
    return cls(tmp_path / "cache", train=False, mirrors=None if own else [mirror])


def recompressed(folder):
    """A mirror with the same data compressed differently (another level: other .gz bytes)."""
    folder.mkdir()
    for name, (raw, gz) in FILES.items():
        other = gzip.compress(raw, compresslevel=1, mtime=0)
        assert other != gz
        (folder / f"{name}.gz").write_bytes(other)
    return folder


def reason(info):
    (_, why), = info.value.failures
    return why


# ------------------------------------------------------------------ .gz and content checksums
@pytest.mark.parametrize("own", [True, False], ids=["own-mirror", "user-mirror"])
def test_the_published_gz_is_accepted(tmp_path, own):
    ds = load(tmp_path, tiny_idx.write_mirror(tmp_path / "m"), own=own)
    np.testing.assert_array_equal(ds.images, tiny_idx.IMAGES_ARRAY)


@pytest.mark.parametrize("own", [True, False], ids=["own-mirror", "user-mirror"])
def test_a_right_gz_with_the_wrong_content_hash_is_refused(tmp_path, own):
    """The .gz matches its published size and SHA-256 but the content's SHA-256 does not: refused.
    (Accepting on the .gz alone -- `gz_ok or idx_ok` -- fails this test.)"""
    files = table(idx_sha256="0" * 64)
    with pytest.raises(DatasetDownloadError) as info:
        load(tmp_path, tiny_idx.write_mirror(tmp_path / "m"), files, own=own)
    assert reason(info).startswith("checksum mismatch: decompressed SHA-256")
    assert "0" * 64 in reason(info)
    assert os.listdir(tmp_path / "cache" / "tiny") == []


def test_own_mirror_needs_the_published_gz_too(tmp_path):
    """From the dataset's own mirrors both checks are needed: right content in another .gz is
    refused (accepting on the content alone, from those mirrors, fails this test)."""
    with pytest.raises(DatasetDownloadError) as info:
        load(tmp_path, recompressed(tmp_path / "m"), own=True)
    assert "the decompressed data is right but the .gz is not the published one" in reason(info)
    assert Tiny.files[IMAGES].gz_sha256 in reason(info)


def test_a_user_mirror_may_hold_another_compression(tmp_path):
    ds = load(tmp_path, recompressed(tmp_path / "m"))
    np.testing.assert_array_equal(ds.images, tiny_idx.IMAGES_ARRAY)


def test_a_wrong_gz_size_alone_fails_the_own_mirror_check(tmp_path):
    files = table(gz_size=Tiny.files[IMAGES].gz_size + 1)
    with pytest.raises(DatasetDownloadError, match="not the published one"):
        load(tmp_path, tiny_idx.write_mirror(tmp_path / "m"), files, own=True)


def test_content_changed_inside_a_valid_gzip_is_refused(tmp_path):
    raw = bytearray(FILES[IMAGES][0])
    raw[-1] ^= 1
    mirror = tiny_idx.write_mirror(tmp_path / "m", {IMAGES: gzip.compress(bytes(raw), mtime=0)})
    with pytest.raises(DatasetDownloadError) as info:
        load(tmp_path, mirror)
    assert hashlib.sha256(bytes(raw)).hexdigest() in reason(info)


def test_without_a_published_gz_the_content_hash_decides(tmp_path):
    files = {name: dataclasses.replace(info, gz_size=None, gz_sha256=None) for name, info in Tiny.files.items()}
    ds = load(tmp_path, recompressed(tmp_path / "m"), files, own=True)
    np.testing.assert_array_equal(ds.images, tiny_idx.IMAGES_ARRAY)


@pytest.mark.parametrize("md5_right", [True, False])
def test_md5_only_tables_as_fashion_mnist_publishes(tmp_path, md5_right):
    """Fashion-MNIST: Zalando publishes the .gz's MD5 only; from its own mirrors the MD5 and the
    content's SHA-256 are both needed."""
    gz = FILES[IMAGES][1]
    md5 = hashlib.md5(gz).hexdigest() if md5_right else "f" * 32
    files = table(gz_size=None, gz_sha256=None, gz_md5=md5)
    mirror = tiny_idx.write_mirror(tmp_path / "m")
    if md5_right:
        load(tmp_path, mirror, files, own=True)
    else:
        with pytest.raises(DatasetDownloadError, match=f"MD5 {hashlib.md5(gz).hexdigest()}, published None bytes "
                                                       f"with MD5 {'f' * 32}"):
            load(tmp_path, mirror, files, own=True)


def test_fashion_mnist_table_has_both_checks():
    for name, info in FashionMNIST.files.items():
        assert len(info.idx_sha256) == 64 and len(info.gz_md5) == 32, name
        assert info.gz_known
    for info in MNIST.files.values():
        assert info.gz_size and len(info.gz_sha256) == 64


# ------------------------------------------------------------------ mirrors of decompressed files
def test_a_folder_of_decompressed_idx_files_is_a_mirror(tmp_path):
    folder = tmp_path / "raw"
    folder.mkdir()
    for name, (raw, _) in FILES.items():
        (folder / name).write_bytes(raw)
    for mirror in (folder, folder.as_uri()):
        ds = load(tmp_path / str(hash(str(mirror))), mirror)
        np.testing.assert_array_equal(ds.labels, tiny_idx.LABELS_ARRAY)


@pytest.mark.parametrize("kind, words", [
    ("tampered", ["checksum mismatch: decompressed SHA-256"]),
    ("header", ["not an unsigned-byte IDX file"]),
    ("longer", ["more than the", "this file can have"]),
])
def test_a_bad_decompressed_file_is_refused(tmp_path, kind, words):
    folder = tiny_idx.write_mirror(tmp_path / "raw")
    for name, (raw, _) in FILES.items():
        (folder / f"{name}.gz").unlink()
        data = bytearray(raw)
        if name == IMAGES:
            if kind == "tampered":
                data[-1] ^= 1
            elif kind == "header":
                data[2] = 0x09
            else:
                data += b"\0"
        (folder / name).write_bytes(bytes(data))
    with pytest.raises(DatasetDownloadError) as info:
        load(tmp_path, folder)
    for word in words:
        assert word in reason(info), (word, reason(info))
    assert os.listdir(tmp_path / "cache" / "tiny") == []


def test_a_missing_file_names_both_forms(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetDownloadError) as info:
        load(tmp_path, tmp_path / "empty")
    assert f"file not found: {tmp_path / 'empty' / IMAGES}.gz (nor the decompressed {IMAGES})" == reason(info)


# ------------------------------------------------------------------ the cache
def test_cache_files_are_0644_and_nothing_else_is_left(tmp_path):
    ds = load(tmp_path, tiny_idx.write_mirror(tmp_path / "m"))
    assert sorted(os.listdir(ds.folder)) == sorted([IMAGES, LABELS])
    for name in (IMAGES, LABELS):
        assert stat.S_IMODE((ds.folder / name).stat().st_mode) == 0o644


@pytest.mark.parametrize("change", ["same-size", "truncated"])
def test_a_tampered_cache_is_rechecked_removed_and_fetched_again(tmp_path, change):
    mirror = tiny_idx.write_mirror(tmp_path / "m")
    ds = load(tmp_path, mirror)
    path = ds.folder / IMAGES
    data = bytearray(path.read_bytes())
    if change == "same-size":            # only the hash can tell
        data[1000] ^= 0xFF
    else:
        data = data[:-10]
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="failed its SHA-256 check"):
        again = load(tmp_path, mirror)
    np.testing.assert_array_equal(again.images, tiny_idx.IMAGES_ARRAY)
    assert path.read_bytes() == FILES[IMAGES][0]


def test_the_cache_is_hashed_again_when_it_changes(tmp_path, monkeypatch):
    mirror = tiny_idx.write_mirror(tmp_path / "m")
    ds = load(tmp_path, mirror)
    hashed = []
    real = datasets.download._sha256_file
    monkeypatch.setattr(datasets.download, "_sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    load(tmp_path, mirror)
    assert hashed == []                                    # verified once per process
    os.utime(ds.folder / IMAGES, ns=(1, 1))                # a new mtime: hashed again
    load(tmp_path, mirror)
    assert hashed == [IMAGES]


# ------------------------------------------------------------------ when every mirror fails
def test_the_error_ends_with_the_command_that_works_offline(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetDownloadError) as info:
        MNIST(tmp_path / "c", train=False, mirrors=[tmp_path / "empty"])
    message = str(info.value)
    assert message.startswith("could not download t10k-images-idx3-ubyte.gz for MNIST from any mirror:")
    assert "    python -m cydnn.train --mirror DIR_OR_URL\n" in message
    assert "t10k-images-idx3-ubyte.gz" in message.split("DIR_OR_URL", 2)[2]      # what the folder holds
    assert "decompressed" in message and "$CYDNN_DATA" in message and str(tmp_path / "c" / "mnist") in message
    with pytest.raises(DatasetDownloadError) as info:
        FashionMNIST(tmp_path / "c", train=False, mirrors=[tmp_path / "empty"])
    assert "python -m cydnn.train --dataset fashion-mnist --mirror DIR_OR_URL" in str(info.value)


# ------------------------------------------------------------------ IDX files: header first
def _read_bytes():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io to count bytes read")
@pytest.mark.parametrize("declared", ["over-the-limit", "fits-but-file-longer"])
def test_an_idx_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch, declared):
    """A 2 GiB (sparse) file: refused from its 16-byte header and its size, reading almost nothing."""
    monkeypatch.setattr(datasets, "MAX_IDX_BYTES", 1 << 20)
    path = tmp_path / "big-idx3-ubyte"
    dims = (70000, 28, 28) if declared == "over-the-limit" else (10, 28, 28)
    with open(path, "wb") as f:
        f.write(tiny_idx.idx_bytes(np.zeros((1, 1, 1), np.uint8))[:4] + b"".join(d.to_bytes(4, "big") for d in dims))
        f.truncate(2 << 30)
    before = _read_bytes()
    with pytest.raises(ValueError) as info:
        datasets.read_idx(path)
    assert _read_bytes() - before < 1 << 16
    assert str(path) in str(info.value)
    if declared == "over-the-limit":
        assert "more than the 1048576-byte limit (MAX_IDX_BYTES)" in str(info.value)
    else:
        assert "trailing bytes" in str(info.value)


def test_read_idx_file_and_bytes_agree(tmp_path):
    raw = FILES[IMAGES][0]
    (tmp_path / "f").write_bytes(raw)
    np.testing.assert_array_equal(datasets.read_idx(tmp_path / "f"), datasets.read_idx(raw))
    (tmp_path / "short").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="truncated"):
        datasets.read_idx(tmp_path / "short")
    (tmp_path / "junk").write_bytes(b"\x01\x02" + raw[2:])
    with pytest.raises(ValueError, match="bad magic number"):
        datasets.read_idx(tmp_path / "junk")


# ------------------------------------------------------------------ time limits, on a counted clock
class Clock:
    """A clock that moves only when told: time becomes a counted quantity."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def guard(monkeypatch, deadline=600, rate=1024, seconds=30):
    clock = Clock()
    monkeypatch.setattr(transfer, "_clock", clock)
    monkeypatch.setattr(datasets, "DOWNLOAD_DEADLINE", deadline)
    monkeypatch.setattr(datasets, "MIN_DOWNLOAD_RATE", rate)
    monkeypatch.setattr(datasets, "MIN_RATE_SECONDS", seconds)
    return clock, transfer._TimeGuard("http://m/f.gz", 10**6)


def test_rate_at_the_limit_passes_and_below_it_stops(monkeypatch):
    clock, g = guard(monkeypatch, rate=100, seconds=10)
    received = 0
    for _ in range(50):                    # exactly 100 bytes/s for 50 s: never stopped
        clock.now += 1
        received += 100
        g.check(received)
    clock.now += 1                         # one second at 99 bytes/s: the last 10 s averaged 99.9
    received += 99
    with pytest.raises(_MirrorFailed) as info:
        g.check(received)
    assert "download slower than 100 bytes/s for 10 s (999 bytes in the last 10.0 s)" in str(info.value)
    assert f"after {received} of 1000000 bytes in 51.0 s from http://m/f.gz" in str(info.value)


def test_a_stall_is_forgiven_once_the_window_has_enough_bytes(monkeypatch):
    clock, g = guard(monkeypatch, rate=100, seconds=10)
    clock.now += 5
    g.check(0)                             # 5 s of nothing: no verdict before a whole window
    clock.now += 5
    g.check(1000)                          # then 1000 bytes: 1000 in the last 10 s, enough
    clock.now += 10
    with pytest.raises(_MirrorFailed, match=r"\(0 bytes in the last 10\.0 s\)"):
        g.check(1000)


def test_no_rate_check_before_a_whole_window_and_when_off(monkeypatch):
    clock, g = guard(monkeypatch, rate=10**9, seconds=5)
    clock.now += 4.9
    g.check(0)                             # less than one window: no verdict yet
    clock, g = guard(monkeypatch, rate=0, seconds=5)
    clock.now += 500
    g.check(0)                             # 0 turns the rate check off


def test_the_deadline_is_enforced_and_reported(monkeypatch):
    clock, g = guard(monkeypatch, deadline=3, rate=0)
    clock.now += 3
    g.check(10)                            # at the deadline: still allowed
    clock.now += 0.5
    with pytest.raises(_MirrorFailed, match=r"download deadline of 3 s passed after 10 of 1000000 bytes "
                                            r"in 3\.5 s .*DOWNLOAD_DEADLINE"):
        g.check(10)
