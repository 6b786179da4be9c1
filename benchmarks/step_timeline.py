"""A zoo network's compiled b64 training step (benchmarks/bench_zoo.py's names) as a kernel timeline: 20 replayed
steps under torch.profiler with CUDA activities (CUPTI records every kernel and copy of the process -- ours, cuDNN's,
cuBLAS's, inside the CUDA graph), then one step printed: start, duration and end (us from the step's first event),
the stream, the kernel.  Shows what runs beside what and which stream bounds the backward.  PyTorch only observes;
it runs nothing of the step.

    python3 benchmarks/step_timeline.py allconv_stride2 [trace.json]
"""
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cydnn
from bench_zoo import train_setup

STEPS = 20


def main(name, path=None):
    model, opt, x, y, shape = train_setup(name, 64)
    step = cydnn.compile(model, opt, batch_size=64, input_shape=shape)
    for _ in range(100):
        step(x, y)
    cydnn.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        step(x, y)
    cydnn.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us a step (200 steps, no profiler)")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(x, y)
        cydnn.cuda.synchronize()
    path = path or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = sorted((e for e in json.load(open(path))["traceEvents"]
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    per = len(events) // STEPS
    one = events[STEPS // 2 * per:(STEPS // 2 + 1) * per]
    start = one[0]["ts"]
    print(f"{per} events a step; one step from its first event to its last: "
          f"{one[-1]['ts'] + one[-1]['dur'] - start:.1f} us (trace: {path})")
    for e in one:
        at = e["ts"] - start
        print(f"{at:8.1f} {e['dur']:7.1f} {at + e['dur']:8.1f}  s{e['args'].get('stream')}  {e['name'][:110]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
