"""The fused training step: a batch's forward, loss and backward in two kernels (cpp/fused_train.cu).

The generic training plan (lower.py) runs a library call or kernel per layer and per direction:
20-60 launches for a small network, each a trip through device memory, with ~1.5-2 us between two
kernels even inside a CUDA graph (docs/performance.md).  Where a network's activations for one image
fit in shared memory, this lowering replaces all of the forward, the loss and the backward with one
plan step of two kernels over the fused network's table (fused_net.py's :func:`describe`):

1. one thread-block cluster per image carries it through the forward, the softmax cross-entropy and
   the gradients of every layer's input, all in shared memory;
2. the batch's weight and bias gradients from what the first kernel left in L2, in a fixed order.

The optimizer update and the bookkeeping stay the plan's steps (``flat_update``, ``step_bookkeeping``).
Which cluster size runs is timed when the plan is bound (``timed_us`` in the plan's printout);
whether this plan or the generic one trains is decided by :class:`~.compiled.CompiledStep`, which runs
both from the same state, compares them and keeps the faster (``info()["fused_train"]``).

Not taken (the generic plan trains; the reason is kept): batch norm (its batch statistics), dropout
with p > 0 (its masks), kernels other than square 1, 2, 3, 4, 5 or 7, activations that do not fit in
shared memory, a network without a final (N, classes) output.
"""
import os

import numpy as np

from .. import _C
from . import fused_net
from .executor import DISPATCH, TRIAL_ROUNDS, least_times, time_calls
from .ir import Plan
from .lower import LR_TABLE, param_names
from .passes import plan_memory

__all__ = ["describe_training", "lower_fused_training", "mode", "trial"]

#: cluster sizes timed when the step is bound (blocks per image)
CLUSTERS = (1, 2, 4)
_KERNELS = (1, 2, 3, 4, 5, 7)


def mode(environ=None):
    """``$CYDNN_FUSED_TRAIN``: ``auto`` (default: the faster of the two plans, by measurement), ``force``
    (the fused step wherever it takes the network), ``off``."""
    value = (os.environ if environ is None else environ).get("CYDNN_FUSED_TRAIN", "auto").strip() or "auto"
    if value not in ("auto", "force", "off"):
        raise ValueError(f"CYDNN_FUSED_TRAIN must be auto, force or off, got {value!r}")
    return value


def describe_training(nodes):
    """The fused network's layers for training ``nodes``, or a string saying why the fused step does not
    take them."""
    for node in nodes:
        if node.op == "dropout" and node.module.p > 0:
            return f"layer {node.name}: dropout (p={node.module.p}) draws masks; the fused step has none"
        if node.op == "batch_norm":
            return f"layer {node.name}: batch norm in training uses the batch's statistics; the fused step has none"
        if node.op == "conv2d":
            kh, kw = node.module.weight.shape[2:]
            if kh != kw or kh not in _KERNELS:
                return f"layer {node.name}: a {kh}x{kw} kernel (the fused step takes square 1, 2, 3, 4, 5 or 7)"
    if len(nodes[-1].out_shape) != 2:
        return f"the network's output is {nodes[-1].out_shape}; cross-entropy needs (N, classes)"
    layers = fused_net.describe(nodes)
    if isinstance(layers, str):
        return layers
    if not any(layer["op"] in ("conv", "linear") for layer in layers):
        return "the network has no weights to train"
    return layers


def lower_fused_training(layers, nodes, batch, log=()):
    """A training plan of three steps: the fused forward + loss + backward, the flat update, bookkeeping."""
    plan = Plan("train", batch, nodes, log=list(log) + [f"fused step: {len(layers)} table layers in two kernels"])
    plan.buffer("x", (batch,) + nodes[0].in_shape[1:], role="input")
    plan.buffer("labels", (batch,), "int32", role="label")
    plan.buffer("loss", (), role="output")
    plan.buffer("counters", (6,), "int32", role="control")
    plan.buffer("lr", (LR_TABLE,), role="control")
    groups = [{"node": n} for n in nodes]
    params = param_names(groups)
    for name, p in params:
        plan.buffer(name, p.shape, role="param")
        plan.buffer("d:" + name, p.shape, role="param_grad")
    plan.buffer("logits", nodes[-1].out_shape, role="scratch")
    names, grads = tuple(n for n, _ in params), tuple("d:" + n for n, _ in params)
    plan.add("fused_train", "forward + loss + backward", ("x", "labels") + names, ("loss", "logits") + grads,
             ("fused_train_kernel", "fused_weight_kernel"), layers=layers)
    plan.add("flat_update", "optimizer update", grads + ("lr", "counters"), names, ("flat_update_kernel",))
    plan.add("step_bookkeeping", "bookkeeping", ("logits", "labels", "loss"), ("counters",), ("bookkeeping_kernel",))
    plan_memory(plan)
    return plan


def _bind_layer(layer, arrays, ranks):
    d = fused_net.FusedNetwork._bind(layer, ranks)
    node = layer.get("node")
    grads = None
    if node is not None and layer["op"] in ("conv", "linear"):
        d["weight"] = arrays[f"{node.name}.weight"]
        has_bias = node.module._parameters.get("bias") is not None
        d["bias"] = arrays[f"{node.name}.bias"] if has_bias else None
        grads = (arrays[f"d:{node.name}.weight"], arrays[f"d:{node.name}.bias"] if has_bias else None)
    return d, grads


