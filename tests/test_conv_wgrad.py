"""The convolution's filter gradient as a split GEMM (cpp/conv_wgrad.cu): every tile against float64 numpy on shapes
that leave partial tiles and chunks (strides, padding beyond kh - 1, non-square kernels, 1x1), with and without dx
beside it and with cuDNN's bias gradient; the same bits every run; its refusals; and the compiler choosing it
(forced) in a training step against the per-op path."""
import numpy as np
import pytest

from cydnn import _C, ops
from cydnn.compiler import executor
from cydnn.compiler.lower import conv_wgrad_name
from cydnn.errors import CydnnError

from compiled_ref import one_step_against_the_per_op_path, small_cnn

gpu = pytest.mark.gpu

# (n, c, h, w, k, kh, kw, stride, padding)
SHAPES = [
    (2, 3, 32, 32, 24, 3, 3, (1, 1), (1, 1)),
    (3, 24, 16, 16, 48, 3, 3, (1, 1), (1, 1)),
    (2, 1, 28, 28, 16, 5, 5, (1, 1), (0, 0)),
    (2, 16, 14, 14, 32, 3, 3, (2, 2), (1, 1)),
    (1, 4, 9, 11, 7, 2, 3, (2, 1), (0, 1)),
    (2, 3, 5, 6, 5, 1, 1, (1, 1), (1, 0)),
    (1, 2, 6, 6, 3, 3, 3, (1, 1), (2, 2)),
    (5, 70, 4, 4, 66, 3, 3, (1, 1), (1, 1)),
]


def _dw64(x, dy, kh, kw, stride, padding):
    """float64 filter gradient: dw[k, c, p, q] = sum over images and output pixels of dy * the input under (p, q)."""
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh, ow = dy.shape[2], dy.shape[3]
    dw = np.zeros((dy.shape[1], x.shape[1], kh, kw))
    for p in range(kh):
        for q in range(kw):
            patch = xp[:, :, p:p + sh * oh:sh, q:q + sw * ow:sw]
            dw[:, :, p, q] = np.einsum("nchw,nkhw->kc", patch, dy.astype(np.float64))
    return dw


