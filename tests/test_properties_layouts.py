"""Property-based tests (hypothesis) of the numpy twins, and of the GPU ops against them, over
memory layouts too (beside test_properties.py).

Each op is checked over random shapes, kernel sizes, strides, paddings, batch
sizes and memory layouts (C-contiguous, strided views, Fortran order) against
a definition written here as plain loops, plus invariants (softmax rows sum to
1, shift invariance, cross-entropy bounds) and gradients against central
finite differences in float64.  ``TestGpuMatchesTwin`` (marked ``gpu``) runs
the GPU ops on the same strategies against the twins.

Examples are drawn at random, except under CI (``$CI`` set), where the run is
derandomized so that it repeats exactly.  ``$CYDNN_HYPOTHESIS_EXAMPLES``
changes the number of examples per test (default 50; 3 under ``$CYDNN_SANITIZE``).
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cydnn.ops import cpu  # noqa: E402

# Under compute-sanitizer (tools/sanitize.sh sets CYDNN_SANITIZE=1) each GPU example costs seconds: a few suffice.
EXAMPLES = int(os.environ.get("CYDNN_HYPOTHESIS_EXAMPLES", "3" if os.environ.get("CYDNN_SANITIZE") else "50"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=bool(os.environ.get("CI")),
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------- strategies
LAYOUTS = ("c", "strided", "fortran")


def layout(a, kind):
    """The same values as ``a`` in another memory layout (a view or a copy)."""
    if kind == "strided":                 # every other element of a buffer twice as wide
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        wide[..., ::2] = a
        view = wide[..., ::2]
        assert not view.flags.c_contiguous or a.shape[-1] == 1
        return view
    if kind == "fortran":
        return np.asfortranarray(a)
    return np.ascontiguousarray(a)


def arrays(draw, shape, dtype=np.float64, scale=1.0, integers=False):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if integers:                          # few distinct values: ties in every window
        return rng.integers(-2, 3, shape).astype(dtype)
    return (rng.standard_normal(shape) * scale).astype(dtype)


@st.composite
def conv_cases(draw, max_batch=3):
    n, c, k = draw(st.integers(1, max_batch)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    h = draw(st.integers(max(1, kh - 2 * ph), 9))
    w = draw(st.integers(max(1, kw - 2 * pw), 9))
    x = layout(arrays(draw, (n, c, h, w)), draw(st.sampled_from(LAYOUTS)))
    wt = layout(arrays(draw, (k, c, kh, kw), scale=0.5), draw(st.sampled_from(LAYOUTS)))
    b = arrays(draw, (k,)) if draw(st.booleans()) else None
    return x, wt, b, (sh, sw), (ph, pw)


@st.composite
def pool_cases(draw, ties=False):
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = None if draw(st.booleans()) else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))
    h = draw(st.integers(max(1, kh - 2 * ph), 9))
    w = draw(st.integers(max(1, kw - 2 * pw), 9))
    x = layout(arrays(draw, (n, c, h, w), integers=ties), draw(st.sampled_from(LAYOUTS)))
    return x, (kh, kw), stride, (ph, pw)


@st.composite
def linear_cases(draw):
    n, fin, fout = draw(st.integers(1, 5)), draw(st.integers(1, 12)), draw(st.integers(1, 7))
    x = layout(arrays(draw, (n, fin)), draw(st.sampled_from(LAYOUTS)))
    w = layout(arrays(draw, (fout, fin)), draw(st.sampled_from(LAYOUTS)))
    b = arrays(draw, (fout,)) if draw(st.booleans()) else None
    return x, w, b


@st.composite
def logits_cases(draw, scale=None):
    n, c = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    scale = draw(st.sampled_from([0.1, 1.0, 30.0, 1e4])) if scale is None else scale
    logits = layout(arrays(draw, (n, c), scale=scale), draw(st.sampled_from(LAYOUTS)))
    labels = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, c, n).astype(np.int64)
    return logits, labels


# ----------------------------------------------------------------- definitions (loops)
def out_size(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def conv_definition(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))
    oh, ow = out_size(h, kh, stride[0], pad[0]), out_size(wd, kw, stride[1], pad[1])
    y = np.zeros((n, k, oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
            for kk in range(k):
                y[:, kk, i, j] = (win * w[kk]).sum(axis=(1, 2, 3)) + (0 if b is None else b[kk])
    return y


def pool_windows(x, kernel, stride, pad, fill):
    """Yield (i, j, window slice of the padded x, row offset, column offset)."""
    stride = kernel if stride is None else stride
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2), constant_values=fill)
    oh = out_size(x.shape[2], kernel[0], stride[0], pad[0])
    ow = out_size(x.shape[3], kernel[1], stride[1], pad[1])
    for i in range(oh):
        for j in range(ow):
            r, s = i * stride[0], j * stride[1]
            yield i, j, xp[:, :, r:r + kernel[0], s:s + kernel[1]], r, s
    return oh, ow


def pool_out_shape(x, kernel, stride, pad):
    stride = kernel if stride is None else stride
    return x.shape[:2] + (out_size(x.shape[2], kernel[0], stride[0], pad[0]),
                          out_size(x.shape[3], kernel[1], stride[1], pad[1]))


def max_pool_definition(x, kernel, stride, pad, dy=None):
    """(y, dx): the max of each window (padding never wins); dy to the first maximum, row-major."""
    y = np.zeros(pool_out_shape(x, kernel, stride, pad))
    dxp = np.zeros((x.shape[0], x.shape[1], x.shape[2] + 2 * pad[0], x.shape[3] + 2 * pad[1]))
    for i, j, win, r, s in pool_windows(x, kernel, stride, pad, -np.inf):
        flat = win.reshape(win.shape[0], win.shape[1], -1)
        y[:, :, i, j] = flat.max(axis=-1)
        if dy is not None:
            first = flat.argmax(axis=-1)                    # numpy: the first maximum
            for a in range(x.shape[0]):
                for ch in range(x.shape[1]):
                    p, q = divmod(int(first[a, ch]), kernel[1])
                    dxp[a, ch, r + p, s + q] += dy[a, ch, i, j]
    dx = dxp[:, :, pad[0]:pad[0] + x.shape[2], pad[1]:pad[1] + x.shape[3]]
    return y, dx


def avg_pool_definition(x, kernel, stride, pad, dy=None):
    """(y, dx): the mean of each window, padding counted as zeros; dy shared over the window."""
    y = np.zeros(pool_out_shape(x, kernel, stride, pad))
    dxp = np.zeros((x.shape[0], x.shape[1], x.shape[2] + 2 * pad[0], x.shape[3] + 2 * pad[1]))
    area = kernel[0] * kernel[1]
    for i, j, win, r, s in pool_windows(x, kernel, stride, pad, 0.0):
        y[:, :, i, j] = win.sum(axis=(2, 3)) / area
        if dy is not None:
            dxp[:, :, r:r + kernel[0], s:s + kernel[1]] += dy[:, :, i, j][:, :, None, None] / area
    dx = dxp[:, :, pad[0]:pad[0] + x.shape[2], pad[1]:pad[1] + x.shape[3]]
    return y, dx


def numeric_gradient(f, x, eps=1e-6):
    """Central differences of the scalar ``f()`` with respect to every element of ``x`` (changed in place)."""
    g = np.zeros(x.shape)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        up = f()
        x[idx] = old - eps
        down = f()
        x[idx] = old
        g[idx] = (up - down) / (2 * eps)
    return g


def close(actual, expected, rtol=1e-10, atol=1e-10):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol)


# ----------------------------------------------------------------- the twins against definitions
@SETTINGS
@given(conv_cases())
def test_conv_forward_is_the_loop_definition(case):
    x, w, b, stride, pad = case
    y, _ = cpu.conv_forward(x, w, b, stride=stride, padding=pad)
    assert y.dtype == np.float64 and y.flags.c_contiguous
    close(y, conv_definition(x, w, b, stride, pad))


@SETTINGS
@given(conv_cases(max_batch=2), st.integers(0, 2**32 - 1))
def test_conv_backward_matches_finite_differences(case, seed):
    x, w, b, stride, pad = case
    x, w = np.array(x), np.array(w)                         # writable copies for the differences
    b = None if b is None else np.array(b)
    y, cache = cpu.conv_forward(x, w, b, stride=stride, padding=pad)
    r = np.random.default_rng(seed).standard_normal(y.shape)   # loss = sum(y * r): dL/dy = r
    dx, dw, db = cpu.conv_backward(r, cache)

    def loss():
        return float((cpu.conv_forward(x, w, b, stride=stride, padding=pad)[0] * r).sum())
    close(dx, numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    close(dw, numeric_gradient(loss, w), rtol=1e-6, atol=1e-7)
    if b is not None:
        close(db, numeric_gradient(loss, b), rtol=1e-6, atol=1e-7)
    else:
        assert db is None
    assert cpu.conv_backward(r, cache, need_dx=False)[0] is None


@SETTINGS
@given(pool_cases(ties=True), st.integers(0, 2**32 - 1))
def test_max_pool_is_the_definition_first_maximum_wins(case, seed):
    x, kernel, stride, pad = case
    y, cache = cpu.max_pool_forward(x, kernel, stride, pad)
    dy = np.random.default_rng(seed).standard_normal(y.shape)
    y_def, dx_def = max_pool_definition(x, kernel, stride, pad, dy)
    close(y, y_def, rtol=0, atol=0)
    close(cpu.max_pool_backward(dy, cache), dx_def)


@SETTINGS
@given(pool_cases(), st.integers(0, 2**32 - 1))
def test_avg_pool_is_the_definition(case, seed):
    x, kernel, stride, pad = case
    y, cache = cpu.avg_pool_forward(x, kernel, stride, pad)
    dy = np.random.default_rng(seed).standard_normal(y.shape)
    y_def, dx_def = avg_pool_definition(x, kernel, stride, pad, dy)
    close(y, y_def)
    close(cpu.avg_pool_backward(dy, cache), dx_def)


@SETTINGS
@given(pool_cases(), st.sampled_from(["max", "avg"]), st.integers(0, 2**32 - 1))
def test_pool_gradients_match_finite_differences(case, mode, seed):
    x, kernel, stride, pad = case
    x = np.array(x)
    forward, backward = getattr(cpu, f"{mode}_pool_forward"), getattr(cpu, f"{mode}_pool_backward")
    y, cache = forward(x, kernel, stride, pad)
    r = np.random.default_rng(seed).standard_normal(y.shape)
    close(backward(r, cache), numeric_gradient(lambda: float((forward(x, kernel, stride, pad)[0] * r).sum()), x),
          rtol=1e-6, atol=1e-7)


@SETTINGS
@given(linear_cases(), st.integers(0, 2**32 - 1))
def test_linear_forward_backward_and_gradients(case, seed):
    x, w, b = case
    y, cache = cpu.linear_forward(x, w, b)
    expected = np.array([[sum(x[i, f] * w[o, f] for f in range(x.shape[1])) + (0 if b is None else b[o])
                          for o in range(w.shape[0])] for i in range(x.shape[0])])
    close(y, expected)
    r = np.random.default_rng(seed).standard_normal(y.shape)
    dx, dw, db = cpu.linear_backward(r, cache)
    xw, ww = np.array(x), np.array(w)
    bw = None if b is None else np.array(b)

    def loss():
        return float((cpu.linear_forward(xw, ww, bw)[0] * r).sum())
    close(dx, numeric_gradient(loss, xw), rtol=1e-6, atol=1e-7)
    close(dw, numeric_gradient(loss, ww), rtol=1e-6, atol=1e-7)
    if b is not None:
        close(db, r.sum(axis=0))


@SETTINGS
@given(st.sampled_from(["relu", "tanh", "sigmoid"]), st.integers(1, 4), st.integers(1, 30),
       st.integers(0, 2**32 - 1))
def test_activation_gradients_match_finite_differences(name, n, f, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, f)) * 3
    if name == "relu":
        x[np.abs(x) < 1e-3] = 0.5                           # away from the kink
    forward, backward = getattr(cpu, f"{name}_forward"), getattr(cpu, f"{name}_backward")
    y, cache = forward(x)
    r = rng.standard_normal(y.shape)
    close(backward(r, cache), numeric_gradient(lambda: float((forward(x)[0] * r).sum()), x), rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------- softmax and cross-entropy invariants
@SETTINGS
@given(logits_cases(), st.floats(-1e3, 1e3))
def test_softmax_rows_are_distributions_and_shift_invariant(case, shift):
    logits, _ = case
    p = cpu.softmax(logits)
    assert np.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()
    close(p.sum(axis=1), np.ones(len(p)), rtol=1e-12, atol=1e-12)
    close(cpu.softmax(logits + shift), p, rtol=1e-9, atol=1e-12)
    logp = cpu.log_softmax(logits)
    assert np.isfinite(logp).all() and (logp <= 1e-12).all()
    close(np.exp(logp), p, rtol=1e-9, atol=1e-15)
    assert (p.argmax(axis=1) == np.asarray(logits).argmax(axis=1)).all()


@SETTINGS
@given(logits_cases())
def test_cross_entropy_value_bounds_and_gradient(case):
    logits, labels = case
    n, c = logits.shape
    loss, dlogits = cpu.softmax_cross_entropy(logits, labels)
    logp = cpu.log_softmax(logits)
    close(loss, -logp[np.arange(n), labels].mean(), rtol=1e-12, atol=1e-12)
    assert float(loss) >= 0
    close(dlogits.sum(axis=1), np.zeros(n), atol=1e-12)                 # each row of the gradient sums to 0
    onehot = np.eye(c)[labels]
    close(dlogits, (np.exp(logp) - onehot) / n, rtol=1e-12, atol=1e-15)
    uniform, _ = cpu.softmax_cross_entropy(np.zeros((n, c)), labels)
    close(uniform, np.log(c), rtol=1e-12)                                # no information: log(classes)


@SETTINGS
@given(logits_cases(scale=2.0))
def test_cross_entropy_gradient_matches_finite_differences(case):
    logits, labels = case
    logits = np.array(logits)
    _, dlogits = cpu.softmax_cross_entropy(logits, labels)
    close(dlogits, numeric_gradient(lambda: float(cpu.softmax_cross_entropy(logits, labels)[0]), logits),
          rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------- the GPU ops against the twins
def f32(a):
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)


def near(gpu, twin, rtol=1e-4, atol=1e-5):
    """GPU float32 against the float32 twin, the tolerance scaled by the values' magnitude."""
    gpu, twin = np.asarray(gpu, np.float64), np.asarray(twin, np.float64)
    scale = max(1.0, float(np.abs(twin).max(initial=0)))
    np.testing.assert_allclose(gpu, twin, rtol=rtol, atol=atol * scale)


