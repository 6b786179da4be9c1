"""The two forms of a generated kernel (compiler/nvrtc_jobs.py: FORMS, Linked, GeneratedKernels' adoption) and the
driver's link (fused_net_gen.link), on the CPU: compiles and the driver are stand-ins that end or fail when the test
says; the layers form in groups of layers (fused_net_gen.units(groups=...)), compiled by NVRTC.  (The forms on the
GPU: test_fused_net_gen.py; the background compiles themselves: test_nvrtc_jobs.py.)"""
import re

import numpy as np
import pytest

from cydnn.compiler import fused_net, fused_net_gen, nvrtc_jobs

from test_fused_net_gen import _layers, needs_nvrtc


class _Done:
    """A finished Generation (its cubin or its error), for the adoption logic without NVRTC."""
    def __init__(self, cubin=b"cubin", error=None, seconds=1.0):
        self.cubin, self.error, self.seconds, self.nvrtc_seconds, self.cached = cubin, error, seconds, seconds, False

    def done(self):
        return True

    @property
    def ended(self):                 # (as a Generation's: its queueing, ``_t0`` where the test sets one, + seconds)
        t0 = getattr(self, "_t0", None)
        return None if t0 is None or self.seconds is None else t0 + self.seconds

    def wait(self, timeout=None):
        return True

    def result(self):
        if self.error is not None:
            raise self.error
        return self.cubin


def _stub_compiles(monkeypatch, made=None):
    """Generation and Linked replaced by compiles that end when the test says (``_Pending``); ``made``: what was
    asked for, (form, text).  (A machine that runs eight compiles at once.)"""
    made = [] if made is None else made
    monkeypatch.setattr(nvrtc_jobs, "MAX_RUNNING", 8)
    monkeypatch.setattr(nvrtc_jobs, "POLL_S", 0.0)           # every call looks (test_calls_look_at_compiles_...)
    monkeypatch.setattr(nvrtc_jobs, "Generation", lambda text, arch=None, rdc=False: made.append(("whole", text))
                        or _Pending(text))
    monkeypatch.setattr(nvrtc_jobs, "Linked", lambda texts, arch=None: made.append(("layers", texts))
                        or _Pending("layers"))
    return made


class _Forms:
    def src(self, cluster, form="whole"):
        return ["unit 0", "kernel"] if form == "layers" else "whole"


@pytest.mark.parametrize("times, want", [({"layers": 30.0, "whole": 27.0}, "whole"),
                                         ({"layers": 27.0, "whole": 30.0}, "layers")])
def test_of_two_forms_the_faster_one_serves(monkeypatch, times, want):
    """The layers form comes first and serves as soon as it passes; the whole one replaces it only where it is
    timed faster beside it; ``info`` says which serves, when the first came, and what happened to each."""
    from cydnn import _C
    monkeypatch.setattr(_C, "NetKernel", lambda cubin, name, cluster: cubin.decode())
    monkeypatch.setenv("CYDNN_NVRTC_SPLIT", "1")

    trials = []

    class Net(_Forms):
        def trial(self, cluster, kernel, serving=None):
            trials.append((kernel, serving))
            timed = {"interpreter": 40.0, "generated": times[kernel]}
            if serving is not None:
                timed["in_use"] = times[serving]
            return True, {"max_diff": 0.0, "timed_us": timed}
    net = Net()
    kernels = nvrtc_jobs.GeneratedKernels(net.src, net.trial)
    made = _stub_compiles(monkeypatch)
    assert kernels.start(8) and made == [("whole", "whole"), ("layers", ["unit 0", "kernel"])]   # the whole first
    assert kernels.get(8) is None and kernels.compiling(8)
    for form, queued in (("layers", 0.3), ("whole", 0.25)):     # queued that long after the network's start
        kernels._pending[8][form]._t0 = kernels._born + queued
    kernels._pending[8]["layers"].finish(seconds=0.8)
    assert kernels.get(8) == "layers" and kernels.info[8]["status"] == "in use" and kernels.info[8]["first_s"] == 0.8
    assert kernels.info[8]["ready_s"] == 1.1                   # 0.3 + 0.8: from the network's start
    assert kernels.compiling(8)
    kernels._pending[8]["whole"].finish(seconds=2.5)
    assert kernels.get(8) == want and not kernels.compiling(8) and 8 not in kernels._pending
    info = kernels.info[8]
    assert info["form"] == want and info["first_s"] == 0.8 and info["status"] == "in use"
    assert info["timed_us"]["generated"] == times[want]
    other = "whole" if want == "layers" else "layers"
    assert info["forms"][other]["status"] == ("replaced" if want == "whole" else "not used")
    assert info["forms"][want]["status"] == "in use"
    assert info["forms"]["whole"]["ready_s"] == 2.75 and info["ready_s"] == (2.75 if want == "whole" else 1.1)
    # one trial an adoption: the second form timed with the one in use in the same rounds, not in a trial of its own
    assert trials == [("layers", None), ("whole", "layers")]
    assert info["forms"]["whole"]["in_use_us"] == times["layers"]


