"""Tests of cydnn.nn: layers against the ops they wrap, gradients, naming, state, init, modes."""
import contextlib
import ctypes
import sys
from collections import OrderedDict

import numpy as np
import pytest

from cydnn import nn, ops
from cydnn.models import LeNet5


# "cuda" runs only where tests/conftest.py finds a usable GPU; elsewhere it is
# skipped with the reason (every test marked gpu is).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

cpu = ops.backend("cpu")


def to_device(a, device):
    return ops.backend(device).asarray(a)


def host(a):
    return None if a is None else ops.backend_of(a).to_numpy(a)


def assert_close(actual, expected, device):
    """Exact on the CPU (the layer must call the very op); float32 tolerance on the GPU."""
    actual = host(actual)
    if device == "cpu":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ----------------------------------------------- layers equal the ops they wrap
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1)])
def test_conv2d_equals_ops(device, bias, stride, padding):
    rng = np.random.default_rng(0)
    layer = nn.Conv2d(3, 4, 3, stride=stride, padding=padding, bias=bias, rng=1)
    x, w = rand(rng, 2, 3, 9, 8), layer.weight.data.copy()
    b = layer.bias.data.copy() if bias else None
    y_ref, cache = cpu.conv_forward(x, w, b, stride=stride, padding=padding)
    dy = rand(rng, *y_ref.shape)
    dx_ref, dw_ref, db_ref = cpu.conv_backward(dy, cache)

    layer.to(device)
    y = layer(to_device(x, device))
    assert_close(y, y_ref, device)
    assert_close(layer.backward(to_device(dy, device)), dx_ref, device)
    assert_close(layer.weight.grad, dw_ref, device)
    if bias:
        assert_close(layer.bias.grad, db_ref, device)
    else:
        assert layer.bias is None and [n for n, _ in layer.named_parameters()] == ["weight"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_ops(device, bias):
    rng = np.random.default_rng(0)
    layer = nn.Linear(7, 5, bias=bias, rng=2)
    x, w = rand(rng, 4, 7), layer.weight.data.copy()
    b = layer.bias.data.copy() if bias else None
    y_ref, cache = cpu.linear_forward(x, w, b)
    dy = rand(rng, 4, 5)
    dx_ref, dw_ref, db_ref = cpu.linear_backward(dy, cache)

    layer.to(device)
    assert_close(layer(to_device(x, device)), y_ref, device)
    assert_close(layer.backward(to_device(dy, device)), dx_ref, device)
    assert_close(layer.weight.grad, dw_ref, device)
    if bias:
        assert_close(layer.bias.grad, db_ref, device)


PARAMETERLESS = [
    (lambda: nn.ReLU(), "relu", {}),
    (lambda: nn.Tanh(), "tanh", {}),
    (lambda: nn.Sigmoid(), "sigmoid", {}),
    (lambda: nn.MaxPool2d(2), "max_pool", {"kernel": 2, "stride": None, "padding": 0}),
    (lambda: nn.MaxPool2d(3, stride=2, padding=1), "max_pool", {"kernel": 3, "stride": 2, "padding": 1}),
    (lambda: nn.AvgPool2d(2), "avg_pool", {"kernel": 2, "stride": None, "padding": 0}),
    (lambda: nn.AvgPool2d(3, stride=1, padding=1), "avg_pool", {"kernel": 3, "stride": 1, "padding": 1}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make,op,kwargs", PARAMETERLESS,
                         ids=["relu", "tanh", "sigmoid", "maxpool2", "maxpool3s2p1", "avgpool2", "avgpool3s1p1"])
def test_parameterless_layer_equals_ops(device, make, op, kwargs):
    rng = np.random.default_rng(0)
    x = rand(rng, 2, 3, 8, 8)
    y_ref, cache = getattr(cpu, op + "_forward")(x, **kwargs)
    dy = rand(rng, *y_ref.shape)
    dx_ref = getattr(cpu, op + "_backward")(dy, cache)

    layer = make().to(device)
    assert list(layer.parameters()) == []
    assert_close(layer(to_device(x, device)), y_ref, device)
    assert_close(layer.backward(to_device(dy, device)), dx_ref, device)


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_forward_and_backward_shapes(device):
    rng = np.random.default_rng(0)
    x = rand(rng, 3, 4, 5, 2)
    layer = nn.Flatten().to(device)
    y = layer(to_device(x, device))
    assert tuple(y.shape) == (3, 40)
    assert_close(y, cpu.flatten(x), device)
    dy = rand(rng, 3, 40)
    dx = layer.backward(to_device(dy, device))
    assert tuple(dx.shape) == x.shape
    assert_close(dx, dy.reshape(x.shape), device)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_loss_equals_op(device):
    rng = np.random.default_rng(0)
    logits = rand(rng, 6, 10)
    labels = rng.integers(0, 10, 6)            # int64: the loss converts to int32
    loss_ref, dlogits_ref = cpu.softmax_cross_entropy(logits, labels.astype(np.int32))
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(to_device(logits, device), labels)
    assert host(loss).shape == ()
    assert_close(loss, loss_ref, device)
    assert_close(loss_fn.backward(), dlogits_ref, device)


# ----------------------------------------------------------------- dropout
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_train_mode_masks_and_scales(device):
    p = 0.25
    x = np.random.default_rng(0).uniform(1.0, 2.0, (64, 128)).astype(np.float32)  # never 0
    layer = nn.Dropout(p, rng=5).to(device)
    assert layer.training
    y = host(layer(to_device(x, device)))
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-6)
    assert abs(kept.mean() - (1 - p)) < 0.02                  # 8192 draws: sd ~ 0.005
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    dx = host(layer.backward(to_device(dy, device)))
    np.testing.assert_allclose(dx[kept], dy[kept] / (1 - p), rtol=1e-6)
    assert np.all(dx[~kept] == 0)

    # A new mask each call, and the same sequence of masks for the same seed.
    y2 = host(layer(to_device(x, device)))
    assert not np.array_equal(y2 != 0, kept)
    again = nn.Dropout(p, rng=5).to(device)
    np.testing.assert_array_equal(host(again(to_device(x, device))), y)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_eval_mode_is_identity(device):
    x = to_device(np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32), device)
    layer = nn.Dropout(0.5, rng=0).to(device).eval()
    assert layer(x) is x
    dy = to_device(np.ones((4, 9), np.float32), device)
    assert layer.backward(dy) is dy


