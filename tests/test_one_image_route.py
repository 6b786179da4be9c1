"""One-image numpy calls of a compiled inference on the fused network, once their route is settled
(compiler/inference.py's ``_one``, _C.MappedCall): one C call -- the image into mapped memory, one launch, one
wait, a new array out -- with no Python between the lock and the C call but the checks that the route still holds:
the structure version (a parameter, buffer or module replaced, the model moved) and the generated kernels'
changes.  GPU: the route is taken, gives the general path's bits and the reference's values, and every change a
user can make is seen -- weights updated in place, a parameter replaced, load_state_dict, the model moved to the
CPU, the model gone --; inputs it does not take (other dtypes, strides, batch sizes, DeviceArrays) go the general
way; a generated kernel adopted later is the one the route then runs.  CPU (the fused network and its C calls stood
in for): when the route is taken, kept, made again or not made at all -- a new structure version, the kernels'
changes, another cluster, a compile running, a bucket hoping, a weakly held model gone."""
import gc

import numpy as np
import pytest

import cydnn
from cydnn import _C, nn, optim
from cydnn.compiler import fused_net_gen

from test_compiler import ZOO

gpu = pytest.mark.gpu


def _reference(model, x):
    return model(_C.to_device(x)).numpy()


def _counted(infer, monkeypatch):
    """``infer`` with its general path counted: calls["general"]."""
    calls = {"general": 0}
    general = infer._call

    def count(x):
        calls["general"] += 1
        return general(x)
    monkeypatch.setattr(infer, "_call", count)
    return calls


