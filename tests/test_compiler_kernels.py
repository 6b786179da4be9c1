"""The kernels a plan lists are the kernels its calls launch (CPU: the plan against the C sources).

``Plan.explain()`` is how a reader learns what a step costs: every name it shows must be a kernel
of cpp/*.cu (a ``__global__`` function the step's C function launches, ``<<<`` or ``CYDNN_LAUNCH``) or a cuDNN / cuBLAS entry
point that C function calls, and the counts must follow the layers.  (The first version of the
activation-backward step named a ``bias_act_backward_kernel`` that does not exist: the call
launches ``act_backward_partial_kernel`` and, when a channel spans several blocks, ``bias_sum_kernel``;
without a bias, ``act_backward_kernel`` alone.)
"""
import math
import pathlib
import re

import pytest

from cydnn import nn
from cydnn.compiler import lower
from cydnn.compiler.compiled import _build_plan

from test_compiler import ZOO, mlp

CPP = pathlib.Path(__file__).resolve().parents[1] / "cpp"
SOURCES = {p.name: p.read_text() for p in CPP.glob("*.cu")}
GLOBALS = {m for text in SOURCES.values()
           for m in re.findall(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?(?:void\s+)?(\w+)\s*\(", text)}
# The C function each step kind calls (python/cydnn/compiler/executor.py's DISPATCH) lives in this file.
FILE_OF = {"linear_forward": "linear.cu", "linear_backward": "linear.cu", "conv_forward": "conv.cu",
           "conv_bias_act": ("conv.cu", "compiled.cu", "compiled_act.cu"), "conv_backward": "conv.cu",
           "bias_act_forward": "compiled_act.cu", "bias_act_backward": "compiled_act.cu",
           "max_pool_act_backward": "compiled_act.cu", "linear_xent": "compiled_head.cu",
           "max_pool_forward": "pool.cu", "avg_pool_forward": "pool.cu", "max_pool_backward": "pool.cu",
           "avg_pool_backward": "pool.cu", "batch_norm_forward": "batchnorm.cu",
           "bn_act_forward": "compiled_norm.cu", "bn_act_backward": "compiled_norm.cu",
           "softmax_cross_entropy": "loss.cu", "softmax": "loss.cu", "flat_update": "compiled.cu",
           "step_bookkeeping": "compiled.cu", "dropout_step": "compiled.cu", "fold_batch_norm": "compiled.cu",
           "mul": "activation.cu"}


def _plans():
    nets = dict(ZOO, mlp_dropout=(lambda: mlp(dropout=0.5), (1, 28, 28)))
    for name, (make, shape) in sorted(nets.items()):
        for training in (True, False):
            for batch in (2, 64):
                yield f"{name}-{'train' if training else 'infer'}-{batch}", _build_plan(make(), shape, batch,
                                                                                        training, {})[0]


PLANS = dict(_plans())


@pytest.mark.parametrize("key", sorted(PLANS))
def test_every_kernel_a_plan_names_is_launched_or_called_by_its_step(key):
    for step in PLANS[key].steps:
        files = FILE_OF[step.kind]
        text = "".join(SOURCES[f] for f in ((files,) if isinstance(files, str) else files))
        for kernel in step.kernels:
            if kernel.startswith(("cudnn", "cublas")):
                assert re.search(rf"\b{kernel}\s*\(", text), (key, step.kind, kernel)
            else:
                assert kernel in GLOBALS, (key, step.kind, kernel)
                # launched: kernel<<<...>>> or CYDNN_LAUNCH(kernel, ...) (cpp/launch.cuh), templates too
                assert re.search(rf"\b{kernel}\s*(<[\w\s,]*>)?<<<|\bCYDNN_LAUNCH\(\s*{kernel}\s*(<[\w\s,]*>)?\s*,",
                                 text), (key, step.kind, kernel)


def test_the_activation_backward_names_the_bias_sum_only_when_a_channel_spans_several_blocks():
    # without a bias (a convolution followed by batch norm): one element-wise kernel, whatever the size
    assert lower._act_backward_kernels((64, 6, 24, 24), False) == ("act_backward_kernel",)
    assert lower._act_backward_kernels((2, 16, 8, 8), False) == ("act_backward_kernel",)
    assert lower._act_backward_kernels((2, 16, 8, 8), True) == ("act_backward_partial_kernel",)     # 128 values a channel
    # 64 * 24 * 24 = 36,864 values a channel: 36 blocks of 1,024, their partial sums added by a second kernel
    assert lower._act_backward_kernels((64, 6, 24, 24), True) == ("act_backward_partial_kernel", "bias_sum_kernel")
    n = lower.ACT_BACKWARD_CHUNK                    # exactly one block's worth: still one kernel
    assert lower._act_backward_kernels((n, 3), True) == ("act_backward_partial_kernel",)
    assert lower._act_backward_kernels((n + 1, 3), True)[-1] == "bias_sum_kernel"
    assert re.search(rf"kChunk = {lower.ACT_BACKWARD_CHUNK};", SOURCES["compiled_act.cu"])


def test_batch_norm_names_its_finalize_kernels_only_for_layers_too_wide_for_a_block():
    assert re.search(rf"kInBlockChannels = {lower.BN_IN_BLOCK_CHANNELS};", SOURCES["compiled_norm.cu"])
    n = lower.BN_IN_BLOCK_CHANNELS
    assert lower._bn_kernels(n) == ("bn_stats_partial_kernel", "bn_apply_kernel")
    assert lower._bn_kernels(n + 1) == ("bn_stats_partial_kernel", "bn_stats_finalize_kernel", "bn_apply_kernel")
    assert lower._bn_kernels(n, backward=True) == ("bn_grad_partial_kernel", "bn_dx_kernel")
    assert lower._bn_kernels(n + 1, backward=True)[1] == "bn_grad_finalize_kernel"


@pytest.mark.parametrize("key", sorted(PLANS))
def test_the_kernel_count_is_the_sum_over_the_steps(key):
    plan = PLANS[key]
    head = plan.explain().splitlines()[0]
    count = sum(len(s.kernels) for s in plan.steps)
    assert f"{len(plan.steps)} steps, {count} kernels per call" in head, head


def test_a_linear_layer_costs_one_gemm_forward_and_two_backward_but_the_first():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3))
    plan = _build_plan(model, (1, 3, 4), 64, True, {})[0]
    gemms = {s.name: s.kernels.count("cublasLtMatmul") for s in plan.steps if "cublasLtMatmul" in s.kernels}
    # forward: one GEMM per layer; backward: dW and dx, but the first layer's input gradient is not needed.  The
    # last layer, the loss and their backward are the head (passes.fuse_head): two kernels of their own, or the
    # steps it replaced (timed against them when bound)
    assert gemms == {"1 forward + bias + relu": 1, "1 backward": 1}
    head = next(s for s in plan.steps if s.kind == "linear_xent")
    assert head.name == "3 forward + loss + 3 backward"
    assert head.kernels == ("linear_xent_rows_kernel", "linear_xent_grads_kernel")
    assert {s.name: s.kernels.count("cublasLtMatmul") for s in head.args["unfused"] if "cublasLtMatmul" in s.kernels} \
        == {"3 forward + bias": 1, "3 backward": 2}
    assert math.prod((64, 5)) < lower.ACT_BACKWARD_CHUNK      # hence one activation-backward kernel
    act = next(s for s in plan.steps if s.kind == "bias_act_backward" and s.name.startswith("1 "))
    assert act.kernels == ("act_backward_partial_kernel",)
