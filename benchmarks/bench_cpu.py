"""One LeNet-5 training epoch on the CPU: cydnn's numpy backend against PyTorch's CPU build.

    python3 benchmarks/bench_cpu.py [--mnist DIR] [--limit-train N] [--repeats 3] [--json out.json]

Same loop on both sides: batches of 64 from a shuffled MNIST subset, the
model's forward, cross-entropy, backward, SGD (lr 0.03, Nesterov momentum
0.9, weight decay 5e-4); PyTorch with ``torch.set_num_threads`` = the cores
numpy's BLAS uses.  Images per second, median and spread of ``--repeats``
epochs after one warm-up epoch.  PyTorch is measured only when it imports.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cydnn import datasets, models, optim

DEFAULT_MNIST = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist")


def _data(mnist, limit):
    ds = datasets.MNIST(root=tempfile.mkdtemp(), train=True, mirrors=[mnist])
    n = len(ds.images) if limit is None else min(limit, len(ds.images))
    return ds.images[:n], ds.labels[:n]


def cydnn_epochs(images, labels, batch_size, repeats):
    model = models.LeNet5(seed=0)
    loader = datasets.DataLoader(images, labels, batch_size=batch_size, mean=model.mean, std=model.std)
    opt = optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step = model.compile(opt, batch_size)          # on the CPU: the reference loop
    rates = []
    for epoch in range(repeats + 1):
        r = step.train_epoch(loader)
        if epoch:
            rates.append(r["images"] / r["seconds"])
    return rates


def torch_epochs(images, labels, batch_size, repeats, threads):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = ((torch.from_numpy(images.copy()).float() / 255 - 0.1307) / 0.3081)[:, None]
    y = torch.from_numpy(labels.astype(np.int64))
    net = tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                         tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(), tnn.Linear(120, 84),
                         tnn.ReLU(), tnn.Linear(84, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)
    rates = []
    for epoch in range(repeats + 1):
        t = time.perf_counter()
        perm = torch.randperm(len(x))
        for b in range(0, len(x), batch_size):
            i = perm[b:b + batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
        if epoch:
            rates.append(len(x) / (time.perf_counter() - t))
    return rates, torch.__version__


def run(limit_train=None, batch_size=64, repeats=3, mnist=DEFAULT_MNIST):
    """The comparison as a dict: images/s (median, min, max) per framework."""
    images, labels = _data(mnist, limit_train)
    stat = lambda r: {"median": statistics.median(r), "min": min(r), "max": max(r)}  # noqa: E731
    out = {"images": len(images), "batch_size": batch_size, "cydnn_cpu": stat(cydnn_epochs(images, labels,
                                                                                         batch_size, repeats))}
    try:
        rates, version = torch_epochs(images, labels, batch_size, repeats, threads=os.cpu_count() or 1)
        out["torch_cpu"] = stat(rates)
        out["torch"] = version
    except ImportError:
        out["torch_cpu"] = None
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mnist", default=DEFAULT_MNIST)
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    r = run(args.limit_train, args.batch_size, args.repeats, args.mnist)
    print(f"LeNet-5, one epoch of {r['images']} images at batch {r['batch_size']}, {os.cpu_count()} cores; "
          f"images/s, median [min-max] of {args.repeats}")
    print("| framework | images/s |\n|---|---|")
    for name in ("cydnn_cpu", "torch_cpu"):
        s = r.get(name)
        print(f"| {name} | " + (f"{s['median']:,.0f} [{s['min']:,.0f}-{s['max']:,.0f}]" if s else "not importable")
              + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
