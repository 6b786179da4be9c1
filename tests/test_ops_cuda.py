"""Every GPU op against its numpy twin (and, where importable, PyTorch).

The reference is the numpy twin run in float64 on the same float32 inputs;
the GPU result must be within a relative error (||gpu - ref|| / ||ref||) of
1e-5.  The pool poisons every new block with NaN, so an output element that
an op forgot to write fails the test.  TF32 is off (the default).
"""
import gc
import os
import types

import numpy as np
import pytest

import cydnn
from cydnn.ops import cpu, cuda

from conftest import WORST_ERRORS

pytestmark = pytest.mark.gpu
TOL = 1e-5


@pytest.fixture(autouse=True)
def poisoned_pool():
    cydnn.cuda.set_debug_poison(True)
    yield
    cydnn.cuda.set_debug_poison(False)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f64(*arrays):
    return [None if a is None else a.astype(np.float64) for a in arrays]


def check(op, got, ref, tol=TOL):
    """Record and assert the relative error of a GPU result (numpy or DeviceArray) against a reference."""
    if got is None or ref is None:
        assert got is None and ref is None, op
        return
    got = cuda.to_numpy(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (op, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{op}: non-finite output (an unwritten element?)"
    denom = max(np.linalg.norm(ref), 1e-30)
    err = float(np.linalg.norm(got - ref) / denom)
    WORST_ERRORS[op] = max(WORST_ERRORS.get(op, 0.0), err)
    assert err <= tol, f"{op}: relative error {err:.3e} > {tol:.0e}"


# ------------------------------------------------------------- convolution
CONV_CASES = [
    # x shape, w shape, stride, padding, bias
    ((1, 1, 28, 28), (6, 1, 5, 5), 1, 0, True),           # batch 1, LeNet conv1
    ((64, 6, 14, 14), (16, 6, 5, 5), 1, 0, True),         # LeNet conv2
    ((3, 2, 7, 9), (4, 2, 3, 3), 2, 2, True),             # odd, non-square, stride 2, padding 2
    ((2, 3, 10, 6), (5, 3, 3, 5), (2, 1), (1, 2), False),  # (h, w) pairs, no bias
    ((2, 64, 3, 3), (32, 64, 2, 2), 1, 1, True),          # more channels than pixels
    ((5, 1, 4, 4), (2, 1, 4, 4), 1, 0, True),             # 1x1 output
    ((2, 6, 32, 32), (6, 6, 5, 5), 1, 2, True),           # classic 32x32 input, 'same' padding
]


@pytest.mark.parametrize("xs, ws, stride, padding, bias", CONV_CASES)
@pytest.mark.parametrize("kind", ["numpy", "device"])
def test_conv(xs, ws, stride, padding, bias, kind, rng):
    x, w = f32(rng, *xs), f32(rng, *ws, scale=0.2)
    b = f32(rng, ws[0]) if bias else None
    ref_y, ref_cache = cpu.conv_forward(*f64(x, w, b), stride=stride, padding=padding)
    dy = f32(rng, *ref_y.shape)
    ref_dx, ref_dw, ref_db = cpu.conv_backward(dy.astype(np.float64), ref_cache)

    args = (x, w, b) if kind == "numpy" else tuple(None if a is None else cydnn.to_device(a) for a in (x, w, b))
    y, cache = cuda.conv_forward(*args, stride=stride, padding=padding)
    assert isinstance(y, np.ndarray if kind == "numpy" else cydnn.DeviceArray)
    check("conv_forward", y, ref_y)
    dx, dw, db = cuda.conv_backward(dy if kind == "numpy" else cydnn.to_device(dy), cache)
    check("conv_backward dx", dx, ref_dx)
    check("conv_backward dw", dw, ref_dw)
    check("conv_backward db", db, ref_db)


@pytest.mark.parametrize("need_dx", [True, False])
def test_conv_backward_forks_the_filter_gradient_eager_and_in_a_captured_graph(need_dx, rng):
    """One C call computes dx on the stream and dw, db on the second stream (two branches of a captured graph):
    each against float64 numpy, eager and in a graph replayed on new gradients; without dx, all on the stream."""
    from cydnn import _C
    x, w = f32(rng, 64, 24, 16, 16), f32(rng, 48, 24, 3, 3, scale=0.2)
    ref_y, ref_cache = cpu.conv_forward(*f64(x, w, None), stride=1, padding=1)
    xd, wd = cydnn.to_device(x), cydnn.to_device(w)
    dx = _C.empty(x.shape) if need_dx else None
    dw, db = _C.empty(w.shape), _C.empty((48,))

    def expect(dy, tag):
        ref_dx, ref_dw, _ = cpu.conv_backward(dy.astype(np.float64), ref_cache)
        ref_db = dy.astype(np.float64).sum(axis=(0, 2, 3))
        if need_dx:
            check(f"conv_backward dx ({tag})", dx, ref_dx)
        check(f"conv_backward dw ({tag})", dw, ref_dw)
        check(f"conv_backward db ({tag})", db, ref_db)

    dy = f32(rng, *ref_y.shape)
    dyd = cydnn.to_device(dy)
    _C.conv_backward(xd, wd, dyd, dx, dw, db, (1, 1), (1, 1))
    expect(dy, "eager")
    _C.graph_begin()
    try:
        _C.conv_backward(xd, wd, dyd, dx, dw, db, (1, 1), (1, 1))
    except BaseException:
        _C.graph_end(True)
        raise
    graph = _C.graph_end()
    for seed in (1, 2):
        dy2 = f32(np.random.default_rng(seed), *ref_y.shape)
        dyd.set_(dy2)
        for a in (dx, dw, db):
            if a is not None:
                a.zero_()
        graph.launch()
        expect(dy2, f"graph, replay {seed}")


def test_conv_deterministic_mode_is_bitwise_repeatable(rng):
    cydnn.cuda.set_deterministic(True)
    try:
        x, w, b = f32(rng, 32, 6, 14, 14), f32(rng, 16, 6, 5, 5), f32(rng, 16)
        dy = f32(rng, 32, 16, 10, 10)
        runs = []
        for _ in range(2):
            y, cache = cuda.conv_forward(x, w, b)
            runs.append((y,) + cuda.conv_backward(dy, cache))
        for a, b_ in zip(*runs):
            np.testing.assert_array_equal(a, b_)
    finally:
        cydnn.cuda.set_deterministic(False)


# ----------------------------------------------------------------- pooling
POOL_CASES = [
    # x shape, kernel, stride, padding
    ((1, 1, 28, 28), 2, None, 0),
    ((64, 6, 28, 28), 2, None, 0),
    ((3, 5, 7, 9), 3, 2, 1),             # overlapping windows, padding, odd sizes
    ((2, 4, 6, 5), (2, 3), (1, 2), (1, 1)),
    ((2, 64, 3, 3), 2, 1, 0),            # more channels than pixels, overlapping
    ((2, 3, 9, 9), 5, 2, 2),             # padding 2
]


@pytest.mark.parametrize("xs, kernel, stride, padding", POOL_CASES)
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool(xs, kernel, stride, padding, mode, rng):
    fwd_cpu, bwd_cpu = getattr(cpu, f"{mode}_pool_forward"), getattr(cpu, f"{mode}_pool_backward")
    fwd_gpu, bwd_gpu = getattr(cuda, f"{mode}_pool_forward"), getattr(cuda, f"{mode}_pool_backward")
    x = f32(rng, *xs)
    ref_y, ref_cache = fwd_cpu(x.astype(np.float64), kernel, stride, padding)
    dy = f32(rng, *ref_y.shape)
    ref_dx = bwd_cpu(dy.astype(np.float64), ref_cache)
    y, cache = fwd_gpu(cydnn.to_device(x), kernel, stride, padding)
    check(f"{mode}_pool_forward", y, ref_y)
    check(f"{mode}_pool_backward", bwd_gpu(cydnn.to_device(dy), cache), ref_dx)


def test_max_pool_ties_go_to_first_maximum():
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, :2, :2] = 1.0       # a window of four equal maxima
    x[0, 0, 2:, 2:] = [[3, 5], [5, 5]]
    dy = np.arange(1, 5, dtype=np.float32).reshape(1, 1, 2, 2)
    _, cache = cuda.max_pool_forward(x, 2)
    dx = cuda.max_pool_backward(dy, cache)
    _, ref_cache = cpu.max_pool_forward(x, 2)
    np.testing.assert_array_equal(dx, cpu.max_pool_backward(dy, ref_cache))
    assert dx[0, 0, 0, 0] == 1 and dx[0, 0, :2, :2].sum() == 1
    assert dx[0, 0, 2, 3] == 4 and dx[0, 0, 3, 2] == 0 and dx[0, 0, 3, 3] == 0


# ------------------------------------------------------------- activations
ELEMENTWISE_SHAPES = [(1,), (7,), (1001,), (3, 5, 7, 9), (64, 6, 28, 28)]


@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES)
@pytest.mark.parametrize("name", ["relu", "tanh", "sigmoid"])
def test_activation(name, shape, rng):
    x = f32(rng, *shape, scale=2.0)
    ref_y, ref_cache = getattr(cpu, f"{name}_forward")(x.astype(np.float64))
    dy = f32(rng, *shape)
    ref_dx = getattr(cpu, f"{name}_backward")(dy.astype(np.float64), ref_cache)
    y, cache = getattr(cuda, f"{name}_forward")(cydnn.to_device(x))
    check(f"{name}_forward", y, ref_y)
    check(f"{name}_backward", getattr(cuda, f"{name}_backward")(cydnn.to_device(dy), cache), ref_dx)


