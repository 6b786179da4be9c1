"""A user's own data: :class:`ArrayDataset` (images and labels in memory) and :func:`from_npz`."""

import operator

import numpy as np

from .errors import DatasetError
from .loader import DataLoader
from .npz import read_npz

_CHUNK = 1024  # images per step when computing statistics (bounded temporary memory)


def _as_uint8_images(images, what):
    """Images as uint8, (N, H, W) for one channel, (N, C, H, W) for several.

    The rule for floats: values must be finite and lie in [0, 1]; they become
    ``round(255 * x)`` (round half to even, numpy's ``rint``), so ``k / 255`` gives back k.
    Integers must lie in [0, 255].  (N, 1, H, W) becomes (N, H, W).
    """
    images = np.asarray(images)
    if images.ndim not in (3, 4):
        raise DatasetError(f"{what}: images must have shape (N, H, W) or (N, C, H, W), got {images.shape}")
    if images.ndim == 4 and images.shape[1] == 1:
        images = images[:, 0]
    if any(d == 0 for d in images.shape[1:]):
        raise DatasetError(f"{what}: images of shape {images.shape}: every size but N must be > 0")
    if images.dtype == np.uint8:
        return np.ascontiguousarray(images)
    if images.dtype.kind not in "biuf":
        raise DatasetError(f"{what}: images have dtype {images.dtype}; expected uint8 (0..255) or float in [0, 1]")
    if np.issubdtype(images.dtype, np.floating):
        if images.size and not np.isfinite(images).all():
            raise DatasetError(f"{what}: float images hold NaN or infinity")
        lo, hi = (float(images.min()), float(images.max())) if images.size else (0.0, 0.0)
        if lo < 0 or hi > 1:
            raise DatasetError(f"{what}: float images must lie in [0, 1] (they become round(255 x)), found "
                               f"values from {lo} to {hi}; scale them, or pass uint8 pixels 0..255")
        out = np.empty(images.shape, np.uint8)
        for start in range(0, len(images), _CHUNK):      # bounded float64 temporaries
            out[start:start + _CHUNK] = np.rint(images[start:start + _CHUNK].astype(np.float64) * 255)
        return out
    if np.issubdtype(images.dtype, np.integer) or images.dtype == np.bool_:
        lo, hi = (int(images.min()), int(images.max())) if images.size else (0, 0)
        if lo < 0 or hi > 255:
            raise DatasetError(f"{what}: integer images must lie in [0, 255], found values from {lo} to {hi}")
        return images.astype(np.uint8)
    raise DatasetError(f"{what}: images have dtype {images.dtype}; expected uint8 (0..255) or float in [0, 1]")


def _as_labels(labels, n, num_classes, classes, what):
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DatasetError(f"{what}: labels must have shape (N,), got {labels.shape}")
    if not (np.issubdtype(labels.dtype, np.integer) and labels.dtype != np.bool_):
        raise DatasetError(f"{what}: labels must be integers, got {labels.dtype}")
    if len(labels) != n:
        raise DatasetError(f"{what}: {n} images but {len(labels)} labels")
    if classes is not None:
        classes = [str(c) for c in classes]
        if num_classes is not None and num_classes != len(classes):
            raise DatasetError(f"{what}: num_classes={num_classes} but {len(classes)} class names")
        num_classes = len(classes)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    else:
        try:
            num_classes = operator.index(num_classes)
        except TypeError:
            raise DatasetError(f"{what}: num_classes must be an int, got {num_classes!r}") from None
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"{what}: labels must lie in [0, {num_classes}), found values from {labels.min()} "
                           f"to {labels.max()}")
    if num_classes < 1:
        raise DatasetError(f"{what}: no classes (an empty dataset needs num_classes or classes)")
    if classes is None:
        classes = [str(i) for i in range(num_classes)]
    return labels.astype(np.int32), num_classes, classes


