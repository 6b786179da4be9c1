"""Download and cache: a missing file is fetched from each mirror in turn until one gives bytes
that pass verification; the cache keeps the decompressed IDX file, which gets its final name
(mode 0644) only once verified (see docs/reliability.md).

What a mirror may hold for a file ``<name>``:

- ``<name>.gz`` (any mirror: http(s)://, file://, a directory path), or
- the decompressed ``<name>`` itself (local mirrors: a directory path or file://), what many
  people already have on disk.

Verification (:func:`_accepted`): the SHA-256 of the decompressed data must always match.  For
the dataset's own default mirrors, which serve the published ``.gz``, its size and SHA-256 (and
its MD5 where only that is published) must match TOO: both are needed where both are known.  A
mirror the user names may hold another compression of the same data (or none): its content's
SHA-256 decides, which is all the cache keeps.
"""

import os
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import DatasetCacheError, DatasetDownloadError, _MirrorFailed
from .idx import _check_idx_header
from .transfer import (_CHUNK, _copy_local, _download_http, _gunzip, _limits, _md5_file,  # noqa: F401
                       _sha256_file)

#: Mode of the files put in the cache: readable by everyone, as any downloaded dataset.
CACHE_FILE_MODE = 0o644


@dataclass(frozen=True)
class _FileInfo:
    """What we know about one dataset file, to verify what a mirror sends.

    ``idx_size`` and ``idx_sha256`` describe the decompressed IDX file.  ``gz_size`` and
    ``gz_sha256`` describe the .gz file as the public mirrors publish it, ``gz_md5`` its MD5
    where that is all its authors publish (None when unknown).
    """

    idx_size: int
    idx_sha256: str
    gz_size: int | None = None
    gz_sha256: str | None = None
    gz_md5: str | None = None

    @property
    def gz_known(self):
        return self.gz_sha256 is not None or self.gz_md5 is not None


def data_root(root=None):
    """The cache root: ``root`` if given, else ``$CYDNN_DATA``, else ``./data``.

    Each dataset keeps its files in a subfolder of it (``<root>/mnist/``...).
    """
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get("CYDNN_DATA"):
        return Path(os.environ["CYDNN_DATA"]).expanduser()
    return Path.cwd() / "data"


# Cached files already verified in this process, keyed by (path, size, mtime):
# a file that was replaced or modified since gets verified again.
_verified = set()


def _verify_key(path):
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def _cached_file_ok(path, info):
    """Whether the cached file at ``path`` has the expected size and SHA-256 (hashed once per
    process, again whenever its size or mtime change)."""
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


def _local_dir(mirror):
    """The directory of a local mirror (a path or a file:// URL), or None for http(s)."""
    if not _is_url(mirror):
        return os.path.expanduser(mirror)
    parts = urllib.parse.urlsplit(mirror)
    return urllib.request.url2pathname(parts.path) if parts.scheme.lower() == "file" else None


def _fetch(mirror, name, dest, max_bytes):
    """Put ``<mirror>/<name>`` (at most ``max_bytes``) into the file ``dest``."""
    directory = _local_dir(mirror)
    if directory is None:
        _download_http(mirror.rstrip("/") + "/" + name, dest, max_bytes=max_bytes)
    else:
        _copy_local(os.path.join(directory, name), dest, max_bytes)


def _max_gz_size(info):
    """The most bytes a .gz of this file may have: its published size, or twice the data
    (deflate's worst case adds 0.1%), whichever is larger.  A bound against filling the
    disk, not a check: the checksums decide."""
    return max(info.gz_size or 0, 2 * info.idx_size + 65536)


def _accepted(info, strict, gz_ok, idx_ok):
    """The rule: the decompressed SHA-256 always; the published .gz too where it is known and
    the mirror is one that serves it (``strict``)."""
    if strict and info.gz_known:
        return gz_ok and idx_ok
    return idx_ok


def _gz_matches(info, path):
    """``(ok, description)``: whether the .gz at ``path`` is the published one."""
    size = os.path.getsize(path)
    sha = _sha256_file(path)
    ok = (info.gz_size is None or size == info.gz_size) and info.gz_known
    if info.gz_sha256 is not None:
        ok = ok and sha == info.gz_sha256
    if info.gz_md5 is not None:
        md5 = _md5_file(path)
        ok = ok and md5 == info.gz_md5
        return ok, (f".gz is {size} bytes with MD5 {md5}, published {info.gz_size} bytes with MD5 "
                    f"{info.gz_md5}")
    return ok, (f".gz is {size} bytes with SHA-256 {sha}, published {info.gz_size} bytes with "
                f"SHA-256 {info.gz_sha256}")


