"""Device queries, the memory pool and the math settings of cydnn's CUDA backend.

Everything here works on a machine without a GPU: the queries say so
(``is_available()`` is False) and nothing is printed.
"""
from cydnn import _C
from cydnn.errors import CydnnError, DeviceUnavailableError

__all__ = [
    "is_available", "device_count", "get_device_name", "check_device", "versions",
    "memory_stats", "empty_cache", "reset_peak_memory_stats", "mem_get_info", "synchronize",
    "set_allow_tf32", "set_deterministic", "set_debug_poison", "set_workspace_limit", "settings",
]


def is_available():
    """True when a CUDA device and a driver new enough for cydnn's runtime are present."""
    try:
        _C.check_device(0)
    except CydnnError:
        return False
    return True


def device_count():
    """Number of CUDA devices (0 without a driver or a device)."""
    return _C.device_count()


def check_device(device=0):
    """Raise DeviceUnavailableError saying why `device` cannot be used (no driver, no device, old driver)."""
    _C.check_device(device)


def get_device_name(device=0):
    return _C.device_name(device)


def mem_get_info(device=0):
    """(free, total) bytes of device memory, as the driver sees them."""
    return _C.device_memory_info(device)


def _version_string(v, scheme):
    if not v:
        return None
    if scheme == "cuda":  # 13000 -> 13.0
        return f"{v // 1000}.{(v % 1000) // 10}"
    if scheme == "cudnn":  # 91900 -> 9.19.0 (cuDNN 9: major*10000 + minor*100 + patch)
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"  # cublas, same layout


def versions():
    """Versions of the CUDA runtime, the driver (None without one), cuDNN and cuBLAS in use."""
    v = _C.versions()
    return {
        "cuda_runtime": _version_string(v["cuda_runtime"], "cuda"),
        "cuda_driver": _version_string(v["cuda_driver"], "cuda"),
        "cudnn": _version_string(v["cudnn"], "cudnn"),
        "cudnn_compiled": _version_string(v["compiled_cudnn"], "cudnn"),
        "cublas": _version_string(v["cublas"], "cublas"),
    }


def memory_stats():
    """The pool's statistics: allocated_bytes, reserved_bytes, peak_allocated_bytes, ... (see cydnn.h)."""
    return _C.memory_stats()


def empty_cache():
    """Return the pool's cached blocks to the driver (arrays in use keep theirs)."""
    _C.empty_cache()


def reset_peak_memory_stats():
    _C.reset_peak_memory_stats()


def synchronize():
    """Wait for every op queued on cydnn's stream."""
    _C.synchronize()


def set_allow_tf32(allow):
    """Let cuDNN and cuBLAS use TF32 tensor cores for float32 (faster, ~1e-3 relative error). Off by default."""
    _C.configure(allow_tf32=bool(allow))


def set_deterministic(deterministic):
    """Pick only deterministic convolution algorithms. Off by default."""
    _C.configure(deterministic=bool(deterministic))


def set_fp16(on):
    """Inference in half precision: conv and linear forwards on float16 tensor cores (float32 in,
    float32 out, float32 accumulation).  Off by default; backward ops are unaffected."""
    _C.configure(fp16=bool(on))


def set_debug_poison(on):
    """Fill every new pool block with 0xFF bytes (NaN as float32): an unwritten output shows."""
    _C.configure(poison=bool(on))


def set_workspace_limit(nbytes):
    """Upper bound of the convolution workspace (default 64 MiB)."""
    _C.configure(workspace_limit=int(nbytes))


def settings():
    return _C.settings()


# cuDNN's algorithm enums, by value (cudnn_cnn.h), for conv_algorithms().
_ALGO_NAMES = {
    "forward": ["IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING", "WINOGRAD",
                "WINOGRAD_NONFUSED"],
    "backward_data": ["ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"],
    "backward_filter": ["ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING"],
}


def _algo_name(direction, value):
    names = _ALGO_NAMES[direction]
    return names[value] if 0 <= value < len(names) else str(value)


def conv_algorithms():
    """Which cuDNN algorithm each convolution plan chose, and what cuDNN measured.

    A list of dicts, one per (plan, direction) measured so far::

        {"key": "conv:n=64,c=1,h=28,...", "direction": "forward",
         "algo": "IMPLICIT_PRECOMP_GEMM", "time_ms": 0.0123,
         "candidates": [("IMPLICIT_GEMM", 0.0150, 0), ...],   # (algorithm, ms, cuDNN status)
         "retimed_ms": {"IMPLICIT_PRECOMP_GEMM": 0.0101, "IMPLICIT_GEMM": 0.0134}}

    ``time_ms`` is cuDNN's measurement of the chosen algorithm (one cold run).
    ``retimed_ms``: the library's own timing of the fastest few usable
    candidates as a step runs them (calls captured in a CUDA graph, replayed
    warm), which decides among them (``$CYDNN_CONV_RETIME=0``: Find's pick).  Candidates with
    a non-zero status did not run for this shape; with TF32 off, tensor-op and
    Winograd results are measured but never chosen (see cpp/conv_plan.cu).
    """
    out = []
    for line in _C.conv_algorithms_text().splitlines():
        key, direction, chosen, cands = line.split("\t")
        candidates, retimed = [], {}
        for c in filter(None, cands.split(",")):
            algo, ms, status, _, again = c.split(":")
            name = _algo_name(direction, int(algo))
            candidates.append((name, float(ms), int(status)))
            if float(again) >= 0:
                retimed[name] = float(again)
        chosen_name = _algo_name(direction, int(chosen))
        time_ms = next((ms for a, ms, st in candidates if a == chosen_name and st == 0), float("nan"))
        out.append({"key": key, "direction": direction, "algo": chosen_name, "time_ms": time_ms,
                    "candidates": candidates, "retimed_ms": retimed})
    return out
