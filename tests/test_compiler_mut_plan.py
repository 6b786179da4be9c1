"""The compiler's plans as data and as text: the steps the lowering emits for a small network (the rules of
lower.py's docstrings written out by hand), the kernels each step names (its boundaries: a bias reduction over
more than one block, batch norm wider than one block), the memory plan (no two live buffers share bytes, exact
sizes, each buffer at the lowest offset the greedy rule allows, the off switch) checked against lifetimes and
placements computed here, and ``explain()`` parsed back and compared with the plan's data and with byte counts
computed here.  Written for the mutation run of the compiler's passes (tools/mutation.py compiler)."""
import re

import numpy as np
import pytest

from cydnn import nn
from cydnn.compiler import lower, passes
from cydnn.compiler.compiled import _build_plan
from cydnn.compiler.ir import ARENA_ROLES, Plan, nbytes
from cydnn.compiler.trace import trace

ALIGN = 256


def small(rng=0):
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, rng=rng), nn.ReLU(), nn.Conv2d(2, 2, 3, bias=False, rng=rng),
                         nn.LeakyReLU(0.2), nn.MaxPool2d(2), nn.BatchNorm2d(2), nn.Sigmoid(), nn.Flatten(),
                         nn.Linear(8, 3, bias=False, rng=rng), nn.Linear(3, 4, rng=rng))


def chained(rng=0):
    """Alias of an alias (dropout p=0, then Flatten, then an eval-time dropout) and a folded Linear."""
    return nn.Sequential(nn.Conv2d(1, 3, 3, rng=rng), nn.Dropout(0.0), nn.Flatten(), nn.Dropout(0.0),
                         nn.Linear(12, 5, rng=rng), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2, bias=False, rng=rng))


def _plan(make, shape, batch, training, **options):
    return _build_plan(make(), shape, batch, training, options)[0]


def _steps(plan):
    return [(s.kind, s.name, s.reads, s.writes, s.kernels) for s in plan.steps]


CONV = ("cudnnConvolutionForward", "bias_act_forward_kernel")


