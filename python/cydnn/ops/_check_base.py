"""The building blocks of argument validation (see ``_check.py``): array, dtype, integer and
number checks, ``pair`` for kernel/stride/padding arguments, and the shape formatting every
message uses.  Like the op-level checks, they look only at ``.shape``, ``.ndim`` and ``.dtype``."""
import math
import numbers

import numpy as np


def _shape(a):
    """``a.shape`` as a tuple of Python ints (prints the same for every array kind)."""
    if type(a) is np.ndarray:  # already a tuple of Python ints (the common case: a fast path)
        return a.shape
    return tuple(int(s) for s in a.shape)


def _shapes(**arrays):
    """``"(x (2, 1, 28, 28), w (6, 1, 5, 5))"``: the shapes of the named arrays (None skipped)."""
    parts = [f"{name} {_shape(a)}" for name, a in arrays.items() if a is not None]
    return "(" + ", ".join(parts) + ")"


def _dtype_names(dtypes):
    return ", ".join(np.dtype(d).name for d in dtypes)


def _type_name(v):
    return type(v).__name__


def _is_array(a):
    return type(a) is np.ndarray or all(hasattr(a, attr) for attr in ("shape", "ndim", "dtype"))


_DTYPE_SETS = {}  # allowed_dtypes tuple -> frozenset of np.dtype (built once per tuple)


def _dtype_set(allowed_dtypes):
    key = tuple(allowed_dtypes)
    dtypes = _DTYPE_SETS.get(key)
    if dtypes is None:
        dtypes = _DTYPE_SETS[key] = frozenset(np.dtype(d) for d in key)
    return dtypes


def _array(op, name, a, allowed_dtypes, ndim=None, what=None):
    """Check that ``a`` is a non-empty array of an allowed dtype and (if given) rank.

    ``allowed_dtypes`` None accepts any dtype; ``what`` describes the axes for
    the rank message, e.g. ``"(n, c, h, w)"``.
    """
    if not _is_array(a):
        accepted = "any dtype" if allowed_dtypes is None else _dtype_names(allowed_dtypes)
        raise TypeError(
            f"{op}: {name} must be an array (numpy.ndarray or DeviceArray) of dtype "
            f"{accepted}; got {_type_name(a)}"
        )
    if allowed_dtypes is not None and np.dtype(a.dtype) not in _dtype_set(allowed_dtypes):
        raise TypeError(
            f"{op}: {name} has dtype {np.dtype(a.dtype).name}; accepted: "
            f"{_dtype_names(allowed_dtypes)} ({name} {_shape(a)})"
        )
    if ndim is not None and a.ndim != ndim:
        axes = f" {what}" if what else ""
        raise ValueError(f"{op}: {name} must have rank {ndim}{axes}, got rank {a.ndim} ({name} {_shape(a)})")
    shape = _shape(a)
    if shape and min(shape) < 1:
        raise ValueError(f"{op}: {name} has an empty dimension ({name} {_shape(a)}); every dimension must be >= 1")


def _integer_array(op, name, a, ndim):
    """Check that ``a`` is a non-empty array of an integer dtype (any width, signed or not) and rank ``ndim``."""
    if not _is_array(a):
        raise TypeError(f"{op}: {name} must be an array of an integer dtype; got {_type_name(a)}")
    if not np.issubdtype(np.dtype(a.dtype), np.integer):
        raise TypeError(f"{op}: {name} must have an integer dtype, got {np.dtype(a.dtype).name} ({name} {_shape(a)})")
    _array(op, name, a, None, ndim)


def _same_dtype(op, name, a, ref_name, ref, **shapes):
    if np.dtype(a.dtype) != np.dtype(ref.dtype):
        raise TypeError(
            f"{op}: {name} has dtype {np.dtype(a.dtype).name} but {ref_name} has dtype "
            f"{np.dtype(ref.dtype).name} {_shapes(**shapes)}"
        )


def _is_int(v):
    # bool is an int subclass in Python, but stride=True is surely a mistake.
    if type(v) is int:  # fast path: isinstance against the numbers ABCs is slow
        return True
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def _number(op, name, v):
    """A finite real number (int or float, not bool) as a Python float."""
    if type(v) is not float and type(v) is not int and (  # (the test of the ABCs is slow: skip it for these)
            isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Real, np.integer, np.floating))):
        raise TypeError(f"{op}: {name} must be a real number, got {_type_name(v)} {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{op}: {name} must be finite, got {v}")
    return v


def _int(op, name, v, minimum=0):
    """An int >= ``minimum`` as a Python int."""
    if not _is_int(v):
        raise TypeError(f"{op}: {name} must be an int, got {_type_name(v)} {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {v}")
    return v


def _seed(op, seed):
    """A seed as a Python int in [0, 2**64) (it becomes a uint64)."""
    seed = _int(op, "seed", seed, 0)
    if seed >= 2**64:
        raise ValueError(f"{op}: seed must be < 2**64, got {seed}")
    return seed


def pair(v, name, op, minimum=0):
    """``v`` (an int or a pair of ints) as ``(h, w)``, each ``>= minimum``.

    Use ``minimum=1`` for kernel and stride, ``minimum=0`` (default) for padding.
    Raises TypeError for non-ints, ValueError for a wrong length or a value below ``minimum``.
    """
    if _is_int(v):
        hw = (int(v), int(v))
    elif isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{op}: {name} must be an int or an (h, w) pair, got {v!r} of length {len(v)}")
        if not all(_is_int(e) for e in v):
            raise TypeError(f"{op}: {name} must hold ints, got {v!r}")
        hw = (int(v[0]), int(v[1]))
    else:
        raise TypeError(f"{op}: {name} must be an int or an (h, w) pair of ints, got {_type_name(v)} {v!r}")
    if min(hw) < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {hw}")
    return hw
