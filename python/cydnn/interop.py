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
``model.export_weights(path, format)`` (for any module:
``cydnn.export_weights(module, path, format)``) writes the same forms, which
PyTorch reads back with::

    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in np.load("lenet.npz").items()})
    # .txt / .bin: np.loadtxt(f, dtype=np.float32) / np.fromfile(f, "<f4"), then
    # .reshape(torch_model.state_dict()[k].shape) before torch.from_numpy

Nothing is ever unpickled (``np.load(allow_pickle=False)``; a ``torch.save``
file is refused with a hint).  Values are taken as they are: NaN and inf load
unchanged (check ``np.isfinite`` yourself if that matters).
"""
import os
import shutil
import tempfile
import warnings
import zipfile

import numpy as np

from .serialization import read_npz_member

__all__ = ["WeightsError", "load_pytorch_weights", "export_weights", "FORMATS"]

#: The forms :func:`export_weights` writes (and :func:`load_pytorch_weights` reads).
FORMATS = ("npz", "safetensors", "txt", "bin")

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
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


# ---------------------------------------------------------------- readers
def _read_npz(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _ZIP_MAGIC:
        raise WeightsError(f"{path} is not an .npz (zip) archive (it starts with {head!r})")
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise WeightsError(f"{path} is truncated or corrupt: cannot open it as .npz ({e})") from e
    with npz:
        names = npz.files
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in npz.zip.namelist()):
            raise WeightsError(f"{path} is a torch.save (pickle) file, which cydnn never unpickles; "
                               f"export the state_dict with np.savez(path, **{{k: v.numpy() for k, v in "
                               f"model.state_dict().items()}}) instead")
        arrays = {}
        for name in names:
            arrays[name] = read_npz_member(npz, name, path, WeightsError, "parameter",
                                           "an object array, which is never loaded; save numeric arrays")
    return arrays


def _read_safetensors(path):
    st = _safetensors_numpy()
    try:
        return dict(st.load_file(path))
    except Exception as e:          # safetensors raises its own SafetensorError, or TypeError for bf16
        raise WeightsError(f"{path}: cannot read it as .safetensors ({type(e).__name__}: {e}); "
                           f"note that numpy has no bfloat16: save float32 tensors") from e


def _read_folder(path, expected):
    """name -> flat float array (or an error string), from ``<name>.txt`` / ``<name>.bin`` files."""
    files = {}
    for entry in sorted(os.listdir(path)):
        stem, ext = os.path.splitext(entry)
        if entry.startswith(".") or ext not in (".txt", ".bin") or not os.path.isfile(os.path.join(path, entry)):
            continue
        if stem in files:
            raise WeightsError(f"{path}: parameter {stem!r} is there twice, as {files[stem]} and {entry}")
        files[stem] = entry
    arrays = {}
    for name, entry in files.items():
        if name not in expected:
            arrays[name] = None         # only its name matters: listed as unexpected
            continue
        file = os.path.join(path, entry)
        count = int(np.prod(expected[name]))
        if entry.endswith(".bin"):
            size = os.path.getsize(file)
            if size != 4 * count:
                raise WeightsError(f"{file}: parameter {name!r}: expected shape {expected[name]} = {count} "
                                   f"float32 values = {4 * count} bytes, got {size} bytes"
                                   + (" (truncated?)" if size < 4 * count else ""))
            arrays[name] = np.fromfile(file, dtype="<f4")
        else:
            try:
                with warnings.catch_warnings():         # an empty file warns; its count is checked below
                    warnings.simplefilter("ignore", UserWarning)
                    arrays[name] = np.loadtxt(file, dtype=np.float64, ndmin=1).ravel()
            except ValueError as e:
                raise WeightsError(f"{file}: parameter {name!r}: not a text file of numbers ({e})") from e
    return arrays


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
    raise WeightsError(f"{path}: neither an .npz archive nor a .safetensors file (it starts with {head!r}); "
                       f"a folder of <name>.txt / <name>.bin files is the third form")


# ----------------------------------------------------------------- loading
def _check(arrays, expected, path, strict, folder):
    """Every problem with ``arrays`` against ``expected`` shapes, as one WeightsError."""
    problems = []
    missing = [n for n in expected if n not in arrays]
    unexpected = [n for n in arrays if n not in expected]
    if strict and missing:
        problems.append(f"missing parameters {missing}")
    if strict and unexpected:
        problems.append(f"unexpected parameters {unexpected}")
    state = {}
    for name, value in arrays.items():
        if name not in expected:
            continue
        shape = expected[name]
        kind = value.dtype.kind
        if kind not in "fiu":
            what = {"O": "object", "c": "complex"}.get(kind, str(value.dtype))
            problems.append(f"parameter {name!r} has dtype {value.dtype} ({what}); expected a real "
                            f"floating-point array of shape {shape}")
            continue
        if folder:              # flat files: the element count decides, the shape is the model's
            if value.size != int(np.prod(shape)):
                problems.append(f"parameter {name!r}: expected shape {shape} ({int(np.prod(shape))} values), "
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


def load_pytorch_weights(model, path, strict=True):
    """Load a PyTorch state_dict saved without torch into ``model``; returns ``model``.

    ``path``: an ``.npz`` archive (``np.savez``), a ``.safetensors`` file (needs
    the ``safetensors`` package: ``pip install cydnn[safetensors]``), or a
    folder with one ``<name>.txt`` (``np.savetxt`` of the flattened tensor) or
    ``<name>.bin`` (raw little-endian float32) per parameter; the form is found
    from the content.  Shapes come from the model (in a folder, only the
    element count is stored).  Everything is read and checked before anything
    changes: missing or unexpected names (with ``strict=True``), a shape or
    count that differs (naming the parameter, the expected and the given
    shape), a non-real dtype (object, complex, strings) all raise one
    :class:`WeightsError` listing every problem.  Values are converted to the
    model's dtype and device; NaN and inf are loaded as they are.
    """
    path = os.fspath(path)
    form = _detect(path)
    expected = _expected_shapes(model)
    if form == "folder":
        arrays = _read_folder(path, expected)
    elif form == "npz":
        arrays = _read_npz(path)
    else:
        arrays = _read_safetensors(path)
    state = _check(arrays, expected, path, strict, folder=form == "folder")
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
            mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
            file = os.path.join(tmp, f"{name}.{ext}")
            with open(file, "wb") as f:
                if ext == "txt":
                    np.savetxt(f, value.ravel(), fmt="%.9g")   # 9 digits: float32 round-trips exactly
                else:
                    f.write(value.astype("<f4").tobytes())
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
    dtype or device.  The write is atomic: a temporary file or folder beside
    ``path`` is filled, then renamed over it, so ``path`` never holds half an
    export; an existing folder is replaced only if it holds nothing but
    ``*.txt`` / ``*.bin`` files.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}: expected one of {FORMATS}")
    path = os.fspath(path)
    state = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in model.state_dict().items()}
    if format == "npz":
        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, **state)        # a file object: no ".npz" is appended
        _replace_file(write, path)
    elif format == "safetensors":
        st = _safetensors_numpy()
        _replace_file(lambda tmp: st.save_file(state, tmp), path)
    else:
        _replace_folder(state, path, format)
    return path
