"""The resident fused network (cpp/fused_net_resident.cu, FusedNetwork.run_host for one image): a kernel
that stays on the GPU between one-image numpy calls.

CPU: the idle-time variable.  GPU: the resident kernel gives the launched kernel's bits on many images
in a row (no stale input), sees weights changed between calls (no stale weights), keeps the library
stream's order when work is queued there, returns after its idle time and starts again, takes turns
with another network's, stops on demand, serves several threads, and refuses bad arguments.
"""
import re
import threading
import time

import numpy as np
import pytest

import cydnn
from cydnn import _C
from cydnn.compiler import fused_net
from cydnn.compiler.trace import trace

from test_compiler import ZOO

gpu = pytest.mark.gpu


# ---------------------------------------------------------------------- CPU: the setting
@pytest.mark.parametrize("text, want", [(None, 0), ("", 0), (" 0 ", 0), ("250", 250), ("10000000", 10_000_000)])
def test_the_idle_time_comes_from_the_environment_and_is_off_by_default(text, want):
    env = {} if text is None else {"CYDNN_RESIDENT_IDLE_US": text}
    assert fused_net.RESIDENT_IDLE_US == 0
    assert fused_net.resident_idle_us(None, env) == want
    assert fused_net.resident_idle_us(7, {"CYDNN_RESIDENT_IDLE_US": "250"}) == 7     # compile's value wins


@pytest.mark.parametrize("text", ["-1", "1.5", "2ms", "10000001"])
def test_a_bad_idle_time_in_the_environment_is_refused_with_the_value(text):
    with pytest.raises(ValueError, match=r"CYDNN_RESIDENT_IDLE_US must be an integer .* got '%s'" % text):
        fused_net.resident_idle_us(None, {"CYDNN_RESIDENT_IDLE_US": text})


@pytest.mark.parametrize("value", [-1, 1.0, True, "100", 10_000_001])
def test_a_bad_resident_us_is_refused_by_compile_before_any_gpu_work(value):
    model = ZOO["mlp"][0]()                         # on the CPU: nothing reaches a device
    with pytest.raises(ValueError, match=r"compile: resident_us must be an integer .* got %s" % re.escape(repr(value))):
        cydnn.compile(model, input_shape=(1, 28, 28), resident_us=value)
    with pytest.raises(ValueError, match="fused_net and resident_us are for inference"):
        cydnn.compile(model, cydnn.optim.SGD(model.parameters(), lr=0.1), batch_size=8, resident_us=100)
    assert cydnn.compile(model, input_shape=(1, 28, 28), resident_us=0).resident_us == 0


# ---------------------------------------------------------------------- GPU
def _net(name, monkeypatch, idle_us=300_000, capacity=4):
    """A fused network whose resident kernel waits idle_us (0.3 s: long enough to stay alive through a
    test's calls, short enough for what waits on the whole device -- cuDNN's first search for a shape,
    say -- to wait little).  References are computed before the first resident call where possible."""
    monkeypatch.delenv("CYDNN_RESIDENT_IDLE_US", raising=False)
    make, shape = ZOO[name]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, capacity,
                                 resident_us=idle_us)
    return model, shape, net


def _launched(net, x, cluster):
    """The same image through one ordinary launch (staging buffers): the bits to match."""
    out = np.empty((x.shape[0],) + net.out_shape, np.float32)
    net.tables[cluster].run_host(x, out, net._dx, net._dy, cluster)
    return out


@gpu
@pytest.mark.parametrize("name", ["cnn32", "mlp", "cnn_bn", "lenet_widths"])
@pytest.mark.parametrize("cluster", [8, 16])
def test_one_image_calls_give_the_launched_kernels_bits_image_after_image(name, cluster, monkeypatch):
    model, shape, net = _net(name, monkeypatch)
    xs = np.random.default_rng(7).standard_normal((40, 1) + shape).astype(np.float32)
    want = model(_C.to_device(xs[-1])).numpy()
    for x in xs:                                    # a new image each call: an old one must never be read
        got = net.run_host(x, cluster)
        np.testing.assert_array_equal(got, _launched(net, x, cluster))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert net.served == {"resident": 40, "launched": 0}  # each staged launch above waits for its copy back
    assert net._residents[cluster].running
    net.stop_resident()
    assert not net._residents[cluster].running


