"""Inference from numpy: cydnn's paths against PyTorch, same GPU, same run.

    python3 benchmarks/bench_inference.py --mnist DIR [--json out.json]

- ``predict`` of ONE 28x28 uint8 image, numpy in, probabilities out:
  p50 / p99 latency over many calls, for the fast path (graph), the fast path
  without graphs, the reference per-layer path in fp32, TF32 and FP16
  (``predict(x, precision=...)``), and PyTorch (upload, normalise, model,
  softmax, download);
- ``predict`` of 10,000 uint8 images: images/s for the same paths;
- the fused MLP (LeNet's head, 256-120-84-10, and a wide 784-1024-1024-10)
  against the per-layer cuBLAS path at batch 1, 8, 64 and 1024;
- test accuracy of each predict path on the 10,000 MNIST test images with
  a model trained for two epochs (fast path, TF32 vs fp32).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import cydnn
from cydnn import datasets, models, ops, optim


def percentile_us(fn, calls, warmup=200):
    for _ in range(warmup):
        fn()
    t = np.empty(calls)
    for i in range(calls):
        s = time.perf_counter()
        fn()
        t[i] = time.perf_counter() - s
    return {"p50_us": float(np.percentile(t, 50) * 1e6), "p99_us": float(np.percentile(t, 99) * 1e6)}


def throughput(fn, n, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - s)
    return {"images_per_s": n / statistics.median(times), "median_ms": 1e3 * statistics.median(times)}


def trained_model(data):
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step = model.compile(opt, 64)
    loader = datasets.DataLoader(data[0], data[1], batch_size=64, seed=0, mean=model.mean, std=model.std,
                                 pad=model.input_pad, device="cuda")
    for _ in range(2):
        step.train_epoch(loader)
    return model


def torch_predictor(model):
    import torch
    import torch.nn as tnn
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    net = tnn.Sequential(tnn.Conv2d(1, 6, 5), tnn.ReLU(), tnn.MaxPool2d(2), tnn.Conv2d(6, 16, 5), tnn.ReLU(),
                         tnn.MaxPool2d(2), tnn.Flatten(), tnn.Linear(256, 120), tnn.ReLU(), tnn.Linear(120, 84),
                         tnn.ReLU(), tnn.Linear(84, 10))
    sd = model.state_dict()
    names = ["conv1", "conv2", "fc1", "fc2", "fc3"]
    idx = [0, 3, 7, 9, 11]
    net.load_state_dict({f"{i}.{k}": torch.from_numpy(sd[f"{n}.{k}"]) for n, i in zip(names, idx)
                         for k in ("weight", "bias")})
    net = net.cuda().eval()
    mean, std = model.mean, model.std

    def predict(x):
        with torch.no_grad():
            t = torch.from_numpy(x).cuda()
            t = (t.float() / 255 - mean) / std
            return torch.softmax(net(t.reshape(-1, 1, 28, 28)), 1).cpu().numpy()
    return predict, torch.__version__


def mlp_bench(dims, batch, iters=200):
    rng = np.random.default_rng(0)
    x = ops.cuda.asarray(rng.standard_normal((batch, dims[0])).astype(np.float32))
    ws = [ops.cuda.asarray((rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32))
          for i, o in zip(dims[:-1], dims[1:])]
    bs = [ops.cuda.asarray(rng.standard_normal(o).astype(np.float32)) for o in dims[1:]]

    def fused():
        ops.cuda.fused_mlp_forward(x, ws, bs)

    def layers():
        h = x
        for i, (w, b) in enumerate(zip(ws, bs)):
            h, _ = ops.cuda.linear_forward(h, w, b)
            if i < len(ws) - 1:
                h, _ = ops.cuda.relu_forward(h)
    out = {}
    for name, fn in (("fused", fused), ("per_layer", layers)):
        for _ in range(20):
            fn()
        cydnn.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(iters):
            fn()
        cydnn.cuda.synchronize()
        out[name] = (time.perf_counter() - s) / iters * 1e6
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mnist", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not cydnn.cuda.is_available():
        print("no GPU: nothing to measure (this benchmark is GPU-only)")
        return 0
    root = tempfile.mkdtemp()
    tr = datasets.MNIST(root=root, train=True, mirrors=[args.mnist])
    te = datasets.MNIST(root=root, train=False, mirrors=[args.mnist])
    data = (tr.images, tr.labels, te.images, te.labels)
    model = trained_model(data)
    one = te.images[:1].copy()
    many = te.images
    paths = {
        "cydnn fast (graph)": lambda x: model.predict(x),
        "cydnn fast (no graph)": None,
        "cydnn reference": lambda x: model.predict(x, fast=False),
        "cydnn reference TF32": lambda x: model.predict(x, precision="tf32"),
        "cydnn reference FP16": lambda x: model.predict(x, precision="fp16"),
    }
    nograph = cydnn.compile(model, input_shape=model.network_input_shape(), softmax=True, cuda_graph=False,
                            preprocess=(model.mean, model.std, model.input_pad))
    paths["cydnn fast (no graph)"] = lambda x: nograph(model._check_images(x))
    result = {"date": time.strftime("%Y-%m-%d"), "gpu": cydnn.cuda.get_device_name(),
              "command": "python3 " + " ".join(sys.argv), "paths": {}}
    try:
        tp, version = torch_predictor(model)
        paths["PyTorch"] = tp
        result["torch"] = version
    except ImportError:
        print("PyTorch not importable: its rows are skipped")
    for name, fn in paths.items():
        r = percentile_us(lambda: fn(one), args.calls)
        r.update(throughput(lambda: fn(many), len(many)))
        r["test_accuracy"] = float(np.mean(fn(many).argmax(1) == te.labels))
        result["paths"][name] = r
    result["mlp"] = {f"{'-'.join(map(str, dims))} @ {b}": mlp_bench(dims, b)
                     for dims in ((256, 120, 84, 10), (784, 1024, 1024, 10)) for b in (1, 8, 64, 1024)}

    print(f"\npredict from numpy on {result['gpu']} (uint8 images in, probabilities out)")
    print("| path | 1 image p50 µs | p99 µs | 10,000 images: M images/s | test acc |")
    print("|---|---|---|---|---|")
    for name, r in result["paths"].items():
        print(f"| {name} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['images_per_s'] / 1e6:.2f} | "
              f"{100 * r['test_accuracy']:.2f}% |")
    print("\n| MLP @ batch | fused µs | per-layer (cuBLAS) µs |")
    print("|---|---|---|")
    for k, v in result["mlp"].items():
        print(f"| {k} | {v['fused']:.1f} | {v['per_layer']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
