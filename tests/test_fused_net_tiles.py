"""Every convolution tile of the fused network (cpp/fused_net_conv.cuh, compiler/fused_tiles.py's TILES) on
one-layer tables, against the per-op path: shapes with few and many input channels, strides, padding,
odd and non-square kernels, at cluster sizes 1, 4 and 16, with all the weights staged, staged in chunks
of a few input channels, and read through the cache (no staging)."""
import numpy as np
import pytest

from cydnn import _C, nn
from cydnn.compiler import fused_net, fused_tiles

gpu = pytest.mark.gpu

# (C, H, W) -> K, kernel, stride, padding
SHAPES = {"first": ((3, 32, 32), 24, (3, 3), (1, 1), (1, 1)),
          "mid": ((24, 16, 16), 48, (3, 3), (1, 1), (1, 1)),
          "deep": ((48, 8, 8), 96, (3, 3), (1, 1), (1, 1)),
          "deeper": ((128, 7, 7), 128, (3, 3), (1, 1), (1, 1)),
          "odd": ((7, 11, 10), 10, (3, 2), (2, 1), (1, 0)),
          "five": ((5, 9, 9), 6, (5, 5), (2, 2), (2, 2)),
          "pointwise": ((16, 6, 6), 33, (1, 1), (1, 1), (0, 0)),
          "wide": ((5, 18, 36), 20, (3, 2), (1, 2), (1, 1)),     # pooled: strided, a 3x2 kernel, an odd width
          "unpadded": ((4, 10, 12), 8, (3, 3), (1, 1), (0, 0))}  # pooled: the 4x4 patches without padding
TILES = [t[0] for t in fused_tiles.TILES]


def _layer(name, device="cpu"):
    (c, h, w), k, (kh, kw), (sh, sw), (ph, pw) = SHAPES[name]
    conv = nn.Conv2d(c, k, (kh, kw), stride=(sh, sw), padding=(ph, pw), rng=len(name))
    model = nn.Sequential(conv, nn.ReLU()).to(device).eval()
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    d = dict(op="conv", c=c, h=h, w=w, k=k, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw,
             epi=[_C.NET_EPI_ACT], act=_C.ACT_RELU, slope=0.0, weight=conv.weight.data, bias=conv.bias.data)
    return model, d


def _cnn32(capacity):
    """The test zoo's 3x32x32 CNN on the GPU: (model, input shape, its traced layers, its FusedNetwork)."""
    from test_compiler import ZOO
    from cydnn.compiler.trace import trace
    make, shape = ZOO["cnn32"]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    layers = fused_net.describe(nodes)
    return model, shape, layers, fused_net.FusedNetwork(layers, shape, nodes[-1].out_shape[1:], False, capacity)


def test_every_tile_code_has_a_template_in_the_generated_source():
    from cydnn.compiler import fused_net_gen
    assert sorted(fused_net_gen._CONV) == sorted(TILES)
    _, d = _layer("mid")
    for code in TILES:
        call = fused_net_gen._call(dict(d, tile=code))
        assert call.startswith(fused_net_gen._CONV[code][0] + "<") and call.endswith(");")
    assert fused_net_gen._call(dict(d, tile=7)) == "conv_wsplit<3, 0>(L, cur, next, cluster, rank, RANKS, wbuf, WCAP, cur, BUF);"
    assert fused_net_gen._call(dict(d, tile=7, pool=_C.NET_OPS["avg_pool"])).startswith(
        f"conv_wsplit<3, {_C.NET_OPS['avg_pool']}>(")                                 # its scratch: the input


