"""The compiler's timed choices, on the CPU with the timings given: the executor's fastest way of a convolution
(executor._fastest: the fastest kept, a way that raises dropped, $CYDNN_CONV's forcing); the steps that bind it, with
the library calls faked (a linear layer's forward and dx, a convolution's dx then dw); and the inference's
choice of the fused network against the plan, with the second timing of a kernel generated for the network where
the plan won the first (fused_choice.FusedChoice: GENERATED_HOPE)."""
import numpy as np
import pytest

from cydnn import _C
from cydnn.compiler import executor, fused_choice
from cydnn.errors import CydnnError, OutOfMemoryError


# ------------------------------------------------------------------ executor._fastest
def _ways(times, raising=()):
    """name -> call; each call records itself, the fake timer returns ``times[name]`` (seconds) or raises."""
    calls = []

    def way(name):
        def run():
            calls.append(name)
            if name in raising:
                raise OutOfMemoryError(f"{name}: over the workspace limit", 0, name)
        run.__name__ = name
        return run
    return {name: way(name) for name in times}, calls


@pytest.fixture
def timer(monkeypatch):
    table = {}

    def fake_time_replayed(fn):
        fn()
        return table[fn.__name__]
    monkeypatch.setattr(executor, "time_replayed", fake_time_replayed)
    return table


def test_the_fastest_way_is_kept_and_every_close_way_timed_twice(timer):
    """Every way is timed once; those within SECOND_ROUND_WITHIN x the fastest again (a slow moment must not decide
    between close ways); one far slower keeps its one timing."""
    timer.update({"library": 3e-6, "direct": 9e-6, "igemm64x64k16": 2e-6, "igemm64x64k16s4": 2.5e-6})
    assert 3e-6 <= executor.SECOND_ROUND_WITHIN * 2e-6 < 9e-6
    ways, calls = _ways(timer)
    chosen, timed = executor._fastest(ways)
    assert chosen == "igemm64x64k16"
    assert timed == {"library": 3.0, "direct": 9.0, "igemm64x64k16": 2.0, "igemm64x64k16s4": 2.5}
    assert sorted(calls) == sorted(["library", "igemm64x64k16", "igemm64x64k16s4"] * 2 + ["direct"])


def test_a_slow_moment_in_the_first_round_does_not_decide_between_close_ways(monkeypatch):
    """The fastest way's first timing caught a slow moment (2.5x, within SECOND_ROUND_WITHIN): it is timed again and
    wins; a way slower still (over the bound) is not."""
    rounds = {"igemm64x64k16": [5e-6, 2e-6], "library": [3e-6, 3e-6], "direct": [40e-6, 40e-6]}

    def fake_time_replayed(fn):
        fn()
        return rounds[fn.__name__].pop(0)
    monkeypatch.setattr(executor, "time_replayed", fake_time_replayed)
    ways, calls = _ways(rounds)
    chosen, timed = executor._fastest(ways)
    assert chosen == "igemm64x64k16" and timed["igemm64x64k16"] == 2.0
    assert calls.count("direct") == 1 and timed["direct"] == 40.0


def test_a_way_that_raises_is_dropped_and_the_rest_compete(timer):
    timer.update({"library": 3e-6, "igemm64x64k16s4": 1e-6, "igemm64x64k16": 2e-6})
    ways, calls = _ways(timer, raising={"igemm64x64k16s4"})
    chosen, timed = executor._fastest(ways)
    assert chosen == "igemm64x64k16" and "igemm64x64k16s4" not in timed
    assert calls.count("igemm64x64k16s4") == 1          # not tried again in the second round


def test_forcing_keeps_the_ways_it_names_or_falls_back_to_all(timer):
    timer.update({"library": 1e-6, "direct": 5e-6, "igemm128x32k8": 4e-6, "igemm64x32k8": 3e-6})
    ways, _ = _ways(timer)
    assert executor._fastest(ways, "igemm")[0] == "igemm64x32k8"
    assert executor._fastest(ways, "direct")[0] == "direct"
    assert executor._fastest(ways, "library") == ("library", {"library": 1.0})
    # every forced way raises (a layer the tiles do not take): the others are timed instead
    ways, _ = _ways(timer, raising={"igemm128x32k8", "igemm64x32k8"})
    assert executor._fastest(ways, "igemm")[0] == "library"


