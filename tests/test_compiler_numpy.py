"""The compiler's plans, run by the numpy twin in their planned arena (tests/plan_numpy.py), against the per-op
reference path on the CPU: two SGD steps (loss, every gradient, every updated parameter, batch norm's running
statistics) and the inference forward, for every network of tests/test_compiler.py without dropout, fused
and unfused, with and without memory reuse.  Runs in CI: it checks the lowering, the fusion pass and the
memory plan without a GPU (the GPU tests check the same plans on cuDNN and the compiler's kernels)."""
import numpy as np
import pytest

from cydnn import nn, optim
from cydnn.compiler.compiled import _build_plan

from plan_numpy import NumpyPlan
from test_compiler import ZOO, _biases_before_norm

NETS = sorted(n for n in ZOO if n != "mlp") + ["mlp"]
SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)


def _batch(shape, n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + shape).astype(np.float32), rng.integers(0, 10, n)


def _state(model):
    arrays = {name: np.array(p.data, copy=True) for name, p in model.named_parameters()}
    arrays.update({"d:" + name: np.zeros_like(a) for name, a in list(arrays.items())})
    arrays.update({name: np.array(a, copy=True) for name, a in model.named_buffers()
                   if a is not None and np.asarray(a).dtype == np.float32})
    return arrays


@pytest.mark.parametrize("options", [{}, {"fuse": False}, {"memory": False}], ids=["fused", "unfused", "no-reuse"])
@pytest.mark.parametrize("name", NETS)
def test_training_plan_equals_the_reference_step(name, options):
    make, shape = ZOO[name]
    batches = [_batch(shape, seed=s) for s in (1, 2)]
    ref = make()
    opt = optim.SGD(ref.parameters(), **SGD)
    loss_fn = nn.CrossEntropyLoss()
    model = make()
    plan = _build_plan(model, shape, 8, True, options)[0]
    run = NumpyPlan(plan, _state(model), optimizer=SGD)
    for x, y in batches:
        want = float(loss_fn(ref(x), y))
        ref.backward(loss_fn.backward(), input_grad=False)
        got = run.run(x, y.astype(np.int32), lr=SGD["lr"])
        assert float(got["loss"]) == pytest.approx(want, rel=1e-5)
        largest = max(np.abs(p.grad).max() for p in ref.parameters())
        noise = 1e-5 * largest
        for pname, p in ref.named_parameters():
            if pname in _biases_before_norm(ref):
                # a bias followed by batch norm has a true gradient of 0: both sides are rounding noise of a
                # sum of ~200 float32 terms (up to ~1.2e-5 of the largest gradient), which two summation
                # orders give with different signs (seen on the GPU machine's numpy: 4.5e-6 against -3.7e-6,
                # the largest gradient 0.63) -- so each side must be that small, not equal to the other
                bound = 5e-5 * largest
                assert np.abs(got["d:" + pname]).max() <= bound and np.abs(p.grad).max() <= bound, pname
                continue
            # any other gradient may be a sum that cancels (batch norm's backward): float32 rounding of its
            # terms, summed in another order, is up to ~1e-5 of the largest gradient (seen: 1.5e-6 on
            # 9.weight of cnn_bn with numpy 2.4, the largest gradient ~0.5)
            np.testing.assert_allclose(got["d:" + pname], p.grad, rtol=1e-4, atol=max(1e-6, noise), err_msg=pname)
        opt.step()
        for pname, p in ref.named_parameters():
            np.testing.assert_allclose(got[pname], p.data, rtol=1e-4, atol=1e-6, err_msg=pname)
    for bname, a in ref.named_buffers():
        if bname in got:
            np.testing.assert_allclose(got[bname], a, rtol=1e-5, atol=1e-6, err_msg=bname)


@pytest.mark.parametrize("options", [{}, {"fuse": False}, {"memory": False}], ids=["fused", "unfused", "no-reuse"])
@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("softmax", [False, True])
def test_inference_plan_equals_the_reference_forward(name, options, softmax):
    make, shape = ZOO[name]
    model = make().eval()
    x, _ = _batch(shape, n=5, seed=3)
    want = model(x)
    if softmax:
        want = np.exp(want - want.max(1, keepdims=True))
        want /= want.sum(1, keepdims=True)
    plan = _build_plan(model, shape, 5, False, options, softmax=softmax)[0]
    got = NumpyPlan(plan, _state(model)).run(x)[plan.output]
    tol = 1e-4 if name == "cnn_bn" else 1e-5         # folding rounds w * s instead of (conv(x, w) - mean) * s
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_an_overlapping_memory_plan_is_caught():
    """The interpreter really uses the planned offsets: with every activation and gradient on top of the
    others, the activations the backward reads are overwritten and the gradients come out wrong."""
    make, shape = ZOO["cnn32"]
    x, y = _batch(shape, seed=4)
    ref = make()
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(ref(x), y)
    ref.backward(loss_fn.backward(), input_grad=False)
    model = make()
    plan = _build_plan(model, shape, 8, True, {})[0]
    for buf in plan.buffers.values():
        if buf.offset is not None:
            buf.offset = 0
    got = NumpyPlan(plan, _state(model), optimizer=SGD).run(x, y.astype(np.int32), lr=0.0)
    assert not all(np.allclose(got["d:" + n], p.grad, rtol=1e-4, atol=1e-6) for n, p in ref.named_parameters())
