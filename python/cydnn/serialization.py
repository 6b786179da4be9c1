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
half of one (a process killed while saving leaves the old file complete, and
at most a hidden ``.<name>.*.tmp`` beside it, which nothing reads).  Loading
uses ``np.load(allow_pickle=False)`` and reads each member's .npy header and
declared size before its data: pickled members, sizes larger than the model
needs (zip bombs), configs with unknown or out-of-range arguments, and
missing, extra or wrong-shaped parameters are refused before anything large
is allocated.  Any problem with the file's content raises
:class:`CheckpointError` saying what is wrong.
"""
import datetime
import errno
import inspect
import json
import math
import os
import tempfile
import zipfile
import zlib

import numpy as np

__all__ = ["FORMAT_VERSION", "CheckpointError", "check_config", "check_save_path", "save", "load",
           "load_metadata"]

FORMAT_VERSION = 1
PARAM_PREFIX = "param/"
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
def check_save_path(path):
    """``path`` as a str if a checkpoint can be written there, else a clear OSError.

    ``IsADirectoryError`` when ``path`` is a directory, ``FileNotFoundError``
    when its folder does not exist (no folder is created), ``PermissionError`` /
    ``OSError(EROFS)`` when the folder cannot be written.  Cheap: the training
    command calls it before training, so a bad ``--save`` fails in a second.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"cannot save a checkpoint to {path}: it is a directory", path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"cannot save a checkpoint to {path}: the folder {directory} "
                                f"does not exist (create it first)", directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only_fs(directory) else errno.EACCES
        raise OSError(code, f"cannot save a checkpoint to {path}: the folder {directory} is not writable "
                      f"({os.strerror(code)})", directory)
    return path


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_only_fs(directory):
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):
        return False


def save(model, path, metadata=None):
    """Write ``model`` (its ``config()`` and weights) and ``metadata`` to ``path``.

    ``metadata``: a dict of JSON-able values (numpy scalars are fine), merged
    over the defaults ``cydnn_version`` and ``created`` (UTC, ISO 8601).
    Weights are stored as float32 whatever the model's dtype or device.
    The write is atomic; on any failure the temporary file is removed and an
    existing file at ``path`` is left untouched.  Returns ``path`` as a str.
    """
    path = check_save_path(path)
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

    directory = os.path.dirname(os.path.abspath(path))
    try:
        tmp = tempfile.NamedTemporaryFile(dir=directory, prefix="." + os.path.basename(path) + ".",
                                          suffix=".tmp", delete=False)
    except OSError as e:
        raise type(e)(e.errno, f"cannot save a checkpoint in {directory}: {e.strerror}", directory) from None
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
        _fsync_dir(directory)                # the rename itself survives a power cut
    except BaseException:
        try:
            os.unlink(tmp.name)
        except FileNotFoundError:
            pass
        raise
    return path


# ---------------------------------------------------------------------- load
#: The most bytes a JSON entry (config, metadata) may inflate to; larger is refused unread.
MAX_JSON_BYTES = 1 << 20

#: Rules for the constructor arguments of each architecture, checked before it is built:
#: name -> (type, minimum, maximum) with None for no bound.  An argument missing here
#: (an architecture registered by a user) must be a JSON scalar, and an int within +-2**31.
CONFIG_RULES = {
    "LeNet5": {
        "classic": (bool, None, None),
        "num_classes": (int, 1, 100_000),
        "seed": (int, 0, 2**63 - 1),
        "mean": (float, -1e6, 1e6),
        "std": (float, 1e-12, 1e6),
    },
}


