"""Read cydnn's own source at run time, level by level (for the teaching notebook).

One op call travels numpy -> ``cydnn.ops.cuda`` (Python) -> ``cydnn._C`` (Cython,
``_C.pyx`` / ``_ops.pxi`` / ``_fast.pxi``, shipped beside the extension) -> ``cpp/*.cu`` (C, found
beside the package in a source checkout or an editable install) -> cuDNN / cuBLAS.
Each function returns the source text, or a sentence saying where it looked.
"""
import inspect
import re
from pathlib import Path

__all__ = ["python_source", "pyx_source", "c_source", "library_calls", "cpp_dir"]

_PKG = Path(__file__).resolve().parent


def python_source(obj):
    """The source of a Python function or class."""
    return inspect.getsource(obj)


def _block(text, start):
    """The indented block (a Python/Cython def) that begins at index ``start``."""
    lines = text[start:].splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def pyx_source(name):
    """The Cython definition ``def name(`` in the shipped _C.pyx / _ops.pxi / _fast.pxi."""
    files = [p for p in (_PKG / "_C.pyx", _PKG / "_ops.pxi", _PKG / "_fast.pxi", _PKG / "_compiled.pxi") if p.exists()]
    for path in files:
        text = path.read_text()
        m = re.search(rf"^(?:cp)?def {re.escape(name)}\(", text, re.M)
        if m:
            return f"# {path.name}\n" + _block(text, m.start())
    return f"(no 'def {name}(' in {', '.join(str(p) for p in files) or 'the package: _C.pyx not shipped'})"


def cpp_dir():
    """The cpp/ folder of a source checkout or editable install, or None."""
    for base in (_PKG.parents[1], _PKG.parents[0]):
        if (base / "cpp" / "cydnn.h").exists():
            return base / "cpp"
    return None


def c_source(name):
    """The C/C++ function ``name`` (e.g. ``cydnn_conv_forward`` or ``conv_forward``) in cpp/*.cu, then
    cpp/*.cuh (the headers the fused kernels share)."""
    folder = cpp_dir()
    if folder is None:
        return f"(cpp/ not found beside {_PKG}: installed from a wheel? the C source ships in the repository)"
    pattern = re.compile(rf"^[A-Za-z_][\w\s\*:<>]*\b{re.escape(name)}\(", re.M)
    for path in sorted(folder.glob("*.cu")) + sorted(folder.glob("*.cuh")):
        text = path.read_text()
        for m in pattern.finditer(text):
            brace = text.find("{", m.end())
            semi = text.find(";", m.end())
            if brace < 0 or (0 <= semi < brace):
                continue                      # a declaration, not the definition
            depth, i = 0, brace
            while i < len(text):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    break
                i += 1
            return f"// {path.name}\n" + text[m.start():i + 1]
    return f"(no definition of {name} in {folder}/*.cu or *.cuh)"


def library_calls(c_text):
    """The lines of a C function that call into cuDNN, cuBLAS or the CUDA runtime."""
    return "\n".join(line for line in c_text.splitlines() if re.search(r"\b(cudnn|cublas|cuda)[A-Z]\w*\(", line))
