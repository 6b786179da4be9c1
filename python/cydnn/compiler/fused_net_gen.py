"""A fused-network kernel generated for one network: the table's loop written out, with the shapes
as constants (item 4 of issue 14, "generated whole-network kernels").

The fused network's kernel (cpp/fused_net.cu) interprets a table: every loop bound, stride and
tile is read at run time, so the compiler can unroll, fold or precompute nothing.  This module
writes the same forward for one network and one cluster size as CUDA source -- one call of the
same layer function per layer (cpp/fused_net_layers.cuh, cpp/fused_net_conv.cuh), the layer's
shapes assigned as literals, every layer function inlined (``CYDNN_NET_FN``) -- and compiles it
with NVRTC into a cubin that the library loads (``cydnn_net_kernel_load``) and launches on the
same table (arrays, sizes, shared memory).  Same code, same summation order: the same bits as the
interpreter, which the self-test checks before the kernel is used.

Why NVRTC and not templates: the shapes are the user's, known only at run time; templates would
fix them at build time.  Why in the background: NVRTC takes a few seconds for a network, more
than a compile() call may take; the interpreter serves until the generated kernel is ready,
checked and timed faster (FusedNetwork.generated_kernel).

``source(...)`` is the text (print it to read what runs); ``compile_cubin(text)`` NVRTC's result in this
process.  ``units(...)`` is the same forward in translation units NVRTC compiles side by side (one a layer, then
the kernel), which ``link`` joins through the driver: ready in a third of the time, run a little slower, so it
serves until the whole form is compiled (docs/performance.md, session 27).  The compiles in the background, and the
kernels a network adopts from them: nvrtc_jobs.py.
"""
import ctypes
import glob
import importlib.util
import os
from pathlib import Path

from . import _nvrtc as _nvrtc_mod
from . import fused_tiles
from .fused_tiles import THREADS          # the kernel's threads a block (kWsplitThreads): the units' register cap

__all__ = ["source", "units", "link", "compile_cubin", "compile_ptx", "GenerationError", "KERNEL_NAME", "headers",
           "enabled", "fast_compile", "split_layers"]

KERNEL_NAME = "cydnn_fused_net_gen"
ARCH = "sm_90"
_HEADERS = ("cydnn.h", "fused_net_rtc.cuh", "fused_net_conv.cuh", "fused_net_wsplit.cuh", "fused_net_layers.cuh")
# what cydnn.h includes, for NVRTC (which has no C library headers)
_STUBS = {"stddef.h": "typedef unsigned long size_t;\n",
          "stdint.h": ("typedef signed char int8_t; typedef unsigned char uint8_t; typedef int int32_t;\n"
                       "typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;\n"
                       "typedef unsigned long uintptr_t;\n")}
_OPS = {"conv": "CYDNN_NET_CONV", "linear": "CYDNN_NET_LINEAR", "max_pool": "CYDNN_NET_MAX_POOL",
        "avg_pool": "CYDNN_NET_AVG_POOL", "global_avg_pool": "CYDNN_NET_GLOBAL_AVG_POOL",
        "epilogue": "CYDNN_NET_EPILOGUE"}
_CALLS = {"linear": "linear_layer(L, cur, next, cluster, rank, RANKS, red);",
          "max_pool": "pool_layer(L, cur, next, cluster, rank, RANKS, true);",
          "avg_pool": "pool_layer(L, cur, next, cluster, rank, RANKS, false);",
          "global_avg_pool": "gap_layer(L, cur, next, cluster, rank, RANKS);",
          "epilogue": "epilogue_layer(L, cur, next, cluster, rank, RANKS);"}
