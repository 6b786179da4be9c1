"""The implicit-GEMM convolution's tiles against cuDNN on the zoo's convolutions (a dev benchmark in llm.c's
manner: every variant checked against the reference, then timed).

For each convolution of the zoo's CNNs and each batch: µs a call, replayed in a CUDA graph as a compiled step
runs it (compiler.executor.time_replayed), of
  forward   cuDNN + the bias/activation epilogue kernel ("library"), the direct kernel, each implicit-GEMM tile;
  backward  the whole conv_backward (dx on the stream, cuDNN's filter gradient on the second) with dx by cuDNN
            or by each tile (stride 1, where dx is needed: not the first layer);
  dw        the filter gradient alone (conv_backward without dx): cuDNN's, or each tile of cpp/conv_wgrad.cu;
with each variant's largest difference from the library's output.  Usage (on the GPU machine):

    python3 benchmarks/bench_conv_igemm.py [--batches 32,64,256] [--layers cnn32] [--only dw]
"""
import argparse

import numpy as np

from cydnn import _C, ops
from cydnn.errors import CydnnError
from cydnn.compiler.executor import igemm_tiles, time_replayed, wgrad_tiles
from cydnn.compiler.lower import conv_igemm_name, conv_wgrad_name

#: name -> (c, h, w, k, kernel, stride, padding, needs dx)
LAYERS = {
    "cnn32.conv1": (3, 32, 32, 24, 3, 1, 1, False),
    "cnn32.conv2": (24, 16, 16, 48, 3, 1, 1, True),
    "cnn32.conv3": (48, 8, 8, 96, 3, 1, 1, True),
    "allconv.conv1": (1, 28, 28, 32, 3, 2, 1, False),
    "allconv.conv2": (32, 14, 14, 64, 3, 2, 1, True),
    "allconv.conv3": (64, 7, 7, 128, 3, 2, 1, True),
    "lenet16.conv1": (1, 28, 28, 16, 5, 1, 0, False),
    "lenet16.conv2": (16, 12, 12, 32, 5, 1, 0, True),
    "smallcnn.conv1_2": (32, 28, 28, 32, 3, 1, 1, True),
    "smallcnn.conv2_1": (32, 14, 14, 64, 3, 1, 1, True),
    "smallcnn.conv2_2": (64, 14, 14, 64, 3, 1, 1, True),
    "smallcnn.conv3_2": (128, 7, 7, 128, 3, 1, 1, True),
}


def row(name, batch, c, h, w, k, ks, s, p, dx_needed, only=""):
    rng = np.random.default_rng(0)
    stride, padding = (s, s), (p, p)
    oh, ow = (h + 2 * p - ks) // s + 1, (w + 2 * p - ks) // s + 1
    x = ops.cuda.asarray(rng.standard_normal((batch, c, h, w)).astype(np.float32))
    wt = ops.cuda.asarray((rng.standard_normal((k, c, ks, ks)) / np.sqrt(c * ks * ks)).astype(np.float32))
    if only in ("", "dw"):
        dy = ops.cuda.asarray(rng.standard_normal((batch, k, oh, ow)).astype(np.float32))
        dw, dw_ref = ops.cuda.empty((k, c, ks, ks)), ops.cuda.empty((k, c, ks, ks))
        _C.conv_backward(x, wt, dy, None, dw_ref, None, stride, padding)
        want = ops.cuda.to_numpy(dw_ref)
        wgrad = {"cuDNN": lambda: _C.conv_backward(x, wt, dy, None, dw, None, stride, padding)}
        for i, t in wgrad_tiles(k, batch * oh * ow):
            wgrad[conv_wgrad_name(t)[5:]] = (
                lambda tile=i: _C.conv_backward(x, wt, dy, None, dw, None, stride, padding, -1, tile))
        print(f"{name:<18} b{batch:<4} dw        " + " | ".join(_timed(wgrad, dw, want, "cuDNN")), flush=True)
    if only == "dw":
        return
    b = ops.cuda.asarray(rng.standard_normal(k).astype(np.float32))
    y, ref = ops.cuda.empty((batch, k, oh, ow)), ops.cuda.empty((batch, k, oh, ow))
    inner = oh * ow

    def library(out=y):
        _C.conv_forward(x, wt, None, out, stride, padding)
        _C.bias_act_forward(out, b, out, batch, k, inner, 1, 0.0)

    library(ref)
    want = ops.cuda.to_numpy(ref)
    fwd = {"library": library, "direct": lambda: _C.direct_conv_forward(x, wt, b, y, stride, padding, 1)}
    for i, t in igemm_tiles(k):
        fwd[conv_igemm_name(t)[5:]] = (lambda tile=i: _C.igemm_conv_forward(x, wt, b, y, stride, padding, 1, 0.0, tile))
    print(f"{name:<18} b{batch:<4} forward   " + " | ".join(_timed(fwd, y, want, "library")), flush=True)
    if not dx_needed or s != 1:
        return
    dy = ops.cuda.asarray(rng.standard_normal((batch, k, oh, ow)).astype(np.float32))
    dx, dw, dx_ref = ops.cuda.empty((batch, c, h, w)), ops.cuda.empty((k, c, ks, ks)), ops.cuda.empty((batch, c, h, w))
    _C.conv_backward(x, wt, dy, dx_ref, dw, None, stride, padding)
    want = ops.cuda.to_numpy(dx_ref)
    bwd = {"cuDNN": lambda: _C.conv_backward(x, wt, dy, dx, dw, None, stride, padding)}
    for i, t in igemm_tiles(c):
        bwd[conv_igemm_name(t)[5:]] = (lambda tile=i: _C.conv_backward(x, wt, dy, dx, dw, None, stride, padding, tile))
    print(f"{name:<18} b{batch:<4} backward  " + " | ".join(_timed(bwd, dx, want, "cuDNN")), flush=True)


def _timed(variants, out, want, reference):
    """'label us (max |difference|)' per variant; one that raises (a split tile's partial sums over the workspace
    limit) is listed as refused, as the executor drops it."""
    cells = []
    for label, fn in variants.items():
        try:
            us = min(time_replayed(fn) for _ in range(3)) * 1e6
        except CydnnError as e:
            cells.append(f"{label} refused ({type(e).__name__})")
            continue
        err = np.abs(ops.cuda.to_numpy(out) - want).max()
        cells.append(f"{label} {us:.1f}" + (f" ({err:.0e})" if label != reference else ""))
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,64,256")
    ap.add_argument("--layers", default="", help="comma-separated prefixes of the layer names (default: all)")
    ap.add_argument("--only", default="", choices=("", "dw"), help="dw: only the filter gradients")
    args = ap.parse_args()
    prefixes = [p for p in args.layers.split(",") if p]
    print("us a call replayed in a CUDA graph (best of 3 x 10); (max |difference| from cuDNN's result)")
    print("tiles:", ", ".join(f"{conv_igemm_name(t)[5:]} ({t[2]} threads)" for t in _C.igemm_conv_tiles()))
    for batch in (int(v) for v in args.batches.split(",")):
        for name, spec in LAYERS.items():
            if not prefixes or any(name.startswith(p) for p in prefixes):
                row(name, batch, *spec, only=args.only)


if __name__ == "__main__":
    main()
