# cython: boundscheck=False, wraparound=False
"""The Cython layer between Python and the CUDA library in cpp/.

Its whole job, for every C function of cydnn.h:
  1. turn DeviceArrays (and numpy arrays) into pointers and shapes,
  2. call the C function,
  3. turn a failed status into the matching Python exception.
It validates nothing about shapes: ``cydnn.ops.cuda`` has done that (with
``cydnn.ops._check``) before calling here.  It does check dtypes, so a wrong
pointer type can never reach a kernel.
"""
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t, uintptr_t
cimport numpy as cnp
import numpy as np

from cydnn.errors import (CublasError, CudaError, CudnnError, CydnnError, DeviceUnavailableError,
                          InvalidArgumentError, OutOfMemoryError)

cnp.import_array()

# ------------------------------------------------------------------ errors
_ERROR_CLASSES = {
    CYDNN_STATUS_CUDA_ERROR: CudaError,
    CYDNN_STATUS_CUDNN_ERROR: CudnnError,
    CYDNN_STATUS_CUBLAS_ERROR: CublasError,
    CYDNN_STATUS_OUT_OF_MEMORY: OutOfMemoryError,
    CYDNN_STATUS_DEVICE_UNAVAILABLE: DeviceUnavailableError,
    CYDNN_STATUS_INVALID_ARGUMENT: InvalidArgumentError,
}


cdef int check(cydnnStatus_t status, str op) except -1:
    """Raise the exception for a failed status, with the library's message."""
    if status == CYDNN_STATUS_SUCCESS:
        return 0
    message = cydnn_last_error_message().decode("utf-8", "replace")
    library_status = cydnn_last_library_status()
    cydnn_clear_error()
    raise _ERROR_CLASSES.get(status, CydnnError)(message, library_status, op)


# ------------------------------------------------------------ device queries
def device_count():
    """Number of usable CUDA devices (0 without a driver or a device)."""
    return cydnn_device_count()


def check_device(int device=0):
    """Raise DeviceUnavailableError saying why `device` cannot be used; else return None."""
    check(cydnn_check_device(device), "check_device")


def device_name(int device=0):
    cdef char buf[256]
    check(cydnn_device_name(device, buf, sizeof(buf)), "device_name")
    return buf.decode("utf-8", "replace")


def device_memory_info(int device=0):
    """(free, total) bytes on the device, as the driver sees them."""
    cdef size_t free_b = 0, total_b = 0
    check(cydnn_device_memory_info(device, &free_b, &total_b), "device_memory_info")
    return free_b, total_b


def versions():
    """Versions of the libraries in use (integers as the libraries report them)."""
    cdef cydnnVersions v
    cydnn_versions(&v)
    return {"cuda_runtime": v.cuda_runtime, "cuda_driver": v.cuda_driver, "cudnn": v.cudnn,
            "cublas": v.cublas, "compiled_cudnn": v.compiled_cudnn}


# ------------------------------------------------------------------ context
cdef cydnnContext *_context = NULL
# Settings applied to the context when it is created, and whenever changed.
_settings = {"allow_tf32": False, "deterministic": False, "poison": False, "workspace_limit": 64 << 20,
             "fp16": False}


cdef cydnnContext *ctx() except NULL:
    """The context of device 0, created on first use."""
    global _context
    if _context == NULL:
        check(cydnn_context_get(0, &_context), "context")
        _apply_settings()
    return _context


cdef _apply_settings():
    check(cydnn_context_set_math(_context, _settings["allow_tf32"], _settings["deterministic"]), "set_math")
    check(cydnn_set_poison(_context, _settings["poison"]), "set_poison")
    check(cydnn_context_set_workspace_limit(_context, _settings["workspace_limit"]), "set_workspace_limit")
    check(cydnn_context_set_fp16(_context, _settings["fp16"]), "set_fp16")


def configure(**changes):
    """Change context settings: allow_tf32, deterministic, poison, workspace_limit, fp16."""
    for key in changes:
        if key not in _settings:
            raise TypeError(f"configure: unknown setting {key!r}; known: {sorted(_settings)}")
    _settings.update(changes)
    if _context != NULL:
        _apply_settings()
    return dict(_settings)


def settings():
    return dict(_settings)


def synchronize():
    """Wait until every op queued on the stream has finished."""
    check(cydnn_context_synchronize(ctx()), "synchronize")


def plan_count():
    """Per-shape plans (descriptors, chosen algorithms) built so far."""
    return 0 if _context == NULL else cydnn_context_plan_count(_context)