class _Archive:
    """A checkpoint opened for reading: each member's .npy header is checked before its data.

    ``members``: entry name -> ZipInfo.  Nothing is unpickled, nothing larger than
    what the caller expects is ever inflated (the declared size is checked first,
    and zipfile never inflates past it).
    """

    def __init__(self, path):
        self.path = path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, f"{path} is a directory, not a cydnn checkpoint file", path)
        with open(path, "rb") as f:   # a missing file is a FileNotFoundError, not a CheckpointError
            head = f.read(len(_ZIP_MAGIC))
        if not head:
            raise CheckpointError(f"{path} is empty, not a cydnn checkpoint")
        if len(head) < len(_ZIP_MAGIC) and _ZIP_MAGIC.startswith(head):
            raise CheckpointError(f"{path} is truncated or corrupt: {len(head)} bytes, the start of a zip archive")
        if head != _ZIP_MAGIC:
            raise CheckpointError(f"{path} is not a cydnn checkpoint: not an .npz (zip) archive "
                                  f"(it starts with {head!r})")
        try:
            self._npz = np.load(path, allow_pickle=False)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise CheckpointError(f"{path} is truncated or corrupt: cannot open it as .npz ({e})") from e
        self.members = {}
        for info in self._npz.zip.infolist():
            if not info.filename.endswith(".npy"):
                self.close()
                raise CheckpointError(f"{path}: entry {info.filename!r} is not a numpy array (.npy) member")
            self.members[info.filename[:-4]] = info

    def close(self):
        self._npz.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def header(self, key, max_bytes):
        """(shape, dtype) of entry ``key`` from its .npy header, after checking its declared size.

        Refuses a member that is not a .npy array, one whose size exceeds
        ``max_bytes`` (before inflating anything), one that holds Python
        objects (never unpickled), and one whose header and size disagree.
        """
        path, info = self.path, self.members[key]
        if not info.filename.endswith(".npy"):
            raise CheckpointError(f"{path}: entry {info.filename!r} is not a numpy array (.npy) member")
        if info.file_size > max_bytes:
            raise CheckpointError(f"{path}: entry {key!r} inflates to {info.file_size:,} bytes, more than "
                                  f"the {max_bytes:,} it can need; refusing to read it (a zip bomb?)")
        try:
            with self._npz.zip.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                offset = f.tell()
        except ValueError as e:
            raise CheckpointError(f"{path}: entry {key!r} has no valid .npy header ({e})") from e
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise CheckpointError(f"{path}: entry {key!r} is truncated or corrupt ({e})") from e
        if dtype.hasobject:
            raise CheckpointError(f"{path}: entry {key!r} holds pickled Python objects (dtype {dtype}), "
                                  f"which a checkpoint never contains; refusing to load it (nothing was unpickled)")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes != info.file_size:
            raise CheckpointError(f"{path}: entry {key!r} is corrupt: its header declares {shape} {dtype} "
                                  f"({nbytes:,} bytes) but the member holds {info.file_size - offset:,}")
        return tuple(shape), dtype

    def read(self, key, max_bytes):
        """Entry ``key`` as a numpy array (``header`` checks first)."""
        shape, dtype = self.header(key, max_bytes)
        try:
            return self._npz[key]
        except ValueError as e:
            raise CheckpointError(f"{self.path}: entry {key!r} is corrupt ({e})") from e
        except (zipfile.BadZipFile, OSError, EOFError, KeyError, zlib.error) as e:
            raise CheckpointError(f"{self.path}: entry {key!r} is truncated or corrupt ({e})") from e

    def check_all_headers(self, limits=None):
        """Refuse any member that is not a plain .npy array (objects, non-.npy files), or larger than
        ``limits[key]`` (default: the JSON entries' bounds), reading headers only."""
        limits = dict({"format_version": 1024, "config": MAX_JSON_BYTES, "metadata": MAX_JSON_BYTES},
                      **(limits or {}))
        for key, info in self.members.items():
            if not info.filename.endswith(".npy"):
                raise CheckpointError(f"{self.path}: entry {info.filename!r} is not a numpy array (.npy) member")
            self.header(key, max_bytes=limits.get(key, info.file_size))


def _json_entry(archive, key):
    path = archive.path
    if key not in archive.members:
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry {key!r}; "
                              f"present: {sorted(archive.members)}")
    value = archive.read(key, MAX_JSON_BYTES)
    if value.shape != () or value.dtype.kind != "U":
        raise CheckpointError(f"{path}: entry {key!r} should be a unicode scalar (JSON), "
                              f"got dtype {value.dtype}, shape {value.shape}")
    try:
        return json.loads(str(value))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: entry {key!r} is not valid JSON ({e})") from e


def _check_format(archive):
    path = archive.path
    if "format_version" not in archive.members:
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry 'format_version'; "
                              f"present: {sorted(archive.members)}")
    version = archive.read("format_version", 1024)
    if version.shape != () or version.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: 'format_version' should be an integer scalar, "
                              f"got dtype {version.dtype}, shape {version.shape}")
    if int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {int(version)} is newer than this cydnn "
                              f"reads ({FORMAT_VERSION}); upgrade cydnn")


