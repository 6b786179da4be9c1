"""IDX parsing: :func:`read_idx` turns IDX bytes into a numpy array, and says exactly what is
wrong when the bytes are not a valid IDX file; the shape checks shared with the datasets."""

import os
import sys

import numpy as np


def _limits():
    """The package, whose tunable limits (``cydnn.datasets.TIMEOUT``, ...) are read at call time,
    so that assigning to them takes effect."""
    return sys.modules[__package__]


def _idx_size(*dims):
    """Bytes in a uint8 IDX file of these dimensions: 4-byte magic, 4 bytes per dim, payload."""
    return 4 + 4 * len(dims) + int(np.prod(dims))



_IDX_UBYTE = 0x08  # the IDX type code for unsigned bytes; the only one MNIST uses


def read_idx(source):
    """Parse an IDX file (a path, or the file's bytes) into a uint8 numpy array.

    The IDX format (http://yann.lecun.com/exdb/mnist/) is a big-endian header
    followed by the raw data::

        bytes 0-1  zero
        byte  2    data type   (0x08 = unsigned byte; the only type accepted here)
        byte  3    rank        (number of dimensions: 1 for labels, 3 for images)
        then       one 4-byte unsigned size per dimension
        then       the data, row-major, exactly prod(sizes) bytes

    So the "magic number" of a label file is 0x00000801 and of an image file
    0x00000803.  Returns an array of shape ``(N,)`` or ``(N, rows, cols)``.
    Raises ``ValueError`` naming what is wrong when the bytes are not such a file.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        what = "IDX data"
        data = np.frombuffer(source, dtype=np.uint8)
    else:
        what = f"IDX file {os.fspath(source)!r}"
        data = _read_idx_file(source, what)

    if data.size < 4:
        raise ValueError(f"{what}: only {data.size} bytes, too short for the 4-byte IDX magic number")
    magic = int.from_bytes(data[:4].tobytes(), "big")
    zeros, dtype_code, rank = int.from_bytes(data[:2].tobytes(), "big"), int(data[2]), int(data[3])
    if zeros != 0:
        raise ValueError(
            f"{what}: bad magic number 0x{magic:08X}: an IDX file starts with two zero bytes "
            f"(expected 0x00000801 for labels or 0x00000803 for images)")
    if dtype_code != _IDX_UBYTE:
        raise ValueError(
            f"{what}: data type byte is 0x{dtype_code:02X}, but only 0x08 (unsigned byte) is "
            f"supported (magic number 0x{magic:08X})")
    if rank not in (1, 3):
        raise ValueError(
            f"{what}: rank {rank} (magic number 0x{magic:08X}) is not supported: expected "
            f"1 (labels, 0x00000801) or 3 (images, 0x00000803)")

    header_size = 4 + 4 * rank
    if data.size < header_size:
        raise ValueError(
            f"{what}: {data.size} bytes, too short for the {header_size}-byte header of a rank-{rank} file")
    dims = tuple(int(d) for d in data[4:header_size].view(">u4"))
    if rank == 3 and (dims[1] == 0 or dims[2] == 0):
        raise ValueError(f"{what}: images of size {dims[1]}x{dims[2]}: rows and columns must be > 0")

    expected = _check_idx_dims(dims, what)
    payload = data.size - header_size
    if payload != expected:
        raise ValueError(
            f"{what}: dimensions {dims} need {expected} data bytes after the header, "
            f"but {payload} follow ({'truncated' if payload < expected else 'trailing bytes'})")

    array = data[header_size:].reshape(dims)
    # np.frombuffer gives a read-only view of the caller's bytes: hand back our own copy.
    return array if array.flags.writeable else array.copy()


def _read_idx_file(path, what):
    """The bytes of the IDX file at ``path``, read only after its header and its size agree.

    The header (at most 16 bytes) is read first and checked (:func:`_check_idx_header`:
    MAX_IDX_BYTES included); the file's size, from ``fstat``, must then be exactly the header
    plus the declared data, so a file over the limit, or longer than its header says, is
    refused having read 16 bytes of it.  Short files fall through to :func:`read_idx`'s
    messages.
    """
    with open(path, "rb") as f:
        head = f.read(16)
        size = os.fstat(f.fileno()).st_size
        if len(head) >= 4 and head[:3] == b"\0\0\x08" and head[3] in (1, 3) and len(head) >= 4 + 4 * head[3]:
            header_size = 4 + 4 * head[3]
            expected = _check_idx_header(head, what)
            if size != header_size + expected:
                raise ValueError(
                    f"{what}: dimensions {_dims(head)} need {expected} data bytes after the header, but "
                    f"{size - header_size} follow ({'truncated' if size < header_size + expected else 'trailing bytes'})")
        elif size > 16:                   # not an IDX header: its first bytes say why, in read_idx
            return np.frombuffer(head, dtype=np.uint8)
        f.seek(0)
        return np.fromfile(f, dtype=np.uint8, count=size)


def _dims(head):
    rank = head[3]
    return tuple(int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(rank))


def _check_idx_dims(dims, what):
    """Bytes of data that IDX dimensions ``dims`` declare; refuses more than MAX_IDX_BYTES."""
    expected = 1
    for d in dims:
        expected *= int(d)          # Python ints: no overflow
    max_bytes = _limits().MAX_IDX_BYTES
    if expected > max_bytes:
        raise ValueError(f"{what}: header declares dimensions {tuple(dims)} = {expected} bytes, more than "
                         f"the {max_bytes}-byte limit (MAX_IDX_BYTES): refusing it")
    return expected


def _check_idx_header(head, what):
    """Check the first bytes of an IDX stream (magic, rank, declared size) before reading the rest."""
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] != _IDX_UBYTE or head[3] not in (1, 3):
        raise ValueError(f"{what}: not an unsigned-byte IDX file of rank 1 or 3 "
                         f"(it starts with {bytes(head[:4])!r})")
    rank = head[3]
    if len(head) < 4 + 4 * rank:
        raise ValueError(f"{what}: too short for the header of a rank-{rank} IDX file")
    dims = [int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
    return _check_idx_dims(dims, what)


def _check_pair(images, labels, num_classes, what="dataset"):
    """Check that an images array and a labels array belong together."""
    if images.ndim != 3:
        raise ValueError(f"{what}: images must have shape (N, rows, cols), got {images.shape}")
    _check_labels(len(images), labels, num_classes, what)


def _check_labels(n, labels, num_classes, what="dataset"):
    """Check labels: shape (n,), values in [0, num_classes)."""
    if labels.ndim != 1:
        raise ValueError(f"{what}: labels must have shape (N,), got {labels.shape}")
    if n != len(labels):
        raise ValueError(f"{what}: {n} images but {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{what}: labels must lie in [0, {num_classes}), found values from "
            f"{labels.min()} to {labels.max()}")
