"""The module system: :class:`Parameter` and :class:`Module` (parameters, buffers, children,
devices, train/eval, state dicts); the helpers the layers share.  (:class:`Sequential` is in
sequential.py.)"""
from collections import OrderedDict, namedtuple

import numpy as np

from .. import ops

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

    __slots__ = ("_data", "grad")

    def __init__(self, data):
        self.data = data
        self.grad = None

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value
        _version[0] += 1           # a compiled plan bound to the old array must look again

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return self.data.dtype

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype}, device={_device_of(self.data)!r})"


#: Bumped whenever something a compiled plan is bound to may have been replaced: a Parameter's array,
#: a module, parameter or device buffer assigned or deleted through the attribute API.  A plan checks
#: this one number per call and only on a change compares what it holds, one by one
#: (``cydnn.compiler.binding.Signature``).  Values changed in place need no bump: plans read the arrays.
_version = [0]


def structure_version():
    return _version[0]


# -------------------------------------------------------------------- module
LoadResult = namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])


class Module:
    """Base class of layers and models.

    Assigning a :class:`Parameter` or a :class:`Module` to an attribute
    registers it (in ``_parameters`` / ``_modules``, in assignment order), so
    that ``named_parameters()`` can name every parameter by its path:
    ``fc1.weight``, ``0.bias``, ...  Subclasses call ``super().__init__()``
    first, and implement ``forward(x)`` and ``backward(dy)``.

    *Buffers* (:meth:`register_buffer`) are arrays that belong to the state
    but are not trained, such as BatchNorm's running statistics: they are in
    :meth:`state_dict` (after the module's parameters, as PyTorch orders
    them), loaded by :meth:`load_state_dict` and moved by :meth:`to`, but
    :meth:`parameters` does not list them, so optimizers never see them.
    """

    #: True where ``backward(dy, input_grad=False)`` may skip the input's gradient
    #: (Conv2d, Linear); Sequential uses it for its first layer.
    can_skip_input_grad = False

    def __init__(self):
        # Set through __dict__ so that __setattr__ below can rely on them.
        self.__dict__["_parameters"] = OrderedDict()
        self.__dict__["_buffers"] = OrderedDict()
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
        buffers = self.__dict__["_buffers"]
        if name in buffers and not isinstance(value, (Parameter, Module)):
            buffers[name] = value       # a registered buffer stays one: its new value (or None)
            if not isinstance(value, np.ndarray):    # host counters (num_batches_tracked) change every step
                _version[0] += 1
            return
        _version[0] += 1
        # An attribute is in exactly one place: a registry or the plain __dict__.  A value replacing
        # one of its own kind keeps its place (as in PyTorch): a new Parameter for ``weight`` stays
        # where ``weight`` was in parameters() and state_dict(), so an optimizer's list still lines up.
        target = (self._parameters if isinstance(value, Parameter)
                  else self._modules if isinstance(value, Module) else self.__dict__)
        for table in (self._parameters, buffers, self._modules, self.__dict__):
            if table is not target:
                table.pop(name, None)
        target[name] = value

    def __getattr__(self, name):
        # Only called when normal lookup fails: look in the registries.
        for table in ("_parameters", "_buffers", "_modules"):
            registry = self.__dict__.get(table)
            if registry is not None and name in registry:
                return registry[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        _version[0] += 1
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name, array):
        """Register ``array`` (a numpy array, a DeviceArray, or None) as the buffer ``name``.

        A buffer is state that is not trained (BatchNorm's ``running_mean``):
        it is saved and loaded with the parameters but is not a parameter.
        ``self.name = new_array`` later replaces its value and keeps it a
        buffer.  A None buffer is left out of :meth:`state_dict` (as PyTorch).
        Floating buffers move with :meth:`to` and change dtype with
        :meth:`double` / :meth:`float`; integer buffers (counters such as
        ``num_batches_tracked``) stay host numpy arrays, since the host reads them.
        """
        if "_buffers" not in self.__dict__:
            raise AttributeError(f"cannot register buffer {name!r} before Module.__init__() was called")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"register_buffer: the name must be an identifier, got {name!r}")
        if name in self._parameters or name in self._modules or name in self.__dict__ or hasattr(type(self), name):
            raise KeyError(f"register_buffer: {type(self).__name__} already has an attribute {name!r}")
        if array is not None and not all(hasattr(array, attr) for attr in ("shape", "dtype", "reshape")):
            raise TypeError(f"register_buffer {name!r}: expected an array or None, got {type(array).__name__}")
        self._buffers[name] = array

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

    def named_buffers(self):
        """``(dotted name, array)`` for every buffer that is not None, e.g. ``("bn1.running_mean", a)``."""
        for module_name, module in self.named_modules():
            for name, array in module._buffers.items():
                if array is not None:
                    yield (f"{module_name}.{name}" if module_name else name), array

    def buffers(self):
        for _, array in self.named_buffers():
            yield array

    def _named_state(self):
        """``(dotted name, module, attribute, kind)`` of everything in the state dict, in PyTorch's
        order: each module's parameters, then its buffers, then its children's (a shared
        parameter once, under its first name)."""
        seen = set()
        for module_name, module in self.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for name, param in module._parameters.items():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield prefix + name, module, name, "parameter"
            for name, array in module._buffers.items():
                if array is not None:
                    yield prefix + name, module, name, "buffer"

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
        """Move every parameter (and gradient) and every floating buffer to ``device``; returns ``self``.

        The Parameter objects stay the same, only their ``data``/``grad`` are
        replaced.  Optimizer state is not moved: move the model first, then
        build the optimizer.  Integer buffers stay on the host.
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
            for name, array in module._buffers.items():
                if array is not None and np.issubdtype(np.dtype(array.dtype), np.floating):
                    module._buffers[name] = move(array)
            module._device = device
        _version[0] += 1           # a model without parameters moves too: its compiled plans look again
        return self

    def _cast(self, dtype):
        if self.device != "cpu":
            raise RuntimeError(f"{np.dtype(dtype).name} parameters are cpu only; "
                               f"this module is on {self.device!r}")
        for param in self.parameters():
            param.data = param.data.astype(dtype)
            param.grad = None if param.grad is None else param.grad.astype(dtype)
        for module in self.modules():
            for name, array in module._buffers.items():
                if array is not None and np.issubdtype(array.dtype, np.floating):
                    module._buffers[name] = array.astype(dtype)
        return self

    def double(self):
        """Turn the parameters and floating buffers into float64 (cpu only; for gradient checks). Returns self."""
        return self._cast(np.float64)

    def float(self):
        """Turn the parameters and floating buffers into float32. Returns self."""
        return self._cast(np.float32)

    # -- state ----------------------------------------------------------------
    def state_dict(self):
        """``OrderedDict`` name -> numpy array: host copies of every parameter and buffer.

        Keys as PyTorch names and orders them: ``conv1.weight``, ``bn1.weight``,
        ``bn1.bias``, ``bn1.running_mean``, ``bn1.running_var``,
        ``bn1.num_batches_tracked`` (an int64 0-d array), ...
        """
        state = OrderedDict()
        for name, module, attr, kind in self._named_state():
            value = module._parameters[attr].data if kind == "parameter" else module._buffers[attr]
            state[name] = np.array(ops.backend_of(value).to_numpy(value), copy=True)
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Copy values from ``state_dict`` (name -> array) into the parameters and buffers.

        Values are converted to each entry's dtype and device (an int64
        ``num_batches_tracked`` stays int64).  With ``strict=True`` the keys
        must match exactly; a missing or unexpected key raises ``ValueError``
        naming it; a shape mismatch always raises ``ValueError`` naming the key
        and both shapes.  Everything is checked before anything is changed.
        Returns ``(missing_keys, unexpected_keys)``.
        """
        entries = OrderedDict((name, (module, attr, kind)) for name, module, attr, kind in self._named_state())
        missing = [name for name in entries if name not in state_dict]
        unexpected = [name for name in state_dict if name not in entries]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise ValueError(f"load_state_dict for {type(self).__name__}: " + "; ".join(parts))

        new_values = {}
        for name, (module, attr, kind) in entries.items():
            if name not in state_dict:
                continue
            current = module._parameters[attr].data if kind == "parameter" else module._buffers[attr]
            shape, dtype = tuple(int(d) for d in current.shape), np.dtype(current.dtype)
            value = state_dict[name]
            if _device_of(value) != "cpu":      # a DeviceArray: bring it to the host
                value = ops.backend_of(value).to_numpy(value)
            value = np.asarray(value)
            if value.shape != shape:
                raise ValueError(f"shape mismatch for key {name!r}: expected {shape}, got {value.shape}")
            if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
                raise TypeError(f"key {name!r}: expected a numeric array, got dtype {value.dtype}")
            # A copy, so that the module never aliases the caller's array.
            new_values[name] = (np.array(value, dtype=dtype, copy=True), _device_of(current))

        for name, (value, device) in new_values.items():
            module, attr, kind = entries[name]
            value = ops.backend(device).asarray(value)
            if kind == "parameter":
                module._parameters[attr].data = value
            else:
                module._buffers[attr] = value
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
