"""Argument validation shared by ``cydnn.ops.cpu`` and ``cydnn.ops.cuda``.

Every function here looks only at ``.shape``, ``.ndim`` and ``.dtype`` of its
array arguments, so the same checks serve numpy arrays and the GPU
``DeviceArray`` (whose ``dtype`` is a numpy dtype).  Nothing here reads data.

Errors
    ``TypeError``  -- not an array, or a wrong dtype (or a wrong Python type
                      for a scalar argument such as ``p`` or ``stride``).
    ``ValueError`` -- wrong rank, mismatched or impossible shapes, scalar
                      arguments out of range.
    Every message starts with the op name, names the offending argument and
    shows the shapes involved, e.g.::

        conv_forward: w has 3 input channels but x has 1 (x (2, 1, 28, 28), w (6, 3, 5, 5))

Arrays must be non-empty (every dimension >= 1): the C layer refuses sizes < 1.

Each op-level check takes ``allowed_dtypes``, a tuple of numpy dtypes (or
scalar types): the cpu module passes ``(np.float32, np.float64)``, the cuda
module ``(np.float32,)``.  Checks return the derived geometry so that callers
do not recompute it.

The building blocks (array, dtype and number checks, ``pair``) are in
``_check_base.py``; this file has one check per op family (batch
normalization's, the longest, is in ``_check_norm.py`` and re-exported here).
"""
import math

import numpy as np

from ._check_base import (_array, _int, _integer_array, _is_array, _number, _same_dtype, _seed, _shape, _shapes,
                          _type_name, pair)
from ._check_norm import check_batch_norm

__all__ = [
    "pair",
    "check_conv",
    "check_pool",
    "check_linear",
    "check_elementwise",
    "check_leaky_relu",
    "check_batch_norm",
    "check_global_avg_pool",
    "check_same_shape",
    "check_flatten",
    "check_softmax",
    "check_cross_entropy",
    "check_dropout",
    "check_sgd",
    "check_adam",
    "check_gather_batch",
    "check_index_values",
    "dropout_threshold",
    "dropout_scale",
]



# ---------------------------------------------------- convolution, pooling


def _out_size(size, k, s, p):
    """Output length of a window of size k, stride s, padding p over ``size`` inputs."""
    return (size + 2 * p - k) // s + 1


def _window_output(op, x, kernel_hw, stride_hw, pad_hw, shapes):
    """(oh, ow) of a window sliding over x (n, c, h, w); the kernel must fit the padded input.

    Shared by convolution and pooling; ``shapes()`` names the arrays for the message.
    """
    padded = (int(x.shape[2]) + 2 * pad_hw[0], int(x.shape[3]) + 2 * pad_hw[1])
    if kernel_hw[0] > padded[0] or kernel_hw[1] > padded[1]:
        raise ValueError(
            f"{op}: kernel {kernel_hw} is larger than the padded input {padded} ({shapes()}, padding {pad_hw})"
        )
    # At least 1 on each side, since the kernel fits the padded input.
    return tuple(_out_size(int(x.shape[2 + i]), kernel_hw[i], stride_hw[i], pad_hw[i]) for i in (0, 1))


def check_conv(x, w, b, stride, padding, allowed_dtypes):
    """Validate a 2-d convolution; return ``(stride_hw, pad_hw, out_hw)``.

    x (n, c, h, w), w (k, c, kh, kw), b None or (k,), all of one allowed dtype;
    each padded input side at least the kernel's.  ``out_hw`` = (oh, ow) with
    ``oh = (h + 2 pad_h - kh) // stride_h + 1`` (likewise ow).  The output is
    (n, k, oh, ow).
    """
    op = "conv_forward"
    _array(op, "x", x, allowed_dtypes, 4, "(n, c, h, w)")
    _array(op, "w", w, allowed_dtypes, 4, "(out_channels, in_channels, kh, kw)")
    _same_dtype(op, "w", w, "x", x, x=x, w=w)
    if b is not None:
        _array(op, "b", b, allowed_dtypes, 1, "(out_channels,)")
        _same_dtype(op, "b", b, "x", x, x=x, w=w, b=b)
        if b.shape[0] != w.shape[0]:
            raise ValueError(
                f"{op}: b has {b.shape[0]} entries but w has {w.shape[0]} output channels {_shapes(x=x, w=w, b=b)}"
            )
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: w has {w.shape[1]} input channels but x has {x.shape[1]} {_shapes(x=x, w=w)}"
        )
    stride_hw = pair(stride, "stride", op, minimum=1)
    pad_hw = pair(padding, "padding", op, minimum=0)
    kernel_hw = (int(w.shape[2]), int(w.shape[3]))
    out_hw = _window_output(op, x, kernel_hw, stride_hw, pad_hw, lambda: f"x {_shape(x)}, w {_shape(w)}")
    return stride_hw, pad_hw, out_hw


