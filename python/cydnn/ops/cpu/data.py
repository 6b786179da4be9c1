"""Training batches from a uint8 image dataset: gather, shift, pad, normalise (and, for
(N, C, H, W) images, flip and normalise per channel)."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .. import _check
from .._check_base import _array, _int, _integer_array, _number, _seed, _shapes
from .elementwise import counter_hash, splitmix64

__all__ = ["gather_batch", "gather_batch_chw", "shifts", "flips"]

#: The most channels gather_batch_chw takes (CYDNN_GATHER_MAX_CHANNELS in cpp/cydnn.h).
MAX_CHANNELS = 64

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


def flips(seed, batch):
    """Per-row horizontal flips (bool array): ``splitmix64(r) >> 63`` with r as in :func:`shifts`."""
    return (splitmix64(counter_hash(seed, batch)) >> np.uint64(63)).astype(bool)


def check_gather_batch_chw(images, labels, indices, mean, std, pad, max_shift, flip, seed):
    """Validate ``gather_batch_chw``; return ``(out_shape, mean, std, seed)``.

    images (N, C, H, W) uint8 with 1 <= C <= MAX_CHANNELS; labels None or (N,) integer; indices
    (B,) integer; mean and std: a number or C numbers, finite, std > 0 (returned as float32
    arrays of C values); pad, max_shift ints >= 0; flip a bool; seed an int in [0, 2**64).
    ``out_shape`` = (B, C, H + 2 pad, W + 2 pad).
    """
    op = "gather_batch_chw"
    _array(op, "images", images, (np.uint8,), 4, "(n_images, channels, h, w)")
    channels = int(images.shape[1])
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"{op}: images must have 1 to {MAX_CHANNELS} channels, got {channels} "
                         f"{_shapes(images=images)}")
    if labels is not None:
        _integer_array(op, "labels", labels, 1)
        if labels.shape[0] != images.shape[0]:
            raise ValueError(f"{op}: labels has {labels.shape[0]} entries but images has {images.shape[0]} "
                             f"{_shapes(images=images, labels=labels)}")
    _integer_array(op, "indices", indices, 1)
    stats = []
    for name, value in (("mean", mean), ("std", std)):
        values = np.atleast_1d(np.asarray(value, dtype=object))
        if values.ndim != 1 or len(values) not in (1, channels):
            raise ValueError(f"{op}: {name} must be a number or {channels} numbers (one per channel), "
                             f"got {value!r}")
        values = [_number(op, f"{name}[{i}]", v) for i, v in enumerate(values)]
        stats.append(np.array(values * (channels if len(values) == 1 else 1), dtype=np.float32))
    if not (stats[1] > 0).all():
        raise ValueError(f"{op}: std must be > 0 in every channel, got {std!r}")
    pad = _int(op, "pad", pad, 0)
    _int(op, "max_shift", max_shift, 0)
    if not isinstance(flip, (bool, np.bool_)):
        raise TypeError(f"{op}: flip must be a bool, got {flip!r}")
    seed = _seed(op, seed)
    out_shape = (int(indices.shape[0]), channels, int(images.shape[2]) + 2 * pad, int(images.shape[3]) + 2 * pad)
    return out_shape, stats[0], stats[1], seed


def gather_batch_chw(images, labels, indices, mean, std, pad=0, max_shift=0, flip=False, seed=0):
    """A batch ``(x, y)`` from uint8 images (N, C, H, W): gather, flip, shift, pad, normalise per channel.

    Row b of x (B, C, H + 2 pad, W + 2 pad), float32, is image ``indices[b]``, mirrored
    left-right when ``flip`` and ``flips(seed, B)[b]``, then shifted by ``shifts(seed, B,
    max_shift)[b]`` inside its H x W frame (zero fill), surrounded by ``pad`` zero pixels,
    then ``(float32(p) / 255 - mean[c]) / std[c]`` per channel c (padding included): the usual
    random crop of a zero-padded image when pad = 0 and max_shift = the crop padding.
    y = labels[indices] as int32, or None when labels is None.  The same numbers as the GPU
    kernel (cpp/data.cu), bit for bit.
    """
    out_shape, mean, std, seed = check_gather_batch_chw(images, labels, indices, mean, std, pad, max_shift,
                                                        flip, seed)
    n_images, channels, h, w = images.shape
    _check.check_index_values("gather_batch_chw", "indices", indices, n_images, images=images, indices=indices)
    idx = indices.astype(np.int64)
    batch = len(idx)
    sy, sx = shifts(seed, batch, max_shift)
    picked = images[idx]                                       # (B, C, H, W)
    if flip:
        mirrored = flips(seed, batch)
        picked = np.where(mirrored[:, None, None, None], picked[..., ::-1], picked)
    # Each channel plane moves with its image: shift the (B*C) planes with per-plane shifts.
    planes = _shifted(picked.reshape(batch * channels, h, w), np.repeat(sy, channels), np.repeat(sx, channels))

    canvas = np.zeros(out_shape, dtype=np.uint8)
    canvas[:, :, pad : pad + h, pad : pad + w] = planes.reshape(batch, channels, h, w)
    x = canvas.astype(np.float32)
    x /= np.float32(255)
    x -= mean[None, :, None, None]
    x /= std[None, :, None, None]
    y = None if labels is None else labels[idx].astype(np.int32)
    return x, y
