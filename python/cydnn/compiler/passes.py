"""Stage 3 and 4: the passes -- fusion over the traced layers, memory planning over a plan.

Fusion (:func:`fuse`): a Conv2d or Linear followed by an activation becomes one group,
lowered to the library call without its bias, then ONE kernel that adds the bias and
applies the activation (``bias_act_forward``) -- a Linear's bias and ReLU are cuBLASLt's
epilogue instead, no kernel of their own -- and in backward ONE kernel for the
activation's derivative and the bias gradient (``bias_act_backward``).  Unfused, the same
work is three kernels forward (conv/GEMM, bias, activation) and two backward.
The patterns are a table (:data:`FUSE_AFTER`); ``fuse=False`` turns the pass off.

Backward fusion over a training plan (:func:`fuse_backward`): a max pooling whose windows tile
its input, back-propagated right before the activation (and bias) it follows, becomes ONE step
(``max_pool_act_backward``, cpp/compiled_act.cu): a thread per window writes the window's
gradient through the activation's derivative and adds it to the bias sums, where the two steps
wrote the pooling's input gradient, read it back, and wrote it again.

The head (:func:`fuse_head`): the last linear layer without activation, the softmax cross-entropy,
that layer's bias gradient and its backward -- four steps, six kernels, each waiting for the one
before -- become ONE step (``linear_xent``, cpp/compiled_head.cu) of two kernels where the layer
has at most 32 outputs (classes).  The executor times it against the four steps' library calls on
the same buffers and keeps the faster.

Memory (:func:`plan_memory`): every arena buffer lives from the first step that touches
it to the last; buffers whose lives do not overlap share bytes.  Placement is greedy,
largest first, at the lowest offset that overlaps no live neighbour (aligned to 256 B).
``memory=False`` gives every buffer its own bytes (the off switch, to debug a suspected
reuse bug).
"""
from .ir import ARENA_ROLES, Step

__all__ = ["fuse", "fuse_backward", "fuse_head", "plan_memory", "FUSE_AFTER", "ACTIVATIONS", "ACT_BACKWARD_CHUNK"]

#: activation op -> the act code of cydnn_bias_act_* (cpp/cydnn.h)
ACTIVATIONS = {"relu": 1, "tanh": 2, "sigmoid": 3, "leaky_relu": 4}

#: ops whose output an activation may be fused into
FUSE_AFTER = ("conv2d", "linear")

ALIGN = 256

#: values of one channel a block of the activation-backward kernels reduces (cpp/compiled_act.cu's kChunk)
ACT_BACKWARD_CHUNK = 1024


def fuse(nodes, enabled=True, log=None, training=True):
    """Group the nodes: each group is ``{"node", "act", "bn"}``: ``act`` a fused activation node, ``bn`` (inference
    only) a batch norm folded into the convolution or linear layer before it."""
    groups, i = [], 0
    log = [] if log is None else log
    while i < len(nodes):
        node = nodes[i]
        group = {"node": node, "act": None, "bn": None}
        i += 1
        nxt = nodes[i] if i < len(nodes) else None
        if enabled and not training and node.op in FUSE_AFTER and nxt is not None and nxt.op == "batch_norm":
            group["bn"] = nxt
            log.append(f"fold: {nxt.name} (batch_norm, running statistics) into {node.name} ({node.op})")
            i += 1
            nxt = nodes[i] if i < len(nodes) else None
        if enabled and node.op in FUSE_AFTER + ("batch_norm",) and nxt is not None and nxt.op in ACTIVATIONS:
            group["act"] = nxt
            log.append(f"fuse: {node.name} ({node.op}) + {nxt.name} ({nxt.op}) -> "
                       + ("cuBLASLt epilogue" if node.op == "linear" and nxt.op == "relu"
                          else "bias_act epilogue" if node.op in FUSE_AFTER else "activation in place"))
            i += 1
        groups.append(group)
    return groups


