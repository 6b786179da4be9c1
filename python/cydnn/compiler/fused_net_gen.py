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
process.  The compiles in the background, and the kernels a network adopts from them: nvrtc_jobs.py.
"""
import ctypes
import glob
import importlib.util
import os
from pathlib import Path

from . import _nvrtc as _nvrtc_mod
from . import fused_tiles

__all__ = ["source", "compile_cubin", "compile_ptx", "GenerationError", "KERNEL_NAME", "headers", "enabled",
           "fast_compile", "split_layers"]

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


def _call(d, ranks=0, buf_floats=0):
    """The layer function call: for a convolution, the one template instance conv_dispatch and
    conv_sized / split_sized would reach for its tile and kernel size (instantiating only that one
    saves NVRTC most of its time).  Tile 7 on a cluster of ``ranks`` blocks with ``buf_floats`` of
    scratch: where its reduction splits 2 ways or more (fused_tiles.wsplit_ways, the device's
    wsplit_ways), the instance says so (SPLIT) and its one-way paths are not compiled.  A linear layer
    gets the scratch of its split between warps only where a block may split (fused_tiles.linear_splits)."""
    if d["op"] == "linear" and not (ranks and fused_tiles.linear_splits(d, ranks)):
        return _CALLS["linear"].replace(", red);", ", nullptr);")    # no block splits: the split not compiled
    if d["op"] != "conv":
        return _CALLS[d["op"]]
    name, args = _CONV[int(d.get("tile", 0))]
    ks = d["kh"] if d["kh"] == d["kw"] and d["kh"] in (1, 3, 5) else 0
    if not args:                      # conv_wsplit (its pooling folded in or 0): the layer's input buffer is its scratch
        split = ", true" if ranks and fused_tiles.wsplit_ways(d, ranks, buf_floats) >= 2 else ""
        return f"{name}<{ks}, {int(d.get('pool', 0))}{split}>(L, cur, next, cluster, rank, RANKS, wbuf, WCAP, cur, BUF);"
    return f"{name}<{args}, {ks}>(L, cur, next, cluster, rank, RANKS, wbuf, WCAP);"


def source(layers, ranks, wcap, buf_floats, in_size, out_size, softmax, split=None):
    """CUDA source of the forward of ``layers`` (the bound table's dicts, tiles chosen for ``ranks``
    blocks a cluster) for clusters of ``ranks``, ``wcap`` floats of staged weights and activation
    buffers of ``buf_floats`` -- the numbers the table and cydnn_fused_net_check give.

    ``split`` (default: ``split_layers()``, $CYDNN_NVRTC_SPLIT): each layer in a function of its own
    (``__noinline__``) that the kernel calls, so that NVRTC's ``--split-compile`` optimises and assembles
    the layers on several threads at once (one inlined kernel function is one job for each stage: most
    of NVRTC's time, docs/performance.md, session 26).  A layer's buffers are the same shared memory
    either way (the layer function takes ``smem`` at fixed offsets: the compiler still sees shared
    addresses), and the code inside is the same, so the bits are the interpreter's."""
    split = split_layers() if split is None else split
    lines = ["// generated by cydnn.compiler.fused_net_gen for one network: the fused network's layer",
             "// functions called in order with the shapes as constants (see cpp/fused_net_layers.cuh)",
             "#define CYDNN_NET_FN __device__ __forceinline__",
             '#include "fused_net_layers.cuh"',
             f"constexpr int RANKS = {int(ranks)};",
             f"constexpr long WCAP = {int(wcap)};",
             f"constexpr int BUF = {int(buf_floats)};",
             "extern __shared__ float smem[];",
             "__shared__ float red[32];"]
    body = []
    for i, d in enumerate(layers):
        shape = " ".join(f"L.{f} = {int(d.get(f, 1 if f in _ONE else 0))};" for f in _SHAPE)
        epi = list(d.get("epi", ()))
        names = [f for f in _ARRAYS if d.get(f) is not None]
        # split: the arrays come as arguments, read by the kernel from its parameters (through a pointer to
        # the parameters, each would be a load from memory at the layer's start: +1 to +10 us a network)
        arrays = " ".join(f"L.{f} = {f if split else f'net.layers[{i}].{f}'};" for f in names)
        layer = ["cydnnNetLayer L = {};                    // the shapes as constants, the arrays from the table",
                 f"{arrays}" if arrays else "// (no arrays)",
                 f"L.op = {_OPS[d['op']]}; L.tile = {int(d.get('tile', 0))}; L.pool = {int(d.get('pool', 0))}; "
                 f"{shape}",
                 f"L.num_epi = {len(epi)};" + "".join(f" L.epi[{s}] = {int(e)};" for s, e in enumerate(epi))
                 + f" L.act = {int(d.get('act', 0))}; L.slope = {float(d.get('slope', 0.0))!r}f;"
                 + f" L.bn_eps = {float(d.get('bn_eps', 0.0))!r}f;",
                 _call(d, ranks, buf_floats)]
        if split:           # buffers alternate: layer i reads smem + (i % 2) * BUF, writes the other
            params = ", ".join(f"const float *{f}" for f in names)
            lines += [f"__device__ __noinline__ void layer_{i}({params}) {{   // layer {i}: {d['op']}",
                      "    cg::cluster_group cluster = cg::this_cluster();",
                      "    const int rank = (int)cluster.block_rank();",
                      f"    float *cur = smem + {i % 2} * BUF, *next = smem + {(i + 1) % 2} * BUF, "
                      "*wbuf = smem + 2L * BUF;",
                      "    (void)rank; (void)wbuf; (void)next;"] + ["    " + t for t in layer] + ["}"]
            body += [f"    layer_{i}({', '.join(f'net.layers[{i}].{f}' for f in names)});", "    cluster.sync();"]
        else:
            body += [f"    {{   // layer {i}: {d['op']}"] + ["        " + t for t in layer] + [
                     "        cluster.sync();", "        float *t = cur; cur = next; next = t;", "    }"]
    last = "smem + BUF" if split and len(layers) % 2 else "cur"
    lines += [f'extern "C" __global__ void __launch_bounds__(kWsplitThreads) {KERNEL_NAME}(',
              "        const __grid_constant__ cydnnNet net, const float *__restrict__ x, int n, float *__restrict__ y,",
              "        int buf_floats) {",
              "    cg::cluster_group cluster = cg::this_cluster();",
              "    const int rank = (int)cluster.block_rank();",
              "    const long image = blockIdx.x / RANKS;",
              "    if (image >= n || buf_floats != BUF || net.wcap != WCAP) return;   // not the table it was made for",
              "    float *cur = smem, *next = smem + BUF, *wbuf = smem + 2L * BUF;",
              "    (void)next; (void)wbuf;",
              f"    load_input(x + image * {int(in_size)}L, {int(in_size)}L, cur, cluster, rank, RANKS);"]
    lines += body
    if split:
        lines.append(f"    cur = {last};")
    lines += [f"    if (rank == 0) write_output(cur, y + image * {int(out_size)}L, {int(out_size)}L, "
              f"{'true' if softmax else 'false'}, red);",
              "}"]
    return "\n".join(lines) + "\n"


def split_layers(environ=None):
    """``$CYDNN_NVRTC_SPLIT``: 1 (default) -- a generated kernel's layers in functions of their own, compiled on
    several threads (NVRTC's --split-compile) -- or 0 (one inlined kernel function); anything else is refused."""
    text = (os.environ if environ is None else environ).get("CYDNN_NVRTC_SPLIT", "1").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"CYDNN_NVRTC_SPLIT must be 0 or 1, got {text!r}")
    return text == "1"


