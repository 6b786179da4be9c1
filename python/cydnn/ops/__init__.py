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


_MODULES = {"cpu": "cydnn.ops.cpu", "cuda": "cydnn.ops.cuda"}
_loaded = {}  # device -> module, imported on first use (every layer asks, on every call)


def backend(device):
    """The ops module for a device name: ``"cpu"`` or ``"cuda"``."""
    module = _loaded.get(device) if isinstance(device, str) else None
    if module is None:
        if not isinstance(device, str) or device not in _MODULES:
            raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")
        module = _loaded[device] = importlib.import_module(_MODULES[device])
    return module


def backend_of(array):
    """The ops module that owns ``array``: cpu for numpy arrays, cuda for DeviceArrays."""
    return backend("cpu" if isinstance(array, np.ndarray) else "cuda")
