"""Moving bytes into the cache: an HTTP download bounded in size, time and rate, a copy from a
local mirror, and gunzip with the IDX header checked first.  Every function here writes into a
file its caller created (a temporary) and raises ``_MirrorFailed`` saying why when the bytes
cannot be had, or ``DatasetCacheError`` when the cache cannot be written."""

import gzip
import hashlib
import os
import sys
import time
import zlib

import requests
import urllib3
from tqdm import tqdm

from .errors import DatasetCacheError, _MirrorFailed
from .idx import _check_idx_header

_CHUNK = 1 << 20  # bytes read or written at a time (1 MiB)

#: The clock every time limit reads (tests replace it to make time a counted quantity).
_clock = time.monotonic


def _limits():
    """The package, whose tunable limits (``cydnn.datasets.TIMEOUT``, ...) are read at call time,
    so that assigning to them takes effect."""
    return sys.modules[__package__]


def _progress(total, desc):
    # disable=None hides the bar when stderr is not a terminal (logs, CI, pytest).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


class _TimeGuard:
    """The time limits of one download, checked after every read (like curl's ``--max-time``,
    ``--speed-limit`` and ``--speed-time``):

    - ``deadline`` seconds for the whole file (``DOWNLOAD_DEADLINE``);
    - a minimum rate: once ``rate_seconds`` (``MIN_RATE_SECONDS``) have passed, the bytes received
      in the last ``rate_seconds`` must be at least ``min_rate * rate_seconds``
      (``MIN_DOWNLOAD_RATE`` bytes/s; 0 turns the check off).

    The window's start is the last sample taken at or before ``now - rate_seconds``, so the count
    can only overestimate what arrived in the window: a fast download is never stopped.
    """

    def __init__(self, url, total):
        limits = _limits()
        self.url, self.total = url, total
        self.deadline = float(limits.DOWNLOAD_DEADLINE)
        self.min_rate, self.rate_seconds = float(limits.MIN_DOWNLOAD_RATE), float(limits.MIN_RATE_SECONDS)
        self.start = _clock()
        self.samples = [(self.start, 0)]   # (time, bytes received by then), oldest first

    def _where(self, received, now):
        total = self.total if self.total is not None else "?"
        return f"after {received} of {total} bytes in {now - self.start:.1f} s from {self.url}"

    def check(self, received):
        now = _clock()
        if now - self.start > self.deadline:
            raise _MirrorFailed(f"download deadline of {self.deadline:g} s passed {self._where(received, now)} "
                                f"(server too slow; see DOWNLOAD_DEADLINE)")
        if self.min_rate <= 0:
            return
        self.samples.append((now, received))
        boundary = now - self.rate_seconds
        if boundary < self.start:
            return
        while len(self.samples) > 1 and self.samples[1][0] <= boundary:
            del self.samples[0]
        got = received - self.samples[0][1]
        if got < self.min_rate * self.rate_seconds:
            raise _MirrorFailed(
                f"download slower than {self.min_rate:g} bytes/s for {self.rate_seconds:g} s "
                f"({got} bytes in the last {now - self.samples[0][0]:.1f} s) {self._where(received, now)} "
                f"(see MIN_DOWNLOAD_RATE and MIN_RATE_SECONDS)")