def _fetch_from_mirror(mirror, filename, info, folder, strict=False):
    """Download, verify and install ``folder/filename`` from one mirror.

    Steps: fetch ``<filename>.gz`` (or, from a local folder that has no .gz, the decompressed
    ``<filename>``) into a temporary file; decompress into a second temporary while hashing;
    apply :func:`_accepted`; only then give the IDX file its final name.  Both temporaries are
    removed whatever happens.
    """
    gz_tmp = _temp_file(folder, filename + ".gz")
    idx_tmp = _temp_file(folder, filename)
    try:
        directory = _local_dir(mirror)
        from_gz = not (directory is not None and not os.path.exists(os.path.join(directory, filename + ".gz"))
                       and os.path.isfile(os.path.join(directory, filename)))
        if not from_gz:
            _fetch(mirror, filename, idx_tmp, info.idx_size)       # a folder of decompressed files
            with open(idx_tmp, "rb") as f:
                try:
                    _check_idx_header(f.read(16), f"{os.path.join(directory, filename)}")
                except ValueError as e:
                    raise _MirrorFailed(str(e)) from None
            idx_sha = _sha256_file(idx_tmp)
            gz_ok, gz_note = False, "decompressed file: no .gz to check"
        else:
            try:
                _fetch(mirror, filename + ".gz", gz_tmp, _max_gz_size(info))
            except _MirrorFailed as e:
                if directory is not None and str(e).startswith("file not found"):
                    raise _MirrorFailed(f"{e} (nor the decompressed {filename})") from None
                raise
            gz_ok, gz_note = _gz_matches(info, gz_tmp)
            idx_sha = _gunzip(gz_tmp, idx_tmp, max_size=info.idx_size)
        idx_ok = idx_sha == info.idx_sha256

        if not _accepted(info, strict and from_gz, gz_ok, idx_ok):
            reason = f"checksum mismatch: decompressed SHA-256 {idx_sha}, expected {info.idx_sha256}"
            if idx_ok:
                reason = "checksum mismatch: the decompressed data is right but the .gz is not the published one"
            if info.gz_known:
                reason += f"; {gz_note}"
            raise _MirrorFailed(reason)
        _install(idx_tmp, folder / filename)
    finally:
        for tmp in (gz_tmp, idx_tmp):
            tmp.unlink(missing_ok=True)


def _install(tmp, final):
    """Give the verified temporary ``tmp`` its final name: synced, mode 0644, atomic rename."""
    try:
        with open(tmp, "rb+") as f:   # on disk before it gets its name
            os.fsync(f.fileno())
        os.chmod(tmp, CACHE_FILE_MODE)
        os.replace(tmp, final)        # atomic: the final name appears complete or not at all
    except OSError as e:
        raise DatasetCacheError(final, e) from None


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


def _remove_leftovers(folder, name):
    """Delete ``.part`` files of ``name`` left by a killed process (call with the lock held)."""
    for leftover in Path(folder).glob(f".{name}.*.part"):
        leftover.unlink(missing_ok=True)


def offline_hint(cli_dataset, folder, dir_holds, url_holds=None):
    """The end of the error when every mirror failed: the command that works offline.

    ``cli_dataset`` is the ``--dataset`` value (None for the default); ``dir_holds`` says what a
    mirror folder must hold, ``url_holds`` what a mirror URL must serve (default: the same).
    """
    option = "" if cli_dataset is None else f" --dataset {cli_dataset}"
    return (f"To train without a network, point to files you already have:\n"
            f"    python -m cydnn.train{option} --mirror DIR_OR_URL\n"
            f"where DIR_OR_URL is a folder holding {dir_holds}, or a URL serving "
            f"{url_holds or dir_holds}.  Or put the verified files in {folder} yourself, or set "
            f"$CYDNN_DATA to the folder that holds {Path(folder).name}/ (in Python: mirrors=[...], "
            f"root=...).")


def _download(dataset, filename, info, folder, mirrors, strict=(), hint=None):
    """Try each mirror in order; raise DatasetDownloadError listing every failure.

    ``strict`` are the mirrors that serve the published .gz (see :func:`_accepted`).
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
                _fetch_from_mirror(mirror, filename, info, folder, strict=mirror in strict)
                _verified.add(_verify_key(path))
                return
            except _MirrorFailed as e:
                failures.append((mirror, str(e)))
        raise DatasetDownloadError(dataset, filename, failures, hint=hint)
