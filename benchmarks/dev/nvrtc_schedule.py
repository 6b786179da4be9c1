"""The generated kernels' background compile under scheduling variants (session 37's A/B): one network's first
one-image call in a fresh process with NVRTC's and cydnn's caches empty, then when each form of its generated kernel
was ready (seconds from the first call), NVRTC's seconds and the kernel's µs.  VARIANT: base (as shipped), split0
($CYDNN_NVRTC_SPLIT=0: the whole form only), nice (the layers form's units at nice 10), g3 (the layers form in three
groups of layers), iso (the whole form's source compiled alone, in this process).  Run each in its own process:

    for v in base split0 nice g3 iso; do python3 benchmarks/dev/nvrtc_schedule.py cnn32_24_48_96 $v; done
"""
import os
import subprocess
import sys
import tempfile
import time
name, variant = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
for var in ("CUDA_CACHE_PATH", "CYDNN_KERNEL_CACHE"):     # empty caches (bench_zoo.fresh_caches), set before CUDA starts
    os.environ.setdefault(var, tempfile.mkdtemp(prefix="nvrtc-schedule-"))
if variant == "split0":
    os.environ["CYDNN_NVRTC_SPLIT"] = "0"
import numpy as np  # noqa: E402
import bench_zoo  # noqa: E402
import cydnn  # noqa: E402
from cydnn.compiler import nvrtc_jobs, fused_net_gen  # noqa: E402
if variant == "nice":
    orig_init, orig_start, real = nvrtc_jobs.Generation.__init__, nvrtc_jobs.Generation._start, subprocess.Popen
    def init(self, text, arch=nvrtc_jobs.ARCH, rdc=False):
        self._nice = rdc
        orig_init(self, text, arch, rdc)
    def start(self):
        if getattr(self, "_nice", False):
            subprocess.Popen = lambda *a, **k: real(*a, preexec_fn=lambda: os.nice(10), **k)
            try:
                orig_start(self)
            finally:
                subprocess.Popen = real
        else:
            orig_start(self)
    nvrtc_jobs.Generation.__init__, nvrtc_jobs.Generation._start = init, start
if variant == "g3":
    orig_units = fused_net_gen.units
    def units(layers, *a, **k):
        n = len(layers)
        return orig_units(layers, *a, groups=sorted({0, n // 3, (2 * n) // 3}), **k)
    fused_net_gen.units = units
model, shape = bench_zoo.build(name)
model.to("cuda").eval()
one = np.random.default_rng(3).standard_normal((1,) + shape).astype(np.float32)
if variant == "iso":
    from cydnn.compiler import fused_net as fn
    from cydnn.compiler.trace import trace
    nodes = trace(model, shape, 1)
    net = fn.FusedNetwork(fn.describe(nodes), shape, nodes[-1].out_shape[1:], False, 1)
    text = net._source(16)
    t = time.perf_counter(); fused_net_gen.compile_cubin(text); a = time.perf_counter() - t
    print(f"{name:16s} iso   whole nvrtc {a:.2f} s (in this process, cold)", flush=True)
    sys.exit()
t0 = time.perf_counter()
infer = cydnn.compile(model, input_shape=shape, softmax=True)
infer(one)
first = time.perf_counter() - t0
g = infer.wait_generated()
out = []
for c, info in sorted(g.items()):
    for f, r in info.get("forms", {}).items():
        out.append(f"{c}/{f} ready {r.get('ready_s')} nvrtc {r.get('nvrtc_s')} {r.get('timed_us', {}).get('generated')} us {r.get('status')}")
print(f"{name:16s} {variant:6s} first call {first:.2f} s; " + "; ".join(out), flush=True)
