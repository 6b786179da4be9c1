"""The compiled CPU kernels (cydnn.ops.cpu._kernels) against the numpy twin, and the thread policy.

Every op is run twice on the same data, once with ``set_kernels("numpy")`` (the
reference) and once with ``set_kernels("cython")``, over many shapes
(hypothesis); results must agree to rounding (the elementwise ops and the
optimizer updates bit for bit).  Caches are swapped between the two to show
they have one form.  The thread policy is checked through threadpoolctl.
"""
import numpy as np
import pytest

from cydnn import models, nn, optim
from cydnn.ops import cpu
from cydnn.ops.cpu import _threads, kernels

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

if not cpu.kernels_available()[0]:
    pytest.skip(f"the compiled CPU kernels are not built: {cpu.kernels_available()[1]}", allow_module_level=True)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@pytest.fixture(autouse=True, scope="module")
def every_kernel_on_all_cores():
    """Run every kernel with all its OpenMP threads, however small the work (races show), the
    load probe of the conv and pool kernels (_threads.kernel_threads) off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_threads, "PARALLEL_ELEMENTS", 0)
        mp.setattr(_threads, "KERNEL_PARALLEL_ELEMENTS", 0)
        mp.setenv("CYDNN_CPU_LOAD_PROBE", "0")
        yield
DTYPES = st.sampled_from([np.float32, np.float64])


def TWO():
    """Two threads for the kernels called directly, one in a forked child (e.g. a mutmut worker), where
    GNU OpenMP's pool inherited from the parent would hang a parallel region."""
    return _threads.fork_safe(2)


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


def both(fn):
    """(fn() with the numpy twin, fn() with the compiled kernels)."""
    with cpu.use_kernels("numpy"):
        ref = fn()
    with cpu.use_kernels("cython"):
        out = fn()
    return ref, out


@st.composite
def conv_case(draw):
    n, c, k = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    h = draw(st.integers(max(1, kh - 2 * ph), 20))
    w = draw(st.integers(max(1, kw - 2 * pw), 20))
    return n, c, k, h, w, (kh, kw), (sh, sw), (ph, pw), draw(st.booleans()), draw(DTYPES), draw(st.integers(0, 2**31))


@SETTINGS
@given(conv_case())
def test_conv_kernels_match_the_twin(case):
    n, c, k, h, wd, khw, stride, pad, has_bias, dtype, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd)).astype(dtype)
    w = rng.standard_normal((k, c) + khw).astype(dtype)
    b = rng.standard_normal(k).astype(dtype) if has_bias else None
    (y0, cache0), (y1, cache1) = both(lambda: cpu.conv_forward(x, w, b, stride=stride, padding=pad))
    assert y1.dtype == dtype and y1.flags.c_contiguous
    np.testing.assert_allclose(y1, y0, **tol(dtype))
    dy = rng.standard_normal(y0.shape).astype(dtype)
    ref, out = both(lambda: cpu.conv_backward(dy, cache0))
    swapped = both(lambda: cpu.conv_backward(dy, cache1))  # each backward on the other's cache
    for got in (out,) + swapped:
        for r, g in zip(ref, got):
            if r is None:
                assert g is None
            else:
                assert g.shape == r.shape and g.dtype == dtype
                np.testing.assert_allclose(g, r, **tol(dtype))
    _, out_no_dx = both(lambda: cpu.conv_backward(dy, cache0, need_dx=False))
    assert out_no_dx[0] is None
    np.testing.assert_allclose(out_no_dx[1], ref[1], **tol(dtype))


@SETTINGS
@given(conv_case())
def test_im2col_and_col2im_kernels_match_the_twin_exactly(case):
    from cydnn.ops.cpu import _kernels, _windows
    from cydnn.ops.cpu import conv as conv_module
    n, c, _, h, wd, (kh, kw), (sh, sw), (ph, pw), _, dtype, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, wd)).astype(dtype)
    xp = _windows.pad(x, (ph, pw))
    ref = np.ascontiguousarray(conv_module._im2col(xp, (kh, kw), (sh, sw), True))
    xt = np.full((c, h, wd, n), np.nan, dtype=dtype)
    _kernels.batch_inner(x, xt, TWO())
    np.testing.assert_array_equal(xt, x.transpose(1, 2, 3, 0))
    back = np.full(x.shape, np.nan, dtype=dtype)
    _kernels.batch_outer(xt, back, TWO())
    np.testing.assert_array_equal(back, x)
    cols = np.full(ref.shape, np.nan, dtype=dtype)  # every entry must be written
    _kernels.im2col_bi(xt, cols, kh, kw, sh, sw, ph, pw, TWO())
    np.testing.assert_array_equal(cols, ref)  # a copy: exact
    oh, ow = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    dcols = rng.standard_normal(ref.shape).astype(dtype)
    for order in (True, False):  # col2im of either column order; the same adds in the same order: exact
        dxp = conv_module._col2im(dcols, xp.shape, (kh, kw), (sh, sw), (oh, ow), order)
        if order:
            dxt = np.zeros((c, h, wd, n), dtype=dtype)
            _kernels.col2im_bi(dcols, dxt, kh, kw, sh, sw, ph, pw, TWO())
            dx = dxt.transpose(3, 0, 1, 2)
        else:
            dx = np.zeros(x.shape, dtype=dtype)
            _kernels.col2im(dcols, dx, kh, kw, sh, sw, ph, pw, False, TWO())
        np.testing.assert_array_equal(dx, _windows.unpad(dxp, (ph, pw)))


