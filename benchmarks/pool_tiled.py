"""The zoo's 2x2 max poolings at batch 64 (the CNN's three, LeNet 16/32's two) by cuDNN (the per-op path) and by
cpp/pool.cu's max_pool_tiled_kernel (the compiler's plans): us a call, queued, best of 3 x 200.

    python3 benchmarks/pool_tiled.py
"""
import numpy as np
from cydnn import _C
from cydnn.compiler.executor import time_calls
rng = np.random.default_rng(0)
for shape in [(64, 24, 32, 32), (64, 48, 16, 16), (64, 96, 8, 8), (64, 16, 24, 24), (64, 32, 8, 8)]:
    x = _C.to_device(rng.standard_normal(shape).astype(np.float32))
    n, c, h, w = shape
    y = _C.empty((n, c, h // 2, w // 2))
    a = lambda: _C.max_pool_forward(x, y, (2, 2), (2, 2), (0, 0))   # noqa: E731
    b = lambda: _C.max_pool_tiled_forward(x, y, (2, 2))              # noqa: E731
    ta = 1e6 * min(time_calls(a, 200) for _ in range(3))
    tb = 1e6 * min(time_calls(b, 200) for _ in range(3))
    print(f"{shape}: cuDNN {ta:5.2f} us, tiled {tb:5.2f} us")
