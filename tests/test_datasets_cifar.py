"""CIFAR-10 from its binary archive, on a small archive the tests write in the same format.

The archive holds ``cifar-10-batches-bin/data_batch_1..5.bin`` and ``test_batch.bin`` of
``RECORDS`` records each (1 label byte + 3072 pixel bytes), as the real one does with 10,000; a
test checksum table (``CIFAR10.archive``, monkeypatched) publishes its size and SHA-256, and a
server on 127.0.0.1 serves it, as the MNIST tests do.
"""
import functools
import gzip
import hashlib
import http.server
import io
import os
import stat
import tarfile
import threading

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import CIFAR10, DatasetDownloadError, DatasetError, load_cifar10
from cydnn.datasets.cifar import RECORD, _ArchiveInfo

RECORDS = 4
NAME = "cifar-10-binary.tar.gz"
REAL = CIFAR10.archive          # the real table, before the tests replace it


def _records(rng):
    labels = rng.integers(0, 10, RECORDS, dtype=np.uint8)
    pixels = rng.integers(0, 256, (RECORDS, 3072), dtype=np.uint8)
    return labels, pixels.reshape(RECORDS, 3, 32, 32), np.column_stack([labels, pixels]).tobytes()


def make_archive(members=None, extra=()):
    """``(bytes of a .tar.gz, {member: (labels, images)})`` in CIFAR-10's binary layout."""
    rng = np.random.default_rng(10)
    content = {}
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        folder = tarfile.TarInfo("cifar-10-batches-bin")
        folder.type, folder.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(folder)
        for name in names:
            labels, images, data = _records(rng)
            content[name] = (labels, images)
            data = (members or {}).get(name, data)
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        meta = b"\n".join(c.encode() for c in CIFAR10.classes)
        for name, data in [("cifar-10-batches-bin/batches.meta.txt", meta), *extra]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0), content


GOOD, CONTENT = make_archive()


def table(data):
    return _ArchiveInfo(NAME, len(data), hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest())


@pytest.fixture(autouse=True)
def small_cifar(monkeypatch):
    """The test checksum table: CIFAR10 expects the small archive, with 4 records per batch."""
    monkeypatch.setattr(CIFAR10, "archive", table(GOOD))
    monkeypatch.setattr(CIFAR10, "records_per_batch", RECORDS)
    monkeypatch.setattr(CIFAR10, "default_mirrors", ())
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    datasets.download._verified.clear()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(data):
        folder = tmp_path / f"served{len(servers)}"
        folder.mkdir()
        (folder / NAME).write_bytes(data)
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(folder)))
        srv.requests = []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_port}/", srv
    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _expected(names):
    labels = np.concatenate([CONTENT[n][0] for n in names])
    images = np.concatenate([CONTENT[n][1] for n in names])
    return labels, images


def test_download_parse_and_cache(serve, tmp_path):
    url, srv = serve(GOOD)
    train, test = load_cifar10(root=tmp_path / "cache", mirrors=[url])
    labels, images = _expected([f"data_batch_{i}.bin" for i in range(1, 6)])
    np.testing.assert_array_equal(train.labels, labels)
    np.testing.assert_array_equal(train.images, images)           # R plane, then G, then B
    assert train.images.shape == (5 * RECORDS, 3, 32, 32) and train.images.dtype == np.uint8
    labels, images = _expected(["test_batch.bin"])
    np.testing.assert_array_equal(test.labels, labels)
    np.testing.assert_array_equal(test.images, images)
    assert srv.requests == [f"/{NAME}"]                           # one download, then the cache
    cached = tmp_path / "cache" / "cifar-10" / NAME
    assert sorted(os.listdir(cached.parent)) == [NAME]
    assert stat.S_IMODE(cached.stat().st_mode) == 0o644
    assert train.mean == CIFAR10.train_mean and test.std == CIFAR10.train_std
    assert train.classes[0] == "airplane" and train.num_classes == 10
    offline = CIFAR10(False, root=tmp_path / "cache", download=False)   # no mirror needed now
    np.testing.assert_array_equal(offline.images, test.images)