def check_pool(op, x, kernel, stride, padding, allowed_dtypes):
    """Validate a 2-d pooling; return ``(kernel_hw, stride_hw, pad_hw, out_hw)``.

    ``op`` is the op's name (``"max_pool_forward"``, ``"avg_pool_forward"``).
    x (n, c, h, w); ``stride`` None means stride = kernel; padding at most half
    the kernel on each axis (as PyTorch: ``2 pad <= kernel``); kernel at most
    the padded input.  ``out_hw`` as in :func:`check_conv`; the output is
    (n, c, oh, ow).
    """
    _array(op, "x", x, allowed_dtypes, 4, "(n, c, h, w)")
    kernel_hw = pair(kernel, "kernel", op, minimum=1)
    stride_hw = kernel_hw if stride is None else pair(stride, "stride", op, minimum=1)
    pad_hw = pair(padding, "padding", op, minimum=0)
    if 2 * pad_hw[0] > kernel_hw[0] or 2 * pad_hw[1] > kernel_hw[1]:
        raise ValueError(
            f"{op}: padding {pad_hw} must be at most half the kernel {kernel_hw} (x {_shape(x)})"
        )
    out_hw = _window_output(op, x, kernel_hw, stride_hw, pad_hw, lambda: f"x {_shape(x)}")
    return kernel_hw, stride_hw, pad_hw, out_hw


# ------------------------------------------------------------ linear, misc


def check_linear(x, w, b, allowed_dtypes):
    """Validate ``y = x @ w.T + b``; return ``(n, in_features, out_features)``.

    x (n, in), w (out, in), b None or (out,), all of one allowed dtype.
    """
    op = "linear_forward"
    _array(op, "x", x, allowed_dtypes, 2, "(n, in_features)")
    _array(op, "w", w, allowed_dtypes, 2, "(out_features, in_features)")
    _same_dtype(op, "w", w, "x", x, x=x, w=w)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: w has {w.shape[1]} input features but x has {x.shape[1]} {_shapes(x=x, w=w)}"
        )
    if b is not None:
        _array(op, "b", b, allowed_dtypes, 1, "(out_features,)")
        _same_dtype(op, "b", b, "x", x, x=x, w=w, b=b)
        if b.shape[0] != w.shape[0]:
            raise ValueError(
                f"{op}: b has {b.shape[0]} entries but w has {w.shape[0]} output features {_shapes(x=x, w=w, b=b)}"
            )
    return int(x.shape[0]), int(x.shape[1]), int(w.shape[0])


def check_elementwise(op, x, allowed_dtypes):
    """Validate the input of an elementwise op (any rank, non-empty); return ``count`` (elements)."""
    _array(op, "x", x, allowed_dtypes)
    return math.prod(_shape(x))


def check_leaky_relu(x, negative_slope, allowed_dtypes):
    """Validate ``leaky_relu_forward``: x of any rank; return ``negative_slope`` as a finite Python float."""
    op = "leaky_relu_forward"
    _array(op, "x", x, allowed_dtypes)
    return _number(op, "negative_slope", negative_slope)


def check_global_avg_pool(x, allowed_dtypes):
    """Validate ``global_avg_pool_forward``: x (n, c, h, w); return ``(n, c, h, w)``."""
    _array("global_avg_pool_forward", "x", x, allowed_dtypes, 4, "(n, c, h, w)")
    return _shape(x)


def check_same_shape(op, name_a, a, name_b, b, dtype=None):
    """Check that array ``a`` matches ``b`` (used for ``dy`` in backward ops).

    ``b`` is an array or a shape tuple.  ``a`` must have ``b``'s shape and the
    dtype ``dtype`` -- by default ``b.dtype`` when ``b`` is an array; no dtype
    check when ``b`` is a shape and ``dtype`` is None.  Returns None.
    Raises TypeError (not an array, dtype differs) or ValueError (shape differs).
    """
    if not _is_array(a):
        raise TypeError(f"{op}: {name_a} must be an array (numpy.ndarray or DeviceArray); got {_type_name(a)}")
    if _is_array(b):
        b_shape = _shape(b)
        if dtype is None:
            dtype = b.dtype
    else:
        b_shape = tuple(int(s) for s in b)
    if _shape(a) != b_shape:
        raise ValueError(f"{op}: {name_a} has shape {_shape(a)} but {name_b} has shape {b_shape}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(
            f"{op}: {name_a} has dtype {np.dtype(a.dtype).name} but {name_b} has dtype "
            f"{np.dtype(dtype).name} ({name_a} {_shape(a)})"
        )


