"""Checkpoints: a model in one ``.npz`` file, with no pickle anywhere.

Layout of the archive (every entry a plain numpy array)::

    format_version    int64 scalar, FORMAT_VERSION
    config            unicode scalar: JSON of model.config(), e.g.
                      {"arch": "LeNet5", "classic": false, "num_classes": 10, ...}
    metadata          unicode scalar: JSON {"cydnn_version": ..., "created": ISO date,
                      plus the caller's entries (accuracy, epochs, ...)}
    param/<name>      an array for each state_dict key, e.g. param/conv1.weight: float32, or
                      int64 for an integer entry (batch norm's num_batches_tracked)

Format 2 (this version) keeps integer entries as int64; format 1 stored them as float32
too, which rounds a counter above 2**24 (16,777,217 read back as 16,777,216): format-1
files still load, with the counter as they hold it.

The file is written exactly at the path given (no ``.npz`` is appended) and
atomically: into a temporary file beside it, flushed and fsync'ed, then
renamed over the target, so a reader sees the old file or the new one, never
half of one.  Loading uses ``np.load(allow_pickle=False)``; any problem with
the file's content raises :class:`CheckpointError` saying what is wrong.
"""
import datetime
import json
import math
import os
import tempfile

import numpy as np

from ._filesafe import NpzReader, creation_mode, describe
from ._names import check_name
from .checkpoint_checks import (FORMAT_VERSION, MAX_CLASSES, CheckpointError, check_config,  # noqa: F401
                                check_format, json_entry)

__all__ = ["FORMAT_VERSION", "CheckpointError", "save", "load", "load_metadata"]

PARAM_PREFIX = "param/"
_check_config = check_config        # the name other modules' tests probe

#: Largest uncompressed size accepted for one archive member, and for all of them (bytes).
MAX_MEMBER_BYTES = 1 << 30
MAX_TOTAL_BYTES = 4 << 30
#: Largest uncompressed size of an entry that is not a parameter (config, metadata, format_version).
MAX_SMALL_ENTRY_BYTES = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"


