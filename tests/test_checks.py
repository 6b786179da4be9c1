"""Tests of the shared argument validation (cydnn.ops._check), through the cpu
ops and directly: each bad input raises the right exception type with a
message naming the op, the argument and the shapes."""
import re

import numpy as np
import pytest

from cydnn.ops import _check, cpu

F32 = (np.float32,)  # what the GPU module allows
FLOATS = (np.float32, np.float64)


def f32(*shape):
    return np.zeros(shape, dtype=np.float32)


class FakeDeviceArray:
    """Only .shape, .ndim and .dtype, like the GPU DeviceArray: the checks must need nothing else."""

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.ndim, self.dtype = tuple(shape), len(shape), np.dtype(dtype)


def raises(exc, call, *fragments):
    """Assert ``call()`` raises ``exc`` whose message contains every fragment; return the message."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ------------------------------------------------------ the brief's examples


def test_example_messages_exactly():
    assert raises(ValueError, lambda: cpu.conv_forward(f32(2, 1, 28, 28), f32(6, 3, 5, 5), None)) == (
        "conv_forward: w has 3 input channels but x has 1 (x (2, 1, 28, 28), w (6, 3, 5, 5))")
    assert raises(ValueError, lambda: cpu.max_pool_forward(f32(1, 1, 4, 4), 5)) == (
        "max_pool_forward: kernel (5, 5) is larger than the padded input (4, 4) (x (1, 1, 4, 4), padding (0, 0))")
    assert raises(ValueError, lambda: cpu.softmax_cross_entropy(f32(8, 10), np.zeros(7, dtype=np.int64))) == (
        "softmax_cross_entropy: labels has 7 entries but logits has 8 rows (logits (8, 10), labels (7,))")


# -------------------------------------------------------- one case per error

CASES = [
    # (id, call, exception, fragments)
    ("conv channel mismatch", lambda: cpu.conv_forward(f32(2, 3, 8, 8), f32(4, 2, 3, 3), None),
     ValueError, ["conv_forward", "w", "(2, 3, 8, 8)", "(4, 2, 3, 3)"]),
    ("conv bias length", lambda: cpu.conv_forward(f32(2, 3, 8, 8), f32(4, 3, 3, 3), f32(5)),
     ValueError, ["conv_forward", "b", "(4, 3, 3, 3)", "(5,)"]),
    ("conv kernel > padded input", lambda: cpu.conv_forward(f32(1, 1, 4, 6), f32(2, 1, 7, 3), None, padding=1),
     ValueError, ["conv_forward", "kernel (7, 3)", "padded input (6, 8)", "(1, 1, 4, 6)", "padding (1, 1)"]),
    ("conv x rank 3", lambda: cpu.conv_forward(f32(1, 28, 28), f32(6, 1, 5, 5), None),
     ValueError, ["conv_forward", "x", "rank 4", "(1, 28, 28)"]),
    ("conv w rank 2", lambda: cpu.conv_forward(f32(1, 1, 28, 28), f32(6, 25), None),
     ValueError, ["conv_forward", "w", "rank 4", "(6, 25)"]),
    ("conv int32 x", lambda: cpu.conv_forward(np.zeros((1, 1, 5, 5), np.int32), f32(1, 1, 3, 3), None),
     TypeError, ["conv_forward", "x", "int32", "float32, float64", "(1, 1, 5, 5)"]),
    ("conv mixed dtypes", lambda: cpu.conv_forward(f32(1, 1, 5, 5), np.zeros((1, 1, 3, 3)), None),
     TypeError, ["conv_forward", "w", "float64", "float32", "(1, 1, 5, 5)", "(1, 1, 3, 3)"]),
    ("conv stride 0", lambda: cpu.conv_forward(f32(1, 1, 5, 5), f32(1, 1, 3, 3), None, stride=0),
     ValueError, ["conv_forward", "stride", ">= 1"]),
    ("conv negative padding", lambda: cpu.conv_forward(f32(1, 1, 5, 5), f32(1, 1, 3, 3), None, padding=(1, -1)),
     ValueError, ["conv_forward", "padding", "(1, -1)"]),
    ("conv float stride", lambda: cpu.conv_forward(f32(1, 1, 5, 5), f32(1, 1, 3, 3), None, stride=1.5),
     TypeError, ["conv_forward", "stride", "float"]),
    ("conv stride of 3", lambda: cpu.conv_forward(f32(1, 1, 5, 5), f32(1, 1, 3, 3), None, stride=(1, 1, 1)),
     ValueError, ["conv_forward", "stride", "(1, 1, 1)"]),
    ("conv empty batch", lambda: cpu.conv_forward(f32(0, 1, 5, 5), f32(1, 1, 3, 3), None),
     ValueError, ["conv_forward", "x", "empty", "(0, 1, 5, 5)"]),
    ("max pool padding > kernel/2", lambda: cpu.max_pool_forward(f32(1, 1, 8, 8), 3, 1, 2),
     ValueError, ["max_pool_forward", "padding (2, 2)", "kernel (3, 3)", "(1, 1, 8, 8)"]),
    ("avg pool kernel > padded input", lambda: cpu.avg_pool_forward(f32(2, 3, 3, 9), (4, 2), padding=(0, 1)),
     ValueError, ["avg_pool_forward", "kernel (4, 2)", "padded input (3, 11)", "(2, 3, 3, 9)"]),
    ("avg pool rank 2", lambda: cpu.avg_pool_forward(f32(4, 4)),
     ValueError, ["avg_pool_forward", "x", "rank 4", "(4, 4)"]),
    ("max pool float16", lambda: cpu.max_pool_forward(np.zeros((1, 1, 4, 4), np.float16)),
     TypeError, ["max_pool_forward", "x", "float16", "(1, 1, 4, 4)"]),
    ("max pool kernel 0", lambda: cpu.max_pool_forward(f32(1, 1, 4, 4), 0),
     ValueError, ["max_pool_forward", "kernel", ">= 1"]),
    ("linear feature mismatch", lambda: cpu.linear_forward(f32(64, 84), f32(10, 100), None),
     ValueError, ["linear_forward", "w", "100", "84", "(64, 84)", "(10, 100)"]),
    ("linear bias length", lambda: cpu.linear_forward(f32(4, 3), f32(2, 3), f32(3)),
     ValueError, ["linear_forward", "b", "(2, 3)", "(3,)"]),
    ("linear x rank 4", lambda: cpu.linear_forward(f32(2, 1, 2, 2), f32(3, 4), None),
     ValueError, ["linear_forward", "x", "rank 2", "(2, 1, 2, 2)"]),
    ("linear float16", lambda: cpu.linear_forward(np.zeros((2, 3), np.float16), f32(4, 3), None),
     TypeError, ["linear_forward", "x", "float16", "(2, 3)"]),
    ("relu int32", lambda: cpu.relu_forward(np.zeros(3, np.int32)),
     TypeError, ["relu_forward", "x", "int32", "(3,)"]),
    ("relu list", lambda: cpu.relu_forward([1.0, -2.0]),
     TypeError, ["relu_forward", "x", "list", "float32, float64"]),
    ("tanh backward shape", lambda: cpu.tanh_backward(f32(2, 3), cpu.tanh_forward(f32(3, 2))[1]),
     ValueError, ["tanh_backward", "dy", "(2, 3)", "(3, 2)"]),
    ("sigmoid backward dtype", lambda: cpu.sigmoid_backward(np.zeros((2, 3)), cpu.sigmoid_forward(f32(2, 3))[1]),
     TypeError, ["sigmoid_backward", "dy", "float64", "float32"]),
    ("conv backward shape", lambda: cpu.conv_backward(f32(1, 2, 4, 4), cpu.conv_forward(f32(1, 1, 5, 5), f32(2, 1, 3, 3), None)[1]),
     ValueError, ["conv_backward", "dy", "(1, 2, 4, 4)", "(1, 2, 3, 3)"]),
    ("max pool backward shape", lambda: cpu.max_pool_backward(f32(1, 1, 3, 3), cpu.max_pool_forward(f32(1, 1, 4, 4))[1]),
     ValueError, ["max_pool_backward", "dy", "(1, 1, 3, 3)", "(1, 1, 2, 2)"]),
    ("linear backward list", lambda: cpu.linear_backward([[0.0]], cpu.linear_forward(f32(1, 1), f32(1, 1), None)[1]),
     TypeError, ["linear_backward", "dy", "list"]),
    ("softmax rank 1", lambda: cpu.softmax(f32(10)),
     ValueError, ["softmax", "x", "rank 2", "(10,)"]),
    ("log_softmax int", lambda: cpu.log_softmax(np.zeros((2, 3), np.int64)),
     TypeError, ["log_softmax", "x", "int64", "(2, 3)"]),
    ("labels too short", lambda: cpu.softmax_cross_entropy(f32(8, 10), np.zeros(7, np.int32)),
     ValueError, ["softmax_cross_entropy", "labels", "(8, 10)", "(7,)"]),
    ("labels rank 2", lambda: cpu.softmax_cross_entropy(f32(8, 10), np.zeros((8, 1), np.int32)),
     ValueError, ["softmax_cross_entropy", "labels", "rank 1", "(8, 1)"]),
    ("labels float", lambda: cpu.softmax_cross_entropy(f32(8, 10), np.zeros(8, np.float32)),
     TypeError, ["softmax_cross_entropy", "labels", "integer", "float32", "(8,)"]),
    ("labels out of range", lambda: cpu.softmax_cross_entropy(f32(4, 10), np.array([1, 2, 10, 11])),
     ValueError, ["softmax_cross_entropy", "labels[2] = 10", "[0, 10)", "(4, 10)", "(4,)"]),
    ("negative label", lambda: cpu.softmax_cross_entropy(f32(3, 5), np.array([-1, 2, 3])),
     ValueError, ["softmax_cross_entropy", "labels[0] = -1", "[0, 5)"]),
    ("logits list", lambda: cpu.softmax_cross_entropy([[0.0, 1.0]], np.array([0])),
     TypeError, ["softmax_cross_entropy", "logits", "list"]),
    ("dropout p = 1", lambda: cpu.dropout_forward(f32(4), 1.0),
     ValueError, ["dropout_forward", "p", "[0, 1)", "(4,)"]),
    ("dropout p < 0", lambda: cpu.dropout_forward(f32(4), -0.1),
     ValueError, ["dropout_forward", "p", "-0.1"]),
    ("dropout p nan", lambda: cpu.dropout_forward(f32(4), float("nan")),
     ValueError, ["dropout_forward", "p"]),
    ("dropout p string", lambda: cpu.dropout_forward(f32(4), "0.5"),
     TypeError, ["dropout_forward", "p", "str"]),
    ("dropout negative seed", lambda: cpu.dropout_forward(f32(4), 0.5, seed=-1),
     ValueError, ["dropout_forward", "seed", "-1"]),
    ("dropout seed 2**64", lambda: cpu.dropout_forward(f32(4), 0.5, seed=2**64),
     ValueError, ["dropout_forward", "seed"]),
    ("flatten rank 1", lambda: cpu.flatten(f32(5)),
     ValueError, ["flatten", "x", "rank", "(5,)"]),
    ("sgd grad shape", lambda: cpu.sgd_update(f32(4, 3), f32(3, 4), None, 0.1),
     ValueError, ["sgd_update", "grad", "(3, 4)", "(4, 3)"]),
    ("sgd grad dtype", lambda: cpu.sgd_update(f32(3), np.zeros(3), None, 0.1),
     TypeError, ["sgd_update", "grad", "float64", "float32"]),
    ("sgd missing buffer", lambda: cpu.sgd_update(f32(3), f32(3), None, 0.1, momentum=0.9),
     TypeError, ["sgd_update", "momentum_buf", "None", "0.9", "(3,)"]),
    ("sgd buffer shape", lambda: cpu.sgd_update(f32(3), f32(3), f32(4), 0.1, momentum=0.9),
     ValueError, ["sgd_update", "momentum_buf", "(4,)", "(3,)"]),
    ("sgd negative lr", lambda: cpu.sgd_update(f32(3), f32(3), None, -0.1),
     ValueError, ["sgd_update", "lr"]),
    ("sgd nesterov without momentum", lambda: cpu.sgd_update(f32(3), f32(3), None, 0.1, nesterov=True),
     ValueError, ["sgd_update", "nesterov"]),
    ("sgd param list", lambda: cpu.sgd_update([1.0], f32(1), None, 0.1),
     TypeError, ["sgd_update", "param", "list"]),
    ("adam m shape", lambda: cpu.adam_update(f32(3), f32(3), f32(2), f32(3), 1),
     ValueError, ["adam_update", "m", "(2,)", "(3,)"]),
    ("adam step 0", lambda: cpu.adam_update(f32(3), f32(3), f32(3), f32(3), 0),
     ValueError, ["adam_update", "step"]),
    ("adam beta1 = 1", lambda: cpu.adam_update(f32(3), f32(3), f32(3), f32(3), 1, beta1=1.0),
     ValueError, ["adam_update", "beta1", "[0, 1)"]),
    ("adam int param", lambda: cpu.adam_update(np.zeros(3, np.int32), f32(3), f32(3), f32(3), 1),
     TypeError, ["adam_update", "param", "int32", "(3,)"]),
    ("gather float images", lambda: cpu.gather_batch(f32(4, 3, 3), None, np.arange(2), 0.0, 1.0),
     TypeError, ["gather_batch", "images", "float32", "uint8", "(4, 3, 3)"]),
    ("gather images rank 4", lambda: cpu.gather_batch(np.zeros((4, 1, 3, 3), np.uint8), None, np.arange(2), 0.0, 1.0),
     ValueError, ["gather_batch", "images", "rank 3", "(4, 1, 3, 3)"]),
    ("gather labels length", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), np.zeros(5, np.int64),
                                                      np.arange(2), 0.0, 1.0),
     ValueError, ["gather_batch", "labels", "(4, 3, 3)", "(5,)"]),
    ("gather float indices", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, np.zeros(2), 0.0, 1.0),
     TypeError, ["gather_batch", "indices", "float64", "(2,)"]),
    ("gather indices list", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, [0, 1], 0.0, 1.0),
     TypeError, ["gather_batch", "indices", "list"]),
    ("gather negative pad", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, np.arange(2), 0.0, 1.0, pad=-1),
     ValueError, ["gather_batch", "pad", "-1"]),
    ("gather negative max_shift", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, np.arange(2), 0.0, 1.0,
                                                           max_shift=-2),
     ValueError, ["gather_batch", "max_shift", "-2"]),
    ("gather std 0", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, np.arange(2), 0.0, 0.0),
     ValueError, ["gather_batch", "std"]),
    ("gather index out of range", lambda: cpu.gather_batch(np.zeros((4, 3, 3), np.uint8), None, np.array([0, 9]), 0.0, 1.0),
     ValueError, ["gather_batch", "indices[1] = 9", "[0, 4)", "(4, 3, 3)", "(2,)"]),
]


@pytest.mark.parametrize("call, exc, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_with_a_helpful_message(call, exc, fragments):
    raises(exc, call, *fragments)


# ------------------------------------------------------ direct use, GPU-style


def test_checks_accept_any_object_with_shape_ndim_dtype():
    x, w = FakeDeviceArray((2, 1, 28, 28)), FakeDeviceArray((6, 1, 5, 5))
    assert _check.check_conv(x, w, FakeDeviceArray((6,)), 1, 2, F32) == ((1, 1), (2, 2), (28, 28))
    assert _check.check_linear(FakeDeviceArray((64, 400)), FakeDeviceArray((120, 400)), None, F32) == (64, 400, 120)
    raises(TypeError, lambda: _check.check_conv(FakeDeviceArray((2, 1, 28, 28), np.float64), w, None, 1, 0, F32),
           "conv_forward", "x", "float64", "accepted: float32", "(2, 1, 28, 28)")


def test_gpu_dtype_set_refuses_float64():
    for call in [
        lambda: _check.check_elementwise("relu_forward", np.zeros(3), F32),
        lambda: _check.check_pool("avg_pool_forward", np.zeros((1, 1, 4, 4)), 2, None, 0, F32),
        lambda: _check.check_softmax("softmax", np.zeros((2, 3)), F32),
        lambda: _check.check_dropout(np.zeros(3), 0.5, 0, F32),
        lambda: _check.check_sgd(np.zeros(3), np.zeros(3), None, 0.1, 0.0, 0.0, 0.0, False, F32),
    ]:
        raises(TypeError, call, "float64", "accepted: float32")


# (x shape, w shape, stride, padding, the (stride, padding) pairs they mean, the output's H, W worked
# out by hand: out = (size + 2 * pad - kernel) // stride + 1).
CONV_GEOMETRIES = [
    ((2, 3, 7, 6), (4, 3, 3, 2), 2, 1, ((2, 2), (1, 1)), (4, 4)),              # (7+2-3)//2+1, (6+2-2)//2+1
    ((1, 2, 9, 8), (3, 2, 3, 3), (2, 1), (1, 2), ((2, 1), (1, 2)), (5, 10)),   # (9+2-3)//2+1, (8+4-3)//1+1
    ((1, 1, 5, 5), (1, 1, 5, 5), 1, 0, ((1, 1), (0, 0)), (1, 1)),
    ((3, 1, 28, 28), (6, 1, 5, 5), 1, 2, ((1, 1), (2, 2)), (28, 28)),         # LeNet's conv1
    ((1, 1, 8, 7), (2, 1, 2, 3), (3, 2), 0, ((3, 2), (0, 0)), (3, 3)),         # (8-2)//3+1, (7-3)//2+1
]


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, pairs, out_hw", CONV_GEOMETRIES)
def test_check_conv_geometry_matches_the_output(x_shape, w_shape, stride, padding, pairs, out_hw):
    """check_conv's (stride, padding, output size) against values worked out by hand, and the
    numpy twin's output has that size."""
    x, w = np.zeros(x_shape), np.zeros(w_shape)
    assert _check.check_conv(x, w, None, stride, padding, FLOATS) == pairs + (out_hw,)
    assert cpu.conv_forward(x, w, None, stride, padding)[0].shape == (x_shape[0], w_shape[0]) + out_hw


