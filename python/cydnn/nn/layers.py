"""The layers: Conv2d and Linear (with weights), ReLU, LeakyReLU, Tanh, Sigmoid, MaxPool2d,
AvgPool2d, AdaptiveAvgPool2d / GlobalAvgPool2d (one op pair each), Flatten, Dropout, and the
loss, CrossEntropyLoss.  (Batch normalization is in norm.py.)"""
import inspect

import numpy as np

from .. import ops
from ..ops._check import pair
from ..ops._check_base import _is_int
from .module import Module, Parameter, _as_rng, _device_of, _saved


# --------------------------------------------------------- layers with weights
def _uniform_fan_in(rng, shape, fan_in):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as float32, on the CPU.

    This is PyTorch's default: ``kaiming_uniform_(w, a=sqrt(5))`` has bound
    gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a^2)) = sqrt(1/3),
    i.e. bound = 1 / sqrt(fan_in); the bias uses the same bound.
    """
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


class _WeightedLayer(Module):
    """Shared by Conv2d and Linear: the device check of the input."""

    can_skip_input_grad = True     # backward(dy, input_grad=False) skips dx

    def _check_input(self, x):
        if _device_of(x) != self.device:
            raise ValueError(f"{type(self).__name__} is on {self.device!r} but its input is on "
                             f"{_device_of(x)!r}: move the input (ops.backend(device).asarray) "
                             f"or the module (.to(device))")

    def _set_grads(self, dw, db):
        self.weight.grad = dw
        if self.bias is not None:
            self.bias.grad = db


class Conv2d(_WeightedLayer):
    """2-D convolution (cross-correlation, as PyTorch).

    x (N, C_in, H, W) -> y (N, C_out, H_out, W_out) with
    ``y[n, o] = b[o] + sum_{c, i, j} w[o, c, i, j] * x_pad[n, c, s*h + i, s*w + j]``
    and ``H_out = (H + 2 p - kh) // s + 1`` (likewise W_out).

    Weight (out_channels, in_channels, kh, kw), bias (out_channels,), both
    initialised U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_channels*kh*kw.
    ``kernel_size``, ``stride``, ``padding``: ints or (h, w) pairs.
    ``rng``: a ``np.random.Generator``, an int seed, or None (unseeded).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 bias=True, rng=None):
        super().__init__()
        kh, kw = pair(kernel_size, "kernel_size", "Conv2d", minimum=1)
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size = (kh, kw)
        self.stride, self.padding = stride, padding      # ints or pairs, checked by the op
        rng = _as_rng(rng)
        fan_in = self.in_channels * kh * kw
        self.weight = Parameter(_uniform_fan_in(rng, (self.out_channels, self.in_channels, kh, kw), fan_in))
        self.bias = Parameter(_uniform_fan_in(rng, (self.out_channels,), fan_in)) if bias else None
        self._cache = None

    def forward(self, x):
        self._check_input(x)
        b = None if self.bias is None else self.bias.data
        y, self._cache = ops.backend_of(x).conv_forward(
            x, self.weight.data, b, stride=self.stride, padding=self.padding)
        return y

    def backward(self, dy, input_grad=True):
        dx, dw, db = ops.backend_of(dy).conv_backward(dy, _saved(self._cache, self), need_dx=input_grad)
        self._set_grads(dw, db)
        return dx

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


