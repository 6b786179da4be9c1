"""The numpy twin of every layer op: the reference the GPU ops are tested
against, and the CPU fallback used for CPU training.

``cydnn.ops.cuda`` has the same functions with the same signatures.

Conventions
    - Layout NCHW.  Weights in PyTorch layouts: conv (out, in, kh, kw),
      linear (out, in).  Convolution is cross-correlation, as in PyTorch.
    - Inputs are float32 or float64 numpy arrays; every op computes in its
      input's dtype (float64 lets tests check gradients by finite differences).
    - Every ``*_forward`` returns ``(y, cache)``; the matching ``*_backward``
      takes ``(dy, cache)``.  The cache is private to this module.
    - ``kernel`` / ``stride`` / ``padding`` are an int or an (h, w) pair.
    - Arguments are validated first by ``cydnn.ops._check`` (shared with the
      GPU module), so errors read the same on both devices.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from . import _check

__all__ = [
    "asarray", "to_numpy", "empty", "zeros", "zeros_like",
    "conv_forward", "conv_backward",
    "max_pool_forward", "max_pool_backward",
    "avg_pool_forward", "avg_pool_backward",
    "relu_forward", "relu_backward",
    "tanh_forward", "tanh_backward",
    "sigmoid_forward", "sigmoid_backward",
    "dropout_forward", "dropout_backward", "splitmix64", "fused_mlp_forward",
    "linear_forward", "linear_backward",
    "softmax", "log_softmax", "softmax_cross_entropy",
    "flatten",
    "sgd_update", "adam_update",
    "gather_batch",
]

# The dtypes the cpu ops compute in (the GPU module accepts float32 only).
_FLOATS = (np.float32, np.float64)


# ------------------------------------------------------------------ arrays


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


# ----------------------------------------------------- window helpers


def _pad(x, pad_hw, value=0.0):
    """x (n, c, h, w) with ``pad_hw`` rows/columns of ``value`` added on each side (x itself if none)."""
    ph, pw = pad_hw
    if ph == 0 and pw == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _windows(xp, kernel_hw, stride_hw):
    """A view (n, c, oh, ow, kh, kw) of every kernel window of the padded input xp (no copy).

    ``[b, ch, i, j]`` is the window ``xp[b, ch, i*sh : i*sh + kh, j*sw : j*sw + kw]``.
    """
    win = sliding_window_view(xp, kernel_hw, axis=(2, 3))  # every window position, stride 1
    return win[:, :, :: stride_hw[0], :: stride_hw[1]]


def _add_windows(dxp, dwin, stride_hw):
    """The adjoint of :func:`_windows`: add each window's gradient back where it was read.

    dxp (n, c, hp, wp) is the gradient of the padded input (updated in place);
    dwin (n, c, oh, ow, kh, kw) the gradient of each window.  One strided slice
    per kernel offset (i, j): offset (i, j) of window (r, s) is pixel
    (r*sh + i, s*sw + j).  Overlapping windows accumulate.
    """
    _, _, oh, ow, kh, kw = dwin.shape
    sh, sw = stride_hw
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] += dwin[:, :, :, :, i, j]


def _unpad(xp, pad_hw):
    """Remove ``pad_hw`` rows/columns from each side of xp (n, c, hp, wp); a C-contiguous array."""
    ph, pw = pad_hw
    hp, wp = xp.shape[2:]
    return np.ascontiguousarray(xp[:, :, ph : hp - ph, pw : wp - pw])


def _cols(x, kernel_hw, stride_hw, pad_hw):
    """The windows of x as columns: (c*kh*kw, n*oh*ow), column (b, p) the input window of
    output pixel p of image b, rows ordered (c, kh, kw) like ``w.reshape(k, c*kh*kw)``.

    One copy, whose innermost runs are rows of x (contiguous when the stride is 1);
    the whole batch in one matrix, so that each product below is one BLAS call.
    """
    win = _windows(_pad(x, pad_hw), kernel_hw, stride_hw)  # (n, c, oh, ow, kh, kw), a view
    n, c, oh, ow, kh, kw = win.shape
    return win.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * oh * ow)


# ------------------------------------------------------------ convolution


def conv_forward(x, w, b, stride=1, padding=0):
    """2-d cross-correlation: ``y[n, k, i, j] = b[k] + sum_{c,p,q} w[k, c, p, q] xp[n, c, i*sh + p, j*sw + q]``.

    x (n, c, h, w), w (k, c, kh, kw), b (k,) or None; xp is x zero-padded.
    Returns y (n, k, oh, ow) and the cache.  Computed as one matrix product
    ``W (k, c*kh*kw) @ cols (c*kh*kw, n*oh*ow)`` (im2col).
    """
    stride_hw, pad_hw, (oh, ow) = _check.check_conv(x, w, b, stride, padding, _FLOATS)
    n, k = x.shape[0], w.shape[0]
    cols = _cols(x, w.shape[2:], stride_hw, pad_hw)
    y = w.reshape(k, -1) @ cols  # (k, n*oh*ow)
    if b is not None:
        y += b[:, None]
    y = np.ascontiguousarray(y.reshape(k, n, oh, ow).transpose(1, 0, 2, 3))
    # The cache keeps the columns (kh*kw times x's size) so backward needs no second copy.
    return y, (x.shape, w, cols, b is not None, stride_hw, pad_hw)


def conv_backward(dy, cache, need_dx=True):
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, db None when there was no bias,
    dx None when ``need_dx`` is False (the first layer of a network).

    With Y = W @ cols and D = dy as (k, n*oh*ow): dW = D @ cols.T, dcols = W.T @ D,
    db = the row sums of D; dx is dcols added back into the windows they were read
    from (col2im: one strided add per kernel offset).
    """
    x_shape, w, cols, has_bias, stride_hw, pad_hw = cache
    n, c, h, wd = x_shape
    k, _, kh, kw = w.shape
    oh = (h + 2 * pad_hw[0] - kh) // stride_hw[0] + 1
    ow = (wd + 2 * pad_hw[1] - kw) // stride_hw[1] + 1
    _check.check_same_shape("conv_backward", "dy", dy, "y", (n, k, oh, ow), dtype=w.dtype)

    d = dy.transpose(1, 0, 2, 3).reshape(k, n * oh * ow)  # columns ordered like cols
    dw = (d @ cols.T).reshape(w.shape)
    db = d.sum(axis=1) if has_bias else None

    if not need_dx:
        return None, dw, db
    dcols = (w.reshape(k, -1).T @ d).reshape(c, kh, kw, n, oh, ow)
    # col2im with the batch innermost, so that each strided add moves runs of ow*n floats.
    dcols = np.ascontiguousarray(dcols.transpose(0, 1, 2, 4, 5, 3))  # (c, kh, kw, oh, ow, n)
    dxp = np.zeros((c, h + 2 * pad_hw[0], wd + 2 * pad_hw[1], n), dtype=w.dtype)
    sh, sw = stride_hw
    for i in range(kh):
        for j in range(kw):
            dxp[:, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] += dcols[:, i, j]
    return _unpad(dxp.transpose(3, 0, 1, 2), pad_hw), dw, db


