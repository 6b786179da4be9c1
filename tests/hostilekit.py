"""Loading hostile files in a child process with a memory and time bound (issue 15).

:func:`run_cases` writes nothing itself: the test builds the files, then one
child Python imports cydnn, caps its address space at what it uses after the
imports plus ``extra_mib`` (``resource.setrlimit(RLIMIT_AS, ...)``: a reader
that tries to allocate more gets ``MemoryError``, which counts as a failure),
and loads each file in turn, timing each load.  Each result says which
exception came out (qualified name), its message, its ``filename`` for an
OSError, and the seconds the load took.
"""
import json
import subprocess
import sys

from faultkit import child_env

#: Every hostile case must end within this many seconds and this much extra memory.
SECONDS = 5.0
EXTRA_MIB = 512

PRELUDE = r'''
import resource, sys, time, json
import numpy as np
import cydnn
from cydnn import interop, serialization, onnx_import, models
try:
    import onnx  # noqa: F401  (imported before the cap, as a user's program would have)
except ImportError:
    pass


def vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def cap(extra_mib):
    limit = vm_bytes() + extra_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
'''

RUNNER = PRELUDE + r'''
LOADERS = {
    "weights": lambda p: interop.load_pytorch_weights(models.LeNet5(), p),
    "checkpoint": serialization.load,
    "metadata": serialization.load_metadata,
    "onnx": lambda p: onnx_import.load_onnx(p),
    "onnx_sequential": lambda p: onnx_import.load_onnx(p, lenet=False),
    "allocate": lambda n: np.ones(int(n), np.uint8),     # the control: proves the cap bites
}
cases = json.loads(sys.argv[1])
models.LeNet5()                     # warm up what a first model costs, before the cap
cap(int(sys.argv[2]))
results = []
for case in cases:
    start = time.perf_counter()
    try:
        LOADERS[case["loader"]](case["path"])
        error = None
    except BaseException as e:      # MemoryError and RecursionError included: reported, not hidden
        error = e
    seconds = time.perf_counter() - start
    results.append({
        "id": case["id"], "seconds": seconds,
        "type": None if error is None else f"{type(error).__module__}.{type(error).__qualname__}",
        "oserror": isinstance(error, OSError), "memoryerror": isinstance(error, MemoryError), "filename": getattr(error, "filename", None),
        "message": None if error is None else str(error)[:2000]})
    del error
print("RESULTS " + json.dumps(results))
'''


def run_cases(cases, extra_mib=EXTRA_MIB, timeout=300):
    """``cases``: list of dicts ``{"id", "loader", "path"}``; returns ``{id: result}``."""
    cases = [dict(c, path=str(c["path"])) for c in cases]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases), str(extra_mib)],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return {r["id"]: r for r in json.loads(lines[-1][len("RESULTS "):])}


def assert_refused(result, error_types, *needles, path=None):
    """The load ended in one of ``error_types`` (qualified names; "OSError" means any OSError that
    names ``path``), within SECONDS, with every needle in its message."""
    where = f"case {result['id']}: {result['type']}: {result['message']}"
    assert result["type"] is not None, f"case {result['id']} was accepted"
    if "OSError" in error_types and result["oserror"]:
        assert path is None or result["filename"] == str(path), where
    else:
        assert result["type"] in error_types, where
    assert result["seconds"] < SECONDS, f"{where} took {result['seconds']:.1f} s"
    for needle in needles:
        assert needle in result["message"], (needle, where)


# ------------------------------------------------------- building files
def npy(array):
    """The bytes ``np.save`` writes for ``array``."""
    import io

    import numpy as np
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def npy_header(shape, dtype="<f4"):
    """A version 1.0 .npy header declaring ``shape`` of ``dtype`` (no data)."""
    import numpy as np
    header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": tuple(shape)}
    text = repr(header).encode("latin1")
    pad = 64 - (10 + len(text) + 1) % 64
    text = text + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text


def write_zip(path, entries):
    """A zip written by hand (stored members, so any name and any duplicate is possible):
    ``entries`` is a list of (name, bytes) or (name, (raw deflate data, declared size, crc))."""
    import struct
    import zlib
    from pathlib import Path
    out, central = bytearray(), bytearray()
    for name, data in entries:
        name = name.encode()
        if isinstance(data, tuple):
            payload, size, crc, method = data[0], data[1], data[2], 8
        else:
            payload, size, crc, method = data, len(data), zlib.crc32(data), 0
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size,
                           len(name), 0) + name + payload
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload),
                               size, len(name), 0, 0, 0, 0, 0, offset) + name
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), len(out), 0)
    Path(path).write_bytes(bytes(out + central + eocd))
    return path


def deflate_bomb(prefix, mib):
    """Raw deflate data inflating to ``prefix`` + ``mib`` MiB of zeros, built in milliseconds."""
    import zlib
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return head + block * mib + c.flush()


def safetensors_bytes(header, data=b"", length=None):
    """A .safetensors file from a header given as JSON text (so that a name may appear twice)."""
    raw = header.encode() if isinstance(header, str) else header
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data
