#!/usr/bin/env python3
"""The compiler on a zoo of networks, against PyTorch on the same GPU in the same run (fp32, TF32 off).

    python3 benchmarks/bench_zoo.py [--models lenet5,mlp_small] [--batches 32,64,256] [--json out.json]

For each network:
- a training step (forward, cross-entropy, backward, SGD momentum update; batch on the
  GPU) at each batch size: cydnn compiled (``cydnn.compile``), cydnn per-op (the
  reference path), PyTorch eager, PyTorch with the whole step captured in a CUDA graph;
- numpy inference (``cydnn.compile(model, input_shape, softmax=True)``; PyTorch:
  upload, model, softmax, download): one image p50/p99 (also with ``resident_us=2000``, the resident
  kernel), and 10,000 images;
- peak GPU memory of the compiled training run (cydnn's pool) and of PyTorch's;
- the largest difference of the logits, and of the parameters after 20 steps, between
  the compiled path and the per-op path (same initial weights, same batches), beside the per-op
  path's own after 20 steps with each batch's rows in another order and with the initial weights one
  ulp up (``--agree-only``: just these);
- compile time (plan + capture of the training step and of the one-image inference); the kernel
  generated for the network compiles in the background after that (its time is reported apart,
  and the inference figures are taken once it is in use).  Each run compiles as a first run does: NVRTC 12.9+
  keeps what it compiled in the driver's compute cache and cydnn keeps cubins of its own (kernel_cache.py), so the
  run takes fresh folders for both (``fresh_caches``) unless ``--warm-caches``.
Times: host clock around many steps with a device synchronisation at both ends, the
median of ``--repeats`` runs.
"""
import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import cydnn
from bench_inference import percentile_us
from cydnn import nn, ops, optim


def zoo():
    """name -> (builder(rng) -> nn.Sequential, input shape, PyTorch builder)."""
    def lenet(c1=6, c2=16, fc=120, classic=False):
        act, pool = (nn.Tanh, nn.AvgPool2d) if classic else (nn.ReLU, nn.MaxPool2d)
        flat = c2 * (25 if classic else 16)
        layers = [nn.Conv2d(1, c1, 5), act(), pool(2), nn.Conv2d(c1, c2, 5), act(), pool(2), nn.Flatten(),
                  nn.Linear(flat, fc), act()]
        layers += [nn.Linear(fc, 84), act(), nn.Linear(84, 10)] if fc == 120 else [nn.Linear(fc, 10)]
        return layers, ((1, 32, 32) if classic else (1, 28, 28))

    def mlp(sizes):
        layers = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        return layers, (1, 28, 28)

    def cnn32():
        return ([nn.Conv2d(3, 24, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                 nn.Conv2d(24, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                 nn.Conv2d(48, 96, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                 nn.Linear(1536, 128), nn.ReLU(), nn.Linear(128, 10)], (3, 32, 32))

    def allconv():
        return ([nn.Conv2d(1, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1),
                 nn.ReLU(), nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                 nn.Linear(128 * 16, 10)], (1, 28, 28))

    def smallcnn_bn():
        layers, c = [], 1
        for w in (32, 64, 128):
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                       nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2)]
            c = w
        return layers + [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)], (1, 28, 28)

    return {
        "lenet5": lambda: lenet(),
        "lenet5_classic": lambda: lenet(classic=True),
        "lenet5_16_32_fc512": lambda: lenet(16, 32, 512),
        "mlp_784_1024_1024_10": lambda: mlp((784, 1024, 1024, 10)),
        "mlp_784_128_10": lambda: mlp((784, 128, 10)),
        "cnn32_24_48_96": cnn32,
        "allconv_stride2": allconv,
        "smallcnn_bn": smallcnn_bn,
    }


def build(name, seed=0):
    layers, shape = zoo()[name]()
    rng = np.random.default_rng(seed)
    for m in layers:                                   # same initial weights every time
        for k, p in m._parameters.items():
            if p is not None and type(m).__name__ in ("Conv2d", "Linear"):
                p.data = rng.uniform(-0.1, 0.1, p.shape).astype(np.float32)
    return nn.Sequential(*layers), shape


