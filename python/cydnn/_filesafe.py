"""Reading files users did not write: bounded .npz members, JSON, safetensors headers.

Shared by :mod:`cydnn.interop` (weights), :mod:`cydnn.serialization`
(checkpoints) and :mod:`cydnn.onnx_import` (ONNX), so that one mechanism
decides, for all three, how much a declared size may make a reader allocate;
names from files are checked by :mod:`cydnn._names`.  Every function takes the
caller's error type (``WeightsError``, ``CheckpointError``,
``OnnxImportError``) and raises only that (or ``OSError`` for the file
system), naming the file, the entry and the problem.  This module needs only
numpy (no cydnn layer), so a lower layer such as ``cydnn.datasets`` may use it.

Sizes.  An ``.npz`` is read member by member with :class:`NpzReader`: the zip's
declared sizes are checked before anything is inflated, each member's ``.npy``
header is parsed and the bytes it declares are compared with the member's size
and the caller's limit before the array is allocated; object dtypes are refused
unread (nothing is ever unpickled); two members of one name are refused.
"""
import contextlib
import json
import math
import os
import zipfile

import numpy as np
import numpy.lib.format as npy_format

__all__ = ["NpzReader", "loads_json", "read_safetensors_header", "read_safetensors_tensor", "check_lossless",
           "describe", "creation_mode"]

#: Largest .npy header read (numpy's own default bound).
MAX_NPY_HEADER = 10_000
_CHUNK = 1 << 20


def check_lossless(value, error, where, dtype=np.float32):
    """Refuse an array whose values ``dtype`` cannot hold exactly: integers beyond a float's
    mantissa (int64 above 2**24 into float32), or non-integral floats into an integer dtype
    (a BatchNorm's num_batches_tracked)."""
    value = np.asarray(value)
    if np.dtype(dtype).kind in "iu" and value.dtype.kind == "f" and value.size:
        info = np.iinfo(dtype)
        ok = np.isfinite(value) & (np.floor(value) == value) & (value >= info.min) & (value <= info.max)
        if not ok.all():
            raise error(f"{where}: {value.dtype} values such as {value.ravel()[np.flatnonzero(~ok.ravel())[0]]} "
                        f"are not exactly representable in {np.dtype(dtype).name}; refusing a lossy cast")
        return value
    if value.dtype.kind in "iub" and value.size:
        cast = value.astype(dtype)
        if not np.array_equal(cast.astype(value.dtype), value):
            bad = value.ravel()[np.flatnonzero(cast.ravel().astype(value.dtype) != value.ravel())[0]]
            raise error(f"{where}: {value.dtype} values such as {bad} are not exactly representable in "
                        f"{np.dtype(dtype).name}; refusing a lossy cast")
    return value


def _umask():
    """The process's umask, read without changing it (Linux: /proc/self/status), else by setting
    and restoring it (a moment in which another thread's new file would get mode 0o666)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def creation_mode(directory=False):
    """The mode ``open()`` (0o666) or ``mkdir()`` (0o777) gives a new file or folder under the
    process's umask: what a file written through a private temporary file (mode 0o600) is given
    before it is renamed into place, so that an atomic write honours the umask like a plain one."""
    return (0o777 if directory else 0o666) & ~_umask()


# ---------------------------------------------------------------------- JSON
MAX_JSON_DEPTH = 32
MAX_JSON_INT_DIGITS = 30


def _depth(value):
    """Nesting depth of a parsed JSON value, iteratively (no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads_json(text, error, where, max_depth=MAX_JSON_DEPTH):
    """``json.loads(text)`` refusing duplicate keys, integers of more than MAX_JSON_INT_DIGITS
    digits and nesting deeper than ``max_depth``, all as ``error``."""
    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise error(f"{where}: the JSON names {key!r} twice")
            seen[key] = value
        return seen

    def parse_int(digits):
        if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
            raise error(f"{where}: the JSON holds an integer of {len(digits)} digits "
                        f"(at most {MAX_JSON_INT_DIGITS})")
        return int(digits)

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_int=parse_int)
    except RecursionError as e:
        raise error(f"{where}: the JSON is nested too deeply") from e
    except ValueError as e:             # JSONDecodeError and int-conversion limits alike
        if isinstance(e, error):
            raise
        raise error(f"{where}: not valid JSON ({e})") from e
    if _depth(value) > max_depth:
        raise error(f"{where}: the JSON is nested deeper than {max_depth} levels")
    return value