def test_dropout_rejects_bad_probability():
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="dropout probability"):
            nn.Dropout(p)


def test_train_eval_propagate_to_every_submodule():
    model = nn.Sequential(nn.Linear(2, 2, rng=0), nn.Sequential(nn.Dropout(), nn.ReLU()))
    assert model.eval() is model
    assert [m.training for m in model.modules()] == [False] * 5
    assert model.train() is model
    assert [m.training for m in model.modules()] == [True] * 5


# --------------------------------------------------------- gradient checks
def _loss_value(model, x, labels):
    loss_fn = nn.CrossEntropyLoss()
    return float(loss_fn(model(x), labels))


def _gradient_check(model, x, labels, seed=0, eps=1e-6, rtol=1e-6):
    """Each parameter's gradient (and the input's) against central differences.

    Along a random direction d: (L(theta + eps d) - L(theta - eps d)) / (2 eps)
    must equal <grad, d>.  In float64 the difference quotient is good to ~1e-9.
    """
    rng = np.random.default_rng(seed)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), labels)
    dx = model.backward(loss_fn.backward())
    grads = {name: p.grad.copy() for name, p in model.named_parameters()}

    checks = [(name, p.data, grads[name]) for name, p in model.named_parameters()] + [("input", x, dx)]
    for name, array, grad in checks:
        assert grad.shape == array.shape and grad.dtype == np.float64, name
        d = rng.standard_normal(array.shape)
        original = array.copy()
        array += eps * d
        up = _loss_value(model, x, labels)
        array[...] = original - eps * d
        down = _loss_value(model, x, labels)
        array[...] = original
        numeric = (up - down) / (2 * eps)
        analytic = float(np.sum(grad * d))
        assert abs(numeric - analytic) <= rtol * max(1.0, abs(numeric)), (name, numeric, analytic)


