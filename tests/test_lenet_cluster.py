"""LeNet-5's few-image kernel on a thread-block cluster (cpp/fused_lenet_cluster.cuh, chosen in
cpp/fused_lenet.cu for up to 4 images (modern) or 16 (classic); CYDNN_LENET_CLUSTER_MAX overrides the limit)
against the one-block kernel and the per-op path.

Both kernels are launched directly (``_C.lenet_forward``, device arrays) and through the numpy predictor
(mapped memory, a CUDA graph per bucket, the image count read from the header: a bucket of 4 for 3 images
leaves one cluster that must exit without touching another's memory), for the modern and the classic network,
1, 10 and 32 classes, uint8 and float input, probabilities and logits.
"""
import numpy as np
import pytest

from cydnn import _C, models, ops

gpu = pytest.mark.gpu
ENV = "CYDNN_LENET_CLUSTER_MAX"


def _model(classic, nc, seed=3):
    model = models.LeNet5(classic=classic, num_classes=nc, seed=seed).to("cuda")
    params = tuple(p.data for p in model.parameters())
    return model, params


def _forward(monkeypatch, limit, model, params, images, softmax):
    monkeypatch.setenv(ENV, str(limit))
    nc = model.num_classes
    out = ops.cuda.empty((len(images), nc))
    _C.lenet_forward(model.classic, nc, params, ops.cuda.asarray(images), out, model.mean, model.std, softmax)
    return out.numpy()


@gpu
@pytest.mark.parametrize("classic", [False, True])
@pytest.mark.parametrize("nc", [1, 10, 32])
def test_the_cluster_kernel_gives_the_block_kernels_results(classic, nc, monkeypatch):
    model, params = _model(classic, nc)
    rng = np.random.default_rng(11)
    images = rng.integers(0, 256, (16, 28, 28), dtype=np.uint8)
    for x in (images, images.astype(np.float32) / 255):
        ref = model.predict(x, fast=False)
        for softmax in (True, False):
            block = _forward(monkeypatch, 0, model, params, x, softmax)
            cluster = _forward(monkeypatch, 64, model, params, x, softmax)
            assert np.all(np.isfinite(cluster))
            scale = 1.0 if softmax else max(1.0, float(np.abs(block).max()))
            assert np.abs(cluster - block).max() <= 1e-5 * scale
            if softmax:
                assert np.abs(cluster - ref).max() <= 1e-5
                assert np.array_equal(cluster.argmax(1), ref.argmax(1))
            elif nc > 1:
                # two kernels ran: their sums are in other orders, so some logit differs in its last bits
                assert not np.array_equal(cluster, block)


@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_the_predictor_on_clusters_equals_the_reference(classic, monkeypatch):
    monkeypatch.setenv(ENV, "64")
    model, params = _model(classic, 10, seed=5)
    rng = np.random.default_rng(12)
    images = rng.integers(0, 256, (70, 28, 28), dtype=np.uint8)
    pred, ps = _C.Predictor(classic, 10, model.mean, model.std, True), tuple(model.parameters())
    for rounds in range(2):       # the second round replays the captured graphs
        for n in (1, 3, 5, 16, 64, 2, 1):
            x = images[(n * 7) % 5:][:n]          # other images at other offsets
            for arr in (x, x.astype(np.float32) / 255):
                got = pred(ps, arr, False)
                ref = model.predict(arr, fast=False)
                assert got.shape == (n, 10)
                assert np.abs(got - ref).max() <= 1e-5, (rounds, n, arr.dtype)
    assert pred.graph_count >= 5


@gpu
def test_above_the_limit_the_block_kernel_runs(monkeypatch):
    model, params = _model(False, 10)
    images = np.random.default_rng(13).integers(0, 256, (8, 28, 28), dtype=np.uint8)
    block = _forward(monkeypatch, 0, model, params, images, False)
    assert np.array_equal(_forward(monkeypatch, 7, model, params, images, False), block)
    assert not np.array_equal(_forward(monkeypatch, 8, model, params, images, False), block)


@gpu
@pytest.mark.parametrize("classic, limit", [(False, 4), (True, 16)])
def test_the_default_limit_is_4_images_modern_and_16_classic(classic, limit, monkeypatch):
    """Measured on the H100 (docs/performance/zoo-session-33.md): past these the one-block kernel is as fast."""
    model, params = _model(classic, 10)
    images = np.random.default_rng(14).integers(0, 256, (limit + 1, 28, 28), dtype=np.uint8)
    for n in (limit, limit + 1):
        x = images[:n]
        cluster = _forward(monkeypatch, 64, model, params, x, False)
        block = _forward(monkeypatch, 0, model, params, x, False)
        monkeypatch.delenv(ENV)
        out = ops.cuda.empty((n, 10))
        _C.lenet_forward(classic, 10, params, ops.cuda.asarray(x), out, model.mean, model.std, False)
        assert np.array_equal(out.numpy(), cluster if n <= limit else block)


@gpu
@pytest.mark.parametrize("classic", [False, True])
def test_the_cluster_kernel_alone_against_the_numpy_path(classic, monkeypatch):
    """The sanitizers' case (tools/sanitize.sh's racecheck): only the cluster kernel runs on the GPU -- three
    images, launched directly -- against the same model's numpy path on the CPU.  Racecheck did not finish the
    tests above in 200 s: they run the one-block kernel too (1,024 threads), on which it is slow."""
    monkeypatch.setenv(ENV, "64")
    images = np.random.default_rng(15).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    ref = models.LeNet5(classic=classic, seed=4).predict(images)          # numpy, on the CPU
    model, params = _model(classic, 10, seed=4)                            # the same weights on the GPU
    out = ops.cuda.empty((3, 10))
    _C.lenet_forward(classic, 10, params, ops.cuda.asarray(images), out, model.mean, model.std, True)
    assert np.abs(out.numpy() - ref).max() <= 1e-5
    assert np.array_equal(out.numpy().argmax(1), ref.argmax(1))
