"""Batch normalization (``batch_norm_forward`` / ``batch_norm_backward``) and global average
pooling (``global_avg_pool_forward`` / ``global_avg_pool_backward``): the reductions over all of
a channel's values.

Batch normalization, as PyTorch's ``F.batch_norm``.  x is (n, c), (n, c, l) or (n, c, h, w);
channel k's statistics are over every value of x[:, k] (its ``count`` = n times the positions).

    training:   mu = mean(x[:, k]),  var = mean((x[:, k] - mu)^2)        (biased)
                running_mean <- (1 - momentum) running_mean + momentum mu
                running_var  <- (1 - momentum) running_var  + momentum var count / (count - 1)
                (unbiased; in place, when the running statistics are given)
    evaluation: mu = running_mean, var = running_var
    both:       xhat = (x - mu) / sqrt(var + eps),   y = gamma xhat + beta

Backward, with g = gamma / sqrt(var + eps) per channel and sums over a channel's values:

    dbeta = sum(dy),  dgamma = sum(dy xhat)
    training:   dx = g (dy - dbeta / count - xhat dgamma / count)   (mu and var depend on x)
    evaluation: dx = g dy                                            (the statistics are constants)

Global average pooling: x (n, c, h, w) -> y (n, c, 1, 1) = the mean of each (h, w) plane;
backward spreads dy / (h w) evenly over the plane.
"""
import numpy as np

from .. import _check
from .arrays import FLOATS as _FLOATS

__all__ = ["batch_norm_forward", "batch_norm_backward", "global_avg_pool_forward", "global_avg_pool_backward"]


def _channel_axes(a):
    """Every axis but the channel axis 1: what batch normalization reduces over."""
    return (0,) + tuple(range(2, a.ndim))


def _per_channel(v, ndim):
    """A (c,) vector shaped to broadcast along axis 1 of a rank-``ndim`` array."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def batch_norm_forward(x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
    """``(y, cache)``: batch normalization of x; see the module docstring for the maths.

    gamma, beta: (c,) or both None (y = xhat).  running_mean, running_var:
    (c,) or both None; in training they are updated in place (when given),
    in evaluation they are used (and required).  ``momentum`` is the weight of
    the batch in the update (PyTorch's ``momentum``; its cumulative average,
    ``momentum=None``, is the caller's ``1 / num_batches_tracked``).  The cache
    holds xhat, gamma, 1/sqrt(var + eps) and the mode: everything backward needs.
    """
    _, count, momentum, eps = _check.check_batch_norm(x, gamma, beta, running_mean, running_var, training,
                                                      momentum, eps, _FLOATS)
    axes = _channel_axes(x)
    if training:
        mean = x.mean(axis=axes)
        centered = x - _per_channel(mean, x.ndim)
        var = np.mean(centered * centered, axis=axes)
        if running_mean is not None:
            running_mean[...] = (1 - momentum) * running_mean + momentum * mean
            running_var[...] = (1 - momentum) * running_var + momentum * (var * (count / (count - 1)))
    else:
        mean, var = running_mean, running_var
        centered = x - _per_channel(mean, x.ndim)
    inv_std = 1 / np.sqrt(var + eps)
    xhat = centered * _per_channel(inv_std, x.ndim)
    y = xhat if gamma is None else xhat * _per_channel(gamma, x.ndim) + _per_channel(beta, x.ndim)
    return y, (xhat, gamma, inv_std, bool(training))


def batch_norm_backward(dy, cache):
    """``(dx, dgamma, dbeta)``; dgamma and dbeta are None when the forward had no gamma/beta."""
    xhat, gamma, inv_std, training = cache
    _check.check_same_shape("batch_norm_backward", "dy", dy, "x", xhat)
    axes = _channel_axes(dy)
    dbeta = dy.sum(axis=axes)
    dgamma = (dy * xhat).sum(axis=axes)
    g = _per_channel(inv_std if gamma is None else gamma * inv_std, dy.ndim)
    if training:
        count = dy.size // dy.shape[1]
        dx = g * (dy - _per_channel(dbeta / count, dy.ndim) - xhat * _per_channel(dgamma / count, dy.ndim))
    else:
        dx = g * dy
    if gamma is None:
        return dx, None, None
    return dx, dgamma, dbeta


def global_avg_pool_forward(x):
    """``y[n, c, 0, 0] = mean(x[n, c])`` over the (h, w) plane; the cache is x's shape."""
    _check.check_global_avg_pool(x, _FLOATS)
    return x.mean(axis=(2, 3), keepdims=True), tuple(x.shape)


def global_avg_pool_backward(dy, cache):
    """``dx[n, c, i, j] = dy[n, c, 0, 0] / (h w)``."""
    shape = cache
    _check.check_same_shape("global_avg_pool_backward", "dy", dy, "the forward output", shape[:2] + (1, 1))
    return np.broadcast_to(dy / (shape[2] * shape[3]), shape).copy()
