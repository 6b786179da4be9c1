"""Quick timings of the fast path, for tuning its launch settings (threads per block).

    CYDNN_TRAIN_THREADS=512 CYDNN_FWD_THREADS=256 CYDNN_FWD1_THREADS=1024 \\
        python3 benchmarks/tune_fast.py --mnist DIR

Prints one line: epoch seconds at batch 64 and 256 (compiled step), the
GPU-resident forward of 10,000 images, and predict() of one uint8 image
(p50 / p99).  The settings it is run with are read by cpp/fused_lenet.cu and cpp/fused_lenet_train.cu.
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import cydnn
from cydnn import _C, datasets, models, ops, optim


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mnist", required=True)
    p.add_argument("--profile", action="store_true", help="a few un-graphed steps and forwards, for ncu")
    args = p.parse_args()
    root = tempfile.mkdtemp()
    tr = datasets.MNIST(root=root, train=True, mirrors=[args.mnist])
    te = datasets.MNIST(root=root, train=False, mirrors=[args.mnist])
    out = {}
    for batch in (64, 256):
        model = models.LeNet5(seed=0).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)
        step = model.compile(opt, batch, cuda_graph=not args.profile)
        loader = datasets.DataLoader(tr.images, tr.labels, batch_size=batch, mean=model.mean, std=model.std,
                                     device="cuda")
        if args.profile:
            step.train_epoch(loader, steps=12)
            continue
        times = [step.train_epoch(loader)["seconds"] for _ in range(4)][1:]
        out[f"epoch_b{batch}_s"] = statistics.median(times)
    model = models.LeNet5(seed=0).to("cuda")
    params = tuple(p.data for p in model.parameters())
    images = ops.cuda.asarray(te.images)
    logits = ops.cuda.empty((10000, 10))
    for n in ((10000,) if not args.profile else (10000, 1)):
        pass
    reps = 3 if args.profile else 50
    _C.lenet_forward(False, 10, params, images, logits, model.mean, model.std, False)
    cydnn.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        _C.lenet_forward(False, 10, params, images, logits, model.mean, model.std, False)
    cydnn.cuda.synchronize()
    out["fwd10k_Mimg_s"] = 10000 * reps / (time.perf_counter() - t) / 1e6
    one = te.images[:1].copy()
    calls = 50 if args.profile else 3000
    for _ in range(200):
        model.predict(one)
    lat = []
    for _ in range(calls):
        s = time.perf_counter()
        model.predict(one)
        lat.append(time.perf_counter() - s)
    out["predict1_p50_us"] = 1e6 * float(np.percentile(lat, 50))
    out["predict1_p99_us"] = 1e6 * float(np.percentile(lat, 99))
    # Where a one-image predict goes: the whole call, FastPredictor (checks done),
    # the C call alone (pinned copy, graph launch, wait, copy out).
    fp = model.fast_predictor()
    checked = model._check_images(one)
    lenet = fp._lenet                      # the LeNet-5 backend the planner picked
    params = tuple(p.data for p in lenet.params)
    probs = np.empty((1, 10), np.float32)
    for name, fn in (("predict", lambda: model.predict(one)), ("fast_predictor_call", lambda: fp(checked)),
                     ("c_run", lambda: lenet._p.run(params, checked[:, 0], probs))):
        for _ in range(200):
            fn()
        lat = []
        for _ in range(calls):
            s = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - s)
        out[f"p50_us_{name}"] = 1e6 * float(np.percentile(lat, 50))
    if not args.profile:
        big = te.images
        model.predict(big)
        s = time.perf_counter()
        for _ in range(5):
            model.predict(big)
        out["predict10k_Mimg_s"] = 5e4 / (time.perf_counter() - s) / 1e6
    env = {k: os.environ[k] for k in ("CYDNN_TRAIN_THREADS", "CYDNN_FWD_THREADS", "CYDNN_FWD1_THREADS")
           if k in os.environ}
    print(env, {k: round(v, 4) for k, v in out.items()}, flush=True)


if __name__ == "__main__":
    main()
