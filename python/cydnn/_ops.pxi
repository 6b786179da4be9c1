# _ops.pxi -- the op wrappers: one ``def`` per C function of cydnn.h's op families
# (convolution, pooling, activations, batch normalization, linear, losses, optimizers, data).  Included by _C.pyx.
# Each turns DeviceArrays into typed pointers (f32 / i32 check the dtype) and geometry
# structs, calls the C function, and turns its status into the library's exception.

# ----------------------------------------------------------- pointer access
cdef float *f32(DeviceArray a, str what) except NULL:
    if a is None:
        raise TypeError(f"{what} must be a DeviceArray, got None")
    if a.dtype is not _F32 and a.dtype != _F32:
        raise TypeError(f"{what} must be float32 on the GPU, got {a.dtype}")
    return <float *>a.data()


cdef float *f32_or_null(DeviceArray a, str what) except? NULL:
    return <float *>NULL if a is None else f32(a, what)


cdef int32_t *i32(DeviceArray a, str what) except NULL:
    if a is None:
        raise TypeError(f"{what} must be a DeviceArray, got None")
    if a.dtype != _I32:
        raise TypeError(f"{what} must be int32 on the GPU, got {a.dtype}")
    return <int32_t *>a.data()


# --------------------------------------------------------------- convolution
cdef cydnnConvGeometry conv_geometry(tuple x_shape, tuple w_shape, tuple stride, tuple padding):
    cdef cydnnConvGeometry g
    g.n, g.c, g.h, g.w = x_shape
    g.k, _, g.kh, g.kw = w_shape
    g.stride_h, g.stride_w = stride
    g.pad_h, g.pad_w = padding
    return g


def conv_forward(DeviceArray x not None, DeviceArray w not None, DeviceArray b, DeviceArray y not None, tuple stride, tuple padding):
    """y = conv(x, w) + b: cydnn_conv_forward -> cudnnConvolutionForward (+ cudnnAddTensor)."""
    cdef cydnnConvGeometry g = conv_geometry(x.shape, w.shape, stride, padding)
    check(cydnn_conv_forward(ctx(), &g, f32(x, "x"), f32(w, "w"), f32_or_null(b, "b"), f32(y, "y")),
          "conv_forward")


def conv_backward(DeviceArray x not None, DeviceArray w not None, DeviceArray dy not None, DeviceArray dx, DeviceArray dw not None,
                  DeviceArray db, tuple stride, tuple padding, int dx_tile=-1, int dw_tile=-1):
    """dx (backward data), dw (backward filter), db (backward bias); dx and db may be None.  One C call:
    with dx asked, dw and db are computed on the second stream beside it (cpp/conv.cu).  dx_tile >= 0: dx
    by that tile of the implicit-GEMM kernel (stride 1; cpp/conv_igemm.cu) instead of cuDNN; dw_tile >= 0: dw
    by that tile of cpp/conv_wgrad.cu."""
    _conv_shapes("conv_backward", x, w, db, dy, stride, padding, "dy", "db")
    if tuple(dw.shape) != tuple(w.shape) or (dx is not None and tuple(dx.shape) != tuple(x.shape)):
        raise ValueError(f"conv_backward: dw must have w's shape {w.shape} and dx x's shape {x.shape}, got dw "
                         f"{dw.shape}, dx {None if dx is None else dx.shape}")
    cdef cydnnConvGeometry g = conv_geometry(x.shape, w.shape, stride, padding)
    check(cydnn_conv_backward_tiles(ctx(), &g, f32(x, "x"), f32(w, "w"), f32(dy, "dy"), f32_or_null(dx, "dx"),
                                    f32(dw, "dw"), f32_or_null(db, "db"), dx_tile, dw_tile), "conv_backward")


# ------------------------------------------------------------------- pooling
cdef cydnnPoolGeometry pool_geometry(tuple x_shape, tuple kernel, tuple stride, tuple padding):
    cdef cydnnPoolGeometry g
    g.n, g.c, g.h, g.w = x_shape
    g.kh, g.kw = kernel
    g.stride_h, g.stride_w = stride
    g.pad_h, g.pad_w = padding
    return g


def max_pool_forward(DeviceArray x not None, DeviceArray y not None, tuple kernel, tuple stride, tuple padding):
    cdef cydnnPoolGeometry g = pool_geometry(x.shape, kernel, stride, padding)
    check(cydnn_max_pool_forward(ctx(), &g, f32(x, "x"), f32(y, "y")), "max_pool_forward")


