"""Tests of batch normalization, global average pooling and leaky ReLU on the CPU: the numpy
twins against plain per-channel loops and finite differences (float64), the layers' running
statistics against a hand computation of PyTorch's rule, state_dict names and round trips,
train/eval modes, module buffers, and bad input with its message.  (GPU and PyTorch
comparisons: tests/test_layers_norm_gpu.py.)"""
import re

import numpy as np
import pytest

from cydnn import nn, optim
from cydnn.ops import cpu

RANK_SHAPES = [(5, 3), (4, 3, 5), (3, 2, 4, 3)]


# ------------------------------------------------------------------ helpers
def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every entry of x (changed in place)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        g[i] = (up - down) / (2 * eps)
    return g


def channel_values(x, k):
    """Every value of channel k (axis 1), as a flat array."""
    return np.moveaxis(x, 1, 0)[k].ravel()


def loop_batch_norm(x, gamma, beta, mean, var, eps):
    """The definition, one channel at a time."""
    y = np.empty_like(x)
    for k in range(x.shape[1]):
        index = (slice(None), k)
        y[index] = gamma[k] * (x[index] - mean[k]) / np.sqrt(var[k] + eps) + beta[k]
    return y


def bn_inputs(rng, shape, dtype=np.float64):
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    gamma = (rng.uniform(0.5, 1.5, c)).astype(dtype)
    beta = rng.standard_normal(c).astype(dtype)
    running_mean = rng.standard_normal(c).astype(dtype)
    running_var = rng.uniform(0.5, 2.0, c).astype(dtype)
    return x, gamma, beta, running_mean, running_var


# ------------------------------------------------------- batch norm: the twin
@pytest.mark.parametrize("shape", RANK_SHAPES)
def test_batch_norm_forward_training_is_the_definition(shape):
    rng = np.random.default_rng(0)
    x, gamma, beta, rm, rv = bn_inputs(rng, shape)
    rm0, rv0 = rm.copy(), rv.copy()
    y, _ = cpu.batch_norm_forward(x, gamma, beta, rm, rv, True, momentum=0.2, eps=1e-3)
    c = shape[1]
    mean = np.array([channel_values(x, k).mean() for k in range(c)])
    var = np.array([channel_values(x, k).var() for k in range(c)])            # biased
    unbiased = np.array([channel_values(x, k).var(ddof=1) for k in range(c)])
    np.testing.assert_allclose(y, loop_batch_norm(x, gamma, beta, mean, var, 1e-3), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rm, 0.8 * rm0 + 0.2 * mean, rtol=1e-12)
    np.testing.assert_allclose(rv, 0.8 * rv0 + 0.2 * unbiased, rtol=1e-12)


