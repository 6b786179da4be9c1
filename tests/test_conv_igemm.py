"""The implicit-GEMM convolution (cpp/conv_igemm.cu): every tile's forward (bias, activation) and data gradient
against float64 numpy and cuDNN, on shapes that leave partial tiles everywhere; its refusals; and the compiler
choosing it (forced) for inference and training against the per-op path."""
import numpy as np
import pytest

import cydnn
from cydnn import _C, ops
from cydnn.compiler.lower import conv_igemm_name
from cydnn.errors import CydnnError

from compiled_ref import inference_against_the_per_op_path, one_step_against_the_per_op_path, small_cnn

gpu = pytest.mark.gpu

# (n, c, h, w, k, kh, kw, stride, padding): partial row and channel tiles, reductions not a multiple of 8,
# planes not a multiple of 4 (no float4 stores), non-square kernels and strides, padding beyond kh - 1
SHAPES = [
    (2, 3, 32, 32, 24, 3, 3, (1, 1), (1, 1)),
    (3, 24, 16, 16, 48, 3, 3, (1, 1), (1, 1)),
    (1, 48, 8, 8, 96, 3, 3, (1, 1), (1, 1)),
    (2, 5, 7, 7, 10, 3, 3, (1, 1), (0, 0)),
    (3, 6, 12, 12, 16, 5, 5, (1, 1), (2, 2)),
    (2, 1, 28, 28, 16, 3, 3, (2, 2), (1, 1)),
    (2, 16, 14, 14, 32, 3, 3, (2, 2), (1, 1)),
    (1, 4, 9, 11, 7, 2, 3, (2, 1), (0, 1)),
    (2, 3, 5, 6, 5, 1, 1, (1, 1), (1, 0)),
    (1, 2, 6, 6, 3, 3, 3, (1, 1), (2, 2)),
]
ACTS = {0: lambda v: v, 1: lambda v: np.maximum(v, 0), 2: np.tanh, 3: lambda v: 1 / (1 + np.exp(-v)),
        4: lambda v: np.where(v > 0, v, 0.1 * v)}