@pytest.mark.gpu
class TestGpuMatchesTwin:
    """Each GPU op on the strategies above, inputs in float32 (as strided numpy where drawn so),
    against the twin on the same float32 inputs."""

    @SETTINGS
    @given(conv_cases())
    def test_conv(self, case):
        from cydnn.ops import cuda
        x, w, b, stride, pad = case
        x, w, b = (layout(f32(x), "strided") if not x.flags.c_contiguous else f32(x)), f32(w), f32(b)
        y, cache = cuda.conv_forward(x, w, b, stride=stride, padding=pad)
        y_ref, cache_ref = cpu.conv_forward(f32(x), w, b, stride=stride, padding=pad)
        near(y, y_ref)
        dy = f32(np.random.default_rng(0).standard_normal(y_ref.shape))
        for got, want in zip(cuda.conv_backward(dy, cache), cpu.conv_backward(dy, cache_ref)):
            if want is None:
                assert got is None
            else:
                near(got, want)

    @SETTINGS
    @given(pool_cases(ties=True), st.sampled_from(["max", "avg"]))
    def test_pool(self, case, mode):
        from cydnn.ops import cuda
        x, kernel, stride, pad = case
        x = f32(x)
        y, cache = getattr(cuda, f"{mode}_pool_forward")(x, kernel, stride, pad)
        y_ref, cache_ref = getattr(cpu, f"{mode}_pool_forward")(x, kernel, stride, pad)
        near(y, y_ref, rtol=0 if mode == "max" else 1e-5, atol=0 if mode == "max" else 1e-6)
        dy = f32(np.random.default_rng(1).standard_normal(y_ref.shape))
        near(getattr(cuda, f"{mode}_pool_backward")(dy, cache), getattr(cpu, f"{mode}_pool_backward")(dy, cache_ref))

    @SETTINGS
    @given(linear_cases())
    def test_linear(self, case):
        from cydnn.ops import cuda
        x, w, b = (f32(a) for a in case)
        y, cache = cuda.linear_forward(x, w, b)
        y_ref, cache_ref = cpu.linear_forward(x, w, b)
        near(y, y_ref)
        dy = f32(np.random.default_rng(2).standard_normal(y_ref.shape))
        for got, want in zip(cuda.linear_backward(dy, cache), cpu.linear_backward(dy, cache_ref)):
            if want is None:
                assert got is None
            else:
                near(got, want)

    @SETTINGS
    @given(logits_cases())
    def test_softmax_and_cross_entropy(self, case):
        from cydnn.ops import cuda
        logits, labels = case
        logits = f32(logits)
        near(cuda.softmax(logits), cpu.softmax(logits), atol=1e-6)
        near(cuda.log_softmax(logits), cpu.log_softmax(logits))
        loss, d = cuda.softmax_cross_entropy(logits, labels.astype(np.int32))
        loss_ref, d_ref = cpu.softmax_cross_entropy(logits, labels)
        near(loss, loss_ref)
        near(d, d_ref, atol=1e-6)

    @SETTINGS
    @given(st.sampled_from(["relu", "tanh", "sigmoid"]), st.integers(1, 4), st.integers(1, 300),
           st.integers(0, 2**32 - 1))
    def test_activations(self, name, n, f, seed):
        from cydnn.ops import cuda
        x = f32(np.random.default_rng(seed).standard_normal((n, f)) * 3)
        y, cache = getattr(cuda, f"{name}_forward")(x)
        y_ref, cache_ref = getattr(cpu, f"{name}_forward")(x)
        near(y, y_ref, atol=1e-6)
        dy = f32(np.random.default_rng(seed + 1).standard_normal(x.shape))
        near(getattr(cuda, f"{name}_backward")(dy, cache), getattr(cpu, f"{name}_backward")(dy, cache_ref), atol=1e-6)