@pytest.mark.parametrize("shape", RANK_SHAPES)
def test_batch_norm_forward_eval_uses_running_stats_and_leaves_them(shape):
    rng = np.random.default_rng(1)
    x, gamma, beta, rm, rv = bn_inputs(rng, shape)
    rm0, rv0 = rm.copy(), rv.copy()
    y, _ = cpu.batch_norm_forward(x, gamma, beta, rm, rv, False, momentum=0.1, eps=1e-5)
    np.testing.assert_allclose(y, loop_batch_norm(x, gamma, beta, rm0, rv0, 1e-5), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(rm, rm0)
    np.testing.assert_array_equal(rv, rv0)


def test_batch_norm_without_affine_or_running_stats():
    rng = np.random.default_rng(2)
    x, _, _, _, _ = bn_inputs(rng, (6, 3, 2, 2))
    y, cache = cpu.batch_norm_forward(x, None, None, None, None, True, momentum=0.1, eps=1e-5)
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), 1, rtol=1e-3)      # var / (var + eps)
    dx, dgamma, dbeta = cpu.batch_norm_backward(np.ones_like(y), cache)
    assert dgamma is None and dbeta is None
    np.testing.assert_allclose(dx, 0, atol=1e-12)     # a constant dy does not move normalised values


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", RANK_SHAPES)
def test_batch_norm_gradients_by_finite_differences(shape, training, affine):
    rng = np.random.default_rng(3)
    x, gamma, beta, rm, rv = bn_inputs(rng, shape)
    if not affine:
        gamma = beta = None
    r = rng.standard_normal(shape)            # loss = sum(r * y): dL/dy = r

    def loss():
        # Fresh running statistics each call: training updates them in place.
        y, _ = cpu.batch_norm_forward(x, gamma, beta, rm.copy(), rv.copy(), training, momentum=0.1, eps=1e-2)
        return float(np.sum(r * y))

    _, cache = cpu.batch_norm_forward(x, gamma, beta, rm.copy(), rv.copy(), training, momentum=0.1, eps=1e-2)
    dx, dgamma, dbeta = cpu.batch_norm_backward(r, cache)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    if affine:
        np.testing.assert_allclose(dgamma, numeric_grad(loss, gamma), rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(dbeta, numeric_grad(loss, beta), rtol=1e-6, atol=1e-8)
    else:
        assert dgamma is None and dbeta is None


def test_batch_norm_float32_stays_float32():
    rng = np.random.default_rng(4)
    x, gamma, beta, rm, rv = (a.astype(np.float32) for a in bn_inputs(rng, (4, 3, 2, 2)))
    y, cache = cpu.batch_norm_forward(x, gamma, beta, rm, rv, True, momentum=0.1, eps=1e-5)
    dx, dgamma, dbeta = cpu.batch_norm_backward(y, cache)
    assert {a.dtype for a in (y, rm, rv, dx, dgamma, dbeta)} == {np.dtype(np.float32)}


# ------------------------------------------------------ batch norm: bad input
def _bad(rng):
    return bn_inputs(rng, (4, 3, 2, 2), np.float32)


@pytest.mark.parametrize("change,error,message", [
    (lambda a: a.update(gamma=a["gamma"][:2], beta=a["beta"][:2]), ValueError,
     "batch_norm_forward: gamma has 2 entries but x has 3 channels (x (4, 3, 2, 2), gamma (2,))"),
    (lambda a: a.update(running_var=None), TypeError,
     "batch_norm_forward: running_var is None but running_mean is not"),
    (lambda a: a.update(x=a["x"][0, 0, 0]), ValueError,
     "batch_norm_forward: x must have rank 2 (n, c), 3 (n, c, l) or 4 (n, c, h, w), got rank 1 (x (2,))"),
    (lambda a: a.update(x=a["x"][None]), ValueError, "got rank 5 (x (1, 4, 3, 2, 2))"),
    (lambda a: a.update(x=a["x"][:1, :, :1, :1]), ValueError,
     "batch_norm_forward: training needs more than 1 value per channel, got x (1, 3, 1, 1)"),
    (lambda a: a.update(momentum=1.5), ValueError, "batch_norm_forward: momentum must be in [0, 1], got 1.5"),
    (lambda a: a.update(eps=-1e-5), ValueError, "batch_norm_forward: eps must be >= 0"),
    (lambda a: a.update(training="yes"), TypeError, "batch_norm_forward: training must be a bool"),
    (lambda a: a.update(training=False, running_mean=None, running_var=None), ValueError,
     "batch_norm_forward: evaluation (training=False) needs running_mean and running_var"),
    (lambda a: a.update(gamma=a["gamma"].astype(np.float64)), TypeError,
     "batch_norm_forward: gamma has dtype float64 but x has dtype float32"),
])
def test_batch_norm_op_refuses_bad_input(change, error, message):
    x, gamma, beta, rm, rv = _bad(np.random.default_rng(5))
    args = dict(x=x, gamma=gamma, beta=beta, running_mean=rm, running_var=rv, training=True, momentum=0.1,
                eps=1e-5)
    change(args)
    with pytest.raises(error, match=re.escape(message)):
        cpu.batch_norm_forward(**args)


def test_batch_norm_backward_refuses_wrong_dy():
    x, gamma, beta, rm, rv = _bad(np.random.default_rng(6))
    _, cache = cpu.batch_norm_forward(x, gamma, beta, rm, rv, True)
    with pytest.raises(ValueError, match=re.escape("batch_norm_backward: dy has shape (4, 3, 2) but x has shape "
                                                   "(4, 3, 2, 2)")):
        cpu.batch_norm_backward(np.zeros((4, 3, 2), np.float32), cache)


@pytest.mark.parametrize("layer,x_shape,message", [
    (lambda: nn.BatchNorm2d(3), (2, 5, 4, 4), "BatchNorm2d(3): expected 3 channels (axis 1), got 5 "
                                              "(input shape (2, 5, 4, 4))"),
    (lambda: nn.BatchNorm2d(3), (2, 3, 4), "BatchNorm2d: expected a 4-D (N, C, H, W) input, got a 3-D input "
                                           "of shape (2, 3, 4)"),
    (lambda: nn.BatchNorm1d(3), (2, 3, 4, 4), "BatchNorm1d: expected a 2-D (N, C) or 3-D (N, C, L) input, "
                                              "got a 4-D input of shape (2, 3, 4, 4)"),
    (lambda: nn.BatchNorm1d(4), (2, 3), "BatchNorm1d(4): expected 4 channels (axis 1), got 3"),
    (lambda: nn.BatchNorm1d(4, affine=False, track_running_stats=False), (2, 3),
     "BatchNorm1d(4): expected 4 channels (axis 1), got 3"),
])
def test_batch_norm_layer_refuses_wrong_input_before_counting_it(layer, x_shape, message):
    bn = layer()
    with pytest.raises(ValueError, match=re.escape(message)):
        bn(np.zeros(x_shape, np.float32))
    if bn.track_running_stats:
        assert int(bn.num_batches_tracked) == 0


def test_batch_norm_layer_refuses_bad_arguments():
    with pytest.raises(ValueError, match="num_features must be an int >= 1"):
        nn.BatchNorm2d(0)
    with pytest.raises(ValueError, match=re.escape("BatchNorm1d: momentum must be in [0, 1] or None, got 2.0")):
        nn.BatchNorm1d(3, momentum=2)
    with pytest.raises(ValueError, match="BatchNorm2d: eps must be >= 0"):
        nn.BatchNorm2d(3, eps=-1)


def test_batch_norm_training_needs_two_values_per_channel():
    bn = nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(np.ones((1, 3), np.float32))
    assert int(bn.num_batches_tracked) == 0
    bn.eval()
    assert bn(np.ones((1, 3), np.float32)).shape == (1, 3)      # evaluation is fine with one sample


# ---------------------------------------------------- batch norm: the layers
def pytorch_rule(batches, momentum, eps=1e-5):
    """PyTorch's BatchNorm running statistics after training forwards on ``batches``, by hand."""
    c = batches[0].shape[1]
    rm, rv = np.zeros(c), np.ones(c)
    for t, x in enumerate(batches, start=1):
        f = 1.0 / t if momentum is None else momentum
        values = np.moveaxis(x.astype(np.float64), 1, 0).reshape(c, -1)
        rm = (1 - f) * rm + f * values.mean(axis=1)
        rv = (1 - f) * rv + f * values.var(axis=1, ddof=1)
    return rm, rv


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("layer,shape", [(nn.BatchNorm2d, (4, 3, 5, 5)), (nn.BatchNorm1d, (8, 3)),
                                         (nn.BatchNorm1d, (4, 3, 7))])
def test_running_statistics_follow_pytorchs_rule(layer, shape, momentum):
    rng = np.random.default_rng(7)
    bn = layer(3, momentum=momentum)
    batches = [(rng.standard_normal(shape) * (1 + i) + i).astype(np.float32) for i in range(4)]
    for x in batches:
        bn(x)
    rm, rv = pytorch_rule(batches, momentum)
    np.testing.assert_allclose(bn.running_mean, rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var, rv, rtol=1e-5, atol=1e-6)
    assert bn.num_batches_tracked.dtype == np.int64 and int(bn.num_batches_tracked) == 4


def test_eval_mode_uses_running_stats_and_changes_nothing():
    rng = np.random.default_rng(8)
    bn = nn.BatchNorm2d(3, eps=1e-3)
    bn.weight.data[...] = [1.0, 2.0, 0.5]
    bn.bias.data[...] = [0.0, -1.0, 3.0]
    for _ in range(3):
        bn(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 3 + 2)
    bn.eval()
    state = bn.state_dict()
    x = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    y = bn(x)
    expected = loop_batch_norm(x.astype(np.float64), state["weight"], state["bias"], state["running_mean"],
                               state["running_var"], 1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    for name, value in bn.state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    # In training mode the same input is normalised with its own statistics instead.
    bn.train()
    y_train = bn(x)
    np.testing.assert_allclose(y_train.mean(axis=(0, 2, 3)), state["bias"], atol=1e-5)
    assert not np.allclose(y_train, y, atol=1e-2)


def test_eval_mode_backward_treats_statistics_as_constants():
    rng = np.random.default_rng(9)
    bn = nn.BatchNorm2d(2).double()
    bn.running_mean[...] = [0.5, -1.0]
    bn.running_var[...] = [2.0, 0.25]
    bn.weight.data[...] = [1.5, -0.5]
    bn.eval()
    x = rng.standard_normal((3, 2, 2, 2))
    r = rng.standard_normal(x.shape)
    bn(x)
    dx = bn.backward(r)
    np.testing.assert_allclose(dx, numeric_grad(lambda: float(np.sum(r * bn(x))), x), rtol=1e-6, atol=1e-9)
    scale = bn.weight.data / np.sqrt(bn.running_var + bn.eps)
    np.testing.assert_allclose(dx, r * scale.reshape(1, 2, 1, 1), rtol=1e-12)


def test_without_running_stats_both_modes_use_the_batch():
    rng = np.random.default_rng(10)
    bn = nn.BatchNorm2d(3, track_running_stats=False)
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32) + 5
    y_train = bn(x)
    bn.eval()
    np.testing.assert_array_equal(bn(x), y_train)
    assert bn.running_mean is None and bn.num_batches_tracked is None
    assert list(bn.state_dict()) == ["weight", "bias"]


def test_batch_norm1d_on_sequences_is_batch_norm2d_on_columns():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 3, 6)).astype(np.float32)
    bn1, bn2 = nn.BatchNorm1d(3), nn.BatchNorm2d(3)
    np.testing.assert_array_equal(bn1(x), bn2(x[..., None])[..., 0])
    np.testing.assert_array_equal(bn1.running_var, bn2.running_var)


