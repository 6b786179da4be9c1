"""cydnn's exceptions.

Every failure of CUDA, cuDNN or cuBLAS reaches Python as one of these, raised
by the Cython layer from the status the C library returned.  Each carries the
failing library's own status code (``.status``), the op that failed (``.op``)
and the library's message.
"""

__all__ = [
    "CydnnError", "CudaError", "CudnnError", "CublasError",
    "OutOfMemoryError", "DeviceUnavailableError", "InvalidArgumentError",
]


class CydnnError(RuntimeError):
    """Base class: a failure inside the CUDA library.

    ``status`` is the failing library's status code (a ``cudaError_t``,
    ``cudnnStatus_t`` or ``cublasStatus_t``), ``op`` the cydnn op's name.
    """

    def __init__(self, message, status=0, op=None):
        super().__init__(message)
        self.status = status
        self.op = op


class CudaError(CydnnError):
    """A CUDA runtime call or a kernel launch failed (``status`` is a cudaError_t)."""


class CudnnError(CydnnError):
    """A cuDNN call failed (``status`` is a cudnnStatus_t)."""


class CublasError(CydnnError):
    """A cuBLAS call failed (``status`` is a cublasStatus_t)."""


class OutOfMemoryError(CydnnError, MemoryError):
    """The device has no room, even after the pool freed its cache and retried."""


class DeviceUnavailableError(CydnnError):
    """GPU work was asked for where there is none: no driver, no device, or a driver too old."""


class InvalidArgumentError(CydnnError, ValueError):
    """The C layer refused an argument (the Python layer normally catches these first)."""
