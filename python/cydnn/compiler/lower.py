"""Stage 2: lowering -- fused groups of layers become a :class:`~cydnn.compiler.ir.Plan` of steps.

Buffers: ``x`` the input, ``a{i}`` the output of group i, ``g{i}`` its gradient (training),
``{layer}.weight`` / ``{layer}.bias`` the parameters and ``d:{layer}.weight`` their gradients
(flat buffers the step owns), ``mask{i}`` a dropout mask, and for training ``labels``,
``loss``, ``counters``, ``lr``.  A Flatten is no step: its output is a view of its input
(likewise its gradient, and an eval-mode Dropout).

Every step is one call of the library (the reference ops' C functions, or the compiler's
kernels in cpp/compiled.cu), listed with the kernels it launches.
"""
import math

from .ir import Plan
from .passes import ACT_BACKWARD_CHUNK, ACTIVATIONS, pool_tiles
from .trace import slope as _slope

__all__ = ["lower_inference", "lower_training", "param_names"]

_CONV_FWD = "cudnnConvolutionForward"
#: A convolution with its bias and activation: cuDNN then the epilogue kernel, or one direct kernel; the
#: executor times both on the plan's buffers and keeps the faster (``Step.kernels`` then says which).
CONV_BIAS_ACT = (_CONV_FWD, "bias_act_forward_kernel")
CONV_DIRECT = ("direct_conv_kernel",)
CONV_BACKWARD_FILTER = "cudnnConvolutionBackwardFilter"
CONV_BACKWARD_DATA = "cudnnConvolutionBackwardData"


def conv_igemm_kernel(tile):
    """The kernels ``explain`` names for a tile (rows, channels, threads, chunk, splits) of the implicit-GEMM
    convolution (cpp/conv_igemm.cu), which the executor may time faster than cuDNN for a forward or a data
    gradient: the kernel, and a split reduction's second pass."""
    rows, channels, _, chunk, splits = tile
    if splits > 1:
        return (f"igemm_conv_kernel<{rows}x{channels}, k{chunk}, split {splits}>", "igemm_split_sum")
    return (f"igemm_conv_kernel<{rows}x{channels}, k{chunk}>",)


def conv_igemm_name(tile):
    """A tile's short name in the executor's timings: igemm64x64k16, igemm64x64k16s4 (reduction split over 4)."""
    rows, channels, _, chunk, splits = tile
    return f"igemm{rows}x{channels}k{chunk}" + (f"s{splits}" if splits > 1 else "")


def conv_wgrad_kernel(tile):
    """The kernels ``explain`` names for a tile (channels, reductions, threads, splits) of the convolution's filter
    gradient (cpp/conv_wgrad.cu), which the executor may time faster than cuDNN's: the split GEMM and its sum."""
    channels, reductions, _, splits = tile
    return (f"wgrad_kernel<{channels}x{reductions}, split {splits}>", "wgrad_split_sum")


def conv_wgrad_name(tile):
    """A tile's short name in the executor's timings: wgrad32x64s16 (the output pixels split over 16 blocks)."""
    channels, reductions, _, splits = tile
    return f"wgrad{channels}x{reductions}s{splits}"


def skinny_gemm_kernel(tile):
    """The kernel ``explain`` names for a tile (rows, columns, threads, splits) of the product with few rows
    (cpp/gemm_skinny.cu), which the executor may time faster than cuBLASLt for a linear layer's forward or dx."""
    rows, cols, _, splits = tile
    return (f"skinny_gemm_kernel<{rows}x{cols}>, cluster {splits}",)


def skinny_gemm_name(tile):
    """A tile's short name in the executor's timings: skinny64x32s8 (the reduction split over a cluster of 8)."""
    rows, cols, _, splits = tile
    return f"skinny{rows}x{cols}s{splits}"


LR_TABLE = 4096     # learning rates the device table holds; longer epochs upload it in chunks (step j at j % LR_TABLE)
#: cuBLASLt, one timed algorithm per shape (cpp/linear.cu); a linear layer's bias, and a ReLU after it, are its
#: epilogue; in backward the weight gradient's product runs on a second stream beside the input gradient's
GEMM = "cublasLtMatmul"
LT_EPILOGUE_ACTS = (0, ACTIVATIONS["relu"])




BN_IN_BLOCK_CHANNELS = 4096      # compiled_norm.cu's kInBlockChannels


def _bn_kernels(channels, backward=False):
    """What cydnn_bn_act_forward_train / cydnn_bn_act_backward launch: partial sums, then the element-wise pass,
    which adds the partial sums itself up to BN_IN_BLOCK_CHANNELS channels (a finalize kernel beyond)."""
    kind = "grad" if backward else "stats"
    wide = (f"bn_{kind}_finalize_kernel",) if channels > BN_IN_BLOCK_CHANNELS else ()
    return (f"bn_{kind}_partial_kernel",) + wide + ("bn_dx_kernel" if backward else "bn_apply_kernel",)


#: a max pooling whose windows tile its input: cpp/pool.cu's kernel (cuDNN's took 4.3-5.8 us a layer in the CNN's
#: step at batch 64; the executor binds the step to _C.max_pool_tiled_forward by this name)
MAX_POOL_TILED = "max_pool_tiled_kernel"


