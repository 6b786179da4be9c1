"""Layers: modules with an explicit forward and backward.

cydnn has no autograd tape.  Each layer's ``forward`` keeps what its backward
will need (the *cache* returned by the op), and ``backward(dy)`` turns the
gradient of the loss with respect to the layer's output into the gradient with
respect to its input, setting the gradients of the layer's parameters on the
way.  A network is run backward by calling the layers' backwards in reverse
order, which is what :class:`Sequential` does::

    model = Sequential(Linear(4, 8, rng=0), ReLU(), Linear(8, 3, rng=1))
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model(x), labels)      # forward
    model.backward(loss_fn.backward())    # backward: sets every p.grad

Gradients are **set, not accumulated**: each backward overwrites ``p.grad``
with the gradient of the last forward.  (PyTorch adds to ``.grad``; here
two backwards in a row leave the gradient of the second.)

Arrays and devices
------------------
A parameter's ``data`` lives on the module's device: a numpy array on
``"cpu"``, a ``DeviceArray`` on ``"cuda"``.  Every layer dispatches on the kind
of its input, ``cydnn.ops.backend_of(x)``; layers with parameters check that
the input is on their own device.  Parameters are created on the CPU in
float32 and moved with :meth:`Module.to`.  On the CPU a model can be turned to
float64 with :meth:`Module.double` (for gradient checks); CUDA is float32 only.
"""
from collections import OrderedDict, namedtuple

import numpy as np

from . import ops
from .ops._check import pair

__all__ = [
    "Parameter", "Module", "Sequential",
    "Conv2d", "MaxPool2d", "AvgPool2d", "Linear",
    "ReLU", "Tanh", "Sigmoid", "Flatten", "Dropout",
    "CrossEntropyLoss",
]

DEVICES = ("cpu", "cuda")


def _device_of(array):
    """``"cpu"`` for a numpy array, ``"cuda"`` for anything else (a DeviceArray)."""
    return "cpu" if isinstance(array, np.ndarray) else "cuda"


def _check_device(device):
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")
    return device


def _saved(cache, module):
    """The cache a forward left, or a clear error when backward comes first."""
    if cache is None:
        raise RuntimeError(f"{type(module).__name__}.backward() called before forward()")
    return cache


