"""NVRTC through ctypes: CUDA source -> cubin.  Standalone on purpose (no cydnn import): the
compiler's background compiles run this file as a child process (``python -I _nvrtc.py SPEC OUT``),
so that a compile still running when the program exits is killed rather than left inside the
exiting interpreter (NVRTC's own static state is torn down under a thread still using it: a crash at
exit), and so that a crash in NVRTC cannot take the user's process down.  fused_net_gen.py imports
``compile_source`` for compiles in the process.
"""
import ctypes
import json
import sys
import time


class NvrtcError(RuntimeError):
    """NVRTC failed; the message says at which step, with NVRTC's log where it has one."""


def _check(lib, status, what):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}")


def version(lib_path):
    """NVRTC's (major, minor)."""
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        raise NvrtcError(f"NVRTC not loadable from {lib_path}: {e}") from None
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


def compile_source(lib_path, text, headers, options, ptx=False):
    """cubin bytes of ``text`` (``headers``: {include name: text}) compiled with ``options``; with
    ``ptx``, the PTX text instead (``options`` then name a virtual architecture, compute_XX)."""
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as e:
        raise NvrtcError(f"NVRTC not loadable from {lib_path}: {e}") from None
    names = [n.encode() for n in headers]
    bodies = [headers[n].encode() for n in headers]
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"fused_net_gen.cu", len(names),
                                       (ctypes.c_char_p * len(bodies))(*bodies),
                                       (ctypes.c_char_p * len(names))(*names)), "create")
    try:
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC refused the generated source: {log.value.decode(errors='replace')[-2000:]}")
        size = ctypes.c_size_t()
        if ptx:
            _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
            text_out = ctypes.create_string_buffer(size.value)
            _check(lib, lib.nvrtcGetPTX(prog, text_out), "PTX")
            return text_out.value.decode()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(spec_path, out_path):
    """The child process: the spec (JSON: lib, text, headers, options) -> the cubin in out_path, or the
    error's message in out_path + ".err" and exit status 1; and in out_path + ".time" (JSON) NVRTC's own
    seconds and the wall-clock time the child finished, so that the parent's figure does not depend on
    when it looked."""
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    try:
        cubin = compile_source(spec["lib"], spec["text"], spec["headers"], spec["options"])
    except Exception as e:
        with open(out_path + ".err", "w") as f:
            f.write(f"{e}" if isinstance(e, NvrtcError) else f"{type(e).__name__}: {e}")
        return 1
    with open(out_path, "wb") as f:
        f.write(cubin)
    with open(out_path + ".time", "w") as f:
        json.dump({"nvrtc_s": time.perf_counter() - t0, "end": time.time()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
