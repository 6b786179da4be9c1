"""Every convolution tile of the fused network (cpp/fused_net_conv.cuh, compiler/fused_net.py's _TILES) on
one-layer tables, against the per-op path: shapes with few and many input channels, strides, padding,
odd and non-square kernels, at cluster sizes 1, 4 and 16, with all the weights staged, staged in chunks
of a few input channels, and read through the cache (no staging)."""
import numpy as np
import pytest

from cydnn import _C, nn
from cydnn.compiler import fused_net

gpu = pytest.mark.gpu

# (C, H, W) -> K, kernel, stride, padding
SHAPES = {"first": ((3, 32, 32), 24, (3, 3), (1, 1), (1, 1)),
          "mid": ((24, 16, 16), 48, (3, 3), (1, 1), (1, 1)),
          "deep": ((48, 8, 8), 96, (3, 3), (1, 1), (1, 1)),
          "deeper": ((128, 7, 7), 128, (3, 3), (1, 1), (1, 1)),
          "odd": ((7, 11, 10), 10, (3, 2), (2, 1), (1, 0)),
          "five": ((5, 9, 9), 6, (5, 5), (2, 2), (2, 2)),
          "pointwise": ((16, 6, 6), 33, (1, 1), (1, 1), (0, 0))}
TILES = [t[0] for t in fused_net._TILES]


def _layer(name, device="cpu"):
    (c, h, w), k, (kh, kw), (sh, sw), (ph, pw) = SHAPES[name]
    conv = nn.Conv2d(c, k, (kh, kw), stride=(sh, sw), padding=(ph, pw), rng=len(name))
    model = nn.Sequential(conv, nn.ReLU()).to(device).eval()
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    d = dict(op="conv", c=c, h=h, w=w, k=k, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
             epi=[_C.NET_EPI_ACT], act=_C.ACT_RELU, slope=0.0, weight=conv.weight.data, bias=conv.bias.data)
    return model, d


def test_every_tile_code_has_a_template_in_the_generated_source():
    from cydnn.compiler import fused_net_gen
    assert sorted(fused_net_gen._CONV) == sorted(TILES)
    _, d = _layer("mid")
    for code in TILES:
        call = fused_net_gen._call(dict(d, tile=code))
        assert call.startswith(fused_net_gen._CONV[code][0] + "<") and call.endswith(");")
    assert fused_net_gen._call(dict(d, tile=7)).endswith("wbuf, WCAP, cur, BUF);")   # its scratch: the input


def test_the_split_ways_follow_threads_channels_and_scratch():
    _, d = _layer("mid")                         # 12 x 16 x 4 = 768 work items of 4x4
    assert fused_net._wsplit_ways(d, 16, 10 ** 6) == 10          # 48 a block: 512 // 48 threads
    assert fused_net._wsplit_ways(d, 16, 48 * 16 * 3) == 3       # the scratch holds 3 ways
    assert fused_net._wsplit_ways(d, 16, 48 * 16) == 0           # one way: tile 3's kernel
    assert fused_net._wsplit_ways(d, 1, 10 ** 6) == 0            # 768 a block: more than the threads
    _, first = _layer("first")
    assert fused_net._wsplit_ways(first, 16, 10 ** 6) == 3       # at most one way an input channel


@gpu
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_tile_gives_the_per_op_outputs(name):
    model, d = _layer(name, "cuda")
    c, h, w = SHAPES[name][0]
    x = np.random.default_rng(1).standard_normal((3, c, h, w)).astype(np.float32)
    want = model(_C.to_device(x)).numpy().reshape(3, -1)
    size = want.shape[1]
    xd, y = _C.to_device(x.ravel()), _C.empty((3 * size,))
    for code in TILES:
        for cluster in (1, 4, 16):
            layer = dict(d, tile=code)
            width = -(-max(c * h * w, size) // 4) * 4
            full = min(fused_net._staged(layer, cluster), fused_net.SMEM_LIMIT // 4 - 2 * width)
            for wcap in (full, 4 * d["kh"] * d["kw"] * 2 + 4, 0):     # all, chunks of a few channels, none
                table = _C.FusedNet([layer], c * h * w, size, False, wcap)
                table.forward(xd, y, 3, cluster)
                got = y.numpy().reshape(3, -1)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6,
                                           err_msg=f"{name} tile {code} cluster {cluster} wcap {wcap}")


@gpu
def test_the_split_tile_really_splits_somewhere():
    """Tile 7 is not only tile 3 in disguise: on these shapes it splits the reduction (S >= 2) at 16 blocks."""
    for name in ("mid", "deep", "deeper", "first"):
        _, d = _layer(name, "cuda")
        table = _C.FusedNet([dict(d, tile=7)], d["c"] * d["h"] * d["w"], d["k"] * d["oh"] * d["ow"], False, 0)
        assert fused_net._wsplit_ways(d, 16, table.smem_bytes // 4 // 2) >= 2, name


@gpu
def test_the_timed_tile_is_the_fastest_of_those_timed():
    from test_compiler import ZOO
    from cydnn.compiler.trace import trace
    make, shape = ZOO["cnn32"]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 4)
    for r in fused_net.CLUSTERS:
        convs = [d for d in net._bound[r][0] if d["op"] == "conv"]
        if r not in fused_net.TUNED_CLUSTERS:
            assert all("tile_us" not in d for d in convs)
            continue
        for d in convs:
            assert len(d["tile_us"]) >= 2 and d["tile"] == min(d["tile_us"], key=d["tile_us"].get), (r, d["tile_us"])
    assert "convolution tiles at 16 blocks, timed" in net.explain()