def test_layer_gradients_reach_weight_and_bias():
    rng = np.random.default_rng(12)
    bn = nn.BatchNorm1d(4).double()
    bn.weight.data[...] = rng.uniform(0.5, 2, 4)
    bn.bias.data[...] = rng.standard_normal(4)
    x = rng.standard_normal((6, 4))
    r = rng.standard_normal((6, 4))

    def loss():
        bn.running_mean[...], bn.running_var[...] = 0, 1
        return float(np.sum(r * bn(x)))

    loss()
    dx = bn.backward(r)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(bn.weight.grad, numeric_grad(loss, bn.weight.data), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(bn.bias.grad, numeric_grad(loss, bn.bias.data), rtol=1e-6, atol=1e-9)


# ------------------------------------------------- state_dict and buffers
def test_state_dict_names_order_and_dtypes_are_pytorchs():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, rng=0), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 8, rng=1), nn.BatchNorm1d(8, affine=False))
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                           "1.num_batches_tracked", "4.weight", "4.bias", "5.running_mean", "5.running_var",
                           "5.num_batches_tracked"]
    assert state["1.num_batches_tracked"].shape == () and state["1.num_batches_tracked"].dtype == np.int64
    assert state["1.running_var"].dtype == np.float32
    # Parameters are not buffers: optimizers never see the running statistics.
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias",
                                                              "4.weight", "4.bias"]
    assert [name for name, _ in model.named_buffers()] == ["1.running_mean", "1.running_var",
                                                           "1.num_batches_tracked", "5.running_mean",
                                                           "5.running_var", "5.num_batches_tracked"]


