"""The numpy twins' refusals, each message checked whole (the op, the argument, the dtype or shape),
and the corners mutation testing found unchecked (tools/mutation.py ops/cpu): defaults, a
softmax whose rows lie far apart, Adam's weight decay of exactly 1."""
import numpy as np
import pytest

from cydnn.ops import cpu

F32 = np.float32


def i32(*shape):
    return np.zeros(shape, np.int32)


def f32(*shape):
    return np.zeros(shape, F32)


# op, call with int32 input, the argument named, its shape
FORWARD = [
    ("relu_forward", lambda: cpu.relu_forward(i32(2, 3)), "x", (2, 3)),
    ("leaky_relu_forward", lambda: cpu.leaky_relu_forward(i32(2, 3)), "x", (2, 3)),
    ("tanh_forward", lambda: cpu.tanh_forward(i32(4)), "x", (4,)),
    ("sigmoid_forward", lambda: cpu.sigmoid_forward(i32(1, 5)), "x", (1, 5)),
    ("dropout_forward", lambda: cpu.dropout_forward(i32(3, 2), 0.5, 0), "x", (3, 2)),
    ("softmax", lambda: cpu.softmax(i32(2, 3)), "x", (2, 3)),
    ("log_softmax", lambda: cpu.log_softmax(i32(2, 4)), "x", (2, 4)),
    ("flatten", lambda: cpu.flatten(i32(2, 3, 4)), "x", (2, 3, 4)),
    ("max_pool_forward", lambda: cpu.max_pool_forward(i32(1, 1, 4, 4), 2), "x", (1, 1, 4, 4)),
    ("avg_pool_forward", lambda: cpu.avg_pool_forward(i32(1, 2, 4, 4), 2), "x", (1, 2, 4, 4)),
    ("global_avg_pool_forward", lambda: cpu.global_avg_pool_forward(i32(1, 2, 3, 3)), "x", (1, 2, 3, 3)),
    ("conv_forward", lambda: cpu.conv_forward(i32(1, 1, 5, 5), f32(2, 1, 3, 3), None), "x", (1, 1, 5, 5)),
    ("linear_forward", lambda: cpu.linear_forward(i32(2, 4), f32(3, 4), None), "x", (2, 4)),
    ("adam_update", lambda: cpu.adam_update(i32(2, 3), i32(2, 3), i32(2, 3), i32(2, 3), 1), "param", (2, 3)),
    ("sgd_update", lambda: cpu.sgd_update(i32(2, 3), i32(2, 3), None, 0.1), "param", (2, 3)),
]


@pytest.mark.parametrize("op, call, arg, shape", FORWARD, ids=[f[0] for f in FORWARD])
def test_int_input_is_refused_naming_the_op_argument_and_shape(op, call, arg, shape):
    with pytest.raises(TypeError) as e:
        call()
    assert str(e.value) == f"{op}: {arg} has dtype int32; accepted: float32, float64 ({arg} {shape})"


def _caches():
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(F32)
    return {
        "relu_backward": (cpu.relu_backward, cpu.relu_forward(x)[1], "y", (1, 2, 4, 4)),
        "leaky_relu_backward": (cpu.leaky_relu_backward, cpu.leaky_relu_forward(x)[1], "x", (1, 2, 4, 4)),
        "tanh_backward": (cpu.tanh_backward, cpu.tanh_forward(x)[1], "y", (1, 2, 4, 4)),
        "sigmoid_backward": (cpu.sigmoid_backward, cpu.sigmoid_forward(x)[1], "y", (1, 2, 4, 4)),
        "dropout_backward": (cpu.dropout_backward, cpu.dropout_forward(x, 0.5, 1)[1], "mask", (1, 2, 4, 4)),
        "max_pool_backward": (cpu.max_pool_backward, cpu.max_pool_forward(x, 2)[1], "y", (1, 2, 2, 2)),
        "avg_pool_backward": (cpu.avg_pool_backward, cpu.avg_pool_forward(x, 2)[1], "y", (1, 2, 2, 2)),
        "conv_backward": (cpu.conv_backward, cpu.conv_forward(x, np.ones((3, 2, 3, 3), F32), None)[1], "y",
                          (1, 3, 2, 2)),
        "linear_backward": (cpu.linear_backward, cpu.linear_forward(x.reshape(1, 32), np.ones((3, 32), F32),
                                                                    None)[1], "y", (1, 3)),
    }


