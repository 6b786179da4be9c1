"""The foundation: import, device queries, errors, DeviceArray and the memory pool."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cydnn
from cydnn import _C

from conftest import GPU_UNAVAILABLE

gpu = pytest.mark.gpu


# ------------------------------------------------------------- everywhere
def test_import_prints_nothing_and_reports_availability():
    """`python -c "import cydnn; print(cydnn.cuda.is_available())"` prints one word and nothing else."""
    out = subprocess.run([sys.executable, "-c", "import cydnn; print(cydnn.cuda.is_available())"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout == f"{GPU_UNAVAILABLE is None}\n"


def test_versions_without_and_with_gpu():
    v = cydnn.versions()
    assert v["cydnn"] == cydnn.__version__
    assert v["cuda_runtime"].startswith("13.")
    assert v["cudnn"].startswith("9.")
    assert v["cublas"].startswith("13.")
    if GPU_UNAVAILABLE is None:
        assert v["cuda_driver"] is not None


# The libraries the extension needs, and the wheel folder each comes from (see cydnn/_libs.py).
_WHEEL_LIBS = {"libcudart": "cu13/lib", "libcublasLt": "cu13/lib", "libcublas": "cu13/lib", "libcudnn": "cudnn/lib"}


def test_libraries_are_mapped_from_the_nvidia_wheels():
    """In a fresh process, every CUDA runtime / cuBLAS / cuDNN file the loader mapped (as
    /proc/self/maps lists them) lies in the folder of the NVIDIA wheel it belongs to, each soname
    is mapped from one file only (no second, system copy beside the wheel's), and
    `_libs.loaded` records those same paths."""
    import importlib.util
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps (Linux)")
    spec = importlib.util.find_spec("nvidia")
    assert spec is not None and spec.submodule_search_locations, \
        "the nvidia-* wheels (cydnn's dependencies) are not installed"
    code = ("import json, re, cydnn; from cydnn import _libs; "
            "maps = sorted({l.split()[-1] for l in open('/proc/self/maps') "
            "if re.search(r'/lib(cudart|cublas|cublasLt|cudnn)[^/]*\\.so', l)}); "
            "print(json.dumps([maps, _libs.loaded]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    maps, loaded = json.loads(out.stdout)
    roots = [os.path.realpath(r) for r in spec.submodule_search_locations]
    by_lib = {}
    for path in maps:
        base = os.path.basename(path)
        lib = max((k for k in _WHEEL_LIBS if base.startswith(k + ".") or base.startswith(k + "_")), key=len,
                  default=None)
        assert lib is not None, f"unexpected CUDA library mapped: {path}"
        folders = [os.path.join(r, _WHEEL_LIBS[lib]) for r in roots]
        assert os.path.dirname(os.path.realpath(path)) in folders, f"{path} is not from the wheel ({folders})"
        by_lib.setdefault(base, []).append(path)
    for lib in _WHEEL_LIBS:
        assert any(b.startswith(lib + ".so") for b in by_lib), f"{lib} is not mapped at all: {maps}"
    assert all(len(paths) == 1 for paths in by_lib.values()), by_lib
    from cydnn import _libs
    assert set(loaded) == {name for name, _, _ in _libs.LIBRARIES}
    for soname, path in loaded.items():
        assert os.path.isabs(path) and os.path.basename(path) == soname and path in maps, (soname, path, maps)


def test_a_missing_library_is_named_with_how_to_get_it(monkeypatch):
    """No wheel and no system copy: ImportError names the library, what was tried and the pip package."""
    from cydnn import _libs
    monkeypatch.setattr(_libs, "loaded", {})
    monkeypatch.setattr(_libs, "LIBRARIES", [("libcydnn_no_such_lib.so.1", "cu13/lib", "nvidia-no-such")])
    with pytest.raises(ImportError) as e:
        _libs.preload()
    msg = str(e.value)
    assert "libcydnn_no_such_lib.so.1" in msg and "system search" in msg and "pip install nvidia-no-such" in msg


def test_device_count_matches_availability():
    n = cydnn.cuda.device_count()
    assert isinstance(n, int) and n >= 0
    if GPU_UNAVAILABLE is None:
        assert n >= 1
        cydnn.cuda.check_device(n - 1)
        with pytest.raises(cydnn.DeviceUnavailableError, match=f"device {n} requested but {n} device"):
            cydnn.cuda.check_device(n)
    elif "update the driver" not in GPU_UNAVAILABLE:   # a driver too old may still count its devices
        assert n == 0, GPU_UNAVAILABLE
        assert "no NVIDIA driver" in GPU_UNAVAILABLE or "no CUDA device" in GPU_UNAVAILABLE \
            or "initialisation failed" in GPU_UNAVAILABLE


@pytest.mark.skipif(GPU_UNAVAILABLE is None, reason="this machine has a GPU")
def test_no_gpu_raises_device_unavailable_with_reason():
    assert cydnn.cuda.is_available() is False
    assert cydnn.cuda.device_count() == 0
    with pytest.raises(cydnn.DeviceUnavailableError) as e:
        cydnn.to_device(np.zeros(3, np.float32))
    assert e.value.status != 0
    assert "driver" in str(e.value) or "no CUDA device" in str(e.value)
    with pytest.raises(cydnn.DeviceUnavailableError):
        cydnn.ops.cuda.relu_forward(np.zeros((2, 2), np.float32))
    # The pool was never created: its statistics are zeros and nothing fails.
    assert cydnn.cuda.memory_stats()["reserved_bytes"] == 0
    cydnn.cuda.empty_cache()


def test_exception_hierarchy():
    assert issubclass(cydnn.CydnnError, RuntimeError)
    for cls in (cydnn.CudaError, cydnn.CudnnError, cydnn.CublasError, cydnn.OutOfMemoryError,
                cydnn.DeviceUnavailableError, cydnn.InvalidArgumentError):
        assert issubclass(cls, cydnn.CydnnError)
    assert issubclass(cydnn.OutOfMemoryError, MemoryError)
    assert issubclass(cydnn.InvalidArgumentError, ValueError)
    e = cydnn.CudnnError("conv_forward: cudnnConvolutionForward failed: CUDNN_STATUS_BAD_PARAM", 2000,
                         "conv_forward")
    assert (e.status, e.op) == (2000, "conv_forward")


def test_dtype_and_rank_refused_before_any_gpu_work():
    # These fail the same way with or without a GPU: the check comes first.
    with pytest.raises(TypeError, match="float64.*accepted: float32, int32, uint8"):
        cydnn.to_device(np.zeros(3, np.float64))
    with pytest.raises(ValueError, match=r"rank 5 .*rank 0 to 4"):
        cydnn.to_device(np.zeros((1, 1, 1, 1, 1), np.float32))
    with pytest.raises(TypeError, match="complex64"):
        cydnn.empty((2,), np.complex64)
    with pytest.raises(TypeError, match="cannot be made directly"):
        cydnn.DeviceArray()


# ------------------------------------------------------------------ GPU
@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (2, 1, 28, 28), (0, 3)])
def test_round_trip(dtype, shape, rng):
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    d = cydnn.to_device(a)
    assert d.shape == a.shape and d.dtype == a.dtype and d.size == a.size and d.nbytes == a.nbytes
    np.testing.assert_array_equal(d.numpy(), a)
    np.testing.assert_array_equal(np.asarray(d), a)


@gpu
def test_large_round_trip_bypasses_staging(rng):
    a = rng.standard_normal((3, 1000, 1000)).astype(np.float32)  # 12 MB > the 8 MiB staging buffer
    np.testing.assert_array_equal(cydnn.to_device(a).numpy(), a)


@gpu
def test_non_contiguous_input_is_copied(rng):
    a = rng.standard_normal((6, 8)).astype(np.float32)
    for view in (a.T, a[:, ::2], a[::-1]):
        np.testing.assert_array_equal(cydnn.to_device(view).numpy(), view)


@gpu
def test_views_share_memory(rng):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    d = cydnn.to_device(a)
    np.testing.assert_array_equal(d.reshape(2, 12).numpy(), a.reshape(2, 12))
    np.testing.assert_array_equal(d.reshape(-1).numpy(), a.reshape(-1))
    np.testing.assert_array_equal(d[1:3].numpy(), a[1:3])
    np.testing.assert_array_equal(d[2].numpy(), a[2])
    np.testing.assert_array_equal(d[-1].numpy(), a[-1])
    assert d[1:3].ptr == d.ptr + 6 * 4
    d[1:3].zero_()
    a[1:3] = 0
    np.testing.assert_array_equal(d.numpy(), a)
    with pytest.raises(IndexError, match="step 1"):
        d[::2]
    with pytest.raises(ValueError, match="cannot reshape"):
        d.reshape(5, 5)


@gpu
def test_copy_set_zeros(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    d = cydnn.to_device(a)
    c = d.copy()
    assert c.ptr != d.ptr
    d.zero_()
    np.testing.assert_array_equal(c.numpy(), a)
    np.testing.assert_array_equal(d.numpy(), np.zeros_like(a))
    d.set_(a * 2)
    np.testing.assert_array_equal(d.numpy(), a * 2)
    with pytest.raises(ValueError, match="set_"):
        d.set_(np.zeros((4, 3), np.float32))
    np.testing.assert_array_equal(cydnn.zeros((2, 2), np.int32).numpy(), np.zeros((2, 2), np.int32))


@gpu
def test_pool_reuses_freed_blocks():
    cydnn.cuda.synchronize()
    cydnn.cuda.empty_cache()          # no cached block that best fit could hand out instead
    before = cydnn.cuda.memory_stats()
    a = cydnn.empty((1000,))          # 4000 B -> a 4096 B class
    ptr = a.ptr
    mid = cydnn.cuda.memory_stats()
    assert mid["allocated_bytes"] == before["allocated_bytes"] + 4096
    assert mid["num_device_mallocs"] == before["num_device_mallocs"] + 1
    assert mid["requested_bytes"] == before["requested_bytes"] + 4000
    del a
    after_free = cydnn.cuda.memory_stats()
    assert after_free["allocated_bytes"] == before["allocated_bytes"]
    assert after_free["reserved_bytes"] == mid["reserved_bytes"]  # kept in the cache
    b = cydnn.empty((1010,))          # same class: served from the cache, same block
    assert b.ptr == ptr
    s = cydnn.cuda.memory_stats()
    assert s["num_cache_hits"] >= after_free["num_cache_hits"] + 1
    assert s["num_device_mallocs"] == mid["num_device_mallocs"]
    assert s["peak_allocated_bytes"] >= s["allocated_bytes"]


@gpu
def test_empty_cache_returns_memory():
    a = cydnn.empty((4 << 20,))  # 16 MiB
    reserved = cydnn.cuda.memory_stats()["reserved_bytes"]
    del a
    cydnn.cuda.empty_cache()
    s = cydnn.cuda.memory_stats()
    assert s["reserved_bytes"] <= reserved - (16 << 20)
    assert s["reserved_bytes"] == s["allocated_bytes"] or s["reserved_bytes"] >= s["allocated_bytes"]


@gpu
def test_out_of_memory_then_recovers():
    free, total = cydnn.cuda.mem_get_info()
    ooms = cydnn.cuda.memory_stats()["num_ooms"]
    with pytest.raises(cydnn.OutOfMemoryError) as e:
        cydnn.empty((total // 4 * 4,))       # four times the card: cannot fit
    msg = str(e.value)
    assert "out of memory" in msg and "MiB free" in msg and "tried to allocate" in msg
    assert isinstance(e.value, MemoryError)
    assert e.value.status == 2  # cudaErrorMemoryAllocation
    assert cydnn.cuda.memory_stats()["num_ooms"] == ooms + 1
    small = cydnn.to_device(np.arange(10, dtype=np.float32))  # the next small allocation works
    np.testing.assert_array_equal(small.numpy(), np.arange(10, dtype=np.float32))
    # A size no device could have is refused the same way, without asking the driver.
    with pytest.raises(cydnn.OutOfMemoryError):
        cydnn.empty((1 << 62,), np.uint8)


@gpu
def test_device_queries_on_gpu():
    assert cydnn.cuda.is_available()
    assert cydnn.cuda.device_count() >= 1
    assert isinstance(cydnn.cuda.get_device_name(), str) and cydnn.cuda.get_device_name()
    free, total = cydnn.cuda.mem_get_info()
    assert 0 < free <= total
    with pytest.raises(cydnn.DeviceUnavailableError, match="device 99"):
        cydnn.cuda.check_device(99)


@gpu
@pytest.mark.parametrize("which, cls, status, words", [
    (1, cydnn.CudaError, 101, ["cudaSetDevice", "cudaErrorInvalidDevice"]),
    (2, cydnn.CudnnError, 2000, ["cudnnSetTensor4dDescriptor", "CUDNN_STATUS_BAD_PARAM"]),
    (3, cydnn.CublasError, 7, ["cublasSgemm", "CUBLAS_STATUS_INVALID_VALUE"]),
    (4, cydnn.InvalidArgumentError, 0, ["free:", "not allocated by this pool"]),
])
def test_library_failures_become_exceptions(which, cls, status, words):
    """A real refusal by each library reaches Python with its status, its message and the op."""
    with pytest.raises(cls) as e:
        _C._debug_fail(which)
    assert e.value.status == status
    assert e.value.op == "debug_fail"
    for w in words:
        assert w in str(e.value)
    # The failure is not sticky: the next op works.
    np.testing.assert_array_equal(cydnn.to_device(np.ones(3, np.float32)).numpy(), np.ones(3, np.float32))
