#!/usr/bin/env python3
"""Where a fused network's generated kernel spends one image: the whole form (fused_net_gen.source) for a cluster of
16 blocks, with a stamp (%globaltimer and clock64) written by block rank 0's thread 0 before the input's load, after
it, after every layer's cluster barrier and after the output -- so each phase is a layer's work, its distributed
stores and the barrier where every block waits for the slowest.  The stamps go past the outputs in y; the
instrumented kernel's time queued is printed beside the plain one's (the stamps cost 0.1-0.4 us).  On the GPU:

    python3 benchmarks/fused_net_phases.py cnn32_24_48_96,allconv_stride2

Session 34 (H100): the CNN's 24.2 us were load 1.8, conv1 4.0, conv2 6.6, conv3 6.7, fc 1536->128 3.1, fc 128->10
1.9, softmax 0.1 (docs/performance/zoo-session-34.md).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("CYDNN_KERNEL_CACHE", "off")   # the instrumented source is compiled here, never cached
import bench_zoo  # noqa: E402
from cydnn import _C  # noqa: E402
from cydnn.compiler import fused_net as fn, fused_net_gen as fg  # noqa: E402
from cydnn.compiler.executor import time_calls  # noqa: E402
from cydnn.compiler.trace import trace  # noqa: E402

RANKS = 16
OFFSET = 16            # floats of y before the stamps (past the outputs of the zoo's networks, 8-byte aligned)
STAMP = ('#define STAMP(k) do { if (rank == 0 && threadIdx.x == 0) { unsigned long long t_; '
         'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); long long c_ = clock64(); '
         f'((unsigned long long *)(y + {OFFSET}))[2 * (k)] = t_; ((long long *)(y + {OFFSET}))[2 * (k) + 1] = c_; }} '
         '} while (0)\n')


def instrument(text):
    """The generated source with STAMP(k) calls; returns (text, number of stamps)."""
    out, k = [], 0
    for line in text.split("\n"):
        if "load_input(" in line and "CYDNN_NET_FN" not in line:
            out += [f"    STAMP({k});", line, f"    STAMP({k + 1});"]
            k += 2
            continue
        out.append(line)
        if line.strip().startswith("if (rank == 0) write_output"):
            out.append(f"    STAMP({k});")
            k += 1
        elif line.strip() == "cluster.sync();":
            out.append(f"        STAMP({k});")
            k += 1
    return STAMP + "\n".join(out), k


def phases(name, calls=300):
    model, shape = bench_zoo.build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
    table, (bound, wcap) = net.tables[RANKS], net._bound[RANKS]
    if net.out_size > OFFSET:
        raise SystemExit(f"{name}: {net.out_size} outputs overlap the stamps at {OFFSET}")
    plain = fg.source(bound, RANKS, wcap, net._bufs[RANKS], net.in_size, net.out_size, False)
    text, k = instrument(plain)
    stamped = _C.NetKernel(fg.compile_cubin(text), fg.KERNEL_NAME, RANKS)
    kernel = _C.NetKernel(fg.compile_cubin(plain), fg.KERNEL_NAME, RANKS)
    x = _C.to_device(np.random.default_rng(3).standard_normal(net.in_size).astype(np.float32))
    y, y0 = _C.empty((OFFSET + 4 * k,)), _C.empty((net.out_size,))
    ns, cycles = [], []
    for _ in range(calls):
        table.forward(x, y, 1, RANKS, stamped)
        _C.synchronize()
        v = y.numpy()[OFFSET:OFFSET + 4 * k].view(np.uint64).reshape(k, 2).astype(np.int64)
        ns.append(np.diff(v[:, 0]))
        cycles.append(np.diff(v[:, 1]))
    ns, cycles = np.median(ns, axis=0), np.median(cycles, axis=0)
    names = ["load"] + [f"{d['op']} {d.get('c')}->{d.get('k')}" + (" +pool" if d.get("pool") else "") for d in bound]
    names.append("output")
    print(f"{name}: layers {[(d['op'], d.get('tile'), d.get('pool')) for d in bound]}")
    print(f"{name}: phases (median of {calls}), us: "
          + ", ".join(f"{n} {t / 1e3:.2f}" for n, t in zip(names, ns)) + f"; total {ns.sum() / 1e3:.2f} us, "
          f"{cycles.sum():.0f} cycles ({cycles.sum() / ns.sum() * 1e3:.0f} MHz)")
    stamped_us = min(time_calls(lambda: table.forward(x, y, 1, RANKS, stamped), 300) for _ in range(3)) * 1e6
    plain_us = min(time_calls(lambda: table.forward(x, y0, 1, RANKS, kernel), 300) for _ in range(3)) * 1e6
    print(f"{name}: queued, instrumented {stamped_us:.1f} us, plain {plain_us:.1f} us", flush=True)


if __name__ == "__main__":
    for n in (sys.argv[1] if len(sys.argv) > 1 else "cnn32_24_48_96").split(","):
        phases(n)