def test_relu_on_unaligned_views(rng):
    """A view at a 4-byte offset cannot use float4 loads: the scalar path must be right too."""
    a = f32(rng, 9, 3)
    d = cydnn.to_device(a)
    for start in (1, 2, 3):
        view = d[start:]
        assert view.ptr % 16 != 0
        y, cache = cuda.relu_forward(view)
        np.testing.assert_array_equal(y.numpy(), np.maximum(a[start:], 0))
        dx = cuda.relu_backward(view, cache)
        np.testing.assert_array_equal(dx.numpy(), np.where(a[start:] > 0, a[start:], 0))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(1,), (1001,), (64, 120)])
def test_dropout_matches_twin_bit_for_bit(p, shape, rng):
    x, dy = f32(rng, *shape), f32(rng, *shape)
    seed = int(rng.integers(0, 2**63))
    ref_y, ref_mask = cpu.dropout_forward(x, p, seed)
    y, mask = cuda.dropout_forward(cydnn.to_device(x), p, seed)
    np.testing.assert_array_equal(mask.numpy(), ref_mask)
    np.testing.assert_array_equal(y.numpy(), ref_y)
    np.testing.assert_array_equal(cuda.dropout_backward(dy, mask), cpu.dropout_backward(dy, ref_mask))


# ------------------------------------------------------------------ linear
LINEAR_CASES = [((1, 256), 120, True), ((7, 13), 5, False), ((300, 784), 10, True), ((64, 3), 1000, True),
                ((128, 84), 10, True)]


