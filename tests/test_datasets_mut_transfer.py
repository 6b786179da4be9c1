"""Mutation-driven tests of cydnn.datasets.transfer: the progress bar, the time guard, the HTTP
download, the local copy, the hashes and gunzip, each called directly.

No network and no wall-clock waits: the HTTP layer is a fake ``requests.get`` (its response
hands out the bytes and the exceptions a test lists), time is a counted clock, files are built
byte by byte, and reads go through a proxy that records their sizes.  Real tqdm bars are drawn
into a fake terminal with their own lock (a lock inherited across mutmut's fork can be held).
"""
import errno
import gzip
import hashlib
import io
import os
import sys
import threading

import pytest
import requests
import urllib3
from requests.structures import CaseInsensitiveDict

from cydnn import datasets
from cydnn.datasets import DatasetCacheError, transfer
from cydnn.datasets.errors import _MirrorFailed

URL = "http://127.0.0.1:9/d/sub/f.gz"        # never contacted: requests.get is a fake here
BUILTIN_OPEN = open


@pytest.fixture(autouse=True)
def own_tqdm_lock(monkeypatch):
    monkeypatch.setattr(transfer.tqdm, "_lock", threading.RLock(), raising=False)
    monkeypatch.setattr(transfer.tqdm, "monitor_interval", 0)


@pytest.fixture(autouse=True)
def limits(monkeypatch):
    monkeypatch.setattr(datasets, "TIMEOUT", 30)
    monkeypatch.setattr(datasets, "DOWNLOAD_DEADLINE", 600)
    monkeypatch.setattr(datasets, "MIN_DOWNLOAD_RATE", 1024)
    monkeypatch.setattr(datasets, "MIN_RATE_SECONDS", 30)


class Context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Bar(Context):
    """Stands for ``_progress``: records its arguments and what the bar was told."""

    def __init__(self, log, total, desc):
        self.updates = []
        log.append((total, desc, self.updates))

    def update(self, n):
        self.updates.append(n + 0)          # a number, not None


@pytest.fixture
def bars(monkeypatch):
    log = []
    monkeypatch.setattr(transfer, "_progress", lambda total, desc: Bar(log, total, desc))
    return log


class Raw:
    def __init__(self, items):
        self.items, self.amounts = list(items), []

    def read1(self, amt=-1):
        self.amounts.append(amt)
        item = self.items.pop(0) if self.items else b""
        if isinstance(item, BaseException):
            raise item
        return item


class Response(Context):
    def __init__(self, items, headers=None, status=200, reason="OK"):
        self.status_code, self.reason = status, reason
        self.headers = CaseInsensitiveDict(headers or {})
        self.raw = Raw(items)


def serve(monkeypatch, *items, headers=None, raises=None, **kw):
    response = Response(items, headers, **kw)

    def get(url, **kwargs):
        assert url == URL and kwargs == {"stream": True, "timeout": (30, 30)}
        if raises is not None:
            raise raises
        return response
    monkeypatch.setattr(transfer.requests, "get", get)
    return response


def download(tmp_path, max_bytes=None):
    transfer._download_http(URL, tmp_path / "out", max_bytes=max_bytes)
    return (tmp_path / "out").read_bytes()


def failure(fn, *args, **kwargs):
    with pytest.raises(_MirrorFailed) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------ the progress bar
