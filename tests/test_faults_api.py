"""Bad input and odd input at the API: each answered with one clear exception or a documented result."""
import threading

import numpy as np
import pytest

from cydnn import models, optim

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return models.LeNet5(seed=0)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)


def test_zero_images_give_an_empty_result(model):
    out = model.predict(np.zeros((0, 28, 28), np.uint8))
    assert out.shape == (0, 10) and out.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.int64, bool, np.complex64, np.int32, object])
def test_non_pixel_dtypes_are_refused_naming_the_dtype(model, dtype):
    with pytest.raises(TypeError, match=f"got dtype {np.dtype(dtype)}"):
        model.predict(np.zeros((2, 28, 28), dtype))


def test_float16_images_are_floats_in_0_1(model, images):
    x = images.astype(np.float32) / 255
    np.testing.assert_allclose(model.predict(x.astype(np.float16)), model.predict(x.astype(np.float16).astype(np.float32)),
                               rtol=0, atol=0)


def test_strided_readonly_and_memmapped_images(model, images, tmp_path):
    ref = model.predict(np.ascontiguousarray(images[::2]))
    np.testing.assert_array_equal(model.predict(images[::2]), ref)                  # non-contiguous
    ro = images.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(model.predict(ro), model.predict(images))         # read-only
    path = tmp_path / "images.u8"
    images.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=images.shape)
    np.testing.assert_array_equal(model.predict(mm), model.predict(images))         # memory-mapped
    wide = np.zeros((50, 28, 56), np.uint8)
    wide[:, :, ::2] = images
    np.testing.assert_array_equal(model.predict(wide[:, :, ::2]), model.predict(images))


def test_many_images_in_chunks_on_the_cpu(model):
    x = np.random.default_rng(1).integers(0, 256, (20_000, 28, 28), dtype=np.uint8)
    out = model.predict(x, batch_size=6_000)              # 4 chunks, the last one short
    assert out.shape == (20_000, 10) and np.isfinite(out).all()
    np.testing.assert_allclose(out[-7:], model.predict(x[-7:]), rtol=1e-5, atol=1e-6)


@gpu
def test_two_hundred_thousand_images_at_once_on_the_gpu():
    m = models.LeNet5(seed=0).to("cuda")
    x = np.random.default_rng(1).integers(0, 256, (200_000, 28, 28), dtype=np.uint8)
    out = m.predict(x)                                     # the fast path: chunks of 4096 through pinned memory
    assert out.shape == (200_000, 10) and np.isfinite(out).all()
    np.testing.assert_allclose(out[::997], m.predict(x[::997], fast=False), rtol=0, atol=1e-5)


def test_nan_weights_give_nan_probabilities(images):
    m = models.LeNet5(seed=1)
    sd = m.state_dict()
    sd["fc3.bias"][3] = np.nan
    m.load_state_dict(sd)
    p = m.predict(images[:4])
    assert np.isnan(p).all()          # softmax over a row with a NaN logit: the whole row is NaN
    sd["fc3.bias"][3] = np.inf
    m.load_state_dict(sd)
    assert np.isnan(m.predict(images[:4])).all()


@pytest.mark.parametrize("make, what", [
    (lambda p, v: optim.SGD(p, lr=v), "SGD: learning rate"),
    (lambda p, v: optim.Adam(p, lr=v), "Adam: learning rate"),
    (lambda p, v: optim.AdamW(p, lr=v), "AdamW: learning rate"),
    (lambda p, v: optim.SGD(p, lr=0.1, momentum=v), "SGD: momentum"),
    (lambda p, v: optim.SGD(p, lr=0.1, weight_decay=v), "SGD: weight_decay"),
    (lambda p, v: optim.Adam(p, eps=v), "Adam: eps"),
    (lambda p, v: optim.Adam(p, weight_decay=v), "Adam: weight_decay"),
    (lambda p, v: optim.Adam(p, betas=(v, 0.9)), r"Adam: betas\[0\]"),
])
@pytest.mark.parametrize("value, rule", [(float("nan"), "must be finite, got nan"),
                                         (float("inf"), "must be finite, got inf"),
                                         (-1.0, "must be >= 0, got -1.0")])
