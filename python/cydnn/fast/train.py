"""A compiled training step: an epoch of LeNet-5 as a few CUDA-graph launches.

``step = model.compile(optimizer, batch_size=64)`` checks once what the
reference path checks on every call (the model's layers and shapes, the
optimizer, the batch size), allocates every buffer a step needs (the epoch's
order, shift seeds and learning rates, the per-block partial gradients, the
gradients, the counters) and, on the first epoch, captures CUDA graphs of
the step.  A step is three kernels (cpp/fused_lenet_train.cu):

1. ``train_kernel``: per block, gather G images of the batch from the
   dataset on the GPU (the same shifts and floats as ``ops.gather_batch``),
   the whole forward, the loss, the whole backward, the block's gradient;
2. ``update_kernel``: the gradient (the blocks' partials summed in a fixed
   order) and the optimizer update of every parameter (SGD with momentum /
   Nesterov / weight decay, Adam, AdamW: optimizer.cu's formulas), with the
   learning rate read from a device table, so a schedule needs no re-capture;
3. ``counters_kernel``: the step's loss and correct count into epoch totals.

``step.train_epoch(loader, scheduler)`` uploads the epoch's permutation (the
same one ``iter(loader)`` would use), replays the graphs, and reads the loss
and accuracy back once.  Results match the reference path (same batches, same
formulas) up to float32 summation order; ``tests/test_fast.py`` checks it.

Fallbacks, each with its reason in ``step.info()`` and in the
``cydnn.fast`` logger: a model or optimizer the fused kernels don't take runs
the reference loop (mode ``"plain"``); a graph that cannot be captured runs
the same kernels launched one by one (mode ``"fused"``).
"""
import logging
import time

import numpy as np

from .. import _C, nn, optim
from .support import lenet_parameters, lenet_unsupported_reason

__all__ = ["CompiledStep", "compile_training"]

log = logging.getLogger("cydnn.fast")

#: steps per captured graph (the rest of an epoch replays the one-step graph)
CHUNK_STEPS = 32


def compile_training(model, optimizer, batch_size, loss_fn=None, cuda_graph=True, fused=True):
    """A :class:`CompiledStep` for ``model`` (see the module docstring)."""
    return CompiledStep(model, optimizer, batch_size, loss_fn=loss_fn, cuda_graph=cuda_graph, fused=fused)


def _optimizer_reason(model, optimizer):
    if type(optimizer) not in (optim.SGD, optim.Adam, optim.AdamW):
        return f"the fused update knows SGD, Adam and AdamW, not {type(optimizer).__name__}"
    params = lenet_parameters(model)
    if len(optimizer.params) != len(params) or any(a is not b for a, b in zip(optimizer.params, params)):
        return "the optimizer does not hold exactly the model's parameters, in order"
    steps = {0 if s is None else s["step"] for s in optimizer.state}
    if len(steps) > 1:
        return f"the parameters have taken different numbers of steps ({sorted(steps)})"
    return None