def test_a_refused_first_form_leaves_the_second_to_serve(monkeypatch):
    from cydnn import _C
    monkeypatch.setattr(_C, "NetKernel", lambda cubin, name, cluster: cubin.decode())
    monkeypatch.setenv("CYDNN_NVRTC_SPLIT", "1")

    class Net(_Forms):
        def trial(self, cluster, kernel, serving=None):
            return True, {"timed_us": {"interpreter": 40.0, "generated": 30.0, **({} if serving is None else
                                                                                  {"in_use": 30.0})}}
    net = Net()
    kernels = nvrtc_jobs.GeneratedKernels(net.src, net.trial)
    _stub_compiles(monkeypatch)
    kernels.start(4)
    kernels._pending[4]["layers"].finish(error=fused_net_gen.GenerationError("cuLink: cuLinkComplete failed"))
    assert kernels.get(4) is None and kernels.info[4]["status"] == "refused" and kernels.compiling(4)
    kernels._pending[4]["whole"].finish()
    assert kernels.get(4) == "whole" and kernels.info[4]["status"] == "in use" and "reason" not in kernels.info[4]
    assert kernels.info[4]["forms"]["layers"]["status"] == "refused"


@pytest.mark.parametrize("split, running, forms", [("0", 8, ["whole"]), ("1", 8, ["whole", "layers"]),
                                                    ("1", 3, ["whole"]), ("1", 4, ["whole", "layers"])])
def test_the_layers_form_is_compiled_where_it_is_on_and_can_run_side_by_side(monkeypatch, split, running, forms):
    monkeypatch.setenv("CYDNN_NVRTC_SPLIT", split)
    made = _stub_compiles(monkeypatch)
    monkeypatch.setattr(nvrtc_jobs, "MAX_RUNNING", running)

    class Net(_Forms):
        def trial(self, cluster, kernel):
            return True, {}
    net = Net()
    nvrtc_jobs.GeneratedKernels(net.src, net.trial).start(2)
    assert [form for form, _ in made] == forms


def _passing_kernels(monkeypatch, split, made=None):
    """GeneratedKernels over stand-in compiles (``_stub_compiles``) whose every kernel passes its trial at 30 us
    (the interpreter's 40), and the network it holds weakly (keep it); ``split``: $CYDNN_NVRTC_SPLIT."""
    from cydnn import _C
    monkeypatch.setattr(_C, "NetKernel", lambda cubin, name, cluster: cubin.decode())
    monkeypatch.setenv("CYDNN_NVRTC_SPLIT", split)
    _stub_compiles(monkeypatch, made)

    class Net(_Forms):
        def trial(self, cluster, kernel, serving=None):
            return True, {"timed_us": {"interpreter": 40.0, "generated": 30.0, **({} if serving is None else
                                                                                  {"in_use": 30.0})}}
    net = Net()
    return nvrtc_jobs.GeneratedKernels(net.src, net.trial), net


