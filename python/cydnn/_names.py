"""Names that come from files: a parameter or layer name is a dotted identifier path.

A name is a dotted path of parts, each an ASCII identifier (``conv1``,
``_orig_mod``) or a decimal index (``0``, as ``nn.Sequential`` names its
children), none of them an attribute of :class:`cydnn.nn.Module`
(``training``, ``forward``, ``_modules``, ...): such a name could replace a
method, a flag or a registry of the model that holds it.  A valid name has
only ``[A-Za-z0-9_.]``, never starts with ``.`` and never holds ``..``, so it
is also a safe file name (:func:`child_path` checks again).  Every reader of
weights, checkpoints and ONNX graphs checks each name here where it enters.
"""
import os
import re

from .nn.module import Module

__all__ = ["check_name", "child_path", "MAX_NAME_LENGTH", "MAX_NAME_PARTS"]

MAX_NAME_LENGTH = 512
MAX_NAME_PARTS = 32
_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]{1,9}\Z")


def _module_attributes():
    """Every attribute a Module has: its class's (methods, properties) and a fresh instance's."""
    return frozenset(dir(Module)) | frozenset(vars(Module())) | {"__dict__", "__class__"}


_RESERVED = _module_attributes()


def check_name(name, error, where, what="parameter"):
    """``name`` if it is a dotted identifier path that cannot shadow a Module attribute,
    else ``error`` saying why (``where``: the file, and the entry when there is one)."""
    if not isinstance(name, str):
        raise error(f"{where}: {what} name {name!r} is not a string")
    shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
    if not name or len(name) > MAX_NAME_LENGTH:
        raise error(f"{where}: {what} name {shown} must have 1 to {MAX_NAME_LENGTH} characters")
    parts = name.split(".")
    if len(parts) > MAX_NAME_PARTS:
        raise error(f"{where}: {what} name {shown} has more than {MAX_NAME_PARTS} dotted parts")
    for part in parts:
        if not part:
            raise error(f"{where}: {what} name {shown} has an empty part (a leading, trailing or double dot)")
        if not _PART.fullmatch(part):
            raise error(f"{where}: {what} name {shown}: part {part!r} is neither an identifier "
                        f"([A-Za-z_][A-Za-z0-9_]*) nor an index (digits); path separators, spaces "
                        f"and control characters are refused")
        if part in _RESERVED or (part.startswith("__") and part.endswith("__")):
            raise error(f"{where}: {what} name {shown}: part {part!r} is an attribute of nn.Module; "
                        f"a layer or parameter of that name would shadow it")
    return name


def child_path(folder, name, ext, error, where):
    """``folder/<name>.<ext>`` for a valid ``name``, checked to lie directly inside ``folder``."""
    check_name(name, error, where)
    path = os.path.join(folder, f"{name}.{ext}")
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(folder):
        raise error(f"{where}: parameter name {name!r} would be written outside {folder}")
    return path
