"""A tiny MNIST-like dataset made on the spot, for download fault tests (no real data needed).

``Tiny`` is an :class:`cydnn.datasets.IDXDataset` whose test split is 400 sparse
28x28 images and their labels; ``FILES`` maps each file name to its IDX bytes
and its .gz bytes, the checksums ``Tiny.files`` publishes.  The bytes are the
same in every process (fixed seed, gzip mtime 0), so a subprocess that
imports this module verifies the same files.
"""
import gzip
import hashlib
import struct

import numpy as np

from cydnn import datasets

IMAGES, LABELS = "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"
N = 400


def idx_bytes(array):
    return b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _make():
    rng = np.random.default_rng(2024)
    images = np.zeros((N, 28, 28), np.uint8)
    images[:, 10:18, 10:18] = rng.integers(0, 256, (N, 8, 8), dtype=np.uint8)
    labels = rng.integers(0, 10, N).astype(np.uint8)
    files = {}
    for name, array in ((IMAGES, images), (LABELS, labels)):
        raw = idx_bytes(array)
        files[name] = (raw, gzip.compress(raw, compresslevel=9, mtime=0))
    return images, labels, files


IMAGES_ARRAY, LABELS_ARRAY, FILES = _make()


class Tiny(datasets.IDXDataset):
    name = "tiny"
    classes = [str(i) for i in range(10)]
    mean, std = 0.1, 0.3
    default_mirrors = ()
    splits = {"train": (IMAGES, LABELS), "test": (IMAGES, LABELS)}
    files = {name: datasets.download._FileInfo(len(raw), hashlib.sha256(raw).hexdigest(), len(gz),
                                      hashlib.sha256(gz).hexdigest())
             for name, (raw, gz) in FILES.items()}


def write_mirror(folder, overrides=None):
    """A mirror folder with both .gz files (``overrides``: name -> bytes to serve instead)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (_, gz) in FILES.items():
        (folder / f"{name}.gz").write_bytes((overrides or {}).get(name, gz))
    return folder
