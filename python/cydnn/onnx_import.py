"""A cydnn model from an ONNX file: ``cydnn.load_onnx(path)``.

Reads the graph that ``torch.onnx.export`` writes for a sequential network
(the legacy exporter, ``dynamo=False``, gives plain nodes) with the ``onnx``
package (``pip install cydnn[onnx]``) and builds the same network from cydnn
layers.  Supported nodes, each taking the previous node's output:

    Conv                  -> nn.Conv2d   (group 1, dilations 1, symmetric pads)
    Relu, Tanh, Sigmoid   -> nn.ReLU, nn.Tanh, nn.Sigmoid
    MaxPool, AveragePool  -> nn.MaxPool2d, nn.AvgPool2d (ceil_mode 0, symmetric
                             pads; AveragePool with pads needs count_include_pad=1,
                             cydnn's average counts the padding)
    Flatten (axis 1), Reshape to (N, -1) -> nn.Flatten
    Gemm, MatMul [+ Add]  -> nn.Linear   (transB 0 or 1; alpha, beta folded in)
    Softmax (last axis)   -> Softmax (below; inference only)
    Identity, Dropout     -> nothing (identities at inference); Constant feeds the others
    BatchNormalization    -> nn.BatchNorm2d (inference: training_mode 0; ONNX momentum m
                             becomes 1 - m; the running statistics are the graph's)
    GlobalAveragePool     -> nn.AdaptiveAvgPool2d(1)
    LeakyRelu             -> nn.LeakyReLU(alpha)
                             (these three where this cydnn's nn has the layers)

Any number of input channels is taken (a 3-channel image network builds as
a Sequential; only a 1-channel LeNet-5 becomes a ``LeNet5``).  A model with
BatchNorm is returned in training mode, like any new module: call ``eval()``
(``predict`` does) to use the running statistics.

Anything else (or a branch: a node reading something other than the previous
node's output and constants) is refused with :class:`OnnxImportError` naming
the op, its node index and its name.

The result is an ``nn.Sequential`` whose weighted layers are named after
their initializers (``conv1.weight`` gives a layer ``conv1``; a name that is
not a dotted identifier path, or that would shadow an ``nn.Module`` attribute
such as ``training.weight``, is refused), so its ``state_dict`` keys are
PyTorch's.  When the layers are exactly cydnn's
LeNet-5 (modern: 28 x 28, ReLU, max pooling; classic: 32 x 32, tanh, average
pooling; see :class:`cydnn.models.LeNet5`), a ``LeNet5`` is returned instead,
weights loaded, so that ``predict`` works; a trailing Softmax is dropped
there (``predict`` returns probabilities already).  Its preprocessing is then
cydnn's, not the exporter's: raw 28 x 28 images, padded by 2 for classic,
normalised with mean 0.1307 and std 0.3081 (pass ``normalize=(mean, std)``
if the network was trained with others, ``normalize=None`` for inputs
already normalised).  ``lenet=False`` always gives the
Sequential, whose input is the ONNX graph's input (already normalised).
"""
import os
from collections import OrderedDict

from . import models, nn
from ._filesafe import describe
from ._normalize import KEEP as _KEEP, apply_normalize
from .onnx_builder import SUPPORTED_OPS, Builder, Softmax
from .onnx_checks import MAX_ONNX_BYTES, MAX_OPSET, OnnxImportError, check_file, check_graph, check_opset
from .ops._check import pair

__all__ = ["OnnxImportError", "Softmax", "load_onnx", "SUPPORTED_OPS", "MAX_ONNX_BYTES", "MAX_OPSET"]


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper  # noqa: F401
    except ImportError as e:
        raise ImportError("cydnn.load_onnx needs the 'onnx' package: pip install onnx  "
                          "(or pip install 'cydnn[onnx]')") from e
    return onnx


def _signature(module):
    """What makes two layers the same: type and hyperparameters, not weights."""
    if isinstance(module, nn.Conv2d):
        return ("conv", module.in_channels, module.out_channels, module.kernel_size,
                pair(module.stride, "s", "c"), pair(module.padding, "p", "c"), module.bias is not None)
    if isinstance(module, nn.Linear):
        return ("fc", module.in_features, module.out_features, module.bias is not None)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        kw = module._kwargs
        k = pair(kw["kernel"], "k", "p")
        s = k if kw["stride"] is None else pair(kw["stride"], "s", "p")
        return (type(module).__name__, k, s, pair(kw["padding"], "p", "p"))
    return (type(module).__name__,)