cdef tuple tiled_pool_shape(str op, str name, tuple shape, tuple kernel):
    """The pooled shape (n, c, h / kh, w / kw) of ``name``'s ``shape`` by windows ``kernel`` that tile its plane
    exactly (stride == kernel, no padding): the check of every op that takes only such a pooling."""
    if len(shape) != 4:
        raise ValueError(f"{op}: {name} must be (n, c, h, w), got shape {shape}")
    n, c, h, w = shape
    kh, kw = kernel
    if kh < 1 or kw < 1 or h < kh or w < kw or h % kh or w % kw:
        raise ValueError(f"{op}: kernel {kernel} must tile {name}'s plane ({h}, {w}) exactly")
    return (n, c, h // kh, w // kw)


def max_pool_tiled_forward(DeviceArray x not None, DeviceArray y not None, tuple kernel):
    """Max pooling by windows ``kernel`` that tile x (stride == kernel, no padding) with the custom kernel the
    compiler's plans use (cydnn_max_pool_tiled_forward): x (n, c, h, w) -> y (n, c, h / kh, w / kw)."""
    op = "max_pool_tiled_forward"
    out = tiled_pool_shape(op, "x", tuple(x.shape), kernel)
    if tuple(y.shape) != out:
        raise ValueError(f"{op}: y must have shape {out} (x {x.shape}, kernel {kernel}), got {y.shape}")
    cdef cydnnPoolGeometry g = pool_geometry(x.shape, kernel, kernel, (0, 0))
    check(cydnn_max_pool_tiled_forward(ctx(), &g, f32(x, "x"), f32(y, "y")), op)


def max_pool_backward(DeviceArray x not None, DeviceArray dy not None, DeviceArray dx, tuple kernel, tuple stride, tuple padding):
    cdef cydnnPoolGeometry g = pool_geometry(x.shape, kernel, stride, padding)
    check(cydnn_max_pool_backward(ctx(), &g, f32(x, "x"), f32(dy, "dy"), f32(dx, "dx")), "max_pool_backward")


def avg_pool_forward(DeviceArray x not None, DeviceArray y not None, tuple kernel, tuple stride, tuple padding):
    cdef cydnnPoolGeometry g = pool_geometry(x.shape, kernel, stride, padding)
    check(cydnn_avg_pool_forward(ctx(), &g, f32(x, "x"), f32(y, "y")), "avg_pool_forward")


def avg_pool_backward(DeviceArray x not None, DeviceArray y not None, DeviceArray dy not None, DeviceArray dx, tuple kernel, tuple stride,
                      tuple padding):
    cdef cydnnPoolGeometry g = pool_geometry(x.shape, kernel, stride, padding)
    check(cydnn_avg_pool_backward(ctx(), &g, f32(x, "x"), f32(y, "y"), f32(dy, "dy"), f32(dx, "dx")),
          "avg_pool_backward")


# --------------------------------------------------------------- activations
def relu_forward(DeviceArray x not None, DeviceArray y not None):
    check(cydnn_relu_forward(ctx(), f32(x, "x"), f32(y, "y"), x.size), "relu_forward")


def relu_backward(DeviceArray y not None, DeviceArray dy not None, DeviceArray dx):
    check(cydnn_relu_backward(ctx(), f32(y, "y"), f32(dy, "dy"), f32(dx, "dx"), y.size), "relu_backward")


def leaky_relu_forward(DeviceArray x not None, DeviceArray y not None, float negative_slope):
    check(cydnn_leaky_relu_forward(ctx(), f32(x, "x"), f32(y, "y"), x.size, negative_slope), "leaky_relu_forward")


def leaky_relu_backward(DeviceArray x not None, DeviceArray dy not None, DeviceArray dx, float negative_slope):
    check(cydnn_leaky_relu_backward(ctx(), f32(x, "x"), f32(dy, "dy"), f32(dx, "dx"), x.size, negative_slope),
          "leaky_relu_backward")


def tanh_forward(DeviceArray x not None, DeviceArray y not None):
    check(cydnn_tanh_forward(ctx(), f32(x, "x"), f32(y, "y"), x.size), "tanh_forward")


def tanh_backward(DeviceArray y not None, DeviceArray dy not None, DeviceArray dx):
    check(cydnn_tanh_backward(ctx(), f32(y, "y"), f32(dy, "dy"), f32(dx, "dx"), y.size), "tanh_backward")


def sigmoid_forward(DeviceArray x not None, DeviceArray y not None):
    check(cydnn_sigmoid_forward(ctx(), f32(x, "x"), f32(y, "y"), x.size), "sigmoid_forward")


def sigmoid_backward(DeviceArray y not None, DeviceArray dy not None, DeviceArray dx):
    check(cydnn_sigmoid_backward(ctx(), f32(y, "y"), f32(dy, "dy"), f32(dx, "dx"), y.size), "sigmoid_backward")


def dropout_forward(DeviceArray x not None, DeviceArray y not None, DeviceArray mask not None, uint32_t threshold, float scale,
                    uint64_t seed):
    check(cydnn_dropout_forward(ctx(), f32(x, "x"), f32(y, "y"), f32(mask, "mask"), x.size, threshold, scale,
                                seed), "dropout_forward")


def mul(DeviceArray a not None, DeviceArray b, DeviceArray out not None):
    """out = a * b, elementwise (dropout's backward)."""
    check(cydnn_mul(ctx(), f32(a, "a"), f32(b, "b"), f32(out, "out"), a.size), "mul")


# ------------------------------------------------------- batch normalization
cdef tuple nchw(DeviceArray x):
    """x's shape as (n, c, h, w): (n, c) is (n, c, 1, 1), (n, c, l) is (n, c, l, 1)."""
    return (tuple(x.shape) + (1, 1))[:4]


def batch_norm_forward(DeviceArray x not None, DeviceArray gamma not None, DeviceArray beta not None,
                       DeviceArray running_mean, DeviceArray running_var, bint training, double factor,
                       double eps, DeviceArray y not None, DeviceArray save_mean, DeviceArray save_inv_std):
    """Training: cudnnBatchNormalizationForwardTraining (running statistics may be None); inference:
    cudnnBatchNormalizationForwardInference (save_mean / save_inv_std may be None)."""
    n, c, h, w = nchw(x)
    if training:
        check(cydnn_batch_norm_forward_training(
            ctx(), n, c, h, w, f32(x, "x"), f32(gamma, "gamma"), f32(beta, "beta"), factor,
            f32_or_null(running_mean, "running_mean"), f32_or_null(running_var, "running_var"), eps, f32(y, "y"),
            f32(save_mean, "save_mean"), f32(save_inv_std, "save_inv_std")), "batch_norm_forward")
    else:
        check(cydnn_batch_norm_forward_inference(
            ctx(), n, c, h, w, f32(x, "x"), f32(gamma, "gamma"), f32(beta, "beta"),
            f32(running_mean, "running_mean"), f32(running_var, "running_var"), eps, f32(y, "y"),
            f32_or_null(save_mean, "save_mean"), f32_or_null(save_inv_std, "save_inv_std")), "batch_norm_forward")


def batch_norm_backward(DeviceArray x not None, DeviceArray dy not None, DeviceArray gamma not None,
                        DeviceArray save_mean not None, DeviceArray save_inv_std not None, bint training, double eps,
                        DeviceArray dx not None, DeviceArray dgamma not None, DeviceArray dbeta not None):
    """Training: cudnnBatchNormalizationBackward; inference: the custom kernel (constant statistics)."""
    n, c, h, w = nchw(x)
    if training:
        check(cydnn_batch_norm_backward(ctx(), n, c, h, w, f32(x, "x"), f32(dy, "dy"), f32(gamma, "gamma"),
                                        f32(save_mean, "save_mean"), f32(save_inv_std, "save_inv_std"), eps,
                                        f32(dx, "dx"), f32(dgamma, "dgamma"), f32(dbeta, "dbeta")),
              "batch_norm_backward")
    else:
        check(cydnn_batch_norm_backward_inference(ctx(), n, c, h, w, f32(x, "x"), f32(dy, "dy"), f32(gamma, "gamma"),
                                                  f32(save_mean, "save_mean"), f32(save_inv_std, "save_inv_std"),
                                                  f32(dx, "dx"), f32(dgamma, "dgamma"), f32(dbeta, "dbeta")),
              "batch_norm_backward")


# -------------------------------------------------------------------- linear
def linear_forward(DeviceArray x not None, DeviceArray w not None, DeviceArray b, DeviceArray y not None,
                   int act=0):
    """y = act(x w^T + b): cydnn_linear_forward_act -> cublasLtMatmul, the bias and the activation (0 none,
    1 relu) in its epilogue."""
    check(cydnn_linear_forward_act(ctx(), f32(x, "x"), f32(w, "w"), f32_or_null(b, "b"), f32(y, "y"),
                                   x.shape[0], x.shape[1], w.shape[0], act), "linear_forward")


def linear_backward(DeviceArray x not None, DeviceArray w not None, DeviceArray dy not None, DeviceArray dx, DeviceArray dw not None, DeviceArray db,
                    int dx_tile=-1):
    """dx (when given), dw and db (when given) of y = x w^T + b: cuBLASLt, dw on the second stream beside dx; dx by
    gemm_skinny.cu's tile ``dx_tile`` where it is >= 0 (cydnn_linear_backward_ex)."""
    check(cydnn_linear_backward_ex(ctx(), f32(x, "x"), f32(w, "w"), f32(dy, "dy"), f32_or_null(dx, "dx"),
                                   f32(dw, "dw"), f32_or_null(db, "db"), x.shape[0], x.shape[1], w.shape[0], dx_tile),
          "linear_backward")


# -------------------------------------------------------------------- losses
def softmax_forward(DeviceArray x not None, DeviceArray y not None, bint log):
    check(cydnn_softmax_forward(ctx(), f32(x, "x"), f32(y, "y"), x.shape[0], x.shape[1], log),
          "log_softmax" if log else "softmax")


def softmax_cross_entropy(DeviceArray logits not None, DeviceArray labels, DeviceArray loss not None, DeviceArray dlogits not None,
                          DeviceArray bad_labels):
    cdef int32_t *bad = <int32_t *>NULL if bad_labels is None else i32(bad_labels, "bad_labels")
    check(cydnn_softmax_cross_entropy(ctx(), f32(logits, "logits"), i32(labels, "labels"), logits.shape[0],
                                      logits.shape[1], f32(loss, "loss"), f32(dlogits, "dlogits"), bad),
          "softmax_cross_entropy")


# ---------------------------------------------------------------- optimizers
def sgd_update(DeviceArray param not None, DeviceArray grad not None, DeviceArray momentum_buf, float lr, float momentum,
               float dampening, float weight_decay, bint nesterov, bint first_step):
    check(cydnn_sgd_update(ctx(), f32(param, "param"), f32(grad, "grad"), f32_or_null(momentum_buf, "momentum_buf"),
                           param.size, lr, momentum, dampening, weight_decay, nesterov, first_step), "sgd_update")


def adam_update(DeviceArray param not None, DeviceArray grad not None, DeviceArray m not None, DeviceArray v not None, float lr, double beta1,
                double beta2, float eps, float weight_decay, bint decoupled, int step):
    check(cydnn_adam_update(ctx(), f32(param, "param"), f32(grad, "grad"), f32(m, "m"), f32(v, "v"), param.size,
                            lr, beta1, beta2, eps, weight_decay, decoupled, step), "adam_update")


# ---------------------------------------------------------------------- data
def gather_batch(DeviceArray images not None, DeviceArray labels, DeviceArray indices not None, float mean, float std, int pad,
                 int max_shift, uint64_t seed, DeviceArray out_images not None, DeviceArray out_labels):
    if images.dtype != _U8:
        raise TypeError(f"gather_batch: images must be uint8 on the GPU, got {images.dtype}")
    cdef int32_t *lab = <int32_t *>NULL if labels is None else i32(labels, "labels")
    cdef int32_t *out_lab = <int32_t *>NULL if out_labels is None else i32(out_labels, "out_labels")
    check(cydnn_gather_batch(ctx(), <const uint8_t *>images.data(), lab, images.shape[0], images.shape[1],
                             images.shape[2], i32(indices, "indices"), indices.shape[0], mean, std, pad,
                             max_shift, seed, f32(out_images, "out_images"), out_lab), "gather_batch")


def gather_batch_chw(DeviceArray images not None, DeviceArray labels, DeviceArray indices not None, mean, std,
                     int pad, int max_shift, bint flip, uint64_t seed, DeviceArray out_images not None,
                     DeviceArray out_labels):
    """images (N, C, H, W) uint8 on the GPU; mean, std: host float32 arrays of C values."""
    if images.dtype != _U8 or len(images.shape) != 4:
        raise TypeError(f"gather_batch_chw: images must be uint8 (N, C, H, W) on the GPU, got {images.dtype} "
                        f"{images.shape}")
    cdef const float[::1] m = np.ascontiguousarray(mean, dtype=np.float32)
    cdef const float[::1] s = np.ascontiguousarray(std, dtype=np.float32)
    if m.shape[0] != images.shape[1] or s.shape[0] != images.shape[1]:
        raise ValueError(f"gather_batch_chw: mean and std need {images.shape[1]} values, got {m.shape[0]} and "
                         f"{s.shape[0]}")
    cdef int32_t *lab = <int32_t *>NULL if labels is None else i32(labels, "labels")
    cdef int32_t *out_lab = <int32_t *>NULL if out_labels is None else i32(out_labels, "out_labels")
    check(cydnn_gather_batch_chw(ctx(), <const uint8_t *>images.data(), lab, images.shape[0], images.shape[1],
                                 images.shape[2], images.shape[3], i32(indices, "indices"), indices.shape[0],
                                 &m[0], &s[0], pad, max_shift, flip, seed, f32(out_images, "out_images"),
                                 out_lab), "gather_batch_chw")
