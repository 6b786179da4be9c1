"""Max pooling whose windows tile its input (kernel == stride, no padding), as the compiler's plans run it.
The forward (cpp/pool.cu's max_pool_tiled_kernel): cuDNN's values and the CPU twin's on ordinary data, the twin's
on windows of NaN and infinities; its refusals; where lowering takes it.  The backward fused with the activation
(and bias gradient) before it (cpp/compiled_act.cu, passes.fuse_backward): the bits of the two passes it replaces,
on ordinary data and on windows of NaN, infinities and ties; its refusals; where the pass fuses it."""
import numpy as np
import pytest

import cydnn
from cydnn import nn, ops
from cydnn.compiler.compiled import _build_plan

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("shape, kernel", [((64, 24, 32, 32), (2, 2)), ((3, 5, 6, 9), (2, 3)), ((2, 4, 8, 8), (4, 4)),
                                           ((70, 6, 28, 28), (2, 2))])
@pytest.mark.parametrize("act", [0, 1, 2, 3, 4])
def test_max_pool_act_backward_is_the_two_passes_it_replaces(shape, kernel, act):
    """The fused backward of a tiling max pooling and the activation before it (passes.fuse_backward) writes
    the bits max_pool_backward + bias_act_backward write, and a bias gradient within float32 rounding of
    theirs and of float64 numpy (ReLU outputs: windows with tied zeros; 70 images: several chunks a channel)."""
    from cydnn import _C
    rng = np.random.default_rng(act)
    n, c, h, w = shape
    z = rng.standard_normal(shape).astype(np.float32)
    y = {0: z, 1: np.maximum(z, 0), 2: np.tanh(z), 3: 1 / (1 + np.exp(-z)), 4: np.where(z > 0, z, 0.2 * z)}[act]
    y = y.astype(np.float32)
    dy = rng.standard_normal((n, c, h // kernel[0], w // kernel[1])).astype(np.float32)
    yd, dyd = cydnn.to_device(y), cydnn.to_device(dy)
    g_ref, db_ref = _C.empty(shape), _C.empty((c,))
    _C.max_pool_backward(yd, dyd, g_ref, kernel, kernel, (0, 0))
    _C.bias_act_backward(yd, g_ref, g_ref, db_ref, n, c, h * w, act, 0.2)
    g, db = _C.empty(shape), _C.empty((c,))
    _C.max_pool_act_backward(yd, dyd, g, db, kernel, act, 0.2)
    np.testing.assert_array_equal(g.numpy(), g_ref.numpy())
    np.testing.assert_allclose(db.numpy(), db_ref.numpy(), rtol=1e-5, atol=1e-4)
    g64 = g_ref.numpy().astype(np.float64)
    np.testing.assert_allclose(db.numpy(), g64.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)
    g2 = _C.empty(shape)
    _C.max_pool_act_backward(yd, dyd, g2, None, kernel, act, 0.2)           # no bias: the same gradient
    np.testing.assert_array_equal(g2.numpy(), g_ref.numpy())


@gpu
def test_max_pool_act_backward_refuses_what_it_cannot_compute():
    from cydnn import _C
    y, dy, g = _C.empty((2, 3, 6, 6)), _C.empty((2, 3, 3, 3)), _C.empty((2, 3, 6, 6))
    with pytest.raises(ValueError, match=r"max_pool_act_backward: kernel \(4, 4\) must tile y's plane \(6, 6\)"):
        _C.max_pool_act_backward(y, _C.empty((2, 3, 1, 1)), g, None, (4, 4), 1)
    with pytest.raises(ValueError, match=r"max_pool_act_backward: dy must have shape \(2, 3, 3, 3\)"):
        _C.max_pool_act_backward(y, _C.empty((2, 3, 2, 3)), g, None, (2, 2), 1)
    with pytest.raises(ValueError, match="dbias must have 3 values"):
        _C.max_pool_act_backward(y, dy, g, _C.empty((4,)), (2, 2), 1)
    with pytest.raises(cydnn.CydnnError, match="act must be 0..4, got 7"):
        _C.max_pool_act_backward(y, dy, g, None, (2, 2), 7)


def test_fuse_backward_takes_only_tiling_pools_right_before_their_activation():
    """CPU: the pass fuses a 2x2/2 pooling after conv + ReLU (the CNN's three), not an overlapping 3x3/2 one, not
    one after a batch norm (its backward is bn_act_backward), and nothing with fuse=False."""
    def kinds(layers, shape, **options):
        plan = _build_plan(nn.Sequential(*layers), shape, 4, True, options)[0]
        return [s.kind for s in plan.steps]
    conv = lambda: nn.Conv2d(3, 4, 3, padding=1)                 # noqa: E731
    tiled = [conv(), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 10)]
    assert kinds(tiled, (3, 8, 8)).count("max_pool_act_backward") == 1
    assert "max_pool_backward" not in kinds(tiled, (3, 8, 8))
    assert "max_pool_act_backward" not in kinds(tiled, (3, 8, 8), fuse=False)
    overlapping = [conv(), nn.ReLU(), nn.MaxPool2d(3, stride=2), nn.Flatten(), nn.Linear(4 * 3 * 3, 10)]
    assert "max_pool_act_backward" not in kinds(overlapping, (3, 8, 8))
    ragged = [conv(), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 10)]
    assert "max_pool_act_backward" not in kinds(ragged, (3, 7, 7))   # a row and a column in no window
    normed = [nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
              nn.Linear(4 * 4 * 4, 10)]
    assert "max_pool_act_backward" not in kinds(normed, (3, 8, 8))


