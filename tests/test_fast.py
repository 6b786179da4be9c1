"""The fast path against the reference path, on real MNIST, on the GPU.

Every fused kernel and graph is compared with the per-op path (itself tested
against the numpy twin): the fused forward on all 10,000 test images, the
numpy-in / numpy-out predictor, the fused MLP, and a compiled training step
against the reference loop on the same batches.
"""
import logging

import numpy as np
import pytest

import cydnn
from cydnn import _C, datasets, models, nn, ops, optim

import mnist_data  # noqa: E402  (the one MNIST lookup: tests/mnist_data.py)

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    MNIST = mnist_data.require()
    root = tmp_path_factory.mktemp("mnist")
    train = datasets.MNIST(root=root, train=True, mirrors=[str(MNIST)])
    test = datasets.MNIST(root=root, train=False, mirrors=[str(MNIST)])
    return train.images, train.labels.astype(np.int64), test.images, test.labels.astype(np.int64)


def _trained(classic, mnist, steps=300, seed=0):
    """A LeNet-5 trained briefly on the reference path (so classes are meaningful)."""
    images, labels = mnist[0], mnist[1]
    model = models.LeNet5(classic=classic, seed=seed).to("cuda")
    loader = datasets.DataLoader(images[:steps * 64], labels[:steps * 64], batch_size=64, seed=seed,
                                 mean=model.mean, std=model.std, pad=model.input_pad, device="cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in loader:
        loss_fn(model(x), y)
        model.backward(loss_fn.backward())
        opt.step()
    return model


# ------------------------------------------------------------ inference
@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_fused_forward_matches_reference_on_every_test_image(classic, mnist):
    model = _trained(classic, mnist)
    test_images, test_labels = mnist[2], mnist[3]
    ref = model.predict(test_images, fast=False)
    dev = ops.cuda.asarray(test_images)
    out = ops.cuda.empty((len(test_images), 10))
    params = tuple(p.data for p in model.parameters())
    _C.lenet_forward(model.classic, 10, params, dev, out, model.mean, model.std, True)
    got = out.numpy()
    diff = np.abs(got - ref).max()
    print(f"fused forward ({'classic' if classic else 'modern'}): max |p - p_ref| = {diff:.2e}, "
          f"accuracy {np.mean(got.argmax(1) == test_labels):.4f}")
    assert diff <= 1e-5
    assert np.array_equal(got.argmax(1), ref.argmax(1))
    assert np.mean(got.argmax(1) == test_labels) > 0.9


@gpu
@pytest.mark.parametrize("classic", [False, True])
@pytest.mark.parametrize("n", [1, 3, 64, 65, 5000, 10000])
def test_fast_predict_equals_reference(classic, n, mnist):
    model = _trained(classic, mnist, steps=100)
    images = mnist[2][:n]
    for x in (images, images.astype(np.float32) / 255, images[:, None]):
        ref = model.predict(x, fast=False)
        got = model.predict(x)
        assert got.shape == ref.shape == (n, 10) and got.dtype == np.float32
        assert np.abs(got - ref).max() <= 1e-5
        assert np.array_equal(got.argmax(1), ref.argmax(1))
    if n <= 64:
        assert model.fast_predictor().graph_count >= 1


@gpu
def test_fast_predict_follows_new_and_updated_weights(mnist):
    model = _trained(False, mnist, steps=50)
    x = mnist[2][:16]
    before = model.predict(x)
    other = _trained(False, mnist, steps=50, seed=1)
    model.load_state_dict(other.state_dict())        # new arrays: the graphs are rebuilt
    assert np.abs(model.predict(x) - other.predict(x, fast=False)).max() <= 1e-5
    assert np.abs(model.predict(x) - before).max() > 1e-3
    w = model.fc3.weight
    w.data = ops.cuda.asarray(w.data.numpy() * 2)      # replaced array, new values
    assert np.abs(model.predict(x) - model.predict(x, fast=False)).max() <= 1e-5


@gpu
def test_fast_predict_refuses_what_the_reference_refuses(mnist):
    model = models.LeNet5().to("cuda")
    for bad in (np.zeros((2, 27, 28), np.uint8), np.zeros((2, 28, 28), np.int32), [[0] * 28] * 28):
        with pytest.raises((TypeError, ValueError)) as fast_err:
            model.predict(bad)
        with pytest.raises((TypeError, ValueError)) as ref_err:
            model.predict(bad, fast=False)
        assert str(fast_err.value) == str(ref_err.value)
    assert model.predict(np.zeros((0, 28, 28), np.uint8)).shape == (0, 10)


@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_compiled_inference_of_lenet_on_float_inputs_uses_the_fused_kernel(classic, mnist):
    """``cydnn.compile(lenet, input_shape, softmax=True)`` without preprocessing: float32 numpy inputs of
    the network's own size ((N, 1, 28, 28); classic (N, 1, 32, 32), padding included) of up to two chunks
    run on the fused LeNet-5 kernel (mean 0, std 1: the inputs as they are) with the reference's
    probabilities; more rows and DeviceArrays keep the plan."""
    model = _trained(classic, mnist, steps=50)
    side = 32 if classic else 28
    shape = (1, side, side)
    infer = cydnn.compile(model, input_shape=shape, softmax=True)
    images = mnist[2][:3100].astype(np.float32) / 255
    x = ((np.pad(images, ((0, 0), (2, 2), (2, 2))) if classic else images) - model.mean) / model.std
    x = np.ascontiguousarray(x[:, None], dtype=np.float32)
    x[0, 0, 0, :] = 3.0                     # a border that is not the padding a raw image would get
    for n in (1, 3, 1030, 3100):                            # up to two chunks the kernel, then the plan's pipe
        want = model(_C.to_device(x[:n])).numpy()
        want = np.exp(want - want.max(1, keepdims=True))
        want /= want.sum(1, keepdims=True)
        got = infer(x[:n])
        assert got.shape == (n, 10)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=f"n={n}")
        np.testing.assert_allclose(infer(_C.to_device(x[:n])).numpy(), want, rtol=1e-5, atol=2e-6)
    if classic:                              # the raw-image path: the same images, 28x28, padded by the kernel
        np.testing.assert_allclose(infer(x[1:4]), model.predict(images[1:4]), rtol=1e-5, atol=2e-6)
        with pytest.raises(TypeError, match="predict: full-size images must be float32, got uint8"):
            infer._lenet._p(infer._lenet.params, np.zeros((1, 32, 32), np.uint8), True)
    assert infer.info()["lenet"] == "fused kernel" and "numpy images run on the fused LeNet-5 kernel" in infer.explain()
    with pytest.raises(ValueError, match=rf"x must be float32 \(N, 1, {side}, {side}\), got uint8"):
        infer(np.zeros((2, 1, side, side), np.uint8))
    with pytest.raises(ValueError, match=rf"x must be float32 \(N, 1, {side}, {side}\), got float32 \(2, 1, 27, 28\)"):
        infer(np.zeros((2, 1, 27, 28), np.float32))
    logits = cydnn.compile(model, input_shape=shape)
    logits(x[:1])
    assert logits.info()["lenet"] == "the fused LeNet-5 kernel needs softmax=True and fused=True"
    forced = cydnn.compile(model, input_shape=shape, softmax=True, fused_net="force")
    forced(x[:1])
    assert forced.info()["lenet"] == "fused_net='force' asks for the fused network"


