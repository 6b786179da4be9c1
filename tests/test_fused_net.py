"""The fused network (cpp/fused_net.cu, compiler/fused_net.py): a whole inference forward in one kernel.

CPU: how layers become the table (epilogues, where batch norm may ride, what is refused).  GPU: the
kernel against the per-op reference forward on every network of the test zoo and on layer
combinations the zoo lacks, at every cluster size, for one image, odd batches, buckets and chunks,
numpy and DeviceArray inputs; weights changed in place or replaced; the self-test's fallback.
"""
import numpy as np
import pytest

import cydnn
from cydnn import _C, nn, optim
from cydnn.compiler import fused_choice, fused_net
from cydnn.compiler.trace import trace

from test_compiler import ZOO

gpu = pytest.mark.gpu


def _ops(layers):
    return [(d["op"], len(d["epi"])) for d in layers]


# ---------------------------------------------------------------------- CPU: the table
def test_activations_and_batch_norm_ride_on_the_layer_before():
    model = ZOO["cnn_bn"][0]()
    layers = fused_net.describe(trace(model, (3, 16, 16), 1))
    # conv+bn+relu, pool, conv+bn+leaky, gap, linear+bn+relu, linear
    assert _ops(layers) == [("conv", 2), ("max_pool", 0), ("conv", 2), ("global_avg_pool", 0),
                            ("linear", 2), ("linear", 0)]
    assert layers[0]["epi"] == [_C.NET_EPI_BN, _C.NET_EPI_ACT] and layers[0]["act"] == _C.ACT_RELU
    assert layers[2]["act"] == _C.ACT_LEAKY and layers[2]["slope"] == pytest.approx(0.1)
    assert layers[0]["bn"].name == "1" and layers[4]["bn"].name == "10"


def test_batch_norm_over_other_channels_gets_a_layer_of_its_own():
    # after Flatten the 1d batch norm's channels are the 2*3*3 features, not the conv's 2 channels
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.BatchNorm1d(18), nn.Tanh(), nn.Linear(18, 4))
    layers = fused_net.describe(trace(model, (1, 5, 5), 1))
    assert _ops(layers) == [("conv", 0), ("epilogue", 2), ("linear", 0)]
    assert (layers[1]["c"], layers[1]["h"], layers[1]["w"]) == (18, 1, 1)
    # a 1x1 plane flattened keeps its channels: the batch norm rides on the pooling
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(2))
    assert _ops(fused_net.describe(trace(model, (1, 5, 5), 1))) == [("conv", 0), ("global_avg_pool", 1)]


def test_a_leading_activation_and_a_second_one_get_epilogue_layers():
    model = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Tanh(), nn.Dropout(0.5))
    layers = fused_net.describe(trace(model, (1, 2, 2), 1))
    assert _ops(layers) == [("epilogue", 1), ("linear", 1), ("epilogue", 1)]
    assert (layers[0]["c"], layers[0]["h"], layers[0]["w"]) == (1, 2, 2)
    assert layers[2]["act"] == _C.ACT_TANH


def test_what_does_not_fit_is_refused_with_the_reason():
    big = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU())          # 64*64*64 floats, twice
    reason = fused_net.describe(trace(big, (3, 64, 64), 1))
    assert isinstance(reason, str) and "262144 values" in reason and "shared memory" in reason
    assert fused_net.describe(trace(nn.Sequential(nn.Flatten(), nn.Dropout(0.1)), (1, 2, 2), 1)).startswith(
        "nothing to compute")
    many = nn.Sequential(*[nn.Linear(4, 4) for _ in range(_C.NET_MAX_LAYERS + 1)])
    assert "33 layers" in fused_net.describe(trace(many, (4,), 1))