def _act_backward_kernels(shape, bias):
    """What cydnn_bias_act_backward launches for an output of ``shape``: without a bias, one element-wise
    kernel; with one, the activation derivative and each block's partial bias sums, plus a kernel adding
    the partials when a channel spans several blocks."""
    if not bias:
        return ("act_backward_kernel",)
    per_channel = shape[0] * math.prod(shape[2:])
    chunks = -(-per_channel // ACT_BACKWARD_CHUNK)
    return ("act_backward_partial_kernel",) + (("bias_sum_kernel",) if chunks > 1 else ())


def param_names(groups):
    """[(buffer name, Parameter)] of every parameter, in layer order (weight, then bias)."""
    out = []
    for g in groups:
        for node in (g["node"], g.get("bn")):
            if node is None:
                continue
            for attr in ("weight", "bias"):
                p = node.module._parameters.get(attr)
                if p is not None:
                    out.append((f"{node.name}.{attr}", p))
    return out


def buffer_names(groups):
    """[(buffer name, array)] of the batch norms' running statistics (read and, in training, updated)."""
    out = []
    for g in groups:
        for node in (g["node"], g.get("bn")):
            if node is not None and node.op == "batch_norm":
                out += [(f"{node.name}.running_mean", node.module.running_mean),
                        (f"{node.name}.running_var", node.module.running_var)]
    return out


def _params(plan, groups, training):
    for name, p in param_names(groups):
        plan.buffer(name, p.shape, role="param")
        if training:
            plan.buffer("d:" + name, p.shape, role="param_grad")
    for name, a in buffer_names(groups):
        plan.buffer(name, a.shape, role="param")


def _act_of(group):
    act = group["act"]
    if act is None:
        return 0, 0.0
    return ACTIVATIONS[act.op], _slope(act.module)


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
    w = f"{name}.weight"
    what = " + ".join(x for x in ("bias" if bias else "", group["act"].op if act else "") if x)
    if op in ("conv2d", "linear") and group.get("bn") is not None:
        _folded_forward(plan, i, group, src, dst)
    elif op == "conv2d" and (bias or act):
        plan.add("conv_bias_act", f"{name} forward + {what}", (src, w) + ((bias,) if bias else ()), (dst,),
                 CONV_BIAS_ACT, stride=node.attrs["stride"], padding=node.attrs["padding"], bias=bias, act=act,
                 slope=slope)
    elif op in ("conv2d", "linear"):
        if op == "conv2d":
            plan.add("conv_forward", f"{name} forward", (src, w), (dst,), (_CONV_FWD,),
                     stride=node.attrs["stride"], padding=node.attrs["padding"])
        elif act in LT_EPILOGUE_ACTS:
            plan.add("linear_forward", f"{name} forward" + (f" + {what}" if what else ""),
                     (src, w) + ((bias,) if bias else ()), (dst,), (GEMM,), bias=bias, act=act)
            return
        else:
            plan.add("linear_forward", f"{name} forward", (src, w), (dst,), (GEMM,))
        if bias or act:
            plan.add("bias_act_forward", f"{name} {what}", (dst,) + ((bias,) if bias else ()), (dst,),
                     ("bias_act_forward_kernel",), act=act, slope=slope)
    elif op in ACTIVATIONS:
        a, s = ACTIVATIONS[op], _slope(node.module)
        plan.add("bias_act_forward", f"{name} {op}", (src,), (dst,), ("bias_act_forward_kernel",), act=a, slope=s)
    elif op in ("max_pool", "avg_pool", "global_avg_pool"):
        kind = "max_pool" if op == "max_pool" else "avg_pool"
        tiled = op == "max_pool" and pool_tiles(node.in_shape, node.attrs)
        plan.add(kind + "_forward", f"{name} {op}", (src,), (dst,),
                 (MAX_POOL_TILED if tiled else "cudnnPoolingForward",), **node.attrs)
    elif op == "batch_norm":
        stats = (f"{name}.weight", f"{name}.bias", f"{name}.running_mean", f"{name}.running_var")
        if training:            # compiled_norm.cu: the batch's statistics, then normalisation + activation
            saved = (plan.buffer(f"bnmean{i}", (node.in_shape[1],)), plan.buffer(f"bnistd{i}", (node.in_shape[1],)))
            what = f"batch_norm + {group['act'].op}" if act else "batch_norm"
            plan.add("bn_act_forward", f"{name} {what}", (src,) + stats, (dst,) + saved + stats[2:],
                     _bn_kernels(node.in_shape[1]), saved=saved, act=act, slope=slope, **node.attrs)
            return
        else:
            plan.add("batch_norm_forward", f"{name} batch_norm", (src,) + stats, (dst,),
                     ("cudnnBatchNormalizationForwardInference",), training=False, saved=(None, None), **node.attrs)
        if act:
            plan.add("bias_act_forward", f"{name} {group['act'].op}", (dst,), (dst,), ("bias_act_forward_kernel",),
                     act=act, slope=slope)
    elif op == "dropout":
        mask = plan.buffer(f"mask{i}", node.out_shape)
        plan.add("dropout_step", f"{name} dropout", (src, "counters"), (dst, mask), ("dropout_step_kernel",),
                 p=node.module.p, seed=int(node.module._rng.integers(0, 2**63 - 1)))
    else:  # pragma: no cover -- trace() refuses what is not in its table
        raise AssertionError(f"no lowering for {op}")


def _folded_forward(plan, i, group, src, dst):
    """Inference: a batch norm folded into the layer before it.  Each call first computes
    w' = w * s and b' = (b - mean) * s + beta with s = gamma / sqrt(var + eps) (one small kernel,
    so that weights or statistics changed in place are seen), then the layer with w' and b'."""
    node, bn = group["node"], group["bn"]
    act, slope = _act_of(group)
    w = f"{node.name}.weight"
    bias = f"{node.name}.bias" if node.module._parameters.get("bias") is not None else None
    wf = plan.buffer(f"wfold{i}", plan.buffers[w].shape, role="scratch")
    bf = plan.buffer(f"bfold{i}", (plan.buffers[w].shape[0],), role="scratch")
    stats = tuple(f"{bn.name}.{k}" for k in ("weight", "bias", "running_mean", "running_var"))
    plan.add("fold_batch_norm", f"{bn.name} folded into {node.name}", (w,) + ((bias,) if bias else ()) + stats,
             (wf, bf), ("fold_batch_norm_kernel",), bias=bias, stats=stats, eps=bn.attrs["eps"])
    what = "folded bias" + (f" + {group['act'].op}" if act else "")
    if node.op == "conv2d":
        plan.add("conv_bias_act", f"{node.name} forward + {what}", (src, wf, bf), (dst,), CONV_BIAS_ACT,
                 stride=node.attrs["stride"], padding=node.attrs["padding"], bias=bf, act=act, slope=slope)
        return
    if act in LT_EPILOGUE_ACTS:
        plan.add("linear_forward", f"{node.name} forward + {what}", (src, wf, bf), (dst,), (GEMM,), bias=bf, act=act)
        return
    plan.add("linear_forward", f"{node.name} forward", (src, wf), (dst,), (GEMM,))
    plan.add("bias_act_forward", f"{node.name} {what}", (dst, bf), (dst,), ("bias_act_forward_kernel",),
             act=act, slope=slope)


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
            what = " + ".join(part for part, on in (("act", act), ("bias", has_bias)) if on)
            plan.add("bias_act_backward", f"{name} {what} backward", (y, dy), writes,
                     _act_backward_kernels(node.out_shape, has_bias), act=act, slope=slope, dx=dy if act else None,
                     dbias=("d:" + name + ".bias") if has_bias else None)
        if op == "conv2d":
            kernels = ((CONV_BACKWARD_DATA,) if dx else ()) + (CONV_BACKWARD_FILTER,)
            plan.add("conv_backward", f"{name} backward", (x, w, dy), ((dx,) if dx else ()) + ("d:" + w,),
                     kernels, stride=node.attrs["stride"], padding=node.attrs["padding"], dx=dx, dw="d:" + w)
        else:
            kernels = ((GEMM,) if dx else ()) + (GEMM,)
            plan.add("linear_backward", f"{name} backward", (x, w, dy), ((dx,) if dx else ()) + ("d:" + w,),
                     kernels, dx=dx, dw="d:" + w)
    elif op == "batch_norm":    # compiled_norm.cu: the activation's derivative folded into the sums and dx
        saved = (f"bnmean{i}", f"bnistd{i}")
        grads = ("d:" + name + ".weight", "d:" + name + ".bias")
        what = f"{group['act'].op} + batch_norm" if act else "batch_norm"
        plan.add("bn_act_backward", f"{name} {what} backward",
                 (x,) + ((y,) if act else ()) + (dy, name + ".weight") + saved, ((dx,) if dx else ()) + grads,
                 _bn_kernels(node.in_shape[1], backward=True), x=x, y=y if act else None, dy=dy, gamma=name + ".weight",
                 act=act, slope=slope, dx=dx, grads=grads, saved=saved)
    elif dx is None:
        return
    elif op in ACTIVATIONS:
        a, s = ACTIVATIONS[op], _slope(node.module)
        plan.add("bias_act_backward", f"{name} {op} backward", (y, dy), (dx,),
                 _act_backward_kernels(node.out_shape, False), act=a, slope=s, dx=dx, dbias=None)
    elif op == "max_pool":
        plan.add("max_pool_backward", f"{name} max_pool backward", (x, dy), (dx,), ("max_pool_backward_kernel",),
                 **node.attrs)
    elif op in ("avg_pool", "global_avg_pool"):
        plan.add("avg_pool_backward", f"{name} {op} backward", (x, y, dy), (dx,), ("cudnnPoolingBackward",),
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
    plan.buffer("loss", (), role="output")
    plan.buffer("counters", (6,), "int32", role="control")   # cydnnStepCounters: 24 bytes
    plan.buffer("lr", (LR_TABLE,), role="control")
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