@st.composite
def pool_case(draw):
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    sh, sw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))
    h, w = draw(st.integers(kh, 17)), draw(st.integers(kw, 17))
    return n, c, h, w, (kh, kw), (sh, sw), (ph, pw), draw(DTYPES), draw(st.booleans()), draw(st.integers(0, 2**31))


@SETTINGS
@given(pool_case())
def test_pool_kernels_match_the_twin(case):
    n, c, h, w, khw, stride, pad, dtype, ties, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    if ties:  # few distinct values: the tie rule (first maximum wins) decides; some NaN and -inf
        x = np.round(x).astype(dtype)
        x.flat[rng.integers(0, x.size, 3)] = np.nan
        x.flat[rng.integers(0, x.size, 2)] = -np.inf
    (ym0, cm0), (ym1, cm1) = both(lambda: cpu.max_pool_forward(x, khw, stride, pad))
    np.testing.assert_array_equal(ym1, ym0)
    np.testing.assert_array_equal(cm1[2], cm0[2])  # the offsets each window sends its gradient to
    dy = rng.standard_normal(ym0.shape).astype(dtype)
    for cache in (cm0, cm1):
        ref, out = both(lambda: cpu.max_pool_backward(dy, cache))
        np.testing.assert_allclose(out, ref, **tol(dtype))
    (ya0, ca0), (ya1, ca1) = both(lambda: cpu.avg_pool_forward(x, khw, stride, pad))
    np.testing.assert_allclose(ya1, ya0, equal_nan=True, **tol(dtype))
    for cache in (ca0, ca1):
        ref, out = both(lambda: cpu.avg_pool_backward(dy, cache))
        np.testing.assert_allclose(out, ref, **tol(dtype))


@SETTINGS
@given(st.lists(st.integers(1, 7), min_size=1, max_size=4), DTYPES, st.integers(0, 2**31))
def test_relu_kernels_equal_the_twin_bit_for_bit(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    x.flat[0] = -0.0
    x.flat[-1] = np.nan
    (y0, _), (y1, c1) = both(lambda: cpu.relu_forward(x))
    np.testing.assert_array_equal(y1, y0)
    assert np.array_equal(np.signbit(y1), np.signbit(y0))
    dy = rng.standard_normal(shape).astype(dtype)
    dy.flat[rng.integers(0, dy.size)] = np.inf
    with np.errstate(invalid="ignore"):  # inf * 0 is NaN in both
        ref, out = both(lambda: cpu.relu_backward(dy, y0))
    np.testing.assert_array_equal(out, ref)


@SETTINGS
@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 20), st.integers(1, 20), st.booleans(), st.booleans(),
       DTYPES, st.integers(0, 2**31))
def test_the_layout_kernels_of_convolution(n, m, oh, ow, has_bias, relu, dtype, seed):
    from cydnn.ops.cpu import _kernels
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((m, oh * ow * n)).astype(dtype)  # columns ordered (i, j, b)
    bias = rng.standard_normal(m).astype(dtype)
    ref = y.reshape(m, oh, ow, n).transpose(3, 0, 1, 2) + (bias[None, :, None, None] if has_bias else 0)
    if relu:
        ref = np.maximum(ref, 0)
    out = np.full((n, m, oh, ow), np.nan, dtype=dtype)
    _kernels.rows_bi_to_nchw(y, bias, out, has_bias, relu, TWO())
    np.testing.assert_array_equal(out, ref)
    rows = np.full(y.shape, np.nan, dtype=dtype)
    _kernels.nchw_to_rows_bi(np.ascontiguousarray(ref), rows, TWO())
    np.testing.assert_array_equal(rows, np.ascontiguousarray(ref.transpose(1, 2, 3, 0)).reshape(m, -1))
    _kernels.nchw_to_rows(np.ascontiguousarray(ref), rows, False, TWO())
    np.testing.assert_array_equal(rows, np.ascontiguousarray(ref.transpose(1, 0, 2, 3)).reshape(m, -1))


