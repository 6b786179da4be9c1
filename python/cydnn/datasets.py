"""MNIST and Fashion-MNIST: download, verify, parse, and serve in batches.

The module has four parts, each usable alone:

1. **Files and checksums.**  Both datasets are four gzip-compressed IDX files.
   For each file we know the SHA-256 of its decompressed contents (and, for
   MNIST, the size and SHA-256 of the ``.gz`` the public mirrors serve).

2. **Download and cache.**  A missing file is fetched as ``<mirror>/<name>.gz``
   from each mirror in turn until one gives bytes that pass verification.
   The cache keeps the *decompressed* IDX file under
   ``<root>/<dataset-name>/<name>``, so a later load reads no gzip.  A file only
   ever gets its final name after it was verified (written to a temporary
   file in the same folder, then moved with ``os.replace``, which is atomic).

3. **IDX parsing.**  :func:`read_idx` turns IDX bytes into a numpy array and
   explains exactly what is wrong when the bytes are not a valid IDX file.

4. **Batches.**  :class:`DataLoader` shuffles, and builds each batch with ONE
   backend op, ``ops.gather_batch``, so the same loop runs on the CPU (numpy)
   and on the GPU (the whole dataset uploaded once).

Typical use::

    from cydnn.datasets import MNIST, DataLoader

    train = MNIST(train=True)              # downloads once into ./data/mnist/
    loader = DataLoader(train.images, train.labels, batch_size=128,
                        mean=MNIST.mean, std=MNIST.std, device="cuda")
    for x, y in loader:                    # x: (B, 1, 28, 28) float32, y: (B,) int32
        ...
"""
from __future__ import annotations

import gzip
import hashlib
import operator
import os
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
import urllib3
from tqdm import tqdm

import cydnn.ops

__all__ = [
    "DataLoader",
    "DatasetCacheError",
    "DatasetDownloadError",
    "FashionMNIST",
    "IDXDataset",
    "MNIST",
    "data_root",
    "load_fashion_mnist",
    "load_mnist",
    "read_idx",
]

#: Seconds to wait for a mirror to connect, and then between two chunks of data.
TIMEOUT = 30

#: Seconds one whole file may take to download from one mirror (a server that
#: trickles a byte a second never trips TIMEOUT, but trips this).
DOWNLOAD_DEADLINE = 600

#: Largest IDX file accepted, in bytes (a header that declares more is refused
#: before anything is allocated; MNIST's largest file is 47 MB).
MAX_IDX_BYTES = 1 << 30

#: Seconds to wait for another process that is filling the same cache file.
LOCK_TIMEOUT = 900

_CHUNK = 1 << 20  # bytes read or written at a time (1 MiB)


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


# --------------------------------------------------------------------------
# 1. Files and checksums
# --------------------------------------------------------------------------

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


def _idx_size(*dims):
    """Bytes in a uint8 IDX file of these dimensions: 4-byte magic, 4 bytes per dim, payload."""
    return 4 + 4 * len(dims) + int(np.prod(dims))


# --------------------------------------------------------------------------
# 3. IDX parsing  (before the datasets, which use it)
# --------------------------------------------------------------------------

_IDX_UBYTE = 0x08  # the IDX type code for unsigned bytes; the only one MNIST uses


