"""The training plan's head (cpp/compiled_head.cu, passes.fuse_head): the last linear layer and the softmax
cross-entropy, forward and backward, in two kernels.  GPU: its six results against float64 numpy and the numpy twin
(ops.cpu.linear_xent), the same bits every run, NaN for a label out of range, its refusals; the plan's loss, gradients
and weights after training steps against the four steps it replaces (``CYDNN_LINEAR=library``).  CPU: the twin
against finite differences, and where the pass fuses."""
import numpy as np
import pytest

import cydnn
from cydnn import nn, ops, optim
from cydnn.compiler.compiled import _build_plan

gpu = pytest.mark.gpu


def _data(n, k, c, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k)).astype(np.float32)
    w = (rng.standard_normal((c, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    return x, w, b, labels


def _run(x, w, b, labels, need_dx=True, bias_grad=True):
    from cydnn import _C
    n, k = x.shape
    c = w.shape[0]
    out = dict(logits=_C.empty((n, c)), row_loss=_C.empty((n,)), loss=_C.empty(()), g=_C.empty((n, c)),
               dbias=_C.empty((c,)) if b is not None and bias_grad else None,
               dx=_C.empty((n, k)) if need_dx else None, dw=_C.empty((c, k)))
    _C.linear_xent(cydnn.to_device(x), cydnn.to_device(w), None if b is None else cydnn.to_device(b),
                   cydnn.to_device(labels), out["logits"], out["row_loss"], out["loss"], out["g"], out["dbias"],
                   out["dx"], out["dw"])
    return {k: (None if v is None else v.numpy()) for k, v in out.items()}


@gpu
@pytest.mark.parametrize("n, k, c", [(64, 2048, 10), (64, 128, 10), (64, 84, 10), (256, 1024, 10), (3, 5, 1),
                                     (7, 300, 17), (32, 513, 32), (192, 64, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_head_is_float64_numpy_and_the_twin(n, k, c, bias):
    """Every output within float32 rounding of float64 numpy (scaled by each output's largest value), and of the
    float32 twin; dx None and dbias None leave the rest unchanged."""
    x, w, b, labels = _data(n, k, c, seed=n + k + c)
    b = b if bias else None
    got = _run(x, w, b, labels)
    ref = ops.cpu.linear_xent(x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64),
                              labels)
    twin = ops.cpu.linear_xent(x, w, b, labels)
    for name, r, t in zip(("logits", "loss", "g", "dbias", "dx", "dw"), ref, twin):
        if r is None:
            assert got[name] is None
            continue
        scale = max(1.0, float(np.abs(r).max()))
        err = float(np.abs(got[name] - r).max())
        assert err <= 2e-5 * scale, (name, err, scale)
        assert float(np.abs(got[name] - t).max()) <= 4e-5 * scale, name
    lse = np.log(np.exp(ref[0] - ref[0].max(1, keepdims=True)).sum(1)) + ref[0].max(1)
    np.testing.assert_allclose(got["row_loss"], lse - ref[0][np.arange(n), labels], rtol=1e-5, atol=1e-5)
    lean = _run(x, w, b, labels, need_dx=False, bias_grad=False)
    for name in ("logits", "loss", "g", "dw"):
        np.testing.assert_array_equal(lean[name], got[name])


@gpu
def test_the_head_gives_the_same_bits_every_run():
    x, w, b, labels = _data(64, 2048, 10, seed=3)
    one, two = _run(x, w, b, labels), _run(x, w, b, labels)
    for name in one:
        assert np.array_equal(one[name].view(np.uint32), two[name].view(np.uint32)), name


@gpu
def test_a_label_out_of_range_makes_its_row_nan():
    """As the unfused cross-entropy: the row's loss and gradient are NaN, so the loss, dbias, dw and that row of dx
    are; the other rows of dx are not."""
    x, w, b, labels = _data(8, 40, 5, seed=4)
    labels[3] = 5
    got = _run(x, w, b, labels)
    assert np.isnan(got["loss"]) and np.isnan(got["row_loss"][3]) and np.isnan(got["g"][3]).all()
    assert not np.isnan(np.delete(got["g"], 3, axis=0)).any()
    assert np.isnan(got["dx"][3]).all() and not np.isnan(np.delete(got["dx"], 3, axis=0)).any()
    assert np.isnan(got["dbias"]).all() and np.isnan(got["dw"]).all()
    assert not np.isnan(got["logits"]).any()


@gpu
@pytest.mark.parametrize("sign", [1, -1])
def test_an_infinite_weight_gives_the_logits_numpy_gives(sign):
    """A weight of +-inf in the first column (k = 128: most of a row's 512 threads own no column): the logit it feeds
    is +-inf, as numpy's product gives it, not NaN -- a thread without a column adds nothing, not 0 * W[j, 0]; with
    -inf that class has probability 0 and the loss stays finite where no label is that class."""
    x, w, b, labels = _data(4, 128, 10, seed=6)
    x[:, 0] = np.abs(x[:, 0]) + 1
    w[2, 0] = sign * np.inf
    labels[labels == 2] = 3
    got = _run(x, w, b, labels)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.array_equal(np.isinf(got["logits"]), np.isinf(want)) and np.isinf(want[:, 2]).all()
    assert np.array_equal(np.sign(got["logits"][:, 2]), np.sign(want[:, 2])) and not np.isnan(got["logits"]).any()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got["logits"][finite], want[finite], rtol=1e-5, atol=1e-5)
    if sign < 0:
        assert np.isfinite(got["loss"]) and got["g"][:, 2].tolist() == [0.0] * 4


@gpu
def test_the_head_refuses_what_it_cannot_compute():
    from cydnn import _C
    e = _C.empty
    lab = cydnn.to_device(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"linear_xent: x \(n, k\) and w \(c, k\) must share k"):
        _C.linear_xent(e((4, 8)), e((3, 9)), None, lab, e((4, 3)), e((4,)), e(()), e((4, 3)), None, None, e((3, 9)))
    with pytest.raises(ValueError, match=r"linear_xent: needs 1 <= c <= 32 classes"):
        _C.linear_xent(e((4, 8)), e((33, 8)), None, lab, e((4, 33)), e((4,)), e(()), e((4, 33)), None, None,
                       e((33, 8)))
    with pytest.raises(ValueError, match=r"linear_xent: dx must have shape \(4, 8\)"):
        _C.linear_xent(e((4, 8)), e((3, 8)), None, lab, e((4, 3)), e((4,)), e(()), e((4, 3)), None, e((4, 9)),
                       e((3, 8)))
    with pytest.raises(ValueError, match=r"linear_xent: labels must have shape \(4,\)"):
        _C.linear_xent(e((4, 8)), e((3, 8)), None, cydnn.to_device(np.zeros(5, np.int32)), e((4, 3)), e((4,)),
                       e(()), e((4, 3)), None, None, e((3, 8)))


def _net(classes=10):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32, rng=1), nn.ReLU(), nn.Linear(32, classes, rng=2))


@gpu
@pytest.mark.parametrize("make_opt", [lambda p: optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: optim.AdamW(p, lr=1e-3, weight_decay=0.01)], ids=["sgd", "adamw"])
@pytest.mark.parametrize("make, shape", [(_net, (1, 8, 8)),
                                         (lambda: nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1, rng=3),
                                                                nn.ReLU(), nn.Flatten(),
                                                                nn.Linear(8 * 4 * 4, 10, rng=4)), (1, 8, 8))],
                         ids=["mlp", "conv"])
