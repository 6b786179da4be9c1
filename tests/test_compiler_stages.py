"""The compiler's stages on the CPU: trace, fusion, lowering, memory planning, the printout, argument errors, and a
CPU model on the reference loop (test_compiler.py holds the zoo of the tests and the GPU comparisons)."""
import numpy as np
import pytest

import cydnn
from cydnn import compiler, nn, optim
from cydnn.compiler import passes
from cydnn.compiler.trace import Unsupported, trace

from test_compiler import ZOO, _plan, lenet_widths, mlp


def test_trace_infers_every_shape_as_the_reference_forward_does():
    for name, (make, shape) in ZOO.items():
        model = make()
        x = np.zeros((2,) + shape, np.float32)
        nodes = trace(model, shape, 2)
        for node in nodes:
            y = node.module(x)
            assert tuple(y.shape) == node.out_shape, (name, node)
            x = y


def test_trace_refuses_what_it_does_not_take_naming_the_layer():
    class Odd(nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(Unsupported, match=r"layer 1 is a Odd"):
        trace(nn.Sequential(nn.Flatten(), Odd()), (1, 28, 28), 1)
    with pytest.raises(Unsupported, match=r"layer 1: Linear\(100, 10\) cannot take input \(4, 784\)"):
        trace(nn.Sequential(nn.Flatten(), nn.Linear(100, 10)), (1, 28, 28), 4)
    with pytest.raises(Unsupported, match=r"layer 0: conv_forward: kernel \(5, 5\) is larger"):
        trace(nn.Sequential(nn.Conv2d(1, 2, 5)), (1, 3, 3), 1)
    with pytest.raises(Unsupported, match="not Model"):
        class Model(nn.Module):
            pass
        trace(Model(), (1, 2, 2), 1)


def test_fusion_groups_conv_and_linear_with_their_activation_and_can_be_switched_off():
    nodes = trace(lenet_widths(), (1, 28, 28), 4)
    log = []
    groups = passes.fuse(nodes, log=log)
    assert [(g["node"].op, g["act"].op if g["act"] else None) for g in groups] == [
        ("conv2d", "relu"), ("max_pool", None), ("conv2d", "relu"), ("max_pool", None), ("flatten", None),
        ("linear", "relu"), ("linear", None)]
    assert len(log) == 3
    assert all(g["act"] is None for g in passes.fuse(nodes, enabled=False))


def test_memory_plan_never_overlaps_two_live_buffers_and_saves_bytes():
    for name, (make, shape) in ZOO.items():
        plan = _plan(make, shape)
        life = passes._lifetimes(plan)
        items = [(n, plan.buffers[n].offset, plan.buffers[n].offset + plan.buffers[n].nbytes, *life[n]) for n in life]
        for a in items:
            assert a[1] % passes.ALIGN == 0
            for b in items:
                if a[0] < b[0] and not (a[4] < b[3] or b[4] < a[3]):      # both live at some step
                    assert a[2] <= b[1] or b[2] <= a[1], (name, a, b)
        unshared = _plan(make, shape, memory=False).arena_bytes
        assert plan.arena_bytes <= unshared, name
        if name in ("cnn32", "lenet_widths"):     # deep enough for early activations to die before late ones
            assert plan.arena_bytes < unshared, name


def test_training_plan_reads_only_what_an_earlier_step_wrote():
    for name, (make, shape) in ZOO.items():
        plan = _plan(make, shape)
        written = {"x", "labels", "counters", "lr", "loss"} | {n for n, b in plan.buffers.items()
                                                              if b.role in ("param", "param_grad")}
        alias = {n: b.alias_of for n, b in plan.buffers.items() if b.alias_of}
        for step in plan.steps:
            for r in step.reads:
                root = r
                while root in alias:
                    root = alias[root]
                assert root in written or r in written, (name, step.name, r)
            for w in step.writes:
                written.add(w)
                root = w
                while root in alias:
                    root = alias[root]
                written.add(root)
        kinds = [s.kind for s in plan.steps]
        assert kinds[-2:] == ["flat_update", "step_bookkeeping"]
        # the first layer's input gradient is never computed
        assert "g-1" not in plan.buffers


def test_explain_lists_layers_steps_kernels_and_bytes():
    text = _plan(mlp, (1, 28, 28), batch=64).explain()
    assert "plan (train, batch 64)" in text
    assert "fuse: 1 (linear) + 2 (relu) -> cuBLASLt epilogue" in text
    assert "cublasLtMatmul" in text and "flat_update_kernel" in text
    assert "arena:" in text and "B" in text
    one = _plan(mlp, (1, 28, 28), batch=1, training=False)
    assert one.kernel_count() == 2        # gemm + bias + relu, gemm + bias (cuBLASLt epilogues)


def test_fusion_removes_kernels():
    for name, (make, shape) in ZOO.items():
        fused = _plan(make, shape, training=False).kernel_count()
        unfused = _plan(make, shape, training=False, fuse=False)
        # unfused lowering keeps the bias in the library call and the activation apart: never fewer kernels
        assert fused <= unfused.kernel_count() + 0, name


def test_compile_argument_errors_before_any_gpu_work():
    model = mlp()
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs batch_size"):
        compiler.compile(model, opt)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        compiler.compile(model, opt, batch_size=0)
    with pytest.raises(ValueError, match="give an optimizer"):
        compiler.compile(model)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        compiler.compile("model", input_shape=(1, 28, 28))
    with pytest.raises(Unsupported, match="cannot take input"):
        compiler.compile(model, input_shape=(1, 20, 20))


def test_cpu_model_runs_the_reference_loop_with_the_reason():
    model = mlp()
    opt = optim.SGD(model.parameters(), lr=0.1)
    step = cydnn.compile(model, opt, batch_size=4)
    assert step.info()["mode"] == "reference" and "'cpu'" in step.info()["reason"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
    y = np.array([1, 2, 3, 4])
    ref = mlp()
    ref_opt = optim.SGD(ref.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    want = loss_fn(ref(x), y)
    ref.backward(loss_fn.backward())
    ref_opt.step()
    got = step(x, y)
    assert float(got) == pytest.approx(float(want))
    for (_, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data)
