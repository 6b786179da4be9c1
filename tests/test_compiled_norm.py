"""cpp/compiled_norm.cu: batch norm in training with its activation (what compiled steps run), against the
numpy twin (cydnn.ops.cpu.batch_norm_forward / _backward with the activation applied around it) and, on
the device, PyTorch.  CPU: the argument checks of the Cython layer."""
import numpy as np
import pytest

from cydnn.ops import cpu

gpu = pytest.mark.gpu

ACTS = {0: lambda v: v, 1: lambda v: np.maximum(v, 0), 2: np.tanh, 4: lambda v: np.where(v > 0, v, 0.1 * v)}
DACTS = {0: lambda y: np.ones_like(y), 1: lambda y: (y > 0).astype(np.float32), 2: lambda y: 1 - y * y,
         4: lambda y: np.where(y > 0, 1, 0.1).astype(np.float32)}


def _twin(x, gamma, beta, rm, rv, momentum, eps, act, dy):
    y, cache = cpu.batch_norm_forward(x.copy(), gamma, beta, rm, rv, True, momentum, eps)
    out = ACTS[act](y).astype(np.float32)
    g = (dy * DACTS[act](out)).astype(np.float32)
    dx, dgamma, dbeta = cpu.batch_norm_backward(g, cache)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    mean = x.astype(np.float64).mean(axis=axes)
    inv_std = 1 / np.sqrt(x.astype(np.float64).var(axis=axes) + eps)
    return out, dx, dgamma, dbeta, mean, inv_std


@gpu
@pytest.mark.parametrize("shape", [(5, 3, 7, 9), (64, 4, 28, 28), (64, 10), (2, 6, 1, 1), (3, 2, 4097), (3, 4100)])
@pytest.mark.parametrize("act", [0, 1, 2, 4])
def test_forward_and_backward_match_the_numpy_twin(shape, act):
    """(64, 4, 28, 28): 50,176 values a channel, seven partial-sum blocks; (64, 10): BatchNorm1d; (3, 4100): more
    channels than a block keeps (the separate finalize kernels); a mean of 20 against a spread of 1-3 checks the
    shifted sums (a plain sum of squares would lose the variance)."""
    from cydnn import _C
    rng = np.random.default_rng(sum(shape) + act)
    c = shape[1]
    x = (rng.standard_normal(shape) * rng.uniform(1, 3, (1, c) + (1,) * (len(shape) - 2))
         + 20).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    rm, rv = rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    momentum, eps = 0.1, 1e-5
    rm_ref, rv_ref = rm.copy(), rv.copy()
    y_ref, dx_ref, dg_ref, db_ref, mean_ref, istd_ref = _twin(x, gamma, beta, rm_ref, rv_ref, momentum, eps, act, dy)

    d = {k: _C.to_device(v) for k, v in dict(x=x, gamma=gamma, beta=beta, rm=rm, rv=rv, dy=dy).items()}
    y, mean, istd = _C.empty(shape), _C.empty((c,)), _C.empty((c,))
    _C.bn_act_forward_train(d["x"], d["gamma"], d["beta"], d["rm"], d["rv"], momentum, eps, y, mean, istd, act, 0.1)
    np.testing.assert_allclose(mean.numpy(), mean_ref, rtol=1e-6)
    np.testing.assert_allclose(istd.numpy(), istd_ref, rtol=2e-5)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d["rm"].numpy(), rm_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d["rv"].numpy(), rv_ref, rtol=1e-5)

    dx, dgamma, dbeta = _C.empty(shape), _C.empty((c,)), _C.empty((c,))
    _C.bn_act_backward(d["x"], y if act else None, d["dy"], d["gamma"], mean, istd, dx, dgamma, dbeta, act, 0.1)
    # dx is a difference of terms of size gamma inv_std |g|: that, not dx (exactly 0 with two values a channel),
    # sets the rounding
    axes = tuple(i for i in range(x.ndim) if i != 1)
    scale = float(np.abs(dy).max() * (gamma.max() / np.sqrt(x.var(axis=axes).min() + eps)))
    np.testing.assert_allclose(dx.numpy(), dx_ref, rtol=1e-3, atol=2e-4 * scale)
    np.testing.assert_allclose(dbeta.numpy(), db_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dgamma.numpy(), dg_ref, rtol=1e-4, atol=1e-3)

    # dx written over dy (the compiled plan may do that), and no dx at all: the same parameter gradients
    dg2, db2 = _C.empty((c,)), _C.empty((c,))
    _C.bn_act_backward(d["x"], y if act else None, d["dy"], d["gamma"], mean, istd, d["dy"], dg2, db2, act, 0.1)
    assert np.array_equal(d["dy"].numpy(), dx.numpy())
    dg3, db3 = _C.empty((c,)), _C.empty((c,))
    _C.bn_act_backward(d["x"], y if act else None, _C.to_device(dy), d["gamma"], mean, istd, None, dg3, db3, act, 0.1)
    assert np.array_equal(dg3.numpy(), dgamma.numpy()) and np.array_equal(db3.numpy(), dbeta.numpy())