def test_the_tile_is_the_one_with_the_fewest_instructions_on_the_busiest_thread():
    # 48 -> 96 channels on 8x8 (3x3): one block: 4x4 tiles are 384 items, one round of 432 taps x 45
    layer = dict(c=48, h=8, w=8, k=96, oh=8, ow=8, kh=3, kw=3)
    assert fused_net._tile(layer, 1) == 3
    # 8 blocks: 4x1 items shared by 4 lanes (6,144 threads, 2 rounds of 108 taps with 4-way conflicts on a
    # 64-value plane: 2 x (108 x 33 + 16)) beat 4x1 alone (one round of 432 taps x 18)
    assert fused_net._tile(layer, 8) == 4
    # 128 -> 128 on 7x7 (no bank conflicts: 49 is odd): 16 lanes a work item at 8 blocks
    deep = dict(c=128, h=7, w=7, k=128, oh=7, ow=7, kh=3, kw=3)
    assert fused_net._tile(deep, 8) == 6 and fused_net._tile(deep, 1) == 3     # one block: 4x4, one round
    first = dict(c=3, h=32, w=32, k=24, oh=32, ow=32, kh=3, kw=3)          # few input channels: no split
    assert fused_net._tile(first, 1) == 3 and fused_net._tile(first, 8) == 2


def test_compiled_inference_of_a_model_on_the_cpu_says_so_instead_of_binding_host_arrays():
    model = ZOO["mlp"][0]()
    infer = cydnn.compile(model, input_shape=(1, 28, 28))
    assert infer.info()["mode"] == "reference" and "cpu" in infer.info()["reason"]
    with pytest.raises(RuntimeError, match=r"the model is on 'cpu'; compiled inference runs on the GPU"):
        infer(np.zeros((1, 1, 28, 28), np.float32))


# ---------------------------------------------------------------------- GPU: against the reference
def _extra():
    """Layer combinations the zoo lacks: strides and padding of every kind, average pooling with padding,
    batch norm on its own layer, a leading activation, sigmoid/tanh, no bias."""
    r = np.random.default_rng(3)
    odd = nn.Sequential(nn.Tanh(), nn.Conv2d(2, 5, (3, 2), stride=(2, 1), padding=(1, 0), rng=1), nn.Sigmoid(),
                        nn.AvgPool2d(3, stride=2, padding=1), nn.Conv2d(5, 7, 1, bias=False, rng=2),
                        nn.MaxPool2d(2, stride=1, padding=1), nn.Flatten(), nn.BatchNorm1d(7 * 4 * 6),
                        nn.Linear(7 * 4 * 6, 9, rng=3))
    bn = odd[7]
    bn.running_mean = r.normal(0, 0.3, bn.num_features).astype(np.float32)
    bn.running_var = r.uniform(0.5, 2.0, bn.num_features).astype(np.float32)
    return {"odd": (lambda: odd, (2, 11, 10)),
            "wide": (lambda: nn.Sequential(nn.Conv2d(1, 40, 5, rng=4), nn.ReLU(), nn.MaxPool2d(2),
                                           nn.Conv2d(40, 33, 3, rng=5), nn.LeakyReLU(0.2), nn.Flatten(),
                                           nn.Linear(33 * 10 * 10, 10, rng=6)), (1, 28, 28))}


CASES = dict(ZOO, **_extra())


def _reference(model, x):
    return model(_C.to_device(x)).numpy()


@gpu
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("softmax", [False, True])
def test_fused_network_gives_the_reference_outputs(name, softmax):
    make, shape = CASES[name]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, softmax=softmax, fused_net="force")
    rng = np.random.default_rng(1)
    for n in (1, 3, 64, 1030):                     # a bucket, inside one, the biggest, chunks
        x = rng.standard_normal((n,) + shape).astype(np.float32)
        want = _reference(model, x)
        if softmax:
            want = np.exp(want - want.max(1, keepdims=True))
            want /= want.sum(1, keepdims=True)
        scale = max(1.0, float(np.abs(want).max()))
        got = infer(x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale, err_msg=f"{name} n={n}")
        got_dev = infer(_C.to_device(x))
        assert isinstance(got_dev, _C.DeviceArray)
        np.testing.assert_allclose(got_dev.numpy(), got, rtol=0, atol=0)
    info = infer.info()["fused_net"]
    assert info["reason"] is None, info
    assert all(c in fused_net.CLUSTERS for c in info["clusters"].values()), info


