"""Tests of cydnn.datasets on real MNIST: download, verification and cache.

No test reaches the internet.  Downloads come from the real MNIST files in
../shared/data/mnist (or $CYDNN_TEST_MNIST; tests/mnist_data.py), served over HTTP on
127.0.0.1 or read as a local directory; tests needing them skip when they are missing
(fail with CYDNN_REQUIRE_MNIST=1).  Those files are re-compressed copies: the user-named
mirrors here are judged by their content's SHA-256 (test_datasets_verify.py covers the rest
of the rules without real data).  IDX parsing and the DataLoader: test_datasets_loader.py.
Dataset files are only ever copied into pytest's temporary folders.
"""
import contextlib
import functools
import gzip
import hashlib
import http.server
import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

import mnist_data  # the one MNIST lookup (tests/mnist_data.py)
from cydnn import datasets
from cydnn.datasets import DatasetDownloadError, FashionMNIST, MNIST, data_root, load_mnist

TEST_CLASS_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]  # from the data's README
TEST_FILES = ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
ALL_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"] + TEST_FILES


# --------------------------------------------------------------------------
# Helpers: a loopback HTTP server, a closed port, mirrors with bad files
# --------------------------------------------------------------------------

class _RecordingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a directory and records every requested path on the server."""

    def do_GET(self):
        self.server.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):  # keep the test output quiet
        pass


@contextlib.contextmanager
def serve_directory(path):
    """Serve ``path`` on 127.0.0.1 (a free port) in a thread; yields the server, with ``.url``."""
    handler = functools.partial(_RecordingHandler, directory=str(path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.requests = []
    server.url = f"http://127.0.0.1:{server.server_port}/"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def dead_url():
    """A URL on a loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def copy_cache(cache_root, root, names=ALL_FILES):
    """Fill ``root/mnist/`` with verified IDX files from the shared test cache."""
    (root / "mnist").mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(cache_root / "mnist" / name, root / "mnist" / name)
    return root


