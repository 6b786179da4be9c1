"""What ``cydnn.compile`` returns for training: :class:`CompiledStep` (inference: inference.py).

It plans lazily per batch size (trace -> fuse -> lower -> memory), binds the plan to device memory,
and on first use runs it once plainly, captures it into a CUDA graph, and checks the graph against
the plain run (the capture self-test, binding.py); a failed capture or self-test leaves the plan
running step by step, with the reason in ``info()`` and the ``cydnn.compiler`` logger.  Every call
first checks that the model still holds the arrays the plan was bound to and re-plans when it does
not.
"""
import numpy as np

from .. import _C, nn
from ..loop import reference_epoch
from . import fused_train, lenet
from .binding import _Runner, _batch_norms, _build_plan, _count_batches, log, module_buffers, signature
from .trace import Unsupported, trace
from .train_step import LR_TABLE, FlatState, optimizer_reason

__all__ = ["CompiledStep", "signature", "_build_plan"]


class CompiledStep:
    """``step(x, y)`` -> loss (a 0-d DeviceArray; reading it waits), ``step.train_epoch(loader, scheduler)``.

    Modes (``info()["mode"]``): ``"graph"`` (the whole step one CUDA-graph launch),
    ``"steps"`` (the same plan launched step by step: capture failed or was switched off),
    ``"fused+graph"`` (an epoch of LeNet-5 on its hand-fused kernels), ``"reference"``
    (the per-op loop: a model on the CPU, or one the compiler does not take; the reason
    says which).  In "graph" and "steps" the plan is the generic one or, where it agrees and
    measures faster on the first batch, the fused step (fused_train.py): ``info()["fused_train"]``.
    """

    def __init__(self, model, optimizer, batch_size, loss_fn=None, input_shape=None, cuda_graph=True,
                 fused=True, **options):
        if not isinstance(model, nn.Module):
            raise TypeError(f"compile: model must be an nn.Module, got {type(model).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"compile: batch_size must be an int >= 1, got {batch_size!r}")
        self.model, self.optimizer, self.batch_size = model, optimizer, int(batch_size)
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.cuda_graph, self.fused, self.options = bool(cuda_graph), bool(fused), options
        self.reason = self._reference_reason()
        self.mode = "reference" if self.reason else ("graph" if cuda_graph else "steps")
        if self.reason:
            log.info("compile: reference path: %s", self.reason)
        elif self.fused and self.input_shape is not None and self.batch_size <= _C.LENET_MAX_TRAIN_BATCH:
            found = lenet.match(trace(self.model, self.input_shape, self.batch_size), self.input_shape)
            if not isinstance(found, str):      # epochs on the hand-fused kernels (steps on the generic plan)
                self.mode = "fused+graph" if cuda_graph else "fused"
        self._flat = None
        self._runners = {}
        self._sig = None
        self._lenet = None
        self._lenet_reason = None
        self._num_classes = {}
        self._fused_trials = {}   # (batch, input shape) -> what the fused step's trial found
        self.mode_used = None     # what ran the last epoch (train_epoch reports it)

    def _reference_reason(self):
        if not self.cuda_graph and not self.fused:
            return "compiled step switched off (cuda_graph=False, fused=False): the per-op reference loop"
        if type(self.loss_fn) is not nn.CrossEntropyLoss:
            return f"the compiled step computes CrossEntropyLoss, not {type(self.loss_fn).__name__}"
        if self.model.device != "cuda":
            return f"the model is on {self.model.device!r}: compiled steps run on 'cuda'"
        if self.input_shape is not None:
            try:
                trace(self.model, self.input_shape, self.batch_size)
            except Unsupported as e:
                return str(e)
        params = [p for _, p in self.model.named_parameters()]
        return optimizer_reason(self.optimizer, params)

    # -- planning --------------------------------------------------------------
    def _runner(self, batch, input_shape):
        key = (batch, tuple(input_shape))
        stale = self._sig is None or not self._sig.fresh() or not self._flat.fresh(self._flat.params)
        plan = None
        if stale or key not in self._runners:      # trace first: a bad shape is refused before any GPU work
            plan, _ = _build_plan(self.model, input_shape, batch, True, self.options)
        if stale:
            self._replan()
        runner = self._runners.get(key)
        if runner is None:
            given = self._flat.given()
            given.update(module_buffers(self.model, plan))
            runner = _Runner(plan, given, self.cuda_graph and self.mode != "steps")
            runner.counted = [m for m in _batch_norms(plan)]
            runner.key, runner.candidate = key, self._fused_candidate(key, plan, given)
            self._runners[key] = runner
        return runner

    def _fused_candidate(self, key, plan, given):
        """The fused step's runner for ``plan``'s network (fused_train.py), or None with the reason kept."""
        if not self.fused:
            self._fused_trials[key] = {"used": False, "reason": "fused kernels switched off (fused=False)"}
            return None
        if fused_train.mode() == "off":
            self._fused_trials[key] = {"used": False, "reason": "switched off ($CYDNN_FUSED_TRAIN=off)"}
            return None
        layers = fused_train.describe_training(plan.nodes)
        if isinstance(layers, str):
            self._fused_trials[key] = {"used": False, "reason": layers}
            return None
        try:
            fplan = fused_train.lower_fused_training(layers, plan.nodes, plan.batch, plan.log)
            cand = _Runner(fplan, given, self.cuda_graph and self.mode != "steps")
        except (_C.CydnnError, ValueError) as e:
            self._fused_trials[key] = {"used": False, "reason": f"not bound: {e}"}
            log.info("compile: fused step not used: %s", e)
            return None
        cand.key = key
        return cand

    def _prepare(self, runner, x, y):
        """First use of a plan: its capture self-test; where the fused step takes the network, that step's too,
        then both run once from the same state (the same loss and gradients, or the fused one is dropped) and
        are timed; the faster trains from now on (``$CYDNN_FUSED_TRAIN=force``: the fused one)."""
        runner.prepare(self._snapshot, compare=("loss",))
        self._note(runner)
        cand, runner.candidate = runner.candidate, None
        if cand is None:
            return runner
        try:
            self._feed(cand, x, y)
            cand.prepare(self._snapshot, compare=("loss",))
            chosen, trial = fused_train.trial(runner, cand, self._snapshot, self._flat)
        except (_C.CydnnError, RuntimeError, ValueError) as e:
            chosen, trial = runner, {"used": False, "reason": f"failed: {e}"}
        step = cand.plan.steps[0]
        trial.update(cluster=step.args.get("cluster"), cluster_us=step.args.get("timed_us"))
        self._fused_trials[runner.key] = trial
        if trial.get("reason"):
            log.info("compile: fused step not used: %s", trial["reason"])
        if chosen is cand:
            cand.generic_plan = runner.plan     # the bound plan it was timed against, for explain()
            self._runners[runner.key] = cand
            self._note(cand)            # its capture failed: "steps", with the reason
        return chosen

    def _replan(self):
        """(Re)bind: flat buffers from the model's current parameters; plans made again on use."""
        named = list(self.model.named_parameters())
        reason = optimizer_reason(self.optimizer, [p for _, p in named])
        if reason:
            raise ValueError(f"compiled step: {reason}")
        self._flat = FlatState(named, self.optimizer)
        self._runners = {}
        self._sig = signature(self.model)

    def _snapshot(self):
        flat = self._flat
        stats = [a for _, a in self.model.named_buffers() if isinstance(a, _C.DeviceArray)]
        saved = [(a, a.copy()) for a in (flat.flat_param, flat.flat_s1, flat.flat_s2, flat.counters, *stats)
                 if a is not None]

        def restore():
            for dst, src in saved:
                _C.copy_into(dst, src)
        return restore

    # -- one step ----------------------------------------------------------------
    def __call__(self, x, y):
        if self.mode == "reference":
            return self._reference_step(x, y)
        x, y = self._check_batch(x, y)
        runner = self._runner(x.shape[0], x.shape[1:])
        self._feed(runner, x, y)
        self._flat.set_lr(self.optimizer.lr)
        if not runner.ready:
            runner = self._prepare(runner, x, y)
        runner.launch()
        for st in self.optimizer.state:
            st["step"] += 1
        _count_batches(runner.counted, 1)
        self._flat.publish_grads()
        return runner.bound.arrays["loss"].copy()

    def _note(self, runner):
        if not runner.use_graph and self.mode in ("graph", "fused+graph"):
            self.mode, self.reason = "steps", runner.reason

    def _reference_step(self, x, y):
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        self.model.backward(self.loss_fn.backward(), input_grad=False)
        self.optimizer.step()
        return loss

    def _check_batch(self, x, y):
        B = self.batch_size
        if not isinstance(x, (np.ndarray, _C.DeviceArray)):
            raise TypeError(f"compiled step: x must be a numpy array or DeviceArray, got {type(x).__name__}")
        if x.dtype != np.float32:
            raise TypeError(f"compiled step: x must be float32, got {x.dtype}")
        if x.ndim < 2 or x.shape[0] != B:
            raise ValueError(f"compiled step: x has shape {tuple(x.shape)}; this step was compiled for batches of "
                             f"{B} (compile another step for another batch size)")
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"compiled step: x has shape {tuple(x.shape)}, the step was compiled for "
                             f"{(B,) + self.input_shape}")
        if isinstance(y, np.ndarray):
            if y.shape != (B,) or not np.issubdtype(y.dtype, np.integer):
                raise ValueError(f"compiled step: y must be {B} integer labels, got {y.dtype} {y.shape}")
            classes = self._classes(x)
            if y.size and (y.min() < 0 or y.max() >= classes):
                raise ValueError(f"compiled step: labels must be in [0, {classes}), got [{y.min()}, {y.max()}]")
            y = y.astype(np.int32, copy=False)
        elif isinstance(y, _C.DeviceArray):
            if y.shape != (B,) or y.dtype != np.int32:
                raise ValueError(f"compiled step: y must be an int32 DeviceArray of shape ({B},), "
                                 f"got {y.dtype} {y.shape}")
        else:
            raise TypeError(f"compiled step: y must be a numpy array or DeviceArray, got {type(y).__name__}")
        return x, y

    def _classes(self, x):
        shape = tuple(x.shape[1:])
        if shape not in self._num_classes:
            self._num_classes[shape] = trace(self.model, shape, 1)[-1].out_shape[-1]
        return self._num_classes[shape]

    @staticmethod
    def _feed(runner, x, y):
        arrays = runner.bound.arrays
        if isinstance(x, _C.DeviceArray) and isinstance(y, _C.DeviceArray):     # one launch for the two copies
            _C.copy2_into(arrays["x"], x, arrays["labels"], y)
            return
        for name, v in (("x", x), ("labels", y)):
            if isinstance(v, _C.DeviceArray):
                _C.copy_into(arrays[name], v)
            else:
                arrays[name].set_(v)

    # -- an epoch ---------------------------------------------------------------
    def train_epoch(self, loader, scheduler=None, steps=None, progress=None):
        """One epoch (or its first ``steps`` batches); returns ``{"loss", "accuracy", "seconds", "steps",
        "images", "mode"}`` as the reference loop reports them."""
        import time
        gpu = self.model.device == "cuda"
        if gpu:
            _C.synchronize()
        start = time.perf_counter()
        if self.mode == "reference":
            self.mode_used = "reference"
            nsteps, images, loss, right = reference_epoch(self.model, self.loss_fn, self.optimizer, loader,
                                                          scheduler, steps, progress)
        else:
            nsteps, images, loss, right = self._compiled_epoch(loader, scheduler, steps)
        if gpu:
            _C.synchronize()
        return {"loss": loss, "accuracy": right / max(1, images), "seconds": time.perf_counter() - start,
                "steps": nsteps, "images": images, "mode": self.mode_used}

    def _compiled_epoch(self, loader, scheduler, steps):
        if loader.device != "cuda":
            raise ValueError(f"train_epoch: the loader is on {loader.device!r}; a compiled step takes 'cuda' loaders")
        if loader.batch_size != self.batch_size:
            raise ValueError(f"train_epoch: the step was compiled for batch_size {self.batch_size}, the loader "
                             f"gives {loader.batch_size}: compile another step for it")
        result = self._lenet_epoch(loader, scheduler, steps)
        if result is not None:
            self.mode_used = "fused+graph" if self._lenet.use_graphs else "fused"
            return self._finish(result, scheduler)
        self.mode_used = "graph" if self.mode in ("fused+graph", "fused") and self.cuda_graph else \
            ("steps" if self.mode in ("fused+graph", "fused") else self.mode)
        opt = self.optimizer
        total = len(loader)
        nsteps = total if steps is None else max(0, min(int(steps), total))
        t0 = scheduler.last_epoch if scheduler is not None else 0
        images = 0
        started = False
        lrs = np.array([scheduler.lr_at(t0 + j) for j in range(nsteps)], np.float32) if scheduler else None
        for i, (x, y) in enumerate(loader):
            if i >= nsteps:
                break
            runner = self._runner(x.shape[0], x.shape[1:])
            if not started:       # the counters, once an epoch
                self._flat.set_counters(opt.state[0]["step"], 0)
                if lrs is None:
                    self._flat.set_lr(opt.lr)
                started = True
            if lrs is not None and i % LR_TABLE == 0:     # the epoch's learning rates, a table at a time
                self._flat.set_schedule(lrs, first=i)
            self._feed(runner, x, y)
            if not runner.ready:
                runner = self._prepare(runner, x, y)
                self.mode_used = "steps" if not runner.use_graph else self.mode_used
            runner.launch()
            _count_batches(runner.counted, 1)
            images += int(y.shape[0])
        if not started:
            return self._finish((0, 0, float("nan"), 0), scheduler)
        c = self._flat.read_counters()
        self._flat.publish_grads()
        return self._finish((nsteps, images, float(c["loss_sum"]), int(c["correct"])), scheduler)

    def _finish(self, result, scheduler):
        nsteps, images, loss_sum, right = result
        for st in self.optimizer.state:
            st["step"] += nsteps
        if scheduler is not None:
            scheduler.last_epoch += nsteps
            self.optimizer.lr = scheduler.lr_at(scheduler.last_epoch)
        return nsteps, images, (loss_sum / nsteps if nsteps else float("nan")), right

    def _lenet_epoch(self, loader, scheduler, steps):
        """The hand-fused LeNet-5 epoch where it takes the model and the loader, else None."""
        if not self.fused:
            self._lenet_reason = "fused kernels switched off (fused=False)"
            return None
        images = getattr(loader, "_images", None)
        if images is None or len(images.shape) != 3 or images.dtype != np.uint8:
            self._lenet_reason = "the loader's images are not single-channel uint8 (N, H, W)"
            return None
        shape = (1, images.shape[1] + 2 * loader.pad, images.shape[2] + 2 * loader.pad)
        try:
            nodes = trace(self.model, shape, self.batch_size)
        except Unsupported as e:
            self._lenet_reason = str(e)
            return None
        found = lenet.match(nodes, shape)
        if isinstance(found, str) or self.batch_size > _C.LENET_MAX_TRAIN_BATCH:
            self._lenet_reason = found if isinstance(found, str) else \
                f"batch_size {self.batch_size} is over the fused step's {_C.LENET_MAX_TRAIN_BATCH}"
            return None
        classic, num_classes = found
        self._lenet_reason = None
        params = lenet.parameters(nodes)
        if self._lenet is None or self._lenet.params != params:
            self._lenet = lenet.LeNetEpoch(params, classic, num_classes, self.optimizer, self.batch_size,
                                           use_graphs=self.cuda_graph)
        try:
            return self._lenet.run(loader, scheduler, steps)
        except _C.CydnnError as e:
            if not self._lenet.use_graphs:
                raise
            self._lenet.use_graphs, self._lenet.graphs = False, {}
            self.mode, self.reason = "fused", f"CUDA graph capture failed: {e}"
            log.warning("compile: running the fused kernels without graphs: %s", self.reason)
            return self._lenet.run(loader, scheduler, steps)

    # -- introspection ----------------------------------------------------------

    def plan(self, input_shape=None, batch=None):
        """The training plan for ``batch`` (default: the compiled batch size) inputs of ``input_shape``."""
        shape = input_shape or self.input_shape
        if shape is None:
            raise ValueError("plan: give input_shape (the step has not seen a batch yet)")
        return _build_plan(self.model, shape, batch or self.batch_size, True, self.options)[0]

    def explain(self, input_shape=None):
        """The plan as text (steps, kernels, buffers and bytes), and what runs an epoch; where the fused step
        takes the network, its plan too, and which of the two trains (or that the first batch decides)."""
        if input_shape is None and self.input_shape is None:      # the shape of the batches seen, if any
            seen = [k[1] for k in self._runners if k[0] == self.batch_size]
            input_shape = seen[-1] if seen else None
        shape = tuple(input_shape or self.input_shape or ())
        runner = self._runners.get((self.batch_size, shape))
        # the bound plan where one runs (its steps carry what was timed and chosen when it was bound: a
        # convolution's direct kernel or cuDNN's), else a fresh one
        plan = (getattr(runner, "generic_plan", None) or runner.plan) if runner is not None else self.plan(input_shape)
        text = plan.explain()
        if self.mode == "reference":
            return f"(not used: the reference loop runs, because {self.reason})\n" + text
        trial = self._fused_trials.get((self.batch_size, shape))
        layers = fused_train.describe_training(plan.nodes) if self.fused else "fused kernels switched off"
        if isinstance(layers, str):
            return text + f"\nfused step: not taken ({trial['reason'] if trial else layers})"
        if trial is None:
            verdict = "the first batch runs both and keeps the faster"
        elif trial["used"]:
            verdict = f"it trains (timed, us: {trial.get('timed_us')})"
        else:
            verdict = f"the plan above trains ({trial.get('reason')})"
        fused = fused_train.lower_fused_training(layers, plan.nodes, plan.batch)
        return text + f"\n\nfused step ({verdict}):\n" + fused.explain()

    def info(self):
        """mode and reason (see the class docstring); ``lenet``: why an epoch does not run on the LeNet-5
        kernels (None when it does or was not tried); ``graphs``: the LeNet-5 epoch graphs, (batch, steps) ->
        kernels; ``plans``: (batch, input shape) -> kernels of the plan's graph (None: launched step by step);
        ``fused_train``: (batch, input shape) -> whether the fused step (fused_train.py) trains, its trial's
        loss, gradient difference and times, or why not."""
        return {"mode": self.mode, "reason": self.reason, "batch_size": self.batch_size,
                "lenet": self._lenet_reason,
                "graphs": dict((k, g.kernel_count) for k, g in self._lenet.graphs.items()) if self._lenet else {},
                "plans": {k: (r.bound.graph.kernel_count if r.bound.graph is not None else None)
                          for k, r in self._runners.items()},
                "kernels_per_step": {k: r.plan.kernel_count() for k, r in self._runners.items()},
                "fused_train": dict(self._fused_trials)}
