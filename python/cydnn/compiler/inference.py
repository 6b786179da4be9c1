"""What ``cydnn.compile`` returns for inference: :class:`CompiledInference`.

A plan and graph per batch bucket (binding.py), the hand-fused LeNet-5 kernel for raw images of a
LeNet-5, and the fused network (fused_net.py) for the buckets where it measures faster.
"""
import bisect
import os
import threading
import weakref

import numpy as np

from .. import _C, nn
from . import fused_choice, fused_net, lenet
from ..nn.module import structure_version
from .binding import _Runner, _build_plan, log, module_buffers, signature
from .trace import Unsupported, trace

__all__ = ["CompiledInference", "BUCKETS"]


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)


class CompiledInference:
    """``infer(x)``: network inputs (N, *input_shape) float32 -> outputs (N, ...), numpy or DeviceArray.

    Any N: a plan and graph per size bucket (1, 2, 4, ..., 64, 256, 1024), made on first
    use; N that is not a bucket runs in the next one up (rows are independent in eval
    mode); more than 1024 runs in chunks.  ``softmax=True`` appends a softmax.
    With ``preprocess=(mean, std, pad)`` the inputs are raw images (N, H, W) in [0, 1] or
    uint8 and a LeNet-5 runs on its fused kernel (one C call, preprocessing included).
    """

    def __init__(self, model, input_shape, softmax=False, cuda_graph=True, fused=True, preprocess=None,
                 weak_model=False, **options):
        if not isinstance(model, nn.Module):
            raise TypeError(f"compile: model must be an nn.Module, got {type(model).__name__}")
        # A model that keeps its own compiled inference (predict's cache) is referred to weakly, so that
        # the two make no reference cycle: the device buffers go when the model goes, not at a later GC.
        self._model = weakref.ref(model) if weak_model else (lambda: model)
        self.softmax, self.options = bool(softmax), options
        self.input_shape = tuple(int(s) for s in input_shape)
        self.cuda_graph, self.fused, self.preprocess = bool(cuda_graph), bool(fused), preprocess
        nodes = trace(model, self.input_shape, 1)          # refuses what the compiler does not take, now
        self.out_shape = nodes[-1].out_shape[1:]
        self.reason = "" if model.device == "cuda" else f"the model is on {model.device!r}"
        self.mode = "reference" if self.reason else ("graph" if cuda_graph else "steps")
        self._runners, self._sig, self._lenet, self._fused = {}, None, None, None
        self._pipe = None                   # pinned buffers for inputs of many chunks, made on first use
        self.lenet_reason = None
        mode = options.pop("fused_net", None) or os.environ.get("CYDNN_FUSED_NET", "auto")
        if mode not in ("auto", "force", "off"):
            raise ValueError(f"compile: fused_net must be 'auto', 'force' or 'off', got {mode!r}")
        self.fused_net_mode = mode if fused else "off"
        self.resident_us = fused_net.resident_idle_us(options.pop("resident_us", None))   # refused now if bad
        self._lock = threading.Lock()
        # one-image numpy calls on the fused network once their route is settled: (structure version, the
        # generated kernels' changes, those kernels, a _C.MappedCall) -- valid while both numbers hold (_settle_one)
        self._one = None

    @property
    def graph_count(self):
        """CUDA graphs captured so far (bucket plans, and the fused LeNet-5 predictor's)."""
        own = sum(r.bound.graph is not None for r in self._runners.values())
        return own + (self._lenet.graph_count if self._lenet is not None else 0)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise ReferenceError("compiled inference: its model no longer exists")
        return model

    def _fresh(self):
        device = self.model.device
        if device != "cuda":
            raise RuntimeError(f"compiled inference: the model is on {device!r}; compiled inference runs on the "
                               f"GPU (on the CPU call the model itself, or move it with model.to('cuda'))")
        if self._sig is None or not self._sig.fresh():
            self._runners, self._lenet, self._sig, self._fused = {}, None, None, None
            nodes = trace(self.model, self.input_shape, 1)   # Unsupported if a layer changed into one it can't take
            self._sig = signature(self.model)
            self._plan_lenet()
            if not self.reason:                               # the model is on the GPU
                self._fused = fused_choice.FusedChoice(nodes, self.softmax, self.fused_net_mode, BUCKETS[-1],
                                                   self.resident_us)

    def unsupported_reason(self):
        """None while the compiler can run the model as it is now, else why not (it re-plans on a change)."""
        try:
            with self._lock:
                self._fresh()
        except Unsupported as e:
            return str(e)
        return None

    def _plan_lenet(self):
        """The fused LeNet-5 kernel (cpp/fastpath.cu) for numpy inputs, where the network is LeNet-5:
        raw images with ``preprocess``; else float32 (N, 1, 28, 28) inputs as they are (the kernel's
        normalisation with mean 0 and std 1 is exact: (x - 0) / 1 = x), classic (N, 1, 32, 32) at
        its full size (CYDNN_INPUT_F32_FULL: not padded again)."""
        if not self.fused or not self.softmax:
            self.lenet_reason = "the fused LeNet-5 kernel needs softmax=True and fused=True"
            return
        nodes = trace(self.model, self.input_shape, 1)
        found = lenet.match(nodes, self.input_shape)
        if isinstance(found, str):
            self.lenet_reason = found
            return
        if self.preprocess is None:
            if self.fused_net_mode == "force":
                self.lenet_reason = "fused_net='force' asks for the fused network"
                return
            mean, std = 0.0, 1.0
        elif self.preprocess[2] != (2 if found[0] else 0):
            self.lenet_reason = f"input padding {self.preprocess[2]} is not LeNet-5's"
            return
        else:
            mean, std, _ = self.preprocess
        self._lenet = lenet.LeNetPredictor(nodes, found[0], found[1], mean, std, self.cuda_graph,
                                           full=self.preprocess is None)
        self.lenet_reason = None

    def _runner(self, n):
        bucket = next((b for b in BUCKETS if b >= n), BUCKETS[-1])
        runner = self._runners.get(bucket)
        if runner is None:
            plan, _ = _build_plan(self.model, self.input_shape, bucket, False, self.options, softmax=self.softmax)
            runner = _Runner(plan, module_buffers(self.model, plan), self.cuda_graph)
            self._runners[bucket] = runner
        return bucket, runner

    def __call__(self, x):
        """Outputs for ``x`` (numpy in -> numpy out, DeviceArray in -> DeviceArray out)."""
        with self._lock:            # the plans' buffers and graphs are shared by the calls
            one = self._one
            if (one is not None and one[0] == structure_version() and one[1] == one[2].changes
                    and self._model() is not None):
                out = one[3](x)     # one image on the fused network, nothing changed since: one C call
                if out is not None:                 # (None: x is not one float32 C-contiguous image)
                    return out
            return self._call(x)

    def _settle_one(self, cluster):
        """Keep the route of one-image numpy calls on ``cluster`` (``_one``) once nothing about it is still being
        decided: the bucket's choice (not waiting for a generated kernel to be timed again) and the cluster's
        generated kernels (none compiling).  The route is checked on every call against the structure version
        (any parameter, buffer or module replaced, the model moved) and the kernels' changes, and made again here
        by the next call that takes the general path."""
        fused, one = self._fused, self._one
        gen = fused.net.generated
        if 1 in fused.hoped or gen.compiling(cluster):
            self._one = None
            return
        if one is not None and one[2] is gen and one[1] == gen.changes and one[3].cluster == cluster:
            self._one = (structure_version(),) + one[1:]
            return
        call = fused.net.mapped_call(cluster)
        self._one = None if call is None else (structure_version(), gen.changes, gen, call)

    def _call(self, x):
        self._fresh()
        if self._lenet is not None and isinstance(x, np.ndarray) and x.ndim in (3, 4):
            if self.preprocess is not None:
                return self._lenet(x.reshape(x.shape[0], x.shape[-2], x.shape[-1]))
            # numpy floats are 4x the bytes of the raw images the kernel's own copy path was made for:
            # from three chunks on, the plan's pipe (copies on several threads, overlapped) is faster
            if x.dtype == np.float32 and x.shape[1:] == self.input_shape and x.shape[0] <= 2 * BUCKETS[-1]:
                return self._lenet(x.reshape(x.shape[0], x.shape[2], x.shape[3]))
        if self.preprocess is not None and isinstance(x, np.ndarray):
            x = self._preprocess(x)
        device_in = isinstance(x, _C.DeviceArray)
        if not device_in and not isinstance(x, np.ndarray):
            raise TypeError(f"compiled inference: x must be a numpy array or DeviceArray, got {type(x).__name__}")
        if x.dtype != np.float32 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"compiled inference: x must be float32 (N, {', '.join(map(str, self.input_shape))}),"
                             f" got {x.dtype} {tuple(x.shape)}")
        n = x.shape[0]
        if not device_in and 0 < n <= BUCKETS[-1] and self._fused is not None:
            cluster = self._fused.cluster(BUCKETS[bisect.bisect_left(BUCKETS, n)])
            if cluster not in (None, "?"):         # one chunk on the fused network, chosen before: one C call
                if n == 1 and self.preprocess is None:
                    self._settle_one(cluster)
                return self._fused.net.run_host(x, cluster)
        out = _C.empty((n,) + self.out_shape) if device_in else np.empty((n,) + self.out_shape, np.float32)
        step = BUCKETS[-1]
        starts = list(range(0, n, step))
        if device_in or len(starts) < 3:
            self._chunks(x, out, starts, device_in)
            return out
        ready = self._runners.get(step)
        if ready is None or not ready.ready:
            self._chunks(x, out, starts[:1], False)     # plans, captures and chooses the full-size bucket
            starts = starts[1:]
        if self._fused is not None and self._fused.mode == "force" and self._fused.cluster(step) is not None:
            self._chunks(x, out, starts, False)          # the fused network asked for: it runs the chunks itself
            return out
        # From three chunks on the pipe runs them (the plan's graph, the copies on several threads and overlapped
        # with the chunk before), also where the fused network won the full bucket: that choice timed one
        # chunk's call, its copies included, against the plan's, and over many chunks only the pipe overlaps
        # the copies.  (The CNN on 3x32x32: its fused network won the bucket at 3.9 ms a chunk against 4.9, both
        # mostly copies, and 10,000 images then ran at 0.55x PyTorch's rate: docs/performance, session 28.)
        self._pipelined(x, out, starts)
        return out

    def _pipelined(self, x, out, starts):
        """Chunks of a numpy input through the full-size bucket's graph with the copies overlapped
        (cpp/pipe.cu): the host copies chunk k into pinned memory while the device runs chunk k - 1.
        The last chunk may be short: it runs in the full bucket too (as ``_chunks`` would: no bucket
        lies between 256 and 1024 rows), its rows past the end being the previous chunk's, whose
        results are not read (rows are independent in eval mode)."""
        step, n = BUCKETS[-1], x.shape[0]
        _, runner = self._runner(step)
        xin, res = runner.bound.arrays["x"], runner.bound.arrays[runner.plan.output]
        if self._pipe is None:
            self._pipe = _C.Pipe(xin.nbytes, res.nbytes)
        pipe, pending = self._pipe, None
        for k, start in enumerate(starts):
            slot, m = k % 2, min(step, n - start)
            if m <= 256:                      # a short tail has a bucket of its own
                break
            pipe.upload(slot, xin if m == step else xin[:m], np.ascontiguousarray(x[start:start + m]))
            runner.launch()
            pipe.download(slot, res if m == step else res[:m])
            if pending is not None:
                pipe.finish(pending[0], out[pending[1]:pending[2]])
            pending = (slot, start, start + m)
        if pending is not None:
            pipe.finish(pending[0], out[pending[1]:pending[2]])
        tail = [s for s in starts if n - s <= 256]
        if tail:
            self._chunks(x, out, tail, False)

    def _chunks(self, x, out, starts, device_in):
        """The chunks of ``x`` at ``starts`` one after the other, each on its bucket's backend."""
        step = BUCKETS[-1]
        for start in starts:
            chunk = x[start:start + step]
            m = chunk.shape[0]
            bucket = next(b for b in BUCKETS if b >= m)
            cluster = self._fused.cluster(bucket) if self._fused is not None else None
            if cluster not in (None, "?"):           # the fused network, chosen for this bucket
                if device_in:
                    self._fused.net.forward(chunk, out[start:start + m], m, cluster)
                else:
                    out[start:start + m] = self._fused.net.run_host(chunk, cluster)
                continue
            if cluster == "?":                       # a first call: a kernel may start compiling before the plan
                self._fused.expect(bucket)
            bucket, runner = self._runner(m)
            arrays = runner.bound.arrays
            dst = arrays["x"] if m == bucket else arrays["x"][:m]
            if device_in:
                _C.copy_into(dst, chunk)
            else:
                dst.set_(chunk)
            if not runner.ready:
                runner.prepare(compare=(runner.plan.output,))
                if not runner.use_graph and self.mode == "graph":
                    self.mode, self.reason = "steps", runner.reason
            if cluster == "?":
                cluster = self._fused.choose(bucket, m, arrays["x"], runner.launch,
                                             lambda: arrays[runner.plan.output], log,
                                             host=None if device_in else chunk)
                if cluster is not None:
                    self._fused.net.forward(arrays["x"], self._fused.net._dy, m, cluster)
                    result = self._fused.net._dy[:m * self._fused.net.out_size].reshape((m,) + self.out_shape)
                    if device_in:
                        _C.copy_into(out[start:start + m], result)
                    else:
                        out[start:start + m] = result.numpy()
                    continue
            runner.launch()
            result = arrays[runner.plan.output]
            result = result if m == bucket else result[:m]
            if device_in:
                _C.copy_into(out[start:start + m], result)
            else:
                out[start:start + m] = result.numpy()


    def _preprocess(self, images):
        mean, std, pad = self.preprocess
        if images.ndim == 3 and self.input_shape[0] == 1:
            images = images[:, None]
        v = images.astype(np.float32)
        if images.dtype == np.uint8:
            v /= np.float32(255)
        if pad:
            v = np.pad(v, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        mean = np.asarray(mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(std, np.float32).reshape(-1, 1, 1)
        return np.ascontiguousarray((v - mean) / std, dtype=np.float32)

    def plan(self, batch=1):
        return _build_plan(self.model, self.input_shape, batch, False, self.options, softmax=self.softmax)[0]

    def explain(self, batch=1):
        self._fresh()
        runner = self._runners.get(batch)       # the bound plan (with its timed choices) where one runs
        text = (runner.plan if runner is not None else self.plan(batch)).explain()
        fused = self._fused
        if fused is not None and fused.net is not None and fused.clusters.get(batch) not in (None, "?"):
            text = (f"batches of {batch} run the fused network (cluster {fused.clusters[batch]}, timed "
                    f"{fused.timed_us[batch]} us):\n{fused.net.explain()}\nthe plan it was timed against:\n" + text)
        one = self._one
        if batch == 1 and one is not None:
            text = (f"one numpy image takes a settled route: one C call into the fused network (cluster "
                    f"{one[3].cluster}, {'its generated kernel' if one[3].kernel is not None else 'the interpreter'}), "
                    f"checked against the structure version and the generated kernels' changes\n" + text)
        if self._lenet is not None:
            text = ("numpy images run on the fused LeNet-5 kernel (one launch: preprocessing, both convolutions "
                    "with bias, activation and pooling, fc1-fc3, softmax); DeviceArray inputs run this plan:\n"
                    + text)
        return text

    def wait_generated(self, timeout=120):
        """Wait until the kernels being generated for this network (compiler/fused_net_gen.py, compiled in
        the background after the first calls) are done, and adopt those that pass their check and run
        faster: benchmarks and tests call it so that what they time is what later calls run.  Returns
        ``info()["fused_net"]["generated"]``."""
        fused = self._fused
        if fused is not None and fused.net is not None:
            with self._lock:
                hoped = [c for c, _, _ in fused.hoped.values()]
                for cluster in set(c for c in fused.clusters.values() if c not in (None, "?")) | set(hoped):
                    fused.net.generated.wait(cluster, timeout)
                for bucket in list(fused.hoped):          # timed against the plan again now, not in a later call
                    fused.cluster(bucket)
        return self.info()["fused_net"]["generated"] if fused is not None else None

    def info(self):
        fused = self._fused
        return {"mode": self.mode, "reason": self.reason, "lenet": self.lenet_reason or "fused kernel",
                "fused_net": (None if fused is None else
                              {"reason": fused.reason, "clusters": dict(fused.clusters), "timed_us": fused.timed_us,
                               "resident": (None if fused.net is None else
                                            {"reason": fused.net.resident_reason,
                                             "idle_us": fused.net.resident_idle_us,
                                             "served": dict(fused.net.served)}),
                               "generated": (None if fused.net is None else
                                             (fused.net.generated.reason or
                                              {c: dict(v) for c, v in fused.net.generated.info.items()}))}),
                "buckets": {b: (r.bound.graph.kernel_count if r.bound.graph is not None else None)
                            for b, r in self._runners.items()},
                "one_image_route": (None if self._one is None else
                                    {"cluster": self._one[3].cluster, "generated": self._one[3].kernel is not None})}
