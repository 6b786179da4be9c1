# _fast.pxi -- the Cython side of the fast path (cpp/fused_lenet.cu, cpp/fastpath.cu,
# cpp/fused_mlp.cu).  Included by _C.pyx.  Same rules as the rest of _C: pointers
# and shapes in, a status out turned into the library's exception; the shape
# checks live in python/cydnn/fast/ and ops/_check.py.

from libc.string cimport memcpy, memset

LENET_MAX_CLASSES = CYDNN_LENET_MAX_CLASSES
LENET_MAX_TRAIN_BATCH = CYDNN_LENET_MAX_TRAIN_BATCH
INPUT_U8 = CYDNN_INPUT_U8
INPUT_F32 = CYDNN_INPUT_F32
OPT_SGD = CYDNN_OPT_SGD
OPT_ADAM = CYDNN_OPT_ADAM
OPT_ADAMW = CYDNN_OPT_ADAMW

# numpy view of cydnnLeNetCounters (8 + 4 + 4 + 8 bytes, no padding).
COUNTERS_DTYPE = np.dtype([("global_step", "<i8"), ("step_in_epoch", "<i4"), ("correct", "<i4"),
                           ("loss_sum", "<f8")])


def lenet_param_size(bint classic, int num_classes, int i):
    return cydnn_lenet_param_size(classic, num_classes, i)


cdef int _lenet_weights(tuple params, cydnnLeNetWeights *w) except -1:
    if len(params) != CYDNN_LENET_NUM_PARAMS:
        raise ValueError(f"lenet: expected {CYDNN_LENET_NUM_PARAMS} parameter arrays, got {len(params)}")
    cdef int i
    for i in range(CYDNN_LENET_NUM_PARAMS):
        w.p[i] = f32(params[i], "lenet weight")
    return 0


def lenet_forward(bint classic, int num_classes, tuple params, DeviceArray images not None,
                  DeviceArray out not None, float mean, float std, bint softmax):
    """The whole LeNet-5 forward in one kernel: images (n, 28, 28) uint8 or float32 -> out (n, classes)."""
    cdef cydnnLeNetWeights w
    _lenet_weights(params, &w)
    cdef int kind
    if images.dtype == _U8:
        kind = CYDNN_INPUT_U8
    elif images.dtype == _F32:
        kind = CYDNN_INPUT_F32
    else:
        raise TypeError(f"lenet_forward: images must be uint8 or float32, got {images.dtype}")
    check(cydnn_lenet_forward(ctx(), classic, num_classes, &w, images.data(), kind, images.shape[0], NULL,
                              mean, std, softmax, f32(out, "out")), "lenet_forward")


def lenet_train_scratch_bytes(bint classic, int num_classes, int batch):
    return cydnn_lenet_train_scratch_bytes(classic, num_classes, batch)


def view(DeviceArray base not None, size_t offset, tuple shape):
    """A view of ``base`` starting ``offset`` elements in, with ``shape`` (for packed buffers)."""
    shape = _normalize_shape(shape, "view")
    cdef size_t n = 1
    for s in shape:
        n *= <size_t>s
    if offset + n > base.size:
        raise ValueError(f"view: {offset} + {n} elements exceed the base's {base.size}")
    return _wrap(base._alloc, base._offset + offset * base.dtype.itemsize, shape, base.dtype)