def channel_stats(images):
    """Per-channel mean and std of uint8 images scaled to [0, 1], over every pixel of every image.

    ``(float, float)`` for (N, H, W) images, ``(tuple, tuple)`` of C floats for (N, C, H, W).
    Exact sums in integers (no float rounding drift on large sets), chunked.
    """
    planes = images[:, None] if images.ndim == 3 else images
    c = planes.shape[1]
    total, squares = np.zeros(c, np.uint64), np.zeros(c, np.uint64)
    for start in range(0, len(planes), _CHUNK):
        part = planes[start:start + _CHUNK].astype(np.uint64)
        total += part.sum(axis=(0, 2, 3))
        squares += (part * part).sum(axis=(0, 2, 3))
    count = max(1, planes.shape[0] * planes.shape[2] * planes.shape[3])
    mean = np.array([int(t) for t in total], dtype=np.float64) / count
    var = np.array([int(s) for s in squares], dtype=np.float64) / count - mean**2
    mean, std = mean / 255, np.sqrt(np.maximum(var, 0)) / 255
    std = np.where(std > 0, std, 1.0)          # a constant channel: no scaling
    if images.ndim == 3:
        return float(mean[0]), float(std[0])
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


class ArrayDataset:
    """Images and labels that are already in memory, as the built-in datasets are.

    ``ArrayDataset(images, labels, num_classes=None, classes=None)``:

    - ``images``: (N, H, W) or (N, C, H, W); uint8 pixels 0..255, or floats in [0, 1] (converted
      to ``round(255 x)``), or integers in [0, 255].  Stored as uint8, (N, H, W) for one
      channel (an (N, 1, H, W) input included), (N, C, H, W) otherwise.
    - ``labels``: (N,) integers in [0, num_classes), stored as int32.
    - ``num_classes``: default ``len(classes)``, else ``labels.max() + 1``; ``classes``: the
      class names (default "0", "1", ...).

    ``mean`` and ``std`` are computed from the data (pixels scaled to [0, 1]): floats for one
    channel, tuples of one float per channel otherwise, ready for :class:`DataLoader`.
    Bad input raises :class:`DatasetError` (a ``ValueError``) naming the problem.
    """

    def __init__(self, images, labels, num_classes=None, classes=None, what="ArrayDataset", stats=None):
        self.images = _as_uint8_images(images, what)
        self.labels, self.num_classes, self.classes = _as_labels(labels, len(self.images), num_classes,
                                                                 classes, what)
        if len(self.images) == 0:
            raise DatasetError(f"{what}: no images")
        # ``stats``: known (mean, std) (a dataset's published training values) instead of measured ones.
        self.mean, self.std = channel_stats(self.images) if stats is None else stats

    @property
    def channels(self):
        return 1 if self.images.ndim == 3 else int(self.images.shape[1])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        """``(image, label)``: a uint8 array and an int."""
        return self.images[i], int(self.labels[i])

    def __repr__(self):
        return (f"{type(self).__name__}({len(self)} images of shape {self.images.shape[1:]}, "
                f"{self.num_classes} classes)")

    def loader(self, batch_size=128, shuffle=True, **kwargs):
        """A :class:`DataLoader` over these images, normalised with this dataset's mean and std."""
        kwargs.setdefault("mean", self.mean)
        kwargs.setdefault("std", self.std)
        kwargs.setdefault("num_classes", self.num_classes)
        return DataLoader(self.images, self.labels, batch_size=batch_size, shuffle=shuffle, **kwargs)


def from_npz(path, num_classes=None, classes=None):
    """An :class:`ArrayDataset` from an .npz holding ``images`` and ``labels`` (``np.savez``).

    Optional member ``classes``: the class names (a numpy string array).  Read without pickles
    and bounded (:mod:`cydnn.datasets.npz`): sizes declared by the archive are checked before
    anything is allocated, a member named twice is refused.  Errors are :class:`DatasetError`
    naming the file (and the member).
    """
    arrays = read_npz(path, ("images", "labels"), ("classes",))
    if classes is None and "classes" in arrays:
        names = arrays["classes"]
        if names.dtype.kind != "U" or names.ndim != 1:
            raise DatasetError(f"{path}: member 'classes.npy' must be a 1-D array of strings, got "
                               f"{names.dtype} {names.shape}")
        classes = names.tolist()
    return ArrayDataset(arrays["images"], arrays["labels"], num_classes=num_classes, classes=classes,
                        what=str(path))
