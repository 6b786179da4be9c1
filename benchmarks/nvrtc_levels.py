"""NVRTC's -Ofast-compile levels ($CYDNN_NVRTC_FAST_COMPILE): for each zoo network's one-image kernel at a
cluster of 16, each level's NVRTC time (each compile in a fresh child process, as the compiler runs them, no disk
cache: a compile at an -Ofast-compile level changes what later compiles in the same process give -- NVRTC 13,
seen in session 26, after session 21's figures were taken in one process), the largest difference of its outputs
from the interpreter's, and its time per launch against the interpreter's (best of 3 x 300).

    python3 benchmarks/nvrtc_levels.py lenet5_16_32_fc512,cnn32_24_48_96,allconv_stride2,smallcnn_bn
"""
import os
import sys

import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_zoo  # noqa: E402
from cydnn import _C  # noqa: E402
from cydnn.compiler import fused_net, fused_net_gen, nvrtc_jobs  # noqa: E402
from cydnn.compiler.executor import time_calls  # noqa: E402
from cydnn.compiler.trace import trace  # noqa: E402
LEVELS = ("off", "min", "mid", "max")
os.environ["CYDNN_KERNEL_CACHE"] = "off"
bench_zoo.fresh_caches()     # and NVRTC's own cache (the driver's compute cache) empty
for name in sys.argv[1].split(","):
    model, shape = bench_zoo.build(name)
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    layers = fused_net.describe(nodes)
    if not isinstance(layers, list):
        print(name, "refused", layers)
        continue
    net = fused_net.FusedNetwork(layers, shape, nodes[-1].out_shape[1:], False, 4)
    c = 16
    text = net._source(c)
    x = _C.to_device(np.random.default_rng(0).standard_normal(4 * net.in_size).astype(np.float32))
    ref, out = _C.empty((4 * net.out_size,)), _C.empty((4 * net.out_size,))
    table = net.tables[c]
    table.forward(x, ref, 4, c)
    kernels, row = {}, []
    for lv in LEVELS:
        os.environ["CYDNN_NVRTC_FAST_COMPILE"] = lv
        assert lv == "off" or fused_net_gen._options("sm_90")[-1] == "-Ofc=" + lv
        gen = nvrtc_jobs.Generation(text)
        gen.wait()
        cubin, dt = gen.result(), gen.seconds
        k = _C.NetKernel(cubin, fused_net_gen.KERNEL_NAME, c)
        table.forward(x, out, 4, c, k)
        diff = float(np.max(np.abs(out.numpy() - ref.numpy())))
        kernels[lv] = k
        row.append(f"{lv}: nvrtc {dt:.2f} s diff {diff:.1e}")
    os.environ.pop("CYDNN_NVRTC_FAST_COMPILE")
    times = {lv: [] for lv in ["interp"] + list(LEVELS)}
    for rep in range(3):
        times["interp"].append(time_calls(lambda: table.forward(x, out, 1, c), 300))
        for lv, k in kernels.items():
            times[lv].append(time_calls(lambda k=k: table.forward(x, out, 1, c, k), 300))
    print(name, " | ".join(row))
    print("   us per launch (best of 3):", {lv: round(1e6 * min(v), 1) for lv, v in times.items()}, flush=True)
