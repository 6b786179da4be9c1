#!/usr/bin/env python3
"""One LeNet-5 training epoch on the CPU: cydnn's CPU backend against PyTorch's CPU build.

    PYTHONPATH=python python3 benchmarks/bench_cpu.py                  # MNIST train set, batch 64, 3 repeats
    PYTHONPATH=python python3 benchmarks/bench_cpu.py --limit-train 10000 --repeats 5 --json out.json
    PYTHONPATH=python python3 benchmarks/bench_cpu.py --network-only    # the network alone (see below)

Both sides run the loop of ``python -m cydnn.train --device cpu`` for one
epoch: LeNet-5 (modern: conv 5x5x6, ReLU, max-pool, conv 5x5x16, ReLU,
max-pool, 120, 84, 10) from the same initial weights, mean softmax
cross-entropy, backward, SGD (lr 0.03, Nesterov momentum 0.9, weight decay
5e-4) with a per-step cosine schedule, on shuffled batches built on the fly
from the uint8 images: a random shift of up to 2 pixels, then
``(pixel / 255 - mean) / std``.  cydnn runs ``model.compile(...).train_epoch``
(on the CPU: the reference loop, batches from ``datasets.DataLoader``, i.e.
``ops.cpu.gather_batch``); PyTorch the same steps with the batch built by
torch ops.  An epoch's time is the host clock around its loop (batches
included), after an untimed warm-up of a few batches.  The repeats alternate
between the two frameworks, so that a busy machine slows both alike; the
table gives the median and the spread (min..max).

``--network-only`` times the network alone: the images are converted once,
before timing, to float32 ``(pixel / 255 - mean) / std`` (no shifts), and
each step is forward, mean cross-entropy, backward and SGD with momentum 0.9
(lr 0.01, no Nesterov, no weight decay, no schedule) on the next slice of
64 (``--batch-size``) images, in the same order on both sides: nothing but
the layers and the update.  Neither side computes the gradient of the input
images (PyTorch's input has no ``requires_grad``; cydnn's backward runs with
``input_grad=False``, as its training loop does), so both do the same work.  cydnn runs with the kernels chosen by
``--kernels`` (numpy, cython or auto; default auto), PyTorch eagerly with
autograd.

``--competing-load N`` starts N busy processes (``while True: pass``) before
the first timed epoch and stops them after the last: the CPU path under load
(issue 17 asks for at most 2x slower with one).

PyTorch is optional; it runs with ``torch.set_num_threads(--torch-threads)``
(default 2, this machine's cores).  numpy's BLAS uses its own default (see
the ``blas`` entry of the JSON, from threadpoolctl when installed).  Import
this file and call :func:`run` for the numbers as a dict.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LR, MOMENTUM, WEIGHT_DECAY, MAX_SHIFT, SEED = 0.03, 0.9, 5e-4, 2, 0
# ../shared/data/mnist beside the repository; from a worktree one level deeper (wt/<name>), the one above
DEFAULT_MNIST = next((d for d in (Path(__file__).resolve().parents[i] / "shared" / "data" / "mnist" for i in (2, 3))
                      if d.is_dir()), Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist")


def load_mnist(limit_train=None, mnist=None, data_dir=None):
    """(images uint8 (N, 28, 28), labels (N,), mean, std): the first N images of the MNIST train set.

    ``mnist``: a mirror (folder or URL) to read the files from (default: ``../shared/data/mnist``
    beside the repository when it exists, else the dataset's own mirrors); ``data_dir``: the cache.
    """
    from cydnn import datasets
    if mnist is None and DEFAULT_MNIST.is_dir():
        mnist = str(DEFAULT_MNIST)
    with tempfile.TemporaryDirectory(prefix="bench_cpu_") as tmp:  # removed after: the files are read into memory
        train = datasets.MNIST(root=data_dir or tmp, train=True, mirrors=None if mnist is None else [mnist])
    images, labels = train.images, train.labels
    if limit_train is not None:
        images, labels = images[:limit_train], labels[:limit_train]
    return images, labels, train.mean, train.std


# ---------------------------------------------------------------------- cydnn


def cydnn_epoch(images, labels, mean, std, batch_size, warmup_batches):
    """(seconds, mean loss) of one epoch of ``python -m cydnn.train --device cpu``'s loop."""
    from cydnn import datasets, models, nn, optim
    model = models.LeNet5(seed=SEED, mean=mean, std=std).to("cpu")
    loader = datasets.DataLoader(images, labels, batch_size=batch_size, shuffle=True, max_shift=MAX_SHIFT,
                                 mean=mean, std=std, pad=model.input_pad, device="cpu", seed=SEED)
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)
    scheduler = optim.CosineAnnealingLR(optimizer, T_max=len(loader))
    if not hasattr(model, "compile"):  # a tree from before cydnn.fast: the same loop, written out
        return _plain_epochs(model, loader, optimizer, scheduler, nn.CrossEntropyLoss(), warmup_batches)
    step = model.compile(optimizer, batch_size, loss_fn=nn.CrossEntropyLoss())
    if warmup_batches:
        step.train_epoch(loader, scheduler, steps=warmup_batches)  # untimed; uses the loader's epoch 0
    result = step.train_epoch(loader, scheduler)
    return result["seconds"], result["loss"]


