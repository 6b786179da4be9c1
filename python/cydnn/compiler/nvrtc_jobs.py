"""NVRTC in the background: the kernels generated for a fused network (fused_net_gen.py writes their source)
compiled in child processes, a few at a time, through the disk cache (kernel_cache.py), and adopted by the
network once they give the interpreter's outputs and run faster.

``Generation(text)``: one compile (``done()``, ``wait()``, ``result()``, ``kill()``); ``GeneratedKernels``:
a network's kernels by cluster size (``start``, ``get``, ``wait``, ``info``).
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

from . import _nvrtc as _nvrtc_mod
from . import fused_net_gen as gen_source        # NVRTC's library, options and headers (looked up at each compile)
from . import kernel_cache
from .fused_net_gen import ARCH, KERNEL_NAME, GenerationError

__all__ = ["Generation", "Linked", "GeneratedKernels", "MAX_RUNNING", "FORMS"]


class Generation:
    """One background compile: ``text`` -> cubin by NVRTC in a child process (compiler/_nvrtc.py), so
    that neither a compile still running at exit nor a crash inside NVRTC touches this process; one
    still running when the program exits is killed.  At most MAX_RUNNING children run at once (the
    others wait their turn: a test suite or a notebook makes many networks).  A cubin compiled before
    from the same source, headers, options and NVRTC comes from the disk cache instead (kernel_cache.py;
    ``cached``), and a fresh one goes into it.  ``done()`` polls; ``result()`` once done: the cubin, or
    raises the GenerationError.  ``rdc``: relocatable code, one unit of a linked kernel (``Linked``).
    ``seconds``: from the Generation's making until the compile ended (the child's own clock where NVRTC ran, so
    not later when nobody looked); ``nvrtc_seconds``: NVRTC's part of it (None from the cache)."""

    def __init__(self, text, arch=ARCH, rdc=False):
        self.cubin, self.error, self.seconds, self.cached, self.nvrtc_seconds = None, None, None, False, None
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._dir, self._proc, self._cache, self._key = None, None, None, None
        try:
            spec = {"lib": gen_source._nvrtc(), "text": text, "headers": gen_source.headers(),
                    "options": gen_source._options(arch, rdc=rdc)}
            self._cache = kernel_cache.cache_dir()
            self._key = kernel_cache.key(text, spec["headers"], spec["options"], gen_source._nvrtc_identity())
        except GenerationError as e:
            self._finish(e)
            return
        cubin = kernel_cache.load(self._cache, self._key)
        if cubin is not None:
            self.cubin, self.cached = cubin, True
            self._finish()
            return
        try:
            self._dir = tempfile.mkdtemp(prefix="cydnn-nvrtc-")
            self._out = os.path.join(self._dir, "kernel.cubin")
            self._spec = os.path.join(self._dir, "spec.json")
            with open(self._spec, "w") as f:
                json.dump(spec, f)
        except OSError as e:
            self._finish(GenerationError(f"cannot write NVRTC's input: {e}"))
            return
        _queue.append(self)
        _pump()

    def _start(self):
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", _nvrtc_mod.__file__, self._spec, self._out],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE)
            _running.add(self)
        except OSError as e:
            self._finish(GenerationError(f"cannot start NVRTC: {e}"))

    def _finish(self, error=None, seconds=None):
        self.error, self.seconds = error, time.perf_counter() - self._t0 if seconds is None else seconds
        _running.discard(self)
        if self in _queue:
            _queue.remove(self)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        _pump()

    def done(self):
        if self.seconds is None and self._proc is not None and self._proc.poll() is not None:
            self._collect()
        _pump()
        return self.seconds is not None

    def _collect(self):
        code, err = self._proc.returncode, self._proc.stderr.read().decode(errors="replace")
        self._proc.stderr.close()
        if code == 0 and os.path.isfile(self._out):
            with open(self._out, "rb") as f:
                self.cubin = f.read()
            kernel_cache.store(self._cache, self._key, self.cubin)
            self._finish(seconds=self._child_seconds())
        elif os.path.isfile(self._out + ".err"):
            with open(self._out + ".err") as f:
                self._finish(GenerationError(f.read()))
        else:
            self._finish(GenerationError(f"the NVRTC process ended with status {code}: {err[-1000:]}"))

    def _child_seconds(self):
        """Seconds from the making until the child finished, by its own record (None where it left none)."""
        try:
            with open(self._out + ".time") as f:
                t = json.load(f)
            self.nvrtc_seconds = float(t["nvrtc_s"])
            return min(time.perf_counter() - self._t0, max(self.nvrtc_seconds, float(t["end"]) - self._wall0))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def ended(self):
        """When the compile ended (time.perf_counter), None while it runs."""
        return None if self.seconds is None else self._t0 + self.seconds

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            for gen in list(_running):              # whichever runs: this one, or those before it
                gen.done()
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def kill(self, why="killed: the program exited before the compile ended"):
        if self.seconds is not None:
            return
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stderr.close()
        self._finish(GenerationError(why))

    def result(self):
        if self.error is not None:
            raise self.error
        return self.cubin


