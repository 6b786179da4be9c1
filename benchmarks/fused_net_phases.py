#!/usr/bin/env python3
"""Where a fused network's generated kernel spends one image: the whole form (fused_net_gen.source) for a cluster of
16 blocks, with a stamp (%globaltimer and clock64) written by block rank 0's thread 0 before the input's load, after
it, after every layer's cluster barrier and after the output -- so each phase is a layer's work, its distributed
stores and the barrier where every block waits for the slowest.  The stamps go past the outputs in y; the
instrumented kernel's time queued is printed beside the plain one's (the stamps cost 0.1-0.4 us).  On the GPU:

    python3 benchmarks/fused_net_phases.py cnn32_24_48_96,allconv_stride2
    python3 benchmarks/fused_net_phases.py cnn32_24_48_96 --headers /tmp/changed_cpp   # A/B, same process

With --headers DIR (repeatable) the same source is also compiled with DIR's headers -- a copy of cpp/ with a change
to the layer code (a benchmarks/dev patch applied there) --, so a change to the generated kernels is timed against
the installed one on one machine, without rebuilding the library; the variants run in turn, in rounds, and each
one's outputs are checked against the library's interpreter (and its bits against the installed headers').

Session 34 (H100): the CNN's 24.2 us were load 1.8, conv1 4.0, conv2 6.6, conv3 6.7, fc 1536->128 3.1, fc 128->10
1.9, softmax 0.1 (docs/performance/zoo-session-34.md).  Session 35, with tile 7's 4x4 patch: 21.8 us, conv1 4.00,
conv2 5.15, conv3 5.73 (docs/performance/zoo-session-35.md).
"""
import argparse
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
        elif line.strip() in ("cluster.sync();", "__syncthreads();"):     # a layer's barrier (a block's own before
            # a tail: cpp/fused_net_layers.cuh's linear_tail, whose rank-0 sum then falls in the "output" phase)
            out.append(f"        STAMP({k});")
            k += 1
    return STAMP + "\n".join(out), k


def _stamps(table, x, y, kernel, k, calls):
    """(ns, cycles) between consecutive stamps, one row a call."""
    ns, cycles = [], []
    for _ in range(calls):
        table.forward(x, y, 1, RANKS, kernel)
        _C.synchronize()
        v = y.numpy()[OFFSET:OFFSET + 4 * k].view(np.uint64).reshape(k, 2).astype(np.int64)
        ns.append(np.diff(v[:, 0]))
        cycles.append(np.diff(v[:, 1]))
    return ns, cycles


def phases(name, calls=300, header_dirs=(), rounds=3):
    """Print the phases of ``name``'s generated kernel; with ``header_dirs``, also of the same source compiled with
    each folder's headers (fused_net_gen.headers: a changed copy of cpp/), measured in rounds taken in turn on this
    machine, each variant's outputs checked against the library's interpreter."""
    model, shape = bench_zoo.build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
    table, (bound, wcap) = net.tables[RANKS], net._bound[RANKS]
    if net.out_size > OFFSET:
        raise SystemExit(f"{name}: {net.out_size} outputs overlap the stamps at {OFFSET}")
    plain = fg.source(bound, RANKS, wcap, net._bufs[RANKS], net.in_size, net.out_size, False)
    text, k = instrument(plain)
    labels = ["installed"] + [str(d) for d in header_dirs]
    kernels = [tuple(_C.NetKernel(fg.compile_cubin(t, header_dir=d), fg.KERNEL_NAME, RANKS) for t in (text, plain))
               for d in (None, *header_dirs)]          # (stamped, plain) a variant
    x = _C.to_device(np.random.default_rng(3).standard_normal(net.in_size).astype(np.float32))
    y, y0 = _C.empty((OFFSET + 4 * k,)), _C.empty((net.out_size,))

    def run(kernel=None):                              # NaN first: a kernel that stores nothing cannot pass
        out = _C.to_device(np.full(net.out_size, np.nan, np.float32))
        table.forward(x, out, 1, RANKS, kernel)
        return out.numpy()

    want = run()                                       # the interpreter: what every variant must give
    outs = [run(kernel) for _, kernel in kernels]
    print(f"{name}: layers {[(d['op'], d.get('tile'), d.get('pool')) for d in bound]}")
    per = [([], []) for _ in kernels]
    queued = [([], []) for _ in kernels]               # (plain, stamped)
    for _ in range(rounds):                            # the variants in turn, so that the machine's drift is shared
        for v, (stamped, kernel) in enumerate(kernels):
            ns, cycles = _stamps(table, x, y, stamped, k, max(1, calls // rounds))
            per[v][0].extend(ns)
            per[v][1].extend(cycles)
            queued[v][0].append(time_calls(lambda: table.forward(x, y0, 1, RANKS, kernel), 300) * 1e6)
            queued[v][1].append(time_calls(lambda: table.forward(x, y, 1, RANKS, stamped), 300) * 1e6)
    names = ["load"] + [f"{d['op']} {d.get('c')}->{d.get('k')}" + (" +pool" if d.get("pool") else "") for d in bound]
    names.append("output")
    for v, label in enumerate(labels):
        ns, cycles = np.median(per[v][0], axis=0), np.median(per[v][1], axis=0)
        tag = f"{name}" + (f" [{label}]" if header_dirs else "")
        print(f"{tag}: phases (median of {len(per[v][0])}), us: "
              + ", ".join(f"{n} {t / 1e3:.2f}" for n, t in zip(names, ns)) + f"; total {ns.sum() / 1e3:.2f} us, "
              f"{cycles.sum():.0f} cycles ({cycles.sum() / ns.sum() * 1e3:.0f} MHz)")
        diff = float(np.abs(outs[v] - want).max())         # NaN where the kernel left an output unwritten
        same = "bits equal" if np.array_equal(outs[v], outs[0]) else "bits differ"
        print(f"{tag}: queued, instrumented {min(queued[v][1]):.1f} us, plain {min(queued[v][0]):.1f} us (best of "
              f"{rounds} rounds of 300); outputs: max |kernel - interpreter| {diff:.2e}"
              + (f", {same} to the installed headers'" if v else ""), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("networks", nargs="?", default="cnn32_24_48_96", help="zoo names, comma-separated")
    p.add_argument("--headers", action="append", default=[], metavar="DIR",
                   help="also time the kernel compiled with DIR's headers (a changed copy of cpp/); repeatable")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    for n in a.networks.split(","):
        phases(n, a.calls, a.headers)