@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_lenet5_gradient_check_float64(classic):
    model = LeNet5(classic=classic, seed=3).double()
    side = 32 if classic else 28
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 1, side, side))
    labels = np.array([1, 7, 3], dtype=np.int32)
    _gradient_check(model, x, labels)


def test_gradient_check_every_layer_kind_float64():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, rng=0), nn.Sigmoid(),
        nn.AvgPool2d(3, stride=1, padding=1), nn.Conv2d(3, 4, (2, 3), bias=False, rng=1), nn.Tanh(),
        nn.MaxPool2d(2, padding=1), nn.Flatten(),
        nn.Linear(4 * 3 * 2, 6, rng=2), nn.ReLU(), nn.Dropout(0.5, rng=3), nn.Linear(6, 5, bias=False, rng=4),
    ).double().eval()                  # eval: Dropout is the identity, so the loss is deterministic
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 2, 9, 7))
    _gradient_check(model, x, np.array([0, 4, 2, 2], dtype=np.int32))


def test_backward_sets_rather_than_accumulates_gradients():
    rng = np.random.default_rng(0)
    layer = nn.Linear(3, 2, rng=0)
    x1, x2, dy = rand(rng, 4, 3), rand(rng, 4, 3), rand(rng, 4, 2)
    layer(x1)
    layer.backward(dy)
    layer(x2)
    layer.backward(dy)
    np.testing.assert_allclose(layer.weight.grad, dy.T @ x2, rtol=1e-5)


def test_backward_before_forward_is_a_clear_error():
    for layer in (nn.Linear(2, 2, rng=0), nn.Conv2d(1, 1, 1, rng=0), nn.ReLU(), nn.Flatten(),
                  nn.MaxPool2d(2)):
        with pytest.raises(RuntimeError, match="before forward"):
            layer.backward(np.zeros((1, 2), np.float32))
    with pytest.raises(RuntimeError, match="before forward"):
        nn.CrossEntropyLoss().backward()


# -------------------------------------------------------- naming and state
MODERN_SHAPES = OrderedDict([
    ("conv1.weight", (6, 1, 5, 5)), ("conv1.bias", (6,)),
    ("conv2.weight", (16, 6, 5, 5)), ("conv2.bias", (16,)),
    ("fc1.weight", (120, 256)), ("fc1.bias", (120,)),
    ("fc2.weight", (84, 120)), ("fc2.bias", (84,)),
    ("fc3.weight", (10, 84)), ("fc3.bias", (10,)),
])


@pytest.mark.parametrize("classic", [False, True], ids=["modern", "classic"])
def test_lenet5_state_dict_names_and_shapes(classic):
    expected = OrderedDict(MODERN_SHAPES)
    if classic:
        expected["fc1.weight"] = (120, 400)
    sd = LeNet5(classic=classic).state_dict()
    assert list(sd) == list(expected)
    assert {k: v.shape for k, v in sd.items()} == dict(expected)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in sd.values())
    assert [n for n, _ in LeNet5(classic=classic).named_parameters()] == list(expected)


def test_sequential_names_children_by_position_and_nests():
    model = nn.Sequential(nn.Linear(2, 3, rng=0), nn.ReLU(),
                          nn.Sequential(nn.Linear(3, 3, rng=1), nn.Tanh(), nn.Linear(3, 1, bias=False, rng=2)))
    assert [n for n, _ in model.named_parameters()] == [
        "0.weight", "0.bias", "2.0.weight", "2.0.bias", "2.2.weight"]
    assert len(model) == 3 and isinstance(model[1], nn.ReLU) and model[2][2] is model[2]._modules["2"]
    named = nn.Sequential(OrderedDict([("enc", nn.Linear(2, 2, rng=0)), ("act", nn.ReLU())]))
    assert [n for n, _ in named.named_parameters()] == ["enc.weight", "enc.bias"]
    assert isinstance(named.enc, nn.Linear)
    with pytest.raises(TypeError, match="not a Module"):
        nn.Sequential(nn.ReLU(), "relu")