def test_when_every_way_raises_the_librarys_own_error_is_raised(timer):
    timer.update({"library": 1e-6, "igemm64x32k8": 1e-6})
    ways, _ = _ways(timer, raising={"library", "igemm64x32k8"})
    with pytest.raises(CydnnError, match="library: over the workspace limit"):
        executor._fastest(ways)


def test_the_tiles_timed_for_a_layer_leave_out_the_much_wider_ones():
    tiles = _C.igemm_conv_tiles()
    narrowest = min(t[1] for t in tiles)
    for channels in (1, 10, 16, 24, 48, 96, 512):
        kept = executor.igemm_tiles(channels)
        assert kept and all(t == tiles[i] for i, t in kept)
        assert {t[1] for _, t in kept} == {t[1] for t in tiles if t[1] == narrowest or t[1] < 2 * channels}
    assert len(executor.igemm_tiles(512)) == len(tiles)


# ------------------------------------------------------------------ FusedChoice and the generated kernel
class _Generated:
    """The fused network's generated kernels as FusedChoice sees them: compiling, ready, or refused."""

    def __init__(self, state):
        self.state, self.started, self.dropped = state, [], []

    def start(self, cluster):
        self.started.append(cluster)
        return self.state != "off"

    def drop(self, cluster, why):
        self.dropped.append(cluster)

    def compiling(self, cluster):
        return self.state == "compiling"

    def get(self, cluster):
        return object() if self.state == "ready" else None


class _Net:
    out_size = 2

    def __init__(self, state):
        self.generated = _Generated(state)
        self._dy = _Out(np.zeros(8 * 2, np.float32))

    def forward(self, x, dy, bucket, r):
        pass


class _Out:
    def __init__(self, v):
        self.v = v

    def numpy(self):
        return self.v


def _choice(state, first_times, monkeypatch, again=None, expect=False):
    """A FusedChoice over a fake network; its first timing returns ``first_times`` (us; None: the plan), the second
    timing ``again`` (us: the fused call, then the plan's); ``expect``: the call's ``expect`` before the choice."""
    choice = object.__new__(fused_choice.FusedChoice)
    choice.mode, choice.reason, choice.net = "auto", None, _Net(state)
    choice.clusters, choice.timed_us, choice.skipped, choice.hoped, choice.expected = {}, {}, {}, {}, None
    if expect:
        choice.expect(1)
    second = {"fused": again[0], "plan": again[1]} if again else {}         # _hope's keys
    timings = []

    def fake_time(candidates):
        timings.append(sorted(map(str, candidates)))
        return {k: (second[k] if k in second else first_times[k]) * 1e-6 for k in candidates}
    monkeypatch.setattr(fused_choice.FusedChoice, "_time", staticmethod(fake_time))
    out = lambda: _Out(np.zeros((8, 2), np.float32))      # noqa: E731
    choice.choose(1, 1, None, lambda: None, out)
    choice.test_timings = timings
    return choice


FIRST = {None: 40.0, 1: 120.0, 2: 80.0, 4: 60.0, 8: 47.0, 16: 49.0}


def test_where_the_fused_network_wins_its_kernel_is_generated_and_nothing_is_hoped(monkeypatch):
    choice = _choice("compiling", {**FIRST, 8: 30.0}, monkeypatch)
    assert choice.clusters[1] == 8 and choice.net.generated.started == [8] and not choice.hoped


def test_where_the_plan_wins_by_little_the_fastest_clusters_kernel_is_generated(monkeypatch):
    choice = _choice("compiling", FIRST, monkeypatch)
    assert choice.clusters[1] is None and choice.net.generated.started == [8]
    assert choice.cluster(1) is None and 1 in choice.hoped        # still compiling: the plan serves, hope kept


def test_where_the_plan_wins_by_much_nothing_is_generated(monkeypatch):
    far = {k: (v if k is None else v * 2) for k, v in FIRST.items()}         # the best cluster 2.35x the plan
    choice = _choice("compiling", far, monkeypatch)
    assert choice.clusters[1] is None and choice.net.generated.started == [] and not choice.hoped


