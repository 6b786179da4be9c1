#!/usr/bin/env python3
"""The fused network's fixed cost per call: a plain kernel (ReLU of 16 values) beside the fused-network
kernel on tiny networks, per cluster size: back-to-back launches (per call), launch + synchronize
(p50), and a numpy call through mapped memory (p50), in us.  On the GPU machine:

    PYTHONPATH=python python3 benchmarks/fused_net_fixed_cost.py

Results: docs/performance.md, "Session 17".
"""
import sys, time
import numpy as np
import cydnn
from cydnn import _C, nn
from cydnn.compiler import fused_net
from cydnn.compiler.executor import time_calls
from cydnn.compiler.trace import trace

def per_call(fn, calls=400):
    """Back to back, between two synchronisations: the compiler's own timing (executor.time_calls)."""
    for _ in range(50): fn()
    return round(1e6 * time_calls(fn, calls), 1)

def p50_sync(fn, calls=1000):
    for _ in range(100): fn(); _C.synchronize()
    t = []
    for _ in range(calls):
        t0 = time.perf_counter(); fn(); _C.synchronize(); t.append(time.perf_counter() - t0)
    return round(1e6 * float(np.median(t)), 1)

x1 = _C.to_device(np.ones(16, np.float32)); y1 = _C.empty((16,))
print("relu 16 values: back-to-back", per_call(lambda: _C.relu_forward(x1, y1)), "us; launch+sync p50", p50_sync(lambda: _C.relu_forward(x1, y1)))
nets = {"linear 784->10": (nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), (1, 28, 28)),
        "relu 1x4x4": (nn.Sequential(nn.ReLU()), (1, 4, 4)),
        "relu 1x28x28": (nn.Sequential(nn.ReLU()), (1, 28, 28)),
        "conv 1->32 s2 (allconv conv1)": (nn.Sequential(nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.ReLU()), (1, 28, 28)),
        "conv1+conv2 of allconv": (nn.Sequential(nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU()), (1, 28, 28)),
        "big smem relu 3x64x64 (98 KB)": (nn.Sequential(nn.ReLU()), (3, 64, 64))}
for name, (model, shape) in nets.items():
    model.to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 4)
    one = np.random.default_rng(0).standard_normal((1,) + shape).astype(np.float32)
    row = []
    for r in fused_net.CLUSTERS:
        bb = per_call(lambda: net.forward(net._dx, net._dy, 1, r))
        ls = p50_sync(lambda: net.forward(net._dx, net._dy, 1, r))
        nh = p50_sync(lambda: net.run_host(one, r))
        row.append(f"c{r}: {bb}/{ls}/{nh}")
    print(f"{name:32s} smem {net.tables[1].smem_bytes:6d} B  back-to-back/launch+sync/numpy mapped:", "  ".join(row), flush=True)
