# Included by _kernels.pyx: ReLU, max and average pooling.


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
                        j0 = _first_inside(w, ow, sw, q - pw)
                        j1 = _end_inside(w, ow, sw, q - pw, j0)
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
                    j0 = _first_inside(w, ow, sw, q - pw)
                    j1 = _end_inside(w, ow, sw, q - pw, j0)
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
                        j0 = _first_inside(w, ow, sw, q - pw)
                        j1 = _end_inside(w, ow, sw, q - pw, j0)
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
                    j0 = _first_inside(w, ow, sw, q - pw)
                    j1 = _end_inside(w, ow, sw, q - pw, j0)
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h:
                            continue
                        dst = &dx[t // c, t % c, yy, 0] + q - pw
                        g = &dy[t // c, t % c, i, 0]
                        for j in range(j0, j1):
                            dst[j * sw] += g[j] / count
