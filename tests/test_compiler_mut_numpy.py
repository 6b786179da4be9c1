"""More networks through the compiler's plans on the numpy twin (tests/plan_numpy.py), against the per-op
reference on the CPU: the shapes tests/test_compiler_numpy.py's zoo does not reach -- asymmetric strides,
kernels and paddings, max / average / global pooling with padding and overlap, batch norm first in the
network, after a Linear, with and without an activation, in training and folded, dropout (p > 0 in training
with the plan's seed, p = 0, eval), LeakyReLU / Tanh / Sigmoid standing alone and fused, Linear-only networks,
layers without parameters before the first weight (whose input gradients the plan must skip), batch sizes
1, 3 and 8.  Each plan runs in its planned arena, so a wrong lowering, fusion or memory plan gives a wrong
number here.  Written for the mutation run of the compiler's passes (tools/mutation.py compiler)."""
import numpy as np
import pytest

from cydnn import nn, optim
from cydnn.compiler.compiled import _build_plan
from cydnn.ops import cpu

from plan_numpy import NumpyPlan

SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


def _stats(model, seed=0):
    """Running statistics and affine parameters away from 0 and 1 (so eval mode and folding show)."""
    r = np.random.default_rng(seed)
    for m in model.modules() if hasattr(model, "modules") else model:
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            c = m.num_features
            m.running_mean = r.normal(0, 0.3, c).astype(np.float32)
            m.running_var = r.uniform(0.5, 2.0, c).astype(np.float32)
            m.weight.data = r.uniform(0.5, 1.5, c).astype(np.float32)
            m.bias.data = r.normal(0, 0.2, c).astype(np.float32)
    return model


def strided(rng=0):
    """Asymmetric kernels, strides, paddings; overlapping padded pools; LeakyReLU fused; a standalone Sigmoid."""
    return nn.Sequential(nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 0), rng=rng), nn.LeakyReLU(0.2),
                         nn.MaxPool2d(3, stride=2, padding=1), nn.Conv2d(4, 5, 2, stride=1, padding=1, rng=rng),
                         nn.AvgPool2d((2, 3), stride=(1, 2), padding=(1, 1)), nn.Sigmoid(), nn.Flatten(),
                         nn.Linear(75, 7, rng=rng), nn.Tanh(), nn.Linear(7, 4, rng=rng))


def linear_only(rng=0):
    """Linear layers only (input (N, 20)), one without bias, each activation kind fused."""
    return nn.Sequential(nn.Linear(20, 16, rng=rng), nn.Tanh(), nn.Linear(16, 12, bias=False, rng=rng),
                         nn.LeakyReLU(0.3), nn.Linear(12, 9, rng=rng), nn.Sigmoid(), nn.Linear(9, 5, rng=rng))


def lone_acts(rng=0):
    """Activations that cannot be fused (after a pool, after another activation), a bias-free conv with no
    activation, a bias-free Linear fused with Sigmoid."""
    return nn.Sequential(nn.Conv2d(1, 3, 3, bias=False, rng=rng), nn.MaxPool2d(2), nn.ReLU(), nn.Tanh(),
                         nn.LeakyReLU(0.25), nn.Conv2d(3, 4, 1, rng=rng), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 6, bias=False, rng=rng), nn.Sigmoid(), nn.Linear(6, 3, rng=rng))


def no_params_first(rng=0):
    """Pooling and activations before the first weight: their input gradients are never needed."""
    return nn.Sequential(nn.AvgPool2d(2), nn.ReLU(), nn.MaxPool2d(2, stride=1), nn.Flatten(), nn.Tanh(),
                         nn.Linear(9, 6, rng=rng), nn.ReLU(), nn.Linear(6, 4, rng=rng))