@pytest.mark.parametrize("op", list(_caches()))
def test_backward_refuses_a_gradient_of_another_shape_or_dtype(op):
    backward, cache, other, shape = _caches()[op]
    wrong = (2,) + shape[1:]
    with pytest.raises(ValueError) as e:
        backward(np.zeros(wrong, F32), cache)
    assert str(e.value) == f"{op}: dy has shape {wrong} but {other} has shape {shape}"
    with pytest.raises(TypeError) as e:
        backward(np.zeros(shape, np.float64), cache)
    assert str(e.value) == f"{op}: dy has dtype float64 but {other} has dtype float32 (dy {shape})"
    out = backward(np.ones(shape, F32), cache)                   # the right gradient passes
    assert (out[0] if isinstance(out, tuple) else out).dtype == F32


def test_array_helpers_default_to_float32():
    assert cpu.zeros((2, 3)).dtype == F32 and cpu.zeros((2, 3)).shape == (2, 3)
    assert not cpu.zeros((4,)).any()
    assert cpu.empty((2,)).dtype == F32
    assert cpu.zeros((2,), np.float64).dtype == np.float64


def test_softmax_rows_far_apart_stay_exact():
    """Each row is shifted by its own maximum: a row a thousand below another must not underflow."""
    x = np.array([[0.0, 1000.0], [-1000.0, -1001.0], [5.0, 5.0]], np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    expected = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(cpu.softmax(x), expected, rtol=1e-12)
    log_expected = x - x.max(axis=1, keepdims=True) - np.log(e.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(cpu.log_softmax(x), log_expected, rtol=1e-12)
    assert cpu.log_softmax(x)[0, 0] == -1000.0                  # not -inf: log of an underflowed 0
    assert np.isfinite(cpu.log_softmax(x)).all()


def test_flatten_keeps_the_batch():
    x = np.arange(24, dtype=F32).reshape(2, 3, 4)
    np.testing.assert_array_equal(cpu.flatten(x), x.reshape(2, 12))


def _adam_reference(p, g, m, v, step, lr, beta1, beta2, eps, wd, decoupled):
    if decoupled:
        p = p * (1 - lr * wd)
    elif wd != 0:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * (m / (1 - beta1 ** step)) / (np.sqrt(v / (1 - beta2 ** step)) + eps)
    return p, m, v


@pytest.mark.parametrize("wd, decoupled", [(1.0, False), (1.0, True), (0.0, False), (0.25, False)])
def test_adam_update_weight_decay_including_exactly_one(wd, decoupled):
    rng = np.random.default_rng(1)
    p, g = rng.standard_normal(6), rng.standard_normal(6)
    m, v = rng.standard_normal(6) * 0.1, rng.random(6) * 0.1
    want = _adam_reference(p, g, m, v, 3, 0.01, 0.9, 0.999, 1e-8, wd, decoupled)
    got = [p.copy(), g.copy(), m.copy(), v.copy()]
    cpu.adam_update(got[0], got[1], got[2], got[3], 3, lr=0.01, weight_decay=wd, decoupled=decoupled)
    for a, b in zip((got[0], got[2], got[3]), want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_adam_update_defaults_are_pytorchs():
    rng = np.random.default_rng(2)
    p, g = rng.standard_normal(5), rng.standard_normal(5)
    a = [p.copy(), g.copy(), np.zeros(5), np.zeros(5)]
    b = [p.copy(), g.copy(), np.zeros(5), np.zeros(5)]
    cpu.adam_update(*a, 1)
    cpu.adam_update(*b, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    want = _adam_reference(p, g, np.zeros(5), np.zeros(5), 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, False)
    np.testing.assert_allclose(a[0], want[0], rtol=1e-12)


# ------------------------------------------------------------- pooling corners
def _adjoint_gap(forward, backward, x, rng):
    """A pooling op is linear in x for a fixed choice of maxima, so its backward is its adjoint:
    <forward(x), dy> == <x, backward(dy)>.  Returns the relative gap (0 up to rounding)."""
    y, cache = forward(x)
    dy = rng.standard_normal(y.shape).astype(x.dtype)
    dx = backward(dy, cache)
    assert dx.shape == x.shape and dx.dtype == x.dtype and y.dtype == x.dtype
    left, right = float(np.sum(y.astype(np.float64) * dy)), float(np.sum(x.astype(np.float64) * dx))
    return abs(left - right) / max(1.0, abs(left))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, kernel, stride, padding", [
    ((2, 3, 8, 6), 2, None, 0),                 # the tiled path: stride == kernel, no padding, divisible
    ((2, 3, 9, 7), 2, None, 0),                 # not divisible: the general path
    ((1, 2, 7, 6), 3, 2, (1, 0)),               # padding on one axis only
    ((1, 2, 6, 7), 3, 2, (0, 1)),
    ((1, 1, 17, 17), 17, None, 0),              # 289 offsets: more than a uint8 holds
    ((1, 1, 1, 257), (1, 257), None, 0),        # 257 offsets
])
def test_pool_backward_is_the_adjoint_of_forward(dtype, shape, kernel, stride, padding):
    rng = np.random.default_rng(3)
    size = int(np.prod(shape))
    x = (rng.permutation(size).reshape(shape) - size).astype(dtype)        # distinct values, all < 0
    assert x.dtype == dtype
    for fwd, bwd in ((cpu.max_pool_forward, cpu.max_pool_backward), (cpu.avg_pool_forward, cpu.avg_pool_backward)):
        gap = _adjoint_gap(lambda a: fwd(a, kernel, stride, padding), bwd, x, rng)
        assert gap < (1e-5 if dtype == np.float32 else 1e-12), (fwd.__name__, gap)


def test_max_pool_pads_with_minus_infinity_and_defaults_to_two():
    x = -np.arange(1, 17, dtype=F32).reshape(1, 1, 4, 4)          # every value below zero
    y, _ = cpu.max_pool_forward(x, 3, 1, 1)
    assert (y < 0).all()                                           # the padding never wins
    assert y[0, 0, 0, 0] == -1.0 and y[0, 0, 3, 3] == -11.0
    np.testing.assert_array_equal(cpu.max_pool_forward(x)[0], cpu.max_pool_forward(x, 2, 2, 0)[0])
    np.testing.assert_array_equal(cpu.max_pool_forward(x)[0], [[[[-1, -3], [-9, -11]]]])


def test_linear_checks_its_bias_and_skips_dx_when_asked():
    x, w = np.ones((2, 4), F32), np.ones((3, 4), F32)
    with pytest.raises(ValueError, match=r"^linear_forward: b"):
        cpu.linear_forward(x, w, np.ones(4, F32))
    y, cache = cpu.linear_forward(x, w, np.ones(3, F32))
    dx, dw, db = cpu.linear_backward(np.ones((2, 3), F32), cache, need_dx=False)
    assert dx is None and dw.shape == (3, 4) and db.shape == (3,)
    assert cpu.linear_backward(np.ones((2, 3), F32), cache)[0].shape == (2, 4)


# ------------------------------------------------- losses, updates, activations
def test_cross_entropy_checks_labels_by_default():
    logits = np.zeros((2, 3), F32)
    with pytest.raises(ValueError) as e:
        cpu.softmax_cross_entropy(logits, np.array([0, 5]))
    assert str(e.value) == ("softmax_cross_entropy: labels[1] = 5 is out of range [0, 3) "
                            "(logits (2, 3), labels (2,))")
    with pytest.raises(TypeError) as e:
        cpu.softmax_cross_entropy(i32(2, 3), np.array([0, 1]))
    assert str(e.value) == "softmax_cross_entropy: logits has dtype int32; accepted: float32, float64 (logits (2, 3))"


def _sgd_reference(p, g, buf, lr, momentum, dampening, wd, nesterov, first):
    g = g + wd * p
    if momentum != 0:
        buf = g.copy() if first else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


@pytest.mark.parametrize("momentum, dampening, wd, nesterov, first", [
    (0.0, 0.0, 1.0, False, False),            # weight decay of exactly 1
    (0.9, 1.0, 0.0, False, False),            # dampening of exactly 1: the gradient adds nothing
    (0.9, 0.0, 0.0, False, False),
    (0.9, 0.0, 0.5, True, True),
])
def test_sgd_update_against_the_rule(momentum, dampening, wd, nesterov, first):
    rng = np.random.default_rng(4)
    p, g, buf = rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)
    want_p, want_buf = _sgd_reference(p, g, buf, 0.1, momentum, dampening, wd, nesterov, first)
    got_p, got_buf = p.copy(), buf.copy()
    cpu.sgd_update(got_p, g.copy(), got_buf if momentum else None, 0.1, momentum=momentum, dampening=dampening,
                   weight_decay=wd, nesterov=nesterov, first_step=first)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-12)
    if momentum:
        np.testing.assert_allclose(got_buf, want_buf, rtol=1e-12)


