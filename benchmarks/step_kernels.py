"""One compiled training step (b64) of a zoo network (benchmarks/bench_zoo.py's names) under ncu: each kernel's
duration. PyTorch's profiler start/stop brackets the one step (cudaProfilerStart is process-wide). Caveat: ncu's
interception slows the launches the plan times while it is built, so the plan may choose other kernels than it does
without ncu; the small kernels' durations carry over, the choices do not.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/step_kernels.py cnn32_24_48_96
"""
import sys
import numpy as np
import torch
import cydnn
from cydnn import optim
from bench_zoo import build

name = sys.argv[1]
model, shape = build(name)
model.to("cuda")
opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
rng = np.random.default_rng(1)
x = cydnn.to_device(rng.standard_normal((64,) + shape).astype(np.float32))
y = cydnn.to_device(rng.integers(0, 10, 64).astype(np.int32))
step = cydnn.compile(model, opt, batch_size=64, input_shape=shape)
for _ in range(5):
    step(x, y)
cydnn.cuda.synchronize()
torch.cuda.profiler.start()
step(x, y)
cydnn.cuda.synchronize()
torch.cuda.profiler.stop()
print("done", step.info().get("step_us") if hasattr(step, "info") else "")