def test_a_generated_split_tile_says_so_only_where_it_splits():
    """A kernel generated for one network names tile 7's instance SPLIT (its one-way paths not compiled:
    a third of NVRTC's time) exactly where wsplit_ways gives 2 ways or more for that cluster and scratch."""
    from cydnn.compiler import fused_net_gen
    _, d = _layer("mid")
    d = dict(d, tile=7)
    for ranks, scratch in [(16, 10 ** 6), (16, 48 * 16 * 3), (16, 48 * 16), (1, 10 ** 6), (4, 10 ** 6)]:
        call = fused_net_gen._call(d, ranks, scratch)
        split = fused_tiles.wsplit_ways(d, ranks, scratch) >= 2
        assert call.startswith("conv_wsplit<3, 0, true>(" if split else "conv_wsplit<3, 0>("), (ranks, scratch)
    assert fused_net_gen._call(d) == fused_net_gen._call(d, 1, 10 ** 6)     # no cluster given: not SPLIT
    assert "<3, 0, true>" in fused_net_gen._call(d, 16, 10 ** 6)


@pytest.mark.parametrize("ranks", [1, 4, 16])
def test_nvrtc_compiles_the_split_and_folded_instances_of_a_network(ranks):
    """CPU (NVRTC needs no GPU; CI has it): the CNN with every convolution on tile 7 and its max poolings folded, one
    average pooling folded too, at 1, 4 and 16 blocks -- tile 7 SPLIT and not, pooled and not, linear layers with
    and without their split's scratch -- compiles to a cubin.  (That it runs right: the GPU test below.)"""
    from test_compiler import ZOO
    from test_fused_net_gen import NVRTC_MISSING
    from cydnn.compiler import fused_net_gen
    from cydnn.compiler.trace import trace
    if NVRTC_MISSING is not None:
        pytest.skip(f"no NVRTC here: {NVRTC_MISSING}")
    make, shape = ZOO["cnn32"]
    bound = [fused_net.FusedNetwork._bind(layer, ranks) for layer in fused_net.describe(trace(make(), shape, 1))]
    out, i = [], 0
    while i < len(bound):
        d = bound[i]
        if d["op"] == "conv" and fused_tiles.foldable(d, bound[i + 1]):
            kind = "avg_pool" if not out else bound[i + 1]["op"]               # the first folded as an average
            out.append(dict(d, tile=7, pool=_C.NET_OPS[kind]))
            i += 2
            continue
        out.append(d)
        i += 1
    buf = -(-max([3 * 32 * 32] + [fused_tiles.size(d) for d in out]) // 4) * 4
    text = fused_net_gen.source(out, ranks, 4000, buf, 3 * 32 * 32, 10, True)
    convs = [line for line in text.splitlines() if "conv_wsplit<" in line]
    args = [line.split("conv_wsplit<")[1].split(">")[0].split(", ") for line in convs]    # KS, POOL[, SPLIT[, STAGED]]
    split = [a[2:3] == ["true"] for a in args]
    assert [a[3:] == ["true"] for a in args] == [fused_tiles.stages_all(d, ranks, 4000) for d in out if d["op"] == "conv"]
    assert split == [fused_tiles.wsplit_ways(d, ranks, buf) >= 2 for d in out if d["op"] == "conv"]
    assert any(split) == (ranks > 1) and all(split) == (ranks == 16)     # at 4 blocks: both kinds
    assert "conv_wsplit<3, %d" % _C.NET_OPS["avg_pool"] in convs[0] and "RANKS, red);" in text
    assert ("RANKS, nullptr);" in text) == (ranks < 16)                   # fc1's 128 rows split only at 16 blocks
    assert fused_net_gen.compile_cubin(text)[:4] == b"\x7fELF"


def test_the_split_ways_follow_threads_channels_and_scratch():
    _, d = _layer("mid")                         # 12 x 16 x 4 = 768 work items of 4x4
    assert fused_tiles.wsplit_ways(d, 16, 10 ** 6) == 10          # 48 a block: 512 // 48 threads
    assert fused_tiles.wsplit_ways(d, 16, 48 * 16 * 3) == 3       # the scratch holds 3 ways
    assert fused_tiles.wsplit_ways(d, 16, 48 * 16) == 0           # one way: tile 3's kernel
    assert fused_tiles.wsplit_ways(d, 1, 10 ** 6) == 0            # 768 a block: more than the threads
    _, first = _layer("first")
    assert fused_tiles.wsplit_ways(first, 16, 10 ** 6) == 3       # at most one way an input channel


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
            full = min(fused_tiles.staged(layer, cluster), fused_net.SMEM_LIMIT // 4 - 2 * width)
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
        assert fused_tiles.wsplit_ways(d, 16, table.smem_bytes // 4 // 2) >= 2, name


@gpu
def test_the_timed_tile_is_the_fastest_of_those_timed():
    _, _, _, net = _cnn32(4)
    for r in fused_net.CLUSTERS:
        convs = [d for d in net._bound[r][0] if d["op"] == "conv"]
        if r not in fused_tiles.TUNED_CLUSTERS:
            assert all("tile_us" not in d for d in convs)
            continue
        for d in convs:
            if d.get("pool"):                        # folded: its time against the two layers apart
                timed = d["fold_us"]
                assert d["tile"] == 7 and timed["folded"] < fused_tiles.FOLD_MARGIN * timed["apart"], timed
                continue
            assert len(d["tile_us"]) >= 2 and d["tile"] == min(d["tile_us"], key=d["tile_us"].get), (r, d["tile_us"])
            assert "fold_us" not in d or d["fold_us"]["folded"] >= fused_tiles.FOLD_MARGIN * d["fold_us"]["apart"]
    assert "convolution tiles at 16 blocks, timed" in net.explain()


class _FakeTables:
    """_C.FusedNet, _C.to_device, _C.empty and time_calls for the CPU: a table's time is ``cost(layers)``."""

    def __init__(self, monkeypatch, cost):
        self.built, self.last = [], None
        fakes = self
        monkeypatch.setattr(fused_tiles, "_TIMED", {})          # nothing timed before in this process

        class Table:
            def __init__(self, layers, in_size, out_size, softmax, wcap):
                self.layers, self.wcap = layers, wcap
                fakes.built.append(self)

            def forward(self, x, y, n, r):
                fakes.last = self
        monkeypatch.setattr(fused_tiles._C, "FusedNet", Table)
        monkeypatch.setattr(fused_tiles._C, "to_device", lambda a: a)
        monkeypatch.setattr(fused_tiles._C, "empty", lambda shape: np.empty(shape, np.float32))

        def time_calls(fn, calls):
            fn()
            return cost(fakes.last.layers) * 1e-6
        monkeypatch.setattr(fused_tiles, "time_calls", time_calls)


def test_tune_keeps_the_fastest_of_the_cheapest_tiles_and_tile_7(monkeypatch):
    _, d = _layer("mid")
    times = {7: 5.0, 3: 9.0, 2: 4.0}
    fakes = _FakeTables(monkeypatch, lambda layers: times.get(layers[0]["tile"], 20.0))
    costs = fused_tiles.tile_costs(d, 16, 10 ** 5)
    cheapest = sorted(costs, key=costs.get)[:fused_tiles.TUNE_CANDIDATES]
    fused_tiles.tune(d, 16, 4000, 10 ** 5)
    assert set(d["tile_us"]) == set(cheapest) | {7}                   # tile 7 timed even where not cheapest
    assert d["tile"] == min(d["tile_us"], key=d["tile_us"].get) and d["tile_us"][d["tile"]] <= 5.0
    assert all(t.wcap == min(4000, fused_tiles.staged(t.layers[0], 16)) for t in fakes.built)
    _, first = _layer("first")                                        # tile 7 does not split: not timed
    fused_tiles.tune(first, 16, 4000, 10)
    assert 7 not in first["tile_us"]


def test_a_layer_timed_before_takes_the_same_tile_and_fold_untimed(monkeypatch):
    """A network compiled again in the same process gets the same tiles and folds without timing (so the same
    generated source, which the kernel cache finds): keyed by the shapes, the cluster and the room."""
    _, d = _layer("mid")
    times = {7: 5.0, 3: 9.0, 2: 4.0}
    fakes = _FakeTables(monkeypatch, lambda layers: times.get(layers[0]["tile"], 20.0))
    fused_tiles.tune(d, 16, 4000, 10 ** 5)
    first, built = (d["tile"], dict(d["tile_us"])), len(fakes.built)
    times.update({2: 30.0, 7: 1.0})                                   # the timings would now choose tile 7
    again = dict(d, tile=0, tile_us={}, weight=None)                   # another model's layer of the same shape
    fused_tiles.tune(again, 16, 4000, 10 ** 5)
    assert (again["tile"], again["tile_us"]) == first and len(fakes.built) == built
    fused_tiles.tune(again, 8, 4000, 10 ** 5)                         # another cluster size: timed
    assert again["tile"] == 7 and len(fakes.built) > built
    pool = _pooling(d, "max_pool")
    out = fused_tiles.fold([dict(d, tile=2), pool], 16, 4000)          # folded 1.0 < apart 30 + 2.5
    timed = len(fakes.built)
    times.update({7: 90.0})
    assert fused_tiles.fold([dict(d, tile=2), pool], 16, 4000)[0]["fold_us"] == out[0]["fold_us"]
    assert len(fakes.built) == timed and len(out) == 1
    fused_tiles.forget()
    assert len(fused_tiles.fold([dict(d, tile=2), pool], 16, 4000)) == 2 and len(fakes.built) > timed


def _pooling(conv, op):
    return dict(op=op, c=conv["k"], h=conv["oh"], w=conv["ow"], oh=conv["oh"] // 2, ow=conv["ow"] // 2, kh=2, kw=2,
                sh=2, sw=2, ph=0, pw=0, epi=[])


def test_fold_keeps_a_pair_folded_where_it_times_faster(monkeypatch):
    _, a = _layer("mid")
    _, b = _layer("first")
    a, b = dict(a, tile=4), dict(b, tile=2)
    linear = dict(op="linear", c=24 * 16 * 16, h=1, w=1, k=10, epi=[])
    bound = [a, _pooling(a, "max_pool"), b, _pooling(b, "avg_pool"), linear]
    # the first pair is faster folded, the second apart (3.0 folded > FOLD_MARGIN x 2.5)
    _FakeTables(monkeypatch, lambda layers: {(48, True): 1.0, (48, False): 2.0, (24, True): 3.0}.get(
        (layers[0]["k"], bool(layers[0].get("pool"))), 2.5))
    out = fused_tiles.fold(bound, 16, 4000)
    assert [(d["op"], d.get("pool", 0)) for d in out] == [("conv", _C.NET_OPS["max_pool"]), ("conv", 0),
                                                          ("avg_pool", 0), ("linear", 0)]
    assert out[0]["tile"] == 7 and out[0]["fold_us"] == {"apart": 2.0, "folded": 1.0}
    assert out[1] is b and b["tile"] == 2 and b["fold_us"] == {"apart": 2.5, "folded": 3.0}
    assert fused_tiles.size(out[0]) == 48 * 8 * 8
    # a pair a little slower folded (under FOLD_MARGIN) folds: the generated kernel gains from one layer fewer
    _FakeTables(monkeypatch, lambda layers: 2.6 if layers[0]["k"] == 24 and layers[0].get("pool") else 2.5)
    assert 2.6 < fused_tiles.FOLD_MARGIN * 2.5 < 3.0
    assert [d.get("pool", 0) for d in fused_tiles.fold(bound, 16, 4000)] == [
        _C.NET_OPS["max_pool"], _C.NET_OPS["avg_pool"], 0]
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "off")
    assert fused_tiles.fold(bound, 16, 4000) == bound
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "always")
    assert [d.get("pool", 0) for d in fused_tiles.fold(bound, 16, 4000)] == [
        _C.NET_OPS["max_pool"], _C.NET_OPS["avg_pool"], 0]
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "yes")
    with pytest.raises(ValueError, match="CYDNN_FUSED_FOLD must be auto, always or off, got 'yes'"):
        fused_tiles.fold(bound, 16, 4000)


