"""The cells of the teaching notebook examples/notebooks/framework_internals.ipynb, in order.

This file is the notebook's source: edit the cells here, then rebuild the .ipynb with
``python tools/make_notebook.py --in-place`` (``--execute`` as well to fill its outputs).
``CELLS`` is a list of ``(kind, source)`` with kind ``"markdown"`` or ``"code"``.
"""

CELLS = []      # (kind, source) in order


def md(source):
    CELLS.append(("markdown", source.strip("\n")))


def code(source):
    CELLS.append(("code", source.strip("\n")))


md("""
# How a deep-learning framework works inside — cydnn, live

This notebook opens cydnn up while it runs: the path of one call from numpy down to cuDNN, every layer
forward and backward with its shapes, a gradient check, the memory pool and cuDNN's algorithm choice,
a training run with its pictures, the compiler's plan for LeNet-5, what CUDA graphs and fused kernels
change, and inference on numpy arrays. It runs top to bottom without a GPU too (the GPU cells then say
what they would show, and training uses a small subset of MNIST). The committed copy holds the outputs
of its last run; the first cell's output names the GPU it ran on.

MNIST comes through cydnn's own dataset API: the cache (`$CYDNN_DATA`, else `./data` beside the
kernel), then the mirror named in `$CYDNN_MNIST_MIRROR` (a folder with the four MNIST `.gz` files, or a
URL), else the public mirrors. Set a variable from here with `%env CYDNN_MNIST_MIRROR=/path/to/mnist`
and re-run the cell.
""")
code("""
%matplotlib inline
import os, time, tempfile
from pathlib import Path
import numpy as np
import matplotlib.pyplot as plt
import cydnn
from cydnn import datasets, introspect, models, nn, ops, optim

GPU = cydnn.cuda.is_available()
device = "cuda" if GPU else "cpu"
print("cydnn", cydnn.versions()["cydnn"], "| GPU:",
      cydnn.cuda.get_device_name() if GPU else "none (the GPU cells say what they would show)")
""")
code("""
class MNISTUnavailable(RuntimeError):
    def _render_traceback_(self):      # IPython shows this one line instead of a traceback
        return [f"MNISTUnavailable: {self}"]

mirror = os.environ.get("CYDNN_MNIST_MIRROR")
try:
    train_set, test_set = datasets.load_mnist(mirrors=[mirror] if mirror else None)
except (datasets.DatasetDownloadError, OSError, ValueError) as e:
    raise MNISTUnavailable(
        f"MNIST is not in {datasets.data_root().resolve() / 'mnist'} and no mirror gave it "
        f"({str(e).splitlines()[0]}): set CYDNN_MNIST_MIRROR=DIR_OR_URL (a folder with the four MNIST .gz files) "
        "or CYDNN_DATA=DIR (a folder holding mnist/), e.g. %env CYDNN_MNIST_MIRROR=DIR, and re-run this cell") from None
LIMIT = int(os.environ.get("CYDNN_NB_LIMIT", 60000 if GPU else 2000))   # training images (a subset on the CPU)
TEST = len(test_set) if GPU else 2000                                    # test images
test_images, test_labels = test_set.images[:TEST], test_set.labels[:TEST]
print(f"MNIST in {os.path.relpath(train_set.folder)}: {len(train_set)} train / {len(test_set)} test images; "
      f"training on {LIMIT}, testing on {TEST}")
""")
md("""
## 1. The path of one call

`ops.cuda.conv_forward(x, w, b)` takes numpy arrays or `DeviceArray`s. Below is the real source of each
level, read from the installed package now: the Python op (checks, allocation), the Cython function
(arrays to pointers, status to exception), the C function (a cached plan, the algorithm cuDNN measured),
and the library calls it makes.
""")
code("""
print("=== Python: cydnn/ops/cuda.py ===")
print(introspect.python_source(ops.cuda.conv_forward))
print("=== Cython: cydnn/_C.pyx ===")
print(introspect.pyx_source("conv_forward"))
""")
code("""
c = introspect.c_source("conv_forward")
print("=== C: cpp/conv.cu (the function behind cydnn_conv_forward) ===")
print(c)
print("=== ...and the library calls in it ===")
print(introspect.library_calls(c))
""")
md("""
## 2. Every layer, forward and backward, on the numpy twin — and the same on the GPU

Each op returns `(y, cache)`; its backward takes `(dy, cache)` and returns the gradient of its input
(and of its weights). The numpy twin is the reference every GPU op is tested against.
""")
code("""
rng = np.random.default_rng(0)
model = models.LeNet5(seed=0)
x = model.preprocess(test_images[:4])                          # (4, 1, 28, 28), normalised
h = x
print(f"{'layer':8s} {'input':>16s} -> {'output':16s}")
for name, layer in model._modules.items():
    y = layer(h)
    print(f"{name:8s} {str(h.shape):>16s} -> {str(y.shape):16s}")
    h = y
dy = rng.standard_normal(h.shape).astype(np.float32)
print("\\nbackward:")
for name, layer in reversed(list(model._modules.items())):
    dx = layer.backward(dy)
    grads = ", ".join(f"d{k} {p.grad.shape}" for k, p in layer._parameters.items() if p is not None and p.grad is not None)
    print(f"{name:8s} dy {str(dy.shape):16s} -> dx {str(dx.shape):16s} {grads}")
    dy = dx
""")
code("""
if not GPU:
    print("no GPU: here conv, max-pool, ReLU and linear would run forward and backward on the GPU and on the "
          "numpy twin, printing max|gpu - cpu| of each (0 for pooling and ReLU, ~1e-5 for conv and linear on an H100)")
else:
    xs = rng.standard_normal((8, 6, 12, 12)).astype(np.float32)
    ws = rng.standard_normal((16, 6, 5, 5)).astype(np.float32)
    bs = rng.standard_normal(16).astype(np.float32)
    for op, args in [("conv_forward", (xs, ws, bs)), ("max_pool_forward", (xs,)), ("relu_forward", (xs,)),
                     ("linear_forward", (xs.reshape(8, -1), rng.standard_normal((10, 864)).astype(np.float32), bs[:10]))]:
        y_cpu, cache_cpu = getattr(ops.cpu, op)(*args)
        y_gpu, cache_gpu = getattr(ops.cuda, op)(*args)
        d = rng.standard_normal(y_cpu.shape).astype(np.float32)
        back = op.replace("forward", "backward")
        g_cpu = getattr(ops.cpu, back)(d, cache_cpu)
        g_gpu = getattr(ops.cuda, back)(d, cache_gpu)
        g_cpu = g_cpu[0] if isinstance(g_cpu, tuple) else g_cpu
        g_gpu = g_gpu[0] if isinstance(g_gpu, tuple) else g_gpu
        print(f"{op:18s} forward max|gpu - cpu| = {np.abs(y_gpu - y_cpu).max():.2e}   "
              f"backward (dx) = {np.abs(g_gpu - g_cpu).max():.2e}")
""")
md("""
## 3. A gradient check, live

Backward is hand-written for every op, so it is checked against finite differences:
`(L(w + e) - L(w - e)) / 2e` for a few weights, in float64 on the CPU, with L = sum(y * r) for a fixed random r.
""")
code("""
def grad_check(layer, x, n=6, eps=1e-6):
    layer.double()
    r = rng.standard_normal(layer(x).shape)
    layer(x); layer.backward(r)
    worst = 0.0
    for pname, p in layer._parameters.items():
        flat = p.data.reshape(-1)
        for i in rng.choice(flat.size, size=min(n, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + eps; up = (layer(x) * r).sum()
            flat[i] = old - eps; down = (layer(x) * r).sum()
            flat[i] = old
            numeric, analytic = (up - down) / (2 * eps), p.grad.reshape(-1)[i]
            worst = max(worst, abs(numeric - analytic) / max(1e-8, abs(numeric) + abs(analytic)))
    return worst

conv = nn.Conv2d(3, 4, 3, padding=1, rng=1)
lin = nn.Linear(20, 7, rng=2)
print(f"Conv2d: worst relative difference {grad_check(conv, rng.standard_normal((2, 3, 6, 6))):.1e}")
print(f"Linear: worst relative difference {grad_check(lin, rng.standard_normal((5, 20))):.1e}")
""")
md("""
## 4. The memory pool and cuDNN's algorithm choice

Every `DeviceArray` comes from cydnn's caching pool: a freed block goes back to the pool and the next
request of its size class takes it (a *cache hit*) without asking the driver. Once warm, a training
step asks the driver for nothing: every allocation is a cache hit (`num_device_mallocs` does not move).
The first convolution of each shape measures cuDNN's algorithms (`cudnnFind*`) and keeps the fastest
usable one in a plan.
""")
code("""
if not GPU:
    print("no GPU: here one warm training step would print the pool's counters before and after it "
          "(num_allocs and num_cache_hits grow by the same count, num_device_mallocs does not move)")
else:
    m = models.LeNet5(seed=0).to("cuda")
    loader = datasets.DataLoader(train_set.images[:640], train_set.labels[:640], batch_size=64,
                                 mean=m.mean, std=m.std, device="cuda")
    opt = optim.SGD(m.parameters(), lr=0.03, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    def one_step(x, y):
        loss_fn(m(x), y); m.backward(loss_fn.backward()); opt.step()
    batches = list(loader)
    one_step(*batches[0]); one_step(*batches[1])   # warm-up: plans, algorithms, and the pool's blocks for two
    cydnn.cuda.synchronize()                       # steps' arrays (a step's arrays die as the next replaces them)
    before = cydnn.cuda.memory_stats()
    one_step(*batches[2])
    cydnn.cuda.synchronize()
    after = cydnn.cuda.memory_stats()
    for k in ("num_allocs", "num_cache_hits", "num_device_mallocs", "allocated_bytes", "reserved_bytes"):
        print(f"{k:20s} {before[k]:>12,} -> {after[k]:>12,}")
""")
code("""
if not GPU:
    print("no GPU: here each convolution shape of LeNet-5 at batch 64 would list the algorithms cuDNN measured "
          "(forward, backward data, backward filter), their times, and the one kept")
else:
    for a in cydnn.cuda.conv_algorithms():
        if "n=64" not in a["key"]:
            continue
        shape = a["key"].split(",k=")[0].replace("conv:", "")
        cands = ", ".join(f"{name} {ms:.3f}" for name, ms, status in a["candidates"] if status == 0)
        print(f"{shape:22s} {a['direction']:16s} chose {a['algo']:22s} ({a['time_ms']:.3f} ms)  measured: {cands}")
""")
md("""
## 5. Training LeNet-5 for an epoch

The reference loop, one op at a time, at batch 32 (the training command's default), recording the loss
every few batches. Without a GPU it trains on the first `LIMIT` images only (2,000 unless
`$CYDNN_NB_LIMIT` says otherwise) and tests on 2,000, so the pictures below come in seconds.
""")
code("""
model = models.LeNet5(seed=0).to(device)
loader = datasets.DataLoader(train_set.images[:LIMIT], train_set.labels[:LIMIT], batch_size=32, seed=0,
                             mean=model.mean, std=model.std, device=device)
opt = optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True, weight_decay=5e-4)
loss_fn = nn.CrossEntropyLoss()
losses, t0 = [], time.perf_counter()
for i, (x, y) in enumerate(loader):
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())
    opt.step()
    if i % 10 == 0:
        losses.append((i, float(ops.backend_of(loss).to_numpy(loss))))
print(f"one epoch of {LIMIT} images on {device}: {time.perf_counter() - t0:.1f} s")
probs = model.predict(test_images)
pred = probs.argmax(1)
print(f"test accuracy {np.mean(pred == test_labels):.2%} on {TEST} test images")
plt.figure(figsize=(5, 3)); plt.plot(*zip(*losses)); plt.xlabel("batch"); plt.ylabel("loss"); plt.title("training loss")
plt.show()
""")
code("""
conf = np.zeros((10, 10), int)
np.add.at(conf, (test_labels, pred), 1)
fig, ax = plt.subplots(figsize=(4.5, 4.5))
ax.imshow(np.log1p(conf), cmap="Blues")
for i in range(10):
    for j in range(10):
        ax.text(j, i, conf[i, j], ha="center", va="center", fontsize=7,
                color="white" if np.log1p(conf[i, j]) > 0.6 * np.log1p(conf.max()) else "black")
ax.set(xlabel="predicted", ylabel="true", title="confusion matrix (colour: log of the count)",
       xticks=range(10), yticks=range(10))
plt.show()
wrong = np.flatnonzero(pred != test_labels)[:16]
fig, axes = plt.subplots(2, 8, figsize=(10, 3))
for ax in axes.flat:
    ax.axis("off")
for ax, i in zip(axes.flat, wrong):
    ax.imshow(test_images[i], cmap="gray")
    ax.set_title(f"{test_labels[i]} as {pred[i]}", fontsize=8)
fig.suptitle("misclassified test digits (true as predicted)")
plt.show()
""")
code("""
w1 = ops.backend_of(model.conv1.weight.data).to_numpy(model.conv1.weight.data)[:, 0]
fig, axes = plt.subplots(1, 6, figsize=(8, 1.6))
for k, ax in enumerate(axes):
    ax.imshow(w1[k], cmap="RdBu"); ax.axis("off"); ax.set_title(f"filter {k}", fontsize=8)
fig.suptitle("learned conv1 filters"); plt.show()
cpu_model = models.LeNet5(seed=0)
cpu_model.load_state_dict(model.state_dict())
digit = cpu_model.preprocess(test_images[:1])
maps = cpu_model.act1(cpu_model.conv1(digit))[0]
fig, axes = plt.subplots(1, 7, figsize=(10, 1.7))
axes[0].imshow(test_images[0], cmap="gray"); axes[0].set_title("digit", fontsize=8)
for k in range(6):
    axes[k + 1].imshow(maps[k], cmap="viridis"); axes[k + 1].set_title(f"map {k}", fontsize=8)
for ax in axes: ax.axis("off")
fig.suptitle("conv1 + ReLU feature maps of one digit"); plt.show()
""")
md("""
## 6. The compiler's plan for LeNet-5

`cydnn.compile(model, optimizer, batch_size=64)` turns a model and its optimizer into one training
step, planned once; `step.explain()` prints the plan: each step with the library calls or kernels it
runs, every buffer with its bytes, and what the compiler's passes did. Without a GPU the compiled step
does not run (the first line says why), but the plan is the same. On a cydnn without `cydnn.compile`
the cell says so in one line.
""")
code("""
# --- The compiler's plan for LeNet-5: cydnn.compile(...).explain() ---
if not hasattr(cydnn, "compile"):
    print("this cydnn has no cydnn.compile yet: once it has, this cell prints the compiler's plan for LeNet-5")
else:
    import cydnn.compiler
    plan_model = models.LeNet5(seed=0).to(device)
    step = cydnn.compile(plan_model, optim.SGD(plan_model.parameters(), lr=0.03, momentum=0.9), batch_size=64,
                         input_shape=(1, 28, 28))
    print(step.explain())
""")
md("""
## 7. What a CUDA graph and a fused kernel change

The reference loop calls the C library ~35 times per step from Python (each call validates its
arguments and launches one or more kernels). `model.compile(...)` checks once, allocates every buffer
once, and runs a step as 3 kernels (gather+forward+loss+backward, the update of all parameters,
bookkeeping), captured as CUDA graphs of 32 steps. Most of the gain is the fusion: with 3 launches a
step the host keeps ahead of the GPU, so the graphs add only a few percent.
""")
code("""
if not GPU:
    print("no GPU: here the reference loop's calls into the C library per step would be counted (~35), then one "
          "epoch timed three ways: reference loop, fused kernels, fused kernels in CUDA graphs (about 1.2 s, "
          "0.074 s and 0.072 s on an H100)")
else:
    from cydnn import _C
    calls = {"n": 0}
    originals = {}
    for name in [n for n in dir(_C) if n.endswith(("_forward", "_backward", "_update"))
                 or n in ("softmax_cross_entropy", "gather_batch")]:          # every op the reference loop calls
        originals[name] = getattr(_C, name)
        def counted(*a, _f=originals[name], **k):
            calls["n"] += 1
            return _f(*a, **k)
        setattr(_C, name, counted)
    m = models.LeNet5(seed=0).to("cuda")
    plain = m.compile(optim.SGD(m.parameters(), lr=0.03, momentum=0.9), 64, fused=False, cuda_graph=False)
    small = datasets.DataLoader(train_set.images[:640], train_set.labels[:640], batch_size=64, mean=m.mean,
                                std=m.std, device="cuda")
    plain.train_epoch(small, steps=1); calls["n"] = 0
    plain.train_epoch(small, steps=1)
    per_step = calls["n"]
    for name, f in originals.items():
        setattr(_C, name, f)
    print(f"reference loop: {per_step} calls into the C library per step (each one or more kernel launches)")

    full = datasets.DataLoader(train_set.images, train_set.labels, batch_size=64, mean=m.mean, std=m.std, device="cuda")
    for label, kw in (("reference loop", dict(fused=False, cuda_graph=False)), ("fused kernels", dict(cuda_graph=False)),
                      ("fused + CUDA graphs", {})):
        mm = models.LeNet5(seed=0).to("cuda")
        step = mm.compile(optim.SGD(mm.parameters(), lr=0.03, momentum=0.9, nesterov=True), 64, **kw)
        step.train_epoch(full)
        r = step.train_epoch(full)
        info = step.info()
        kernels = ", ".join(map(str, sorted(set(info["kernels_per_step"].values()))))
        if info["mode"] == "reference":
            kernels = f"~{per_step}+ (one op at a time)"
        print(f"{label:20s} epoch {r['seconds']:.3f} s   mode {info['mode']:12s} kernels per step: {kernels or '-'}"
              f"   graphs (batch, steps) -> kernels: {info['graphs'] or '-'}   train acc {r['accuracy']:.2%}")
""")
md("""
## 8. Inference on numpy arrays

Save the model of section 5, load it back (a checkpoint is one `.npz`, never unpickled), and predict raw
uint8 digits. On the GPU `predict` takes the fast path: one C call (pinned memory, one fused kernel in a
captured graph); `predict(x, fast=False)` is the per-layer reference.
""")
code("""
path = Path(tempfile.mkdtemp()) / "lenet.npz"
cydnn.save(model, path)
loaded = cydnn.load(path, device=device)
digits = test_images[100:106]
p = loaded.predict(digits)
if GPU:
    print(f"fast vs reference path: max |dp| = {np.abs(p - loaded.predict(digits, fast=False)).max():.1e}")
else:
    print("no GPU: on a GPU this line compares predict's fast path with the per-layer reference (max |dp| ~3e-7)")
fig, axes = plt.subplots(2, 6, figsize=(11, 3.6), gridspec_kw={"height_ratios": [2, 1]})
for k in range(6):
    axes[0, k].imshow(digits[k], cmap="gray"); axes[0, k].axis("off")
    axes[0, k].set_title(f"predicted {p[k].argmax()} ({p[k].max():.0%})", fontsize=8)
    axes[1, k].bar(range(10), p[k]); axes[1, k].set_xticks(range(10)); axes[1, k].set_ylim(0, 1)
    axes[1, k].tick_params(labelsize=6)
plt.show()
""")