@pytest.mark.parametrize("kernel, stride, padding, expected", [
    (2, None, 0, ((2, 2), (2, 2), (0, 0), (3, 3))),                     # stride defaults to the kernel
    (3, 2, 1, ((3, 3), (2, 2), (1, 1), (4, 3))),                        # (7+2-3)//2+1, (6+2-3)//2+1
    ((3, 2), (1, 2), (1, 1), ((3, 2), (1, 2), (1, 1), (7, 4))),         # (7+2-3)//1+1, (6+2-2)//2+1
])
def test_check_pool_geometry_matches_the_output(kernel, stride, padding, expected):
    """check_pool's (kernel, stride, padding, output size) against values worked out by hand."""
    x = np.zeros((2, 3, 7, 6))
    assert _check.check_pool("max_pool_forward", x, kernel, stride, padding, FLOATS) == expected
    assert cpu.max_pool_forward(x, kernel, stride, padding)[0].shape == (2, 3) + expected[3]
    assert cpu.avg_pool_forward(x, kernel, stride, padding)[0].shape == (2, 3) + expected[3]


def test_other_check_return_values():
    assert _check.check_elementwise("relu_forward", np.zeros((2, 3, 4)), FLOATS) == 24
    assert _check.check_flatten(np.zeros((2, 3, 4)), FLOATS) == (2, 12)
    assert _check.check_softmax("softmax", np.zeros((5, 7)), FLOATS) == (5, 7)
    assert _check.check_cross_entropy(np.zeros((5, 7)), np.zeros(5, np.uint8), FLOATS) == (5, 7)
    assert _check.check_dropout(np.zeros(3), 0.5, np.uint64(7), FLOATS) == (2**23, 2.0, 7)
    threshold, scale, _ = _check.check_dropout(np.zeros(3), 0.1, 0, FLOATS)
    assert threshold == round(0.1 * 2**24) and scale == float(np.float32(1 / 0.9))
    assert isinstance(scale, float) and isinstance(threshold, int)
    images = np.zeros((10, 28, 28), np.uint8)
    assert _check.check_gather_batch(images, np.zeros(10, np.int32), np.zeros(64, np.int32),
                                     0.1307, 0.3081, 2, 2, 5) == ((64, 1, 32, 32), 5)
    assert _check.check_same_shape("op", "dy", np.zeros(3), "y", (3,)) is None


@pytest.mark.parametrize("value, name, minimum, expected", [
    (3, "kernel", 1, (3, 3)), ((2, 1), "stride", 1, (2, 1)), ([0, 2], "padding", 0, (0, 2)),
    (np.int64(2), "stride", 1, (2, 2)),
])
def test_pair_accepts(value, name, minimum, expected):
    assert _check.pair(value, name, "op", minimum) == expected


@pytest.mark.parametrize("value, exc", [(0, ValueError), ((1, 0), ValueError), ((1, 2, 3), ValueError),
                                        (1.0, TypeError), (True, TypeError), ("2", TypeError), ((1, 2.0), TypeError)])
def test_pair_rejects(value, exc):
    message = raises(exc, lambda: _check.pair(value, "stride", "my_op", minimum=1), "my_op", "stride")
    assert re.match(r"my_op: ", message)