@gpu
def test_weights_changed_between_calls_are_read_again(monkeypatch):
    """The kernel stays alive across an optimizer step on the library's stream: it must read the new
    weights (through L2), not lines a read-only cache kept from the call before."""
    model, shape, net = _net("lenet_widths", monkeypatch)
    x = np.random.default_rng(8).standard_normal((1,) + shape).astype(np.float32)
    grads = [_C.to_device(np.full(p.data.shape, 0.01, np.float32)) for p in model.parameters()]
    scratch = _C.to_device(np.zeros(4, np.float32))        # the update's kernel loaded before the resident one runs:
    _C.sgd_update(scratch, scratch, None, 1.0, 0.0, 0.0, 0.0, False, True)   # a first launch may wait for the device
    _C.synchronize()                   # (an allocation may wait for the whole device: the kernel's idle time)
    before = net.run_host(x, 16)
    resident = net._residents[16]
    for p, grad in zip(model.parameters(), grads):
        _C.sgd_update(p.data, grad, None, 1.0, 0.0, 0.0, 0.0, False, True)
    _C.synchronize()                               # the stream is idle again: the resident kernel serves
    assert resident.running
    after = net.run_host(x, 16)
    assert net.served["launched"] == 0 and net.served["resident"] == 2
    assert np.abs(after - before).max() > 1e-3
    np.testing.assert_array_equal(after, _launched(net, x, 16))
    np.testing.assert_allclose(after, model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)


@gpu
def test_a_call_with_work_queued_on_the_stream_runs_after_it(monkeypatch):
    model, shape, net = _net("mlp", monkeypatch)
    x = np.random.default_rng(9).standard_normal((1,) + shape).astype(np.float32)
    net.run_host(x, 16)
    a = _C.to_device(np.ones((4096, 4096), np.float32))
    c = _C.empty((4096, 4096))
    for _ in range(10):                             # ~30 ms of matrix products queued
        _C.linear_forward(a, a, None, c)
    w = model[-1].weight.data                      # then a change of the last layer's weights, queued
    _C.sgd_update(w, _C.to_device(np.full(w.shape, -0.05, np.float32)), None, 1.0, 0.0, 0.0, 0.0, False, True)
    got = net.run_host(x, 16)
    assert net.served["launched"] == 1, net.served
    np.testing.assert_array_equal(got, _launched(net, x, 16))
    np.testing.assert_allclose(got, model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)


@gpu
def test_the_kernel_returns_when_idle_and_starts_again(monkeypatch):
    model, shape, net = _net("cnn32", monkeypatch, idle_us=300)
    xs = np.random.default_rng(10).standard_normal((3, 1) + shape).astype(np.float32)
    net.run_host(xs[0], 8)
    resident = net._residents[8]
    deadline = time.monotonic() + 5
    while resident.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not resident.running                     # it gave its SMs back after ~300 us
    for x in xs[1:]:
        np.testing.assert_array_equal(net.run_host(x, 8), _launched(net, x, 8))
    assert net.served == {"resident": 3, "launched": 0}


@gpu
def test_two_networks_take_turns_with_one_resident_kernel(monkeypatch):
    _, shape_a, a = _net("mlp", monkeypatch)
    _, shape_b, b = _net("cnn32", monkeypatch)
    rng = np.random.default_rng(11)
    for _ in range(5):
        xa = rng.standard_normal((1,) + shape_a).astype(np.float32)
        xb = rng.standard_normal((1,) + shape_b).astype(np.float32)
        np.testing.assert_array_equal(a.run_host(xa, 16), _launched(a, xa, 16))
        assert not b._residents.get(16) or not b._residents[16].running
        np.testing.assert_array_equal(b.run_host(xb, 16), _launched(b, xb, 16))
        assert not a._residents[16].running        # b stopped a's before starting its own
    assert a.served["resident"] == b.served["resident"] == 5


