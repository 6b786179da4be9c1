"""Batches: :class:`DataLoader` shuffles, and builds each batch with one backend op,
``ops.gather_batch`` (grey (N, H, W) images) or ``gather_batch_chw`` ((N, C, H, W) images), so the
same loop runs on the CPU (numpy) and on the GPU."""

import operator

import numpy as np

import cydnn.ops

from .idx import _check_pair, _check_labels

_MAX_CHANNELS = 64  # what gather_batch_chw takes (CYDNN_GATHER_MAX_CHANNELS)

# Tags that keep the random streams of a loader apart (see DataLoader).
_PERMUTATION_STREAM = 0
_AUGMENTATION_STREAM = 1


def _nonnegative_int(value, name):
    try:
        value = operator.index(value)  # accepts int and numpy integers, refuses floats
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _channel_stats(mean, std, channels, per_channel):
    """``(mean, std)``: floats for grey images, tuples of ``channels`` floats for (N, C, H, W)
    ones (a single number applies to every channel).  Finite, std > 0, else ValueError."""
    values = []
    for name, v in (("mean", mean), ("std", std)):
        arr = np.atleast_1d(np.asarray(v, dtype=np.float64))
        if arr.ndim != 1 or len(arr) not in (1, channels):
            raise ValueError(f"DataLoader: {name} must be a number or {channels} numbers (one per channel), "
                             f"got {v!r}")
        if not np.isfinite(arr).all():
            raise ValueError(f"need a finite mean and a std > 0, got mean={mean}, std={std}")
        values.append(np.broadcast_to(arr, (channels,)))
    if not (values[1] > 0).all():
        raise ValueError(f"need a finite mean and a std > 0, got mean={mean}, std={std}")
    if per_channel:
        return tuple(float(m) for m in values[0]), tuple(float(s) for s in values[1])
    return float(values[0][0]), float(values[1][0])


def _gather_chw(ops):
    """The backend's ``gather_batch_chw`` (the CPU package exports only ``gather_batch``: its
    twin lives in ``ops.cpu.data``)."""
    gather = getattr(ops, "gather_batch_chw", None)
    if gather is None:
        from cydnn.ops.cpu.data import gather_batch_chw as gather
    return gather


