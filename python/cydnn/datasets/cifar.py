"""CIFAR-10 from its published BINARY archive (``cifar-10-binary.tar.gz``), never unpickled.

The archive (https://www.cs.toronto.edu/~kriz/cifar.html, "CIFAR-10 binary version (suitable
for C programs)") holds ``cifar-10-batches-bin/data_batch_1.bin`` ... ``data_batch_5.bin``
(training) and ``test_batch.bin``: 10,000 records each of 1 label byte and 3,072 pixel bytes
(1,024 red, then green, then blue, each 32 rows of 32).

Download and cache: the archive is fetched from each mirror in turn into a temporary file in
the cache folder, bounded by its known size, and gets its final name (mode 0644) only once its
size and SHA-256 (and the MD5 the CIFAR page publishes) match; the cached archive is verified
again (once per process, and whenever it changes) before it is read.  Reading streams the tar
(no extraction, no path from the archive ever touches the file system): each member's name,
type and declared size are checked before its bytes are read, a name seen twice is refused, and
at most ``MAX_MEMBERS`` entries are looked at.
"""

import os
import tarfile
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

from .arrays import ArrayDataset
from .download import (_FolderLock, _check_mirror, _fetch, _install, _md5_file, _remove_leftovers,
                       _sha256_file, _temp_file, _verified, _verify_key, data_root, offline_hint)
from .errors import DatasetCacheError, DatasetDownloadError, DatasetError, _MirrorFailed

RECORD = 1 + 3 * 32 * 32     # bytes per image: the label, then the 3072 pixels
MAX_MEMBERS = 64             # tar entries looked at (the real archive has 9)
_FOLDER = "cifar-10-batches-bin"
TRAIN_MEMBERS = tuple(f"{_FOLDER}/data_batch_{i}.bin" for i in range(1, 6))
TEST_MEMBERS = (f"{_FOLDER}/test_batch.bin",)


@dataclass(frozen=True)
class _ArchiveInfo:
    """The published archive: its name, size and SHA-256 (and MD5 where published)."""

    name: str
    size: int
    sha256: str
    md5: str | None = None

    def check(self, path):
        """None when ``path`` is this archive, else the reason it is not."""
        size = os.path.getsize(path)
        if size != self.size:
            return f"archive is {size} bytes, expected {self.size}"
        sha = _sha256_file(path)
        if sha != self.sha256:
            return f"checksum mismatch: archive SHA-256 {sha}, expected {self.sha256}"
        if self.md5 is not None and _md5_file(path) != self.md5:
            return f"checksum mismatch: archive MD5 {_md5_file(path)}, expected {self.md5}"
        return None


class CIFAR10(ArrayDataset):
    """CIFAR-10 (Krizhevsky, 2009): 32x32 colour images of 10 classes, 50,000 train / 10,000 test.

    ``CIFAR10(train=True, root=None, mirrors=None, download=True)``: ``root`` is the cache root
    (:func:`data_root`; the archive lives in ``<root>/cifar-10/``); ``mirrors`` replaces
    ``default_mirrors`` (http(s) URLs, file:// URLs or folders holding
    ``cifar-10-binary.tar.gz``).  ``images`` (N, 3, 32, 32) uint8, ``labels`` (N,) int32;
    ``mean`` / ``std`` are the training set's per-channel values (for both splits).
    """

    name = "cifar-10"
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    default_mirrors = ("https://www.cs.toronto.edu/~kriz/",)
    # Size and MD5: the CIFAR page.  SHA-256: the same archive's hash as recorded by several
    # independent projects (e.g. the Ruby torchvision port, gomlx's downloader), consistent
    # with that size and MD5.
    archive = _ArchiveInfo("cifar-10-binary.tar.gz", 170052171,
                           "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
                           "c32a1d4ab5d03f1284b67883e8d87530")
    records_per_batch = 10000
    train_mean = (0.4914, 0.4822, 0.4465)
    train_std = (0.2470, 0.2435, 0.2616)

    def __init__(self, train=True, root=None, mirrors=None, download=True):
        self.train = bool(train)
        self.root = data_root(root)
        self.folder = self.root / self.name
        self.mirrors = [_check_mirror(m) for m in (self.default_mirrors if mirrors is None else mirrors)]
        path = self._ensure(download)
        images, labels = _read_archive(path, TRAIN_MEMBERS if self.train else TEST_MEMBERS,
                                       self.records_per_batch)
        super().__init__(images, labels, classes=self.classes, what=f"CIFAR10 {path}",
                         stats=(self.train_mean, self.train_std))

    def _ensure(self, download):
        path = self.folder / self.archive.name
        if path.exists():
            key = _verify_key(path)
            if key in _verified or self.archive.check(path) is None:
                _verified.add(key)
                return path
            path.unlink()
            warnings.warn(f"{path} failed its checksum check and was removed"
                          + ("; downloading it again" if download else ""), stacklevel=3)
        if not download:
            raise FileNotFoundError(
                f"CIFAR10: {self.archive.name} is not in {self.folder}. Pass download=True to fetch it "
                f"(mirrors: {', '.join(map(str, self.mirrors))}), or point root= or $CYDNN_DATA at the "
                f"folder that holds {self.name}/{self.archive.name}.")
        _download_archive(self.archive, self.folder, self.mirrors,
                          offline_hint("cifar10", self.folder, f"{self.archive.name} (the binary version)"))
        return path

    def __repr__(self):
        split = "train" if self.train else "test"
        return f"CIFAR10({split}, {len(self)} samples, folder='{self.folder}')"