class CompiledStep:
    """See the module docstring.  ``mode``: "fused+graph", "fused" or "plain"."""

    def __init__(self, model, optimizer, batch_size, loss_fn=None, cuda_graph=True, fused=True):
        self.model, self.optimizer = model, optimizer
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"compile: batch_size must be >= 1, got {batch_size}")
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.cuda_graph = bool(cuda_graph)
        reason = None
        if not fused:
            reason = "fused kernels switched off (fused=False)"
        elif type(self.loss_fn) is not nn.CrossEntropyLoss:
            reason = f"the fused step computes CrossEntropyLoss, not {type(self.loss_fn).__name__}"
        elif self.batch_size > _C.LENET_MAX_TRAIN_BATCH:
            reason = f"batch_size {self.batch_size} is over the fused step's {_C.LENET_MAX_TRAIN_BATCH}"
        else:
            reason = lenet_unsupported_reason(model) or _optimizer_reason(model, optimizer)
        self.mode = "plain" if reason else ("fused+graph" if cuda_graph else "fused")
        self.reason = reason or ("" if cuda_graph else "CUDA graphs switched off (cuda_graph=False)")
        if reason:
            log.info("compile: reference path: %s", reason)
        self._built = None      # (loader images, params) the buffers were made for
        self._graphs = {}

    # -- introspection ------------------------------------------------------
    def info(self):
        """What runs: mode, reason for any fallback, kernels per step, graphs captured."""
        kernels = {"fused+graph": 3, "fused": 3}.get(self.mode)
        return {"mode": self.mode, "reason": self.reason, "kernels_per_step": kernels,
                "graphs": {k: g.kernel_count for k, g in self._graphs.items()},
                "batch_size": self.batch_size}

    # -- the reference loop -------------------------------------------------
    def _plain_epoch(self, loader, scheduler, steps, progress=None):
        """The reference loop, the one ``python -m cydnn.train --no-cuda-graph`` and the CPU run.

        Nothing is read back until the epoch ends: the losses and logits stay
        on the device and are looked at once.
        """
        from .. import ops
        model, loss_fn, opt = self.model, self.loss_fn, self.optimizer
        model.train()
        losses, correct, images = [], [], 0
        batches = loader if progress is None else progress(loader)
        for i, (x, y) in enumerate(batches):
            if steps is not None and i >= steps:
                break
            logits = model(x)
            losses.append(loss_fn(logits, y))
            correct.append((logits, y))
            if isinstance(model, nn.Sequential):
                model.backward(loss_fn.backward(), input_grad=False)   # the input is data
            else:
                model.backward(loss_fn.backward())
            opt.step()
            if scheduler is not None:
                scheduler.step()
            images += len(y)
        backend = ops.backend_of(losses[0]) if losses else None
        loss = float(np.mean([float(backend.to_numpy(l)) for l in losses])) if losses else float("nan")
        right = sum(int((backend.to_numpy(z).argmax(1) == backend.to_numpy(t)).sum()) for z, t in correct)
        return len(losses), images, loss, right

    # -- the fused step -----------------------------------------------------
    def _build(self, loader):
        model, opt = self.model, self.optimizer
        if loader.device != "cuda" or loader.pad != model.input_pad:
            raise ValueError(f"train_epoch: the loader must be on 'cuda' with pad {model.input_pad} "
                             f"(got device {loader.device!r}, pad {loader.pad})")
        params = lenet_parameters(model)
        for i, p in enumerate(params):
            if opt.state[i] is None:
                opt.state[i] = opt._init_state(p)
        n, B = loader.num_samples, self.batch_size
        steps = -(-n // B)
        sizes = [_C.lenet_param_size(model.classic, model.num_classes, i) for i in range(len(params))]
        grad_buf = _C.empty((sum(sizes),))
        grads, off = [], 0
        for p, size in zip(params, sizes):
            grads.append(_C.view(grad_buf, off, p.shape))
            off += size
        if isinstance(opt, optim.SGD):
            kind = _C.OPT_SGD
            s1 = tuple(st["momentum_buffer"] for st in opt.state)
            s2 = (None,) * len(params)
            hyper = dict(momentum=opt.momentum, dampening=opt.dampening, weight_decay=opt.weight_decay,
                         nesterov=opt.nesterov)
        else:
            kind = _C.OPT_ADAMW if isinstance(opt, optim.AdamW) else _C.OPT_ADAM
            s1 = tuple(st["exp_avg"] for st in opt.state)
            s2 = tuple(st["exp_avg_sq"] for st in opt.state)
            hyper = dict(weight_decay=opt.weight_decay, beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps)
        self._order = _C.empty((n,), np.int32)
        self._seeds = _C.empty((2 * steps,), np.int32) if loader.max_shift > 0 else None
        self._lr = _C.empty((steps,))
        self._counters = _C.empty((_C.COUNTERS_DTYPE.itemsize // 4,), np.int32)
        scratch = _C.empty((_C.lenet_train_scratch_bytes(model.classic, model.num_classes, B),), np.uint8)
        common = dict(classic=model.classic, num_classes=model.num_classes, images=loader._images,
                      labels=loader._labels, order=self._order, order_stride=B, seeds=self._seeds,
                      max_shift=loader.max_shift, mean=loader.mean, std=loader.std,
                      params=tuple(p.data for p in params), grads=tuple(grads), state1=s1, state2=s2,
                      optimizer=kind, lr_table=self._lr, counters=self._counters, scratch=scratch, **hyper)
        tail = n - (steps - 1) * B
        self._steps = {B: _C.LeNetTrainStep(batch=B, **common)}
        if tail != B:
            self._steps[tail] = _C.LeNetTrainStep(batch=tail, **common)
        self._grads = grads
        self._graphs = {}
        self._built = self._build_key(loader)

    def _build_key(self, loader):
        opt = self.optimizer
        state = tuple(v for s in opt.state if s is not None for v in s.values() if isinstance(v, _C.DeviceArray))
        return (loader._images, loader._labels, loader.num_samples, loader.max_shift, loader.mean, loader.std,
                tuple(p.data for p in lenet_parameters(self.model)), state)

    def _stale(self, loader):
        key = self._build_key(loader)
        return self._built is None or len(key) != len(self._built) or any(
            (a is not b) if not isinstance(a, (int, float, tuple)) else a != b for a, b in zip(key, self._built))

    def _graph(self, batch, count):
        """The graph of ``count`` steps of ``batch`` images, captured on first use."""
        key = (batch, count)
        if key not in self._graphs:
            step = self._steps[batch]
            _C.graph_begin()
            try:
                for _ in range(count):
                    step.enqueue()
            except BaseException:
                _C.graph_end(discard=True)
                raise
            self._graphs[key] = _C.graph_end()
        return self._graphs[key]

    def _run_fused(self, n_full, tail):
        B = self.batch_size
        if self.mode == "fused+graph":
            try:
                chunk = min(CHUNK_STEPS, n_full) if n_full else 0
                launches = [(B, chunk)] * (n_full // chunk) if chunk else []
                launches += [(B, 1)] * (n_full - (n_full // chunk) * chunk if chunk else 0)
                if tail:
                    launches.append((tail, 1))
                for b, c in dict.fromkeys(launches):   # capture every graph before launching any
                    self._graph(b, c)
                for b, c in launches:
                    self._graphs[(b, c)].launch()
                return
            except _C.CydnnError as e:  # noqa: F841 -- e.g. a driver that cannot capture
                self.mode, self.reason = "fused", f"CUDA graph capture failed: {e}"
                self._graphs = {}
                log.warning("compile: running the fused kernels without graphs: %s", self.reason)
        for _ in range(n_full):
            self._steps[B].enqueue()
        if tail:
            self._steps[tail].enqueue()

    def train_epoch(self, loader, scheduler=None, steps=None, progress=None):
        """One epoch (or its first ``steps`` batches) of ``loader``; returns a dict.

        ``scheduler``: a per-step schedule (``scheduler.step()`` after every
        step in the reference loop); its learning rates for the epoch go to
        the GPU as a table.  Returns ``{"loss", "accuracy", "seconds",
        "steps", "images", "mode"}``; loss and accuracy are over the epoch's
        training batches, as ``python -m cydnn.train`` reports them.
        ``progress``: wraps the batches of the reference loop (e.g. tqdm).
        """
        gpu = self.model.device == "cuda"
        if gpu:
            _C.synchronize()
        start = time.perf_counter()
        if self.mode == "plain":
            nsteps, images, loss, right = self._plain_epoch(loader, scheduler, steps, progress)
        else:
            nsteps, images, loss, right = self._fused_epoch(loader, scheduler, steps)
        if gpu:
            _C.synchronize()
        seconds = time.perf_counter() - start
        return {"loss": loss, "accuracy": right / max(1, images), "seconds": seconds, "steps": nsteps,
                "images": images, "mode": self.mode}

    def _fused_epoch(self, loader, scheduler, steps):
        if loader.batch_size != self.batch_size:
            raise ValueError(f"train_epoch: the step was compiled for batch_size {self.batch_size}, "
                             f"the loader gives {loader.batch_size}: compile another step for it")
        if self._stale(loader):
            self._build(loader)
        B, n, opt = self.batch_size, loader.num_samples, self.optimizer
        total = n // B if loader.drop_last else -(-n // B)
        nsteps = total if steps is None else max(0, min(int(steps), total))
        n_full = min(nsteps, n // B)
        tail = (n - (n // B) * B) if (nsteps > n_full) else 0
        epoch = loader.epoch
        loader.epoch += 1
        self._order.set_(loader.permutation(epoch))
        if self._seeds is not None:
            seeds = np.array([loader.batch_seed(epoch, b) for b in range(total)], dtype=np.uint64)
            seeds = np.concatenate([seeds, np.zeros(self._seeds.size // 2 - total, np.uint64)])
            self._seeds.set_(seeds.view(np.int32))
        t0 = scheduler.last_epoch if scheduler is not None else 0
        lrs = [scheduler.lr_at(t0 + j) for j in range(nsteps)] if scheduler is not None else [opt.lr] * nsteps
        table = np.zeros(self._lr.size, np.float32)
        table[:nsteps] = lrs
        self._lr.set_(table)
        counters = np.zeros(1, _C.COUNTERS_DTYPE)
        counters["global_step"] = opt.state[0]["step"]
        self._counters.set_(counters.view(np.int32))
        self._run_fused(n_full, tail)
        result = self._counters.numpy().view(_C.COUNTERS_DTYPE)[0]
        for state in opt.state:
            state["step"] += nsteps
        if scheduler is not None:
            scheduler.last_epoch += nsteps
            opt.lr = scheduler.lr_at(scheduler.last_epoch)
        for p, g in zip(lenet_parameters(self.model), self._grads):
            p.grad = g
        images = n_full * B + tail
        loss = float(result["loss_sum"]) / nsteps if nsteps else float("nan")
        return nsteps, images, loss, int(result["correct"])
