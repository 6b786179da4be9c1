"""A bounded, pickle-free reader of ``.npz`` archives for user datasets.

It mirrors the checkpoint reader of ``cydnn.serialization`` (which the datasets package may not
import: it sits above it): every size is checked from what the archive declares BEFORE anything
is allocated, and the archive is refused when it names a member twice.

For each member asked for: its declared uncompressed size (zip directory) must be at most
``MAX_NPZ_MEMBER_BYTES``; its .npy header is read (``numpy.lib.format``, header at most 10,000
bytes) and must declare a plain numeric or fixed-width string dtype (never objects: nothing is unpickled) whose
``shape x itemsize`` plus the header is exactly the member's declared size; only then are that
many bytes read (zipfile never returns more than the declared size, and checks the CRC).
"""

import sys
import zipfile
import zlib

import numpy as np

from .errors import DatasetError

#: Largest member of a dataset .npz, uncompressed, in bytes (a declared size above it is
#: refused before reading).  Read at call time: ``cydnn.datasets.MAX_NPZ_MEMBER_BYTES = ...``.
_DEFAULT_MAX = 4 << 30


def _max_member_bytes():
    return getattr(sys.modules[__package__], "MAX_NPZ_MEMBER_BYTES", _DEFAULT_MAX)


def read_npz(path, required, optional=()):
    """``{name: array}`` for the members ``<name>.npy`` of the .npz at ``path``.

    ``required`` names must be present, ``optional`` ones may be; other members are not read.
    Raises :class:`DatasetError` naming the file and the member for anything wrong, or
    ``OSError`` (with the path) when the file cannot be opened.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise DatasetError(f"{path}: not an .npz (zip) archive, or a corrupt one ({e})") from None
    with archive:
        infos = archive.infolist()
        seen = set()
        for info in infos:
            if info.filename in seen:
                raise DatasetError(f"{path}: member {info.filename!r} appears twice; refusing an "
                                   f"ambiguous archive")
            seen.add(info.filename)
        by_name = {info.filename: info for info in infos}
        out = {}
        for name in list(required) + list(optional):
            info = by_name.get(name + ".npy")
            if info is None:
                if name in required:
                    raise DatasetError(f"{path}: no member {name + '.npy'!r} (it holds "
                                       f"{sorted(by_name) or 'nothing'}); save with "
                                       f"np.savez(path, images=..., labels=...)")
                continue
            out[name] = _read_member(archive, info, path)
    return out


def _read_member(archive, info, path):
    where = f"{path}: member {info.filename!r}"
    limit = _max_member_bytes()
    if info.file_size > limit:
        raise DatasetError(f"{where} declares {info.file_size} bytes uncompressed, more than the {limit}-byte "
                           f"limit (MAX_NPZ_MEMBER_BYTES); refusing to read it")
    try:
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise DatasetError(f"{where}: unknown .npy format version {version}")
            header = f.tell()
            if dtype.hasobject or dtype.kind not in "biufU" or dtype.fields is not None:
                raise DatasetError(f"{where} has dtype {dtype}: only plain numbers and fixed-width "
                                   f"strings are read (never Python objects, which would need unpickling)")
            count = 1
            for d in shape:
                count *= int(d)
            need = count * dtype.itemsize
            if header + need != info.file_size:
                raise DatasetError(f"{where}: its header declares shape {shape} of {dtype} ({need} bytes) but "
                                   f"the member holds {info.file_size - header} bytes after the header")
            data = f.read(need)
    except DatasetError:
        raise
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as e:
        raise DatasetError(f"{where} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if len(data) != need:
        raise DatasetError(f"{where} is truncated: {len(data)} of {need} bytes")
    array = np.frombuffer(data, dtype=dtype)
    return array.reshape(shape, order="F" if fortran else "C").copy()
