"""How many threads a CPU op uses: BLAS threads per matrix product, OpenMP threads per kernel.

Why: numpy's BLAS (OpenBLAS) starts one thread per core for every product, and
its threads wait for each other by spinning.  On a machine where another
process keeps a core busy, a product split over both cores waits for the
descheduled half: LeNet-5 training fell from 9,061 images/s (one thread) to
439 (default threading).  Small products gain little from a second thread
anyway, so:

- a product of fewer than ``PARALLEL_FLOPS`` floating-point operations
  (2*m*k*n) runs with 1 BLAS thread;
- a larger one with ``min(the BLAS's current setting, the cores this process
  may run on)`` -- so a limit the user set (``threadpoolctl.threadpool_limits``,
  ``OPENBLAS_NUM_THREADS``) is never exceeded.

The setting is changed only for the call and restored after it
(threadpoolctl's per-library controllers; a get and a set are a few hundred
nanoseconds).  The compiled kernels (``_kernels``) get their OpenMP thread
count the same way from the number of elements they touch
(:func:`omp_threads`, ``PARALLEL_ELEMENTS``).

Environment: ``CYDNN_CPU_PARALLEL_FLOPS``, ``CYDNN_CPU_PARALLEL_ELEMENTS``
(integers) move the two thresholds; ``0`` means always parallel.
"""
import os

import numpy as np

__all__ = ["PARALLEL_FLOPS", "PARALLEL_ELEMENTS", "available_cores", "blas_threads_for", "omp_threads",
           "matmul", "BlasThreads"]


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        out = int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None
    if out < 0:
        raise ValueError(f"${name} must be >= 0, got {out}")
    return out


#: products below this many floating-point operations (2*m*k*n) run on one BLAS thread (~1 ms of one core)
PARALLEL_FLOPS = _env_int("CYDNN_CPU_PARALLEL_FLOPS", 1 << 26)
#: kernels touching fewer elements than this run on one OpenMP thread
PARALLEL_ELEMENTS = _env_int("CYDNN_CPU_PARALLEL_ELEMENTS", 1 << 21)


def available_cores():
    """The number of CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_OMP_CAP = None  # min(available cores, $OMP_NUM_THREADS), computed once


def omp_threads(elements):
    """OpenMP threads for a kernel touching ``elements`` numbers: 1 below ``PARALLEL_ELEMENTS``,
    else the available cores (at most ``$OMP_NUM_THREADS`` when set)."""
    global _OMP_CAP
    if elements < PARALLEL_ELEMENTS:
        return 1
    if _OMP_CAP is None:
        cap = available_cores()
        env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        if env.isdigit() and int(env) > 0:
            cap = min(cap, int(env))
        _OMP_CAP = cap
    return _OMP_CAP


# ------------------------------------------------------------------------ BLAS

_blas_libs = None  # threadpoolctl's controllers of the BLAS libraries loaded (numpy's), found once


def _blas():
    """threadpoolctl's controllers of the loaded BLAS libraries ([] without threadpoolctl)."""
    global _blas_libs
    if _blas_libs is None:
        try:
            import threadpoolctl
        except ImportError:  # a declared dependency; without it the BLAS keeps its own threading
            _blas_libs = []
        else:
            controller = threadpoolctl.ThreadpoolController()
            _blas_libs = list(controller.select(user_api="blas").lib_controllers)
    return _blas_libs


def blas_threads_for(flops, current):
    """The BLAS thread count for a product of ``flops`` operations when the library is set to
    ``current``: 1 below ``PARALLEL_FLOPS``, else ``min(current, available_cores())``."""
    if flops < PARALLEL_FLOPS:
        return 1
    return max(1, min(current, available_cores()))


class BlasThreads:
    """Context manager: numpy's BLAS runs with :func:`blas_threads_for` threads inside, the
    previous setting restored on exit (also when the body raises)."""

    __slots__ = ("flops", "saved")

    def __init__(self, flops):
        self.flops = flops
        self.saved = None

    def __enter__(self):
        saved = []
        for lib in _blas():
            current = lib.get_num_threads()
            want = blas_threads_for(self.flops, current)
            if want != current:
                lib.set_num_threads(want)
                saved.append((lib, current))
        self.saved = saved
        return self

    def __exit__(self, *exc):
        for lib, current in self.saved:
            lib.set_num_threads(current)
        self.saved = None
        return False


def matmul(a, b):
    """``a @ b`` for 2-d arrays with the BLAS threads chosen by the size (:class:`BlasThreads`)."""
    with BlasThreads(2 * a.shape[0] * a.shape[1] * b.shape[1]):
        return np.matmul(a, b)