@pytest.mark.parametrize("fused, plan, chosen", [(35.0, 47.0, 8), (37.0, 29.0, None)])
def test_a_ready_kernel_is_timed_against_the_plan_again_and_the_faster_serves(monkeypatch, fused, plan, chosen):
    choice = _choice("ready", FIRST, monkeypatch, again=(fused, plan))
    assert choice.cluster(1) == chosen and not choice.hoped
    assert choice.timed_us[1]["generated/8"] == fused and choice.timed_us[1]["plan again"] == plan
    assert choice.cluster(1) == chosen                             # decided once: no third timing
    assert choice.test_timings[1:] == [["fused", "plan"]]


def test_a_choice_takes_each_candidates_least_time_over_its_rounds(monkeypatch):
    """One slow moment in a round (the all-conv plan's chunk once timed 4x its usual on the H100) does not lose
    the bucket: each candidate keeps its least time over TIME_ROUNDS rounds, timed in turn."""
    seen = []
    slow = {("plan", 0): 2456.0}                                   # the plan's first round, a slow moment
    usual = {"plan": 600.0, "fused/4": 2087.0}

    def fake_calls(fn, n):
        key = fn()
        r = sum(1 for k in seen if k == key)
        seen.append(key)
        return slow.get((key, r), usual[key]) * 1e-6
    monkeypatch.setattr(fused_choice, "time_calls", fake_calls)
    times = fused_choice.FusedChoice._time({k: (lambda k=k: k) for k in usual})
    assert times == {k: v * 1e-6 for k, v in usual.items()}
    assert seen == ["plan", "fused/4"] * fused_choice.TIME_ROUNDS
    assert fused_choice.TIME_ROUNDS >= 2


def test_a_refused_kernel_leaves_the_plan_without_a_second_timing(monkeypatch):
    choice = _choice("refused", FIRST, monkeypatch, again=())
    assert choice.cluster(1) is None and not choice.hoped and "generated/8" not in choice.timed_us[1]
    assert len(choice.test_timings) == 1


def test_generation_switched_off_hopes_for_nothing(monkeypatch):
    choice = _choice("off", FIRST, monkeypatch)
    assert choice.clusters[1] is None and not choice.hoped


@pytest.mark.parametrize("times, started, kept", [
    ({**FIRST, 16: 30.0}, [16, 16], True),                        # the expected cluster wins: its compile goes on
    ({**FIRST, 8: 30.0}, [16, 8], False),                         # another wins: stopped, the winner's started
    ({**FIRST, 8: 60.0, 16: 45.0}, [16, 16], True),               # the plan wins by little, 16 the best: hoped for
    ({k: (v if k is None else v * 2) for k, v in FIRST.items()}, [16], False)])   # the plan by much: stopped
def test_a_one_image_first_call_starts_the_largest_clusters_kernel_before_the_timing(monkeypatch, times, started,
                                                                                      kept):
    """expect: a one-image bucket's first call starts the kernel generated for EXPECTED_CLUSTER before the plan is
    built and the candidates timed; the choice keeps that compile where the cluster serves or is hoped for, else
    drops it; a bucket already chosen expects nothing."""
    assert fused_choice.EXPECTED_CLUSTER == 16
    choice = _choice("compiling", times, monkeypatch, expect=True)
    assert choice.net.generated.started == started
    assert choice.net.generated.dropped == ([] if kept else [16]) and choice.expected is None
    choice.expect(1)
    assert choice.net.generated.started == started


def test_only_a_one_image_bucket_expects_and_only_once(monkeypatch):
    choice = object.__new__(fused_choice.FusedChoice)
    choice.net, choice.expected, choice.clusters = _Net("compiling"), None, {}
    choice.expect(8)
    assert choice.net.generated.started == [] and choice.expected is None
    choice.expect(1)
    choice.expect(1)
    assert choice.net.generated.started == [fused_choice.EXPECTED_CLUSTER] == [choice.expected]
    off = object.__new__(fused_choice.FusedChoice)
    off.net, off.expected, off.clusters = _Net("off"), None, {}      # generation switched off: nothing expected
    off.expect(1)
    assert off.expected is None


