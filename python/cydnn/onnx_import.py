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

Anything else (or a branch: a node reading something other than the previous
node's output and constants) is refused with :class:`OnnxImportError` naming
the op, its node index and its name.

The result is an ``nn.Sequential`` whose weighted layers are named after
their initializers (``conv1.weight`` gives a layer ``conv1``), so its
``state_dict`` keys are PyTorch's.  When the layers are exactly cydnn's
LeNet-5 (modern: 28 x 28, ReLU, max pooling; classic: 32 x 32, tanh, average
pooling; see :class:`cydnn.models.LeNet5`), a ``LeNet5`` is returned instead,
weights loaded, so that ``predict`` works; a trailing Softmax is dropped
there (``predict`` returns probabilities already).  Its preprocessing is then
cydnn's, not the exporter's: raw 28 x 28 images, padded by 2 for classic,
normalised with mean 0.1307 and std 0.3081 (set ``model.mean`` / ``model.std``
if the network was trained with others).  ``lenet=False`` always gives the
Sequential, whose input is the ONNX graph's input (already normalised).
"""
from collections import OrderedDict

import numpy as np

from . import models, nn, ops
from .ops._check import pair

__all__ = ["OnnxImportError", "Softmax", "load_onnx", "SUPPORTED_OPS"]

SUPPORTED_OPS = ("Conv", "Relu", "Tanh", "Sigmoid", "MaxPool", "AveragePool", "Flatten", "Reshape",
                 "Gemm", "MatMul", "Add", "Softmax", "Identity", "Dropout", "Constant")


class OnnxImportError(ValueError):
    """An ONNX graph that cydnn cannot build: an unsupported op, attribute or structure."""


class Softmax(nn.Module):
    """Row-wise softmax of (N, C), for inference: ``ops.softmax``.  Backward is refused:
    train on logits with ``nn.CrossEntropyLoss``, which includes the softmax."""

    def forward(self, x):
        return ops.backend_of(x).softmax(x)

    def backward(self, dy):
        raise RuntimeError("Softmax is an inference layer (imported from ONNX) and has no backward; "
                           "drop it and train the logits with nn.CrossEntropyLoss")


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper  # noqa: F401
    except ImportError as e:
        raise ImportError("cydnn.load_onnx needs the 'onnx' package: pip install onnx  "
                          "(or pip install 'cydnn[onnx]')") from e
    return onnx


def _out_len(size, k, s, p):
    return None if size is None else (size + 2 * p - k) // s + 1


class _Builder:
    """Walks the nodes once, keeping the current tensor's name and per-sample shape."""

    def __init__(self, onnx, graph, path):
        self.onnx, self.path = onnx, path
        self.consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        inputs = [i for i in graph.input if i.name not in self.consts]
        if len(inputs) != 1 or len(graph.output) != 1:
            raise OnnxImportError(f"{path}: a sequential network has one input and one output; this graph "
                                  f"has inputs {[i.name for i in inputs]} and outputs "
                                  f"{[o.name for o in graph.output]}")
        dims = inputs[0].type.tensor_type.shape.dim
        self.batch = dims[0].dim_value if len(dims) and dims[0].HasField("dim_value") else None
        self.shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims[1:])
        self.input_shape = self.shape
        self.current = inputs[0].name
        self.output = graph.output[0].name
        self.used = {name for node in graph.node for name in node.input} | {self.output}
        self.layers = []        # [name, module]
        self.names = set()
        self.counts = {}

    # -- helpers --------------------------------------------------------------
    def fail(self, msg):
        raise OnnxImportError(f"{self.path}: node {self.index} ({self.node.name!r}, {self.node.op_type}): {msg}")

    def attrs(self):
        return {a.name: self.onnx.helper.get_attribute_value(a) for a in self.node.attribute}

    def const(self, k, what):
        inputs = self.node.input
        if len(inputs) <= k or not inputs[k]:
            return None
        if inputs[k] not in self.consts:
            self.fail(f"the {what} ({inputs[k]!r}) must be a constant (an initializer or a Constant node)")
        return self.consts[inputs[k]]

    def need_rank(self, rank, what):
        if len(self.shape) != rank:
            self.fail(f"{what} needs {'(N, C, H, W)' if rank == 3 else '(N, features)'} input, "
                      f"got a per-sample shape {self.shape}")

    def add(self, module, base, weight_input=None):
        name = None
        if weight_input and weight_input.endswith(".weight"):
            name = weight_input[:-len(".weight")]
        if not name or name in self.names:
            self.counts[base] = self.counts.get(base, 0) + 1
            name = f"{base}{self.counts[base]}"
            while name in self.names:
                name += "_"
        self.names.add(name)
        self.layers.append([name, module])

    @staticmethod
    def set_params(layer, weight, bias):
        layer.weight.data = np.ascontiguousarray(weight, dtype=np.float32)
        if bias is not None:
            layer.bias.data = np.ascontiguousarray(bias, dtype=np.float32)
        return layer

    def window(self, a, kernel_default=None):
        kernel = tuple(a.get("kernel_shape", kernel_default or ()))
        if len(kernel) != 2:
            self.fail(f"needs a 2-D kernel_shape, got {list(kernel)}")
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            self.fail(f"auto_pad={a['auto_pad']!r} is not supported (use explicit pads)")
        if any(d != 1 for d in a.get("dilations", [1, 1])):
            self.fail(f"dilations {list(a['dilations'])} are not supported (only 1)")
        pads = list(a.get("pads", [0, 0, 0, 0]))
        if len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3]:
            self.fail(f"pads {pads} are not symmetric (begin == end on each axis is needed)")
        strides = tuple(a.get("strides", [1, 1]))
        c, h, w = self.shape
        out = (_out_len(h, kernel[0], strides[0], pads[0]), _out_len(w, kernel[1], strides[1], pads[1]))
        return kernel, strides, (pads[0], pads[1]), out

    # -- ops ------------------------------------------------------------------
    def Conv(self, a):
        self.need_rank(3, "Conv")
        w, b = self.const(1, "weight"), self.const(2, "bias")
        if w is None or w.ndim != 4:
            self.fail(f"needs a 4-D weight, got {None if w is None else w.shape}")
        if a.get("group", 1) != 1:
            self.fail(f"group={a['group']} is not supported (only 1)")
        kernel, strides, pads, (oh, ow) = self.window(a, w.shape[2:])
        if kernel != w.shape[2:] or (self.shape[0] is not None and self.shape[0] != w.shape[1]):
            self.fail(f"weight {w.shape} does not fit kernel_shape {list(kernel)} and input {self.shape}")
        conv = nn.Conv2d(w.shape[1], w.shape[0], kernel, stride=strides, padding=pads,
                         bias=b is not None, rng=0)
        self.add(self.set_params(conv, w, None if b is None else b.reshape(w.shape[0])), "conv",
                 self.node.input[1])
        self.shape = (w.shape[0], oh, ow)

    def _pool(self, a, cls, base):
        self.need_rank(3, self.node.op_type)
        if a.get("ceil_mode", 0) != 0:
            self.fail("ceil_mode=1 is not supported (only 0, PyTorch's default)")
        if a.get("storage_order", 0) != 0:
            self.fail("storage_order=1 is not supported")
        kernel, strides, pads, (oh, ow) = self.window(a)
        if base == "avgpool" and any(pads) and a.get("count_include_pad", 0) != 1:
            self.fail("count_include_pad=0 with padding is not supported: cydnn's average pooling "
                      "counts the padding (count_include_pad=1)")
        self.add(cls(kernel, stride=strides, padding=pads), base)
        self.shape = (self.shape[0], oh, ow)

    def MaxPool(self, a):
        self._pool(a, nn.MaxPool2d, "maxpool")

    def AveragePool(self, a):
        self._pool(a, nn.AvgPool2d, "avgpool")

    def Relu(self, a):
        self.add(nn.ReLU(), "relu")

    def Tanh(self, a):
        self.add(nn.Tanh(), "tanh")

    def Sigmoid(self, a):
        self.add(nn.Sigmoid(), "sigmoid")

    def _flatten(self):
        size = None if None in self.shape else int(np.prod(self.shape))
        self.add(nn.Flatten(), "flatten")
        self.shape = (size,)

    def Flatten(self, a):
        axis = a.get("axis", 1)
        if axis not in (1, 1 - (len(self.shape) + 1)):
            self.fail(f"axis={axis} is not supported (only 1: (N, ...) -> (N, features))")
        self._flatten()

    def Reshape(self, a):
        target = self.const(1, "shape")
        size = None if None in self.shape else int(np.prod(self.shape))
        t = [] if target is None else [int(v) for v in np.asarray(target).ravel()]
        ok = (len(t) == 2 and (t[0] in (0, -1) or (self.batch is not None and t[0] == self.batch))
              and (t[1] == -1 or (size is not None and t[1] == size)) and (t[0], t[1]) != (-1, -1))
        if not ok:
            self.fail(f"only a reshape to (N, features) is supported, got the shape {t} "
                      f"for a per-sample input {self.shape}")
        self._flatten()

    def _linear(self, w_out_in, bias, weight_input):
        self.need_rank(1, self.node.op_type)
        out_features, in_features = w_out_in.shape
        if self.shape[0] is not None and self.shape[0] != in_features:
            self.fail(f"weight for {in_features} input features, but the input has {self.shape[0]}")
        if bias is not None:
            bias = np.asarray(bias)
            if bias.size == 1:
                bias = np.full(out_features, bias.item(), dtype=np.float32)
            elif bias.size != out_features or bias.ndim > 2:
                self.fail(f"bias of shape {bias.shape} does not fit {out_features} outputs")
            bias = bias.reshape(out_features)
        layer = nn.Linear(in_features, out_features, bias=bias is not None, rng=0)
        self.add(self.set_params(layer, w_out_in, bias), "fc", weight_input)
        self.shape = (out_features,)

    def Gemm(self, a):
        w, c = self.const(1, "weight (B)"), self.const(2, "bias (C)")
        if a.get("transA", 0) != 0:
            self.fail("transA=1 is not supported")
        if w is None or w.ndim != 2:
            self.fail(f"needs a 2-D weight, got {None if w is None else w.shape}")
        w = w if a.get("transB", 0) else w.T
        alpha, beta = a.get("alpha", 1.0), a.get("beta", 1.0)
        w = w if alpha == 1.0 else w * np.float32(alpha)
        c = c if c is None or beta == 1.0 else c * np.float32(beta)
        self._linear(w, c, self.node.input[1])

    def MatMul(self, a):
        w = self.const(1, "weight")
        if w is None or w.ndim != 2:
            self.fail(f"needs a constant 2-D weight, got {None if w is None else w.shape}")
        self._linear(w.T, None, self.node.input[1])
        self.matmul_output = self.node.output[0]

    def Add(self, a):
        inputs = list(self.node.input)
        last = self.layers[-1][1] if self.layers else None
        if (len(inputs) != 2 or self.current not in inputs or getattr(self, "matmul_output", None) != self.current
                or not isinstance(last, nn.Linear) or last.bias is not None):
            self.fail("Add is supported only as the bias right after a MatMul")
        other = inputs[1] if inputs[0] == self.current else inputs[0]
        if other not in self.consts:
            self.fail(f"the bias ({other!r}) must be a constant")
        b = np.asarray(self.consts[other])
        if b.size != last.out_features and b.size != 1:
            self.fail(f"bias of shape {b.shape} does not fit {last.out_features} outputs")
        last.bias = nn.Parameter(np.broadcast_to(b.reshape(-1), (last.out_features,)).astype(np.float32))

    def Softmax(self, a):
        self.need_rank(1, "Softmax")
        if a.get("axis", -1) not in (1, -1):
            self.fail(f"axis={a['axis']} is not supported (only the class axis, 1 or -1)")
        self.add(Softmax(), "softmax")

    def Identity(self, a):
        pass

    def Dropout(self, a):
        mode = self.const(2, "training_mode")
        if mode is not None and bool(np.asarray(mode)):
            self.fail("training_mode=true: a Dropout that drops at inference is not supported")

    # -- the walk -------------------------------------------------------------
    def run(self, nodes):
        for self.index, self.node in enumerate(nodes):
            op = self.node.op_type
            if self.node.domain not in ("", "ai.onnx") or op not in SUPPORTED_OPS:
                raise OnnxImportError(
                    f"{self.path}: unsupported op {op!r}" + (f" (domain {self.node.domain!r})" if self.node.domain
                                                           else "")
                    + f" at node {self.index} ({self.node.name!r}); cydnn.load_onnx supports "
                    + ", ".join(SUPPORTED_OPS))
            if op == "Constant":
                value = self.attrs().get("value")
                if value is None:
                    self.fail("only Constant nodes with a tensor 'value' are supported")
                self.consts[self.node.output[0]] = self.onnx.numpy_helper.to_array(value)
                continue
            if op != "Add" and (not self.node.input or self.node.input[0] != self.current):
                self.fail(f"reads {list(self.node.input)[:1]}, not the previous node's output "
                          f"{self.current!r}: only a chain of layers is supported")
            for extra in self.node.output[1:]:
                if extra and extra in self.used:
                    self.fail(f"its second output {extra!r} is used; only the first output is supported")
            getattr(self, op)(self.attrs())
            self.current = self.node.output[0]
        if self.current != self.output:
            raise OnnxImportError(f"{self.path}: the graph's output {self.output!r} is not the last "
                                  f"layer's output {self.current!r}")
        return self.layers


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


def load_onnx(path, device="cpu", lenet=True):
    """The network in the ONNX file at ``path`` as cydnn layers, on ``device``.

    Returns a :class:`cydnn.models.LeNet5` when the graph is exactly LeNet-5
    and ``lenet`` is true (a trailing Softmax dropped; cydnn's preprocessing:
    see the module docstring), otherwise an ``nn.Sequential`` of the layers in
    the graph's order (a Softmax kept as a :class:`Softmax` layer).  The model
    is in training mode, as any new module.  Raises :class:`OnnxImportError`
    for an unsupported op (naming it, its node index and name), attribute or
    graph shape, and ``ImportError`` when the ``onnx`` package is missing.
    """
    import os
    onnx = _onnx()
    path = os.fspath(path)
    try:
        proto = onnx.load(path)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise OnnxImportError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    builder = _Builder(onnx, proto.graph, path)
    layers = builder.run(proto.graph.node)
    if not layers:
        raise OnnxImportError(f"{path}: the graph has no layers")
    model = _as_lenet(layers, builder.input_shape) if lenet else None
    if model is None:
        model = nn.Sequential(OrderedDict((name, module) for name, module in layers))
    return model.to(device)
