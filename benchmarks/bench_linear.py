"""The skinny GEMM's tiles (cpp/gemm_skinny.cu) against cuBLASLt on the zoo's linear layers (a dev benchmark in
llm.c's manner: every variant checked against the reference, then timed).

For each linear layer of the zoo's networks and each batch: us a call, replayed in a CUDA graph as a compiled step
runs it (compiler.executor.time_replayed), of
  forward   cuBLASLt (linear_forward, bias + ReLU in its epilogue for a hidden layer) and every skinny tile
            (skinny_gemm, same epilogue); also at batch 1 (--forward-batches);
  backward  the whole linear_backward (dx on the stream, cuBLASLt's dw on the second) with dx by cuBLASLt or by
            each tile (where dx is needed: not an MLP's first layer, whose input is the network's);
with each tile's largest difference from cuBLASLt's output (a tile's output buffer starts as NaN, so a tile that
writes nothing shows nan).  A '*' marks the tiles compiler.executor.skinny_tiles keeps (those the compiler times);
'compiler' is the fastest of cuBLASLt and those, i.e. what a compiled step would choose.  Usage (on the GPU machine):

    python3 benchmarks/bench_linear.py [--batches 64,256] [--forward-batches 1] [--layers mlp,cnn32] [--all]
                                       [--calls 20] [--json out.json]
"""
import argparse
import json

import numpy as np

from cydnn import _C, ops
from cydnn.errors import CydnnError
from cydnn.compiler.executor import skinny_tiles, time_replayed
from cydnn.compiler.lower import skinny_gemm_name

#: name -> (in features, out features, act (1 relu: a hidden layer; 0 none), needs dx); from bench_zoo.zoo().
#: 128->10 is also smallcnn_bn's head, 120->84->10 also lenet5_classic's (tanh there; ReLU here).
LAYERS = {
    "mlp1024.fc1": (784, 1024, 1, False),
    "mlp1024.fc2": (1024, 1024, 1, True),
    "mlp1024.fc3": (1024, 10, 0, True),
    "mlp128.fc1": (784, 128, 1, False),
    "mlp128.fc2": (128, 10, 0, True),
    "cnn32.fc1": (1536, 128, 1, True),
    "cnn32.fc2": (128, 10, 0, True),
    "allconv.fc": (2048, 10, 0, True),
    "lenet16_32.fc1": (512, 512, 1, True),
    "lenet16_32.fc2": (512, 10, 0, True),
    "lenet5.fc1": (256, 120, 1, True),
    "lenet5_classic.fc1": (400, 120, 1, True),
    "lenet5.fc2": (120, 84, 1, True),
    "lenet5.fc3": (84, 10, 0, True),
}


def _nan(shape):
    return ops.cuda.asarray(np.full(shape, np.nan, np.float32))


def _measure(variants, shape, want, reps, calls):
    """name -> (us, max |difference| from ``want``) for each variant (name -> fn(out)); None for one that raises
    (a tile the kernel does not take for this shape, as the executor drops it)."""
    res = {}
    for name, fn in variants.items():
        out = _nan(shape)
        try:
            us = min(time_replayed(lambda: fn(out), calls=calls) for _ in range(reps)) * 1e6
        except CydnnError:
            res[name] = None
            continue
        res[name] = (us, float(np.abs(ops.cuda.to_numpy(out) - want).max()))
    return res