def test_a_plan_with_the_head_trains_as_the_steps_it_replaces(make, shape, make_opt, monkeypatch):
    """Ten steps from the same weights: the plan whose head ran fused and the plan forced to the four library
    steps (CYDNN_LINEAR=library) give the same losses and weights within float32 rounding carried over the steps."""
    monkeypatch.setenv("CYDNN_FUSED_TRAIN", "off")
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((64,) + shape).astype(np.float32), rng.integers(0, 10, 64).astype(np.int64))
               for _ in range(10)]
    runs = []
    for forced in ("fused", "library"):          # $CYDNN_LINEAR: the way the executor takes (otherwise timed)
        monkeypatch.setenv("CYDNN_LINEAR", forced)
        model = make().to("cuda")
        step = cydnn.compile(model, make_opt(model.parameters()), batch_size=64, input_shape=shape)
        losses = [float(step(x, y)) for x, y in batches]
        runner = step._runners[(64, shape)]
        head = [s for s in (getattr(runner, "generic_plan", None) or runner.plan).steps if s.kind == "linear_xent"]
        assert len(head) == 1
        runs.append((losses, [p.data.numpy().copy() for p in model.parameters()], head[0].kernels))
    (fused_loss, fused_w, kernels), (lib_loss, lib_w, lib_kernels) = runs
    assert kernels == ("linear_xent_rows_kernel", "linear_xent_grads_kernel")
    assert "linear_xent_rows_kernel" not in lib_kernels and "cross_entropy_rows_kernel" in lib_kernels
    np.testing.assert_allclose(fused_loss, lib_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(fused_w, lib_w):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------- CPU
def test_the_twin_is_the_gradient_of_its_loss():
    """Central differences of the twin's loss (float64) in x, w and bias match its dx, dw and dbias, and its g
    is the loss's gradient in the logits."""
    x, w, b, labels = (a.astype(np.float64) if a.dtype == np.float32 else a for a in _data(5, 7, 4, seed=9))
    logits, loss, g, dbias, dx, dw = ops.cpu.linear_xent(x, w, b, labels)
    np.testing.assert_allclose(logits, x @ w.T + b)
    eps = 1e-6
    for arr, grad in ((x, dx), (w, dw), (b, dbias)):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            up = float(ops.cpu.linear_xent(x, w, b, labels)[1])
            arr[i] = old - eps
            down = float(ops.cpu.linear_xent(x, w, b, labels)[1])
            arr[i] = old
            num[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-8)
    z = logits.copy()
    num = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        old = z[i]
        z[i] = old + eps
        up = float(ops.cpu.softmax_cross_entropy(z, labels)[0])
        z[i] = old - eps
        down = float(ops.cpu.softmax_cross_entropy(z, labels)[0])
        z[i] = old
        num[i] = (up - down) / (2 * eps)
    np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-8)


