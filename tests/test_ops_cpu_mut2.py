"""What ops/cpu's session-17 mutation run left unchecked (docs/mutation/ops-cpu.md, "Session 18"):
which kernel each op takes (conv's direct path at its limits, max pooling's 2 x 2 kernel, the
compiled updates' layout test), how many threads a direct convolution asks for, the twins' dtypes
and large pooling windows, non-contiguous optimizer state, weight decay 1 and dampening 1, batch
normalization's defaults and dtype refusal, and a kernel module without ``set_isa``.

Every result is compared with the numpy twin (itself checked against loops elsewhere) or a formula.
"""
import numpy as np
import pytest

from cydnn.ops import cpu
from cydnn.ops.cpu import _threads, conv, kernels, pool

BUILT = kernels.kernels_available()[0]
DIRECT = BUILT and kernels._compiled.isa() != "baseline"
needs_kernels = pytest.mark.skipif(not BUILT, reason="the compiled kernels are not built here")
needs_direct = pytest.mark.skipif(not DIRECT, reason="no compiled kernels with AVX2 + FMA here")


class Recording:
    """The compiled module, with the names of the kernels called recorded (and some hidden)."""

    def __init__(self, module, hide=()):
        self._module, self._hide, self.calls = module, set(hide), []

    def __getattr__(self, name):
        if name in self._hide:
            raise AttributeError(name)
        attr = getattr(self._module, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return call


@pytest.fixture
def compiled(monkeypatch):
    """Install a Recording of the compiled kernels as the active ones (put back after the test)."""
    def install(hide=()):
        rec = Recording(kernels._compiled, hide)
        monkeypatch.setattr(kernels, "_active", rec)
        return rec
    return install


def twin(fn, *args, **kwargs):
    """``fn`` on the numpy twin; the kernels in use before (a Recording too) are put back."""
    before = kernels._active
    kernels._active = None
    try:
        return fn(*args, **kwargs)
    finally:
        kernels._active = before


def data(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------ conv: the direct path


@needs_direct
@pytest.mark.parametrize("x_shape, w_shape, direct", [
    ((2, 16, 6, 6), (4, 16, 4, 4), True),      # c*kh*kw == DIRECT_MAX_WINDOW (256)
    ((1, 257, 2, 2), (2, 257, 1, 1), False),   # 257
    ((2, 1, 5, 5), (64, 1, 3, 3), True),       # k == DIRECT_MAX_OUT (64)
    ((2, 1, 5, 5), (65, 1, 3, 3), False),      # 65
    ((1, 1, 1, 1), (1, 1, 1, 1), True),        # one number each
    ((2, 1, 3, 3), (1, 1, 1, 1), True),        # one weight
])
def test_the_direct_path_at_its_limits(compiled, x_shape, w_shape, direct):
    assert (conv.DIRECT_MAX_WINDOW, conv.DIRECT_MAX_OUT) == (256, 64)
    x, w, b = data(*x_shape), data(*w_shape, seed=1), data(w_shape[0], seed=2)
    rec = compiled()
    y, cache = cpu.conv_forward(x, w, b, 1, 0)
    assert (cache[2] is None and cache[7] is not None) == direct
    assert ("conv_direct_forward" in rec.calls) == direct
    np.testing.assert_allclose(y, twin(cpu.conv_forward, x, w, b, 1, 0)[0], rtol=1e-5, atol=1e-5)


@needs_direct
def test_a_kernel_module_without_isa_takes_im2col_both_ways(compiled):
    """Without ``isa`` (an older build) neither pass may take the direct path; a direct-path cache is
    then differentiated from its padded input through im2col and the compiled backward."""
    x, w, dy = data(2, 3, 7, 7), data(4, 3, 3, 3, seed=1), data(2, 4, 7, 7, seed=2)
    b = data(4, seed=3)
    y_ref, cache_ref = twin(cpu.conv_forward, x, w, b, 1, 1)
    rec = compiled(hide={"isa"})
    y, cache = cpu.conv_forward(x, w, b, 1, 1)
    assert cache[2] is not None and "conv_direct_forward" not in rec.calls
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    compiled()   # a direct-path cache, made with every kernel
    _, direct_cache = cpu.conv_forward(x, w, b, 1, 1)
    assert direct_cache[2] is None
    rec = compiled(hide={"isa"})
    got = cpu.conv_backward(dy, direct_cache)
    assert "nchw_to_rows" in rec.calls and "conv_direct_weight_grad" not in rec.calls
    for g, want in zip(got, twin(cpu.conv_backward, dy, cache_ref)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)


@needs_direct
def test_direct_backward_without_bias_or_dx(compiled):
    x, w, dy = data(2, 3, 6, 6), data(5, 3, 3, 3, seed=1), data(2, 5, 4, 4, seed=2)
    compiled()
    _, cache = cpu.conv_forward(x, w, None, 1, 0)
    assert cache[2] is None
    dx, dw, db = cpu.conv_backward(dy, cache, need_dx=False)
    assert dx is None and db is None
    _, cache_ref = twin(cpu.conv_forward, x, w, None, 1, 0)
    np.testing.assert_allclose(dw, twin(cpu.conv_backward, dy, cache_ref, need_dx=False)[1], rtol=1e-4, atol=1e-4)


@needs_direct
def test_the_direct_kernels_ask_threads_for_their_multiply_adds(compiled, monkeypatch):
    asked = []
    monkeypatch.setattr(_threads, "kernel_threads", lambda work: asked.append(work) or 1)
    x, w, b = data(2, 3, 8, 8), data(6, 3, 5, 5, seed=1), data(6, seed=2)
    compiled()
    y, cache = cpu.conv_forward(x, w, b, 1, 2)
    assert asked == [2 * 6 * 8 * 8 * (3 * 5 * 5)]   # every output, c*kh*kw multiply-adds each
    asked.clear()
    cpu.conv_backward(np.ones_like(y), cache)
    assert asked == [y.size * 75, y.size * 75]      # the weight gradient, then dx: the same work


# ------------------------------------------------------------------ pooling


def pool_pair(fwd, bwd, x, *args, seed=5):
    y, cache = fwd(x, *args)
    dy = data(*y.shape, seed=seed, dtype=x.dtype)
    return y, bwd(dy, cache), dy


@needs_kernels
@pytest.mark.parametrize("kernel, stride, padding", [(2, 1, 0), (2, 2, 1), (2, (2, 1), 0), ((2, 1), 2, 0),
                                                     (2, 2, 0), (3, 2, 0)])
def test_max_pooling_beside_the_2x2_kernel(compiled, kernel, stride, padding):
    x = data(2, 3, 9, 8)
    rec = compiled()
    y, dx, dy = pool_pair(cpu.max_pool_forward, cpu.max_pool_backward, x, kernel, stride, padding)
    y_ref, cache = twin(cpu.max_pool_forward, x, kernel, stride, padding)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, twin(cpu.max_pool_backward, dy, cache))
    special = (kernel, stride, padding) == (2, 2, 0)
    assert rec.calls == (["max_pool2x2_forward", "max_pool2x2_backward"] if special
                         else ["max_pool_forward", "max_pool_backward"])


@needs_kernels
def test_the_2x2_kernel_takes_a_single_window_and_the_twin_s_offsets(compiled):
    x = data(1, 1, 2, 2)
    rec = compiled()
    y, dx, dy = pool_pair(cpu.max_pool_forward, cpu.max_pool_backward, x)
    assert rec.calls == ["max_pool2x2_forward", "max_pool2x2_backward"]
    np.testing.assert_array_equal(dx, np.where(x == x.max(), dy[0, 0, 0, 0], 0).astype(np.float32))
    # a cache of the twin (its offsets as uint8) differentiated by the 2 x 2 kernel
    x = data(3, 2, 6, 6)
    _, cache = twin(cpu.max_pool_forward, x)
    assert cache[2].dtype == np.uint8
    dy = data(3, 2, 3, 3, seed=7)
    rec.calls.clear()
    np.testing.assert_array_equal(cpu.max_pool_backward(dy, cache), twin(cpu.max_pool_backward, dy, cache))
    assert rec.calls == ["max_pool2x2_backward"]


@needs_kernels
def test_without_the_2x2_kernel_the_general_one(compiled):
    x = data(2, 2, 6, 6)
    rec = compiled(hide={"max_pool2x2_forward"})
    y, dx, dy = pool_pair(cpu.max_pool_forward, cpu.max_pool_backward, x)
    assert rec.calls == ["max_pool_forward", "max_pool_backward"]
    y_ref, cache = twin(cpu.max_pool_forward, x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, twin(cpu.max_pool_backward, dy, cache))


@needs_kernels
def test_average_pooling_runs_the_compiled_kernels(compiled):
    rec = compiled()
    x = data(2, 3, 6, 6)
    y, dx, dy = pool_pair(cpu.avg_pool_forward, cpu.avg_pool_backward, x, 2)
    assert rec.calls == ["avg_pool_forward", "avg_pool_backward"]
    y_ref, cache = twin(cpu.avg_pool_forward, x, 2)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    np.testing.assert_allclose(dx, twin(cpu.avg_pool_backward, dy, cache), rtol=1e-6)


@pytest.mark.parametrize("kernel, stride, padding", [(2, 2, 0), (3, 2, 0), (2, 2, 1), (3, 3, 0)])
@pytest.mark.parametrize("op", ["max", "avg"])
def test_the_twins_gradients_keep_float32(op, kernel, stride, padding):
    """5 x 7 with 2 x 2 / 2: tiles that do not cover the input; 3 x 3 / 2: overlapping windows;
    padding: the padded buffer.  dx is float32 and exact."""
    x = np.arange(2 * 5 * 7, dtype=np.float32).reshape(1, 2, 5, 7) % 11
    fwd, bwd = (cpu.max_pool_forward, cpu.max_pool_backward) if op == "max" else \
        (cpu.avg_pool_forward, cpu.avg_pool_backward)
    with kernels.use_kernels("numpy"):
        y, cache = fwd(x, kernel, stride, padding)
        dy = np.full(y.shape, 0.5, np.float32)
        dx = bwd(dy, cache)
    assert dx.dtype == np.float32 and dx.shape == x.shape
    kh = kw = kernel
    want = np.zeros((1, 2, 5 + 2 * padding, 7 + 2 * padding))
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)), constant_values=-np.inf)
    for c in range(2):
        for i in range(y.shape[2]):
            for j in range(y.shape[3]):
                win = xp[0, c, i * stride:i * stride + kh, j * stride:j * stride + kw]
                if op == "max":
                    p, q = np.unravel_index(np.argmax(win), win.shape)  # the first maximum
                    want[0, c, i * stride + p, j * stride + q] += 0.5
                else:
                    want[0, c, i * stride:i * stride + kh, j * stride:j * stride + kw] += 0.5 / (kh * kw)
    np.testing.assert_allclose(dx, want[:, :, padding:padding + 5, padding:padding + 7], rtol=1e-6)


@pytest.mark.parametrize("kernel", [(17, 17), (1, 257), (16, 16)])
def test_max_pooling_windows_of_more_than_256_offsets(kernel):
    """The twin keeps the offsets as uint8 up to 256 of them (16 x 16 included), else int32: the last
    one of a 17 x 17 (288) or 1 x 257 (256) window must come back."""
    kh, kw = kernel
    x = np.zeros((1, 2, kh, kw), np.float32)
    x[0, 0, -1, -1] = 5.0   # the last offset
    x[0, 1, kh // 2, 0] = 3.0
    with kernels.use_kernels("numpy"):
        y, cache = cpu.max_pool_forward(x, kernel)
        dx = cpu.max_pool_backward(np.array([[[[2.0]], [[4.0]]]], np.float32), cache)
    assert y.ravel().tolist() == [5.0, 3.0]
    assert cache[2].ravel().tolist() == [kh * kw - 1, (kh // 2) * kw]
    assert cache[2].dtype == (np.uint8 if kh * kw <= 256 else np.int32)
    want = np.zeros_like(x)
    want[0, 0, -1, -1], want[0, 1, kh // 2, 0] = 2.0, 4.0
    np.testing.assert_array_equal(dx, want)
