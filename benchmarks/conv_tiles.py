"""The zoo CNN's three convolutions (3x32x32, 24/48/96 channels, 3x3, padding 1) at batch 64, every tile of
cpp/conv_igemm.cu (forward with bias + ReLU) and of cpp/conv_wgrad.cu (the filter gradient alone), each timed alone:
us a call (queued, best of 3 x 50) and GFLOP/s. Under ncu (the second form) only the chosen kernel launches.

    python3 benchmarks/conv_tiles.py               # timings
    ncu --kernel-name regex:"igemm_conv_kernel|wgrad_kernel" --launch-skip 4 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \\
        python3 benchmarks/conv_tiles.py ncu LAYER fwd|wgrad TILE     # only that kernel launches (13 times)
"""
import sys
import numpy as np
from cydnn import _C
from cydnn.compiler.executor import time_calls

ncu = len(sys.argv) > 1
ONLY = sys.argv[2:] and (int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))   # layer, fwd|wgrad, tile
rng = np.random.default_rng(0)


def measure(li, kind, ti, label, flop, f):
    """Time one tile's call (a tile that refuses the layer is left out); under ncu only launch the chosen one."""
    if ncu and ONLY != (li, kind, ti):
        return                            # under ncu only the chosen kernel launches (--launch-skip counts them)
    try:
        f()
    except _C.CydnnError:
        return
    if ncu:
        for _ in range(12):
            f()
        return
    us = 1e6 * min(time_calls(f, 50) for _ in range(3))
    print(f"layer {li} {label}: {us:6.1f} us {flop / us / 1e3:7.0f} GFLOP/s", flush=True)


# (n, c, h, w, k): the CNN's three convolutions, 3x3, stride 1, padding 1
LAYERS = [(64, 3, 32, 32, 24), (64, 24, 16, 16, 48), (64, 48, 8, 8, 96)]
igemm = {t: i for i, t in enumerate(_C.igemm_conv_tiles())}
wgrad = {t: i for i, t in enumerate(_C.conv_wgrad_tiles())}
print("igemm tiles", list(igemm), "\nwgrad tiles", list(wgrad))
for li, (n, c, h, w, k) in enumerate(LAYERS):
    x = _C.to_device(rng.standard_normal((n, c, h, w)).astype(np.float32))
    wt = _C.to_device((rng.standard_normal((k, c, 3, 3)) * 0.1).astype(np.float32))
    b = _C.to_device(np.zeros(k, np.float32))
    y = _C.empty((n, k, h, w))
    dw = _C.empty((k, c, 3, 3))
    flop = 2.0 * n * h * w * k * c * 9
    for ti, t in enumerate(_C.igemm_conv_tiles()):
        measure(li, "fwd", ti, f"fwd igemm {t}", flop,
                lambda ti=ti: _C.igemm_conv_forward(x, wt, b, y, (1, 1), (1, 1), 1, 0.0, ti))
    for ti, t in enumerate(_C.conv_wgrad_tiles()):
        measure(li, "wgrad", ti, f"wgrad {t}", flop,
                lambda ti=ti: _C.conv_backward(x, wt, y, None, dw, None, (1, 1), (1, 1), -1, ti))
    _C.synchronize()