def _kinds(layers, shape, batch=4, **options):
    plan = _build_plan(nn.Sequential(*layers), shape, batch, True, options)[0]
    return [s.kind for s in plan.steps], plan


def test_fuse_head_takes_the_last_linear_before_the_loss():
    """CPU: an MLP's and a CNN's last linear layer (with and without bias, with and without an input gradient)
    become one step in place of four; not with an activation after it, not beyond 32 classes (saying why), not
    with fuse=False."""
    kinds, plan = _kinds([nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 10)], (1, 4, 4))
    assert kinds.count("linear_xent") == 1 and "softmax_cross_entropy" not in kinds
    head = plan.steps[kinds.index("linear_xent")]
    assert head.reads == ("a1", "3.weight", "3.bias", "labels")
    assert head.writes == ("a2", "loss", "g2", "rowloss", "d:3.bias", "g1", "d:3.weight")
    assert [s.kind for s in head.args["unfused"]] == ["linear_forward", "softmax_cross_entropy", "bias_act_backward",
                                                      "linear_backward"]
    assert kinds.count("linear_backward") == 1                     # the first layer's
    kinds, plan = _kinds([nn.Flatten(), nn.Linear(16, 10, bias=False)], (1, 4, 4))
    assert kinds[:1] == ["linear_xent"]
    head = plan.steps[0]
    assert head.args["dx"] is None and head.args["dbias"] is None and head.writes == ("a1", "loss", "g1", "rowloss",
                                                                                       "d:1.weight")
    assert "linear_xent" not in _kinds([nn.Flatten(), nn.Linear(16, 10), nn.Tanh()], (1, 4, 4))[0]
    kinds, plan = _kinds([nn.Flatten(), nn.Linear(16, 33)], (1, 4, 4))
    assert "linear_xent" not in kinds and "head: not fused (33 classes: the fused head takes at most 32)" in plan.log
    assert "linear_xent" in _kinds([nn.Flatten(), nn.Linear(16, 32)], (1, 4, 4), batch=1024)[0]
    assert "linear_xent" not in _kinds([nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 10)], (1, 4, 4),
                                       fuse=False)[0]
