"""numpy twins of the fused kernels (re-exported by ``cydnn.ops.cpu``)."""
import numpy as np

from . import _check

__all__ = ["fused_mlp_forward"]


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
