"""Batch normalization layers: :class:`BatchNorm1d` and :class:`BatchNorm2d`, with PyTorch's
arguments, semantics and state_dict names, so that a PyTorch state_dict loads as it is."""
import numpy as np

from .. import ops
from ..ops._check_base import _is_int, _number
from .module import Module, Parameter, _device_of, _saved


class _BatchNorm(Module):
    """Shared by BatchNorm1d and BatchNorm2d (which differ in the input ranks they take).

    Per channel k (``num_features`` channels, axis 1), over the channel's values
    (all of x[:, k]): ``y = weight[k] (x - mu) / sqrt(var + eps) + bias[k]``.

    - Training mode: mu and var (biased) are the batch's, and, with
      ``track_running_stats``, the running statistics are updated in place:
      ``running_mean = (1 - f) running_mean + f mu`` and
      ``running_var = (1 - f) running_var + f var_unbiased`` (the batch variance
      times count / (count - 1)), where f = ``momentum``, or f = 1 /
      ``num_batches_tracked`` (a cumulative average) when ``momentum`` is None;
      ``num_batches_tracked`` counts the training forwards.
    - Evaluation mode: mu = running_mean, var = running_var (the statistics are
      constants for the backward).  Without ``track_running_stats`` there are no
      running statistics and both modes use the batch's.

    Parameters ``weight`` (ones) and ``bias`` (zeros), shape (num_features,), when
    ``affine``; buffers ``running_mean`` (zeros), ``running_var`` (ones) and
    ``num_batches_tracked`` (an int64 0-d array, kept on the host) when
    ``track_running_stats``.  The state_dict keys are PyTorch's.
    """

    _ranks = ()          # the input ranks the layer takes
    _layout = ""         # how they read, for messages

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__()
        name = type(self).__name__
        if not _is_int(num_features) or int(num_features) < 1:
            raise ValueError(f"{name}: num_features must be an int >= 1, got {num_features!r}")
        eps = _number(name, "eps", eps)
        if eps < 0:
            raise ValueError(f"{name}: eps must be >= 0, got {eps}")
        if momentum is not None:
            momentum = _number(name, "momentum", momentum)
            if not 0.0 <= momentum <= 1.0:
                raise ValueError(f"{name}: momentum must be in [0, 1] or None, got {momentum}")
        self.num_features, self.eps, self.momentum = int(num_features), eps, momentum
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        c = self.num_features
        if self.affine:
            self.weight = Parameter(np.ones(c, np.float32))
            self.bias = Parameter(np.zeros(c, np.float32))
        else:
            self.weight = self.bias = None
        tracked = self.track_running_stats
        self.register_buffer("running_mean", np.zeros(c, np.float32) if tracked else None)
        self.register_buffer("running_var", np.ones(c, np.float32) if tracked else None)
        self.register_buffer("num_batches_tracked", np.array(0, np.int64) if tracked else None)
        self._cache = None

    def reset_running_stats(self):
        """running_mean = 0, running_var = 1, num_batches_tracked = 0 (on the module's device)."""
        if self.track_running_stats:
            backend = ops.backend(_device_of(self.running_mean))
            dtype = np.dtype(self.running_mean.dtype)
            self.running_mean = backend.asarray(np.zeros(self.num_features, dtype))
            self.running_var = backend.asarray(np.ones(self.num_features, dtype))
            self.num_batches_tracked = np.array(0, np.int64)

    def _check_input(self, x):
        name = type(self).__name__
        if _device_of(x) != self.device:
            raise ValueError(f"{name} is on {self.device!r} but its input is on {_device_of(x)!r}: move the "
                             f"input (ops.backend(device).asarray) or the module (.to(device))")
        ndim = getattr(x, "ndim", None)
        if ndim is None:
            return          # not an array: the op says so
        if ndim not in self._ranks:
            raise ValueError(f"{name}: expected a {self._layout} input, got a {ndim}-D input of shape "
                             f"{tuple(int(d) for d in x.shape)}")
        if int(x.shape[1]) != self.num_features:
            raise ValueError(f"{name}({self.num_features}): expected {self.num_features} channels (axis 1), "
                             f"got {int(x.shape[1])} (input shape {tuple(int(d) for d in x.shape)})")

    def forward(self, x):
        self._check_input(x)
        tracked = self.track_running_stats
        batch_stats = self.training or not tracked
        update = self.training and tracked
        if update and self.momentum is None:
            factor = 1.0 / (int(self.num_batches_tracked) + 1)      # the cumulative average
        else:
            factor = 0.0 if self.momentum is None else self.momentum
        gamma = self.weight.data if self.affine else None
        beta = self.bias.data if self.affine else None
        running = (self.running_mean, self.running_var) if tracked else (None, None)
        y, self._cache = ops.backend_of(x).batch_norm_forward(
            x, gamma, beta, *running, training=batch_stats, momentum=factor, eps=self.eps)
        if update:          # counted once the forward succeeded
            self.num_batches_tracked = np.array(int(self.num_batches_tracked) + 1, np.int64)
        return y

    def backward(self, dy):
        """dx; sets ``weight.grad`` and ``bias.grad`` (when affine)."""
        dx, dgamma, dbeta = ops.backend_of(dy).batch_norm_backward(dy, _saved(self._cache, self))
        if self.affine:
            self.weight.grad, self.bias.grad = dgamma, dbeta
        return dx

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalization of (N, C) or (N, C, L) inputs (statistics per channel over N, and L)."""
    _ranks = (2, 3)
    _layout = "2-D (N, C) or 3-D (N, C, L)"


class BatchNorm2d(_BatchNorm):
    """Batch normalization of (N, C, H, W) inputs (statistics per channel over N, H and W)."""
    _ranks = (4,)
    _layout = "4-D (N, C, H, W)"