def test_sgd_update_defaults_and_nesterov_check():
    rng = np.random.default_rng(5)
    p, g, buf = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4)
    a, abuf = p.copy(), buf.copy()
    cpu.sgd_update(a, g, abuf, 0.1, momentum=0.5)          # defaults: no decay, a later step
    want_p, want_buf = _sgd_reference(p, g, buf, 0.1, 0.5, 0.0, 0.0, False, False)
    np.testing.assert_allclose(a, want_p, rtol=1e-12)
    np.testing.assert_allclose(abuf, want_buf, rtol=1e-12)
    with pytest.raises(ValueError) as e:
        cpu.sgd_update(p.copy(), g, None, 0.1, nesterov=True)
    assert str(e.value) == ("sgd_update: nesterov needs momentum > 0 and dampening == 0, "
                            "got momentum 0.0, dampening 0.0")


def test_adam_update_couples_weight_decay_by_default():
    rng = np.random.default_rng(6)
    p, g = rng.standard_normal(5), rng.standard_normal(5)
    a = [p.copy(), g.copy(), np.zeros(5), np.zeros(5)]
    cpu.adam_update(*a, 1, lr=0.01, weight_decay=0.5)
    want = _adam_reference(p, g, np.zeros(5), np.zeros(5), 1, 0.01, 0.9, 0.999, 1e-8, 0.5, False)
    np.testing.assert_allclose(a[0], want[0], rtol=1e-12)