def _conv64(x, w, stride, padding):
    """float64 cross-correlation (what conv_forward computes), summing window offset by window offset."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh, ow = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, k, oh, ow))
    for p in range(kh):
        for q in range(kw):
            patch = xp[:, :, p:p + sh * oh:sh, q:q + sw * ow:sw]
            y += np.einsum("nchw,kc->nkhw", patch, w[:, :, p, q].astype(np.float64))
    return y


def _dx64(dy, w, x_shape, padding):
    """float64 data gradient of a stride-1 convolution (the adjoint of _conv64)."""
    n, c, h, wd = x_shape
    k, _, kh, kw = w.shape
    (ph, pw), oh, ow = padding, dy.shape[2], dy.shape[3]
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    for p in range(kh):
        for q in range(kw):
            dxp[:, :, p:p + oh, q:q + ow] += np.einsum("nkhw,kc->nchw", dy.astype(np.float64), w[:, :, p, q])
    return dxp[:, :, ph:ph + h, pw:pw + wd]


def _data(shape, seed=0):
    n, c, h, wd, k, kh, kw, stride, padding = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = (rng.standard_normal((k, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return x, w, b, stride, padding


def _tiles():
    return range(len(_C.igemm_conv_tiles()))


def test_the_tiles_are_named_without_a_gpu():
    """The tile table is host data: rows and channels a block, its threads (every tile divides its work evenly)."""
    tiles = _C.igemm_conv_tiles()
    assert len(tiles) >= 3 and len({conv_igemm_name(t) for t in tiles}) == len(tiles)     # names tell them apart
    for rows, channels, threads, chunk, splits in tiles:
        assert rows % 16 == 0 and channels % 16 == 0 and threads % 32 == 0 and rows * chunk % threads == 0
        assert chunk in (8, 16, 24) and splits >= 1


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + f"s{s[7][0]}{s[7][1]}p{s[8][0]}{s[8][1]}")
def test_every_tile_computes_the_forward_with_bias_and_activation(shape):
    x, w, b, stride, padding = _data(shape)
    ref = _conv64(x, w, stride, padding) + b[None, :, None, None]
    dx, dw, db = (ops.cuda.asarray(a) for a in (x, w, b))
    scale = np.abs(ref).max()
    for tile in _tiles():
        for act, fn in ACTS.items():
            y = ops.cuda.empty(ref.shape)
            _C.igemm_conv_forward(dx, dw, db, y, stride, padding, act, 0.1, tile)
            got = ops.cuda.to_numpy(y)
            np.testing.assert_allclose(got, fn(ref), rtol=0, atol=2e-6 * scale, err_msg=f"tile {tile} act {act}")
        y = ops.cuda.empty(ref.shape)                              # no bias
        _C.igemm_conv_forward(dx, dw, None, y, stride, padding, 0, 0.0, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(y), ref - b[None, :, None, None], rtol=0, atol=2e-6 * scale)


@gpu
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[7] == (1, 1)],
                         ids=lambda s: "x".join(map(str, s[:7])) + f"p{s[8][0]}{s[8][1]}")
def test_every_tile_computes_the_data_gradient_beside_cudnns_filter_gradient(shape):
    """conv_backward with dx by a tile: dx against float64 numpy and cuDNN's dx; dw (cuDNN's, on the second
    stream) as in the call where cuDNN computes dx (not bit for bit: cuDNN's filter gradient may add with
    atomics, and two calls of it differed in the last bits on the H100)."""
    x, w, _, stride, padding = _data(shape)
    y_shape = _conv64(x, w, stride, padding).shape
    dy = np.random.default_rng(1).standard_normal(y_shape).astype(np.float32)
    ref = _dx64(dy, w, x.shape, padding)
    gx, gw, gdy = (ops.cuda.asarray(a) for a in (x, w, dy))
    dx0, dw0 = ops.cuda.empty(x.shape), ops.cuda.empty(w.shape)
    _C.conv_backward(gx, gw, gdy, dx0, dw0, None, stride, padding)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ops.cuda.to_numpy(dx0), ref, rtol=0, atol=2e-6 * scale)
    for tile in _tiles():
        dx, dw = ops.cuda.empty(x.shape), ops.cuda.empty(w.shape)
        _C.conv_backward(gx, gw, gdy, dx, dw, None, stride, padding, tile)
        np.testing.assert_allclose(ops.cuda.to_numpy(dx), ref, rtol=0, atol=2e-6 * scale, err_msg=f"tile {tile}")
        want = ops.cuda.to_numpy(dw0)
        np.testing.assert_allclose(ops.cuda.to_numpy(dw), want, rtol=0, atol=1e-5 * np.abs(want).max())


@gpu
def test_bad_calls_are_refused_before_any_gpu_work():
    x, w, b, stride, padding = _data(SHAPES[0])
    gx, gw, gb = (ops.cuda.asarray(a) for a in (x, w, b))
    y = ops.cuda.empty((2, 24, 32, 32))
    with pytest.raises(ValueError, match=r"igemm_conv_forward: .*got y \(2, 24, 31, 32\)"):
        _C.igemm_conv_forward(gx, gw, gb, ops.cuda.empty((2, 24, 31, 32)), stride, padding, 1)
    with pytest.raises(ValueError, match=r"b must have shape \(24,\)"):
        _C.igemm_conv_forward(gx, gw, ops.cuda.asarray(b[:5]), y, stride, padding, 1)
    with pytest.raises(CydnnError, match=r"igemm_conv_forward: tile must be 0\.\.\d+, got 99"):
        _C.igemm_conv_forward(gx, gw, gb, y, stride, padding, 1, 0.0, 99)
    with pytest.raises(CydnnError, match="act must be 0..4"):
        _C.igemm_conv_forward(gx, gw, gb, y, stride, padding, 7)
    wide = ops.cuda.asarray(np.zeros((4, 300, 3, 3), np.float32))           # c*kh*kw = 2700: beyond the table
    with pytest.raises(CydnnError, match=r"reduction \(c\*kh\*kw\) is 2700"):
        _C.igemm_conv_forward(ops.cuda.empty((1, 300, 5, 5)), wide, None, ops.cuda.empty((1, 4, 3, 3)), (1, 1),
                              (0, 0), 0)
    x2, w2, _, s2, p2 = _data(SHAPES[5])                                      # stride 2: no implicit-GEMM dx
    dy2 = ops.cuda.empty((2, 16, 14, 14))
    with pytest.raises(CydnnError, match="takes stride 1, got 2x2"):
        _C.conv_backward(ops.cuda.asarray(x2), ops.cuda.asarray(w2), dy2, ops.cuda.empty(x2.shape),
                         ops.cuda.empty(w2.shape), None, s2, p2, 0)


@gpu
def test_a_split_reduction_beyond_the_workspace_limit_is_refused_and_the_compiler_drops_it():
    """A split tile's partial sums live in the context's workspace: over the limit, the call raises (the executor
    then drops that tile, as it drops any that raises) and the unsplit tiles still run."""
    x, w, b, stride, padding = _data(SHAPES[2])                       # 27 chunks of 16: every split is used
    ref = _conv64(x, w, stride, padding) + b[None, :, None, None]
    gx, gw, gb = (ops.cuda.asarray(a) for a in (x, w, b))
    tiles = _C.igemm_conv_tiles()
    split = next(i for i, t in enumerate(tiles) if t[4] > 1)
    whole = next(i for i, t in enumerate(tiles) if t[4] == 1)
    limit = cydnn.cuda.settings()["workspace_limit"]
    cydnn.cuda.set_workspace_limit(1024)
    try:
        y = ops.cuda.empty(ref.shape)
        with pytest.raises(CydnnError, match="igemm_conv_forward"):
            _C.igemm_conv_forward(gx, gw, gb, y, stride, padding, 0, 0.0, split)
        _C.igemm_conv_forward(gx, gw, gb, y, stride, padding, 0, 0.0, whole)
        np.testing.assert_allclose(ops.cuda.to_numpy(y), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    finally:
        cydnn.cuda.set_workspace_limit(limit)


@gpu
@pytest.mark.parametrize("n", [1, 64])
def test_the_compiled_inference_on_the_implicit_gemm_gives_the_reference(monkeypatch, n):
    monkeypatch.setenv("CYDNN_CONV", "igemm")
    x = np.random.default_rng(4).standard_normal((n, 3, 32, 32)).astype(np.float32)
    infer = inference_against_the_per_op_path(small_cnn, x, rtol=1e-4, atol=1e-5)
    kernels = [step.kernels for step in infer._runners[n].plan.steps if step.kind == "conv_bias_act"]
    assert len(kernels) == 3 and all(k[0].startswith("igemm_conv_kernel<") for k in kernels), kernels
    assert "igemm_conv_kernel<" in infer.explain(n)


@gpu
def test_a_training_step_on_the_implicit_gemm_gives_the_reference_gradients(monkeypatch):
    """Forced: every convolution's forward on a tile, and the data gradient of the stride-1 one that needs it
    (the first layer has none; the stride-2 one keeps cuDNN's); one step's gradients against the per-op path."""
    monkeypatch.setenv("CYDNN_CONV", "igemm")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 32)
    text = one_step_against_the_per_op_path(small_cnn, x, y).explain()
    backward = [line for line in text.splitlines() if " conv_backward " in line]
    assert len(backward) == 3
    assert sum("igemm_conv_kernel<" in line for line in backward) == 1, backward     # conv2 only (conv1: no dx)
    assert sum("igemm_conv_kernel<" in line for line in text.splitlines() if " conv_bias_act " in line) == 3
