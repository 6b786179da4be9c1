"""Batch normalization, global average pooling and leaky ReLU on the GPU: each op against its
numpy twin (run in float64 on the same float32 inputs), the layers on cuda against the layers
on the CPU, and, where PyTorch is importable, against PyTorch (float64 on the CPU): forward,
backward, running statistics after 3 training steps, momentum=None, evaluation mode.

Every test here needs a GPU (marked ``gpu``).  The pool poisons new blocks with NaN, so an
output element an op forgot to write fails.
"""
import re

import numpy as np
import pytest

import cydnn
from cydnn import nn
from cydnn.ops import cpu, cuda

from conftest import WORST_ERRORS

pytestmark = pytest.mark.gpu
TOL = 1e-5


@pytest.fixture(autouse=True)
def poisoned_pool():
    cydnn.cuda.set_debug_poison(True)
    yield
    cydnn.cuda.set_debug_poison(False)


def f32(rng, *shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


def f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def dev(a):
    return None if a is None else cuda.asarray(a)


def check(op, got, ref, tol=TOL):
    """The relative error ||got - ref|| / ||ref|| of a GPU result (numpy or DeviceArray) is at most tol."""
    if got is None or ref is None:
        assert got is None and ref is None, op
        return
    got = cuda.to_numpy(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (op, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{op}: non-finite output (an unwritten element?)"
    err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    WORST_ERRORS[op] = max(WORST_ERRORS.get(op, 0.0), err)
    assert err <= tol, f"{op}: relative error {err:.3e} > {tol:.0e}"


# ------------------------------------------------------ batch norm: the ops
BN_SHAPES = [(16, 5), (8, 4, 7), (4, 3, 5, 6), (2, 64, 8, 8), (32, 16, 1, 1)]


def bn_arrays(rng, shape):
    c = shape[1]
    return (f32(rng, *shape, scale=3.0, shift=1.0), rng.uniform(0.5, 1.5, c).astype(np.float32),
            f32(rng, c), f32(rng, c), rng.uniform(0.5, 2.0, c).astype(np.float32))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_matches_twin(shape, affine, training):
    rng = np.random.default_rng(0)
    x, gamma, beta, rm, rv = bn_arrays(rng, shape)
    if not affine:
        gamma = beta = None
    rm_ref, rv_ref = f64(rm), f64(rv)
    y_ref, cache_ref = cpu.batch_norm_forward(f64(x), f64(gamma), f64(beta), rm_ref, rv_ref, training,
                                              momentum=0.3, eps=1e-3)
    rm_dev, rv_dev = dev(rm), dev(rv)
    y, cache = cuda.batch_norm_forward(dev(x), dev(gamma), dev(beta), rm_dev, rv_dev, training, momentum=0.3,
                                       eps=1e-3)
    assert isinstance(y, cydnn.DeviceArray)
    check("batch_norm_forward", y, y_ref)
    check("batch_norm_forward running_mean", rm_dev, rm_ref)
    check("batch_norm_forward running_var", rv_dev, rv_ref)
    if not training:
        np.testing.assert_array_equal(rm_dev.numpy(), rm)       # evaluation leaves them
        np.testing.assert_array_equal(rv_dev.numpy(), rv)
    dy = f32(rng, *shape)
    dx_ref, dgamma_ref, dbeta_ref = cpu.batch_norm_backward(f64(dy), cache_ref)
    dx, dgamma, dbeta = cuda.batch_norm_backward(dev(dy), cache)
    check("batch_norm_backward dx", dx, dx_ref, tol=1e-4 if training else TOL)
    check("batch_norm_backward dgamma", dgamma, dgamma_ref, tol=1e-4)
    check("batch_norm_backward dbeta", dbeta, dbeta_ref)


def test_batch_norm_without_running_stats_matches_twin():
    rng = np.random.default_rng(1)
    x, gamma, beta, _, _ = bn_arrays(rng, (6, 3, 4, 4))
    y_ref, _ = cpu.batch_norm_forward(f64(x), f64(gamma), f64(beta), None, None, True)
    y, _ = cuda.batch_norm_forward(dev(x), dev(gamma), dev(beta), None, None, True)
    check("batch_norm_forward (no running stats)", y, y_ref)


def test_batch_norm_takes_numpy_and_updates_numpy_running_stats():
    rng = np.random.default_rng(2)
    x, gamma, beta, rm, rv = bn_arrays(rng, (8, 3, 4, 4))
    rm_ref, rv_ref = f64(rm), f64(rv)
    y_ref, cache_ref = cpu.batch_norm_forward(f64(x), f64(gamma), f64(beta), rm_ref, rv_ref, True)
    y, cache = cuda.batch_norm_forward(x, gamma, beta, rm, rv, True)
    assert isinstance(y, np.ndarray)
    check("batch_norm_forward (numpy)", y, y_ref)
    check("batch_norm_forward (numpy) running_var", rv, rv_ref)
    dx, dgamma, dbeta = cuda.batch_norm_backward(np.ones_like(x), cache)
    assert all(isinstance(a, np.ndarray) for a in (dx, dgamma, dbeta))


def test_eval_backward_uses_the_statistics_of_its_forward():
    """An evaluation forward keeps the statistics it used: a training forward that updates the same
    running arrays before the backward does not change that backward."""
    rng = np.random.default_rng(3)
    x, gamma, beta, rm, rv = bn_arrays(rng, (4, 3, 5, 5))
    _, cache_ref = cpu.batch_norm_forward(f64(x), f64(gamma), f64(beta), f64(rm), f64(rv), False)
    rm_dev, rv_dev = dev(rm), dev(rv)
    _, cache = cuda.batch_norm_forward(dev(x), dev(gamma), dev(beta), rm_dev, rv_dev, False)
    cuda.batch_norm_forward(dev(x * 5 + 3), dev(gamma), dev(beta), rm_dev, rv_dev, True, momentum=1.0)
    dy = f32(rng, *x.shape)
    dx_ref, dgamma_ref, _ = cpu.batch_norm_backward(f64(dy), cache_ref)
    dx, dgamma, _ = cuda.batch_norm_backward(dev(dy), cache)
    check("batch_norm_backward (eval) dx", dx, dx_ref)
    check("batch_norm_backward (eval) dgamma", dgamma, dgamma_ref, tol=1e-4)


def test_batch_norm_bad_input_raises_the_twins_errors():
    rng = np.random.default_rng(4)
    x, gamma, beta, rm, rv = bn_arrays(rng, (4, 3, 2, 2))
    message = "batch_norm_forward: gamma has 2 entries but x has 3 channels (x (4, 3, 2, 2), gamma (2,))"
    for backend, arrays in ((cpu, (x, gamma[:2], beta[:2], rm, rv)),
                            (cuda, (dev(x), dev(gamma[:2]), dev(beta[:2]), dev(rm), dev(rv)))):
        with pytest.raises(ValueError, match=re.escape(message)):
            backend.batch_norm_forward(*arrays, True)
    with pytest.raises(TypeError, match="batch_norm_forward: x has dtype float64; accepted: float32"):
        cuda.batch_norm_forward(f64(x), gamma, beta, rm, rv, True)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        cuda.batch_norm_forward(dev(x[:1, :, :1, :1]), dev(gamma), dev(beta), dev(rm), dev(rv), True)
    _, cache = cuda.batch_norm_forward(dev(x), dev(gamma), dev(beta), dev(rm), dev(rv), True)
    with pytest.raises(ValueError, match=re.escape("batch_norm_backward: dy has shape (4, 3, 2) but x has shape")):
        cuda.batch_norm_backward(dev(x[:, :, 0]), cache)


# -------------------------------------------------- global avg pool, leaky relu
@pytest.mark.parametrize("shape", [(2, 3, 1, 1), (2, 3, 4, 4), (4, 16, 7, 5), (2, 8, 32, 32), (1, 2, 64, 64)])
def test_global_avg_pool_matches_twin(shape):
    rng = np.random.default_rng(5)
    x = f32(rng, *shape, shift=0.5)
    y_ref, cache_ref = cpu.global_avg_pool_forward(f64(x))
    y, cache = cuda.global_avg_pool_forward(dev(x))
    # up to 4096 float32 additions per mean; a wrong window or divisor would be off by O(1)
    check("global_avg_pool_forward", y, y_ref, tol=1e-4)
    dy = f32(rng, shape[0], shape[1], 1, 1)
    check("global_avg_pool_backward", cuda.global_avg_pool_backward(dev(dy), cache),
          cpu.global_avg_pool_backward(f64(dy), cache_ref))


@pytest.mark.parametrize("slope", [0.01, 0.2, -0.3, 0.0])
@pytest.mark.parametrize("shape", [(1,), (7,), (4, 5, 3), (4099,)])
def test_leaky_relu_is_the_twin_bit_for_bit(shape, slope):
    rng = np.random.default_rng(6)
    x = f32(rng, *shape)
    x.ravel()[:5] = [np.nan, np.inf, -np.inf, -0.0, 0.0][:x.size]
    y_ref, cache_ref = cpu.leaky_relu_forward(x, slope)
    y, cache = cuda.leaky_relu_forward(dev(x), slope)
    np.testing.assert_array_equal(y.numpy(), y_ref)
    numbers = ~np.isnan(y_ref)          # (a NaN's sign bit is not specified: the GPU's is canonical)
    np.testing.assert_array_equal(np.signbit(y.numpy()[numbers]), np.signbit(y_ref[numbers]))
    dy = f32(rng, *shape)
    np.testing.assert_array_equal(cuda.leaky_relu_backward(dev(dy), cache).numpy(),
                                  cpu.leaky_relu_backward(dy, cache_ref))


def test_leaky_relu_on_unaligned_views_and_numpy():
    rng = np.random.default_rng(7)
    x, dy = f32(rng, 1027), f32(rng, 1027)
    y, cache = cuda.leaky_relu_forward(dev(x)[1:], 0.1)           # 4-byte offsets: the scalar path
    y_ref, cache_ref = cpu.leaky_relu_forward(x[1:], 0.1)
    np.testing.assert_array_equal(y.numpy(), y_ref)
    np.testing.assert_array_equal(cuda.leaky_relu_backward(dev(dy)[1:], cache).numpy(),
                                  cpu.leaky_relu_backward(dy[1:], cache_ref))
    y_host, _ = cuda.leaky_relu_forward(x, 0.1)
    assert isinstance(y_host, np.ndarray)
    np.testing.assert_array_equal(y_host, cpu.leaky_relu_forward(x, 0.1)[0])
    with pytest.raises(TypeError, match="leaky_relu_forward: x has dtype float64; accepted: float32"):
        cuda.leaky_relu_forward(f64(x), 0.1)


# ------------------------------------------------- the layers: cuda vs cpu
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("layer,shape", [(nn.BatchNorm2d, (8, 4, 5, 5)), (nn.BatchNorm1d, (16, 4)),
                                         (nn.BatchNorm1d, (8, 4, 6))])
def test_batch_norm_layer_on_cuda_matches_cpu(layer, shape, momentum):
    rng = np.random.default_rng(8)
    on_cpu = layer(4, momentum=momentum).double()
    on_cpu.weight.data[...] = rng.uniform(0.5, 1.5, 4)
    on_cpu.bias.data[...] = rng.standard_normal(4)
    on_gpu = layer(4, momentum=momentum)
    on_gpu.load_state_dict(on_cpu.state_dict())
    on_gpu.to("cuda")
    for step in range(3):
        x, dy = f32(rng, *shape, scale=2.0, shift=step), f32(rng, *shape)
        check("BatchNorm train forward", on_gpu(dev(x)), on_cpu(f64(x)))
        check("BatchNorm train backward", on_gpu.backward(dev(dy)), on_cpu.backward(f64(dy)), tol=1e-4)
        check("BatchNorm weight.grad", on_gpu.weight.grad, on_cpu.weight.grad, tol=1e-4)
        check("BatchNorm bias.grad", on_gpu.bias.grad, on_cpu.bias.grad)
    gpu_state, cpu_state = on_gpu.state_dict(), on_cpu.state_dict()
    assert list(gpu_state) == list(cpu_state)
    assert gpu_state["num_batches_tracked"].dtype == np.int64 and int(gpu_state["num_batches_tracked"]) == 3
    for name in ("running_mean", "running_var"):
        check(f"BatchNorm {name} after 3 steps", gpu_state[name], cpu_state[name])
    on_gpu.eval(), on_cpu.eval()
    x, dy = f32(rng, *shape), f32(rng, *shape)
    check("BatchNorm eval forward", on_gpu(dev(x)), on_cpu(f64(x)))
    check("BatchNorm eval backward", on_gpu.backward(dev(dy)), on_cpu.backward(f64(dy)))


def test_model_with_batch_norm_moves_and_round_trips():
    rng = np.random.default_rng(9)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=0), nn.BatchNorm2d(8), nn.LeakyReLU(0.1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4, rng=1))
    reference = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, rng=0), nn.BatchNorm2d(8), nn.LeakyReLU(0.1),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4, rng=1)).double()
    model.to("cuda")
    assert isinstance(model[1].running_mean, cydnn.DeviceArray)
    assert isinstance(model[1].num_batches_tracked, np.ndarray)      # counters stay on the host
    for _ in range(2):
        x = f32(rng, 4, 3, 6, 6)
        check("model train forward", model(dev(x)), reference(f64(x)), tol=1e-4)
        dy = f32(rng, 4, 4)
        check("model backward", model.backward(dev(dy)), reference.backward(f64(dy)), tol=1e-4)
    model.to("cpu")
    assert isinstance(model[1].running_var, np.ndarray)
    check("running_var after .to('cpu')", model[1].running_var, reference[1].running_var)