def load_cifar10(root=None, mirrors=None, download=True):
    """``(train, test)``: both splits of CIFAR-10."""
    return (CIFAR10(True, root=root, mirrors=mirrors, download=download),
            CIFAR10(False, root=root, mirrors=mirrors, download=download))


def _download_archive(info, folder, mirrors, hint):
    """Try each mirror; install the archive only once verified; DatasetDownloadError otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetCacheError(folder / info.name, e) from None
    with _FolderLock(folder):
        final = folder / info.name
        if final.exists() and info.check(final) is None:      # another process just filled it
            _verified.add(_verify_key(final))
            return
        _remove_leftovers(folder, info.name)
        failures = []
        for mirror in mirrors:
            tmp = _temp_file(folder, info.name)
            try:
                _fetch(mirror, info.name, tmp, info.size)
                reason = info.check(tmp)
                if reason is not None:
                    raise _MirrorFailed(reason)
                _install(tmp, final)
                _verified.add(_verify_key(final))
                return
            except _MirrorFailed as e:
                failures.append((mirror, str(e)))
            finally:
                tmp.unlink(missing_ok=True)
        raise DatasetDownloadError("CIFAR10", info.name, failures, hint=hint, source_name=info.name)


def _read_archive(path, wanted, records):
    """``(images (N, 3, 32, 32) uint8, labels (N,) int32)`` from the members ``wanted``, in order.

    Streams the tar once.  Every member's name is checked against those seen (twice: refused);
    a wanted member must be a regular file of exactly ``records * RECORD`` bytes, checked from
    its header before its bytes are read; labels must lie in [0, 10).
    """
    where = f"CIFAR-10 archive {path}"
    found, seen = {}, set()
    try:
        with tarfile.open(path, mode="r|gz") as tar:
            for count, member in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise DatasetError(f"{where}: more than {MAX_MEMBERS} entries; not the CIFAR-10 archive")
                if member.name in seen:
                    raise DatasetError(f"{where}: entry {member.name!r} appears twice")
                seen.add(member.name)
                if member.name not in wanted:
                    continue
                if not member.isreg():
                    raise DatasetError(f"{where}: entry {member.name!r} is not a regular file")
                if member.size != records * RECORD:
                    raise DatasetError(f"{where}: entry {member.name!r} declares {member.size} bytes, expected "
                                       f"{records} records of {RECORD} = {records * RECORD}")
                data = tar.extractfile(member).read(member.size)
                if len(data) != member.size:
                    raise DatasetError(f"{where}: entry {member.name!r} is truncated ({len(data)} of "
                                       f"{member.size} bytes)")
                found[member.name] = np.frombuffer(data, np.uint8).reshape(records, RECORD)
    except DatasetError:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise DatasetError(f"{where} is truncated or corrupt ({type(e).__name__}: {e})") from None
    missing = [name for name in wanted if name not in found]
    if missing:
        raise DatasetError(f"{where}: no entry {missing[0]!r} (entries: {sorted(seen)})")
    table = np.concatenate([found[name] for name in wanted])
    labels = table[:, 0].astype(np.int32)
    if labels.max(initial=0) >= 10:
        bad = int(np.flatnonzero(labels >= 10)[0])
        raise DatasetError(f"{where}: record {bad} has label {labels[bad]}, outside [0, 10)")
    images = np.ascontiguousarray(table[:, 1:]).reshape(-1, 3, 32, 32)
    return images, labels
