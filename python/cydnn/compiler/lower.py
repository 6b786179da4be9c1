"""Stage 2: lowering -- fused groups of layers become a :class:`~cydnn.compiler.ir.Plan` of steps.

Buffers: ``x`` the input, ``a{i}`` the output of group i, ``g{i}`` its gradient (training),
``{layer}.weight`` / ``{layer}.bias`` the parameters and ``d:{layer}.weight`` their gradients
(flat buffers the step owns), ``mask{i}`` a dropout mask, and for training ``labels``,
``loss``, ``counters``, ``lr``.  A Flatten is no step: its output is a view of its input
(likewise its gradient, and an eval-mode Dropout).

Every step is one call of the library (the reference ops' C functions, or the compiler's
kernels in cpp/compiled.cu), listed with the kernels it launches.
"""
from .ir import Plan
from .passes import ACTIVATIONS

__all__ = ["lower_inference", "lower_training", "param_names"]

_CONV_FWD = "cudnnConvolutionForward"
_GEMM = "cublasSgemm"


def param_names(groups):
    """[(buffer name, Parameter)] of every parameter, in layer order (weight, then bias)."""
    out = []
    for g in groups:
        m = g["node"].module
        for attr in ("weight", "bias"):
            p = m._parameters.get(attr)
            if p is not None:
                out.append((f"{g['node'].name}.{attr}", p))
    return out


def _params(plan, groups, training):
    for name, p in param_names(groups):
        plan.buffer(name, p.shape, role="param")
        if training:
            plan.buffer("d:" + name, p.shape, role="param_grad")


def _act_of(group):
    act = group["act"]
    if act is None:
        return 0, 0.0
    return ACTIVATIONS[act.op], float(getattr(act.module, "negative_slope", 0.0))


def _forward(plan, i, group, src, dst, training):
    """Steps computing buffer ``dst`` from ``src`` for group i; returns dst (or an alias)."""
    node = group["node"]
    op, name = node.op, node.name
    act, slope = _act_of(group)
    bias = f"{name}.bias" if node.module._parameters.get("bias") is not None else None
    if op == "flatten" or (op == "dropout" and (not training or node.module.p == 0.0)):
        plan.buffer(dst, node.out_shape, alias_of=src)
        return
    plan.buffer(dst, node.out_shape)
    if op in ("conv2d", "linear"):
        w = f"{name}.weight"
        if op == "conv2d":
            plan.add("conv_forward", f"{name} forward", (src, w), (dst,), (_CONV_FWD,),
                     stride=node.attrs["stride"], padding=node.attrs["padding"])
        else:
            plan.add("linear_forward", f"{name} forward", (src, w), (dst,), (_GEMM,))
        if bias or act:
            what = " + ".join(x for x in ("bias" if bias else "", group["act"].op if act else "") if x)
            plan.add("bias_act_forward", f"{name} {what}", (dst,) + ((bias,) if bias else ()), (dst,),
                     ("bias_act_forward_kernel",), act=act, slope=slope)
    elif op in ACTIVATIONS:
        a, s = ACTIVATIONS[op], float(getattr(node.module, "negative_slope", 0.0))
        plan.add("bias_act_forward", f"{name} {op}", (src,), (dst,), ("bias_act_forward_kernel",), act=a, slope=s)
    elif op in ("max_pool", "avg_pool"):
        kernel = "cudnnPoolingForward"
        plan.add(op + "_forward", f"{name} {op}", (src,), (dst,), (kernel,), **node.attrs)
    elif op == "dropout":
        mask = plan.buffer(f"mask{i}", node.out_shape)
        plan.add("dropout_step", f"{name} dropout", (src, "counters"), (dst, mask), ("dropout_step_kernel",),
                 p=node.module.p, seed=int(node.module._rng.integers(0, 2**63 - 1)))
    else:  # pragma: no cover -- trace() refuses what is not in its table
        raise AssertionError(f"no lowering for {op}")