def test_state_dict_round_trip_after_training_predicts_the_same():
    rng = np.random.default_rng(13)

    def build():
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, rng=0), nn.BatchNorm2d(3, momentum=None),
                             nn.LeakyReLU(0.2), nn.GlobalAvgPool2d(), nn.Flatten(), nn.Linear(3, 2, rng=1))

    model, loss_fn = build(), nn.CrossEntropyLoss()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = rng.standard_normal((8, 2, 5, 5)).astype(np.float32)
        loss_fn(model(x), rng.integers(0, 2, 8))
        model.backward(loss_fn.backward())
        opt.step()
    state = model.state_dict()             # saved in training mode
    copy = build()
    assert copy.load_state_dict(state) == ([], [])
    assert int(copy[1].num_batches_tracked) == 3 and copy[1].num_batches_tracked.dtype == np.int64
    x = rng.standard_normal((5, 2, 5, 5)).astype(np.float32)
    model.eval(), copy.eval()
    np.testing.assert_array_equal(copy(x), model(x))


def test_load_state_dict_takes_a_pytorch_style_dict_and_checks_it():
    bn = nn.BatchNorm2d(2)
    torch_like = {"weight": np.array([2.0, 3.0]), "bias": np.array([0.5, 0.0]),
                  "running_mean": np.array([1.0, -1.0]), "running_var": np.array([4.0, 0.25]),
                  "num_batches_tracked": np.array(17, dtype=np.int64)}
    bn.load_state_dict(torch_like)
    assert bn.running_var.dtype == np.float32 and bn.num_batches_tracked.dtype == np.int64
    assert int(bn.num_batches_tracked) == 17
    np.testing.assert_array_equal(bn.running_mean, [1.0, -1.0])
    missing = dict(torch_like)
    del missing["running_var"]
    with pytest.raises(ValueError, match=re.escape("missing keys ['running_var']")):
        bn.load_state_dict(missing)
    wrong = dict(torch_like, running_mean=np.zeros(3))
    with pytest.raises(ValueError, match=re.escape("shape mismatch for key 'running_mean': expected (2,), got (3,)")):
        bn.load_state_dict(wrong)
    np.testing.assert_array_equal(bn.running_mean, [1.0, -1.0])      # nothing changed
    assert bn.load_state_dict({"weight": np.ones(2)}, strict=False).missing_keys == [
        "bias", "running_mean", "running_var", "num_batches_tracked"]


