"""The float32 C kernels (_kernels_direct.h, _kernels_rows.h, _kernels_pool.h) against the numpy twin.

Direct convolution (forward, weight and bias gradients) and the row-by-row
input gradient are compared, with both instruction sets (AVX2 + FMA and the
plain loops, ``_kernels.set_isa``) and 1 to 3 threads, with the twin computed
in float64; the tolerance is derived from the reference: 32 float32 epsilons
times the sum of the absolute values of the terms of each output (the same
sums over |x|, |w|, |dy|) -- far below what one missing or misplaced term
would leave.  Pooling 2 x 2 / 2 must equal the twin bit for bit, ties, NaN and
-inf included.  The routing of conv.py / pool.py is checked through the cache.
"""
import contextlib

import numpy as np
import pytest

from cydnn.ops import cpu
from cydnn.ops.cpu import _threads
from cydnn.ops.cpu import conv as conv_module

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

if not cpu.kernels_available()[0]:
    pytest.skip(f"the compiled CPU kernels are not built: {cpu.kernels_available()[1]}", allow_module_level=True)
from cydnn.ops.cpu import _kernels  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
EPS32 = float(np.finfo(np.float32).eps)
ISAS = ["baseline"] + (["avx2"] if _kernels.isa_max() == "avx2" else [])


@contextlib.contextmanager
def using_isa(name):
    """The kernels on instruction set ``name`` inside, the one in use before restored after."""
    before = _kernels.isa()
    assert _kernels.set_isa(name) == name
    try:
        yield
    finally:
        _kernels.set_isa(before)


def twin64(fn):
    """fn() with the numpy twin (fn converts its arrays to float64 itself)."""
    with cpu.use_kernels("numpy"):
        return fn()


def assert_close(got, ref, scale, what):
    """|got - ref| <= 32 eps32 * scale (+ a few denormal-sized units) everywhere."""
    assert got.shape == ref.shape and got.dtype == np.float32, what
    bound = 32 * EPS32 * scale + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what}: max error {err.max():.3g}, where the bound is {bound.flat[err.argmax()]:.3g}"


@st.composite
def conv_case(draw):
    n, c, k = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 17))
    kh, kw = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    h, w = draw(st.integers(kh, 30)), draw(st.integers(kw, 30))
    return n, c, k, h, w, kh, kw, draw(st.booleans()), draw(st.integers(0, 2**31))


