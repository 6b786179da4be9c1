"""The product with few rows (cpp/gemm_skinny.cu): every tile's forward (bias, activation) and data-gradient layout
against float64 numpy, on shapes that leave partial tiles, reductions that are not whole chunks and rows that are
not whole float4s; the same bits every run (the cluster's sums in a fixed order); its refusals; the linear layer's
backward with dx on a tile; and the compiler choosing it (forced) for inference and training against the per-op
path."""
import numpy as np
import pytest

from cydnn import _C, nn, ops
from cydnn.compiler import executor
from cydnn.compiler.lower import skinny_gemm_name
from cydnn.errors import CydnnError

from compiled_ref import inference_against_the_per_op_path, one_step_against_the_per_op_path

gpu = pytest.mark.gpu

# (m, n, k): the zoo's layers at small batches; partial row and column tiles; k not a multiple of 16 or of 4
# (scalar loads); fewer chunks than a cluster has blocks
SHAPES = [(64, 1024, 784), (64, 128, 1536), (1, 10, 128), (3, 37, 131), (17, 5, 9), (70, 66, 260)]
ACTS = {0: lambda v: v, 1: lambda v: np.maximum(v, 0), 2: np.tanh, 3: lambda v: 1 / (1 + np.exp(-v)),
        4: lambda v: np.where(v > 0, v, 0.1 * v)}


def _data(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    return a, w, b


def _tiles():
    return range(len(_C.skinny_gemm_tiles()))


def test_the_tiles_are_named_without_a_gpu():
    """The tile table is host data: rows and columns a block (4 x 4 a thread), the splits of a cluster."""
    tiles = _C.skinny_gemm_tiles()
    assert len(tiles) >= 4 and len({skinny_gemm_name(t) for t in tiles}) == len(tiles)
    for rows, cols, threads, splits in tiles:
        assert rows % 16 == 0 and cols % 16 == 0 and threads == (rows // 4) * (cols // 4)
        assert splits in (1, 2, 4, 8, 16)


def test_the_tiles_timed_fit_the_product(monkeypatch):
    """executor.skinny_tiles: no tile with more rows than the product (but the fewest-row tile always), none
    wider than twice its columns (but the narrowest), no split with a block left without a chunk of 16."""
    table = [(64, 64, 256, 1), (64, 64, 256, 8), (64, 32, 128, 16), (16, 64, 64, 16), (32, 32, 64, 4)]
    monkeypatch.setattr(executor._C, "skinny_gemm_tiles", lambda: table)
    names = lambda *a: [skinny_gemm_name(t) for _, t in executor.skinny_tiles(*a)]     # noqa: E731
    assert names(64, 1024, 1024) == ["skinny64x64s1", "skinny64x64s8", "skinny64x32s16", "skinny16x64s16",
                                     "skinny32x32s4"]
    assert names(1, 1024, 1024) == ["skinny16x64s16"]                  # one row: the fewest-row tile only
    assert names(64, 10, 1024) == ["skinny64x32s16", "skinny32x32s4"]   # ten columns: 32 wide at most
    assert names(64, 1024, 64) == ["skinny64x64s1", "skinny32x32s4"]    # 4 chunks: no split beyond 4
    assert names(1, 10, 130) == ["skinny16x64s16"]     # the narrowest and least split of the one-row tiles
    assert names(1, 10, 10) == ["skinny16x64s16"]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_tile_gives_the_product_forward_and_data_gradient(shape):
    m, n, k = shape
    a, w, b = _data(m, n, k)
    ga, gw, gb = ops.cuda.asarray(a), ops.cuda.asarray(w), ops.cuda.asarray(b)
    forward = a.astype(np.float64) @ w.T.astype(np.float64) + b
    # the data-gradient layout: c (m, k) = a' (m, n) . w (n, k)
    d = np.random.default_rng(1).standard_normal((m, n)).astype(np.float32)
    gd = ops.cuda.asarray(d)
    dx = d.astype(np.float64) @ w.astype(np.float64)
    for tile in _tiles():
        y = ops.cuda.empty((m, n))
        _C.skinny_gemm(ga, gw, gb, y, False, 0, 0.0, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(y), forward, rtol=0, atol=2e-6 * np.abs(forward).max(),
                                   err_msg=f"forward, tile {tile}")
        g = ops.cuda.empty((m, k))
        _C.skinny_gemm(gd, gw, None, g, True, 0, 0.0, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(g), dx, rtol=0, atol=2e-6 * np.abs(dx).max(),
                                   err_msg=f"data gradient, tile {tile}")


@gpu
@pytest.mark.parametrize("act", sorted(ACTS))
def test_the_epilogue_adds_the_bias_and_the_activation(act):
    m, n, k = 37, 70, 300
    a, w, b = _data(m, n, k, seed=act)
    want = ACTS[act](a.astype(np.float64) @ w.T.astype(np.float64) + b)
    ga, gw, gb = ops.cuda.asarray(a), ops.cuda.asarray(w), ops.cuda.asarray(b)
    for tile in _tiles():
        y = ops.cuda.empty((m, n))
        _C.skinny_gemm(ga, gw, gb, y, False, act, 0.1, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(y), want, rtol=0, atol=3e-6 * max(1.0, np.abs(want).max()),
                                   err_msg=f"act {act}, tile {tile}")


@gpu
def test_the_same_bits_every_run():
    """The cluster's partial sums are added in rank order: two runs, and the run inside a CUDA graph, agree bit for
    bit."""
    a, w, b = _data(64, 256, 1024)
    ga, gw, gb = ops.cuda.asarray(a), ops.cuda.asarray(w), ops.cuda.asarray(b)
    for tile in _tiles():
        y1, y2 = ops.cuda.empty((64, 256)), ops.cuda.empty((64, 256))
        _C.skinny_gemm(ga, gw, gb, y1, False, 0, 0.0, tile)
        _C.synchronize()
        _C.graph_begin()
        _C.skinny_gemm(ga, gw, gb, y2, False, 0, 0.0, tile)
        graph = _C.graph_end()
        graph.launch()
        _C.synchronize()
        assert np.array_equal(ops.cuda.to_numpy(y1), ops.cuda.to_numpy(y2)), tile


@gpu
def test_bad_arguments_are_refused_before_any_gpu_work():
    a, w, b = (ops.cuda.asarray(v) for v in _data(4, 8, 16))
    y = ops.cuda.empty((4, 8))
    with pytest.raises(ValueError, match=r"skinny_gemm: a \(4, 16\) and w \(8, 16\)"):
        _C.skinny_gemm(a, w, b, ops.cuda.empty((4, 9)), False)
    with pytest.raises(ValueError, match="skinny_gemm: bias must have shape"):
        _C.skinny_gemm(a, w, ops.cuda.empty((7,)), y, False)
    with pytest.raises(ValueError, match="must be 2-D"):
        _C.skinny_gemm(a.reshape((4, 16, 1)), w, b, y, False)
    with pytest.raises(ValueError, match=r"\(k, n\)"):
        _C.skinny_gemm(a, w, None, y, True)                    # b_kn: w would have to be (16, n)
    with pytest.raises(CydnnError, match="skinny_gemm: tile must be"):
        _C.skinny_gemm(a, w, b, y, False, 0, 0.0, len(_C.skinny_gemm_tiles()))
    with pytest.raises(CydnnError, match="act must be"):
        _C.skinny_gemm(a, w, b, y, False, 7)


@gpu
def test_the_linear_backward_with_dx_on_a_tile_gives_cublas_results():
    """dx by each tile beside cuBLASLt's dw on the second stream: dx against float64, dw and db as without it."""
    m, k, n = 64, 200, 96
    x, w, _ = _data(m, n, k)
    dy = np.random.default_rng(3).standard_normal((m, n)).astype(np.float32)
    gx, gw, gdy = ops.cuda.asarray(x), ops.cuda.asarray(w), ops.cuda.asarray(dy)
    ref = [ops.cuda.empty(s) for s in ((m, k), (n, k), (n,))]
    _C.linear_backward(gx, gw, gdy, *ref)
    want_dx = dy.astype(np.float64) @ w.astype(np.float64)
    for tile in _tiles():
        got = [ops.cuda.empty(s) for s in ((m, k), (n, k), (n,))]
        _C.linear_backward(gx, gw, gdy, *got, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(got[0]), want_dx, rtol=0, atol=2e-6 * np.abs(want_dx).max())
        for g, r in zip(got[1:], ref[1:]):
            assert np.array_equal(ops.cuda.to_numpy(g), ops.cuda.to_numpy(r)), tile


def _mlp(rng=0):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 300, rng=rng), nn.ReLU(), nn.Linear(300, 130, rng=rng),
                         nn.Tanh(), nn.Linear(130, 10, rng=rng))