@gpu
@pytest.mark.parametrize("name", ["cnn32", "odd", "cnn_bn", "mlp"])
@pytest.mark.parametrize("cluster", fused_net.CLUSTERS)
def test_every_cluster_size_gives_the_reference_outputs(cluster, name):
    """Also the sanitizers' case (tools/sanitize.sh): every layer kind at every cluster size, 5 images."""
    make, shape = CASES[name]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 16)
    x = np.random.default_rng(2).standard_normal((5,) + shape).astype(np.float32)
    np.testing.assert_allclose(net.run_host(x, cluster), _reference(model, x), rtol=1e-5, atol=2e-6)


@gpu
@pytest.mark.parametrize("name", ["cnn32", "odd", "mlp"])
def test_mapped_and_staged_numpy_calls_give_the_same_bits(name):
    """run_host takes up to MAPPED_ROWS images through mapped pinned memory (the kernel reads and writes
    host memory), more through the staging buffers and two copies: the same kernel, the same bits; and the
    numpy fast path of a compiled inference (one chunk, the fused network chosen) gives them too."""
    make, shape = CASES[name]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 256)
    x = np.random.default_rng(5).standard_normal((fused_net.MAPPED_ROWS + 1,) + shape).astype(np.float32)
    want = _reference(model, x)
    for cluster in (1, 16):
        for n in (1, 7, fused_net.MAPPED_ROWS):
            mapped = net.run_host(x[:n], cluster)       # the resident kernel is off by default
            assert net._mapped and net.mapped_reason is None and net.served["resident"] == 0
            staged = np.empty_like(mapped)
            net.tables[cluster].run_host(x[:n], staged, net._dx, net._dy, cluster)
            np.testing.assert_array_equal(mapped, staged)
            np.testing.assert_allclose(mapped, want[:n], rtol=1e-5, atol=2e-6)
        bigger = net.run_host(x, cluster)             # one more than the mapped buffers hold: staged
        np.testing.assert_array_equal(bigger[:fused_net.MAPPED_ROWS], net.run_host(x[:fused_net.MAPPED_ROWS], cluster))
    xin, yout = net._mapped
    with pytest.raises(ValueError, match=r"mapped buffers of \d+ and \d+ bytes cannot hold 65 images"):
        net.tables[1].run_mapped(x, np.empty((65,) + want.shape[1:], np.float32), xin, yout, 1)
    with pytest.raises(ValueError, match="must be C-contiguous float32 of n images"):
        net.tables[1].run_mapped(x[:2].astype(np.float64), np.empty((2,) + want.shape[1:], np.float32), xin, yout, 1)
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    for n in (1, 3):
        first = infer(x[:n])                          # chooses the cluster for the bucket
        np.testing.assert_array_equal(infer(x[:n]), first)
        np.testing.assert_allclose(first, want[:n], rtol=1e-5, atol=2e-6)


@gpu
def test_weights_updated_in_place_or_replaced_are_seen():
    make, shape = CASES["lenet_widths"]
    model = make().to("cuda")
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    x = np.random.default_rng(4).standard_normal((2,) + shape).astype(np.float32)
    before = infer(x)
    model.train()
    opt = optim.SGD(model.parameters(), lr=0.5)
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(_C.to_device(x)), np.array([1, 2]))
    model.backward(loss_fn.backward(), input_grad=False)
    opt.step()                                     # in place: the same device arrays
    model.eval()
    after = infer(x)
    assert np.abs(after - before).max() > 1e-3
    np.testing.assert_allclose(after, _reference(model, x), rtol=1e-5, atol=2e-6)
    model[9].weight = nn.Parameter(np.zeros((10, 512), np.float32))       # a new array: re-planned
    model.to("cuda")
    np.testing.assert_allclose(infer(x), _reference(model, x), rtol=1e-5, atol=2e-6)
    assert np.abs(infer(x) - model[9].bias.data.numpy()).max() < 1e-6


