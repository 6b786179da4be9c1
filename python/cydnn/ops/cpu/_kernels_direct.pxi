# Included by _kernels.pyx: the float32 kernels written in C (_kernels_*.h) -- direct convolution
# (forward and weight gradient, _kernels_direct.h), the row-by-row input gradient
# (_kernels_rows.h), 2 x 2 / 2 max pooling (_kernels_pool.h) -- and the choice of instruction set
# (_kernels_isa.h): AVX2 + FMA where the CPU has them, else plain loops; set_isa forces a lower one.
# Shapes are checked by the callers (conv.py, pool.py), as for every kernel here.

cdef extern from "_kernels_isa.h" nogil:
    int cy_isa()
    int cy_isa_max()
    int cy_isa_set(int level)

cdef extern from "_kernels_direct.h" nogil:
    int cy_conv_direct_fwd_f32(const float *x, const float *w, const float *bias, float *y, long n, long c,
                               long h, long wd, long k, int kh, int kw, int nthreads)
    int cy_conv_direct_dw_f32(const float *x, const float *dy, float *dw, float *db, long n, long c, long h,
                              long wd, long k, int kh, int kw, int nthreads)

cdef extern from "_kernels_rows.h" nogil:
    int cy_conv_rows_dx_f32(const float *dy, const float *w, float *dx, long n, long c, long h, long wd, long k,
                            int kh, int kw, int nthreads)

cdef extern from "_kernels_pool.h" nogil:
    void cy_max_pool2x2_fwd_f32(const float *x, float *y, int *arg, long planes, long h, long w, int nthreads)
    void cy_max_pool2x2_bwd_f32(const float *dy, const int *arg, float *dx, long planes, long h, long w,
                                int nthreads)

#: the instruction sets by level
ISA_NAMES = ("baseline", "avx2")


def isa():
    """The instruction set the C kernels use now: "baseline" or "avx2" (AVX2 + FMA)."""
    return ISA_NAMES[cy_isa()]


def isa_max():
    """The best instruction set this CPU supports ("baseline" or "avx2")."""
    return ISA_NAMES[cy_isa_max()]


def set_isa(name):
    """Use instruction set ``name`` ("baseline" or "avx2"; lowered to what the CPU supports)
    from now on; returns the one set."""
    if name not in ISA_NAMES:
        raise ValueError(f"set_isa: name must be one of {', '.join(map(repr, ISA_NAMES))}, got {name!r}")
    return ISA_NAMES[cy_isa_set(ISA_NAMES.index(name))]


def conv_direct_forward(const float[:, :, :, ::1] x, const float[:, :, :, ::1] w, const float[::1] bias,
                        float[:, :, :, ::1] y, bint has_bias, int nthreads):
    """``y[b, o, i, j] = bias[o] + sum_{c,p,q} w[o, c, p, q] * x[b, c, i + p, j + q]`` (stride 1;
    x already padded); bias ignored unless ``has_bias``.  Every size > 0."""
    cdef int rc
    with nogil:
        rc = cy_conv_direct_fwd_f32(&x[0, 0, 0, 0], &w[0, 0, 0, 0], &bias[0] if has_bias else NULL,
                                    &y[0, 0, 0, 0], x.shape[0], x.shape[1], x.shape[2], x.shape[3], w.shape[0],
                                    <int>w.shape[2], <int>w.shape[3], nthreads)
    if rc != 0:
        raise MemoryError("conv_direct_forward: no memory for the tiles")


def conv_direct_weight_grad(const float[:, :, :, ::1] x, const float[:, :, :, ::1] dy, float[:, :, :, ::1] dw,
                            float[::1] db, bint has_bias, int nthreads):
    """``dw[o, c, p, q] = sum_{b,i,j} dy[b, o, i, j] * x[b, c, i + p, j + q]`` and, when
    ``has_bias``, ``db[o] = sum_{b,i,j} dy[b, o, i, j]`` (stride 1; x already padded)."""
    cdef int rc
    with nogil:
        rc = cy_conv_direct_dw_f32(&x[0, 0, 0, 0], &dy[0, 0, 0, 0], &dw[0, 0, 0, 0], &db[0] if has_bias else NULL,
                                   x.shape[0], x.shape[1], x.shape[2], x.shape[3], dw.shape[0],
                                   <int>dw.shape[2], <int>dw.shape[3], nthreads)
    if rc != 0:
        raise MemoryError("conv_direct_weight_grad: no memory for the partial sums")


def conv_rows_input_grad(const float[:, :, :, ::1] dy, const float[:, :, :, ::1] w, float[:, :, :, ::1] dx,
                         int nthreads):
    """``dx[b, c, y, x] = sum_{o,p,q} w[o, c, p, q] * dy[b, o, y - p, x - q]``: the gradient of
    the padded input of a stride-1 convolution (every element written)."""
    with nogil:
        cy_conv_rows_dx_f32(&dy[0, 0, 0, 0], &w[0, 0, 0, 0], &dx[0, 0, 0, 0], dx.shape[0], dx.shape[1],
                            dx.shape[2], dx.shape[3], w.shape[0], <int>w.shape[2], <int>w.shape[3], nthreads)


def max_pool2x2_forward(const float[:, :, :, ::1] x, float[:, :, :, ::1] y, int[:, :, :, ::1] arg, int nthreads):
    """:func:`max_pool_forward` for a 2 x 2 kernel, stride 2, no padding (float32)."""
    with nogil:
        cy_max_pool2x2_fwd_f32(&x[0, 0, 0, 0], &y[0, 0, 0, 0], &arg[0, 0, 0, 0], x.shape[0] * x.shape[1],
                               x.shape[2], x.shape[3], nthreads)


def max_pool2x2_backward(const float[:, :, :, ::1] dy, const int[:, :, :, ::1] arg, float[:, :, :, ::1] dx,
                         int nthreads):
    """:func:`max_pool_backward` for a 2 x 2 kernel, stride 2, no padding (float32); every
    element of dx written."""
    with nogil:
        cy_max_pool2x2_bwd_f32(&dy[0, 0, 0, 0], &arg[0, 0, 0, 0], &dx[0, 0, 0, 0], dx.shape[0] * dx.shape[1],
                               dx.shape[2], dx.shape[3], nthreads)