# ---------------------------------------------------------------------- a 2x2 pooling folded into tile 7
def test_what_folds_into_the_convolution():
    _, d = _layer("mid")
    pool = dict(op="max_pool", c=48, h=16, w=16, oh=8, ow=8, kh=2, kw=2, sh=2, sw=2, ph=0, pw=0, epi=[])
    assert fused_tiles.foldable(d, pool) and fused_tiles.foldable(d, dict(pool, op="avg_pool"))
    assert not fused_tiles.foldable(d, dict(pool, kh=3, kw=3, oh=7, ow=7))            # another window
    assert not fused_tiles.foldable(d, dict(pool, sh=1, sw=1, oh=15, ow=15))          # another stride
    assert not fused_tiles.foldable(d, dict(pool, ph=1, pw=1, oh=9, ow=9))            # padding
    assert not fused_tiles.foldable(d, dict(pool, epi=[_C.NET_EPI_ACT]))              # an epilogue of its own
    assert not fused_tiles.foldable(d, dict(pool, op="global_avg_pool"))
    folded = dict(d, tile=7, pool=_C.NET_OPS["max_pool"])
    assert fused_tiles.size(folded) == 48 * 8 * 8 and fused_tiles.wsplit_items(folded) == 12 * 8 * 8
    _, deeper = _layer("deeper")                                                    # 7x7: floor, 3x3
    assert fused_tiles.size(dict(deeper, pool=_C.NET_OPS["avg_pool"])) == 128 * 3 * 3


