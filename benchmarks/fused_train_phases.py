#!/usr/bin/env python3
"""Where the fused training step's time goes (compiler/fused_train.py, cpp/fused_train.cu), on the GPU.

    python3 benchmarks/fused_train_phases.py lenet5,lenet5_16_32_fc512 1,2    # zoo models, cluster sizes

For each model of bench_zoo.py and cluster size: the step forced onto the fused kernels at batch 64, its
two kernels alone and the whole captured step (us per call), then one step with
``$CYDNN_FUSED_TRAIN_CLOCK=1``: %globaltimer at the train kernel's phase ends on image 0 (forward, saved
inputs, loss, each layer's backward), the end of its last block, and the weight kernel's start and end.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_zoo  # noqa: E402
import cydnn  # noqa: E402
from cydnn import optim  # noqa: E402
from cydnn.compiler.executor import time_calls  # noqa: E402

os.environ["CYDNN_FUSED_TRAIN"] = "force"
for name in sys.argv[1].split(","):
    for cl in (int(c) for c in sys.argv[2].split(",")):
        os.environ["CYDNN_FUSED_TRAIN_CLUSTER"] = str(cl)
        model, shape = bench_zoo.build(name)
        model.to("cuda")
        step = cydnn.compile(model, optim.SGD(model.parameters(), lr=0.01, momentum=0.9), batch_size=64,
                             input_shape=shape)
        rng = np.random.default_rng(1)
        x = cydnn.to_device(rng.standard_normal((64,) + shape).astype(np.float32))
        y = cydnn.to_device(rng.integers(0, 10, 64).astype(np.int32))
        step(x, y)
        cydnn.cuda.synchronize()
        runner = step._runners[(64, shape)]
        ft = runner.bound.calls[0][0].__self__
        both = time_calls(ft.enqueue, 50)
        whole = time_calls(runner.launch, 50)
        os.environ["CYDNN_FUSED_TRAIN_CLOCK"] = "1"
        ft.enqueue()
        cydnn.cuda.synchronize()
        os.environ["CYDNN_FUSED_TRAIN_CLOCK"] = "0"
        c = ft.clocks().astype(np.int64)
        t0 = c[0]
        names = ["fwd", "save", "loss"]
        parts = [f"{n} {(c[i + 1] - c[i]) / 1e3:.1f}" for i, n in enumerate(names)]
        prev = c[3]
        nl = len(runner.plan.steps[0].args["layers"])
        for l in range(nl - 1, -1, -1):
            v = c[4 + l]
            if v > prev and v - prev < 10**8:
                parts.append(f"L{l}:{runner.plan.steps[0].args['layers'][l]['op']} {(v - prev) / 1e3:.1f}")
                prev = v
        layers = runner.plan.steps[0].args["layers"]
        fwd, prev_f = [], t0
        for l in range(nl):
            v = c[40 + l]
            if prev_f < v < prev_f + 10**8:
                fwd.append(f"{layers[l]['op']} {(v - prev_f) / 1e3:.1f}")
                prev_f = v
        parts[0] += " (" + ", ".join(fwd) + ")"
        print(f"{name:22s} cluster {cl}: T+W {1e6 * both:.1f} us, graph step {1e6 * whole:.1f} us; image 0 "
              f"total {(prev - t0) / 1e3:.1f} us: " + ", ".join(parts)
              + f"; T's last block ends {(c[36] - t0) / 1e3:.1f}, W {(c[37] - t0) / 1e3:.1f} -> {(c[38] - t0) / 1e3:.1f}",
              flush=True)