@pytest.mark.parametrize("xs, out_features, bias", LINEAR_CASES)
def test_linear(xs, out_features, bias, rng):
    x, w = f32(rng, *xs), f32(rng, out_features, xs[1], scale=0.1)
    b = f32(rng, out_features) if bias else None
    ref_y, ref_cache = cpu.linear_forward(*f64(x, w, b))
    dy = f32(rng, *ref_y.shape)
    ref = cpu.linear_backward(dy.astype(np.float64), ref_cache)
    y, cache = cuda.linear_forward(cydnn.to_device(x), cydnn.to_device(w), None if b is None else cydnn.to_device(b))
    check("linear_forward", y, ref_y)
    for name, got, want in zip(("dx", "dw", "db"), cuda.linear_backward(cydnn.to_device(dy), cache), ref):
        check(f"linear_backward {name}", got, want)


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_linear_on_cublaslt_epilogues_odd_alignments_and_a_captured_fork(offset, rng):
    """cuBLASLt with the bias and ReLU in its epilogue, on views 4 or 12 bytes past an aligned block (an algorithm
    that assumed 16 bytes would read the wrong floats), bit for bit what arrays of their own give (one algorithm per
    shape, whatever the addresses: a saved and loaded model predicts the same bits), and the backward's weight
    gradient on the second stream: eager, then inside a captured graph replayed on new inputs."""
    from cydnn import _C
    n, fin, fout = 64, 200, 96
    x, w, b, dy = f32(rng, n, fin), f32(rng, fout, fin, scale=0.1), f32(rng, fout), f32(rng, n, fout)

    def at(a):                          # a copy of `a` that starts `offset` floats into a fresh block
        block = cydnn.to_device(np.concatenate([np.zeros(offset, np.float32), a.ravel()]))
        return _C.view(block, offset, a.shape), block
    (dx_, kx), (dw_, kw), (db_, kb), (dy_, kd) = at(x), at(w), at(b), at(dy)
    y_, ky = at(np.zeros((n, fout), np.float32))
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    own = [cydnn.to_device(a) for a in (x, w, b)] + [_C.empty((n, fout))]
    for act, want in ((0, z), (1, np.maximum(z, 0))):
        _C.linear_forward(dx_, dw_, db_, y_, act)
        check(f"linear_forward act={act} offset={offset}", y_, want)
        _C.linear_forward(*own, act)
        np.testing.assert_array_equal(y_.numpy(), own[3].numpy())
    with pytest.raises(cydnn.CydnnError, match="linear_forward: act must be 0 .none. or 1 .relu., got 2"):
        _C.linear_forward(dx_, dw_, db_, y_, 2)
    gx, gw = at(np.zeros((n, fin), np.float32)), at(np.zeros((fout, fin), np.float32))
    want_dx, want_dw = dy.astype(np.float64) @ w, dy.astype(np.float64).T @ x
    _C.linear_backward(dx_, dw_, dy_, gx[0], gw[0], None)
    check("linear_backward dx (eager)", gx[0], want_dx)
    check("linear_backward dw (second stream, eager)", gw[0], want_dw)
    own_dx, own_dw = _C.empty((n, fin)), _C.empty((fout, fin))
    _C.linear_backward(own[0], own[1], cydnn.to_device(dy), own_dx, own_dw, None)
    np.testing.assert_array_equal(gx[0].numpy(), own_dx.numpy())
    np.testing.assert_array_equal(gw[0].numpy(), own_dw.numpy())
    _C.graph_begin()
    try:
        _C.linear_backward(dx_, dw_, dy_, gx[0], gw[0], None)
    except BaseException:
        _C.graph_end(True)
        raise
    graph = _C.graph_end()
    for seed in (1, 2):
        dy2 = f32(np.random.default_rng(seed), n, fout)
        dy_.set_(dy2)
        gx[0].zero_(), gw[0].zero_()
        graph.launch()
        check(f"linear_backward dx (graph, replay {seed})", gx[0], dy2.astype(np.float64) @ w)
        check(f"linear_backward dw (graph branch, replay {seed})", gw[0], dy2.astype(np.float64).T @ x)


