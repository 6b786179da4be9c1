"""The walk behind :func:`cydnn.load_onnx`: one cydnn layer per supported ONNX node.

:class:`Builder` visits the nodes of a graph that :mod:`cydnn.onnx_checks`
accepted, keeping the current value's name and per-sample shape, and checks
each node's attributes and constants before it builds a layer: integer
attributes of the right length and sign (a stride of 0 is refused), a window
that fits the input (naming the node), weights that are real numbers, a bias of
the right length, layer names from initializers that are valid
(:func:`cydnn._names.check_name`: ``training.weight`` cannot make a layer
that shadows ``Module.training``).  Every failure is an
:class:`~cydnn.onnx_checks.OnnxImportError` naming the node.
"""
import math

import numpy as np

from . import nn, ops
from ._names import check_name
from .onnx_checks import OnnxImportError, as_weight, tensor_array

__all__ = ["Builder", "Softmax", "SUPPORTED_OPS"]

SUPPORTED_OPS = ("Conv", "Relu", "Tanh", "Sigmoid", "MaxPool", "AveragePool", "Flatten", "Reshape",
                 "Gemm", "MatMul", "Add", "Softmax", "Identity", "Dropout", "Constant")
# Issue 16's layers, supported where this cydnn's nn has them (the module that adds them is separate).
_OPTIONAL_OPS = {"BatchNormalization": "BatchNorm2d", "GlobalAveragePool": "AdaptiveAvgPool2d",
                 "LeakyRelu": "LeakyReLU"}
SUPPORTED_OPS += tuple(op for op, layer in _OPTIONAL_OPS.items() if hasattr(nn, layer))
#: Largest input dimension accepted from the graph's declared input shape.
MAX_DIM = 1 << 31


class Softmax(nn.Module):
    """Row-wise softmax of (N, C), for inference: ``ops.softmax``.  Backward is refused:
    train on logits with ``nn.CrossEntropyLoss``, which includes the softmax."""

    def forward(self, x):
        return ops.backend_of(x).softmax(x)

    def backward(self, dy):
        raise RuntimeError("Softmax is an inference layer (imported from ONNX) and has no backward; "
                           "drop it and train the logits with nn.CrossEntropyLoss")


def _out_len(size, k, s, p):
    return None if size is None else (size + 2 * p - k) // s + 1