@gpu
def test_fast_predict_runs_other_models_on_the_generic_plan():
    model = models.LeNet5().to("cuda")
    model.extra = nn.ReLU()      # the layers changed: not LeNet-5 any more, but still a Sequential
    x = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    predictor = model.fast_predictor()
    assert predictor is not None
    np.testing.assert_allclose(model.predict(x), model.predict(x, fast=False), rtol=1e-5, atol=1e-6)
    assert "LeNet-5 only" in predictor.info()["lenet"] and predictor.info()["mode"] == "graph"

    class Odd(nn.Module):
        def forward(self, x):
            return x
    model.odd = Odd()            # a layer the compiler does not take: the reference path, or an error
    assert model.fast_predictor() is None
    with pytest.raises(ValueError, match="does not take"):
        model.predict(x, fast=True)


@gpu
@pytest.mark.parametrize("n", [1, 8, 64, 1024])
@pytest.mark.parametrize("dims", [(256, 120, 84, 10), (64, 1024, 1024, 32), (7, 3)])
def test_fused_mlp_matches_the_twin(n, dims):
    rng = np.random.default_rng(n + len(dims))
    x = rng.standard_normal((n, dims[0])).astype(np.float32)
    ws = [(rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32) for i, o in zip(dims[:-1], dims[1:])]
    bs = [rng.standard_normal(o).astype(np.float32) for o in dims[1:]]
    bs[0] = None
    ref = ops.cpu.fused_mlp_forward(x.astype(np.float64), [w.astype(np.float64) for w in ws],
                                    [None if b is None else b.astype(np.float64) for b in bs])
    got = ops.cuda.fused_mlp_forward(x, ws, bs)
    err = np.abs(got - ref).max() / max(1e-6, np.abs(ref).max())
    assert err < 1e-5, err
    # and through the per-layer path
    h = ops.cuda.asarray(x)
    for i, (w, b) in enumerate(zip(ws, bs)):
        h, _ = ops.cuda.linear_forward(h, ops.cuda.asarray(w), None if b is None else ops.cuda.asarray(b))
        if i < len(ws) - 1:
            h, _ = ops.cuda.relu_forward(h)
    assert np.abs(h.numpy() - got).max() / max(1e-6, np.abs(ref).max()) < 1e-5


