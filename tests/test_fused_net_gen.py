"""Kernels generated for one network (compiler/fused_net_gen.py): the fused network's layer loop
written out with the shapes as constants, compiled by NVRTC, loaded and launched on the same table.

CPU (NVRTC needs no GPU): the source says what it runs and compiles to a cubin; the fast-compile levels;
the switch (the background compiles and the disk cache: test_nvrtc_jobs.py).  GPU: every test network at several cluster sizes gives the
interpreter's outputs and the reference forward's; a compiled inference adopts the kernel once its
background compile is done (checked and timed), sees weights changed in place, refuses a kernel made
for another cluster size.
"""
import numpy as np
import pytest

import cydnn
from cydnn import _C
from cydnn.compiler import fused_choice, fused_net, fused_net_gen, nvrtc_jobs
from cydnn.compiler.trace import trace

from test_compiler import ZOO
from test_fused_net import CASES

gpu = pytest.mark.gpu


def _have_nvrtc():
    try:
        fused_net_gen._nvrtc()
        fused_net_gen.headers()
        return None
    except fused_net_gen.GenerationError as e:
        return str(e)


NVRTC_MISSING = _have_nvrtc()
needs_nvrtc = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"no NVRTC here: {NVRTC_MISSING}")


def _layers(name):
    make, shape = CASES[name]
    model = make()
    nodes = trace(model, shape, 1)
    return model, shape, nodes, fused_net.describe(nodes)


# ---------------------------------------------------------------------- CPU: the source and NVRTC
def test_the_source_calls_each_layer_with_its_shapes_as_constants():
    _, shape, _, layers = _layers("lenet_widths")
    bound = [fused_net.FusedNetwork._bind(layer, 8) for layer in layers]
    text = fused_net_gen.source(bound, 8, 1234, 4704, 784, 10, True)
    assert "constexpr int RANKS = 8;" in text and "constexpr long WCAP = 1234;" in text
    assert "constexpr int BUF = 4704;" in text and f"{fused_net_gen.KERNEL_NAME}(" in text
    calls = [line.strip().split("(")[0] for line in text.splitlines()
             if line.strip().startswith(("conv_layer<", "conv_split<", "pool_layer(", "linear_layer("))]
    convs = [fused_net_gen._call(d, 8, 4704, 1234).split("(")[0] for d in bound if d["op"] == "conv"]
    assert calls == [convs[0], "pool_layer", convs[1], "pool_layer", "linear_layer", "linear_layer"]
    # 5x5 kernels: the unrolled instance (STAGED after it where every block stages its weights in WCAP)
    assert all(c.endswith((", 5>", ", 5, true>")) for c in convs), convs
    first = bound[0]
    assert (f"L.op = CYDNN_NET_CONV; L.tile = {first['tile']}; L.pool = 0; L.c = 1; L.h = 28; L.w = 28; L.k = {first['k']}; "
            f"L.oh = {first['oh']}; L.ow = {first['ow']}; L.kh = 5; L.kw = 5;") in text
    assert "write_output(cur, y + image * 10L, 10L, true, red);" in text
    assert "write_output(cur, y + image * 10L, 10L, false, red);" in fused_net_gen.source(
        bound, 8, 1234, 4704, 784, 10, False)


@needs_nvrtc
@pytest.mark.parametrize("name", ["mlp", "odd"])
def test_nvrtc_compiles_the_source_into_a_cubin(name):
    _, _, nodes, layers = _layers(name)
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    text = fused_net_gen.source(bound, 16, 0, 4096, int(np.prod(nodes[0].in_shape[1:])),
                                int(np.prod(nodes[-1].out_shape[1:])), False)
    cubin = fused_net_gen.compile_cubin(text)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000


