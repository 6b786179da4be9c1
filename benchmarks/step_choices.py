"""A zoo network's compiled b64 step (benchmarks/bench_zoo.py's names) built N times in one process: its time a step
(best of 3 x 200, synchronised) and the plan's timed choices (explain), to see what moves between builds.

    python3 benchmarks/step_choices.py lenet5_16_32_fc512 3
"""
import sys
import time
import numpy as np
import cydnn
from cydnn import optim
from bench_zoo import build

name, builds = sys.argv[1], int(sys.argv[2])
for k in range(builds):
    model, shape = build(name)
    model.to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(1)
    x = cydnn.to_device(rng.standard_normal((64,) + shape).astype(np.float32))
    y = cydnn.to_device(rng.integers(0, 10, 64).astype(np.int32))
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
