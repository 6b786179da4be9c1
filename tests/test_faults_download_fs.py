"""Downloads against real file-system faults and endless bodies (beside test_faults_download.py).

* a read-only and a full file system: a fresh tmpfs mounted in a child process's private mount
  namespace (``unshare -m``, as root), gone when the child exits; skipped where that is not
  possible (test_faults_download.py simulates both with monkeypatched calls);
* a server whose body is larger than the file can be, announced or not: refused before reading,
  or as soon as the bound is passed, so an endless stream never fills the disk.

The data is the tiny dataset of tests/tiny_idx.py; servers run on 127.0.0.1 inside the test.
"""
import errno
import http.server
import os
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import urllib3.response

from cydnn import datasets
from cydnn.datasets import DatasetDownloadError

sys.path.insert(0, str(Path(__file__).parent))
import tiny_idx  # noqa: E402
from faultkit import UNSHARE_AVAILABLE, UNSHARE_REASON, run_on_tmpfs  # noqa: E402
from tiny_idx import IMAGES, Tiny  # noqa: E402

UNSHARE = pytest.mark.skipif(not UNSHARE_AVAILABLE, reason=UNSHARE_REASON)

CHILD = textwrap.dedent("""
    import os, sys
    from cydnn.datasets import DatasetCacheError
    from tiny_idx import Tiny
    root = sys.argv[1]
    try:
        Tiny(root, train=False, mirrors=[sys.argv[2]])
    except DatasetCacheError as e:
        folder = os.path.join(root, "tiny")
        print(f"errno={e.errno}", file=sys.stderr)
        print(e, file=sys.stderr)
        print("left:", sorted(os.listdir(folder)) if os.path.isdir(folder) else [], file=sys.stderr)
        sys.exit(3)
""")


def on_tmpfs(tmp_path, options):
    mirror = tiny_idx.write_mirror(tmp_path / "mirror")
    (tmp_path / "mnt").mkdir()
    return run_on_tmpfs(tmp_path / "mnt", options, CHILD, tmp_path / "mnt", mirror)


@UNSHARE
def test_read_only_file_system(tmp_path):
    out = on_tmpfs(tmp_path, "ro,size=1m")
    assert out.returncode == 3, out.stderr
    assert f"errno={errno.EROFS}" in out.stderr and "Read-only file system" in out.stderr
    assert "cannot write into the dataset cache folder" in out.stderr and "Traceback" not in out.stderr


@UNSHARE
def test_full_file_system(tmp_path):
    out = on_tmpfs(tmp_path, "size=64k")          # the images file needs 313,616 bytes
    assert out.returncode == 3, out.stderr
    assert f"errno={errno.ENOSPC}" in out.stderr and "No space left on device" in out.stderr
    assert "left: []" in out.stderr               # no temporary, nothing partial under the final name


class _Endless(http.server.BaseHTTPRequestHandler):
    """Serves gzip magic and then zeros: with a huge Content-Length, or with none and without end."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if self.server.announce:
            self.send_header("Content-Length", str(10**12))
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.server.sent += 2
            self.wfile.write(b"\x1f\x8b")
            while not self.server.stop.is_set():
                self.server.sent += 1 << 16          # counted before the write: a write blocked on a full
                self.wfile.write(bytes(1 << 16))     # socket is data the server still has to send
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "streamed"])
def test_a_body_larger_than_the_file_can_be_is_refused(tmp_path, monkeypatch, announce):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    # What the client took out of the connection. (What the server wrote is no measure: the
    # kernel's socket buffers on both ends hold up to tcp_rmem + tcp_wmem bytes, tens of MB.)
    taken, read1 = [0], urllib3.response.HTTPResponse.read1

    def counting_read1(self, *args, **kwargs):
        data = read1(self, *args, **kwargs)
        taken[0] += len(data)
        return data
    monkeypatch.setattr(urllib3.response.HTTPResponse, "read1", counting_read1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    server.daemon_threads, server.announce, server.stop, server.sent = True, announce, threading.Event(), 0
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        with pytest.raises(DatasetDownloadError) as info:
            Tiny(tmp_path, train=False, mirrors=[f"http://127.0.0.1:{server.server_port}/"])
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
    (_, reason), = info.value.failures
    bound = datasets.download._max_gz_size(Tiny.files[IMAGES])
    if announce:
        assert f"announces 1000000000000 bytes, more than the {bound} this file can have" in reason
    else:
        assert reason.startswith(f"more than {bound} bytes received")
        # It stopped reading at the first chunk that passed the bound.
        assert bound < taken[0] <= bound + datasets.download._CHUNK, (taken[0], bound)
        assert server.sent > taken[0]              # the server still had more to send
    assert os.listdir(tmp_path / "tiny") == []


def test_an_oversized_file_on_a_local_mirror_is_not_copied(tmp_path):
    big = tiny_idx.write_mirror(tmp_path / "mirror")
    (big / f"{IMAGES}.gz").write_bytes(b"\x1f\x8b" + bytes(datasets.download._max_gz_size(Tiny.files[IMAGES])))
    with pytest.raises(DatasetDownloadError, match="bytes, more than the .* this file can have"):
        Tiny(tmp_path / "cache", train=False, mirrors=[big])
