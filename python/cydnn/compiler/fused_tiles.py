"""The fused network's convolution tiles (cpp/fused_net_conv.cuh, cpp/fused_net_wsplit.cuh): which tile a
layer takes, what its weights need, the poolings that fold into a convolution -- by a cost model, and for
clusters of TUNED_CLUSTERS blocks by timing one-layer tables on the GPU (:func:`tune`, :func:`fold`).

``layer`` arguments are the table's dicts (compiler/fused_net.py's ``describe`` / ``FusedNetwork._bind``).
"""
import os

import numpy as np

from .. import _C
from .executor import time_calls

#: threads per block of the kernel (cpp/fused_net.cu's kNetThreads, cpp/fused_net_wsplit.cuh's kWsplitThreads)
THREADS = 512
#: cluster sizes whose convolution tiles are chosen by timing (tune): the cost model's
#: TUNE_CANDIDATES cheapest tiles and the split tile (7), each on a one-layer table; smaller clusters (many
#: images, few blocks each) take the cost model's choice, without tile 7
TUNED_CLUSTERS = (4, 8, 16)
TUNE_CANDIDATES = 3
#: a pair folds where its one-layer table times under FOLD_MARGIN x the two layers apart (on the interpreter):
#: a fold removes a layer and a cluster barrier, which the kernel generated for the network (what serves once
#: NVRTC is done) gains more from than the interpreter does -- the 3x32x32 CNN's last convolution and
#: pooling timed 4 % slower folded on the interpreter, and its generated kernel 1.3 us (4 %) faster folded
#: (H100, docs/performance.md, session 26)
FOLD_MARGIN = 1.10

# tile code -> (output channels, output pixels, lanes sharing the reduction) per work item, biggest first;
# 0 lanes: tile 7 (conv_wsplit), the reduction split between the block's threads through scratch
TILES = ((3, 4, 4, 1), (2, 4, 1, 1), (1, 1, 4, 1), (0, 1, 1, 1), (4, 4, 1, 4), (5, 4, 1, 8), (6, 4, 1, 16),
         (7, 4, 4, 0))


