#!/usr/bin/env python3
"""Where a compiled step's GPU time goes: every kernel of one replayed step, with its duration.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 tools/profile_step.py MODEL [--batch 64] [--infer] [--torch]  > out.csv

MODEL is a name of benchmarks/bench_zoo.py's zoo.  The script compiles the step, runs it a few times
(algorithm search, capture), then brackets ONE graph replay with cudaProfilerStart/Stop, so ncu
profiles exactly the kernels of one step (ncu times each kernel on its own: launch gaps are not in it).
``--torch``: the same for PyTorch's step (bench_zoo's twin, SGD momentum, the whole step one CUDA graph),
so the two kernel lists can be set side by side.
"""
import argparse
import ctypes
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_zoo  # noqa: E402

import cydnn  # noqa: E402
from cydnn import optim  # noqa: E402


def cudart():
    import nvidia
    for base in nvidia.__path__:
        for path in glob.glob(os.path.join(base, "cu13", "lib", "libcudart.so*")):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--infer", action="store_true")
    p.add_argument("--torch", action="store_true", help="profile PyTorch's graph of the same step instead")
    a = p.parse_args()
    model, shape = bench_zoo.build(a.model)
    if a.torch:
        return torch_step(model, shape, a.batch)
    model.to("cuda")
    rng = np.random.default_rng(0)
    x = cydnn.to_device(rng.standard_normal((a.batch,) + shape).astype(np.float32))
    y = cydnn.to_device(rng.integers(0, 10, a.batch).astype(np.int32))
    if a.infer:
        model.eval()
        f = cydnn.compile(model, input_shape=shape, softmax=True)
        run = lambda: f(x)  # noqa: E731
    else:
        step = cydnn.compile(model, optim.SGD(model.parameters(), lr=0.01, momentum=0.9), batch_size=a.batch)
        run = lambda: step(x, y)  # noqa: E731
    for _ in range(5):
        run()
    cydnn.cuda.synchronize()
    rt = cudart()
    rt.cudaProfilerStart()
    run()
    cydnn.cuda.synchronize()
    rt.cudaProfilerStop()
    print((f.explain(a.batch) if a.infer else step.explain(shape)).split("buffers:")[0], file=sys.stderr)


def torch_step(model, shape, batch):
    import torch
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    replay = bench_zoo.torch_step(model, shape, batch, graph=True)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    replay()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
