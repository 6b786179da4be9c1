"""2-d convolution (cross-correlation, as PyTorch): im2col + one matrix product for the whole batch.

The definition, for x (n, c, h, w) zero-padded to xp (n, c, hp, wp), w (k, c, kh, kw)::

    y[b, o, i, j] = bias[o] + sum_{c, p, q} w[o, c, p, q] * xp[b, c, i*sh + p, j*sw + q]

im2col lays the windows out as the columns of one matrix: ``cols[(c, p, q),
pixel]`` is the pixel at offset (p, q), channel c, of the window of an output
pixel (one column per output pixel of every image), so that ``Y = W @ cols``
with W = w as a (k, c*kh*kw) matrix -- a single BLAS call for the batch (one
product per image measured slower).  Backward is the same product read the
other way, with D = dy as a (k, pixels) matrix: ``dW = D @ cols.T``,
``dcols = W.T @ D``, and dx adds each column of dcols back into the window it
was read from (col2im).

The columns are ordered (b, i, j) -- image, then output row and column -- or,
when the output rows are short (ow < 16, e.g. LeNet's second layer, ow = 8),
(i, j, b) with the batch innermost.  im2col copies and col2im adds then move
runs of ow*n numbers instead of ow (measured 2.5-3x faster for LeNet's second
layer), at the price of transposing y and dy, element by element, to and from
NCHW -- which costs more than it saves when ow is long.

With the compiled kernels (``kernels.set_kernels("cython")``) the columns are
always ordered (i, j, b): x is transposed once to (c, h, w, n), after which
each im2col copy (and each col2im add) of a kernel offset and an output row is
one run of ow*n numbers (for stride 1); the padding is read as zeros, never
copied; the bias is added during the transposition of y to NCHW.  One pass
each, in C with OpenMP.  The cache has the same form either way, so the two
can be mixed (the kernels take a cache of either column order).  The products
go through ``_threads.matmul`` (BLAS threads by size) in both.

Direct path (compiled kernels, float32, stride 1, the CPU with AVX2 + FMA --
``_kernels.isa()`` -- and a small layer: ``c*kh*kw <= DIRECT_MAX_WINDOW``
and ``k <= DIRECT_MAX_OUT``, as LeNet's two layers): no im2col and no
matrix product.  The forward and the weight gradient are direct sums over
the (padded) input (``_kernels_direct.h``), the input gradient is computed
row by row from dy (``_kernels_rows.h``), each one pass in C parallel over
the batch (``_threads.kernel_threads``).  The cache then keeps the padded
input instead of the columns (``cols`` None, ``xp`` set); the twin's
backward takes that cache too (it makes the columns from xp), and the
kernels' backward takes the twin's.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import _check
from . import _threads, _windows, kernels
from .arrays import FLOATS as _FLOATS

__all__ = ["conv_forward", "conv_backward"]

#: output rows shorter than this put the batch innermost in the columns (see the module docstring)
BATCH_INNER_BELOW_OW = 16
#: the direct path takes layers with at most this many weights per output channel (c*kh*kw) ...
DIRECT_MAX_WINDOW = 256
#: ... and at most this many output channels (beyond, im2col + BLAS)
DIRECT_MAX_OUT = 64


def _direct(compiled, x, w, stride_hw):
    """Whether conv_forward takes the direct path (see the module docstring)."""
    k, c, kh, kw = w.shape
    return (x.dtype == np.float32 and tuple(stride_hw) == (1, 1) and c * kh * kw <= DIRECT_MAX_WINDOW
            and k <= DIRECT_MAX_OUT and x.size > 0 and w.size > 0 and getattr(compiled, "isa", None) is not None
            and compiled.isa() != "baseline")


def _im2col(xp, kernel_hw, stride_hw, batch_inner):
    """cols (c*kh*kw, n*oh*ow), rows ordered (c, p, q) like ``w.reshape(k, -1)``, columns
    ordered (i, j, b) if ``batch_inner`` else (b, i, j).  One copy."""
    sh, sw = stride_hw
    if batch_inner:
        xt = np.ascontiguousarray(xp.transpose(1, 2, 3, 0))  # (c, hp, wp, n)
        win = sliding_window_view(xt, kernel_hw, axis=(1, 2))[:, ::sh, ::sw]  # (c, oh, ow, n, kh, kw)
        view = win.transpose(0, 4, 5, 1, 2, 3)  # (c, kh, kw, oh, ow, n)
    else:
        win = _windows.windows(xp, kernel_hw, stride_hw)  # (n, c, oh, ow, kh, kw)
        view = win.transpose(1, 4, 5, 0, 2, 3)  # (c, kh, kw, n, oh, ow)
    c, kh, kw = view.shape[:3]
    return view.reshape(c * kh * kw, -1)


def _to_nchw(a, n, out_hw, batch_inner):
    """a (m, pixels) in the column order -> (n, m, oh, ow), C-contiguous."""
    oh, ow = out_hw
    if batch_inner:
        return np.ascontiguousarray(a.reshape(-1, oh, ow, n).transpose(3, 0, 1, 2))
    return np.ascontiguousarray(a.reshape(-1, n, oh, ow).transpose(1, 0, 2, 3))


def _from_nchw(a, batch_inner):
    """a (n, m, oh, ow) -> (m, pixels) in the column order."""
    return (a.transpose(1, 2, 3, 0) if batch_inner else a.transpose(1, 0, 2, 3)).reshape(a.shape[1], -1)


def _col2im(dcols, xp_shape, kernel_hw, stride_hw, out_hw, batch_inner):
    """The adjoint of :func:`_im2col`: dx of the padded input, (n, c, hp, wp), from dcols.

    The adds run with the batch innermost either way (dcols rearranged to
    (c, kh, kw, oh, ow, n) first when it is not), so that each of the kh*kw
    strided adds moves runs of ow*n numbers.
    """
    n, c, hp, wp = xp_shape
    (kh, kw), (oh, ow) = kernel_hw, out_hw
    if batch_inner:
        dcols = dcols.reshape(c, kh, kw, oh, ow, n)
    else:
        dcols = np.ascontiguousarray(dcols.reshape(c, kh, kw, n, oh, ow).transpose(0, 1, 2, 4, 5, 3))
    dxp = np.zeros((c, hp, wp, n), dtype=dcols.dtype)
    for p in range(kh):
        for q in range(kw):
            dxp[(slice(None),) + _windows.offset_pixels(p, q, out_hw, stride_hw)] += dcols[:, p, q]
    return dxp.transpose(3, 0, 1, 2)  # (n, c, hp, wp), a view


def conv_forward(x, w, b, stride=1, padding=0):
    """2-d cross-correlation: ``y[n, k, i, j] = b[k] + sum_{c,p,q} w[k, c, p, q] xp[n, c, i*sh + p, j*sw + q]``.

    x (n, c, h, w), w (k, c, kh, kw), b (k,) or None; xp is x zero-padded.
    Returns y (n, k, oh, ow), C-contiguous, and the cache.  Computed as one
    matrix product ``W (k, c*kh*kw) @ cols (c*kh*kw, n*oh*ow)`` (im2col).
    """
    stride_hw, pad_hw, out_hw = _check.check_conv(x, w, b, stride, padding, _FLOATS)
    n, k = x.shape[0], w.shape[0]
    xp_shape = x.shape[:2] + (x.shape[2] + 2 * pad_hw[0], x.shape[3] + 2 * pad_hw[1])
    compiled = kernels.active()
    if compiled is not None and _direct(compiled, x, w, stride_hw):
        return _forward_direct(compiled, x, w, b, pad_hw, out_hw, xp_shape)
    if compiled is not None:
        return _forward_compiled(compiled, x, w, b, stride_hw, pad_hw, out_hw, xp_shape)
    batch_inner = out_hw[1] < BATCH_INNER_BELOW_OW
    xp = _windows.pad(x, pad_hw)
    cols = _im2col(xp, w.shape[2:], stride_hw, batch_inner)
    y = _threads.matmul(w.reshape(k, -1), cols)  # (k, n*oh*ow)
    if b is not None:
        y += b[:, None]  # on contiguous rows: several times faster than on the (n, k, oh, ow) result
    # The cache keeps the columns (about kh*kw times x's size) so that backward needs no second im2col.
    return (_to_nchw(y, n, out_hw, batch_inner),
            (xp_shape, w, cols, b is not None, stride_hw, pad_hw, batch_inner, None))


def _forward_direct(compiled, x, w, b, pad_hw, out_hw, xp_shape):
    """conv_forward on the direct path: y from the padded input, no columns; the cache keeps xp."""
    n, k = x.shape[0], w.shape[0]
    xp = np.ascontiguousarray(_windows.pad(x, pad_hw))
    w = np.ascontiguousarray(w)
    y = np.empty((n, k) + tuple(out_hw), dtype=x.dtype)
    bias = np.zeros(1, dtype=x.dtype) if b is None else np.ascontiguousarray(b)
    compiled.conv_direct_forward(xp, w, bias, y, b is not None, _threads.kernel_threads(y.size * w[0].size))
    return y, (xp_shape, w, None, b is not None, (1, 1), pad_hw, None, xp)


def _backward_direct(compiled, dy, cache, need_dx):
    """conv_backward on the direct path (a cache with xp): the direct weight gradient, the row-by-row dx."""
    xp_shape, w, _, has_bias, _, pad_hw, _, xp = cache
    k = w.shape[0]
    dy = np.ascontiguousarray(dy)
    dw = np.empty(w.shape, dtype=dy.dtype)
    db = np.empty(k, dtype=dy.dtype) if has_bias else np.zeros(1, dtype=dy.dtype)
    macs = dy.size * w[0].size  # multiply-adds of each pass: the work that sets the threads
    compiled.conv_direct_weight_grad(xp, dy, dw, db, has_bias, _threads.kernel_threads(macs))
    if not need_dx:
        return None, dw, db if has_bias else None
    dxp = np.empty(xp_shape, dtype=dy.dtype)
    compiled.conv_rows_input_grad(dy, np.ascontiguousarray(w), dxp, _threads.kernel_threads(macs))
    return np.ascontiguousarray(_windows.unpad(dxp, pad_hw)), dw, db if has_bias else None


def _forward_compiled(compiled, x, w, b, stride_hw, pad_hw, out_hw, xp_shape):
    """conv_forward with the compiled kernels, the columns always ordered (i, j, b): x is
    transposed to (c, h, w, n) once, after which every im2col copy is a run of ow*n numbers."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    (oh, ow), threads = out_hw, _threads.kernel_threads
    xt = np.empty((c, h, wd, n), dtype=x.dtype)
    compiled.batch_inner(np.ascontiguousarray(x), xt, threads(x.size))
    cols = np.empty((c * kh * kw, n * oh * ow), dtype=x.dtype)
    compiled.im2col_bi(xt, cols, kh, kw, *stride_hw, *pad_hw, threads(cols.size))
    y = _threads.matmul(w.reshape(k, -1), cols)
    out = np.empty((n, k, oh, ow), dtype=x.dtype)
    bias = np.zeros(1, dtype=x.dtype) if b is None else np.ascontiguousarray(b)
    compiled.rows_bi_to_nchw(y, bias, out, b is not None, False, threads(y.size))
    return out, (xp_shape, w, cols, b is not None, stride_hw, pad_hw, True, None)