def torch_twin(model):
    import torch
    tnn = torch.nn
    mods = []
    for m in model:
        kind = type(m).__name__
        if kind == "Conv2d":
            t = tnn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                           bias=m.bias is not None)
        elif kind in ("BatchNorm2d", "BatchNorm1d"):
            t = getattr(tnn, kind)(m.num_features, eps=m.eps, momentum=m.momentum)
        elif kind == "AdaptiveAvgPool2d":
            t = tnn.AdaptiveAvgPool2d(1)
        elif kind == "Linear":
            t = tnn.Linear(m.in_features, m.out_features)
        elif kind in ("MaxPool2d", "AvgPool2d"):
            t = getattr(tnn, kind)(m._kwargs["kernel"], m._kwargs["stride"], m._kwargs["padding"])
        else:
            t = getattr(tnn, kind)()
        if kind in ("Conv2d", "Linear", "BatchNorm2d", "BatchNorm1d"):
            with torch.no_grad():
                t.weight.copy_(torch.from_numpy(ops.cuda.to_numpy(m.weight.data)))
                if m.bias is not None:
                    t.bias.copy_(torch.from_numpy(ops.cuda.to_numpy(m.bias.data)))
        mods.append(t)
    return tnn.Sequential(*mods).cuda()


def timed(step, sync, steps, repeats):
    for _ in range(10):
        step()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        out.append((time.perf_counter() - t0) / steps)
    return statistics.median(out) * 1e6


def latencies(fn, calls=500, warmup=100):
    r = percentile_us(fn, calls, warmup)
    return r["p50_us"], r["p99_us"]


def train_setup(name, batch):
    """The network on the GPU, its SGD (momentum 0.9), one batch of device inputs and labels, the input shape."""
    model, shape = build(name)
    model.to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(1)
    x = cydnn.to_device(rng.standard_normal((batch,) + shape).astype(np.float32))
    y = cydnn.to_device(rng.integers(0, 10, batch).astype(np.int32))
    return model, opt, x, y, shape


def cydnn_train(name, batch, steps, repeats, compiled):
    model, opt, x, y, shape = train_setup(name, batch)
    if compiled:
        t0 = time.perf_counter()
        step_fn = cydnn.compile(model, opt, batch_size=batch, input_shape=shape)
        step_fn(x, y)
        cydnn.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        info = step_fn.info()
        return timed(lambda: step_fn(x, y), cydnn.cuda.synchronize, steps, repeats), compile_s, info
    loss_fn = nn.CrossEntropyLoss()

    def step():
        loss_fn(model(x), y)
        model.backward(loss_fn.backward(), input_grad=False)
        opt.step()
    return timed(step, cydnn.cuda.synchronize, steps, repeats), None, None


