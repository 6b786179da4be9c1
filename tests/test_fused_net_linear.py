"""The fused network's linear layer (cpp/fused_net_layers.cuh's linear_layer): where a block has few output rows,
the warps of a row group split its inputs (linear_parts; its twin compiler/fused_tiles.py's linear_parts), and a
kernel generated for the network gets the split's scratch only where some block may split (linear_splits).  CPU:
the twin and the generator's choice; GPU: one-layer tables at clusters of 1, 4 and 16 against the per-op path."""
import numpy as np
import pytest

from cydnn import _C, nn
from cydnn.compiler import fused_tiles

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
