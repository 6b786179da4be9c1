"""Shared test setup.

Tests marked ``gpu`` need a usable CUDA device; where there is none they are
skipped with the reason cydnn gives (no driver, no device, driver too old).
"""
import os

import numpy as np
import pytest

# The suite compiles the same generated kernels many times on purpose (child processes, kills, limits):
# the disk cache of compiled kernels (compiler/kernel_cache.py) is off unless a test turns it on, and the
# suite never writes to the user's cache.
os.environ.setdefault("CYDNN_KERNEL_CACHE", "off")

import cydnn  # noqa: E402


def _gpu_unavailable_reason():
    try:
        cydnn.cuda.check_device(0)
    except cydnn.CydnnError as e:
        return str(e)
    return None


GPU_UNAVAILABLE = _gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_UNAVAILABLE is None:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {GPU_UNAVAILABLE}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    v = cydnn.versions()
    gpu = cydnn.cuda.get_device_name() if GPU_UNAVAILABLE is None else f"none ({GPU_UNAVAILABLE})"
    return [f"cydnn {v['cydnn']}: GPU {gpu}; CUDA runtime {v['cuda_runtime']}, driver {v['cuda_driver']}, "
            f"cuDNN {v['cudnn']}, cuBLAS {v['cublas']}"]


# Worst relative error seen per GPU op (filled by test_ops_cuda, printed at the end).
WORST_ERRORS = {}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if WORST_ERRORS:
        terminalreporter.write_sep("-", "worst relative error of each GPU op vs its numpy twin")
        for op, err in sorted(WORST_ERRORS.items()):
            terminalreporter.write_line(f"{op:28s} {err:.3e}")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