def norms(rng=0):
    """Batch norm first (its input gradient is never needed), after a bias-free conv with Tanh, alone with a
    LeakyReLU after a pool, after a Linear without activation, global pooling; eps and momentum not the
    defaults."""
    return _stats(nn.Sequential(
        nn.BatchNorm2d(2, eps=1e-3, momentum=0.3), nn.Conv2d(2, 4, 3, padding=1, bias=False, rng=rng),
        nn.BatchNorm2d(4, momentum=0.2), nn.Tanh(), nn.MaxPool2d(2), nn.BatchNorm2d(4, eps=1e-2),
        nn.LeakyReLU(0.1), nn.Conv2d(4, 6, 3, rng=rng), nn.BatchNorm2d(6), nn.GlobalAvgPool2d(), nn.Flatten(),
        nn.Linear(6, 8, rng=rng), nn.BatchNorm1d(8, eps=1e-4, momentum=0.5), nn.Linear(8, 5, rng=rng),
        nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3, rng=rng)), seed=rng)


def dropouts(rng=0):
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 10, rng=rng), nn.ReLU(), nn.Dropout(0.3, rng=rng + 1),
                         nn.Linear(10, 8, rng=rng), nn.Dropout(0.0, rng=rng + 2), nn.Tanh(),
                         nn.Dropout(0.5, rng=rng + 3), nn.Linear(8, 4, rng=rng))


NETS = {"strided": (strided, (2, 9, 8)), "linear_only": (linear_only, (20,)), "lone_acts": (lone_acts, (1, 8, 8)),
        "no_params_first": (no_params_first, (1, 8, 8)), "norms": (norms, (2, 8, 8)),
        "dropouts": (dropouts, (3, 2, 2))}
OPTIONS = [{}, {"fuse": False}, {"memory": False}]
IDS = ["fused", "unfused", "no-reuse"]


class DropoutPlan(NumpyPlan):
    """The twin plus the dropout step: the mask of the reference op for the step's seed (the device mixes
    its step counter in; at the first step the reference layer draws the same seed from the same generator)."""

    def _dropout_step(self, s, b, lr):
        y, mask = cpu.dropout_forward(b[s.reads[0]].copy(), s.args["p"], s.args["seed"])
        b[s.writes[0]][...] = y
        b[s.writes[1]][...] = mask


def _state(model):
    arrays = {name: np.array(p.data, copy=True) for name, p in model.named_parameters()}
    arrays.update({"d:" + name: np.full_like(a, np.nan) for name, a in list(arrays.items())})
    arrays.update({name: np.array(a, copy=True) for name, a in model.named_buffers()
                   if a is not None and np.asarray(a).dtype == np.float32})
    return arrays


def _batch(shape, n, seed, classes):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + shape).astype(np.float32), rng.integers(0, classes, n)


