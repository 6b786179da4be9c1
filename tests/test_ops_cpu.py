"""Tests of the numpy ops (cydnn.ops.cpu): finite-difference gradient checks in
float64 for every backward, and independent references (naive loops, plain
Python transcriptions of the formulas) for the forwards."""
import math

import numpy as np
import pytest

from cydnn.ops import cpu

MASK64 = 2**64 - 1


# ------------------------------------------------------------------ helpers


def assert_directional(loss, inputs, grads, rng, eps=1e-6, rtol=1e-6):
    """Check analytic gradients against central differences along a random direction.

    ``loss(**inputs)`` is a scalar; ``grads[name]`` the claimed gradient of the
    loss with respect to ``inputs[name]``.  For each name, with a random v:
    ``(loss(x + eps v) - loss(x - eps v)) / (2 eps)`` must equal ``<grad, v>``.
    """
    for name, grad in grads.items():
        x = inputs[name]
        assert grad.shape == x.shape, (name, grad.shape, x.shape)
        v = rng.standard_normal(x.shape)

        def at(t):
            moved = dict(inputs)
            moved[name] = x + t * v
            return float(loss(**moved))

        numeric = (at(eps) - at(-eps)) / (2 * eps)
        analytic = float(np.sum(grad * v))
        assert abs(numeric - analytic) <= rtol * max(1.0, abs(analytic)), (name, numeric, analytic)


def distinct(rng, shape, spacing=0.01):
    """Values with no two closer than ``spacing`` (so a max is never a tie), centred on 0."""
    size = int(np.prod(shape))
    return ((rng.permutation(size) - size / 2) * spacing).reshape(shape)


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def pad_input(x, ph, pw, value):
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    xp[:, :, ph : ph + h, pw : pw + w] = x
    return xp