def test_a_dropped_cluster_stops_its_compiles_and_may_start_again(monkeypatch):
    """drop (a compile started before the timing, which chose another cluster): the cluster's running compiles are
    killed with the reason and forgotten, so that a later start compiles it again; a kernel in use is kept."""
    made = []
    kernels, _net = _passing_kernels(monkeypatch, "1", made)
    kernels.start(16)
    forms = dict(kernels._pending[16])
    kernels.drop(16, "dropped: cluster 16 was not chosen")
    assert all(f.killed == "dropped: cluster 16 was not chosen" for f in forms.values())
    assert 16 not in kernels.info and not kernels.compiling(16) and kernels.get(16) is None
    made.clear()
    assert kernels.start(16) and [form for form, _ in made] == ["whole", "layers"]     # compiled again
    for form in ("layers", "whole"):
        kernels._pending[16][form].finish()
    assert kernels.get(16) == "layers"               # (both timed 30 us: the first adopted stays)
    kernels.drop(16, "dropped")
    assert kernels.get(16) == "layers" and kernels.info[16]["status"] == "in use"


def test_calls_look_at_running_compiles_at_most_every_poll_interval(monkeypatch):
    """A call's get / compiling polls the cluster's child processes at most once every POLL_S (a look cost a
    one-image call ~15-20 us while its kernel compiled); wait looks at once."""
    kernels, _net = _passing_kernels(monkeypatch, "0")
    monkeypatch.setattr(nvrtc_jobs, "POLL_S", 3600.0)
    polls = []
    kernels.start(4)
    whole = kernels._pending[4]["whole"]
    done = whole.done
    whole.done = lambda: polls.append(1) or done()
    assert kernels.get(4) is None and polls == [1]                 # the first look
    whole.finish()
    assert kernels.get(4) is None and kernels.compiling(4) and polls == [1]    # within the interval: no look
    assert kernels.wait(4) == "whole" and polls == [1, 1] and not kernels.compiling(4)
    monkeypatch.setattr(nvrtc_jobs, "POLL_S", 0.0)
    kernels.start(8)
    kernels._pending[8]["whole"].finish()
    assert kernels.get(8) == "whole"                               # the interval past: the next call adopts it


def test_a_linked_kernel_is_done_when_every_unit_is_and_links_them_in_order(monkeypatch):
    """Linked: done only when each unit is; its time is the slowest unit's; its result the driver's link of the
    units' cubins in order (once); a unit's error, or the link's, is its error."""
    units = []
    monkeypatch.setattr(nvrtc_jobs, "Generation", lambda text, arch=None, rdc=False: units.append(rdc) or _Pending(text))
    linked_calls = []
    monkeypatch.setattr(fused_net_gen, "link", lambda cubins: linked_calls.append(cubins) or b"+".join(cubins))
    gen = nvrtc_jobs.Linked(["a", "b", "k"])
    assert units == [True, True, True] and not gen.done() and gen.seconds is None
    gen.units[0].finish(seconds=0.5)
    gen.units[2].finish(seconds=0.2)
    assert not gen.done()
    gen.units[1].finish(seconds=0.9)
    assert gen.done() and gen.seconds == 0.9 and gen.nvrtc_seconds == 0.9 and not gen.cached
    assert gen.result() == b"a+b+k" and gen.result() == b"a+b+k" and len(linked_calls) == 1
    bad = nvrtc_jobs.Linked(["a", "k"])
    bad.units[0].finish(error=fused_net_gen.GenerationError("NVRTC refused the generated source: unit a"))
    bad.units[1].finish()
    with pytest.raises(fused_net_gen.GenerationError, match="unit a"):
        bad.result()

    def refuse(cubins):
        raise fused_net_gen.GenerationError("cuLink: cuLinkAddData (unit 1) failed with CUresult 300")
    monkeypatch.setattr(fused_net_gen, "link", refuse)
    nolink = nvrtc_jobs.Linked(["a", "k"])
    for u in nolink.units:
        u.finish()
    with pytest.raises(fused_net_gen.GenerationError, match="CUresult 300"):
        nolink.result()


