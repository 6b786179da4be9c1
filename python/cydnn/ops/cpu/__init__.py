"""The numpy twin of every layer op: the reference the GPU ops are tested
against, and the CPU backend used for CPU training.

``cydnn.ops.cuda`` has the same functions with the same signatures.  The ops
live in one module per family and are all re-exported here, so that
``cydnn.ops.cpu.conv_forward`` (and ``cydnn.ops.backend("cpu")``) is the
whole interface:

    arrays.py       asarray, to_numpy, empty, zeros, zeros_like
    conv.py         conv_forward / conv_backward (im2col + one matrix product per batch)
    pool.py         max_pool_* / avg_pool_*
    elementwise.py  relu_*, leaky_relu_*, tanh_*, sigmoid_*, dropout_*, splitmix64
    norm.py         batch_norm_*, global_avg_pool_* (reductions over a channel's values)
    dense.py        linear_*, softmax, log_softmax, softmax_cross_entropy, flatten
    updates.py      sgd_update, adam_update
    data.py         gather_batch
    _windows.py     the window views and their adjoint, shared by conv and pool
    kernels.py      set_kernels / get_kernels: the numpy twin or the compiled kernels
    _kernels.pyx    the compiled (Cython, OpenMP) twins of the hot loops
    _threads.py     BLAS and OpenMP threads chosen per call size (threadpoolctl)

Conventions
    - Layout NCHW.  Weights in PyTorch layouts: conv (out, in, kh, kw),
      linear (out, in).  Convolution is cross-correlation, as in PyTorch.
    - Inputs are float32 or float64 numpy arrays; every op computes in its
      input's dtype (float64 lets tests check gradients by finite differences).
    - Every ``*_forward`` returns ``(y, cache)``; the matching ``*_backward``
      takes ``(dy, cache)`` and nothing else of the forward's: the cache
      carries every argument the backward needs (leaky_relu's slope, batch
      norm's eps and mode), so a layer can never pass the wrong one.  (A
      ``need_dx`` flag, which only skips work, is the one extra argument.)
      The cache is private to this package.
    - ``kernel`` / ``stride`` / ``padding`` are an int or an (h, w) pair.
    - Arguments are validated first by ``cydnn.ops._check`` (shared with the
      GPU module), so errors read the same on both devices.

Speed
    The numpy twin: each op is written as whole-array numpy: no Python loop over images,
    channels or pixels, only (where unavoidable) over the kh*kw offsets of a
    kernel window.  The matrix products go to numpy's BLAS.  Where the fast
    formulation is less obvious than the definition, the docstring gives both.
    The compiled kernels (the default where built; ``set_kernels("numpy")``
    or ``$CYDNN_CPU_KERNELS=numpy`` selects the twin) do the loops of
    convolution, pooling, ReLU and the optimizer updates in one pass each, in
    C with OpenMP; the tests compare them with the twin.  Matrix products run
    on one BLAS thread below ``_threads.PARALLEL_FLOPS`` (a busy machine
    otherwise stalls the BLAS's spinning threads).
"""
from ..fused_cpu import fused_mlp_forward, linear_xent
from .arrays import asarray, empty, to_numpy, zeros, zeros_like
from .conv import conv_backward, conv_forward
from .data import gather_batch, gather_batch_chw
from .dense import flatten, linear_backward, linear_forward, log_softmax, softmax, softmax_cross_entropy
from .elementwise import (dropout_backward, dropout_forward, leaky_relu_backward, leaky_relu_forward, relu_backward,
                          relu_forward, sigmoid_backward, sigmoid_forward, splitmix64, tanh_backward, tanh_forward)
from .kernels import get_kernels, kernels_available, set_kernels, use_kernels
from .norm import batch_norm_backward, batch_norm_forward, global_avg_pool_backward, global_avg_pool_forward
from .pool import avg_pool_backward, avg_pool_forward, max_pool_backward, max_pool_forward
from .updates import adam_update, sgd_update

__all__ = [
    "asarray", "to_numpy", "empty", "zeros", "zeros_like",
    "conv_forward", "conv_backward",
    "max_pool_forward", "max_pool_backward",
    "avg_pool_forward", "avg_pool_backward",
    "relu_forward", "relu_backward",
    "leaky_relu_forward", "leaky_relu_backward",
    "batch_norm_forward", "batch_norm_backward",
    "global_avg_pool_forward", "global_avg_pool_backward",
    "tanh_forward", "tanh_backward",
    "sigmoid_forward", "sigmoid_backward",
    "dropout_forward", "dropout_backward", "splitmix64", "fused_mlp_forward", "linear_xent",
    "linear_forward", "linear_backward",
    "softmax", "log_softmax", "softmax_cross_entropy",
    "flatten",
    "sgd_update", "adam_update",
    "gather_batch", "gather_batch_chw",
    "set_kernels", "get_kernels", "kernels_available", "use_kernels",
]