# ------------------------------------------------------------------ losses
@pytest.mark.parametrize("shape", [(1, 10), (7, 3), (256, 10), (33, 1000), (2049, 10), (5000, 7)])
def test_softmax_and_cross_entropy(shape, rng):
    """Against numpy; 2,049 and 5,000 rows: more rows than one grid pass of the row kernel's first blocks."""
    logits = f32(rng, *shape, scale=3.0)
    labels = rng.integers(0, shape[1], size=shape[0])
    check("softmax", cuda.softmax(cydnn.to_device(logits)), cpu.softmax(logits.astype(np.float64)))
    check("log_softmax", cuda.log_softmax(logits), cpu.log_softmax(logits.astype(np.float64)))
    ref_loss, ref_d = cpu.softmax_cross_entropy(logits.astype(np.float64), labels)
    for lab in (labels, cydnn.to_device(labels.astype(np.int32))):  # int64 numpy, int32 on the GPU
        loss, d = cuda.softmax_cross_entropy(cydnn.to_device(logits), lab)
        assert isinstance(loss, cydnn.DeviceArray) and loss.shape == ()
        check("softmax_cross_entropy loss", loss, ref_loss)
        check("softmax_cross_entropy dlogits", d, ref_d)
    loss, d = cuda.softmax_cross_entropy(logits, labels)
    assert isinstance(loss, np.ndarray) and loss.shape == () and isinstance(d, np.ndarray)


def test_cross_entropy_bad_labels(rng):
    logits = f32(rng, 4, 10)
    with pytest.raises(ValueError, match=r"softmax_cross_entropy: labels\[2\] = 10 is out of range \[0, 10\)"):
        cuda.softmax_cross_entropy(logits, np.array([1, 2, 10, 3]))
    dev_labels = cydnn.to_device(np.array([1, -1, 2, 3], np.int32))
    with pytest.raises(ValueError, match=r"labels\[1\] = -1 is out of range"):
        cuda.softmax_cross_entropy(logits, dev_labels)
    loss, d = cuda.softmax_cross_entropy(cydnn.to_device(logits), dev_labels, validate=False)
    assert np.isnan(loss.item())  # nothing waited; the bad row shows as NaN
    assert np.isnan(d.numpy()[1]).all() and np.isfinite(d.numpy()[[0, 2, 3]]).all()