@gpu
@pytest.mark.parametrize("n", [1, 64])
def test_the_compiled_inference_on_the_tiles_gives_the_reference(monkeypatch, n):
    monkeypatch.setenv("CYDNN_LINEAR", "skinny")
    x = np.random.default_rng(4).standard_normal((n, 1, 28, 28)).astype(np.float32)
    infer = inference_against_the_per_op_path(_mlp, x, rtol=1e-5, atol=1e-5)
    kernels = [step.kernels for step in infer._runners[n].plan.steps if step.kind == "linear_forward"]
    assert len(kernels) == 3 and all(k[0].startswith("skinny_gemm_kernel<") for k in kernels), kernels
    assert "skinny_gemm_kernel<" in infer.explain(n)


@gpu
def test_a_training_step_on_the_tiles_gives_the_reference_gradients(monkeypatch):
    """Forced: every linear forward on a tile, and the data gradient of the layer that needs one outside the head;
    one step's loss and gradients against the per-op path.  The last layer is the head (passes.fuse_head): the
    two kernels of cpp/compiled_head.cu, or the four steps it replaced, whichever is faster (``skinny`` forces
    neither)."""
    monkeypatch.setenv("CYDNN_LINEAR", "skinny")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 64)
    lines = one_step_against_the_per_op_path(_mlp, x, y).explain().splitlines()
    assert sum("skinny_gemm_kernel<" in line for line in lines if " linear_forward " in line) == 2
    assert sum("skinny_gemm_kernel<" in line for line in lines if " linear_backward " in line) == 1
    assert sum(" linear_xent " in line for line in lines) == 1
