"""Layer ops, in two modules with the same functions and signatures.

- ``cydnn.ops.cpu``:  the numpy twin of every op -- the reference and the fallback.
- ``cydnn.ops.cuda``: the same ops on the GPU, through the Cython layer into the
  CUDA library in ``cpp/`` (cuDNN, cuBLAS and custom kernels).

Every function accepts the array kind of its module (numpy arrays for cpu;
``DeviceArray`` or numpy for cuda) and returns the kind it was given.
"""
import importlib

import numpy as np

__all__ = ["backend", "backend_of"]


def backend(device):
    """The ops module for a device name: ``"cpu"`` or ``"cuda"``."""
    if device == "cpu":
        return importlib.import_module("cydnn.ops.cpu")
    if device == "cuda":
        return importlib.import_module("cydnn.ops.cuda")
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")


def backend_of(array):
    """The ops module that owns ``array``: cpu for numpy arrays, cuda for DeviceArrays."""
    if isinstance(array, np.ndarray):
        return backend("cpu")
    return backend("cuda")
