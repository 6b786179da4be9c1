"""Which implementation the hot loops of the CPU ops use: the numpy twin or the compiled kernels.

    cydnn.ops.cpu.set_kernels("cython")   # the OpenMP kernels of ops/cpu/_kernels.pyx
    cydnn.ops.cpu.set_kernels("numpy")    # whole-array numpy: the reference the tests compare with
    cydnn.ops.cpu.set_kernels("auto")     # cython where the extension was built, else numpy

The default is ``$CYDNN_CPU_KERNELS`` (one of the three names), else "auto".

The float32 kernels written in C (direct convolution, 2 x 2 pooling) have an
AVX2 + FMA version chosen at run time where the CPU has it;
``$CYDNN_CPU_ISA=baseline`` (or ``_kernels.set_isa("baseline")``) forces the
plain loops, ``avx2`` or ``auto`` (the default) the best the CPU supports.
Both choices compute the same functions with the same caches, so a forward
pass run with one can be differentiated with the other.  The choice covers
im2col / col2im and the layout changes of convolution, max and average
pooling, ReLU, and the SGD and Adam updates; the matrix products go to
numpy's BLAS either way (with the thread policy of ``_threads``).
"""
import contextlib
import os

__all__ = ["set_kernels", "get_kernels", "kernels_available", "use_kernels", "active"]

_ENV = "CYDNN_CPU_KERNELS"
_NAMES = ("numpy", "cython", "auto")

try:
    from . import _kernels as _compiled
    _missing = None
except ImportError as e:  # not built (a tree used without `pip install`/`setup.py build_ext`)
    _compiled, _missing = None, str(e)

_active = None  # the compiled module when "cython" is in use, else None (read by every op)


def kernels_available():
    """(True, None) when the compiled kernels import, else (False, why)."""
    return (_compiled is not None), _missing


def set_kernels(name):
    """Use ``"numpy"``, ``"cython"`` or ``"auto"`` kernels in the CPU ops from now on (process-wide).

    ``"cython"`` raises ImportError, saying how to build them, when the extension is missing.
    """
    global _active
    if name not in _NAMES:
        raise ValueError(f"set_kernels: name must be one of {', '.join(map(repr, _NAMES))}, got {name!r}")
    if name == "cython" and _compiled is None:
        raise ImportError(f"set_kernels('cython'): the compiled CPU kernels (cydnn.ops.cpu._kernels) are not "
                          f"built ({_missing}); run `pip install -e .` or `python setup.py build_ext --inplace`, "
                          f"or use set_kernels('numpy')")
    _active = _compiled if name in ("cython", "auto") else None


def get_kernels():
    """``"cython"`` or ``"numpy"``: what the ops use now."""
    return "numpy" if _active is None else "cython"


def active():
    """The compiled kernel module in use, or None for the numpy twin (the ops' dispatch)."""
    return _active


@contextlib.contextmanager
def use_kernels(name):
    """``with use_kernels("numpy"): ...`` -- :func:`set_kernels` for a block, restored after."""
    before = get_kernels()
    set_kernels(name)
    try:
        yield
    finally:
        set_kernels(before)


def _from_env():
    name = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if name not in _NAMES:
        raise ValueError(f"${_ENV} must be one of {', '.join(_NAMES)}, got {os.environ[_ENV]!r}")
    set_kernels(name)
    isa = os.environ.get("CYDNN_CPU_ISA", "auto").strip().lower() or "auto"
    if isa not in ("auto", "baseline", "avx2"):
        raise ValueError(f"$CYDNN_CPU_ISA must be one of auto, baseline, avx2, got {os.environ['CYDNN_CPU_ISA']!r}")
    if _compiled is not None and hasattr(_compiled, "set_isa"):
        _compiled.set_isa(_compiled.isa_max() if isa == "auto" else isa)


_from_env()