cdef class LeNetTrainStep:
    """One compiled training step of a LeNet-5: the cydnnLeNetTrainStep struct and
    the arrays it points into (kept alive here)."""
    cdef cydnnLeNetTrainStep s
    cdef readonly object arrays

    def __init__(self, *, bint classic, int num_classes, int batch, DeviceArray images not None,
                 DeviceArray labels not None, DeviceArray order not None, int order_stride, DeviceArray seeds,
                 int max_shift, float mean, float std, tuple params, tuple grads, tuple state1, tuple state2,
                 int optimizer, float momentum=0, float dampening=0, float weight_decay=0, bint nesterov=False,
                 double beta1=0.9, double beta2=0.999, float eps=1e-8, DeviceArray lr_table not None,
                 DeviceArray counters not None, DeviceArray scratch not None):
        memset(&self.s, 0, sizeof(self.s))
        if images.dtype != _U8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise TypeError(f"lenet_train_step: images must be uint8 (N, 28, 28), got {images.dtype} {images.shape}")
        if scratch.nbytes < cydnn_lenet_train_scratch_bytes(classic, num_classes, batch):
            raise ValueError("lenet_train_step: scratch is too small")
        if counters.nbytes < sizeof(cydnnLeNetCounters):
            raise ValueError("lenet_train_step: counters is too small")
        self.s.classic, self.s.num_classes, self.s.batch = classic, num_classes, batch
        self.s.images = <const uint8_t *>images.data()
        self.s.labels = i32(labels, "labels")
        self.s.n_images = images.shape[0]
        self.s.order = i32(order, "order")
        self.s.order_stride = order_stride
        self.s.shift_seeds = <const uint64_t *>NULL if seeds is None else <const uint64_t *>seeds.data()
        self.s.max_shift, self.s.mean, self.s.std = max_shift, mean, std
        cdef int i
        for i in range(CYDNN_LENET_NUM_PARAMS):
            self.s.param[i] = f32(params[i], "param")
            self.s.grad[i] = f32(grads[i], "grad")
            self.s.state1[i] = f32_or_null(state1[i], "optimizer state")
            self.s.state2[i] = f32_or_null(state2[i], "optimizer state")
        self.s.optimizer = optimizer
        self.s.momentum, self.s.dampening, self.s.weight_decay = momentum, dampening, weight_decay
        self.s.nesterov = nesterov
        self.s.beta1, self.s.beta2, self.s.eps = beta1, beta2, eps
        self.s.lr_table = f32(lr_table, "lr_table")
        self.s.counters = <cydnnLeNetCounters *>counters.data()
        self.s.scratch = scratch.data()
        self.arrays = (images, labels, order, seeds, params, grads, state1, state2, lr_table, counters, scratch)

    def enqueue(self):
        """Queue the step's three kernels (nothing waits, nothing is allocated)."""
        check(cydnn_lenet_train_step(ctx(), &self.s), "lenet_train_step")


cdef class Graph:
    """A captured, instantiated CUDA graph; ``launch()`` replays it on the context's stream."""
    cdef cydnnGraph *g

    def __dealloc__(self):
        if self.g != NULL:
            cydnn_graph_destroy(self.g)
            self.g = NULL

    def launch(self):
        check(cydnn_graph_launch(ctx(), self.g), "cuda_graph")

    @property
    def kernel_count(self):
        return cydnn_graph_kernel_count(self.g)


def graph_begin():
    """Start capturing the context's stream into a graph."""
    check(cydnn_graph_begin(ctx()), "cuda_graph")


def graph_end(bint discard=False):
    """End the capture; a Graph (or None when ``discard``).  Always ends the capture."""
    cdef cydnnGraph *g = NULL
    check(cydnn_graph_end(ctx(), discard, &g), "cuda_graph")
    if g == NULL:
        return None
    cdef Graph out = Graph.__new__(Graph)
    out.g = g
    return out


