"""The fused network's linear layer (cpp/fused_net_layers.cuh's linear_layer): where a block has few output rows,
the warps of a row group split its inputs (linear_parts; its twin compiler/fused_tiles.py's linear_parts), and a
kernel generated for the network gets the split's scratch only where some block may split (linear_splits).  CPU:
the twin and the generator's choice; GPU: one-layer tables at clusters of 1, 4 and 16 against the per-op path.

The tail (linear_tail): the last linear layer of few outputs after a linear layer, each block multiplying its own
share of the input, rank 0 adding the partial sums, the layer before storing into its own block with no cluster
barrier after it.  CPU: which layer becomes one (fused_net.mark_tail), the generated source of both forms; GPU: two-
layer tables with shares of every kind at every cluster size against the per-op path and the table without the
tail, and the checks that refuse a tail elsewhere (the table, the fused training step)."""
import re

import numpy as np
import pytest

from cydnn import _C, nn
from cydnn.compiler import fused_net, fused_net_gen, fused_tiles
from cydnn.compiler.trace import trace

from test_compiler import ZOO

gpu = pytest.mark.gpu


# inputs, outputs, whether clusters of 1 / 4 / 16 blocks split the inputs between warps
LINEARS = [(1536, 128, (False, False, True)), (2048, 10, (True, True, True)), (1537, 20, (False, True, True)),
           (64, 300, (False, False, False)), (130, 3, (True, True, True))]