def _bad(kind):
    data = bytearray(GOOD)
    if kind == "truncated":
        return bytes(data[: len(data) // 2])
    if kind == "tampered":               # same size, one byte changed
        data[len(data) // 2] ^= 0x55
        return bytes(data)
    if kind == "longer":
        return bytes(data) + b"\0" * 10
    raise ValueError(kind)


@pytest.mark.parametrize("kind, reason", [("truncated", "archive is"), ("tampered", "checksum mismatch"),
                                          ("longer", "more than")])
def test_a_bad_archive_never_reaches_the_cache(kind, reason, serve, tmp_path):
    bad_url, _ = serve(_bad(kind))
    root = tmp_path / "cache"
    with pytest.raises(DatasetDownloadError) as info:
        CIFAR10(root=root, mirrors=[bad_url])
    (mirror, why), = info.value.failures
    assert mirror == bad_url and reason in why
    assert "python -m cydnn.train --dataset cifar10 --mirror DIR_OR_URL" in str(info.value)
    assert os.listdir(root / "cifar-10") == []                   # nothing poisoned, no temporary
    good_url, _ = serve(GOOD)
    ds = CIFAR10(root=root, mirrors=[bad_url, good_url])          # the next mirror is used
    assert len(ds) == 5 * RECORDS


def test_a_tampered_cached_archive_is_removed_and_fetched_again(serve, tmp_path):
    url, srv = serve(GOOD)
    CIFAR10(False, root=tmp_path, mirrors=[url])
    cached = tmp_path / "cifar-10" / NAME
    data = bytearray(cached.read_bytes())
    data[100] ^= 1
    cached.write_bytes(bytes(data))
    datasets.download._verified.clear()
    with pytest.warns(UserWarning, match="failed its checksum check"):
        CIFAR10(False, root=tmp_path, mirrors=[url])
    assert cached.read_bytes() == GOOD and len(srv.requests) == 2


def test_local_folder_mirror(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / NAME).write_bytes(GOOD)
    ds = CIFAR10(False, root=tmp_path / "c", mirrors=[tmp_path / "m"])
    np.testing.assert_array_equal(ds.labels, CONTENT["test_batch.bin"][0])


def _published(monkeypatch, data):
    monkeypatch.setattr(CIFAR10, "archive", table(data))
    return data


@pytest.mark.parametrize("members, extra, words", [
    ({"test_batch.bin": b"\0" * (RECORD * RECORDS - 1)}, (), ["test_batch.bin", "declares 12291 bytes"]),
    ({"test_batch.bin": bytes([10]) + b"\0" * (RECORD * RECORDS - 1)}, (), ["record 0 has label 10"]),
    ({}, [("cifar-10-batches-bin/test_batch.bin", b"\0" * RECORD * RECORDS)], ["appears twice"]),
    ({}, [(f"junk{i}", b"") for i in range(60)], ["more than 64 entries"]),
])
def test_archive_structure_is_validated_before_reading(members, extra, words, monkeypatch, tmp_path):
    """A verified archive (its checksum is in the table) whose members are wrong: DatasetError
    naming the archive and the entry."""
    data, _ = make_archive(members, extra)
    _published(monkeypatch, data)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / NAME).write_bytes(data)
    with pytest.raises(DatasetError) as info:
        CIFAR10(False, root=tmp_path / "c", mirrors=[tmp_path / "m"])
    for word in words + ["CIFAR-10 archive"]:
        assert word in str(info.value), (word, str(info.value))


def test_missing_archive_without_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        CIFAR10(root=tmp_path, download=False)


def test_published_checksums_are_the_real_archive():
    """What the package expects of the real archive: the size and MD5 of the CIFAR page."""
    assert (REAL.name, REAL.size, REAL.md5) == (NAME, 170052171, "c32a1d4ab5d03f1284b67883e8d87530")
    assert len(REAL.sha256) == 64 and int(REAL.sha256, 16) >= 0
