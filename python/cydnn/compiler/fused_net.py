"""The fused network: a whole inference forward in one kernel launch (cpp/fused_net.cu).

The generic inference plan (lower.py) runs one library call or kernel per layer, each a trip
through device memory and a launch of a few microseconds; for one image that is most of the
time.  Where a network's activations for one image fit in shared memory, this backend describes
its layers as a table (:func:`describe`) that one kernel interprets: the image stays in shared
memory from the input to the logits, and a thread-block cluster of up to 16 blocks (on as many
SMs) shares each layer's work, every block storing its slice of the outputs into every block's
shared memory.

What the table holds, from the traced nodes:

- convolution, linear, max / average pooling, global average pooling: a layer each;
- activation and batch norm (eval mode: the running statistics): steps of the epilogue of the
  layer before (at most three), or an "epilogue" layer of their own when there is none to ride on
  (or batch norm's channels are not that layer's, e.g. after a Flatten);
- Flatten and Dropout (eval mode): nothing -- the table's activations are (c, h, w) flattened.

The table refers to the model's device arrays (weights, biases, running statistics) directly: a
training step's in-place updates are seen by the next call; a replaced array changes the model's
structure version, on which :class:`~cydnn.compiler.inference.CompiledInference` re-plans.

``CompiledInference`` times this kernel (at each cluster size) against the generic plan's graph
for each batch bucket and keeps the faster one (fused_choice.py; ``info()["fused_net"]`` shows the choice).
"""
import os

import numpy as np

from .. import _C
from . import fused_net_gen, fused_tiles, nvrtc_jobs
from .executor import TRIAL_ROUNDS, least_times, time_calls
from .fused_tiles import THREADS, TUNED_CLUSTERS  # noqa: F401  (THREADS: the kernel's, for the tables' users)
from .fused_tiles import channels as _channels, size as _size, staged as _staged, tile as _tile
from .trace import slope

__all__ = ["describe", "FusedNetwork", "CLUSTERS", "SMEM_LIMIT", "resident_idle_us"]

#: cluster sizes tried (blocks per image; 16 is sm_90's non-portable size)
CLUSTERS = (1, 2, 4, 8, 16)
#: shared memory one block may use on sm_90 (bytes), less the kernel's own
SMEM_LIMIT = 227 * 1024 - 256
#: numpy calls of up to this many images go through mapped pinned memory (FusedNetwork.run_host)
MAPPED_ROWS = 64
#: microseconds the resident kernel waits for the next one-image call before it gives its SMs back
#: (cpp/fused_net_resident.cu): 0, off, unless ``compile(..., resident_us=N)`` or
#: ``$CYDNN_RESIDENT_IDLE_US`` asks for it (docs/performance.md, "Session 18", says what it costs)
RESIDENT_IDLE_US = 0
_RESIDENT_MAX_US = 10_000_000