def test_reset_running_stats():
    rng = np.random.default_rng(17)
    bn = nn.BatchNorm2d(3)
    bn(rng.standard_normal((2, 3, 2, 2)).astype(np.float32) + 4)
    assert int(bn.num_batches_tracked) == 1 and bn.running_mean.max() > 0.1
    bn.reset_running_stats()
    np.testing.assert_array_equal(bn.running_mean, np.zeros(3, np.float32))
    np.testing.assert_array_equal(bn.running_var, np.ones(3, np.float32))
    assert int(bn.num_batches_tracked) == 0 and bn.num_batches_tracked.dtype == np.int64


def test_buffers_follow_double_and_float_but_counters_stay_int64():
    bn = nn.BatchNorm1d(3).double()
    assert bn.running_mean.dtype == np.float64 and bn.weight.dtype == np.float64
    assert bn.num_batches_tracked.dtype == np.int64
    bn.float()
    assert bn.running_var.dtype == np.float32


def test_register_buffer_rules():
    m = nn.Module()
    m.register_buffer("stat", np.zeros(2))
    m.stat = np.ones(2)                      # assignment keeps it a buffer
    assert list(m.state_dict()) == ["stat"] and m.state_dict()["stat"].tolist() == [1.0, 1.0]
    assert list(m.parameters()) == []
    m.weight = nn.Parameter(np.zeros(1))
    with pytest.raises(KeyError, match="already has an attribute 'weight'"):
        m.register_buffer("weight", np.zeros(1))
    with pytest.raises(ValueError, match="must be an identifier"):
        m.register_buffer("a.b", np.zeros(1))
    with pytest.raises(TypeError, match="expected an array or None"):
        m.register_buffer("bad", [1, 2])
    m.stat = nn.Parameter(np.zeros(2))       # a Parameter replaces the buffer
    assert [n for n, _ in m.named_buffers()] == [] and "stat" in dict(m.named_parameters())
    del m.stat
    assert "stat" not in m.state_dict()


