"""benchmarks/bench_zoo.py's reading of agreement on the CPU (the numpy twin; the compiled side runs on the GPU
machine): the per-op path's own spread after a few steps, under the two perturbations it is read against, is
the size of float32 rounding carried on by training -- not zero (the perturbations reach the parameters) and
nowhere near the parameters' own size."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_zoo  # noqa: E402


def test_the_per_op_paths_own_spread_is_rounding():
    name = "mlp_784_128_10"
    rng = np.random.default_rng(2)
    _, shape = bench_zoo.build(name)
    batches = [(rng.standard_normal((64,) + shape).astype(np.float32), rng.integers(0, 10, 64)) for _ in range(3)]
    start = [np.array(p.data) for p in bench_zoo.build(name)[0].parameters()]
    ref = bench_zoo.per_op_params(name, batches, device="cpu")
    assert bench_zoo._maxdiff(ref, start) > 1e-4                       # the steps moved the weights
    assert bench_zoo._maxdiff(bench_zoo.per_op_params(name, batches, device="cpu"), ref) == 0.0   # deterministic
    order = np.random.default_rng(5).permutation(64)
    rows = bench_zoo._maxdiff(bench_zoo.per_op_params(name, [(x[order], y[order]) for x, y in batches],
                                                      device="cpu"), ref)
    ulp = bench_zoo._maxdiff(bench_zoo.per_op_params(name, batches, nudge=True, device="cpu"), ref)
    for spread in (rows, ulp):
        assert 0.0 < spread < 1e-5


def test_each_run_compiles_with_empty_caches_unless_told(tmp_path):
    """fresh_caches: NVRTC's cache (the driver's compute cache, $CUDA_CACHE_PATH) and cydnn's kernel cache point at
    new empty folders, so that the run times a first run's compiles; a folder the caller set is kept."""
    env = {"CYDNN_KERNEL_CACHE": str(tmp_path)}
    made = bench_zoo.fresh_caches(env)
    assert list(made) == ["CUDA_CACHE_PATH"] and env["CYDNN_KERNEL_CACHE"] == str(tmp_path)
    assert os.path.isdir(env["CUDA_CACHE_PATH"]) and os.listdir(env["CUDA_CACHE_PATH"]) == []
    other = {}
    assert set(bench_zoo.fresh_caches(other)) == {"CUDA_CACHE_PATH", "CYDNN_KERNEL_CACHE"}
    assert other["CUDA_CACHE_PATH"] != env["CUDA_CACHE_PATH"]