def test_sequential_forward_backward_run_children_in_order_and_reverse():
    rng = np.random.default_rng(0)
    a, b = nn.Linear(3, 4, rng=0), nn.Linear(4, 2, rng=1)
    model = nn.Sequential(a, nn.Tanh(), b)
    x, dy = rand(rng, 5, 3), rand(rng, 5, 2)
    h, c1 = cpu.linear_forward(x, a.weight.data, a.bias.data)
    t, c2 = cpu.tanh_forward(h)
    y, c3 = cpu.linear_forward(t, b.weight.data, b.bias.data)
    np.testing.assert_array_equal(model(x), y)
    dt, dwb, dbb = cpu.linear_backward(dy, c3)
    dx, dwa, dba = cpu.linear_backward(cpu.tanh_backward(dt, c2), c1)
    np.testing.assert_array_equal(model.backward(dy), dx)
    for got, want in ((a.weight.grad, dwa), (a.bias.grad, dba), (b.weight.grad, dwb), (b.bias.grad, dbb)):
        np.testing.assert_array_equal(got, want)


def test_attribute_registration_and_replacement():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(2, 2, rng=0)
            self.scale = nn.Parameter(np.ones(3, np.float32))
            self.note = "not registered"

    net = Net()
    # As PyTorch: a module's own parameters first, then its children's.
    assert [n for n, _ in net.named_parameters()] == ["scale", "first.weight", "first.bias"]
    net.first = None                       # replacing a module by a plain value unregisters it
    assert net.first is None and [n for n, _ in net.named_parameters()] == ["scale"]
    del net.scale
    assert list(net.parameters()) == []

    class Forgot(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(1, 1)

    with pytest.raises(AttributeError, match="__init__"):
        Forgot()


def test_a_replaced_parameter_or_module_keeps_its_place():
    """As PyTorch's: ``layer.weight = Parameter(...)`` leaves ``weight`` where it was in parameters() and
    state_dict(), so an optimizer's list, updated at the same index, still lines up with the model's."""
    model = nn.Sequential(nn.Linear(3, 4, rng=0), nn.ReLU(), nn.Linear(4, 2, rng=1))
    names = [n for n, _ in model.named_parameters()]
    new = nn.Parameter(np.zeros((4, 3), np.float32))
    model[0].weight = new
    assert [n for n, _ in model.named_parameters()] == names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(model.parameters())[0] is new and list(model.state_dict()) == names
    model[1] = nn.Tanh()                   # a module for a module: the same place among the children
    assert [type(m).__name__ for m in model] == ["Linear", "Tanh", "Linear"]
    model[0].weight = None                 # a parameter for a plain value: unregistered
    assert [n for n, _ in model.named_parameters()] == ["0.bias", "2.weight", "2.bias"]


def test_shared_parameter_is_listed_once():
    a = nn.Linear(2, 2, rng=0)
    b = nn.Linear(2, 2, rng=1)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.bias"]


def test_state_dict_is_a_copy():
    model = LeNet5(seed=0)
    sd = model.state_dict()
    sd["fc3.bias"][:] = 123.0
    assert not np.any(model.fc3.bias.data == 123.0)


def test_load_state_dict_round_trip_copies_and_converts():
    source, target = LeNet5(seed=1), LeNet5(seed=2)
    sd = OrderedDict((k, v.astype(np.float64)) for k, v in source.state_dict().items())
    assert target.load_state_dict(sd) == ([], [])
    for (name, got), want in zip(target.state_dict().items(), source.state_dict().values()):
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, want)
    sd["conv1.weight"][:] = 0                  # the model does not alias the caller's arrays
    assert np.any(target.conv1.weight.data != 0)