def _data(shape, seed=0):
    n, c, h, wd, k, kh, kw, stride, padding = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = (rng.standard_normal((k, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(np.float32)
    oh, ow = (h + 2 * padding[0] - kh) // stride[0] + 1, (wd + 2 * padding[1] - kw) // stride[1] + 1
    dy = rng.standard_normal((n, k, oh, ow)).astype(np.float32)
    return x, w, dy, stride, padding


def _tiles():
    return range(len(_C.conv_wgrad_tiles()))


def test_the_tiles_are_named_without_a_gpu():
    tiles = _C.conv_wgrad_tiles()
    assert len(tiles) >= 4 and len({conv_wgrad_name(t) for t in tiles}) == len(tiles)
    for channels, reductions, threads, splits in tiles:
        assert channels % 16 == 0 and reductions % 16 == 0 and threads == (channels // 4) * (reductions // 4)
        assert threads % 16 == 0 and splits >= 1


def test_the_tiles_timed_fit_the_layer(monkeypatch):
    """executor.wgrad_tiles: none wider than twice the output channels (but the narrowest), none split into blocks
    of fewer than 4 chunks of 16 output pixels."""
    table = [(16, 64, 64, 32), (32, 32, 64, 128), (64, 64, 256, 8)]
    monkeypatch.setattr(executor._C, "conv_wgrad_tiles", lambda: table)
    names = lambda *a: [conv_wgrad_name(t) for _, t in executor.wgrad_tiles(*a)]     # noqa: E731
    assert names(16, 64 * 24 * 24) == ["wgrad16x64s32"]                          # 16 channels: 16 wide
    assert names(48, 64 * 16 * 16) == ["wgrad16x64s32", "wgrad32x32s128", "wgrad64x64s8"]
    assert names(96, 64 * 8 * 8) == ["wgrad16x64s32", "wgrad64x64s8"]           # 256 chunks: no split of 128
    assert names(8, 16) == []                                                   # one chunk: not worth splitting


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + f"s{s[7][0]}{s[7][1]}p{s[8][0]}{s[8][1]}")
def test_every_tile_gives_the_filter_gradient(shape):
    """Alone (no dx: a first layer's backward, on the stream) and beside dx (on the second stream), with the bias
    gradient (cuDNN's) in both; dx and db as cuDNN's."""
    x, w, dy, stride, padding = _data(shape)
    want = _dw64(x, dy, w.shape[2], w.shape[3], stride, padding)
    gx, gw, gdy = ops.cuda.asarray(x), ops.cuda.asarray(w), ops.cuda.asarray(dy)
    dx0, db0 = ops.cuda.empty(x.shape), ops.cuda.empty((w.shape[0],))
    _C.conv_backward(gx, gw, gdy, dx0, ops.cuda.empty(w.shape), db0, stride, padding)
    for tile in _tiles():
        for with_dx in (False, True):
            dw, db = ops.cuda.empty(w.shape), ops.cuda.empty((w.shape[0],))
            dx = ops.cuda.empty(x.shape) if with_dx else None
            _C.conv_backward(gx, gw, gdy, dx, dw, db, stride, padding, -1, tile)
            np.testing.assert_allclose(ops.cuda.to_numpy(dw), want, rtol=0, atol=3e-6 * np.abs(want).max(),
                                       err_msg=f"tile {tile}, dx {with_dx}")
            np.testing.assert_allclose(ops.cuda.to_numpy(db), ops.cuda.to_numpy(db0), rtol=1e-6, atol=1e-5)
            if with_dx:
                ref = ops.cuda.to_numpy(dx0)
                np.testing.assert_allclose(ops.cuda.to_numpy(dx), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


@gpu
def test_the_same_bits_every_run():
    """The splits' partial sums are added in a fixed order by the second kernel: eager and replayed agree bit for bit."""
    x, w, dy, stride, padding = _data(SHAPES[1])
    gx, gw, gdy = ops.cuda.asarray(x), ops.cuda.asarray(w), ops.cuda.asarray(dy)
    for tile in _tiles():
        dw1, dw2 = ops.cuda.empty(w.shape), ops.cuda.empty(w.shape)
        _C.conv_backward(gx, gw, gdy, None, dw1, None, stride, padding, -1, tile)
        _C.synchronize()
        _C.graph_begin()
        _C.conv_backward(gx, gw, gdy, None, dw2, None, stride, padding, -1, tile)
        graph = _C.graph_end()
        graph.launch()
        _C.synchronize()
        assert np.array_equal(ops.cuda.to_numpy(dw1), ops.cuda.to_numpy(dw2)), tile


@gpu
def test_bad_arguments_are_refused_before_any_gpu_work():
    x, w, dy, stride, padding = _data(SHAPES[0])
    gx, gw, gdy = ops.cuda.asarray(x), ops.cuda.asarray(w), ops.cuda.asarray(dy)
    with pytest.raises(ValueError, match="conv_backward: dw must have w's shape"):
        _C.conv_backward(gx, gw, gdy, None, ops.cuda.empty((24, 3, 3, 2)), None, stride, padding, -1, 0)
    with pytest.raises(ValueError, match="conv_backward: x .* make dy"):
        _C.conv_backward(gx, gw, ops.cuda.empty((2, 24, 31, 32)), None, ops.cuda.empty(w.shape), None, stride,
                         padding)
    with pytest.raises(CydnnError, match="conv_backward: tile must be"):
        _C.conv_backward(gx, gw, gdy, None, ops.cuda.empty(w.shape), None, stride, padding, -1,
                         len(_C.conv_wgrad_tiles()))


@gpu
def test_a_training_step_on_the_filter_gradient_tiles_gives_the_reference_gradients(monkeypatch):
    """Forced: every convolution's filter gradient on a tile (the first without dx, the stride-2 one beside cuDNN's
    dx); one step's loss and gradients against the per-op path, and the printout naming the kernels."""
    monkeypatch.setenv("CYDNN_CONV", "wgrad")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 32)
    step = one_step_against_the_per_op_path(small_cnn, x, y)
    backward = [line for line in step.explain().splitlines() if " conv_backward " in line]
    assert len(backward) == 3 and all("wgrad_kernel<" in line for line in backward), backward