# ------------------------------------------------- the steps' timed choices, with the library calls faked
class _Arr:
    """What the executor reads of a bound array: its shape."""

    def __init__(self, *shape):
        self.shape = shape


@pytest.fixture
def faked(monkeypatch):
    """executor._C's calls replaced by recorders; the fake timer charges a call by the way it recorded
    (``costs[way]`` seconds, a way being e.g. ("tile", 1) or ("bwd", dx_tile, dw_tile))."""
    calls, costs = [], {}

    def record(way):
        calls.append(way)

    def fake_time_replayed(fn):
        fn()
        return costs[calls[-1]]
    monkeypatch.setattr(executor, "time_replayed", fake_time_replayed)
    monkeypatch.setattr(executor._C, "skinny_gemm_tiles", lambda: [(64, 64, 256, 1), (16, 64, 64, 16)])
    monkeypatch.setattr(executor._C, "igemm_conv_tiles", lambda: [(64, 64, 256, 16, 1)])
    monkeypatch.setattr(executor._C, "conv_wgrad_tiles", lambda: [(32, 32, 64, 32), (32, 64, 128, 16)])
    monkeypatch.setattr(executor._C, "linear_forward", lambda *a: record(("library",)))
    monkeypatch.setattr(executor._C, "skinny_gemm", lambda *a: record(("tile", a[-1])))
    monkeypatch.setattr(executor._C, "linear_backward", lambda *a: record(("bwd",) + (a[6:] or (-1,))))
    monkeypatch.setattr(executor._C, "conv_backward",
                        lambda *a: record(("conv",) + tuple(a[8:]) + (-1,) * (2 - len(a[8:]))))
    monkeypatch.delenv("CYDNN_LINEAR", raising=False)
    monkeypatch.delenv("CYDNN_CONV", raising=False)
    return calls, costs


def _linear_step(kind, dx=True):
    from cydnn.compiler.ir import Step
    from cydnn.compiler.lower import GEMM
    if kind == "linear_forward":
        return Step(kind, "fc forward", ("x", "w", "bias"), ("y",), (GEMM,), {"bias": "bias", "act": 1})
    return Step(kind, "fc backward", ("x", "w", "dy"), (("dx",) if dx else ()) + ("dw",), (GEMM,) * (2 if dx else 1),
                {"dx": "dx" if dx else None, "dw": "dw"})


def test_a_linear_forward_binds_its_fastest_way_and_names_its_kernels(faked, monkeypatch):
    from cydnn.compiler.lower import GEMM, skinny_gemm_kernel
    calls, costs = faked
    costs.update({("library",): 3e-6, ("tile", 0): 4e-6, ("tile", 1): 1e-6})
    b = {"x": _Arr(64, 784), "w": _Arr(1024, 784), "bias": _Arr(1024), "y": _Arr(64, 1024)}
    s = _linear_step("linear_forward")
    fn, args = executor.DISPATCH["linear_forward"](b, s)
    calls.clear()
    fn(*args)
    assert calls == [("tile", 1)]                                  # the bound call is the fastest way
    assert s.kernels == skinny_gemm_kernel((16, 64, 64, 16))
    assert s.args["timed_us"] == {"library": 3.0, "skinny64x64s1": 4.0, "skinny16x64s16": 1.0}
    monkeypatch.setenv("CYDNN_LINEAR", "library")                  # forced: the library, though slower
    s = _linear_step("linear_forward")
    fn, args = executor.DISPATCH["linear_forward"](b, s)
    calls.clear()
    fn(*args)
    assert calls == [("library",)] and s.kernels == (GEMM,)


def test_a_linear_backward_binds_dx_on_its_fastest_way_beside_the_library_dw(faked):
    from cydnn.compiler.lower import GEMM, skinny_gemm_kernel
    calls, costs = faked
    costs.update({("bwd", -1): 5e-6, ("bwd", 0): 3e-6, ("bwd", 1): 4e-6})
    b = {"x": _Arr(64, 1024), "w": _Arr(1024, 1024), "dy": _Arr(64, 1024), "dx": _Arr(64, 1024),
         "dw": _Arr(1024, 1024)}
    s = _linear_step("linear_backward")
    fn, args = executor.DISPATCH["linear_backward"](b, s)
    assert args[-1] == 0 and s.kernels == skinny_gemm_kernel((64, 64, 256, 1)) + (GEMM,)
    calls.clear()
    s = _linear_step("linear_backward", dx=False)                  # no dx: nothing to choose, nothing timed
    fn, args = executor.DISPATCH["linear_backward"](b, s)
    assert calls == [] and len(args) == 6 and s.kernels == (GEMM,) and "timed_us" not in s.args


