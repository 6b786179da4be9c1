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


# ------------------------------------------------------- argument checks
def _one():
    return [nn.Parameter(np.zeros((2, 3), np.float32))]


@pytest.mark.parametrize("make, error, message", [
    (lambda ps: optim.SGD(ps, lr="fast"), TypeError, "SGD: learning rate must be a number, got 'fast'"),
    (lambda ps: optim.SGD(ps, lr=True), TypeError, "SGD: learning rate must be a number, got True"),
    (lambda ps: optim.SGD(ps, lr=None), TypeError, "SGD: learning rate must be a number, got None"),
    (lambda ps: optim.SGD(ps, lr=0.1, dampening=float("nan")), ValueError, "SGD: dampening must be finite, got nan"),
    (lambda ps: optim.SGD(ps, lr=0.1, nesterov=True), ValueError,
     "SGD: nesterov momentum requires momentum > 0 and dampening == 0, got momentum=0.0, dampening=0.0"),
    (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
     "SGD: nesterov momentum requires momentum > 0 and dampening == 0, got momentum=0.9, dampening=0.1"),
    (lambda ps: optim.Adam(ps, betas=(0.9, 1.0)), ValueError, "Adam: betas[1] must be < 1, got 1.0"),
    (lambda ps: optim.Adam(ps, betas=(-0.1, 0.9)), ValueError, "Adam: betas[0] must be >= 0, got -0.1"),
    (lambda ps: optim.AdamW(ps, betas=(0.9, float("nan"))), ValueError, "AdamW: betas[1] must be finite, got nan"),
    (lambda ps: optim.Adam(ps, betas=0.9), ValueError, "Adam: betas must be a pair (beta1, beta2), got 0.9"),
    (lambda ps: optim.Adam(ps, betas=(0.9, 0.99, 0.999)), ValueError, "Adam: betas must be a pair"),
    (lambda ps: optim.AdamW(ps, weight_decay=-0.01), ValueError, "AdamW: weight_decay must be >= 0, got -0.01"),
    (lambda ps: optim.Adam([], lr=0.1), ValueError, "Adam got an empty parameter list"),
])
def test_optimizer_arguments_are_refused_naming_the_setting(make, error, message):
    with pytest.raises(error) as e:
        make(_one())
    assert str(e.value).startswith(message), str(e.value)


def test_boundary_values_are_accepted():
    """The limits themselves are allowed: lr 0, momentum 0, betas 0, eps 0, decay 0."""
    opt = optim.SGD(_one(), lr=0, momentum=0, weight_decay=0)
    assert (opt.lr, opt.momentum, opt.weight_decay, opt.nesterov) == (0.0, 0.0, 0.0, False)
    adam = optim.Adam(_one(), lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    assert adam.betas == (0.0, 0.0) and adam.eps == 0.0
    assert isinstance(adam.betas[0], float) and isinstance(opt.lr, float)
    assert optim.SGD(_one(), lr=np.float32(0.5), momentum=0.9, nesterov=1).nesterov is True
    assert optim.AdamW(_one()).hyperparameters() == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                     "weight_decay": 1e-2}
    assert optim.Adam(_one()).hyperparameters()["weight_decay"] == 0.0


@pytest.mark.parametrize("make, error, message", [
    (lambda o: optim.StepLR(o, step_size=0), ValueError, "StepLR: step_size must be >= 1, got 0"),
    (lambda o: optim.StepLR(o, step_size=2.5), TypeError, "StepLR: step_size must be an integer, got 2.5"),
    (lambda o: optim.StepLR(o, step_size=True), TypeError, "StepLR: step_size must be an integer, got True"),
    (lambda o: optim.StepLR(o, step_size=2, gamma=-0.5), ValueError, "StepLR: gamma must be >= 0, got -0.5"),
    (lambda o: optim.StepLR(o, step_size=2, gamma="x"), TypeError, "StepLR: gamma must be a number, got 'x'"),
    (lambda o: optim.CosineAnnealingLR(o, T_max=0), ValueError, "CosineAnnealingLR: T_max must be >= 1, got 0"),
    (lambda o: optim.CosineAnnealingLR(o, T_max="10"), TypeError,
     "CosineAnnealingLR: T_max must be an integer, got '10'"),
    (lambda o: optim.CosineAnnealingLR(o, T_max=10, eta_min=-1e-3), ValueError,
     "CosineAnnealingLR: eta_min must be >= 0, got -0.001"),
    (lambda o: optim.LinearWarmup(o, 0), ValueError, "LinearWarmup: warmup_steps must be >= 1, got 0"),
    (lambda o: optim.LinearWarmup(o, 1.0), TypeError, "LinearWarmup: warmup_steps must be an integer, got 1.0"),
    (lambda o: optim.LinearWarmup(o, 3, after="cosine"), TypeError,
     "LinearWarmup: after must be a schedule (LRScheduler) or None, got str"),
    (lambda o: optim.LinearWarmup(o, 3, after=optim.StepLR(optim.SGD(_one(), lr=1.0), 2)), ValueError,
     "LinearWarmup: the schedule after the warm-up must drive the same optimizer"),
    (lambda o: optim.StepLR("not an optimizer", 2), TypeError, "StepLR drives an Optimizer, got str"),
])
def test_schedule_arguments_are_refused_naming_the_setting(make, error, message):
    opt = optim.SGD(_one(), lr=0.5)
    with pytest.raises(error) as e:
        make(opt)
    assert str(e.value) == message
    assert opt.lr == 0.5                      # a refused schedule never touched the learning rate


