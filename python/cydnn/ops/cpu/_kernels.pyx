# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c
"""Compiled twins of the hot loops of ``cydnn.ops.cpu`` (OpenMP, the GIL released).

Every function writes into arrays its caller allocated and validated (the ops
in conv.py, pool.py, elementwise.py and updates.py check shapes and dtypes
first, with the same messages as the numpy twin); nothing here allocates,
checks or raises.  ``real`` is float32 or float64, the dtype of the op.
``nthreads`` is the OpenMP thread count of the call, chosen by the caller from
the size of the work (``_threads.omp_threads``).

Each loop computes what the numpy twin computes, with the same operations in
the same order where that is cheap (the elementwise ops, the optimizer
updates, the adds of col2im and pooling backward), so most results are equal
bit for bit; the tests compare every kernel with the twin on many shapes.

Layouts, as in conv.py: ``cols`` is (c*kh*kw, n*oh*ow), rows ordered (c, p, q),
columns ordered (b, i, j) or, when ``batch_inner``, (i, j, b).
"""
from cython.parallel cimport prange
from libc.math cimport INFINITY, sqrt, sqrtf
from libc.string cimport memcpy, memset

ctypedef fused real:
    float
    double


# ----------------------------------------------------------------- im2col / col2im


cdef inline void _inside(Py_ssize_t size, Py_ssize_t n_out, Py_ssize_t stride, Py_ssize_t offset,
                         Py_ssize_t* first, Py_ssize_t* last) noexcept nogil:
    """The outputs o in [first, last) whose input o*stride + offset lies in [0, size)."""
    cdef Py_ssize_t lo = 0, hi = n_out
    while lo < n_out and lo * stride + offset < 0:
        lo += 1
    while hi > lo and (hi - 1) * stride + offset >= size:
        hi -= 1
    first[0] = lo
    last[0] = hi