def _as_lenet(layers, input_shape):
    """A models.LeNet5 with the layers' weights when they are exactly one, else None."""
    if layers and isinstance(layers[-1][1], Softmax):
        layers = layers[:-1]
    last = layers[-1][1] if layers else None
    if not isinstance(last, nn.Linear):
        return None
    for classic in (False, True):
        size = 32 if classic else 28
        if len(input_shape) != 3 or any(d not in (None, e) for d, e in zip(input_shape, (1, size, size))):
            continue
        lenet = models.LeNet5(classic=classic, num_classes=last.out_features, seed=0)
        if [_signature(m) for m in lenet] != [_signature(m) for _, m in layers]:
            continue
        weighted = [m for _, m in layers if isinstance(m, (nn.Conv2d, nn.Linear))]
        state = {}
        for name, module in zip(("conv1", "conv2", "fc1", "fc2", "fc3"), weighted):
            state[f"{name}.weight"], state[f"{name}.bias"] = module.weight.data, module.bias.data
        lenet.load_state_dict(state)
        return lenet
    return None


def load_onnx(path, device="cpu", lenet=True, normalize=_KEEP):
    """The network in the ONNX file at ``path`` as cydnn layers, on ``device``.

    Returns a :class:`cydnn.models.LeNet5` when the graph is exactly LeNet-5
    and ``lenet`` is true (a trailing Softmax dropped), otherwise an
    ``nn.Sequential`` of the layers in the graph's order (a Softmax kept as a
    :class:`Softmax` layer).  The model is in training mode, as any new module.

    Preprocessing.  An ONNX graph takes its input already preprocessed; what
    the exporter did before it is not in the file.  The ``Sequential`` applies
    nothing: its input is the graph's input (``normalize`` may only be None).
    The ``LeNet5`` takes raw images (pixels in [0, 1]) and computes
    ``(x - mean) / std`` itself (after padding 28 x 28 images by 2 for the
    classic, 32 x 32 variant): ``normalize=(mean, std)`` (numbers) sets the values the
    network was trained with, ``normalize=None`` means the input is already
    normalised (mean 0, std 1), and leaving it out keeps cydnn's MNIST values
    (0.1307, 0.3081).

    Hostile files: a file over protobuf's 2 GiB limit is refused from its
    size; external data is never read; the opset must lie in [MIN_OPSET,
    MAX_OPSET]; the graph must define every value once and before it is read
    (no cycle); every tensor used must be numeric with dims that agree with its
    data; every node's attributes, weights and window are checked before a
    layer is built (see :mod:`cydnn.onnx_checks`, :mod:`cydnn.onnx_builder`).
    Raises :class:`OnnxImportError` naming the file, the node (index, name,
    op) and the problem; ``FileNotFoundError`` for a missing file;
    ``ImportError`` when the ``onnx`` package is missing.
    """
    onnx = _onnx()
    path = os.fspath(path)
    if normalize is not _KEEP and normalize is not None and not lenet:
        raise ValueError("load_onnx: normalize=(mean, std) applies to the LeNet5 it returns with lenet=True; "
                         "the Sequential takes the graph's input as it is (normalize=None)")
    check_file(path)
    try:
        proto = onnx.load(path, load_external_data=False)
    except FileNotFoundError:
        raise
    except Exception as e:      # protobuf's DecodeError, onnx's own errors
        looks = describe(path)
        looks = f"; it looks like {looks}" if looks and "ONNX" not in looks else ""
        raise OnnxImportError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e}){looks}") from e
    check_opset(proto, path)
    check_graph(proto.graph, path)
    builder = Builder(onnx, proto.graph, path)
    layers = builder.run(proto.graph.node)
    if not layers:
        raise OnnxImportError(f"{path}: the graph has no layers")
    model = _as_lenet(layers, builder.input_shape) if lenet else None
    if model is None:
        if normalize is not _KEEP and normalize is not None:
            raise ValueError(f"load_onnx: {path} is not a LeNet-5; normalize=(mean, std) applies only "
                             f"to a LeNet5 (the Sequential takes the graph's input as it is)")
        model = nn.Sequential(OrderedDict((name, module) for name, module in layers))
    else:
        apply_normalize(model, normalize, ValueError, f"load_onnx({path!r})")
    return model.to(device)
