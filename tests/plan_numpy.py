"""Run a compiler Plan on the CPU with the numpy twin, in one arena laid out as the memory pass planned.

Every step kind of ``cydnn.compiler.executor.DISPATCH`` has its numpy meaning here, written from the op
definitions (``cydnn.ops.cpu``), not from the executor.  Activations and gradients are views of one
float32 arena at the planned offsets, so a plan that reuses bytes while they are still live computes a
wrong answer here and the tests comparing with the per-op reference fail.  Used by
tests/test_compiler_numpy.py; lets CI (no GPU) check the lowering, the fusion and the memory plan.
"""
import numpy as np

from cydnn.ops import cpu
from cydnn.compiler.ir import ARENA_ROLES


def _act(v, act, slope):
    return {0: lambda: v, 1: lambda: np.maximum(v, 0), 2: lambda: np.tanh(v),
            3: lambda: 1 / (1 + np.exp(-v)), 4: lambda: np.where(v > 0, v, v * slope)}[act]()


def _dact(y, act, slope):
    return {0: lambda: np.ones_like(y), 1: lambda: (y > 0).astype(y.dtype), 2: lambda: 1 - y * y,
            3: lambda: y * (1 - y), 4: lambda: np.where(y > 0, 1, slope).astype(y.dtype)}[act]()


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


