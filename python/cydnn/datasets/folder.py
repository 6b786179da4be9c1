"""``ImageFolder``: one folder per class, as torchvision lays it out, read with Pillow.

::

    root/cat/001.png
    root/cat/xyz.jpg
    root/dog/abc.png

Classes are the sub-folders' names, sorted (label i = the i-th name); images are the files with
an image extension in each, sorted by name (other files and hidden ones are skipped, as
torchvision does).  Pillow is an optional dependency: ``pip install "cydnn[images]"``.
"""

import os
import sys
from pathlib import Path

import numpy as np

from .arrays import ArrayDataset
from .errors import DatasetError

#: File extensions read as images (lower case), those of torchvision's ImageFolder.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")


def _max_pixels():
    """``cydnn.datasets.MAX_IMAGE_PIXELS``, read at call time."""
    return sys.modules[__package__].MAX_IMAGE_PIXELS


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError('ImageFolder reads images with Pillow, which is not installed: '
                          'pip install "cydnn[images]" (or pip install Pillow)') from None
    return Image


def _size(size):
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)):
        raise ValueError(f"ImageFolder: size must be an int or (height, width) of ints >= 1, got {size!r}")
    return int(size[0]), int(size[1])


def _scan(root):
    """``(classes, [(path, label), ...])``; DatasetError for a root without class folders or an
    empty class folder."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"ImageFolder: {root} is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DatasetError(f"ImageFolder: {root} has no class folders (expected one sub-folder per class, "
                           f"e.g. {root}/cat/001.png)")
    samples = []
    for label, name in enumerate(classes):
        files = sorted(e.path for e in os.scandir(root / name)
                       if e.is_file() and not e.name.startswith(".")
                       and os.path.splitext(e.name)[1].lower() in IMG_EXTENSIONS)
        if not files:
            raise DatasetError(f"ImageFolder: class folder {root / name} holds no images "
                               f"(extensions read: {', '.join(IMG_EXTENSIONS)})")
        samples += [(path, label) for path in files]
    return classes, samples


def _read(Image, path, size, grey):
    """One image as a uint8 array (H, W) when ``grey`` else (H, W, 3); DatasetError naming the file."""
    try:
        with Image.open(path) as im:
            w, h = im.size                      # from the header: nothing decoded yet
            if w * h > _max_pixels():
                raise DatasetError(f"ImageFolder: {path} is {w}x{h} pixels, more than MAX_IMAGE_PIXELS "
                                   f"({_max_pixels()}); refusing to decode it")
            if grey is None:                    # the first pass reads only the header's mode
                return im.mode in _GREY_MODES
            im.load()
            im = im.convert("L" if grey else "RGB")
            if size is not None and im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), Image.BILINEAR)
            return np.asarray(im, dtype=np.uint8)
    except DatasetError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DatasetError(f"ImageFolder: cannot read image {path}: {type(e).__name__}: {e}") from None


class ImageFolder(ArrayDataset):
    """Every image under ``root`` (one folder per class), loaded into memory as an ArrayDataset.

    ``ImageFolder(root, size=None)``: ``size`` (an int or ``(height, width)``) resizes every image
    (bilinear); without it every image must already have the size of the first, else a
    DatasetError names the first that differs.  Images are grey, (N, H, W), when every file is
    a grey-level image, else RGB, (N, 3, H, W) (grey files converted).  ``samples`` lists
    ``(path, label)`` in order; ``classes`` the folder names.

    Errors name the file: an unreadable or corrupt image, an empty class folder, a folder with
    no class folders, mixed sizes without ``size``, an image over ``MAX_IMAGE_PIXELS``.
    """

    def __init__(self, root, size=None):
        Image = _pillow()
        size = _size(size)
        self.root = Path(root).expanduser()
        classes, self.samples = _scan(self.root)
        grey = all(_read(Image, path, size, None) for path, _ in self.samples)
        images = []
        for path, _ in self.samples:
            image = _read(Image, path, size, grey)
            if images and image.shape != images[0].shape:
                first = self.samples[0][0]
                raise DatasetError(f"ImageFolder: {path} is {image.shape[1]}x{image.shape[0]} but {first} is "
                                   f"{images[0].shape[1]}x{images[0].shape[0]} (width x height); pass "
                                   f"size=(height, width) to resize every image")
            images.append(image)
        array = np.stack(images)
        if not grey:
            array = np.ascontiguousarray(array.transpose(0, 3, 1, 2))   # (N, H, W, 3) -> (N, 3, H, W)
        labels = np.array([label for _, label in self.samples], dtype=np.int32)
        super().__init__(array, labels, classes=classes, what=f"ImageFolder {self.root}")

    def __repr__(self):
        return (f"ImageFolder({str(self.root)!r}, {len(self)} images of shape {self.images.shape[1:]}, "
                f"{self.num_classes} classes)")
