"""The generated kernel's forms side by side, on one network of bench_zoo's zoo at a cluster of 16 blocks: the whole
form (every layer inlined), the layers form (one relocatable unit a layer, linked by the driver), the same linked
with the kernel's unit first, and the layers in 2 and 3 groups a unit (fused_net_gen.units(groups=...)).  For each:
the kernel's time (queued, best of 3 x 300 launches, us), whether it gives the interpreter's bits, and NVRTC's cold
seconds for each unit (the driver's compute cache, where NVRTC keeps what it compiled, removed before each
compile; the max is what units compiled side by side would take).  On the GPU machine:

    python3 benchmarks/generated_forms.py cnn32_24_48_96

With a variant after the network (whole, layers, kfirst, g2, g3) it only builds that one and launches it 30 times,
for ncu (docs/performance/zoo-session-28.md):

    ncu --kernel-name cydnn_fused_net_gen --launch-skip 20 --launch-count 1 --section WarpStateStats \
        --section SourceCounters python3 benchmarks/generated_forms.py cnn32_24_48_96 layers
"""
import os, sys, time, shutil
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["CYDNN_KERNEL_CACHE"] = "off"
import bench_zoo
from cydnn import _C
from cydnn.compiler import fused_net as fn, fused_net_gen as fg
from cydnn.compiler.executor import time_calls
from cydnn.compiler.trace import trace

name = sys.argv[1] if len(sys.argv) > 1 else "cnn32_24_48_96"
only = sys.argv[2] if len(sys.argv) > 2 else None
model, shape = bench_zoo.build(name)
model.to("cuda").eval()
nodes = trace(model, shape, 1)
net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
r = 16
table, (bound, wcap) = net.tables[r], net._bound[r]
args = (bound, r, wcap, net._bufs[r], net.in_size, net.out_size, False)
n = len(bound)
print(name, "layers:", [(d["op"], d.get("tile"), d.get("pool")) for d in bound], flush=True)


def cold(text, rdc):
    # NVRTC 12.9+ serves a source it compiled before from the driver's compute cache (bench_zoo.fresh_caches)
    shutil.rmtree(os.environ.get("CUDA_CACHE_PATH") or os.path.expanduser("~/.nv/ComputeCache"), ignore_errors=True)
    t = time.perf_counter()
    c = fg.compile_cubin(text, rdc=rdc)
    return c, time.perf_counter() - t


def build(variant):
    if variant == "whole":
        c, s = cold(fg.source(*args), False)
        return c, [s]
    groups = {"layers": None, "kfirst": None, "g2": [0, n // 2], "g3": [0, n // 3, (2 * n) // 3]}[variant]
    res = [cold(u, True) for u in fg.units(*args, groups=groups)]
    cubins = [c for c, _ in res]
    if variant == "kfirst":
        cubins = cubins[-1:] + cubins[:-1]
    return fg.link(cubins), [s for _, s in res]


x = _C.to_device(np.random.default_rng(3).standard_normal(net.in_size).astype(np.float32))
want, y = _C.empty((net.out_size,)), _C.empty((net.out_size,))
table.forward(x, want, 1, r)
for variant in ([only] if only else ["whole", "layers", "kfirst", "g2", "g3"]):
    cubin, secs = build(variant)
    k = _C.NetKernel(cubin, fg.KERNEL_NAME, r)
    for _ in range(30):
        table.forward(x, y, 1, r, k)
    _C.synchronize()
    if only:
        break
    same = bool(np.array_equal(y.numpy(), want.numpy()))
    us = 1e6 * min(time_calls(lambda: table.forward(x, y, 1, r, k), 300) for _ in range(3))
    print(f"{name} {variant:7s} {us:6.1f} us  bits {same}  nvrtc max {max(secs):.2f} s sum {sum(secs):.2f} s "
          f"units {len(secs)} [{' '.join(f'{s:.2f}' for s in secs)}]", flush=True)