def check_flatten(x, allowed_dtypes):
    """Validate ``flatten``: x of rank >= 2; return the output shape ``(n, features)``."""
    op = "flatten"
    _array(op, "x", x, allowed_dtypes)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2 (n, ...), got rank {x.ndim} (x {_shape(x)})")
    n = int(x.shape[0])
    return n, math.prod(_shape(x)[1:])


# ------------------------------------------------------------ softmax, loss


def check_softmax(op, x, allowed_dtypes):
    """Validate a row-wise softmax input (``"softmax"``, ``"log_softmax"``): x (n, c); return ``(n, c)``."""
    _array(op, "x", x, allowed_dtypes, 2, "(n, classes)")
    return int(x.shape[0]), int(x.shape[1])


def check_cross_entropy(logits, labels, allowed_dtypes):
    """Validate ``softmax_cross_entropy``; return ``(n, c)``.

    logits (n, c) of an allowed dtype; labels (n,) of any integer dtype.  The
    label *values* (each in [0, c)) are not checked here: that needs the data.
    """
    op = "softmax_cross_entropy"
    _array(op, "logits", logits, allowed_dtypes, 2, "(n, classes)")
    _integer_array(op, "labels", labels, 1)
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{op}: labels has {labels.shape[0]} entries but logits has {logits.shape[0]} rows "
            f"{_shapes(logits=logits, labels=labels)}"
        )
    return int(logits.shape[0]), int(logits.shape[1])


# ------------------------------------------------------------------ dropout


def dropout_threshold(p):
    """The integer keep threshold of dropout: ``int(round(p * 2**24))`` (Python's round, half to even).

    Element i is kept iff ``(hash_i >> 40) >= threshold``, where ``hash_i >> 40``
    is a 24-bit number, so the keep rate is ``1 - threshold / 2**24``.
    """
    return int(round(p * 2**24))


def dropout_scale(p):
    """The scale of kept elements: ``1 / (1 - p)`` computed in float64, then rounded once to float32.

    Returned as a Python float whose value is exactly a float32.
    """
    return float(np.float32(1.0 / (1.0 - p)))


def check_dropout(x, p, seed, allowed_dtypes):
    """Validate dropout; return ``(threshold, scale, seed)``.

    ``0 <= p < 1``; ``seed`` an int in [0, 2**64).  ``threshold`` is
    :func:`dropout_threshold` (int), ``scale`` :func:`dropout_scale` (a Python
    float exactly representable in float32), ``seed`` a Python int.
    """
    op = "dropout_forward"
    _array(op, "x", x, allowed_dtypes)
    p = _number(op, "p", p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: p must be in [0, 1), got {p} (x {_shape(x)})")
    return dropout_threshold(p), dropout_scale(p), _seed(op, seed)


# --------------------------------------------------------------- optimizers


def _param_like(op, param, grad, states, allowed_dtypes):
    """param of an allowed dtype; grad and each (name, state) of param's shape and dtype."""
    _array(op, "param", param, allowed_dtypes)
    for name, a in (("grad", grad),) + tuple(states):
        _array(op, name, a, allowed_dtypes)
        if _shape(a) != _shape(param):
            raise ValueError(f"{op}: {name} has shape {_shape(a)} but param has shape {_shape(param)}")
        _same_dtype(op, name, a, "param", param, param=param, **{name: a})


def check_sgd(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, allowed_dtypes):
    """Validate ``sgd_update``; return None.

    param, grad (and momentum_buf, required when momentum != 0) of one shape
    and dtype.  lr, momentum, weight_decay >= 0 and finite; dampening finite;
    nesterov needs momentum > 0 and dampening == 0 (as PyTorch).
    """
    op = "sgd_update"
    lr = _number(op, "lr", lr)
    momentum = _number(op, "momentum", momentum)
    dampening = _number(op, "dampening", dampening)
    weight_decay = _number(op, "weight_decay", weight_decay)
    for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if v < 0:
            raise ValueError(f"{op}: {name} must be >= 0, got {v}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"{op}: nesterov needs momentum > 0 and dampening == 0, got momentum {momentum}, dampening {dampening}"
        )
    states = ()
    if momentum != 0:
        if momentum_buf is None:
            raise TypeError(
                f"{op}: momentum_buf is None but momentum is {momentum}; pass an array shaped like "
                f"param (param {_shape(param) if _is_array(param) else _type_name(param)})"
            )
        states = (("momentum_buf", momentum_buf),)
    elif momentum_buf is not None:
        states = (("momentum_buf", momentum_buf),)
    _param_like(op, param, grad, states, allowed_dtypes)


def check_adam(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, allowed_dtypes):
    """Validate ``adam_update``; return None.

    param, grad, m, v of one shape and dtype; step an int >= 1; lr, eps,
    weight_decay >= 0 and finite; 0 <= beta1, beta2 < 1 (as PyTorch).
    """
    op = "adam_update"
    _int(op, "step", step, 1)
    values = {name: _number(op, name, val) for name, val in
              (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay))}
    for name in ("lr", "eps", "weight_decay"):
        if values[name] < 0:
            raise ValueError(f"{op}: {name} must be >= 0, got {values[name]}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= values[name] < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {values[name]}")
    _param_like(op, param, grad, (("m", m), ("v", v)), allowed_dtypes)