def test_training_steps_of_a_small_network():
    """Forward (conv + bias + relu fused, conv without bias + leaky fused, pool, batch norm + sigmoid in one
    step, Flatten a view, a Linear without bias, a Linear with its bias apart), the loss, the backward in
    reverse with the first layer's input gradient skipped, one update of every parameter, the bookkeeping."""
    plan = _plan(small, (1, 6, 6), 2, True)
    bn = ("bn_stats_partial_kernel", "bn_apply_kernel")
    params = ("0.weight", "0.bias", "2.weight", "5.weight", "5.bias", "8.weight", "9.weight", "9.bias")
    assert _steps(plan) == [
        ("conv_bias_act", "0 forward + bias + relu", ("x", "0.weight", "0.bias"), ("a0",), CONV),
        ("conv_bias_act", "2 forward + leaky_relu", ("a0", "2.weight"), ("a1",), CONV),
        ("max_pool_forward", "4 max_pool", ("a1",), ("a2",), ("max_pool_tiled_kernel",)),
        ("bn_act_forward", "5 batch_norm + sigmoid", ("a2", "5.weight", "5.bias", "5.running_mean", "5.running_var"),
         ("a3", "bnmean3", "bnistd3", "5.running_mean", "5.running_var"), bn),
        ("linear_forward", "8 forward", ("a4", "8.weight"), ("a5",), ("cublasLtMatmul",)),
        ("linear_xent", "9 forward + loss + 9 backward", ("a5", "9.weight", "9.bias", "labels"),
         ("a6", "loss", "g6", "rowloss", "d:9.bias", "g5", "d:9.weight"),
         ("linear_xent_rows_kernel", "linear_xent_grads_kernel")),
        ("linear_backward", "8 backward", ("a4", "8.weight", "g5"), ("g4", "d:8.weight"), ("cublasLtMatmul",) * 2),
        ("bn_act_backward", "5 sigmoid + batch_norm backward", ("a2", "a3", "g3", "5.weight", "bnmean3", "bnistd3"),
         ("g2", "d:5.weight", "d:5.bias"), ("bn_grad_partial_kernel", "bn_dx_kernel")),
        ("max_pool_act_backward", "4 max_pool + 2 act backward", ("a1", "g2"), ("g1",),
         ("max_pool_act_backward_kernel",)),
        ("conv_backward", "2 backward", ("a0", "2.weight", "g1"), ("g0", "d:2.weight"),
         ("cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter")),
        ("bias_act_backward", "0 act + bias backward", ("a0", "g0"), ("g0", "d:0.bias"), ("act_backward_partial_kernel",)),
        ("conv_backward", "0 backward", ("x", "0.weight", "g0"), ("d:0.weight",), ("cudnnConvolutionBackwardFilter",)),
        ("flat_update", "optimizer update", tuple("d:" + p for p in params) + ("lr", "counters"), params,
         ("flat_update_kernel",)),
        ("step_bookkeeping", "bookkeeping", ("a6", "labels", "loss"), ("counters",), ("bookkeeping_kernel",))]
    args = [s.args for s in plan.steps]
    assert args[0] == dict(stride=(1, 1), padding=(1, 1), bias="0.bias", act=1, slope=0.0)
    assert args[1] == dict(stride=(1, 1), padding=(0, 0), bias=None, act=4, slope=pytest.approx(0.2))
    assert args[2] == dict(kernel=(2, 2), stride=(2, 2), padding=(0, 0))
    assert args[3] == dict(saved=("bnmean3", "bnistd3"), act=3, slope=0.0, eps=1e-5, momentum=pytest.approx(0.1))
    assert args[4] == dict(bias=None, act=0)
    # the last layer, the loss and their backward: one step (passes.fuse_head), which keeps the four it replaced
    unfused = args[5].pop("unfused")
    assert args[5] == dict(bias="9.bias", dbias="d:9.bias", dx="g5", dw="d:9.weight", row_loss="rowloss")
    assert [(u.kind, u.name, u.reads, u.writes, u.kernels) for u in unfused] == [
        ("linear_forward", "9 forward + bias", ("a5", "9.weight", "9.bias"), ("a6",), ("cublasLtMatmul",)),
        ("softmax_cross_entropy", "loss", ("a6", "labels"), ("loss", "g6"), ("cross_entropy_rows_kernel", "mean_kernel")),
        ("bias_act_backward", "9 bias backward", ("a6", "g6"), ("d:9.bias",), ("act_backward_partial_kernel",)),
        ("linear_backward", "9 backward", ("a5", "9.weight", "g6"), ("g5", "d:9.weight"), ("cublasLtMatmul",) * 2)]
    assert [u.args for u in unfused] == [dict(bias="9.bias", act=0), {}, dict(act=0, slope=0.0, dx=None,
                                                                               dbias="d:9.bias"),
                                         dict(dx="g5", dw="d:9.weight")]   # the bias: Lt's epilogue
    assert args[7] == dict(x="a2", y="a3", dy="g3", gamma="5.weight", act=3, slope=0.0, dx="g2",
                            grads=("d:5.weight", "d:5.bias"), saved=("bnmean3", "bnistd3"))
    # the pooling's backward and the leaky ReLU's before it: one kernel (passes.fuse_backward; 4x4 planes, 2x2)
    assert args[8] == dict(kernel=(2, 2), act=4, slope=pytest.approx(0.2), dx="g1", dbias=None)
    assert args[9] == dict(stride=(1, 1), padding=(0, 0), dx="g0", dw="d:2.weight")
    assert args[11] == dict(stride=(1, 1), padding=(1, 1), dx=None, dw="d:0.weight")
    b = plan.buffers
    assert (b["x"].shape, b["x"].role) == ((2, 1, 6, 6), "input")
    assert (b["labels"].shape, b["labels"].dtype, b["labels"].role) == ((2,), "int32", "label")
    assert (b["loss"].shape, b["loss"].role) == ((), "output")
    assert (b["counters"].shape, b["counters"].dtype, b["counters"].role) == ((6,), "int32", "control")
    assert (b["lr"].shape, b["lr"].role) == ((lower.LR_TABLE,), "control") and lower.LR_TABLE == 4096
    assert b["a4"].alias_of == "a3" and b["g3"].alias_of == "g4" and b["a4"].shape == (2, 8)
    assert (b["bnmean3"].shape, b["bnistd3"].shape) == ((2,), (2,))
    assert {n: b[n].role for n in params} == dict.fromkeys(params, "param")
    assert {n: b["d:" + n].role for n in params} == dict.fromkeys(params, "param_grad")
    assert b["5.running_mean"].role == b["5.running_var"].role == "param"
    assert all(b[f"g{i}"].role == "grad" for i in range(7))      # g3 too: a view of g4 (the Flatten's)
    assert all(b[f"a{i}"].role == "act" for i in range(7)) and b["bnmean3"].role == b["bnistd3"].role == "act"
    assert "g-1" not in b and plan.mode == "train" and plan.batch == 2