def test_optimizer_steps_leave_running_statistics_alone():
    rng = np.random.default_rng(14)
    bn = nn.BatchNorm1d(3)
    bn(rng.standard_normal((4, 3)).astype(np.float32))
    bn.backward(rng.standard_normal((4, 3)).astype(np.float32))
    before = {k: v.copy() for k, v in bn.state_dict().items()}
    optim.SGD(bn.parameters(), lr=1.0).step()
    after = bn.state_dict()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        np.testing.assert_array_equal(after[name], before[name])
    assert not np.array_equal(after["weight"], before["weight"])


def test_repr_is_pytorchs():
    assert repr(nn.BatchNorm2d(8)) == "BatchNorm2d(8, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"
    assert repr(nn.BatchNorm1d(4, momentum=None, affine=False)) == \
        "BatchNorm1d(4, eps=1e-05, momentum=None, affine=False, track_running_stats=True)"
    assert repr(nn.LeakyReLU(0.2)) == "LeakyReLU(negative_slope=0.2)"
    assert repr(nn.AdaptiveAvgPool2d((1, 1))) == "AdaptiveAvgPool2d(output_size=(1, 1))"


# ------------------------------------------------------ global average pool
def test_global_avg_pool_forward_and_gradient():
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 3, 4, 5))
    y, cache = cpu.global_avg_pool_forward(x)
    assert y.shape == (2, 3, 1, 1)
    for n in range(2):
        for c in range(3):
            assert y[n, c, 0, 0] == pytest.approx(sum(x[n, c].ravel()) / 20, rel=1e-12)
    r = rng.standard_normal(y.shape)
    dx = cpu.global_avg_pool_backward(r, cache)
    np.testing.assert_allclose(dx, numeric_grad(lambda: float(np.sum(r * cpu.global_avg_pool_forward(x)[0])), x),
                               rtol=1e-6, atol=1e-10)


def test_global_avg_pool_layers_and_their_errors():
    x = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    for layer in (nn.AdaptiveAvgPool2d(1), nn.AdaptiveAvgPool2d((1, 1)), nn.GlobalAvgPool2d()):
        np.testing.assert_array_equal(layer(x), x.mean(axis=(2, 3), keepdims=True))
        np.testing.assert_array_equal(layer.backward(np.ones((2, 3, 1, 1), np.float32)), np.full(x.shape, 0.25))
    for bad in (2, (2, 2), (1, None), None, True, (1, 1, 1)):
        with pytest.raises(ValueError, match=re.escape(f"AdaptiveAvgPool2d: only output_size 1 or (1, 1) (global "
                                                       f"average pooling) is supported, got {bad!r}")):
            nn.AdaptiveAvgPool2d(bad)
    with pytest.raises(ValueError, match=re.escape("global_avg_pool_forward: x must have rank 4 (n, c, h, w), got "
                                                   "rank 3 (x (3, 2, 2))")):
        nn.GlobalAvgPool2d()(x[0])
    _, cache = cpu.global_avg_pool_forward(x)
    with pytest.raises(ValueError, match=re.escape("global_avg_pool_backward: dy has shape (2, 3) but the forward "
                                                   "output has shape (2, 3, 1, 1)")):
        cpu.global_avg_pool_backward(np.ones((2, 3), np.float32), cache)


