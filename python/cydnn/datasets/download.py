"""Download and cache: a missing file is fetched as ``<mirror>/<name>.gz`` from each mirror in
turn until one gives bytes that pass verification; the cache keeps the decompressed IDX file,
which gets its final name only once verified (see docs/reliability.md)."""

import gzip
import hashlib
import os
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import requests
import urllib3
from tqdm import tqdm

from .idx import _check_idx_header


_CHUNK = 1 << 20  # bytes read or written at a time (1 MiB)


def _limits():
    """The package, whose tunable limits (``cydnn.datasets.TIMEOUT``, ...) are read at call time,
    so that assigning to them takes effect."""
    return sys.modules[__package__]


class DatasetDownloadError(RuntimeError):
    """No mirror gave a file that passed verification.

    ``failures`` is the list of ``(mirror, reason)`` pairs, one per mirror tried,
    in the order tried; the message lists them too.
    """

    def __init__(self, dataset, filename, failures):
        self.dataset = dataset
        self.filename = filename
        self.failures = list(failures)
        lines = [f"could not download {filename}.gz for {dataset} from any mirror:"]
        lines += [f"  - {mirror}: {reason}" for mirror, reason in self.failures]
        super().__init__("\n".join(lines))


class _MirrorFailed(Exception):
    """One mirror could not provide one file; the message says why."""


class DatasetCacheError(OSError):
    """The cache folder cannot be written (read-only, disk full, ...): no mirror can fix that.

    ``errno`` is the system's error number; the message names the folder and the file.
    No partial file is left behind.
    """

    def __init__(self, path, error):
        path = os.fspath(path)
        super().__init__(error.errno, f"cannot write into the dataset cache folder "
                                      f"{os.path.dirname(path) or '.'!r}: {error.strerror or error} "
                                      f"(while writing {os.path.basename(path)})")


@dataclass(frozen=True)
class _FileInfo:
    """What we know about one dataset file, to verify what a mirror sends.

    ``idx_size`` and ``idx_sha256`` describe the decompressed IDX file.
    ``gz_size`` and ``gz_sha256`` describe the .gz file as the public mirrors
    publish it (None when unknown).
    """

    idx_size: int
    idx_sha256: str
    gz_size: int | None = None
    gz_sha256: str | None = None



def data_root(root=None):
    """The cache root: ``root`` if given, else ``$CYDNN_DATA``, else ``./data``.

    Each dataset keeps its files in a subfolder of it (``<root>/mnist/``...).
    """
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get("CYDNN_DATA"):
        return Path(os.environ["CYDNN_DATA"]).expanduser()
    return Path.cwd() / "data"


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# Cached files already verified in this process, keyed by (path, size, mtime):
# a file that was replaced or modified since gets verified again.
_verified = set()


def _verify_key(path):
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _cached_file_ok(path, info):
    """Whether the cached IDX file at ``path`` has the expected SHA-256 (checked once per process)."""
    key = _verify_key(path)
    if key in _verified:
        return True
    ok = key[1] == info.idx_size and _sha256_file(path) == info.idx_sha256
    if ok:
        _verified.add(key)
    return ok


def _is_url(mirror):
    return isinstance(mirror, str) and "://" in mirror


def _check_mirror(mirror):
    """Return the mirror as a str (a URL or a local path); refuse unknown URL schemes early."""
    if isinstance(mirror, os.PathLike):
        return os.fspath(mirror)
    if not isinstance(mirror, str):
        raise TypeError(f"a mirror must be a URL or a directory path, got {mirror!r}")
    if _is_url(mirror):
        scheme = urllib.parse.urlsplit(mirror).scheme.lower()
        if scheme not in ("http", "https", "file"):
            raise ValueError(f"mirror {mirror!r}: unsupported URL scheme {scheme!r} "
                             f"(use http://, https://, file:// or a directory path)")
    return mirror


def _progress(total, desc):
    # disable=None hides the bar when stderr is not a terminal (logs, CI, pytest).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