def bench(name, batch, fin, fout, act, direction, tiles, args):
    """One row: cuBLASLt against every tile on ``direction`` ('forward' or 'dx') of the layer at ``batch``."""
    rng = np.random.default_rng(0)
    x = ops.cuda.asarray(rng.standard_normal((batch, fin)).astype(np.float32))
    w = ops.cuda.asarray((rng.standard_normal((fout, fin)) / np.sqrt(fin)).astype(np.float32))
    if direction == "forward":
        b = ops.cuda.asarray(rng.standard_normal(fout).astype(np.float32))
        shape, (m, n, k) = (batch, fout), (batch, fout, fin)
        library = lambda out: _C.linear_forward(x, w, b, out, act)
        tile_fn = lambda i: (lambda out: _C.skinny_gemm(x, w, b, out, False, act, 0.0, i))
    else:
        dy = ops.cuda.asarray(rng.standard_normal((batch, fout)).astype(np.float32))
        dw = ops.cuda.empty((fout, fin))
        shape, (m, n, k) = (batch, fin), (batch, fin, fout)
        library = lambda out: _C.linear_backward(x, w, dy, out, dw, None)
        tile_fn = lambda i: (lambda out: _C.linear_backward(x, w, dy, out, dw, None, i))
    ref = _nan(shape)
    library(ref)
    want = ops.cuda.to_numpy(ref)
    pruned = {i for i, _ in skinny_tiles(m, n, k)}
    names = {i: skinny_gemm_name(t) for i, t in enumerate(tiles)}
    variants = {"cuBLASLt": library}
    variants.update({names[i]: tile_fn(i) for i in names})
    res = _measure(variants, shape, want, args.reps, args.calls)
    lib_us = res["cuBLASLt"][0]
    ran = {i: res[names[i]] for i in names if res[names[i]] is not None}
    best = min(ran, key=lambda i: ran[i][0]) if ran else None
    chosen = min(["cuBLASLt"] + [names[i] for i in ran if i in pruned], key=lambda v: res[v][0])
    worst = float(np.max([d for _, d in ran.values()])) if ran else float("nan")     # nan propagates
    cell = (f"{names[best] + ('*' if best in pruned else ''):<18} {ran[best][0]:8.1f} {lib_us / ran[best][0]:6.2f}x "
            f"{ran[best][1]:9.1e}" if best is not None else f"{'(none ran)':<18} {'':8} {'':7} {'':9}")
    print(f"{name:<19} {direction:<8} b{batch:<5} {lib_us:9.1f}  {cell} {worst:9.1e}  {chosen}", flush=True)
    if args.all:
        for i in names:
            r = res[names[i]]
            mark = "*" if i in pruned else " "
            print(f"{'':46} {names[i] + mark:<18} " + (f"{r[0]:8.1f} {lib_us / r[0]:6.2f}x {r[1]:9.1e}"
                                                        if r else "refused"), flush=True)
    return {"layer": name, "in": fin, "out": fout, "act": act, "direction": direction, "batch": batch,
            "m": m, "n": n, "k": k, "cublaslt_us": round(lib_us, 2),
            "best_tile": names[best] if best is not None else None,
            "best_tile_us": round(ran[best][0], 2) if best is not None else None,
            "speedup": round(lib_us / ran[best][0], 3) if best is not None else None,
            "best_tile_maxdiff": ran[best][1] if best is not None else None, "worst_tile_maxdiff": worst,
            "compiler_choice": chosen, "pruned": sorted(names[i] for i in pruned),
            "tiles": {names[i]: (None if res[names[i]] is None else
                                 {"us": round(res[names[i]][0], 2), "maxdiff": res[names[i]][1]}) for i in names}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256", help="batches of the forward and dx rows")
    ap.add_argument("--forward-batches", default="1", help="further batches, forward only (inference)")
    ap.add_argument("--layers", default="", help="comma-separated prefixes of the layer names (default: all)")
    ap.add_argument("--all", action="store_true", help="also every tile's time and difference")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in the timed graph")
    ap.add_argument("--reps", type=int, default=3, help="best of this many timings")
    ap.add_argument("--json", help="write the rows (every tile's time) to this file")
    args = ap.parse_args()
    prefixes = [p for p in args.layers.split(",") if p]
    both = [int(v) for v in args.batches.split(",") if v]
    fwd_only = [int(v) for v in args.forward_batches.split(",") if v and int(v) not in both]
    tiles = _C.skinny_gemm_tiles()
    print(f"us a call replayed in a CUDA graph (best of {args.reps} x {args.calls}); dx rows: the whole "
          "linear_backward (cuBLASLt's dw beside);\ndiff: max |difference| from cuBLASLt's output; "
          "* kept by skinny_tiles")
    print("tiles:", ", ".join(f"{skinny_gemm_name(t)} ({t[2]} threads)" for t in tiles))
    print(f"{'layer':<19} {'dir':<8} {'batch':<6} {'cuBLASLt':>9}  {'best tile':<18} {'us':>8} {'speed':>7} "
          f"{'diff':>9} {'worst diff':>9}  compiler")
    rows = []
    for batch in sorted(both + fwd_only):
        for name, (fin, fout, act, dx_needed) in LAYERS.items():
            if prefixes and not any(name.startswith(p) for p in prefixes):
                continue
            rows.append(bench(name, batch, fin, fout, act, "forward", tiles, args))
            if dx_needed and batch in both:
                rows.append(bench(name, batch, fin, fout, act, "dx", tiles, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
