"""LeNet-5 training and GPU-resident forward: cydnn against PyTorch, same GPU, same run.

    python3 benchmarks/bench_lenet.py --mnist DIR [--repeats 3] [--json out.json]

On the GPU machine it measures, fp32 with TF32 off on both sides, MNIST's
60,000 training images on the GPU, no augmentation, SGD (lr 0.03, Nesterov
momentum 0.9, weight decay 5e-4), batch 64 and 256:

- epoch time: cydnn reference path (per-op loop), cydnn compiled step (fused
  kernels + CUDA graphs), PyTorch eager, PyTorch with the whole step captured
  in a CUDA graph (static buffers, ``copy_`` of each batch, ``replay()``);
  the median and the spread of ``--repeats`` epochs after one warm-up epoch;
- the forward of 10,000 images already on the GPU (images/s);
- peak GPU memory of a training epoch;
- test accuracy after the timed epochs of each path.

Without a GPU it runs the CPU comparison (benchmarks/bench_cpu.py) and says
what it skipped.  Speed is judged by this table, never by timed tests.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cydnn  # noqa: E402
from cydnn import _C, datasets, models, ops, optim  # noqa: E402

LR, MOMENTUM, WD = 0.03, 0.9, 5e-4


def load_mnist(folder, root):
    train = datasets.MNIST(root=root, train=True, mirrors=[folder])
    test = datasets.MNIST(root=root, train=False, mirrors=[folder])
    return train.images, train.labels, test.images, test.labels


def stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


# ------------------------------------------------------------------ cydnn
def cydnn_training(data, batch, repeats, compiled):
    x_train, y_train, x_test, y_test = data
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD)
    step = model.compile(opt, batch, fused=compiled, cuda_graph=compiled)
    loader = datasets.DataLoader(x_train, y_train, batch_size=batch, seed=0, mean=model.mean, std=model.std,
                                 pad=model.input_pad, device="cuda")
    cydnn.cuda.reset_peak_memory_stats()
    times = []
    for epoch in range(repeats + 1):
        r = step.train_epoch(loader)
        if epoch:
            times.append(r["seconds"])
    acc = float(np.mean(model.predict(x_test, fast=compiled).argmax(1) == y_test))
    peak = cydnn.cuda.memory_stats()["peak_allocated_bytes"]
    return {"epoch_s": stats(times), "test_accuracy": acc, "epochs": repeats + 1, "mode": step.info()["mode"],
            "peak_bytes": peak}


def cydnn_forward(data, iters=50):
    model = models.LeNet5(seed=0).to("cuda")
    images = ops.cuda.asarray(data[2][:10000])
    out = ops.cuda.empty((10000, 10))
    params = tuple(p.data for p in model.parameters())
    res = {}
    for name in ("fused", "reference"):
        if name == "reference":
            x = ops.cuda.asarray(model.preprocess(data[2][:10000]))

            def run():
                model.forward(x)
        else:
            def run():
                _C.lenet_forward(False, 10, params, images, out, model.mean, model.std, False)
        for _ in range(5):
            run()
        cydnn.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(iters):
                run()
            cydnn.cuda.synchronize()
            times.append((time.perf_counter() - t) / iters)
        res[name] = stats(times)
    return res


# ---------------------------------------------------------------- PyTorch
def torch_setup():
    import torch
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    return torch


def torch_lenet(torch):
    import torch.nn as tnn
    torch.manual_seed(0)
    return tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                          tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(), tnn.Linear(120, 84),
                          tnn.ReLU(), tnn.Linear(84, 10)).cuda()


def torch_data(torch, data):
    mean, std = 0.1307, 0.3081
    to = lambda a: ((torch.from_numpy(a).cuda().float() / 255 - mean) / std)[:, None].contiguous()  # noqa: E731
    return (to(data[0]), torch.from_numpy(data[1].astype(np.int64)).cuda(), to(data[2]),
            torch.from_numpy(data[3].astype(np.int64)).cuda())


def torch_training(torch, tdata, batch, repeats, graph):
    import torch.nn.functional as F
    X, Y, Xt, Yt = tdata
    model = torch_lenet(torch)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD)
    n = X.shape[0]
    steps = n // batch if graph else -(-n // batch)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    if graph:
        sx, sy = X[:batch].clone(), Y[:batch].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(sx), sy).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            static_loss = F.cross_entropy(model(sx), sy)
            static_loss.backward()
            opt.step()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for epoch in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        perm = torch.randperm(n, device="cuda", generator=gen)
        for b in range(steps):
            idx = perm[b * batch:(b + 1) * batch]
            if graph:
                sx.copy_(X[idx])
                sy.copy_(Y[idx])
                g.replay()
            else:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(X[idx]), Y[idx]).backward()
                opt.step()
        torch.cuda.synchronize()
        if epoch:
            times.append(time.perf_counter() - t)
    with torch.no_grad():
        acc = float((model(Xt).argmax(1) == Yt).float().mean())
    return {"epoch_s": stats(times), "test_accuracy": acc, "epochs": repeats + 1,
            "peak_bytes": torch.cuda.max_memory_allocated(), "steps_per_epoch": steps}


def torch_forward(torch, tdata, iters=50):
    model = torch_lenet(torch).eval()
    x = tdata[2][:10000]
    with torch.no_grad():
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(iters):
                model(x)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / iters)
    return stats(times)


# ------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mnist", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
    p.add_argument("--data-dir", default=None, help="cache for the decompressed MNIST files")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python3 " + " ".join(sys.argv)}
    if not cydnn.cuda.is_available():
        print("no GPU: running the CPU comparison only (GPU epochs, forward and memory skipped)")
        import bench_cpu
        result["cpu"] = bench_cpu.run()
        print(json.dumps(result["cpu"], indent=1))
        return 0
    import tempfile
    data = load_mnist(args.mnist, args.data_dir or tempfile.mkdtemp())
    result["gpu"] = cydnn.cuda.get_device_name()
    try:
        torch = torch_setup()
        tdata = torch_data(torch, data)
        result["torch"] = torch.__version__
    except ImportError:
        torch = None
        print("PyTorch not importable: its columns are skipped")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        entry = {"cydnn_plain": cydnn_training(data, batch, args.repeats, compiled=False),
                 "cydnn_graph": cydnn_training(data, batch, args.repeats, compiled=True)}
        if torch is not None:
            entry["torch_eager"] = torch_training(torch, tdata, batch, args.repeats, graph=False)
            entry["torch_graph"] = torch_training(torch, tdata, batch, args.repeats, graph=True)
        result[f"batch_{batch}"] = entry
        rows.append((batch, entry))
    result["forward_10k"] = {"cydnn": cydnn_forward(data)}
    if torch is not None:
        result["forward_10k"]["torch"] = torch_forward(torch, tdata)

    print(f"\nLeNet-5 on {result['gpu']}, fp32 (TF32 off), MNIST 60k on the GPU, no augmentation; "
          f"median of {args.repeats} epochs after 1 warm-up [min-max]")
    print("| batch | path | epoch s | test acc | peak MB |")
    print("|---|---|---|---|---|")
    for batch, entry in rows:
        for name, r in entry.items():
            e = r["epoch_s"]
            print(f"| {batch} | {name} | {e['median']:.4f} [{e['min']:.4f}-{e['max']:.4f}] | "
                  f"{100 * r['test_accuracy']:.2f}% ({r['epochs']} ep) | {r['peak_bytes'] / 2**20:.0f} |")
    print("\n| forward of 10,000 GPU-resident images | ms | M images/s |")
    print("|---|---|---|")
    fw = result["forward_10k"]
    for name, s in list(fw["cydnn"].items()) + ([("torch", fw["torch"])] if "torch" in fw else []):
        name = name if name == "torch" else f"cydnn {name}"
        print(f"| {name} | {1e3 * s['median']:.3f} | {1e4 / s['median'] / 1e6:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