@needs_nvrtc
@pytest.mark.parametrize("name", ["allconv", "odd"])
def test_each_convolution_calls_the_instance_the_dispatch_would_reach(name, monkeypatch):
    """The source names each convolution's template instance (tile and kernel size) instead of calling
    conv_dispatch (NVRTC then instantiates only those: 3.5-14 s -> 0.3-1 s): the PTX must be the
    dispatch's, instruction for instruction (virtual register numbers aside).  (Tile 7's instance gives
    PTX that differs in the order of a few index computations from the dispatch's, which reaches it
    through two more inlined calls: test_fused_net_tiles.py checks its generated kernel's outputs against
    the interpreter's instead.)"""
    import re
    from cydnn.compiler import fused_tiles
    # the dispatch reads staged or not at run time; the source's STAGED instances compile the staged reads alone
    # (test_staged_instances_compile_the_staged_reads_alone)
    monkeypatch.setattr(fused_tiles, "stages_all", lambda *a: False)
    _, _, nodes, layers = _layers(name)
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    direct = fused_net_gen.source(bound, 16, 1000, 4096, int(np.prod(nodes[0].in_shape[1:])),
                                  int(np.prod(nodes[-1].out_shape[1:])), False)
    dispatched = direct
    for d in bound:
        if d["op"] == "conv":
            assert fused_net_gen._call(d) in dispatched
            dispatched = dispatched.replace(fused_net_gen._call(d),
                                            "conv_dispatch(L, cur, next, cluster, rank, RANKS, wbuf, WCAP);", 1)
    assert dispatched != direct

    def code(text):
        lines = [line for line in fused_net_gen.compile_ptx(text).splitlines()
                 if line.strip() and not line.startswith("//") and not line.strip().startswith((".loc", ".file"))]
        return [re.sub(r"%(f|r|rd|p|fd|rs)\d+", r"%\1", line) for line in lines]
    assert code(direct) == code(dispatched)