def resident_idle_us(value=None, environ=None):
    """The resident kernel's idle time in microseconds: ``value`` (compile's ``resident_us``) where
    given, else ``$CYDNN_RESIDENT_IDLE_US``, else RESIDENT_IDLE_US; 0 is off.  Anything but an
    integer in [0, 10_000_000] is refused with ValueError naming where it came from."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _RESIDENT_MAX_US:
            raise ValueError(f"compile: resident_us must be an integer number of microseconds in [0, "
                             f"{_RESIDENT_MAX_US}] (0: no resident kernel), got {value!r}")
        return int(value)
    text = (os.environ if environ is None else environ).get("CYDNN_RESIDENT_IDLE_US")
    if text is None or not text.strip():
        return RESIDENT_IDLE_US
    try:
        number = int(text.strip())
    except ValueError:
        number = -1
    if not 0 <= number <= _RESIDENT_MAX_US:
        raise ValueError(f"CYDNN_RESIDENT_IDLE_US must be an integer number of microseconds in [0, "
                         f"{_RESIDENT_MAX_US}] (0: no resident kernel), got {text!r}")
    return number


#: the smallest cluster the resident kernel serves: it reads weights through L2 only (never a line
#: cached by an earlier call), which costs nothing where each block stages its share of a layer's
#: weights once (8-16 blocks an image) and 30 % where one block re-reads them (cnn32 at cluster 1:
#: 386 vs 297 us on the H100; docs/performance.md, "Session 18")
RESIDENT_MIN_CLUSTER = 8

#: the last layer runs as a "tail" (a linear layer of at most TAIL_MAX outputs right after a linear layer: each
#: block multiplies its own share of the input, rank 0 adds the partial sums; the layer before keeps its outputs in
#: its own block and needs no cluster barrier -- cpp/fused_net_layers.cuh, linear_tail) unless $CYDNN_FUSED_TAIL is 0
TAIL_MAX = 64


def tail_enabled(environ=None):
    """``$CYDNN_FUSED_TAIL``: 1 (default) or 0 (every linear layer broadcasts its outputs); anything else is
    refused."""
    return fused_net_gen._switch("CYDNN_FUSED_TAIL", environ)


def mark_tail(layers, environ=None):
    """``layers`` with the last one a tail (``tile`` 1, a copy of its dict) where it is a linear layer of at most
    TAIL_MAX outputs after a linear layer, its partial sums fit the shared memory beside its input (``tail_floats``
    in each of the two buffers) and ``tail_enabled``; else ``layers`` as they are."""
    if (not tail_enabled(environ) or len(layers) < 2 or layers[-1]["op"] != "linear"
            or layers[-2]["op"] != "linear" or layers[-1]["k"] > TAIL_MAX):
        return layers
    tail = dict(layers[-1], tile=1)
    return layers if 8 * tail_floats(tail) > SMEM_LIMIT else layers[:-1] + [tail]


def tail_floats(layer):
    """Floats of an activation buffer a tail needs: its input and the partial sums of up to 16 blocks (0 for
    any other layer; cydnn_fused_net_check's rule)."""
    return layer["c"] + 16 * layer["k"] if layer["op"] == "linear" and layer.get("tile") == 1 else 0


_ACTS = {"relu": _C.ACT_RELU, "tanh": _C.ACT_TANH, "sigmoid": _C.ACT_SIGMOID, "leaky_relu": _C.ACT_LEAKY}
def _epilogue_layer(shape):
    c = shape[1]
    h, w = (shape[2], shape[3]) if len(shape) == 4 else (1, 1)
    return {"op": "epilogue", "c": c, "h": h, "w": w, "epi": [], "node": None}


def describe(nodes):
    """The table's layers for traced ``nodes`` (batch 1), without arrays: a list of dicts, or a
    string saying why the network does not fit the fused kernel."""
    layers = []
    for node in nodes:
        op, m, shape = node.op, node.module, node.in_shape
        if op in ("flatten", "dropout"):
            continue
        if op == "conv2d":
            (_, c, h, w), (_, k, oh, ow) = shape, node.out_shape
            kh, kw = m.weight.shape[2:]
            (sh, sw), (ph, pw) = node.attrs["stride"], node.attrs["padding"]
            layers.append(dict(op="conv", c=c, h=h, w=w, k=k, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph,
                               pw=pw, epi=[], node=node))
        elif op == "linear":
            layers.append(dict(op="linear", c=shape[1], h=1, w=1, k=node.out_shape[1], epi=[], node=node))
        elif op in ("max_pool", "avg_pool", "global_avg_pool"):
            (_, c, h, w), (_, _, oh, ow) = shape, node.out_shape
            (kh, kw), (sh, sw), (ph, pw) = node.attrs["kernel"], node.attrs["stride"], node.attrs["padding"]
            layers.append(dict(op=op, c=c, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
                               epi=[], node=node))
        elif op in _ACTS or op == "batch_norm":
            last = layers[-1] if layers else None
            kind = _C.NET_EPI_BN if op == "batch_norm" else _C.NET_EPI_ACT
            inner = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
            fits = (last is not None and len(last["epi"]) < 3 and kind not in last["epi"]
                    and (kind == _C.NET_EPI_ACT or _channels(last) == (shape[1], inner)))
            if not fits:
                last = _epilogue_layer(shape)
                layers.append(last)
            last["epi"].append(kind)
            if kind == _C.NET_EPI_BN:
                last["bn"] = node
            else:
                last["act"], last["slope"] = _ACTS[op], slope(m)
        else:
            return f"layer {node.name}: the fused kernel has no {op}"
    if not layers:
        return "nothing to compute (only Flatten / Dropout layers)"
    if len(layers) > _C.NET_MAX_LAYERS:
        return f"{len(layers)} layers, the fused kernel takes {_C.NET_MAX_LAYERS}"
    width = max([int(np.prod(nodes[0].in_shape[1:]))] + [_size(layer) for layer in layers])
    if 8 * width > SMEM_LIMIT:
        return (f"the widest activation has {width} values: two buffers of it need {8 * width} bytes of shared "
                f"memory, more than {SMEM_LIMIT}")
    return layers


class FusedNetwork:
    """The tables of one network (one per cluster size), bound to the model's arrays now.

    ``forward(x, y, n, cluster)`` on DeviceArrays; ``run_host(x, cluster)`` numpy in, numpy out
    through staging buffers for up to ``capacity`` images.
    """

    def __init__(self, layers, in_shape, out_shape, softmax, capacity, resident_us=None):
        on = fused_net_gen.enabled()
        fused_net_gen.fast_compile()              # a wrong $CYDNN_NVRTC_FAST_COMPILE is refused here, not later
        fused_net_gen.split_layers()              # and a wrong $CYDNN_NVRTC_SPLIT
        self.in_shape, self.in_size = tuple(int(v) for v in in_shape), int(np.prod(in_shape))
        self.out_shape = tuple(out_shape)
        self.out_size = int(np.prod(out_shape))
        self.layers = layers = mark_tail(layers)
        width = max([self.in_size] + [max(_size(layer), tail_floats(layer)) for layer in layers])
        self.tables, self._bound, self._bufs = {}, {}, {}
        self.softmax, self._buf_floats = bool(softmax), -(-width // 4) * 4
        room = SMEM_LIMIT // 4 - 2 * self._buf_floats      # floats left beside the two activation buffers
        for r in CLUSTERS:
            bound = [self._bind(layer, r) for layer in layers]
            if r in TUNED_CLUSTERS:
                for d in bound:
                    if d["op"] == "conv":
                        fused_tiles.tune(d, r, room, self._buf_floats)
                bound = fused_tiles.fold(bound, r, room)
            wcap = min(room, max([_staged(d, r) for d in bound] + [0]))
            self.tables[r] = _C.FusedNet(bound, self.in_size, self.out_size, bool(softmax), wcap)
            self._bound[r] = (bound, wcap)
            # the table's activation buffers, as cydnn_fused_net_check sized them (smaller than _buf_floats where
            # a folded pooling's input is no activation any more)
            self._bufs[r] = (self.tables[r].smem_bytes // 4 - wcap) // 2
        # kernels generated for this network (fused_net_gen.py), per cluster size, compiled in the background
        # (nvrtc_jobs.py)
        self.generated = nvrtc_jobs.GeneratedKernels(self._source, self._trial, on)
        self.capacity = capacity
        self._dx = _C.empty((capacity * self.in_size,))
        self._dy = _C.empty((capacity * self.out_size,))
        self._mapped, self.mapped_reason = None, None    # mapped pinned in/out buffers, made on first use
        # one-image numpy calls: the resident kernel (one per cluster size, made on first use)
        self.resident_idle_us = resident_idle_us(resident_us)
        self.resident_reason = None if self.resident_idle_us else "off (resident_us=0)"
        self._residents = {}
        self.served = {"resident": 0, "launched": 0}

    @staticmethod
    def _bind(layer, ranks):
        d = {k: v for k, v in layer.items() if k not in ("node", "bn")}    # (a tail keeps its tile 1)
        if layer["op"] == "conv":
            d["tile"] = _tile(layer, ranks)
        node = layer.get("node")
        if node is not None and layer["op"] in ("conv", "linear"):
            d["weight"] = node.module.weight.data
            d["bias"] = node.module.bias.data if node.module.bias is not None else None
        bn = layer.get("bn")
        if bn is not None:
            m = bn.module
            d.update(bn_mean=m.running_mean, bn_var=m.running_var, bn_weight=m.weight.data, bn_bias=m.bias.data,
                     bn_eps=float(m.eps))
        return d

    def _source(self, cluster, form="whole"):
        """The generated kernel's source for ``cluster``: one text (``form`` "whole") or the list of translation
        units of the "layers" form (fused_net_gen.units)."""
        bound, wcap = self._bound[cluster]
        make = fused_net_gen.units if form == "layers" else fused_net_gen.source
        return make(bound, cluster, wcap, self._bufs[cluster], self.in_size, self.out_size, self.softmax)

    def _trial(self, cluster, kernel, serving=None):
        """The generated kernel against the interpreter on one and on several random images: the same
        outputs (within 1e-5: the same code and order, so in practice the same bits), then both timed, in turn
        over the same rounds; ``serving``: the generated kernel in use for ``cluster`` (another form), timed in
        those rounds too (``timed_us["in_use"]``)."""
        n = min(self.capacity, 4)
        rng = np.random.default_rng(0)
        x = _C.to_device(rng.standard_normal(n * self.in_size).astype(np.float32))
        # Other images go through the interpreter right before the kernel: whatever a block of the kernel leaves
        # unwritten (a layer whose instance assumes what does not hold -- SPLIT, STAGED -- stores nothing) then holds
        # another image's values, in shared memory left from that launch and in the output, never the right ones.
        other = _C.to_device(rng.standard_normal(n * self.in_size).astype(np.float32))
        want = _C.empty((n * self.out_size,))
        table = self.tables[cluster]
        for m in sorted({1, n}):
            table.forward(x, want, m, cluster)
            table.forward(other, self._dy, m, cluster)
            table.forward(x, self._dy, m, cluster, kernel)
            ref, got = want.numpy()[:m * self.out_size], self._dy.numpy()[:m * self.out_size]
            diff = float(np.max(np.abs(got - ref))) if ref.size else 0.0
            if not np.allclose(got, ref, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(ref).max()))):
                return False, {"reason": f"self-test: {m} images differ from the interpreter's by {diff:.3g}"}
        candidates = {"interpreter": lambda: table.forward(x, self._dy, 1, cluster),
                      "generated": lambda: table.forward(x, self._dy, 1, cluster, kernel)}
        if serving is not None:
            candidates["in_use"] = lambda: table.forward(x, self._dy, 1, cluster, serving)
        times = least_times(candidates, 20, TRIAL_ROUNDS, timer=time_calls)
        trial = {"max_diff": diff, "timed_us": {k: round(1e6 * t, 1) for k, t in times.items()}}
        return times["generated"] < times["interpreter"], trial

    def forward(self, x, y, n, cluster):
        self.tables[cluster].forward(x, y, n, cluster, self.generated.get(cluster))

    def run_host(self, x, cluster):
        """x: float32 (n, *in_shape), n <= capacity -> numpy (n, *out_shape).  One image on a cluster of
        RESIDENT_MIN_CLUSTER blocks or more goes to the resident kernel (no launch:
        cpp/fused_net_resident.cu) where it is asked for and no generated kernel serves the cluster; up to
        MAPPED_ROWS images through mapped pinned memory (one launch and one wait: ~6 us less than two
        copies on the stream); more, or where mapped memory cannot be had, through the staging
        buffers."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        n = x.shape[0]
        out = np.empty((n,) + self.out_shape, np.float32)
        kernel = self.generated.get(cluster)
        if n == 1 and self._resident_serves(cluster, kernel):
            resident = self._residents.get(cluster) or self._resident(cluster)
            if resident is not None:
                self.served["resident" if resident.run(x, out) else "launched"] += 1
                return out
        if n <= MAPPED_ROWS and self._mapped_buffers():
            self.tables[cluster].run_mapped(x, out, *self._mapped, cluster, kernel)
        else:
            self.tables[cluster].run_host(x, out, self._dx, self._dy, cluster, kernel)
        return out

    def mapped_call(self, cluster):
        """A ``_C.MappedCall`` for one-image numpy calls on ``cluster``, with the kernel in use now (the caller
        checks ``generated.changes`` before each call), or None where ``run_host`` would take another way: the
        resident kernel, or no mapped memory."""
        kernel = self.generated.get(cluster)
        if self._resident_serves(cluster, kernel) or not self._mapped_buffers():
            return None
        return _C.MappedCall(self.tables[cluster], *self._mapped, cluster, kernel, self.in_shape, self.out_shape)

    def _resident_serves(self, cluster, kernel):
        """Whether one image on ``cluster`` goes to the resident kernel (``run_host``), ``kernel`` being the generated
        kernel in use there: where it is asked for, the cluster is large enough and no generated kernel serves."""
        return kernel is None and cluster >= RESIDENT_MIN_CLUSTER and self.resident_reason is None

    def _mapped_buffers(self):
        """The mapped pinned in/out buffers of MAPPED_ROWS images (made on first use), or False where the
        system refused them (``mapped_reason`` says why)."""
        if self._mapped is None:
            try:
                self._mapped = (_C.MappedBuffer(4 * MAPPED_ROWS * self.in_size),
                                _C.MappedBuffer(4 * MAPPED_ROWS * self.out_size))
            except _C.CydnnError as e:
                self._mapped = False
                self.mapped_reason = str(e)
        return self._mapped

    def _resident(self, cluster):
        """The resident kernel for ``cluster`` (made now), or None with the reason kept."""
        try:
            self._residents[cluster] = _C.ResidentNet(self.tables[cluster], cluster, self.resident_idle_us)
        except _C.CydnnError as e:
            self.resident_reason = f"no resident kernel: {e}"
            return None
        return self._residents[cluster]

    def stop_resident(self):
        """Make every resident kernel of this network return now (they start again on the next call)."""
        for resident in self._residents.values():
            resident.stop()

    def explain(self):
        acts = {v: k for k, v in _ACTS.items()}
        lines = [f"fused network: one kernel launch, {len(self.layers)} layers, activations in shared memory "
                 f"({self.tables[1].smem_bytes} bytes a block), a cluster of {'/'.join(map(str, CLUSTERS))} "
                 f"blocks per image"]
        for layer in self.layers:
            node, bn = layer.get("node"), layer.get("bn")
            steps = ["bias"] if layer["op"] in ("conv", "linear") and node.module.bias is not None else []
            steps += ["batch_norm" if e == _C.NET_EPI_BN else acts[layer["act"]] for e in layer["epi"]]
            name = node.name if node is not None else (bn.name if bn is not None else "-")
            tail = "  (tail: each block's share of the input, partial sums added by block 0)" if tail_floats(layer) else ""
            lines.append(f"  {layer['op']:<16} {name:<16} {layer['c']}x{layer['h']}x{layer['w']} -> "
                         f"{_size(layer):<8} epilogue: {' + '.join(steps) or '-'}{tail}")
        bound = getattr(self, "_bound", {}).get(CLUSTERS[-1], ([], 0))[0]
        tiles = [f"{d['tile']}{' + 2x2 pooling' if d.get('pool') else ''} {d.get('tile_us', {})}"
                 + (f" {d['fold_us']}" if "fold_us" in d else "") for d in bound if "tile_us" in d or "fold_us" in d]
        if tiles:
            lines.append(f"convolution tiles at {CLUSTERS[-1]} blocks, timed (tile {{tile: us}}): " + "; ".join(tiles))
        gen = self.generated
        said = [f"cluster {c}: {v['status']}" + (f" ({v['form']} form)" if "form" in v else "")
                for c, v in sorted(gen.info.items())]
        lines.append("kernels generated for this network (fused_net_gen.source(...) prints one): "
                     + (gen.reason or ", ".join(said) or "none yet"))
        return "\n".join(lines)
