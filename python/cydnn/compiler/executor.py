"""Stage 5: the executor -- a plan's buffers bound to device memory, its steps run or replayed.

``bind`` turns every buffer name into a DeviceArray (arena views at the planned offsets,
aliases as reshaped views, parameters as the model's arrays) and every step into one
``(function, arguments)`` pair through :data:`DISPATCH`, a table from a step's kind to
the library call that runs it (tinygrad's engine/realize.py keeps the same shape).

Three ways to run a bound plan:

- ``run_plain()``: every call in order (the steps launched one by one);
- ``capture()``: the same calls recorded once into a CUDA graph (cuDNN algorithms are
  chosen and workspaces grown by a warm-up run on the same stream first, so nothing is
  searched or allocated inside the capture; cpp/fastpath.cu keeps the blocks a graph
  uses out of the pool's reach), then ``launch()`` replays it with one call;
- ``CYDNN_DEBUG=2``: each step alone, synchronised and timed (printed).
"""
import os
import sys
import time

import numpy as np

from .. import _C
from .ir import ARENA_ROLES
from .lower import CONV_BIAS_ACT, CONV_DIRECT

__all__ = ["Bound", "DISPATCH"]

F32 = np.dtype(np.float32)


def _pool_args(s):
    return s.args["kernel"], s.args["stride"], s.args["padding"]


def _dropout(b, s):
    p = s.args["p"]
    threshold = min(int(round(p * 2 ** 24)), 2 ** 24)
    return _C.dropout_step, (b[s.reads[0]], b[s.writes[0]], b[s.writes[1]], threshold, 1.0 / (1.0 - p),
                             s.args["seed"], b["counters"])


#: launches per variant when the executor times the two ways of a convolution with bias and activation
TUNE_CALLS = 10


def time_calls(fn, calls=TUNE_CALLS):
    """Seconds one call of ``fn`` takes on the device: one warm-up call, then ``calls`` calls between two
    device synchronisations (host launch costs included, as a plan pays them)."""
    fn()
    _C.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _C.synchronize()
    return (time.perf_counter() - t0) / calls


def time_replayed(fn, calls=TUNE_CALLS):
    """Seconds one call of ``fn`` takes on the device as a captured plan runs it: one warm-up call (an
    algorithm search happens there, outside any capture), then ``calls`` calls captured into one CUDA graph,
    replayed once to warm it and once timed.  The host's launch costs are not in it: a plan replayed as a
    graph does not pay them (timing eager calls did, and chose the direct convolution kernel for the 3x32x32
    CNN's training step, 1.8x slower there than cuDNN's: docs/performance.md, session 22).  Where the
    capture fails, the eager calls are timed instead."""
    fn()
    _C.synchronize()
    _C.graph_begin()
    try:
        for _ in range(calls):
            fn()
    except BaseException:
        _C.graph_end(discard=True)
        return time_calls(fn, calls)
    graph = _C.graph_end()
    graph.launch()
    _C.synchronize()
    t0 = time.perf_counter()
    graph.launch()
    _C.synchronize()
    return (time.perf_counter() - t0) / calls


def _conv_bias_act(b, s):
    """The faster, on these buffers and replayed as the plan's graph replays it, of cuDNN's convolution + the
    epilogue kernel and the direct kernel."""
    x, w, y = b[s.reads[0]], b[s.reads[1]], b[s.writes[0]]
    bias, act, slope = b.get(s.args["bias"]), s.args["act"], s.args["slope"]
    n, c = y.shape[0], y.shape[1]
    inner = _inner(y)

    def library():
        _C.conv_forward(x, w, None, y, s.args["stride"], s.args["padding"])
        _C.bias_act_forward(y, bias, y, n, c, inner, act, slope)

    def direct():
        _C.direct_conv_forward(x, w, bias, y, s.args["stride"], s.args["padding"], act, slope)

    if os.environ.get("CYDNN_CONV") in ("library", "direct"):       # a switch for tests and debugging
        chosen = library if os.environ["CYDNN_CONV"] == "library" else direct
    else:
        times = {}
        for fn in (library, direct, library, direct):                # warm-up (algorithm search), then timed
            times[fn] = time_replayed(fn)
        chosen = min(times, key=times.get)
        s.args["timed_us"] = {f.__name__: round(1e6 * t, 1) for f, t in times.items()}
    s.kernels = CONV_DIRECT if chosen is direct else CONV_BIAS_ACT
    return chosen, ()