def _device_stages_all(d, ranks, wcap):
    """cpp/fused_net_conv.cuh's stage_weights for every block of the cluster (tiles 0-6), or conv_wsplit's chunk
    of at least one input channel (tile 7: fit > 0), written out from the device code's arithmetic."""
    from cydnn.compiler import fused_tiles
    tile, kk = int(d.get("tile", 0)), d["kh"] * d["kw"]
    tco, tp = next((c, p) for code, c, p, _ in fused_tiles.TILES if code == tile)
    if tile == 7 and d.get("pool"):
        row = (d["oh"] // 2) * (d["ow"] // 2)
    else:
        row = d["oh"] * -(-d["ow"] // tp)
    items = -(-d["k"] // tco) * row
    per = -(-items // ranks)
    for rank in range(ranks):
        lo, hi = per * rank, min(per * rank + per, items)
        if hi <= lo:
            continue
        c_lo = lo // row * tco
        cs = -(-(min(((hi - 1) // row + 1) * tco, d["k"]) - c_lo) // 4) * 4
        if (tile == 7 and wcap // (cs * kk) <= 0) or (tile != 7 and cs * d["c"] * kk > wcap):
            return False
    return True


def test_stages_all_is_the_devices_staging_for_every_block():
    from cydnn.compiler import fused_tiles
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(400):
        c, k, oh, ks = int(rng.integers(1, 40)), int(rng.integers(1, 70)), int(rng.integers(2, 20)), int(rng.choice([1, 3, 5]))
        tile, pool = int(rng.choice([0, 1, 2, 3, 4, 5, 6, 7])), 0
        if tile == 7 and rng.random() < 0.5:
            pool = 2
        d = dict(op="conv", c=c, k=k, oh=oh, ow=oh + int(rng.integers(0, 3)), kh=ks, kw=ks, tile=tile, pool=pool)
        ranks = int(rng.choice([1, 2, 4, 8, 16]))
        full = fused_tiles.staged(d, ranks)
        for wcap in {0, 1, full // max(1, c), full // max(1, c) - 1, full - 1, full, full + 5, int(rng.integers(0, 4000))}:
            want = _device_stages_all(d, ranks, max(0, wcap))
            assert fused_tiles.stages_all(d, ranks, max(0, wcap)) == want, (d, ranks, wcap)
            seen.add(want)
    assert seen == {True, False}
    assert not fused_tiles.stages_all(dict(op="linear", c=4, k=4), 16, 10 ** 6)


def test_staged_instances_where_every_block_stages():
    """STAGED (the last template argument) where every block of the cluster stages the layer's weights in WCAP;
    without it where some block would read them through the read-only cache.  Tile 7 names SPLIT before it."""
    from cydnn.compiler import fused_tiles
    _, _, nodes, layers = _layers("lenet_widths")
    for fold in (False, True):
        bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
        if fold:
            bound = [dict(bound[0], tile=7, pool=2), dict(bound[2], tile=7, pool=2)] + bound[4:]
        convs = [d for d in bound if d["op"] == "conv"]
        for wcap in (0, max(fused_tiles.staged(d, 16) for d in convs)):
            text = fused_net_gen.source(bound, 16, wcap, 4704, 784, 10, True)
            calls = [line.strip() for line in text.splitlines() if line.strip().startswith("conv_")]
            assert len(calls) == len(convs)
            for call, d in zip(calls, convs):
                args = call.split("<")[1].split(">")[0].split(", ")
                stages = fused_tiles.stages_all(d, 16, wcap)
                assert stages == (wcap > 0)
                if d["tile"] == 7:
                    assert len(args) == (4 if stages else 2 + (fused_tiles.wsplit_ways(d, 16, 4704) >= 2))
                    assert stages == (args[3:] == ["true"])
                else:
                    assert stages == (args[-1] == "true")
    d = [dict(layer) for layer in bound if layer["op"] == "conv"][0]
    assert fused_net_gen._call(d) == fused_net_gen._call(d, 16, 4704)      # no WCAP given: not STAGED


@needs_nvrtc
def test_staged_instances_compile_the_staged_reads_alone():
    """A STAGED instance has no reads through the read-only cache in its convolution's loop: NVRTC no longer
    compiles the path no block takes (docs/performance: session 31), so the cubin is smaller."""
    from cydnn.compiler import fused_tiles
    _, _, nodes, layers = _layers("lenet_widths")
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    bound = [dict(bound[0], tile=7, pool=2), dict(bound[2], tile=7, pool=2)] + bound[4:]
    wcap = max(fused_tiles.staged(d, 16) for d in bound)
    staged = fused_net_gen.source(bound, 16, wcap, 4704, 784, 10, True)
    assert ", true, true>(" in staged
    import re
    unstaged = re.sub(r"(conv_wsplit<\d+, \d+, (true|false)), true>", r"\1>", staged)
    assert unstaged != staged
    assert len(fused_net_gen.compile_cubin(staged)) < len(fused_net_gen.compile_cubin(unstaged))


@pytest.mark.parametrize("text, want", [(None, fused_net_gen.FAST_COMPILE_DEFAULT), ("", fused_net_gen.FAST_COMPILE_DEFAULT),
                                        (" mid ", "mid"), ("off", "off"), ("max", "max")])
def test_the_fast_compile_level(text, want):
    assert fused_net_gen.fast_compile({} if text is None else {"CYDNN_NVRTC_FAST_COMPILE": text}) == want
    with pytest.raises(ValueError, match="CYDNN_NVRTC_FAST_COMPILE must be one of off, min, mid, max, got 'O1'"):
        fused_net_gen.fast_compile({"CYDNN_NVRTC_FAST_COMPILE": "O1"})


@pytest.mark.parametrize("text, want", [(None, True), ("1", True), (" 0 ", False), ("", True)])
def test_the_split_switch(text, want):
    assert fused_net_gen.split_layers({} if text is None else {"CYDNN_NVRTC_SPLIT": text}) == want
    with pytest.raises(ValueError, match="CYDNN_NVRTC_SPLIT must be 0 or 1, got 'yes'"):
        fused_net_gen.split_layers({"CYDNN_NVRTC_SPLIT": "yes"})


def test_the_units_register_cap_is_the_kernels_thread_count():
    """A relocatable unit is held to 65536 / THREADS registers (it does not see the kernel's launch bounds): THREADS
    must be the block size the kernel is launched with, kWsplitThreads, or a unit may take more registers than the
    kernel's 512 threads leave and the linked kernel fail to launch."""
    import re
    declared = re.search(r"constexpr int kWsplitThreads = (\d+);", fused_net_gen.headers()["fused_net_wsplit.cuh"])
    assert declared and int(declared.group(1)) == fused_net_gen.THREADS
    assert f"--maxrregcount={65536 // fused_net_gen.THREADS}" in fused_net_gen._options("sm_90", "off", rdc=True)


@needs_nvrtc
@pytest.mark.parametrize("name", ["allconv", "odd"])
def test_the_layers_form_runs_the_same_layers_on_the_same_buffers(name):
    """The layers form (one relocatable unit a layer, then the kernel: fused_net_gen.units) holds the whole form's
    layer bodies line for line; layer i reads buffer i % 2; the kernel calls the layers in order and reads the
    output from where the last one wrote; NVRTC compiles every unit as relocatable code.  (Linked by the driver and
    run against the interpreter, bit for bit: on the device, test_the_layers_form_gives_the_interpreters_bits.)"""
    import re
    _, _, nodes, layers = _layers(name)
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    args = (bound, 16, 1000, 4096, int(np.prod(nodes[0].in_shape[1:])), int(np.prod(nodes[-1].out_shape[1:])), True)
    whole, units = fused_net_gen.source(*args), fused_net_gen.units(*args)
    assert len(units) == len(bound) + 1

    def body(text):
        return [re.sub(r"net\.layers\[\d+\]\.|\bl\d+_", "", t.strip()) for t in text.splitlines()
                if t.strip().startswith(("L.", "cydnnNetLayer", "conv_", "linear_", "pool_", "gap_", "epilogue_"))]
    assert body(whole) == [line for u in units[:-1] for line in body(u)] and len(body(whole)) >= 4 * len(bound)
    kernel = units[-1]
    assert re.findall(r"    cydnn_net_layer_(\d+)\(", kernel) == [str(i) for i in range(len(bound))]
    for i, unit in enumerate(units[:-1]):
        assert f"float *cur = smem + {i % 2} * BUF, *next = smem + {(i + 1) % 2} * BUF" in unit
        assert f'extern "C" __device__ void cydnn_net_layer_{i}(' in unit and "__global__" not in unit
    assert f"write_output({'smem + BUF' if len(bound) % 2 else 'smem'}, " in kernel
    for unit in units:
        assert fused_net_gen.compile_cubin(unit, rdc=True)[:4] == b"\x7fELF"


@needs_nvrtc
def test_a_fast_compile_level_is_an_option_of_nvrtc_and_of_the_cache_key(monkeypatch, tmp_path):
    """(NVRTC is run in child processes here: an -Ofast-compile compile changes what later compiles in the same
    process give -- NVRTC 13, seen in session 26 -- and the background compiles each have a process.)"""
    base = ["--gpu-architecture=sm_90", "-std=c++17", "-default-device"]
    assert fused_net_gen._options("sm_90", "off") == base
    assert fused_net_gen._options("sm_90", "off", rdc=True) == base + ["-rdc=true", "--maxrregcount=128"]
    if fused_net_gen._nvrtc_mod.version(fused_net_gen._nvrtc()) >= (12, 8):
        assert fused_net_gen._options("sm_90", "mid") == base + ["-Ofc=mid"]
    monkeypatch.setattr(fused_net_gen._nvrtc_mod, "version", lambda lib: (12, 4))      # an NVRTC without it
    assert fused_net_gen._options("sm_90", "mid") == base
    monkeypatch.undo()
    _, _, nodes, layers = _layers("mlp")
    text = fused_net_gen.source([fused_net.FusedNetwork._bind(layer, 16) for layer in layers], 16, 0, 784, 784, 10,
                                True)
    monkeypatch.setenv("CYDNN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CYDNN_NVRTC_FAST_COMPILE", "max")
    fast = nvrtc_jobs.Generation(text)
    assert fast.wait(120) and fast.result()[:4] == b"\x7fELF"               # NVRTC takes it
    monkeypatch.setenv("CYDNN_NVRTC_FAST_COMPILE", "off")
    full = nvrtc_jobs.Generation(text)                                      # another key: not the cached one
    assert full.wait(120) and not full.cached and full.result() != fast.result()
    assert len(list(tmp_path.iterdir())) == 2
    monkeypatch.setenv("CYDNN_NVRTC_FAST_COMPILE", "fast")
    with pytest.raises(ValueError, match="CYDNN_NVRTC_FAST_COMPILE"):      # refused when the network is made
        fused_net.FusedNetwork(layers, (1, 28, 28), (10,), False, 4)


@pytest.mark.parametrize("text, want", [(None, True), ("1", True), (" 0 ", False), ("", True)])
def test_the_switch(text, want):
    assert fused_net_gen.enabled({} if text is None else {"CYDNN_FUSED_GEN": text}) is want
    with pytest.raises(ValueError, match="CYDNN_FUSED_GEN must be 0 or 1, got 'yes'"):
        fused_net_gen.enabled({"CYDNN_FUSED_GEN": "yes"})


# ---------------------------------------------------------------------- GPU
def _fused(name, capacity=8):
    """(model on the GPU, input shape, its fused network for ``capacity`` images) of CASES[name]."""
    make, shape = CASES[name]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    return model, shape, fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False,
                                                capacity)


def _both(net, dx, n, cluster, kernel):
    """The interpreter's and ``kernel``'s outputs for the first ``n`` images of ``dx`` (numpy)."""
    interp, gen = _C.empty((n * net.out_size,)), _C.empty((n * net.out_size,))
    net.tables[cluster].forward(dx, interp, n, cluster)
    other = _C.to_device(np.random.default_rng(99).standard_normal(dx.size).astype(np.float32))
    net.tables[cluster].forward(other, gen, n, cluster)     # what the kernel leaves unwritten holds other values
    net.tables[cluster].forward(dx, gen, n, cluster, kernel)
    return interp.numpy(), gen.numpy()


def _kernel(net, cluster):
    return _C.NetKernel(fused_net_gen.compile_cubin(net._source(cluster)), fused_net_gen.KERNEL_NAME, cluster)


@gpu
@needs_nvrtc
@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_kernels_give_the_interpreters_outputs(name):
    model, shape, net = _fused(name)
    x = np.random.default_rng(21).standard_normal((5,) + shape).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    dx = _C.to_device(x)
    for cluster in (1, 8, 16):
        kernel = _kernel(net, cluster)
        for n in (1, 5):
            interp, gen = _both(net, dx, n, cluster, kernel)
            np.testing.assert_allclose(gen, interp, rtol=1e-6, atol=1e-7, err_msg=f"{cluster} {n}")
            np.testing.assert_allclose(gen.reshape(want[:n].shape), want[:n], rtol=1e-5, atol=2e-6)
        out = np.empty((5,) + net.out_shape, np.float32)
        net.tables[cluster].run_host(x, out, net._dx, net._dy, cluster, kernel)       # numpy in, numpy out
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)


def _linked(net, cluster):
    units = [fused_net_gen.compile_cubin(u, rdc=True) for u in net._source(cluster, "layers")]
    return _C.NetKernel(fused_net_gen.link(units), fused_net_gen.KERNEL_NAME, cluster)


@gpu
@needs_nvrtc
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_layers_form_gives_the_interpreters_bits(name):
    """The layers form: each unit compiled as relocatable code, linked by the driver, loaded and run on the same
    table: the interpreter's outputs, bit for bit (the same layer code in the same order), at 1, 8 and 16 blocks."""
    _, shape, net = _fused(name)
    dx = _C.to_device(np.random.default_rng(24).standard_normal((5,) + shape).astype(np.float32))
    for cluster in (1, 8, 16):
        kernel = _linked(net, cluster)
        for n in (1, 5):
            interp, gen = _both(net, dx, n, cluster, kernel)
            np.testing.assert_array_equal(gen, interp, err_msg=f"{cluster} {n}")


@gpu
@needs_nvrtc
def test_a_trial_times_the_kernel_in_use_in_the_same_rounds(monkeypatch):
    """A second form's trial (nvrtc_jobs.GeneratedKernels._adopt) times it, the interpreter and the form in use
    over the same rounds, so that a slow moment falls on all three; each checked against the interpreter first."""
    _, _, net = _fused("lenet_widths")
    whole, layers = _kernel(net, 8), _linked(net, 8)
    timed = []
    real = fused_net.least_times
    monkeypatch.setattr(fused_net, "least_times", lambda c, *a, **k: timed.append(sorted(c)) or real(c, *a, **k))
    ok, trial = net._trial(8, whole, layers)
    assert timed == [["generated", "in_use", "interpreter"]] and trial["max_diff"] == 0.0
    assert all(trial["timed_us"][k] > 0 for k in ("generated", "in_use", "interpreter"))
    ok, alone = net._trial(8, whole)
    assert timed[-1] == ["generated", "interpreter"] and "in_use" not in alone["timed_us"]


@gpu
@needs_nvrtc
def test_a_kernel_serves_only_its_cluster_size():
    make, shape = ZOO["mlp"]
    model = make().to("cuda").eval()
    nodes = trace(model, shape, 1)
    net = fused_net.FusedNetwork(fused_net.describe(nodes), shape, nodes[-1].out_shape[1:], False, 4)
    kernel = _kernel(net, 16)
    with pytest.raises(_C.CydnnError, match="the generated kernel serves clusters of 16 blocks, asked for 8"):
        net.tables[8].forward(net._dx, net._dy, 1, 8, kernel)
    with pytest.raises(_C.CydnnError, match="cluster must be 1, 2, 4, 8 or 16, got 3"):
        _C.NetKernel(fused_net_gen.compile_cubin(net._source(16)), fused_net_gen.KERNEL_NAME, 3)
    with pytest.raises(_C.CydnnError, match="cudaLibraryGetKernel"):
        _C.NetKernel(fused_net_gen.compile_cubin(net._source(16)), "no_such_kernel", 16)


@gpu
@needs_nvrtc
@pytest.mark.parametrize("name", ["cnn32", "lenet_widths"])
def test_a_compiled_inference_adopts_the_generated_kernel_and_sees_new_weights(name, monkeypatch):
    monkeypatch.delenv("CYDNN_FUSED_GEN", raising=False)
    make, shape = ZOO[name]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    x = np.random.default_rng(22).standard_normal((1,) + shape).astype(np.float32)
    np.testing.assert_allclose(infer(x), model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)
    cluster = infer.info()["fused_net"]["clusters"][1]
    info = infer.wait_generated()[cluster]
    assert info["status"] in ("in use", "not used") and info["max_diff"] <= 1e-5, info
    assert info["timed_us"]["generated"] > 0 and info["compile_s"] > 0
    np.testing.assert_allclose(infer(x), model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)
    for p in model.parameters():                     # in place: the same arrays, new values
        _C.sgd_update(p.data, _C.to_device(np.full(p.data.shape, 0.02, np.float32)), None, 1.0, 0.0, 0.0, 0.0,
                      False, True)
    np.testing.assert_allclose(infer(x), model(_C.to_device(x)).numpy(), rtol=1e-5, atol=2e-6)


@gpu
@needs_nvrtc
def test_where_the_plan_beat_the_interpreter_the_generated_kernel_is_timed_against_it(monkeypatch):
    """The first choice (made to go to the plan here: the plan's time reported 10 % under the fastest cluster's)
    starts the generated kernel's compile anyway; once it is adopted, it and the plan are timed again as numpy
    calls and the faster serves: the choice follows those two times, and the outputs stay the reference's."""
    monkeypatch.delenv("CYDNN_FUSED_GEN", raising=False)
    real = fused_choice.FusedChoice._time

    def plan_first(candidates):
        times = real(candidates)
        times[None] = 0.9 * min(t for k, t in times.items() if k is not None)
        return times
    monkeypatch.setattr(fused_choice.FusedChoice, "_time", staticmethod(plan_first))
    make, shape = ZOO["cnn32"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape)
    x = np.random.default_rng(23).standard_normal((1,) + shape).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    np.testing.assert_allclose(infer(x), want, rtol=1e-5, atol=2e-6)
    fused = infer.info()["fused_net"]
    assert fused["clusters"][1] is None and fused["generated"], fused
    (cluster, gen), = fused["generated"].items()
    infer.wait_generated()
    fused = infer.info()["fused_net"]
    timed = fused["timed_us"][1]
    if fused["generated"][cluster]["status"] == "in use":
        assert f"generated/{cluster}" in timed and "plan again" in timed, timed
        faster = timed[f"generated/{cluster}"] < timed["plan again"]
        assert fused["clusters"][1] == (cluster if faster else None), fused
    else:                                             # refused, or slower than the interpreter: the plan stays
        assert fused["clusters"][1] is None and f"generated/{cluster}" not in timed, fused
    np.testing.assert_allclose(infer(x), want, rtol=1e-5, atol=2e-6)


@gpu
@needs_nvrtc
def test_a_kernel_from_the_disk_cache_runs_and_gives_nvrtcs_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv("CYDNN_FUSED_GEN", raising=False)
    monkeypatch.setenv("CYDNN_KERNEL_CACHE", str(tmp_path / "kernels"))
    make, shape = ZOO["cnn32"]
    model = make().to("cuda").eval()
    x = np.random.default_rng(23).standard_normal((1,) + shape).astype(np.float32)
    want = model(_C.to_device(x)).numpy()
    runs = []
    for _ in range(2):                               # NVRTC, then the cubin it left on disk
        infer = cydnn.compile(model, input_shape=shape, fused_net="force")
        infer(x)                                     # the first call plans the fused network, starts the compile
        cluster = infer.info()["fused_net"]["clusters"][1]
        info = infer.wait_generated()[cluster]
        assert info["max_diff"] <= 1e-5 and info["status"] in ("in use", "not used"), info
        runs.append((info["cached"], infer(x), len(list((tmp_path / "kernels").iterdir()))))
    assert [cached for cached, _, _ in runs] == [False, True]
    assert runs[0][2] == runs[1][2] >= 2                  # an entry a unit of the layers form and one for the whole
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    np.testing.assert_allclose(runs[1][1], want, rtol=1e-5, atol=2e-6)


@gpu
def test_switched_off_nothing_is_generated(monkeypatch):
    monkeypatch.setenv("CYDNN_FUSED_GEN", "0")
    make, shape = ZOO["mlp"]
    model = make().to("cuda").eval()
    infer = cydnn.compile(model, input_shape=shape, fused_net="force")
    infer(np.zeros((1,) + shape, np.float32))
    assert infer.info()["fused_net"]["generated"] == "off (CYDNN_FUSED_GEN=0)"


def test_the_headers_a_wheel_installs_are_the_ones_the_source_includes():
    """setup.py's build_py copies cpp/'s headers into cydnn/_cuda_src for installs without the source
    tree: its list must be the generator's (a header missing there turns every generation off)."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    listed = text.split('for name in ("', 1)[1].split(")", 1)[0]
    assert tuple(n.strip().strip('"') for n in listed.split(",")) == fused_net_gen._HEADERS
    found = fused_net_gen.headers()
    assert set(found) == set(fused_net_gen._HEADERS) | {"stddef.h", "stdint.h"}
    assert "cluster_group" in found["fused_net_rtc.cuh"] and "forward_image" in found["fused_net_layers.cuh"]


def test_explain_says_what_was_generated():
    import types

    class Net:
        def src(self, cluster):
            return ""

        def trial(self, cluster, kernel):
            return True, {}
    owner = Net()
    stub = types.SimpleNamespace(tables={1: types.SimpleNamespace(smem_bytes=4096)}, layers=[],
                                 generated=nvrtc_jobs.GeneratedKernels(owner.src, owner.trial, on=True))
    assert fused_net.FusedNetwork.explain(stub).endswith("(fused_net_gen.source(...) prints one): none yet")
    stub.generated.info.update({16: {"status": "in use"}, 8: {"status": "not used"}})
    assert fused_net.FusedNetwork.explain(stub).endswith(": cluster 8: not used, cluster 16: in use")
    stub.generated = nvrtc_jobs.GeneratedKernels(owner.src, owner.trial, on=False)
    assert fused_net.FusedNetwork.explain(stub).endswith(": off (CYDNN_FUSED_GEN=0)")
    # the tiles timed at the biggest cluster size
    stub._bound = {16: ([{"op": "conv", "tile": 7, "tile_us": {4: 10.8, 7: 10.1}}, {"op": "linear"}], 0)}
    assert "convolution tiles at 16 blocks, timed (tile {tile: us}): 7 {4: 10.8, 7: 10.1}\n" in (
        fused_net.FusedNetwork.explain(stub))