def make_bad_mirror(folder, source, kind):
    """A mirror folder whose t10k-images .gz is broken in the way ``kind`` says (labels are fine)."""
    folder.mkdir(parents=True)
    shutil.copy(source / "t10k-labels-idx1-ubyte.gz", folder)
    good = (source / "t10k-images-idx3-ubyte.gz").read_bytes()
    if kind == "flipped":        # bytes flipped in the middle of the compressed stream
        bad = bytearray(good)
        middle = len(bad) // 2
        bad[middle:middle + 16] = bytes(b ^ 0xFF for b in bad[middle:middle + 16])
        bad = bytes(bad)
    elif kind == "truncated":    # the first half only
        bad = good[: len(good) // 2]
    elif kind == "not-gzip":     # e.g. an HTML error page served with status 200
        bad = b"<html><body>Service unavailable</body></html>\n"
    elif kind == "wrong-content":  # a valid gzip of a valid IDX file with one pixel changed
        idx = bytearray(gzip.decompress(good))
        idx[1000] ^= 0x01
        bad = gzip.compress(bytes(idx), compresslevel=1)
    else:
        raise ValueError(kind)
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(bad)
    return folder


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def mnist_no_proxy():
    """Loopback requests must never go through a proxy set in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        yield


@pytest.fixture(scope="session")
def mnist_source():
    """The folder of the real MNIST .gz files (read-only); skips when absent (fails with
    CYDNN_REQUIRE_MNIST=1: tests/mnist_data.py)."""
    return mnist_data.require()


@pytest.fixture(scope="session")
def mnist_server(mnist_source):
    """An HTTP server on 127.0.0.1 serving the real MNIST folder for the whole session."""
    with serve_directory(mnist_source) as server:
        yield server


@pytest.fixture(scope="session")
def mnist_cache(mnist_server, tmp_path_factory):
    """ONE download of both MNIST splits over HTTP, shared by the tests (copy from it, don't modify it).

    Returns a dict: root, train, test (the datasets), requests (what the server was asked).
    """
    root = tmp_path_factory.mktemp("mnist-cache")
    before = len(mnist_server.requests)
    train, test = load_mnist(root=root, mirrors=[mnist_server.url])
    return {"root": root, "train": train, "test": test,
            "requests": list(mnist_server.requests[before:])}


# --------------------------------------------------------------------------
# Download, cache, verification
# --------------------------------------------------------------------------

def test_download_over_http_verifies_and_caches_idx(mnist_cache):
    root, train, test = mnist_cache["root"], mnist_cache["train"], mnist_cache["test"]
    assert sorted(mnist_cache["requests"]) == sorted(f"/{n}.gz" for n in ALL_FILES)

    # The cache holds exactly the four decompressed IDX files, with the published SHA-256.
    assert listing(root / "mnist") == sorted(ALL_FILES)
    for name in ALL_FILES:
        assert sha256(root / "mnist" / name) == MNIST.files[name].idx_sha256

    assert train.images.shape == (60000, 28, 28) and train.images.dtype == np.uint8
    assert train.labels.shape == (60000,) and train.labels.dtype == np.int32
    assert test.images.shape == (10000, 28, 28) and test.images.dtype == np.uint8
    assert test.labels.shape == (10000,) and test.labels.dtype == np.int32
    assert len(train) == 60000 and len(test) == 10000
    assert np.bincount(test.labels, minlength=10).tolist() == TEST_CLASS_COUNTS
    assert train.train and not test.train
    image, label = test[0]
    assert image.shape == (28, 28) and isinstance(label, int)
    # The training pixels have the documented normalisation statistics.
    pixels = train.images / 255.0
    assert abs(pixels.mean() - MNIST.mean) < 1e-4 and abs(pixels.std() - MNIST.std) < 1e-4


def test_second_load_reads_the_cache_without_any_request(mnist_cache, mnist_server, tmp_path):
    root = copy_cache(mnist_cache["root"], tmp_path, TEST_FILES)
    before = len(mnist_server.requests)

    live = MNIST(root, train=False, mirrors=[mnist_server.url])
    dead = MNIST(root, train=False, mirrors=[dead_url()])
    offline = MNIST(root, train=False, download=False)

    assert len(mnist_server.requests) == before  # the live mirror was never asked
    for ds in (live, dead, offline):
        np.testing.assert_array_equal(ds.images, mnist_cache["test"].images)
        np.testing.assert_array_equal(ds.labels, mnist_cache["test"].labels)


def test_cached_files_are_hashed_once_per_process(mnist_cache, tmp_path, monkeypatch):
    root = copy_cache(mnist_cache["root"], tmp_path, TEST_FILES)
    MNIST(root, train=False, download=False)  # first load: hashes both files

    def no_hashing(path):
        raise AssertionError(f"{path} was hashed again")
    monkeypatch.setattr(datasets.download, "_sha256_file", no_hashing)
    MNIST(root, train=False, download=False)


def test_corrupt_cached_file_is_removed_and_downloaded_again(mnist_cache, mnist_source, tmp_path):
    root = copy_cache(mnist_cache["root"], tmp_path, TEST_FILES)
    labels_file = root / "mnist" / "t10k-labels-idx1-ubyte"
    data = bytearray(labels_file.read_bytes())
    data[-1] = (data[-1] + 1) % 10  # still a valid IDX file: only the hash can tell
    labels_file.write_bytes(bytes(data))

    with pytest.warns(UserWarning, match="failed its SHA-256 check"):
        test = MNIST(root, train=False, mirrors=[mnist_source])
    assert sha256(labels_file) == MNIST.files["t10k-labels-idx1-ubyte"].idx_sha256
    np.testing.assert_array_equal(test.labels, mnist_cache["test"].labels)


def test_corrupt_cached_file_without_download_is_removed_and_reported(mnist_cache, tmp_path):
    root = copy_cache(mnist_cache["root"], tmp_path, TEST_FILES)
    images_file = root / "mnist" / "t10k-images-idx3-ubyte"
    with open(images_file, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    with pytest.warns(UserWarning, match="failed its SHA-256 check"), \
            pytest.raises(FileNotFoundError, match="download=True"):
        MNIST(root, train=False, download=False)
    assert not images_file.exists()


@pytest.mark.parametrize("kind", ["flipped", "truncated", "not-gzip", "wrong-content"])
def test_bad_file_on_first_mirror_falls_back_to_the_next(kind, mnist_cache, mnist_source,
                                                         mnist_server, tmp_path):
    bad = make_bad_mirror(tmp_path / "bad", mnist_source, kind)
    root = tmp_path / "cache"
    with serve_directory(bad) as bad_server:
        test = MNIST(root, train=False, mirrors=[bad_server.url, mnist_server.url])
        assert "/t10k-images-idx3-ubyte.gz" in bad_server.requests  # the bad mirror was tried first
    np.testing.assert_array_equal(test.images, mnist_cache["test"].images)
    assert listing(root / "mnist") == sorted(TEST_FILES)  # no temporaries left behind


def test_only_bad_mirrors_raise_an_error_listing_each_mirror_and_why(mnist_source, tmp_path):
    flipped = make_bad_mirror(tmp_path / "flipped", mnist_source, "flipped")
    truncated = make_bad_mirror(tmp_path / "truncated", mnist_source, "truncated")
    wrong = make_bad_mirror(tmp_path / "wrong", mnist_source, "wrong-content")
    empty = tmp_path / "empty"
    empty.mkdir()
    root = tmp_path / "cache"
    closed = dead_url()

    with serve_directory(flipped) as flipped_server, serve_directory(empty) as empty_server:
        mirrors = [flipped_server.url, str(truncated), wrong.as_uri(), empty_server.url, closed,
                   str(tmp_path / "nowhere")]
        with pytest.raises(DatasetDownloadError) as info:
            MNIST(root, train=False, mirrors=mirrors)

    error = info.value
    assert isinstance(error, RuntimeError)
    assert [mirror for mirror, _ in error.failures] == mirrors
    reasons = [reason for _, reason in error.failures]
    assert reasons[0].startswith("corrupt gzip")
    assert reasons[1].startswith("truncated gzip")
    expected = MNIST.files["t10k-images-idx3-ubyte"].idx_sha256
    actual = hashlib.sha256(gzip.decompress((wrong / "t10k-images-idx3-ubyte.gz").read_bytes())).hexdigest()
    assert reasons[2].startswith("checksum mismatch") and expected in reasons[2] and actual in reasons[2]
    assert reasons[3].startswith("HTTP 404")
    assert reasons[4].startswith("connection failed")
    assert reasons[5].startswith("file not found")
    message = str(error)
    assert "t10k-images-idx3-ubyte.gz" in message
    for mirror, reason in error.failures:
        assert f"{mirror}: {reason}" in message
    # Nothing with the final name, and no temporaries, were left in the cache.
    assert listing(root / "mnist") == []


class _CutOffHandler(http.server.BaseHTTPRequestHandler):
    """Announces the whole file but closes the connection halfway through it."""

    def do_GET(self):
        self.server.requests.append(self.path)
        data = (self.server.folder / self.path.lstrip("/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_connection_cut_mid_transfer_falls_back(mnist_cache, mnist_source, mnist_server, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutOffHandler)
    server.folder, server.requests = mnist_source, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}/"
    try:
        with pytest.raises(DatasetDownloadError, match="truncated download") as info:
            MNIST(tmp_path, train=False, mirrors=[url])
        assert listing(tmp_path / "mnist") == []
        test = MNIST(tmp_path, train=False, mirrors=[url, mnist_server.url])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert info.value.failures[0][1].startswith("truncated download: the connection closed after")
    np.testing.assert_array_equal(test.images, mnist_cache["test"].images)
    assert server.requests.count("/t10k-images-idx3-ubyte.gz") == 2


def test_dead_mirror_then_good_one(mnist_cache, mnist_server, tmp_path):
    test = MNIST(tmp_path, train=False, mirrors=[dead_url(), mnist_server.url])
    np.testing.assert_array_equal(test.labels, mnist_cache["test"].labels)


@pytest.mark.parametrize("form", ["str", "path", "file-url"])
def test_local_directory_mirror(form, mnist_cache, mnist_source, tmp_path):
    mirror = {"str": str(mnist_source), "path": mnist_source, "file-url": mnist_source.as_uri()}[form]
    test = MNIST(tmp_path, train=False, mirrors=[mirror])
    np.testing.assert_array_equal(test.images, mnist_cache["test"].images)
    assert listing(tmp_path / "mnist") == sorted(TEST_FILES)


def test_missing_files_without_download(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        MNIST(tmp_path, train=False, download=False)
    message = str(info.value)
    assert str(tmp_path / "mnist") in message and "download=True" in message
    assert "t10k-images-idx3-ubyte" in message


def test_cache_root_argument_then_environment_then_cwd(mnist_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CYDNN_DATA", raising=False)
    assert data_root() == tmp_path / "data"
    monkeypatch.setenv("CYDNN_DATA", str(tmp_path / "env"))
    assert data_root() == tmp_path / "env"
    assert data_root(tmp_path / "arg") == tmp_path / "arg"

    copy_cache(mnist_cache["root"], tmp_path / "env", TEST_FILES)
    test = MNIST(train=False, download=False)  # found through $CYDNN_DATA
    assert test.folder == tmp_path / "env" / "mnist" and len(test) == 10000


def test_class_attributes():
    assert FashionMNIST.mean == 0.2860 and FashionMNIST.std == 0.3530
    assert len(FashionMNIST.classes) == 10 and FashionMNIST.classes[9] == "Ankle boot"
    assert MNIST.mean == 0.1307 and MNIST.std == 0.3081 and len(MNIST.classes) == 10
    assert MNIST.default_mirrors[0] == "https://ossci-datasets.s3.amazonaws.com/mnist/"
    assert FashionMNIST.name == "fashion-mnist" and MNIST.name == "mnist"


def test_fashion_mnist_refuses_mnist_files(mnist_source, tmp_path):
    with pytest.raises(DatasetDownloadError, match="checksum mismatch"):
        FashionMNIST(tmp_path, train=False, mirrors=[mnist_source])
    assert listing(tmp_path / "fashion-mnist") == []


def test_unsupported_mirror_scheme_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        MNIST(tmp_path, mirrors=["ftp://example.org/mnist/"])


def test_mnist_loader_helper(mnist_cache):
    test = mnist_cache["test"]
    loader = test.loader(batch_size=1000)
    assert not loader.shuffle and len(loader) == 10
    x, y = next(iter(loader))
    np.testing.assert_allclose(x[:, 0], (test.images[:1000] / 255 - MNIST.mean) / MNIST.std,
                               atol=1e-5)
    np.testing.assert_array_equal(y, test.labels[:1000])