#: step kind -> function(bound arrays, step) -> (library function, its arguments)
DISPATCH = {
    "conv_forward": lambda b, s: (_C.conv_forward, (b[s.reads[0]], b[s.reads[1]], None, b[s.writes[0]],
                                                    s.args["stride"], s.args["padding"])),
    "conv_bias_act": _conv_bias_act,
    "linear_forward": lambda b, s: (_C.linear_forward, (b[s.reads[0]], b[s.reads[1]], b.get(s.args.get("bias")),
                                                        b[s.writes[0]], s.args.get("act", 0))),
    "bias_act_forward": lambda b, s: (_C.bias_act_forward, (
        b[s.reads[0]], b[s.reads[1]] if len(s.reads) > 1 else None, b[s.writes[0]],
        b[s.reads[0]].shape[0], b[s.reads[0]].shape[1], _inner(b[s.reads[0]]), s.args["act"], s.args["slope"])),
    "max_pool_forward": lambda b, s: (_C.max_pool_forward, (b[s.reads[0]], b[s.writes[0]]) + _pool_args(s)),
    "avg_pool_forward": lambda b, s: (_C.avg_pool_forward, (b[s.reads[0]], b[s.writes[0]]) + _pool_args(s)),
    "dropout_step": _dropout,
    "softmax": lambda b, s: (_C.softmax_forward, (b[s.reads[0]], b[s.writes[0]], False)),
    "softmax_cross_entropy": lambda b, s: (_C.softmax_cross_entropy, (b[s.reads[0]], b[s.reads[1]],
                                                                      b[s.writes[0]], b[s.writes[1]], None)),
    "bias_act_backward": lambda b, s: (_C.bias_act_backward, (
        b[s.reads[0]], b[s.reads[1]], b.get(s.args["dx"]), b.get(s.args["dbias"]),
        b[s.reads[0]].shape[0], b[s.reads[0]].shape[1], _inner(b[s.reads[0]]), s.args["act"], s.args["slope"])),
    "conv_backward": lambda b, s: (_C.conv_backward, (b[s.reads[0]], b[s.reads[1]], b[s.reads[2]],
                                                      b.get(s.args["dx"]), b[s.args["dw"]], None,
                                                      s.args["stride"], s.args["padding"])),
    "linear_backward": lambda b, s: (_C.linear_backward, (b[s.reads[0]], b[s.reads[1]], b[s.reads[2]],
                                                          b.get(s.args["dx"]), b[s.args["dw"]], None)),
    "max_pool_act_backward": lambda b, s: (_C.max_pool_act_backward, (
        b[s.reads[0]], b[s.reads[1]], b[s.args["dx"]], b.get(s.args["dbias"]), s.args["kernel"], s.args["act"],
        s.args["slope"])),
    "max_pool_backward": lambda b, s: (_C.max_pool_backward, (b[s.reads[0]], b[s.reads[1]], b[s.writes[0]])
                                       + _pool_args(s)),
    "avg_pool_backward": lambda b, s: (_C.avg_pool_backward, (b[s.reads[0]], b[s.reads[1]], b[s.reads[2]],
                                                              b[s.writes[0]]) + _pool_args(s)),
    "mul": lambda b, s: (_C.mul, (b[s.reads[0]], b[s.reads[1]], b[s.writes[0]])),
    "batch_norm_forward": lambda b, s: (_C.batch_norm_forward, (
        b[s.reads[0]], b[s.reads[1]], b[s.reads[2]], b[s.reads[3]], b[s.reads[4]], s.args["training"],
        s.args["momentum"], s.args["eps"], b[s.writes[0]], b.get(s.args["saved"][0]), b.get(s.args["saved"][1]))),
    "bn_act_forward": lambda b, s: (_C.bn_act_forward_train, (
        b[s.reads[0]], b[s.reads[1]], b[s.reads[2]], b[s.reads[3]], b[s.reads[4]], s.args["momentum"],
        s.args["eps"], b[s.writes[0]], b[s.args["saved"][0]], b[s.args["saved"][1]], s.args["act"], s.args["slope"])),
    "bn_act_backward": lambda b, s: (_C.bn_act_backward, (
        b[s.args["x"]], b.get(s.args["y"]), b[s.args["dy"]], b[s.args["gamma"]], b[s.args["saved"][0]],
        b[s.args["saved"][1]], b.get(s.args["dx"]), b[s.args["grads"][0]], b[s.args["grads"][1]], s.args["act"],
        s.args["slope"])),
    "fold_batch_norm": lambda b, s: (_C.fold_batch_norm, (
        b[s.reads[0]], b.get(s.args["bias"]), *(b[n] for n in s.args["stats"]), s.args["eps"],
        b[s.writes[0]], b[s.writes[1]])),
    "flat_update": lambda b, s: (b["__update__"].enqueue, ()),
    "step_bookkeeping": lambda b, s: (_C.step_bookkeeping, (b[s.reads[0]], b[s.reads[1]], b[s.reads[2]],
                                                            b["counters"])),
}