def read_idx(source):
    """Parse an IDX file (a path, or the file's bytes) into a uint8 numpy array.

    The IDX format (http://yann.lecun.com/exdb/mnist/) is a big-endian header
    followed by the raw data::

        bytes 0-1  zero
        byte  2    data type   (0x08 = unsigned byte; the only type accepted here)
        byte  3    rank        (number of dimensions: 1 for labels, 3 for images)
        then       one 4-byte unsigned size per dimension
        then       the data, row-major, exactly prod(sizes) bytes

    So the "magic number" of a label file is 0x00000801 and of an image file
    0x00000803.  Returns an array of shape ``(N,)`` or ``(N, rows, cols)``.
    Raises ``ValueError`` naming what is wrong when the bytes are not such a file.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        what = "IDX data"
        data = np.frombuffer(source, dtype=np.uint8)
    else:
        what = f"IDX file {os.fspath(source)!r}"
        data = np.fromfile(source, dtype=np.uint8)

    if data.size < 4:
        raise ValueError(f"{what}: only {data.size} bytes, too short for the 4-byte IDX magic number")
    magic = int.from_bytes(data[:4].tobytes(), "big")
    zeros, dtype_code, rank = int.from_bytes(data[:2].tobytes(), "big"), int(data[2]), int(data[3])
    if zeros != 0:
        raise ValueError(
            f"{what}: bad magic number 0x{magic:08X}: an IDX file starts with two zero bytes "
            f"(expected 0x00000801 for labels or 0x00000803 for images)")
    if dtype_code != _IDX_UBYTE:
        raise ValueError(
            f"{what}: data type byte is 0x{dtype_code:02X}, but only 0x08 (unsigned byte) is "
            f"supported (magic number 0x{magic:08X})")
    if rank not in (1, 3):
        raise ValueError(
            f"{what}: rank {rank} (magic number 0x{magic:08X}) is not supported: expected "
            f"1 (labels, 0x00000801) or 3 (images, 0x00000803)")

    header_size = 4 + 4 * rank
    if data.size < header_size:
        raise ValueError(
            f"{what}: {data.size} bytes, too short for the {header_size}-byte header of a rank-{rank} file")
    dims = tuple(int(d) for d in data[4:header_size].view(">u4"))
    if rank == 3 and (dims[1] == 0 or dims[2] == 0):
        raise ValueError(f"{what}: images of size {dims[1]}x{dims[2]}: rows and columns must be > 0")

    expected = _check_idx_dims(dims, what)
    payload = data.size - header_size
    if payload != expected:
        raise ValueError(
            f"{what}: dimensions {dims} need {expected} data bytes after the header, "
            f"but {payload} follow ({'truncated' if payload < expected else 'trailing bytes'})")

    array = data[header_size:].reshape(dims)
    # np.frombuffer gives a read-only view of the caller's bytes: hand back our own copy.
    return array if array.flags.writeable else array.copy()


def _check_idx_dims(dims, what):
    """Bytes of data that IDX dimensions ``dims`` declare; refuses more than MAX_IDX_BYTES."""
    expected = 1
    for d in dims:
        expected *= int(d)          # Python ints: no overflow
    if expected > MAX_IDX_BYTES:
        raise ValueError(f"{what}: header declares dimensions {tuple(dims)} = {expected} bytes, more than "
                         f"the {MAX_IDX_BYTES}-byte limit (MAX_IDX_BYTES): refusing it")
    return expected


def _check_idx_header(head, what):
    """Check the first bytes of an IDX stream (magic, rank, declared size) before reading the rest."""
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] != _IDX_UBYTE or head[3] not in (1, 3):
        raise ValueError(f"{what}: not an unsigned-byte IDX file of rank 1 or 3 "
                         f"(it starts with {bytes(head[:4])!r})")
    rank = head[3]
    if len(head) < 4 + 4 * rank:
        raise ValueError(f"{what}: too short for the header of a rank-{rank} IDX file")
    dims = [int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return _check_idx_dims(dims, what)


def _check_pair(images, labels, num_classes, what="dataset"):
    """Check that an images array and a labels array belong together."""
    if images.ndim != 3:
        raise ValueError(f"{what}: images must have shape (N, rows, cols), got {images.shape}")
    if labels.ndim != 1:
        raise ValueError(f"{what}: labels must have shape (N,), got {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{what}: {len(images)} images but {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{what}: labels must lie in [0, {num_classes}), found values from "
            f"{labels.min()} to {labels.max()}")


# --------------------------------------------------------------------------
# 2. Download and cache
# --------------------------------------------------------------------------

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
    limit = DOWNLOAD_DEADLINE if deadline is None else deadline
    stop_at = time.monotonic() + limit
    received, total = 0, None
    try:
        with requests.get(url, stream=True, timeout=(TIMEOUT, min(TIMEOUT, limit))) as response:
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
        raise _MirrorFailed(f"timed out: no data for {min(TIMEOUT, limit)} s after {received} bytes "
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
        self.timeout = LOCK_TIMEOUT if timeout is None else timeout
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


# --------------------------------------------------------------------------
# The datasets
# --------------------------------------------------------------------------

class IDXDataset:
    """One split of an MNIST-like dataset, loaded into memory.

    Subclasses only fill in the class attributes below; ``MNIST`` and
    ``FashionMNIST`` are the two provided.

    Attributes of an instance:
        images  uint8 array (N, 28, 28), pixel values 0..255
        labels  int32 array (N,), values in [0, len(classes))
        train   True for the training split, False for the test split
        folder  the cache folder holding the decompressed IDX files
    """

    name = ""                 # the cache subfolder, e.g. "mnist"
    classes = []              # class names, indexed by label
    mean = 0.0                # mean and std of the training pixels scaled to [0, 1],
    std = 1.0                 #   for normalisation: x = (pixel / 255 - mean) / std
    default_mirrors = ()      # base URLs, tried in order
    splits = {}               # "train"/"test" -> (images file, labels file)
    files = {}                # file name -> _FileInfo

    def __init__(self, root=None, train=True, download=True, mirrors=None):
        self.train = bool(train)
        self.root = data_root(root)
        self.folder = self.root / self.name
        self.mirrors = [_check_mirror(m) for m in (self.default_mirrors if mirrors is None else mirrors)]

        images_name, labels_name = self.splits["train" if self.train else "test"]
        images_path = self._ensure(images_name, download)
        labels_path = self._ensure(labels_name, download)

        self.images = read_idx(images_path)
        self.labels = read_idx(labels_path).astype(np.int32)
        _check_pair(self.images, self.labels, len(self.classes), what=f"{type(self).__name__} {images_name}")

    def _ensure(self, filename, download):
        """Path of a verified cached IDX file, downloading it if needed (and allowed)."""
        path = self.folder / filename
        info = self.files[filename]
        if path.exists():
            if _cached_file_ok(path, info):
                return path
            path.unlink()
            warnings.warn(f"{path} failed its SHA-256 check and was removed"
                          + ("; downloading it again" if download else ""), stacklevel=3)
        if not download:
            raise FileNotFoundError(
                f"{type(self).__name__}: {filename} is not in {self.folder}. "
                f"Pass download=True to fetch it (mirrors: {', '.join(map(str, self.mirrors))}), "
                f"or point root= or $CYDNN_DATA at the folder that holds {self.name}/{filename}.")
        _download(type(self).__name__, filename, info, self.folder, self.mirrors)
        return path

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        """``(image, label)``: a (28, 28) uint8 array and an int."""
        return self.images[i], int(self.labels[i])

    def __repr__(self):
        split = "train" if self.train else "test"
        return f"{type(self).__name__}({split}, {len(self)} samples, folder='{self.folder}')"

    def loader(self, batch_size=128, shuffle=None, **kwargs):
        """A :class:`DataLoader` over this split, normalised with the class's mean and std.

        ``shuffle`` defaults to True for the training split and False for the test split;
        other keyword arguments go to :class:`DataLoader`.
        """
        kwargs.setdefault("mean", self.mean)
        kwargs.setdefault("std", self.std)
        kwargs.setdefault("num_classes", len(self.classes))
        return DataLoader(self.images, self.labels, batch_size=batch_size,
                          shuffle=self.train if shuffle is None else shuffle, **kwargs)


_MNIST_SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class MNIST(IDXDataset):
    """The MNIST handwritten digits (LeCun, Cortes, Burges): 60,000 train / 10,000 test.

    ``MNIST(root=None, train=True, download=True, mirrors=None)``: ``root`` is the
    cache root (see :func:`data_root`); ``mirrors`` replaces ``default_mirrors``
    and may hold http(s) URLs, ``file://`` URLs or local directory paths.
    """

    name = "mnist"
    classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    mean = 0.1307
    std = 0.3081
    default_mirrors = (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    )
    splits = _MNIST_SPLITS
    files = {
        "train-images-idx3-ubyte": _FileInfo(
            _idx_size(60000, 28, 28),
            "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
            9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        "train-labels-idx1-ubyte": _FileInfo(
            _idx_size(60000),
            "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
            28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        "t10k-images-idx3-ubyte": _FileInfo(
            _idx_size(10000, 28, 28),
            "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
            1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        "t10k-labels-idx1-ubyte": _FileInfo(
            _idx_size(10000),
            "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
            4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    }


class FashionMNIST(IDXDataset):
    """Zalando's Fashion-MNIST: 28x28 grey images of 10 kinds of clothing, same format as MNIST.

    Zalando publishes only MD5 sums of its .gz files, so downloads are verified
    by the SHA-256 of the decompressed files alone.
    """

    name = "fashion-mnist"
    classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    mean = 0.2860
    std = 0.3530
    default_mirrors = (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
    )
    splits = _MNIST_SPLITS
    files = {
        "train-images-idx3-ubyte": _FileInfo(
            _idx_size(60000, 28, 28),
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
        "train-labels-idx1-ubyte": _FileInfo(
            _idx_size(60000),
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
        "t10k-images-idx3-ubyte": _FileInfo(
            _idx_size(10000, 28, 28),
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
        "t10k-labels-idx1-ubyte": _FileInfo(
            _idx_size(10000),
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
    }


def load_mnist(root=None, mirrors=None, download=True):
    """``(train, test)``: both splits of MNIST."""
    return (MNIST(root, train=True, download=download, mirrors=mirrors),
            MNIST(root, train=False, download=download, mirrors=mirrors))


def load_fashion_mnist(root=None, mirrors=None, download=True):
    """``(train, test)``: both splits of Fashion-MNIST."""
    return (FashionMNIST(root, train=True, download=download, mirrors=mirrors),
            FashionMNIST(root, train=False, download=download, mirrors=mirrors))


# --------------------------------------------------------------------------
# 4. Batches
# --------------------------------------------------------------------------

# Tags that keep the random streams of a loader apart (see DataLoader).
_PERMUTATION_STREAM = 0
_AUGMENTATION_STREAM = 1


def _nonnegative_int(value, name):
    try:
        value = operator.index(value)  # accepts int and numpy integers, refuses floats
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class DataLoader:
    """Mini-batches ``(x, y)`` of an image dataset, built on the CPU or on the GPU.

    ``x`` is float32 ``(B, 1, H + 2*pad, W + 2*pad)`` holding
    ``(pixel / 255 - mean) / std`` (zero padding is applied to the pixels
    first, so the border reads ``-mean / std``); ``y`` is int32 ``(B,)``.

    How it works: the images, labels and each epoch's order are converted once
    with ``ops.asarray`` (for ``device="cuda"`` that uploads the whole dataset to
    the GPU once, and the epoch's permutation once per epoch); each batch is
    then ONE call ``ops.gather_batch(images, labels, perm[start:stop], mean,
    std, pad=, max_shift=, seed=)``, which gathers, pads, shifts and normalises.

    Randomness, all derived from ``seed`` (an int >= 0), so that two loaders
    with the same arguments give identical batches:

    - the order of epoch ``e`` is a permutation drawn from
      ``np.random.default_rng(SeedSequence(seed, spawn_key=(0, e)))``: a fresh
      generator per epoch, so any epoch can be replayed on its own;
    - batch ``b`` of epoch ``e`` gets the seed of its random shifts from
      ``SeedSequence(seed, spawn_key=(1, e, b))``, an int in [0, 2**63).

    Epochs: the loader counts them itself.  Each ``iter(loader)`` (each ``for``
    loop over it) uses epoch ``loader.epoch`` and then adds one to it;
    ``set_epoch(e)`` chooses the epoch of the next loop (to resume training).

    ``max_shift > 0`` moves each image by a random whole number of pixels in
    ``[-max_shift, max_shift]`` along each axis (augmentation: use it for the
    training loader only).  ``drop_last=True`` drops the last, smaller batch.
    """

    def __init__(self, images, labels, batch_size=128, shuffle=True, seed=0,
                 mean=0.0, std=1.0, pad=0, max_shift=0, device="cpu",
                 drop_last=False, num_classes=10):
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim != 3:
            raise ValueError(f"images must be a uint8 array (N, H, W), got {images.dtype} {images.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got {labels.dtype}")
        _check_pair(images, labels, num_classes, what="DataLoader")
        if len(images) == 0:
            raise ValueError("DataLoader: the dataset is empty")
        if len(images) >= 2**31:
            raise ValueError("DataLoader: at most 2**31 - 1 samples (indices are int32)")

        self.batch_size = _nonnegative_int(batch_size, "batch_size")
        if self.batch_size == 0:
            raise ValueError("batch_size must be >= 1")
        self.seed = _nonnegative_int(seed, "seed")
        self.pad = _nonnegative_int(pad, "pad")
        self.max_shift = _nonnegative_int(max_shift, "max_shift")
        self.mean, self.std = float(mean), float(std)
        if not (np.isfinite(self.std) and self.std > 0 and np.isfinite(self.mean)):
            raise ValueError(f"need a finite mean and a std > 0, got mean={mean}, std={std}")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.device = device
        self.num_samples = len(images)  # samples in the dataset (one epoch visits each once)
        self.epoch = 0

        # Everything is checked on the host: from here on the data may live on the GPU.
        self._ops = cydnn.ops.backend(device)
        self._images = self._ops.asarray(np.ascontiguousarray(images))
        self._labels = self._ops.asarray(labels.astype(np.int32))
        self._fixed_order = None  # uploaded once when not shuffling

    def __len__(self):
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)  # ceil division

    def set_epoch(self, epoch):
        """Make the next ``iter(loader)`` produce epoch ``epoch``."""
        self.epoch = _nonnegative_int(epoch, "epoch")

    def permutation(self, epoch):
        """The sample order of ``epoch`` (int32 numpy array, host side).

        Being a permutation of ``range(num_samples)``, every index is in range by
        construction: the GPU never sees an index it would have to check.
        """
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int32)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PERMUTATION_STREAM, epoch)))
        return rng.permutation(self.num_samples).astype(np.int32)

    def batch_seed(self, epoch, batch):
        """The seed of the random shifts of batch ``batch`` of ``epoch``: an int in [0, 2**63)."""
        seq = np.random.SeedSequence(self.seed, spawn_key=(_AUGMENTATION_STREAM, epoch, batch))
        return int(seq.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        if self.shuffle:
            order = self._ops.asarray(self.permutation(epoch))  # one upload per epoch
        else:
            if self._fixed_order is None:
                self._fixed_order = self._ops.asarray(self.permutation(0))
            order = self._fixed_order
        return self._batches(epoch, order)

    def _batches(self, epoch, order):
        for b in range(len(self)):
            start = b * self.batch_size
            stop = min(start + self.batch_size, self.num_samples)
            yield self._ops.gather_batch(
                self._images, self._labels, order[start:stop], self.mean, self.std,
                pad=self.pad, max_shift=self.max_shift, seed=self.batch_seed(epoch, b))

    def __repr__(self):
        return (f"DataLoader({self.num_samples} samples, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, device={self.device!r}, epoch={self.epoch})")