# ------------------------------------------------------------- leaky relu
@pytest.mark.parametrize("slope", [0.01, 0.1, 0.0, -0.5, 2.0])
def test_leaky_relu_forward_and_gradient(slope):
    rng = np.random.default_rng(16)
    x = rng.standard_normal((3, 4, 5))
    x[np.abs(x) < 1e-3] = 0.5                   # keep away from the kink for the differences
    y, cache = cpu.leaky_relu_forward(x, slope)
    np.testing.assert_array_equal(y, np.array([v if v > 0 else slope * v for v in x.ravel()]).reshape(x.shape))
    r = rng.standard_normal(x.shape)
    dx = cpu.leaky_relu_backward(r, cache)
    np.testing.assert_allclose(dx, numeric_grad(lambda: float(np.sum(r * cpu.leaky_relu_forward(x, slope)[0])), x),
                               rtol=1e-7, atol=1e-9)


def test_leaky_relu_refuses_bad_slope():
    with pytest.raises(TypeError, match="leaky_relu_forward: negative_slope must be a real number"):
        cpu.leaky_relu_forward(np.ones(3), "0.1")
    with pytest.raises(ValueError, match="leaky_relu_forward: negative_slope must be finite"):
        cpu.leaky_relu_forward(np.ones(3), float("nan"))


# ------------------------------------------------------ against PyTorch (CPU)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("name,shape", [("BatchNorm2d", (8, 4, 5, 5)), ("BatchNorm1d", (16, 4)),
                                        ("BatchNorm1d", (8, 4, 6))])
def test_batch_norm_layers_match_pytorch(name, shape, momentum):
    """PyTorch's state_dict loads as it is; 3 training steps (forward, dx, dweight, dbias, running
    statistics, num_batches_tracked), then evaluation, all in float64 on the CPU."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(18)
    ref = getattr(torch.nn, name)(4, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, 4)))
        ref.bias.copy_(torch.from_numpy(rng.standard_normal(4)))
    ours = getattr(nn, name)(4, momentum=momentum).double()
    ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})

    def step(x, dy):
        xt = torch.from_numpy(x).requires_grad_(True)
        ref.weight.grad = ref.bias.grad = None
        yt = ref(xt)
        yt.backward(torch.from_numpy(dy))
        np.testing.assert_allclose(ours(x), yt.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ours.backward(dy), xt.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(ours.weight.grad, ref.weight.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(ours.bias.grad, ref.bias.grad.numpy(), rtol=1e-9, atol=1e-12)

    for i in range(3):
        step(rng.standard_normal(shape) * 2 + i, rng.standard_normal(shape))
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert list(ours_state) == list(ref_state)
    assert ours_state["num_batches_tracked"].dtype == np.int64
    for key, value in ref_state.items():
        np.testing.assert_allclose(ours_state[key], value.numpy(), rtol=1e-12, err_msg=key)
    ref.eval(), ours.eval()
    step(rng.standard_normal(shape), rng.standard_normal(shape))


def test_leaky_relu_and_adaptive_avg_pool_match_pytorch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(19)
    x, dy = rng.standard_normal((4, 3, 7, 5)), rng.standard_normal((4, 3, 7, 5))
    for layer, ref in ((nn.LeakyReLU(0.2), torch.nn.LeakyReLU(0.2)),
                       (nn.AdaptiveAvgPool2d(1), torch.nn.AdaptiveAvgPool2d(1))):
        xt = torch.from_numpy(x).requires_grad_(True)
        yt = ref(xt)
        g = dy[:, :, :1, :1] if isinstance(layer, nn.AdaptiveAvgPool2d) else dy
        yt.backward(torch.from_numpy(np.ascontiguousarray(g)))
        np.testing.assert_allclose(layer(x), yt.detach().numpy(), rtol=1e-12)
        np.testing.assert_allclose(layer.backward(np.ascontiguousarray(g)), xt.grad.numpy(), rtol=1e-12)
