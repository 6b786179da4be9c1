"""Training batches from a uint8 image dataset: gather, shift, pad, normalise."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import _check
from .elementwise import counter_hash

__all__ = ["gather_batch", "shifts"]

_LOW32 = np.uint64(0xFFFFFFFF)  # mask of the low 32 bits of a uint64


def shifts(seed, batch, max_shift):
    """Per-row shifts (sy, sx), int64 arrays in [-max_shift, max_shift].

    r = splitmix64(seed ^ splitmix64(b)); sx from the low 32 bits of r, sy from
    the high 32 bits, each ``% (2 max_shift + 1) - max_shift``.
    """
    r = counter_hash(seed, batch)
    span = np.uint64(2 * max_shift + 1)
    sx = ((r & _LOW32) % span).astype(np.int64) - max_shift
    sy = ((r >> np.uint64(32)) % span).astype(np.int64) - max_shift
    return sy, sx


def _shifted(frames, sy, sx):
    """``out[b, i, j] = frames[b, i - sy[b], j - sx[b]]``, 0 where that is outside the frame.

    The reference is a loop over the rows b, copying the part of frame b that
    stays in the frame.  Here: every frame gets a margin of m zeros (m the
    largest shift, capped at the frame size, since a shift by the frame size
    already leaves nothing), and row b is the (h, w) window of its bordered
    frame that starts at (m - sy[b], m - sx[b]): one fancy-indexed copy.
    """
    b, h, w = frames.shape
    mh, mw = min(int(np.abs(sy).max(initial=0)), h), min(int(np.abs(sx).max(initial=0)), w)
    if mh == 0 and mw == 0:
        return frames
    bordered = np.zeros((b, h + 2 * mh, w + 2 * mw), dtype=frames.dtype)
    bordered[:, mh : mh + h, mw : mw + w] = frames
    windows = sliding_window_view(bordered, (h, w), axis=(1, 2))  # (b, 2 mh + 1, 2 mw + 1, h, w), a view
    return windows[np.arange(b), mh - np.clip(sy, -mh, mh), mw - np.clip(sx, -mw, mw)]


def gather_batch(images, labels, indices, mean, std, pad=0, max_shift=0, seed=0):
    """Build a training batch ``(x, y)`` from uint8 images (N, H, W) and labels (N,) or None.

    Row b of x (B, 1, H + 2 pad, W + 2 pad), float32, is image ``indices[b]``:
    pixels / 255, shifted by (sy, sx) (pixel (i, j) moves to (i + sy, j + sx);
    what leaves the H x W frame is lost, what is uncovered is 0), surrounded by
    ``pad`` zero pixels, then every pixel (padding included) normalised
    ``(v - mean) / std``.  All float32, in that order: ``(float32(p) / 255 -
    mean) / std``.  Shifts as in :func:`shifts` (0 when max_shift is 0).
    y = labels[indices] as int32, or None when labels is None.

    The shifting and padding move uint8 pixels (:func:`_shifted`: no loop
    over the rows); the float formula is applied once, to the whole batch.
    """
    out_shape, seed = _check.check_gather_batch(images, labels, indices, mean, std, pad, max_shift, seed)
    n_images, h, w = images.shape
    _check.check_index_values("gather_batch", "indices", indices, n_images, images=images, indices=indices)
    idx = indices.astype(np.int64)
    sy, sx = shifts(seed, len(idx), max_shift)

    canvas = np.zeros(out_shape, dtype=np.uint8)  # 0 pixels: the padding and what the shift uncovers
    canvas[:, 0, pad : pad + h, pad : pad + w] = _shifted(images[idx], sy, sx)
    x = canvas.astype(np.float32)
    x /= np.float32(255)
    x -= np.float32(mean)
    x /= np.float32(std)
    y = None if labels is None else labels[idx].astype(np.int32)
    return x, y
