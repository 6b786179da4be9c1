"""More odd input at the API (beside test_faults_api.py): 200,000 images on the CPU, NaN pixels,
odd array types, and DeviceArrays used after empty_cache()."""
import numpy as np
import pytest

import cydnn
from cydnn import models

gpu = pytest.mark.gpu


def test_two_hundred_thousand_images_at_once_on_the_cpu_go_in_chunks(monkeypatch):
    """200,000 images (a zero-copy broadcast view: no 157 MB input): predict goes through them
    ``batch_size`` at a time, each chunk preprocessed on its own, and fills the (N, 10) result.
    The layers are replaced by a stand-in that encodes each image's mean pixel into its logits,
    so that the test takes a second and still checks that each row belongs to its image."""
    m = models.LeNet5(seed=0)
    pixels = np.arange(256, dtype=np.uint8)
    n = 200_000
    base = np.broadcast_to(pixels[:, None, None], (256, 28, 28))
    images = np.broadcast_to(base[None], (n // 256 + 1, 256, 28, 28)).reshape(-1, 28, 28)[:n]
    assert images.shape == (n, 28, 28) and images.base is not None

    seen = []

    def stand_in(x):
        seen.append(x.shape)
        logits = np.zeros((x.shape[0], 10), np.float32)
        logits[:, 0] = x.mean(axis=(1, 2, 3))               # normalised mean pixel of each image
        return logits
    monkeypatch.setattr(m, "forward", stand_in)
    probs = m.predict(images, batch_size=4096)
    assert probs.shape == (n, 10) and probs.dtype == np.float32
    assert len(seen) == -(-n // 4096) and all(s[1:] == (1, 28, 28) for s in seen)
    assert max(s[0] for s in seen) == 4096 and seen[-1][0] == n - 4096 * (n // 4096)
    # Row i came from image i: its first logit is a monotone function of the pixel value i % 256.
    order = np.argsort(probs[:256, 0], kind="stable")
    np.testing.assert_array_equal(order, np.arange(256))
    np.testing.assert_array_equal(probs[256:512], probs[:256])
    np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-6)


def test_real_forward_agrees_across_chunk_boundaries():
    m = models.LeNet5(seed=1)
    x = np.random.default_rng(0).integers(0, 256, (1000, 28, 28), dtype=np.uint8)
    whole = m.predict(x, batch_size=1000)
    np.testing.assert_allclose(m.predict(x, batch_size=333), whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m.predict(x[:20], batch_size=1), whole[:20], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad, what", [
    (np.nan, "NaN"), (1.5, "above 1"), (-0.01, "below 0"), (np.inf, "inf")])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_images_outside_0_1_are_refused_naming_the_range(bad, what, dtype):
    x = np.full((2, 28, 28), 0.5, dtype)
    x[1, 3, 4] = bad
    with pytest.raises(ValueError, match=r"float images must hold values in \[0, 1\], got the range"):
        models.LeNet5().predict(x)


@pytest.mark.parametrize("x, error, match", [
    ([[0] * 28] * 28, TypeError, "predict expects a numpy array, got list"),
    (np.zeros((2, 28, 28), np.int64), TypeError, "got dtype int64"),
    (np.zeros((2, 28, 28), np.uint16), TypeError, "got dtype uint16"),
    (np.zeros((2, 28, 28), bool), TypeError, "got dtype bool"),
    (np.zeros((2, 28, 28), np.complex128), TypeError, "got dtype complex128"),
    (np.zeros((2, 28, 28), [("a", np.uint8)]), TypeError, "got dtype"),
    (np.zeros((2, 3, 28, 28), np.uint8), ValueError, r"got \(2, 3, 28, 28\)"),
    (np.zeros((28,), np.uint8), ValueError, r"got \(28,\)"),
    (np.zeros((2, 32, 32), np.uint8), ValueError, r"got \(2, 32, 32\)"),
])
def test_odd_inputs_are_refused_with_type_or_value_error(x, error, match):
    with pytest.raises(error, match=match):
        models.LeNet5().predict(x)


def test_zero_images_of_every_accepted_kind():
    m = models.LeNet5()
    for x in (np.zeros((0, 28, 28), np.uint8), np.zeros((0, 1, 28, 28), np.float16),
              np.zeros((0, 28, 28), np.float64)):
        out = m.predict(x)
        assert out.shape == (0, 10) and out.dtype == np.float32
    assert m.predict_classes(np.zeros((0, 28, 28), np.uint8)).shape == (0,)


@gpu
def test_device_arrays_work_in_ops_after_empty_cache():
    from cydnn.ops import cuda
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    a = cydnn.to_device(x)
    y, cache = cuda.relu_forward(a)
    del cache
    cydnn.cuda.empty_cache()
    assert np.array_equal(a.numpy(), x)                       # still its data
    y2, _ = cuda.relu_forward(a)                              # and usable as an op's input
    assert np.array_equal(y2.numpy(), np.maximum(x, 0)) and np.array_equal(y.numpy(), y2.numpy())
    p, _ = cuda.max_pool_forward(a, 2)
    cydnn.cuda.empty_cache()
    out = cuda.relu_backward(cydnn.to_device(np.ones_like(x)), y2)   # y2 made before the second empty_cache
    assert np.array_equal(out.numpy(), (x > 0).astype(np.float32))
    assert p.numpy().shape == (4, 3, 4, 4)


@gpu
def test_the_fast_predictors_c_calls_take_turns_between_threads():
    """The fast predictor's pinned buffers and graphs are shared by its calls, so the calls of one
    predictor must never overlap (here the wrapper sleeps with the GIL released to invite it).  The real
    FastPredictor, made by ``predict`` itself, with its C predictor wrapped to count how many calls
    are inside at once (and to hold each call a little longer, GIL released): with the predictor's
    own lock the peak is 1 and every result equals the call made alone; with the lock taken out
    the same threads do overlap, so the count can see an overlap when there is one."""
    import contextlib
    import threading
    import time

    m = models.LeNet5(seed=0).to("cuda")
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) for n in (1, 5, 17, 64)]
    alone = [m.predict(b) for b in batches]                 # makes the predictor (public API)
    outer = m.fast_predictor()                              # the compiled inference ...
    predictor = outer._lenet                                # ... which runs LeNet-5 on its fused C predictor
    assert predictor is not None and isinstance(predictor._lock, type(threading.Lock()))
    assert isinstance(outer._lock, type(threading.Lock()))
    real = predictor._p

    class Counting:
        inside = peak = calls = 0
        guard = threading.Lock()

        def __call__(self, *args):        # what the C predictor takes: params, images, the input kind
            with self.guard:
                self.inside += 1
                self.peak = max(self.peak, self.inside)
                self.calls += 1
            try:
                time.sleep(0.002)
                return real(*args)
            finally:
                with self.guard:
                    self.inside -= 1

    def hammer():
        counting = Counting()
        predictor._p = counting
        results, errors = [], []

        def work(k):
            try:
                for _ in range(10):
                    results.append((k, m.predict(batches[k])))
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(k % len(batches),)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        return counting, results

    try:
        counting, results = hammer()
        assert counting.calls == 60 and counting.peak == 1
        for k, r in results:
            np.testing.assert_array_equal(r, alone[k])
        predictor._lock = outer._lock = contextlib.nullcontext()   # the locks taken out: the calls overlap
        counting, _ = hammer()
        assert counting.calls == 60 and counting.peak > 1
    finally:
        predictor._p, predictor._lock, outer._lock = real, threading.Lock(), threading.Lock()


def test_predict_fast_true_on_the_cpu_raises_as_documented():
    """``fast=True`` "raises ValueError, with the reason, where the fast path cannot run": on the
    CPU it cannot (the fused kernels are CUDA), so it must not quietly return the reference result."""
    m = models.LeNet5(seed=0)
    x = np.zeros((2, 28, 28), np.uint8)
    with pytest.raises(ValueError, match=r"predict\(fast=True\).*(GPU|cuda|CUDA)"):
        m.predict(x, fast=True)
    assert m.predict(x, fast=None).shape == (2, 10) and m.predict(x, fast=False).shape == (2, 10)
