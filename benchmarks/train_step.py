#!/usr/bin/env python3
"""Time one LeNet-5 training step (forward, loss, backward, SGD update) in cydnn and in PyTorch.

    python benchmarks/train_step.py                 # batch sizes 32 64 128 256, on the GPU
    python benchmarks/train_step.py --batch 32 --steps 500

Both run the same network (LeNet-5: conv 5x5x6, ReLU, max-pool, conv 5x5x16,
ReLU, max-pool, 120, 84, 10) with SGD + Nesterov momentum on a batch already on
the GPU, TF32 off in both.  Time is measured with the host clock around `steps`
steps after a warm-up, with a device synchronisation at both ends; the median of
`repeats` runs is reported.  PyTorch is optional: without it only cydnn is timed.
"""
import argparse
import statistics
import time

import numpy as np

import cydnn
from cydnn import models, nn, optim


def time_steps(step, sync, steps, repeats):
    for _ in range(20):
        step()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def bench_cydnn(batch, steps, repeats):
    rng = np.random.default_rng(0)
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    loss_fn = nn.CrossEntropyLoss()
    x = cydnn.to_device(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32))
    y = cydnn.to_device(rng.integers(0, 10, batch).astype(np.int32))

    def step():
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()

    return time_steps(step, cydnn.cuda.synchronize, steps, repeats)


def bench_torch(batch, steps, repeats):
    import torch
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    tnn = torch.nn
    model = tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                           tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(), tnn.Linear(120, 84),
                           tnn.ReLU(), tnn.Linear(84, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    loss_fn = tnn.CrossEntropyLoss()
    x = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return time_steps(step, torch.cuda.synchronize, steps, repeats)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="*", default=[32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cydnn.cuda.check_device(0)
    try:
        import torch  # noqa: F401
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    print(f"GPU: {cydnn.cuda.get_device_name()}; cydnn {cydnn.versions()}")
    print(f"{'batch':>5}  {'cydnn ms/step':>13}  {'cydnn img/s':>11}  {'torch ms/step':>13}  {'torch img/s':>11}  ratio")
    for b in args.batch:
        c = bench_cydnn(b, args.steps, args.repeats)
        t = bench_torch(b, args.steps, args.repeats) if have_torch else float("nan")
        print(f"{b:5d}  {c * 1e3:13.3f}  {b / c:11,.0f}  {t * 1e3:13.3f}  {b / t:11,.0f}  {t / c:5.2f}x")


if __name__ == "__main__":
    main()
