"""Weights to and from PyTorch, without torch: ``.npz``, ``.safetensors``, a folder of ``.txt``/``.bin``.

A cydnn model names its parameters as PyTorch does (``conv1.weight``,
``fc3.bias``) and keeps them in PyTorch's layouts (conv ``(out, in, kh, kw)``,
linear ``(out, in)``), so a PyTorch ``state_dict`` loads as it is.  On the
PyTorch side, export one of these forms::

    sd = {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}
    np.savez("lenet.npz", **sd)                                 # .npz
    safetensors.numpy.save_file(sd, "lenet.safetensors")        # .safetensors
    for k, v in sd.items():                                     # a folder, one file per parameter:
        np.savetxt(f"lenet_txt/{k}.txt", v.ravel())             #   text, the flattened tensor
        v.astype("<f4").tofile(f"lenet_bin/{k}.bin")            #   or raw little-endian float32

and load it with ``cydnn.load_pytorch_weights(model, path)``.  The other way,
``cydnn.export_weights(module, path, format)`` (any module) writes the same forms, which
PyTorch reads back with::

    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in np.load("lenet.npz").items()})
    # .txt / .bin: np.loadtxt(f, dtype=np.float32) / np.fromfile(f, "<f4"), then
    # .reshape(torch_model.state_dict()[k].shape) before torch.from_numpy

Nothing is ever unpickled (a ``torch.save`` file is refused with a hint);
files are hostile until checked (bounds: docs/reliability.md).  NaN and inf
load unchanged (check ``np.isfinite`` yourself if that matters).
"""
import math
import os
import shutil
import tempfile
import warnings

import numpy as np

from ._filesafe import (NpzReader, check_lossless, creation_mode, describe, read_safetensors_header,
                        read_safetensors_tensor)
from ._names import check_name, child_path
from ._normalize import KEEP as _KEEP, apply_normalize, check_normalize  # noqa: F401

__all__ = ["WeightsError", "load_pytorch_weights", "export_weights", "FORMATS"]

#: The forms :func:`export_weights` writes (and :func:`load_pytorch_weights` reads).
FORMATS = ("npz", "safetensors", "txt", "bin")
#: Largest declared uncompressed size of one .npz member, and of all of them (bytes).
MAX_MEMBER_BYTES = 1 << 30
MAX_TOTAL_BYTES = 4 << 30
#: Largest .txt parameter file read, per value it must hold (``np.savetxt``'s default
#: ``%.18e`` takes 25 bytes a value; 64 leaves room for any sane format).
MAX_TXT_BYTES_PER_VALUE = 64

_ZIP_MAGIC = b"PK\x03\x04"


class WeightsError(ValueError):
    """Weights that do not fit the model (names, shapes, dtypes) or a file that cannot be read."""


def _safetensors_numpy():
    try:
        import safetensors.numpy
    except ImportError as e:
        raise ImportError("reading or writing .safetensors needs the 'safetensors' package: "
                          "pip install safetensors  (or pip install 'cydnn[safetensors]')") from e
    return safetensors.numpy


def _expected_shapes(model):
    """name -> shape of everything the model's state_dict holds: parameters, then buffers
    (BatchNorm's running statistics) where the module system has them."""
    return {name: tuple(shape) for name, (shape, _) in _expected(model).items()}


def _expected(model):
    """name -> (shape, dtype) of every parameter and buffer."""
    out = {name: (p.shape, np.dtype(p.dtype)) for name, p in model.named_parameters()}
    if hasattr(model, "named_buffers"):
        out.update((name, (b.shape, np.dtype(b.dtype))) for name, b in model.named_buffers())
    return out


def _limit(shape):
    """Bytes a parameter of ``shape`` may take in a file: float64 (or int64) at most."""
    return 8 * math.prod(shape)


# ---------------------------------------------------------------- readers
#: How an object-dtype member is refused (by its .npy header, before anything is read).
_OBJECT_NOTE = "an object array, which is never loaded; save numeric arrays"