def test_flatten_is_a_view(rng):
    d = cydnn.to_device(f32(rng, 4, 16, 4, 4))
    f = cuda.flatten(d)
    assert f.shape == (4, 256) and f.ptr == d.ptr


# -------------------------------------------------------------- optimizers
@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4),
    dict(lr=0.01, momentum=0.8, dampening=0.1, weight_decay=1e-2),
])
def test_sgd_update(kw, rng):
    shape = (37, 11)
    p, buf = f32(rng, *shape), np.zeros(shape, np.float32)
    dp, dbuf = cydnn.to_device(p), cydnn.to_device(buf)
    for step in range(3):
        g = f32(rng, *shape)
        cpu.sgd_update(p, g, buf, first_step=step == 0, **kw)
        cuda.sgd_update(dp, cydnn.to_device(g), dbuf, first_step=step == 0, **kw)
        check("sgd_update", dp, p)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_update(decoupled, rng):
    shape = (5, 6, 5, 5)
    p, m, v = f32(rng, *shape), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    dp, dm, dv = (cydnn.to_device(a) for a in (p, m, v))
    for step in range(1, 4):
        g = f32(rng, *shape)
        kw = dict(lr=1e-2, weight_decay=1e-2, decoupled=decoupled)
        cpu.adam_update(p, g, m, v, step, **kw)
        cuda.adam_update(dp, cydnn.to_device(g), dm, dv, step, **kw)
        check("adam_update param", dp, p)
        check("adam_update m", dm, m)
        check("adam_update v", dv, v)


def test_optimizer_numpy_arrays_updated_in_place(rng):
    p, g = f32(rng, 10), f32(rng, 10)
    expect = p.copy()
    cpu.sgd_update(expect, g, None, lr=0.5)
    cuda.sgd_update(p, g, None, lr=0.5)
    check("sgd_update", p, expect)


# -------------------------------------------------------------------- data
@pytest.mark.parametrize("pad, max_shift", [(0, 0), (2, 0), (0, 2), (2, 3)])
def test_gather_batch(pad, max_shift, rng):
    images = rng.integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=50).astype(np.int32)
    indices = rng.permutation(50)[:17].astype(np.int32)
    seed = int(rng.integers(0, 2**63))
    ref_x, ref_y = cpu.gather_batch(images, labels, indices, 0.1307, 0.3081, pad, max_shift, seed)
    x, y = cuda.gather_batch(cydnn.to_device(images), cydnn.to_device(labels), cydnn.to_device(indices),
                             0.1307, 0.3081, pad, max_shift, seed)
    np.testing.assert_array_equal(y.numpy(), ref_y)
    np.testing.assert_allclose(x.numpy(), ref_x, rtol=0, atol=1e-6)
    check("gather_batch", x, ref_x, tol=1e-7)


# ----------------------------------------------------------- bad input
def test_bad_input_raises_before_any_gpu_work(rng):
    before = cydnn.cuda.memory_stats()["num_allocs"]
    x = f32(rng, 2, 1, 28, 28)
    with pytest.raises(ValueError, match=r"conv_forward: w has 3 input channels but x has 1"):
        cuda.conv_forward(x, f32(rng, 6, 3, 5, 5), None)
    with pytest.raises(ValueError, match=r"max_pool_forward: kernel \(5, 5\) is larger than the padded input"):
        cuda.max_pool_forward(f32(rng, 1, 1, 4, 4), 5)
    with pytest.raises(ValueError, match=r"linear_forward: x must have rank 2"):
        cuda.linear_forward(x, f32(rng, 10, 784), None)
    with pytest.raises(TypeError, match=r"relu_forward: x has dtype float64"):
        cuda.relu_forward(np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"softmax_cross_entropy: labels has 7 entries but logits has 8 rows"):
        cuda.softmax_cross_entropy(f32(rng, 8, 10), np.zeros(7, np.int64))
    assert cydnn.cuda.memory_stats()["num_allocs"] == before  # nothing reached the GPU