def _download_http(url, dest, deadline=None, max_bytes=None):
    """Stream ``url`` into the file ``dest``; raise _MirrorFailed saying why on any failure.

    ``deadline`` (seconds, default DOWNLOAD_DEADLINE) bounds the whole file, whatever
    the server does; TIMEOUT bounds each wait for the next bytes.  The deadline is
    checked after each read, so a download stops at most min(TIMEOUT, deadline)
    seconds after it.  ``max_bytes`` bounds the body: a larger announced length is
    refused before reading, a longer stream as soon as it passes the bound (a
    server that streams without end never fills the disk).
    """
    timeout = _limits().TIMEOUT
    limit = _limits().DOWNLOAD_DEADLINE if deadline is None else deadline
    stop_at = time.monotonic() + limit
    received, total = 0, None
    try:
        with requests.get(url, stream=True, timeout=(timeout, min(timeout, limit))) as response:
            if response.status_code != 200:
                raise _MirrorFailed(f"HTTP {response.status_code} {response.reason} for {url}")
            ctype = response.headers.get("Content-Type", "")
            if ctype.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
                raise _MirrorFailed(f"{url} answered an HTML page (Content-Type {ctype!r}), "
                                    f"not a .gz file: probably an error or login page")
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            if max_bytes is not None and total is not None and total > max_bytes:
                raise _MirrorFailed(f"{url} announces {total} bytes, more than the {max_bytes} this file "
                                    f"can have; not downloading it")
            raw = response.raw
            with open(dest, "wb") as out, _progress(total, url.rsplit("/", 1)[-1]) as bar:
                while True:
                    if time.monotonic() > stop_at:
                        raise _MirrorFailed(f"download deadline of {limit} s passed after {received} "
                                            f"of {total if total is not None else '?'} bytes from {url} "
                                            f"(server too slow; see DOWNLOAD_DEADLINE)")
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
        raise _MirrorFailed(f"timed out: no data for {min(timeout, limit)} s after {received} bytes "
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
        if max_bytes is not None and os.path.getsize(path) > max_bytes:
            raise _MirrorFailed(f"{path} has {os.path.getsize(path)} bytes, more than the {max_bytes} "
                                f"this file can have")
        with open(path, "rb") as src, open(dest, "wb") as out, \
                _progress(os.path.getsize(path), os.path.basename(path)) as bar:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
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


def _fetch_gz(mirror, gz_name, dest, max_bytes=None):
    """Put ``<mirror>/<gz_name>`` (at most ``max_bytes``) into the file ``dest``, whatever kind of mirror it is."""
    if _is_url(mirror):
        parts = urllib.parse.urlsplit(mirror)
        if parts.scheme.lower() == "file":
            directory = urllib.request.url2pathname(parts.path)
            _copy_local(os.path.join(directory, gz_name), dest, max_bytes)
        else:
            _download_http(mirror.rstrip("/") + "/" + gz_name, dest, max_bytes=max_bytes)
    else:
        _copy_local(os.path.join(os.path.expanduser(mirror), gz_name), dest, max_bytes)


def _max_gz_size(info):
    """The most bytes a .gz of this file may have: its published size, or twice the data
    (deflate's worst case adds 0.1%), whichever is larger.  A bound against filling the
    disk, not a check: the checksums decide."""
    return max(info.gz_size or 0, 2 * info.idx_size + 65536)


def _gunzip(src, dest, max_size):
    """Decompress ``src`` into ``dest`` and return the SHA-256 of what was written.

    Stops with _MirrorFailed if the gzip stream is invalid or truncated, or
    grows past ``max_size`` bytes (the known size of the file: no need to
    write a larger one to learn that it is wrong).
    """
    digest = hashlib.sha256()
    written = 0
    with open(src, "rb") as f:
        head = f.read(64)
    if head[:2] != b"\x1f\x8b":
        if head.lstrip()[:1] == b"<":
            raise _MirrorFailed(f"not a gzip file but an HTML/XML page (it starts with {head[:40]!r}): "
                                f"probably an error page served with HTTP 200")
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


def _fetch_from_mirror(mirror, filename, info, folder):
    """Download, verify and install ``folder/filename`` from one mirror.

    Steps: download ``<filename>.gz`` to a temporary file; check its size and
    SHA-256 against the published .gz; decompress to a second temporary file
    while hashing; accept if either check passed; only then move the IDX file
    to its final name.  Both temporaries are removed whatever happens.
    """
    gz_tmp = _temp_file(folder, filename + ".gz")
    idx_tmp = _temp_file(folder, filename)
    try:
        _fetch_gz(mirror, filename + ".gz", gz_tmp, _max_gz_size(info))

        gz_size, gz_sha = os.path.getsize(gz_tmp), _sha256_file(gz_tmp)
        gz_ok = info.gz_sha256 is not None and (gz_size, gz_sha) == (info.gz_size, info.gz_sha256)

        idx_sha = _gunzip(gz_tmp, idx_tmp, max_size=info.idx_size)
        idx_ok = idx_sha == info.idx_sha256

        if not (gz_ok or idx_ok):
            reason = f"checksum mismatch: decompressed SHA-256 {idx_sha}, expected {info.idx_sha256}"
            if info.gz_sha256 is not None:
                reason += (f"; .gz is {gz_size} bytes with SHA-256 {gz_sha}, published "
                           f"{info.gz_size} bytes with SHA-256 {info.gz_sha256}")
            raise _MirrorFailed(reason)

        with open(idx_tmp, "rb+") as f:   # on disk before it gets its name
            os.fsync(f.fileno())
        os.replace(idx_tmp, folder / filename)  # atomic: the final name appears complete or not at all
    finally:
        for tmp in (gz_tmp, idx_tmp):
            tmp.unlink(missing_ok=True)


def _temp_file(folder, name):
    """A new, empty, uniquely named hidden file in ``folder``, for ``name`` while it downloads."""
    try:
        fd, path = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    except OSError as e:
        raise DatasetCacheError(os.path.join(folder, name), e) from None
    os.close(fd)
    return Path(path)


class _FolderLock:
    """An exclusive ``flock`` on the cache folder itself: one process fills a folder at a time.

    Locking the folder (not a lock file) leaves nothing behind in the cache.
    The kernel drops the lock when its holder dies (even by SIGKILL), so a
    killed download never blocks the next run.
    """

    def __init__(self, folder, timeout=None):
        self.path = Path(folder)
        self.timeout = _limits().LOCK_TIMEOUT if timeout is None else timeout
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:       # no flock (Windows): unique temp names + os.replace still apply
            return self
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise DatasetCacheError(self.path / ".lock", e) from None
        stop_at = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > stop_at:
                    os.close(self.fd)
                    raise TimeoutError(f"another process has held the lock on {self.path} for more than "
                                       f"{self.timeout} s (LOCK_TIMEOUT); is a download stuck?") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)     # closing releases the flock


def _remove_leftovers(folder, filename):
    """Delete ``.part`` files of ``filename`` left by a killed process (call with the lock held)."""
    for leftover in Path(folder).glob(f".{filename}.*.part"):
        leftover.unlink(missing_ok=True)


def _download(dataset, filename, info, folder, mirrors):
    """Try each mirror in order; raise DatasetDownloadError listing every failure.

    A cache folder that cannot be written raises DatasetCacheError at once.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetCacheError(folder / filename, e) from None
    with _FolderLock(folder):
        path = folder / filename
        if path.exists() and _cached_file_ok(path, info):    # another process just filled it
            return
        _remove_leftovers(folder, filename)
        failures = []
        for mirror in mirrors:
            try:
                _fetch_from_mirror(mirror, filename, info, folder)
                _verified.add(_verify_key(path))
                return
            except _MirrorFailed as e:
                failures.append((mirror, str(e)))
        raise DatasetDownloadError(dataset, filename, failures)