def _inner(a):
    n = 1
    for d in a.shape[2:]:
        n *= d
    return n


def _debug_level():
    try:
        return int(os.environ.get("CYDNN_DEBUG", "0"))
    except ValueError:
        return 0


class Bound:
    """A plan with device memory: ``arrays`` (name -> DeviceArray) and ``calls`` (one per step).

    ``given``: arrays the caller owns (parameters, their gradients, the control buffers,
    the flat update); the rest (the arena, the input, labels, output) are allocated here.
    """

    def __init__(self, plan, given):
        self.plan = plan
        arrays = dict(given)
        self.arena = _C.empty((max(1, plan.arena_bytes // 4),)) if plan.arena_bytes else None
        for name, buf in plan.buffers.items():
            if name in arrays or buf.alias_of:
                continue
            if buf.role in ARENA_ROLES:
                arrays[name] = _C.view(self.arena, buf.offset // 4, buf.shape)
            elif buf.role in ("input", "label", "output"):
                arrays[name] = _C.empty(buf.shape, buf.dtype)
            else:
                raise ValueError(f"compiler: buffer {name!r} ({buf.role}) was not given")
        for name, buf in plan.buffers.items():      # aliases, after their bases (in plan order)
            if buf.alias_of:
                arrays[name] = arrays[buf.alias_of].reshape(buf.shape)
        self.arrays = arrays
        self.calls = [DISPATCH[s.kind](arrays, s) for s in plan.steps]
        self.graph = None

    def run_plain(self):
        if _debug_level() >= 2:
            return self._run_debug()
        for fn, args in self.calls:
            fn(*args)

    def _run_debug(self):
        for step, (fn, args) in zip(self.plan.steps, self.calls):
            _C.synchronize()
            t0 = time.perf_counter()
            fn(*args)
            _C.synchronize()
            print(f"[cydnn] {step.name:<28} {1e6 * (time.perf_counter() - t0):9.1f} us", file=sys.stderr)

    def capture(self):
        """Record the calls into a CUDA graph (after a warm-up run by the caller)."""
        _C.graph_begin()
        try:
            for fn, args in self.calls:
                fn(*args)
        except BaseException:
            _C.graph_end(discard=True)
            raise
        self.graph = _C.graph_end()
        return self.graph

    def launch(self):
        if self.graph is not None and _debug_level() < 2:
            self.graph.launch()
        else:
            self.run_plain()