def test_load_state_dict_reports_missing_and_unexpected_keys():
    model = LeNet5(seed=0)
    before = model.state_dict()
    sd = LeNet5(seed=1).state_dict()
    del sd["fc2.bias"]
    sd["fc4.weight"] = np.zeros((1, 1), np.float32)
    with pytest.raises(ValueError) as err:
        model.load_state_dict(sd)
    assert "fc2.bias" in str(err.value) and "fc4.weight" in str(err.value)
    for name, value in model.state_dict().items():       # nothing was loaded
        np.testing.assert_array_equal(value, before[name])

    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert (missing, unexpected) == (["fc2.bias"], ["fc4.weight"])
    np.testing.assert_array_equal(model.fc2.bias.data, before["fc2.bias"])
    np.testing.assert_array_equal(model.conv1.weight.data, sd["conv1.weight"])


def test_load_state_dict_shape_mismatch_names_key_and_shapes():
    model = LeNet5(seed=0)
    sd = LeNet5(classic=True).state_dict()              # fc1.weight is (120, 400) there
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"fc1\.weight.*\(120, 256\).*\(120, 400\)"):
            model.load_state_dict(sd, strict=strict)


# ----------------------------------------------------------- initialisation
@pytest.mark.parametrize("make,fan_in", [
    (lambda rng: nn.Linear(256, 120, rng=rng), 256),
    (lambda rng: nn.Conv2d(6, 16, 5, rng=rng), 150),
    (lambda rng: nn.Conv2d(3, 8, (3, 2), rng=rng), 18),
], ids=["linear", "conv", "conv-rect"])
def test_init_matches_pytorch_default_bounds(make, fan_in):
    layer = make(0)
    bound = 1 / np.sqrt(fan_in)
    for p in (layer.weight, layer.bias):
        assert p.data.dtype == np.float32 and isinstance(p.data, np.ndarray)
        assert np.abs(p.data).max() <= bound
    w = layer.weight.data.astype(np.float64).ravel()
    n = w.size
    # U(-b, b): mean 0, variance b^2/3; the sample extremes come within a few b/n of +-b.
    assert abs(w.mean()) < 4 * bound / np.sqrt(3 * n)
    assert abs(w.var() / (bound**2 / 3) - 1) < 4 * np.sqrt(0.8 / n) + 0.01
    assert w.max() > bound * (1 - 20 / n) and w.min() < -bound * (1 - 20 / n)


def test_init_is_reproducible_from_seed():
    a, b, c = LeNet5(seed=7), LeNet5(seed=7), LeNet5(seed=8)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z), name
    np.testing.assert_array_equal(nn.Conv2d(1, 2, 3, rng=4).weight.data, nn.Conv2d(1, 2, 3, rng=4).weight.data)
    gen = np.random.default_rng(0)
    first, second = nn.Linear(4, 4, rng=gen), nn.Linear(4, 4, rng=gen)   # one generator: new draws
    assert not np.array_equal(first.weight.data, second.weight.data)


# ----------------------------------------------------- devices and dtypes
def test_double_and_float_convert_parameters():
    model = nn.Sequential(nn.Linear(3, 2, rng=0))
    w = model[0].weight
    assert model.dtype == np.float32
    assert model.double() is model and model.dtype == np.float64 and w.data.dtype == np.float64
    assert model.float().dtype == np.float32
    assert model[0].weight is w                          # the same Parameter object


def test_to_rejects_unknown_device():
    with pytest.raises(ValueError, match="unknown device"):
        nn.Linear(1, 1).to("tpu")


def test_zero_grad_forgets_gradients():
    layer = nn.Linear(2, 2, rng=0)
    layer(np.ones((1, 2), np.float32))
    layer.backward(np.ones((1, 2), np.float32))
    assert layer.weight.grad is not None
    layer.zero_grad()
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_to_moves_parameters_and_keeps_objects(device):
    model = LeNet5(seed=0)
    before = model.state_dict()
    params = list(model.parameters())
    assert model.to(device) is model
    assert model.device == device and all(m.device == device for m in model.modules())
    assert list(model.parameters()) == params
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    model.to("cpu")
    assert all(isinstance(p.data, np.ndarray) for p in model.parameters())