_SHAPE = ("c", "h", "w", "k", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw")
_ONE = ("h", "w", "oh", "ow", "kh", "kw", "sh", "sw")          # the table's defaults (FusedNet)
_ARRAYS = ("weight", "bias", "bn_mean", "bn_var", "bn_weight", "bn_bias")


class GenerationError(RuntimeError):
    """NVRTC could not be found or refused the generated source (the message has its log)."""


# tile code -> the convolution template conv_dispatch calls for it (cpp/fused_net_conv.cuh)
_CONV = {7: ("conv_wsplit", ""), 6: ("conv_split", "16"), 5: ("conv_split", "8"), 4: ("conv_split", "4"), 3: ("conv_layer", "4, 4"),
         2: ("conv_layer", "4, 1"), 1: ("conv_layer", "1, 4"), 0: ("conv_layer", "1, 1")}


def _call(d, ranks=0, buf_floats=0, wcap=None, local=False):
    """The layer function call: for a convolution, the one template instance conv_dispatch and
    conv_sized / split_sized would reach for its tile and kernel size (instantiating only that one
    saves NVRTC most of its time).  Tile 7 on a cluster of ``ranks`` blocks with ``buf_floats`` of
    scratch: where its reduction splits 2 ways or more (fused_tiles.wsplit_ways, the device's
    wsplit_ways), the instance says so (SPLIT) and its one-way paths are not compiled.  Where every block
    of the cluster stages the layer's weights in ``wcap`` floats (fused_tiles.stages_all), the instance says
    so too (STAGED) and the reads through the read-only cache are not compiled: NVRTC had made a second copy
    of the layer's inner loop for them, which no block ran.  A linear layer gets the scratch of its split
    between warps only where a block may split (fused_tiles.linear_splits).  A tail (a linear layer of tile 1)
    is ``linear_tail``; ``local``: the linear layer before a tail, which stores into its own block only."""
    if d["op"] == "linear" and d.get("tile") == 1:
        return "linear_tail(L, cur, cluster, rank, RANKS);"
    if d["op"] == "linear":
        call = _CALLS["linear"]
        if not (ranks and fused_tiles.linear_splits(d, ranks)):
            call = call.replace(", red);", ", nullptr);")                # no block splits: the split not compiled
        return call.replace(");", ", true);") if local else call
    if d["op"] != "conv":
        return _CALLS[d["op"]]
    name, args = _CONV[int(d.get("tile", 0))]
    ks = d["kh"] if d["kh"] == d["kw"] and d["kh"] in (1, 3, 5) else 0
    staged = ranks and wcap is not None and fused_tiles.stages_all(d, ranks, wcap)
    if not args:                      # conv_wsplit (its pooling folded in or 0): the layer's input buffer is its scratch
        split = ranks and fused_tiles.wsplit_ways(d, ranks, buf_floats) >= 2
        flags = ", true" if split else ""
        if staged:                    # (the one-way fallback, conv_layer<4, 4>, keeps its own check)
            flags = f", {'true' if split else 'false'}, true"
        return f"{name}<{ks}, {int(d.get('pool', 0))}{flags}>(L, cur, next, cluster, rank, RANKS, wbuf, WCAP, cur, BUF);"
    return f"{name}<{args}, {ks}{', true' if staged else ''}>(L, cur, next, cluster, rank, RANKS, wbuf, WCAP);"


def _prelude(ranks, wcap, buf_floats):
    return ["// generated by cydnn.compiler.fused_net_gen for one network: the fused network's layer",
            "// functions called in order with the shapes as constants (see cpp/fused_net_layers.cuh)",
            "#define CYDNN_NET_FN __device__ __forceinline__",
            '#include "fused_net_layers.cuh"',
            f"constexpr int RANKS = {int(ranks)};",
            f"constexpr long WCAP = {int(wcap)};",
            f"constexpr int BUF = {int(buf_floats)};",
            "extern __shared__ float smem[];"]


def _local(layers, i):
    """Whether layer ``i`` is a linear layer right before a tail (it keeps its outputs in its own block)."""
    return (layers[i]["op"] == "linear" and i + 1 < len(layers) and layers[i + 1]["op"] == "linear"
            and layers[i + 1].get("tile") == 1)


def _after(layers, i):
    """The lines after layer ``i``'s call: the barrier (a block's own after a layer before a tail, else the
    cluster's), and after a tail rank 0's sum of the partials (as forward_image does)."""
    if _local(layers, i):
        return ["__syncthreads();"]
    if layers[i]["op"] == "linear" and layers[i].get("tile") == 1:
        return ["cluster.sync();", "if (rank == 0) linear_tail_sum(L, cur, next, RANKS);"]
    return ["cluster.sync();"]


def _layer(i, d, ranks, buf_floats, arrays_from, wcap=None, local=False):
    """The lines of layer ``i``: its table entry with the shapes as constants, then the call.  ``arrays_from``:
    where its arrays come from (``net.layers[i].`` in the kernel, or "" where they are the function's arguments);
    ``local``: ``_local``."""
    shape = " ".join(f"L.{f} = {int(d.get(f, 1 if f in _ONE else 0))};" for f in _SHAPE)
    epi = list(d.get("epi", ()))
    arrays = " ".join(f"L.{f} = {arrays_from}{f};" for f in _ARRAYS if d.get(f) is not None)
    return ["cydnnNetLayer L = {};                    // the shapes as constants, the arrays from the table",
            f"{arrays}" if arrays else "// (no arrays)",
            f"L.op = {_OPS[d['op']]}; L.tile = {int(d.get('tile', 0))}; L.pool = {int(d.get('pool', 0))}; {shape}",
            f"L.num_epi = {len(epi)};" + "".join(f" L.epi[{s}] = {int(e)};" for s, e in enumerate(epi))
            + f" L.act = {int(d.get('act', 0))}; L.slope = {float(d.get('slope', 0.0))!r}f;"
            + f" L.bn_eps = {float(d.get('bn_eps', 0.0))!r}f;",
            _call(d, ranks, buf_floats, wcap, local)]


def _kernel(in_size, out_size, softmax, body, last="cur"):
    return ([f'extern "C" __global__ void __launch_bounds__(kWsplitThreads) {KERNEL_NAME}(',
             "        const __grid_constant__ cydnnNet net, const float *__restrict__ x, int n, float *__restrict__ y,",
             "        int buf_floats) {",
             "    cg::cluster_group cluster = cg::this_cluster();",
             "    const int rank = (int)cluster.block_rank();",
             "    const long image = blockIdx.x / RANKS;",
             "    if (image >= n || buf_floats != BUF || net.wcap != WCAP) return;   // not the table it was made for",
             "    float *cur = smem, *next = smem + BUF, *wbuf = smem + 2L * BUF;",
             "    (void)next; (void)wbuf;",
             f"    load_input(x + image * {int(in_size)}L, {int(in_size)}L, cur, cluster, rank, RANKS);"]
            + body
            + [f"    if (rank == 0) write_output({last}, y + image * {int(out_size)}L, {int(out_size)}L, "
               f"{'true' if softmax else 'false'}, red);",
               "}"])


def source(layers, ranks, wcap, buf_floats, in_size, out_size, softmax):
    """CUDA source of the forward of ``layers`` (the bound table's dicts, tiles chosen for ``ranks``
    blocks a cluster) for clusters of ``ranks``, ``wcap`` floats of staged weights and activation
    buffers of ``buf_floats`` -- the numbers the table and cydnn_fused_net_check give: one kernel function
    with every layer inlined (the "whole" form)."""
    body = []
    for i, d in enumerate(layers):
        lines = _layer(i, d, ranks, buf_floats, f"net.layers[{i}].", wcap, _local(layers, i)) + _after(layers, i)
        body += [f"    {{   // layer {i}: {d['op']}"] + ["        " + t for t in lines]
        body += ["        float *t = cur; cur = next; next = t;", "    }"]
    lines = _prelude(ranks, wcap, buf_floats) + ["__shared__ float red[32];"] + _kernel(in_size, out_size, softmax, body)
    return "\n".join(lines) + "\n"


def units(layers, ranks, wcap, buf_floats, in_size, out_size, softmax, groups=None):
    """The same forward as ``source`` in translation units that NVRTC compiles apart, at once, as relocatable code
    (``_options(..., rdc=True)``), and the driver links (``link``): one a group of consecutive layers --
    ``cydnn_net_layer_<i>`` (i its first layer), which reads buffer i % 2 of the shared memory, runs its layers
    inlined (a cluster barrier between two), and takes their arrays and the kernel's 32-float ``red`` as
    arguments -- and last the kernel that calls them in order (the "layers" form).  ``groups``: the index of each
    group's first layer (default: every layer its own group).  NVRTC spends its time optimising the one function
    everything is inlined into (docs/performance.md, session 26); split, the compiles run side by side.  The code
    inside each layer is the same, so the bits are the interpreter's."""
    starts = sorted(set([0] + list(range(len(layers)) if groups is None else [int(g) for g in groups])))
    if not layers:
        starts = []                                   # the kernel alone (as before groups: no unit a layer)
    elif starts[-1] >= len(layers) or starts[0] < 0:
        raise ValueError(f"units: groups must start at layers 0..{len(layers) - 1}, got {groups!r}")
    out, decls, body = [], [], []
    for a, b in zip(starts, starts[1:] + [len(layers)]):
        names = [(i, f) for i in range(a, b) for f in _ARRAYS if layers[i].get(f) is not None]
        sig = (f'extern "C" __device__ void cydnn_net_layer_{a}('
               + ", ".join([f"const float *l{i}_{f}" for i, f in names] + ["float *red"]) + ")")
        text = [sig + f" {{   // layers {a}..{b - 1}",
                "    cg::cluster_group cluster = cg::this_cluster();",
                "    const int rank = (int)cluster.block_rank();",
                f"    float *cur = smem + {a % 2} * BUF, *next = smem + {(a + 1) % 2} * BUF, *wbuf = smem + 2L * BUF;",
                "    (void)rank; (void)wbuf; (void)next; (void)red;"]
        for i in range(a, b):
            text += [f"    {{   // layer {i}: {layers[i]['op']}"]
            text += ["        " + t for t in _layer(i, layers[i], ranks, buf_floats, f"l{i}_", wcap, _local(layers, i))]
            text += ["        " + t for t in _after(layers, i)]       # the group's last barrier too: its own
            if i + 1 < b:
                text += ["        float *t = cur; cur = next; next = t;"]
            text += ["    }"]
        out.append("\n".join(_prelude(ranks, wcap, buf_floats) + text + ["}"]) + "\n")
        decls.append(sig + ";")
        body += [f"    cydnn_net_layer_{a}(" + ", ".join([f"net.layers[{i}].{f}" for i, f in names] + ["red"]) + ");"]
    last = "smem + BUF" if len(layers) % 2 else "smem"
    out.append("\n".join(_prelude(ranks, wcap, buf_floats) + ["__shared__ float red[32];"] + decls
                         + _kernel(in_size, out_size, softmax, body, last)) + "\n")
    return out


def _switch(name, environ=None):
    """An on/off environment variable: 1 (default, also when empty) or 0; anything else is refused."""
    text = (os.environ if environ is None else environ).get(name, "1").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def split_layers(environ=None):
    """``$CYDNN_NVRTC_SPLIT``: 1 (default) -- a generated kernel is compiled in the "layers" form too (``units``),
    which is ready sooner -- or 0 (the "whole" form only); anything else is refused."""
    return _switch("CYDNN_NVRTC_SPLIT", environ)


def headers(folder=None):
    """{name: text} of the library's headers the generated source includes: from the installed package
    (cydnn/_cuda_src) or the source tree's cpp/ (an editable install).  ``folder``: another folder holding them (a
    changed copy of cpp/, to time a change to the generated kernels without rebuilding the library:
    benchmarks/fused_net_phases.py --headers); its cydnn.h must be the installed one, whose table layout the
    library's precompiled code fills."""
    package = Path(__file__).resolve().parents[1]
    installed = (package / "_cuda_src", package.parents[1] / "cpp")
    for where in installed if folder is None else (Path(folder),):
        if all((where / h).is_file() for h in _HEADERS):
            out = {h: (where / h).read_text() for h in _HEADERS}
            if folder is not None and out["cydnn.h"] != headers()["cydnn.h"]:
                raise GenerationError(f"{folder}/cydnn.h differs from the installed library's: a kernel compiled "
                                      "with it would misread the library's tables")
            out.update(_STUBS)
            return out
    if folder is not None:
        missing = [h for h in _HEADERS if not (Path(folder) / h).is_file()]
        raise GenerationError(f"{folder} lacks the fused network's headers {', '.join(missing)}")
    raise GenerationError("the fused network's CUDA headers are not installed (cydnn/_cuda_src or cpp/)")


_lib_path = None


def _nvrtc():
    """The path of libnvrtc: from the NVIDIA wheels (nvidia/cu*/lib), else the system's."""
    global _lib_path
    if _lib_path is not None:
        return _lib_path
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []):
        candidates += sorted(glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so.*")))
    candidates = [c for c in candidates if "builtins" not in c] + ["libnvrtc.so"]
    errors = []
    for path in candidates:
        try:
            ctypes.CDLL(path)
        except OSError as e:
            errors.append(str(e))
            continue
        _lib_path = path
        return path
    raise GenerationError("NVRTC not found: " + "; ".join(errors))


_identity = None


def _nvrtc_identity():
    """Which NVRTC compiles (its path and version): part of a cached kernel's key."""
    global _identity
    if _identity is None:
        try:
            _identity = "%s %d.%d" % ((_nvrtc(),) + _nvrtc_mod.version(_nvrtc()))
        except _nvrtc_mod.NvrtcError as e:
            raise GenerationError(str(e)) from None
    return _identity


#: NVRTC's -Ofast-compile levels (NVRTC 12.8+): less optimisation for a shorter compile
FAST_COMPILE_LEVELS = ("off", "min", "mid", "max")
FAST_COMPILE_DEFAULT = "off"


def fast_compile(environ=None):
    """``$CYDNN_NVRTC_FAST_COMPILE``: off (NVRTC's full optimisation), min, mid or max (its -Ofast-compile
    level); anything else is refused.  What each level costs in compile time and kernel time on the zoo:
    docs/performance.md (session 21)."""
    text = (os.environ if environ is None else environ).get("CYDNN_NVRTC_FAST_COMPILE", "").strip()
    text = text or FAST_COMPILE_DEFAULT
    if text not in FAST_COMPILE_LEVELS:
        raise ValueError(f"CYDNN_NVRTC_FAST_COMPILE must be one of {', '.join(FAST_COMPILE_LEVELS)}, got {text!r}")
    return text


def _options(arch, level=None, rdc=False):
    """NVRTC's options; ``level``: the -Ofast-compile level (default: $CYDNN_NVRTC_FAST_COMPILE), left out
    where it is off or NVRTC is older than 12.8 (which does not know it); ``rdc``: relocatable code for the driver's
    link (``units``), each function held to the registers the kernel's 512 threads leave it (a function compiled
    apart does not see the kernel's launch bounds)."""
    level = fast_compile() if level is None else level
    fast = []
    if level != "off":
        try:
            if _nvrtc_mod.version(_nvrtc()) >= (12, 8):
                fast = [f"-Ofc={level}"]
        except _nvrtc_mod.NvrtcError as e:
            raise GenerationError(str(e)) from None
    return [f"--gpu-architecture={arch}", "-std=c++17", "-default-device"] + fast + (
        ["-rdc=true", f"--maxrregcount={65536 // THREADS}"] if rdc else [])


def _compile(text, arch, ptx, rdc=False, header_dir=None):
    included = headers(header_dir)
    try:
        return _nvrtc_mod.compile_source(_nvrtc(), text, included, _options(arch, rdc=rdc), ptx=ptx)
    except _nvrtc_mod.NvrtcError as e:
        raise GenerationError(str(e)) from None


def compile_cubin(text, arch=ARCH, rdc=False, header_dir=None):
    """NVRTC, in this process: ``text`` (with the library's headers, or those in ``header_dir``: ``headers``) ->
    cubin bytes for ``arch``.  (A compile at an -Ofast-compile level changes what later compiles in the same process
    give -- NVRTC 13.0, seen in session 26 --; the compiler's own compiles each run in a fresh process:
    nvrtc_jobs.py.)"""
    return _compile(text, arch, False, rdc, header_dir)


def compile_ptx(text, arch="compute_90"):
    """NVRTC, in this process: ``text`` -> PTX (to read, or to compare two sources' code)."""
    return _compile(text, arch, True)


def enabled(environ=None):
    """Whether kernels are generated: ``$CYDNN_FUSED_GEN`` 1 (default) or 0; anything else is refused."""
    return _switch("CYDNN_FUSED_GEN", environ)


_CU_JIT_ERROR_LOG_BUFFER, _CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, _CU_JIT_INPUT_CUBIN = 5, 6, 0
# the driver's results a link may give, named (cuda.h's CUresult)
_CU_RESULTS = {3: " (CUDA_ERROR_NOT_INITIALIZED)",
               201: " (CUDA_ERROR_INVALID_CONTEXT: no CUDA context is current on this thread; the whole form serves)",
               209: " (CUDA_ERROR_NO_BINARY_FOR_GPU)", 300: " (CUDA_ERROR_INVALID_SOURCE)",
               500: " (CUDA_ERROR_NOT_FOUND: a symbol a unit needs is missing)"}


def link(cubins):
    """The driver's linker (cuLink*, through ctypes: no link-time dependency on libcuda) on relocatable cubins ->
    one loadable cubin.  It needs the CUDA context current on this thread (the library's calls make the primary
    context current); any failure is a GenerationError with the driver's status and log (the "layers" form is then
    refused and the "whole" form serves)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise GenerationError(f"cuLink: the driver library is not loadable: {e}") from None
    log = ctypes.create_string_buffer(4096)
    opts = (ctypes.c_int * 2)(_CU_JIT_ERROR_LOG_BUFFER, _CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
    vals = (ctypes.c_void_p * 2)(ctypes.cast(log, ctypes.c_void_p), ctypes.c_void_p(len(log)))
    state = ctypes.c_void_p()

    def check(status, what):
        if status != 0:
            why = _CU_RESULTS.get(status, "")
            raise GenerationError(f"cuLink: {what} failed with CUresult {status}{why}: "
                                  f"{log.value.decode(errors='replace')[:1000]}")
    check(cuda.cuLinkCreate_v2(2, opts, vals, ctypes.byref(state)), "cuLinkCreate")
    try:
        for i, cubin in enumerate(cubins):
            data = ctypes.create_string_buffer(cubin, len(cubin))
            check(cuda.cuLinkAddData_v2(state, _CU_JIT_INPUT_CUBIN, data, ctypes.c_size_t(len(cubin)),
                                        f"unit{i}".encode(), 0, None, None), f"cuLinkAddData (unit {i})")
        out, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(cuda.cuLinkComplete(state, ctypes.byref(out), ctypes.byref(size)), "cuLinkComplete")
        return ctypes.string_at(out, size.value)          # copied before the state (which owns it) goes
    finally:
        cuda.cuLinkDestroy(state)
