"""The pipe's fill of pinned memory (cpp/host_copy.h) on the host alone: slices over a pool of threads that live for
the process, threads started per fill when another caller holds the pool, and a new pool after fork().  Every
byte is compared with the source; a hang (a slice nobody copies) is caught by the time limits."""
import multiprocessing
import os

import numpy as np
import pytest

from cydnn import _C

from threadkit import run_in_threads

MIB = 1 << 20


def _source(nbytes, seed):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [1, 100, MIB - 1, 2 * MIB + 7, 3 * MIB, 31_360_000 + 13])
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8, 100])
def test_every_byte_arrives_and_the_way_follows_the_slices(nbytes, threads):
    src = _source(nbytes, nbytes + threads)
    dst = np.zeros_like(src)
    way = _C.host_copy(dst, src, threads)
    np.testing.assert_array_equal(dst, src)
    slices = min(nbytes // MIB, threads)
    assert way == ("one" if slices <= 1 else "pool"), (nbytes, threads, way)


def test_the_default_threads_are_a_pipes():
    src = _source(8 * MIB + 3, 1)
    dst = np.zeros_like(src)
    way = _C.host_copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert way == ("one" if min(4, max(1, (os.cpu_count() or 1) // 2)) <= 1 else "pool")


def test_the_pool_grows_then_serves_fewer_slices():
    src = _source(16 * MIB, 2)
    for threads in (2, 8, 3, 16, 2):
        dst = np.zeros_like(src)
        assert _C.host_copy(dst, src, threads) == "pool"
        np.testing.assert_array_equal(dst, src)


def test_callers_at_once_each_get_their_bytes():
    """Four Python threads (the copy runs without the GIL) fill at the same time: one holds the pool, the others
    start their own threads; every copy is whole."""
    sources = [_source(6 * MIB + k, 10 + k) for k in range(4)]
    ways, wrong = [], []

    def work(k):
        for _ in range(25):
            dst = np.zeros_like(sources[k])
            ways.append(_C.host_copy(dst, sources[k], 4))
            if not np.array_equal(dst, sources[k]):
                wrong.append(k)

    errors, alive = run_in_threads(work, 4, 120)
    assert alive == 0, "a copy did not end"
    assert errors == [] and wrong == []
    assert len(ways) == 100 and set(ways) <= {"pool", "spawn"} and "pool" in ways


def _child_copies(queue):
    src = _source(5 * MIB + 1, 7)
    dst = np.zeros_like(src)
    way = _C.host_copy(dst, src, 4)
    queue.put((way, bool(np.array_equal(dst, src))))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="this platform has no fork()")
def test_a_forked_child_gets_its_own_pool():
    """The parent's pool threads do not exist in a child made by fork(): the child's fill must not wait for them."""
    src = _source(5 * MIB, 3)
    dst = np.zeros_like(src)
    assert _C.host_copy(dst, src, 4) == "pool"            # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_copies, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's copy did not end: it waited for its parent's pool")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == ("pool", True)
    dst[:] = 0
    assert _C.host_copy(dst, src, 4) == "pool"            # and the parent's pool still serves
    np.testing.assert_array_equal(dst, src)


def test_refusals():
    a = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="host_copy"):
        _C.host_copy(a, np.zeros(11, np.uint8))
    with pytest.raises(ValueError, match="host_copy"):
        _C.host_copy(np.zeros((4, 4), np.uint8)[:, ::2], np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="threads"):
        _C.host_copy(a, a.copy(), -1)
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _C.host_copy(ro, a)
    big = np.zeros(4 * MIB, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _C.host_copy(big[MIB:3 * MIB], big[:2 * MIB])
