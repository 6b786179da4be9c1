"""What every GPU op module shares: the accepted dtypes and the numpy-in, numpy-out helpers
(an op given numpy arrays copies them to the GPU and returns numpy; given DeviceArrays it
returns DeviceArrays and waits for nothing)."""
import numpy as np

from cydnn import _C

F32 = (np.float32,)


def _on_host(a):
    return not isinstance(a, _C.DeviceArray)


def _dev(a):
    return a if isinstance(a, _C.DeviceArray) else _C.to_device(a)


def _opt(a):
    return None if a is None else _dev(a)


def _ret(host, *arrays):
    """Return arrays as numpy when the caller gave numpy (None stays None)."""
    out = tuple(a.numpy() if host and a is not None else a for a in arrays)
    return out if len(out) > 1 else out[0]
