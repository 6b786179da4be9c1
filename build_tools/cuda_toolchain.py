"""Find what building cydnn needs: nvcc, the CUDA runtime, cuDNN 9 and cuBLAS 13.

Used by the build backend (to decide what pip must fetch) and by setup.py (to
compile and link).  Search order, as documented in README.md:

- nvcc: $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin,
  then the `nvidia-cuda-nvcc` wheel (nvidia/cu13/bin/nvcc).
- cuDNN and cuBLAS: the system (the CUDA toolkit's folders, /usr/include,
  /usr/lib/x86_64-linux-gnu, $CUDNN_HOME) where both header and library are
  present, else the NVIDIA wheels (nvidia/cudnn, nvidia/cu13).

The `nvidia` package is a namespace package that can span several
site-packages folders (pip's isolated build environment splits it), so every
folder of it is searched.
"""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional

CUDNN_SONAME = "libcudnn.so.9"
CUBLAS_SONAMES = ("libcublas.so.13", "libcublasLt.so.13")
CUDART_SONAME = "libcudart.so.13"


@dataclass
class Library:
    name: str
    include_dir: str
    lib_dir: str
    source: str  # "system" or "wheel"


@dataclass
class Toolchain:
    nvcc: Optional[str] = None
    cuda_root: Optional[str] = None
    cudart_lib_dir: Optional[str] = None
    cudnn: Optional[Library] = None
    cublas: Optional[Library] = None
    notes: List[str] = field(default_factory=list)

    def missing(self):
        """What is missing, each with how to get it."""
        out = []
        if self.nvcc is None:
            out.append("nvcc (the CUDA compiler): install a CUDA 13 toolkit, set $NVCC or $CUDA_HOME, "
                       "or `pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 "
                       "nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96`")
        if self.cudart_lib_dir is None:
            out.append(f"the CUDA runtime ({CUDART_SONAME}): `pip install nvidia-cuda-runtime`")
        if self.cudnn is None:
            out.append(f"cuDNN 9 (cudnn.h and {CUDNN_SONAME}): `pip install nvidia-cudnn-cu13`")
        if self.cublas is None:
            out.append(f"cuBLAS 13 (cublas_v2.h and {CUBLAS_SONAMES[0]}): `pip install nvidia-cublas`")
        return out


def nvidia_dirs():
    """Every folder of the `nvidia` namespace package on sys.path."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [d for d in spec.submodule_search_locations if os.path.isdir(d)]


def _is_file(*parts):
    path = os.path.join(*parts)
    return path if os.path.isfile(path) else None


def find_nvcc():
    candidates = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for d in nvidia_dirs():
        candidates.append(os.path.join(d, "cu13", "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c)
    return None


def cuda_root_of(nvcc):
    """The toolkit folder of an nvcc (which may be a wrapper script elsewhere)."""
    root = os.path.dirname(os.path.dirname(nvcc))
    if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        return root
    try:  # ask nvcc itself: its dry run prints "#$ TOP=<root>/bin/.."
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.M)
        if m:
            return os.path.realpath(m.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return root


def _cudnn_major(include_dir):
    for name in ("cudnn_version.h", "cudnn_version_v9.h", "cudnn.h"):
        path = os.path.join(include_dir, name)
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                m = re.search(r"#define\s+CUDNN_MAJOR\s+(\d+)", f.read())
            if m:
                return int(m.group(1))
    return None


def _system_dirs(cuda_root, sub):
    dirs = []
    for var in ("CUDNN_HOME", "CUDNN_PATH"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], sub if sub == "include" else "lib64"))
            dirs.append(os.path.join(os.environ[var], sub if sub == "include" else "lib"))
    if cuda_root:
        if sub == "include":
            dirs += [os.path.join(cuda_root, "include"), os.path.join(cuda_root, "targets", "x86_64-linux", "include")]
        else:
            dirs += [os.path.join(cuda_root, "lib64"), os.path.join(cuda_root, "lib"),
                     os.path.join(cuda_root, "targets", "x86_64-linux", "lib")]
    if sub == "include":
        dirs += ["/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/local/cuda/include"]
    else:
        dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64"]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def find_cudnn(cuda_root):
    incs = [d for d in _system_dirs(cuda_root, "include") if _is_file(d, "cudnn.h") and _cudnn_major(d) == 9]
    libs = [d for d in _system_dirs(cuda_root, "lib") if _is_file(d, CUDNN_SONAME)]
    if incs and libs:
        return Library("cudnn", incs[0], libs[0], "system")
    for d in nvidia_dirs():
        inc, lib = os.path.join(d, "cudnn", "include"), os.path.join(d, "cudnn", "lib")
        if _is_file(inc, "cudnn.h") and _is_file(lib, CUDNN_SONAME):
            return Library("cudnn", inc, lib, "wheel")
    return None


def find_cublas(cuda_root):
    incs = [d for d in _system_dirs(cuda_root, "include") if _is_file(d, "cublas_v2.h")]
    libs = [d for d in _system_dirs(cuda_root, "lib") if all(_is_file(d, s) for s in CUBLAS_SONAMES)]
    if incs and libs:
        return Library("cublas", incs[0], libs[0], "system")
    for d in nvidia_dirs():
        inc, lib = os.path.join(d, "cu13", "include"), os.path.join(d, "cu13", "lib")
        if _is_file(inc, "cublas_v2.h") and all(_is_file(lib, s) for s in CUBLAS_SONAMES):
            return Library("cublas", inc, lib, "wheel")
    return None


def find_cudart(cuda_root):
    # Prefer the wheel: it is the copy loaded at run time.
    for d in nvidia_dirs():
        if _is_file(d, "cu13", "lib", CUDART_SONAME):
            return os.path.join(d, "cu13", "lib")
    for d in _system_dirs(cuda_root, "lib"):
        if _is_file(d, CUDART_SONAME):
            return d
    return None


def probe():
    tc = Toolchain()
    tc.nvcc = find_nvcc()
    if tc.nvcc:
        tc.cuda_root = cuda_root_of(tc.nvcc)
    tc.cudart_lib_dir = find_cudart(tc.cuda_root)
    tc.cudnn = find_cudnn(tc.cuda_root)
    tc.cublas = find_cublas(tc.cuda_root)
    return tc


def stage_headers(tc, dest):
    """Link just the cuDNN and cuBLAS headers into `dest`.

    The wheels keep cuBLAS's headers beside a CUDA runtime's headers of another
    release (nvidia/cu13/include); putting that whole folder on the include
    path would shadow nvcc's own cuda_runtime.h.  Only cudnn*.h and cublas*.h
    are wanted from there.
    """
    os.makedirs(dest, exist_ok=True)
    for lib, pattern in ((tc.cudnn, "cudnn*.h"), (tc.cublas, "cublas*.h")):
        for src in glob.glob(os.path.join(lib.include_dir, pattern)):
            target = os.path.join(dest, os.path.basename(src))
            if os.path.lexists(target):
                os.remove(target)
            os.symlink(src, target)
    return dest