class Linear(_WeightedLayer):
    """Affine map ``y = x W^T + b``: x (N, in_features) -> y (N, out_features).

    Weight (out_features, in_features) as PyTorch, bias (out_features,), both
    initialised U(-1/sqrt(in_features), 1/sqrt(in_features)).
    Backward: ``dx = dy W``, ``dW = dy^T x``, ``db = sum_n dy[n]``.
    """

    def __init__(self, in_features, out_features, bias=True, rng=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        rng = _as_rng(rng)
        self.weight = Parameter(_uniform_fan_in(rng, (self.out_features, self.in_features), self.in_features))
        self.bias = Parameter(_uniform_fan_in(rng, (self.out_features,), self.in_features)) if bias else None
        self._cache = None

    def forward(self, x):
        self._check_input(x)
        b = None if self.bias is None else self.bias.data
        y, self._cache = ops.backend_of(x).linear_forward(x, self.weight.data, b)
        return y

    def backward(self, dy, input_grad=True):
        dx, dw, db = ops.backend_of(dy).linear_backward(dy, _saved(self._cache, self), need_dx=input_grad)
        self._set_grads(dw, db)
        return dx

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# ------------------------------------------------- layers without parameters
class _CachedOp(Module):
    """A parameterless layer made of one op pair ``<name>_forward`` / ``<name>_backward``.

    forward: ``y, cache = op_forward(x, **kwargs)``; backward: ``op_backward(dy, cache)``.
    The layer's arguments (``kwargs``) reach the forward only: the op's cache must carry
    whatever of them the backward needs (leaky_relu's cache is ``(x, negative_slope)``).
    A backward op that asks for more than ``(dy, cache)`` would silently get its
    defaults, so it is refused with a TypeError instead.
    """

    op = None  # e.g. "relu"

    def __init__(self, **kwargs):
        super().__init__()
        self._kwargs = kwargs
        self._cache = None

    def forward(self, x):
        y, self._cache = getattr(ops.backend_of(x), self.op + "_forward")(x, **self._kwargs)
        return y

    def backward(self, dy):
        return _backward_op(ops.backend_of(dy), self.op + "_backward")(dy, _saved(self._cache, self))

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self._kwargs.items())


_EXTRA_BACKWARD_ARGS = {}   # backward function -> the parameters it has besides (dy, cache)


def _backward_op(backend, name):
    """``backend.<name>``, checked (once per function) to take nothing but ``(dy, cache)``
    (and ``need_dx``, which only skips work)."""
    fn = getattr(backend, name)
    extra = _EXTRA_BACKWARD_ARGS.get(fn)
    if extra is None:
        params = tuple(inspect.signature(fn).parameters)[2:]
        extra = _EXTRA_BACKWARD_ARGS[fn] = tuple(p for p in params if p != "need_dx")
    if extra:
        raise TypeError(f"{backend.__name__}.{name} takes {', '.join(extra)} besides (dy, cache), which a layer "
                        f"cannot pass: make the forward's cache carry them (docs/architecture.md, adding an op)")
    return fn


class ReLU(_CachedOp):
    """``y = max(x, 0)``; ``dx = dy * (y > 0)``."""
    op = "relu"


class LeakyReLU(_CachedOp):
    """``y = x if x > 0 else negative_slope * x``; ``dx = dy if x > 0 else negative_slope * dy`` (as PyTorch)."""
    op = "leaky_relu"

    def __init__(self, negative_slope=0.01):
        super().__init__(negative_slope=negative_slope)


class Tanh(_CachedOp):
    """``y = tanh(x)``; ``dx = dy * (1 - y^2)``."""
    op = "tanh"


class Sigmoid(_CachedOp):
    """``y = 1 / (1 + exp(-x))``; ``dx = dy * y * (1 - y)``."""
    op = "sigmoid"


class MaxPool2d(_CachedOp):
    """Max over each kernel_size x kernel_size window (stride defaults to kernel_size).

    kernel_size, stride, padding: ints or (h, w) pairs, checked by the op.

    ``H_out = (H + 2 p - k) // s + 1``; padding never wins the max.  Backward
    routes each ``dy`` to the (first) maximum of its window.
    """
    op = "max_pool"

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__(kernel=kernel_size, stride=stride, padding=padding)


class AvgPool2d(_CachedOp):
    """Mean over each kernel_size x kernel_size window (stride defaults to kernel_size).

    kernel_size, stride, padding: ints or (h, w) pairs, checked by the op.

    Padding counts in the mean (PyTorch's ``count_include_pad=True``); backward
    spreads ``dy / k^2`` evenly over the window.
    """
    op = "avg_pool"

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__(kernel=kernel_size, stride=stride, padding=padding)