def test_inference_steps_fold_and_alias():
    plan = _plan(chained, (1, 4, 4), 3, False)
    assert _steps(plan) == [
        ("conv_bias_act", "0 forward + bias", ("x", "0.weight", "0.bias"), ("a0",), CONV),
        ("fold_batch_norm", "5 folded into 4", ("4.weight", "4.bias", "5.weight", "5.bias", "5.running_mean",
                                                "5.running_var"), ("wfold4", "bfold4"), ("fold_batch_norm_kernel",)),
        ("linear_forward", "4 forward", ("a3", "wfold4"), ("a4",), ("cublasLtMatmul",)),
        ("bias_act_forward", "4 folded bias + tanh", ("a4", "bfold4"), ("a4",), ("bias_act_forward_kernel",)),
        ("linear_forward", "7 forward", ("a4", "7.weight"), ("a5",), ("cublasLtMatmul",))]
    b = plan.buffers
    assert (b["a1"].alias_of, b["a2"].alias_of, b["a3"].alias_of) == ("a0", "a1", "a2")
    assert (b["a2"].shape, b["a3"].shape) == ((3, 12), (3, 12))
    assert (b["wfold4"].shape, b["wfold4"].role, b["bfold4"].shape, b["bfold4"].role) == ((5, 12), "scratch",
                                                                                            (5,), "scratch")
    assert plan.steps[1].args == dict(bias="4.bias", stats=("5.weight", "5.bias", "5.running_mean", "5.running_var"),
                                      eps=1e-5)
    assert plan.steps[3].args == dict(act=2, slope=0.0)
    assert plan.output == "a5" and plan.mode == "infer" and plan.batch == 3
    assert {n: (v.role, v.shape) for n, v in b.items()} == {
        "x": ("input", (3, 1, 4, 4)), "0.weight": ("param", (3, 1, 3, 3)), "0.bias": ("param", (3,)),
        "4.weight": ("param", (5, 12)), "4.bias": ("param", (5,)), "5.weight": ("param", (5,)),
        "5.bias": ("param", (5,)), "7.weight": ("param", (2, 5)), "5.running_mean": ("param", (5,)),
        "5.running_var": ("param", (5,)), "a0": ("act", (3, 3, 2, 2)), "a1": ("act", (3, 3, 2, 2)),
        "a2": ("act", (3, 12)), "a3": ("act", (3, 12)), "wfold4": ("scratch", (5, 12)), "bfold4": ("scratch", (5,)),
        "a4": ("act", (3, 5)), "a5": ("act", (3, 2))}
    soft = _build_plan(chained(), (1, 4, 4), 3, False, {}, softmax=True)[0]
    assert _steps(soft)[-1] == ("softmax", "softmax", ("a5",), ("probs",), ("cudnnSoftmaxForward",))
    assert (soft.output, soft.buffers["probs"].shape, soft.buffers["probs"].role) == ("probs", (3, 2), "act")