def _data(n, c, k, h, w, kh, kw, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((k, c, kh, kw)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    dy = rng.standard_normal((n, k, h - kh + 1, w - kw + 1)).astype(np.float32)
    return x, wt, b, dy


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(case=conv_case(), threads=st.integers(1, 3))
def test_direct_kernels_match_the_twin(isa, case, threads):
    with using_isa(isa):
        _check_direct_kernels(case, threads)


def _check_direct_kernels(case, threads):
    threads = _threads.fork_safe(threads)  # one in a forked child (GNU OpenMP's pool does not survive fork)
    n, c, k, h, w, kh, kw, has_bias, seed = case
    x, wt, b, dy = _data(n, c, k, h, w, kh, kw, seed)
    f64 = np.float64
    y64, cache64 = twin64(lambda: cpu.conv_forward(x.astype(f64), wt.astype(f64), b.astype(f64) if has_bias else None))
    yabs, _ = twin64(lambda: cpu.conv_forward(np.abs(x).astype(f64), np.abs(wt).astype(f64),
                                              np.abs(b).astype(f64) if has_bias else None))
    y = np.full(dy.shape, np.nan, np.float32)  # every element must be written
    _kernels.conv_direct_forward(x, wt, b if has_bias else np.zeros(1, np.float32), y, has_bias, threads)
    assert_close(y, y64, yabs, "forward")

    dx64, dw64, db64 = twin64(lambda: cpu.conv_backward(dy.astype(f64), cache64))
    _, cache_abs = twin64(lambda: cpu.conv_forward(np.abs(x).astype(f64), np.abs(wt).astype(f64), None))
    dxabs, dwabs, _ = twin64(lambda: cpu.conv_backward(np.abs(dy).astype(f64), cache_abs))
    dw = np.full(wt.shape, np.nan, np.float32)
    db = np.full(k, np.nan, np.float32)
    _kernels.conv_direct_weight_grad(x, dy, dw, db, has_bias, threads)
    assert_close(dw, dw64, dwabs, "weight gradient")
    if has_bias:
        assert_close(db, db64, np.abs(dy).astype(f64).sum(axis=(0, 2, 3)), "bias gradient")
    else:
        assert np.isnan(db).all()  # not written without a bias
    dx = np.full(x.shape, np.nan, np.float32)
    _kernels.conv_rows_input_grad(dy, wt, dx, threads)
    assert_close(dx, dx64, dxabs, "input gradient")


@pytest.mark.parametrize("isa", ISAS)
def test_the_thread_count_changes_nothing(isa):
    """Not even the weight gradient's bits: its sums are grouped by slices of the batch that depend on n alone
    (the threads follow the machine's load, and a seeded run must repeat exactly)."""
    x, wt, b, dy = _data(9, 3, 7, 17, 21, 5, 5, 4)
    outs = []
    for threads in map(_threads.fork_safe, (1, 2, 3)):
        y, dw, db, dx = (np.empty(dy.shape, np.float32), np.empty_like(wt), np.empty(7, np.float32),
                         np.empty_like(x))
        with using_isa(isa):
            _kernels.conv_direct_forward(x, wt, b, y, True, threads)
            _kernels.conv_direct_weight_grad(x, dy, dw, db, True, threads)
            _kernels.conv_rows_input_grad(dy, wt, dx, threads)
        outs.append((y, dw, db, dx))
    _, cache_abs = twin64(lambda: cpu.conv_forward(np.abs(x).astype(np.float64), np.abs(wt).astype(np.float64), None))
    _, dwabs, _ = twin64(lambda: cpu.conv_backward(np.abs(dy).astype(np.float64), cache_abs))
    for y, dw, db, dx in outs[1:]:
        np.testing.assert_array_equal(y, outs[0][0])  # one thread computes each output: the same sums
        np.testing.assert_array_equal(dx, outs[0][3])
        np.testing.assert_array_equal(dw, outs[0][1])  # the same slices of the batch, whatever the threads
        np.testing.assert_array_equal(db, outs[0][2])
    assert_close(outs[0][1], twin64(lambda: cpu.conv_backward(dy.astype(np.float64), twin64(
        lambda: cpu.conv_forward(x.astype(np.float64), wt.astype(np.float64), None))[1]))[1], dwabs, "weight gradient")


@pytest.mark.parametrize("shape", [(64, 1, 28, 28, 6), (64, 6, 12, 12, 16), (1, 1, 5, 5, 1), (3, 2, 32, 32, 6)])
@pytest.mark.parametrize("padding", [0, 2])
def test_conv_ops_route_to_the_direct_path_and_agree_with_the_twin(shape, padding):
    n, c, h, w, k = shape
    x, wt, b, _ = _data(n, c, k, h + 2 * padding, w + 2 * padding, 5, 5, 7)
    x = np.ascontiguousarray(x[:, :, padding:padding + h, padding:padding + w])
    with cpu.use_kernels("numpy"):
        y0, cache0 = cpu.conv_forward(x, wt, b, padding=padding)
    with cpu.use_kernels("cython"):
        y1, cache1 = cpu.conv_forward(x, wt, b, padding=padding)
    direct = _kernels.isa() != "baseline"
    assert (cache1[2] is None) == direct and (cache1[7] is not None) == direct  # xp kept instead of columns
    np.testing.assert_allclose(y1, y0, rtol=1e-4, atol=1e-4)
    dy = np.random.default_rng(8).standard_normal(y0.shape).astype(np.float32)
    with cpu.use_kernels("numpy"):
        ref = cpu.conv_backward(dy, cache0)
        swapped0 = cpu.conv_backward(dy, cache1)  # the twin on the direct path's cache
    with cpu.use_kernels("cython"):
        out = cpu.conv_backward(dy, cache1)
        swapped1 = cpu.conv_backward(dy, cache0)  # the kernels on the twin's cache
        no_dx = cpu.conv_backward(dy, cache1, need_dx=False)
    for got in (out, swapped0, swapped1):
        for r, g in zip(ref, got):
            assert g.shape == r.shape and g.dtype == np.float32 and g.flags.c_contiguous
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-3 * np.abs(r).max())
    assert no_dx[0] is None
    np.testing.assert_array_equal(no_dx[1], out[1])
    np.testing.assert_array_equal(no_dx[2], out[2])


def test_what_the_direct_path_leaves_to_im2col():
    x = np.ones((2, 3, 9, 9), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    with cpu.use_kernels("cython"):
        for args in ((x, w, None, 2, 0),  # stride 2
                     (x.astype(np.float64), w.astype(np.float64), None, 1, 0),  # float64
                     (np.ones((2, 30, 9, 9), np.float32), np.ones((4, 30, 3, 3), np.float32), None, 1, 0)):  # 270 > 256
            _, cache = cpu.conv_forward(*args)
            assert cache[2] is not None and cache[7] is None
        _, cache = cpu.conv_forward(np.ones((2, 28, 3, 3), np.float32), np.ones((65, 28, 3, 3), np.float32), None)
        assert cache[2] is not None  # 65 output channels > DIRECT_MAX_OUT
        with using_isa("baseline"):
            _, cache = cpu.conv_forward(x, w, None)
        assert cache[2] is not None  # without AVX2 the plain loops would lose to BLAS
    assert conv_module.DIRECT_MAX_WINDOW == 256 and conv_module.DIRECT_MAX_OUT == 64


def test_the_direct_convolution_makes_no_product(monkeypatch):
    if _kernels.isa() == "baseline":
        pytest.skip("no AVX2 + FMA here: float32 convolution takes im2col + products")
    products = []

    class Numpy:  # stands in for numpy inside _threads, where every product of the ops goes
        def matmul(self, a, b):
            products.append((a.shape, b.shape))
            return np.matmul(a, b)

    monkeypatch.setattr(_threads, "np", Numpy())
    xc, wc = np.ones((2, 3, 9, 9), np.float32), np.ones((4, 3, 3, 3), np.float32)
    with cpu.use_kernels("cython"):
        y, cache = cpu.conv_forward(xc, wc, None)
        cpu.conv_backward(y, cache)
        assert cache[2] is None and cache[7] is not None  # the padded input kept, no columns
        assert products == []
        cpu.conv_forward(xc.astype(np.float64), wc.astype(np.float64), None)  # im2col: one product
    assert len(products) == 1


def test_the_environment_variable_chooses_the_isa():
    import os
    import subprocess
    import sys
    code = "from cydnn.ops.cpu import _kernels; print(_kernels.isa())"
    for value, want in (("baseline", "baseline"), ("avx2", _kernels.isa_max()), ("", _kernels.isa_max()),
                        ("auto", _kernels.isa_max())):
        env = dict(os.environ, CYDNN_CPU_ISA=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, value
    env = dict(os.environ, CYDNN_CPU_ISA="avx512")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "$CYDNN_CPU_ISA must be one of auto, baseline, avx2, got 'avx512'" in out.stderr


def test_set_isa_names_and_clamps():
    with pytest.raises(ValueError, match=r"set_isa: name must be one of 'baseline', 'avx2', got 'sse'"):
        _kernels.set_isa("sse")
    before = _kernels.isa()
    try:
        assert _kernels.set_isa("baseline") == "baseline" and _kernels.isa() == "baseline"
        assert _kernels.set_isa("avx2") == _kernels.isa_max() == _kernels.isa()
    finally:
        _kernels.set_isa(before)


# ------------------------------------------------------------------ pooling


@st.composite
def pool_case(draw):
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    h, w = draw(st.integers(2, 40)), draw(st.integers(2, 40))
    return n, c, h, w, draw(st.booleans()), draw(st.integers(0, 2**31))


@pytest.mark.parametrize("isa", ISAS)
@SETTINGS
@given(case=pool_case(), threads=st.integers(1, 3))
@example(case=(64, 16, 8, 8, False, 1), threads=2)  # LeNet's pool2: rows of 4 windows
@example(case=(3, 6, 24, 25, True, 2), threads=2)   # pool1's rows of 12 = 8 + 4, an odd column left
@example(case=(2, 2, 31, 30, True, 3), threads=1)   # 15 = 8 + 4 + 3
def test_max_pool_2x2_matches_the_twin_exactly(isa, case, threads):
    with using_isa(isa):
        _check_max_pool_2x2(case, threads)


def _check_max_pool_2x2(case, threads):
    threads = _threads.fork_safe(threads)
    n, c, h, w, ties, seed = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    if ties:  # few distinct values: the first maximum must win; some NaN and -inf
        x = np.round(x).astype(np.float32)
        x.flat[rng.integers(0, x.size, 5)] = np.nan
        x.flat[rng.integers(0, x.size, 3)] = -np.inf
    x[0, 0, :2, :2] = np.nan  # a window of NaN: -inf at offset 0
    with cpu.use_kernels("numpy"):
        y0, cache0 = cpu.max_pool_forward(x, 2)
    y = np.full(y0.shape, np.nan, np.float32)
    arg = np.full(y0.shape, -1, np.int32)
    _kernels.max_pool2x2_forward(x, y, arg, threads)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(arg, cache0[2])
    dy = rng.standard_normal(y0.shape).astype(np.float32)
    dy.flat[rng.integers(0, dy.size, 2)] = np.inf  # 0 * inf is NaN in the twin's product
    with cpu.use_kernels("numpy"), np.errstate(invalid="ignore"):
        dx0 = cpu.max_pool_backward(dy, cache0)
    dx = np.full(x.shape, 7.0, np.float32)  # every element must be written, odd rows/columns too
    _kernels.max_pool2x2_backward(dy, arg, dx, threads)
    np.testing.assert_array_equal(dx, dx0)
    assert np.array_equal(np.signbit(dx), np.signbit(dx0))  # -0.0 where the twin has it


def test_pool_ops_route_2x2_stride_2_float32_to_the_kernel(monkeypatch):
    calls = []
    real = _kernels.max_pool2x2_forward
    monkeypatch.setattr(_kernels, "max_pool2x2_forward", lambda *a: calls.append(a[0].shape) or real(*a))
    x = np.random.default_rng(0).standard_normal((2, 3, 9, 8)).astype(np.float32)
    with cpu.use_kernels("cython"):
        y, cache = cpu.max_pool_forward(x, 2)
        cpu.max_pool_forward(x, 2, stride=1)                 # stride 1: the general kernel
        cpu.max_pool_forward(x, 2, padding=1)                # padding: the general kernel
        cpu.max_pool_forward(x.astype(np.float64), 2)        # float64: the general kernel
        dx = cpu.max_pool_backward(np.ones_like(y), cache)
    assert calls == [(2, 3, 9, 8)]
    with cpu.use_kernels("numpy"):
        y0, cache0 = cpu.max_pool_forward(x, 2)
        dx0 = cpu.max_pool_backward(np.ones_like(y0), cache0)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)


def test_the_environment_is_read_in_this_process_too(monkeypatch):
    """kernels._from_env, which runs once at import, called again here: the subprocess tests above import
    a fresh copy (under mutmut an unmutated one), this one exercises the code in place."""
    from cydnn.ops.cpu import kernels as kmod
    before_kernels, before_isa = cpu.get_kernels(), _kernels.isa()
    try:
        monkeypatch.delenv("CYDNN_CPU_ISA", raising=False)
        for value, want in (("numpy", "numpy"), (" Cython ", "cython"), ("", "cython"), ("AUTO", "cython")):
            monkeypatch.setenv("CYDNN_CPU_KERNELS", value)
            _kernels.set_isa("baseline")
            kmod._from_env()
            assert (cpu.get_kernels(), _kernels.isa()) == (want, _kernels.isa_max()), value
        monkeypatch.setenv("CYDNN_CPU_KERNELS", "numpy")
        for value, want in (("baseline", "baseline"), (" Baseline ", "baseline"), ("", _kernels.isa_max()),
                            ("auto", _kernels.isa_max())) + ((("AVX2", "avx2"),) if "avx2" in ISAS else ()):
            monkeypatch.setenv("CYDNN_CPU_ISA", value)
            _kernels.set_isa("baseline" if want != "baseline" else _kernels.isa_max())
            kmod._from_env()
            assert _kernels.isa() == want, value
        monkeypatch.setenv("CYDNN_CPU_KERNELS", "fast")
        with pytest.raises(ValueError, match=r"^\$CYDNN_CPU_KERNELS must be one of .*, got 'fast'$"):
            kmod._from_env()
        monkeypatch.setenv("CYDNN_CPU_KERNELS", "numpy")
        monkeypatch.setenv("CYDNN_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match=r"^\$CYDNN_CPU_ISA must be one of auto, baseline, avx2, got 'avx512'$"):
            kmod._from_env()
    finally:
        cpu.set_kernels(before_kernels)
        _kernels.set_isa(before_isa)
