"""Downloads that go wrong: every fault answered by a clear reason, nothing partial ever accepted.

Each server runs in a thread on 127.0.0.1 (a free port) inside the test and is
shut down by it; nothing else is contacted.  The data is the tiny dataset of
tests/tiny_idx.py, so no test needs the real MNIST files.  Deadlines and
timeouts are set to a second or two (``datasets.TIMEOUT`` / ``DEADLINE``,
or $CYDNN_DOWNLOAD_TIMEOUT / $CYDNN_DOWNLOAD_DEADLINE in subprocesses).
"""
import contextlib
import errno
import http.server
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from cydnn import datasets
from cydnn.datasets import DatasetCacheError, DatasetDownloadError

sys.path.insert(0, str(Path(__file__).parent))
import tiny_idx  # noqa: E402
from faultkit import UNSHARE_AVAILABLE, UNSHARE_REASON, child_env, run_on_tmpfs  # noqa: E402
from tiny_idx import FILES, IMAGES, LABELS, Tiny  # noqa: E402


# --------------------------------------------------------------------------
# A loopback server whose every answer is a function of the handler
# --------------------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.server.requests.append(self.path)
        name = self.path.rsplit("/", 1)[-1].removesuffix(".gz")
        try:
            self.server.behaviour(self, name)
        except (BrokenPipeError, ConnectionResetError):
            pass                          # the client gave up, as it should
        self.close_connection = True

    def send_bytes(self, data, length=None, ctype="application/gzip"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def fault_server(behaviour):
    """Serve on 127.0.0.1 with ``behaviour(handler, file name)``; yields the server (``.url``, ``.stop``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.behaviour, server.requests, server.stop = behaviour, [], threading.Event()
    server.url = f"http://127.0.0.1:{server.server_port}/"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()                 # ends the handlers that sleep
        server.shutdown()
        server.server_close()
        thread.join(5)


def good(handler, name):
    handler.send_bytes(FILES[name][1])


def serving(overrides):
    """Serve the tiny files, with ``overrides`` (name -> bytes) served instead."""
    def behaviour(handler, name):
        handler.send_bytes(overrides.get(name, FILES[name][1]))
    return behaviour


@pytest.fixture
def quick(monkeypatch):
    """Short limits for this test: 1 s per read, 2 s per file."""
    monkeypatch.setattr(datasets, "TIMEOUT", 1.0)
    monkeypatch.setattr(datasets, "DEADLINE", 2.0)
    monkeypatch.delenv("CYDNN_DOWNLOAD_TIMEOUT", raising=False)
    monkeypatch.delenv("CYDNN_DOWNLOAD_DEADLINE", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def listing(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def assert_loaded(ds):
    np.testing.assert_array_equal(ds.images, tiny_idx.IMAGES_ARRAY)
    np.testing.assert_array_equal(ds.labels, tiny_idx.LABELS_ARRAY)


def single_failure(error_info):
    """The one (mirror, reason) of a DatasetDownloadError with one mirror."""
    (failure,) = error_info.value.failures
    return failure[1]


def fails_with(root, url, timeout=10, kept=()):
    """The reason the one mirror ``url`` failed; checks the time taken and that the cache folder
    holds only the files ``kept`` (verified earlier): no temporary, no lock, nothing partial."""
    start = time.monotonic()
    with pytest.raises(DatasetDownloadError) as info:
        Tiny(root, train=False, mirrors=[url])
    elapsed = time.monotonic() - start
    assert elapsed < timeout, f"took {elapsed:.1f} s"
    assert listing(root / "tiny") == sorted(kept)
    return single_failure(info)


# --------------------------------------------------------------------------
# HTTP faults
# --------------------------------------------------------------------------

def test_announces_more_bytes_than_it_sends(quick, tmp_path):
    def short(handler, name):
        data = FILES[name][1]
        handler.send_bytes(data, length=2 * len(data))       # then closes: half of what was promised
    with fault_server(short) as server:
        reason = fails_with(tmp_path, server.url)
    assert reason.startswith("truncated download"), reason


def test_stalls_after_a_few_bytes(quick, tmp_path):
    def stall(handler, name):
        data = FILES[name][1]
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data[:100])
        handler.wfile.flush()
        handler.server.stop.wait(60)
    with fault_server(stall) as server:
        reason = fails_with(tmp_path, server.url, timeout=5)
    assert reason.startswith("timed out: no data for 1 s after 100 bytes"), reason


def test_trickles_a_byte_at_a_time_hits_the_whole_file_deadline(quick, tmp_path):
    def trickle(handler, name):             # never silent for a whole second: only the deadline stops it
        data = FILES[name][1]
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for i in range(len(data)):
            handler.wfile.write(data[i:i + 1])
            handler.wfile.flush()
            if handler.server.stop.wait(0.25):
                return
    with fault_server(trickle) as server:
        reason = fails_with(tmp_path, server.url, timeout=5)
    assert reason.startswith("too slow:") and "whole-file deadline of 2 s" in reason, reason


def test_deadline_from_the_environment(monkeypatch):
    monkeypatch.setenv("CYDNN_DOWNLOAD_DEADLINE", "3.5")
    monkeypatch.setenv("CYDNN_DOWNLOAD_TIMEOUT", "0.5")
    assert datasets._limits() == (0.5, 3.5)
    monkeypatch.setenv("CYDNN_DOWNLOAD_DEADLINE", "-1")
    with pytest.raises(ValueError, match=r"\$CYDNN_DOWNLOAD_DEADLINE must be a positive number"):
        datasets._limits()


def test_http_200_with_an_html_error_page(quick, tmp_path):
    page = b"<!DOCTYPE html>\n<html><head><title>Access denied</title></head><body>" + b"x" * 5000 + b"</body></html>"
    with fault_server(lambda h, name: h.send_bytes(page, ctype="text/html; charset=utf-8")) as server:
        reason = fails_with(tmp_path, server.url)
    assert reason.startswith("an HTML page (an error or login page?)"), reason
    assert "<!DOCTYPE html>" in reason and "Content-Type text/html" in reason


def test_404_on_the_first_mirror_and_a_good_second(quick, tmp_path):
    with fault_server(lambda h, name: h.send_error(404)) as missing, fault_server(good) as ok:
        ds = Tiny(tmp_path, train=False, mirrors=[missing.url, ok.url])
        assert sorted(missing.requests) == sorted(f"/{n}.gz" for n in FILES)
    assert_loaded(ds)
    assert listing(tmp_path / "tiny") == sorted(FILES)


def test_redirect_loop(quick, tmp_path):
    def loop(handler, name):
        handler.send_response(302)
        handler.send_header("Location", handler.path)
        handler.send_header("Connection", "close")
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    with fault_server(loop) as server:
        reason = fails_with(tmp_path, server.url)
        assert len(server.requests) <= datasets.MAX_REDIRECTS + 1
    assert reason.startswith(f"redirect loop: more than {datasets.MAX_REDIRECTS} redirects"), reason


def gzip_bomb(prefix, inflated_mib):
    """A gzip stream that inflates to ``prefix`` + ``inflated_mib`` MiB of zeros, built in a few ms.

    After a full flush, deflate's output for the same input is the same bytes:
    one compressed MiB of zeros, repeated.  No trailer: a reader must stop early.
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    mib = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x02\xff" + head + mib * inflated_mib


def test_gzip_bomb_is_refused_past_the_known_size(quick, tmp_path):
    bomb = gzip_bomb(FILES[IMAGES][0], 256)       # a valid IDX file, then 256 MiB of zeros
    assert len(bomb) < datasets._max_gz_size(Tiny.files[IMAGES])
    tracemalloc.start()
    try:
        with fault_server(serving({IMAGES: bomb})) as server:
            reason = fails_with(tmp_path, server.url)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert reason.startswith("decompressed data is larger than the expected 313616 bytes"), reason
    assert peak < 16 << 20                        # a few chunks, never the inflated size


def test_a_body_larger_than_any_valid_file_is_refused(quick, tmp_path):
    def huge(handler, name):                      # announces 10 GB: refused before reading
        handler.send_bytes(b"\x1f\x8b" + bytes(100), length=10 ** 10)
    with fault_server(huge) as server:
        reason = fails_with(tmp_path, server.url)
    assert reason.startswith("the server announces 10000000000 bytes, more than the"), reason

    def unannounced(handler, name):               # no length: stopped once past the bound
        handler.send_response(200)
        handler.end_headers()
        for _ in range(64):
            handler.wfile.write(b"\x1f\x8b" + bytes(1 << 16))
    with fault_server(unannounced) as server:
        reason = fails_with(tmp_path, server.url)
    assert reason.startswith("more than") and "bytes received" in reason, reason


def test_valid_gzip_whose_idx_header_declares_absurd_dimensions(quick, tmp_path):
    absurd = b"\x00\x00\x08\x03" + struct.pack(">3I", 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF) + bytes(1000)
    import gzip
    with fault_server(serving({IMAGES: gzip.compress(absurd)})) as server:
        reason = fails_with(tmp_path, server.url)
    assert reason.startswith("the IDX header declares dimensions (4294967295, 4294967295, 4294967295)"), reason
    assert "refused before reading it" in reason

    # The same file given to read_idx directly: refused from the header and the size, nothing allocated.
    path = tmp_path / "absurd-idx3-ubyte"
    path.write_bytes(absurd)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"dimensions \(4294967295, 4294967295, 4294967295\) need "
                                             r"79228162458924105385300197375 data bytes.*but 1000 follow"):
            datasets.read_idx(path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_right_size_wrong_sha256(quick, tmp_path):
    import gzip
    raw = bytearray(FILES[LABELS][0])
    raw[-1] = (raw[-1] + 1) % 10                  # still a valid IDX file of the right size
    with fault_server(serving({LABELS: gzip.compress(bytes(raw), mtime=0)})) as server:
        reason = fails_with(tmp_path, server.url, kept=[IMAGES])
    assert reason.startswith("checksum mismatch: decompressed SHA-256"), reason
    assert Tiny.files[LABELS].idx_sha256 in reason


def test_local_mirror_with_an_html_file(tmp_path):
    mirror = tiny_idx.write_mirror(tmp_path / "mirror", {IMAGES: b"<html><body>404 Not Found</body></html>"})
    with pytest.raises(DatasetDownloadError) as info:
        Tiny(tmp_path / "cache", train=False, mirrors=[mirror])
    assert single_failure(info).startswith("an HTML page")
    assert listing(tmp_path / "cache" / "tiny") == []      # the images come first: nothing was installed


# --------------------------------------------------------------------------
# Processes: two filling one cache; one killed midway
# --------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import hashlib, sys
    from tiny_idx import Tiny
    ds = Tiny(sys.argv[1], train=False, mirrors=sys.argv[2:])
    print(hashlib.sha256(ds.images.tobytes() + ds.labels.tobytes()).hexdigest(), flush=True)
""")


def child(root, *mirrors, **kw):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), *mirrors], env=child_env(**kw),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def slow(handler, name):
    """The real file, in 8 pieces 0.1 s apart: downloads that overlap."""
    data = FILES[name][1]
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    step = -(-len(data) // 8)
    for i in range(0, len(data), step):
        handler.wfile.write(data[i:i + step])
        handler.wfile.flush()
        if handler.server.stop.wait(0.1):
            return


def test_two_processes_fill_one_cache(tmp_path):
    import hashlib
    expected = hashlib.sha256(tiny_idx.IMAGES_ARRAY.tobytes() + tiny_idx.LABELS_ARRAY.astype(np.int32).tobytes())
    with fault_server(slow) as server:
        procs = [child(tmp_path, server.url) for _ in range(2)]
        outs = [p.communicate(timeout=60) for p in procs]
        requests = list(server.requests)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip() == expected.hexdigest()          # each loaded the verified data
    assert listing(tmp_path / "tiny") == sorted(FILES)       # final files only: no temporary, no lock
    # The lock made the second process wait and reuse the first one's files: one request per file.
    assert sorted(requests) == sorted(f"/{n}.gz" for n in FILES), requests


def test_download_killed_midway_leaves_nothing_the_next_run_accepts(quick, tmp_path):
    def half_then_stall(handler, name):
        data = FILES[name][1]
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data[: len(data) // 2])
        handler.wfile.flush()
        handler.server.stop.wait(60)
    folder = tmp_path / "tiny"
    with fault_server(half_then_stall) as server:
        proc = child(tmp_path, server.url, CYDNN_DOWNLOAD_TIMEOUT="60", CYDNN_DOWNLOAD_DEADLINE="60")
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:    # wait until half a .gz sits in a temporary file
                parts = [p for p in folder.glob(".*.part") if p.stat().st_size > 0] if folder.is_dir() else []
                if parts:
                    break
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.05)
            assert parts, "the child never started writing"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    left = listing(folder)
    assert any(name.endswith(".part") for name in left) and IMAGES not in left and LABELS not in left

    # The leftover is never taken for the file ...
    with pytest.raises(FileNotFoundError, match="download=True"):
        Tiny(tmp_path, train=False, download=False)
    # ... and the next download removes it and installs a verified file.
    with fault_server(good) as server:
        assert_loaded(Tiny(tmp_path, train=False, mirrors=[server.url]))
    assert listing(folder) == sorted(FILES)


# --------------------------------------------------------------------------
# The cache folder: read-only, full
# --------------------------------------------------------------------------

def test_unwritable_cache_is_a_cache_error_not_a_mirror_failure(tmp_path, monkeypatch):
    """Simulated EACCES (root ignores permission bits, so chmod cannot show it here)."""
    mirror = tiny_idx.write_mirror(tmp_path / "mirror")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(datasets.tempfile, "mkstemp", refuse)
    with pytest.raises(DatasetCacheError) as info:
        Tiny(tmp_path / "cache", train=False, mirrors=[mirror, mirror])
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.EACCES
    assert str(e).startswith("cannot use the dataset cache: creating a temporary file in")
    assert "no permission: choose a writable folder" in str(e) and "$CYDNN_DATA" in str(e)
    assert listing(tmp_path / "cache" / "tiny") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; see the EROFS test")
def test_read_only_cache_folder_with_permissions(tmp_path):
    mirror = tiny_idx.write_mirror(tmp_path / "mirror")
    (tmp_path / "cache" / "tiny").mkdir(parents=True)
    os.chmod(tmp_path / "cache" / "tiny", 0o555)
    try:
        with pytest.raises(DatasetCacheError, match="no permission"):
            Tiny(tmp_path / "cache", train=False, mirrors=[mirror])
    finally:
        os.chmod(tmp_path / "cache" / "tiny", 0o755)


def test_full_disk_simulated(tmp_path, monkeypatch):
    """ENOSPC from write() after 1000 bytes of any cache file: a cache error, temporaries removed."""
    mirror = tiny_idx.write_mirror(tmp_path / "mirror")

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            if self.n + len(data) > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.n += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if "w" in mode and str(path).endswith(".part") else f
    monkeypatch.setattr(datasets, "open", full_open, raising=False)
    with pytest.raises(DatasetCacheError) as info:
        Tiny(tmp_path / "cache", train=False, mirrors=[mirror])
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value) and "free some space" in str(info.value)
    assert listing(tmp_path / "cache" / "tiny") == []


UNSHARE = pytest.mark.skipif(not UNSHARE_AVAILABLE, reason=UNSHARE_REASON)

MOUNTED_CHILD = textwrap.dedent("""
    import errno, os, sys
    from cydnn.datasets import DatasetCacheError
    from tiny_idx import Tiny
    try:
        Tiny(sys.argv[1], train=False, mirrors=[sys.argv[2]])
    except DatasetCacheError as e:
        print(f"errno={e.errno}", file=sys.stderr)
        print(e, file=sys.stderr)
        print("left:", sorted(os.listdir(os.path.join(sys.argv[1], "tiny")))
              if os.path.isdir(os.path.join(sys.argv[1], "tiny")) else "left: []", file=sys.stderr)
        sys.exit(3)
""")


def tmpfs_child(tmp_path, options):
    """MOUNTED_CHILD with its cache on a fresh tmpfs mounted with ``options``."""
    mirror = tiny_idx.write_mirror(tmp_path / "mirror")
    (tmp_path / "mnt").mkdir()
    return run_on_tmpfs(tmp_path / "mnt", options, MOUNTED_CHILD, tmp_path / "mnt", mirror)


@UNSHARE
def test_read_only_file_system(tmp_path):
    out = tmpfs_child(tmp_path, "ro,size=1m")
    assert out.returncode == 3, out.stderr
    assert f"errno={errno.EROFS}" in out.stderr
    assert "cannot use the dataset cache: creating the folder" in out.stderr
    assert "Read-only file system" in out.stderr and "choose a writable folder" in out.stderr


@UNSHARE
def test_full_file_system_on_a_tiny_tmpfs(tmp_path):
    out = tmpfs_child(tmp_path, "size=64k")       # the images file needs 313,620 bytes
    assert out.returncode == 3, out.stderr
    assert f"errno={errno.ENOSPC}" in out.stderr and "No space left on device" in out.stderr
    assert "left: []" in out.stderr                 # no temporary, no lock, nothing partial
