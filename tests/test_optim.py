"""Tests of cydnn.optim: updates against transcriptions of PyTorch's rules, schedules, a training run."""
import math

import numpy as np
import pytest

from cydnn import nn, ops, optim


# "cuda" runs only where tests/conftest.py finds a usable GPU; elsewhere it is
# skipped with the reason (every test marked gpu is).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def host(a):
    return ops.backend_of(a).to_numpy(a)


# ------------------------------------------- PyTorch's update rules, in numpy
# Transcribed from torch/optim/sgd.py and adam.py (_single_tensor_*), one
# tensor, no amsgrad/maximize.  Each takes the parameter and a function giving
# the gradient at the current parameter, and returns the trajectory.
def torch_sgd(p, grad_fn, steps, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    p, buf, out = p.copy(), None, []
    for _ in range(steps):
        d_p = grad_fn(p)
        if weight_decay != 0:
            d_p = d_p + weight_decay * p
        if momentum != 0:
            if buf is None:
                buf = d_p.copy()
            else:
                buf = buf * momentum + (1 - dampening) * d_p
            d_p = d_p + momentum * buf if nesterov else buf
        p = p - lr * d_p
        out.append(p)
    return out


def torch_adam(p, grad_fn, steps, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    beta1, beta2 = betas
    p, out = p.copy(), []
    exp_avg, exp_avg_sq = np.zeros_like(p), np.zeros_like(p)
    for step in range(1, steps + 1):
        grad = grad_fn(p)
        if decoupled:
            p = p * (1 - lr * weight_decay)
        elif weight_decay != 0:
            grad = grad + weight_decay * p
        exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)          # lerp_
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = np.sqrt(exp_avg_sq) / math.sqrt(bias_correction2) + eps
        p = p - step_size * exp_avg / denom
        out.append(p)
    return out


def _run(optimizer_cls, device, dtype, steps, **kwargs):
    """Trajectory of a cydnn optimizer on two parameters, with gradients that depend on them."""
    rng = np.random.default_rng(0)
    starts = [rng.standard_normal((3, 4)).astype(dtype), rng.standard_normal(5).astype(dtype)]
    targets = [rng.standard_normal(s.shape).astype(dtype) for s in starts]
    grad_fns = [lambda p, t=t: (p - t) * 1.5 + np.sin(p) for t in targets]   # a smooth, nonlinear gradient
    backend = ops.backend(device)
    params = [nn.Parameter(backend.asarray(s.copy())) for s in starts]
    opt = optimizer_cls(params, **kwargs)
    trajectories = [[] for _ in params]
    for _ in range(steps):
        for p, fn in zip(params, grad_fns):
            p.grad = backend.asarray(fn(host(p.data)).astype(dtype))
        opt.step()
        for traj, p in zip(trajectories, params):
            traj.append(host(p.data).copy())
    return starts, grad_fns, trajectories


def _tolerance(device):
    # float64 on the CPU: only rounding differs from the transcription; float32 on the GPU.
    return (1e-12, 1e-12) if device == "cpu" else (2e-5, 2e-6)


SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.8, dampening=0.3),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.1, weight_decay=0.01),
    "all": dict(lr=0.03, momentum=0.7, weight_decay=0.05, nesterov=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_pytorch_rule(device, case):
    kwargs = SGD_CASES[case]
    dtype = np.float64 if device == "cpu" else np.float32
    starts, grad_fns, trajectories = _run(optim.SGD, device, dtype, 6, **kwargs)
    rtol, atol = _tolerance(device)
    for start, fn, traj in zip(starts, grad_fns, trajectories):
        expected = torch_sgd(start.astype(np.float64), fn, 6, **kwargs)
        np.testing.assert_allclose(np.array(traj), np.array(expected), rtol=rtol, atol=atol)


ADAM_CASES = {
    "adam": (optim.Adam, dict(lr=0.01), False),
    "adam_betas_eps": (optim.Adam, dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6), False),
    "adam_l2": (optim.Adam, dict(lr=0.01, weight_decay=0.1), False),
    "adamw_default_decay": (optim.AdamW, dict(lr=0.01), True),
    "adamw": (optim.AdamW, dict(lr=0.05, weight_decay=0.3), True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_pytorch_rule(device, case):
    cls, kwargs, decoupled = ADAM_CASES[case]
    dtype = np.float64 if device == "cpu" else np.float32
    starts, grad_fns, trajectories = _run(cls, device, dtype, 6, **kwargs)
    ref_kwargs = dict(kwargs, decoupled=decoupled)
    if cls is optim.AdamW:
        ref_kwargs.setdefault("weight_decay", 1e-2)           # AdamW's default, as PyTorch
    rtol, atol = _tolerance(device)
    for start, fn, traj in zip(starts, grad_fns, trajectories):
        expected = torch_adam(start.astype(np.float64), fn, 6, **ref_kwargs)
        np.testing.assert_allclose(np.array(traj), np.array(expected), rtol=rtol, atol=atol)


def test_adam_and_adamw_differ_with_weight_decay():
    _, _, adam = _run(optim.Adam, "cpu", np.float64, 3, lr=0.01, weight_decay=0.1)
    _, _, adamw = _run(optim.AdamW, "cpu", np.float64, 3, lr=0.01, weight_decay=0.1)
    assert not np.allclose(adam[0][-1], adamw[0][-1])


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam])
def test_parameters_without_gradient_are_skipped(cls):
    a = nn.Parameter(np.ones(3, np.float32))
    b = nn.Parameter(np.ones(3, np.float32))
    opt = cls([a, b], lr=0.1, **({"momentum": 0.9} if cls is optim.SGD else {}))
    a.grad = np.ones(3, np.float32)
    opt.step()
    assert np.all(a.data < 1) and np.all(b.data == 1)
    assert opt.state[0] is not None and opt.state[1] is None      # no state for b yet


