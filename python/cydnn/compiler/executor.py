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
from ..errors import CydnnError
from .ir import ARENA_ROLES
from .lower import (CONV_BIAS_ACT, CONV_DIRECT, CONV_BACKWARD_DATA, CONV_BACKWARD_FILTER, GEMM, MAX_POOL_TILED,
                    conv_igemm_kernel, conv_igemm_name, conv_wgrad_kernel, conv_wgrad_name, skinny_gemm_kernel,
                    skinny_gemm_name)

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
#: a way whose first timing (warm: time_replayed warms it up) is over this many times the fastest way's first is
#: not timed again: the second round is there so that one slow moment does not decide between close ways, and
#: each timing of a large batch costs milliseconds (session 36: SmallCNN's compile at batch 256, 2.95 s, of which
#: 2.87 s in 518 timings of candidate ways)
SECOND_ROUND_WITHIN = 3.0
#: rounds of a trial between two ways of running the same thing (:func:`least_times`): the fused network's
#: generated kernel against its interpreter, the fused training step's cluster sizes and against the plan
TRIAL_ROUNDS = 2


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


def least_times(candidates, calls, rounds, timer=time_calls, after=None):
    """Seconds a call of each candidate takes (key -> zero-argument call; key -> seconds): the least of ``rounds``
    rounds that time every candidate in turn with ``timer(fn, calls)``, so that one slow moment of the machine --
    another process, the host's memory -- does not decide a choice for the life of the process (session 33: the
    all-conv plan's 10,000-image chunk timed once at 4x its usual lost its bucket to a slower kernel).  ``after``:
    called after each timing, even a failed one (a training step's timing restores the state it changed)."""
    best = {}
    for _ in range(rounds):
        for key, fn in candidates.items():
            try:
                t = timer(fn, calls)
            finally:
                if after is not None:
                    after()
            best[key] = min(t, best.get(key, t))
    return best


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


def _not_too_wide(tiles, i, n):
    """The (index, tile) pairs of ``tiles`` whose extent ``tile[i]`` is under twice ``n`` (beyond, most of a block's
    work would be padding), and those of the least extent, which are always kept."""
    least = min(t[i] for _, t in tiles)
    return [(k, t) for k, t in tiles if t[i] == least or t[i] < 2 * n]


def igemm_tiles(out_channels):
    """The implicit-GEMM convolution's tiles worth timing for a layer of ``out_channels`` output channels:
    (index, (rows, channels, threads, chunk, splits)) of those whose channels are not more than twice as many (the
    narrowest always kept)."""
    return _not_too_wide(list(enumerate(_C.igemm_conv_tiles())), 1, out_channels)