# Each reader returns {name: array, or None for a name the model does not have (never read)}
# plus a list of problems found from headers alone (a shape that does not fit, read no further).
def _read_npz(path, expected):
    with NpzReader(path, WeightsError, MAX_MEMBER_BYTES, MAX_TOTAL_BYTES, what="parameter") as npz:
        names = npz.names()
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            raise WeightsError(f"{path} is a torch.save (pickle) file, which cydnn never unpickles; "
                               f"export the state_dict with np.savez(path, **{{k: v.numpy() for k, v in "
                               f"model.state_dict().items()}}) instead")
        arrays, problems = {}, []
        for name in names:
            check_name(name, WeightsError, path)
            if name not in expected:
                arrays[name] = None
                continue
            shape, _ = npz.header(name, _OBJECT_NOTE)
            if shape != expected[name]:
                problems.append(f"parameter {name!r}: expected shape {expected[name]}, got {shape}")
                arrays[name] = None         # present (not missing), not read
                continue
            arrays[name] = npz.read(name, _limit(expected[name]), _OBJECT_NOTE)
    return arrays, problems


def _read_safetensors(path, expected):
    """Read with cydnn's own checked header parser, not safetensors.numpy.load_file: that one reads
    every tensor at once and, given a name twice, keeps the last; this one refuses duplicates,
    checks every offset and shape, and reads only the tensors the model has."""
    header, data_start = read_safetensors_header(path, WeightsError)
    arrays, problems = {}, []
    for name, tensor in header.items():
        check_name(name, WeightsError, path)
        if name not in expected:
            arrays[name] = None
        elif tensor[1] != expected[name]:
            problems.append(f"parameter {name!r}: expected shape {expected[name]}, got {tensor[1]}")
            arrays[name] = None             # present (not missing), not read
        else:
            arrays[name] = read_safetensors_tensor(path, tensor, data_start)
    return arrays, problems


def _read_folder(path, expected):
    """name -> flat array (None for a name the model lacks), from ``<name>.txt`` / ``<name>.bin`` files;
    each file's size is checked against its parameter's before it is read."""
    files = {}
    for entry in sorted(os.listdir(path)):
        stem, ext = os.path.splitext(entry)
        if entry.startswith(".") or ext not in (".txt", ".bin") or not os.path.isfile(os.path.join(path, entry)):
            continue
        check_name(stem, WeightsError, f"{path}: file {entry!r}")
        if stem in files:
            raise WeightsError(f"{path}: parameter {stem!r} is there twice, as {files[stem]} and {entry}")
        files[stem] = entry
    arrays = {}
    for name, entry in files.items():
        if name not in expected:
            arrays[name] = None         # only its name matters: listed as unexpected
            continue
        file = os.path.join(path, entry)
        count = math.prod(expected[name])
        size = os.path.getsize(file)
        if entry.endswith(".bin"):
            if size != 4 * count:
                raise WeightsError(f"{file}: parameter {name!r}: expected shape {expected[name]} = {count} "
                                   f"float32 values = {4 * count} bytes, got {size} bytes"
                                   + (" (truncated?)" if size < 4 * count else ""))
            arrays[name] = np.fromfile(file, dtype="<f4", count=count)
        else:
            if size > MAX_TXT_BYTES_PER_VALUE * count + 4096:
                raise WeightsError(f"{file}: parameter {name!r}: {size} bytes of text for {count} values "
                                   f"(at most {MAX_TXT_BYTES_PER_VALUE} a value); refusing to parse it")
            try:
                with warnings.catch_warnings():         # an empty file warns; its count is checked below
                    warnings.simplefilter("ignore", UserWarning)
                    arrays[name] = np.loadtxt(file, dtype=np.float64, ndmin=1).ravel()
            except ValueError as e:
                raise WeightsError(f"{file}: parameter {name!r}: not a text file of numbers ({e})") from e
    return arrays, []


def _detect(path):
    if os.path.isdir(path):
        return "folder"
    with open(path, "rb") as f:         # a missing file is a FileNotFoundError
        head = f.read(9)
    if head[:4] == _ZIP_MAGIC:
        return "npz"
    if len(head) == 9 and head[8:9] == b"{":          # u64 header length, then the JSON header
        return "safetensors"
    if path.endswith(".safetensors"):
        return "safetensors"
    looks = describe(path)
    raise WeightsError(f"{path}: neither an .npz archive nor a .safetensors file (it starts with {head!r}); "
                       f"a folder of <name>.txt / <name>.bin files is the third form"
                       + (f"; it looks like {looks}" if looks else ""))


