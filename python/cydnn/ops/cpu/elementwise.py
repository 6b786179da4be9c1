"""Elementwise layer ops: activations and dropout (and the counter-based hash behind dropout)."""
import numpy as np

from .. import _check
from . import _fast_elementwise
from .arrays import FLOATS as _FLOATS

__all__ = ["relu_forward", "relu_backward", "leaky_relu_forward", "leaky_relu_backward", "tanh_forward", "tanh_backward", "sigmoid_forward",
           "sigmoid_backward", "splitmix64", "counter_hash", "dropout_forward", "dropout_backward"]


def relu_forward(x):
    """``y = max(x, 0)``; the cache is y."""
    _check.check_elementwise("relu_forward", x, _FLOATS)
    if _fast_elementwise.compiled() is not None:
        return _fast_elementwise.relu_forward(x)
    y = np.zeros(x.shape, dtype=x.dtype)
    np.maximum(x, y, out=y)  # against an array of zeros: numpy's loop for a scalar 0 is ~3x slower
    return y, y


def relu_backward(dy, cache):
    """``dx = dy * (y > 0)``."""
    y = cache
    _check.check_same_shape("relu_backward", "dy", dy, "y", y)
    if _fast_elementwise.compiled() is not None:
        return _fast_elementwise.relu_backward(dy, y)
    return dy * (y > 0)


def leaky_relu_forward(x, negative_slope=0.01):
    """``y = x if x > 0 else negative_slope * x`` (as PyTorch's LeakyReLU).

    The cache is ``(x, negative_slope)``: the backward needs x (not y, since
    the slope may be 0 or negative) and the slope, and gets both from the
    cache, so that ``leaky_relu_backward(dy, cache)`` needs no other argument.
    """
    slope = _check.check_leaky_relu(x, negative_slope, _FLOATS)
    return np.where(x > 0, x, x.dtype.type(slope) * x), (x, slope)


def leaky_relu_backward(dy, cache):
    """``dx = dy if x > 0 else negative_slope * dy``."""
    x, slope = cache
    _check.check_same_shape("leaky_relu_backward", "dy", dy, "x", x)
    return np.where(x > 0, dy, dy.dtype.type(slope) * dy)


def tanh_forward(x):
    """``y = tanh(x)``; the cache is y."""
    _check.check_elementwise("tanh_forward", x, _FLOATS)
    y = np.tanh(x)
    return y, y


def tanh_backward(dy, cache):
    """``dx = dy * (1 - y^2)``."""
    y = cache
    _check.check_same_shape("tanh_backward", "dy", dy, "y", y)
    return dy * (1 - y * y)


def sigmoid_forward(x):
    """``y = 1 / (1 + exp(-x))``; the cache is y.

    Evaluated as ``1/(1+e)`` for x >= 0 and ``e/(1+e)`` for x < 0 with
    ``e = exp(-|x|) <= 1``, so exp never overflows.
    """
    _check.check_elementwise("sigmoid_forward", x, _FLOATS)
    e = np.exp(-np.abs(x))
    y = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
    return y, y


def sigmoid_backward(dy, cache):
    """``dx = dy * y * (1 - y)``."""
    y = cache
    _check.check_same_shape("sigmoid_backward", "dy", dy, "y", y)
    return dy * y * (1 - y)


# ---------------------------------------------------------------- dropout


def splitmix64(z):
    """The SplitMix64 finaliser of ``z`` (a uint64 array, or an int in [0, 2**64)), in uint64.

    ``z += 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
    z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31``, every operation
    modulo 2**64 (as uint64_t arithmetic in C).  The counter-based random
    numbers of dropout and gather_batch are ``splitmix64(seed ^ splitmix64(i))``.
    """
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wraparound is intended
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def counter_hash(seed, count):
    """``splitmix64(seed ^ splitmix64(i))`` for i = 0 .. count-1 (uint64)."""
    return splitmix64(np.uint64(seed) ^ splitmix64(np.arange(count, dtype=np.uint64)))


def dropout_forward(x, p=0.5, seed=0):
    """Inverted dropout: ``y = x * mask``, ``mask[i] = scale`` if element i is kept, else 0.

    Element i (flat C-order index) is kept iff
    ``(splitmix64(seed ^ splitmix64(i)) >> 40) >= threshold`` with
    ``threshold = round(p * 2**24)`` and ``scale = float32(1 / (1 - p))``
    (see ``_check.dropout_threshold`` / ``dropout_scale``): the keep rate is
    1 - p and E[y] = x.  Bit for bit the same mask as the GPU kernel.
    The cache is the mask (in x's dtype).
    """
    threshold, scale, seed = _check.check_dropout(x, p, seed, _FLOATS)
    if threshold == 0:  # p == 0 (or below 2**-25): everything kept with scale 1
        mask = np.ones(x.shape, dtype=x.dtype)
    else:
        kept = (counter_hash(seed, x.size) >> np.uint64(40)) >= np.uint64(threshold)
        mask = np.where(kept, x.dtype.type(scale), x.dtype.type(0)).reshape(x.shape)
    return x * mask, mask


def dropout_backward(dy, cache):
    """``dx = dy * mask``."""
    mask = cache
    _check.check_same_shape("dropout_backward", "dy", dy, "mask", mask)
    return dy * mask