def test_a_convolutions_backward_chooses_dx_then_dw_beside_it(faked):
    from cydnn.compiler.ir import Step
    from cydnn.compiler.lower import (CONV_BACKWARD_DATA, CONV_BACKWARD_FILTER, conv_igemm_kernel,
                                      conv_wgrad_kernel)
    calls, costs = faked
    # dx: the tile wins (2 < 5); dw, timed with that dx: wgrad32x64s16 wins (1 < 2 < 3)
    costs.update({("conv", -1, -1): 5e-6, ("conv", 0, -1): 2e-6, ("conv", 0, 0): 3e-6, ("conv", 0, 1): 1e-6})
    b = {"x": _Arr(64, 24, 16, 16), "w": _Arr(48, 24, 3, 3), "dy": _Arr(64, 48, 16, 16), "dx": _Arr(64, 24, 16, 16),
         "dw": _Arr(48, 24, 3, 3)}

    def step(stride):
        return Step("conv_backward", "conv2 backward", ("x", "w", "dy"), ("dx", "dw"),
                    (CONV_BACKWARD_DATA, CONV_BACKWARD_FILTER), {"dx": "dx", "dw": "dw", "stride": stride,
                                                                 "padding": (1, 1)})
    s = step((1, 1))
    fn, args = executor.DISPATCH["conv_backward"](b, s)
    assert args[-2:] == (0, 1)
    assert s.kernels == conv_igemm_kernel((64, 64, 256, 16, 1)) + conv_wgrad_kernel((32, 64, 128, 16))
    assert s.args["timed_us"] == {"library": 5.0, "igemm64x64k16": 2.0, "dw library": 2.0, "wgrad32x32s32": 3.0,
                                  "wgrad32x64s16": 1.0}
    # stride 2: dx stays cuDNN's (no choice), dw is still chosen; the library winning keeps cuDNN's kernels
    costs.update({("conv", -1, -1): 1e-6, ("conv", -1, 0): 2e-6, ("conv", -1, 1): 3e-6})
    b["dx"], b["dy"] = _Arr(64, 24, 16, 16), _Arr(64, 48, 8, 8)
    s = step((2, 2))
    fn, args = executor.DISPATCH["conv_backward"](b, s)
    assert args[-2:] == (-1, -1) and s.kernels == (CONV_BACKWARD_DATA, CONV_BACKWARD_FILTER)
    assert set(s.args["timed_us"]) == {"dw library", "wgrad32x32s32", "wgrad32x64s16"}


def test_least_times_takes_each_ways_least_over_rounds_and_restores_after_every_timing():
    """executor.least_times, behind every timed trial between two ways (the fused network's buckets, its generated
    kernel against the interpreter, the fused training step's clusters and against the plan): candidates in turn
    each round, the least of each, ``after`` after every timing even where the timing raises."""
    order, after = [], []
    seconds = {("a", 0): 5.0, ("a", 1): 2.0, ("b", 0): 1.0, ("b", 1): 4.0}

    def timer(fn, calls):
        key = fn()
        order.append((key, calls))
        return seconds[(key, sum(1 for k, _ in order if k == key) - 1)]
    got = executor.least_times({"a": lambda: "a", "b": lambda: "b"}, 7, 2, timer=timer, after=lambda: after.append(1))
    assert got == {"a": 2.0, "b": 1.0}
    assert order == [("a", 7), ("b", 7), ("a", 7), ("b", 7)] and len(after) == 4

    def failing(fn, calls):
        raise CydnnError("a launch failed")
    after.clear()
    with pytest.raises(CydnnError, match="a launch failed"):
        executor.least_times({"a": lambda: "a"}, 1, 2, timer=failing, after=lambda: after.append(1))
    assert after == [1]
