"""Stage 1: trace -- an ``nn.Sequential`` and an input shape become a list of :class:`Node`.

Shapes are inferred once, with the same checks the ops run on every call
(``cydnn.ops._check``: a kernel that does not fit its padded input, a Linear whose
in_features do not match, ...), so a network that would fail at its first forward
fails here, naming the layer.  A layer the compiler does not know gives
:class:`Unsupported` with the reason; callers fall back to the reference path.

Nested Sequentials are flattened; names are the module paths (``block1.conv1``).
"""
import numpy as np

from .. import nn
from ..ops import _check
from .ir import Node

__all__ = ["trace", "Unsupported", "SUPPORTED"]


class Unsupported(ValueError):
    """The network has something the compiler does not take (the message says what)."""


def _stand_in(shape):
    """A float32 array of ``shape`` that owns no memory (for the shape checks)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=shape, strides=(0,) * len(shape))


def _conv(name, m, shape):
    x = _stand_in(shape)
    w = _stand_in(m.weight.shape)
    b = None if m.bias is None else _stand_in(m.bias.shape)
    try:
        stride, pad, (oh, ow) = _check.check_conv(x, w, b, m.stride, m.padding, (np.float32,))
    except (TypeError, ValueError) as e:
        raise Unsupported(f"layer {name}: {e}") from None
    return (shape[0], m.weight.shape[0], oh, ow), {"stride": stride, "padding": pad}


def _pool(name, m, shape, op):
    kw = m._kwargs
    try:
        kernel, stride, pad, (oh, ow) = _check.check_pool(op, _stand_in(shape), kw["kernel"], kw["stride"],
                                                         kw["padding"], (np.float32,))
    except (TypeError, ValueError) as e:
        raise Unsupported(f"layer {name}: {e}") from None
    return (shape[0], shape[1], oh, ow), {"kernel": kernel, "stride": stride, "padding": pad}


def _linear(name, m, shape):
    if len(shape) != 2 or shape[1] != m.in_features:
        raise Unsupported(f"layer {name}: Linear({m.in_features}, {m.out_features}) cannot take input {shape} "
                          f"(it needs (N, {m.in_features}); a Flatten before it?)")
    return (shape[0], m.out_features), {}


def _same(name, m, shape):
    return shape, {}


def _batch_norm(name, m, shape):
    if len(shape) not in m._ranks or shape[1] != m.num_features:
        raise Unsupported(f"layer {name}: {type(m).__name__}({m.num_features}) cannot take input {shape}")
    if not (m.affine and m.track_running_stats):
        raise Unsupported(f"layer {name}: the compiler takes batch norm with affine=True and "
                          f"track_running_stats=True")
    if m.momentum is None:
        raise Unsupported(f"layer {name}: momentum=None (a cumulative average) needs the host's batch count "
                          f"every step; the compiler takes a fixed momentum")
    return shape, {"eps": float(m.eps), "momentum": float(m.momentum)}


def _global_avg_pool(name, m, shape):
    return (shape[0], shape[1], 1, 1), {"kernel": (shape[2], shape[3]), "stride": (shape[2], shape[3]),
                                        "padding": (0, 0)}


def _flatten(name, m, shape):
    return (shape[0], int(np.prod(shape[1:], dtype=np.int64))), {}


def _max_pool(name, m, shape):
    return _pool(name, m, shape, "max_pool_forward")


def _avg_pool(name, m, shape):
    return _pool(name, m, shape, "avg_pool_forward")


#: ops whose input must be (N, C, H, W); checked by trace() before the shape function
NEEDS_4D = ("conv2d", "max_pool", "avg_pool", "global_avg_pool")


def _check_4d(name, m, shape):
    if len(shape) != 4:
        raise Unsupported(f"layer {name}: {type(m).__name__} needs (N, C, H, W), got {shape}")


#: layer class name -> (op, shape function).  Looked up by class name so that layers added
#: to ``cydnn.nn`` later (BatchNorm, LeakyReLU, ...) are taken as soon as they exist.
SUPPORTED = {
    "Conv2d": ("conv2d", _conv),
    "Linear": ("linear", _linear),
    "ReLU": ("relu", _same),
    "Tanh": ("tanh", _same),
    "Sigmoid": ("sigmoid", _same),
    "MaxPool2d": ("max_pool", _max_pool),
    "AvgPool2d": ("avg_pool", _avg_pool),
    "Flatten": ("flatten", _flatten),
    "Dropout": ("dropout", _same),
    "LeakyReLU": ("leaky_relu", _same),
    "BatchNorm2d": ("batch_norm", _batch_norm),
    "BatchNorm1d": ("batch_norm", _batch_norm),
    "AdaptiveAvgPool2d": ("global_avg_pool", _global_avg_pool),
    "GlobalAvgPool2d": ("global_avg_pool", _global_avg_pool),
}


def slope(module):
    """A LeakyReLU's negative slope (0 for every other layer)."""
    return float(getattr(module, "_kwargs", {}).get("negative_slope", 0.0))


def _leaves(module, prefix=""):
    """(path, layer) of every non-Sequential module, in order."""
    for name, child in module._modules.items():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Sequential) and type(child).forward is nn.Sequential.forward:
            yield from _leaves(child, path + ".")
        else:
            yield path, child


def trace(model, input_shape, batch):
    """The nodes of ``model`` (an ``nn.Sequential``) for inputs (batch, *input_shape).

    Raises :class:`Unsupported` naming the layer and the reason where the compiler cannot
    take the network (a layer it does not know, a shape that does not fit).
    """
    if not isinstance(model, nn.Sequential):
        raise Unsupported(f"the compiler takes an nn.Sequential, not {type(model).__name__}")
    if type(model).forward is not nn.Sequential.forward:
        raise Unsupported(f"{type(model).__name__} overrides forward(): the compiler only knows Sequential's")
    shape = (int(batch),) + tuple(int(s) for s in input_shape)
    if batch < 1 or any(s < 1 for s in shape):
        raise Unsupported(f"input shape {shape} must be positive")
    nodes = []
    for name, layer in _leaves(model):
        entry = SUPPORTED.get(type(layer).__name__)
        if entry is None or type(layer).__module__.split(".")[0] != "cydnn":
            raise Unsupported(f"layer {name} is a {type(layer).__name__}, which the compiler does not take "
                              f"(it takes {', '.join(sorted(SUPPORTED))})")
        op, infer = entry
        for p in layer._parameters.values():
            if p is not None and str(p.data.dtype) != "float32":
                raise Unsupported(f"layer {name} has {p.data.dtype} parameters; the compiler runs float32")
        if op in NEEDS_4D:
            _check_4d(name, layer, shape)
        out, attrs = infer(name, layer, shape)
        nodes.append(Node(name, op, layer, shape, tuple(int(s) for s in out), attrs))
        shape = nodes[-1].out_shape
    if not nodes:
        raise Unsupported("the Sequential has no layers")
    return nodes
