"""Load the CUDA runtime, cuBLAS and cuDNN before the extension is imported.

The extension links against libcudart.so.13, libcublas.so.13,
libcublasLt.so.13 and libcudnn.so.9.  An rpath finds them beside a regular
install, but not in editable or in-place builds, and nobody should have to set
LD_LIBRARY_PATH.  So they are loaded here by absolute path, from the NVIDIA
wheels (the package's dependencies), with RTLD_GLOBAL, in dependency order;
the dynamic loader then resolves the extension's needs to these copies.  If a
wheel is missing, the system's copy (found by the loader's usual search) is
used; if neither is there, ImportError names the library and how to get it.
"""
import ctypes
import importlib.util
import os

# (soname, folder inside the `nvidia` namespace package, pip package)
LIBRARIES = [
    ("libcudart.so.13", "cu13/lib", "nvidia-cuda-runtime"),
    ("libcublasLt.so.13", "cu13/lib", "nvidia-cublas"),
    ("libcublas.so.13", "cu13/lib", "nvidia-cublas"),
    ("libcudnn.so.9", "cudnn/lib", "nvidia-cudnn-cu13"),
]

loaded = {}  # soname -> path (or soname, when the system's copy was used)


def _nvidia_dirs():
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return list(spec.submodule_search_locations)


def preload():
    if len(loaded) == len(LIBRARIES):
        return
    mode = ctypes.RTLD_GLOBAL
    roots = _nvidia_dirs()
    for soname, sub, package in LIBRARIES:
        if soname in loaded:
            continue
        tried = []
        for root in roots:
            path = os.path.join(root, sub, soname)
            if os.path.isfile(path):
                try:
                    ctypes.CDLL(path, mode=mode)
                    loaded[soname] = path
                    break
                except OSError as e:
                    tried.append(f"{path}: {e}")
        else:
            try:
                ctypes.CDLL(soname, mode=mode)
                loaded[soname] = soname
            except OSError as e:
                tried.append(f"{soname} (system search): {e}")
                raise ImportError(
                    f"cydnn needs {soname} but could not load it; tried: " + "; ".join(tried)
                    + f". Install it with `pip install {package}` (a dependency of cydnn)."
                ) from None