def _download_http(url, dest, max_bytes=None):
    """Stream ``url`` into the file ``dest``; raise _MirrorFailed saying why on any failure.

    Time: TIMEOUT bounds each wait for the next bytes; :class:`_TimeGuard` bounds the whole
    file and its rate, checked after each read, so a download stops at most TIMEOUT seconds
    after a limit passes.  ``max_bytes`` bounds the body: a larger announced length is refused
    before reading, a longer stream as soon as it passes the bound (a server that streams
    without end never fills the disk).
    """
    limits = _limits()
    timeout = min(limits.TIMEOUT, limits.DOWNLOAD_DEADLINE)
    received, total = 0, None
    try:
        with requests.get(url, stream=True, timeout=(timeout, timeout)) as response:
            if response.status_code != 200:
                raise _MirrorFailed(f"HTTP {response.status_code} {response.reason} for {url}")
            ctype = response.headers.get("Content-Type", "")
            if ctype.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
                raise _MirrorFailed(f"{url} answered an HTML page (Content-Type {ctype!r}), "
                                    f"not the file: probably an error or login page")
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            if max_bytes is not None and total is not None and total > max_bytes:
                raise _MirrorFailed(f"{url} announces {total} bytes, more than the {max_bytes} this file "
                                    f"can have; not downloading it")
            guard = _TimeGuard(url, total)
            raw = response.raw
            with open(dest, "wb") as out, _progress(total, url.rsplit("/", 1)[-1]) as bar:
                while True:
                    guard.check(received)
                    chunk = raw.read1(_CHUNK)       # returns as soon as some bytes came
                    if not chunk:
                        break
                    if max_bytes is not None and received + len(chunk) > max_bytes:
                        raise _MirrorFailed(f"more than {max_bytes} bytes received from {url}, more than "
                                            f"this file can have; stopped")
                    try:
                        out.write(chunk)
                    except OSError as e:
                        raise DatasetCacheError(dest, e) from None
                    received += len(chunk)
                    bar.update(len(chunk))
    except _MirrorFailed:
        raise
    except (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError) as e:
        # What is raised when the connection closes before the announced length.
        raise _MirrorFailed(f"truncated download: the connection closed after {received} "
                            f"of {total if total is not None else '?'} bytes from {url} ({e})") from None
    except (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError) as e:
        raise _MirrorFailed(f"timed out: no data for {timeout} s after {received} bytes "
                            f"from {url} ({e})") from None
    except requests.TooManyRedirects as e:
        raise _MirrorFailed(f"too many redirects (a redirect loop?) for {url} ({e})") from None
    except requests.ConnectionError as e:
        raise _MirrorFailed(f"connection failed ({e})") from None
    except requests.RequestException as e:
        raise _MirrorFailed(f"request failed ({type(e).__name__}: {e})") from None
    except urllib3.exceptions.HTTPError as e:
        raise _MirrorFailed(f"download failed after {received} bytes from {url} "
                            f"({type(e).__name__}: {e})") from None
    if total is not None and received != total:  # in case the HTTP layer did not notice
        raise _MirrorFailed(f"truncated download: got {received} of {total} bytes from {url}")


def _copy_local(path, dest, max_bytes=None):
    """Copy a file from a local mirror into ``dest``; raise _MirrorFailed if that is not possible."""
    try:
        size = os.path.getsize(path)
        if max_bytes is not None and size > max_bytes:
            raise _MirrorFailed(f"{path} has {size} bytes, more than the {max_bytes} this file can have")
        with open(path, "rb") as src, open(dest, "wb") as out, _progress(size, os.path.basename(path)) as bar:
            copied = 0
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                copied += len(chunk)
                if max_bytes is not None and copied > max_bytes:   # it grew while we copied
                    raise _MirrorFailed(f"{path} grew past {max_bytes} bytes while being copied")
                try:
                    out.write(chunk)
                except OSError as e:
                    raise DatasetCacheError(dest, e) from None
                bar.update(len(chunk))
    except (DatasetCacheError, _MirrorFailed):
        raise
    except FileNotFoundError:
        raise _MirrorFailed(f"file not found: {path}") from None
    except OSError as e:
        raise _MirrorFailed(f"cannot read {path} ({e})") from None


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _md5_file(path):
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_not_html(head):
    if head.lstrip()[:1] == b"<":
        raise _MirrorFailed(f"not a gzip file but an HTML/XML page (it starts with {head[:40]!r}): "
                            f"probably an error page served with HTTP 200")


def _gunzip(src, dest, max_size):
    """Decompress ``src`` into ``dest`` and return the SHA-256 of what was written.

    Stops with _MirrorFailed if the gzip stream is invalid or truncated, its IDX header is
    not valid, or it grows past ``max_size`` bytes (the known size of the file: no need to
    write a larger one to learn that it is wrong).
    """
    digest = hashlib.sha256()
    written = 0
    with open(src, "rb") as f:
        head = f.read(64)
    if head[:2] != b"\x1f\x8b":
        _check_not_html(head)
        raise _MirrorFailed(f"not a gzip file (it starts with {head[:16]!r})")
    try:
        with gzip.open(src, "rb") as f, open(dest, "wb") as out:
            first = True
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                if first:
                    first = False
                    try:
                        _check_idx_header(chunk[:16], "decompressed data")
                    except ValueError as e:
                        raise _MirrorFailed(str(e)) from None
                written += len(chunk)
                if written > max_size:
                    raise _MirrorFailed(
                        f"decompressed data is larger than the expected {max_size} bytes: "
                        f"refusing it (a gzip bomb or the wrong file)")
                digest.update(chunk)
                try:
                    out.write(chunk)
                except OSError as e:
                    raise DatasetCacheError(dest, e) from None
    except EOFError:
        raise _MirrorFailed("truncated gzip: the compressed stream ends before its end marker") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise _MirrorFailed(f"corrupt gzip ({e})") from None
    return digest.hexdigest()