def test_relu_kernel_takes_a_non_contiguous_input(rng):
    x = rng.standard_normal((4, 6, 5)).astype(np.float32)[:, ::2]
    (y0, _), (y1, _) = both(lambda: cpu.relu_forward(x))
    np.testing.assert_array_equal(y1, y0)


@SETTINGS
@given(st.integers(1, 300), DTYPES, st.sampled_from([0.0, 0.9]), st.sampled_from([0.0, 0.3]),
       st.sampled_from([0.0, 1e-2]), st.booleans(), st.booleans(), st.integers(0, 2**31))
def test_sgd_kernel_equals_the_twin_bit_for_bit(size, dtype, momentum, dampening, weight_decay, nesterov, first,
                                                seed):
    if nesterov and (momentum == 0 or dampening != 0):
        nesterov = False  # PyTorch's rule, enforced by the check
    rng = np.random.default_rng(seed)
    p0, g = rng.standard_normal(size).astype(dtype), rng.standard_normal(size).astype(dtype)
    b0 = rng.standard_normal(size).astype(dtype)

    def step():
        p, buf = p0.copy(), b0.copy()
        cpu.sgd_update(p, g, buf if momentum else None, 0.05, momentum=momentum, dampening=dampening,
                       weight_decay=weight_decay, nesterov=nesterov, first_step=first)
        return p, buf

    (p_ref, b_ref), (p_out, b_out) = both(step)
    np.testing.assert_array_equal(p_out, p_ref)
    np.testing.assert_array_equal(b_out, b_ref)


@SETTINGS
@given(st.integers(1, 300), DTYPES, st.integers(1, 50), st.sampled_from([0.0, 1e-2]), st.booleans(),
       st.integers(0, 2**31))
def test_adam_kernel_equals_the_twin_bit_for_bit(size, dtype, step, weight_decay, decoupled, seed):
    rng = np.random.default_rng(seed)
    p0, g = rng.standard_normal(size).astype(dtype), rng.standard_normal(size).astype(dtype)
    m0, v0 = rng.standard_normal(size).astype(dtype), rng.random(size).astype(dtype)

    def update():
        p, m, v = p0.copy(), m0.copy(), v0.copy()
        cpu.adam_update(p, g, m, v, step, lr=1e-2, weight_decay=weight_decay, decoupled=decoupled)
        return p, m, v

    for r, o in zip(*both(update)):
        np.testing.assert_array_equal(o, r)


def test_updates_fall_back_to_the_twin_for_non_contiguous_parameters(rng):
    p0 = rng.standard_normal((6, 8)).astype(np.float32)
    g = rng.standard_normal((6, 4)).astype(np.float32)

    def step():
        big = p0.copy()
        cpu.sgd_update(big[:, ::2], g, None, 0.1)  # a strided view: updated in place, through the view
        return big

    ref, out = both(step)
    np.testing.assert_array_equal(out, ref)
    assert not np.array_equal(out, p0)


# ----------------------------------------------------------------- a training step, both ways


