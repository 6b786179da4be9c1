"""Max and average pooling.

Both work on :func:`_windows.windows`, a view (n, c, oh, ow, kh, kw) of every
window, one whole-array step per kernel offset (p, q) -- never a copy of the
windows.  Backward writes the gradient straight into dx when the windows tile
the input (stride == kernel, no padding: LeNet's 2x2/2) and otherwise adds it
back one offset at a time (overlapping windows accumulate).

With the compiled kernels (``kernels.set_kernels("cython")``) each op is one
pass over the (image, channel) planes in C with OpenMP, the padding never
materialised; the caches have the same form (max pooling's offsets as int32).
Max pooling with a 2 x 2 kernel, stride 2 and no padding (LeNet's) on float32
takes a kernel of its own (``_kernels_pool.h``): 8 windows at a time with AVX2
where the CPU has it, bit for bit the twin's result either way.
"""
import numpy as np

from .. import _check
from . import _threads, _windows, kernels
from .arrays import FLOATS as _FLOATS

__all__ = ["max_pool_forward", "max_pool_backward", "avg_pool_forward", "avg_pool_backward"]


def _pool2x2(compiled, dtype, size, kernel_hw, stride_hw, pad_hw):
    """Whether max pooling takes the 2 x 2 / 2 kernel (float32, no padding, something to pool)."""
    return (dtype == np.float32 and tuple(kernel_hw) == (2, 2) and tuple(stride_hw) == (2, 2)
            and tuple(pad_hw) == (0, 0) and size > 0 and getattr(compiled, "max_pool2x2_forward", None) is not None)


def _tiled(x_shape, kernel_hw, stride_hw, pad_hw):
    """Whether the windows tile the input without overlap or padding (stride == kernel, pad 0)."""
    return tuple(stride_hw) == tuple(kernel_hw) and tuple(pad_hw) == (0, 0)


def _scatter_tiles(x_shape, dtiles):
    """dx (n, c, h, w) from the gradient of the tiles dtiles (n, c, oh, kh, ow, kw); rows and columns
    that no window covers (h % kh, w % kw) get 0."""
    n, c, oh, kh, ow, kw = dtiles.shape
    if x_shape[2:] == (oh * kh, ow * kw):
        return np.ascontiguousarray(dtiles).reshape(x_shape)
    dx = np.zeros(x_shape, dtype=dtiles.dtype)
    dx[:, :, : oh * kh, : ow * kw] = dtiles.reshape(n, c, oh * kh, ow * kw)
    return dx


# -------------------------------------------------------------------- max


def max_pool_forward(x, kernel=2, stride=None, padding=0):
    """Max pooling: ``y[n, c, i, j] = max over the window (i, j) of xp``, xp padded with -inf.

    stride None means stride = kernel.  Returns y (n, c, oh, ow) and the cache,
    which records for each window the position backward sends the gradient
    to: scanning the window row by row from ``best = -inf``, the position of
    the last *strictly greater* value -- so the first maximum wins ties, and
    neither padding nor a NaN ever wins (the GPU kernel's rule).  A window
    with nothing above -inf gives -inf and position (0, 0).
    """
    kernel_hw, stride_hw, pad_hw, (oh, ow) = _check.check_pool(
        "max_pool_forward", x, kernel, stride, padding, _FLOATS)
    kh, kw = kernel_hw
    compiled = kernels.active()
    if compiled is not None:
        x = np.ascontiguousarray(x)
        y = np.empty(x.shape[:2] + (oh, ow), dtype=x.dtype)
        arg = np.empty(y.shape, dtype=np.int32)
        if _pool2x2(compiled, x.dtype, y.size, kernel_hw, stride_hw, pad_hw):
            compiled.max_pool2x2_forward(x, y, arg, _threads.kernel_threads(x.size))
        else:
            compiled.max_pool_forward(x, y, arg, kh, kw, *stride_hw, *pad_hw, _threads.kernel_threads(x.size))
        return y, (x.shape, x.dtype, arg, kernel_hw, stride_hw, pad_hw)
    win = _windows.windows(_windows.pad(x, pad_hw, -np.inf), kernel_hw, stride_hw)
    y = np.full(win.shape[:4], -np.inf, dtype=x.dtype)  # the running maximum
    np.fmax(y, win[:, :, :, :, 0, 0], out=y)  # offset (0, 0), a NaN read as -inf
    arg = np.zeros(y.shape, dtype=np.uint8 if kh * kw <= 256 else np.int32)  # its offset p*kw + q
    v = np.empty_like(y)  # offset (p, q) of every window, contiguous: the strided view is read once
    for p in range(kh):
        for q in range(kw):
            if p or q:
                np.copyto(v, win[:, :, :, :, p, q])
                # arg = where(v > y, p*kw + q, arg), in arithmetic (np.where is slow on random masks):
                # offsets only grow, so max(arg, (v > y) * offset) is the offset exactly where v > y.
                np.maximum(arg, (v > y) * arg.dtype.type(p * kw + q), out=arg)
                np.fmax(y, v, out=y)  # = where(v > y, v, y), NaN never taken
    return y, (x.shape, x.dtype, arg, kernel_hw, stride_hw, pad_hw)