@gpu
@pytest.mark.parametrize("name", ["mlp", "cnn32"])
def test_one_image_calls_take_the_route_and_see_every_change(name, monkeypatch):
    monkeypatch.setenv("CYDNN_FUSED_GEN", "0")            # the interpreter: nothing compiles in the background
    make, shape = ZOO[name]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    calls = _counted(infer, monkeypatch)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1,) + shape).astype(np.float32)
    infer(x)                                              # chooses the cluster
    second = infer(x)                                     # settles the route
    assert calls["general"] == 2 and infer._one is not None
    cluster = infer._one[3].cluster
    assert infer.info()["one_image_route"] == {"cluster": cluster, "generated": False}
    assert infer.explain(1).startswith(f"one numpy image takes a settled route: one C call into the fused network "
                                       f"(cluster {cluster}, the interpreter)")
    third = infer(x)
    assert calls["general"] == 2, "the settled route serves the call"
    assert third.shape == (1,) + infer.out_shape and third.dtype == np.float32
    np.testing.assert_array_equal(third, infer._fused.net.run_host(x, cluster))
    np.testing.assert_array_equal(third, second)
    np.testing.assert_allclose(third, _reference(model, x), rtol=1e-5, atol=2e-6)
    assert infer(x) is not infer(x)                       # a new array each call

    # weights updated in place (an optimizer step): the same arrays, the route stays and reads them
    model.train()
    opt, loss_fn = optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss()
    loss_fn(model(_C.to_device(np.repeat(x, 2, 0))), np.array([1, 2]))
    model.backward(loss_fn.backward(), input_grad=False)
    opt.step()
    model.eval()
    updated = infer(x)           # (the general path once where training made new attributes: a new version)
    assert np.abs(updated - third).max() > 1e-4
    np.testing.assert_allclose(updated, _reference(model, x), rtol=1e-5, atol=2e-6)
    general = calls["general"]
    np.testing.assert_array_equal(infer(x), updated)
    assert calls["general"] == general

    # a parameter replaced: the general path re-plans, then the route is settled again
    last = [m for m in model if isinstance(m, nn.Linear)][-1]
    last.weight = nn.Parameter(np.full(last.weight.shape, 0.01, np.float32))
    model.to("cuda")
    np.testing.assert_allclose(infer(x), _reference(model, x), rtol=1e-5, atol=2e-6)
    assert calls["general"] == general + 1
    infer(x)
    np.testing.assert_allclose(infer(x), _reference(model, x), rtol=1e-5, atol=2e-6)
    assert calls["general"] == general + 2

    # load_state_dict with other weights
    other = make(rng=7).to("cuda").eval()
    model.load_state_dict(other.state_dict())
    np.testing.assert_allclose(infer(x), _reference(other, x), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(infer(x), _reference(other, x), rtol=1e-5, atol=2e-6)

    # what the route does not take goes the general way: the same values, or the same refusal
    base = infer(x)
    n = calls["general"]
    with pytest.raises(ValueError, match=r"x must be float32 \(N, .*\), got float64"):
        infer(x.astype(np.float64))                       # refused by the general path, as before the route
    strided = np.repeat(x, 2, axis=-1)[..., ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(infer(strided), base)
    two = np.concatenate([x, x])
    np.testing.assert_allclose(infer(two), np.concatenate([base, base]), rtol=1e-5, atol=2e-6)
    dev = infer(_C.to_device(x))
    assert isinstance(dev, _C.DeviceArray)
    np.testing.assert_allclose(dev.numpy(), base, rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="compiled inference: x must be float32"):
        infer(np.zeros((1, 5), np.float32))
    assert calls["general"] == n + 5

    # the model moved to the CPU: refused, as before the route
    model.to("cpu")
    with pytest.raises(RuntimeError, match="the model is on 'cpu'"):
        infer(x)
    model.to("cuda")
    np.testing.assert_allclose(infer(x), _reference(model, x), rtol=1e-5, atol=2e-6)


@gpu
def test_the_route_of_a_model_that_is_gone_refuses_like_the_general_path(monkeypatch):
    monkeypatch.setenv("CYDNN_FUSED_GEN", "0")
    make, shape = ZOO["mlp"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force", weak_model=True)
    x = np.ones((1,) + shape, np.float32)
    infer(x), infer(x)
    assert infer._one is not None
    del model
    gc.collect()
    with pytest.raises(ReferenceError, match="its model no longer exists"):
        infer(x)


@gpu
@pytest.mark.skipif(fused_net_gen.enabled() is False, reason="CYDNN_FUSED_GEN=0 in this environment")
def test_the_route_runs_the_generated_kernel_once_it_is_adopted(monkeypatch):
    try:
        fused_net_gen._nvrtc()
        fused_net_gen.headers()
    except fused_net_gen.GenerationError as e:
        pytest.skip(f"no NVRTC here: {e}")
    monkeypatch.setenv("CYDNN_KERNEL_CACHE", "off")
    make, shape = ZOO["cnn32"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    x = np.random.default_rng(8).standard_normal((1,) + shape).astype(np.float32)
    infer(x), infer(x)
    infer.wait_generated()
    want = infer(x)                                       # the general path: adopts, settles the route again
    route = infer._one
    assert route is not None
    net = infer._fused.net
    kernel = net.generated.get(route[3].cluster)
    assert kernel is not None and route[3].kernel is kernel, net.generated.info
    np.testing.assert_array_equal(infer(x), want)
    np.testing.assert_array_equal(infer(x), net.run_host(x, route[3].cluster))
    np.testing.assert_allclose(want, _reference(model, x), rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------------- CPU: when the route holds (stand-ins)
class _Call:
    """Stands in for _C.MappedCall: records its calls, answers x + 1 for one float32 image, None otherwise."""
    def __init__(self, cluster, kernel=None):
        self.cluster, self.kernel, self.calls = cluster, kernel, 0

    def __call__(self, x):
        if type(x) is not np.ndarray or x.dtype != np.float32 or x.shape[0] != 1:
            return None
        self.calls += 1
        return x + 1


class _Generated:
    def __init__(self):
        self.changes, self.busy = 0, False

    def compiling(self, cluster):
        return self.busy


class _Net:
    def __init__(self):
        self.generated, self.made, self.hosted = _Generated(), [], 0

    def mapped_call(self, cluster):
        self.made.append(_Call(cluster))
        return self.made[-1]

    def run_host(self, x, cluster):
        self.hosted += 1
        return x + 1


class _Fused:
    def __init__(self):
        self.net, self.hoped, self.clusters = _Net(), {}, {1: 16, 2: 16}

    def cluster(self, bucket):
        return self.clusters.get(bucket, "?")


def _stand_in(monkeypatch):
    """A CompiledInference of the test zoo's MLP whose fused network and GPU calls are stand-ins (no GPU): what
    its __call__ and _settle_one decide is real."""
    import weakref
    from cydnn.compiler import binding, inference
    make, shape = ZOO["mlp"]
    model = make()
    infer = inference.CompiledInference(model, shape)
    monkeypatch.setattr(type(model), "device", property(lambda self: "cuda"))
    infer._sig, infer._fused = binding.signature(model), _Fused()
    infer.reason, infer.preprocess = "", None
    monkeypatch.setattr(infer, "_fresh", lambda: infer.model)     # (raises ReferenceError once a weak model is gone)
    return model, infer, np.zeros((1,) + shape, np.float32), weakref


def test_the_route_holds_only_while_nothing_changed(monkeypatch):
    model, infer, x, _ = _stand_in(monkeypatch)
    net = infer._fused.net
    infer(x)
    assert net.hosted == 1 and len(net.made) == 1 and infer._one is not None       # settled by the general path
    infer(x)
    infer(x)
    assert net.hosted == 1 and net.made[0].calls == 2                               # the route served
    model[1].weight = nn.Parameter(np.zeros((128, 784), np.float32))               # a new structure version
    infer(x)
    assert net.hosted == 2 and net.made[0].calls == 2 and len(net.made) == 1        # general, same call kept
    infer(x)
    assert net.made[0].calls == 3
    net.generated.changes += 1                                                      # e.g. a form adopted
    infer(x)
    assert net.hosted == 3 and len(net.made) == 2                                   # general, a new call made
    infer(x)
    assert net.made[1].calls == 1
    infer(np.concatenate([x, x]))                                                   # not one image: general
    assert net.hosted == 4 and net.made[1].calls == 1
    infer._fused.clusters[1] = 8                                                    # another cluster chosen
    model[1].bias = nn.Parameter(np.zeros(128, np.float32))
    infer(x)
    assert net.made[-1].cluster == 8 and len(net.made) == 3


def test_no_route_while_a_kernel_compiles_or_a_bucket_hopes(monkeypatch):
    _, infer, x, _ = _stand_in(monkeypatch)
    net = infer._fused.net
    net.generated.busy = True
    infer(x)
    infer(x)
    assert net.hosted == 2 and infer._one is None and not net.made
    net.generated.busy = False
    infer._fused.hoped[1] = (16, None, None)
    infer(x)
    assert net.hosted == 3 and infer._one is None
    del infer._fused.hoped[1]
    infer(x)
    infer(x)
    assert net.hosted == 4 and net.made[0].calls == 1


def test_the_route_of_a_weakly_held_model_that_is_gone_is_not_taken(monkeypatch):
    model, infer, x, weakref = _stand_in(monkeypatch)
    infer._model = weakref.ref(model)
    infer(x)
    infer(x)
    assert infer._fused.net.made[0].calls == 1
    del model
    gc.collect()
    with pytest.raises(ReferenceError, match="its model no longer exists"):
        infer(x)
    assert infer._fused.net.made[0].calls == 1