def test_leaky_relu_gradient_at_zero_is_the_slope():
    """As PyTorch: x > 0 passes dy, x <= 0 (zero included) scales it by the slope."""
    x = np.array([-1.0, 0.0, 2.0], F32)
    _, cache = cpu.leaky_relu_forward(x, 0.25)
    np.testing.assert_array_equal(cpu.leaky_relu_backward(np.ones(3, F32), cache), [0.25, 0.25, 1.0])


def test_conv_defaults_and_bias_check():
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((1, 2, 6, 5)).astype(F32), rng.standard_normal((3, 2, 3, 3)).astype(F32)
    y, _ = cpu.conv_forward(x, w, None)                             # stride 1, no padding
    assert y.shape == (1, 3, 4, 3)
    np.testing.assert_array_equal(y, cpu.conv_forward(x, w, None, 1, 0)[0])
    with pytest.raises(ValueError) as e:
        cpu.conv_forward(x, w, np.zeros(2, F32))
    assert str(e.value) == ("conv_forward: b has 2 entries but w has 3 output channels "
                            "(x (1, 2, 6, 5), w (3, 2, 3, 3), b (2,))")


def test_dropout_and_leaky_relu_defaults():
    x = np.random.default_rng(8).standard_normal((4, 64)).astype(F32)
    y, mask = cpu.dropout_forward(x)
    y2, mask2 = cpu.dropout_forward(x, 0.5, 0)                      # p = 0.5, seed 0
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(mask, mask2)
    assert set(np.unique(mask).tolist()) == {0.0, 2.0}
    y0, mask0 = cpu.dropout_forward(x, 0.0)                          # nothing dropped, scale 1
    assert mask0.dtype == F32 and (mask0 == 1).all()
    np.testing.assert_array_equal(y0, x)
    np.testing.assert_array_equal(cpu.leaky_relu_forward(np.array([-2.0, 3.0], F32))[0],
                                  np.array([-0.02, 3.0], F32))       # slope 0.01


def test_avg_pool_defaults_to_two_by_two():
    x = np.arange(16, dtype=F32).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(cpu.avg_pool_forward(x)[0], [[[[2.5, 4.5], [10.5, 12.5]]]])