def _backward_compiled(compiled, dy, cache, need_dx):
    """conv_backward with the compiled kernels (either column order of the cache)."""
    xp_shape, w, cols, has_bias, stride_hw, pad_hw, batch_inner, _ = cache
    n, c, hp, wp = xp_shape
    k, _, kh, kw = w.shape
    h, wd = hp - 2 * pad_hw[0], wp - 2 * pad_hw[1]
    threads = _threads.kernel_threads
    dy = np.ascontiguousarray(dy)
    d = np.empty((k, cols.shape[1]), dtype=dy.dtype)  # dy as rows, columns ordered like cols
    if batch_inner:
        compiled.nchw_to_rows_bi(dy, d, threads(d.size))
    else:
        compiled.nchw_to_rows(dy, d, False, threads(d.size))
    # dW^T = cols @ D^T: the same sums, and OpenBLAS runs this orientation of the long, thin
    # product ~1.3-1.5x faster than D @ cols.T (measured for LeNet's two layers)
    dw = np.ascontiguousarray(_threads.matmul(cols, d.T).T).reshape(w.shape)
    db = d.sum(axis=1) if has_bias else None
    if not need_dx:
        return None, dw, db
    dcols = _threads.matmul(w.reshape(k, -1).T, d)
    if batch_inner:  # added into dx as (c, h, w, n), in runs of ow*n, then transposed
        dxt = np.zeros((c, h, wd, n), dtype=dy.dtype)
        compiled.col2im_bi(dcols, dxt, kh, kw, *stride_hw, *pad_hw, threads(dcols.size))
        dx = np.empty((n, c, h, wd), dtype=dy.dtype)
        compiled.batch_outer(dxt, dx, threads(dx.size))
    else:  # added straight into dx; the padding is never written
        dx = np.zeros((n, c, h, wd), dtype=dy.dtype)
        compiled.col2im(dcols, dx, kh, kw, *stride_hw, *pad_hw, False, threads(dcols.size))
    return dx, dw, db