POOLED = ("first", "mid", "deep", "deeper", "odd", "five", "wide", "unpadded")


def _pooled(name, kind, device):
    model, d = _layer(name, device)
    pool = nn.MaxPool2d(2) if kind == "max_pool" else nn.AvgPool2d(2)
    return nn.Sequential(*model, pool).to(device).eval(), dict(d, tile=7, pool=_C.NET_OPS[kind])


@gpu
@pytest.mark.parametrize("kind", ["max_pool", "avg_pool"])
@pytest.mark.parametrize("name", POOLED)
def test_the_folded_pooling_gives_the_per_op_outputs(name, kind):
    """Split ways (16 blocks), one way with scratch too small (cluster 1: every item a thread, no staging),
    weights staged, in chunks, unstaged."""
    model, d = _pooled(name, kind, "cuda")
    c, h, w = SHAPES[name][0]
    x = np.random.default_rng(1).standard_normal((3, c, h, w)).astype(np.float32)
    want = model(_C.to_device(x)).numpy().reshape(3, -1)
    size = want.shape[1]
    assert size == fused_tiles.size(d)
    xd, y = _C.to_device(x.ravel()), _C.empty((3 * size,))
    for cluster in (1, 4, 16):
        width = -(-max(c * h * w, d["k"] * d["oh"] * d["ow"]) // 4) * 4
        full = min(fused_tiles.staged(d, cluster), fused_net.SMEM_LIMIT // 4 - 2 * width)
        for wcap in (full, 4 * d["kh"] * d["kw"] * 2 + 4, 0):
            table = _C.FusedNet([d], c * h * w, size, False, wcap)
            table.forward(xd, y, 3, cluster)
            np.testing.assert_allclose(y.numpy().reshape(3, -1), want, rtol=1e-5, atol=2e-6,
                                       err_msg=f"{name} {kind} cluster {cluster} wcap {wcap}")


@gpu
def test_a_folded_pooling_is_refused_where_it_cannot_be():
    _, d = _pooled("mid", "max_pool", "cuda")
    size = fused_tiles.size(d)
    for bad, match in ((dict(d, tile=3), "tile 7"), (dict(d, pool=_C.NET_OPS["linear"]), "pool 1"),
                       (dict(d, oh=1, ow=1, h=1, w=1, k=48, ph=0, pw=0, kh=1, kw=1), "2x2 or more")):
        with pytest.raises(ValueError, match=match):
            _C.FusedNet([bad], bad["c"] * bad["h"] * bad["w"], fused_tiles.size(bad), False, 0)
    with pytest.raises(ValueError, match="the layer before gives"):        # the pooled size chains on
        _C.FusedNet([d, dict(op="epilogue", c=48, h=16, w=16, epi=[])], 24 * 256, 48 * 256, False, 0)
    assert size == 48 * 64


@gpu
def test_a_network_with_its_poolings_folded_gives_the_reference_outputs(monkeypatch):
    """Where the folded table times faster (made so here: $CYDNN_FUSED_FOLD=always), the network's bound table
    folds each convolution and its 2x2 pooling into one layer; the outputs stay the per-op path's; a wrong
    value of the switch is refused."""
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "always")
    model, shape, layers, net = _cnn32(8)
    x = np.random.default_rng(2).standard_normal((5,) + shape).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    pools = sum(d["op"] in ("max_pool", "avg_pool") for d in layers)
    assert pools >= 1
    for r in fused_tiles.TUNED_CLUSTERS:
        bound = net._bound[r][0]
        assert sum(bool(d.get("pool")) for d in bound) == pools and len(bound) == len(layers) - pools
        np.testing.assert_allclose(net.run_host(x, r), want, rtol=1e-5, atol=2e-6)
    assert "+ 2x2 pooling" in net.explain()
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "sometimes")
    with pytest.raises(ValueError, match="CYDNN_FUSED_FOLD must be auto, always or off, got 'sometimes'"):
        fused_net.FusedNetwork(layers, shape, net.out_shape, False, 8)


