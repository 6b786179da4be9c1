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
