"""The compiler's data: what a traced network is, what a plan is, and how both print.

- :class:`Node`: one layer after tracing: its op, its module, its input and output shapes.
- :class:`Buffer`: a named device array a plan reads or writes, with its role and, after
  memory planning, its offset in the plan's arena.
- :class:`Step`: one entry of a plan: a kind (the executor's dispatch key), the buffers it
  reads and writes, the kernels it launches (for :meth:`Plan.explain`), its arguments.
- :class:`Plan`: the steps in order, the buffers, the log of what the passes did.

Nothing here touches the GPU: a plan is data, printable before anything runs.
"""
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Node", "Buffer", "Step", "Plan", "nbytes"]

#: Roles of buffers.  "act"/"grad"/"scratch" live in the arena (offsets from the memory
#: pass); "param", "param_grad" are the step's flat buffers (or the model's arrays); "input"
#: and "label" are where a call's data is copied, "output" where a result is read (the loss);
#: "control" holds the counters and the learning-rate table (shared by a step's plans).
ARENA_ROLES = ("act", "grad", "scratch")


def nbytes(shape, dtype="float32"):
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclass
class Node:
    """One layer of the traced network (shapes include the batch)."""
    name: str            # the module's path in the model, e.g. "features.conv1" or "3"
    op: str              # conv2d, linear, relu, tanh, sigmoid, leaky_relu, max_pool, avg_pool,
                         # flatten, dropout, batch_norm, global_avg_pool
    module: object
    in_shape: tuple
    out_shape: tuple
    attrs: dict = field(default_factory=dict)

    def __str__(self):
        extra = "".join(f" {k}={v}" for k, v in self.attrs.items())
        return f"{self.name:<14} {self.op:<16} {str(self.in_shape):<20} -> {self.out_shape}{extra}"


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: str = "float32"
    role: str = "act"
    alias_of: str = None      # a reshaped view of another buffer (Flatten)
    offset: int = None        # bytes into the arena (set by the memory pass)

    @property
    def nbytes(self):
        return nbytes(self.shape, self.dtype)


@dataclass
class Step:
    kind: str                 # the executor's dispatch key, e.g. "conv_forward"
    name: str                 # what it is for, e.g. "conv1 forward"
    reads: tuple
    writes: tuple
    kernels: tuple            # names of the kernels/library calls it launches
    args: dict = field(default_factory=dict)

    def __str__(self):
        r = ", ".join(self.reads)
        w = ", ".join(self.writes)
        timed = sorted(self.args.get("timed_us", {}).items(), key=lambda kv: kv[1])    # the executor's timed ways
        shown = ", ".join(f"{k} {v:g}" for k, v in timed[:4]) + (f"; {len(timed) - 4} more" if len(timed) > 4 else "")
        chosen = f"  (timed, us, fastest first: {shown})" if timed else ""
        return f"{self.name:<26} {self.kind:<18} [{' + '.join(self.kernels)}]  {r} -> {w}{chosen}"


@dataclass
class Plan:
    """Steps in launch order, their buffers, and what each pass did (``log``)."""
    mode: str                 # "train" or "infer"
    batch: int
    nodes: list
    steps: list = field(default_factory=list)
    buffers: dict = field(default_factory=dict)
    log: list = field(default_factory=list)
    arena_bytes: int = 0
    output: str = None        # the buffer a call's result is read from (inference)

    def buffer(self, name, shape, dtype="float32", role="act", alias_of=None):
        if name in self.buffers:
            raise ValueError(f"plan: buffer {name!r} defined twice")
        buf = Buffer(name, tuple(int(s) for s in shape), dtype, role, alias_of)
        self.buffers[name] = buf
        return name

    def add(self, kind, name, reads, writes, kernels, **args):
        for b in tuple(reads) + tuple(writes):
            if b not in self.buffers:
                raise ValueError(f"plan: step {name!r} uses unknown buffer {b!r}")
        self.steps.append(Step(kind, name, tuple(reads), tuple(writes), tuple(kernels), args))

    def kernel_count(self):
        return sum(len(s.kernels) for s in self.steps)

    def explain(self):
        """The plan as text: the layers, the steps with their kernels, the buffers and their bytes."""
        lines = [f"plan ({self.mode}, batch {self.batch}): {len(self.nodes)} layers, {len(self.steps)} steps, "
                 f"{self.kernel_count()} kernels per call"]
        lines.append("layers:")
        lines += [f"  {n}" for n in self.nodes]
        lines.append("steps:")
        lines += [f"  {i:>2}. {s}" for i, s in enumerate(self.steps)]
        lines.append("buffers:")
        for b in self.buffers.values():
            where = (f"view of {b.alias_of}" if b.alias_of else
                     f"arena +{b.offset}" if b.offset is not None else b.role)
            lines.append(f"  {b.name:<18} {str(b.shape):<20} {b.dtype:<8} {b.nbytes:>10,} B  {where}")
        if self.arena_bytes:
            own = sum(b.nbytes for b in self.buffers.values() if b.role in ARENA_ROLES and not b.alias_of)
            lines.append(f"arena: {self.arena_bytes:,} B for {own:,} B of activations and gradients "
                         f"(reused by liveness)")
        if self.log:
            lines.append("passes:")
            lines += [f"  {entry}" for entry in self.log]
        return "\n".join(lines)

    __str__ = explain
