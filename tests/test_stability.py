"""Long runs on the GPU: no memory creeping, pool back where it was, recovery after OOM.

Each test states what it measures: the pool's allocated and reserved bytes
(cydnn's own counters, exact), sampled after the first epoch, when every
plan, static buffer and cached block exists.
"""
import gc
import os
from pathlib import Path

import numpy as np
import pytest

import cydnn
from cydnn import datasets, models, nn, optim

MNIST = Path(os.environ.get("CYDNN_TEST_MNIST", Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
gpu = pytest.mark.gpu
# Under compute-sanitizer everything runs ~100x slower: fewer steps, same assertions.
SCALE = 50 if os.environ.get("CYDNN_SANITIZE") else 1


@pytest.fixture(scope="module")
def train_set(tmp_path_factory):
    if not MNIST.is_dir():
        pytest.skip(f"real MNIST not found in {MNIST} (set CYDNN_TEST_MNIST)")
    ds = datasets.MNIST(root=tmp_path_factory.mktemp("mnist"), train=True, mirrors=[str(MNIST)])
    return ds.images[:6400], ds.labels[:6400]


def _pool():
    """(bytes asked for by the live arrays, bytes reserved from the driver).

    ``requested_bytes`` counts exactly what live arrays asked for: a leak of any
    array shows in it.  ``allocated_bytes`` is not used: it counts the rounded
    size of the cached block that served each request, and best fit may hand
    the same request a block of another size class from one epoch to the next.
    """
    s = cydnn.cuda.memory_stats()
    return s["requested_bytes"], s["reserved_bytes"]


@gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_twenty_thousand_steps_do_not_grow_the_pool(compiled, train_set):
    steps = 20000 // SCALE
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = model.compile(opt, 32, fused=compiled, cuda_graph=compiled)
    loader = datasets.DataLoader(*train_set, batch_size=32, mean=model.mean, std=model.std, device="cuda",
                                 max_shift=2)
    per_epoch = len(loader)
    step.train_epoch(loader)               # the first epoch builds plans, buffers and graphs
    # Both samples after a collection: arrays that earlier tests in this process left in reference cycles are
    # not this loop's, and a collection between the samples would count them as a change (session 37: the
    # reference run failed here right after tests/test_fast.py in one process, most likely that).
    gc.collect()
    cydnn.cuda.synchronize()
    after_first = _pool()
    done = per_epoch
    while done < steps:
        r = step.train_epoch(loader)
        done += r["steps"]
        assert np.isfinite(r["loss"])
    gc.collect()
    cydnn.cuda.synchronize()
    end = _pool()
    assert end[0] == after_first[0], (after_first, end, done)          # no live array more or less
    assert end[1] <= after_first[1] + (1 << 20), (after_first, end, done)  # no growth of the reservation
    print(f"{'compiled' if compiled else 'reference'}: {done} steps, pool requested/reserved "
          f"{after_first[0]}/{after_first[1]} bytes after the first epoch, {end[0]}/{end[1]} at the end")


@gpu
def test_a_thousand_models_return_the_pool_where_it_was():
    images = np.random.default_rng(0).integers(0, 256, (100, 28, 28), dtype=np.uint8)
    warm = models.LeNet5().to("cuda")
    warm.predict(images[:3]), warm.predict(images)
    del warm
    gc.collect()
    cydnn.cuda.synchronize()
    before = cydnn.cuda.memory_stats()["allocated_bytes"]
    for i in range(1000 // SCALE):
        m = models.LeNet5(seed=i, classic=bool(i % 2)).to("cuda")
        if i % 100 == 0:
            m.predict(images[:3]), m.predict(images), m.predict(images, fast=False)
        del m
    gc.collect()
    cydnn.cuda.synchronize()
    assert cydnn.cuda.memory_stats()["allocated_bytes"] == before


@gpu
def test_out_of_memory_then_both_paths_still_work(train_set):
    model = models.LeNet5(seed=0).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = model.compile(opt, 64)
    loader = datasets.DataLoader(*train_set, batch_size=64, mean=model.mean, std=model.std, device="cuda")
    step.train_epoch(loader, steps=3)
    ooms = cydnn.cuda.memory_stats()["num_ooms"]
    with pytest.raises(cydnn.OutOfMemoryError):
        cydnn.empty((1 << 40,), np.uint8)            # 1 TiB: more than any GPU here
    assert cydnn.cuda.memory_stats()["num_ooms"] == ooms + 1
    assert np.isfinite(step.train_epoch(loader, steps=3)["loss"])      # captured step
    x, y = next(iter(loader))
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(model(x), y)                                        # reference step
    model.backward(loss_fn.backward())
    opt.step()
    assert np.isfinite(float(loss.numpy()))
    assert model.predict(train_set[0][:5]).shape == (5, 10)


@gpu
def test_compiled_step_refuses_a_loader_of_another_batch_size(train_set):
    model = models.LeNet5(seed=0).to("cuda")
    step = model.compile(optim.SGD(model.parameters(), lr=0.01), 64)
    loader = datasets.DataLoader(*train_set, batch_size=32, mean=model.mean, std=model.std, device="cuda")
    with pytest.raises(ValueError, match="compiled for batch_size 64, the loader gives 32"):
        step.train_epoch(loader)


@gpu
def test_device_arrays_outlive_empty_cache_and_their_model():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    a = cydnn.to_device(x)
    cydnn.cuda.empty_cache()                 # frees cached free blocks only: `a` holds its block
    assert np.array_equal(a.numpy(), x)
    model = models.LeNet5(seed=3).to("cuda")
    w = model.fc1.weight.data
    expected = models.LeNet5(seed=3).fc1.weight.data
    step = model.compile(optim.SGD(model.parameters(), lr=0.0), 16)
    del model, step
    gc.collect()
    cydnn.cuda.empty_cache()
    assert np.array_equal(w.numpy(), expected)   # the array keeps its memory after its model is gone
    b = cydnn.to_device(np.ones(1000, np.float32))   # and new allocations don't land on it
    assert np.array_equal(w.numpy(), expected) and b.numpy().sum() == 1000