def test_fused_mlp_refuses_bad_shapes():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"weights\[1\] takes 5 features but layer 1 gets 3"):
        ops.cpu.fused_mlp_forward(x, [np.zeros((3, 4), np.float32), np.zeros((2, 5), np.float32)])
    with pytest.raises(TypeError, match="dtype"):
        ops.cpu.fused_mlp_forward(x, [np.zeros((3, 4), np.int32)])


# ------------------------------------------------------------ training
def _loader(mnist, model, n, batch, max_shift=0, seed=3):
    return datasets.DataLoader(mnist[0][:n], mnist[1][:n], batch_size=batch, seed=seed, mean=model.mean,
                               std=model.std, pad=model.input_pad, max_shift=max_shift, device="cuda")


def _make_opt(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if kind == "adam":
        return optim.Adam(params, lr=2e-3, weight_decay=1e-4)
    return optim.AdamW(params, lr=2e-3)


@gpu
@pytest.mark.parametrize("classic,opt_kind,max_shift,batch,n", [
    (False, "sgd", 0, 64, 64 * 12),
    (False, "sgd", 2, 32, 32 * 10 + 7),    # shifts, and a tail batch of 7
    (True, "sgd", 1, 256, 256 * 4),
    (False, "adam", 0, 128, 128 * 8),
    (True, "adamw", 0, 64, 64 * 6 + 30),
])
def test_compiled_step_matches_reference_loop(classic, opt_kind, max_shift, batch, n, mnist):
    ref_model = models.LeNet5(classic=classic, seed=5).to("cuda")
    ref_opt = _make_opt(opt_kind, ref_model.parameters())
    ref_sched = optim.CosineAnnealingLR(ref_opt, T_max=100)
    ref_step = ref_model.compile(ref_opt, batch, cuda_graph=False, fused=False)
    assert ref_step.info()["mode"] == "reference"
    fast_model = models.LeNet5(classic=classic, seed=5).to("cuda")
    fast_opt = _make_opt(opt_kind, fast_model.parameters())
    fast_sched = optim.CosineAnnealingLR(fast_opt, T_max=100)
    step = fast_model.compile(fast_opt, batch)
    assert step.info()["mode"] == "fused+graph", step.info()
    ref_loader, fast_loader = _loader(mnist, ref_model, n, batch, max_shift), _loader(mnist, fast_model, n, batch,
                                                                                      max_shift)
    for epoch in range(2):
        r = ref_step.train_epoch(ref_loader, ref_sched)
        f = step.train_epoch(fast_loader, fast_sched)
        assert r["steps"] == f["steps"] and r["images"] == f["images"] == n
        assert abs(r["loss"] - f["loss"]) <= 1e-3 * max(1.0, abs(r["loss"])), (r, f)
        assert abs(r["accuracy"] - f["accuracy"]) <= 5 / n + 1e-9
    assert fast_opt.lr == pytest.approx(ref_opt.lr) and fast_sched.last_epoch == ref_sched.last_epoch
    worst = 0.0
    for (name, p), (_, q) in zip(ref_model.named_parameters(), fast_model.named_parameters()):
        a, b = p.data.numpy(), q.data.numpy()
        err = np.abs(a - b).max() / max(1e-3, np.abs(a).max())
        worst = max(worst, err)
        # Classic (tanh, average pool) is smooth: rounding differences stay rounding-sized.
        # Modern max-pools: where a window holds equal values (the constant background of
        # MNIST digits), cuDNN's rounding and the fused kernel's can pick different
        # "first maxima", equally valid subgradients, and SGD's momentum carries the
        # difference on; the one-step gradient test below bounds the gradient itself.
        assert err < (2e-4 if classic else 3e-2), (name, err)
        assert q.grad is not None and q.grad.shape == q.shape
    for s_ref, s_fast in zip(ref_opt.state, fast_opt.state):
        assert s_ref["step"] == s_fast["step"]
    print(f"compiled vs reference after {2 * r['steps']} steps: worst relative parameter difference {worst:.2e}")


@gpu
def test_the_next_epochs_order_is_drawn_while_an_epoch_runs(mnist, monkeypatch):
    """The fused LeNet-5 epoch draws epoch e + 1's order and shift seeds while epoch e runs on the GPU, and starts
    e + 1 with one device copy of them; where what decides them changed (here the loader's seed), e + 1's are
    drawn again at its start."""
    model = models.LeNet5(seed=5).to("cuda")
    step = model.compile(optim.SGD(model.parameters(), lr=0.01), 64)
    loader = _loader(mnist, model, 64 * 6 + 10, 64, max_shift=2)
    drawn, real = [], datasets.DataLoader.permutation
    monkeypatch.setattr(datasets.DataLoader, "permutation", lambda self, e: drawn.append(e) or real(self, e))

    def seeds(epoch):
        return np.array([loader.batch_seed(epoch, b) for b in range(7)], np.uint64)    # 6 batches and a tail
    step.train_epoch(loader)                      # epoch 0's drawn at its start, epoch 1's while it ran
    lenet = step._lenet
    assert drawn == [0, 1] and step.info()["mode"] == "fused+graph"
    np.testing.assert_array_equal(lenet._order_ahead.numpy(), real(loader, 1))
    np.testing.assert_array_equal(lenet._seeds_ahead.numpy().view(np.uint64)[:7], seeds(1))
    step.train_epoch(loader)                      # epoch 1 from what was drawn ahead; epoch 2's drawn
    assert drawn == [0, 1, 2]
    np.testing.assert_array_equal(lenet._order.numpy(), real(loader, 1))
    np.testing.assert_array_equal(lenet._seeds.numpy().view(np.uint64)[:7], seeds(1))
    loader.seed = 11                              # epoch 2's order is another one now: drawn again
    step.train_epoch(loader)
    assert drawn == [0, 1, 2, 2, 3]
    np.testing.assert_array_equal(lenet._order.numpy(), real(loader, 2))
    np.testing.assert_array_equal(lenet._seeds.numpy().view(np.uint64)[:7], seeds(2))


@gpu
def test_compiled_step_last_gradient_matches_reference(mnist):
    """One step from the same weights: the fused backward against the reference backward."""
    for classic in (False, True):
        ref_model = models.LeNet5(classic=classic, seed=9).to("cuda")
        fast_model = models.LeNet5(classic=classic, seed=9).to("cuda")
        ref_opt = optim.SGD(ref_model.parameters(), lr=0.0)
        fast_opt = optim.SGD(fast_model.parameters(), lr=0.0)
        loader_r, loader_f = _loader(mnist, ref_model, 96, 96), _loader(mnist, fast_model, 96, 96)
        ref_model.compile(ref_opt, 96, cuda_graph=False, fused=False).train_epoch(loader_r)
        fast_model.compile(fast_opt, 96).train_epoch(loader_f)
        for (name, p), (_, q) in zip(ref_model.named_parameters(), fast_model.named_parameters()):
            g_ref, g = p.grad.numpy(), q.grad.numpy()
            err = np.abs(g - g_ref).max() / max(1e-8, np.abs(g_ref).max())
            assert err < 1e-4, (classic, name, err)


@gpu
def test_capture_failure_falls_back_to_fused_kernels(mnist, monkeypatch, caplog):
    def refuse():
        raise cydnn.CudaError("cuda_graph: capture refused (test)", 900, "cuda_graph")

    results = []
    for break_capture in (False, True):
        model = models.LeNet5(seed=2).to("cuda")
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = model.compile(opt, 64)
        if break_capture:
            monkeypatch.setattr(_C, "graph_begin", refuse)
        with caplog.at_level(logging.WARNING, logger="cydnn.compiler"):
            stats = step.train_epoch(_loader(mnist, model, 64 * 5, 64))
        results.append((stats, [p.data.numpy() for p in model.parameters()]))
        if break_capture:
            assert step.info()["mode"] == "fused" and "capture refused" in step.info()["reason"]
            assert "capture refused" in caplog.text
            assert stats["mode"] == "fused"
    (s1, p1), (s2, p2) = results
    assert s1["loss"] == s2["loss"]                      # same kernels, same order: bit-identical
    assert all(np.array_equal(a, b) for a, b in zip(p1, p2))


@gpu
def test_a_changed_lenet_runs_the_generic_compiled_plan(mnist):
    model = models.LeNet5(seed=1).to("cuda")
    model.extra = nn.Flatten()
    opt = optim.SGD(model.parameters(), lr=0.05)
    step = model.compile(opt, 64)
    assert step.info()["mode"] == "graph"
    stats = step.train_epoch(_loader(mnist, model, 64 * 3, 64))
    assert stats["steps"] == 3 and np.isfinite(stats["loss"]) and stats["mode"] == "graph"
    assert "LeNet-5 only" in step.info()["lenet"]


@gpu
def test_compiled_training_learns(mnist):
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    step = model.compile(opt, 64)
    loader = _loader(mnist, model, 60000, 64)
    stats = step.train_epoch(loader)
    acc = np.mean(model.predict(mnist[2]).argmax(1) == mnist[3])
    print(f"one compiled epoch: loss {stats['loss']:.4f}, train acc {stats['accuracy']:.4f}, "
          f"test acc {acc:.4f}, {stats['seconds'] * 1e3:.1f} ms")
    assert acc > 0.97
    assert step.info()["graphs"] and all(k == 3 * c for (b, c), k in step.info()["graphs"].items())


@gpu
def test_conv_algorithms_reports_the_measured_choice():
    x = ops.cuda.asarray(np.random.default_rng(0).standard_normal((8, 1, 28, 28)).astype(np.float32))
    w = ops.cuda.asarray(np.random.default_rng(1).standard_normal((6, 1, 5, 5)).astype(np.float32))
    y, cache = ops.cuda.conv_forward(x, w, None)
    ops.cuda.conv_backward(ops.cuda.zeros(y.shape), cache)
    found = [a for a in cydnn.cuda.conv_algorithms() if "n=8,c=1,h=28" in a["key"]]
    assert {a["direction"] for a in found} == {"forward", "backward_data", "backward_filter"}
    for a in found:
        ok = [c for c in a["candidates"] if c[2] == 0]
        assert ok and a["algo"] in [c[0] for c in ok] and a["time_ms"] >= 0
        assert "WINOGRAD" not in a["algo"]          # TF32 off: never chosen
        # the retimed candidates are usable ones, and the choice is the fastest of them (or Find's pick
        # where none beat it by the margin: conv_plan.cu's kRetimeMargin)
        assert set(a["retimed_ms"]) <= {c[0] for c in ok}
        if len(a["retimed_ms"]) > 1:
            assert a["algo"] in a["retimed_ms"]
            assert a["retimed_ms"][a["algo"]] <= min(a["retimed_ms"].values()) / 0.97 + 1e-9


# ------------------------------------------------------------ reduced precision
@gpu
def test_fp16_conv_and_linear_match_float16_rounded_inputs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 6, 12, 12)).astype(np.float32)
    w = (rng.standard_normal((16, 6, 5, 5)) / 8).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    h = lambda a: a.astype(np.float16).astype(np.float64)      # noqa: E731  the inputs the tensor cores see
    ref, _ = ops.cpu.conv_forward(h(x), h(w), b.astype(np.float64))
    xl = rng.standard_normal((32, 256)).astype(np.float32)
    wl = (rng.standard_normal((120, 256)) / 16).astype(np.float32)
    ref_l, _ = ops.cpu.linear_forward(h(xl), h(wl), b[:1].repeat(120).astype(np.float64))
    cydnn.cuda.set_fp16(True)
    try:
        got, _ = ops.cuda.conv_forward(x, w, b)
        got_l, _ = ops.cuda.linear_forward(xl, wl, b[:1].repeat(120))
    finally:
        cydnn.cuda.set_fp16(False)
    # conv's output passes through float16 (2^-11 relative); linear's accumulates and stays in float32
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-3
    assert np.abs(got_l - ref_l).max() / np.abs(ref_l).max() < 1e-5
    fp32, _ = ops.cuda.conv_forward(x, w, b)
    assert np.abs(fp32 - ops.cpu.conv_forward(x.astype(np.float64), w.astype(np.float64),
                                              b.astype(np.float64))[0]).max() < 1e-4   # back to fp32


