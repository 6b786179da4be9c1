"""Checkpoints: a model in one ``.npz`` file, with no pickle anywhere.

Layout of the archive (every entry a plain numpy array)::

    format_version    int64 scalar, FORMAT_VERSION
    config            unicode scalar: JSON of model.config(), e.g.
                      {"arch": "LeNet5", "classic": false, "num_classes": 10, ...}
    metadata          unicode scalar: JSON {"cydnn_version": ..., "created": ISO date,
                      plus the caller's entries (accuracy, epochs, ...)}
    param/<name>      float32 array for each state_dict key, e.g. param/conv1.weight

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
import zipfile

import numpy as np

__all__ = ["FORMAT_VERSION", "CheckpointError", "save", "load", "load_metadata"]

FORMAT_VERSION = 1
PARAM_PREFIX = "param/"

#: Largest uncompressed size accepted for one archive member, and for all of them (bytes).
MAX_MEMBER_BYTES = 1 << 30
MAX_TOTAL_BYTES = 4 << 30
#: Largest num_classes a config may ask for.
MAX_CLASSES = 100_000
_ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(ValueError):
    """A file that is not a valid cydnn checkpoint (corrupt, truncated, incomplete, incompatible)."""


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
    Weights are stored as float32 whatever the model's dtype or device.
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
        arrays[PARAM_PREFIX + name] = value.astype(np.float32)

    tmp = tempfile.NamedTemporaryFile(dir=directory, prefix="." + os.path.basename(path) + ".",
                                      suffix=".tmp", delete=False)
    try:
        with tmp:
            np.savez(tmp, **arrays)          # a file object: np.savez adds no ".npz"
            tmp.flush()
            os.fsync(tmp.fileno())
        # NamedTemporaryFile makes the file private (0600); give it the mode a
        # plain open() would have had, or keep the mode of the file it replaces.
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
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
def _read_archive(path, lazy=False):
    """Every entry of the checkpoint at ``path``, as a dict name -> numpy array.

    ``lazy=True`` returns a :class:`_LazyEntries` instead (close it): the small
    entries are read at once, the parameters only when asked for, each after its
    declared size was checked against the bound ``load`` sets from the model.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory, not a cydnn checkpoint file")
    with open(path, "rb") as f:       # a missing file is a FileNotFoundError, not a CheckpointError
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        raise CheckpointError(f"{path} is empty, not a cydnn checkpoint")
    if head != _ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a cydnn checkpoint: not an .npz (zip) archive "
                              f"(it starts with {head!r})")
    _check_zip_sizes(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt: cannot open it as .npz ({e})") from e
    if lazy:
        return _LazyEntries(npz, path)
    entries = {}
    with npz:
        for key in npz.files:
            entries[key] = read_npz_member(npz, key, path, CheckpointError, "entry",
                                           "which a checkpoint never contains; refusing to load it")
    return entries


#: Largest uncompressed size of an entry that is not a parameter (config, metadata, format_version).
MAX_SMALL_ENTRY_BYTES = 1 << 20


class _LazyEntries(dict):
    """The entries of an open checkpoint: non-parameter entries read at once (each at most
    MAX_SMALL_ENTRY_BYTES), ``param/...`` entries read on first access, and only when their
    declared uncompressed size is within ``limits[key]`` (set by ``load`` from the model
    the config built: a member larger than its parameter can be is refused unread)."""

    def __init__(self, npz, path):
        super().__init__()
        self._npz, self._path, self.limits = npz, path, {}
        self._infos = {name[:-4] if name.endswith(".npy") else name: info
                       for name, info in ((i.filename, i) for i in npz.zip.infolist())}
        try:
            for key in self._infos:
                if not key.startswith(PARAM_PREFIX):
                    self._read(key, MAX_SMALL_ENTRY_BYTES)
        except BaseException:
            npz.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._npz.close()

    def names(self):
        """Every entry's name, read or not."""
        return list(self._infos)

    def _read(self, key, limit):
        size = self._infos[key].file_size
        if size > limit:
            raise CheckpointError(f"{self._path}: entry {key!r} declares {size} bytes uncompressed, more than "
                                  f"the {limit} it can need; refusing to read it")
        self[key] = read_npz_member(self._npz, key, self._path, CheckpointError, "entry",
                                    "which a checkpoint never contains; refusing to load it")
        return dict.__getitem__(self, key)

    def __missing__(self, key):
        if key not in self._infos:
            raise KeyError(key)
        return self._read(key, self.limits.get(key, MAX_SMALL_ENTRY_BYTES))


def _check_zip_sizes(path):
    """Refuse an archive whose members declare huge uncompressed sizes, before reading any."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt: cannot open it as .npz ({e})") from e
    total = 0
    for info in infos:
        if info.file_size > MAX_MEMBER_BYTES:
            raise CheckpointError(f"{path}: entry {info.filename!r} declares {info.file_size} bytes "
                                  f"uncompressed, more than the {MAX_MEMBER_BYTES}-byte limit "
                                  f"(MAX_MEMBER_BYTES); refusing to read it")
        total += info.file_size
    if total > MAX_TOTAL_BYTES:
        raise CheckpointError(f"{path}: its entries declare {total} bytes uncompressed in all, more than "
                              f"the {MAX_TOTAL_BYTES}-byte limit (MAX_TOTAL_BYTES); refusing to read it")


def _check_config(config, path, models):
    """Check a config's arguments against its class's constructor, before building anything."""
    import inspect
    cls = models.ARCHITECTURES[config["arch"]]
    params = inspect.signature(cls.__init__).parameters
    known = [n for n in params if n != "self"]
    args = {k: v for k, v in config.items() if k != "arch"}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise CheckpointError(f"{path}: cannot build {config['arch']}: config has arguments {unknown} "
                              f"that {config['arch']} does not take "
                              f"(it takes {known})")
    for name, value in args.items():
        default = params[name].default
        where = f"{path}: cannot build {config['arch']}: config argument {name}={value!r}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise CheckpointError(f"{where} must be true or false")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"{where} must be an integer")
            if value < 0:
                raise CheckpointError(f"{where} must be >= 0")
            if name == "num_classes" and not 1 <= value <= MAX_CLASSES:
                raise CheckpointError(f"{where} must lie in [1, {MAX_CLASSES}] (MAX_CLASSES)")
            if value >= 2**63:
                raise CheckpointError(f"{where} is too large")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CheckpointError(f"{where} must be a finite number")
            if name == "std" and not value > 0:
                raise CheckpointError(f"{where} must be > 0")


def _json_entry(entries, key, path):
    if key not in entries:
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry {key!r}; "
                              f"present: {sorted(entries)}")
    value = entries[key]
    if value.shape != () or value.dtype.kind != "U":
        raise CheckpointError(f"{path}: entry {key!r} should be a unicode scalar (JSON), "
                              f"got dtype {value.dtype}, shape {value.shape}")
    try:
        return json.loads(str(value))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: entry {key!r} is not valid JSON ({e})") from e


def _check_format(entries, path):
    if "format_version" not in entries:
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry 'format_version'; "
                              f"present: {sorted(entries)}")
    version = entries["format_version"]
    if version.shape != () or version.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: 'format_version' should be an integer scalar, "
                              f"got dtype {version.dtype}, shape {version.shape}")
    if int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {int(version)} is newer than this cydnn "
                              f"reads ({FORMAT_VERSION}); upgrade cydnn")


def load_metadata(path):
    """The metadata dict of the checkpoint at ``path`` (the model is not built)."""
    entries = _read_archive(path)
    _check_format(entries, path)
    return _json_entry(entries, "metadata", path)


def read_npz_member(npz, key, path, error, what, pickled_note):
    """``npz[key]`` (allow_pickle off), or ``error`` naming the file, the member and what is wrong:
    pickled objects (never unpickled), truncation or corruption, a member that is not a .npy array."""
    try:
        value = npz[key]
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise error(f"{path}: {what} {key!r} holds pickled Python objects, {pickled_note}") from e
        raise error(f"{path}: {what} {key!r} is corrupt ({e})") from e
    except (zipfile.BadZipFile, OSError, EOFError, KeyError) as e:
        raise error(f"{path}: {what} {key!r} is truncated or corrupt ({e})") from e
    if not isinstance(value, np.ndarray):    # np.load gives raw bytes for a non-.npy member
        raise error(f"{path}: {what} {key!r} is not a numpy array (.npy) member")
    return value


def load(path, device="cpu"):
    """The model saved at ``path``, rebuilt from its config, weights loaded, on ``device``.

    Raises ``FileNotFoundError`` for a missing file and :class:`CheckpointError`
    for any problem with its content.  The model is returned in training mode
    (as any new module); ``predict`` switches to eval mode by itself.

    Nothing large is read before it is known to be needed: the declared sizes
    of all members first (MAX_MEMBER_BYTES, MAX_TOTAL_BYTES), then the small
    entries (each at most MAX_SMALL_ENTRY_BYTES), the config (checked, then
    built), and only then each parameter, whose member may hold at most its
    float64 size: a 1 MB file cannot make ``load`` allocate a gigabyte.
    """
    from . import models

    with _read_archive(path, lazy=True) as entries:
        return _load(entries, os.fspath(path), device, models)


def _load(entries, path, device, models):
    """``load`` on an open _LazyEntries: format, config, model; then each parameter, read
    only after the model says how large it may be."""
    _check_format(entries, path)
    config = _json_entry(entries, "config", path)
    if not isinstance(config, dict) or "arch" not in config:
        raise CheckpointError(f"{path}: 'config' must be a JSON object with an 'arch' key, got {config!r}")
    if config["arch"] not in models.ARCHITECTURES:
        raise CheckpointError(f"{path}: unknown architecture {config['arch']!r}; "
                              f"known: {sorted(models.ARCHITECTURES)}")
    _check_config(config, path, models)
    try:
        model = models.build(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot build {config['arch']} from config {config}: {e}") from e

    expected = {name: tuple(v.shape) for name, v in model.state_dict().items()}
    # A parameter's member holds a header and at most float64 data: a larger one is refused unread.
    entries.limits.update({PARAM_PREFIX + name: 1024 + math.prod(shape) * 8 for name, shape in expected.items()})
    names = [key[len(PARAM_PREFIX):] for key in entries.names() if key.startswith(PARAM_PREFIX)]
    missing = sorted(set(expected) - set(names))
    extra = sorted(set(names) - set(expected))
    stored = {name: entries[PARAM_PREFIX + name] for name in names if name in expected}
    wrong = sorted(f"{n}: expected {expected[n]}, got {tuple(stored[n].shape)}"
                   for n in set(stored) & set(expected) if tuple(stored[n].shape) != expected[n])
    if missing or extra or wrong:
        parts = ([f"missing parameters {missing}"] if missing else []) + \
                ([f"unexpected parameters {extra}"] if extra else []) + \
                ([f"wrong shapes: {', '.join(wrong)}"] if wrong else [])
        raise CheckpointError(f"{path}: weights do not fit {config['arch']}: " + "; ".join(parts))

    state = {}
    for name, value in stored.items():
        if value.dtype.kind != "f":
            raise CheckpointError(f"{path}: parameter {name!r} has dtype {value.dtype}, expected float32")
        state[name] = value
    try:
        model.load_state_dict(state, strict=True)
    except ValueError as e:
        raise CheckpointError(f"{path}: weights do not fit {config['arch']}: {e}") from e
    return model.to(device)