# ------------------------------------------------------- memory steadiness
def _op_pairs(rng):
    """(name, one forward+backward call) for each op family, on DeviceArrays."""
    d = cydnn.to_device
    x, w, b = d(f32(rng, 8, 3, 12, 12)), d(f32(rng, 4, 3, 3, 3)), d(f32(rng, 4))
    dy_conv = d(f32(rng, 8, 4, 10, 10))
    dy_pool = d(f32(rng, 8, 3, 6, 6))
    xl, wl, bl, dyl = d(f32(rng, 8, 20)), d(f32(rng, 5, 20)), d(f32(rng, 5)), d(f32(rng, 8, 5))
    labels = d(rng.integers(0, 5, 8).astype(np.int32))
    images, idx = d(rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)), d(np.arange(8, dtype=np.int32))
    m, v = cuda.zeros_like(wl), cuda.zeros_like(wl)
    return {
        "conv": lambda: cuda.conv_backward(dy_conv, cuda.conv_forward(x, w, b)[1]),
        "max_pool": lambda: cuda.max_pool_backward(dy_pool, cuda.max_pool_forward(x, 2)[1]),
        "avg_pool": lambda: cuda.avg_pool_backward(dy_pool, cuda.avg_pool_forward(x, 2)[1]),
        "relu": lambda: cuda.relu_backward(x, cuda.relu_forward(x)[1]),
        "tanh": lambda: cuda.tanh_backward(x, cuda.tanh_forward(x)[1]),
        "sigmoid": lambda: cuda.sigmoid_backward(x, cuda.sigmoid_forward(x)[1]),
        "dropout": lambda: cuda.dropout_backward(x, cuda.dropout_forward(x, 0.5, 7)[1]),
        "linear": lambda: cuda.linear_backward(dyl, cuda.linear_forward(xl, wl, bl)[1]),
        "softmax": lambda: (cuda.softmax(xl), cuda.log_softmax(xl)),
        "cross_entropy": lambda: cuda.softmax_cross_entropy(dyl, labels, validate=False),
        "sgd": lambda: cuda.sgd_update(wl, wl, m, lr=1e-6, momentum=0.9),
        "adam": lambda: cuda.adam_update(wl, wl, m, v, 1, lr=1e-6),
        "gather_batch": lambda: cuda.gather_batch(images, None, idx, 0.5, 0.5, 2, 2, 3),
    }


def _kept_op_frames():
    """Frames of finished cydnn.ops.cuda calls still alive: whatever holds them holds the
    arrays in their locals."""
    suffix = os.path.join("cydnn", "ops", "cuda.py")
    return [o for o in gc.get_objects()
            if isinstance(o, types.FrameType) and o.f_code.co_filename.endswith(suffix)]


def test_ten_thousand_calls_leave_memory_where_it_was(rng):
    """What it measures, after one warm-up call per op family: the bytes asked for by the
    arrays the program can still reach (a leaked array shows), the bytes reserved from the
    driver and the driver mallocs (a pool that grows shows), and the plan count (a descriptor
    made per call shows); both readings follow a full garbage collection.

    It holds under compute-sanitizer too, with one condition: the sanitizer's host backtraces
    must be off (``--show-backtrace device``, as tools/sanitize.sh runs it).  With them on (the
    default) the sanitizer records the Python stack at every kernel launch and keeps a
    reference to the launching frame, so every call's arrays stay alive (measured on the H100,
    compute-sanitizer 2025.3.1: one retained frame and +17,280 B per max-pool call, none with
    host backtraces off).  The test checks for such retained frames first and says so.  Under
    CYDNN_SANITIZE=1 it makes 200 calls per family instead of 10,000."""
    cydnn.cuda.set_debug_poison(False)
    calls = 200 if os.environ.get("CYDNN_SANITIZE") else 10_000
    keys = ("requested_bytes", "reserved_bytes", "num_device_mallocs")
    for name, call in _op_pairs(rng).items():
        call()  # warm-up: plans built, workspace sized, pool blocks cached
        cydnn.cuda.synchronize()
        gc.collect()
        start = {k: cydnn.cuda.memory_stats()[k] for k in keys}
        plans = cydnn._C.plan_count()
        for _ in range(calls):
            call()
        cydnn.cuda.synchronize()
        gc.collect()
        end = {k: cydnn.cuda.memory_stats()[k] for k in keys}
        kept = _kept_op_frames()
        assert not kept, (
            f"{name}: {len(kept)} frames of finished op calls are still referenced from outside the "
            f"program (e.g. {kept[0].f_code.co_name}), keeping their arrays alive; under "
            f"compute-sanitizer, turn host backtraces off with --show-backtrace device")
        assert end == start, f"{name}: memory moved over {calls} calls: {start} -> {end}"
        assert cydnn._C.plan_count() == plans, f"{name}: new descriptors were made after warm-up"