def _round4(n):
    return -(-n // 4) * 4


def _table(layers, arrays, ranks, in_size, out_size):
    """The fused network's table over ``arrays`` for clusters of ``ranks`` blocks, and the gradients per layer.
    The convolutions' weight staging gets what shared memory the train kernel leaves: the image, every layer's
    output and two gradient buffers of the widest (cpp/fused_train.cu's layout)."""
    bound, grads = zip(*(_bind_layer(layer, arrays, ranks) for layer in layers))
    sizes = [fused_net._size(layer) for layer in layers]
    used = _round4(in_size) + sum(_round4(n) for n in sizes) + 2 * _round4(max([in_size] + sizes))
    room = fused_net.SMEM_LIMIT // 4 - used
    if room < 0:
        raise ValueError(f"fused_train_step: one image's activations and gradients need {4 * used} bytes of shared "
                         f"memory, more than {fused_net.SMEM_LIMIT}")
    dgrad = [d["k"] * d["kh"] * d["kw"] * _round4(-(-d["c"] // ranks) + 4) for d in bound
             if d["op"] == "conv" and d["sh"] == d["sw"] == 1 and d["kh"] == d["kw"] and d["kh"] in (1, 3, 5)]
    wcap = min(room, max([fused_net._staged(d, ranks) for d in bound] + dgrad + [0]))
    return _C.FusedNet(list(bound), in_size, out_size, False, wcap), list(grads)


def dispatch(b, s):
    """The executor's entry for a ``fused_train`` step: the table over the bound arrays, each cluster size
    timed once (the kernels write only gradients, logits and the loss: timing changes no parameter)."""
    layers = s.args["layers"]
    x, logits = b["x"], b["logits"]
    batch = x.shape[0]
    in_size, out_size = x.size // batch, logits.size // batch
    steps, times, reasons = {}, {}, {}
    for ranks in CLUSTERS:
        try:
            table, grads = _table(layers, b, ranks, in_size, out_size)
            steps[ranks] = _C.FusedTrain(table, batch, ranks, x, b["labels"], logits, b["loss"], grads)
        except (_C.CydnnError, ValueError) as e:
            reasons[ranks] = str(e)
    if not steps:
        raise _C.CydnnError(f"fused_train_step: no cluster size takes the network: {reasons}")
    forced = os.environ.get("CYDNN_FUSED_TRAIN_CLUSTER")
    if forced and int(forced) in steps:
        chosen = int(forced)
    else:
        times = least_times({ranks: step.enqueue for ranks, step in steps.items()}, 10, TRIAL_ROUNDS,
                            timer=time_calls)
        chosen = min(times, key=times.get)
    s.args["cluster"] = chosen
    s.args["timed_us"] = {f"cluster {r}": round(1e6 * t, 1) for r, t in times.items()}
    if reasons:
        s.args["refused"] = reasons
    return steps[chosen].enqueue, ()


#: the fused step is kept when it measures under this fraction of the plan's time: a win inside the timing's
#: noise (LeNet 16/32 on the H100: 205.7 against 209.8 us) would flip between runs, and with it the step's
#: rounding (Adam carries a rounding difference on: docs/performance.md, session 20)
KEEP_BELOW = 0.97


def trial(plan_runner, fused_runner, snapshot, flat):
    """(the runner to keep, what was found): one step of the generic plan and one of the fused step from the
    same state (``snapshot()`` restores it; ``flat``: the step's FlatState), their loss and gradients compared,
    then both timed; the fused one is kept where it agrees and is faster by more than 3 % (``KEEP_BELOW``;
    ``$CYDNN_FUSED_TRAIN=force``: where it agrees)."""
    restore = snapshot()
    out = []
    for r in (plan_runner, fused_runner):
        try:
            r.launch()
            out.append((float(r.bound.arrays["loss"].numpy()), flat.flat_grad.numpy()))
        finally:
            restore()          # a failed launch leaves the state as the call found it
    (lp, gp), (lf, gf) = out
    scale = float(np.max(np.abs(gp))) if gp.size else 0.0
    gdiff = float(np.max(np.abs(gf - gp))) if gp.size else 0.0
    found = {"used": False, "loss": (lp, lf), "max_grad_diff": gdiff}
    if not (abs(lf - lp) <= 1e-4 * max(1.0, abs(lp)) and gdiff <= 1e-3 * scale + 1e-7
            and np.all(np.isfinite(gf)) == np.all(np.isfinite(gp))):
        found["reason"] = (f"self-test: the fused step's loss {lf} / gradients (max |diff| {gdiff:.3g} of "
                           f"{scale:.3g}) differ from the plan's ({lp})")
        return plan_runner, found
    times = least_times({"plan": plan_runner.launch, "fused": fused_runner.launch}, 20, TRIAL_ROUNDS,
                        timer=time_calls, after=restore)
    found["timed_us"] = {k: round(1e6 * t, 1) for k, t in times.items()}
    use = mode() == "force" or times["fused"] < KEEP_BELOW * times["plan"]
    found["used"] = bool(use)
    if not use:
        found["reason"] = ("the plan's graph measured faster" if times["plan"] <= times["fused"] else
                           f"the fused step measured less than {100 * (1 - KEEP_BELOW):.0f} % faster")
    return (fused_runner if use else plan_runner), found


#: the executor runs a ``fused_train`` step through :func:`dispatch` (registered here, where the step is defined)
DISPATCH["fused_train"] = dispatch
