"""Optimizer updates, in place: SGD (momentum, Nesterov, weight decay) and Adam / AdamW.

With the compiled kernels (``kernels.set_kernels("cython")``) and C-contiguous
state (what the optimizers hold), each update is one pass over the elements in
C with OpenMP instead of several whole-array numpy passes; the arithmetic is
the twin's, operation for operation (see ``_kernels.sgd_update``).
"""
import numpy as np

from .. import _check
from . import _threads, kernels
from .arrays import FLOATS as _FLOATS

__all__ = ["sgd_update", "adam_update"]


def _flat_ok(*arrays):
    """Whether the arrays updated in place (None skipped) are C-contiguous and writeable, so that
    ``reshape(-1)`` is a view the kernels can write through."""
    return all(a is None or (a.flags.c_contiguous and a.flags.writeable) for a in arrays)


def sgd_update(param, grad, momentum_buf, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False, first_step=False):
    """One SGD step in place on ``param`` (and ``momentum_buf``), as PyTorch::

        g = grad + weight_decay * param
        if momentum != 0:
            buf = g if first_step else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        param -= lr * g

    momentum_buf may be None when momentum == 0.  Returns None.
    """
    _check.check_sgd(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, _FLOATS)
    compiled = kernels.active()
    if compiled is not None and _flat_ok(param, momentum_buf if momentum != 0 else None):
        buf = momentum_buf.reshape(-1) if momentum != 0 else param.reshape(-1)[:1]  # unused without momentum
        compiled.sgd_update(param.reshape(-1), np.ascontiguousarray(grad).reshape(-1), buf, float(lr),
                            float(momentum), float(dampening), float(weight_decay), bool(nesterov),
                            bool(first_step), momentum != 0, _threads.omp_threads(param.size))
        return
    # The same operations in place where that allocates less (a + b == b + a exactly).
    g = grad
    if weight_decay != 0:
        g = weight_decay * param
        g += grad  # a new array: grad is left alone
    if momentum != 0:
        if first_step:
            momentum_buf[...] = g
        else:
            momentum_buf *= momentum
            momentum_buf += g if dampening == 0 else (1 - dampening) * g
        if nesterov:
            g_new = momentum * momentum_buf
            g_new += g
            g = g_new
        else:
            g = momentum_buf
    if g is grad or g is momentum_buf:
        param -= lr * g
    else:  # g is a temporary of this call
        g *= lr
        param -= g


def adam_update(param, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                decoupled=False):
    """One Adam (decoupled=False) or AdamW (decoupled=True) step in place, as PyTorch::

        Adam:  g = grad + weight_decay * param      AdamW: param *= 1 - lr * weight_decay
        m = beta1 m + (1 - beta1) g
        v = beta2 v + (1 - beta2) g^2
        m_hat = m / (1 - beta1^step);  v_hat = v / (1 - beta2^step)
        param -= lr m_hat / (sqrt(v_hat) + eps)

    ``step`` counts from 1.  Updates param, m and v; returns None.
    """
    _check.check_adam(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay, _FLOATS)
    compiled = kernels.active()
    if compiled is not None and _flat_ok(param, m, v):
        compiled.adam_update(param.reshape(-1), np.ascontiguousarray(grad).reshape(-1), m.reshape(-1),
                             v.reshape(-1), float(lr), float(beta1), float(beta2), float(eps),
                             float(weight_decay), 1 - beta1**step, 1 - beta2**step, bool(decoupled),
                             _threads.omp_threads(param.size))
        return
    g = grad
    if weight_decay != 0:
        if decoupled:
            param *= 1 - lr * weight_decay
        else:
            g = g + weight_decay * param
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * g * g
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)