def _as_rng(rng):
    """A ``np.random.Generator`` from a Generator, an int seed, or None (fresh entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


# ----------------------------------------------------------------- parameter
class Parameter:
    """A trainable array and its gradient.

    ``data`` is the value (a backend array); ``grad`` is ``dLoss/d data`` from
    the last backward, or ``None`` before any backward / after ``zero_grad``.
    Optimizers hold Parameter objects, and ``Module.to`` replaces ``data`` in
    place, so an optimizer built after ``.to()`` sees the moved arrays.
    """

    __slots__ = ("data", "grad")

    def __init__(self, data):
        self.data = data
        self.grad = None

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype}, device={_device_of(self.data)!r})"


# -------------------------------------------------------------------- module
LoadResult = namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])


class Module:
    """Base class of layers and models.

    Assigning a :class:`Parameter` or a :class:`Module` to an attribute
    registers it (in ``_parameters`` / ``_modules``, in assignment order), so
    that ``named_parameters()`` can name every parameter by its path:
    ``fc1.weight``, ``0.bias``, ...  Subclasses call ``super().__init__()``
    first, and implement ``forward(x)`` and ``backward(dy)``.
    """

    def __init__(self):
        # Set through __dict__ so that __setattr__ below can rely on them.
        self.__dict__["_parameters"] = OrderedDict()
        self.__dict__["_modules"] = OrderedDict()
        self.__dict__["training"] = True
        self.__dict__["_device"] = "cpu"

    # -- registration -------------------------------------------------------
    def __setattr__(self, name, value):
        plain = self.__dict__
        if name in plain and not isinstance(value, (Parameter, Module)):
            plain[name] = value  # a plain attribute stays one (e.g. each forward's cache): the fast path
            return
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"cannot assign {name!r} before Module.__init__() was called")
        # An attribute is in exactly one place: a registry or the plain __dict__.
        for table in (self._parameters, self._modules, self.__dict__):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            self.__dict__[name] = value

    def __getattr__(self, name):
        # Only called when normal lookup fails: look in the registries.
        for table in ("_parameters", "_modules"):
            registry = self.__dict__.get(table)
            if registry is not None and name in registry:
                return registry[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        for table in (self._parameters, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    # -- running ------------------------------------------------------------
    def forward(self, *args):
        raise NotImplementedError(f"{type(self).__name__} does not implement forward")

    def backward(self, dy):
        """Gradient w.r.t. the input of the last forward, given ``dy`` = dLoss/d output.

        Sets (overwrites) ``.grad`` of this module's parameters.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement backward")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # -- traversal ----------------------------------------------------------
    def children(self):
        """The direct submodules, in registration order."""
        return iter(self._modules.values())

    def named_modules(self, prefix=""):
        """``(dotted name, module)`` for this module (name ``prefix``) and all below it."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_parameters(self):
        """``(dotted name, Parameter)`` pairs, e.g. ``("conv1.weight", p)``.

        A parameter shared by several modules is listed once, under its first name.
        """
        seen = set()
        for module_name, module in self.named_modules():
            for name, param in module._parameters.items():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield (f"{module_name}.{name}" if module_name else name), param

    def parameters(self):
        for _, param in self.named_parameters():
            yield param

    # -- modes and gradients --------------------------------------------------
    def train(self, mode=True):
        """Set training mode (``mode=True``) or evaluation mode on every submodule."""
        for module in self.modules():
            module.training = bool(mode)
        return self

    def eval(self):
        """Evaluation mode: e.g. Dropout becomes the identity."""
        return self.train(False)

    def zero_grad(self):
        """Forget the gradients (``p.grad = None``).

        Not needed between steps, since backward overwrites gradients, but it
        frees their memory and makes a stale gradient impossible to use.
        """
        for param in self.parameters():
            param.grad = None

    # -- devices and dtypes ---------------------------------------------------
    @property
    def device(self):
        """``"cpu"`` or ``"cuda"``: where this module's parameters live."""
        return self._device

    @property
    def dtype(self):
        """The dtype of the parameters (float32 unless :meth:`double` was called)."""
        for param in self.parameters():
            return np.dtype(param.data.dtype)
        return np.dtype(np.float32)

    def to(self, device):
        """Move every parameter (and gradient) to ``device``; returns ``self``.

        The Parameter objects stay the same, only their ``data``/``grad`` are
        replaced.  Optimizer state is not moved: move the model first, then
        build the optimizer.
        """
        _check_device(device)
        target = ops.backend(device)

        def move(array):
            if array is None or _device_of(array) == device:
                return array
            host = ops.backend_of(array).to_numpy(array)
            return target.asarray(host)

        for param in self.parameters():
            param.data = move(param.data)
            param.grad = move(param.grad)
        for module in self.modules():
            module._device = device
        return self

    def _cast(self, dtype):
        if self.device != "cpu":
            raise RuntimeError(f"{np.dtype(dtype).name} parameters are cpu only; "
                               f"this module is on {self.device!r}")
        for param in self.parameters():
            param.data = param.data.astype(dtype)
            param.grad = None if param.grad is None else param.grad.astype(dtype)
        return self

    def double(self):
        """Turn the parameters into float64 (cpu only; for gradient checks). Returns self."""
        return self._cast(np.float64)

    def float(self):
        """Turn the parameters into float32. Returns self."""
        return self._cast(np.float32)

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        """``OrderedDict`` name -> numpy array: host copies of every parameter."""
        return OrderedDict(
            (name, np.array(ops.backend_of(p.data).to_numpy(p.data), copy=True))
            for name, p in self.named_parameters())

    def load_state_dict(self, state_dict, strict=True):
        """Copy values from ``state_dict`` (name -> array) into the parameters.

        Values are converted to each parameter's dtype and device.  With
        ``strict=True`` the keys must match exactly; a missing or unexpected
        key raises ``ValueError`` naming it; a shape mismatch always raises
        ``ValueError`` naming the key and both shapes.  Everything is checked
        before anything is changed.  Returns ``(missing_keys, unexpected_keys)``.
        """
        params = OrderedDict(self.named_parameters())
        missing = [name for name in params if name not in state_dict]
        unexpected = [name for name in state_dict if name not in params]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise ValueError(f"load_state_dict for {type(self).__name__}: " + "; ".join(parts))

        new_values = {}
        for name, param in params.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            if _device_of(value) != "cpu":      # a DeviceArray: bring it to the host
                value = ops.backend_of(value).to_numpy(value)
            value = np.asarray(value)
            if value.shape != param.shape:
                raise ValueError(f"shape mismatch for key {name!r}: expected {param.shape}, "
                                 f"got {value.shape}")
            if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
                raise TypeError(f"key {name!r}: expected a numeric array, got dtype {value.dtype}")
            # A copy, so that the module never aliases the caller's array.
            new_values[name] = np.array(value, dtype=param.dtype, copy=True)

        backend = ops.backend(self.device)
        for name, value in new_values.items():
            params[name].data = backend.asarray(value)
        return LoadResult(missing, unexpected)

    # -- printing -------------------------------------------------------------
    def extra_repr(self):
        return ""

    def __repr__(self):
        lines = [f"({name}): " + repr(child).replace("\n", "\n  ")
                 for name, child in self._modules.items()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not lines:
            return head + ")"
        return head + "\n  " + "\n  ".join(lines) + "\n)"


class Sequential(Module):
    """Modules applied one after the other; backward runs them in reverse.

    ``Sequential(a, b, c)`` names its children ``"0"``, ``"1"``, ``"2"`` (so
    parameters are ``0.weight``, ...); ``Sequential(OrderedDict(conv1=..., ...))``
    uses the dictionary's names.
    """

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            named = modules[0].items()
        else:
            named = ((str(i), module) for i, module in enumerate(modules))
        for name, module in named:
            if not isinstance(module, Module):
                raise TypeError(f"Sequential child {name!r} is not a Module: {type(module).__name__}")
            setattr(self, name, module)

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def forward(self, x):
        for module in self._modules.values():
            x = module(x)
        return x

    def backward(self, dy, input_grad=True):
        """Run every child's backward in reverse; returns dLoss/d(input).

        ``input_grad=False`` (training, where the input is data) lets the first
        layer skip the gradient of its input -- for a first Conv2d that is the
        costliest part of its backward -- and returns None.
        """
        modules = list(self._modules.values())
        for i, module in enumerate(reversed(modules)):
            if i == len(modules) - 1 and not input_grad and isinstance(module, _WeightedLayer):
                return module.backward(dy, input_grad=False)
            dy = module.backward(dy)
        return dy


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
        return getattr(ops.backend_of(dy), self.op + "_backward")(dy, _saved(self._cache, self))

    def extra_repr(self):
        return ", ".join(f"{k}={v}" for k, v in self._kwargs.items())


class ReLU(_CachedOp):
    """``y = max(x, 0)``; ``dx = dy * (y > 0)``."""
    op = "relu"


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
