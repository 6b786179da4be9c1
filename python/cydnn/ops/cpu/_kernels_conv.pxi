# Included by _kernels.pyx: the loops of convolution around its matrix products -- im2col,
# col2im and the layout changes (with the bias, and optionally ReLU).  The forward pass always
# orders the columns (i, j, b) (the section below); col2im and nchw_to_rows also take the
# (b, i, j) order, for a cache made by the numpy twin.  ``real``, ``_first_inside``: see _kernels.pyx.


# --------------------------------------------------- col2im / dy as rows, either column order


def col2im(const real[:, ::1] dcols, real[:, :, :, ::1] dx, int kh, int kw, int sh, int sw, int ph, int pw,
           bint batch_inner, int nthreads):
    """The adjoint of im2col (conv._im2col): ``dx[b, c, y, x] += dcols[(c, p, q), col(b, i, j)]`` over every
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
                    j0 = _first_inside(w, ow, sw, q - pw)
                    j1 = _end_inside(w, ow, sw, q - pw, j0)
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


# ------------------------------------------- the batch-innermost path (long contiguous runs)
#
# x (n, c, h, w) is first transposed to xt (c, h, w, n).  Then, with the columns
# ordered (i, j, b), the im2col entries of one row (c, p, q) and one output row i
# are, for stride 1, ONE contiguous run of xt: ``xt[c, i*sh + p - ph, j0 + q - pw :
# j1 + q - pw, :]`` -- ow*n numbers copied (or, for col2im, added) at once, where
# the (b, i, j) order moves runs of only ow.


cdef inline void _transpose(const real* src, Py_ssize_t src_stride, real* dst, Py_ssize_t dst_stride,
                            Py_ssize_t rows, Py_ssize_t cols, const real* bias, bint relu) noexcept nogil:
    """``dst[c*dst_stride + r] = act(src[r*src_stride + c] + bias[0])`` for r < rows, c < cols,
    in 16 x 16 tiles (bias NULL: none; relu: ``0 if v <= 0 else v``, as np.maximum)."""
    cdef Py_ssize_t r0, c0, r, c, r1, c1
    cdef real v, b = bias[0] if bias != NULL else 0
    for r0 in range(0, rows, 16):
        r1 = min(r0 + 16, rows)
        for c0 in range(0, cols, 16):
            c1 = min(c0 + 16, cols)
            for c in range(c0, c1):
                for r in range(r0, r1):
                    v = src[r * src_stride + c]
                    if bias != NULL:
                        v = v + b
                    if relu and v <= 0:
                        v = 0
                    dst[c * dst_stride + r] = v


def batch_inner(const real[:, :, :, ::1] x, real[:, :, :, ::1] xt, int nthreads):
    """``xt[c, y, x, b] = x[b, c, y, x]``: (n, c, h, w) to (c, h, w, n)."""
    cdef Py_ssize_t n = x.shape[0], c = x.shape[1], hw = x.shape[2] * x.shape[3], ch
    with nogil:
        for ch in prange(c, num_threads=nthreads, schedule="static"):
            _transpose(&x[0, 0, 0, 0] + ch * hw, c * hw, &xt[ch, 0, 0, 0], n, n, hw, NULL, False)


def batch_outer(const real[:, :, :, ::1] xt, real[:, :, :, ::1] x, int nthreads):
    """``x[b, c, y, x] = xt[c, y, x, b]``: (c, h, w, n) back to (n, c, h, w)."""
    cdef Py_ssize_t c = xt.shape[0], hw = xt.shape[1] * xt.shape[2], n = xt.shape[3], ch
    with nogil:
        for ch in prange(c, num_threads=nthreads, schedule="static"):
            _transpose(&xt[ch, 0, 0, 0], n, &x[0, 0, 0, 0] + ch * hw, c * hw, hw, n, NULL, False)


def im2col_bi(const real[:, :, :, ::1] xt, real[:, ::1] cols, int kh, int kw, int sh, int sw, int ph, int pw,
              int nthreads):
    """``cols[(c, p, q), (i*ow + j)*n + b] = xt[c, i*sh + p - ph, j*sw + q - pw, b]`` (0 outside):
    :func:`im2col` with ``batch_inner``, from x already as (c, h, w, n) (:func:`batch_inner`)."""
    cdef Py_ssize_t c = xt.shape[0], h = xt.shape[1], w = xt.shape[2], n = xt.shape[3]
    cdef Py_ssize_t oh = (h + 2 * ph - kh) // sh + 1, ow = (w + 2 * pw - kw) // sw + 1
    cdef Py_ssize_t r, ch, p, q, i, j, yy, j0, j1
    cdef real* out
    cdef const real* src
    with nogil:
        for r in prange(c * kh * kw, num_threads=nthreads, schedule="static"):
            ch = r // (kh * kw)
            p = (r // kw) % kh
            q = r % kw
            j0 = _first_inside(w, ow, sw, q - pw)
            j1 = _end_inside(w, ow, sw, q - pw, j0)
            for i in range(oh):
                out = &cols[r, i * ow * n]
                yy = i * sh + p - ph
                if yy < 0 or yy >= h or j0 >= j1:
                    memset(out, 0, ow * n * sizeof(real))
                    continue
                memset(out, 0, j0 * n * sizeof(real))
                src = &xt[ch, yy, 0, 0] + (q - pw) * n
                if sw == 1:
                    memcpy(out + j0 * n, src + j0 * n, (j1 - j0) * n * sizeof(real))
                else:
                    for j in range(j0, j1):
                        memcpy(out + j * n, src + j * sw * n, n * sizeof(real))
                memset(out + j1 * n, 0, (ow - j1) * n * sizeof(real))


def col2im_bi(const real[:, ::1] dcols, real[:, :, :, ::1] dxt, int kh, int kw, int sh, int sw, int ph, int pw,
              int nthreads):
    """The adjoint of :func:`im2col_bi`: ``dxt[c, y, x, b] += dcols[(c, p, q), (i*ow + j)*n + b]``
    over every (p, q, i, j) reading pixel (y, x), in (p, q) order as the twin; dxt (c, h, w, n)
    must hold zeros.  One channel per thread step."""
    cdef Py_ssize_t c = dxt.shape[0], h = dxt.shape[1], w = dxt.shape[2], n = dxt.shape[3]
    cdef Py_ssize_t oh = (h + 2 * ph - kh) // sh + 1, ow = (w + 2 * pw - kw) // sw + 1
    cdef Py_ssize_t ch, p, q, i, j, e, yy, j0, j1, run
    cdef real* dst
    cdef const real* src
    with nogil:
        for ch in prange(c, num_threads=nthreads, schedule="static"):
            for p in range(kh):
                for q in range(kw):
                    j0 = _first_inside(w, ow, sw, q - pw)
                    j1 = _end_inside(w, ow, sw, q - pw, j0)
                    for i in range(oh):
                        yy = i * sh + p - ph
                        if yy < 0 or yy >= h or j0 >= j1:
                            continue
                        src = &dcols[(ch * kh + p) * kw + q, i * ow * n]
                        dst = &dxt[ch, yy, 0, 0] + (q - pw) * n
                        if sw == 1:
                            run = (j1 - j0) * n
                            src = src + j0 * n
                            dst = dst + j0 * n
                            for e in range(run):
                                dst[e] += src[e]
                        else:
                            for j in range(j0, j1):
                                for e in range(n):
                                    dst[j * sw * n + e] += src[j * n + e]


def rows_bi_to_nchw(const real[:, ::1] y, const real[::1] bias, real[:, :, :, ::1] out, bint has_bias, bint relu,
                    int nthreads):
    """``out[b, k, i, j] = act(y[k, (i*ow + j)*n + b] + bias[k])``: a product in the (i, j, b)
    column order to NCHW, the bias added when ``has_bias``, ReLU applied when ``relu``."""
    cdef Py_ssize_t n = out.shape[0], m = out.shape[1], hw = out.shape[2] * out.shape[3], k
    with nogil:
        for k in prange(m, num_threads=nthreads, schedule="static"):
            _transpose(&y[k, 0], n, &out[0, 0, 0, 0] + k * hw, m * hw, hw, n,
                       &bias[k] if has_bias else NULL, relu)


def nchw_to_rows_bi(const real[:, :, :, ::1] a, real[:, ::1] out, int nthreads):
    """``out[k, (i*ow + j)*n + b] = a[b, k, i, j]``: (n, m, oh, ow) to (m, oh*ow*n)."""
    cdef Py_ssize_t n = a.shape[0], m = a.shape[1], hw = a.shape[2] * a.shape[3], k
    with nogil:
        for k in prange(m, num_threads=nthreads, schedule="static"):
            _transpose(&a[0, 0, 0, 0] + k * hw, m * hw, &out[k, 0], n, n, hw, NULL, False)