class Builder:
    """Walks the nodes once, keeping the current tensor's name and per-sample shape."""

    def __init__(self, onnx, graph, path):
        self.onnx, self.path = onnx, path
        self.index, self.node = None, None
        self.tensors = {t.name: t for t in graph.initializer}      # converted on first use
        self.consts = {}
        inputs = [i for i in graph.input if i.name not in self.tensors]
        if len(inputs) != 1 or len(graph.output) != 1:
            raise OnnxImportError(f"{path}: a sequential network has one input and one output; this graph "
                                  f"has inputs {[i.name for i in inputs][:10]} and outputs "
                                  f"{[o.name for o in graph.output][:10]}")
        dims = [d.dim_value if d.HasField("dim_value") else None
                for d in inputs[0].type.tensor_type.shape.dim]
        if any(d is not None and not 0 < d < MAX_DIM for d in dims):
            raise OnnxImportError(f"{path}: graph input {inputs[0].name!r} has dimensions {dims}: each must "
                                  f"lie in [1, {MAX_DIM})")
        self.batch = dims[0] if dims else None
        self.shape = tuple(dims[1:])
        self.input_shape = self.shape
        self.current = inputs[0].name
        self.output = graph.output[0].name
        self.used = {name for node in graph.node for name in node.input} | {self.output}
        self.layers = []        # [name, module]
        self.names = set()
        self.counts = {}
        self.matmul_output = None

    # -- helpers --------------------------------------------------------------
    def where(self):
        return f"{self.path}: node {self.index} ({self.node.name!r}, {self.node.op_type})"

    def fail(self, msg):
        raise OnnxImportError(f"{self.where()}: {msg}")

    def attrs(self):
        try:
            return {a.name: self.onnx.helper.get_attribute_value(a) for a in self.node.attribute}
        except Exception as e:      # an attribute of an unknown or malformed type
            self.fail(f"cannot read its attributes ({type(e).__name__}: {e})")

    def ints(self, a, name, default, length, minimum):
        """Attribute ``name``: ``length`` integers, each >= ``minimum``."""
        value = a.get(name, default)
        if (not isinstance(value, (list, tuple)) or len(value) != length
                or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in value)):
            self.fail(f"{name}={value!r:.100} must be {length} integers >= {minimum}")
        return tuple(value)

    def int_attr(self, a, name, default, allowed=None):
        value = a.get(name, default)
        if not isinstance(value, int) or (allowed is not None and value not in allowed):
            self.fail(f"{name}={value!r:.100} is not supported" + (f" (only {list(allowed)})" if allowed else ""))
        return value

    def float_attr(self, a, name, default):
        value = a.get(name, default)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(f"{name}={value!r:.100} must be a finite number")
        return float(value)

    def const(self, k, what):
        """The constant that input ``k`` names, or None when there is no input ``k``."""
        inputs = self.node.input
        if len(inputs) <= k or not inputs[k]:
            return None
        name = inputs[k]
        if name not in self.consts:
            if name not in self.tensors:
                self.fail(f"the {what} ({name!r}) must be a constant (an initializer or a Constant node)")
            self.consts[name] = tensor_array(self.onnx, self.tensors[name], self.where())
        return self.consts[name]

    def weight(self, k, what):
        value = self.const(k, what)
        return None if value is None else as_weight(value, f"{self.where()}: the {what} ({self.node.input[k]!r})")

    def need_rank(self, rank, what):
        if len(self.shape) != rank:
            self.fail(f"{what} needs {'(N, C, H, W)' if rank == 3 else '(N, features)'} input, "
                      f"got a per-sample shape {self.shape}")

    def add(self, module, base, weight_input=None):
        name = None
        if weight_input and weight_input.endswith(".weight"):
            name = check_name(weight_input[:-len(".weight")], OnnxImportError,
                              f"{self.where()}: initializer {weight_input!r}", what="layer")
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

    def window(self, a, kernel_default=None, pool=False):
        """kernel, strides, pads, output size: checked, and checked to fit the input."""
        kernel = self.ints(a, "kernel_shape", kernel_default, 2, 1)
        if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
            self.fail(f"auto_pad={a['auto_pad']!r} is not supported (use explicit pads)")
        if any(d != 1 for d in self.ints(a, "dilations", (1, 1), 2, 1)):
            self.fail(f"dilations {list(a['dilations'])} are not supported (only 1)")
        pads = list(self.ints(a, "pads", (0, 0, 0, 0), 4, 0))
        if pads[0] != pads[2] or pads[1] != pads[3]:
            self.fail(f"pads {pads} are not symmetric (begin == end on each axis is needed)")
        strides = self.ints(a, "strides", (1, 1), 2, 1)
        if pool and any(p > k // 2 for p, k in zip(pads, kernel)):
            self.fail(f"pads {pads} must be at most half the kernel {list(kernel)}")
        c, h, w = self.shape
        for size, k, p, axis in ((h, kernel[0], pads[0], "height"), (w, kernel[1], pads[1], "width")):
            if size is not None and size + 2 * p < k:
                self.fail(f"the kernel {list(kernel)} does not fit the input of {axis} {size} "
                          f"padded by {p} (per-sample input {self.shape})")
        out = (_out_len(h, kernel[0], strides[0], pads[0]), _out_len(w, kernel[1], strides[1], pads[1]))
        return kernel, strides, (pads[0], pads[1]), out

    # -- ops ------------------------------------------------------------------
    def Conv(self, a):
        self.need_rank(3, "Conv")
        w, b = self.weight(1, "weight"), self.weight(2, "bias")
        if w is None or w.ndim != 4 or 0 in w.shape:
            self.fail(f"needs a 4-D weight without empty axes, got {None if w is None else w.shape}")
        self.int_attr(a, "group", 1, allowed=(1,))
        kernel, strides, pads, (oh, ow) = self.window(a, w.shape[2:])
        if kernel != w.shape[2:] or (self.shape[0] is not None and self.shape[0] != w.shape[1]):
            self.fail(f"weight {w.shape} does not fit kernel_shape {list(kernel)} and input {self.shape}")
        if b is not None and b.shape != (w.shape[0],):
            self.fail(f"bias of shape {b.shape} does not fit {w.shape[0]} output channels (it must be 1-D)")
        conv = nn.Conv2d(w.shape[1], w.shape[0], kernel, stride=strides, padding=pads,
                         bias=b is not None, rng=0)
        self.add(self.set_params(conv, w, b), "conv", self.node.input[1])
        self.shape = (w.shape[0], oh, ow)

    def _pool(self, a, cls, base):
        self.need_rank(3, self.node.op_type)
        self.int_attr(a, "ceil_mode", 0, allowed=(0,))
        self.int_attr(a, "storage_order", 0, allowed=(0,))
        kernel, strides, pads, (oh, ow) = self.window(a, pool=True)
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
        size = None if None in self.shape else math.prod(self.shape)
        self.add(nn.Flatten(), "flatten")
        self.shape = (size,)

    def Flatten(self, a):
        axis = self.int_attr(a, "axis", 1)
        if axis not in (1, 1 - (len(self.shape) + 1)):
            self.fail(f"axis={axis} is not supported (only 1: (N, ...) -> (N, features))")
        self._flatten()

    def Reshape(self, a):
        target = self.const(1, "shape")
        size = None if None in self.shape else math.prod(self.shape)
        t = [] if target is None or target.dtype.kind not in "iu" else [int(v) for v in target.ravel()[:3]]
        ok = (len(t) == 2 and (t[0] in (0, -1) or (self.batch is not None and t[0] == self.batch))
              and (t[1] == -1 or (size is not None and t[1] == size)) and (t[0], t[1]) != (-1, -1))
        if not ok:
            self.fail(f"only a reshape to (N, features) is supported, got the shape "
                      f"{t if target is None or target.dtype.kind in 'iu' else target.dtype} "
                      f"for a per-sample input {self.shape}")
        self._flatten()

    def row_bias(self, c, out_features, what):
        """``c`` as one bias per output, (out_features,), when ONNX broadcasting adds the same
        vector to every batch row: shapes (), (1,), (out,), (1, 1), (1, out).  A C of shape
        (M, 1) or (M, out) adds one value per row (sample), which nn.Linear cannot express."""
        if c is None:
            return None
        if c.ndim > 2 or (c.ndim == 2 and c.shape[0] != 1) or (c.ndim >= 1 and c.shape[-1] not in (1, out_features)):
            self.fail(f"the {what} of shape {c.shape} does not broadcast as one bias per output to "
                      f"(batch, {out_features}) (ONNX broadcasting: a leading axis of size M adds a "
                      f"different value to each batch row); use shape ({out_features},) or (1, {out_features})")
        return np.broadcast_to(c.reshape(-1) if c.ndim else c, (out_features,)).astype(np.float32)

    def _linear(self, w_out_in, bias, weight_input):
        self.need_rank(1, self.node.op_type)
        out_features, in_features = w_out_in.shape
        if 0 in w_out_in.shape:
            self.fail(f"weight of shape {w_out_in.shape} has an empty axis")
        if self.shape[0] is not None and self.shape[0] != in_features:
            self.fail(f"weight for {in_features} input features, but the input has {self.shape[0]}")
        bias = self.row_bias(bias, out_features, "bias (C)")
        layer = nn.Linear(in_features, out_features, bias=bias is not None, rng=0)
        self.add(self.set_params(layer, w_out_in, bias), "fc", weight_input)
        self.shape = (out_features,)

    def Gemm(self, a):
        w, c = self.weight(1, "weight (B)"), self.weight(2, "bias (C)")
        self.int_attr(a, "transA", 0, allowed=(0,))
        trans_b = self.int_attr(a, "transB", 0, allowed=(0, 1))
        if w is None or w.ndim != 2:
            self.fail(f"needs a 2-D weight, got {None if w is None else w.shape}")
        w = w if trans_b else w.T
        alpha, beta = self.float_attr(a, "alpha", 1.0), self.float_attr(a, "beta", 1.0)
        w = w if alpha == 1.0 else w * np.float32(alpha)
        c = c if c is None or beta == 1.0 else c * np.float32(beta)
        self._linear(w, c, self.node.input[1])

    def MatMul(self, a):
        w = self.weight(1, "weight")
        if w is None or w.ndim != 2:
            self.fail(f"needs a constant 2-D weight, got {None if w is None else w.shape}")
        self._linear(w.T, None, self.node.input[1])
        self.matmul_output = self.node.output[0]

    def Add(self, a):
        inputs = list(self.node.input)
        last = self.layers[-1][1] if self.layers else None
        if (len(inputs) != 2 or self.current not in inputs or self.matmul_output != self.current
                or not isinstance(last, nn.Linear) or last.bias is not None):
            self.fail("Add is supported only as the bias right after a MatMul")
        k = 1 if inputs[0] == self.current else 0
        if inputs[k] not in self.tensors and inputs[k] not in self.consts:
            self.fail(f"the bias ({inputs[k]!r}) must be a constant")
        bias = self.row_bias(self.weight(k, "bias"), last.out_features, "bias")
        last.bias = nn.Parameter(bias)

    def Softmax(self, a):
        self.need_rank(1, "Softmax")
        if self.int_attr(a, "axis", -1) not in (1, -1):
            self.fail(f"axis={a['axis']} is not supported (only the class axis, 1 or -1)")
        self.add(Softmax(), "softmax")

    def LeakyRelu(self, a):
        self.add(nn.LeakyReLU(negative_slope=self.float_attr(a, "alpha", 0.01)), "leakyrelu")

    def GlobalAveragePool(self, a):
        self.need_rank(3, "GlobalAveragePool")
        self.add(nn.AdaptiveAvgPool2d(1), "avgpool")
        self.shape = (self.shape[0], 1, 1)

    def BatchNormalization(self, a):
        """Inference batch norm: ``y = scale (x - mean) / sqrt(var + epsilon) + B`` per channel, as
        nn.BatchNorm2d in eval mode (ONNX momentum m is PyTorch's 1 - m)."""
        self.need_rank(3, "BatchNormalization")
        if self.int_attr(a, "training_mode", 0) != 0 or a.get("spatial", 1) != 1:
            self.fail("only inference batch norm (training_mode=0, spatial=1) is supported")
        eps = self.float_attr(a, "epsilon", 1e-5)
        momentum = self.float_attr(a, "momentum", 0.9)
        if not (eps > 0 and 0 <= momentum <= 1):
            self.fail(f"epsilon={eps} must be > 0 and momentum={momentum} in [0, 1]")
        names = ("scale", "bias (B)", "mean", "var")
        values = [self.weight(k + 1, what) for k, what in enumerate(names)]
        channels = self.shape[0]
        for what, v in zip(names, values):
            if v is None or v.ndim != 1 or (channels is not None and v.shape[0] != channels) \
                    or v.shape[0] != values[0].shape[0]:
                self.fail(f"the {what} must be a constant of shape (channels,) = ({channels},), got "
                          f"{None if v is None else v.shape}")
        if (values[3] < 0).any():
            self.fail("the running variance has negative values")
        layer = nn.BatchNorm2d(values[0].shape[0], eps=eps, momentum=1.0 - momentum)
        layer.weight.data, layer.bias.data = values[0], values[1]
        layer.running_mean, layer.running_var = values[2], values[3]
        self.add(layer, "bn", self.node.input[1])

    def Identity(self, a):
        pass

    def Dropout(self, a):
        mode = self.const(2, "training_mode")
        if mode is not None and (mode.size != 1 or bool(mode.ravel()[0])):
            self.fail("training_mode=true: a Dropout that drops at inference is not supported")

    def Constant(self, a):
        value = a.get("value")
        if len(a) != 1 or not isinstance(value, self.onnx.TensorProto):
            self.fail("only Constant nodes with a tensor 'value' are supported")
        value.name = self.node.output[0]
        self.consts[self.node.output[0]] = tensor_array(self.onnx, value, self.where())

    # -- the walk -------------------------------------------------------------
    def run(self, nodes):
        for self.index, self.node in enumerate(nodes):
            op = self.node.op_type
            if self.node.domain not in ("", "ai.onnx") or op not in SUPPORTED_OPS:
                raise OnnxImportError(
                    f"{self.path}: unsupported op {op!r:.100}" + (f" (domain {self.node.domain!r:.100})"
                                                                 if self.node.domain else "")
                    + f" at node {self.index} ({self.node.name!r:.100}); cydnn.load_onnx supports "
                    + ", ".join(SUPPORTED_OPS))
            if op == "Constant":
                self.Constant(self.attrs())
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