def _train(kernel_name, opt_name, steps=3):
    with cpu.use_kernels(kernel_name):
        rng = np.random.default_rng(7)
        x = rng.standard_normal((16, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, 16).astype(np.int32)
        model = models.LeNet5(seed=3).to("cpu")
        model.train()
        opt = (optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
               if opt_name == "sgd" else optim.Adam(model.parameters(), lr=1e-3))
        loss_fn = nn.CrossEntropyLoss()
        losses = []
        for _ in range(steps):
            losses.append(float(loss_fn(model(x), y)))
            model.backward(loss_fn.backward())
            opt.step()
        return losses, [p.data.copy() for p in model.parameters()]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_a_lenet_training_step_is_the_same_with_either_kernels(opt_name):
    loss_ref, params_ref = _train("numpy", opt_name)
    loss_out, params_out = _train("cython", opt_name)
    np.testing.assert_allclose(loss_out, loss_ref, rtol=1e-5)
    assert loss_ref[-1] < loss_ref[0]  # it trains
    for r, o in zip(params_ref, params_out):
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------- selection


def test_set_kernels_selects_and_rejects():
    before = cpu.get_kernels()
    try:
        cpu.set_kernels("numpy")
        assert cpu.get_kernels() == "numpy" and kernels.active() is None
        cpu.set_kernels("cython")
        assert cpu.get_kernels() == "cython" and kernels.active() is not None
        cpu.set_kernels("auto")
        assert cpu.get_kernels() == "cython"
        with pytest.raises(ValueError, match="set_kernels: name must be one of"):
            cpu.set_kernels("fortran")
        with cpu.use_kernels("numpy"):
            assert cpu.get_kernels() == "numpy"
        assert cpu.get_kernels() == "cython"
    finally:
        cpu.set_kernels(before)


def test_the_environment_variable_chooses_the_kernels():
    import os
    import subprocess
    import sys
    code = "from cydnn.ops import cpu; print(cpu.get_kernels())"
    for value, want in (("numpy", "numpy"), ("cython", "cython"), ("", "cython")):
        env = dict(os.environ, CYDNN_CPU_KERNELS=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want
    env = dict(os.environ, CYDNN_CPU_KERNELS="fast")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "CYDNN_CPU_KERNELS must be one of" in out.stderr


# ----------------------------------------------------------------- thread policy

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads():
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]


class _Recorder:
    """Stands in for numpy inside _threads: records the BLAS threads while each product runs."""

    def __init__(self):
        self.seen = []

    def matmul(self, a, b):
        self.seen.append(_blas_threads())
        return np.matmul(a, b)


@pytest.fixture
def recorder(monkeypatch):
    if not _blas_threads():
        pytest.skip("threadpoolctl finds no BLAS library in this numpy")
    rec = _Recorder()
    monkeypatch.setattr(_threads, "np", rec)
    return rec


def test_a_small_product_runs_on_one_blas_thread_and_the_setting_is_restored(recorder):
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        outside = _blas_threads()
        a, b = np.ones((64, 256), np.float32), np.ones((256, 120), np.float32)
        np.testing.assert_array_equal(_threads.matmul(a, b), a @ b)
        assert recorder.seen == [[1] * len(outside)]
        assert _blas_threads() == outside


def test_a_large_product_keeps_the_user_limit_and_the_available_cores(recorder, monkeypatch):
    monkeypatch.setattr(_threads, "PARALLEL_FLOPS", 1000)
    a, b = np.ones((20, 30), np.float32), np.ones((30, 40), np.float32)  # 48,000 flops: "large" now
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        _threads.matmul(a, b)
    assert recorder.seen[-1] == [1] * len(recorder.seen[-1])  # never above the user's limit
    monkeypatch.setattr(_threads, "available_cores", lambda: 1)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        _threads.matmul(a, b)
        assert _blas_threads() == [2] * len(recorder.seen[-1])  # restored after the call
    assert recorder.seen[-1] == [1] * len(recorder.seen[-1])  # at most the cores this process may use


def test_the_setting_is_restored_when_the_product_raises(recorder):
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        outside = _blas_threads()
        with pytest.raises(ValueError):
            _threads.matmul(np.ones((3, 4)), np.ones((5, 6)))
        assert _blas_threads() == outside


def test_layer_ops_multiply_through_the_policy(recorder):
    x, w = np.ones((8, 16), np.float32), np.ones((4, 16), np.float32)
    cpu.linear_forward(x, w, None)
    # float64: im2col + products with both kernels (float32 would take the direct path, below)
    xc, wc = np.ones((2, 3, 9, 9), np.float64), np.ones((4, 3, 3, 3), np.float64)
    for name in ("numpy", "cython"):
        with cpu.use_kernels(name):
            y, cache = cpu.conv_forward(xc, wc, None)
            cpu.conv_backward(y, cache)
    assert len(recorder.seen) == 1 + 2 * 3 and all(set(s) == {1} for s in recorder.seen)



def test_omp_threads_by_size(monkeypatch):
    monkeypatch.setattr(_threads, "PARALLEL_ELEMENTS", 100)
    assert _threads.omp_threads(99) == 1
    assert 1 <= _threads.omp_threads(100) <= _threads.available_cores()


def test_a_bad_threshold_in_the_environment_is_named():
    with pytest.raises(ValueError, match=r"\$CYDNN_CPU_PARALLEL_FLOPS must be an integer"):
        import os
        os.environ["CYDNN_CPU_PARALLEL_FLOPS"] = "many"
        try:
            _threads._env_int("CYDNN_CPU_PARALLEL_FLOPS", 1)
        finally:
            del os.environ["CYDNN_CPU_PARALLEL_FLOPS"]
