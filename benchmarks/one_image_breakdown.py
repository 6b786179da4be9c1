"""Where a one-image numpy call on the fused network goes, layer of the call by layer (the compiler's choice of
cluster, its generated kernel once NVRTC is done), p50 of 3,000 calls each, µs:

  infer(x)             the compiled inference, as a user calls it
  net.run_host         the fused network's numpy call (no lock, no bucket, no check for replaced weights)
  table.run_mapped     the C call: the image copied into mapped pinned memory, one launch, one wait, copied out
  device launch+sync   the image already on the device: one launch and one stream synchronisation
  device queued        300 launches between two synchronisations: the kernel's own time
  interp ...           the same two with the interpreter instead of the generated kernel

For LeNet-5 (lenet5, lenet5_classic) the layers are its own: infer(x), the LeNetPredictor (one C call: mapped
memory, a graph, a wait), the kernel launched on device arrays and synchronised, and queued.

Usage (on the GPU machine): python3 benchmarks/one_image_breakdown.py cnn32_24_48_96,allconv_stride2
(docs/performance.md, session 26, ran this as .diag/s26_one.py, the same code.)
"""
import os
import sys

import numpy as np

import cydnn
from cydnn import _C
from cydnn.compiler.executor import time_calls

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_zoo  # noqa: E402
from bench_inference import percentile_us  # noqa: E402


def p50(fn, n=3000):
    return round(percentile_us(fn, n)["p50_us"], 1)


def main(names):
    for name in names:
        model, shape = bench_zoo.build(name)
        model.to("cuda").eval()
        one = np.random.default_rng(3).standard_normal((1,) + shape).astype(np.float32)
        infer = cydnn.compile(model, input_shape=shape, softmax=True)
        infer(one)
        gen = infer.wait_generated()
        if infer._lenet is not None:               # LeNet-5's own kernels (cpp/fused_lenet.cu, cpp/fastpath.cu)
            lenet(name, infer, one)
            continue
        fused = infer._fused
        c = fused.cluster(1) if fused is not None else None
        if c in (None, "?"):
            print(name, "the plan serves one image:", p50(lambda: infer(one)))
            continue
        net = fused.net
        k = net.generated.get(c)
        table = net.tables[c]
        out = np.empty((1,) + net.out_shape, np.float32)
        net.run_host(one, c)                      # makes the mapped buffers
        dx, dy = _C.to_device(one.ravel()), _C.empty((net.out_size,))
        r = {"infer(x)": p50(lambda: infer(one)),
             "net.run_host": p50(lambda: net.run_host(one, c)),
             "table.run_mapped": p50(lambda: table.run_mapped(one, out, *net._mapped, c, k)),
             "device launch+sync": p50(lambda: (table.forward(dx, dy, 1, c, k), _C.synchronize())),
             "device queued": round(1e6 * min(time_calls(lambda: table.forward(dx, dy, 1, c, k), 300)
                                              for _ in range(3)), 1),
             "interp launch+sync": p50(lambda: (table.forward(dx, dy, 1, c), _C.synchronize())),
             "interp queued": round(1e6 * min(time_calls(lambda: table.forward(dx, dy, 1, c), 300)
                                              for _ in range(3)), 1)}
        print(f"{name} cluster {c} generated={k is not None}: {r}; generated kernels {gen}", flush=True)


def lenet(name, infer, one):
    """The same layers for LeNet-5 (modern or classic), whose one image runs its own kernel: the cluster kernel of
    four blocks for a few images, else one block an image (the C call picks: CYDNN_LENET_CLUSTER_MAX)."""
    lp = infer._lenet
    images = one.reshape(1, one.shape[-2], one.shape[-1])
    pd = tuple(p.data for p in lp.params)
    dx, dy = _C.to_device(np.full((1, 28, 28), 0.5, np.float32)), _C.empty((1, lp.num_classes))   # a raw image

    def forward():
        _C.lenet_forward(lp.classic, lp.num_classes, pd, dx, dy, 0.0, 1.0, True)
    r = {"infer(x)": p50(lambda: infer(one)),
         "LeNetPredictor": p50(lambda: lp(images)),
         "device launch+sync": p50(lambda: (forward(), _C.synchronize())),
         "device queued": round(1e6 * min(time_calls(forward, 300) for _ in range(3)), 1),
         "bare synchronize": p50(_C.synchronize)}
    print(f"{name} (LeNet-5's kernels, full-size float input: {lp.full}): {r}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["cnn32_24_48_96", "allconv_stride2"])