@gpu
@pytest.mark.parametrize("ranks", [1, 4, 16])
def test_the_generated_kernel_of_split_and_folded_layers_gives_the_interpreters_outputs(monkeypatch, ranks):
    """Every convolution of the CNN on tile 7 and its poolings folded in: the kernel NVRTC compiles from the
    generated source (tile 7's template instances named directly, SPLIT where they split: at 16 blocks all
    of them, at 4 some, at 1 none) against the interpreter's table of the same layers, on 3 images."""
    from cydnn.compiler import fused_net_gen
    monkeypatch.setenv("CYDNN_FUSED_FOLD", "always")
    _, _, _, net = _cnn32(4)
    bound = net._bound[16][0]
    assert any(d.get("pool") for d in bound) and all(d["tile"] == 7 for d in bound if d["op"] == "conv")
    room = fused_net.SMEM_LIMIT // 4 - 2 * net._buf_floats
    wcap = min(room, max(fused_tiles.staged(d, ranks) for d in bound))
    table = _C.FusedNet(bound, net.in_size, net.out_size, False, wcap)
    buf = (table.smem_bytes // 4 - wcap) // 2                      # the table's buffers: smaller, folded
    assert buf < net._buf_floats
    text = fused_net_gen.source(bound, ranks, wcap, buf, net.in_size, net.out_size, False)
    convs = [line for line in text.splitlines() if "conv_wsplit<" in line]
    split = [fused_tiles.wsplit_ways(d, ranks, buf) >= 2 for d in bound if d["op"] == "conv"]
    flags = [line.split("conv_wsplit<", 1)[1].split(">(", 1)[0].split(", ") for line in convs]   # KS, POOL[, SPLIT[, STAGED]]
    assert [len(f) > 2 and f[2] == "true" for f in flags] == split
    assert any(split) == (ranks > 1) and all(split) == (ranks == 16)      # at 4 blocks: both kinds of instance
    kernel = _C.NetKernel(fused_net_gen.compile_cubin(text), fused_net_gen.KERNEL_NAME, ranks)
    x = _C.to_device(np.random.default_rng(3).standard_normal(3 * net.in_size).astype(np.float32))
    want, got = _C.empty((3 * net.out_size,)), _C.empty((3 * net.out_size,))
    table.forward(x, want, 3, ranks)
    other = _C.to_device(np.random.default_rng(4).standard_normal(3 * net.in_size).astype(np.float32))
    table.forward(other, got, 3, ranks)          # what the kernel leaves unwritten (in `got`, in shared memory) is wrong
    table.forward(x, got, 3, ranks, kernel)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
