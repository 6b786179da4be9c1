"""A zoo network's compiled b64 step (benchmarks/bench_zoo.py's names) built N times in one process: its time a step
(best of 3 x 200, synchronised) and the plan's timed choices (explain), to see what moves between builds.

    python3 benchmarks/step_choices.py lenet5_16_32_fc512 3
"""
import sys
import time
import cydnn
from bench_zoo import train_setup

name, builds = sys.argv[1], int(sys.argv[2])
for k in range(builds):
    model, opt, x, y, shape = train_setup(name, 64)
    step = cydnn.compile(model, opt, batch_size=64, input_shape=shape)
    step(x, y)
    cydnn.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(200):
            step(x, y)
        cydnn.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
    print(f"#### build {k}: {best:.1f} us a step; fused: {str(step.info().get('fused_train'))[:300]}")
    for line in step.explain().splitlines():
        if "timed" in line or "plan (" in line or "max_pool" in line:
            print(line[:260])