def im2col(const real[:, :, :, ::1] x, real[:, ::1] cols, int kh, int kw, int sh, int sw, int ph, int pw,
           bint batch_inner, int nthreads):
    """``cols[(c, p, q), col(b, i, j)] = x[b, c, i*sh + p - ph, j*sw + q - pw]`` (0 outside x).

    x (n, c, h, w) unpadded; the padding is read as zeros.  One row of cols per
    thread step; each row is written once, in order.
    """
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t oh = (h + 2 * ph - kh) // sh + 1, ow = (w + 2 * pw - kw) // sw + 1
    cdef Py_ssize_t r, ch, p, q, b, i, j, yy, xx, j0, j1
    cdef real* out
    cdef const real* src
    with nogil:
        for r in prange(c * kh * kw, num_threads=nthreads, schedule="static"):
            ch = r // (kh * kw)
            p = (r // kw) % kh
            q = r % kw
            out = &cols[r, 0]
            _inside(w, ow, sw, q - pw, &j0, &j1)  # the columns j whose pixel j*sw + q - pw is inside x
            if not batch_inner:
                for b in range(n):
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h:
                            memset(out + (b * oh + i) * ow, 0, ow * sizeof(real))
                            continue
                        src = &x[b, ch, yy, 0]
                        for j in range(j0):
                            out[(b * oh + i) * ow + j] = 0
                        if sw == 1:
                            for j in range(j0, j1):
                                out[(b * oh + i) * ow + j] = src[j + q - pw]
                        else:
                            for j in range(j0, j1):
                                out[(b * oh + i) * ow + j] = src[j * sw + q - pw]
                        for j in range(j1, ow):
                            out[(b * oh + i) * ow + j] = 0
            else:
                for i in range(oh):
                    yy = i * sh + p - ph
                    for j in range(ow):
                        xx = j * sw + q - pw
                        if yy < 0 or yy >= h or xx < 0 or xx >= w:
                            memset(out + (i * ow + j) * n, 0, n * sizeof(real))
                        else:
                            for b in range(n):
                                out[(i * ow + j) * n + b] = x[b, ch, yy, xx]


def col2im(const real[:, ::1] dcols, real[:, :, :, ::1] dx, int kh, int kw, int sh, int sw, int ph, int pw,
           bint batch_inner, int nthreads):
    """The adjoint of :func:`im2col`: ``dx[b, c, y, x] += dcols[(c, p, q), col(b, i, j)]`` over every
    (p, q, i, j) reading pixel (y, x); dx (n, c, h, w) must hold zeros (or what to add to).

    One (image, channel) plane per thread step, no two steps write one pixel;
    each pixel gets its terms in (p, q) order, as in the twin.
    """
    cdef Py_ssize_t n = dx.shape[0], c = dx.shape[1], h = dx.shape[2], w = dx.shape[3]
    cdef Py_ssize_t oh = (h + 2 * ph - kh) // sh + 1, ow = (w + 2 * pw - kw) // sw + 1
    cdef Py_ssize_t t, b, ch, p, q, i, j, yy, j0, j1
    cdef real* dst
    cdef const real* src
    with nogil:
        for t in prange(n * c, num_threads=nthreads, schedule="static"):
            b = t // c
            ch = t % c
            for p in range(kh):
                for q in range(kw):
                    _inside(w, ow, sw, q - pw, &j0, &j1)
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h:
                            continue
                        dst = &dx[b, ch, yy, 0] + q - pw
                        if not batch_inner:
                            src = &dcols[(ch * kh + p) * kw + q, (b * oh + i) * ow]
                            for j in range(j0, j1):
                                dst[j * sw] += src[j]
                        else:
                            src = &dcols[(ch * kh + p) * kw + q, i * ow * n + b]
                            for j in range(j0, j1):
                                dst[j * sw] += src[j * n]


# ------------------------------------------------------- layouts, bias, activation


def rows_to_nchw(const real[:, ::1] y, const real[::1] bias, real[:, :, :, ::1] out, bint batch_inner,
                 bint has_bias, bint relu, int nthreads):
    """``out[b, k, i, j] = act(y[k, col(b, i, j)] + bias[k])``: the product of a convolution, in the
    cols column order, to NCHW with the bias added (``has_bias``) and, when ``relu``,
    ``max(v, 0)`` applied (as ``np.maximum``: NaN kept, -0.0 to 0).  bias may be any 1-element array when
    not ``has_bias``."""
    cdef Py_ssize_t n = out.shape[0], m = out.shape[1], oh = out.shape[2], ow = out.shape[3]
    cdef Py_ssize_t t, b, k, i, j, s, hw = oh * ow
    cdef real v, bk
    cdef real* dst
    cdef const real* src
    with nogil:
        for t in prange(n * m, num_threads=nthreads, schedule="static"):
            b = t // m
            k = t % m
            bk = bias[k] if has_bias else 0
            dst = &out[b, k, 0, 0]
            if not batch_inner:
                src = &y[k, b * hw]
                for s in range(hw):
                    v = src[s] + bk if has_bias else src[s]
                    if relu and v <= 0:
                        v = 0
                    dst[s] = v
            else:
                src = &y[k, 0]
                for s in range(hw):
                    v = src[s * n + b] + bk if has_bias else src[s * n + b]
                    if relu and v <= 0:
                        v = 0
                    dst[s] = v


def nchw_to_rows(const real[:, :, :, ::1] a, real[:, ::1] out, bint batch_inner, int nthreads):
    """``out[k, col(b, i, j)] = a[b, k, i, j]``: (n, m, oh, ow) to (m, n*oh*ow) in the cols order."""
    cdef Py_ssize_t n = a.shape[0], m = a.shape[1], oh = a.shape[2], ow = a.shape[3]
    cdef Py_ssize_t t, b, k, s, hw = oh * ow
    with nogil:
        for t in prange(n * m, num_threads=nthreads, schedule="static"):
            k = t // n
            b = t % n
            if not batch_inner:
                memcpy(&out[k, b * hw], &a[b, k, 0, 0], hw * sizeof(real))
            else:
                for s in range(hw):
                    out[k, s * n + b] = a[b, k, s // ow, s % ow]


def relu_forward(const real[::1] x, real[::1] y, int nthreads):
    """``y = max(x, 0)`` elementwise as ``np.maximum(x, 0)``: NaN kept, -0.0 becomes 0."""
    cdef Py_ssize_t i
    cdef real v
    with nogil:
        for i in prange(x.shape[0], num_threads=nthreads, schedule="static"):
            v = x[i]
            y[i] = 0 if v <= 0 else v


def relu_backward(const real[::1] dy, const real[::1] y, real[::1] dx, int nthreads):
    """``dx = dy * (y > 0)`` elementwise (a product, as the twin: 0 * inf is NaN)."""
    cdef Py_ssize_t i
    with nogil:
        for i in prange(dy.shape[0], num_threads=nthreads, schedule="static"):
            dx[i] = dy[i] * (<real>1 if y[i] > 0 else <real>0)


# ----------------------------------------------------------------------- pooling


def max_pool_forward(const real[:, :, :, ::1] x, real[:, :, :, ::1] y, int[:, :, :, ::1] arg, int kh, int kw,
                     int sh, int sw, int ph, int pw, int nthreads):
    """``y[b, c, i, j]`` = the maximum of window (i, j) of x padded with -inf; ``arg`` its offset
    p*kw + q: scanning the window row by row from ``best = -inf``, the last value *strictly
    greater* than best (first maximum wins ties; NaN and padding never win; an all -inf/NaN
    window gives -inf at offset 0) -- the rule of the twin and the GPU kernel.

    Per output row, one sweep of the row per offset (p, q), branch-free, so that it vectorises.
    """
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t oh = y.shape[2], ow = y.shape[3]
    cdef Py_ssize_t t, i, j, p, q, yy, j0, j1
    cdef int off, gt
    cdef real v, cur
    cdef const real* plane
    cdef const real* src
    cdef real* yrow
    cdef int* arow
    cdef real ninf = -INFINITY
    with nogil:
        for t in prange(n * c, num_threads=nthreads, schedule="static"):
            plane = &x[t // c, t % c, 0, 0]
            for i in range(oh):
                yrow = &y[t // c, t % c, i, 0]
                arow = &arg[t // c, t % c, i, 0]
                for j in range(ow):
                    yrow[j] = ninf
                    arow[j] = 0
                for p in range(kh):
                    yy = i * sh + p - ph
                    if yy < 0 or yy >= h:
                        continue
                    for q in range(kw):
                        _inside(w, ow, sw, q - pw, &j0, &j1)
                        src = plane + yy * w + q - pw
                        off = <int>(p * kw + q)
                        for j in range(j0, j1):  # branch-free: random data defeats the predictor
                            v = src[j * sw]
                            cur = yrow[j]
                            gt = v > cur
                            arow[j] = arow[j] ^ ((arow[j] ^ off) & -gt)
                            yrow[j] = v if gt else cur  # one maxss: NaN never taken


def max_pool_backward(const real[:, :, :, ::1] dy, const int[:, :, :, ::1] arg, real[:, :, :, ::1] dx,
                      int kh, int kw, int sh, int sw, int ph, int pw, int nthreads):
    """``dx[pixel] += dy[b, c, i, j] * (arg[b, c, i, j] == p*kw + q)`` for every window (i, j) and
    offset (p, q) reading the pixel (a product, as the twin); dx (n, c, h, w) must hold zeros.
    The terms of a pixel are added in (p, q) order, as in the twin."""
    cdef Py_ssize_t n = dx.shape[0], c = dx.shape[1], h = dx.shape[2], w = dx.shape[3]
    cdef Py_ssize_t oh = dy.shape[2], ow = dy.shape[3]
    cdef Py_ssize_t t, i, j, p, q, yy, j0, j1
    cdef int off
    cdef real* dst
    cdef const real* g
    cdef const int* a
    with nogil:
        for t in prange(n * c, num_threads=nthreads, schedule="static"):
            for p in range(kh):
                for q in range(kw):
                    off = <int>(p * kw + q)
                    _inside(w, ow, sw, q - pw, &j0, &j1)
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h:
                            continue
                        dst = &dx[t // c, t % c, yy, 0] + q - pw
                        g = &dy[t // c, t % c, i, 0]
                        a = &arg[t // c, t % c, i, 0]
                        for j in range(j0, j1):
                            dst[j * sw] += g[j] * (<real>1 if a[j] == off else <real>0)


def avg_pool_forward(const real[:, :, :, ::1] x, real[:, :, :, ::1] y, int kh, int kw, int sh, int sw,
                     int ph, int pw, int nthreads):
    """``y[b, c, i, j] = (sum of window (i, j) of x zero-padded) / (kh*kw)``, the terms added in
    (p, q) order as the twin (the padding counts in the divisor, as zeros in the sum)."""
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], h = x.shape[2], w = x.shape[3]
    cdef Py_ssize_t oh = y.shape[2], ow = y.shape[3]
    cdef Py_ssize_t t, i, j, p, q, yy, j0, j1
    cdef real count = kh * kw
    cdef const real* plane
    cdef const real* src
    cdef real* yrow
    with nogil:
        for t in prange(n * c, num_threads=nthreads, schedule="static"):
            plane = &x[t // c, t % c, 0, 0]
            for i in range(oh):
                yrow = &y[t // c, t % c, i, 0]
                for j in range(ow):
                    yrow[j] = 0
                for p in range(kh):
                    yy = i * sh + p - ph
                    if yy < 0 or yy >= h:
                        continue
                    for q in range(kw):
                        _inside(w, ow, sw, q - pw, &j0, &j1)
                        src = plane + yy * w + q - pw
                        for j in range(j0, j1):
                            yrow[j] = yrow[j] + src[j * sw]
                for j in range(ow):
                    yrow[j] = yrow[j] / count


def avg_pool_backward(const real[:, :, :, ::1] dy, real[:, :, :, ::1] dx, int kh, int kw, int sh, int sw,
                      int ph, int pw, int nthreads):
    """``dx[pixel] += dy[b, c, i, j] / (kh*kw)`` for every window (i, j) reading the pixel, in
    (p, q) order; dx (n, c, h, w) must hold zeros."""
    cdef Py_ssize_t n = dx.shape[0], c = dx.shape[1], h = dx.shape[2], w = dx.shape[3]
    cdef Py_ssize_t oh = dy.shape[2], ow = dy.shape[3]
    cdef Py_ssize_t t, i, j, p, q, yy, j0, j1
    cdef real count = kh * kw
    cdef real* dst
    cdef const real* g
    with nogil:
        for t in prange(n * c, num_threads=nthreads, schedule="static"):
            for p in range(kh):
                for q in range(kw):
                    _inside(w, ow, sw, q - pw, &j0, &j1)
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h:
                            continue
                        dst = &dx[t // c, t % c, yy, 0] + q - pw
                        g = &dy[t // c, t % c, i, 0]
                        for j in range(j0, j1):
                            dst[j * sw] += g[j] / count


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
