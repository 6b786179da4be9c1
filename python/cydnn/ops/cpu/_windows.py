"""Kernel windows of an NCHW array as views, and the adjoint that adds window gradients back.

Shared by convolution and pooling.  ``hw`` arguments are (h, w) pairs of ints.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["pad", "unpad", "windows", "offset_pixels", "add_windows"]


def pad(x, pad_hw, value=0.0):
    """x (n, c, h, w) with ``pad_hw`` rows/columns of ``value`` added on each side (x itself if none)."""
    ph, pw = pad_hw
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    xp[:, :, ph : ph + h, pw : pw + w] = x
    return xp


def unpad(xp, pad_hw):
    """Remove ``pad_hw`` rows/columns from each side of xp (n, c, hp, wp); a C-contiguous array."""
    ph, pw = pad_hw
    if ph == 0 and pw == 0:
        return xp
    hp, wp = xp.shape[2:]
    return np.ascontiguousarray(xp[:, :, ph : hp - ph, pw : wp - pw])


def windows(xp, kernel_hw, stride_hw):
    """A view (n, c, oh, ow, kh, kw) of every kernel window of the padded input xp (no copy).

    ``[b, ch, i, j]`` is the window ``xp[b, ch, i*sh : i*sh + kh, j*sw : j*sw + kw]``, so
    ``[..., p, q]`` is, for every window at once, its pixel at offset (p, q): an (n, c, oh, ow) view.
    """
    win = sliding_window_view(xp, kernel_hw, axis=(2, 3))  # every window position, stride 1
    return win[:, :, :: stride_hw[0], :: stride_hw[1]]


def offset_pixels(p, q, out_hw, stride_hw):
    """Index (slice_h, slice_w) of the pixels of the padded input at offset (p, q) of every window:
    ``xp[:, :, sl_h, sl_w]`` is (n, c, oh, ow), entry (i, j) the pixel (i*sh + p, j*sw + q)."""
    (oh, ow), (sh, sw) = out_hw, stride_hw
    return slice(p, p + sh * (oh - 1) + 1, sh), slice(q, q + sw * (ow - 1) + 1, sw)


def add_windows(dxp, dwin, stride_hw):
    """The adjoint of :func:`windows`: add each window's gradient back where it was read.

    dxp (n, c, hp, wp) is the gradient of the padded input (updated in place);
    dwin (n, c, oh, ow, kh, kw) the gradient of each window (any view).  One
    strided add per kernel offset (p, q) (:func:`offset_pixels`); overlapping
    windows accumulate.
    """
    _, _, oh, ow, kh, kw = dwin.shape
    for p in range(kh):
        for q in range(kw):
            dxp[(Ellipsis,) + offset_pixels(p, q, (oh, ow), stride_hw)] += dwin[:, :, :, :, p, q]
