"""The GPU batch normalization ops (re-exported by ``cydnn.ops.cuda``); twin: ``ops/cpu/norm.py``."""
import numpy as np

from cydnn import _C
from cydnn.ops import _check
from cydnn.ops._cuda_base import F32, _dev, _on_host, _opt, _ret

__all__ = ["batch_norm_forward", "batch_norm_backward"]


def batch_norm_forward(x, gamma, beta, running_mean, running_var, training, momentum=0.1, eps=1e-5):
    """(y, cache): cuDNN batch normalization, mode SPATIAL, on x seen as (n, c, h, w) ((n, c) as
    (n, c, 1, 1), (n, c, l) as (n, c, l, 1)); the maths and arguments as the twin's.

    Training: cudnnBatchNormalizationForwardTraining with exponentialAverageFactor = momentum
    updates the running statistics in place (the unbiased variance into running_var; numpy
    running statistics get their new values back).  Evaluation: ...ForwardInference.  Without
    gamma/beta, cuDNN gets ones and zeros.  The cache holds x, gamma, the statistics used (mu and
    1 / sqrt(var + eps)), the mode and eps.
    """
    c, _, momentum, eps = _check.check_batch_norm(x, gamma, beta, running_mean, running_var, training, momentum,
                                                  eps, F32)
    host = _on_host(x)
    x = _dev(x)
    affine = gamma is not None
    g = _dev(gamma) if affine else _C.to_device(np.ones(c, np.float32))
    b = _dev(beta) if affine else _C.zeros((c,))
    rm, rv = _opt(running_mean), _opt(running_var)
    y, save_mean, save_inv_std = _C.empty(x.shape), _C.empty((c,)), _C.empty((c,))
    _C.batch_norm_forward(x, g, b, rm, rv, bool(training), momentum, eps, y, save_mean, save_inv_std)
    if training:
        for given, device in ((running_mean, rm), (running_var, rv)):
            if isinstance(given, np.ndarray):
                given[...] = device.numpy()
    return _ret(host, y), (x, g, save_mean, save_inv_std, bool(training), eps, affine)


def batch_norm_backward(dy, cache):
    """(dx, dgamma, dbeta): cudnnBatchNormalizationBackward after a training forward; after an
    evaluation forward (constant statistics) a custom kernel.  dgamma, dbeta None without gamma."""
    x, g, save_mean, save_inv_std, training, eps, affine = cache
    _check.check_same_shape("batch_norm_backward", "dy", dy, "x", x.shape, np.float32)
    host = _on_host(dy)
    dy = _dev(dy)
    c = x.shape[1]
    dx, dgamma, dbeta = _C.empty(x.shape), _C.empty((c,)), _C.empty((c,))
    _C.batch_norm_backward(x, dy, g, save_mean, save_inv_std, training, eps, dx, dgamma, dbeta)
    if not affine:
        return _ret(host, dx), None, None
    return _ret(host, dx, dgamma, dbeta)