def torch_step(model, shape, batch, graph):
    """PyTorch's training step of bench's twin of ``model`` (SGD momentum 0.9, cross-entropy, random batch on
    the GPU): a callable running one step, eagerly or as a replay of the whole step captured in a CUDA graph."""
    import torch
    tm = torch_twin(model)
    opt = torch.optim.SGD(tm.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn((batch,) + shape, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(tm(x), y).backward()
        opt.step()
    if not graph:
        return step
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def torch_train(name, batch, steps, repeats, graph):
    import torch
    model, shape = build(name)
    return timed(torch_step(model, shape, batch, graph), torch.cuda.synchronize, steps, repeats)


def per_op_params(name, batches, nudge=False, device="cuda"):
    """The parameters after the per-op path's steps over ``batches`` (SGD with momentum from the zoo's initial
    weights; ``nudge``: every weight one ulp up first, on the host); ``device="cpu"`` runs the numpy twin."""
    m, _ = build(name)
    if nudge:
        for p in m.parameters():
            p.data = np.nextafter(p.data, np.float32(np.inf))
    m.to(device)
    opt = optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for bx, by in batches:
        loss_fn(m(ops.cuda.asarray(bx) if device == "cuda" else bx), by)
        m.backward(loss_fn.backward(), input_grad=False)
        opt.step()
    return [p.data.numpy() if device == "cuda" else np.array(p.data) for p in m.parameters()]


def _maxdiff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


def agreement(name, steps=20, batch=64):
    """max |logits| difference (compiled vs per-op, same weights); max |param| difference after 20 steps of
    compiled vs per-op; and the scale that difference is read against, the per-op path against itself under two
    perturbations that change only float32 rounding (tests/test_compiler.py's 20-step test takes the same two):
    each batch's rows in another order (every reduction over the batch), and the initial weights one ulp up (every
    activation: what a kernel that sums in another order does -- the executor picks each convolution's kernel by
    timing).  Training carries a rounding difference on, through a ReLU or a pooling choice that flips, batch norm
    on random data most of all (session 36: all-conv 5.2e-5 apart compiled vs per-op on the GPU, and the numpy
    twin 5.2e-5 apart from itself with the rows reordered; SmallCNN 2.8e-2 against 2.4e-2), so the first figure
    means something only beside the other two.  Returns (logits, params, {"rows": .., "ulp": ..})."""
    rng = np.random.default_rng(2)
    model, shape = build(name)
    batches = [(rng.standard_normal((batch,) + shape).astype(np.float32), rng.integers(0, 10, batch))
               for _ in range(steps)]
    model.to("cuda").eval()
    x = batches[0][0]
    ref = ops.cuda.to_numpy(model(ops.cuda.asarray(x)))
    got = cydnn.compile(model, input_shape=shape)(x)
    logits = float(np.abs(got - ref).max())
    m, _ = build(name)
    m.to("cuda")
    s = cydnn.compile(m, optim.SGD(m.parameters(), lr=0.01, momentum=0.9), batch_size=batch, input_shape=shape)
    for bx, by in batches:
        s(bx, by)
    compiled = [p.data.numpy() for p in m.parameters()]
    per_op = per_op_params(name, batches)
    order = np.random.default_rng(5).permutation(batch)
    self_diff = {"rows": _maxdiff(per_op_params(name, [(x[order], y[order]) for x, y in batches]), per_op),
                 "ulp": _maxdiff(per_op_params(name, batches, nudge=True), per_op)}
    return logits, _maxdiff(compiled, per_op), self_diff


def fresh_caches(environ=os.environ):
    """Empty folders for NVRTC's cache and for cydnn's kernel cache, for this process and the NVRTC children it
    starts, removed at exit; where ``$CUDA_CACHE_PATH`` or ``$CYDNN_KERNEL_CACHE`` is set, that one is kept.  NVRTC
    12.9+ stores what it compiled in the driver's compute cache (``~/.nv/ComputeCache``, ``$CUDA_CACHE_PATH``) and
    serves the same source and options from it (known since session 26, whose commands removed ~/.nv/ComputeCache by
    hand; session 37's first call did not, and its second run on one machine had the CNN's whole form in 0.1 s of
    NVRTC against 1.7-2.9 s cold; most likely session 21's unexplained 0.06-0.09 s too).  Returns the folders made."""
    made = {}
    for var, prefix in (("CUDA_CACHE_PATH", "cuda-cache-"), ("CYDNN_KERNEL_CACHE", "cydnn-kernels-")):
        if not environ.get(var):
            made[var] = environ[var] = tempfile.mkdtemp(prefix=prefix)
            atexit.register(shutil.rmtree, made[var], True)
    return made


def inference(name, have_torch):
    import torch
    model, shape = build(name)
    model.to("cuda").eval()
    rng = np.random.default_rng(3)
    one = rng.standard_normal((1,) + shape).astype(np.float32)
    many = rng.standard_normal((10000,) + shape).astype(np.float32)
    t0 = time.perf_counter()
    infer = cydnn.compile(model, input_shape=shape, softmax=True)
    infer(one)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = {"compile_s": compile_s, "generated": infer.wait_generated()}   # the kernel generated in the background
    res["generated_wait_s"] = time.perf_counter() - t0
    res["cydnn_1_p50_us"], res["cydnn_1_p99_us"] = latencies(lambda: infer(one))
    # the resident kernel (opt-in, compile(..., resident_us=N)): the same one image without a launch
    resident = cydnn.compile(model, input_shape=shape, softmax=True, resident_us=2000)
    resident(one)
    resident.wait_generated()                  # (a generated kernel, where one is used, takes precedence)
    res["resident_1_p50_us"], res["resident_1_p99_us"] = latencies(lambda: resident(one))
    res["resident_served"] = resident.info()["fused_net"]["resident"]
    resident = None                           # its kernel returns now: nothing below waits on its idle time
    infer(many)
    many_calls = {"cydnn": lambda: infer(many)}
    if have_torch:
        tm = torch_twin(model).eval()

        def tpredict(a):
            with torch.no_grad():
                return torch.softmax(tm(torch.from_numpy(a).cuda()), 1).cpu().numpy()
        res["torch_1_p50_us"], res["torch_1_p99_us"] = latencies(lambda: tpredict(one))
        tpredict(many)
        many_calls["torch"] = lambda: tpredict(many)
    rates = rates_10k(many_calls)
    res["cydnn_10k_img_s"] = rates["cydnn"]
    if have_torch:
        res["torch_10k_img_s"] = rates["torch"]
    fused = infer.info()["fused_net"]
    res["backend"] = {b: ("plan" if c is None else f"fused/{c}") for b, c in fused["clusters"].items()}
    res["piped_10k"] = infer._pipe is not None        # the 10,000 images' full chunks went through the copy pipe
    res["fused_reason"], res["fused_timed_us"] = fused["reason"], fused["timed_us"]
    # The compiles this network started in the background (a 1,024-image bucket the plan won by less than
    # GENERATED_HOPE compiles a kernel to time again) end here, so that the next network's compile time is its own
    # (session 29: LeNet 16/32's and the CNN's whole forms were ready 0.4-0.7 s later in the zoo than alone)
    infer.wait_generated()
    return res


def rates_10k(calls, passes=7):
    """Images a second of each of ``calls`` (name -> a call of 10,000 images): the median of ``passes`` calls each,
    timed one by one and in turn, one call of each per pass, so that a slow moment of the host (31 MB of copies
    are bound by its memory) falls on both sides of a ratio. Session 29: one slow window of three passes timed
    together gave LeNet-5 0.29x PyTorch's rate (its reruns 1.57-1.77x); session 33: with the two sides timed one
    after the other, either moved 20-40 % between runs."""
    times = {name: [] for name in calls}
    for _ in range(passes):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: 10000 / statistics.median(t) for name, t in times.items()}


def _generated_summary(generated):
    """One line for the kernels generated for a network (the whole record is in the JSON): per cluster size, the form
    in use, when the first kernel came and each form's compile seconds and kernel microseconds."""
    if not isinstance(generated, dict):
        return str(generated)
    out = []
    for cluster, info in sorted(generated.items()):
        forms = ", ".join(f"{f} {r.get('compile_s')} s (ready {r.get('ready_s', '-')} s from the first call) "
                          f"{r.get('timed_us', {}).get('generated', '-')} us {r.get('status')}"
                          for f, r in info.get("forms", {}).items())
        out.append(f"{cluster}: {info.get('status')} ({info.get('form', '-')}, first {info.get('first_s', '-')} s; {forms})")
    return "; ".join(out) or "none"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(zoo()))
    p.add_argument("--batches", default="32,64,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--infer-only", action="store_true", help="only the inference figures")
    p.add_argument("--train-only", action="store_true", help="only the training figures")
    p.add_argument("--agree-only", action="store_true", help="only the compiled path's agreement with the per-op path")
    p.add_argument("--warm-caches", action="store_true",
                   help="use NVRTC's and cydnn's kernel caches as they are (default: fresh folders, a first run's compile)")
    args = p.parse_args()
    if not args.warm_caches:
        fresh_caches()
    cydnn.cuda.check_device(0)
    import torch
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    print(f"GPU {cydnn.cuda.get_device_name()}; torch {torch.__version__}; fp32, TF32 off")
    out = {}
    for name in args.models.split(","):
        r = out[name] = {"train": {}}
        for b in ([] if args.infer_only or args.agree_only else (int(s) for s in args.batches.split(","))):
            torch.cuda.reset_peak_memory_stats()
            cydnn.cuda.reset_peak_memory_stats()
            comp, compile_s, info = cydnn_train(name, b, args.steps, args.repeats, True)
            peak = cydnn.cuda.memory_stats()["peak_reserved_bytes"]
            perop, _, _ = cydnn_train(name, b, max(20, args.steps // 4), args.repeats, False)
            eager = torch_train(name, b, max(20, args.steps // 4), args.repeats, False)
            graph = torch_train(name, b, args.steps, args.repeats, True)
            r["train"][b] = {"compiled_us": comp, "per_op_us": perop, "torch_eager_us": eager, "torch_graph_us": graph,
                             "vs_torch_graph": graph / comp, "compile_s": compile_s, "mode": info["mode"],
                             "kernels": info["kernels_per_step"] and max(info["kernels_per_step"].values()),
                             "torch_peak_bytes": torch.cuda.max_memory_reserved(), "cydnn_peak_reserved": peak}
            print(f"{name:22s} b{b:<4d} compiled {comp:8.1f} us  per-op {perop:8.1f}  torch eager {eager:8.1f}  "
                  f"torch graph {graph:8.1f}  -> {graph / comp:5.2f}x vs graph  ({info['mode']}, "
                  f"{r['train'][b]['kernels']} kernels, compile {compile_s:.2f} s)", flush=True)
            trial = next(iter(info.get("fused_train", {}).values()), {})
            r["train"][b]["fused_train"] = {k: v for k, v in trial.items() if k in ("used", "reason", "timed_us",
                                                                                   "cluster", "cluster_us")}
            print(f"{'':22s}       fused step: {r['train'][b]['fused_train']}", flush=True)
        if args.train_only:
            continue
        if not args.agree_only:
            r["infer"] = inference(name, True)
            i = r["infer"]
            print(f"{name:22s} timed (us) {i['fused_timed_us']}", flush=True)
            print(f"{name:22s} infer 1 img p50 {i['cydnn_1_p50_us']:6.1f} us (p99 {i['cydnn_1_p99_us']:6.1f}) torch "
                  f"{i['torch_1_p50_us']:6.1f}; resident kernel p50 {i['resident_1_p50_us']:6.1f} (p99 "
                  f"{i['resident_1_p99_us']:6.1f}, {i['resident_served']['served']}); 10k: {i['cydnn_10k_img_s']:,.0f} img/s vs torch "
                  f"{i['torch_10k_img_s']:,.0f}; compile {i['compile_s']:.2f} s; backend by bucket {i['backend']}"
                  + f" (10k piped: {i.get('piped_10k')})"
                  + (f" ({i['fused_reason']})" if i["fused_reason"] else "")
                  + f"; generated kernels {_generated_summary(i['generated'])} (waited {i['generated_wait_s']:.1f} s)",
                  flush=True)
        if args.infer_only:
            continue
        r["logits_maxdiff"], r["params_maxdiff_20_steps"], r["params_self_maxdiff_20_steps"] = agreement(name)
        own = r["params_self_maxdiff_20_steps"]
        print(f"{name:22s} max |logits diff| {r['logits_maxdiff']:.2e}, max |param diff| after 20 steps "
              f"{r['params_maxdiff_20_steps']:.2e} (per-op against itself: rows reordered {own['rows']:.2e}, "
              f"weights one ulp up {own['ulp']:.2e})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