def conv_backward(dy, cache, need_dx=True):
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, db None when there was no bias,
    dx None when ``need_dx`` is False (the first layer of a network).

    With Y = W @ cols and D = dy as (k, n*oh*ow): ``dW = D @ cols.T``,
    ``db = the row sums of D``, ``dcols = W.T @ D``; dx is dcols added back into
    the windows they were read from (col2im), then unpadded.
    """
    xp_shape, w, cols, has_bias, stride_hw, pad_hw, batch_inner, xp = cache
    n, c, hp, wp = xp_shape
    k, _, kh, kw = w.shape
    out_hw = ((hp - kh) // stride_hw[0] + 1, (wp - kw) // stride_hw[1] + 1)
    _check.check_same_shape("conv_backward", "dy", dy, "y", (n, k) + out_hw, dtype=w.dtype)

    compiled = kernels.active()
    if compiled is not None and cols is None and getattr(compiled, "isa", None) is not None:
        return _backward_direct(compiled, dy, cache, need_dx)
    if cols is None:  # a cache of the direct path: its columns, made from the padded input it kept
        cols, batch_inner = _im2col(xp, (kh, kw), stride_hw, False), False
        cache = (xp_shape, w, cols, has_bias, stride_hw, pad_hw, batch_inner, None)
    if compiled is not None:
        return _backward_compiled(compiled, dy, cache, need_dx)
    d = _from_nchw(dy, batch_inner)  # (k, n*oh*ow), columns ordered like cols
    dw = _threads.matmul(d, cols.T).reshape(w.shape)
    db = d.sum(axis=1) if has_bias else None
    if not need_dx:
        return None, dw, db
    dxp = _col2im(_threads.matmul(w.reshape(k, -1).T, d), xp_shape, (kh, kw), stride_hw, out_hw, batch_inner)
    return np.ascontiguousarray(_windows.unpad(dxp, pad_hw)), dw, db
