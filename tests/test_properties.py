"""Property-based tests (hypothesis): the numpy twins over random shapes, strides, paddings and
batch sizes against direct definitions, and (on a GPU) every GPU op against its twin over the same
space.  Derandomized, so a run is repeatable; the examples are small so the file stays fast."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cydnn.ops import cpu  # noqa: E402

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


@st.composite
def conv_case(draw):
    n, c, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    h = draw(st.integers(max(1, kh - 2 * ph), 9))
    w = draw(st.integers(max(1, kw - 2 * pw), 9))
    seed = draw(st.integers(0, 2**31))
    return n, c, k, h, w, (kh, kw), (sh, sw), (ph, pw), seed


@st.composite
def pool_case(draw):
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, (kh - 1) // 2)), draw(st.integers(0, (kw - 1) // 2))
    h, w = draw(st.integers(kh, 9)), draw(st.integers(kw, 9))
    return n, c, h, w, (kh, kw), (sh, sw), (ph, pw), draw(st.integers(0, 2**31))


def conv_direct(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (wd + 2 * pad[1] - kw) // stride[1] + 1
    y = np.zeros((n, k, oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
            y[:, :, i, j] = np.einsum("ncpq,kcpq->nk", win, w)
    return y + b[None, :, None, None]


@SETTINGS
@given(conv_case())
def test_conv_twin_matches_the_definition_and_finite_differences(case):
    n, c, k, h, wd, khw, stride, pad, seed = case
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((n, c, h, wd)), rng.standard_normal((k, c) + khw), rng.standard_normal(k)
    y, cache = cpu.conv_forward(x, w, b, stride=stride, padding=pad)
    np.testing.assert_allclose(y, conv_direct(x, w, b, stride, pad), rtol=1e-10, atol=1e-10)
    r = rng.standard_normal(y.shape)
    dx, dw, db = cpu.conv_backward(r, cache)
    eps = 1e-6
    for arr, grad in ((x, dx), (w, dw)):
        i = tuple(rng.integers(0, s) for s in arr.shape)
        old = arr[i]
        arr[i] = old + eps
        up = (cpu.conv_forward(x, w, b, stride=stride, padding=pad)[0] * r).sum()
        arr[i] = old - eps
        down = (cpu.conv_forward(x, w, b, stride=stride, padding=pad)[0] * r).sum()
        arr[i] = old
        assert abs((up - down) / (2 * eps) - grad[i]) <= 1e-6 * max(1.0, abs(grad[i]))
    np.testing.assert_allclose(db, r.sum(axis=(0, 2, 3)))


@SETTINGS
@given(pool_case())
def test_pools_match_the_definition(case):
    n, c, h, w, (kh, kw), (sh, sw), (ph, pw), seed = case
    x = np.random.default_rng(seed).standard_normal((n, c, h, w))
    ymax, _ = cpu.max_pool_forward(x, (kh, kw), (sh, sw), (ph, pw))
    yavg, _ = cpu.avg_pool_forward(x, (kh, kw), (sh, sw), (ph, pw))
    xm = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    xa = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    for i in range(oh):
        for j in range(ow):
            sl = (slice(None), slice(None), slice(i * sh, i * sh + kh), slice(j * sw, j * sw + kw))
            np.testing.assert_allclose(ymax[:, :, i, j], xm[sl].max(axis=(2, 3)))
            np.testing.assert_allclose(yavg[:, :, i, j], xa[sl].sum(axis=(2, 3)) / (kh * kw))


@SETTINGS
@given(st.integers(1, 7), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31))
def test_linear_softmax_and_cross_entropy_properties(n, fin, fout, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((n, fin)), rng.standard_normal((fout, fin)), rng.standard_normal(fout)
    y, _ = cpu.linear_forward(x, w, b)
    np.testing.assert_allclose(y, x @ w.T + b)
    p = cpu.softmax(y)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    labels = rng.integers(0, fout, n)
    loss, dlogits = cpu.softmax_cross_entropy(y, labels)
    assert loss >= 0
    onehot = np.eye(fout)[labels]
    np.testing.assert_allclose(dlogits, (p - onehot) / n, atol=1e-12)


@pytest.mark.gpu
class TestGpuAgainstTwin:
    """The same spaces, GPU op against the float64 twin (float32 on the GPU)."""

    @SETTINGS
    @given(conv_case())
    def test_conv(self, case):
        from cydnn.ops import cuda
        n, c, k, h, wd, khw, stride, pad, seed = case
        rng = np.random.default_rng(seed)
        x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((n, c, h, wd), (k, c) + khw, (k,)))
        y, cache = cuda.conv_forward(x, w, b, stride=stride, padding=pad)
        ref, rcache = cpu.conv_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                                       stride=stride, padding=pad)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
        r = rng.standard_normal(y.shape).astype(np.float32)
        for g, gr in zip(cuda.conv_backward(r, cache), cpu.conv_backward(r.astype(np.float64), rcache)):
            np.testing.assert_allclose(g, gr, rtol=1e-4, atol=1e-4)

    @SETTINGS
    @given(pool_case())
    def test_pools(self, case):
        from cydnn.ops import cuda
        n, c, h, w, khw, stride, pad, seed = case
        x = np.random.default_rng(seed).standard_normal((n, c, h, w)).astype(np.float32)
        for op in ("max_pool", "avg_pool"):
            y, cache = getattr(cuda, op + "_forward")(x, khw, stride, pad)
            ref, rcache = getattr(cpu, op + "_forward")(x.astype(np.float64), khw, stride, pad)
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
            dy = np.ones(y.shape, np.float32)
            np.testing.assert_allclose(getattr(cuda, op + "_backward")(dy, cache),
                                       getattr(cpu, op + "_backward")(dy.astype(np.float64), rcache),
                                       rtol=1e-5, atol=1e-5)

    @SETTINGS
    @given(st.integers(1, 7), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**31))
    def test_linear_and_loss(self, n, fin, fout, seed):
        from cydnn.ops import cuda
        rng = np.random.default_rng(seed)
        x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((n, fin), (fout, fin), (fout,)))
        y, _ = cuda.linear_forward(x, w, b)
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T.astype(np.float64) + b, rtol=1e-4, atol=1e-4)
        labels = rng.integers(0, fout, n)
        loss, d = cuda.softmax_cross_entropy(y, labels)
        rl, rd = cpu.softmax_cross_entropy(y.astype(np.float64), labels)
        assert abs(float(loss) - float(rl)) <= 1e-5 * max(1.0, abs(float(rl)))
        np.testing.assert_allclose(d, rd, atol=1e-6)