def _backward(plan, i, group, x, y, dy, dx):
    """Steps computing dx (None: not needed) and the parameter gradients from dy."""
    node = group["node"]
    op, name = node.op, node.name
    act, slope = _act_of(group)
    if op == "flatten" or (op == "dropout" and node.module.p == 0.0):
        if dx is not None:
            plan.buffer(dx, node.in_shape, role="grad", alias_of=dy)
        return
    if dx is not None:
        plan.buffer(dx, node.in_shape, role="grad")
    if op in ("conv2d", "linear"):
        w, has_bias = f"{name}.weight", node.module._parameters.get("bias") is not None
        if act or has_bias:
            writes = ((dy,) if act else ()) + (("d:" + name + ".bias",) if has_bias else ())
            plan.add("bias_act_backward", f"{name} {'act + ' if act else ''}bias backward", (y, dy), writes,
                     ("bias_act_backward_kernel",), act=act, slope=slope, dx=dy if act else None,
                     dbias=("d:" + name + ".bias") if has_bias else None)
        if op == "conv2d":
            kernels = (("cudnnConvolutionBackwardData",) if dx else ()) + ("cudnnConvolutionBackwardFilter",)
            plan.add("conv_backward", f"{name} backward", (x, w, dy), ((dx,) if dx else ()) + ("d:" + w,),
                     kernels, stride=node.attrs["stride"], padding=node.attrs["padding"], dx=dx, dw="d:" + w)
        else:
            kernels = ((_GEMM,) if dx else ()) + (_GEMM,)
            plan.add("linear_backward", f"{name} backward", (x, w, dy), ((dx,) if dx else ()) + ("d:" + w,),
                     kernels, dx=dx, dw="d:" + w)
    elif dx is None:
        return
    elif op in ACTIVATIONS:
        a, s = ACTIVATIONS[op], float(getattr(node.module, "negative_slope", 0.0))
        plan.add("bias_act_backward", f"{name} {op} backward", (y, dy), (dx,), ("bias_act_backward_kernel",),
                 act=a, slope=s, dx=dx, dbias=None)
    elif op == "max_pool":
        plan.add("max_pool_backward", f"{name} max_pool backward", (x, dy), (dx,), ("max_pool_backward_kernel",),
                 **node.attrs)
    elif op == "avg_pool":
        plan.add("avg_pool_backward", f"{name} avg_pool backward", (x, y, dy), (dx,), ("cudnnPoolingBackward",),
                 **node.attrs)
    elif op == "dropout":
        plan.add("mul", f"{name} dropout backward", (dy, f"mask{i}"), (dx,), ("mul_kernel",))


def lower_inference(groups, nodes, batch, softmax=False, log=()):
    """Forward only, eval mode: ``x`` -> ``out`` (logits, or probabilities with ``softmax``)."""
    plan = Plan("infer", batch, nodes, log=list(log))
    plan.buffer("x", (batch,) + nodes[0].in_shape[1:], role="input")
    _params(plan, groups, training=False)
    src = "x"
    for i, g in enumerate(groups):
        _forward(plan, i, g, src, f"a{i}", training=False)
        src = f"a{i}"
    if softmax:
        plan.buffer("probs", plan.buffers[src].shape, role="act")
        plan.add("softmax", "softmax", (src,), ("probs",), ("cudnnSoftmaxForward",))
        src = "probs"
    plan.output = src
    return plan


def lower_training(groups, nodes, batch, log=()):
    """Forward, softmax cross-entropy, backward, one flat optimizer update, bookkeeping."""
    plan = Plan("train", batch, nodes, log=list(log))
    plan.buffer("x", (batch,) + nodes[0].in_shape[1:], role="input")
    plan.buffer("labels", (batch,), "int32", role="label")
    plan.buffer("loss", (), role="control")
    plan.buffer("counters", (6,), "int32", role="control")   # cydnnStepCounters: 24 bytes
    plan.buffer("lr", (1,), role="control")
    _params(plan, groups, training=True)
    outs = []
    src = "x"
    for i, g in enumerate(groups):
        _forward(plan, i, g, src, f"a{i}", training=True)
        outs.append((src, f"a{i}"))
        src = f"a{i}"
    logits = src
    if len(plan.buffers[logits].shape) != 2:
        raise ValueError(f"the network's output is {plan.buffers[logits].shape}; cross-entropy needs (N, classes)")
    last = len(groups) - 1
    plan.buffer(f"g{last}", plan.buffers[logits].shape, role="grad")
    plan.add("softmax_cross_entropy", "loss", (logits, "labels"), ("loss", f"g{last}"),
             ("cross_entropy_rows_kernel", "mean_kernel"))
    for i in range(last, -1, -1):
        x, y = outs[i]
        first_needed = next((j for j in range(i) if param_names([groups[j]])), None)
        dx = f"g{i - 1}" if i > 0 and first_needed is not None else None
        _backward(plan, i, groups[i], x, y, f"g{i}", dx)
        if dx is None:
            break
    grads = tuple("d:" + n for n, _ in param_names(groups))
    plan.add("flat_update", "optimizer update", grads + ("lr", "counters"), tuple(n for n, _ in param_names(groups)),
             ("flat_update_kernel",))
    plan.add("step_bookkeeping", "bookkeeping", (logits, "labels", "loss"), ("counters",), ("bookkeeping_kernel",))
    return plan