def test_folded_conv_without_bias_and_a_trained_linear_batch_norm_without_activation():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, bias=False, rng=0), nn.BatchNorm2d(2), nn.Flatten(),
                          nn.Linear(8, 3, rng=0), nn.BatchNorm1d(3), nn.Linear(3, 2, rng=0))
    infer = _build_plan(model, (1, 4, 4), 2, False, {})[0]
    assert _steps(infer)[:2] == [
        ("fold_batch_norm", "1 folded into 0", ("0.weight", "1.weight", "1.bias", "1.running_mean", "1.running_var"),
         ("wfold0", "bfold0"), ("fold_batch_norm_kernel",)),
        ("conv_bias_act", "0 forward + folded bias", ("x", "wfold0", "bfold0"), ("a0",), CONV)]
    assert infer.steps[0].args["bias"] is None and infer.steps[1].args == dict(
        stride=(1, 1), padding=(0, 0), bias="bfold0", act=0, slope=0.0)
    assert infer.steps[3].name == "3 forward + folded bias" and infer.steps[3].args == dict(bias="bfold2", act=0)
    assert infer.steps[3].reads == ("a1", "wfold2", "bfold2")          # the folded bias: Lt's epilogue
    train = _build_plan(model, (1, 4, 4), 2, True, {})[0]
    kinds = {s.name: (s.kind, s.reads, s.writes) for s in train.steps}
    assert kinds["4 batch_norm"][0] == "bn_act_forward"
    assert kinds["4 batch_norm backward"] == ("bn_act_backward", ("a3", "g4", "4.weight", "bnmean4", "bnistd4"),
                                              ("g3", "d:4.weight", "d:4.bias"))
    first = kinds["1 batch_norm backward"]        # the first weight is before it: its dx is needed
    assert first[2] == ("g0", "d:1.weight", "d:1.bias")
    bn_first = _build_plan(nn.Sequential(nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(16, 2, rng=0)),
                           (1, 4, 4), 2, True, {})[0]
    step = [s for s in bn_first.steps if s.kind == "bn_act_backward"][0]
    assert step.writes == ("d:0.weight", "d:0.bias") and step.args["dx"] is None and step.args["y"] is None


def test_the_bias_reduction_and_batch_norm_kernels_at_their_block_boundaries():
    chunk = lower.ACT_BACKWARD_CHUNK
    assert chunk == 1024 and lower.BN_IN_BLOCK_CHANNELS == 4096
    assert lower._act_backward_kernels((2, 4, 16, 32), True) == ("act_backward_partial_kernel",)       # 1024 each
    assert lower._act_backward_kernels((2, 4, 16, 33), True) == ("act_backward_partial_kernel", "bias_sum_kernel")
    assert lower._act_backward_kernels((1025, 3), True) == ("act_backward_partial_kernel", "bias_sum_kernel")
    assert lower._act_backward_kernels((1024, 3), True) == ("act_backward_partial_kernel",)
    assert lower._act_backward_kernels((2, 4, 16, 33), False) == ("act_backward_kernel",)
    assert lower._bn_kernels(4096) == ("bn_stats_partial_kernel", "bn_apply_kernel")
    assert lower._bn_kernels(4097) == ("bn_stats_partial_kernel", "bn_stats_finalize_kernel", "bn_apply_kernel")
    assert lower._bn_kernels(4096, backward=True) == ("bn_grad_partial_kernel", "bn_dx_kernel")
    assert lower._bn_kernels(4097, True) == ("bn_grad_partial_kernel", "bn_grad_finalize_kernel", "bn_dx_kernel")
    # in a plan: a conv's bias gradient over 2 * 64 * 65 values per channel needs the second kernel
    plan = _build_plan(nn.Sequential(nn.Conv2d(1, 2, 1, rng=0), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 64 * 65, 2)),
                       (1, 64, 65), 2, True, {})[0]
    assert [s.kernels for s in plan.steps if s.name == "0 act + bias backward"] == [
        ("act_backward_partial_kernel", "bias_sum_kernel")]


def test_training_refuses_an_output_that_is_not_n_by_classes():
    with pytest.raises(ValueError, match=r"output is \(2, 3, 2, 2\); cross-entropy needs \(N, classes\)"):
        _build_plan(nn.Sequential(nn.Conv2d(1, 3, 3, rng=0)), (1, 4, 4), 2, True, {})


def test_param_and_buffer_names_in_layer_order():
    groups = passes.fuse(trace(small(), (1, 6, 6), 2), training=False)
    assert [n for n, _ in lower.param_names(groups)] == ["0.weight", "0.bias", "2.weight", "5.weight", "5.bias",
                                                          "8.weight", "9.weight", "9.bias"]
    assert [n for n, _ in lower.buffer_names(groups)] == ["5.running_mean", "5.running_var"]
    model = chained()
    groups = passes.fuse(trace(model, (1, 4, 4), 2), training=False)
    names = lower.buffer_names(groups)
    assert [n for n, _ in names] == ["5.running_mean", "5.running_var"]
    assert names[0][1] is model[5].running_mean and names[1][1] is model[5].running_var
    assert [p for _, p in lower.param_names(groups)] == [model[0].weight, model[0].bias, model[4].weight,
                                                          model[4].bias, model[5].weight, model[5].bias, model[7].weight]