def _tiles(x, kernel_hw, stride_hw, pad_hw):
    """x as (n, c, oh, kh, ow, kw) -- a view, no copy -- when the windows tile x exactly
    (stride == kernel, no padding, sizes divisible); else None (the general path)."""
    n, c, h, w = x.shape
    kh, kw = kernel_hw
    if tuple(stride_hw) != (kh, kw) or tuple(pad_hw) != (0, 0) or h % kh or w % kw:
        return None
    return x.reshape(n, c, h // kh, kh, w // kw, kw)


# ---------------------------------------------------------------- pooling


def max_pool_forward(x, kernel=2, stride=None, padding=0):
    """Max pooling: ``y[n, c, i, j] = max over the window (i, j) of xp``, xp padded with -inf.

    stride None means stride = kernel.  Returns y (n, c, oh, ow) and the cache,
    which records the position of the *first* maximum of each window in
    row-major order (np.argmax order): backward sends the gradient there.
    """
    kernel_hw, stride_hw, pad_hw, (oh, ow) = _check.check_pool(
        "max_pool_forward", x, kernel, stride, padding, _FLOATS)
    n, c = x.shape[:2]
    kh, kw = kernel_hw
    tiles = _tiles(x, kernel_hw, stride_hw, pad_hw)
    if tiles is not None:  # windows that tile x (LeNet's 2x2/2): a reduction over a view
        y = tiles[:, :, :, 0, :, 0]
        for p in range(kh):
            for q in range(kw):
                if p or q:
                    y = np.maximum(y, tiles[:, :, :, p, :, q])
        return y, ("tiles", tiles, y, kernel_hw)
    win = _windows(_pad(x, pad_hw, -np.inf), kernel_hw, stride_hw)
    win = win.reshape(n, c, oh, ow, kh * kw)  # a copy: one flat window per output
    arg = win.argmax(axis=-1)  # first maximum, row-major within the window
    y = np.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    return y, (x.shape, x.dtype, arg, kernel_hw, stride_hw, pad_hw)


def max_pool_backward(dy, cache):
    """Gradient of :func:`max_pool_forward`: each ``dy[n, c, i, j]`` goes to the first
    maximum of window (i, j); overlapping windows accumulate; padding gets nothing."""
    if cache[0] == "tiles":
        _, tiles, y, (kh, kw) = cache
        _check.check_same_shape("max_pool_backward", "dy", dy, "y", y.shape, dtype=y.dtype)
        # The first (row-major) position of each window that holds its maximum gets dy.
        dtiles = np.zeros(tiles.shape, dtype=y.dtype)
        taken = np.zeros(y.shape, dtype=bool)
        for p in range(kh):
            for q in range(kw):
                first = (tiles[:, :, :, p, :, q] == y) & ~taken
                dtiles[:, :, :, p, :, q] = np.where(first, dy, 0)
                taken |= first
        n, c, oh, _, ow, _ = tiles.shape
        return dtiles.reshape(n, c, oh * kh, ow * kw)
    x_shape, dtype, arg, kernel_hw, stride_hw, pad_hw = cache
    _check.check_same_shape("max_pool_backward", "dy", dy, "y", arg.shape, dtype=dtype)
    n, c, h, w = x_shape
    kh, kw = kernel_hw
    # dwin[..., p, q] = dy where (p, q) is the argmax of the window, else 0.
    onehot = arg[..., None] == np.arange(kh * kw)  # (n, c, oh, ow, kh*kw)
    dwin = (onehot * dy[..., None]).reshape(arg.shape + (kh, kw))
    dxp = np.zeros((n, c, h + 2 * pad_hw[0], w + 2 * pad_hw[1]), dtype=dtype)
    _add_windows(dxp, dwin, stride_hw)
    return _unpad(dxp, pad_hw)


def avg_pool_forward(x, kernel=2, stride=None, padding=0):
    """Average pooling: ``y[n, c, i, j] = sum over window (i, j) of xp / (kh*kw)``.

    xp is x zero-padded and the padding counts in the average: the divisor is
    always kh*kw (PyTorch's count_include_pad=True).  stride None means
    stride = kernel.  Returns y (n, c, oh, ow) and the cache.
    """
    kernel_hw, stride_hw, pad_hw, _ = _check.check_pool(
        "avg_pool_forward", x, kernel, stride, padding, _FLOATS)
    tiles = _tiles(x, kernel_hw, stride_hw, pad_hw)
    if tiles is not None:  # windows that tile x: a reduction over a view
        y = sum(tiles[:, :, :, p, :, q] for p in range(kernel_hw[0]) for q in range(kernel_hw[1]))
        y = y / (kernel_hw[0] * kernel_hw[1])
    else:
        win = _windows(_pad(x, pad_hw, 0.0), kernel_hw, stride_hw)
        y = win.sum(axis=(-2, -1)) / (kernel_hw[0] * kernel_hw[1])
    return y, (x.shape, x.dtype, y.shape, kernel_hw, stride_hw, pad_hw)


def avg_pool_backward(dy, cache):
    """Gradient of :func:`avg_pool_forward`: every pixel of window (i, j) gets
    ``dy[n, c, i, j] / (kh*kw)``; overlapping windows accumulate."""
    x_shape, dtype, y_shape, kernel_hw, stride_hw, pad_hw = cache
    _check.check_same_shape("avg_pool_backward", "dy", dy, "y", y_shape, dtype=dtype)
    n, c, h, w = x_shape
    kh, kw = kernel_hw
    share = dy / (kh * kw)
    if _tiles(np.empty((0, 0, h, w)), kernel_hw, stride_hw, pad_hw) is not None:  # windows tile x
        oh, ow = y_shape[2:]
        full = np.broadcast_to(share[:, :, :, None, :, None], (n, c, oh, kh, ow, kw))
        return np.ascontiguousarray(full).reshape(n, c, h, w)
    dwin = np.broadcast_to(share[..., None, None], y_shape + (kh, kw))  # a view, no copy
    dxp = np.zeros((n, c, h + 2 * pad_hw[0], w + 2 * pad_hw[1]), dtype=dtype)
    _add_windows(dxp, dwin, stride_hw)
    return _unpad(dxp, pad_hw)


# ------------------------------------------------------------ activations


def relu_forward(x):
    """``y = max(x, 0)``; the cache is y."""
    _check.check_elementwise("relu_forward", x, _FLOATS)
    y = np.maximum(x, 0)
    return y, y


def relu_backward(dy, cache):
    """``dx = dy * (y > 0)``."""
    y = cache
    _check.check_same_shape("relu_backward", "dy", dy, "y", y)
    return dy * (y > 0)


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


_LOW32 = np.uint64(0xFFFFFFFF)  # mask of the low 32 bits of a uint64


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


def _counter_hash(seed, count):
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
        kept = (_counter_hash(seed, x.size) >> np.uint64(40)) >= np.uint64(threshold)
        mask = np.where(kept, x.dtype.type(scale), x.dtype.type(0)).reshape(x.shape)
    return x * mask, mask


def dropout_backward(dy, cache):
    """``dx = dy * mask``."""
    mask = cache
    _check.check_same_shape("dropout_backward", "dy", dy, "mask", mask)
    return dy * mask


# ----------------------------------------------------------------- linear


def linear_forward(x, w, b):
    """``y = x @ w.T + b``: x (n, in), w (out, in), b (out,) or None; y (n, out)."""
    _check.check_linear(x, w, b, _FLOATS)
    y = x @ w.T
    if b is not None:
        y += b
    return y, (x, w, b is not None)


def linear_backward(dy, cache, need_dx=True):
    """``dx = dy @ w`` (None when not ``need_dx``), ``dw = dy.T @ x``, ``db = sum_n dy`` (None without bias)."""
    x, w, has_bias = cache
    _check.check_same_shape("linear_backward", "dy", dy, "y", (x.shape[0], w.shape[0]), dtype=x.dtype)
    db = dy.sum(axis=0) if has_bias else None
    return (dy @ w if need_dx else None), dy.T @ x, db


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


# ------------------------------------------------------------- optimizers


def sgd_update(param, grad, momentum_buf, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, first_step=False):
    """One SGD step in place on ``param`` (and ``momentum_buf``), as PyTorch::

        g = grad + weight_decay * param
        if momentum != 0:
            buf = g if first_step else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        param -= lr * g

    momentum_buf may be None when momentum == 0.  Returns None.
    """
    _check.check_sgd(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, _FLOATS)
    g = grad
    if weight_decay != 0:
        g = g + weight_decay * param  # a new array: grad is left alone
    if momentum != 0:
        if first_step:
            momentum_buf[...] = g
        else:
            momentum_buf *= momentum
            momentum_buf += (1 - dampening) * g
        g = g + momentum * momentum_buf if nesterov else momentum_buf
    param -= lr * g


def adam_update(param, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                decoupled=False):
    """One Adam (decoupled=False) or AdamW (decoupled=True) step in place, as PyTorch::

        Adam:  g = grad + weight_decay * param      AdamW: param *= 1 - lr * weight_decay
        m = beta1 m + (1 - beta1) g
        v = beta2 v + (1 - beta2) g^2
        m_hat = m / (1 - beta1^step);  v_hat = v / (1 - beta2^step)
        param -= lr m_hat / (sqrt(v_hat) + eps)

    ``step`` counts from 1.  Updates param, m and v; returns None.
    """
    _check.check_adam(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, _FLOATS)
    g = grad
    if weight_decay != 0:
        if decoupled:
            param *= 1 - lr * weight_decay
        else:
            g = g + weight_decay * param
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * g * g
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)