def test_without_a_driver_the_link_is_refused_with_the_reason(monkeypatch):
    import ctypes
    real = ctypes.CDLL

    def no_driver(name, *a, **k):
        if name == "libcuda.so.1":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return real(name, *a, **k)
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.raises(fused_net_gen.GenerationError, match="cuLink: the driver library is not loadable"):
        fused_net_gen.link([b"x"])


class _Pending(_Done):
    """A compile that ends when the test says so."""
    def __init__(self, text):
        super().__init__(cubin=text.encode(), seconds=None)
        self.finished, self.text = False, text

    def finish(self, error=None, seconds=1.0):
        self.error, self.seconds, self.nvrtc_seconds, self.finished = error, seconds, seconds, True
        self.cubin = self.text if isinstance(self.text, bytes) else self.cubin

    def done(self):
        return self.finished

    def kill(self, why=""):
        if not self.finished:
            self.killed = why


def test_a_link_the_driver_refuses_names_the_result(monkeypatch):
    """What the driver says goes into the GenerationError: the call, the CUresult and its name, the log; the link
    state is destroyed whatever happens (a stand-in for libcuda records the calls)."""
    import ctypes
    calls = []

    class Driver:
        def __init__(self, results):
            self.results = results

        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return self.results.get(name, 0)
            return call
    real = ctypes.CDLL
    for results, match in (({"cuLinkCreate_v2": 201}, r"cuLinkCreate failed with CUresult 201 \(CUDA_ERROR_INVALID_CONTEXT"),
                           ({"cuLinkAddData_v2": 300}, r"cuLinkAddData \(unit 0\) failed with CUresult 300 \(CUDA_ERROR_INV"),
                           ({"cuLinkComplete": 500}, r"cuLinkComplete failed with CUresult 500 \(CUDA_ERROR_NOT_FOUND")):
        calls.clear()
        monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, results=results, **k:
                            Driver(results) if name == "libcuda.so.1" else real(name, *a, **k))
        with pytest.raises(fused_net_gen.GenerationError, match=match):
            fused_net_gen.link([b"unit0", b"unit1"])
        assert (calls[-1] == "cuLinkDestroy") == ("cuLinkCreate_v2" not in results), calls


@needs_nvrtc
def test_the_layers_form_in_groups_inlines_each_groups_layers_between_barriers():
    """units(..., groups=[0, 2]): two layer units (layers 0-1, then 2 on) and the kernel; each group's layers are the
    whole form's lines, a cluster barrier after each (the group's last too: the kernel only calls the groups), the
    first reading buffer 0 and the second buffer 0 again
    (two layers later); the kernel calls the groups by their first layer; a group past the last layer is refused.
    (On the device every grouping gave the interpreter's bits: docs/performance/zoo-session-28.md.)"""
    _, _, nodes, layers = _layers("allconv")
    bound = [fused_net.FusedNetwork._bind(layer, 16) for layer in layers]
    assert len(bound) >= 3
    args = (bound, 16, 1000, 4096, int(np.prod(nodes[0].in_shape[1:])), int(np.prod(nodes[-1].out_shape[1:])), True)
    whole, units = fused_net_gen.source(*args), fused_net_gen.units(*args, groups=[0, 2])
    assert len(units) == 3

    def body(text):
        return [re.sub(r"net\.layers\[\d+\]\.|\bl\d+_", "", t.strip()) for t in text.splitlines()
                if t.strip().startswith(("L.", "cydnnNetLayer", "conv_", "linear_", "pool_", "gap_", "epilogue_"))]
    assert body(whole) == body(units[0]) + body(units[1])
    assert units[0].count("cluster.sync();") == 2 and units[1].count("cluster.sync();") == len(bound) - 2
    assert "cluster.sync();" not in units[2].split("load_input(")[1]
    assert "float *cur = smem + 0 * BUF" in units[0] and "float *cur = smem + 0 * BUF" in units[1]
    assert re.findall(r"    cydnn_net_layer_(\d+)\(", units[2]) == ["0", "2"]
    for unit in units:
        assert fused_net_gen.compile_cubin(unit, rdc=True)[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="groups must start at layers"):
        fused_net_gen.units(*args, groups=[0, len(bound)])