def _plain_epochs(model, loader, optimizer, scheduler, loss_fn, warmup_batches):
    """(seconds, mean loss) of one epoch after ``warmup_batches`` untimed steps, without ``model.compile``."""
    def epoch(max_batches):
        losses = []
        for i, (x, y) in enumerate(loader):
            if i >= max_batches:
                break
            losses.append(loss_fn(model(x), y))
            model.backward(loss_fn.backward())
            optimizer.step()
            scheduler.step()
        return float(np.mean([float(loss) for loss in losses])) if losses else float("nan")

    model.train()
    if warmup_batches:
        epoch(warmup_batches)
    start = time.perf_counter()
    loss = epoch(len(loader))
    return time.perf_counter() - start, loss


# ---------------------------------------------------------------------- torch


def torch_epoch(images, labels, mean, std, batch_size, warmup_batches):
    """(seconds, mean loss) of the same loop in PyTorch on the CPU, from the same initial weights."""
    import torch
    import torch.nn.functional as F
    from cydnn import models

    tnn = torch.nn
    model = tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                           tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(),
                           tnn.Linear(120, 84), tnn.ReLU(), tnn.Linear(84, 10))
    weights = models.LeNet5(seed=SEED, mean=mean, std=std).state_dict().values()
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(torch.from_numpy(w))
    n = len(images)
    steps = -(-n // batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True,
                                weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loss_fn = tnn.CrossEntropyLoss()
    timages = torch.from_numpy(np.ascontiguousarray(images))
    tlabels = torch.from_numpy(labels.astype(np.int64))
    generator = torch.Generator().manual_seed(SEED)
    span = torch.arange(images.shape[1])

    def batch(idx):
        # Each image moved by (sy, sx) in [-2, 2]^2, zeros where uncovered: a crop of a bordered copy.
        b = len(idx)
        bordered = F.pad(timages[idx], (MAX_SHIFT,) * 4)
        sy, sx = torch.randint(0, 2 * MAX_SHIFT + 1, (2, b), generator=generator)
        rows = (span + sy[:, None])[:, :, None]
        cols = (span + sx[:, None])[:, None, :]
        x = bordered[torch.arange(b)[:, None, None], rows, cols].float().div_(255)
        return x.sub_(mean).div_(std).unsqueeze(1), tlabels[idx]

    def epoch(max_batches):
        model.train()
        order = torch.randperm(n, generator=generator)
        losses, outputs = [], []
        for i in range(min(steps, max_batches)):
            x, y = batch(order[i * batch_size:(i + 1) * batch_size])
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
            outputs.append((logits.detach(), y))
        correct = sum(int((z.argmax(1) == t).sum()) for z, t in outputs)  # as train_epoch reports it
        return float(torch.stack(losses).mean()) if losses else float("nan"), correct

    if warmup_batches:
        epoch(warmup_batches)
    start = time.perf_counter()
    loss, _ = epoch(steps)
    return time.perf_counter() - start, loss


# ------------------------------------------------------------ network only

NET_LR, NET_MOMENTUM = 0.01, 0.9


def normalised(images, mean, std):
    """float32 (N, 1, H, W): ``(pixel / 255 - mean) / std``, done once before any timing."""
    x = images.astype(np.float32) / np.float32(255)
    return ((x - np.float32(mean)) / np.float32(std))[:, None]


def cydnn_network_epoch(x, labels, batch_size, warmup_batches):
    """(seconds, mean loss) of one epoch of the bare network in cydnn on the CPU."""
    from cydnn import models, nn, optim
    model = models.LeNet5(seed=SEED).to("cpu")
    model.train()
    optimizer = optim.SGD(model.parameters(), lr=NET_LR, momentum=NET_MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()
    y = labels.astype(np.int32)

    def epoch(max_batches):
        losses = []
        for i in range(min(max_batches, -(-len(x) // batch_size))):
            sl = slice(i * batch_size, (i + 1) * batch_size)
            losses.append(loss_fn(model(x[sl]), y[sl]))
            model.backward(loss_fn.backward(), input_grad=False)  # no gradient for the data, as in PyTorch
            optimizer.step()
        return float(np.mean([float(v) for v in losses]))

    if warmup_batches:
        epoch(warmup_batches)
    start = time.perf_counter()
    loss = epoch(len(x))
    return time.perf_counter() - start, loss


def torch_network_epoch(x, labels, batch_size, warmup_batches):
    """(seconds, mean loss) of the same epoch in PyTorch (eager, autograd) from the same weights."""
    import torch
    from cydnn import models
    tnn = torch.nn
    model = tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                           tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(),
                           tnn.Linear(120, 84), tnn.ReLU(), tnn.Linear(84, 10))
    with torch.no_grad():
        for p, w in zip(model.parameters(), models.LeNet5(seed=SEED).state_dict().values()):
            p.copy_(torch.from_numpy(w))
    optimizer = torch.optim.SGD(model.parameters(), lr=NET_LR, momentum=NET_MOMENTUM)
    loss_fn = tnn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))

    def epoch(max_batches):
        losses = []
        for i in range(min(max_batches, -(-len(x) // batch_size))):
            sl = slice(i * batch_size, (i + 1) * batch_size)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(tx[sl]), ty[sl])
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return float(torch.stack(losses).mean())

    if warmup_batches:
        epoch(warmup_batches)
    start = time.perf_counter()
    loss = epoch(len(x))
    return time.perf_counter() - start, loss


# ------------------------------------------------------------------- driver


def _blas_info():
    """numpy's BLAS as threadpoolctl sees it (library, version, threads, the kernel it picked), or None."""
    try:
        import threadpoolctl
    except ImportError:
        return None
    keys = ("internal_api", "version", "num_threads", "architecture", "threading_layer")
    return [{k: lib.get(k) for k in keys} for lib in threadpoolctl.threadpool_info() if lib.get("user_api") == "blas"]


def _summary(seconds, images, losses):
    med = statistics.median(seconds)
    return {"seconds": seconds, "median_seconds": med, "min_seconds": min(seconds), "max_seconds": max(seconds),
            "images_per_second": images / med, "images_per_second_min": images / max(seconds),
            "images_per_second_max": images / min(seconds), "mean_loss": losses}


def run(limit_train=None, batch_size=64, repeats=3, mnist=None, data_dir=None, use_torch=True, torch_threads=2,
        warmup_batches=10, log=None, network_only=False, kernels="auto", competing_load=0):
    """Time ``repeats`` epochs of each framework (alternating); returns a JSON-able dict.

    Keys: ``config``; ``machine`` (numpy, BLAS, load averages, the OPENBLAS_*
    variables); ``cydnn`` and ``torch``, each with ``seconds`` per repeat,
    ``median_seconds``, ``images_per_second`` (of the median) and its
    ``_min`` / ``_max``, ``mean_loss`` per repeat; ``torch`` is None when
    PyTorch does not import (``torch_missing`` says why); ``speedup`` = torch's
    median seconds / cydnn's (> 1: cydnn is faster).  ``network_only``: time the
    bare network (see the module docstring) with cydnn's CPU ``kernels``.
    """
    from cydnn.ops import cpu
    log = log or (lambda msg: None)
    cpu.set_kernels(kernels)
    images, labels, mean, std = load_mnist(limit_train, mnist, data_dir)
    torch_missing = None if use_torch else "not asked for"
    if use_torch:
        try:
            import torch
            torch.set_num_threads(torch_threads)
        except ImportError as e:
            use_torch, torch_missing = False, f"torch does not import: {e}"
    if network_only:
        x = normalised(images, mean, std)
        frameworks = [("cydnn", lambda *a: cydnn_network_epoch(x, labels, batch_size, warmup_batches))]
        frameworks += [("torch", lambda *a: torch_network_epoch(x, labels, batch_size, warmup_batches))] \
            if use_torch else []
    else:
        frameworks = [("cydnn", cydnn_epoch)] + ([("torch", torch_epoch)] if use_torch else [])

    loads = [os.getloadavg()[0]]
    seconds = {name: [] for name, _ in frameworks}
    losses = {name: [] for name, _ in frameworks}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competing_load)]
    try:
        for r in range(repeats):
            for name, epoch in (frameworks if r % 2 == 0 else frameworks[::-1]):  # alternate who goes first
                s, loss = epoch(images, labels, mean, std, batch_size, warmup_batches)
                seconds[name].append(s)
                losses[name].append(loss)
                loads.append(os.getloadavg()[0])
                log(f"repeat {r + 1}/{repeats} {name}: {s:.2f} s, {len(images) / s:,.0f} images/s, "
                    f"mean loss {loss:.4f} (load average {loads[-1]:.2f})")
    finally:
        for proc in busy:  # the processes this run started, by their handles
            proc.kill()
            proc.wait()

    result = {
        "config": {"train_images": len(images), "batch_size": batch_size, "repeats": repeats,
                   "warmup_batches": warmup_batches, "competing_load": competing_load,
                   "mode": "network only" if network_only else "training loop",
                   "max_shift": 0 if network_only else MAX_SHIFT, "cydnn_kernels": cpu.get_kernels(),
                   "optimizer": (f"SGD lr {NET_LR}, momentum {NET_MOMENTUM}" if network_only else
                                 f"SGD lr {LR}, Nesterov momentum {MOMENTUM}, weight decay {WEIGHT_DECAY}, cosine")},
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                    "blas": _blas_info(), "load_average_1min": loads,
                    "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
                    "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
                    "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
                    "CYDNN_CPU_PARALLEL_FLOPS": cpu._threads.PARALLEL_FLOPS,
                    "CYDNN_CPU_PARALLEL_ELEMENTS": cpu._threads.PARALLEL_ELEMENTS},
        "cydnn": _summary(seconds["cydnn"], len(images), losses["cydnn"]),
        "torch": None, "torch_missing": torch_missing, "speedup": None,
    }
    if use_torch:
        import torch
        result["machine"].update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        result["torch"] = _summary(seconds["torch"], len(images), losses["torch"])
        result["speedup"] = result["torch"]["median_seconds"] / result["cydnn"]["median_seconds"]
    return result


def format_table(result):
    """The result as a Markdown table plus a line comparing the two."""
    cfg = result["config"]
    load = f", {cfg['competing_load']} competing busy processes" if cfg.get("competing_load") else ""
    lines = [f"LeNet-5, one epoch ({cfg.get('mode', 'training loop')}) of {cfg['train_images']:,} MNIST images "
             f"at batch {cfg['batch_size']}, {cfg['repeats']} repeats{load}; images/s of the median epoch [min-max]",
             "| framework | median s | images/s |", "|---|---|---|"]
    for name, label in (("cydnn", f"cydnn (CPU, {cfg.get('cydnn_kernels', 'numpy')} kernels)"),
                        ("torch", "PyTorch CPU")):
        r = result[name]
        if r is not None:
            lines.append(f"| {label} | {r['median_seconds']:.2f} | {r['images_per_second']:,.0f} "
                         f"[{r['images_per_second_min']:,.0f}-{r['images_per_second_max']:,.0f}] |")
    if result["speedup"] is not None:
        lines.append(f"cydnn / PyTorch throughput: {result['speedup']:.2f}x")
    else:
        lines.append(f"PyTorch: {result['torch_missing']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-train", type=int, default=None, metavar="N", help="use the first N training images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-batches", type=int, default=10)
    p.add_argument("--mnist", default=None, help=f"folder or URL with the MNIST files (default: {DEFAULT_MNIST})")
    p.add_argument("--data-dir", default=None, help="cache for the decompressed files (default: a temporary folder)")
    p.add_argument("--no-torch", action="store_true", help="time cydnn only")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--network-only", action="store_true",
                   help="time the bare network: normalised float input, no shifts, SGD with momentum, no schedule")
    p.add_argument("--kernels", choices=["auto", "cython", "numpy"], default="auto",
                   help="cydnn's CPU kernels (cydnn.ops.cpu.set_kernels)")
    p.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help="run N busy processes (while True: pass) during the timed epochs")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    args = p.parse_args(argv)
    result = run(limit_train=args.limit_train, batch_size=args.batch_size, repeats=args.repeats, mnist=args.mnist,
                 data_dir=args.data_dir, use_torch=not args.no_torch, torch_threads=args.torch_threads,
                 warmup_batches=args.warmup_batches, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                 network_only=args.network_only, kernels=args.kernels, competing_load=args.competing_load)
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