def _debug_fail(int which):
    """Test hook: make the C library fail in library `which` (1 CUDA, 2 cuDNN, 3 cuBLAS, 4 pool)."""
    check(cydnn_debug_fail(ctx(), which), "debug_fail")


def stream_handle():
    """The context's cudaStream_t, as an integer (for interop)."""
    return <uintptr_t>cydnn_context_stream(ctx())


# ------------------------------------------------------------------- memory
def memory_stats():
    """Statistics of the caching pool, in bytes and counts."""
    if _context == NULL:  # nothing allocated yet: don't create a context to say so
        return {k: 0 for k in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes",
                               "peak_reserved_bytes", "requested_bytes", "num_allocs", "num_frees",
                               "num_device_mallocs", "num_device_frees", "num_cache_hits", "num_ooms")}
    cdef cydnnMemoryStats s
    check(cydnn_memory_stats(_context, &s), "memory_stats")
    return {"allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes,
            "peak_allocated_bytes": s.peak_allocated_bytes, "peak_reserved_bytes": s.peak_reserved_bytes,
            "requested_bytes": s.requested_bytes, "num_allocs": s.num_allocs, "num_frees": s.num_frees,
            "num_device_mallocs": s.num_device_mallocs, "num_device_frees": s.num_device_frees,
            "num_cache_hits": s.num_cache_hits, "num_ooms": s.num_ooms}


def empty_cache():
    """Give every cached (free) block back to the driver."""
    if _context != NULL:
        check(cydnn_empty_cache(_context), "empty_cache")


def reset_peak_memory_stats():
    if _context != NULL:
        check(cydnn_reset_peak_memory_stats(_context), "reset_peak_memory_stats")


# -------------------------------------------------------------- DeviceArray
SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8))
MAX_RANK = 4
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_U8 = np.dtype(np.uint8)


cdef class _Allocation:
    """One block from the pool; back to the pool when the last array using it goes."""

    def __dealloc__(self):
        if self.ptr != NULL:
            # Cannot raise here; a failure is left in the C error buffer.
            cydnn_free(self.ctx, self.ptr)
            self.ptr = NULL


cdef _Allocation _allocate(size_t nbytes):
    cdef _Allocation a = _Allocation.__new__(_Allocation)
    a.ctx = ctx()
    check(cydnn_malloc(a.ctx, nbytes, &a.ptr), "malloc")
    a.nbytes = nbytes
    return a


def _normalize_dtype(dtype, str op):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{op}: dtype {dtype!r} is not a dtype; accepted: float32, int32, uint8") from None
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype {dt} is not supported on the GPU; accepted: float32, int32, uint8")
    return dt


def _normalize_shape(shape, str op):
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"{op}: shape {shape!r} is not a tuple of ints") from None
    if len(shape) > MAX_RANK:
        raise ValueError(f"{op}: rank {len(shape)} (shape {shape}) is not supported; "
                         f"DeviceArray has rank 0 to {MAX_RANK}")
    if any(s < 0 for s in shape):
        raise ValueError(f"{op}: negative dimension in shape {shape}")
    return shape


cdef DeviceArray _wrap(_Allocation alloc, size_t offset, tuple shape, object dtype):
    cdef DeviceArray a = DeviceArray.__new__(DeviceArray)
    a._alloc = alloc
    a._offset = offset
    a.shape = shape
    a.dtype = dtype
    cdef size_t n = 1
    for s in shape:
        n *= <size_t>s
    a.size = n
    return a


def empty(shape, dtype=np.float32):
    """An uninitialised DeviceArray from the pool."""
    shape = _normalize_shape(shape, "empty")
    dt = _normalize_dtype(dtype, "empty")
    cdef size_t n = 1
    for s in shape:
        n *= <size_t>s
    return _wrap(_allocate(n * dt.itemsize), 0, shape, dt)


def zeros(shape, dtype=np.float32):
    cdef DeviceArray a = empty(shape, dtype)
    a.zero_()
    return a


def to_device(a):
    """Copy a numpy array (or array-like) to the GPU; a DeviceArray is returned as is.

    Non-contiguous input is made contiguous first.  Accepted dtypes: float32,
    int32, uint8; ranks 0 to 4.
    """
    if isinstance(a, DeviceArray):
        return a
    arr = np.asarray(a)
    if arr.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"to_device: dtype {arr.dtype} is not supported on the GPU; accepted: float32, int32, "
                        f"uint8 (convert first, e.g. x.astype(np.float32))")
    if arr.ndim > MAX_RANK:
        raise ValueError(f"to_device: rank {arr.ndim} (shape {arr.shape}) is not supported; "
                         f"DeviceArray has rank 0 to {MAX_RANK}")
    cdef cnp.ndarray c = np.ascontiguousarray(arr)
    cdef DeviceArray d = _wrap(_allocate(<size_t>arr.nbytes), 0, tuple(arr.shape), arr.dtype)
    check(cydnn_memcpy_h2d(d._alloc.ctx, d.data(), cnp.PyArray_DATA(c), <size_t>arr.nbytes), "to_device")
    return d


