# _compiled.pxi -- wrappers of the compiler's kernels (cpp/compiled.cu, compiled_act.cu, compiled_head.cu,
# compiled_norm.cu),
# included by _C.pyx.
# The compiler (python/cydnn/compiler/) calls these with buffers it planned once.

ACT_NONE, ACT_RELU, ACT_TANH, ACT_SIGMOID, ACT_LEAKY = (
    CYDNN_ACT_NONE, CYDNN_ACT_RELU, CYDNN_ACT_TANH, CYDNN_ACT_SIGMOID, CYDNN_ACT_LEAKY)


def bias_act_forward(DeviceArray x not None, DeviceArray bias, DeviceArray y not None, int n, int channels,
                     size_t inner, int act, float slope=0.0):
    """y = act(x + bias[channel]) over x (n, channels, inner); bias may be None; y may be x."""
    check(cydnn_bias_act_forward(ctx(), f32(x, "x"), f32_or_null(bias, "bias"), f32(y, "y"), n, channels,
                                 inner, act, slope), "bias_act_forward")


def bias_act_backward(DeviceArray y not None, DeviceArray dy not None, DeviceArray dx, DeviceArray dbias,
                      int n, int channels, size_t inner, int act, float slope=0.0):
    """dx = dy * act'(y); dbias[c] = sum of dx over n and inner (either may be None)."""
    check(cydnn_bias_act_backward(ctx(), f32(y, "y"), f32(dy, "dy"), f32_or_null(dx, "dx"),
                                  f32_or_null(dbias, "dbias"), n, channels, inner, act, slope),
          "bias_act_backward")


def max_pool_act_backward(DeviceArray y not None, DeviceArray dy not None, DeviceArray dx not None,
                          DeviceArray dbias, tuple kernel, int act, float slope=0.0):
    """The max pooling's backward (windows ``kernel`` that tile y: stride == kernel, no padding) and then the
    activation's before it, in one pass: dx = (dy at each window's first maximum, 0 elsewhere) * act'(y);
    dbias[c] = the sum of dx over n, h, w (may be None).  y, dx (n, c, h, w); dy (n, c, h / kh, w / kw)."""
    op = "max_pool_act_backward"
    out = tiled_pool_shape(op, "y", tuple(y.shape), kernel)       # _ops.pxi
    c = out[1]
    if tuple(dy.shape) != out:
        raise ValueError(f"{op}: dy must have shape {out} (y {y.shape}, kernel {kernel}), got {dy.shape}")
    if tuple(dx.shape) != tuple(y.shape):
        raise ValueError(f"{op}: dx must have y's shape {y.shape}, got {dx.shape}")
    if dbias is not None and dbias.size != c:
        raise ValueError(f"{op}: dbias must have {c} values (y's channels), got shape {dbias.shape}")
    cdef cydnnPoolGeometry g = pool_geometry(tuple(y.shape), kernel, kernel, (0, 0))
    check(cydnn_max_pool_act_backward(ctx(), &g, f32(y, "y"), f32(dy, "dy"), f32(dx, "dx"),
                                      f32_or_null(dbias, "dbias"), act, slope), op)



def linear_xent(DeviceArray x not None, DeviceArray w not None, DeviceArray bias, DeviceArray labels not None,
                DeviceArray logits not None, DeviceArray row_loss not None, DeviceArray loss not None,
                DeviceArray g not None, DeviceArray dbias, DeviceArray dx, DeviceArray dw not None):
    """A training plan's head (cpp/compiled_head.cu): the last linear layer and the softmax cross-entropy, forward
    and backward.  x (n, k), w (c, k), bias (c,) or None, labels (n,) int32; writes logits (n, c), row_loss (n,),
    loss (), g (n, c) (the logits' gradient), dbias (c,) or None, dx (n, k) or None, dw (c, k).
    1 <= c <= 32."""
    op = "linear_xent"
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x (n, k) and w (c, k) must share k, got x {x.shape}, w {w.shape}")
    n, k, c = x.shape[0], x.shape[1], w.shape[0]
    if not 1 <= c <= 32:
        raise ValueError(f"{op}: needs 1 <= c <= 32 classes, got x {x.shape}, w {w.shape}")
    for name, a, shape in (("bias", bias, (c,)), ("labels", labels, (n,)), ("logits", logits, (n, c)),
                           ("row_loss", row_loss, (n,)), ("loss", loss, ()), ("g", g, (n, c)),
                           ("dbias", dbias, (c,)), ("dx", dx, (n, k)), ("dw", dw, (c, k))):
        if a is not None and tuple(a.shape) != shape and not (shape == () and a.size == 1):
            raise ValueError(f"{op}: {name} must have shape {shape} (x {x.shape}, w {w.shape}), got {a.shape}")
    check(cydnn_linear_xent(ctx(), f32(x, "x"), f32(w, "w"), f32_or_null(bias, "bias"), i32(labels, "labels"), n, k,
                            c, f32(logits, "logits"), f32(row_loss, "row_loss"), f32(loss, "loss"), f32(g, "g"),
                            f32_or_null(dbias, "dbias"), f32_or_null(dx, "dx"), f32(dw, "dw")), op)


