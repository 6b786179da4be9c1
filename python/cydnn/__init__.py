"""cydnn: a small deep-learning framework on cuDNN and cuBLAS, with a numpy twin of every op.

    import cydnn
    cydnn.cuda.is_available()            # False on a machine without a GPU
    x = cydnn.to_device(np_array)        # a DeviceArray; x.numpy() copies back
    y, cache = cydnn.ops.cuda.relu_forward(x)
    y, cache = cydnn.ops.cpu.relu_forward(np_array)   # the numpy twin

See README.md for training LeNet-5 on MNIST.
"""
from cydnn import _libs

_libs.preload()  # the CUDA runtime, cuBLAS and cuDNN, before the extension needs them

from cydnn import _C, cuda, ops  # noqa: E402
import cydnn.ops.cpu  # noqa: E402,F401  (so that cydnn.ops.cpu and cydnn.ops.cuda are attributes)
import cydnn.ops.cuda  # noqa: E402,F401
from cydnn._C import DeviceArray, empty, to_device, zeros  # noqa: E402
from cydnn.errors import (  # noqa: E402
    CublasError, CudaError, CudnnError, CydnnError, DeviceUnavailableError, InvalidArgumentError,
    OutOfMemoryError,
)

__version__ = "0.1.0"

__all__ = [
    "DeviceArray", "to_device", "empty", "zeros", "cuda", "ops", "versions",
    "CydnnError", "CudaError", "CudnnError", "CublasError", "OutOfMemoryError",
    "DeviceUnavailableError", "InvalidArgumentError",
]


def versions():
    """Versions of cydnn and of the CUDA runtime, driver, cuDNN and cuBLAS in use."""
    return {"cydnn": __version__, **cuda.versions()}


def __getattr__(name):
    # The layer API, models and datasets load on first use (they pull in more).
    import importlib
    if name in ("nn", "optim", "models", "datasets", "serialization", "train", "interop", "onnx_import",
                "compiler", "loop"):
        return importlib.import_module(f"cydnn.{name}")
    if name == "compile":                                       # any Sequential -> plan, graph, fused kernels
        from cydnn.compiler import compile
        return compile
    if name in ("load", "save"):                                # checkpoints (free functions: a model
        from cydnn import serialization                         # never imports the layers above it)
        return getattr(serialization, name)
    if name in ("load_pytorch_weights", "export_weights"):     # weights from/for PyTorch, no torch needed
        return getattr(importlib.import_module("cydnn.interop"), name)
    if name == "load_onnx":                                     # needs the onnx package when called
        from cydnn.onnx_import import load_onnx
        return load_onnx
    raise AttributeError(f"module 'cydnn' has no attribute {name!r}")