def py_splitmix64(z):
    """SplitMix64 in plain Python ints, masking to 64 bits after every step."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


# ---------------------------------------------------------- naive references


def naive_conv(x, w, b, stride, padding):
    sh, sw = pair(stride)
    ph, pw = pair(padding)
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    xp = pad_input(x, ph, pw, 0.0)
    oh, ow = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, k, oh, ow))
    for i in range(n):
        for o in range(k):
            for r in range(oh):
                for s in range(ow):
                    window = xp[i, :, r * sh : r * sh + kh, s * sw : s * sw + kw]
                    y[i, o, r, s] = np.sum(window * w[o]) + (0.0 if b is None else b[o])
    return y


def naive_pool(x, dy, kernel, stride, padding, mode):
    """Forward y and backward dx of max / avg pooling by loops.

    Max: the gradient goes to the first strict maximum met scanning the window
    row by row; padding is -inf.  Avg: padding is 0 and the divisor kh*kw.
    """
    kh, kw = pair(kernel)
    sh, sw = pair(kernel if stride is None else stride)
    ph, pw = pair(padding)
    n, c, h, w = x.shape
    xp = pad_input(x, ph, pw, -np.inf if mode == "max" else 0.0)
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    y = np.zeros((n, c, oh, ow))
    dxp = np.zeros(xp.shape)
    for i in range(n):
        for ch in range(c):
            for r in range(oh):
                for s in range(ow):
                    cells = [(r * sh + p, s * sw + q) for p in range(kh) for q in range(kw)]
                    if mode == "max":
                        best = cells[0]
                        for cell in cells[1:]:
                            if xp[i, ch][cell] > xp[i, ch][best]:
                                best = cell
                        y[i, ch, r, s] = xp[i, ch][best]
                        dxp[i, ch][best] += dy[i, ch, r, s]
                    else:
                        y[i, ch, r, s] = sum(xp[i, ch][cell] for cell in cells) / (kh * kw)
                        for cell in cells:
                            dxp[i, ch][cell] += dy[i, ch, r, s] / (kh * kw)
    return y, dxp[:, :, ph : ph + h, pw : pw + w]


# ------------------------------------------------------------- convolution

# (x shape, (out channels, kh, kw), stride, padding, bias)
CONV_CASES = [
    ((2, 3, 7, 6), (4, 3, 3), 1, 0, True),
    ((2, 3, 7, 6), (4, 3, 2), 2, 2, False),
    ((1, 2, 9, 8), (3, 3, 3), (2, 1), (1, 2), True),
    ((1, 8, 3, 3), (5, 2, 2), 1, 1, True),  # more channels than pixels
    ((3, 1, 5, 4), (2, 5, 4), 1, 0, False),  # kernel == input: 1x1 output
    ((2, 2, 8, 8), (3, 3, 3), 3, 1, True),  # stride that leaves a remainder
    ((1, 1, 6, 11), (2, 1, 3), (1, 3), (0, 1), True),  # non-square everything
]


def _conv_inputs(rng, x_shape, w_spec, bias):
    k, kh, kw = w_spec
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((k, x_shape[1], kh, kw))
    b = rng.standard_normal(k) if bias else None
    return x, w, b


@pytest.mark.parametrize("x_shape, w_spec, stride, padding, bias", CONV_CASES)
def test_conv_forward_matches_naive_loops(x_shape, w_spec, stride, padding, bias):
    rng = np.random.default_rng(1)
    x, w, b = _conv_inputs(rng, x_shape, w_spec, bias)
    y, _ = cpu.conv_forward(x, w, b, stride, padding)
    np.testing.assert_allclose(y, naive_conv(x, w, b, stride, padding), rtol=1e-12, atol=1e-12)
    assert y.flags.c_contiguous


@pytest.mark.parametrize("x_shape, w_spec, stride, padding, bias", CONV_CASES)
def test_conv_gradients(x_shape, w_spec, stride, padding, bias):
    rng = np.random.default_rng(2)
    x, w, b = _conv_inputs(rng, x_shape, w_spec, bias)
    y, cache = cpu.conv_forward(x, w, b, stride, padding)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = cpu.conv_backward(dy, cache)
    assert (db is None) == (b is None)

    def loss(x, w, b):
        return np.sum(cpu.conv_forward(x, w, b, stride, padding)[0] * dy)

    grads = {"x": dx, "w": dw}
    if bias:
        grads["b"] = db
    assert_directional(loss, {"x": x, "w": w, "b": b}, grads, rng)


@pytest.mark.parametrize("batch_inner", [False, True])
@pytest.mark.parametrize("x_shape, w_spec, stride, padding, bias",
                         CONV_CASES + [((2, 2, 9, 21), (3, 3, 4), 1, 1, True)])
def test_conv_both_column_orders(monkeypatch, batch_inner, x_shape, w_spec, stride, padding, bias):
    # im2col orders its columns (i, j, b) for short output rows and (b, i, j) otherwise:
    # force each order on every case; both must match the loops and each other's gradients.
    from cydnn.ops.cpu import conv
    rng = np.random.default_rng(6)
    x, w, b = _conv_inputs(rng, x_shape, w_spec, bias)
    monkeypatch.setattr(conv, "BATCH_INNER_BELOW_OW", 10**9 if batch_inner else 0)
    y, cache = cpu.conv_forward(x, w, b, stride, padding)
    np.testing.assert_allclose(y, naive_conv(x, w, b, stride, padding), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    grads = cpu.conv_backward(dy, cache)
    monkeypatch.setattr(conv, "BATCH_INNER_BELOW_OW", 0 if batch_inner else 10**9)
    other = cpu.conv_backward(dy, cpu.conv_forward(x, w, b, stride, padding)[1])
    for g, h in zip(grads, other):
        if g is None:
            assert h is None
        else:
            np.testing.assert_allclose(g, h, rtol=1e-12, atol=1e-12)
            assert g.flags.c_contiguous


def test_conv_float32_stays_float32_and_agrees_with_float64():
    rng = np.random.default_rng(3)
    x, w, b = _conv_inputs(rng, (2, 3, 10, 10), (4, 3, 3), True)
    y64, c64 = cpu.conv_forward(x, w, b, 2, 1)
    y32, c32 = cpu.conv_forward(x.astype(np.float32), w.astype(np.float32), b.astype(np.float32), 2, 1)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-4)
    dy = rng.standard_normal(y64.shape)
    for g32, g64 in zip(cpu.conv_backward(dy.astype(np.float32), c32), cpu.conv_backward(dy, c64)):
        assert g32.dtype == np.float32
        np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ pooling

# (x shape, kernel, stride, padding)
POOL_CASES = [
    ((2, 3, 6, 6), 2, None, 0),
    ((1, 1, 5, 5), 2, None, 0),  # odd size: the last row and column are dropped
    ((2, 2, 7, 7), 3, 2, 0),  # overlapping windows
    ((1, 2, 6, 5), 3, 2, 1),  # overlapping and padded
    ((2, 1, 5, 6), (3, 2), (1, 2), (1, 1)),
    ((1, 2, 4, 4), 4, 1, 2),  # padding = kernel / 2
    ((1, 1, 3, 8), (1, 3), (1, 2), 0),
]


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("x_shape, kernel, stride, padding", POOL_CASES)
def test_pool_matches_naive_loops(mode, x_shape, kernel, stride, padding):
    rng = np.random.default_rng(4)
    x = distinct(rng, x_shape)
    forward = cpu.max_pool_forward if mode == "max" else cpu.avg_pool_forward
    backward = cpu.max_pool_backward if mode == "max" else cpu.avg_pool_backward
    y, cache = forward(x, kernel, stride, padding)
    dy = rng.standard_normal(y.shape)
    y_ref, dx_ref = naive_pool(x, dy, kernel, stride, padding, mode)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backward(dy, cache), dx_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("x_shape, kernel, stride, padding", POOL_CASES)
def test_pool_gradients(mode, x_shape, kernel, stride, padding):
    rng = np.random.default_rng(5)
    x = distinct(rng, x_shape)  # distinct values: the max of every window is unique
    forward = cpu.max_pool_forward if mode == "max" else cpu.avg_pool_forward
    backward = cpu.max_pool_backward if mode == "max" else cpu.avg_pool_backward
    y, cache = forward(x, kernel, stride, padding)
    dy = rng.standard_normal(y.shape)

    def loss(x):
        return np.sum(forward(x, kernel, stride, padding)[0] * dy)

    assert_directional(loss, {"x": x}, {"x": backward(dy, cache)}, rng)


def test_max_pool_tie_goes_to_first_element():
    # All equal: each 2x2 window sends its gradient to its top-left element.
    x = np.ones((1, 1, 4, 4))
    y, cache = cpu.max_pool_forward(x, 2)
    dy = np.arange(1.0, 5.0).reshape(1, 1, 2, 2)
    expected = np.zeros((1, 1, 4, 4))
    expected[0, 0, ::2, ::2] = dy[0, 0]
    np.testing.assert_array_equal(cpu.max_pool_backward(dy, cache), expected)

    # Two maxima at (0, 1) and (1, 0): (0, 1) comes first in row-major order.
    x = np.array([[[[0.0, 5.0], [5.0, 1.0]]]])
    _, cache = cpu.max_pool_forward(x, 2)
    np.testing.assert_array_equal(cpu.max_pool_backward(np.full((1, 1, 1, 1), 3.0), cache),
                                  [[[[0.0, 3.0], [0.0, 0.0]]]])


def test_max_pool_overlapping_windows_accumulate():
    # One big value shared by four 3x3 windows (stride 2) collects all four gradients.
    x = np.zeros((1, 1, 5, 5))
    x[0, 0, 2, 2] = 1.0
    y, cache = cpu.max_pool_forward(x, 3, 2)
    assert y.shape == (1, 1, 2, 2) and np.all(y == 1.0)
    dy = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    dx = cpu.max_pool_backward(dy, cache)
    assert dx[0, 0, 2, 2] == 10.0 and np.count_nonzero(dx) == 1


def test_max_pool_padding_is_minus_infinity():
    x = -np.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # all negative: a zero pad would win
    y, _ = cpu.max_pool_forward(x, 2, 2, 1)
    np.testing.assert_array_equal(y[0, 0], [[-1.0, -2.0], [-4.0, -5.0]])


def test_avg_pool_padding_counts_as_zero():
    x = np.ones((1, 1, 2, 2))
    y, _ = cpu.avg_pool_forward(x, 2, 2, 1)  # each window holds one 1 and three padding zeros
    np.testing.assert_array_equal(y, np.full((1, 1, 2, 2), 0.25))


# -------------------------------------------------------------- activations

ACTIVATIONS = {
    "relu": (cpu.relu_forward, cpu.relu_backward, lambda x: np.where(x > 0, x, 0.0)),
    "tanh": (cpu.tanh_forward, cpu.tanh_backward, lambda x: np.array([math.tanh(v) for v in x.flat]).reshape(x.shape)),
    "sigmoid": (cpu.sigmoid_forward, cpu.sigmoid_backward,
                lambda x: np.array([1 / (1 + math.exp(-v)) for v in x.flat]).reshape(x.shape)),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4, 5)])
def test_activation_forward_and_gradient(name, shape):
    forward, backward, reference = ACTIVATIONS[name]
    rng = np.random.default_rng(6)
    # Magnitudes in [0.1, 3]: away from relu's kink at 0.
    x = rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.1, 3.0, size=shape)
    y, cache = forward(x)
    np.testing.assert_allclose(y, reference(x), rtol=1e-13, atol=1e-15)
    dy = rng.standard_normal(shape)
    assert_directional(lambda x: np.sum(forward(x)[0] * dy), {"x": x}, {"x": backward(dy, cache)}, rng)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activation_keeps_dtype_and_handles_extremes(name, dtype):
    forward, backward, _ = ACTIVATIONS[name]
    x = np.array([-1e4, -50.0, 0.0, 50.0, 1e4], dtype=dtype)
    with np.errstate(over="raise", divide="raise", invalid="raise"):  # e.g. no exp(1e4) in sigmoid
        y, cache = forward(x)
        dx = backward(np.ones_like(x), cache)
    assert y.dtype == dtype and dx.dtype == dtype
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))


# ------------------------------------------------------------------ dropout


def test_splitmix64_matches_plain_python():
    # 0xE220A8397B1DCDAF is the published first output of SplitMix64 seeded with 0.
    assert int(cpu.splitmix64(0)) == 0xE220A8397B1DCDAF
    zs = [0, 1, 2, 12345, 2**32 - 1, 2**63, MASK64]
    got = cpu.splitmix64(np.array(zs, dtype=np.uint64))
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [py_splitmix64(z) for z in zs]


@pytest.mark.parametrize("p, seed", [(0.3, 12345), (0.5, 0), (0.9, 2**64 - 1)])
def test_dropout_mask_matches_plain_python_hash(p, seed):
    x = np.ones((4, 16), dtype=np.float32)
    y, mask = cpu.dropout_forward(x, p, seed)
    threshold = int(round(p * 2**24))
    scale = float(np.float32(1.0 / (1.0 - p)))
    expected = [scale if (py_splitmix64(seed ^ py_splitmix64(i)) >> 40) >= threshold else 0.0 for i in range(x.size)]
    np.testing.assert_array_equal(mask.ravel(), np.array(expected, dtype=np.float32))
    np.testing.assert_array_equal(y, x * mask)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keep_rate_and_determinism(p):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(100_000).astype(np.float32)
    y, mask = cpu.dropout_forward(x, p, seed=42)
    kept = mask != 0
    # Within 5 standard deviations of the binomial keep rate.
    assert abs(kept.mean() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / x.size)
    assert set(np.unique(mask)) == {0.0, np.float32(1 / (1 - p))}
    assert mask.dtype == np.float32 and y.dtype == np.float32
    np.testing.assert_array_equal(y, x * mask)
    np.testing.assert_array_equal(cpu.dropout_forward(x, p, seed=42)[1], mask)  # same seed, same mask
    assert np.mean(cpu.dropout_forward(x, p, seed=43)[1] != mask) > 0.1  # another seed, another mask
    # The mask depends on the flat index only: same pattern for any shape or dtype.
    _, mask64 = cpu.dropout_forward(x.reshape(100, 1000).astype(np.float64), p, seed=42)
    np.testing.assert_array_equal(mask64.ravel() != 0, kept)


def test_dropout_p_zero_is_identity():
    x = np.random.default_rng(8).standard_normal((3, 4))
    y, mask = cpu.dropout_forward(x, 0.0, seed=5)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(mask, np.ones_like(x))


@pytest.mark.parametrize("shape", [(10,), (4, 5, 6)])
def test_dropout_gradient(shape):
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape)
    y, mask = cpu.dropout_forward(x, 0.4, seed=3)
    dy = rng.standard_normal(shape)

    def loss(x):
        return np.sum(cpu.dropout_forward(x, 0.4, seed=3)[0] * dy)  # fixed seed: fixed mask

    assert_directional(loss, {"x": x}, {"x": cpu.dropout_backward(dy, mask)}, rng)


# ------------------------------------------------------------------- linear


@pytest.mark.parametrize("n, fin, fout, bias", [(1, 3, 2, True), (5, 4, 7, False), (8, 16, 10, True)])
def test_linear_forward_and_gradients(n, fin, fout, bias):
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((n, fin)), rng.standard_normal((fout, fin))
    b = rng.standard_normal(fout) if bias else None
    y, cache = cpu.linear_forward(x, w, b)
    ref = np.array([[sum(x[i, j] * w[o, j] for j in range(fin)) + (b[o] if bias else 0.0)
                     for o in range(fout)] for i in range(n)])
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = cpu.linear_backward(dy, cache)
    assert (db is None) == (not bias)
    grads = {"x": dx, "w": dw}
    if bias:
        grads["b"] = db
    assert_directional(lambda x, w, b: np.sum(cpu.linear_forward(x, w, b)[0] * dy),
                       {"x": x, "w": w, "b": b}, grads, rng)


# ---------------------------------------------------------- softmax, loss


@pytest.mark.parametrize("shape", [(1, 2), (4, 10), (3, 1)])
def test_softmax_and_log_softmax_forward(shape):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape) * 3
    ref = np.array([[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in x])
    np.testing.assert_allclose(cpu.softmax(x), ref, rtol=1e-12)
    np.testing.assert_allclose(np.exp(cpu.log_softmax(x)), ref, rtol=1e-12)
    # Stable for huge logits: shifting a row changes nothing.
    np.testing.assert_allclose(cpu.softmax(x + 1000.0), ref, rtol=1e-12)
    np.testing.assert_allclose(cpu.log_softmax(x - 1000.0), np.log(ref), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 3), (4, 10)])
def test_softmax_and_log_softmax_gradients_by_projection(shape):
    # No backward op exists for these; project onto a random R and compare the
    # finite differences with the textbook vector-Jacobian products:
    #   d<R, softmax(x)>/dx     = s * (R - sum_j R s)
    #   d<R, log_softmax(x)>/dx = R - s * sum_j R
    # which also ties softmax and log_softmax to each other.
    rng = np.random.default_rng(12)
    x, r = rng.standard_normal(shape), rng.standard_normal(shape)
    s = cpu.softmax(x)
    grad_softmax = s * (r - np.sum(r * s, axis=1, keepdims=True))
    grad_log_softmax = r - s * np.sum(r, axis=1, keepdims=True)
    assert_directional(lambda x: np.sum(cpu.softmax(x) * r), {"x": x}, {"x": grad_softmax}, rng)
    assert_directional(lambda x: np.sum(cpu.log_softmax(x) * r), {"x": x}, {"x": grad_log_softmax}, rng)


@pytest.mark.parametrize("n, c", [(1, 2), (8, 10), (5, 3)])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32, np.uint8])
def test_softmax_cross_entropy(n, c, label_dtype):
    rng = np.random.default_rng(13)
    logits = rng.standard_normal((n, c)) * 2
    labels = rng.integers(0, c, size=n).astype(label_dtype)
    loss, dlogits = cpu.softmax_cross_entropy(logits, labels)
    ref = sum(math.log(sum(math.exp(v) for v in logits[i])) - logits[i, labels[i]] for i in range(n)) / n
    assert loss.shape == () and loss.dtype == np.float64
    assert abs(float(loss) - ref) < 1e-12
    assert_directional(lambda logits: cpu.softmax_cross_entropy(logits, labels)[0],
                       {"logits": logits}, {"logits": dlogits}, rng)


def test_softmax_cross_entropy_float32_and_huge_logits():
    logits = np.array([[1000.0, 0.0], [0.0, 1000.0]], dtype=np.float32)
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        loss, dlogits = cpu.softmax_cross_entropy(logits, np.array([0, 0]))
    assert loss.shape == () and loss.dtype == np.float32 and dlogits.dtype == np.float32
    np.testing.assert_allclose(float(loss), 500.0, rtol=1e-6)  # (0 + 1000) / 2
    np.testing.assert_allclose(dlogits, [[0.0, 0.0], [-0.5, 0.5]], atol=1e-7)


# ------------------------------------------------------------------ flatten


def test_flatten_is_a_view():
    x = np.arange(24.0).reshape(2, 3, 2, 2)
    y = cpu.flatten(x)
    assert y.shape == (2, 12) and np.shares_memory(x, y)
    np.testing.assert_array_equal(y[1], np.arange(12.0, 24.0))


def test_conv_output_flattens_without_copy():
    x = np.ones((2, 1, 5, 5), dtype=np.float32)
    y, _ = cpu.conv_forward(x, np.ones((3, 1, 3, 3), dtype=np.float32), None)
    assert np.shares_memory(cpu.flatten(y), y)


# --------------------------------------------------------------- optimizers


def py_sgd(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step):
    """PyTorch's SGD step on one element (plain floats); returns (p, buf)."""
    d_p = g + weight_decay * p if weight_decay != 0 else g
    if momentum != 0:
        buf = d_p if first_step else buf * momentum + (1 - dampening) * d_p
        d_p = d_p + momentum * buf if nesterov else buf
    return p - lr * d_p, buf


