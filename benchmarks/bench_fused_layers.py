"""The fused network's one-image layers (cpp/fused_net_conv.cuh, fused_net_wsplit.cuh), one layer at a time.

  --tiles  each convolution of each network alone in a table (its input random), every tile code timed on
           device arrays, minus an epilogue-only table of the same input (launch, the input's broadcast,
           one barrier: 'base').  '*' marks the tile the network's table took (timed among the cost model's
           best at 4-16 blocks: compiler/fused_tiles.py's tune).
  --fold   each network's whole table on one image with its 2x2 poolings folded into the convolutions
           before them where that timed faster ($CYDNN_FUSED_FOLD=auto) and with none folded (off), and
           explain()'s line of the tiles and folds at 16 blocks.
  --prefix the kernel generated (NVRTC) for each prefix of each network's table, timed: what each layer adds
           to the generated kernel, and to the interpreter's.

Usage (on the GPU machine): python3 benchmarks/bench_fused_layers.py --tiles|--fold|--prefix [--models a,b] [--clusters 8,16]
"""
import argparse
import os
import sys

import numpy as np

import cydnn
from cydnn import _C
from cydnn.compiler import fused_net as fn, fused_tiles as ft
from cydnn.compiler.executor import time_calls
from cydnn.compiler.trace import trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zoo import build  # noqa: E402

CNNS = "cnn32_24_48_96,smallcnn_bn,lenet5_16_32_fc512,allconv_stride2"


def _us(table, x, y, r):
    return 1e6 * min(time_calls(lambda: table.forward(x, y, 1, r), 200) for _ in range(3))


def _table(net, d, r, tile=None):
    d = dict(d) if tile is None else dict(d, tile=tile)
    room = fn.SMEM_LIMIT // 4 - 2 * net._buf_floats
    wcap = min(room, ft.staged(d, r)) if d["op"] == "conv" else 0
    return _C.FusedNet([d], d["c"] * d["h"] * d["w"], ft.size(d), False, wcap), wcap >= ft.staged(d, r)


def tiles(name, clusters):
    model, shape = build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    os.environ["CYDNN_FUSED_FOLD"] = "off"
    net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
    for r in clusters:
        for i, d in enumerate(net._bound[r][0]):
            if d["op"] != "conv":
                continue
            x = _C.to_device(np.random.default_rng(1).standard_normal(d["c"] * d["h"] * d["w"]).astype(np.float32))
            base_table, _ = _table(net, {"op": "epilogue", "c": d["c"], "h": d["h"], "w": d["w"], "epi": []}, r)
            base = _us(base_table, x, _C.empty((d["c"] * d["h"] * d["w"],)), r)
            cells = []
            for code, *_ in ft.TILES:
                table, staged = _table(net, d, r, code)
                cells.append(f"t{code}{'*' if code == d['tile'] else ''} {_us(table, x, _C.empty((ft.size(d),)), r) - base:.1f}"
                             + ("" if staged else " (unstaged)"))
            macs = d["k"] * d["oh"] * d["ow"] * d["c"] * d["kh"] * d["kw"]
            print(f"{name} {r} blocks, layer {i} {d['c']}x{d['h']}x{d['w']} -> {d['k']}x{d['oh']}x{d['ow']} "
                  f"({macs / 1e6:.2f} M MAC), base {base:.1f} us | " + " | ".join(sorted(cells)), flush=True)


def fold(name, clusters):
    model, shape = build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    layers = fn.describe(nodes)
    x = _C.to_device(np.random.default_rng(3).standard_normal(int(np.prod(shape))).astype(np.float32))
    timed = {}
    for mode in ("off", "auto"):
        os.environ["CYDNN_FUSED_FOLD"] = mode
        net = fn.FusedNetwork(layers, shape, nodes[-1].out_shape[1:], False, 1)
        y = _C.empty((net.out_size,))
        for r in clusters:
            timed[f"{mode}/{r}"] = round(_us(net.tables[r], x, y, r), 1)
    print(f"{name}: the whole table on one image, us (folds/blocks): {timed}")
    print("  " + next(line for line in net.explain().splitlines() if "tiles" in line))


def prefix(name, clusters):
    """The kernel generated for each prefix of the network's table (layers 0..i, its tiles and folds as the
    compiler chose them), timed on one image of device arrays: what each layer adds to the generated
    kernel, beside what it adds to the interpreter's."""
    from cydnn.compiler import fused_net_gen, nvrtc_jobs
    model, shape = build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
    x = _C.to_device(np.random.default_rng(3).standard_normal(net.in_size).astype(np.float32))
    for r in clusters:
        bound, wcap = net._bound[r]
        tables = [_C.FusedNet(bound[:i + 1], net.in_size, ft.size(bound[i]), False, wcap) for i in range(len(bound))]
        gens = [nvrtc_jobs.Generation(fused_net_gen.source(bound[:i + 1], r, wcap, (t.smem_bytes // 4 - wcap) // 2,
                                                           net.in_size, ft.size(bound[i]), False))
                for i, t in enumerate(tables)]
        last_i = last_g = 0.0
        cells = []
        for d, t, g in zip(bound, tables, gens):
            g.wait()
            kernel = _C.NetKernel(g.result(), fused_net_gen.KERNEL_NAME, r)
            y = _C.empty((ft.size(d),))
            interp = _us(t, x, y, r)
            gen = 1e6 * min(time_calls(lambda: t.forward(x, y, 1, r, kernel), 200) for _ in range(3))
            label = d["op"] + (f" t{d['tile']}" if d["op"] == "conv" else "") + (" +pool" if d.get("pool") else "")
            cells.append(f"{label} {gen - last_g:+.1f} ({interp - last_i:+.1f}; NVRTC {g.seconds:.2f} s)")
            last_i, last_g = interp, gen
        print(f"{name} {r} blocks, generated kernel us per prefix, added by each layer (interpreter's): "
              + " | ".join(cells) + f" | whole: generated {last_g:.1f}, interpreter {last_i:.1f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--fold", action="store_true")
    p.add_argument("--prefix", action="store_true")
    p.add_argument("--models", default=CNNS)
    p.add_argument("--clusters", default="8,16")
    a = p.parse_args()
    if a.tiles + a.fold + a.prefix != 1:
        p.error("give one of --tiles, --fold and --prefix")
    clusters = [int(c) for c in a.clusters.split(",")]
    print(f"GPU {_C.device_name()}; cydnn {cydnn.__version__}")
    for name in a.models.split(","):
        (tiles if a.tiles else fold if a.fold else prefix)(name, clusters)


if __name__ == "__main__":
    main()
