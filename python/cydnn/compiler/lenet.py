"""The LeNet-5 backend: the hand-fused kernels (cpp/fused_lenet*.cu), one of the planner's choices.

The kernels hard-code LeNet-5's geometry: a network qualifies by its traced layers, not by
its class.  :func:`match` returns ``(classic, num_classes)`` for the nodes of exactly that
network, else the reason it is not.  Inference: one kernel does the preprocessing, both
convolutions with bias, activation and pooling, the three linear layers and softmax
(:class:`LeNetPredictor`, numpy in / numpy out in one C call).  Training:
:class:`LeNetEpoch` runs a whole epoch of the loader as three kernels per step
(gather + forward + loss + backward; reduce + update; bookkeeping), in CUDA graphs of
32 steps, the next epoch's sample order drawn on the host while the GPU runs this one.  The planner (:mod:`cydnn.compiler.api`) picks them where they take the model.
"""
import threading
import weakref

import numpy as np

from .. import _C, optim

__all__ = ["match", "LeNetPredictor", "LeNetEpoch", "MAX_CLASSES"]

MAX_CLASSES = 32
CHUNK_STEPS = 32       # steps per captured graph (the rest of an epoch replays the one-step graph)


def _is(node, op, **attrs):
    return node.op == op and all(node.attrs.get(k) == v for k, v in attrs.items())


def match(nodes, input_shape):
    """``(classic, num_classes)`` when ``nodes`` are LeNet-5's layers, else a str: why not."""
    ops = [n.op for n in nodes]
    modern = ["conv2d", "relu", "max_pool", "conv2d", "relu", "max_pool", "flatten",
              "linear", "relu", "linear", "relu", "linear"]
    classic = [o.replace("relu", "tanh").replace("max_pool", "avg_pool") for o in modern]
    if ops not in (modern, classic):
        return "the fused kernels run LeNet-5 only: " + " ".join(ops) + " is another network"
    is_classic = ops == classic
    if tuple(input_shape) != ((1, 32, 32) if is_classic else (1, 28, 28)):
        return f"input {tuple(input_shape)} is not LeNet-5's"
    weights = [(0, (6, 1, 5, 5)), (3, (16, 6, 5, 5)), (7, (120, 400 if is_classic else 256)), (9, (84, 120))]
    for i, shape in weights:
        m = nodes[i].module
        if m.weight.shape != shape or m.bias is None:
            return f"layer {nodes[i].name} has weight {m.weight.shape} (want {shape}) or no bias"
    for i in (0, 3):
        if nodes[i].attrs != {"stride": (1, 1), "padding": (0, 0)}:
            return f"layer {nodes[i].name} has stride/padding {nodes[i].attrs}"
    for i in (2, 5):
        if nodes[i].attrs != {"kernel": (2, 2), "stride": (2, 2), "padding": (0, 0)}:
            return f"layer {nodes[i].name} is not a 2x2 pool with stride 2 and no padding"
    last = nodes[11].module
    if last.weight.shape[1] != 84 or last.bias is None or not 1 <= last.weight.shape[0] <= MAX_CLASSES:
        return f"layer {nodes[11].name} has weight {last.weight.shape}: (1..{MAX_CLASSES}, 84) with a bias wanted"
    return is_classic, int(last.weight.shape[0])


def parameters(nodes):
    """The ten Parameters in the kernels' order (conv1.w, conv1.b, ..., fc3.b)."""
    return tuple(p for i in (0, 3, 7, 9, 11) for p in (nodes[i].module.weight, nodes[i].module.bias))


class LeNetPredictor:
    """Raw images (N, 28, 28) uint8 or float32 in [0, 1] -> probabilities, one C call (cpp/fastpath.cu)."""

    def __init__(self, nodes, classic, num_classes, mean, std, use_graphs=True, full=False):
        """``full``: inputs are float32 of the network's own size (classic (N, 32, 32), padding
        included), taken as they are instead of raw 28x28 images the kernel pads."""
        self.classic, self.num_classes, self.full = bool(classic), num_classes, bool(full)
        self.params = parameters(nodes)
        self._p = _C.Predictor(classic, num_classes, float(mean), float(std), use_graphs)
        self._lock = threading.Lock()     # the C predictor's pinned buffers and graphs are shared by its calls

    @property
    def graph_count(self):
        return self._p.graph_count

    def __call__(self, images):
        if images.dtype != np.uint8 and images.dtype != np.float32:
            images = images.astype(np.float32)
        if not images.flags.c_contiguous:
            images = np.ascontiguousarray(images)
        if not images.shape[0]:
            return np.empty((0, self.num_classes), np.float32)
        with self._lock:
            return self._p(self.params, images, self.full)   # the Parameters: the C call reads each .data now