#: NVRTC children running at once (each takes a core for 0.2-20 s)
MAX_RUNNING = max(1, (os.cpu_count() or 2) // 2)
_running, _queue = set(), []


def _pump():
    """Start waiting compiles while fewer than MAX_RUNNING run."""
    while _queue and len(_running) < MAX_RUNNING:
        _queue.pop(0)._start()


@atexit.register
def _kill_running():
    """At exit: the waiting compiles never start, the running ones are killed (both end as killed, so
    that nothing is left for a finaliser to do while the interpreter tears its modules down)."""
    waiting = list(_queue)
    _queue.clear()
    for gen in waiting + list(_running):
        gen.kill()


class Linked:
    """The "layers" form of a generated kernel: one Generation a translation unit (fused_net_gen.units), compiled
    side by side as relocatable code, then linked by the driver in this process (fused_net_gen.link: a few ms) when
    the result is asked for.  The same interface as a Generation; each unit goes through the disk cache on its own."""

    def __init__(self, texts, arch=ARCH):
        self.units = [Generation(t, arch, rdc=True) for t in texts]
        self._cubin, self._error = None, None

    def done(self):
        return all([u.done() for u in self.units])           # (a list: every unit polled, so each one collected)

    def wait(self, timeout=None):
        return all(u.wait(timeout) for u in self.units)

    def kill(self, why="killed: the program exited before the compile ended"):
        for u in self.units:
            u.kill(why)

    @property
    def seconds(self):
        return None if not self.done() else max(u.seconds for u in self.units)

    @property
    def ended(self):
        ends = [u.ended for u in self.units]
        return None if None in ends or not ends else max(ends)

    @property
    def nvrtc_seconds(self):
        times = [u.nvrtc_seconds for u in self.units]
        return None if None in times else max(times)

    @property
    def cached(self):
        return all(u.cached for u in self.units)

    def result(self):
        if self._cubin is None and self._error is None:
            try:
                self._cubin = gen_source.link([u.result() for u in self.units])
            except GenerationError as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._cubin


#: the forms of a generated kernel compiled for a cluster size, in this order: one relocatable unit a layer,
#: compiled side by side and linked by the driver (fused_net_gen.units: ready sooner, 0.6-0.9 s against 1.7-3.7 s
#: cold on the H100's host), then one inlined kernel function (fused_net_gen.source), which ptxas schedules as a
#: whole (faster: 3-12 us on the zoo); each is adopted when it passes its check and runs faster than what
#: serves (docs/performance.md, session 27)
FORMS = ("layers", "whole")
#: seconds between two looks at a cluster's running compiles from the network's calls (GeneratedKernels.get and
#: compiling): a look polls every child process, 8 of them for the CNN's two forms, and a one-image call that
#: looked each time paid ~15-20 us for it while its kernel compiled (cluster 16 timed 75 against 53 us beside its
#: own compile, and lost the choice: docs/performance.md, session 29)
POLL_S = 0.01
#: the layers form is compiled only where this many NVRTC children may run at once (MAX_RUNNING: half the CPUs);
#: with fewer, its units would queue one after another and hold the whole form back
LAYERS_MIN_RUNNING = 4


class GeneratedKernels:
    """The generated kernels of one fused network, by cluster size: compiling (Generations, one a form),
    in use (a NetKernel), or refused (the reason).  ``get(cluster)`` is what every call asks: the kernel in
    use or None, adopting a finished compile on the way -- loaded, checked against the interpreter and
    timed by ``trial(cluster, kernel)`` (the network's), kept only if it gives the same outputs and runs
    faster than the interpreter and than the form already in use.  ``info`` says what happened to each
    cluster (its top-level keys: the kernel in use, or the last refused; ``forms``: each form's record;
    ``first_s``: the compile seconds of the first kernel put in use; ``ready_s``: the seconds from this object's
    making -- the network's first call, right after ``compile()`` -- to the end of a form's compile, the issue's
    "compile time" of generated code counted from the network's start)."""

    def __init__(self, make_source, trial, on=True):
        # the network's own methods, held weakly: the network holds this object, and a reference cycle
        # would keep its device buffers until the next garbage collection instead of until it goes
        self._make_source, self._trial = weakref.WeakMethod(make_source), weakref.WeakMethod(trial)
        self._pending, self._ready, self.info, self._looked = {}, {}, {}, {}
        self.changes = 0                   # counts what may change a kernel in use: a start, a drop, a form adopted
        self.reason = None if on else "off (CYDNN_FUSED_GEN=0)"
        self._born = time.perf_counter()

    def __del__(self):
        for forms in getattr(self, "_pending", {}).values():     # the network went: its compiles are not needed
            for gen in forms.values():
                gen.kill("dropped: the network went before the compile ended")

    def start(self, cluster):
        """Generate and compile (in the background) the kernel for ``cluster``, once: both forms where
        ``$CYDNN_NVRTC_SPLIT`` is on (the default) and the machine runs LAYERS_MIN_RUNNING compiles at once, else
        the whole one (queued first either way).  Returns whether a kernel for it is
        compiling or in use."""
        if self.reason is None and cluster not in self._pending and cluster not in self.info:
            layers = gen_source.split_layers() and MAX_RUNNING >= LAYERS_MIN_RUNNING
            make = self._make_source()
            whole = Generation(make(cluster, "whole"))          # queued first: the longest compile starts first
            self._pending[cluster] = ({"layers": Linked(make(cluster, "layers"))} if layers else {})
            self._pending[cluster]["whole"] = whole
            self.info[cluster] = {"status": "compiling"}
            self.changes += 1
        return cluster in self._pending or cluster in self._ready

    def drop(self, cluster, why):
        """Stop ``cluster``'s compiles (a start made before the timing, which chose another cluster) and forget
        them, so that a later ``start`` compiles it again; a kernel already in use stays."""
        if cluster in self._ready:
            return
        self.changes += 1
        for gen in self._pending.pop(cluster, {}).values():
            gen.kill(why)
        self.info.pop(cluster, None)
        self._looked.pop(cluster, None)

    def compiling(self, cluster):
        """Whether a form of ``cluster``'s kernel is still being compiled (not yet adopted or refused)."""
        self._look(cluster)
        return cluster in self._pending

    def get(self, cluster):
        """The kernel in use for ``cluster``, or None; a finished compile is adopted on the way."""
        self._look(cluster)
        return self._ready.get(cluster)

    def wait(self, cluster, timeout=120):
        """Block until every form of ``cluster``'s kernel is compiled and adopted or refused (tests, benchmarks)."""
        for gen in list(self._pending.get(cluster, {}).values()):
            gen.wait(timeout)
        self._look(cluster, force=True)
        return self._ready.get(cluster)

    def _look(self, cluster, force=False):
        """Adopt ``cluster``'s finished compiles: at most once every POLL_S seconds from the calls (each look polls
        every child process), at once from ``wait``."""
        forms = self._pending.get(cluster)
        if not forms:
            return
        now, last = time.perf_counter(), self._looked.get(cluster)
        if not force and last is not None and now - last < POLL_S:
            return
        self._looked[cluster] = now
        for form, gen in list(forms.items()):
            if gen.done():
                del forms[form]
                self.changes += 1
                self._adopt(cluster, form, gen)
        if not forms:
            del self._pending[cluster]

    def source(self, cluster, form="whole"):
        return self._make_source()(cluster, form)

    def _adopt(self, cluster, form, gen):
        from .. import _C
        info = self.info[cluster]
        rec = {"compile_s": round(gen.seconds, 2),
               "nvrtc_s": None if gen.nvrtc_seconds is None else round(gen.nvrtc_seconds, 2), "cached": gen.cached}
        if gen.ended is not None:
            rec["ready_s"] = round(gen.ended - self._born, 2)
        info.setdefault("forms", {})[form] = rec
        serving = self._ready.get(cluster)
        try:
            kernel = _C.NetKernel(gen.result(), KERNEL_NAME, cluster)
            # against the form in use, timed in the same rounds (a slow moment falls on both: session 37 saw the
            # CNN's whole form timed at 31.2 us in one trial and the layers form at 28.7 in the next, and the
            # slower form served for the process's life; the whole form runs 24.7-25.0 us)
            ok, trial = (self._trial()(cluster, kernel) if serving is None else
                         self._trial()(cluster, kernel, serving))
        except (GenerationError, _C.CydnnError) as e:
            rec.update(status="refused", reason=str(e))
            if serving is None:
                info.update(rec, form=form)
            return None
        rec.update(trial)
        if ok and serving is not None:
            us, again = trial.get("timed_us", {}).get("generated"), trial.get("timed_us", {}).get("in_use")
            rec["in_use_us"] = again
            ok = us is not None and again is not None and us < again
        if not ok:
            rec["status"] = "not used"
            if serving is None:
                info.update(rec, form=form)
            return None
        rec["status"] = "in use"
        if serving is not None:
            info["forms"][info["form"]]["status"] = "replaced"
        else:
            info["first_s"] = rec["compile_s"]
        info.pop("reason", None)
        info.update({k: v for k, v in rec.items() if k != "in_use_us"}, form=form)
        self._ready[cluster] = kernel
        return kernel