def skinny_tiles(m, n, k):
    """gemm_skinny.cu's tiles worth timing for an (m x n) product over k: (index, (rows, cols, threads, splits)) of
    those whose rows are not beyond m (or the fewest rows any tile has), whose columns are not more than twice n
    (or the narrowest of those), and whose split leaves every block of the cluster a chunk of 16 reductions (or
    the least split of those)."""
    tiles = list(enumerate(_C.skinny_gemm_tiles()))
    fewest = min(t[0] for _, t in tiles)
    tiles = _not_too_wide([(i, t) for i, t in tiles if t[0] <= max(m, fewest)], 1, n)
    least = min(t[3] for _, t in tiles)
    chunks = -(-k // 16)
    return [(i, t) for i, t in tiles if t[3] == least or t[3] <= chunks]


def _fastest(candidates, forced=None):
    """The fastest of ``candidates`` (name -> zero-argument call), each timed replayed as the plan's graph replays
    it, twice round, each keeping its lesser time (the first round also warms up: cuDNN's algorithm search, the
    graphs' first launches; one slow moment in the second round must not hand the step to a slower way) -- the
    second round only for those within SECOND_ROUND_WITHIN x the first round's fastest; a candidate that raises (a
    shape its kernel does not take) is dropped.  ``forced``: only the names it starts with
    (``$CYDNN_CONV`` or ``$CYDNN_LINEAR``, switches for tests and debugging), where any is left.  Returns
    (name, {name: us})."""
    kept = {k: f for k, f in candidates.items() if forced and k.startswith(forced)}
    for pool in (kept, candidates):
        times = dict.fromkeys(pool)
        for second in (False, True):
            close = SECOND_ROUND_WITHIN * min(times.values()) if second and times else None
            for name in [n for n in times if close is None or times[n] <= close]:
                try:
                    t = time_replayed(pool[name])
                    times[name] = t if times[name] is None else min(t, times[name])
                except CydnnError:
                    del times[name]
        if times:
            chosen = min(times, key=times.get)
            return chosen, {k: round(1e6 * t, 1) for k, t in times.items()}
    candidates["library"]()                      # the library's own way: let its error speak
    raise RuntimeError("no way of the step ran")


def _choose(s, candidates, kernels, env):
    """The fastest of ``candidates`` (:func:`_fastest`, ``$env`` forcing a way), recorded on step ``s``: the ways'
    timings (``timed_us``, where more than one ran) and the kernels the chosen way launches.  Returns its name."""
    chosen, timed = _fastest(candidates, os.environ.get(env))
    if len(timed) > 1:
        s.args["timed_us"] = timed
    s.kernels = kernels[chosen]
    return chosen


def _conv_forward(b, s):
    """The fastest, on these buffers and replayed as the plan's graph replays it, of cuDNN's convolution (+ the
    epilogue kernel, for a conv_bias_act step), the direct kernel (conv_bias_act), and the implicit-GEMM kernel's
    tiles (cpp/conv_igemm.cu), which take the bias and activation in their epilogue."""
    x, w, y = b[s.reads[0]], b[s.reads[1]], b[s.writes[0]]
    epilogue = s.kind == "conv_bias_act"
    bias = b.get(s.args["bias"]) if epilogue else None
    act, slope = (s.args["act"], s.args["slope"]) if epilogue else (0, 0.0)
    stride, padding = s.args["stride"], s.args["padding"]
    n, c = y.shape[0], y.shape[1]
    inner = _inner(y)

    def library():
        _C.conv_forward(x, w, None, y, stride, padding)
        if epilogue:
            _C.bias_act_forward(y, bias, y, n, c, inner, act, slope)

    def direct():
        _C.direct_conv_forward(x, w, bias, y, stride, padding, act, slope)

    def igemm(tile):
        return lambda: _C.igemm_conv_forward(x, w, bias, y, stride, padding, act, slope, tile)

    candidates = {"library": library}
    kernels = {"library": CONV_BIAS_ACT if epilogue else s.kernels}
    if epilogue:
        candidates["direct"], kernels["direct"] = direct, CONV_DIRECT
    for i, t in igemm_tiles(c):
        name = conv_igemm_name(t)
        candidates[name], kernels[name] = igemm(i), conv_igemm_kernel(t)
    return candidates[_choose(s, candidates, kernels, "CYDNN_CONV")], ()


def wgrad_tiles(out_channels, pixels):
    """The filter-gradient kernel's tiles worth timing for a layer of ``out_channels`` output channels and ``pixels``
    output pixels (n * oh * ow): (index, (channels, reductions, threads, splits)) of those whose channels are not
    more than twice as many (the narrowest always kept) and whose splits leave every block 4 chunks of 16 pixels."""
    chunks = -(-pixels // 16)
    return [(i, t) for i, t in _not_too_wide(list(enumerate(_C.conv_wgrad_tiles())), 0, out_channels)
            if 4 * t[3] <= max(chunks, 4)]


def _conv_backward(b, s):
    """A convolution's backward: where dx is asked and the stride is 1, dx by cuDNN or by an implicit-GEMM tile; then
    the filter gradient (beside dx on the second stream) by cuDNN or by a tile of cpp/conv_wgrad.cu -- each choice
    the fastest whole backward replayed."""
    x, w, dy = b[s.reads[0]], b[s.reads[1]], b[s.reads[2]]
    dx, dw = b.get(s.args["dx"]), b[s.args["dw"]]
    stride, padding = s.args["stride"], s.args["padding"]
    args = (x, w, dy, dx, dw, None, stride, padding)
    forced = os.environ.get("CYDNN_CONV")
    timed_all, dx_tile = {}, -1
    dx_kernels = (CONV_BACKWARD_DATA,) if dx is not None else ()
    if dx is not None and tuple(stride) == (1, 1):
        candidates = {"library": lambda: _C.conv_backward(*args)}
        tiles = {"library": (-1, None)}
        for i, t in igemm_tiles(x.shape[1]):
            name = conv_igemm_name(t)
            candidates[name], tiles[name] = (lambda tile=i: _C.conv_backward(*args, tile)), (i, t)
        chosen, timed = _fastest(candidates, forced)
        timed_all.update(timed)
        dx_tile, shape = tiles[chosen]
        if dx_tile >= 0:
            dx_kernels = conv_igemm_kernel(shape)
    candidates = {"library": lambda: _C.conv_backward(*args, dx_tile)}
    tiles = {"library": (-1, None)}
    pixels = dy.shape[0] * dy.shape[2] * dy.shape[3]
    for i, t in wgrad_tiles(w.shape[0], pixels):
        name = conv_wgrad_name(t)
        candidates[name], tiles[name] = (lambda tile=i: _C.conv_backward(*args, dx_tile, tile)), (i, t)
    chosen, timed = _fastest(candidates, forced) if len(candidates) > 1 else ("library", {})
    timed_all.update({("dw " + k if k == "library" else k): v for k, v in timed.items()})
    dw_tile, shape = tiles[chosen]
    if len(timed_all) > 1:
        s.args["timed_us"] = timed_all
    s.kernels = dx_kernels + (conv_wgrad_kernel(shape) if dw_tile >= 0 else (CONV_BACKWARD_FILTER,))
    return _C.conv_backward, args + (dx_tile, dw_tile)


def _linear_forward(b, s):
    """A linear layer's forward (its bias and a ReLU in the epilogue): cuBLASLt or a tile of the product with few
    rows (cpp/gemm_skinny.cu), whichever is faster on these buffers, replayed."""
    x, w, y = b[s.reads[0]], b[s.reads[1]], b[s.writes[0]]
    bias, act = b.get(s.args.get("bias")), s.args.get("act", 0)
    args = (x, w, bias, y, act)
    candidates = {"library": lambda: _C.linear_forward(*args)}
    kernels = {"library": s.kernels}
    for i, t in skinny_tiles(y.shape[0], y.shape[1], x.shape[1]):
        name = skinny_gemm_name(t)
        candidates[name] = lambda tile=i: _C.skinny_gemm(x, w, bias, y, False, act, 0.0, tile)
        kernels[name] = skinny_gemm_kernel(t)
    return candidates[_choose(s, candidates, kernels, "CYDNN_LINEAR")], ()


def _linear_backward(b, s):
    """A linear layer's backward: dw by cuBLASLt on the second stream; dx (where asked) beside it by cuBLASLt or a
    tile of the product with few rows, whichever is faster replayed."""
    x, w, dy = b[s.reads[0]], b[s.reads[1]], b[s.reads[2]]
    dx, dw = b.get(s.args["dx"]), b[s.args["dw"]]
    args = (x, w, dy, dx, dw, None)
    if dx is None:
        return _C.linear_backward, args
    candidates = {"library": lambda: _C.linear_backward(*args)}
    tiles, kernels = {"library": -1}, {"library": (GEMM, GEMM)}
    for i, t in skinny_tiles(dx.shape[0], dx.shape[1], dy.shape[1]):
        name = skinny_gemm_name(t)
        candidates[name] = lambda tile=i: _C.linear_backward(*args, tile)
        tiles[name], kernels[name] = i, skinny_gemm_kernel(t) + (GEMM,)     # dx's kernel, then dw's product
    return _C.linear_backward, args + (tiles[_choose(s, candidates, kernels, "CYDNN_LINEAR")],)


def _run_calls(calls):
    for fn, args in calls:
        fn(*args)


def _linear_xent(b, s):
    """The head (passes.fuse_head): cpp/compiled_head.cu's two kernels, or the four steps it replaced
    (``args["unfused"]``, each bound and tuned as the plan would), whichever is faster replayed."""
    a = s.args
    args = (b[s.reads[0]], b[s.reads[1]], b.get(a["bias"]), b["labels"], b[s.writes[0]], b[a["row_loss"]],
            b["loss"], b[s.writes[2]], b.get(a["dbias"]), b.get(a["dx"]), b[a["dw"]])
    steps = a["unfused"]
    calls = [DISPATCH[u.kind](b, u) for u in steps]
    candidates = {"fused": lambda: _C.linear_xent(*args), "library": lambda: _run_calls(calls)}
    kernels = {"fused": s.kernels, "library": sum((u.kernels for u in steps), ())}
    if _choose(s, candidates, kernels, "CYDNN_LINEAR") == "fused":
        return _C.linear_xent, args
    return _run_calls, (calls,)


#: step kind -> function(bound arrays, step) -> (library function, its arguments)
DISPATCH = {
    "conv_forward": _conv_forward,
    "conv_bias_act": _conv_forward,
    "linear_forward": _linear_forward,
    "bias_act_forward": lambda b, s: (_C.bias_act_forward, (
        b[s.reads[0]], b[s.reads[1]] if len(s.reads) > 1 else None, b[s.writes[0]],
        b[s.reads[0]].shape[0], b[s.reads[0]].shape[1], _inner(b[s.reads[0]]), s.args["act"], s.args["slope"])),
    "max_pool_forward": lambda b, s: ((_C.max_pool_tiled_forward, (b[s.reads[0]], b[s.writes[0]], s.args["kernel"]))
                                      if s.kernels == (MAX_POOL_TILED,) else
                                      (_C.max_pool_forward, (b[s.reads[0]], b[s.writes[0]]) + _pool_args(s))),
    "avg_pool_forward": lambda b, s: (_C.avg_pool_forward, (b[s.reads[0]], b[s.writes[0]]) + _pool_args(s)),
    "dropout_step": _dropout,
    "softmax": lambda b, s: (_C.softmax_forward, (b[s.reads[0]], b[s.writes[0]], False)),
    "softmax_cross_entropy": lambda b, s: (_C.softmax_cross_entropy, (b[s.reads[0]], b[s.reads[1]],
                                                                      b[s.writes[0]], b[s.writes[1]], None)),
    "bias_act_backward": lambda b, s: (_C.bias_act_backward, (
        b[s.reads[0]], b[s.reads[1]], b.get(s.args["dx"]), b.get(s.args["dbias"]),
        b[s.reads[0]].shape[0], b[s.reads[0]].shape[1], _inner(b[s.reads[0]]), s.args["act"], s.args["slope"])),
    "conv_backward": _conv_backward,
    "linear_backward": _linear_backward,
    "linear_xent": _linear_xent,
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
