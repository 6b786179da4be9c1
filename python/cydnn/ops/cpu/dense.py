"""Dense ops: linear layers, softmax, the cross-entropy loss, flatten."""
import numpy as np

from .. import _check
from . import _threads
from .arrays import FLOATS as _FLOATS

__all__ = ["linear_forward", "linear_backward", "softmax", "log_softmax", "softmax_cross_entropy", "flatten"]


def linear_forward(x, w, b):
    """``y = x @ w.T + b``: x (n, in), w (out, in), b (out,) or None; y (n, out)."""
    _check.check_linear(x, w, b, _FLOATS)
    y = _threads.matmul(x, w.T)  # BLAS threads by size (see _threads)
    if b is not None:
        y += b
    return y, (x, w, b is not None)


def linear_backward(dy, cache, need_dx=True):
    """``dx = dy @ w`` (None when not ``need_dx``), ``dw = dy.T @ x``, ``db = sum_n dy`` (None without bias)."""
    x, w, has_bias = cache
    _check.check_same_shape("linear_backward", "dy", dy, "y", (x.shape[0], w.shape[0]), dtype=x.dtype)
    db = dy.sum(axis=0) if has_bias else None
    return (_threads.matmul(dy, w) if need_dx else None), _threads.matmul(dy.T, x), db


# ---------------------------------------------------------- softmax, loss


def _log_softmax(x):
    """Row-wise ``x - logsumexp(x)``, shifted by the row max so exp never overflows."""
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax(x):
    """Row-wise ``exp(x_ij) / sum_j exp(x_ij)`` of x (n, c), shifted by the row max for stability."""
    _check.check_softmax("softmax", x, _FLOATS)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def log_softmax(x):
    """Row-wise ``x_ij - log sum_j exp(x_ij)`` of x (n, c), computed stably."""
    _check.check_softmax("log_softmax", x, _FLOATS)
    return _log_softmax(x)


def softmax_cross_entropy(logits, labels, validate=True):
    """Mean cross-entropy of softmax(logits) against integer labels, and its gradient.

    ``loss = mean_i (logsumexp(logits_i) - logits_i[labels_i])`` (a 0-d array of
    logits' dtype); ``dlogits = (softmax(logits) - onehot(labels)) / n``.
    Each label must be in [0, c).  ``validate`` exists for parity with
    ``cydnn.ops.cuda``; here the labels are always checked (indexing needs it).
    """
    n, c = _check.check_cross_entropy(logits, labels, _FLOATS)
    _check.check_index_values("softmax_cross_entropy", "labels", labels, c, logits=logits, labels=labels)
    rows, cols = np.arange(n), labels.astype(np.int64)
    logp = _log_softmax(logits)
    loss = np.asarray(-logp[rows, cols].mean(), dtype=logits.dtype)
    dlogits = np.exp(logp)  # softmax
    dlogits[rows, cols] -= 1
    dlogits /= n
    return loss, dlogits


# ---------------------------------------------------------------- flatten


def flatten(x):
    """``x.reshape(n, -1)``: a view of x (n, ...) as (n, features); no copy for contiguous x."""
    _check.check_flatten(x, _FLOATS)
    return x.reshape(x.shape[0], -1)
