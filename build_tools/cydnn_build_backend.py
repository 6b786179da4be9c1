"""PEP 517 backend: setuptools, plus the CUDA build requirements this machine lacks.

A machine with a CUDA toolkit and a system cuDNN/cuBLAS builds with those.
Otherwise pip is asked for the NVIDIA wheels that hold the headers and
libraries, and, when no nvcc can be found at all, for a pinned CUDA 13.0
compiler from PyPI (its pieces must be of one release: a 13.0 nvcc with a
newer nvvm fails in ptxas).  A package must not be named both here and in
pyproject.toml's static list: pip refuses two pins of one name.
"""
import os
import sys

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the PEP 517 hooks)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_toolchain  # noqa: E402

NVCC_FROM_PYPI = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-runtime==13.0.96",
]


def _cuda_requires():
    found = cuda_toolchain.probe()
    req = []
    if found.nvcc is None:
        req += NVCC_FROM_PYPI  # includes the runtime (headers + libcudart)
    elif found.cudart_lib_dir is None:
        req.append("nvidia-cuda-runtime>=13.0,<14")
    if found.cudnn is None:
        req.append("nvidia-cudnn-cu13>=9.1,<10")
    if found.cublas is None:
        req.append("nvidia-cublas>=13.0,<14")
    return req


def get_requires_for_build_wheel(config_settings=None):
    return _orig.get_requires_for_build_wheel(config_settings) + _cuda_requires()


def get_requires_for_build_editable(config_settings=None):
    return _orig.get_requires_for_build_editable(config_settings) + _cuda_requires()
