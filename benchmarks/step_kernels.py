"""One compiled training step (b64) of a zoo network (benchmarks/bench_zoo.py's names) under ncu: each kernel's
duration. PyTorch's profiler start/stop brackets the one step (cudaProfilerStart is process-wide). Caveat: ncu's
interception slows the launches the plan times while it is built, so the plan may choose other kernels than it does
without ncu; the small kernels' durations carry over, the choices do not.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/step_kernels.py cnn32_24_48_96
"""
import sys
import torch
import cydnn
from bench_zoo import train_setup

name = sys.argv[1]
model, opt, x, y, shape = train_setup(name, 64)
step = cydnn.compile(model, opt, batch_size=64, input_shape=shape)
for _ in range(5):
    step(x, y)
cydnn.cuda.synchronize()
torch.cuda.profiler.start()
step(x, y)
cydnn.cuda.synchronize()
torch.cuda.profiler.stop()
print("done")
