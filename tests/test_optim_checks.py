"""cydnn.optim's checks: the optimizers' and schedules' arguments, load_state_dict's refusals
(each message whole, the optimizer unchanged after a refusal), and the corners mutation testing
found unchecked (tools/mutation.py optim)."""
import numpy as np
import pytest

from cydnn import nn, ops, optim


def _lrs(make_scheduler, steps, base_lr=0.5):
    opt = optim.SGD([nn.Parameter(np.zeros(1, np.float32))], lr=base_lr)
    sched = make_scheduler(opt)
    lrs = [opt.lr]
    for _ in range(steps):
        sched.step()
        lrs.append(opt.lr)
    return lrs


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


# ------------------------------------------ what mutation testing asked for
def test_defaults_are_pytorchs():
    adam = optim.Adam(_one())
    assert adam.hyperparameters() == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert optim.AdamW(_one(), eps=1e-3).eps == 1e-3                # AdamW passes every setting on
    opt = optim.SGD(_one(), lr=1.0)
    sched = optim.StepLR(opt, step_size=1)                         # gamma defaults to 0.1
    sched.step()
    assert opt.lr == pytest.approx(0.1, rel=1e-15)


def test_a_parameter_without_gradient_does_not_stop_the_others():
    a, b = nn.Parameter(np.ones(3, np.float32)), nn.Parameter(np.ones(3, np.float32))
    opt = optim.SGD([a, b], lr=0.5)
    b.grad = np.ones(3, np.float32)                              # the first has none
    opt.step()
    np.testing.assert_array_equal(a.data, np.ones(3, np.float32))
    np.testing.assert_array_equal(b.data, np.full(3, 0.5, np.float32))


def test_state_dict_is_a_snapshot_not_a_view():
    opt = _trained(SGD_M, n=1)
    sd = opt.state_dict()
    saved = sd["state"][0]["momentum_buffer"].copy()
    opt.params[0].grad = np.ones((2, 3), np.float32)
    opt.step()                                                   # the live buffer moves on
    np.testing.assert_array_equal(sd["state"][0]["momentum_buffer"], saved)
    assert not np.array_equal(opt.state[0]["momentum_buffer"], saved)


def test_load_state_dict_converts_dtype_and_keeps_entries_after_a_none():
    src = _trained(SGD_M, n=2)
    sd = src.state_dict()
    sd["state"][0] = None                                        # the first parameter never had a gradient
    sd["state"][1]["momentum_buffer"] = sd["state"][1]["momentum_buffer"].astype(np.float64)
    sd["state"][1] = {"momentum_buffer": sd["state"][1]["momentum_buffer"], "step": 2}   # another key order
    dst = _trained(SGD_M, n=2, steps=0)
    dst.load_state_dict(sd)
    assert dst.state[0] is None
    assert dst.state[1]["step"] == 2 and dst.state[1]["momentum_buffer"].dtype == np.float32
    np.testing.assert_array_equal(dst.state[1]["momentum_buffer"], src.state[1]["momentum_buffer"])
    plain = optim.SGD(_one(), lr=0.1)                            # momentum 0: the buffer is None
    plain.load_state_dict({"hyperparameters": plain.hyperparameters(),
                           "state": [{"momentum_buffer": None, "step": 4}]})
    assert plain.state == [{"momentum_buffer": None, "step": 4}]


def test_load_state_dict_names_the_type_of_odd_hyperparameters():
    opt = optim.SGD(_one(), lr=0.1)
    with pytest.raises(ValueError, match=r"hyperparameters must be \[.*\], got list$"):
        opt.load_state_dict({"hyperparameters": [0.1], "state": [None]})


@pytest.mark.gpu
def test_state_dict_of_a_cuda_optimizer_is_on_the_host():
    cuda = ops.backend("cuda")
    p = nn.Parameter(cuda.asarray(np.zeros((2, 3), np.float32)))
    opt = optim.Adam([p], lr=0.1)
    p.grad = cuda.asarray(np.ones((2, 3), np.float32))
    opt.step()
    sd = opt.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        assert isinstance(sd["state"][0][key], np.ndarray)
        np.testing.assert_array_equal(sd["state"][0][key], cuda.to_numpy(opt.state[0][key]))
    opt2 = optim.Adam([nn.Parameter(cuda.asarray(np.zeros((2, 3), np.float32)))], lr=0.1)
    opt2.load_state_dict(sd)
    assert type(opt2.state[0]["exp_avg"]) is type(p.data)           # back on the device