@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_reduced_precision_predict_keeps_test_accuracy(classic, mnist):
    model = models.LeNet5(classic=classic, seed=0).to("cuda")       # two compiled epochs: ~98.5%
    opt = optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True)
    step = model.compile(opt, 64)
    loader = _loader(mnist, model, 60000, 64)
    for _ in range(2):
        step.train_epoch(loader)
    x, labels = mnist[2], mnist[3]
    acc = {p: float(np.mean(model.predict(x, precision=p).argmax(1) == labels)) for p in ("fp32", "tf32", "fp16")}
    print(f"test accuracy by precision ({'classic' if classic else 'modern'}): {acc}")
    assert abs(acc["tf32"] - acc["fp32"]) <= 0.001 and abs(acc["fp16"] - acc["fp32"]) <= 0.001
    assert cydnn.cuda.settings()["fp16"] is False and cydnn.cuda.settings()["allow_tf32"] is False
    with pytest.raises(ValueError, match="precision must be one of"):
        model.predict(x[:2], precision="bf16")


@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_fast_paths_on_a_few_images(classic):
    """Small and quick (the sanitizer subset): every fast inference path against the reference."""
    rng = np.random.default_rng(7)
    model = models.LeNet5(classic=classic, seed=3).to("cuda")
    images = rng.integers(0, 256, (100, 28, 28), dtype=np.uint8)
    for x in (images[:3], images[:3].astype(np.float32) / 255, images):      # graph path, float, chunked path
        assert np.abs(model.predict(x) - model.predict(x, fast=False)).max() <= 1e-5
    out = ops.cuda.empty((100, 10))
    _C.lenet_forward(classic, 10, tuple(p.data for p in model.parameters()), ops.cuda.asarray(images), out, model.mean,
                     model.std, True)
    assert np.abs(out.numpy() - model.predict(images, fast=False)).max() <= 1e-5
