"""The dataset cache's folder lock: one process fills a cache folder at a time, a waiter gives up
after LOCK_TIMEOUT with a message naming the folder, and nothing is left open.

The lock is held here by a second open file description of the same folder (flock conflicts
between descriptions even in one process).  Time is a virtual clock (the lock's ``time``
module replaced): the tests count the lock's polls instead of measuring seconds, so that a
loaded machine cannot flake them.
"""
import fcntl
import os
import types

import pytest

from cydnn import datasets
from cydnn.datasets import download


class VirtualTime:
    """``monotonic`` and ``sleep`` of a clock that moves only when slept on; ``on_sleep`` runs at
    each sleep (to let a holder go after a few polls)."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 1000.0, 0, on_sleep

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert 0 < seconds <= 1, seconds
        self.sleeps += 1
        self.now += seconds
        if self.on_sleep:
            self.on_sleep(self.sleeps)


def hold(folder):
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def closed(fd):
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_free_folder_is_locked_at_once_and_released(tmp_path, monkeypatch):
    clock = VirtualTime()
    monkeypatch.setattr(download, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    with download._FolderLock(tmp_path, timeout=5) as lock:
        assert clock.sleeps == 0 and not closed(lock.fd)
        with pytest.raises(BlockingIOError):        # held: another description cannot take it
            hold(tmp_path)
    assert closed(lock.fd)
    fd = hold(tmp_path)                              # released on exit
    os.close(fd)
    assert list(tmp_path.iterdir()) == []            # no lock file left in the cache


def test_a_held_lock_times_out_after_lock_timeout_naming_the_folder(tmp_path, monkeypatch):
    clock = VirtualTime()
    monkeypatch.setattr(download, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(datasets, "LOCK_TIMEOUT", 2)        # read at call time
    holder = hold(tmp_path)
    lock = download._FolderLock(tmp_path)
    try:
        with pytest.raises(TimeoutError) as e:
            with lock:
                pytest.fail("the lock was taken while another holder had it")
    finally:
        os.close(holder)
    assert str(e.value) == (f"another process has held the lock on {tmp_path} for more than 2 s "
                            f"(LOCK_TIMEOUT); is a download stuck?")
    # It waited the timeout and no longer: polls every 0.05 s, gives up on the first poll past 2 s.
    assert clock.now - 1000.0 == pytest.approx(2.05, abs=0.051)
    assert 40 <= clock.sleeps <= 42
    assert lock.fd is not None and closed(lock.fd)           # its descriptor was closed


def test_a_waiter_gets_the_lock_when_the_holder_lets_go(tmp_path, monkeypatch):
    holder = [hold(tmp_path)]

    def release(sleeps):
        if sleeps == 3:
            os.close(holder.pop())
    clock = VirtualTime(on_sleep=release)
    monkeypatch.setattr(download, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    with download._FolderLock(tmp_path, timeout=900) as lock:
        assert lock.fd is not None
        assert clock.sleeps == 3                             # three polls, then the lock
    assert holder == []


def test_a_folder_that_cannot_be_opened_is_a_cache_error(tmp_path):
    with pytest.raises(datasets.DatasetCacheError) as e:
        with download._FolderLock(tmp_path / "missing", timeout=1):
            pass
    assert str(tmp_path / "missing") in str(e.value)