class NumpyPlan:
    """``arrays``: parameter name -> numpy array (used in place); the rest is allocated here."""

    def __init__(self, plan, arrays, optimizer=None):
        self.plan, self.opt = plan, optimizer
        self.arena = np.full(max(1, plan.arena_bytes // 4), np.nan, np.float32)
        self.b = dict(arrays)
        for name, buf in plan.buffers.items():
            if name in self.b or buf.alias_of:
                continue
            if buf.role in ARENA_ROLES:
                start = buf.offset // 4
                self.b[name] = self.arena[start:start + int(np.prod(buf.shape, dtype=np.int64))].reshape(buf.shape)
            elif buf.role == "control":
                continue
            else:
                self.b[name] = np.zeros(buf.shape, buf.dtype)
        for name, buf in plan.buffers.items():
            if buf.alias_of:
                self.b[name] = self.b[buf.alias_of].reshape(buf.shape)
        self.aux = {}
        self.steps_taken = 0

    def run(self, x, labels=None, lr=0.0):
        b = self.b
        b["x"][...] = x
        if labels is not None:
            b["labels"][...] = labels
        for s in self.plan.steps:
            getattr(self, "_" + s.kind)(s, b, lr)
        return b

    # -- forward ------------------------------------------------------------------------------
    def _conv(self, s, x, w, bias):
        y, _ = cpu.conv_forward(x, w, bias, s.args["stride"], s.args["padding"])
        return y

    def _conv_forward(self, s, b, lr):
        b[s.writes[0]][...] = self._conv(s, b[s.reads[0]], b[s.reads[1]], None)

    def _conv_bias_act(self, s, b, lr):
        bias = b[s.args["bias"]] if s.args["bias"] else None
        b[s.writes[0]][...] = _act(self._conv(s, b[s.reads[0]], b[s.reads[1]], bias), s.args["act"], s.args["slope"])

    def _linear_forward(self, s, b, lr):
        v = b[s.reads[0]] @ b[s.reads[1]].T
        if s.args.get("bias"):
            v = v + b[s.args["bias"]]
        b[s.writes[0]][...] = _act(v, s.args.get("act", 0), 0.0)

    def _bias_act_forward(self, s, b, lr):
        v = b[s.reads[0]]
        if len(s.reads) > 1:
            v = v + _per_channel(b[s.reads[1]], v.ndim)
        b[s.writes[0]][...] = _act(v, s.args["act"], s.args["slope"])

    def _max_pool_forward(self, s, b, lr):
        b[s.writes[0]][...] = cpu.max_pool_forward(b[s.reads[0]], s.args["kernel"], s.args["stride"],
                                                   s.args["padding"])[0]

    def _avg_pool_forward(self, s, b, lr):
        b[s.writes[0]][...] = cpu.avg_pool_forward(b[s.reads[0]], s.args["kernel"], s.args["stride"],
                                                   s.args["padding"])[0]

    def _softmax(self, s, b, lr):
        b[s.writes[0]][...] = cpu.softmax(b[s.reads[0]])

    def _batch_norm_forward(self, s, b, lr):
        x, gamma, beta, rm, rv = (b[n] for n in s.reads)
        y, cache = cpu.batch_norm_forward(x.copy(), gamma, beta, rm, rv, s.args["training"], s.args["momentum"],
                                          s.args["eps"])
        b[s.writes[0]][...] = y
        self.aux[s.args["saved"][0]] = cache

    def _bn_act_forward(self, s, b, lr):
        x, gamma, beta, rm, rv = (b[n] for n in s.reads)
        y, cache = cpu.batch_norm_forward(x.copy(), gamma, beta, rm, rv, True, s.args["momentum"], s.args["eps"])
        b[s.writes[0]][...] = _act(y, s.args["act"], s.args["slope"])
        self.aux[s.args["saved"][0]] = cache

    def _fold_batch_norm(self, s, b, lr):
        w = b[s.reads[0]]
        bias = b[s.args["bias"]] if s.args["bias"] else np.zeros(w.shape[0], np.float32)
        gamma, beta, mean, var = (b[n] for n in s.args["stats"])
        scale = gamma / np.sqrt(var + s.args["eps"])
        b[s.writes[0]][...] = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
        b[s.writes[1]][...] = (bias - mean) * scale + beta

    # -- loss, backward, update ---------------------------------------------------------------------
    def _softmax_cross_entropy(self, s, b, lr):
        loss, dlogits = cpu.softmax_cross_entropy(b[s.reads[0]], b[s.reads[1]])
        b[s.writes[0]][...] = loss
        b[s.writes[1]][...] = dlogits

    def _bias_act_backward(self, s, b, lr):
        y, dy = b[s.reads[0]], b[s.reads[1]]
        g = dy * _dact(y, s.args["act"], s.args["slope"])
        if s.args["dbias"]:
            b[s.args["dbias"]][...] = g.sum(axis=tuple(i for i in range(g.ndim) if i != 1))
        if s.args["dx"]:
            b[s.args["dx"]][...] = g

    def _conv_backward(self, s, b, lr):
        x, w, dy = (b[n] for n in s.reads)
        _, cache = cpu.conv_forward(x.copy(), w, None, s.args["stride"], s.args["padding"])
        dx, dw, _ = cpu.conv_backward(dy.copy(), cache, need_dx=s.args["dx"] is not None)
        b[s.args["dw"]][...] = dw
        if s.args["dx"]:
            b[s.args["dx"]][...] = dx

    def _linear_backward(self, s, b, lr):
        x, w, dy = (b[n] for n in s.reads)
        dw = dy.T @ x
        if s.args["dx"]:
            b[s.args["dx"]][...] = dy @ w
        b[s.args["dw"]][...] = dw

    def _linear_xent(self, s, b, lr):
        a = s.args
        x, w = b[s.reads[0]], b[s.reads[1]]
        z = x @ w.T + (b[a["bias"]] if a["bias"] else np.float32(0))
        loss, g = cpu.softmax_cross_entropy(z, b["labels"])
        outs = {s.writes[0]: z, "loss": loss, s.writes[2]: g, a["dw"]: g.T @ x}
        if a["dbias"]:
            outs[a["dbias"]] = g.sum(axis=0)
        if a["dx"]:
            outs[a["dx"]] = g @ w
        for name, v in outs.items():          # all computed first: none of them is read after a write
            b[name][...] = v

    def _max_pool_backward(self, s, b, lr):
        x, dy = b[s.reads[0]], b[s.reads[1]]
        _, cache = cpu.max_pool_forward(x.copy(), s.args["kernel"], s.args["stride"], s.args["padding"])
        b[s.writes[0]][...] = cpu.max_pool_backward(dy.copy(), cache)

    def _max_pool_act_backward(self, s, b, lr):
        y, dy = b[s.reads[0]], b[s.reads[1]]
        k = s.args["kernel"]
        _, cache = cpu.max_pool_forward(y.copy(), k, k, 0)
        g = cpu.max_pool_backward(dy.copy(), cache) * _dact(y, s.args["act"], s.args["slope"])
        if s.args["dbias"]:
            b[s.args["dbias"]][...] = g.sum(axis=(0, 2, 3))
        b[s.args["dx"]][...] = g

    def _avg_pool_backward(self, s, b, lr):
        x, _, dy = (b[n] for n in s.reads)
        _, cache = cpu.avg_pool_forward(x.copy(), s.args["kernel"], s.args["stride"], s.args["padding"])
        b[s.writes[0]][...] = cpu.avg_pool_backward(dy.copy(), cache)

    def _bn_act_backward(self, s, b, lr):
        dy = b[s.args["dy"]]
        g = dy * _dact(b[s.args["y"]], s.args["act"], s.args["slope"]) if s.args["act"] else dy.copy()
        dx, dgamma, dbeta = cpu.batch_norm_backward(g, self.aux[s.args["saved"][0]])
        if s.args["dx"]:
            b[s.args["dx"]][...] = dx
        b[s.args["grads"][0]][...] = dgamma
        b[s.args["grads"][1]][...] = dbeta

    def _mul(self, s, b, lr):
        b[s.writes[0]][...] = b[s.reads[0]] * b[s.reads[1]]

    def _flat_update(self, s, b, lr):
        opt = self.opt
        for grad_name, param_name in zip(s.reads, s.writes):
            buf = self.aux.setdefault("momentum:" + param_name, np.zeros_like(b[param_name]))
            cpu.sgd_update(b[param_name], b[grad_name], buf if opt["momentum"] else None, lr,
                           momentum=opt["momentum"], weight_decay=opt["weight_decay"],
                           first_step=self.steps_taken == 0)
        self.steps_taken += 1

    def _step_bookkeeping(self, s, b, lr):
        pass