# ------------------------------------------------------------------------------------------ memory
def _lives(plan):
    """{arena root buffer: (first step, last step)}, computed here: a view's use is its root's."""
    def root(n):
        while plan.buffers[n].alias_of:
            n = plan.buffers[n].alias_of
        return n
    lives = {}
    for i, s in enumerate(plan.steps):
        for n in s.reads + s.writes:
            r = root(n)
            if plan.buffers[r].role in ARENA_ROLES:
                f, l = lives.get(r, (i, i))
                lives[r] = (min(f, i), max(l, i))
    return lives


def _padded(plan, n):
    return -(-int(np.prod(plan.buffers[n].shape)) * 4 // ALIGN) * ALIGN


PLANS = [(small, (1, 6, 6), 2, True), (small, (1, 6, 6), 3, False), (chained, (1, 4, 4), 1, False),
         (chained, (1, 4, 4), 5, True)]


@pytest.mark.parametrize("make, shape, batch, training", PLANS)
def test_memory_plan_is_the_greedy_lowest_offset_plan(make, shape, batch, training):
    plan = _plan(make, shape, batch, training)
    lives = _lives(plan)
    order = sorted(lives, key=lambda n: (-plan.buffers[n].nbytes, n))
    placed = []
    for n in order:
        f, l = lives[n]
        off, size = plan.buffers[n].offset, _padded(plan, n)
        assert off % ALIGN == 0, n
        live = [(o, e) for m, o, e, f2, l2 in placed if f2 <= l and f <= l2]
        assert all(off + size <= o or e <= off for o, e in live), (n, off, live)
        candidates = [0] + [e for _, e in live]
        lowest = min(c for c in candidates if all(c + size <= o or e <= c for o, e in live))
        assert off == lowest, (n, off, lowest)
        placed.append((n, off, off + size, f, l))
    assert plan.arena_bytes == max(e for _, _, e, _, _ in placed)
    for name, buf in plan.buffers.items():       # views, parameters, inputs, control: no arena offset
        assert (buf.offset is not None) == (name in lives), name
    total = sum(_padded(plan, n) for n in lives)
    assert plan.log[-1] == f"memory: {len(lives)} arena buffers, {total:,} B without reuse -> {plan.arena_bytes:,} B"
    assert plan.arena_bytes < total


@pytest.mark.parametrize("make, shape, batch, training", PLANS)
def test_memory_off_gives_every_buffer_its_own_bytes(make, shape, batch, training):
    plan = _plan(make, shape, batch, training, memory=False)
    lives = _lives(plan)
    order = sorted(lives, key=lambda n: (-plan.buffers[n].nbytes, n))
    end = 0
    for n in order:
        assert plan.buffers[n].offset == end, n
        end += _padded(plan, n)
    assert plan.arena_bytes == end
    assert plan.log[-1] == (f"memory: {len(lives)} arena buffers, {end:,} B without reuse -> {end:,} B"
                            " (reuse switched off)")


def test_an_empty_plan_has_no_arena():
    plan = Plan("infer", 1, [])
    plan.buffer("x", (1, 3), role="input")
    passes.plan_memory(plan)
    assert plan.arena_bytes == 0 and plan.log == ["memory: 0 arena buffers, 0 B without reuse -> 0 B"]
    assert "arena:" not in plan.explain()


# ------------------------------------------------------------------------------------------ explain
STEP = re.compile(r"^ +(\d+)\. (.+?) +(\w+) +\[(.*)\]  (.*) -> (.*?)(?:  \(timed, us, fastest first: (.*)\))?$")
BUF = re.compile(r"^  (\S+) +(\(.*?\)) +(\w+) +([\d,]+) B  (.*)$")


@pytest.mark.parametrize("make, shape, batch, training", PLANS)
def test_explain_prints_what_the_plan_holds(make, shape, batch, training):
    plan = _plan(make, shape, batch, training)
    plan.steps[1].args["timed_us"] = {"cudnn": 12.5, "direct": 7.25}
    lines = plan.explain().split("\n")
    assert str(plan) == plan.explain()
    kernels = sum(len(s.kernels) for s in plan.steps)
    mode = "train" if training else "infer"
    assert lines[0] == (f"plan ({mode}, batch {batch}): {len(plan.nodes)} layers, {len(plan.steps)} steps, "
                        f"{kernels} kernels per call")
    assert lines[1] == "layers:"
    for node, line in zip(plan.nodes, lines[2:]):
        parts = line.split()
        assert parts[:2] == [node.name, node.op], line
        assert f"{node.in_shape}" in line and line.split(" -> ")[1].startswith(str(node.out_shape)), line
        for k, v in node.attrs.items():
            assert f" {k}={v}" in line, (line, k)
        assert line.index(node.op) == 2 + 15 and line.index(str(node.in_shape)) == 2 + 15 + 17, line
    at = 2 + len(plan.nodes)
    assert lines[at] == "steps:"
    for i, s in enumerate(plan.steps):
        m = STEP.match(lines[at + 1 + i])
        assert m, lines[at + 1 + i]
        assert (int(m[1]), m[2], m[3], tuple(m[4].split(" + ")), tuple(m[5].split(", ")), tuple(m[6].split(", "))) \
            == (i, s.name, s.kind, s.kernels, s.reads, s.writes)
        assert (m[7] is None) == (i != 1) and (i != 1 or m[7] == "direct 7.25, cudnn 12.5")
    at += 1 + len(plan.steps)
    assert lines[at] == "buffers:"
    for j, (name, buf) in enumerate(plan.buffers.items()):
        m = BUF.match(lines[at + 1 + j])
        assert m, lines[at + 1 + j]
        size = int(np.prod(buf.shape)) * (4 if buf.dtype in ("float32", "int32") else 0)
        assert (m[1], m[2], m[3], int(m[4].replace(",", ""))) == (name, str(buf.shape), buf.dtype, size)
        where = (f"view of {buf.alias_of}" if buf.alias_of else f"arena +{buf.offset}" if buf.offset is not None
                 else buf.role)
        assert m[5] == where
    at += 1 + len(plan.buffers)
    own = sum(int(np.prod(b.shape)) * 4 for b in plan.buffers.values() if b.role in ARENA_ROLES and not b.alias_of)
    assert lines[at] == (f"arena: {plan.arena_bytes:,} B for {own:,} B of activations and gradients "
                         f"(reused by liveness)")
    assert lines[at + 1] == "passes:"
    assert lines[at + 2:] == [f"  {entry}" for entry in plan.log]


def test_explain_without_memory_plan_or_log():
    groups = passes.fuse(trace(chained(), (1, 4, 4), 1), enabled=False)
    plan = lower.lower_inference(groups, trace(chained(), (1, 4, 4), 1), 1)
    text = plan.explain()
    assert "arena:" not in text and "passes:" not in text
    assert "  a0                 (1, 3, 2, 2)         float32          48 B  act" in text.split("\n")
    assert text.split("\n")[-1].startswith("  a7 ")


def test_ir_refuses_a_buffer_defined_twice_and_an_unknown_buffer():
    plan = Plan("infer", 1, [])
    assert plan.buffer("x", (1, np.int64(3))) == "x" and plan.buffers["x"].shape == (1, 3)
    assert type(plan.buffers["x"].shape[1]) is int
    with pytest.raises(ValueError, match=r"plan: buffer 'x' defined twice"):
        plan.buffer("x", (1,))
    with pytest.raises(ValueError, match=r"plan: step 's' uses unknown buffer 'y'"):
        plan.add("k", "s", ("x",), ("y",), ())
    with pytest.raises(ValueError, match=r"unknown buffer 'z'"):
        plan.add("k", "s", ("z",), ("x",), ())
    assert plan.steps == []
    plan.add("k", "s", ["x"], ["x"], ["a", "b"], q=1)
    s = plan.steps[0]
    assert (s.reads, s.writes, s.kernels, s.args) == (("x",), ("x",), ("a", "b"), {"q": 1})
    assert plan.kernel_count() == 2
    assert nbytes((2, 3)) == 24 and nbytes((2, 3), "int32") == 24 and nbytes((5,), "float64") == 40
    assert nbytes(()) == 4
    b = plan.buffers["x"]
    assert (b.dtype, b.role, b.alias_of, b.offset, b.nbytes) == ("float32", "act", None, None, 12)


def test_memory_reuses_a_gap_of_exactly_the_buffer_s_size():
    """A lives at step 0, B at steps 0-1, C at steps 1-2 (512 B each, placed A, B, C): B goes above A, and C
    fits exactly in the 512 B below B that A no longer uses."""
    plan = Plan("infer", 1, [])
    for name in "ABC":
        plan.buffer(name, (128,))
    plan.add("k", "s0", ("A",), ("B",), ())
    plan.add("k", "s1", ("B",), ("C",), ())
    plan.add("k", "s2", ("C",), ("C",), ())
    passes.plan_memory(plan)
    assert [plan.buffers[n].offset for n in "ABC"] == [0, 512, 0] and plan.arena_bytes == 1024
    assert plan.log == ["memory: 3 arena buffers, 1,536 B without reuse -> 1,024 B"]


def test_names_and_kernels_of_the_remaining_step_kinds():
    """Linear + bias + activation, a bias-free Linear + activation, activations and pools standing alone,
    batch norm in inference with and without an activation, dropout: each step's name and kernels."""
    model = nn.Sequential(nn.Linear(6, 4, rng=0), nn.ReLU(), nn.Linear(4, 4, bias=False, rng=0), nn.Tanh(),
                          nn.BatchNorm1d(4), nn.Sigmoid(), nn.Dropout(0.5, rng=1), nn.Tanh(), nn.BatchNorm1d(4),
                          nn.Linear(4, 3, rng=0))
    infer = _build_plan(model, (6,), 2, False, {"fuse": False})[0]
    fused = _build_plan(model, (6,), 2, False, {})[0]
    train = _build_plan(model, (6,), 2, True, {"fuse": False})[0]
    act, bnk = ("bias_act_forward_kernel",), ("cudnnBatchNormalizationForwardInference",)
    assert [(s.name, s.kernels) for s in fused.steps][:5] == [
        ("0 forward + bias + relu", ("cublasLtMatmul",)), ("2 forward", ("cublasLtMatmul",)), ("2 tanh", act),
        ("4 batch_norm", bnk), ("4 sigmoid", act)]
    assert [(s.name, s.kernels) for s in infer.steps][:7] == [
        ("0 forward + bias", ("cublasLtMatmul",)), ("1 relu", act), ("2 forward", ("cublasLtMatmul",)),
        ("3 tanh", act), ("4 batch_norm", bnk), ("5 sigmoid", act), ("7 tanh", act)]
    named = {s.name: s for s in train.steps}
    assert named["6 dropout"].kernels == ("dropout_step_kernel",)
    assert named["6 dropout backward"].kernels == ("mul_kernel",) and named["6 dropout backward"].kind == "mul"
    assert named["7 tanh backward"].kernels == ("act_backward_kernel",)
    assert named["1 relu backward"].kernels == ("act_backward_kernel",)
    pools = nn.Sequential(nn.Conv2d(1, 2, 3, rng=0), nn.AvgPool2d(2), nn.MaxPool2d(1), nn.GlobalAvgPool2d(),
                          nn.Flatten(), nn.Linear(2, 2, rng=0))
    named = {s.name: s for s in _build_plan(pools, (1, 6, 6), 2, True, {})[0].steps}
    assert named["1 avg_pool backward"].kernels == ("cudnnPoolingBackward",)
    assert named["3 global_avg_pool backward"].kernels == ("cudnnPoolingBackward",)
    assert named["3 global_avg_pool"].kernels == ("cudnnPoolingForward",) and named["3 global_avg_pool"].kind == \
        "avg_pool_forward"
    assert named["2 max_pool backward"].kernels == ("max_pool_backward_kernel",)


def test_a_step_timed_many_ways_shows_the_four_fastest_and_how_many_more():
    """The executor times up to 13 ways of a convolution: the printout keeps the four fastest (the first is the
    one that runs) and counts the rest; ``step.args["timed_us"]`` keeps them all."""
    plan = _plan(*PLANS[0])
    plan.steps[0].args["timed_us"] = {**{f"igemm{i}": 30.0 - i for i in range(9)}, "library": 25.5}
    line = str(plan.steps[0])
    assert line.endswith("(timed, us, fastest first: igemm8 22, igemm7 23, igemm6 24, igemm5 25; 6 more)"), line