cdef class DeviceArray:
    """A dense, C-contiguous array in GPU memory from cydnn's pool.

    ``shape``, ``dtype`` (a numpy dtype), ``size``, ``ndim``, ``nbytes``.
    ``reshape`` and axis-0 indexing make views that share the memory; the
    memory returns to the pool when the last array using it is dropped.
    Create with ``cydnn.to_device(numpy_array)``, ``cydnn.empty`` or
    ``cydnn.zeros``; copy back with ``.numpy()``.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("DeviceArray cannot be made directly: use cydnn.to_device, cydnn.empty or cydnn.zeros")

    cdef void *data(self):
        return <char *>self._alloc.ptr + self._offset

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def device(self):
        return "cuda"

    @property
    def ptr(self):
        """The device address, as an integer."""
        return <uintptr_t>self.data()

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device='cuda:0')"

    def numpy(self):
        """Copy to a new numpy array (waits for the queued work that writes it)."""
        cdef cnp.ndarray out = np.empty(self.shape, dtype=self.dtype)
        check(cydnn_memcpy_d2h(self._alloc.ctx, cnp.PyArray_DATA(out), self.data(), self.nbytes), "numpy")
        return out

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def item(self):
        return self.numpy().item()

    def __float__(self):
        return float(self.item())

    def copy(self):
        """A new DeviceArray with the same contents (device to device)."""
        cdef DeviceArray out = empty(self.shape, self.dtype)
        check(cydnn_memcpy_d2d(out._alloc.ctx, out.data(), self.data(), self.nbytes), "copy")
        return out

    def zero_(self):
        """Set every element to zero, in place."""
        check(cydnn_memset(self._alloc.ctx, self.data(), 0, self.nbytes), "zero_")
        return self

    def set_(self, a):
        """Copy a numpy array of the same shape and dtype into this array, in place."""
        arr = np.ascontiguousarray(a)
        if arr.dtype != self.dtype or arr.shape != self.shape:
            raise ValueError(f"set_: got {arr.dtype} {arr.shape}, this array is {self.dtype} {self.shape}")
        cdef cnp.ndarray c = arr
        check(cydnn_memcpy_h2d(self._alloc.ctx, self.data(), cnp.PyArray_DATA(c), self.nbytes), "set_")
        return self

    def reshape(self, *shape):
        """A view with another shape of the same size (one dimension may be -1)."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if shape.count(-1) > 1:
            raise ValueError(f"reshape: only one dimension can be -1, got {shape}")
        if -1 in shape:
            known = 1
            for s in shape:
                if s != -1:
                    known *= s
            if known == 0 or self.size % known:
                raise ValueError(f"reshape: cannot reshape {self.shape} into {shape}")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        shape = _normalize_shape(shape, "reshape")
        total = 1
        for s in shape:
            total *= s
        if total != self.size:
            raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {shape}")
        return _wrap(self._alloc, self._offset, shape, self.dtype)

    def __getitem__(self, key):
        """Axis-0 indexing only: an int or a slice with step 1 (a view, no copy)."""
        if not self.shape:
            raise IndexError("a 0-d DeviceArray cannot be indexed")
        n = self.shape[0]
        row_bytes = (self.size // n if n else 0) * self.dtype.itemsize
        if isinstance(key, (int, np.integer)):
            i = int(key)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"index {key} out of range for axis 0 of size {n}")
            return _wrap(self._alloc, self._offset + i * row_bytes, self.shape[1:], self.dtype)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("DeviceArray slices must have step 1; use .numpy() for strided access")
            stop = max(stop, start)
            return _wrap(self._alloc, self._offset + start * row_bytes, (stop - start,) + self.shape[1:],
                         self.dtype)
        raise IndexError(f"DeviceArray supports only axis-0 indexing with an int or a slice, got {key!r}; "
                         f"use .numpy() for other indexing")


include "_ops.pxi"
include "_fast.pxi"
include "_compiled.pxi"
include "_fused_net.pxi"
include "_pipe.pxi"