@pytest.mark.gpu
def test_cuda_device_mismatch_and_float64_refused():
    model = nn.Linear(3, 2, rng=0).to("cuda")
    with pytest.raises(ValueError, match="on 'cuda' but its input is on 'cpu'"):
        model(np.ones((1, 3), np.float32))
    with pytest.raises(RuntimeError, match="cpu only"):
        model.double()


# Where tp_flags lies in a PyTypeObject (the same from Python 3.10 to 3.13; checked before use).
_TP_FLAGS_OFFSET = 21 * ctypes.sizeof(ctypes.c_void_p)
_IMMUTABLETYPE = 1 << 8


@contextlib.contextmanager
def _watch_host_reads(device_array, reads):
    """While inside, every copy of a DeviceArray to the host appends the Python function that
    asked for it to ``reads``.  Every such copy goes through ``DeviceArray.numpy`` -- ``item``,
    ``__float__``, ``__int__``, ``__array__`` (``np.asarray``, ``np.array``) all call it -- so that
    one method is wrapped.  DeviceArray is an immutable extension type: its immutable flag is
    lifted (through ctypes) for the two assignments and put back.  Works on any Python >= 3.10."""
    flags = ctypes.c_ulong.from_address(id(device_array) + _TP_FLAGS_OFFSET)
    assert flags.value == device_array.__flags__ and flags.value & _IMMUTABLETYPE, "unexpected type layout"
    original = device_array.__dict__["numpy"]

    def numpy(self):
        caller = sys._getframe(1)
        reads.append(f"{caller.f_code.co_name} ({caller.f_code.co_filename}:{caller.f_lineno}) reads "
                     f"{self.shape} to the host")
        return original(self)

    def assign(value):
        flags.value &= ~_IMMUTABLETYPE
        try:
            setattr(device_array, "numpy", value)
        finally:
            flags.value |= _IMMUTABLETYPE
    assign(numpy)
    try:
        yield
    finally:
        assign(original)


def test_the_host_read_watch_puts_the_type_back():
    from cydnn import _C
    before, reads = _C.DeviceArray.__dict__["numpy"], []
    with _watch_host_reads(_C.DeviceArray, reads):
        assert _C.DeviceArray.__dict__["numpy"] is not before
    assert _C.DeviceArray.__dict__["numpy"] is before and reads == []
    with pytest.raises(TypeError, match="immutable type"):
        _C.DeviceArray.numpy = before


def _device_reads(fn):
    """Run ``fn()`` and list the copies of a DeviceArray to the host it made (each waits for the GPU)."""
    reads = []
    with _watch_host_reads(type(ops.backend("cuda").zeros((1,))), reads):
        fn()
    return reads


@pytest.mark.gpu
def test_cuda_training_step_never_reads_device_memory():
    """forward, backward and an optimizer step on cuda must not wait for the GPU."""
    from cydnn import optim
    cuda = ops.backend("cuda")
    model = nn.Sequential(OrderedDict([("net", LeNet5(seed=0)), ("drop", nn.Dropout(0.1, rng=0))]))
    model.to("cuda")
    opt = optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    x = cuda.asarray(np.random.default_rng(0).standard_normal((8, 1, 28, 28)).astype(np.float32))
    y = cuda.asarray(np.arange(8, dtype=np.int32))

    def train_steps():
        for _ in range(2):
            loss_fn(model(x), y)
            model.backward(loss_fn.backward())
            opt.step()

    train_steps()                                   # warm-up: lazily created state, cached plans
    assert _device_reads(train_steps) == []
    # The watch does see each way of reading: numpy(), to_numpy, np.asarray, float, item.
    assert len(_device_reads(lambda: cuda.to_numpy(x))) == 1
    assert len(_device_reads(lambda: np.asarray(x))) == 1
    one = cuda.asarray(np.ones((1,), np.float32))
    assert len(_device_reads(lambda: (float(one), one.item(), one.numpy()))) == 3