class LeNetEpoch:
    """A whole epoch of a device DataLoader through the fused training kernels (see the module docstring).

    ``run(loader, scheduler, steps)`` returns ``(steps, images, loss sum, correct)``;
    raises ``_C.CydnnError`` when a graph cannot be captured (the caller falls back).
    """

    def __init__(self, params, classic, num_classes, optimizer, batch_size, use_graphs=True):
        self.params, self.classic, self.num_classes = tuple(params), classic, num_classes
        self.optimizer, self.batch_size, self.use_graphs = optimizer, batch_size, use_graphs
        self._built = None
        self.graphs = {}
        self._ahead = None        # what the order/seeds "ahead" buffers hold: _ahead_key's tuple, or None

    def _build(self, loader):
        opt, params, B = self.optimizer, self.params, self.batch_size
        for i, p in enumerate(params):
            if opt.state[i] is None:
                opt.state[i] = opt._init_state(p)
        n = loader.num_samples
        steps = -(-n // B)
        sizes = [_C.lenet_param_size(self.classic, self.num_classes, i) for i in range(len(params))]
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
        # the next epoch's order and seeds, computed and uploaded while this one runs (``run``)
        self._order_ahead = _C.empty((n,), np.int32)
        self._seeds_ahead = _C.empty((2 * steps,), np.int32) if loader.max_shift > 0 else None
        self._ahead = None
        self._lr = _C.empty((steps,))
        self._counters = _C.empty((_C.COUNTERS_DTYPE.itemsize // 4,), np.int32)
        scratch = _C.empty((_C.lenet_train_scratch_bytes(self.classic, self.num_classes, B),), np.uint8)
        common = dict(classic=self.classic, num_classes=self.num_classes, images=loader._images,
                      labels=loader._labels, order=self._order, order_stride=B, seeds=self._seeds,
                      max_shift=loader.max_shift, mean=loader.mean, std=loader.std,
                      params=tuple(p.data for p in params), grads=tuple(grads), state1=s1, state2=s2,
                      optimizer=kind, lr_table=self._lr, counters=self._counters, scratch=scratch, **hyper)
        tail = n - (steps - 1) * B
        self._steps = {B: _C.LeNetTrainStep(batch=B, **common)}
        if tail != B:
            self._steps[tail] = _C.LeNetTrainStep(batch=tail, **common)
        self.grads = grads
        self.graphs = {}
        self._built = self._key(loader)

    def _key(self, loader):
        state = tuple(v for s in self.optimizer.state if s is not None for v in s.values()
                      if isinstance(v, _C.DeviceArray))
        return (loader._images, loader._labels, loader.num_samples, loader.max_shift, loader.mean, loader.std,
                tuple(p.data for p in self.params), state)

    def _stale(self, loader):
        key = self._key(loader)
        return self._built is None or len(key) != len(self._built) or any(
            (a is not b) if not isinstance(a, (int, float, tuple)) else a != b for a, b in zip(key, self._built))

    def _inputs(self, loader, epoch, total):
        """``epoch``'s sample order (int32) and, where the loader shifts its images, its ``total`` batches' seeds
        (uint64 pairs as int32, zero-padded to the buffer), as numpy arrays; else (order, None)."""
        seeds = None
        if self._seeds is not None:
            s = np.array([loader.batch_seed(epoch, b) for b in range(total)], dtype=np.uint64)
            seeds = np.concatenate([s, np.zeros(self._seeds.size // 2 - total, np.uint64)]).view(np.int32)
        return loader.permutation(epoch), seeds

    @staticmethod
    def _ahead_key(loader, epoch, total):
        """What decides ``_inputs(loader, epoch, total)``: the loader (weakly), its seed, shuffle, size and shifts."""
        return (weakref.ref(loader), loader.seed, loader.shuffle, loader.num_samples, loader.max_shift, epoch, total)

    def _ahead_holds(self, loader, epoch, total):
        """Whether the ahead buffers hold ``_inputs(loader, epoch, total)`` (``_build`` forgets them)."""
        key = self._ahead
        return key is not None and key[0]() is loader and key[1:] == self._ahead_key(loader, epoch, total)[1:]

    def _graph(self, batch, count):
        key = (batch, count)
        if key not in self.graphs:
            step = self._steps[batch]
            _C.graph_begin()
            try:
                for _ in range(count):
                    step.enqueue()
            except BaseException:
                _C.graph_end(discard=True)
                raise
            self.graphs[key] = _C.graph_end()
        return self.graphs[key]

    def _launch(self, n_full, tail):
        B = self.batch_size
        if self.use_graphs:
            chunk = min(CHUNK_STEPS, n_full) if n_full else 0
            launches = [(B, chunk)] * (n_full // chunk) if chunk else []
            launches += [(B, 1)] * (n_full - (n_full // chunk) * chunk if chunk else 0)
            if tail:
                launches.append((tail, 1))
            for b, c in dict.fromkeys(launches):   # capture every graph before launching any
                self._graph(b, c)
            for b, c in launches:
                self.graphs[(b, c)].launch()
            return
        for _ in range(n_full):
            self._steps[B].enqueue()
        if tail:
            self._steps[tail].enqueue()

    def run(self, loader, scheduler, steps):
        if self._stale(loader):
            self._build(loader)
        B, n, opt = self.batch_size, loader.num_samples, self.optimizer
        total = n // B if loader.drop_last else -(-n // B)
        nsteps = total if steps is None else max(0, min(int(steps), total))
        n_full = min(nsteps, n // B)
        tail = (n - (n // B) * B) if (nsteps > n_full) else 0
        epoch = loader.epoch
        if self._ahead_holds(loader, epoch, total):
            # computed and uploaded while the last epoch ran: one copy on the device, queued before the steps
            if self._seeds is not None:
                _C.copy2_into(self._order, self._order_ahead, self._seeds, self._seeds_ahead)
            else:
                _C.copy_into(self._order, self._order_ahead)
        else:
            order, seeds = self._inputs(loader, epoch, total)
            self._order.set_(order)
            if seeds is not None:
                self._seeds.set_(seeds)
        self._ahead = None
        t0 = scheduler.last_epoch if scheduler is not None else 0
        lrs = [scheduler.lr_at(t0 + j) for j in range(nsteps)] if scheduler is not None else [opt.lr] * nsteps
        table = np.zeros(self._lr.size, np.float32)
        table[:nsteps] = lrs
        self._lr.set_(table)
        counters = np.zeros(1, _C.COUNTERS_DTYPE)
        counters["global_step"] = opt.state[0]["step"]
        self._counters.set_(counters.view(np.int32))
        self._launch(n_full, tail)       # may raise (capture failed): nothing has been counted yet
        loader.epoch += 1
        # While the GPU runs the epoch (70 ms at batch 64 on the H100), the host draws the next epoch's order
        # (a permutation of the samples: ~1-1.5 ms there) and the shifts' seeds (a SeedSequence a batch), and
        # queues them into the "ahead" buffers behind the steps, which do not read them: the next run starts
        # with one device copy instead of that work while the GPU waits (session 37: 1.6-2 ms of a 71.3 ms epoch
        # were the host's, the launches alone 69.6).  The key says what they hold; any change, and run computes
        # the order as before.
        try:
            order, seeds = self._inputs(loader, epoch + 1, total)
            self._order_ahead.set_(order)
            if seeds is not None:
                self._seeds_ahead.set_(seeds)
            self._ahead = self._ahead_key(loader, epoch + 1, total)
        except Exception:         # (a loader that cannot give its next epoch says so when that epoch runs)
            self._ahead = None
        result = self._counters.numpy().view(_C.COUNTERS_DTYPE)[0]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return nsteps, n_full * B + tail, float(result["loss_sum"]), int(result["correct"])
