"""Mutation-driven tests of cydnn.datasets.errors: the exact messages and attributes of the
dataset package's three public errors (and the private ``_MirrorFailed``), built directly."""
import errno
import os
from pathlib import Path

import pytest

from cydnn.datasets import DatasetCacheError, DatasetDownloadError, DatasetError
from cydnn.datasets.errors import _MirrorFailed


def test_the_error_classes_and_their_bases():
    assert issubclass(DatasetError, ValueError)
    assert issubclass(DatasetDownloadError, RuntimeError)
    assert issubclass(DatasetCacheError, OSError)
    assert issubclass(_MirrorFailed, Exception) and not issubclass(_MirrorFailed, (OSError, ValueError))


def test_download_error_lists_every_mirror_then_the_hint():
    failures = (("http://a/", "HTTP 404 Not Found"), ("/mirror", "file not found: /mirror/x.gz"))
    e = DatasetDownloadError("mnist", "x-idx1-ubyte", iter(failures), hint="HINT line 1\nline 2")
    assert str(e) == ("could not download x-idx1-ubyte.gz for mnist from any mirror:\n"
                      "  - http://a/: HTTP 404 Not Found\n"
                      "  - /mirror: file not found: /mirror/x.gz\n"
                      "HINT line 1\nline 2")
    assert e.args == (str(e),)
    assert e.dataset == "mnist" and e.filename == "x-idx1-ubyte" and e.hint == "HINT line 1\nline 2"
    assert e.failures == list(failures) and isinstance(e.failures, list)   # the iterator kept as a list


def test_download_error_without_mirrors_or_hint():
    e = DatasetDownloadError("cifar10", "data", [])
    assert str(e) == "could not download data.gz for cifar10 from any mirror:\n  (no mirror was given)"
    assert e.failures == [] and e.hint is None
    e = DatasetDownloadError("cifar10", "data", [("m", "why")], hint="")   # an empty hint adds no line
    assert str(e) == "could not download data.gz for cifar10 from any mirror:\n  - m: why"


def test_download_error_names_the_source_file_when_given():
    e = DatasetDownloadError("cifar10", "data_batch_1", [("m", "why")], hint="H", source_name="cifar.tar.gz")
    assert str(e) == "could not download cifar.tar.gz for cifar10 from any mirror:\n  - m: why\nH"
    e = DatasetDownloadError("cifar10", "f", [("m", "why")], source_name=None)
    assert str(e).startswith("could not download f.gz for cifar10")


def test_cache_error_names_the_folder_the_file_and_the_cause():
    e = DatasetCacheError(Path("/cache/mnist/.f.123.part"), OSError(errno.ENOSPC, "No space left on device"))
    assert e.errno == errno.ENOSPC
    assert e.strerror == ("cannot write into the dataset cache folder '/cache/mnist': No space left on device "
                          "(while writing .f.123.part)")
    assert str(e) == f"[Errno {errno.ENOSPC}] {e.strerror}"
    assert isinstance(e, OSError) and e.filename is None


def test_cache_error_of_a_bare_name_and_an_error_without_strerror():
    e = DatasetCacheError("f.part", OSError("disk on fire"))
    assert e.errno is None
    assert e.strerror == "cannot write into the dataset cache folder '.': disk on fire (while writing f.part)"
    e = DatasetCacheError(os.path.join("dir", "sub", "g"), PermissionError(errno.EACCES, "Permission denied"))
    assert e.errno == errno.EACCES
    assert e.strerror == ("cannot write into the dataset cache folder 'dir/sub': Permission denied "
                          "(while writing g)")


def test_mirror_failed_carries_its_reason():
    with pytest.raises(_MirrorFailed) as info:
        raise _MirrorFailed("why")
    assert str(info.value) == "why"