# ------------------------------------------------------------- vs PyTorch
def _torch_layer(torch, name, c, momentum, rng):
    ref = getattr(torch.nn, name)(c, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, c)))
        ref.bias.copy_(torch.from_numpy(rng.standard_normal(c)))
    return ref


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("name,shape", [("BatchNorm2d", (8, 4, 5, 5)), ("BatchNorm1d", (16, 4)),
                                        ("BatchNorm1d", (8, 4, 6))])
def test_batch_norm_matches_pytorch(name, shape, momentum):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    ref = _torch_layer(torch, name, 4, momentum, rng)
    ours = getattr(nn, name)(4, momentum=momentum)
    ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})    # PyTorch's state_dict as it is
    ours.to("cuda")
    for step in range(3):
        x, dy = f32(rng, *shape, scale=2.0, shift=step), f32(rng, *shape)
        xt = torch.from_numpy(f64(x)).requires_grad_(True)
        ref.weight.grad = ref.bias.grad = None
        yt = ref(xt)
        yt.backward(torch.from_numpy(f64(dy)))
        check("vs torch: BatchNorm train forward", ours(dev(x)), yt.detach().numpy())
        check("vs torch: BatchNorm train dx", ours.backward(dev(dy)), xt.grad.numpy(), tol=1e-4)
        check("vs torch: BatchNorm dweight", ours.weight.grad, ref.weight.grad.numpy(), tol=1e-4)
        check("vs torch: BatchNorm dbias", ours.bias.grad, ref.bias.grad.numpy())
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert list(ours_state) == list(ref_state)
    assert int(ours_state["num_batches_tracked"]) == int(ref_state["num_batches_tracked"]) == 3
    for key in ("running_mean", "running_var"):
        check(f"vs torch: {key} after 3 steps", ours_state[key], ref_state[key].numpy())
    ref.eval(), ours.eval()
    x, dy = f32(rng, *shape), f32(rng, *shape)
    xt = torch.from_numpy(f64(x)).requires_grad_(True)
    yt = ref(xt)
    yt.backward(torch.from_numpy(f64(dy)))
    check("vs torch: BatchNorm eval forward", ours(dev(x)), yt.detach().numpy())
    check("vs torch: BatchNorm eval dx", ours.backward(dev(dy)), xt.grad.numpy())


def test_leaky_relu_and_adaptive_avg_pool_match_pytorch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x, dy = f32(rng, 4, 3, 7, 5), f32(rng, 4, 3, 7, 5)
    xt = torch.from_numpy(f64(x)).requires_grad_(True)
    torch.nn.functional.leaky_relu(xt, 0.2).backward(torch.from_numpy(f64(dy)))
    layer = nn.LeakyReLU(0.2)
    check("vs torch: LeakyReLU forward", layer(dev(x)), torch.nn.functional.leaky_relu(xt, 0.2).detach().numpy())
    check("vs torch: LeakyReLU backward", layer.backward(dev(dy)), xt.grad.numpy())
    xt = torch.from_numpy(f64(x)).requires_grad_(True)
    pool_dy = f32(rng, 4, 3, 1, 1)
    yt = torch.nn.AdaptiveAvgPool2d(1)(xt)
    yt.backward(torch.from_numpy(f64(pool_dy)))
    pool = nn.AdaptiveAvgPool2d(1)
    check("vs torch: AdaptiveAvgPool2d forward", pool(dev(x)), yt.detach().numpy())
    check("vs torch: AdaptiveAvgPool2d backward", pool.backward(dev(pool_dy)), xt.grad.numpy())
