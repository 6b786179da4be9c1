"""What :func:`cydnn.load_onnx` checks in an ONNX file before building any layer.

The file (its size against protobuf's 2 GiB limit, before it is read), the
opsets it declares, the graph's structure (every value defined once, before it
is read: no cycle, no duplicate initializer; input dims not negative) and each
tensor the importer uses (numeric, stored inside the file, dims that agree
with its data, at most MAX_TENSOR_ELEMENTS values, integers that float32
holds exactly).  Every failure is an :class:`OnnxImportError` naming the file,
the node or tensor, and the problem.
"""
import math
import os

import numpy as np

from ._filesafe import check_lossless

__all__ = ["OnnxImportError", "check_file", "check_opset", "check_graph", "tensor_array", "as_weight",
           "MAX_ONNX_BYTES", "MIN_OPSET", "MAX_OPSET", "MAX_NODES", "MAX_TENSOR_ELEMENTS"]

#: Largest file read: protobuf cannot parse a message of 2 GiB or more.
MAX_ONNX_BYTES = (2 << 30) - 1
#: The default-domain opsets whose semantics of the supported ops the importer follows (opset 7
#: dropped Gemm's and Add's ``broadcast`` attribute; newer opsets than MAX_OPSET are refused,
#: since an op may have changed meaning there).
MIN_OPSET, MAX_OPSET = 7, 22
#: Most nodes, and most values in one tensor, accepted.
MAX_NODES = 10_000
MAX_TENSOR_ELEMENTS = 1 << 29

# TensorProto.DataType -> (numpy dtype, the repeated field holding the values when not raw_data).
_TYPES = {1: (np.float32, "float_data"), 2: (np.uint8, "int32_data"), 3: (np.int8, "int32_data"),
          4: (np.uint16, "int32_data"), 5: (np.int16, "int32_data"), 6: (np.int32, "int32_data"),
          7: (np.int64, "int64_data"), 9: (np.bool_, "int32_data"), 10: (np.float16, "int32_data"),
          11: (np.float64, "double_data"), 12: (np.uint32, "uint64_data"), 13: (np.uint64, "uint64_data")}
_NAMES = {8: "string", 14: "complex64", 15: "complex128", 16: "bfloat16"}


class OnnxImportError(ValueError):
    """An ONNX file that cydnn cannot build: unreadable, invalid, or an unsupported op,
    attribute or structure."""


def check_file(path):
    """Refuse a file over MAX_ONNX_BYTES from its size, before reading it."""
    size = os.path.getsize(path)        # a missing file is a FileNotFoundError
    if size > MAX_ONNX_BYTES:
        raise OnnxImportError(f"{path}: {size} bytes, over protobuf's 2 GiB limit for one message "
                              f"(MAX_ONNX_BYTES); models that large keep their weights as external data, "
                              f"which cydnn does not load")


def check_opset(proto, path):
    """The default domain's opset must lie in [MIN_OPSET, MAX_OPSET]."""
    versions = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise OnnxImportError(f"{path}: the model declares no opset for the default ONNX domain")
    for version in versions:
        if version > MAX_OPSET:
            raise OnnxImportError(f"{path}: opset {version} is newer than this importer knows (at most "
                                  f"{MAX_OPSET}); export with opset_version={MAX_OPSET} or lower")
        if version < MIN_OPSET:
            raise OnnxImportError(f"{path}: opset {version} is older than this importer reads "
                                  f"(at least {MIN_OPSET}); export with a newer opset")


def _dims(value_info):
    shape = value_info.type.tensor_type.shape
    return [(d.dim_value if d.HasField("dim_value") else None) for d in shape.dim]


def check_graph(graph, path):
    """Every value defined once and before it is read; initializers unique; no negative input dim."""
    if len(graph.node) > MAX_NODES:
        raise OnnxImportError(f"{path}: {len(graph.node)} nodes, more than MAX_NODES ({MAX_NODES})")
    defined = {}
    for init in graph.initializer:
        if init.name in defined:
            raise OnnxImportError(f"{path}: initializer {init.name!r} is given twice")
        defined[init.name] = "an initializer"
    for value in graph.input:
        if value.name in defined and defined[value.name] != "an initializer":
            raise OnnxImportError(f"{path}: graph input {value.name!r} is declared twice")
        defined.setdefault(value.name, "a graph input")
        for d in _dims(value):
            if d is not None and d < 0:
                raise OnnxImportError(f"{path}: graph input {value.name!r} has a negative dimension "
                                      f"{_dims(value)}")
    for index, node in enumerate(graph.node):
        where = f"{path}: node {index} ({node.name!r}, {node.op_type})"
        for name in node.input:
            if name and name not in defined:
                raise OnnxImportError(f"{where} reads {name!r}, which no earlier node, input or initializer "
                                      f"defines (a cycle, or nodes out of order)")
        for name in node.output:
            if name and name in defined:
                raise OnnxImportError(f"{where} writes {name!r}, which is already {defined[name]}: "
                                      f"each value must be defined once")
            if name:
                defined[name] = f"the output of node {index}"
    for value in graph.output:
        if value.name not in defined:
            raise OnnxImportError(f"{path}: the graph's output {value.name!r} is never computed")


def tensor_array(onnx, tensor, where):
    """The numpy array of a TensorProto, after checking what it declares: a numeric type, data
    inside the file, non-negative dims whose product (at most MAX_TENSOR_ELEMENTS) is the number
    of values it holds."""
    what = f"{where}: tensor {tensor.name!r}"
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.external_data:
        raise OnnxImportError(f"{what} keeps its data in an external file, which cydnn never reads; "
                              f"save the model with its weights inside (onnx.save(..., "
                              f"save_as_external_data=False))")
    if tensor.data_type not in _TYPES:
        kind = _NAMES.get(tensor.data_type, f"data type {tensor.data_type}")
        raise OnnxImportError(f"{what} is a {kind} tensor; only real numeric tensors are read")
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise OnnxImportError(f"{what} has a negative dimension in {dims}")
    count = math.prod(dims)
    if count > MAX_TENSOR_ELEMENTS:
        raise OnnxImportError(f"{what} declares {dims} = {count} values, more than MAX_TENSOR_ELEMENTS "
                              f"({MAX_TENSOR_ELEMENTS})")
    dtype, field = _TYPES[tensor.data_type]
    if tensor.HasField("raw_data"):
        held = len(tensor.raw_data) / np.dtype(dtype).itemsize
    else:
        held = len(getattr(tensor, field))
    if held != count:
        raise OnnxImportError(f"{what}: dims {dims} declare {count} values, but its data holds {held:g}")
    try:
        return onnx.numpy_helper.to_array(tensor)
    except Exception as e:      # onnx raises ValueError, TypeError, ... for a malformed tensor
        raise OnnxImportError(f"{what} cannot be read ({type(e).__name__}: {e})") from e


def as_weight(array, what):
    """``array`` as float32 for a layer: a real numeric array whose integers float32 holds exactly.
    Its shape is kept, a 0-d scalar included (``np.ascontiguousarray`` would make it 1-D, and a
    scalar where ONNX wants a 1-D tensor would pass the layer's shape checks)."""
    array = np.asarray(array)
    if array.dtype.kind not in "fiu":
        raise OnnxImportError(f"{what} has dtype {array.dtype}; a weight must be a real number array")
    check_lossless(array, OnnxImportError, what)
    return np.asarray(array, dtype=np.float32, order="C")