@gpu
def test_threads_share_a_resident_kernel(monkeypatch):
    _, shape, net = _net("mlp", monkeypatch)
    xs = np.random.default_rng(12).standard_normal((8, 1) + shape).astype(np.float32)
    want = [_launched(net, x, 8) for x in xs]
    errors = []

    def worker(k):
        try:
            for i in range(30):
                j = (k + i) % len(xs)
                np.testing.assert_array_equal(net.run_host(xs[j], 8), want[j])
        except Exception as e:                      # reported below: an assert in a thread fails nothing
            errors.append(repr(e))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert net.served == {"resident": 120, "launched": 0}


@gpu
def test_small_clusters_are_launched_through_mapped_memory(monkeypatch):
    _, shape, net = _net("mlp", monkeypatch)
    x = np.random.default_rng(15).standard_normal((1,) + shape).astype(np.float32)
    for cluster in fused_net.CLUSTERS:
        np.testing.assert_array_equal(net.run_host(x, cluster), _launched(net, x, cluster))
    small = sum(c < fused_net.RESIDENT_MIN_CLUSTER for c in fused_net.CLUSTERS)
    assert net.served == {"resident": len(fused_net.CLUSTERS) - small, "launched": 0}
    assert sorted(net._residents) == [c for c in fused_net.CLUSTERS if c >= fused_net.RESIDENT_MIN_CLUSTER]


@gpu
def test_switched_off_one_image_goes_through_mapped_memory(monkeypatch):
    _, shape, net = _net("mlp", monkeypatch, idle_us=0)
    assert net.resident_reason == "off (resident_us=0)"
    x = np.random.default_rng(13).standard_normal((1,) + shape).astype(np.float32)
    np.testing.assert_array_equal(net.run_host(x, 2), _launched(net, x, 2))
    assert net._mapped and not net._residents and net.served == {"resident": 0, "launched": 0}


@gpu
def test_a_compiled_inference_reports_its_resident_kernel(monkeypatch):
    monkeypatch.setenv("CYDNN_RESIDENT_IDLE_US", "5000")
    make, shape = ZOO["mlp"]
    model = make().to("cuda").eval()
    off = cydnn.compile(model, input_shape=shape, fused_net="force", resident_us=0)
    x = np.random.default_rng(14).standard_normal((1,) + shape).astype(np.float32)
    off(x)
    assert off.info()["fused_net"]["resident"] == {"reason": "off (resident_us=0)", "idle_us": 0,
                                                   "served": {"resident": 0, "launched": 0}}
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")       # from the environment
    for _ in range(3):
        np.testing.assert_allclose(infer(x), model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)
    info = infer.info()["fused_net"]["resident"]
    assert info["reason"] is None and info["idle_us"] == 5000 and info["served"]["resident"] >= 2, info


@gpu
def test_bad_arguments_are_refused_before_any_gpu_work(monkeypatch):
    _, shape, net = _net("mlp", monkeypatch)
    with pytest.raises(_C.CydnnError, match="cluster must be 1, 2, 4, 8 or 16, got 3"):
        _C.ResidentNet(net.tables[1], 3, 1000)
    with pytest.raises(_C.CydnnError, match=r"idle_us must be in \[1, 10000000\], got 0"):
        _C.ResidentNet(net.tables[1], 1, 0)
    resident = _C.ResidentNet(net.tables[1], 1, 1000)
    x = np.zeros((1,) + shape, np.float32)
    out = np.empty((1,) + net.out_shape, np.float32)
    with pytest.raises(ValueError, match=r"one image \(784 and 10 values\), got float32 1568 and float32 10"):
        resident.run(np.zeros((2,) + shape, np.float32), out)
    with pytest.raises(ValueError, match="got float64 784"):
        resident.run(x.astype(np.float64), out)
    assert resident.run(x, out) is True
    del resident                                    # stops its kernel: no hang, nothing left running
    _C.synchronize()
