"""A compiled training step for any Sequential: the plan of :mod:`.lower`, bound and captured.

What a step owns (made once, shared by the plans of each batch size):

- one flat buffer of every parameter, one of their gradients, one or two of the
  optimizer's state; the model's ``Parameter.data`` and the optimizer's state arrays
  become views of them (same values), so the reference path and the compiled one
  train the same arrays, and ``flat_update`` updates all of them in one launch;
- the control block: the step counters (global step for Adam's bias correction and
  SGD's first step, the step within the epoch, loss sum, correct count) and the
  learning-rate table, read on the device, so a schedule needs no re-capture.

A call ``step(x, y)`` copies the batch into the plan's input buffers and launches the
graph: forward, loss, backward, update and bookkeeping in one launch.  Before that it
checks, with identity compares, that the model still holds the arrays the graph was
recorded with: a replaced ``Parameter``, ``.data``, ``load_state_dict`` that replaced
arrays, or a ``.to()`` round trip makes it re-plan (never compute with stale weights).
"""
import logging

import numpy as np

from .. import _C, optim
from .executor import Bound
from .lower import LR_TABLE

__all__ = ["FlatState", "optimizer_reason"]

log = logging.getLogger("cydnn.compiler")



def optimizer_reason(optimizer, params):
    """None when the flat update can run ``optimizer`` over ``params``, else why not."""
    if type(optimizer) not in (optim.SGD, optim.Adam, optim.AdamW):
        return f"the compiled update knows SGD, Adam and AdamW, not {type(optimizer).__name__}"
    if len(optimizer.params) != len(params) or any(a is not b for a, b in zip(optimizer.params, params)):
        return "the optimizer does not hold exactly the model's parameters, in order"
    steps = {0 if s is None else s["step"] for s in optimizer.state}
    if len(steps) > 1:
        return f"the parameters have taken different numbers of steps ({sorted(steps)})"
    return None


def _aligned(n, to=64):
    return -(-n // to) * to


class FlatState:
    """Flat parameters, gradients, optimizer state and the control block of one model + optimizer."""

    def __init__(self, named_params, optimizer):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.optimizer = optimizer
        offsets, off = [], 0
        for p in self.params:
            offsets.append(off)
            off += _aligned(int(np.prod(p.shape, dtype=np.int64)))
        total = max(off, 1)
        self.flat_param = _C.zeros((total,))
        self.flat_grad = _C.zeros((total,))
        sgd = isinstance(optimizer, optim.SGD)
        need1 = not sgd or optimizer.momentum != 0
        self.flat_s1 = _C.zeros((total,)) if need1 else None
        self.flat_s2 = _C.zeros((total,)) if not sgd else None
        views = lambda flat, i, p: _C.view(flat, offsets[i], p.shape)   # noqa: E731
        for i, p in enumerate(self.params):
            if optimizer.state[i] is None:
                optimizer.state[i] = optimizer._init_state(p)
            view = views(self.flat_param, i, p)
            _C.copy_into(view, p.data)
            p.data = view
            st = optimizer.state[i]
            for key, flat in (("momentum_buffer", self.flat_s1), ("exp_avg", self.flat_s1),
                              ("exp_avg_sq", self.flat_s2)):
                if key in st and st[key] is not None and flat is not None:
                    v = views(flat, i, p)
                    _C.copy_into(v, st[key])
                    st[key] = v
        self.grads = [views(self.flat_grad, i, p) for i, p in enumerate(self.params)]
        self.counters = _C.zeros((_C.COUNTERS_DTYPE.itemsize // 4,), np.int32)
        self.lr = _C.empty((LR_TABLE,))
        self._lr_host = None          # the lr the whole table holds now (None: a schedule)
        self.set_counters(optimizer.state[0]["step"])
        hyper = dict(weight_decay=optimizer.weight_decay)
        if sgd:
            kind = _C.OPT_SGD
            hyper.update(momentum=optimizer.momentum, dampening=optimizer.dampening, nesterov=optimizer.nesterov)
        else:
            kind = _C.OPT_ADAMW if isinstance(optimizer, optim.AdamW) else _C.OPT_ADAM
            hyper.update(beta1=optimizer.betas[0], beta2=optimizer.betas[1], eps=optimizer.eps)
        self.update = _C.FlatUpdate(param=self.flat_param, grad=self.flat_grad, state1=self.flat_s1,
                                    state2=self.flat_s2, optimizer=kind, lr_table=self.lr,
                                    counters=self.counters, **hyper)
        self.key = self._key()

    def _key(self):
        st = tuple(v for s in self.optimizer.state for v in s.values() if isinstance(v, _C.DeviceArray))
        return tuple((p, p.data) for p in self.params), st

    def fresh(self, params):
        """True while the model's parameters and the optimizer's state are still these arrays."""
        if len(params) != len(self.params):
            return False
        for p, q in zip(params, self.params):
            if p is not q:
                return False
        pairs, st = self.key
        for p, d in pairs:
            if p.data is not d:
                return False
        now = tuple(v for s in self.optimizer.state for v in s.values() if isinstance(v, _C.DeviceArray))
        return len(now) == len(st) and all(a is b for a, b in zip(now, st))

    def given(self):
        """The arrays a plan's Bound takes from here."""
        out = {n: p.data for n, p in zip(self.names, self.params)}
        out.update({"d:" + n: g for n, g in zip(self.names, self.grads)})
        out.update(counters=self.counters, lr=self.lr, __update__=self.update)
        return out

    def set_counters(self, global_step, step_in_epoch=0):
        c = np.zeros(1, _C.COUNTERS_DTYPE)
        c["global_step"], c["step_in_epoch"] = global_step, step_in_epoch
        self.counters.set_(c.view(np.int32))

    def read_counters(self):
        return self.counters.numpy().view(_C.COUNTERS_DTYPE)[0]

    def set_lr(self, lr):
        """The whole table at one learning rate (only uploaded when it changed)."""
        if self._lr_host != lr:
            self.lr.set_(np.full(LR_TABLE, lr, np.float32))
            self._lr_host = lr

    def set_schedule(self, lrs, first=0):
        """Steps first .. first + LR_TABLE - 1 of an epoch's schedule ``lrs``, at positions j % LR_TABLE
        (``first`` a multiple of LR_TABLE; the upload is queued after the steps before it)."""
        chunk = np.asarray(lrs[first:first + LR_TABLE], np.float32)
        table = np.full(LR_TABLE, chunk[-1] if len(chunk) else self.optimizer.lr, np.float32)
        table[:len(chunk)] = chunk
        self.lr.set_(table)
        self._lr_host = None

    def publish_grads(self):
        for p, g in zip(self.params, self.grads):
            p.grad = g


def bind_training(plan, flat):
    """A :class:`Bound` of a training plan over ``flat``'s arrays."""
    return Bound(plan, flat.given())