class DataLoader:
    """Mini-batches ``(x, y)`` of an image dataset, built on the CPU or on the GPU.

    ``images`` are uint8, ``(N, H, W)`` (grey) or ``(N, C, H, W)`` (C channels).
    ``x`` is float32 ``(B, C, H + 2*pad, W + 2*pad)`` (C = 1 for grey images) holding
    ``(pixel / 255 - mean[c]) / std[c]`` (zero padding is applied to the pixels
    first, so the border reads ``-mean / std``); ``y`` is int32 ``(B,)``.
    ``mean`` and ``std`` are numbers, or one number per channel.

    How it works: the images, labels and each epoch's order are converted once
    with ``ops.asarray`` (for ``device="cuda"`` that uploads the whole dataset to
    the GPU once, and the epoch's permutation once per epoch); each batch is
    then ONE call ``ops.gather_batch(images, labels, perm[start:stop], mean,
    std, pad=, max_shift=, seed=)``, which gathers, pads, shifts and normalises.

    Randomness, all derived from ``seed`` (an int >= 0), so that two loaders
    with the same arguments give identical batches:

    - the order of epoch ``e`` is a permutation drawn from
      ``np.random.default_rng(SeedSequence(seed, spawn_key=(0, e)))``: a fresh
      generator per epoch, so any epoch can be replayed on its own;
    - batch ``b`` of epoch ``e`` gets the seed of its random shifts from
      ``SeedSequence(seed, spawn_key=(1, e, b))``, an int in [0, 2**63).

    Epochs: the loader counts them itself.  Each ``iter(loader)`` (each ``for``
    loop over it) uses epoch ``loader.epoch`` and then adds one to it;
    ``set_epoch(e)`` chooses the epoch of the next loop (to resume training).

    ``max_shift > 0`` moves each image by a random whole number of pixels in
    ``[-max_shift, max_shift]`` along each axis (augmentation: use it for the
    training loader only).  ``flip=True`` (colour images, (N, C, H, W) only)
    also mirrors each image left-right with probability 1/2; with ``pad=0``,
    ``max_shift=4`` and ``flip=True`` that is the usual CIFAR recipe (a random
    32x32 crop of the image padded by 4, and a random horizontal flip).
    ``drop_last=True`` drops the last, smaller batch.
    """

    def __init__(self, images, labels, batch_size=128, shuffle=True, seed=0,
                 mean=0.0, std=1.0, pad=0, max_shift=0, device="cpu",
                 drop_last=False, num_classes=10, flip=False):
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"images must be a uint8 array (N, H, W) or (N, C, H, W), got "
                             f"{images.dtype} {images.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got {labels.dtype}")
        if images.ndim == 3:
            _check_pair(images, labels, num_classes, what="DataLoader")
        else:
            _check_labels(len(images), labels, num_classes, what="DataLoader")
        self.channels = 1 if images.ndim == 3 else int(images.shape[1])
        if not 1 <= self.channels <= _MAX_CHANNELS:
            raise ValueError(f"DataLoader: images must have 1 to {_MAX_CHANNELS} channels, got {images.shape}")
        if flip and images.ndim == 3:
            raise ValueError("DataLoader: flip=True needs (N, C, H, W) images (a flipped digit is another "
                             "digit); grey (N, H, W) images use max_shift")
        if len(images) == 0:
            raise ValueError("DataLoader: the dataset is empty")
        if len(images) >= 2**31:
            raise ValueError("DataLoader: at most 2**31 - 1 samples (indices are int32)")

        self.batch_size = _nonnegative_int(batch_size, "batch_size")
        if self.batch_size == 0:
            raise ValueError("batch_size must be >= 1")
        self.seed = _nonnegative_int(seed, "seed")
        self.pad = _nonnegative_int(pad, "pad")
        self.max_shift = _nonnegative_int(max_shift, "max_shift")
        self.mean, self.std = _channel_stats(mean, std, self.channels, per_channel=images.ndim == 4)
        self.flip = bool(flip)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.device = device
        self.num_samples = len(images)  # samples in the dataset (one epoch visits each once)
        self.epoch = 0

        # Everything is checked on the host: from here on the data may live on the GPU.
        self._ops = cydnn.ops.backend(device)
        self._images = self._ops.asarray(np.ascontiguousarray(images))
        self._labels = self._ops.asarray(labels.astype(np.int32))
        self._fixed_order = None  # uploaded once when not shuffling

    def __len__(self):
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)  # ceil division

    def set_epoch(self, epoch):
        """Make the next ``iter(loader)`` produce epoch ``epoch``."""
        self.epoch = _nonnegative_int(epoch, "epoch")

    def permutation(self, epoch):
        """The sample order of ``epoch`` (int32 numpy array, host side).

        Being a permutation of ``range(num_samples)``, every index is in range by
        construction: the GPU never sees an index it would have to check.
        """
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int32)
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_PERMUTATION_STREAM, epoch)))
        return rng.permutation(self.num_samples).astype(np.int32)

    def batch_seed(self, epoch, batch):
        """The seed of the random shifts of batch ``batch`` of ``epoch``: an int in [0, 2**63)."""
        seq = np.random.SeedSequence(self.seed, spawn_key=(_AUGMENTATION_STREAM, epoch, batch))
        return int(seq.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        if self.shuffle:
            order = self._ops.asarray(self.permutation(epoch))  # one upload per epoch
        else:
            if self._fixed_order is None:
                self._fixed_order = self._ops.asarray(self.permutation(0))
            order = self._fixed_order
        return self._batches(epoch, order)

    def _batches(self, epoch, order):
        chw = len(self._images.shape) == 4
        gather = _gather_chw(self._ops) if chw else None
        for b in range(len(self)):
            start = b * self.batch_size
            stop = min(start + self.batch_size, self.num_samples)
            if chw:
                yield gather(self._images, self._labels, order[start:stop], self.mean, self.std,
                             pad=self.pad, max_shift=self.max_shift, flip=self.flip,
                             seed=self.batch_seed(epoch, b))
            else:
                yield self._ops.gather_batch(
                    self._images, self._labels, order[start:stop], self.mean, self.std,
                    pad=self.pad, max_shift=self.max_shift, seed=self.batch_seed(epoch, b))

    def __repr__(self):
        return (f"DataLoader({self.num_samples} samples, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, device={self.device!r}, epoch={self.epoch})")