@gpu
@pytest.mark.parametrize("act", [0, 1, 4])
def test_max_pool_act_backward_on_nan_infinities_ties_and_signed_zeros(act):
    """2x2 windows (the float2 path) whose maximum is NaN-free but beside NaN, all -inf, all NaN, tied in each of
    the four places, with dy of -0.0 and +0.0: the first-maximum rule and the products are the unfused passes'
    bit for bit (NaN never wins; a window with no winner sends dy to its first input)."""
    from cydnn import _C
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    windows = [[1, nan, 2, 0], [nan, nan, nan, nan], [-inf, -inf, -inf, -inf], [3, 3, 3, 3], [0, 5, 5, 1],
               [0, 0, 7, 7], [-1, -2, -3, 4], [inf, nan, inf, 1], [nan, -inf, 2, 2], [0, -0.0, 0, 0]]
    n, c = 2, 3
    wins = np.array([windows[i % len(windows)] for i in range(n * c * 2 * 5)], np.float32).reshape(n, c, 2, 5, 2, 2)
    y = wins.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, 4, 10)            # (oy, ky, ox, kx) -> rows, columns
    if act == 1:
        y = np.where(np.isnan(y), y, np.maximum(y, 0)).astype(np.float32)
    dy = np.where(np.arange(n * c * 10).reshape(n, c, 2, 5) % 3 == 0, np.float32(-0.0), np.float32(1.5))
    dy = dy * np.where(np.arange(n * c * 10).reshape(n, c, 2, 5) % 2 == 0, 1, -1).astype(np.float32)
    yd, dyd = cydnn.to_device(y), cydnn.to_device(dy.astype(np.float32))
    g_ref = _C.empty(y.shape)
    _C.max_pool_backward(yd, dyd, g_ref, (2, 2), (2, 2), (0, 0))
    _C.bias_act_backward(yd, g_ref, g_ref, None, n, c, 40, act, 0.2)
    g = _C.empty(y.shape)
    _C.max_pool_act_backward(yd, dyd, g, None, (2, 2), act, 0.2)
    ref, got = g_ref.numpy(), g.numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), np.argwhere(ref.view(np.uint32) !=
                                                                                  got.view(np.uint32))[:5]


@gpu
@pytest.mark.parametrize("shape, kernel", [((64, 24, 32, 32), (2, 2)), ((3, 5, 6, 9), (2, 3)), ((2, 4, 8, 8), (4, 4)),
                                           ((2, 3, 6, 6), (3, 3)), ((5, 7, 2, 2), (2, 2))])