def check_config(config, where="config"):
    """Refuse a model config that is not safe to build, before anything is allocated.

    ``config`` must be a dict with a registered ``"arch"``; the other keys must be
    arguments of that class's constructor, each of the right type and within
    bounds (:data:`CONFIG_RULES`).  Raises :class:`CheckpointError` naming the
    offending key and what is accepted.  Returns the architecture's class.
    """
    from . import models

    if not isinstance(config, dict) or not isinstance(config.get("arch"), str):
        raise CheckpointError(f"{where}: 'config' must be a JSON object with an 'arch' string, got {config!r}")
    arch = config["arch"]
    if arch not in models.ARCHITECTURES:
        raise CheckpointError(f"{where}: unknown architecture {arch!r}; known: {sorted(models.ARCHITECTURES)}")
    cls = models.ARCHITECTURES[arch]
    params = inspect.signature(cls.__init__).parameters
    accepted = [n for n, p in params.items()
                if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    rules = CONFIG_RULES.get(arch, {})
    for key, value in config.items():
        if key == "arch":
            continue
        if key not in accepted and not takes_kwargs:
            raise CheckpointError(f"{where}: cannot build {arch}: unknown argument {key!r} "
                                  f"(= {value!r}); {arch} takes {accepted}")
        kind, low, high = rules.get(key, (None, -2**31, 2**31))
        _check_config_value(arch, key, value, kind, low, high, where)
    return cls


def _check_config_value(arch, key, value, kind, low, high, where):
    def refuse(why):
        raise CheckpointError(f"{where}: cannot build {arch}: argument {key!r} = {value!r} {why}")

    if kind is None:                                   # no rule: a JSON scalar, ints bounded
        if not (value is None or isinstance(value, (bool, int, float, str))):
            refuse(f"is a {type(value).__name__}, not a JSON scalar")
        if isinstance(value, float) and not math.isfinite(value):
            refuse("is not finite")
        if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
            refuse(f"is out of [{low}, {high}]")
        return
    if kind is bool:
        if not isinstance(value, bool):
            refuse(f"must be true or false, not a {type(value).__name__}")
        return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            refuse(f"must be an integer, not a {type(value).__name__}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refuse(f"must be a number, not a {type(value).__name__}")
        if not math.isfinite(value):
            refuse("must be finite")
    if low is not None and value < low or high is not None and value > high:
        refuse(f"is out of the accepted range [{low}, {high}]")


def load_metadata(path):
    """The metadata dict of the checkpoint at ``path`` (the model is not built)."""
    with _Archive(path) as archive:
        archive.check_all_headers()
        _check_format(archive)
        return _json_entry(archive, "metadata")


def load(path, device="cpu"):
    """The model saved at ``path``, rebuilt from its config, weights loaded, on ``device``.

    Raises ``FileNotFoundError`` for a missing file, ``IsADirectoryError`` for a
    directory, and :class:`CheckpointError` for any problem with its content,
    found in this order and before the next step allocates anything: the zip
    directory; the format version; the config (at most 1 MiB; architecture
    and every argument checked against :data:`CONFIG_RULES`); every member's
    declared size (a parameter's at most its float64 size) and .npy header (no
    pickled objects); the parameter names and shapes against the model the
    config builds (all missing, unexpected and wrong-shaped names in one
    message); only then the weights.
    The model is returned in training mode (as any new module); ``predict``
    switches to eval mode by itself.
    """
    from . import models

    with _Archive(path) as archive:
        path = archive.path
        _check_format(archive)
        config = _json_entry(archive, "config")
        check_config(config, where=path)
        try:
            model = models.build(config)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot build {config['arch']} from config {config}: {e}") from e

        expected = {name: value.shape for name, value in model.state_dict().items()}
        # A parameter's member holds its header and at most float64 data: anything larger is refused unread.
        limits = {PARAM_PREFIX + name: 1024 + math.prod(shape) * 8 for name, shape in expected.items()}
        archive.check_all_headers(limits)
        found = {key[len(PARAM_PREFIX):]: key for key in archive.members if key.startswith(PARAM_PREFIX)}
        missing = [n for n in expected if n not in found]
        unexpected = [n for n in found if n not in expected]
        wrong = []
        for name, key in found.items():
            if name not in expected:
                continue
            shape, dtype = archive.header(key, archive.members[key].file_size)
            if dtype.kind != "f":
                raise CheckpointError(f"{path}: parameter {name!r} has dtype {dtype}, expected float32")
            if shape != tuple(expected[name]):
                wrong.append(f"{name!r}: expected {tuple(expected[name])}, got {shape}")
        if missing or unexpected or wrong:
            parts = ([f"missing {missing}"] if missing else []) + \
                    ([f"unexpected {unexpected}"] if unexpected else []) + \
                    ([f"wrong shape: {'; '.join(wrong)}"] if wrong else [])
            raise CheckpointError(f"{path}: weights do not fit {config['arch']}: " + "; ".join(parts))

        state = {name: archive.read(key, limits[key]) for name, key in found.items()}
    try:
        model.load_state_dict(state, strict=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: weights do not fit {config['arch']}: {e}") from e
    return model.to(device)