def headers():
    """{name: text} of the library's headers the generated source includes: from the installed package
    (cydnn/_cuda_src) or the source tree's cpp/ (an editable install)."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "_cuda_src", package.parents[1] / "cpp"):
        if all((folder / h).is_file() for h in _HEADERS):
            out = {h: (folder / h).read_text() for h in _HEADERS}
            out.update(_STUBS)
            return out
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
#: NVRTC's --split-compile threads (0: one a CPU)
SPLIT_THREADS = 0


def fast_compile(environ=None):
    """``$CYDNN_NVRTC_FAST_COMPILE``: off (NVRTC's full optimisation), min, mid or max (its -Ofast-compile
    level); anything else is refused.  What each level costs in compile time and kernel time on the zoo:
    docs/performance.md (session 21)."""
    text = (os.environ if environ is None else environ).get("CYDNN_NVRTC_FAST_COMPILE", "").strip()
    text = text or FAST_COMPILE_DEFAULT
    if text not in FAST_COMPILE_LEVELS:
        raise ValueError(f"CYDNN_NVRTC_FAST_COMPILE must be one of {', '.join(FAST_COMPILE_LEVELS)}, got {text!r}")
    return text


def _options(arch, level=None, split=None):
    """NVRTC's options; ``level``: the -Ofast-compile level (default: $CYDNN_NVRTC_FAST_COMPILE), left out
    where it is off or NVRTC is older than 12.8 (which does not know it); ``split`` (default:
    ``split_layers()``): --split-compile, NVRTC's optimiser on as many threads as the machine has CPUs
    (a source with one function a layer gives it one job a layer)."""
    level = fast_compile() if level is None else level
    split = split_layers() if split is None else split
    fast = []
    if level != "off":
        try:
            if _nvrtc_mod.version(_nvrtc()) >= (12, 8):
                fast = [f"-Ofc={level}"]
        except _nvrtc_mod.NvrtcError as e:
            raise GenerationError(str(e)) from None
    return [f"--gpu-architecture={arch}", "-std=c++17", "-default-device"] + fast + (
        [f"--split-compile={SPLIT_THREADS}"] if split else [])


def _compile(text, arch, ptx):
    try:
        return _nvrtc_mod.compile_source(_nvrtc(), text, headers(), _options(arch), ptx=ptx)
    except _nvrtc_mod.NvrtcError as e:
        raise GenerationError(str(e)) from None


def compile_cubin(text, arch=ARCH):
    """NVRTC, in this process: ``text`` (with the library's headers) -> cubin bytes for ``arch``.  (A compile at
    an -Ofast-compile level changes what later compiles in the same process give -- NVRTC 13.0, seen in
    session 26 --; the compiler's own compiles each run in a fresh process: nvrtc_jobs.py.)"""
    return _compile(text, arch, False)


def compile_ptx(text, arch="compute_90"):
    """NVRTC, in this process: ``text`` -> PTX (to read, or to compare two sources' code)."""
    return _compile(text, arch, True)


def enabled(environ=None):
    """Whether kernels are generated: ``$CYDNN_FUSED_GEN`` 1 (default) or 0; anything else is refused."""
    text = (os.environ if environ is None else environ).get("CYDNN_FUSED_GEN", "1").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"CYDNN_FUSED_GEN must be 0 or 1, got {text!r}")
    return text == "1"