def test_the_tiled_max_pool_forward_is_cudnns_and_the_twins(shape, kernel):
    """Random data: cuDNN's pooling (the per-op path) and the CPU twin give the same values bit for bit."""
    from cydnn import _C
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    out = (shape[0], shape[1], shape[2] // kernel[0], shape[3] // kernel[1])
    xd, y, y_ref = cydnn.to_device(x), _C.empty(out), _C.empty(out)
    _C.max_pool_tiled_forward(xd, y, kernel)
    _C.max_pool_forward(xd, y_ref, kernel, kernel, (0, 0))
    np.testing.assert_array_equal(y.numpy(), y_ref.numpy())
    np.testing.assert_array_equal(y.numpy(), ops.cpu.max_pool_forward(x, kernel, kernel)[0])


@gpu
@pytest.mark.parametrize("kernel", [(2, 2), (1, 2)])
def test_the_tiled_max_pool_forward_on_nan_and_infinities_is_the_twins(kernel):
    """NaN never wins, a window of -inf / NaN only gives -inf, +inf wins: the CPU twin's rule, bit for bit."""
    from cydnn import _C
    nan, inf = np.nan, np.inf
    windows = [[1, nan, 2, 0], [nan, nan, nan, nan], [-inf, -inf, -inf, -inf], [nan, -inf, nan, -inf],
               [inf, nan, 1, 2], [-0.0, 0.0, -0.0, -1], [nan, 3, nan, nan], [5, 5, 5, 5]]
    wins = np.array(windows * 3, np.float32).reshape(2, 3, 2, 2, 2, 2)       # (n, c, oy, ox, ky, kx)
    x = np.ascontiguousarray(wins.transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 4, 4))
    out = (2, 3, 4 // kernel[0], 4 // kernel[1])
    y = _C.empty(out)
    _C.max_pool_tiled_forward(cydnn.to_device(x), y, kernel)
    ref = ops.cpu.max_pool_forward(x, kernel, kernel)[0]
    assert np.array_equal(y.numpy().view(np.uint32), ref.view(np.uint32))


@gpu
def test_the_tiled_max_pool_forward_refuses_what_it_cannot_compute():
    from cydnn import _C
    x = _C.empty((2, 3, 6, 6))
    with pytest.raises(ValueError, match=r"max_pool_tiled_forward: kernel \(4, 4\) must tile x's plane \(6, 6\)"):
        _C.max_pool_tiled_forward(x, _C.empty((2, 3, 1, 1)), (4, 4))
    with pytest.raises(ValueError, match=r"max_pool_tiled_forward: y must have shape \(2, 3, 3, 3\)"):
        _C.max_pool_tiled_forward(x, _C.empty((2, 3, 3, 2)), (2, 2))
    with pytest.raises(ValueError, match=r"max_pool_tiled_forward: x must be \(n, c, h, w\)"):
        _C.max_pool_tiled_forward(_C.empty((6, 6)), _C.empty((3, 3)), (2, 2))


def test_lowering_takes_the_tiled_kernel_only_for_pools_whose_windows_tile_their_input():
    """CPU: a 2x2/2 pooling of an even plane runs max_pool_tiled_kernel, in training and in inference; an
    overlapping one, a padded one and one that leaves a row out keep cuDNN's pooling."""
    def pools(pool, shape, out, training=True):
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), pool, nn.Flatten(), nn.Linear(4 * out * out, 10))
        plan = _build_plan(model, shape, 4, training, {})[0]
        return [s.kernels for s in plan.steps if s.kind == "max_pool_forward"]
    tiled = ("max_pool_tiled_kernel",)
    assert pools(nn.MaxPool2d(2), (3, 8, 8), 4) == [tiled]
    assert pools(nn.MaxPool2d(2), (3, 8, 8), 4, training=False) == [tiled]
    assert pools(nn.MaxPool2d(3, stride=2), (3, 8, 8), 3) == [("cudnnPoolingForward",)]
    assert pools(nn.MaxPool2d(2, padding=1), (3, 8, 8), 5) == [("cudnnPoolingForward",)]
    assert pools(nn.MaxPool2d(2), (3, 7, 7), 3) == [("cudnnPoolingForward",)]