def test_schedules_accept_numpy_integers_and_zero_gamma():
    lrs = _lrs(lambda o: optim.StepLR(o, step_size=np.int64(2), gamma=0), 4)
    assert lrs == [0.5, 0.5, 0.0, 0.0, 0.0]
    cos = optim.CosineAnnealingLR(optim.SGD(_one(), lr=1.0), T_max=np.int32(4))
    assert cos.T_max == 4 and type(cos.T_max) is int


# -------------------------------------------------- load_state_dict refusals
def _trained(make, n=2, steps=2):
    params = [nn.Parameter(np.full((2, 3), float(i), np.float32)) for i in range(n)]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = np.ones((2, 3), np.float32)
        opt.step()
    return opt


SGD_M = (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9))
ADAM = (lambda ps: optim.Adam(ps, lr=0.1))


def _edit(sd, fn):
    import copy
    sd = copy.deepcopy(sd)
    fn(sd)
    return sd


@pytest.mark.parametrize("make, edit, error, message", [
    (SGD_M, lambda sd: sd["state"].pop(), ValueError,
     "optimizer state has 1 entries but the optimizer has 2 parameters"),
    (SGD_M, lambda sd: sd["state"].append(None), ValueError,
     "optimizer state has 3 entries but the optimizer has 2 parameters"),
    (SGD_M, lambda sd: sd.__setitem__("state", {}), ValueError,
     "optimizer state must be a list with one entry per parameter, got dict"),
    (SGD_M, lambda sd: sd["state"][1].__setitem__("momentum_buffer", np.zeros((3, 2), np.float32)), ValueError,
     "optimizer state 1 'momentum_buffer': expected shape (2, 3), got (3, 2)"),
    (ADAM, lambda sd: sd["state"][0].__setitem__("exp_avg_sq", np.zeros(6, np.float32)), ValueError,
     "optimizer state 0 'exp_avg_sq': expected shape (2, 3), got (6,)"),
    (ADAM, lambda sd: sd["state"][0].pop("exp_avg"), ValueError,
     "optimizer state 0: expected the keys ['exp_avg', 'exp_avg_sq', 'step'], got ['exp_avg_sq', 'step']"),
    (ADAM, lambda sd: sd["state"][1].__setitem__("momentum_buffer", None), ValueError,
     "optimizer state 1: expected the keys ['exp_avg', 'exp_avg_sq', 'step'], got "
     "['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step']"),
    (ADAM, lambda sd: sd["state"][1].__setitem__("exp_avg", None), ValueError,
     "optimizer state 1 'exp_avg': missing (None)"),
    (ADAM, lambda sd: sd["state"].__setitem__(0, [1, 2]), ValueError,
     "optimizer state 0: expected the keys ['exp_avg', 'exp_avg_sq', 'step'], got list"),
    (ADAM, lambda sd: sd["state"][0].__setitem__("step", -1), ValueError, "optimizer state 0 'step' must be >= 0, got -1"),
    (ADAM, lambda sd: sd["state"][0].__setitem__("step", 1.5), TypeError,
     "optimizer state 0 'step' must be an integer, got 1.5"),
    (SGD_M, lambda sd: sd["state"][0].__setitem__("momentum_buffer", None), ValueError,
     "optimizer state 0 'momentum_buffer': missing, but momentum is 0.9"),
    (SGD_M, lambda sd: sd["hyperparameters"].__setitem__("momentum", 0.0), ValueError,
     "optimizer state 0 'momentum_buffer': present, but momentum is 0.0"),
    (SGD_M, lambda sd: sd["hyperparameters"].__setitem__("momentum", float("nan")), ValueError,
     "SGD: momentum must be finite, got nan"),
    (ADAM, lambda sd: sd["hyperparameters"].__setitem__("lr", -1), ValueError,
     "Adam: learning rate must be >= 0, got -1.0"),
    (ADAM, lambda sd: sd["hyperparameters"].__setitem__("betas", (0.9, 1.5)), ValueError,
     "Adam: betas[1] must be < 1, got 1.5"),
    (ADAM, lambda sd: sd["hyperparameters"].pop("eps"), ValueError,
     "Adam.load_state_dict: hyperparameters must be ['betas', 'eps', 'lr', 'weight_decay'], "
     "got ['betas', 'lr', 'weight_decay']"),
    (SGD_M, lambda sd: sd["hyperparameters"].__setitem__("betas", (0.9, 0.99)), ValueError,
     "SGD.load_state_dict: hyperparameters must be ['dampening', 'lr', 'momentum', 'nesterov', 'weight_decay'], got "
     "['betas', 'dampening', 'lr', 'momentum', 'nesterov', 'weight_decay']"),
    (SGD_M, lambda sd: sd.__setitem__("hyperparameters", None), ValueError,
     "SGD.load_state_dict: hyperparameters must be ['dampening', 'lr', 'momentum', 'nesterov', 'weight_decay'], "
     "got NoneType"),
    (SGD_M, lambda sd: sd.pop("hyperparameters"), ValueError,
     "SGD.load_state_dict: expected a dict with 'hyperparameters' and 'state', got ['state']"),
])
def test_load_state_dict_refuses_what_does_not_fit_and_changes_nothing(make, edit, error, message):
    opt = _trained(make)
    before = opt.state_dict()
    bad = _edit(before, edit)
    with pytest.raises(error) as e:
        opt.load_state_dict(bad)
    assert str(e.value) == message
    after = opt.state_dict()                  # nothing changed: settings and every buffer as before
    assert after["hyperparameters"] == before["hyperparameters"]
    for a, b in zip(after["state"], before["state"]):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_load_state_dict_refuses_a_non_dict():
    with pytest.raises(ValueError, match=r"^SGD.load_state_dict: expected a dict with 'hyperparameters' and "
                                         r"'state', got list$"):
        optim.SGD(_one(), lr=0.1).load_state_dict([])