def max_pool_backward(dy, cache):
    """Gradient of :func:`max_pool_forward`: each ``dy[n, c, i, j]`` goes to the recorded
    maximum of window (i, j); overlapping windows accumulate; padding gets nothing.

    ``dwin[n, c, i, j, p, q] = dy[n, c, i, j] * (arg[n, c, i, j] == p*kw + q)`` (a product
    rather than np.where, which is several times slower: so a non-finite dy makes the
    whole window NaN, not only its maximum).
    """
    x_shape, dtype, arg, kernel_hw, stride_hw, pad_hw = cache
    _check.check_same_shape("max_pool_backward", "dy", dy, "y", arg.shape, dtype=dtype)
    n, c, h, w = x_shape
    kh, kw = kernel_hw
    compiled = kernels.active()
    if compiled is not None and _pool2x2(compiled, dtype, arg.size, kernel_hw, stride_hw, pad_hw):
        dx = np.empty(x_shape, dtype=dtype)  # every element written
        compiled.max_pool2x2_backward(np.ascontiguousarray(dy), np.ascontiguousarray(arg, dtype=np.int32), dx,
                                      _threads.kernel_threads(dx.size))
        return dx
    if compiled is not None:
        dx = np.zeros(x_shape, dtype=dtype)
        compiled.max_pool_backward(np.ascontiguousarray(dy), np.ascontiguousarray(arg, dtype=np.int32), dx,
                                   kh, kw, *stride_hw, *pad_hw, _threads.kernel_threads(dx.size))
        return dx
    if _tiled(x_shape, kernel_hw, stride_hw, pad_hw):  # written straight into dx's tiles
        dtiles = np.empty((n, c, h // kh, kh, w // kw, kw), dtype=dtype)
        for p in range(kh):
            for q in range(kw):
                np.multiply(dy, arg == p * kw + q, out=dtiles[:, :, :, p, :, q])
        return _scatter_tiles(x_shape, dtiles)
    dxp = np.zeros((n, c, h + 2 * pad_hw[0], w + 2 * pad_hw[1]), dtype=dtype)
    for p in range(kh):
        for q in range(kw):
            dxp[(Ellipsis,) + _windows.offset_pixels(p, q, arg.shape[2:], stride_hw)] += dy * (arg == p * kw + q)
    return _windows.unpad(dxp, pad_hw)


# -------------------------------------------------------------------- avg


def avg_pool_forward(x, kernel=2, stride=None, padding=0):
    """Average pooling: ``y[n, c, i, j] = sum over window (i, j) of xp / (kh*kw)``.

    xp is x zero-padded and the padding counts in the average: the divisor is
    always kh*kw (PyTorch's count_include_pad=True).  stride None means
    stride = kernel.  Returns y (n, c, oh, ow) and the cache.
    """
    kernel_hw, stride_hw, pad_hw, out_hw = _check.check_pool(
        "avg_pool_forward", x, kernel, stride, padding, _FLOATS)
    kh, kw = kernel_hw
    compiled = kernels.active()
    if compiled is not None:
        x = np.ascontiguousarray(x)
        y = np.empty(x.shape[:2] + out_hw, dtype=x.dtype)
        compiled.avg_pool_forward(x, y, kh, kw, *stride_hw, *pad_hw, _threads.kernel_threads(x.size))
        return y, (x.shape, x.dtype, y.shape, kernel_hw, stride_hw, pad_hw)
    win = _windows.windows(_windows.pad(x, pad_hw, 0.0), kernel_hw, stride_hw)
    y = win[:, :, :, :, 0, 0].copy()
    for p in range(kh):
        for q in range(kw):
            if p or q:
                y += win[:, :, :, :, p, q]
    y /= kh * kw
    return y, (x.shape, x.dtype, y.shape, kernel_hw, stride_hw, pad_hw)


def avg_pool_backward(dy, cache):
    """Gradient of :func:`avg_pool_forward`: every pixel of window (i, j) gets
    ``dy[n, c, i, j] / (kh*kw)``; overlapping windows accumulate."""
    x_shape, dtype, y_shape, kernel_hw, stride_hw, pad_hw = cache
    _check.check_same_shape("avg_pool_backward", "dy", dy, "y", y_shape, dtype=dtype)
    n, c, h, w = x_shape
    kh, kw = kernel_hw
    compiled = kernels.active()
    if compiled is not None:
        dx = np.zeros(x_shape, dtype=dtype)
        compiled.avg_pool_backward(np.ascontiguousarray(dy), dx, kh, kw, *stride_hw, *pad_hw,
                                   _threads.kernel_threads(dx.size))
        return dx
    share = dy / (kh * kw)
    if _tiled(x_shape, kernel_hw, stride_hw, pad_hw):
        oh, ow = y_shape[2:]
        return _scatter_tiles(x_shape, np.broadcast_to(share[:, :, :, None, :, None], (n, c, oh, kh, ow, kw)))
    dwin = np.broadcast_to(share[..., None, None], y_shape + (kh, kw))  # a view, no copy
    dxp = np.zeros((n, c, h + 2 * pad_hw[0], w + 2 * pad_hw[1]), dtype=dtype)
    _windows.add_windows(dxp, dwin, stride_hw)
    return _windows.unpad(dxp, pad_hw)