class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_bar_counts_bytes_in_binary_units_and_leaves_nothing(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    with transfer._progress(20480, "f.gz") as bar:
        bar.update(10240)
        bar.refresh()
    out = sys.stderr.getvalue()
    assert "f.gz: " in out and " 50%" in out
    assert "10.0k/20.0k" in out                  # 1024-byte units, scaled, out of the total
    assert "B/s]" in out                         # the unit is the byte
    assert "\n" not in out                       # drawn with \r and cleared when done (leave=False)


def test_the_bar_is_hidden_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with transfer._progress(20480, "f.gz") as bar:
        bar.update(10240)
        bar.refresh()
    assert sys.stderr.getvalue() == ""


# ------------------------------------------------------------------ the time guard
class Clock:
    def __init__(self, step=0.0):
        self.now, self.step = 1000.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def guard(monkeypatch, total=None, rate=100, seconds=10, deadline=600):
    clock = Clock()
    monkeypatch.setattr(transfer, "_clock", clock)
    monkeypatch.setattr(datasets, "DOWNLOAD_DEADLINE", deadline)
    monkeypatch.setattr(datasets, "MIN_DOWNLOAD_RATE", rate)
    monkeypatch.setattr(datasets, "MIN_RATE_SECONDS", seconds)
    return clock, transfer._TimeGuard("http://m/f.gz", total)


def test_an_unknown_total_is_reported_as_a_question_mark(monkeypatch):
    clock, g = guard(monkeypatch, total=None, rate=0, deadline=5)
    clock.now += 6
    assert failure(g.check, 10) == ("download deadline of 5 s passed after 10 of ? bytes in 6.0 s from "
                                    "http://m/f.gz (server too slow; see DOWNLOAD_DEADLINE)")


def test_the_rate_is_checked_from_exactly_one_window(monkeypatch):
    clock, g = guard(monkeypatch, rate=100, seconds=10)
    clock.now += 10                              # exactly one window, nothing received
    assert failure(g.check, 0).startswith("download slower than 100 bytes/s for 10 s (0 bytes in the "
                                          "last 10.0 s) after 0 of ? bytes in 10.0 s")


def test_a_rate_of_one_byte_a_second_is_enforced(monkeypatch):
    clock, g = guard(monkeypatch, rate=1, seconds=10)
    clock.now += 10
    g.check(10)                                  # 10 bytes in 10 s: enough
    clock.now += 10
    assert "download slower than 1 bytes/s for 10 s (9 bytes" in failure(g.check, 19)


def test_a_rate_of_zero_is_off_and_keeps_no_samples(monkeypatch):
    clock, g = guard(monkeypatch, rate=0, seconds=10)
    for _ in range(5):
        clock.now += 100
        g.check(0)
    assert g.samples == [(1000.0, 0)]


def test_a_window_of_zero_seconds_never_stops_a_download(monkeypatch):
    clock, g = guard(monkeypatch, rate=100, seconds=0)
    for received in (0, 0, 5, 5):
        clock.now += 1
        g.check(received)
    assert g.samples == [(1004.0, 5)]


# ------------------------------------------------------------------ HTTP
def test_the_body_is_read_in_chunks_and_counted(monkeypatch, tmp_path, bars):
    response = serve(monkeypatch, b"abc", b"defg", headers={"Content-Length": "7"})
    assert download(tmp_path) == b"abcdefg"
    assert bars == [(7, "f.gz", [3, 4])]         # the total and the file's name, every byte counted
    assert response.raw.amounts == [transfer._CHUNK] * 3


def test_without_a_length_the_total_is_unknown(monkeypatch, tmp_path, bars):
    serve(monkeypatch, b"abc", headers={"Content-Type": "application/gzip"})
    assert download(tmp_path) == b"abc"
    assert bars == [(None, "f.gz", [3])]


@pytest.mark.parametrize("ctype", ["text/html; charset=utf-8", " Application/XHTML+XML ", "TEXT/HTML"])
def test_an_html_page_is_refused_whatever_its_parameters_and_case(monkeypatch, tmp_path, ctype):
    serve(monkeypatch, b"\x1f\x8b", headers={"Content-Type": ctype})
    assert failure(download, tmp_path) == (f"{URL} answered an HTML page (Content-Type {ctype!r}), not the "
                                           f"file: probably an error or login page")


def test_the_deadline_message_names_the_url(monkeypatch, tmp_path):
    monkeypatch.setattr(transfer, "_clock", Clock(step=1000))
    serve(monkeypatch, b"abc", headers={"Content-Length": "3"})
    assert failure(download, tmp_path) == (f"download deadline of 600 s passed after 0 of 3 bytes in 1000.0 s "
                                           f"from {URL} (server too slow; see DOWNLOAD_DEADLINE)")


def test_a_short_body_the_http_layer_missed_is_truncated(monkeypatch, tmp_path, bars):
    serve(monkeypatch, b"abcde", headers={"Content-Length": "10"})
    assert failure(download, tmp_path) == f"truncated download: got 5 of 10 bytes from {URL}"


@pytest.mark.parametrize("length, total", [("10", "10"), (None, "?")])
def test_a_connection_closed_midway(monkeypatch, tmp_path, length, total):
    serve(monkeypatch, b"abcde", urllib3.exceptions.ProtocolError("closed"),
          headers={"Content-Length": length} if length else {})
    assert failure(download, tmp_path) == (f"truncated download: the connection closed after 5 of {total} "
                                           f"bytes from {URL} (closed)")


@pytest.mark.parametrize("error, message", [
    (requests.TooManyRedirects("Exceeded 30 redirects."),
     f"too many redirects (a redirect loop?) for {URL} (Exceeded 30 redirects.)"),
    (requests.ConnectionError("refused"), "connection failed (refused)"),
    (requests.exceptions.InvalidURL("bad"), "request failed (InvalidURL: bad)"),
], ids=["redirects", "connection", "request"])
def test_request_errors_each_have_their_message(monkeypatch, tmp_path, error, message):
    serve(monkeypatch, raises=error)
    assert failure(download, tmp_path) == message


def test_an_urllib3_error_while_reading(monkeypatch, tmp_path):
    serve(monkeypatch, b"abc", urllib3.exceptions.DecodeError("garbled"))
    assert failure(download, tmp_path) == f"download failed after 3 bytes from {URL} (DecodeError: garbled)"


# ------------------------------------------------------------------ reads, recorded
class Recorded:
    """A file whose reads are recorded (``grow``: bytes appended to it at the first read)."""

    def __init__(self, f, log, grow=None):
        self.f, self.log, self.grow = f, log, grow

    def read(self, n=-1):
        if self.grow is not None:
            with BUILTIN_OPEN(self.f.name, "ab") as g:
                g.write(self.grow)
            self.grow = None
        self.log.append(n)
        return self.f.read(n)

    def write(self, data):
        return self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def record_opens(monkeypatch, grow=None, full=False):
    """``transfer.open`` replaced: reads recorded, writes refused with ENOSPC when ``full``."""
    log = []

    class Full(Recorded):
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fake_open(file, mode="r", *args, **kwargs):
        f = BUILTIN_OPEN(file, mode, *args, **kwargs)
        return (Full if full and "w" in mode else Recorded)(f, log, grow if "r" in mode else None)
    monkeypatch.setattr(transfer, "open", fake_open, raising=False)
    return log


@pytest.mark.parametrize("fn, algo", [(transfer._sha256_file, hashlib.sha256), (transfer._md5_file, hashlib.md5)])
def test_hashes_read_in_bounded_chunks(monkeypatch, tmp_path, fn, algo):
    data = bytes(range(256)) * 10
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(transfer, "_CHUNK", 1000)
    log = record_opens(monkeypatch)
    assert fn(tmp_path / "f") == algo(data).hexdigest()
    assert log == [1000] * 4                     # three chunks and the empty read that ends


def test_md5_is_asked_for_as_not_a_security_use(monkeypatch, tmp_path):
    """On a FIPS build, hashlib.md5() is refused unless ``usedforsecurity=False`` (a checksum)."""
    def fips_md5(*args, usedforsecurity=True):
        if usedforsecurity:
            raise ValueError("[digital envelope routines] unsupported")
        return hashlib.md5(*args, usedforsecurity=False)
    monkeypatch.setattr(transfer, "hashlib", type(sys)("fips_hashlib"))
    transfer.hashlib.md5 = fips_md5
    (tmp_path / "f").write_bytes(b"abc")
    assert transfer._md5_file(tmp_path / "f") == "900150983cd24fb0d6963f7d28e17f72"


def test_a_local_copy_reads_in_chunks_and_counts(monkeypatch, tmp_path, bars):
    data = bytes(range(256)) * 10
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "f.gz").write_bytes(data)
    monkeypatch.setattr(transfer, "_CHUNK", 1000)
    log = record_opens(monkeypatch)
    transfer._copy_local(str(tmp_path / "m" / "f.gz"), tmp_path / "out", max_bytes=len(data))
    assert (tmp_path / "out").read_bytes() == data
    assert log == [1000] * 4
    assert bars == [(2560, "f.gz", [1000, 1000, 560])]