def test_state_is_created_on_the_parameter_device_and_dtype():
    p = nn.Parameter(np.zeros((2, 3), np.float64))
    p.grad = np.ones((2, 3), np.float64)
    opt = optim.Adam([p])
    opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt.state[0][key].shape == (2, 3) and opt.state[0][key].dtype == np.float64
    assert opt.state[0]["step"] == 1


def test_zero_grad_clears_every_gradient():
    params = [nn.Parameter(np.zeros(2, np.float32)) for _ in range(3)]
    for p in params:
        p.grad = np.ones(2, np.float32)
    optim.SGD(params, lr=1.0).zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("make,match", [
    (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), "nesterov"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (lambda ps: optim.SGD(ps, lr=-1.0), "learning rate"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=-0.5), "momentum"),
    (lambda ps: optim.SGD(ps, lr=0.1, weight_decay=-1), "weight_decay"),
    (lambda ps: optim.Adam(ps, betas=(1.0, 0.999)), "betas"),
    (lambda ps: optim.Adam(ps, eps=-1.0), "eps"),
    (lambda ps: optim.SGD([], lr=0.1), "empty"),
])
def test_invalid_hyperparameters_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make([nn.Parameter(np.zeros(1, np.float32))])


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: optim.SGD(ps, lr=0.05),
    lambda ps: optim.AdamW(ps, lr=0.01),
], ids=["sgd-momentum", "sgd", "adamw"])
def test_optimizer_state_dict_resumes_exactly(make):
    rng = np.random.default_rng(0)
    start = rng.standard_normal((4, 3))
    grads = [rng.standard_normal((4, 3)) for _ in range(5)]

    def run(p, opt, gs):
        for g in gs:
            p.grad = g.copy()
            opt.step()

    p1 = nn.Parameter(start.copy())
    opt1 = make([p1])
    run(p1, opt1, grads)                              # 5 steps in one go

    p2 = nn.Parameter(start.copy())
    opt2 = make([p2])
    run(p2, opt2, grads[:3])
    saved = opt2.state_dict()
    p3 = nn.Parameter(p2.data.copy())
    opt3 = make([p3])
    opt3.load_state_dict(saved)
    run(p3, opt3, grads[3:])                          # 3 steps, save, restore, 2 more
    np.testing.assert_array_equal(p3.data, p1.data)


# --------------------------------------------------------------- schedules
def _lrs(make_scheduler, steps, base_lr=0.5):
    opt = optim.SGD([nn.Parameter(np.zeros(1, np.float32))], lr=base_lr)
    sched = make_scheduler(opt)
    lrs = [opt.lr]
    for _ in range(steps):
        sched.step()
        assert sched.get_last_lr() == opt.lr
        lrs.append(opt.lr)
    return lrs