def bn_act_forward_train(DeviceArray x not None, DeviceArray gamma not None, DeviceArray beta not None,
                         DeviceArray running_mean, DeviceArray running_var, double factor, double eps,
                         DeviceArray y not None, DeviceArray save_mean not None, DeviceArray save_inv_std not None,
                         int act=0, float slope=0.0):
    """Batch norm in training + activation (cydnn_bn_act_forward_train); x, y (n, c, ...)."""
    n, c, inner = _nc_inner(x, "bn_act_forward_train")
    _sizes("bn_act_forward_train", x.size, c, y=y, gamma=gamma, beta=beta, running_mean=running_mean,
           running_var=running_var, save_mean=save_mean, save_inv_std=save_inv_std)
    check(cydnn_bn_act_forward_train(ctx(), f32(x, "x"), f32(gamma, "gamma"), f32(beta, "beta"),
                                     f32_or_null(running_mean, "running_mean"), f32_or_null(running_var, "running_var"),
                                     factor, eps, f32(y, "y"), f32(save_mean, "save_mean"),
                                     f32(save_inv_std, "save_inv_std"), n, c, inner, act, slope),
          "bn_act_forward_train")


def bn_act_backward(DeviceArray x not None, DeviceArray y, DeviceArray dy not None, DeviceArray gamma not None,
                    DeviceArray save_mean not None, DeviceArray save_inv_std not None, DeviceArray dx,
                    DeviceArray dgamma not None, DeviceArray dbeta not None, int act=0, float slope=0.0):
    """Its backward (cydnn_bn_act_backward): dx (may be None, or dy), dgamma, dbeta."""
    n, c, inner = _nc_inner(x, "bn_act_backward")
    _sizes("bn_act_backward", x.size, c, y=y, dy=dy, dx=dx, gamma=gamma, save_mean=save_mean,
           save_inv_std=save_inv_std, dgamma=dgamma, dbeta=dbeta)
    check(cydnn_bn_act_backward(ctx(), f32(x, "x"), f32_or_null(y, "y"), f32(dy, "dy"), f32(gamma, "gamma"),
                                f32(save_mean, "save_mean"), f32(save_inv_std, "save_inv_std"), f32_or_null(dx, "dx"),
                                f32(dgamma, "dgamma"), f32(dbeta, "dbeta"), n, c, inner, act, slope),
          "bn_act_backward")


def _sizes(op, size, c, **arrays):
    """Every per-value array has x's size, every per-channel one c values (None: not given)."""
    for name, a in arrays.items():
        want = size if name in ("y", "dy", "dx") else c
        if a is not None and a.size != want:
            raise ValueError(f"{op}: {name} must have {want} values ({'x' if want == size else 'channels'}), "
                             f"got shape {a.shape}")


def _nc_inner(DeviceArray x, str op):
    if len(x.shape) < 2:
        raise ValueError(f"{op}: x must be (n, c, ...), got shape {x.shape}")
    inner = 1
    for s in x.shape[2:]:
        inner *= s
    return x.shape[0], x.shape[1], inner

cdef class FlatUpdate:
    """One optimizer update of every parameter over flat buffers (cydnn_flat_update)."""
    cdef cydnnFlatUpdate u
    cdef readonly object arrays

    def __init__(self, *, DeviceArray param not None, DeviceArray grad not None, DeviceArray state1,
                 DeviceArray state2, int optimizer, float momentum=0.0, float dampening=0.0,
                 float weight_decay=0.0, bint nesterov=False, double beta1=0.9, double beta2=0.999,
                 float eps=1e-8, DeviceArray lr_table not None, DeviceArray counters not None):
        self.u.param = f32(param, "param")
        self.u.grad = f32(grad, "grad")
        self.u.state1 = f32_or_null(state1, "state1")
        self.u.state2 = f32_or_null(state2, "state2")
        self.u.count = param.size
        self.u.optimizer = optimizer
        self.u.momentum, self.u.dampening, self.u.weight_decay = momentum, dampening, weight_decay
        self.u.nesterov = nesterov
        self.u.beta1, self.u.beta2, self.u.eps = beta1, beta2, eps
        self.u.lr_table = f32(lr_table, "lr_table")
        self.u.lr_len = lr_table.size
        self.u.counters = <cydnnStepCounters *>counters.data()
        self.arrays = (param, grad, state1, state2, lr_table, counters)   # kept alive with the update

    def enqueue(self):
        check(cydnn_flat_update(ctx(), &self.u), "flat_update")