# ------------------------------------------------------------ vs PyTorch
def test_against_pytorch(rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    def t(a, grad=True):
        return torch.tensor(a, device=dev, requires_grad=grad)

    x, w, b = f32(rng, 4, 3, 11, 9), f32(rng, 5, 3, 3, 3, scale=0.2), f32(rng, 5)
    tx, tw, tb = t(x), t(w), t(b)
    ty = F.conv2d(tx, tw, tb, stride=2, padding=2)
    dy = f32(rng, *ty.shape)
    ty.backward(torch.tensor(dy, device=dev))
    y, cache = cuda.conv_forward(x, w, b, stride=2, padding=2)
    check("torch conv2d", y, ty.detach().cpu().numpy())
    for got, want in zip(cuda.conv_backward(dy, cache), (tx.grad, tw.grad, tb.grad)):
        check("torch conv2d backward", got, want.cpu().numpy())

    for mode, tf in (("max", F.max_pool2d), ("avg", F.avg_pool2d)):
        x = f32(rng, 2, 3, 9, 7)
        tx = t(x)
        ty = tf(tx, 3, 2, 1)
        dy = f32(rng, *ty.shape)
        ty.backward(torch.tensor(dy, device=dev))
        y, cache = getattr(cuda, f"{mode}_pool_forward")(x, 3, 2, 1)
        check(f"torch {mode}_pool2d", y, ty.detach().cpu().numpy())
        check(f"torch {mode}_pool2d backward", getattr(cuda, f"{mode}_pool_backward")(dy, cache),
              tx.grad.cpu().numpy())

    x, w, b = f32(rng, 16, 84), f32(rng, 10, 84, scale=0.1), f32(rng, 10)
    labels = rng.integers(0, 10, 16)
    tx, tw, tb = t(x), t(w), t(b)
    tl = F.cross_entropy(F.linear(tx, tw, tb), torch.tensor(labels, device=dev))
    tl.backward()
    logits, cache = cuda.linear_forward(x, w, b)
    loss, dlogits = cuda.softmax_cross_entropy(logits, labels)
    check("torch cross_entropy", loss, tl.detach().cpu().numpy())
    for got, want in zip(cuda.linear_backward(dlogits, cache), (tx.grad, tw.grad, tb.grad)):
        check("torch linear backward", got, want.cpu().numpy())


def test_gather_batch_bad_device_index_reads_nothing(rng):
    """A device index out of range (not checked on the host) gives NaN pixels and label -1, no wild read."""
    images = cydnn.to_device(rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8))
    labels = cydnn.to_device(np.arange(5, dtype=np.int32))
    x, y = cuda.gather_batch(images, labels, cydnn.to_device(np.array([1, 7, -3, 4], np.int32)), 0.5, 0.5)
    x, y = x.numpy(), y.numpy()
    np.testing.assert_array_equal(y, [1, -1, -1, 4])
    assert np.isnan(x[1]).all() and np.isnan(x[2]).all() and np.isfinite(x[[0, 3]]).all()
    with pytest.raises(ValueError, match=r"labels\[1\] = -1 is out of range"):
        cuda.softmax_cross_entropy(cydnn.to_device(f32(rng, 4, 10)), cydnn.to_device(y))


@pytest.mark.parametrize("shapes", [((64, 1, 28, 28), (64,)), ((3, 5), (7,)), ((0,), (9,))])
def test_copy2_into_copies_both_arrays_in_one_launch(shapes):
    """The compiled step's feed (cpp/memory.cu's copy2_kernel): both copies exact, the 16-byte path (whole float4
    rows) and the byte path (a 60-byte and a 28-byte region), an empty first copy; mismatched shapes refused."""
    from cydnn import _C
    rng = np.random.default_rng(len(shapes[0]))
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    b = rng.integers(-5, 5, shapes[1]).astype(np.int32)
    da, db = _C.empty(a.shape), _C.empty(b.shape, np.int32)
    _C.copy2_into(da, cydnn.to_device(a), db, cydnn.to_device(b))
    np.testing.assert_array_equal(da.numpy(), a)
    np.testing.assert_array_equal(db.numpy(), b)
    with pytest.raises(ValueError, match="copy2_into: dst is float32"):
        _C.copy2_into(_C.empty((2, 2)), cydnn.to_device(np.zeros((4,), np.float32)), db, cydnn.to_device(b))