def py_adam(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, decoupled):
    """PyTorch's Adam/AdamW step on one element, in its own operation order; returns (p, m, v)."""
    if weight_decay != 0:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = m + (g - m) * (1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    step_size = lr / (1 - beta1**step)
    denom = math.sqrt(v) / math.sqrt(1 - beta2**step) + eps
    return p - step_size * m / denom, m, v


@pytest.mark.parametrize("momentum, dampening, weight_decay, nesterov", [
    (0.0, 0.0, 0.0, False),
    (0.0, 0.0, 0.01, False),
    (0.9, 0.0, 0.0, False),
    (0.9, 0.1, 0.01, False),
    (0.8, 0.0, 0.001, True),
])
def test_sgd_matches_pytorch_formulas(momentum, dampening, weight_decay, nesterov):
    rng = np.random.default_rng(14)
    param = rng.standard_normal(6)
    buf = np.zeros(6) if momentum != 0 else None
    ref_p, ref_buf = list(param), [0.0] * 6
    for step in range(3):
        grad = rng.standard_normal(6)
        cpu.sgd_update(param, grad, buf, 0.1, momentum, dampening, weight_decay, nesterov, first_step=step == 0)
        for i in range(6):
            ref_p[i], ref_buf[i] = py_sgd(ref_p[i], grad[i], ref_buf[i], 0.1, momentum, dampening,
                                          weight_decay, nesterov, step == 0)
        np.testing.assert_allclose(param, ref_p, rtol=1e-13, atol=1e-15)
        if buf is not None:
            np.testing.assert_allclose(buf, ref_buf, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("lr, beta1, beta2, eps, weight_decay, decoupled", [
    (1e-3, 0.9, 0.999, 1e-8, 0.0, False),
    (1e-2, 0.9, 0.999, 1e-8, 0.1, False),
    (1e-2, 0.9, 0.999, 1e-8, 0.1, True),
    (0.5, 0.5, 0.9, 1e-3, 0.0, True),
])
def test_adam_matches_pytorch_formulas(lr, beta1, beta2, eps, weight_decay, decoupled):
    rng = np.random.default_rng(15)
    param = rng.standard_normal(6)
    m, v = np.zeros(6), np.zeros(6)
    ref_p, ref_m, ref_v = list(param), [0.0] * 6, [0.0] * 6
    for step in range(1, 4):
        grad = rng.standard_normal(6)
        cpu.adam_update(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, decoupled)
        for i in range(6):
            ref_p[i], ref_m[i], ref_v[i] = py_adam(ref_p[i], grad[i], ref_m[i], ref_v[i], step, lr, beta1,
                                                   beta2, eps, weight_decay, decoupled)
        np.testing.assert_allclose(param, ref_p, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(m, ref_m, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(v, ref_v, rtol=1e-12, atol=1e-15)


def test_optimizers_work_in_place_in_float32_and_leave_grad_alone():
    rng = np.random.default_rng(16)
    param = rng.standard_normal((3, 4)).astype(np.float32)
    grad = rng.standard_normal((3, 4)).astype(np.float32)
    grad_before, buf = grad.copy(), np.zeros_like(param)
    original = param
    assert cpu.sgd_update(param, grad, buf, 0.1, 0.9, weight_decay=0.1, nesterov=True, first_step=True) is None
    m, v = np.zeros_like(param), np.zeros_like(param)
    assert cpu.adam_update(param, grad, m, v, 1, weight_decay=0.1) is None
    assert param is original and param.dtype == np.float32 and m.dtype == np.float32
    np.testing.assert_array_equal(grad, grad_before)
    assert np.all(m != 0) and np.all(v != 0) and np.all(buf != 0)


# --------------------------------------------------------------------- data


def naive_gather(images, indices, mean, std, pad, max_shift, seed):
    """gather_batch's image by loops; shifts from the plain-Python hash."""
    n, h, w = images.shape
    out = np.zeros((len(indices), 1, h + 2 * pad, w + 2 * pad), dtype=np.float32)
    span = 2 * max_shift + 1
    for b, index in enumerate(indices):
        r = py_splitmix64(seed ^ py_splitmix64(b))
        sx = (r & 0xFFFFFFFF) % span - max_shift
        sy = (r >> 32) % span - max_shift
        for i in range(h + 2 * pad):
            for j in range(w + 2 * pad):
                si, sj = i - pad - sy, j - pad - sx  # the source pixel that lands on (i, j)
                v = np.float32(0)
                if 0 <= i - pad < h and 0 <= j - pad < w and 0 <= si < h and 0 <= sj < w:
                    v = np.float32(images[index, si, sj]) / np.float32(255)
                out[b, 0, i, j] = (v - np.float32(mean)) / np.float32(std)
    return out


@pytest.mark.parametrize("pad, max_shift, seed", [(0, 0, 0), (2, 0, 1), (0, 2, 3), (2, 3, 2**64 - 5), (1, 7, 9)])
def test_gather_batch_matches_naive_loops(pad, max_shift, seed):
    rng = np.random.default_rng(17)
    images = rng.integers(0, 256, size=(10, 6, 5), dtype=np.uint8)
    labels = rng.integers(0, 10, size=10)
    indices = np.array([3, 0, 9, 3, 5, 1, 2, 8], dtype=np.int32)
    x, y = cpu.gather_batch(images, labels, indices, 0.1307, 0.3081, pad, max_shift, seed)
    assert x.dtype == np.float32 and x.shape == (8, 1, 6 + 2 * pad, 5 + 2 * pad)
    np.testing.assert_array_equal(x, naive_gather(images, indices, 0.1307, 0.3081, pad, max_shift, seed))
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, labels[indices])


def test_gather_batch_shifts_in_range_and_varied():
    # One bright pixel at the centre: where it lands gives each row's shift.
    images = np.zeros((1, 9, 9), dtype=np.uint8)
    images[0, 4, 4] = 255
    x, y = cpu.gather_batch(images, None, np.zeros(200, dtype=np.int64), 0.0, 1.0, pad=0, max_shift=2, seed=11)
    assert y is None
    flat = x.reshape(200, -1)
    assert np.all(flat.max(axis=1) == 1.0) and np.all((flat == 1.0).sum(axis=1) == 1)
    sy, sx = np.divmod(flat.argmax(axis=1), 9)
    sy, sx = sy - 4, sx - 4
    assert sy.min() == -2 and sy.max() == 2 and sx.min() == -2 and sx.max() == 2  # all of the range, no more
    assert len(set(zip(sy.tolist(), sx.tolist()))) > 15  # of the 25 possible
    # Another seed, other shifts.
    x2, _ = cpu.gather_batch(images, None, np.zeros(200, dtype=np.int64), 0.0, 1.0, pad=0, max_shift=2, seed=12)
    assert np.any(x2 != x)


def test_gather_batch_index_out_of_range():
    images = np.zeros((4, 3, 3), dtype=np.uint8)
    for bad in (4, -1):
        with pytest.raises(ValueError, match=r"gather_batch: indices\[1\] = %d is out of range \[0, 4\)" % bad):
            cpu.gather_batch(images, None, np.array([0, bad, 1]), 0.0, 1.0)


# ------------------------------------------------------------------- arrays


def test_array_helpers():
    a = cpu.asarray([[1, 2], [3, 4]], dtype=np.float32)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
    assert cpu.asarray(a.T).flags.c_contiguous
    assert cpu.to_numpy(a) is a
    assert cpu.empty((2, 3)).dtype == np.float32 and cpu.empty((2, 3)).shape == (2, 3)
    z = cpu.zeros((2, 3), "float64")
    assert z.dtype == np.float64 and not z.any()
    zl = cpu.zeros_like(a.T)
    assert zl.shape == (2, 2) and zl.dtype == np.float32 and not zl.any()
