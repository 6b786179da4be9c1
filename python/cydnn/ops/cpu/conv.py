"""2-d convolution (cross-correlation, as PyTorch): im2col + one matrix product for the whole batch.

The definition, for x (n, c, h, w) zero-padded to xp (n, c, hp, wp), w (k, c, kh, kw)::

    y[b, o, i, j] = bias[o] + sum_{c, p, q} w[o, c, p, q] * xp[b, c, i*sh + p, j*sw + q]

im2col lays the windows out as the columns of one matrix: ``cols[(c, p, q),
(b, i, j)]`` is the pixel at offset (p, q), channel c, of the window of output
pixel (i, j) of image b, so that ``Y = W @ cols`` with W = w as a
(k, c*kh*kw) matrix -- a single BLAS call for the batch (large enough for
BLAS to use its threads; one product per image measured slower).  Backward is
the same product read the other way, with D = dy as a (k, n*oh*ow) matrix:
``dW = D @ cols.T``, ``dcols = W.T @ D``, and dx adds each column of dcols
back into the window it was read from (col2im).
"""
import numpy as np

from .. import _check
from . import _windows
from .arrays import FLOATS as _FLOATS

__all__ = ["conv_forward", "conv_backward"]


def _im2col(xp, kernel_hw, stride_hw):
    """cols (c*kh*kw, n*oh*ow): column (b, i, j) the window of output pixel (i, j) of image b,
    rows ordered (c, p, q) like ``w.reshape(k, -1)``.  One copy, in runs of rows of xp."""
    win = _windows.windows(xp, kernel_hw, stride_hw)  # (n, c, oh, ow, kh, kw), a view
    n, c, oh, ow, kh, kw = win.shape
    return win.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * oh * ow)


def _col2im(dcols, xp_shape, kernel_hw, stride_hw, out_hw):
    """The adjoint of :func:`_im2col`: dxp (n, c, hp, wp) from dcols (c*kh*kw, n*oh*ow).

    One strided add per kernel offset (p, q), with the batch innermost (dcols
    rearranged to (c, kh, kw, oh, ow, n) once), so that each add moves runs of
    ow*n numbers rather than ow.
    """
    n, c, hp, wp = xp_shape
    (kh, kw), (oh, ow) = kernel_hw, out_hw
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
    stride_hw, pad_hw, (oh, ow) = _check.check_conv(x, w, b, stride, padding, _FLOATS)
    n, k = x.shape[0], w.shape[0]
    xp = _windows.pad(x, pad_hw)
    cols = _im2col(xp, w.shape[2:], stride_hw)
    y = w.reshape(k, -1) @ cols  # (k, n*oh*ow)
    if b is not None:
        y += b[:, None]  # on contiguous rows: several times faster than on the (n, k, oh, ow) result
    y = np.ascontiguousarray(y.reshape(k, n, oh, ow).transpose(1, 0, 2, 3))
    # The cache keeps the columns (about kh*kw times x's size) so that backward needs no second im2col.
    return y, (xp.shape, w, cols, b is not None, stride_hw, pad_hw)


def conv_backward(dy, cache, need_dx=True):
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, db None when there was no bias,
    dx None when ``need_dx`` is False (the first layer of a network).

    With Y = W @ cols and D = dy as (k, n*oh*ow): ``dW = D @ cols.T``,
    ``db = the row sums of D``, ``dcols = W.T @ D``; dx is dcols added back into
    the windows they were read from (col2im), then unpadded.
    """
    xp_shape, w, cols, has_bias, stride_hw, pad_hw = cache
    n, c, hp, wp = xp_shape
    k, _, kh, kw = w.shape
    out_hw = ((hp - kh) // stride_hw[0] + 1, (wp - kw) // stride_hw[1] + 1)
    _check.check_same_shape("conv_backward", "dy", dy, "y", (n, k) + out_hw, dtype=w.dtype)

    d = dy.transpose(1, 0, 2, 3).reshape(k, -1)  # (k, n*oh*ow), columns ordered like cols
    dw = (d @ cols.T).reshape(w.shape)
    db = d.sum(axis=1) if has_bias else None
    if not need_dx:
        return None, dw, db
    dxp = _col2im(w.reshape(k, -1).T @ d, xp_shape, (kh, kw), stride_hw, out_hw)
    return np.ascontiguousarray(_windows.unpad(dxp, pad_hw)), dw, db
