"""Optimizers and learning-rate schedules.

An optimizer holds a list of :class:`cydnn.nn.Parameter` and, for each, a
small state (momentum buffer, Adam moments) created lazily on the parameter's
device the first time the parameter has a gradient.  ``step()`` calls the
backend's fused update once per parameter -- on CUDA, one kernel per tensor,
with every hyperparameter passed as a Python number, so a step never waits
for the GPU.

All optimizers have one parameter group: ``optimizer.lr`` is the learning
rate, and a schedule changes it by assigning to it.
"""
import math

import numpy as np

from . import ops

__all__ = ["Optimizer", "SGD", "Adam", "AdamW",
           "LRScheduler", "StepLR", "CosineAnnealingLR", "LinearWarmup"]


def _finite(what, value, minimum=None, below=None):
    """``value`` as a float, refusing NaN, infinities, non-numbers, values below ``minimum`` and
    values not below ``below``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{what} must be >= {minimum:g}, got {v}")
    if below is not None and not v < below:
        raise ValueError(f"{what} must be < {below:g}, got {v}")
    return v


def _count(what, value, minimum):
    """``value`` as an int >= ``minimum``, refusing bools, fractions and non-numbers."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


class Optimizer:
    """Base class: parameters, per-parameter state, ``zero_grad`` and ``step``.

    Subclasses define ``_init_state(param)`` (the state of a parameter at its
    first step, a dict with the keys ``STATE_KEYS``), ``_update(param, state)``
    (one update, in place) and ``_checked(hyperparameters)`` (the settings
    validated, as the constructor and :meth:`load_state_dict` take them).
    ``state[i]`` belongs to ``params[i]``; its array entries live on that
    parameter's device.
    """

    STATE_KEYS = ()

    def __init__(self, params, lr):
        self.params = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        self.lr = lr
        self.state = [None] * len(self.params)

    @property
    def lr(self):
        """The learning rate: a finite number >= 0 (checked on every assignment, schedules included)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = _finite(f"{type(self).__name__}: learning rate", value, minimum=0.0)

    def zero_grad(self):
        """Forget every parameter's gradient (``p.grad = None``)."""
        for param in self.params:
            param.grad = None

    def step(self):
        """Update every parameter that has a gradient; those without one are skipped."""
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            if self.state[i] is None:
                self.state[i] = self._init_state(param)
            self._update(param, self.state[i])

    def _init_state(self, param):
        raise NotImplementedError

    def _update(self, param, state):
        raise NotImplementedError

    def _checked(self, hyperparameters):
        """The settings of ``hyperparameters()`` validated (``ValueError``/``TypeError`` naming the
        optimizer and the setting); subclasses add theirs."""
        name = type(self).__name__
        return {"lr": _finite(f"{name}: learning rate", hyperparameters["lr"], minimum=0.0)}

    def _check_entry(self, i, entry, hyperparameters):
        """Subclass hook: refuse a restored state entry that does not fit the restored settings."""

    # -- saving and restoring -------------------------------------------------
    def hyperparameters(self):
        """The settings a checkpoint must keep (``lr`` plus the subclass's)."""
        return {"lr": self.lr}

    def state_dict(self):
        """``{"hyperparameters": {...}, "state": [per-parameter dict or None]}`` on the host.

        Arrays become numpy copies; step counters (and None buffers) stay as they are.
        """
        def to_host(value):
            if value is None or isinstance(value, (int, float)):
                return value
            return np.array(ops.backend_of(value).to_numpy(value), copy=True)

        state = [None if s is None else {k: to_host(v) for k, v in s.items()} for s in self.state]
        return {"hyperparameters": self.hyperparameters(), "state": state}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output; arrays go to each parameter's device and dtype.

        Everything is checked before anything changes (a refused dict leaves the optimizer as it
        was): the settings as the constructor checks them, one state entry per parameter, each
        None or a dict with exactly this optimizer's keys, ``step`` an integer >= 0 and every
        array of its parameter's shape.  ``ValueError``/``TypeError`` name the entry.
        """
        name = type(self).__name__
        if not isinstance(state_dict, dict) or set(state_dict) != {"hyperparameters", "state"}:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{name}.load_state_dict: expected a dict with 'hyperparameters' and 'state', "
                             f"got {got}")
        saved_hp, state = state_dict["hyperparameters"], state_dict["state"]
        expected = set(self.hyperparameters())
        if not isinstance(saved_hp, dict) or set(saved_hp) != expected:
            got = sorted(saved_hp) if isinstance(saved_hp, dict) else type(saved_hp).__name__
            raise ValueError(f"{name}.load_state_dict: hyperparameters must be {sorted(expected)}, got {got}")
        hp = self._checked(saved_hp)
        if not isinstance(state, (list, tuple)):
            raise ValueError(f"optimizer state must be a list with one entry per parameter, "
                             f"got {type(state).__name__}")
        if len(state) != len(self.params):
            raise ValueError(f"optimizer state has {len(state)} entries but the optimizer "
                             f"has {len(self.params)} parameters")
        new_state = []
        for i, (param, saved) in enumerate(zip(self.params, state)):
            if saved is None:
                new_state.append(None)
                continue
            if not isinstance(saved, dict) or set(saved) != set(self.STATE_KEYS):
                got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
                raise ValueError(f"optimizer state {i}: expected the keys {sorted(self.STATE_KEYS)}, got {got}")
            entry = {}
            for key, value in saved.items():
                if key == "step":
                    entry[key] = _count(f"optimizer state {i} 'step'", value, 0)
                    continue
                if value is None:
                    entry[key] = None
                    continue
                value = np.asarray(value)
                if value.shape != param.shape:
                    raise ValueError(f"optimizer state {i} {key!r}: expected shape {param.shape}, "
                                     f"got {value.shape}")
                entry[key] = value
            self._check_entry(i, entry, hp)
            new_state.append(entry)
        for entry, param in zip(new_state, self.params):     # all checked: now copy to the devices
            if entry is not None:
                backend = ops.backend_of(param.data)
                for key, value in entry.items():
                    if isinstance(value, np.ndarray):
                        entry[key] = backend.asarray(np.array(value, dtype=param.dtype, copy=True))
        for key, value in hp.items():          # checked above (lr by the same rule as its setter)
            setattr(self, "_lr" if key == "lr" else key, value)
        self.state = new_state


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as PyTorch.

    With ``g = grad + weight_decay * p``::

        buf = g                                          (first step)
        buf = momentum * buf + (1 - dampening) * g       (later steps)
        g   = g + momentum * buf   if nesterov else buf  (when momentum > 0)
        p  -= lr * g

    ``lr``, ``momentum`` and ``weight_decay`` are finite and >= 0, ``dampening`` finite;
    nesterov needs momentum > 0 and dampening 0.
    """

    STATE_KEYS = ("step", "momentum_buffer")

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, lr)
        hp = self._checked(dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                nesterov=nesterov))
        self.momentum, self.dampening = hp["momentum"], hp["dampening"]
        self.weight_decay, self.nesterov = hp["weight_decay"], hp["nesterov"]

    def _checked(self, hp):
        out = super()._checked(hp)
        out["momentum"] = _finite("SGD: momentum", hp["momentum"], minimum=0.0)
        out["dampening"] = _finite("SGD: dampening", hp["dampening"])
        out["weight_decay"] = _finite("SGD: weight_decay", hp["weight_decay"], minimum=0.0)
        out["nesterov"] = bool(hp["nesterov"])
        if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
            raise ValueError("SGD: nesterov momentum requires momentum > 0 and dampening == 0, got "
                             f"momentum={out['momentum']}, dampening={out['dampening']}")
        return out

    def _check_entry(self, i, entry, hp):
        if (entry["momentum_buffer"] is None) != (hp["momentum"] == 0):
            raise ValueError(f"optimizer state {i} 'momentum_buffer': "
                             + ("missing, but momentum is " if entry["momentum_buffer"] is None
                                else "present, but momentum is ") + f"{hp['momentum']}")

    def hyperparameters(self):
        return dict(super().hyperparameters(), momentum=self.momentum, dampening=self.dampening,
                    weight_decay=self.weight_decay, nesterov=self.nesterov)

    def _init_state(self, param):
        buf = ops.backend_of(param.data).zeros_like(param.data) if self.momentum != 0 else None
        return {"step": 0, "momentum_buffer": buf}

    def _update(self, param, state):
        ops.backend_of(param.data).sgd_update(
            param.data, param.grad, state["momentum_buffer"], self.lr,
            momentum=self.momentum, dampening=self.dampening, weight_decay=self.weight_decay,
            nesterov=self.nesterov, first_step=state["step"] == 0)
        state["step"] += 1


