"""What :func:`cydnn.serialization.load` checks in a checkpoint before building anything.

The entries that are not parameters (``format_version``, ``config``,
``metadata``) and the config itself: JSON parsed with bounded depth and
integer length, no duplicate keys, and every argument checked against the
architecture's constructor (types, signs, bounds) so that nothing a file says
reaches a constructor unchecked.  Every failure is a :class:`CheckpointError`
naming the file, the entry and the problem.
"""
import inspect
import math

from ._filesafe import loads_json

__all__ = ["CheckpointError", "check_format", "json_entry", "check_config", "MAX_CLASSES",
           "MAX_LIST_LENGTH", "MAX_STRING_LENGTH"]

FORMAT_VERSION = 2     # 2: integer state entries (num_batches_tracked) as int64, not float32
#: Largest num_classes a config may ask for.
MAX_CLASSES = 100_000
#: Longest list (e.g. MLP sizes, SmallCNN widths) and string a config argument may hold.
MAX_LIST_LENGTH = 256
MAX_STRING_LENGTH = 256
#: Deepest nesting of a config argument (a list of lists at most).
MAX_ARG_DEPTH = 2
#: Largest magnitude of an integer inside a list argument.
MAX_LIST_INT = 1 << 31


class CheckpointError(ValueError):
    """A file that is not a valid cydnn checkpoint (corrupt, truncated, incomplete, incompatible)."""


def json_entry(entries, key, path):
    """The JSON value of the unicode-scalar entry ``key`` (bounded depth, no duplicate keys)."""
    if key not in entries:
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry {key!r}; "
                              f"present: {sorted(entries)}")
    value = entries[key]
    if value.shape != () or value.dtype.kind != "U":
        raise CheckpointError(f"{path}: entry {key!r} should be a unicode scalar (JSON), "
                              f"got dtype {value.dtype}, shape {value.shape}")
    return loads_json(str(value), CheckpointError, f"{path}: entry {key!r}")


def check_format(entries, path, describe=None):
    """``format_version`` present, an integer scalar, not newer than FORMAT_VERSION.  When it is
    missing, ``describe`` (if given) says what the file looks like instead."""
    if "format_version" not in entries:
        looks = f"; it looks like {describe}" if describe else ""
        raise CheckpointError(f"{path} is not a complete cydnn checkpoint: missing entry 'format_version'; "
                              f"present: {sorted(entries)[:10]}{looks}")
    version = entries["format_version"]
    if version.shape != () or version.dtype.kind not in "iu":
        raise CheckpointError(f"{path}: 'format_version' should be an integer scalar, "
                              f"got dtype {version.dtype}, shape {version.shape}")
    if int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {int(version)} is newer than this cydnn "
                              f"reads ({FORMAT_VERSION}); upgrade cydnn")


def _check_plain(value, where, depth=0):
    """A bounded JSON value: a bool, a number (integers |v| < 2**31, floats finite), a short
    string or None, or a short list or object of them nested at most MAX_ARG_DEPTH deep.  Only
    sizes are checked here; what each item must be, the model's constructor checks (before it
    allocates anything: cydnn.models bounds a model's parameters from its arguments)."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) >= MAX_LIST_INT:
            raise CheckpointError(f"{where}: integer {value} is too large (|v| < 2**31)")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"{where}: {value} is not a finite number")
    elif isinstance(value, str):
        if len(value) > MAX_STRING_LENGTH:
            raise CheckpointError(f"{where}: a string of {len(value)} characters (at most {MAX_STRING_LENGTH})")
    elif isinstance(value, (list, dict)):   # what the items must be is the constructor's to say
        if depth >= MAX_ARG_DEPTH:
            raise CheckpointError(f"{where}: lists nested deeper than {MAX_ARG_DEPTH}")
        if len(value) > MAX_LIST_LENGTH:
            raise CheckpointError(f"{where}: a {type(value).__name__} of {len(value)} items "
                                  f"(at most {MAX_LIST_LENGTH})")
        for item in (value if isinstance(value, list) else list(value) + list(value.values())):
            _check_plain(item, where, depth + 1)
    else:
        raise CheckpointError(f"{where}: a JSON {type(value).__name__} is not a valid argument")


def check_config(config, path, models):
    """Check a config (a parsed JSON value) against its class's constructor, before building anything."""
    if not isinstance(config, dict) or "arch" not in config:
        raise CheckpointError(f"{path}: 'config' must be a JSON object with an 'arch' key, got {config!r:.200}")
    arch = config["arch"]
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: config 'arch' must be a string naming an architecture, "
                              f"got {type(arch).__name__} {arch!r:.100}")
    if arch not in models.ARCHITECTURES:
        raise CheckpointError(f"{path}: unknown architecture {arch!r:.100}; known: {sorted(models.ARCHITECTURES)}")
    cls = models.ARCHITECTURES[arch]
    params = inspect.signature(cls.__init__).parameters
    known = [n for n in params if n != "self"]
    args = {k: v for k, v in config.items() if k != "arch"}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise CheckpointError(f"{path}: cannot build {arch}: config has arguments {unknown} "
                              f"that {arch} does not take (it takes {known})")
    for name, value in args.items():
        default = params[name].default
        where = f"{path}: cannot build {arch}: config argument {name}={value!r:.100}"
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
        elif isinstance(default, float):        # a number, or one per channel (mean, std)
            values = value if isinstance(value, list) and 0 < len(value) <= MAX_LIST_LENGTH else [value]
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise CheckpointError(f"{where} must be a finite number (or a list of them, one per channel)")
                if name == "std" and not v > 0:
                    raise CheckpointError(f"{where} must be > 0")
        else:       # a string, no default, None, a tuple: bounded JSON; the constructor checks the rest
            _check_plain(value, where)
            if name == "num_classes" and (isinstance(value, bool) or not isinstance(value, int)
                                          or not 1 <= value <= MAX_CLASSES):
                raise CheckpointError(f"{where} must be an integer in [1, {MAX_CLASSES}] (MAX_CLASSES)")