# ------------------------------------------------------------------- data


def _shifts(seed, batch, max_shift):
    """Per-row shifts (sy, sx), int64 arrays in [-max_shift, max_shift].

    r = splitmix64(seed ^ splitmix64(b)); sx from the low 32 bits of r, sy from
    the high 32 bits, each ``% (2 max_shift + 1) - max_shift``.
    """
    r = _counter_hash(seed, batch)
    span = np.uint64(2 * max_shift + 1)
    sx = ((r & _LOW32) % span).astype(np.int64) - max_shift
    sy = ((r >> np.uint64(32)) % span).astype(np.int64) - max_shift
    return sy, sx


def gather_batch(images, labels, indices, mean, std, pad=0, max_shift=0, seed=0):
    """Build a training batch ``(x, y)`` from uint8 images (N, H, W) and labels (N,) or None.

    Row b of x (B, 1, H + 2 pad, W + 2 pad), float32, is image ``indices[b]``:
    pixels / 255, shifted by (sy, sx) (pixel (i, j) moves to (i + sy, j + sx);
    what leaves the H x W frame is lost, what is uncovered is 0), surrounded by
    ``pad`` zero pixels, then every pixel (padding included) normalised
    ``(v - mean) / std``.  All float32, in that order: ``(float32(p) / 255 -
    mean) / std``.  Shifts as in :func:`_shifts` (0 when max_shift is 0).
    y = labels[indices] as int32, or None when labels is None.
    """
    out_shape, seed = _check.check_gather_batch(images, labels, indices, mean, std, pad, max_shift, seed)
    n_images, h, w = images.shape
    _check.check_index_values("gather_batch", "indices", indices, n_images, images=images, indices=indices)
    idx = indices.astype(np.int64)
    pixels = images[idx].astype(np.float32) / np.float32(255)
    sy, sx = _shifts(seed, len(idx), max_shift)

    canvas = np.zeros(out_shape, dtype=np.float32)
    for b in range(len(idx)):
        dy, dx = int(sy[b]), int(sx[b])
        if abs(dy) >= h or abs(dx) >= w:
            continue  # shifted out of the frame entirely: all zeros
        # Source rows [max(0, -dy), min(h, h - dy)) land on rows [max(0, dy), min(h, h + dy));
        # likewise for columns.
        src = pixels[b, max(0, -dy) : min(h, h - dy), max(0, -dx) : min(w, w - dx)]
        canvas[b, 0, pad + max(0, dy) : pad + min(h, h + dy), pad + max(0, dx) : pad + min(w, w + dx)] = src
    x = (canvas - np.float32(mean)) / np.float32(std)
    y = None if labels is None else labels[idx].astype(np.int32)
    return x, y


from .fused_cpu import fused_mlp_forward  # noqa: E402,F401  (the fused kernels' twins)