@gpu
def test_the_same_bits_every_run_and_pytorch_agrees():
    torch = pytest.importorskip("torch")
    from cydnn import _C
    rng = np.random.default_rng(3)
    shape, c = (64, 32, 14, 14), 32
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    runs = []
    for _ in range(2):
        rm, rv = _C.to_device(np.zeros(c, np.float32)), _C.to_device(np.ones(c, np.float32))
        y, mean, istd = _C.empty(shape), _C.empty((c,)), _C.empty((c,))
        _C.bn_act_forward_train(_C.to_device(x), _C.to_device(gamma), _C.to_device(beta), rm, rv, 0.1, 1e-5, y, mean,
                                istd, 1, 0.0)
        dx, dg, db = _C.empty(shape), _C.empty((c,)), _C.empty((c,))
        _C.bn_act_backward(_C.to_device(x), y, _C.to_device(dy), _C.to_device(gamma), mean, istd, dx, dg, db, 1, 0.0)
        runs.append([a.numpy() for a in (y, dx, dg, db, rm, rv)])
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    bn = torch.nn.BatchNorm2d(c).cuda()
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(gamma))
        bn.bias.copy_(torch.from_numpy(beta))
    tx = torch.from_numpy(x).cuda().requires_grad_()
    ty = torch.relu(bn(tx))
    ty.backward(torch.from_numpy(dy).cuda())
    want = [ty.detach(), tx.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]
    for got, w, tol in zip(runs[0], want, [1e-5, 1e-4, 1e-4, 1e-4, 1e-6, 1e-6]):
        w = w.detach().cpu().numpy()
        np.testing.assert_allclose(got, w, rtol=tol, atol=tol * max(1.0, float(np.abs(w).max())))


@gpu
def test_bad_arguments_are_refused_before_the_device_runs():
    from cydnn import _C
    x, g = _C.empty((4, 3, 2, 2)), _C.empty((3,))
    with pytest.raises(ValueError, match=r"bn_act_forward_train: gamma must have 3 values \(channels\), got shape \(4,\)"):
        _C.bn_act_forward_train(x, _C.empty((4,)), g, None, None, 0.1, 1e-5, _C.empty((4, 3, 2, 2)), g, g)
    with pytest.raises(ValueError, match=r"bn_act_backward: dx must have 48 values \(x\), got shape \(4, 3, 2\)"):
        _C.bn_act_backward(x, None, x, g, g, g, _C.empty((4, 3, 2)), g, g)
    with pytest.raises(Exception, match="running_mean and running_var must both be given"):
        _C.bn_act_forward_train(x, g, g, g, None, 0.1, 1e-5, _C.empty((4, 3, 2, 2)), g, g)
    with pytest.raises(Exception, match=r"y is NULL"):
        _C.bn_act_backward(x, None, x, g, g, g, None, g, g, 1)
