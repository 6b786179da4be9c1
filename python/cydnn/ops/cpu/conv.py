"""2-d convolution (cross-correlation, as PyTorch): im2col + one batched matrix product.

The definition, for x (n, c, h, w) zero-padded to xp (n, c, hp, wp), w (k, c, kh, kw)::

    y[b, o, i, j] = bias[o] + sum_{c, p, q} w[o, c, p, q] * xp[b, c, i*sh + p, j*sw + q]

im2col lays the windows out as columns: ``cols[b, (c, p, q), u]`` is the pixel
at offset (p, q), channel c, of the window of output position u of image b,
so that ``y[b] = W @ cols[b]`` with W = w as a (k, c*kh*kw) matrix -- one
``np.matmul`` for the batch.  Backward is the same product read the other
way: ``dW = sum_b D[b] @ cols[b].T``, ``dcols[b] = W.T @ D[b]``, and dx adds
each column of dcols back into the window it was read from (col2im).

Output positions u are numbered ``u = i * pitch + j``.  For stride 1 the
pitch is the padded row length wp, so that the offset (p, q) of *every*
window is one contiguous run of xp's flattened plane: ``xp_flat[p*wp + q + u]``.
im2col is then kh*kw plain slices, and col2im kh*kw adds of contiguous runs,
instead of (oh, ow) blocks with short rows.  The price: the columns j in
[ow, wp) of each output row are computed too and dropped (wp/ow times the
work of the product; 28/24 and 12/8 for LeNet's two layers).  Other strides
use pitch = ow, the plain (oh, ow) grid.
"""
import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import _check
from . import _windows
from .arrays import FLOATS as _FLOATS

__all__ = ["conv_forward", "conv_backward"]


def _positions(oh, ow, pitch):
    """The number of output positions u = i * pitch + j for i < oh, j < ow: the last is (oh-1)*pitch + ow-1."""
    return (oh - 1) * pitch + ow


def _grid(a, out_hw, pitch):
    """A view (n, m, oh, ow) of a positions array a (n, m, P): entry (i, j) is position i * pitch + j."""
    n, m, _ = a.shape
    s = a.strides
    return as_strided(a, (n, m) + tuple(out_hw), (s[0], s[1], pitch * s[2], s[2]), writeable=False)


def _im2col(xp, kernel_hw, stride_hw, out_hw):
    """``(cols, pitch)``: cols (n, c*kh*kw, P) C-contiguous, ``cols[b, (c, p, q), i*pitch + j]`` =
    ``xp[b, c, i*sh + p, j*sw + q]``; rows ordered (c, p, q) like ``w.reshape(k, -1)``."""
    n, c, hp, wp = xp.shape
    (kh, kw), (oh, ow) = kernel_hw, out_hw
    if tuple(stride_hw) == (1, 1):
        pitch = wp
        flat = np.ascontiguousarray(xp).reshape(n, c, hp * wp)
        s = flat.strides
        # Offset (p, q) of the windows at positions u = 0 .. P-1 is flat[b, c, p*wp + q + u].
        view = as_strided(flat, (n, c, kh, kw, _positions(oh, ow, pitch)), (s[0], s[1], wp * s[2], s[2], s[2]),
                          writeable=False)
    else:
        pitch = ow
        view = _windows.windows(xp, kernel_hw, stride_hw).transpose(0, 1, 4, 5, 2, 3)  # (n, c, kh, kw, oh, ow)
    return np.ascontiguousarray(view).reshape(n, c * kh * kw, -1), pitch


def _col2im(dcols, xp_shape, kernel_hw, stride_hw, out_hw, pitch):
    """The adjoint of :func:`_im2col`: dxp (n, c, hp, wp), each column of dcols (n, c*kh*kw, P)
    added back into the window it was read from (overlapping windows accumulate)."""
    n, c, hp, wp = xp_shape
    kh, kw = kernel_hw
    dcols = dcols.reshape(n, c, kh, kw, -1)
    dxp = np.zeros(xp_shape, dtype=dcols.dtype)
    if pitch == wp and tuple(stride_hw) == (1, 1):
        flat = dxp.reshape(n, c, hp * wp)
        P = dcols.shape[-1]
        for p in range(kh):
            for q in range(kw):
                flat[:, :, p * wp + q : p * wp + q + P] += dcols[:, :, p, q]
        return dxp
    dwin = dcols.reshape(n, c, kh, kw, *out_hw).transpose(0, 1, 4, 5, 2, 3)  # (n, c, oh, ow, kh, kw)
    _windows.add_windows(dxp, dwin, stride_hw)
    return dxp


def conv_forward(x, w, b, stride=1, padding=0):
    """2-d cross-correlation: ``y[n, k, i, j] = b[k] + sum_{c,p,q} w[k, c, p, q] xp[n, c, i*sh + p, j*sw + q]``.

    x (n, c, h, w), w (k, c, kh, kw), b (k,) or None; xp is x zero-padded.
    Returns y (n, k, oh, ow), C-contiguous, and the cache.  Computed as
    ``y[b] = W (k, c*kh*kw) @ cols[b]`` (im2col; see the module docstring).
    """
    stride_hw, pad_hw, out_hw = _check.check_conv(x, w, b, stride, padding, _FLOATS)
    k = w.shape[0]
    xp = _windows.pad(x, pad_hw)
    cols, pitch = _im2col(xp, w.shape[2:], stride_hw, out_hw)
    y = np.matmul(w.reshape(k, -1), cols)  # (n, k, P)
    if b is not None:
        y += b[:, None]  # here rather than on the grid below: contiguous rows, several times faster
    y = np.ascontiguousarray(_grid(y, out_hw, pitch))  # (n, k, oh, ow)
    # The cache keeps the columns (about kh*kw times x's size) so that backward needs no second im2col.
    return y, (xp.shape, w, cols, pitch, b is not None, stride_hw, pad_hw)


def conv_backward(dy, cache, need_dx=True):
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, db None when there was no bias,
    dx None when ``need_dx`` is False (the first layer of a network).

    With D[b] = dy[b] as a (k, positions) matrix: ``dW = sum_b D[b] @ cols[b].T``,
    ``db[k] = sum of dy[:, k]``, ``dcols[b] = W.T @ D[b]``; dx is dcols added back
    into the windows they were read from (col2im), then unpadded.
    """
    xp_shape, w, cols, pitch, has_bias, stride_hw, pad_hw = cache
    n, c, hp, wp = xp_shape
    k, _, kh, kw = w.shape
    out_hw = ((hp - kh) // stride_hw[0] + 1, (wp - kw) // stride_hw[1] + 1)
    _check.check_same_shape("conv_backward", "dy", dy, "y", (n, k) + out_hw, dtype=w.dtype)

    # D (n, k, P): dy at positions i * pitch + j, zero at the positions that are not outputs.
    oh, ow = out_hw
    if pitch == ow:
        d = dy.reshape(n, k, oh * ow)
    else:
        d = np.zeros((n, k, oh * pitch), dtype=dy.dtype)
        d.reshape(n, k, oh, pitch)[:, :, :, :ow] = dy
        d = d[:, :, : cols.shape[-1]]
    w2 = w.reshape(k, -1)
    dw = np.matmul(d, cols.transpose(0, 2, 1)).sum(axis=0).reshape(w.shape)
    db = dy.sum(axis=(0, 2, 3)) if has_bias else None
    if not need_dx:
        return None, dw, db
    dxp = _col2im(np.matmul(w2.T, d), xp_shape, (kh, kw), stride_hw, out_hw, pitch)
    return _windows.unpad(dxp, pad_hw), dw, db
