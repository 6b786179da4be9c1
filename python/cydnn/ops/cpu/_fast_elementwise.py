"""The compiled ReLU of ``elementwise.relu_forward`` / ``relu_backward`` (arguments already checked).

Kept apart from elementwise.py so that the numpy twin there stays whole-array
numpy; see ``kernels`` for the choice between the two.
"""
import numpy as np

from . import _threads, kernels

__all__ = ["compiled", "relu_forward", "relu_backward"]

compiled = kernels.active


def relu_forward(x):
    """``y = max(x, 0)`` (as ``np.maximum``: NaN kept, -0.0 to 0); returns (y, y)."""
    x = np.ascontiguousarray(x)
    y = np.empty(x.shape, dtype=x.dtype)
    kernels.active().relu_forward(x.reshape(-1), y.reshape(-1), _threads.omp_threads(x.size))
    return y, y


def relu_backward(dy, y):
    """``dx = dy * (y > 0)``, a product as in the twin."""
    dy, y = np.ascontiguousarray(dy), np.ascontiguousarray(y)
    dx = np.empty(dy.shape, dtype=dy.dtype)
    kernels.active().relu_backward(dy.reshape(-1), y.reshape(-1), dx.reshape(-1), _threads.omp_threads(dy.size))
    return dx
