"""More of what ops/cpu's session-17 mutation run left unchecked (docs/mutation/ops-cpu.md, "Session
18"): the optimizer updates with non-contiguous state (the compiled kernels must not update a copy),
which path they take, weight decay 1 and dampening 1 on the twin, batch normalization's defaults and
dtype refusal, and a kernel module without ``set_isa``.
"""
import numpy as np
import pytest

from cydnn.ops import cpu
from cydnn.ops.cpu import kernels

from test_ops_cpu_mut2 import Recording     # the compiled module, the kernels called recorded
from test_ops_cpu_mut2 import twin as on_twin     # fn on the numpy twin, the kernels in use put back after

BUILT = kernels.kernels_available()[0]
needs_kernels = pytest.mark.skipif(not BUILT, reason="the compiled kernels are not built here")


@pytest.fixture
def rec(monkeypatch):
    r = Recording(kernels._compiled)
    monkeypatch.setattr(kernels, "_active", r)
    return r


def strided(a):
    """``a``'s values in a writeable view that is not C-contiguous."""
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    view = big[..., ::2]
    view[...] = a
    assert not view.flags.c_contiguous and view.flags.writeable
    return view


def state(seed=0, shape=(4, 6)):
    rng = np.random.default_rng(seed)
    param, grad, m = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    return param, grad, m, np.abs(rng.standard_normal(shape)).astype(np.float32)


# ------------------------------------------------------------------ the compiled updates: which path


@needs_kernels
@pytest.mark.parametrize("which", [None, 0, 2, 3])  # contiguous; param, m or v strided
def test_adam_updates_non_contiguous_state_in_place(rec, which):
    arrays = list(state())
    want = [a.copy() for a in arrays]
    on_twin(cpu.adam_update, want[0], want[1], want[2], want[3], 3, lr=0.01, weight_decay=0.1)
    if which is not None:
        arrays[which] = strided(arrays[which])
    cpu.adam_update(arrays[0], arrays[1], arrays[2], arrays[3], 3, lr=0.01, weight_decay=0.1)
    assert rec.calls == (["adam_update"] if which is None else [])
    for got, w in zip(arrays, want):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("momentum", [0.9, 1.0])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_sgd_updates_a_non_contiguous_momentum_buffer_in_place(rec, momentum, layout):
    param, grad, buf, _ = state(1)
    want = [param.copy(), buf.copy()]
    on_twin(cpu.sgd_update, want[0], grad, want[1], 0.1, momentum=momentum, dampening=0.25)
    if layout == "strided":
        buf = strided(buf)
    cpu.sgd_update(param, grad, buf, 0.1, momentum=momentum, dampening=0.25)
    assert rec.calls == (["sgd_update"] if layout == "contiguous" else [])
    np.testing.assert_allclose(param, want[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(buf, want[1], rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("shape", [(5,), (4, 6), (2, 3, 4)])
def test_sgd_without_momentum_ignores_the_buffer_s_layout(rec, shape):
    """Without momentum the buffer is not used: a strided one (or none) keeps the kernel, for a
    parameter of any rank."""
    param, grad, buf, _ = state(2, shape)
    want = param - np.float32(0.1) * grad
    for b in (None, strided(buf)):
        p = param.copy()
        rec.calls.clear()
        cpu.sgd_update(p, grad, b, 0.1)
        assert rec.calls == ["sgd_update"]
        np.testing.assert_allclose(p, want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ the twins' arithmetic


def test_sgd_weight_decay_of_one():
    param, grad, buf, _ = (a.astype(np.float64) for a in state(3))
    p = param.copy()
    on_twin(cpu.sgd_update, p, grad, None, 0.1, weight_decay=1.0)
    np.testing.assert_allclose(p, param - 0.1 * (grad + 1.0 * param), rtol=1e-12)


def test_sgd_dampening_of_one_keeps_the_buffer_s_decay_only():
    param, grad, buf, _ = (a.astype(np.float64) for a in state(4))
    p, b = param.copy(), buf.copy()
    on_twin(cpu.sgd_update, p, grad, b, 0.1, momentum=0.5, dampening=1.0)
    np.testing.assert_allclose(b, 0.5 * buf, rtol=1e-12)
    np.testing.assert_allclose(p, param - 0.1 * 0.5 * buf, rtol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_weight_decay_of_one(decoupled):
    param, grad, m, v = (a.astype(np.float64) for a in state(5))
    p, m2, v2 = param.copy(), m.copy(), v.copy()
    on_twin(cpu.adam_update, p, grad, m2, v2, 2, lr=0.01, weight_decay=1.0, decoupled=decoupled)
    g = grad if decoupled else grad + param
    start = param * (1 - 0.01) if decoupled else param
    m_want, v_want = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    step = 0.01 * (m_want / (1 - 0.9 ** 2)) / (np.sqrt(v_want / (1 - 0.999 ** 2)) + 1e-8)
    np.testing.assert_allclose(m2, m_want, rtol=1e-12)
    np.testing.assert_allclose(v2, v_want, rtol=1e-12)
    np.testing.assert_allclose(p, start - step, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ batch normalization


def test_batch_norm_defaults_are_momentum_0_1_and_eps_1e_5():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32) * 1e-3  # small variance: eps shows
    gamma, beta = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    for training in (True, False):
        rm, rv = np.full(3, 0.5, np.float32), np.full(3, 2e-6, np.float32)
        rm2, rv2 = rm.copy(), rv.copy()
        y, _ = cpu.batch_norm_forward(x, gamma, beta, rm, rv, training)
        y2, _ = cpu.batch_norm_forward(x, gamma, beta, rm2, rv2, training, momentum=0.1, eps=1e-5)
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(rm, rm2)
        np.testing.assert_array_equal(rv, rv2)


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_batch_norm_refuses_other_dtypes(dtype):
    with pytest.raises(TypeError) as info:
        cpu.batch_norm_forward(np.zeros((2, 3), dtype), None, None, None, None, True)
    assert str(info.value) == (f"batch_norm_forward: x has dtype {np.dtype(dtype).name}; accepted: float32, "
                               f"float64 (x (2, 3))")


# ------------------------------------------------------------------ kernel selection


class NoSetIsa:
    """A kernel module of an older build: no set_isa."""
    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        if name == "set_isa":
            raise AttributeError(name)
        return getattr(self._module, name)


@needs_kernels
def test_from_env_with_a_module_without_set_isa(monkeypatch):
    old = NoSetIsa(kernels._compiled)
    monkeypatch.setattr(kernels, "_compiled", old)
    monkeypatch.setattr(kernels, "_active", kernels._active)  # put back after the test
    monkeypatch.delenv("CYDNN_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CYDNN_CPU_ISA", "baseline")
    kernels._from_env()
    assert kernels.active() is old