def test_a_local_file_that_grows_while_copied_is_refused(monkeypatch, tmp_path):
    (tmp_path / "f").write_bytes(bytes(10))
    monkeypatch.setattr(transfer, "_CHUNK", 4)
    record_opens(monkeypatch, grow=bytes(10))
    assert failure(transfer._copy_local, str(tmp_path / "f"), tmp_path / "out", 10) == \
        f"{tmp_path / 'f'} grew past 10 bytes while being copied"


def test_a_local_path_that_cannot_be_read(tmp_path):
    path = str(tmp_path)                         # a folder: its size is known, opening it fails
    assert failure(transfer._copy_local, path, tmp_path / "out") == \
        f"cannot read {path} ([Errno {errno.EISDIR}] Is a directory: {path!r})"


# ------------------------------------------------------------------ gunzip
def idx(n):
    return b"\x00\x00\x08\x01" + n.to_bytes(4, "big") + bytes((7 * i) % 256 for i in range(n))


def gunzip(tmp_path, data, max_size=10**6):
    (tmp_path / "f.gz").write_bytes(data)
    return transfer._gunzip(tmp_path / "f.gz", tmp_path / "f", max_size)


def test_gunzip_of_many_chunks_checks_the_header_once(monkeypatch, tmp_path):
    raw = idx(300)
    monkeypatch.setattr(transfer, "_CHUNK", 64)
    assert gunzip(tmp_path, gzip.compress(raw), max_size=len(raw)) == hashlib.sha256(raw).hexdigest()
    assert (tmp_path / "f").read_bytes() == raw


