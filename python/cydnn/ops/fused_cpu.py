"""numpy twins of the fused kernels (re-exported by ``cydnn.ops.cpu``)."""
import numpy as np

from . import _check
from .cpu import dense

__all__ = ["fused_mlp_forward", "linear_xent"]


def fused_mlp_forward(x, weights, biases=None):
    """``h0 = x``, ``h_{i+1} = relu(h_i W_i^T + b_i)`` for every layer but the last,
    which has no ReLU: the reference of the GPU's one-launch fused MLP.

    x (n, d0); weights[i] (d_{i+1}, d_i) as PyTorch; biases[i] (d_{i+1},) or None.
    """
    _check.check_fused_mlp(x, weights, biases, (np.float32, np.float64))
    biases = list(biases) if biases is not None else [None] * len(weights)
    h = x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w.T
        if b is not None:
            h = h + b
        if i < len(weights) - 1:
            h = np.maximum(h, 0)
    return h


def linear_xent(x, w, bias, labels):
    """The reference of the compiled plan's head (cpp/compiled_head.cu): the last linear layer and the softmax
    cross-entropy, forward and backward, composed from the op twins.  x (n, k), w (c, k), bias (c,) or None,
    labels (n,) in [0, c).  Returns (logits, loss, g, dbias, dx, dw): logits = x w^T + bias, the mean loss,
    g = (softmax(logits) - onehot(labels)) / n, dbias = sum of g's rows (None without bias), dx = g w, dw = g^T x."""
    logits, cache = dense.linear_forward(x, w, bias)
    loss, g = dense.softmax_cross_entropy(logits, labels)
    dx, dw, dbias = dense.linear_backward(g, cache)
    return logits, loss, g, dbias, dx, dw
