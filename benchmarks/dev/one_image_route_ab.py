"""A/B of the one-image route (compiler/inference.py's ``_settle_one``, _C.MappedCall; session 38): a compiled
inference's ``infer(x)`` p50 for one numpy image with the route and with it kept off (``_settle_one`` a no-op, so
every call takes the general path), in turn over 3 rounds of 3,000 calls, each zoo network's generated kernels
adopted first.  On the GPU machine:

    python3 benchmarks/dev/one_image_route_ab.py cnn32_24_48_96,mlp_784_128_10,lenet5_16_32_fc512,allconv_stride2

Session 38, H100 (µs, route / general): CNN 32.8-34.5 / 38.8-43.7, MLP 784-128-10 16.6-16.7 / 18.9-22.5,
LeNet 16/32 26.0-27.2 / 29.2-30.1, all-conv 28.8-29.3 / 31.4-33.4 (docs/performance/zoo-session-38.md).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_zoo  # noqa: E402
import cydnn  # noqa: E402
from bench_inference import percentile_us  # noqa: E402


def ab(name, rounds=3, calls=3000):
    model, shape = bench_zoo.build(name)
    model.to("cuda").eval()
    one = np.random.default_rng(3).standard_normal((1,) + shape).astype(np.float32)
    infer = cydnn.compile(model, input_shape=shape, softmax=True)
    infer(one)
    infer(one)
    infer.wait_generated()
    infer(one)
    settle = infer._settle_one
    res = {"route": [], "general": []}
    for _ in range(rounds):
        for mode in res:
            if mode == "general":
                infer._settle_one, infer._one = (lambda cluster: None), None
            else:
                infer._settle_one = settle
                infer(one)                         # settles the route again
            res[mode].append(round(percentile_us(lambda: infer(one), calls)["p50_us"], 1))
    print(name, res, flush=True)


if __name__ == "__main__":
    for n in (sys.argv[1] if len(sys.argv) > 1 else "cnn32_24_48_96").split(","):
        ab(n)