# ----------------------------------------------------------------- loading
def _check(arrays, problems, expected, dtypes, path, strict, folder):
    """Every problem with ``arrays`` against ``expected`` shapes, as one WeightsError."""
    problems = list(problems)
    missing = [n for n in expected if n not in arrays]
    unexpected = [n for n in arrays if n not in expected]
    if strict and missing:
        problems.insert(0, f"missing parameters {missing}")
    if strict and unexpected:
        problems.insert(0, f"unexpected parameters {unexpected}")
    state = {}
    for name, value in arrays.items():
        if name not in expected or value is None:
            continue
        shape = expected[name]
        kind = value.dtype.kind
        if kind not in "fiu":
            what = {"O": "object", "c": "complex"}.get(kind, str(value.dtype))
            problems.append(f"parameter {name!r} has dtype {value.dtype} ({what}); expected a real "
                            f"floating-point array of shape {shape}")
            continue
        try:
            check_lossless(value, WeightsError, f"parameter {name!r}", dtypes[name])
        except WeightsError as e:
            problems.append(str(e))
            continue
        if folder:              # flat files: the element count decides, the shape is the model's
            if value.size != math.prod(shape):
                problems.append(f"parameter {name!r}: expected shape {shape} ({math.prod(shape)} values), "
                                f"got {value.size} values")
                continue
            value = value.reshape(shape)
        elif tuple(value.shape) != shape:
            problems.append(f"parameter {name!r}: expected shape {shape}, got {tuple(value.shape)}")
            continue
        state[name] = value
    if problems:
        raise WeightsError(f"{path}: weights do not fit the model: " + "; ".join(problems))
    return state


def load_pytorch_weights(model, path, strict=True, normalize=_KEEP):
    """Load a PyTorch state_dict saved without torch into ``model``; returns ``model``.

    ``path``: an ``.npz`` archive (``np.savez``), a ``.safetensors`` file, or a
    folder with one ``<name>.txt`` (``np.savetxt`` of the flattened tensor) or
    ``<name>.bin`` (raw little-endian float32) per parameter; the form is found
    from the content.  Shapes come from the model (in a folder, only the
    element count is stored).  Everything is read and checked before anything
    changes: missing or unexpected names (with ``strict=True``), a shape or
    count that differs (naming the parameter, the expected and the given
    shape), a non-real dtype (object, complex, strings), integers the model's
    dtype cannot hold exactly all raise one :class:`WeightsError` listing every
    problem.  Values are converted to the model's dtype and device; NaN and inf
    are loaded as they are.

    Preprocessing: a PyTorch state_dict holds no preprocessing.  A cydnn image
    model (``LeNet5``) computes ``(x - mean) / std`` on its raw input (after
    ``input_pad`` zero pixels for classic LeNet-5) before the first layer;
    ``normalize=(mean, std)`` (each a number, or one per channel) sets those
    to what the PyTorch model was trained with, ``normalize=None`` makes the input pass unchanged (mean 0, std 1: the
    caller normalises), and leaving it out keeps the model's own (LeNet5:
    0.1307, 0.3081, MNIST's).

    Hostile files: every name is checked (:func:`cydnn._names.check_name`),
    nothing is unpickled, a member or tensor is read only after its declared
    shape matched the model's (so a small file cannot make this allocate more
    than the model's size), and a name given twice is refused.
    """
    path = os.fspath(path)
    form = _detect(path)
    expected = _expected_shapes(model)
    reader = {"folder": _read_folder, "npz": _read_npz, "safetensors": _read_safetensors}[form]
    arrays, problems = reader(path, expected)
    dtypes = {name: dtype for name, (_, dtype) in _expected(model).items()}
    state = _check(arrays, problems, expected, dtypes, path, strict, folder=form == "folder")
    apply_normalize(model, normalize, WeightsError, path)     # checked, like the weights, before loading
    model.load_state_dict(state, strict=strict)
    return model


