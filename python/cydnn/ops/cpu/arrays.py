"""Array helpers of the cpu backend (numpy arrays are its device arrays)."""
import numpy as np

__all__ = ["asarray", "to_numpy", "empty", "zeros", "zeros_like", "FLOATS"]

#: The dtypes the cpu ops compute in (the GPU module accepts float32 only).
FLOATS = (np.float32, np.float64)


def asarray(a, dtype=None):
    """``a`` as a C-contiguous numpy array (no copy when it already is one of ``dtype``)."""
    return np.asarray(a, dtype=dtype, order="C")


def to_numpy(a):
    """``a`` as a numpy array (the identity for numpy arrays)."""
    return np.asarray(a)


def empty(shape, dtype="float32"):
    """An uninitialised array."""
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype="float32"):
    """An array of zeros."""
    return np.zeros(shape, dtype=dtype)


def zeros_like(a):
    """Zeros with ``a``'s shape and dtype (C-contiguous)."""
    return np.zeros(a.shape, dtype=a.dtype)