def test_optimizer_hyperparameters_must_be_finite_and_valid(model, make, what, value, rule):
    """Each of the 24 refusals names the optimizer, the setting, the rule and the value given."""
    with pytest.raises(ValueError, match=f"^{what} {rule}$"):
        make(model.parameters(), value)


def test_a_schedule_cannot_set_a_nan_learning_rate(model):
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="^StepLR: gamma must be finite, got nan$"):
        optim.StepLR(opt, step_size=1, gamma=float("nan"))
    with pytest.raises(ValueError, match="^CosineAnnealingLR: eta_min must be finite, got inf$"):
        optim.CosineAnnealingLR(opt, T_max=3, eta_min=float("inf"))

    class Broken(optim.LRScheduler):          # a schedule of one's own that goes wrong at t = 2
        def lr_at(self, t):
            return self.base_lr if t < 2 else float("nan")
    sched = Broken(opt)
    sched.step()
    assert opt.lr == 0.1
    with pytest.raises(ValueError, match="^SGD: learning rate must be finite, got nan$"):
        sched.step()
    assert opt.lr == 0.1                      # the refused value never took effect
    with pytest.raises(ValueError, match="^SGD: learning rate must be finite, got nan$"):
        opt.lr = float("nan")


def test_mismatched_dtypes_between_op_arguments_are_named():
    from cydnn.ops import cpu
    with pytest.raises(TypeError, match=r"conv_forward: w has dtype float64 but x has dtype float32"):
        cpu.conv_forward(np.zeros((1, 1, 8, 8), np.float32), np.zeros((2, 1, 3, 3)), None)
    with pytest.raises(TypeError, match=r"linear_forward: w has dtype float64 but x has dtype float32"):
        cpu.linear_forward(np.zeros((2, 4), np.float32), np.zeros((3, 4)), None)


def _threads_predict(model, images, n=4):
    results, errors = [None] * n, []

    def work(i):
        try:
            results[i] = [model.predict(images[i::n]) for _ in range(20)][-1]
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    return results


def test_threads_predicting_with_one_model_on_the_cpu(model, images):
    for i, r in enumerate(_threads_predict(model, images)):
        np.testing.assert_array_equal(r, model.predict(images[i::4]))


@gpu
def test_threads_predicting_with_one_model_on_the_gpu(images):
    m = models.LeNet5(seed=0).to("cuda")
    big = np.random.default_rng(2).integers(0, 256, (400, 28, 28), dtype=np.uint8)
    for data in (images, big):                   # the graph path and the chunked path
        for i, r in enumerate(_threads_predict(m, data)):
            np.testing.assert_array_equal(r, m.predict(data[i::4]))


def test_threads_predicting_leave_a_training_model_in_training_mode(images, monkeypatch):
    """Each reference predict switches the model to eval and back; interleaved switches
    (forced here by a forward that sleeps) must not leave a training model in eval mode."""
    import time
    m = models.LeNet5(seed=0)
    forward = m.forward

    def slow_forward(x):
        time.sleep(0.002)
        return forward(x)
    monkeypatch.setattr(m, "forward", slow_forward)
    m.train()
    _threads_predict(m, images[:8])
    assert m.training, "concurrent predict calls left a training model in eval mode"
    assert all(layer.training for layer in m._modules.values())


@gpu
def test_threads_on_two_models_fast_and_reference_paths_at_once(images):
    """Two models' fast predictors (first calls capture graphs on the library's one stream)
    and a third model on the reference per-layer path, all from threads at the same time:
    every result equals the same call made alone."""
    a = models.LeNet5(seed=0).to("cuda")
    b = models.LeNet5(seed=1, classic=True).to("cuda")
    c = models.LeNet5(seed=2).to("cuda")
    sizes = (1, 3, 17, 64, 65, 300)
    jobs = [(m, n, fast) for n in sizes for (m, fast) in ((a, None), (b, None), (c, False))]
    results, errors = {}, []

    def work(k):
        m, n, fast = jobs[k]
        try:
            results[k] = [m.predict(images[:n], fast=fast) for _ in range(5)]
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for k, (m, n, fast) in enumerate(jobs):
        alone = m.predict(images[:n], fast=fast)
        for r in results[k]:
            np.testing.assert_array_equal(r, alone)