def test_load_state_dict_restores_settings_and_copies_arrays():
    src = _trained(lambda ps: optim.SGD(ps, lr=0.3, momentum=0.5, dampening=0.1, weight_decay=0.01), steps=3)
    sd = src.state_dict()
    dst = optim.SGD([nn.Parameter(np.zeros((2, 3), np.float32)) for _ in range(2)], lr=1.0)
    dst.load_state_dict(sd)
    assert dst.hyperparameters() == {"lr": 0.3, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01,
                                     "nesterov": False}
    for i in range(2):
        assert dst.state[i]["step"] == 3 and type(dst.state[i]["step"]) is int
        buf = dst.state[i]["momentum_buffer"]
        assert buf.dtype == np.float32 and buf.shape == (2, 3)
        np.testing.assert_array_equal(buf, sd["state"][i]["momentum_buffer"])
        sd["state"][i]["momentum_buffer"][:] = 99          # the optimizer holds its own copy
        assert not np.any(dst.state[i]["momentum_buffer"] == 99)
    # A state with None entries (parameters that never had a gradient) round-trips as None.
    fresh = optim.Adam([nn.Parameter(np.zeros(2, np.float32))])
    fresh.load_state_dict(optim.Adam([nn.Parameter(np.ones(2, np.float32))], lr=0.2).state_dict())
    assert fresh.state == [None] and fresh.lr == 0.2
    # numpy integers (as a file gives them back) are accepted as steps
    sd = _trained(ADAM).state_dict()
    sd["state"][0]["step"] = np.int64(2)
    opt = _trained(ADAM)
    opt.load_state_dict(sd)
    assert opt.state[0]["step"] == 2 and type(opt.state[0]["step"]) is int


def test_scheduler_state_dict_keeps_base_lr_and_time():
    opt = optim.SGD(_one(), lr=0.8)
    sched = optim.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        sched.step()
    sd = sched.state_dict()
    assert sd == {"base_lr": 0.8, "last_epoch": 5}
    opt2 = optim.SGD(_one(), lr=0.1)
    sched2 = optim.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(sd)
    assert (sched2.base_lr, sched2.last_epoch, opt2.lr) == (0.8, 5, 0.8 * 0.5 ** 2)