def _classes(model):
    return [m for m in model if isinstance(m, nn.Linear)][-1].out_features


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(NETS))
def test_training_plan_equals_the_reference(name, n, options):
    """Loss, every gradient, every parameter after the SGD update, the running statistics; two steps (one with
    dropout: the device draws a new mask the next step, the twin cannot)."""
    make, shape = NETS[name]
    ref = make()
    if n == 1 and any(isinstance(m, nn.BatchNorm1d) for m in ref):
        pytest.skip("BatchNorm1d needs more than one value per channel in training (the reference refuses n=1)")
    steps = 1 if name == "dropouts" else 2
    classes = _classes(ref)
    opt = optim.SGD(ref.parameters(), **SGD)
    loss_fn = nn.CrossEntropyLoss()
    model = make()
    plan = _build_plan(model, shape, n, True, options)[0]
    run = DropoutPlan(plan, _state(model), optimizer=SGD)
    for k in range(steps):
        x, y = _batch(shape, n, 10 + k, classes)
        want = float(loss_fn(ref(x), y))
        ref.backward(loss_fn.backward(), input_grad=False)
        got = run.run(x, y.astype(np.int32), lr=SGD["lr"])
        assert float(got["loss"]) == pytest.approx(want, rel=1e-5), k
        noise = 1e-5 * max(np.abs(p.grad).max() for p in ref.parameters())
        for pname, p in ref.named_parameters():
            np.testing.assert_allclose(got["d:" + pname], p.grad, rtol=1e-4, atol=max(noise, 1e-6),
                                       err_msg=f"step {k}: d:{pname}")
        opt.step()
        for pname, p in ref.named_parameters():
            np.testing.assert_allclose(got[pname], p.data, rtol=1e-4, atol=1e-6, err_msg=f"step {k}: {pname}")
        for bname, a in ref.named_buffers():
            if bname in got:
                np.testing.assert_allclose(got[bname], a, rtol=1e-5, atol=1e-6, err_msg=f"step {k}: {bname}")


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(NETS))
def test_inference_plan_equals_the_reference(name, n, options):
    make, shape = NETS[name]
    model = make().eval()
    x, _ = _batch(shape, n, 3, 2)
    want = model(x)
    plan = _build_plan(model, shape, n, False, options)[0]
    got = NumpyPlan(plan, _state(model)).run(x)[plan.output]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    if options.get("fuse", True):
        layers = list(model)
        unfolded = [m for prev, m in zip([None] + layers, layers) if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))
                    and not isinstance(prev, (nn.Conv2d, nn.Linear))]
        assert sum(s.kind == "batch_norm_forward" for s in plan.steps) == len(unfolded), \
            "every batch norm after a conv or linear is folded, the others run"
        assert sum(s.kind == "fold_batch_norm" for s in plan.steps) == sum(
            isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for m in layers) - len(unfolded)


def test_dropout_in_training_is_a_mask_step_and_its_backward_a_multiply():
    """p > 0: the forward writes the mask the backward multiplies by, seeded from the layer's generator;
    p = 0: an alias, no step at all, in both directions."""
    model = dropouts()
    seeds = [int(np.random.default_rng(s).integers(0, 2**63 - 1)) for s in (1, 3)]
    plan = _build_plan(model, (3, 2, 2), 4, True, {})[0]
    drops = [s for s in plan.steps if s.kind == "dropout_step"]
    assert [(s.args["p"], s.args["seed"]) for s in drops] == [(0.3, seeds[0]), (0.5, seeds[1])]
    muls = [s for s in plan.steps if s.kind == "mul"]
    assert sorted(m.reads[1] for m in muls) == sorted(d.writes[1] for d in drops)
    assert all(d.reads[1] == "counters" for d in drops)
    zero = [i for i, m in enumerate(model) if isinstance(m, nn.Dropout) and m.p == 0.0][0]
    assert not any(s.name.startswith(f"{zero} ") for s in plan.steps)


def test_one_element_batch_norm_folding_uses_each_statistic():
    """Folding w' = w * gamma / sqrt(var + eps), b' = (b - mean) * gamma / sqrt(var + eps) + beta: each
    statistic and eps moved alone changes the folded output as the reference forward's does."""
    base = nn.Sequential(nn.Linear(3, 2, rng=1), nn.BatchNorm1d(2, eps=0.5))
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    for attr in ("running_mean", "running_var", "weight", "bias", None):
        model = _stats(nn.Sequential(nn.Linear(3, 2, rng=1), nn.BatchNorm1d(2, eps=0.5)), seed=4).eval()
        if attr in ("running_mean", "running_var"):
            setattr(model[1], attr, getattr(model[1], attr) + np.float32(0.7))
        elif attr:
            getattr(model[1], attr).data = getattr(model[1], attr).data * np.float32(1.5)
        plan = _build_plan(model, (3,), 2, False, {})[0]
        assert [s.kind for s in plan.steps] == ["fold_batch_norm", "linear_forward"]     # the bias: Lt's epilogue
        got = NumpyPlan(plan, _state(model)).run(x)[plan.output]
        np.testing.assert_allclose(got, model(x), rtol=1e-5, atol=1e-6, err_msg=str(attr))
    assert base is not None