def test_gunzip_reads_in_chunks(monkeypatch, tmp_path):
    log, real = [], gzip.open
    monkeypatch.setattr(transfer.gzip, "open", lambda *a, **k: Recorded(real(*a, **k), log))
    monkeypatch.setattr(transfer, "_CHUNK", 64)
    gunzip(tmp_path, gzip.compress(idx(100)))
    assert log == [64, 64, 64]                   # 108 bytes: two chunks and the empty read


def test_gunzip_refuses_more_than_the_expected_size_counted_over_chunks(monkeypatch, tmp_path):
    monkeypatch.setattr(transfer, "_CHUNK", 64)
    assert failure(gunzip, tmp_path, gzip.compress(idx(300)), max_size=200) == (
        "decompressed data is larger than the expected 200 bytes: refusing it (a gzip bomb or the wrong file)")


def test_gunzip_names_the_decompressed_data_in_header_errors(tmp_path):
    assert failure(gunzip, tmp_path, gzip.compress(b"\x00\x00\x09\x01" + bytes(20))) == (
        "decompressed data: not an unsigned-byte IDX file of rank 1 or 3 (it starts with b'\\x00\\x00\\t\\x01')")


def test_not_a_gzip_file_shows_its_first_16_bytes(tmp_path):
    data = b"PK\x03\x04" + bytes(range(1, 30))
    assert failure(gunzip, tmp_path, data) == f"not a gzip file (it starts with {data[:16]!r})"


def test_an_html_page_is_recognised_after_leading_whitespace(tmp_path):
    page = b" \r\n\t<!DOCTYPE html><html><head><title>Error 503: unavailable</title></head></html>"
    assert failure(gunzip, tmp_path, page) == (f"not a gzip file but an HTML/XML page (it starts with "
                                               f"{page[:40]!r}): probably an error page served with HTTP 200")


@pytest.mark.parametrize("spaces", [64, 70])
def test_only_the_first_64_bytes_are_looked_at(tmp_path, spaces):
    data = b" " * spaces + b"<html></html>"
    assert failure(gunzip, tmp_path, data) == f"not a gzip file (it starts with {data[:16]!r})"


def test_a_truncated_and_a_corrupt_gzip(tmp_path):
    good = gzip.compress(idx(100))
    assert failure(gunzip, tmp_path, good[:-12]) == \
        "truncated gzip: the compressed stream ends before its end marker"
    bad_crc = good[:-8] + bytes(b ^ 0xFF for b in good[-8:-4]) + good[-4:]
    assert failure(gunzip, tmp_path, bad_crc).startswith("corrupt gzip (CRC check failed ")


@pytest.mark.parametrize("step", ["copy", "gunzip"])
def test_a_full_cache_is_a_cache_error(monkeypatch, tmp_path, step):
    (tmp_path / "c").mkdir()
    (tmp_path / "f.gz").write_bytes(gzip.compress(idx(100)))
    record_opens(monkeypatch, full=True)
    with pytest.raises(DatasetCacheError) as info:
        if step == "copy":
            transfer._copy_local(str(tmp_path / "f.gz"), tmp_path / "c" / "f.part")
        else:
            transfer._gunzip(tmp_path / "f.gz", tmp_path / "c" / "f.part", 10**6)
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror == (f"cannot write into the dataset cache folder {str(tmp_path / 'c')!r}: "
                                   f"No space left on device (while writing f.part)")