def _json_default(value):
    """Let numpy scalars and arrays through ``json.dumps`` (accuracy as np.float32, ...)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"metadata value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def _cydnn_version():
    import cydnn
    version = getattr(cydnn, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version
            version = dist_version("cydnn")
        except Exception:          # not installed as a distribution
            version = None
    return version


# ---------------------------------------------------------------------- save
def save(model, path, metadata=None):
    """Write ``model`` (its ``config()`` and weights) and ``metadata`` to ``path``.

    ``metadata``: a dict of JSON-able values (numpy scalars are fine), merged
    over the defaults ``cydnn_version`` and ``created`` (UTC, ISO 8601).
    Weights are stored as float32 whatever the model's dtype or device; integer
    entries (counters) as int64.
    The write is atomic; on any failure the temporary file is removed and an
    existing file at ``path`` is left untouched.  Returns ``path`` as a str.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot save a checkpoint to {path!r}: it is a directory")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save a checkpoint to {path!r}: the folder {directory!r} "
                                f"does not exist (create it first)")
    meta = {"cydnn_version": _cydnn_version(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    meta.update(metadata or {})
    # Build every entry before touching the disk: a bad config or metadata fails here.
    arrays = {
        "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "config": np.array(json.dumps(model.config(), default=_json_default)),
        "metadata": np.array(json.dumps(meta, default=_json_default)),
    }
    for name, value in model.state_dict().items():
        value = np.asarray(value)
        arrays[PARAM_PREFIX + name] = value.astype(np.int64 if value.dtype.kind in "iub" else np.float32)

    tmp = tempfile.NamedTemporaryFile(dir=directory, prefix="." + os.path.basename(path) + ".",
                                      suffix=".tmp", delete=False)
    try:
        with tmp:
            np.savez(tmp, **arrays)          # a file object: np.savez adds no ".npz"
            tmp.flush()
            os.fsync(tmp.fileno())
        # NamedTemporaryFile makes the file private (0600); give it the mode a
        # plain open() would have had (umask applied), or keep the mode of the file it replaces.
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = creation_mode()
        os.chmod(tmp.name, mode)
        os.replace(tmp.name, path)
    except BaseException:
        try:
            os.unlink(tmp.name)
        except FileNotFoundError:
            pass
        raise
    return path


# ---------------------------------------------------------------------- load
#: Room for a member's .npy header beside its data (np.save writes 128 bytes or a little more).
_NPY_HEADER_ROOM = 1024
#: The entries that are not parameters, each read (at most MAX_SMALL_ENTRY_BYTES) before the model is built.
SMALL_ENTRIES = ("format_version", "config", "metadata")


class _Entries(dict):
    """The entries of an open checkpoint (an :class:`NpzReader`): the entries that are not
    parameters read at once (each at most MAX_SMALL_ENTRY_BYTES; names other than SMALL_ENTRIES
    are read, so that a smuggled pickle is refused, and otherwise ignored), ``param/...`` entries read on first access, each
    only after its declared size was checked against ``limits[key]`` (set by ``load`` from the
    model the config built: a member larger than its parameter can be is refused unread)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.limits = path, {}
        self.npz = NpzReader(path, CheckpointError, MAX_MEMBER_BYTES, MAX_TOTAL_BYTES)
        try:
            self._names = self.npz.names()
            for key in self._names:
                if key.startswith(PARAM_PREFIX):
                    check_name(key[len(PARAM_PREFIX):], CheckpointError, f"{path}: entry {key!r}")
                elif self.npz.infos[key].filename.endswith(".npy"):     # others: refused by _open
                    self.npz.check_size(key, MAX_SMALL_ENTRY_BYTES)
                    self[key] = self.npz.read(key, MAX_SMALL_ENTRY_BYTES, _PICKLED)
        except BaseException:
            self.npz.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.npz.close()

    def names(self):
        """Every entry's name, read or not."""
        return list(self._names)

    def __missing__(self, key):
        if key not in self._names:
            raise KeyError(key)
        limit = self.limits.get(key, MAX_SMALL_ENTRY_BYTES)
        self.npz.check_size(key, _NPY_HEADER_ROOM + limit)
        self[key] = self.npz.read(key, limit, _PICKLED)
        return dict.__getitem__(self, key)


_PICKLED = "which a checkpoint never contains; refusing to load it"


def _open(path):
    """The checkpoint at ``path`` as open :class:`_Entries` (close it)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a cydnn checkpoint file")
    with open(path, "rb") as f:       # a missing file is a FileNotFoundError, not a CheckpointError
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        raise CheckpointError(f"{path} is empty, not a cydnn checkpoint")
    if head != _ZIP_MAGIC:
        looks = describe(path)
        raise CheckpointError(f"{path} is not a cydnn checkpoint: not an .npz (zip) archive "
                              f"(it starts with {head!r})" + (f"; it looks like {looks}" if looks else ""))
    entries = _Entries(path)
    try:
        looks = None if "format_version" in entries else describe(path)
        if looks:                   # a state_dict, a torch.save file: say so, and what loads it
            check_format(entries, path, looks)
        for key in entries.names():
            if not entries.npz.infos[key].filename.endswith(".npy"):
                raise CheckpointError(f"{path}: entry {key!r} is not a numpy array (.npy) member")
    except BaseException:
        entries.npz.close()
        raise
    return entries


def load_metadata(path):
    """The metadata dict of the checkpoint at ``path``, without building the model.

    ``metadata`` is what :func:`save` stored: ``cydnn_version``, ``created``
    (UTC, ISO 8601) and the caller's entries (``accuracy``, ``epochs``, ...), as
    parsed JSON.  Only the small entries are read (each at most
    ``MAX_SMALL_ENTRY_BYTES``); the parameters are not.  Raises
    ``FileNotFoundError`` for a missing file and :class:`CheckpointError` for a
    file that is not a checkpoint (naming what it looks like), a newer format,
    or a missing or invalid ``metadata`` entry.
    """
    with _open(path) as entries:
        check_format(entries, os.fspath(path))
        return json_entry(entries, "metadata", os.fspath(path))


def load(path, device="cpu"):
    """The model saved at ``path``, rebuilt from its config, weights loaded, on ``device``.

    Raises ``FileNotFoundError`` for a missing file and :class:`CheckpointError`
    for any problem with its content; a file that is not a checkpoint (a bare
    state_dict ``.npz``, a ``.safetensors``, an ``.onnx``, a ``torch.save``
    file) is named as what it looks like, with the function that loads it.
    The model is returned in training mode (as any new module); ``predict``
    switches to eval mode by itself.

    Nothing large is read before it is known to be needed: the declared sizes
    of all members first (MAX_MEMBER_BYTES, MAX_TOTAL_BYTES; two members of one
    name are refused), then the small entries (each at most
    MAX_SMALL_ENTRY_BYTES), the config (bounded JSON, checked, then built), and
    only then each parameter, whose ``.npy`` header is checked against its
    member's size and its float64 size in the model before the array is
    allocated: a 1 MB file cannot make ``load`` allocate a gigabyte (except
    through a config that asks for a model that large: see docs/reliability.md).
    """
    from . import models

    with _open(path) as entries:
        return _load(entries, os.fspath(path), device, models)


def _load(entries, path, device, models):
    """``load`` on open _Entries: format, config, model; then each parameter, read
    only after the model says how large it may be."""
    check_format(entries, path)
    config = json_entry(entries, "config", path)
    check_config(config, path, models)
    try:
        model = models.build(config)
    except (TypeError, ValueError, KeyError, OverflowError, MemoryError) as e:
        raise CheckpointError(f"{path}: cannot build {config['arch']} from config {config!r:.300}: "
                              f"{type(e).__name__}: {e}") from e

    reference = model.state_dict()
    expected = {name: tuple(v.shape) for name, v in reference.items()}
    # A parameter's member holds at most float64 data: a larger one is refused unallocated.
    entries.limits.update({PARAM_PREFIX + name: math.prod(shape) * 8 for name, shape in expected.items()})
    names = [key[len(PARAM_PREFIX):] for key in entries.names() if key.startswith(PARAM_PREFIX)]
    missing = sorted(set(expected) - set(names))
    extra = sorted(set(names) - set(expected))
    for name in names:
        if name in expected:
            entries.npz.check_size(PARAM_PREFIX + name, _NPY_HEADER_ROOM + entries.limits[PARAM_PREFIX + name])
    shapes = {name: entries.npz.header(PARAM_PREFIX + name, _PICKLED)[0] for name in names if name in expected}
    wrong = sorted(f"{n}: expected {expected[n]}, got {shapes[n]}" for n in shapes if shapes[n] != expected[n])
    if missing or extra or wrong:
        parts = ([f"missing parameters {missing}"] if missing else []) + \
                ([f"unexpected parameters {extra}"] if extra else []) + \
                ([f"wrong shapes: {', '.join(wrong)}"] if wrong else [])
        raise CheckpointError(f"{path}: weights do not fit {config['arch']}: " + "; ".join(parts))

    state = {}
    for name in shapes:
        value = entries[PARAM_PREFIX + name]
        integer = np.asarray(reference[name]).dtype.kind in "iub"
        if value.dtype.kind != "f" and not (integer and value.dtype.kind in "iu"):
            raise CheckpointError(f"{path}: parameter {name!r} has dtype {value.dtype}, expected "
                                  f"{'int64 (or float32 in format 1)' if integer else 'float32'}")
        state[name] = value
    try:
        model.load_state_dict(state, strict=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: weights do not fit {config['arch']}: {e}") from e
    return model.to(device)