def wsplit_ways(layer, ranks, scratch_floats):
    """The ways tile 7 splits a block's reduction into (cpp/fused_net_conv.cuh's wsplit_ways): one work item
    and way a thread, at most one way an input channel, 16 partial sums a work item and way in the scratch
    (the layer's input buffer, ``scratch_floats``); 0 where fewer than 2 (the tile is then tile 3's)."""
    per = -(-wsplit_items(layer) // ranks)
    ways = min(THREADS // per, layer["c"], scratch_floats // (16 * per))
    return ways if ways >= 2 else 0


def linear_parts(rows, n, warps=THREADS // 32, group=4):
    """The ways a linear layer's block splits each row group's inputs (cpp/fused_net_layers.cuh's
    linear_parts): ``rows`` rows a block, ``n`` input steps (float4s where the inputs are a multiple of 4),
    row groups of ``group``; 1 (no split) unless each part gets a warp's width of inputs and the parts fit
    in 32 floats."""
    groups = -(-rows // group)
    if groups == 0 or groups * group > 16:
        return 1
    parts = min(warps // groups, 32 // (groups * group), n // 32)
    return parts if parts >= 2 else 1


def linear_splits(layer, ranks):
    """Whether some block of a cluster of ``ranks`` may split linear ``layer``'s inputs between warps (its
    rows: its share of the outputs, as the device's ``share`` gives them -- ceil(k / ranks) a block, the last
    ones fewer or none; its input steps: float4s, or floats where the weight is not 16-byte aligned): a
    kernel generated for the network passes the split's scratch only then, so that NVRTC compiles no split
    where none can happen."""
    per = -(-layer["k"] // ranks)
    rows = {max(0, min(per, layer["k"] - per * rank)) for rank in range(ranks)}
    steps = {layer["c"]} | ({layer["c"] // 4} if layer["c"] % 4 == 0 else set())
    return any(linear_parts(r, n) > 1 for r in rows for n in steps)


def wsplit_items(layer):
    """Tile 7's work items: 4 channels x 4 pixels of a row, or with a pooling folded in, x a 2x2 window."""
    if layer.get("pool"):
        return -(-layer["k"] // 4) * (layer["oh"] // 2) * (layer["ow"] // 2)
    return -(-layer["k"] // 4) * layer["oh"] * -(-layer["ow"] // 4)


def channels(layer):
    """(channels, values per channel) of a layer's output, as its epilogue indexes them."""
    op = layer["op"]
    if op == "linear":
        return layer["k"], 1
    if op == "conv":
        if layer.get("pool"):                         # a 2x2 stride-2 pooling folded in (tile 7)
            return layer["k"], (layer["oh"] // 2) * (layer["ow"] // 2)
        return layer["k"], layer["oh"] * layer["ow"]
    if op == "global_avg_pool":
        return layer["c"], 1
    if op == "epilogue":
        return layer["c"], layer["h"] * layer["w"]
    return layer["c"], layer["oh"] * layer["ow"]


def size(layer):
    """Values of a layer's output."""
    count, inner = channels(layer)
    return count * inner



def tile(layer, ranks, scratch_floats=0):
    """The convolution tile with the fewest instructions on the busiest thread (the kernel is bound by
    instruction issue and latency, not by memory: ncu, docs/performance.md): rounds of work items per
    thread x taps per item x instructions per tap (TCO * TP multiply-adds, ~5 per input read with its
    bounds -- times the bank conflicts when G lanes read G planes of the same pixel --, ~9 of weight
    read, loop and addressing), plus the shuffles that add a split reduction, or for tile 7 (the
    reduction split S ways between the block's threads, ``scratch_floats`` of scratch) the taps of one
    way and the sums of the S partial tiles.  Ties go to the first."""
    costs = tile_costs(layer, ranks, scratch_floats)
    return min(costs, key=costs.get)


def tile_costs(layer, ranks, scratch_floats=0):
    """{tile code: the cost :func:`tile` compares} (tile 7 infinite where its reduction does not split)."""
    ksize = layer["c"] * layer["kh"] * layer["kw"]
    plane = layer["h"] * layer["w"]

    def cost(tco, tp, g):
        items = -(-layer["k"] // tco) * layer["oh"] * -(-layer["ow"] // tp)
        if g == 0:
            ways = wsplit_ways(layer, ranks, scratch_floats)
            if not ways:
                return float("inf")
            per = -(-items // ranks)
            taps = -(-layer["c"] // ways) * layer["kh"] * layer["kw"]
            return taps * (tco * tp + 5 * tp + 9) + -(-per * tco * tp // THREADS) * (2 * ways + 12)
        rounds = -(-items * g // (ranks * THREADS))
        if g == 1:
            return rounds * ksize * (tco * tp + 5 * tp + 9)
        ways = g // min(g, 32 // np.gcd(plane, 32))
        taps = -(-layer["c"] // g) * layer["kh"] * layer["kw"]
        return rounds * (taps * (tco + 5 * ways + 9) + 8 * int(np.log2(g)))
    return {t[0]: cost(t[1], t[2], t[3]) for t in TILES}


def foldable(conv, pool):
    """Whether pooling layer ``pool`` (a bound dict) after convolution ``conv`` folds into it: a 2x2 window,
    stride 2, no padding, no epilogue steps of its own, over the convolution's whole output."""
    return (pool["op"] in ("max_pool", "avg_pool") and (pool["kh"], pool["kw"], pool["sh"], pool["sw"]) == (2, 2, 2, 2)
            and (pool["ph"], pool["pw"]) == (0, 0) and not pool.get("epi")
            and (pool["c"], pool["h"], pool["w"]) == (conv["k"], conv["oh"], conv["ow"])
            and (pool["oh"], pool["ow"]) == (conv["oh"] // 2, conv["ow"] // 2) and min(conv["oh"], conv["ow"]) >= 2)


def staged(layer, ranks):
    """Floats of weights the block of a cluster with the most to stage needs for convolution ``layer``
    (the channels its share of the work items touches; cpp/fused_net.cu's conv_layer)."""
    if layer["op"] != "conv":
        return 0
    tco, tp = next((c, p) for code, c, p, _ in TILES if code == layer["tile"])
    row = layer["oh"] * -(-layer["ow"] // tp)
    if layer.get("pool"):
        row = (layer["oh"] // 2) * (layer["ow"] // 2)
    items = -(-layer["k"] // tco) * row
    per = -(-items // ranks)
    ksize = layer["c"] * layer["kh"] * layer["kw"]
    most = 0
    for rank in range(ranks):
        lo, hi = per * rank, min(per * rank + per, items)
        if hi > lo:
            span = min(layer["k"], ((hi - 1) // row + 1) * tco) - lo // row * tco
            most = max(most, -(-span // 4) * 4 * ksize)        # staged rows of a multiple of 4 channels
    return most


def stages_all(layer, ranks, wcap):
    """Whether every block of a cluster of ``ranks`` stages convolution ``layer``'s weights in ``wcap`` floats:
    cpp/fused_net_conv.cuh's stage_weights (its rows of the channels a block touches, all input channels), or
    for tile 7's split reduction (conv_wsplit) at least one input channel's taps a chunk.  A kernel generated
    for one network then compiles the staged reads alone (STAGED: the loads through the read-only cache and
    the loop copies NVRTC made for them are not compiled)."""
    if layer["op"] != "conv":
        return False
    most = staged(dict(layer, tile=int(layer.get("tile", 0))), ranks)
    if int(layer.get("tile", 0)) == 7:
        most //= layer["c"]                            # one input channel's kh * kw taps of the block's channels
    return most <= wcap


# Timed choices, kept for the process: a network compiled again (a notebook's cell run twice, the tests, a
# model rebuilt) takes the same tiles and folds without timing them again -- so the same generated source,
# which the kernel cache (kernel_cache.py) then finds, and the same bits.  Keyed by the layers' shapes and
# epilogues, the cluster size and the shared memory the layer has; never by the weights.
_TIMED = {}
_TIMED_MAX = 4096
_KEY = ("op", "c", "h", "w", "k", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw", "epi", "act", "slope", "pool",
        "tile")


def _key(*parts):
    return tuple(tuple((f, tuple(p[f]) if isinstance(p.get(f), list) else p.get(f)) for f in _KEY)
                 if isinstance(p, dict) else p for p in parts)


def _remember(key, value):
    if len(_TIMED) >= _TIMED_MAX:
        _TIMED.clear()
    _TIMED[key] = value
    return value


def forget():
    """Forget the timed tiles and folds of this process (the next network is timed afresh)."""
    _TIMED.clear()


def _one_image(in_size, out_size):
    """A random input image and an output buffer on the device, for timing one-layer tables."""
    return (_C.to_device(np.random.default_rng(0).standard_normal(in_size).astype(np.float32)),
            _C.empty((out_size,)))


def _us(table, x, y, ranks):
    """µs a call of ``table`` on one image takes: the least of two rounds of 20 calls."""
    return round(1e6 * min(time_calls(lambda: table.forward(x, y, 1, ranks), 20) for _ in range(2)), 1)


def tune(d, ranks, room, scratch_floats):
    """Choose convolution ``d``'s tile for clusters of ``ranks`` by timing: the cost model's TUNE_CANDIDATES
    cheapest tiles and tile 7 (where its reduction splits), each on a table of this one layer (its weights
    staged as the network's room allows), one image of random values, the least of two rounds of 20
    calls.  The cost model alone mispredicts by up to 3x between tiles whose costs are close (the
    H100, docs/performance.md, session 25).  Sets ``d["tile"]`` and ``d["tile_us"]``; a layer of the same
    shape timed before in this process takes that choice untimed."""
    key = _key("tile", dict(d, tile=None), ranks, room, scratch_floats)
    if key in _TIMED:
        d["tile"], timed = _TIMED[key]
        d["tile_us"] = dict(timed)
        return
    costs = tile_costs(d, ranks, scratch_floats)
    codes = sorted(costs, key=costs.get)[:TUNE_CANDIDATES]
    if costs.get(7, float("inf")) < float("inf") and 7 not in codes:
        codes.append(7)
    out_size, in_size = size(d), d["c"] * d["h"] * d["w"]
    x, y = _one_image(in_size, out_size)
    timed = {}
    for code in codes:
        layer = dict(d, tile=code)
        timed[code] = _us(_C.FusedNet([layer], in_size, out_size, False, min(room, staged(layer, ranks))), x, y, ranks)
    d["tile"] = min(timed, key=timed.get)
    d["tile_us"] = timed
    _remember(key, (d["tile"], dict(timed)))


def fold(bound, ranks, room):
    """``bound`` with each convolution followed by a 2x2 stride-2 pooling (no epilogue of its own) folded
    into one layer of tile 7 (cpp/fused_net_wsplit.cuh: the pooled values alone are stored into the
    cluster's blocks, one barrier fewer) where that table times under FOLD_MARGIN x the two layers apart, each
    on one image of random values (a pair of the same shapes timed before in this process: that choice).
    The folded layer keeps both timings in ``fold_us``.  ``$CYDNN_FUSED_FOLD``
    (a switch for tests and debugging): auto (the default), always (every pair that folds, untimed), off."""
    mode = os.environ.get("CYDNN_FUSED_FOLD", "auto").strip() or "auto"
    if mode not in ("auto", "always", "off"):
        raise ValueError(f"CYDNN_FUSED_FOLD must be auto, always or off, got {mode!r}")
    out, i = [], 0
    while i < len(bound):
        d = bound[i]
        after = bound[i + 1] if i + 1 < len(bound) else None
        if mode == "off" or not (d["op"] == "conv" and after is not None and foldable(d, after)):
            out.append(d)
            i += 1
            continue
        folded = dict(d, tile=7, pool=_C.NET_OPS[after["op"]])
        folded.pop("tile_us", None)
        if mode == "always":
            folded["fold_us"] = {}
            out.append(folded)
            i += 2
            continue
        key = _key("fold", d, after, ranks, room)
        timed = _TIMED.get(key)
        if timed is None:
            in_size = d["c"] * d["h"] * d["w"]
            x, y = _one_image(in_size, size(after))
            apart = _C.FusedNet([d, after], in_size, size(after), False, min(room, staged(d, ranks)))
            one = _C.FusedNet([folded], in_size, size(after), False, min(room, staged(folded, ranks)))
            timed = _remember(key, {"apart": _us(apart, x, y, ranks), "folded": _us(one, x, y, ranks)})
        timed = dict(timed)
        if timed["folded"] < FOLD_MARGIN * timed["apart"]:
            folded["fold_us"] = timed
            out.append(folded)
        else:
            d["fold_us"] = timed
            out += [d, after]
        i += 2
    return out