class Adam(Optimizer):
    """Adam (Kingma & Ba), as PyTorch.  At step t (from 1), with g = grad::

        g  += weight_decay * p                  (Adam: L2 penalty in the gradient)
        p  *= 1 - lr * weight_decay             (AdamW: decoupled decay instead)
        m   = beta1 * m + (1 - beta1) * g
        v   = beta2 * v + (1 - beta2) * g^2
        p  -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

    ``betas`` is a pair in [0, 1); ``lr``, ``eps`` and ``weight_decay`` are finite and >= 0.
    """

    decoupled = False
    STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr)
        hp = self._checked(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.betas, self.eps, self.weight_decay = hp["betas"], hp["eps"], hp["weight_decay"]

    def _checked(self, hp):
        name = type(self).__name__
        out = super()._checked(hp)
        betas = hp["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        out["betas"] = tuple(_finite(f"{name}: betas[{k}]", b, minimum=0.0, below=1.0) for k, b in enumerate(betas))
        out["eps"] = _finite(f"{name}: eps", hp["eps"], minimum=0.0)
        out["weight_decay"] = _finite(f"{name}: weight_decay", hp["weight_decay"], minimum=0.0)
        return out

    def _check_entry(self, i, entry, hp):
        for key in ("exp_avg", "exp_avg_sq"):
            if entry[key] is None:
                raise ValueError(f"optimizer state {i} {key!r}: missing (None)")

    def hyperparameters(self):
        return dict(super().hyperparameters(), betas=self.betas, eps=self.eps,
                    weight_decay=self.weight_decay)

    def _init_state(self, param):
        backend = ops.backend_of(param.data)
        return {"step": 0, "exp_avg": backend.zeros_like(param.data),
                "exp_avg_sq": backend.zeros_like(param.data)}

    def _update(self, param, state):
        state["step"] += 1
        ops.backend_of(param.data).adam_update(
            param.data, param.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
            lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
            weight_decay=self.weight_decay, decoupled=self.decoupled)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr * weight_decay``
    before the Adam step, instead of adding ``weight_decay * p`` to the gradient."""

    decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# ------------------------------------------------------------------ schedules
class LRScheduler:
    """Base class of schedules: the learning rate as a closed-form function of time.

    ``t = last_epoch`` counts the calls to :meth:`step` (an "epoch" is whatever
    unit the trainer steps in: an iteration or an epoch).  Subclasses define
    ``lr_at(t)`` from ``base_lr``, the optimizer's lr when the schedule was
    made.  Construction sets ``optimizer.lr = lr_at(0)``; each ``step()``
    advances t by one and sets ``optimizer.lr = lr_at(t)``.
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} drives an Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, t):
        raise NotImplementedError

    def step(self):
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def get_last_lr(self):
        """The learning rate now in force (a float: cydnn has one parameter group)."""
        return self.optimizer.lr

    def state_dict(self):
        return {"base_lr": self.base_lr, "last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict):
        self.base_lr = state_dict["base_lr"]
        self.last_epoch = state_dict["last_epoch"]
        self.optimizer.lr = self.lr_at(self.last_epoch)


class StepLR(LRScheduler):
    """``lr(t) = base_lr * gamma ** (t // step_size)``: decay by gamma every step_size steps.

    ``step_size`` is an integer >= 1, ``gamma`` a finite number >= 0.
    """

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = _count("StepLR: step_size", step_size, 1)
        self.gamma = _finite("StepLR: gamma", gamma, minimum=0.0)
        super().__init__(optimizer)

    def lr_at(self, t):
        return self.base_lr * self.gamma ** (t // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """``lr(t) = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2``.

    From base_lr at t = 0 down to eta_min at t = T_max (and, like PyTorch's
    closed form, back up again after that if stepping goes on).  ``T_max`` is an integer >= 1,
    ``eta_min`` a finite number >= 0.
    """

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = _count("CosineAnnealingLR: T_max", T_max, 1)
        self.eta_min = _finite("CosineAnnealingLR: eta_min", eta_min, minimum=0.0)
        super().__init__(optimizer)

    def lr_at(self, t):
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2


class LinearWarmup(LRScheduler):
    """Linear warm-up over ``warmup_steps``, then an optional schedule ``after``.

    ``lr(t) = base_lr * (t + 1) / warmup_steps`` for t < warmup_steps, then
    ``after.lr_at(t - warmup_steps)`` (or base_lr when ``after`` is None).
    Make ``after`` on the same optimizer first, and step only the warm-up::

        sched = LinearWarmup(opt, 500, after=CosineAnnealingLR(opt, T_max=9500))

    ``warmup_steps`` is an integer >= 1; ``after`` None or a schedule of the same optimizer.
    """

    def __init__(self, optimizer, warmup_steps, after=None):
        self.warmup_steps = _count("LinearWarmup: warmup_steps", warmup_steps, 1)
        if after is not None and not isinstance(after, LRScheduler):
            raise TypeError(f"LinearWarmup: after must be a schedule (LRScheduler) or None, got {type(after).__name__}")
        if after is not None and after.optimizer is not optimizer:
            raise ValueError("LinearWarmup: the schedule after the warm-up must drive the same optimizer")
        self.after = after
        if after is not None:
            optimizer.lr = after.base_lr     # undo the lr the inner schedule set at t = 0
        super().__init__(optimizer)

    def lr_at(self, t):
        if t < self.warmup_steps:
            return self.base_lr * (t + 1) / self.warmup_steps
        if self.after is None:
            return self.base_lr
        return self.after.lr_at(t - self.warmup_steps)
