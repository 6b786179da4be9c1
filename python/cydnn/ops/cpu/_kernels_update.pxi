# Included by _kernels.pyx: the optimizer updates (SGD, Adam / AdamW).


# ------------------------------------------------------------------ optimizer updates


def sgd_update(real[::1] param, const real[::1] grad, real[::1] buf, double lr, double momentum,
               double dampening, double weight_decay, bint nesterov, bint first_step, bint has_momentum,
               int nthreads):
    """One SGD step in place, element by element, the twin's operations in its order::

        g = weight_decay * p + grad                         (when weight_decay != 0)
        buf = g  (first step)  or  momentum * buf + (1 - dampening) * g
        g = momentum * buf + g  (nesterov)  or  buf         (when has_momentum)
        p = p - lr * g

    The scalars are rounded to ``real`` first, as numpy does with Python floats.  buf may be any
    1-element array when not ``has_momentum``.
    """
    cdef Py_ssize_t i
    cdef real lr_ = <real>lr, mom = <real>momentum, damp1 = <real>(1.0 - dampening), wd = <real>weight_decay
    cdef bint decay = weight_decay != 0, plain = dampening == 0
    cdef real g, bv
    with nogil:
        for i in prange(param.shape[0], num_threads=nthreads, schedule="static"):
            g = grad[i]
            if decay:
                g = wd * param[i] + g
            if has_momentum:
                if first_step:
                    bv = g
                else:
                    bv = buf[i] * mom + (g if plain else damp1 * g)
                buf[i] = bv
                if nesterov:
                    g = mom * bv + g
                else:
                    g = bv
            param[i] = param[i] - lr_ * g


def adam_update(real[::1] param, const real[::1] grad, real[::1] m, real[::1] v, double lr, double beta1,
                double beta2, double eps, double weight_decay, double bias1, double bias2, bint decoupled,
                int nthreads):
    """One Adam / AdamW step in place, element by element, the twin's operations in its order::

        p = p * (1 - lr * weight_decay)  (AdamW)    g = grad + weight_decay * p  (Adam)
        m = beta1 m + (1 - beta1) g;  v = beta2 v + ((1 - beta2) g) g
        p = p - (lr * (m / bias1)) / (sqrt(v / bias2) + eps)

    with ``bias1 = 1 - beta1**step``, ``bias2 = 1 - beta2**step`` from the caller; the scalars
    rounded to ``real`` first, as numpy does with Python floats.
    """
    cdef Py_ssize_t i
    cdef real lr_ = <real>lr, b1 = <real>beta1, b2 = <real>beta2, c1 = <real>(1.0 - beta1)
    cdef real c2 = <real>(1.0 - beta2), eps_ = <real>eps, wd = <real>weight_decay
    cdef real shrink = <real>(1.0 - lr * weight_decay), bc1 = <real>bias1, bc2 = <real>bias2
    cdef bint decay = weight_decay != 0
    cdef real g, mi, vi, root
    with nogil:
        for i in prange(param.shape[0], num_threads=nthreads, schedule="static"):
            g = grad[i]
            if decay:
                if decoupled:
                    param[i] = param[i] * shrink
                else:
                    g = g + wd * param[i]
            mi = m[i] * b1 + c1 * g
            vi = v[i] * b2 + c2 * g * g
            m[i] = mi
            v[i] = vi
            if real is float:
                root = sqrtf(vi / bc2)
            else:
                root = sqrt(vi / bc2)
            param[i] = param[i] - lr_ * (mi / bc1) / (root + eps_)