@gpu
def test_a_failed_self_test_falls_back_to_the_plan_with_the_reason(monkeypatch, caplog):
    make, shape = CASES["mlp"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    real = fused_net.FusedNetwork.forward

    def wrong(self, x, y, n, cluster):             # a kernel that gets every output wrong by 1
        real(self, x, y, n, cluster)
        _C.copy_into(y, _C.to_device(y.numpy() + 1))
    monkeypatch.setattr(fused_net.FusedNetwork, "forward", wrong)
    x = np.random.default_rng(5).standard_normal((3,) + shape).astype(np.float32)
    with caplog.at_level("WARNING", logger="cydnn.compiler"):
        got = infer(x)
    np.testing.assert_allclose(got, _reference(model, x), rtol=1e-5, atol=2e-6)
    reason = infer.info()["fused_net"]["reason"]
    assert reason.startswith("self-test failed") and "differs from the plan by 1" in reason
    assert any("self-test failed" in r.getMessage() for r in caplog.records)


@gpu
def test_auto_mode_records_what_it_timed_and_off_mode_never_runs_it():
    make, shape = CASES["mlp"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape)
    infer(np.zeros((1,) + shape, np.float32))
    info = infer.info()["fused_net"]
    assert set(info["timed_us"][1]) == {"plan"} | {f"fused/{r}" for r in fused_net.CLUSTERS}
    off = cydnn.compile(model, input_shape=shape, fused_net="off")
    off(np.zeros((1,) + shape, np.float32))
    assert off.info()["fused_net"]["clusters"] == {1: None}
    assert "switched off" in off.info()["fused_net"]["reason"]


@gpu
@pytest.mark.parametrize("mode", ["off", "auto"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("tail", [37, 600])
def test_many_chunks_through_the_copy_pipe_give_the_reference_outputs(mode, contiguous, tail):
    """Four full chunks and a partial one: the full ones after the first go through cpp/pipe.cu (uploads and
    downloads overlapping the graph of the chunk before); a partial one of more than 256 rows through the
    pipe and the full bucket's graph, a shorter one through its own bucket.  A second call pipes every chunk."""
    make, shape = CASES["cnn32"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net=mode)
    n = 4 * 1024 + tail
    x = np.random.default_rng(6).standard_normal((n,) + shape).astype(np.float32)
    if not contiguous:                              # every other image of a twice-as-long array
        x = np.repeat(x, 2, axis=0)[::2]
        assert not x.flags.c_contiguous
    got = infer(x)
    want = np.concatenate([_reference(model, np.ascontiguousarray(x[i:i + 1024])) for i in range(0, n, 1024)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * max(1.0, float(np.abs(want).max())))
    # the pipe serves the full chunks after the first, also where the fused network won their bucket in auto mode
    # (that choice timed one chunk's call: test_many_numpy_chunks_go_through_the_pipe_unless_the_fused_net_is_forced)
    assert infer._pipe is not None, infer.info()["fused_net"]
    again = infer(x[::-1].copy())                   # the same pinned buffers, other data
    np.testing.assert_allclose(again, got[::-1], rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("fused_mode,cluster,piped", [("auto", 4, True), ("auto", None, True), ("force", 4, False)])
def test_many_numpy_chunks_go_through_the_pipe_unless_the_fused_net_is_forced(fused_mode, cluster, piped):
    """CPU, the dispatch alone (stand-ins for the plans, the pipe and the fused network): from three chunks on, a
    numpy call runs its full chunks through the pipe (the plan's graph, copies overlapped) even where the fused
    network won the 1,024-image bucket -- that choice timed one chunk's call, and the CNN's 10,000 images ran at
    0.55x PyTorch's rate through the fused network's calls (session 28) --; only fused_net="force" keeps them there."""
    from cydnn.compiler.inference import CompiledInference

    class Fused:
        mode = fused_mode

        def cluster(self, bucket):
            return cluster

    class Ready:
        ready = True

    calls = []
    infer = object.__new__(CompiledInference)
    infer._fresh = lambda: None
    infer._lenet, infer.preprocess, infer.input_shape, infer.out_shape = None, None, (3, 4, 4), (10,)
    infer._fused, infer._runners = Fused(), {1024: Ready()}
    infer._chunks = lambda x, out, starts, device_in: calls.append(("chunks", list(starts)))
    infer._pipelined = lambda x, out, starts: calls.append(("pipe", list(starts)))
    infer._call(np.zeros((3 * 1024 + 5, 3, 4, 4), np.float32))
    assert calls == ([("pipe", [0, 1024, 2048, 3072])] if piped else [("chunks", [0, 1024, 2048, 3072])])
    calls.clear()
    infer._call(np.zeros((2 * 1024, 3, 4, 4), np.float32))        # two chunks: each on its bucket's backend
    assert calls == [("chunks", [0, 1024])]


@gpu
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_the_pipe_fills_a_slot_with_several_threads_byte_for_byte(threads):
    """cpp/pipe.cu splits a slot's fill over host threads (slices of >= 1 MiB): every byte must arrive, in
    place, whatever the split (sizes not a multiple of the slice nor of a cache line; a short copy)."""
    rng = np.random.default_rng(threads)
    pipe = _C.Pipe(9 * 2**20 + 12, 9 * 2**20 + 12, threads)
    assert pipe.threads == threads
    for k, nbytes in enumerate([9 * 2**20 + 12, 3 * 2**20 + 4, 4096]):
        src = rng.integers(0, 2**31, nbytes // 4, dtype=np.int32).view(np.float32)
        dev = _C.empty((src.size,))
        pipe.upload(k % 2, dev, src)
        pipe.download(k % 2, dev)
        back = np.empty_like(src)
        pipe.finish(k % 2, back)
        assert np.array_equal(back.view(np.int32), src.view(np.int32))
    with pytest.raises(Exception, match="threads must be 0"):
        _C.Pipe(16, 16, -1)


def test_a_numpy_call_chooses_by_the_numpy_paths_times(monkeypatch):
    """CPU, with stand-ins for the device: where the choosing call came with numpy rows, each fused candidate is
    timed through run_host and the plan through its upload, graph and download (the copies a numpy call pays);
    a call with device arrays times the device paths.  The fastest by those times is chosen."""
    calls = []

    class Rows:                                  # the plan's input (a DeviceArray stand-in)
        def __init__(self, n):
            self.shape = (n, 3)

        def __getitem__(self, s):
            return Rows(s.stop)

        def set_(self, a):
            calls.append(("upload", self.shape[0], a.shape[0]))

    class Out:
        def __init__(self, v):
            self.v = v

        def numpy(self):
            return self.v

    class Net:
        out_size = 2
        _dy = Out(np.zeros(8 * 2, np.float32))

        def forward(self, x, dy, bucket, r):
            calls.append(("forward", r))

        def run_host(self, host, r):
            calls.append(("run_host", r, host.shape[0]))

        def start(self, cluster):
            pass

    net = Net()
    net.generated = net
    launch = lambda: calls.append(("launch",))                                          # noqa: E731
    output = lambda: calls.append(("download",)) or Out(np.zeros((8, 2), np.float32))    # noqa: E731
    for host in (np.zeros((3, 3), np.float32), None):
        for cost in ({None: 3, 1: 5, 2: 4, 4: 2, 8: 6, 16: 7}, {None: 1, 1: 5, 2: 4, 4: 2, 8: 6, 16: 7}):
            timed = []

            def fake_time(fn, n):
                calls.clear()
                fn()
                timed.append(tuple(calls))
                return cost[None if calls[-1][0] in ("launch", "download") else calls[-1][1]] * 1e-6
            monkeypatch.setattr(fused_choice, "time_calls", fake_time)
            choice = object.__new__(fused_choice.FusedChoice)
            choice.mode, choice.reason, choice.net = "auto", None, net
            choice.clusters, choice.timed_us, choice.skipped, choice.hoped, choice.expected = {}, {}, {}, {}, None
            chosen = choice.choose(8, 3, Rows(8), launch, output, host=host)
            assert chosen == min(cost, key=cost.get)
            assert choice.timed_us[8] == {("plan" if k is None else f"fused/{k}"): float(v) for k, v in cost.items()}
            rounds = fused_choice.TIME_ROUNDS          # every candidate in turn, round after round
            if host is not None:
                assert timed == ([(("run_host", r, 3),) for r in fused_net.CLUSTERS] + [
                    (("upload", 3, 3), ("launch",), ("download",))]) * rounds
            else:
                assert timed == ([(("forward", r),) for r in fused_net.CLUSTERS] + [(("launch",),)]) * rounds
