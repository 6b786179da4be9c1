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
(threadpoolctl's per-library controllers, which also keep one Python thread
from changing a limit another thread set; a get and two sets cost a few
microseconds, small beside a product).  The compiled elementwise kernels
(ReLU, the optimizer updates) get their OpenMP thread count the same way from
the number of elements they touch (:func:`omp_threads`, ``PARALLEL_ELEMENTS``).

The kernels of convolution and pooling (im2col / col2im, direct convolution,
the row-by-row input gradient, pooling) get theirs from :func:`kernel_threads`:
parallel from ``KERNEL_PARALLEL_ELEMENTS`` (2^15) elements -- LeNet-5's layers
at batch 64 use both cores -- but only on cores that other processes leave free.  A load probe (:class:`LoadProbe`) reads, at
most every ``PROBE_SECONDS``, how much CPU time the machine's other processes
took since its last reading (``/proc/stat`` over the CPUs this process may run
on, less this process's own time): with one busy process beside us on two
cores the kernels run on one thread, where two would wait for each other at
every barrier of an OpenMP loop whose second thread shares its core (a
collapse, as the BLAS's above).

Environment: ``CYDNN_CPU_PARALLEL_FLOPS``, ``CYDNN_CPU_PARALLEL_ELEMENTS``,
``CYDNN_CPU_KERNEL_PARALLEL_ELEMENTS`` (integers) move the three thresholds;
``0`` means always parallel.  ``CYDNN_CPU_LOAD_PROBE=0`` turns the probe off
(the machine is then taken to be idle).
"""
import os
import threading
import time

import numpy as np

__all__ = ["PARALLEL_FLOPS", "PARALLEL_ELEMENTS", "KERNEL_PARALLEL_ELEMENTS", "available_cores", "blas_threads_for",
           "omp_threads", "kernel_threads", "fork_safe", "LoadProbe", "matmul", "BlasThreads"]


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
#: the C kernels of conv and pool (:func:`kernel_threads`) touching fewer elements run on one thread
KERNEL_PARALLEL_ELEMENTS = _env_int("CYDNN_CPU_KERNEL_PARALLEL_ELEMENTS", 1 << 15)
#: the load probe's interval: it reads /proc/stat at most this often (seconds)
PROBE_SECONDS = 0.25


def available_cores():
    """The number of CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_OMP_CAP = None  # min(available cores, $OMP_NUM_THREADS), computed once

# GNU OpenMP's thread pool does not survive fork(): in a child forked after the kernels ran on
# several threads, the next parallel region waits for pool threads that do not exist there, for
# ever (seen with multiprocessing's default start method on Linux and with mutmut's forked
# workers).  A forked child therefore runs every kernel on one thread, which needs no pool.
_FORKED = False


def _after_fork_in_child():
    global _FORKED, _probe
    _FORKED = True
    _probe = LoadProbe()  # a fresh lock: another thread of the parent may have held the old one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_safe(threads):
    """``threads``, or 1 in a forked child: for callers that pass a kernel its thread count
    themselves (tests, benchmarks), as the policy's own counts are."""
    return 1 if _FORKED else threads


def _omp_cap():
    """min(available cores, $OMP_NUM_THREADS when set), computed once; 1 in a forked child."""
    global _OMP_CAP
    if _FORKED:
        return 1
    if _OMP_CAP is None:
        cap = available_cores()
        env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        if env.isdigit() and int(env) > 0:
            cap = min(cap, int(env))
        _OMP_CAP = cap
    return _OMP_CAP


def omp_threads(elements):
    """OpenMP threads for a kernel touching ``elements`` numbers: 1 below ``PARALLEL_ELEMENTS``,
    else the available cores (at most ``$OMP_NUM_THREADS`` when set)."""
    if elements < PARALLEL_ELEMENTS:
        return 1
    return _omp_cap()


class LoadProbe:
    """How many cores the other processes of the machine keep busy, measured from ``/proc/stat``.

    :meth:`busy_elsewhere` is the CPU time (in cores) that the CPUs this process
    may run on spent busy (user, nice, system, irq, softirq, steal) over the last
    interval, less the CPU time of this process (``os.times``, all its threads).
    A reading is taken when the probe is made and again whenever ``PROBE_SECONDS``
    have passed (a call in between costs a clock read).  None until an interval of
    ``FIRST_SECONDS`` has passed (too few clock ticks to tell before); 0.0 where
    /proc/stat cannot be read or parsed (never an exception: the probe is made at import).
    """

    FIRST_SECONDS = 0.05

    def __init__(self, stat_path="/proc/stat", clock=time.monotonic, own_cpu=None, cpus=None):
        self.stat_path = stat_path
        self.clock = clock
        self.own_cpu = own_cpu or (lambda: sum(os.times()[:2]))
        self.cpus = cpus  # the "cpuN" names to count (None: this process's affinity)
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.lock = threading.Lock()
        self.busy = None
        self.last = self._reading()  # (clock, busy seconds of our CPUs or None, own CPU seconds)

    def _names(self):
        if self.cpus is not None:
            return self.cpus
        try:
            return {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            return None

    def _busy_seconds(self):
        """Busy seconds since boot of the CPUs counted (None if /proc/stat cannot be read, has no
        line of those CPUs, or one of their first eight fields is not an integer)."""
        try:
            with open(self.stat_path, "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            return None
        names, total, seen = self._names(), 0, False
        for line in text.splitlines():
            fields = line.split()
            if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
                continue
            if names is not None and fields[0] not in names:
                continue
            try:
                v = [int(f) for f in fields[1:9]]
            except ValueError:  # not the format of proc(5): unknown, as an unreadable file
                return None
            v += [0] * (8 - len(v))
            total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
            seen = True
        return total / self.tick if seen else None

    def _reading(self):
        return self.clock(), self._busy_seconds(), self.own_cpu()

    def busy_elsewhere(self):
        """Cores kept busy by other processes over the last interval (None: not known yet)."""
        last = self.last
        wait = self.FIRST_SECONDS if self.busy is None else PROBE_SECONDS
        if self.clock() - last[0] < wait:
            return self.busy
        with self.lock:
            now, busy, own = reading = self._reading()
            if busy is None or last[1] is None:
                self.busy = 0.0
            elif now > last[0]:
                self.busy = max(0.0, ((busy - last[1]) - (own - last[2])) / (now - last[0]))
            self.last = reading
        return self.busy


_probe = LoadProbe()


def kernel_threads(elements):
    """OpenMP threads for a C kernel of conv or pool touching ``elements`` numbers: 1 below
    ``KERNEL_PARALLEL_ELEMENTS``, else the cores of :func:`omp_threads`'s cap that the other
    processes leave free (:class:`LoadProbe`; cores minus their busy time, rounded to nearest,
    half up), at least 1; 1 while the probe has no reading yet."""
    if elements < KERNEL_PARALLEL_ELEMENTS:
        return 1
    cap = _omp_cap()
    if cap <= 1 or os.environ.get("CYDNN_CPU_LOAD_PROBE", "1").strip() == "0":
        return cap
    busy = _probe.busy_elsewhere()
    if busy is None:  # the first few ms of the process: not known yet, so one thread
        return 1
    return max(1, min(cap, int(cap - busy + 0.5)))


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