# --------------------------------------------------------------------- data


def check_gather_batch(images, labels, indices, mean, std, pad, max_shift, seed):
    """Validate ``gather_batch``; return ``(out_shape, seed)``.

    images (N, H, W) uint8; labels None or (N,) integer; indices (B,) integer;
    mean finite; std finite and > 0; pad, max_shift ints >= 0; seed an int in
    [0, 2**64).  ``out_shape`` = (B, 1, H + 2 pad, W + 2 pad); ``seed`` as a
    Python int.  Index values (in [0, N)) are not checked here: that needs the data.
    """
    op = "gather_batch"
    _array(op, "images", images, (np.uint8,), 3, "(n_images, h, w)")
    if labels is not None:
        _integer_array(op, "labels", labels, 1)
        if labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"{op}: labels has {labels.shape[0]} entries but images has {images.shape[0]} "
                f"{_shapes(images=images, labels=labels)}"
            )
    _integer_array(op, "indices", indices, 1)
    _number(op, "mean", mean)
    if _number(op, "std", std) <= 0:
        raise ValueError(f"{op}: std must be > 0, got {std}")
    pad = _int(op, "pad", pad, 0)
    _int(op, "max_shift", max_shift, 0)
    seed = _seed(op, seed)
    out_shape = (int(indices.shape[0]), 1, int(images.shape[1]) + 2 * pad, int(images.shape[2]) + 2 * pad)
    return out_shape, seed


def check_index_values(op, name, values, limit, **shapes):
    """Check the *values* of a host integer array: each in [0, limit).

    Used for class labels and sample indices, whose range needs the data.
    Raises ValueError naming the first bad entry, e.g.
    ``softmax_cross_entropy: labels[2] = 10 is out of range [0, 10) (logits (4, 10), labels (4,))``.
    """
    values = np.asarray(values)
    bad = np.flatnonzero((values < 0) | (values >= limit))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(values[i])} is out of range [0, {limit}) {_shapes(**shapes)}")


MLP_MAX_LAYERS = 8
MLP_MAX_WIDTH = 1024


def check_fused_mlp(x, weights, biases, allowed_dtypes, max_width=None):
    """Validate a chain of linear layers ``x -> relu(x W0^T + b0) -> ... -> x Wk^T + bk``.

    x (n, d0); weights[i] (d_{i+1}, d_i); biases[i] None or (d_{i+1},); all of one
    allowed dtype; 1 to MLP_MAX_LAYERS layers (and, for the GPU kernel, widths at
    most ``max_width``).  Returns the widths ``(d0, ..., dk)``.
    """
    op = "fused_mlp_forward"
    _array(op, "x", x, allowed_dtypes, 2, "(n, features)")
    weights, biases = list(weights), list(biases) if biases is not None else [None] * len(list(weights))
    if not 1 <= len(weights) <= MLP_MAX_LAYERS:
        raise ValueError(f"{op}: 1 to {MLP_MAX_LAYERS} layers, got {len(weights)} weights")
    if len(biases) != len(weights):
        raise ValueError(f"{op}: {len(weights)} weights but {len(biases)} biases (use None for no bias)")
    dims = [int(x.shape[1])]
    for i, (w, b) in enumerate(zip(weights, biases)):
        _array(op, f"weights[{i}]", w, allowed_dtypes, 2, "(out_features, in_features)")
        _same_dtype(op, f"weights[{i}]", w, "x", x, x=x, **{f"weights[{i}]": w})
        if w.shape[1] != dims[-1]:
            raise ValueError(f"{op}: weights[{i}] takes {w.shape[1]} features but layer {i} gets {dims[-1]} "
                             f"{_shapes(x=x, **{f'weights[{i}]': w})}")
        if b is not None:
            _array(op, f"biases[{i}]", b, allowed_dtypes, 1, "(out_features,)")
            _same_dtype(op, f"biases[{i}]", b, "x", x, x=x, **{f"biases[{i}]": b})
            if b.shape[0] != w.shape[0]:
                raise ValueError(f"{op}: biases[{i}] has {b.shape[0]} entries but weights[{i}] has {w.shape[0]} "
                                 f"outputs {_shapes(**{f'weights[{i}]': w, f'biases[{i}]': b})}")
        dims.append(int(w.shape[0]))
    if max_width is not None and max(dims) > max_width:
        raise ValueError(f"{op}: widths {dims}: the fused kernel takes at most {max_width} features per layer")
    return dims