def step_bookkeeping(DeviceArray logits not None, DeviceArray labels not None, DeviceArray loss not None,
                     DeviceArray counters not None):
    """counters: correct += right argmaxes, loss_sum += loss, step_in_epoch += 1, global_step += 1."""
    check(cydnn_step_bookkeeping(ctx(), f32(logits, "logits"), i32(labels, "labels"), logits.shape[0],
                                 logits.shape[1], f32(loss, "loss"), <cydnnStepCounters *>counters.data()),
          "step_bookkeeping")


def dropout_step(DeviceArray x not None, DeviceArray y not None, DeviceArray mask not None, uint32_t threshold,
                 float scale, uint64_t seed, DeviceArray counters not None):
    """Dropout whose mask seed mixes in the device step counter (a new mask every replay)."""
    check(cydnn_dropout_step(ctx(), f32(x, "x"), f32(y, "y"), f32(mask, "mask"), x.size, threshold, scale, seed,
                             <const cydnnStepCounters *>counters.data()), "dropout_step")


def copy_into(DeviceArray dst not None, DeviceArray src not None):
    """dst[...] = src, device to device, asynchronous (same shape and dtype)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_into: dst is {dst.dtype} {dst.shape}, src is {src.dtype} {src.shape}")
    if dst.nbytes:
        check(cydnn_memcpy_d2d(ctx(), dst.data(), src.data(), dst.nbytes), "copy_into")


def copy2_into(DeviceArray dst0 not None, DeviceArray src0 not None, DeviceArray dst1 not None,
               DeviceArray src1 not None):
    """dst0[...] = src0 and dst1[...] = src1 (device to device, asynchronous) in one kernel launch."""
    for a, b in ((dst0, src0), (dst1, src1)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"copy2_into: dst is {a.dtype} {a.shape}, src is {b.dtype} {b.shape}")
    check(cydnn_copy2_d2d(ctx(), dst0.data(), src0.data(), dst0.nbytes, dst1.data(), src1.data(), dst1.nbytes),
          "copy2_into")


def fold_batch_norm(DeviceArray w not None, DeviceArray b, DeviceArray gamma not None, DeviceArray beta not None,
                    DeviceArray mean not None, DeviceArray var not None, float eps, DeviceArray w_out not None,
                    DeviceArray b_out not None):
    """w_out = w * s, b_out = (b - mean) * s + beta, s = gamma / sqrt(var + eps) (per output channel)."""
    cdef int out = w.shape[0]
    check(cydnn_fold_batch_norm(ctx(), f32(w, "w"), f32_or_null(b, "b"), f32(gamma, "gamma"), f32(beta, "beta"),
                                f32(mean, "mean"), f32(var, "var"), eps, out, w.size // out, f32(w_out, "w_out"),
                                f32(b_out, "b_out")), "fold_batch_norm")


def _conv_shapes(str op, DeviceArray x, DeviceArray w, DeviceArray b, DeviceArray y, tuple stride, tuple padding,
                 str y_name="y", str b_name="b"):
    """Refuse, before any GPU work, arrays that do not make the convolution y = conv(x, w) + b (named y_name and
    b_name in the message: dy and db for the backward)."""
    if len(x.shape) != 4 or len(w.shape) != 4 or len(y.shape) != 4:
        raise ValueError(f"{op}: x, w and {y_name} must be 4-D, got {x.shape}, {w.shape}, {y.shape}")
    if len(stride) != 2 or len(padding) != 2 or min(stride) < 1 or min(padding) < 0:
        raise ValueError(f"{op}: stride {stride} must be two ints >= 1 and padding {padding} two ints >= 0")
    oh = (x.shape[2] + 2 * padding[0] - w.shape[2]) // stride[0] + 1
    ow = (x.shape[3] + 2 * padding[1] - w.shape[3]) // stride[1] + 1
    want = (x.shape[0], w.shape[0], oh, ow)
    if w.shape[1] != x.shape[1] or tuple(y.shape) != want:
        raise ValueError(f"{op}: x {x.shape} and w {w.shape} (stride {stride}, padding {padding}) make {y_name} "
                         f"{want} with w.shape[1] == x.shape[1], got {y_name} {y.shape}")
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"{op}: {b_name} must have shape ({w.shape[0]},), got {b.shape}")


def direct_conv_forward(DeviceArray x not None, DeviceArray w not None, DeviceArray b, DeviceArray y not None,
                        tuple stride, tuple padding, int act, float slope=0.0):
    """y = act(conv(x, w) + b) in one direct kernel (cydnn_direct_conv_forward)."""
    _conv_shapes("direct_conv_forward", x, w, b, y, stride, padding)
    cdef cydnnConvGeometry g = conv_geometry(x.shape, w.shape, stride, padding)
    check(cydnn_direct_conv_forward(ctx(), &g, f32(x, "x"), f32(w, "w"), f32_or_null(b, "b"), f32(y, "y"), act,
                                    slope), "direct_conv_forward")


def igemm_conv_tiles():
    """The implicit-GEMM convolution's tiles: a list of (output pixels, output channels, threads, reductions a
    chunk, splits of the reduction) a block."""
    cdef int rows = 0, channels = 0, threads = 0, chunk = 0, splits = 0
    tiles = []
    for t in range(cydnn_igemm_conv_tile_count()):
        check(cydnn_igemm_conv_tile(t, &rows, &channels, &threads, &chunk, &splits), "igemm_conv_tiles")
        tiles.append((rows, channels, threads, chunk, splits))
    return tiles


def igemm_conv_forward(DeviceArray x not None, DeviceArray w not None, DeviceArray b, DeviceArray y not None,
                       tuple stride, tuple padding, int act, float slope=0.0, int tile=0):
    """y = act(conv(x, w) + b) as an implicit GEMM by tile ``tile`` (cydnn_igemm_conv_forward)."""
    _conv_shapes("igemm_conv_forward", x, w, b, y, stride, padding)
    cdef cydnnConvGeometry g = conv_geometry(x.shape, w.shape, stride, padding)
    check(cydnn_igemm_conv_forward(ctx(), &g, f32(x, "x"), f32(w, "w"), f32_or_null(b, "b"), f32(y, "y"), act,
                                   slope, tile), "igemm_conv_forward")


def skinny_gemm_tiles():
    """gemm_skinny.cu's tiles: a list of (rows, columns, threads, splits of the reduction over a cluster's blocks)."""
    cdef int rows = 0, cols = 0, threads = 0, splits = 0
    tiles = []
    for t in range(cydnn_skinny_gemm_tile_count()):
        check(cydnn_skinny_gemm_tile(t, &rows, &cols, &threads, &splits), "skinny_gemm_tiles")
        tiles.append((rows, cols, threads, splits))
    return tiles


def skinny_gemm(DeviceArray a not None, DeviceArray w not None, DeviceArray bias, DeviceArray c not None,
                bint b_kn, int act=0, float slope=0.0, int tile=0):
    """c = act(a B + bias) by tile ``tile`` (cydnn_skinny_gemm): a (m, k), c (m, n); B = w^T with w (n, k) (a linear
    layer's forward), or B = w with w (k, n) where ``b_kn`` (its data gradient dy w)."""
    if len(a.shape) != 2 or len(w.shape) != 2 or len(c.shape) != 2:
        raise ValueError(f"skinny_gemm: a, w and c must be 2-D, got {a.shape}, {w.shape}, {c.shape}")
    m, k = a.shape
    n = w.shape[1] if b_kn else w.shape[0]
    if (w.shape[0] if b_kn else w.shape[1]) != k or tuple(c.shape) != (m, n):
        raise ValueError(f"skinny_gemm: a {a.shape} and w {w.shape} ({'(k, n)' if b_kn else '(n, k)'}) make c "
                         f"({m}, {n}), got c {c.shape}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"skinny_gemm: bias must have shape ({n},), got {bias.shape}")
    check(cydnn_skinny_gemm(ctx(), f32(a, "a"), f32(w, "w"), f32_or_null(bias, "bias"), f32(c, "c"), m, n, k, b_kn,
                            act, slope, tile), "skinny_gemm")


def conv_wgrad_tiles():
    """conv_wgrad.cu's tiles: a list of (output channels, reductions (c, ky, kx), threads, splits of the output
    pixels) a block."""
    cdef int channels = 0, reductions = 0, threads = 0, splits = 0
    tiles = []
    for t in range(cydnn_conv_wgrad_tile_count()):
        check(cydnn_conv_wgrad_tile(t, &channels, &reductions, &threads, &splits), "conv_wgrad_tiles")
        tiles.append((channels, reductions, threads, splits))
    return tiles