cdef class Predictor:
    """numpy in, numpy out for a LeNet-5 (cydnn_predictor_*): see cpp/fastpath.cu."""
    cdef cydnnPredictor *p
    cdef readonly int num_classes

    def __cinit__(self, bint classic, int num_classes, float mean, float std, bint use_graphs=True):
        self.p = NULL
        self.num_classes = num_classes
        check(cydnn_predictor_create(ctx(), classic, num_classes, mean, std, use_graphs, &self.p), "predict")

    def __dealloc__(self):
        if self.p != NULL:
            cydnn_predictor_destroy(self.p)
            self.p = NULL

    def __call__(self, tuple parameters, cnp.ndarray images not None, bint full=False):
        """Probabilities (n, classes) for C-contiguous (n, 28, 28) uint8 or float32 images, n >= 1;
        ``full``: float32 images of the network's own input size (classic (n, 32, 32)), not padded
        again (the caller checks the shape); ``parameters``: the ten nn.Parameter objects (their
        ``.data`` is read now)."""
        cdef cydnnLeNetWeights w
        cdef int i
        if len(parameters) != CYDNN_LENET_NUM_PARAMS:
            raise ValueError(f"predict: expected {CYDNN_LENET_NUM_PARAMS} parameters, got {len(parameters)}")
        for i in range(CYDNN_LENET_NUM_PARAMS):
            w.p[i] = f32(parameters[i].data, "lenet weight")
        if full and images.dtype != _F32:
            raise TypeError(f"predict: full-size images must be float32, got {images.dtype}")
        cdef int kind = CYDNN_INPUT_F32_FULL if full else (CYDNN_INPUT_U8 if images.dtype == _U8 else CYDNN_INPUT_F32)
        cdef int n = images.shape[0]
        cdef cnp.npy_intp dims[2]
        dims[0] = n
        dims[1] = self.num_classes
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(2, dims, cnp.NPY_FLOAT32, 0)
        cdef const void *src = cnp.PyArray_DATA(images)
        cdef float *dst = <float *>cnp.PyArray_DATA(out)
        cdef cydnnStatus_t status
        # The GIL stays held: the call queues work on the library's one stream and may capture a
        # graph on it, so no other thread may enqueue (or capture) there meanwhile.
        status = cydnn_predictor_run(self.p, &w, src, kind, n, dst)
        check(status, "predict")
        return out

    def run(self, tuple params, cnp.ndarray images not None, cnp.ndarray out not None):
        """images: C-contiguous (n, 28, 28) uint8 or float32; out: C-contiguous float32 (n, classes)."""
        cdef cydnnLeNetWeights w
        _lenet_weights(params, &w)
        cdef int kind = CYDNN_INPUT_U8 if images.dtype == _U8 else CYDNN_INPUT_F32
        cdef int n = images.shape[0]
        cdef const void *src = cnp.PyArray_DATA(images)
        cdef float *dst = <float *>cnp.PyArray_DATA(out)
        cdef cydnnStatus_t status
        # The GIL stays held: the call queues work on the library's one stream and may capture a
        # graph on it, so no other thread may enqueue (or capture) there meanwhile.
        status = cydnn_predictor_run(self.p, &w, src, kind, n, dst)
        check(status, "predict")

    @property
    def graph_count(self):
        return cydnn_predictor_graph_count(self.p)


def fused_mlp_forward(DeviceArray x not None, tuple weights, tuple biases, DeviceArray y not None):
    """y = fused chain of Linear (+ ReLU between): cydnn_fused_mlp_forward."""
    cdef int layers = len(weights)
    if layers < 1 or layers > 8 or len(biases) != layers:
        raise ValueError(f"fused_mlp_forward: 1 to 8 layers with one bias entry each, got {layers} and {len(biases)}")
    cdef int dims[9]
    cdef const float *wp[8]
    cdef const float *bp[8]
    cdef int i
    dims[0] = x.shape[1]
    for i in range(layers):
        wp[i] = f32(weights[i], "weight")
        bp[i] = f32_or_null(biases[i], "bias")
        dims[i + 1] = weights[i].shape[0]
    check(cydnn_fused_mlp_forward(ctx(), f32(x, "x"), x.shape[0], layers, dims, wp, bp, f32(y, "y")),
          "fused_mlp_forward")


def conv_algorithms_text():
    """cydnn_conv_algorithms: the raw text (see cydnn.h); parsed by cydnn.cuda.conv_algorithms."""
    if _context == NULL:
        return ""
    cdef size_t need = cydnn_conv_algorithms(_context, NULL, 0)
    cdef bytearray buf = bytearray(need + 1)
    cydnn_conv_algorithms(_context, <char *>buf, need + 1)
    return bytes(buf[:need - 1]).decode("utf-8", "replace") if need else ""