def test_step_lr_closed_form_and_pytorch_recursion():
    lrs = _lrs(lambda o: optim.StepLR(o, step_size=3, gamma=0.5), 12)
    np.testing.assert_allclose(lrs, [0.5 * 0.5 ** (t // 3) for t in range(13)], rtol=1e-15)
    # PyTorch's chainable form: multiply by gamma when t is a positive multiple of step_size.
    lr, recursive = 0.5, [0.5]
    for t in range(1, 13):
        lr = lr * 0.5 if t % 3 == 0 else lr
        recursive.append(lr)
    np.testing.assert_allclose(lrs, recursive, rtol=1e-12)


def test_cosine_annealing_closed_form_and_pytorch_recursion():
    T, eta_min, base = 10, 0.01, 0.5
    lrs = _lrs(lambda o: optim.CosineAnnealingLR(o, T_max=T, eta_min=eta_min), 2 * T, base)
    closed = [eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / T)) / 2 for t in range(2 * T + 1)]
    np.testing.assert_allclose(lrs, closed, rtol=1e-12)
    assert lrs[0] == base and abs(lrs[T] - eta_min) < 1e-15
    # PyTorch's chainable form (torch/optim/lr_scheduler.py, CosineAnnealingLR.get_lr).
    lr, recursive = base, [base]
    for t in range(1, 2 * T + 1):
        if (t - 1 - T) % (2 * T) == 0:
            lr = lr + (base - eta_min) * (1 - math.cos(math.pi / T)) / 2
        else:
            lr = (1 + math.cos(math.pi * t / T)) / (1 + math.cos(math.pi * (t - 1) / T)) * (lr - eta_min) + eta_min
        recursive.append(lr)
    np.testing.assert_allclose(lrs, recursive, rtol=1e-9)


def test_linear_warmup_then_cosine():
    W, T, base = 4, 8, 0.5
    lrs = _lrs(lambda o: optim.LinearWarmup(o, W, after=optim.CosineAnnealingLR(o, T_max=T)), W + T, base)
    expected = [base * (t + 1) / W for t in range(W)]
    expected += [base * (1 + math.cos(math.pi * (t - W) / T)) / 2 for t in range(W, W + T + 1)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12)
    alone = _lrs(lambda o: optim.LinearWarmup(o, W), W + 3, base)
    np.testing.assert_allclose(alone, [base * (t + 1) / W for t in range(W)] + [base] * 4, rtol=1e-12)


def test_scheduler_drives_the_optimizer_step():
    p = nn.Parameter(np.zeros(1, np.float64))
    opt = optim.SGD([p], lr=1.0)
    sched = optim.StepLR(opt, step_size=1, gamma=0.1)
    moves = []
    for _ in range(3):
        before = p.data.copy()
        p.grad = np.ones(1)
        opt.step()
        sched.step()
        moves.append(float(before[0] - p.data[0]))
    np.testing.assert_allclose(moves, [1.0, 0.1, 0.01], rtol=1e-12)


def test_scheduler_state_dict_round_trip():
    opt = optim.SGD([nn.Parameter(np.zeros(1, np.float32))], lr=0.5)
    sched = optim.CosineAnnealingLR(opt, T_max=10)
    for _ in range(4):
        sched.step()
    saved, lr = sched.state_dict(), opt.lr
    opt2 = optim.SGD([nn.Parameter(np.zeros(1, np.float32))], lr=0.5)
    sched2 = optim.CosineAnnealingLR(opt2, T_max=10)
    sched2.load_state_dict(saved)
    assert opt2.lr == lr
    sched.step()
    sched2.step()
    assert opt2.lr == opt.lr


# ------------------------------------------------------------ training run
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_opt", [
    lambda ps: optim.SGD(ps, lr=0.5, momentum=0.9),
    lambda ps: optim.Adam(ps, lr=0.05),
], ids=["sgd", "adam"])
def test_training_a_linear_classifier_lowers_the_loss(device, make_opt):
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((3, 5))
    x_host = rng.standard_normal((256, 5)).astype(np.float32)
    y_host = (x_host @ teacher.T).argmax(axis=1).astype(np.int32)      # linearly separable labels
    backend = ops.backend(device)
    x, y = backend.asarray(x_host), backend.asarray(y_host)

    model = nn.Sequential(nn.Linear(5, 3, rng=1)).to(device)
    loss_fn = nn.CrossEntropyLoss()
    opt = make_opt(list(model.parameters()))
    first = float(host(loss_fn(model(x), y)))
    for _ in range(100):
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
    logits = host(model(x))
    last = float(host(loss_fn(model(x), y)))
    assert last < 0.3 * first
    assert (logits.argmax(axis=1) == y_host).mean() > 0.95