# --------------------------------------------------------------- exporting
def _replace_file(write, path):
    """Call ``write(tmp_path)``, fsync, then rename over ``path``; no temp file is left on failure."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = creation_mode()              # what open() would give (mkstemp's is 0o600)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:      # write(2) errors name no file: name it
            raise _with_path(e, path) from e
        raise


def _with_path(error, path):
    """``error`` (an OSError from a write) as the same OSError subclass and errno, naming ``path``."""
    return OSError(error.errno, f"{error.strerror or error} (writing {path})", path)


def _is_weight_folder(path):
    """True for a folder that holds only ``*.txt`` / ``*.bin`` files (what export_weights writes)."""
    return all(os.path.isfile(os.path.join(path, e)) and os.path.splitext(e)[1] in (".txt", ".bin")
               for e in os.listdir(path))


def _replace_folder(state, path, ext):
    """Write a folder of per-parameter files beside ``path``, then move it into place."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        raise FileExistsError(f"{path} exists and is not a folder (or is a link); the {ext} form "
                              f"is a folder")
    if os.path.isdir(path) and not _is_weight_folder(path):
        raise FileExistsError(f"{path} holds files other than *.txt / *.bin: not replacing it")
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(os.path.abspath(path))
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{base}.", suffix=".tmp")
    old = None
    try:
        for name, value in state.items():
            file = child_path(tmp, name, ext, WeightsError, f"export to {path}")
            with open(file, "xb") as f:
                if ext == "txt":
                    np.savetxt(f, value.ravel(), fmt="%.9g")   # 9 digits: float32 round-trips exactly
                else:
                    f.write(value.astype("<f4").tobytes())
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, creation_mode(directory=True))        # mkdtemp's is 0o700
        if os.path.isdir(path):          # rename(2) cannot replace a non-empty folder: swap it
            old = tempfile.mkdtemp(dir=parent, prefix=f".{base}.", suffix=".old")
            os.rmdir(old)
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
                old = None
            raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename is None:
            raise _with_path(e, path) from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_weights(model, path, format="npz"):
    """Write ``model``'s parameters for PyTorch's ``load_state_dict``; returns ``path`` as a str.

    ``format``: ``"npz"`` (one ``np.savez`` archive, written exactly at
    ``path``), ``"safetensors"`` (needs the ``safetensors`` package), ``"txt"``
    or ``"bin"`` (a folder at ``path`` with one ``<name>.txt`` / ``<name>.bin``
    file per parameter: the flattened tensor as text, 9 significant digits, or
    as raw little-endian float32).  Values are float32 whatever the model's
    dtype or device; integer entries (batch norm's ``num_batches_tracked``) stay
    int64 as PyTorch keeps them, except in ``.bin`` files (float32: exact below 2**24).  The write is atomic: a temporary file or folder beside
    ``path`` is filled, then renamed over it, so ``path`` never holds half an
    export; an existing folder is replaced only if it holds nothing but
    ``*.txt`` / ``*.bin`` files.  Every parameter name is checked
    (:func:`cydnn._names.check_name`: dotted identifiers only) before
    anything is written, so no file lands outside ``path``; a file-system
    failure (a full disk) is an ``OSError`` with its errno and ``path``.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}: expected one of {FORMATS}")
    path = os.fspath(path)
    # np.array, not np.ascontiguousarray, which makes a 0-d buffer (num_batches_tracked) 1-d.  Integer
    # entries (that counter) stay int64 as in PyTorch, except in raw float32 .bin files.
    def _array(value):
        integer = np.asarray(value).dtype.kind in "iub" and format != "bin"
        return np.array(value, dtype=np.int64 if integer else np.float32, order="C")
    state = {check_name(name, WeightsError, f"export to {path}"): _array(value)
             for name, value in model.state_dict().items()}
    if format == "npz":
        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, **state)        # a file object: no ".npz" is appended
        _replace_file(write, path)
    elif format == "safetensors":
        st = _safetensors_numpy()
        data = st.save(state)           # bytes; written by Python so that a full disk is an OSError

        def write(tmp):
            with open(tmp, "wb") as f:
                f.write(data)
        _replace_file(write, path)
    else:
        _replace_folder(state, path, format)
    return path