# ----------------------------------------------------------------------- npz
class NpzReader:
    """The members of an ``.npz`` archive, read one at a time within declared bounds.

    Opening checks the zip's central directory only: every member's declared
    uncompressed size against ``max_member``, their sum against ``max_total``,
    and that no name appears twice (``a`` and ``a.npy`` are one name, as for
    ``np.load``).  :meth:`read` then parses one member's ``.npy`` header and
    refuses an object dtype (never unpickled), a declared size above ``limit``
    or above what the member holds, before allocating the array.
    """

    def __init__(self, path, error, max_member, max_total, what="entry"):
        self.path, self.error, self.what = path, error, what
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise error(f"{path} is truncated or corrupt: cannot open it as .npz ({e})") from e
        try:
            self.infos, total = {}, 0
            for info in self.zip.infolist():
                key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if key in self.infos:
                    raise error(f"{path}: {what} {key!r} is in the archive twice; refusing to guess which counts")
                if info.file_size > max_member:
                    raise error(f"{path}: {what} {info.filename!r} declares {info.file_size} bytes uncompressed, "
                                f"more than the {max_member}-byte limit (MAX_MEMBER_BYTES); refusing to read it")
                total += info.file_size
                self.infos[key] = info
            if total > max_total:
                raise error(f"{path}: its members declare {total} bytes uncompressed in all, more than the "
                            f"{max_total}-byte limit (MAX_TOTAL_BYTES); refusing to read it")
        except BaseException:
            self.zip.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.zip.close()

    def names(self):
        return list(self.infos)

    def size(self, key):
        """The member's declared uncompressed size in bytes."""
        return self.infos[key].file_size

    def check_size(self, key, limit):
        """Refuse member ``key`` when its declared uncompressed size exceeds ``limit`` (nothing read)."""
        size = self.infos[key].file_size
        if size > limit:
            raise self.error(f"{self.path}: {self.what} {key!r} declares {size} bytes uncompressed, more than "
                             f"the {limit} it can need; refusing to read it")

    def header(self, key, pickled_note="which is never loaded"):
        """``(shape, dtype)`` from member ``key``'s .npy header; its data is not read.  An object
        dtype is refused as in :meth:`read`, with the same ``pickled_note``."""
        with self._open(key) as (f, info, where):
            shape, fortran, dtype = self._header(f, info, where, pickled_note)
        return shape, dtype

    def read(self, key, limit, pickled_note="which is never loaded"):
        """The array in member ``key``: at most ``limit`` bytes of data, allocated only after the
        header's shape and dtype were checked against the member's declared size."""
        with self._open(key) as (f, info, where):
            shape, fortran, dtype = self._header(f, info, where, pickled_note)
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > limit:
                raise self.error(f"{where}: the .npy header declares shape {shape} of {dtype} = {nbytes} "
                                 f"bytes, more than the {limit} it may hold; refusing to allocate it")
            array = np.empty(math.prod(shape), dtype=dtype)
            view = memoryview(array.view(np.uint8).reshape(-1)) if nbytes else None
            got = 0
            while got < nbytes:         # 1 MiB reads: zipfile's read(n) copies what it gathers
                chunk = f.read(min(_CHUNK, nbytes - got))
                if not chunk:
                    raise self.error(f"{where} is truncated: {got} of {nbytes} bytes")
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
            if f.read(1):               # reaching the end makes zipfile check the CRC
                raise self.error(f"{where} holds more bytes than its header declares")
        if fortran:
            return array.reshape(shape[::-1]).transpose()
        return array.reshape(shape)

    @contextlib.contextmanager
    def _open(self, key):
        info, where = self.infos[key], f"{self.path}: {self.what} {key!r}"
        if not info.filename.endswith(".npy"):
            raise self.error(f"{where} is not a numpy array (.npy) member")
        try:
            with self.zip.open(info) as f:
                yield f, info, where
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, KeyError) as e:
            if isinstance(e, self.error):
                raise
            raise self.error(f"{where} is truncated or corrupt ({e})") from e

    def _header(self, f, info, where, pickled_note):
        """Parse the .npy header at ``f``; refuse objects and data sizes the member cannot hold."""
        version = npy_format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(f, max_header_size=MAX_NPY_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(f, max_header_size=MAX_NPY_HEADER)
        else:
            raise self.error(f"{where}: .npy format version {version} is not read (only 1.0 and 2.0)")
        if dtype.hasobject:
            raise self.error(f"{where} holds pickled Python objects, {pickled_note}")
        if len(shape) > 32 or any(not isinstance(d, int) or d < 0 for d in shape):
            raise self.error(f"{where}: the .npy header declares an invalid shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        held = info.file_size - f.tell()
        if nbytes != held:
            raise self.error(f"{where}: the .npy header declares {nbytes} bytes of data (shape {shape}, "
                             f"{dtype}) but the member holds {held}; truncated or forged")
        return tuple(shape), fortran, dtype


# --------------------------------------------------------------- safetensors
#: safetensors dtype names -> numpy dtypes (little-endian); BF16 and the FP8 types have no numpy twin.
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                      "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
#: Largest safetensors JSON header read (the safetensors library's own limit is 100 MB).
MAX_SAFETENSORS_HEADER = 100_000_000


def read_safetensors_header(path, error):
    """``({name: (numpy dtype, shape, begin, end)}, data_start)`` from a .safetensors file's header,
    checked: a bounded header length, valid JSON without duplicate names, known dtypes,
    non-negative shapes, offsets inside the file that hold exactly the declared bytes and do not
    overlap.  Every failure is ``error("<path>: cannot read it as .safetensors: <why>")``."""
    def fail(why):
        raise error(f"{path}: cannot read it as .safetensors: {why}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            fail(f"too short for a header ({size} bytes)")
        length = int.from_bytes(head, "little")
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            fail(f"the header declares {length} bytes, more than the file ({size} bytes) "
                 f"or the {MAX_SAFETENSORS_HEADER}-byte limit holds")
        raw = f.read(length)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"the header is not UTF-8 ({e})")
    header = loads_json(text, error, f"{path}: cannot read it as .safetensors: its header", max_depth=3)
    if not isinstance(header, dict):
        fail("the header is not a JSON object")
    data_size, tensors, spans = size - 8 - length, {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            fail(f"{where}: expected {{dtype, shape, data_offsets}}, got {entry!r:.200}")
        kind, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if kind == "BF16" or (isinstance(kind, str) and kind.startswith("F8")):
            fail(f"{where}: dtype {kind} has no numpy equivalent; note that numpy has no bfloat16: "
                 f"save float32 tensors")
        if kind not in SAFETENSORS_DTYPES:
            fail(f"{where}: unknown dtype {kind!r:.50}")
        if (not isinstance(shape, list) or len(shape) > 32
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
            fail(f"{where}: shape {shape!r:.200} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            fail(f"{where}: data_offsets {offsets!r:.200} do not lie in the file's {data_size} data bytes")
        dtype = np.dtype(SAFETENSORS_DTYPES[kind])
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            fail(f"{where}: shape {shape} of {kind} is {nbytes} bytes, but data_offsets {offsets} "
                 f"span {offsets[1] - offsets[0]}")
        tensors[name] = (dtype, tuple(shape), offsets[0], offsets[1])
        if nbytes:
            spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            fail(f"tensors {a!r} and {b!r} overlap in the file")
    return tensors, 8 + length


def read_safetensors_tensor(path, tensor, data_start):
    """One tensor of a header checked by :func:`read_safetensors_header`: exactly its declared bytes."""
    dtype, shape, begin, end = tensor
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        array = np.fromfile(f, dtype=dtype, count=(end - begin) // dtype.itemsize)
    return array.reshape(shape)


# ------------------------------------------------------------ what is this?
_ZIP_MAGIC = b"PK\x03\x04"


def describe(path):
    """What the file at ``path`` looks like and the cydnn function that loads it, or None."""
    if os.path.isdir(path):
        return ("a folder (a folder of <name>.txt / <name>.bin weights is loaded into a model with "
                "cydnn.load_pytorch_weights(model, path))")
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == _ZIP_MAGIC:
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError):
            return None
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return ("a torch.save file (a zip holding a pickle), which cydnn never unpickles: in PyTorch, "
                    "np.savez(path, **{k: v.numpy() for k, v in model.state_dict().items()}), then "
                    "cydnn.load_pytorch_weights(model, path)")
        if names and all(n.endswith(".npy") and "/" not in n for n in names):
            shown = ", ".join(repr(n[:-4]) for n in names[:3]) + (", ..." if len(names) > 3 else "")
            return (f"a bare state_dict (.npz of arrays {shown}, no cydnn config): load it into a model "
                    f"with cydnn.load_pytorch_weights(model, path)")
        return None
    if len(head) >= 9 and head[8:9] == b"{":
        return ("a .safetensors file (weights without an architecture): load it into a model with "
                "cydnn.load_pytorch_weights(model, path)")
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        return "a Python pickle (a legacy torch.save file?), which cydnn never unpickles"
    if head[:1] == b"\x08" or str(path).endswith(".onnx"):      # field 1 (ir_version), a varint
        return "an ONNX model: load it with cydnn.load_onnx(path)"
    if head[:4] in (b"\x00\x00\x08\x01", b"\x00\x00\x08\x03"):
        return "an IDX dataset file: read it with cydnn.datasets.read_idx(path)"
    return None