class AdaptiveAvgPool2d(_CachedOp):
    """Global average pooling, (N, C, H, W) -> (N, C, 1, 1): each plane's mean (as PyTorch's
    ``AdaptiveAvgPool2d(1)``; put a Flatten after it for a linear layer).  Backward spreads
    ``dy / (H W)`` over the plane.  Only ``output_size`` 1 or (1, 1) is supported.
    """
    op = "global_avg_pool"

    def __init__(self, output_size):
        is_one = _is_int(output_size) and int(output_size) == 1
        is_pair = (isinstance(output_size, (tuple, list)) and len(output_size) == 2
                   and all(_is_int(v) and int(v) == 1 for v in output_size))
        if not (is_one or is_pair):
            raise ValueError(f"{type(self).__name__}: only output_size 1 or (1, 1) (global average pooling) is "
                             f"supported, got {output_size!r}")
        super().__init__()
        self.output_size = (1, 1) if is_pair else 1

    def extra_repr(self):
        return f"output_size={self.output_size}"


class GlobalAvgPool2d(AdaptiveAvgPool2d):
    """``AdaptiveAvgPool2d(1)``: (N, C, H, W) -> (N, C, 1, 1), the mean of each plane."""

    def __init__(self):
        super().__init__(1)

    def extra_repr(self):
        return ""


class Flatten(Module):
    """(N, d1, d2, ...) -> (N, d1*d2*...) without copying; backward reshapes back."""

    def __init__(self):
        super().__init__()
        self._input_shape = None

    def forward(self, x):
        self._input_shape = tuple(x.shape)
        return ops.backend_of(x).flatten(x)

    def backward(self, dy):
        return dy.reshape(*_saved(self._input_shape, self))


class Dropout(Module):
    """Inverted dropout: in training, ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``.

    Each element is zeroed with probability ``p`` and the survivors are scaled
    by 1/(1-p), so E[y] = x and evaluation needs no rescaling: in eval mode
    the layer is the identity.  Each training forward draws a fresh mask seed
    from the layer's generator (``rng``: Generator, int seed or None), so runs
    with the same seed repeat exactly.  0 <= p < 1.
    """

    def __init__(self, p=0.5, rng=None):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)
        self._rng = _as_rng(rng)
        self._cache = None

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self._cache = None          # identity: backward passes dy through
            return x
        seed = int(self._rng.integers(0, 2**63 - 1))
        y, self._cache = ops.backend_of(x).dropout_forward(x, p=self.p, seed=seed)
        return y

    def backward(self, dy):
        if self._cache is None:
            return dy
        return ops.backend_of(dy).dropout_backward(dy, self._cache)

    def extra_repr(self):
        return f"p={self.p}"


# ---------------------------------------------------------------------- loss
class CrossEntropyLoss(Module):
    """Mean softmax cross-entropy of logits (N, C) against int labels (N,).

    ``loss = (1/N) sum_n [logsumexp(z_n) - z_n[y_n]]``, and
    ``dloss/dz = (softmax(z) - onehot(y)) / N``, computed in the same fused op
    and returned by :meth:`backward`.  The loss is a 0-d array on the logits'
    device (read it with ``ops.backend_of(loss).to_numpy(loss)``, which waits
    for the GPU: do it when you need the number, not every step).
    """

    def __init__(self):
        super().__init__()
        self._dlogits = None

    def forward(self, logits, labels):
        """``labels``: a numpy integer array (its values are range-checked on the host)
        or, on cuda, an int32 DeviceArray (not range-checked, since that would wait
        for the GPU: a label outside [0, C) gives a NaN loss instead)."""
        backend = ops.backend_of(logits)
        if isinstance(labels, np.ndarray):
            loss, self._dlogits = backend.softmax_cross_entropy(logits, labels)
        else:
            loss, self._dlogits = backend.softmax_cross_entropy(logits, labels, validate=False)
        return loss

    def backward(self):
        """dLoss/dlogits of the last forward."""
        return _saved(self._dlogits, self)
