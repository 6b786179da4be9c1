"""What the compiled step and the compiled inference share: the model's signature (has anything the
plan was bound to been replaced?), the plan of one batch size, and a bound plan with its CUDA graph.

``_Runner.prepare`` is the capture self-test: the plan runs once plainly, is captured into a graph,
replayed, and the two results compared; a failed capture or self-test leaves the plan running step
by step, with the reason in ``info()`` and the ``cydnn.compiler`` logger.
"""
import logging

import numpy as np

from .. import _C
from ..nn.module import structure_version
from .executor import Bound
from .lower import lower_inference, lower_training
from .passes import fuse, fuse_backward, fuse_head, plan_memory
from .trace import trace

__all__ = ["Signature", "signature", "module_buffers"]

log = logging.getLogger("cydnn.compiler")


class Signature:
    """What a bound plan depends on: every module's children, every parameter object and its array.

    ``fresh()`` checks, by identity only, that none of them was replaced since: one compare of
    ``nn``'s structure version when nothing was assigned anywhere, the full walk otherwise (it runs
    on every call).  Values changing in place (training, ``copy_``)
    need no check: the plan reads the arrays themselves.
    """

    def __init__(self, model):
        self.version = structure_version()
        self.entries = []          # (dict, key, object it held)
        self.arrays = []           # (Parameter, array it held)
        stack = [model]
        while stack:
            m = stack.pop()
            self.entries.append((m.__dict__, "_modules", m._modules))
            self.entries.append((m.__dict__, "_parameters", m._parameters))
            for key, child in m._modules.items():
                self.entries.append((m._modules, key, child))
                stack.append(child)
            for key, p in m._parameters.items():
                self.entries.append((m._parameters, key, p))
                if p is not None:
                    self.arrays.append((p, p.data))
            for key, a in getattr(m, "_buffers", {}).items():
                if isinstance(a, _C.DeviceArray):       # running statistics (a host count may change freely)
                    self.entries.append((m._buffers, key, a))
        self.sizes = [(v, len(v)) for d, k, v in self.entries if k in ("_modules", "_parameters")]

    def fresh(self):
        if structure_version() == self.version:    # nothing was assigned anywhere since: one compare
            return True
        if self._full_check():
            self.version = structure_version()
            return True
        return False

    def _full_check(self):
        for d, key, obj in self.entries:
            if d.get(key) is not obj:
                return False
        for p, data in self.arrays:
            if p.data is not data:
                return False
        for table, size in self.sizes:
            if len(table) != size:
                return False
        return True


def signature(model):
    return Signature(model)


def module_buffers(model, plan):
    """The plan's running statistics and (inference) parameters, from the model's modules by path."""
    out = {}
    for name, buf in plan.buffers.items():
        if buf.role != "param" or name.startswith("d:"):
            continue
        path, attr = name.rsplit(".", 1)
        m = model
        for part in path.split("."):
            m = m._modules[part]
        if attr in m._parameters:
            out[name] = m._parameters[attr].data
        elif attr in getattr(m, "_buffers", {}):
            out[name] = m._buffers[attr]
    return out


def _batch_norms(plan):
    return [n.module for n in plan.nodes if n.op == "batch_norm"]


def _count_batches(modules, steps):
    """num_batches_tracked as the reference forward keeps it (a host int64 counter)."""
    for m in modules:
        if m.num_batches_tracked is not None:
            m.num_batches_tracked = np.array(int(m.num_batches_tracked) + steps, np.int64)


def _build_plan(model, input_shape, batch, training, options, softmax=False):
    nodes = trace(model, input_shape, batch)
    plan_log = []
    groups = fuse(nodes, enabled=options.get("fuse", True), log=plan_log, training=training)
    if training:
        plan = fuse_backward(lower_training(groups, nodes, batch, log=plan_log), enabled=options.get("fuse", True))
        plan = fuse_head(plan, enabled=options.get("fuse", True))
    else:
        plan = lower_inference(groups, nodes, batch, softmax=softmax, log=plan_log)
    plan_memory(plan, enabled=options.get("memory", True))
    return plan, groups


class _Runner:
    """A bound plan and its graph: ``launch()`` replays it (or runs it step by step)."""

    def __init__(self, plan, given, use_graph):
        self.plan = plan
        self.bound = Bound(plan, given)
        self.use_graph = use_graph
        self.ready = False
        self.reason = "" if use_graph else "CUDA graphs switched off (cuda_graph=False)"
        # set by CompiledStep (compiled.py): the (batch, input shape) it serves, the batch norms whose
        # counters it advances, and the fused step's runner waiting for the first batch's trial
        self.key, self.counted, self.candidate = None, [], None

    def prepare(self, snapshot=None, compare=()):
        """First use: plain run, capture, replay, compare (``snapshot()`` restores the state the run changed)."""
        self.ready = True
        if not self.use_graph:
            return
        restore = snapshot() if snapshot else None
        try:
            self.bound.run_plain()
            expected = [self.bound.arrays[n].numpy() if n in self.bound.arrays else n().numpy() for n in compare]
            if restore:
                restore()
            self.bound.capture()
            self.bound.graph.launch()
            got = [self.bound.arrays[n].numpy() if n in self.bound.arrays else n().numpy() for n in compare]
            if restore:
                restore()
            for name, e, g in zip(compare, expected, got):
                if e.shape != g.shape or not np.array_equal(e, g, equal_nan=True):
                    raise RuntimeError(f"the graph's {getattr(name, '__name__', name)} differs from the plain run "
                                       f"(max |diff| {np.nanmax(np.abs(e - g))})")
        except (_C.CydnnError, RuntimeError) as e:
            self.bound.graph = None
            self.use_graph = False
            self.reason = f"capture self-test failed, running the steps one by one: {e}"
            log.warning("compile: %s", self.reason)
            if restore:
                restore()

    def launch(self):
        self.bound.launch()
