"""The dataset package's errors, shared by the download, the cache and the parsers."""

import os


class DatasetError(ValueError):
    """A dataset file (an .npz, an image, an archive member) is not what it must be.

    The message names the file, the entry and the problem.  A ``ValueError``, so callers
    that caught ``ValueError`` from a dataset before still do.
    """


class DatasetDownloadError(RuntimeError):
    """No mirror gave a file that passed verification.

    ``failures`` is the list of ``(mirror, reason)`` pairs, one per mirror tried,
    in the order tried; the message lists them too, and ends with what to do
    offline (``hint``: the exact command, what a mirror folder must hold, ``$CYDNN_DATA``).
    """

    def __init__(self, dataset, filename, failures, hint=None, source_name=None):
        self.dataset = dataset
        self.filename = filename
        self.failures = list(failures)
        self.hint = hint
        lines = [f"could not download {source_name or filename + '.gz'} for {dataset} from any mirror:"]
        lines += [f"  - {mirror}: {reason}" for mirror, reason in self.failures]
        if not self.failures:
            lines.append("  (no mirror was given)")
        if hint:
            lines.append(hint)
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