def test_the_linear_split_twin():
    assert fused_tiles.linear_parts(8, 1536 // 4) == 4             # 2 row groups, 32 floats of parts
    assert fused_tiles.linear_parts(1, 2048 // 4) == 8
    assert fused_tiles.linear_parts(2, 1537) == 8                   # not a multiple of 4: floats
    assert fused_tiles.linear_parts(19, 64 // 4) == 1               # many rows: the warps are busy
    assert fused_tiles.linear_parts(1, 130) == 4                    # each part a warp's width of inputs
    assert fused_tiles.linear_parts(1, 32) == 1 and fused_tiles.linear_parts(0, 999) == 1
    # a kernel generated for the network gets the split's scratch only where some block may split
    from cydnn.compiler import fused_net_gen
    for inputs, outputs, split in LINEARS:
        d = dict(op="linear", c=inputs, h=1, w=1, k=outputs, epi=[])
        for ranks, splits in zip((1, 4, 16), split):
            may = fused_tiles.linear_splits(d, ranks)       # some block, float4 or (weights unaligned) float steps
            assert may or not splits, (inputs, outputs, ranks)
            call = fused_net_gen._call(d, ranks)
            assert call == "linear_layer(L, cur, next, cluster, rank, RANKS, %s);" % ("red" if may else "nullptr")
    assert not fused_tiles.linear_splits(dict(op="linear", c=64, h=1, w=1, k=300, epi=[]), 4)      # 75 rows a block
    assert fused_tiles.linear_splits(dict(op="linear", c=64, h=1, w=1, k=300, epi=[]), 16)    # 15 on the last
    # 273 outputs on 16 blocks (the device's share): 18 rows for 15 blocks, which do not split, and 3 for the last,
    # which does -- neither 273 // 16 nor its ceiling would say so
    assert fused_tiles.linear_parts(18, 160) == fused_tiles.linear_parts(17, 160) == 1
    assert fused_tiles.linear_parts(3, 160) > 1
    assert fused_tiles.linear_splits(dict(op="linear", c=640, h=1, w=1, k=273, epi=[]), 16)
    assert not fused_tiles.linear_splits(dict(op="linear", c=640, h=1, w=1, k=288, epi=[]), 16)    # 18 each


@gpu
@pytest.mark.parametrize("inputs,outputs,split", LINEARS)
def test_a_linear_layer_split_between_warps_gives_the_per_op_outputs(inputs, outputs, split):
    """A linear layer alone in a table at clusters of 1, 4 and 16 blocks: with few rows a block its inputs are
    split between warps (fused_tiles.linear_parts, the device's), else not; both against the per-op path."""
    linear = nn.Linear(inputs, outputs, rng=inputs)
    model = nn.Sequential(linear, nn.ReLU()).to("cuda").eval()
    d = dict(op="linear", c=inputs, h=1, w=1, k=outputs, epi=[_C.NET_EPI_ACT], act=_C.ACT_RELU, slope=0.0,
             weight=linear.weight.data, bias=linear.bias.data)
    x = np.random.default_rng(1).standard_normal((3, inputs)).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    xd, y = _C.to_device(x.ravel()), _C.empty((3 * outputs,))
    table = _C.FusedNet([d], inputs, outputs, False, 0)
    steps = inputs // 4 if inputs % 4 == 0 else inputs
    for cluster, splits in zip((1, 4, 16), split):
        assert (fused_tiles.linear_parts(-(-outputs // cluster), steps) > 1) == splits, cluster
        table.forward(xd, y, 3, cluster)
        np.testing.assert_allclose(y.numpy().reshape(3, -1), want, rtol=1e-5, atol=2e-6, err_msg=f"cluster {cluster}")


# ---------------------------------------------------------------------- the tail
def _described(name):
    make, shape = ZOO[name]
    return fused_net.describe(trace(make(), shape, 1))


def test_the_last_linear_layer_after_a_linear_layer_becomes_a_tail(monkeypatch):
    monkeypatch.delenv("CYDNN_FUSED_TAIL", raising=False)
    for name, tail in (("mlp", True), ("cnn32", True), ("lenet_widths", True), ("cnn_bn", True),
                       ("allconv", False)):                       # allconv: a pooling before its linear layer
        layers = _described(name)
        marked = fused_net.mark_tail(layers)
        assert [d.get("tile") == 1 for d in marked] == [False] * (len(layers) - 1) + [tail], name
        assert all(d.get("tile") is None for d in layers if d["op"] == "linear"), "the described layers unchanged"
        assert fused_net.tail_floats(marked[-1]) == (marked[-1]["c"] + 16 * marked[-1]["k"] if tail else 0)
    mlp = _described("mlp")
    wide = mlp[:-1] + [dict(mlp[-1], k=fused_net.TAIL_MAX + 1)]          # too many outputs for a tail
    assert fused_net.mark_tail(wide) is wide
    assert fused_net.mark_tail(mlp, {"CYDNN_FUSED_TAIL": "0"}) is mlp
    assert fused_net.mark_tail(mlp[-1:]) == mlp[-1:]                     # nothing before it
    # an input that fits the shared memory whose partial sums beside it would not: no tail (the table would be refused)
    c = fused_net.SMEM_LIMIT // 8 - 8
    big = [dict(mlp[0], k=c), dict(mlp[-1], c=c)]
    assert fused_net.mark_tail(big) is big and fused_net.mark_tail([big[0], dict(big[1], c=c - 160)])[-1]["tile"] == 1
    with pytest.raises(ValueError, match="CYDNN_FUSED_TAIL must be 0 or 1, got 'yes'"):
        fused_net.tail_enabled({"CYDNN_FUSED_TAIL": "yes"})


def _tail_forms(name, ranks=16):
    layers = fused_net.mark_tail(_described(name))
    bound = [fused_net.FusedNetwork._bind(d, ranks) for d in layers]
    make, shape = ZOO[name]
    args = (bound, ranks, 0, 1024, int(np.prod(shape)), 10, True)
    return bound, fused_net_gen.source(*args), fused_net_gen.units(*args)


def test_the_generated_source_of_a_tail():
    """The layer before the tail stores into its own block (``local``) and ends with a block barrier; the tail's
    partial sums, the cluster barrier, rank 0's sum: in the whole form and, line for line, in the layers form,
    whose units carry their own barriers."""
    bound, whole, units = _tail_forms("mlp")
    lines = [t.strip() for t in whole.splitlines()]
    i = next(k for k, t in enumerate(lines) if t.startswith("linear_layer("))
    assert lines[i].endswith(", true);") and lines[i + 1] == "__syncthreads();"
    j = lines.index("linear_tail(L, cur, cluster, rank, RANKS);")
    assert lines[j + 1:j + 3] == ["cluster.sync();", "if (rank == 0) linear_tail_sum(L, cur, next, RANKS);"]
    assert "L.tile = 1;" in lines[j - 2]
    flat = [t.strip() for u in units[:-1] for t in u.splitlines()]
    for want in (lines[i], "__syncthreads();", lines[j], "if (rank == 0) linear_tail_sum(L, cur, next, RANKS);"):
        assert want in flat, want
    assert "cluster.sync();" not in units[-1].split("load_input")[1]     # the kernel only calls the units
    # a network without a tail: every layer ends with the cluster barrier, and nothing is local
    plain = [fused_net.FusedNetwork._bind(d, 16) for d in _described("allconv")]
    text = fused_net_gen.source(plain, 16, 0, 1024, 784, 10, True)
    assert "linear_tail" not in text and not re.search(r"linear_layer\(.*, true\);", text)
    assert text.count("cluster.sync();") == len(plain)


def test_nvrtc_compiles_both_forms_of_a_tail():
    try:
        fused_net_gen._nvrtc()
        fused_net_gen.headers()
    except fused_net_gen.GenerationError as e:
        pytest.skip(f"no NVRTC here: {e}")
    _, whole, units = _tail_forms("cnn32")
    assert fused_net_gen.compile_cubin(whole)[:4] == b"\x7fELF"
    for unit in units:
        assert fused_net_gen.compile_cubin(unit, rdc=True)[:4] == b"\x7fELF"


# (hidden, outputs): blocks with no share (5 < 16), uneven shares (37, 300), many rows a block (1024), float steps
TAILS = [(128, 10, 1536), (5, 33, 20), (37, 7, 130), (300, 3, 64), (1024, 10, 784)]


def _two_linears(inputs, hidden, outputs):
    first, second = nn.Linear(inputs, hidden, rng=hidden), nn.Linear(hidden, outputs, rng=outputs)
    model = nn.Sequential(first, nn.Tanh(), second).to("cuda").eval()
    layers = [dict(op="linear", c=inputs, h=1, w=1, k=hidden, epi=[_C.NET_EPI_ACT], act=_C.ACT_TANH, slope=0.0,
                   weight=first.weight.data, bias=first.bias.data),
              dict(op="linear", c=hidden, h=1, w=1, k=outputs, epi=[], weight=second.weight.data,
                   bias=second.bias.data)]
    return model, layers


@gpu
@pytest.mark.parametrize("hidden,outputs,inputs", TAILS)
def test_a_tail_gives_the_per_op_outputs_at_every_cluster_size(hidden, outputs, inputs):
    model, layers = _two_linears(inputs, hidden, outputs)
    tail = fused_net.mark_tail(layers, {})
    assert tail[-1]["tile"] == 1
    x = np.random.default_rng(2).standard_normal((3, inputs)).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    xd = _C.to_device(x.ravel())
    plain, tailed = _C.FusedNet(layers, inputs, outputs, False, 0), _C.FusedNet(tail, inputs, outputs, True, 0)
    assert tailed.smem_bytes >= 4 * 2 * (hidden + 16 * outputs)          # the partial sums beside the input
    soft = np.exp(want - want.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    for cluster in fused_net.CLUSTERS:
        for n in (1, 3):
            a, b = _C.empty((n * outputs,)), _C.to_device(np.full(n * outputs, np.nan, np.float32))
            plain.forward(xd, a, n, cluster)
            tailed.forward(xd, b, n, cluster)
            np.testing.assert_allclose(a.numpy().reshape(n, -1), want[:n], rtol=1e-5, atol=2e-6)
            np.testing.assert_allclose(b.numpy().reshape(n, -1), soft[:n], rtol=1e-5, atol=2e-6,
                                       err_msg=f"cluster {cluster} n {n}")


@gpu
def test_a_tail_anywhere_but_last_and_a_trained_tail_are_refused():
    model, layers = _two_linears(16, 8, 4)
    bad = [dict(layers[0], tile=1), layers[1]]
    with pytest.raises(_C.CydnnError, match=r"layer 0: a linear layer's tile is 0, or 1 \(a tail\) on the last layer "
                                            r"only, got 1"):
        _C.FusedNet(bad, 16, 4, False, 0)
    with pytest.raises(_C.CydnnError, match="layer 1: a linear layer's tile is 0, or 1"):
        _C.FusedNet([layers[0], dict(layers[1], tile=2)], 16, 4, False, 0)
    table = _C.FusedNet(fused_net.mark_tail(layers, {}), 16, 4, False, 0)
    x, labels, logits, loss = _C.empty((4 * 16,)), _C.to_device(np.zeros(4, np.int32)), _C.empty((16,)), _C.empty((1,))
    grads = [(_C.empty((8 * 16,)), _C.empty((8,))), (_C.empty((4 * 8,)), _C.empty((4,)))]
    with pytest.raises(_C.CydnnError, match=r"layer 1: a linear tail \(tile 1\) is the inference kernel's"):
        _C.FusedTrain(table, 4, 1, x, labels, logits, loss, grads)