def pool_tiles(shape, attrs):
    """Whether a pooling's windows tile its (n, c, h, w) input: kernel == stride, no padding, the plane a whole
    number of windows (each input in exactly one window)."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    return (kh, kw) == (sh, sw) and (ph, pw) == (0, 0) and shape[2] % kh == 0 and shape[3] % kw == 0


def fuse_backward(plan, enabled=True):
    """Training: each ``max_pool_backward`` whose windows tile its input, followed by the ``bias_act_backward``
    of the layer whose output it pooled (reading that output and the pooling's input gradient, in place),
    becomes one ``max_pool_act_backward`` step (the pooling's input gradient is then never written alone)."""
    if not enabled:
        return plan
    steps, i = [], 0
    while i < len(plan.steps):
        s = plan.steps[i]
        nxt = plan.steps[i + 1] if i + 1 < len(plan.steps) else None
        if (s.kind == "max_pool_backward" and nxt is not None and nxt.kind == "bias_act_backward"
                and nxt.reads == (s.reads[0], s.writes[0]) and nxt.args["dx"] in (None, s.writes[0])
                and pool_tiles(plan.buffers[s.reads[0]].shape, s.args)):
            dbias = nxt.args["dbias"]
            shape = plan.buffers[s.reads[0]].shape
            kh, kw = s.args["kernel"]
            windows = shape[0] * (shape[2] // kh) * (shape[3] // kw)
            chunks = -(-windows // max(1, ACT_BACKWARD_CHUNK // (kh * kw)))
            kernels = ("max_pool_act_backward_kernel",) + (("bias_sum_kernel",) if dbias and chunks > 1 else ())
            steps.append(Step("max_pool_act_backward", f"{s.name.split()[0]} max_pool + {nxt.name}",
                              (s.reads[0], s.reads[1]), (s.writes[0],) + ((dbias,) if dbias else ()), kernels,
                              dict(kernel=(kh, kw), act=nxt.args["act"], slope=nxt.args["slope"], dx=s.writes[0],
                                   dbias=dbias)))
            plan.log.append(f"fuse: {s.name} + {nxt.name} -> one kernel (max_pool_act_backward)")
            i += 2
            continue
        steps.append(s)
        i += 1
    plan.steps = steps
    return plan


#: the classes cpp/compiled_head.cu takes (a lane of one warp each in the softmax)
HEAD_MAX_CLASSES = 32


def fuse_head(plan, enabled=True):
    """Training: ``linear_forward`` (no activation) of the logits, ``softmax_cross_entropy``, the layer's
    ``bias_act_backward`` (its bias gradient alone, if it has a bias) and its ``linear_backward`` become one
    ``linear_xent`` step, where the logits are (n, c) with c <= 32."""
    if not enabled:
        return plan
    at = next((i for i, s in enumerate(plan.steps) if s.kind == "softmax_cross_entropy"), None)
    if at is None or at == 0:
        return plan
    fwd, loss = plan.steps[at - 1], plan.steps[at]
    logits, g = loss.reads[0], loss.writes[1]
    if fwd.kind != "linear_forward" or fwd.writes != (logits,) or fwd.args.get("act", 0) != 0:
        return plan
    n, c = plan.buffers[logits].shape
    if c > HEAD_MAX_CLASSES:
        plan.log.append(f"head: not fused ({c} classes: the fused head takes at most {HEAD_MAX_CLASSES})")
        return plan
    src, w = fwd.reads[0], fwd.reads[1]
    bias = fwd.args.get("bias")
    rest = plan.steps[at + 1:]
    dbias = None
    if rest and rest[0].kind == "bias_act_backward" and rest[0].reads == (logits, g):
        if rest[0].args["act"] != 0 or rest[0].args["dx"] is not None:
            return plan
        dbias = rest[0].args["dbias"]
        rest = rest[1:]
    if (bias is None) != (dbias is None) or not rest or rest[0].kind != "linear_backward" \
            or rest[0].reads != (src, w, g):
        return plan
    back = rest[0]
    row_loss = plan.buffer("rowloss", (n,), role="scratch")
    name = fwd.name.split()[0]
    writes = (logits, "loss", g, row_loss) + ((dbias,) if dbias else ()) + \
        ((back.args["dx"],) if back.args["dx"] else ()) + (back.args["dw"],)
    step = Step("linear_xent", f"{name} forward + loss + {name} backward",
                (src, w) + ((bias,) if bias else ()) + ("labels",), writes,
                ("linear_xent_rows_kernel", "linear_xent_grads_kernel"),
                dict(bias=bias, dbias=dbias, dx=back.args["dx"], dw=back.args["dw"], row_loss=row_loss,
                     unfused=(fwd, loss) + ((plan.steps[at + 1],) if dbias else ()) + (back,)))
    plan.steps = plan.steps[:at - 1] + [step] + rest[1:]
    plan.log.append(f"fuse: {fwd.name} + loss + {name} backward -> one step of two kernels (linear_xent)")
    return plan


def _lifetimes(plan):
    """{arena buffer: (first step, last step)}; an alias's uses count for its base."""
    base = {name: (b.alias_of or name) for name, b in plan.buffers.items()}
    while any(base[b] != b and plan.buffers[base[b]].alias_of for b in base):
        base = {name: (plan.buffers[t].alias_of or t) for name, t in base.items()}
    life = {}
    for i, step in enumerate(plan.steps):
        for name in step.reads + step.writes:
            root = base[name]
            if plan.buffers[root].role not in ARENA_ROLES:
                continue
            first, last = life.get(root, (i, i))
            life[root] = (min(first, i), max(last, i))
    return life


def plan_memory(plan, enabled=True):
    """Give every arena buffer an offset; set ``plan.arena_bytes``; log what was saved."""
    life = _lifetimes(plan)
    placed = []     # (offset, end, first, last)
    order = sorted(life, key=lambda n: (-plan.buffers[n].nbytes, n))
    for name in order:
        size = -(-plan.buffers[name].nbytes // ALIGN) * ALIGN
        first, last = life[name]
        offset = 0
        if enabled:
            clashes = sorted((o, e) for o, e, f, l in placed if not (l < first or f > last))
            for o, e in clashes:
                if offset + size <= o:
                    break
                offset = max(offset, e)
        else:
            offset = max((e for _, e, _, _ in placed), default=0)
        plan.buffers[name].offset = offset
        placed.append((offset, offset + size, first, last))
    plan.arena_bytes = max((e for _, e, _, _ in placed), default=0)
    total = sum(-(-plan.buffers[n].nbytes // ALIGN) * ALIGN for n in life)
    plan.log.append(f"memory: {len(life)} arena buffers, {total:,} B without reuse -> {plan.arena_bytes:,} B"
                    + ("" if enabled else " (reuse switched off)"))
    return plan
