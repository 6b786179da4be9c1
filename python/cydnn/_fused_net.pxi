# _fused_net.pxi -- the fused network's table and launches (cpp/fused_net.cu), included by _C.pyx.
# The compiler (python/cydnn/compiler/fused_net.py) describes the layers; this builds the C table
# once and keeps the arrays it points into alive.

NET_MAX_LAYERS = CYDNN_NET_MAX_LAYERS
NET_OPS = {"conv": CYDNN_NET_CONV, "linear": CYDNN_NET_LINEAR, "max_pool": CYDNN_NET_MAX_POOL,
           "avg_pool": CYDNN_NET_AVG_POOL, "global_avg_pool": CYDNN_NET_GLOBAL_AVG_POOL,
           "epilogue": CYDNN_NET_EPILOGUE}
NET_EPI_ACT, NET_EPI_BN = CYDNN_NET_EPI_ACT, CYDNN_NET_EPI_BN


# A call of a few images through mapped memory waits for its outputs rather than for the stream (cpp/mapped_wait.h):
# the output words are set to MAPPED_PENDING, and the host spins until every one was overwritten, for at most
# spin_ns, then synchronises the stream (which also raises a kernel's error).
cdef extern from "mapped_wait.h":
    unsigned int CYDNN_MAPPED_PENDING
    long long CYDNN_MAPPED_SPIN_NS
    void cydnn_mapped_clear(void *p, size_t n) nogil
    int cydnn_mapped_written(const void *p, size_t n, long long limit_ns) nogil

MAPPED_PENDING = CYDNN_MAPPED_PENDING


cdef class MappedBuffer:
    """``nbytes`` of pinned host memory mapped into the device's address space (cydnn_host_alloc_mapped):
    a kernel reads and writes it over PCIe, with no copy on the stream."""
    cdef void *host
    cdef void *device
    cdef readonly size_t nbytes

    def __cinit__(self, size_t nbytes):
        self.host = NULL
        self.device = NULL
        check(cydnn_host_alloc_mapped(ctx(), nbytes, &self.host, &self.device), "host_alloc_mapped")
        self.nbytes = nbytes

    def __dealloc__(self):
        if self.host != NULL:
            cydnn_host_free(self.host)      # a failure here (the driver already gone at exit) is not actionable
            self.host = NULL


cdef class NetKernel:
    """A fused-network kernel generated for one network and one cluster size (compiler/fused_net_gen.py):
    NVRTC's cubin loaded as a library (cydnn_net_kernel_load).  FusedNet's calls take it as ``kernel``."""
    cdef cydnnNetKernel *k
    cdef readonly int cluster

    def __cinit__(self, bytes image not None, str name not None, int cluster):
        self.k = NULL
        self.cluster = cluster
        check(cydnn_net_kernel_load(ctx(), <const char *>image, name.encode(), cluster, &self.k),
              "fused_net_kernel_load")

    def __dealloc__(self):
        if self.k != NULL:
            if _context != NULL:        # a call that returned on its outputs may leave the kernel's last blocks
                cydnn_context_synchronize(_context)     # exiting: not unloaded under them (a failure: nothing to do)
            cydnn_net_kernel_destroy(self.k)
            self.k = NULL


cdef cydnnStatus_t _net_launch(cydnnContext *c, const cydnnNet *net, const float *x, int n, float *y, int cluster,
                               NetKernel kernel):
    if kernel is None:
        return cydnn_fused_net_forward(c, net, x, n, y, cluster)
    return cydnn_fused_net_launch(c, net, x, n, y, cluster, kernel.k)


# A call of n images through mapped memory (FusedNet.run_mapped, MappedCall), in two halves: the images into `xin`,
# the outputs in `yout` set pending, one launch; then the wait -- for every output word, at most spin_ns, else (or 0)
# the stream's synchronisation, which also raises a kernel's error -- and the outputs copied into `out`.  The caller
# has checked that the buffers hold n images.
cdef int _mapped_launch(const cydnnNet *net, const void *x, int n, MappedBuffer xin, MappedBuffer yout, int cluster,
                        NetKernel kernel) except -1:
    memcpy(xin.host, x, <size_t>n * net.in_size * 4)
    cydnn_mapped_clear(yout.host, <size_t>n * net.out_size)
    check(_net_launch(ctx(), net, <const float *>xin.device, n, <float *>yout.device, cluster, kernel),
          "fused_net_forward")
    return 0


cdef int _mapped_finish(const cydnnNet *net, void *out, int n, MappedBuffer yout, long long spin_ns) except -1:
    cdef size_t count = <size_t>n * net.out_size
    cdef bint written = False
    if spin_ns > 0:
        with nogil:
            written = cydnn_mapped_written(yout.host, count, spin_ns)
    if not written:
        check(cydnn_context_synchronize(ctx()), "fused_net_forward")
    memcpy(out, yout.host, count * 4)
    return 0


cdef class FusedNet:
    """A network table (cydnnNet) over DeviceArrays, checked once (cydnn_fused_net_check).

    ``layers``: dicts with ``op`` (a key of NET_OPS), ``tile``, ``pool`` (a convolution of tile 7: 0, or
    NET_OPS["max_pool"] / NET_OPS["avg_pool"], a 2x2 stride-2 pooling folded in), the geometry ``c h w k oh ow kh kw sh sw ph
    pw``, the arrays ``weight bias bn_mean bn_var bn_weight bn_bias`` (DeviceArray or None), ``epi`` (a
    list of NET_EPI_ACT / NET_EPI_BN), ``act``, ``slope``, ``bn_eps``.  The table holds the arrays' device
    addresses: whoever changes an array's buffer (not its values) must build a new FusedNet.
    """
    cdef cydnnNet net
    cdef readonly object arrays
    cdef readonly size_t smem_bytes

    def __init__(self, list layers, long in_size, long out_size, bint softmax=False, long wcap=0):
        if not 1 <= len(layers) <= CYDNN_NET_MAX_LAYERS:
            raise ValueError(f"fused_net: 1 to {CYDNN_NET_MAX_LAYERS} layers, got {len(layers)}")
        memset(&self.net, 0, sizeof(cydnnNet))
        self.net.num_layers = len(layers)
        self.net.softmax = softmax
        self.net.in_size, self.net.out_size = in_size, out_size
        self.net.wcap = wcap
        keep = []
        cdef cydnnNetLayer *L
        cdef int i, s
        for i, d in enumerate(layers):
            L = &self.net.layers[i]
            L.op = NET_OPS[d["op"]]
            L.tile = d.get("tile", 0)
            L.pool = d.get("pool", 0)
            L.c, L.h, L.w = d["c"], d.get("h", 1), d.get("w", 1)
            L.k, L.oh, L.ow = d.get("k", 0), d.get("oh", 1), d.get("ow", 1)
            L.kh, L.kw, L.sh, L.sw = d.get("kh", 1), d.get("kw", 1), d.get("sh", 1), d.get("sw", 1)
            L.ph, L.pw = d.get("ph", 0), d.get("pw", 0)
            L.weight = f32_or_null(d.get("weight"), "weight")
            L.bias = f32_or_null(d.get("bias"), "bias")
            L.bn_mean = f32_or_null(d.get("bn_mean"), "bn_mean")
            L.bn_var = f32_or_null(d.get("bn_var"), "bn_var")
            L.bn_weight = f32_or_null(d.get("bn_weight"), "bn_weight")
            L.bn_bias = f32_or_null(d.get("bn_bias"), "bn_bias")
            L.bn_eps = d.get("bn_eps", 0.0)
            epi = d.get("epi", ())
            if len(epi) > 3:
                raise ValueError(f"fused_net: layer {i} has {len(epi)} epilogue steps, at most 3")
            L.num_epi = len(epi)
            for s in range(len(epi)):
                L.epi[s] = epi[s]
            L.act, L.slope = d.get("act", 0), d.get("slope", 0.0)
            keep += [d.get(k) for k in ("weight", "bias", "bn_mean", "bn_var", "bn_weight", "bn_bias")]
        self.arrays = tuple(a for a in keep if a is not None)
        check(cydnn_fused_net_check(&self.net, &self.smem_bytes), "fused_net_forward")

    def forward(self, DeviceArray x not None, DeviceArray y not None, int n, int cluster=1, NetKernel kernel=None):
        """y[:n] = the network on x[:n] (float32 DeviceArrays of n * in_size and n * out_size at least);
        ``kernel``: a generated kernel for this table and cluster size (None: the interpreter)."""
        if x.size < <size_t>n * self.net.in_size or y.size < <size_t>n * self.net.out_size:
            raise ValueError(f"fused_net_forward: x of {x.size} and y of {y.size} values cannot hold {n} images "
                             f"of {self.net.in_size} -> {self.net.out_size}")
        check(_net_launch(ctx(), &self.net, f32(x, "x"), n, f32(y, "y"), cluster, kernel), "fused_net_forward")

    def run_mapped(self, cnp.ndarray x not None, cnp.ndarray out not None, MappedBuffer xin not None,
                   MappedBuffer yout not None, int cluster=1, NetKernel kernel=None,
                   long long spin_ns=CYDNN_MAPPED_SPIN_NS):
        """numpy in, numpy out through mapped pinned memory: x copied into ``xin`` on the host, one launch
        whose kernel reads ``xin`` and writes ``yout`` over PCIe, one wait, ``yout`` copied into out (a few
        images: two copies on the stream would cost more than the kernel's reads).  The wait: until every output
        word was written (MAPPED_PENDING), for at most ``spin_ns``, then the stream's synchronisation (0: at
        once).  Same x / out rules as run_host."""
        cdef int n = x.shape[0]
        if (x.dtype != np.float32 or out.dtype != np.float32 or not x.flags.c_contiguous
                or not out.flags.c_contiguous or x.size != n * self.net.in_size
                or out.size != n * self.net.out_size or n < 1):
            raise ValueError("fused_net_forward: x and out must be C-contiguous float32 of n images")
        cdef size_t in_bytes = <size_t>n * self.net.in_size * 4
        cdef size_t out_bytes = <size_t>n * self.net.out_size * 4
        if in_bytes > xin.nbytes or out_bytes > yout.nbytes:
            raise ValueError(f"fused_net_forward: mapped buffers of {xin.nbytes} and {yout.nbytes} bytes cannot hold "
                             f"{n} images ({in_bytes} and {out_bytes} bytes)")
        _mapped_launch(&self.net, cnp.PyArray_DATA(x), n, xin, yout, cluster, kernel)
        _mapped_finish(&self.net, cnp.PyArray_DATA(out), n, yout, spin_ns)

    def run_host(self, cnp.ndarray x not None, cnp.ndarray out not None, DeviceArray dx not None,
                 DeviceArray dy not None, int cluster=1, NetKernel kernel=None):
        """numpy in, numpy out in one call: copy x up into dx, the kernel, copy dy down into out.
        x: C-contiguous float32 (n, ...) of n * in_size values; out: C-contiguous float32 of n * out_size."""
        cdef int n = x.shape[0]
        if (x.dtype != np.float32 or out.dtype != np.float32 or not x.flags.c_contiguous
                or not out.flags.c_contiguous or x.size != n * self.net.in_size
                or out.size != n * self.net.out_size or n < 1):
            raise ValueError("fused_net_forward: x and out must be C-contiguous float32 of n images")
        if dx.size < <size_t>n * self.net.in_size or dy.size < <size_t>n * self.net.out_size:
            raise ValueError(f"fused_net_forward: staging buffers too small for {n} images")
        cdef cydnnContext *c = ctx()
        cdef float *px = f32(dx, "x")
        cdef float *py = f32(dy, "y")
        check(cydnn_memcpy_h2d(c, px, cnp.PyArray_DATA(x), <size_t>n * self.net.in_size * 4), "fused_net_forward")
        check(_net_launch(c, &self.net, px, n, py, cluster, kernel), "fused_net_forward")
        check(cydnn_memcpy_d2h(c, cnp.PyArray_DATA(out), py, <size_t>n * self.net.out_size * 4),
              "fused_net_forward")


cdef class MappedCall:
    """A one-image numpy call of a fused network with everything settled -- the table, the mapped buffers, the
    cluster size, the kernel (a generated one, or None: the interpreter) and the image's shape -- so that the call
    costs one Python call into C: what CompiledInference keeps for its one-image calls once their route no longer
    changes (compiler/inference.py).  ``call(x)``: x a float32 C-contiguous numpy array of ``in_shape`` (one image,
    the batch axis first) -> a new array (1, *out_shape), through the mapped buffers as FusedNet.run_mapped does;
    None where x is anything else (the caller's general path then converts it or says what is wrong)."""
    cdef FusedNet table
    cdef MappedBuffer xin, yout
    cdef readonly NetKernel kernel
    cdef readonly int cluster
    cdef int in_ndim, out_ndim
    cdef cnp.npy_intp in_dims[8]
    cdef cnp.npy_intp out_dims[8]

    def __init__(self, FusedNet table not None, MappedBuffer xin not None, MappedBuffer yout not None, int cluster,
                 NetKernel kernel, tuple in_shape not None, tuple out_shape not None):
        if not 1 <= len(in_shape) <= 7 or not 0 <= len(out_shape) <= 7:
            raise ValueError(f"fused_net_forward: shapes {in_shape} -> {out_shape}: at most 7 axes each")
        if (int(np.prod(in_shape)) != table.net.in_size or int(np.prod(out_shape)) != table.net.out_size
                or xin.nbytes < <size_t>table.net.in_size * 4 or yout.nbytes < <size_t>table.net.out_size * 4):
            raise ValueError(f"fused_net_forward: one image of {in_shape} -> {out_shape} does not match the table "
                             f"({table.net.in_size} -> {table.net.out_size} values) or the mapped buffers")
        if kernel is not None and kernel.cluster != cluster:
            raise ValueError(f"fused_net_forward: the generated kernel serves clusters of {kernel.cluster}, "
                             f"asked for {cluster}")
        self.table, self.xin, self.yout, self.kernel, self.cluster = table, xin, yout, kernel, cluster
        self.in_ndim, self.out_ndim = len(in_shape) + 1, len(out_shape) + 1
        self.in_dims[0] = self.out_dims[0] = 1
        cdef int i
        for i in range(len(in_shape)):
            self.in_dims[i + 1] = in_shape[i]
        for i in range(len(out_shape)):
            self.out_dims[i + 1] = out_shape[i]

    def __call__(self, x):
        if not cnp.PyArray_CheckExact(x):
            return None
        cdef cnp.ndarray a = <cnp.ndarray>x
        if (cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(a)
                or cnp.PyArray_NDIM(a) != self.in_ndim):
            return None
        cdef int i
        for i in range(self.in_ndim):
            if cnp.PyArray_DIMS(a)[i] != self.in_dims[i]:
                return None
        _mapped_launch(&self.table.net, cnp.PyArray_DATA(a), 1, self.xin, self.yout, self.cluster, self.kernel)
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(self.out_ndim, self.out_dims, cnp.NPY_FLOAT32, 0)  # while it runs
        _mapped_finish(&self.table.net, cnp.PyArray_DATA(out), 1, self.yout, CYDNN_MAPPED_SPIN_NS)
        return out


cdef class ResidentNet:
    """One-image calls of a FusedNet served by a kernel that stays on the GPU between calls
    (cpp/fused_net_resident.cu): no launch and no stream synchronisation per call.  The kernel
    returns after ``idle_us`` microseconds without a call and is launched again by the next one; a
    call made while the library's stream has work queued is one ordinary launch after that work.

    ``run(x, out)``: x float32 C-contiguous of in_size values, out of out_size; returns True when the
    resident kernel answered, False for an ordinary launch.  ``stop()`` makes the kernel return now.
    """
    cdef cydnnResident *r
    cdef readonly FusedNet table       # keeps the table's arrays alive as long as the kernel may read them
    cdef readonly int cluster
    cdef readonly long idle_us

    def __cinit__(self, FusedNet table not None, int cluster, long idle_us):
        self.r = NULL
        self.table, self.cluster, self.idle_us = table, cluster, idle_us
        check(cydnn_resident_create(ctx(), &table.net, cluster, idle_us, &self.r), "fused_net_resident")

    def run(self, cnp.ndarray x not None, cnp.ndarray out not None):
        if (x.dtype != np.float32 or out.dtype != np.float32 or not x.flags.c_contiguous
                or not out.flags.c_contiguous or x.size != self.table.net.in_size
                or out.size != self.table.net.out_size):
            raise ValueError(f"fused_net_resident: x and out must be C-contiguous float32 of one image "
                             f"({self.table.net.in_size} and {self.table.net.out_size} values), got "
                             f"{x.dtype} {x.size} and {out.dtype} {out.size}")
        cdef int served = 0
        check(cydnn_resident_run(self.r, <const float *>cnp.PyArray_DATA(x), <float *>cnp.PyArray_DATA(out),
                                 &served), "fused_net_resident")
        return served == 1

    def stop(self):
        check(cydnn_resident_stop(self.r), "fused_net_resident")

    @property
    def running(self):
        return cydnn_resident_running(self.r) == 1

    def __dealloc__(self):
        if self.r != NULL:
            cydnn_resident_destroy(self.r)
            self.r = NULL


cdef class FusedTrain:
    """A training step's forward, loss and backward on a fused network's table (cpp/fused_train.cu): one
    thread-block cluster of ``cluster`` blocks per image, then the batch's weight and bias gradients.

    ``table``: a FusedNet of the network (logits out: softmax off; no batch norm); ``x`` (batch * in_size
    floats), ``labels`` (batch int32), ``logits`` (batch * out_size floats, written), ``loss`` (one float,
    written); ``grads``: per layer of the table, ``(dweight, dbias)`` DeviceArrays for a convolution or
    linear layer (dbias None where the layer has no bias), ``None`` for the others.  The scratch is its own.
    ``enqueue()`` launches the two kernels on the library's stream (capturable).
    """
    cdef cydnnNet net
    cdef cydnnNetTrain t
    cdef readonly int cluster, batch
    cdef readonly size_t smem_bytes, scratch_bytes
    cdef readonly object arrays

    def __init__(self, FusedNet table not None, int batch, int cluster, DeviceArray x not None,
                 DeviceArray labels not None, DeviceArray logits not None, DeviceArray loss not None,
                 list grads not None):
        self.net = table.net
        check(cydnn_fused_train_check(&self.net, batch, cluster, &self.smem_bytes, &self.scratch_bytes),
              "fused_train_step")
        if (x.size < <size_t>batch * self.net.in_size or labels.size < <size_t>batch
                or logits.size < <size_t>batch * self.net.out_size or loss.size < 1):
            raise ValueError(f"fused_train_step: x of {x.size}, labels of {labels.size}, logits of {logits.size} "
                             f"and loss of {loss.size} values cannot hold a batch of {batch} images of "
                             f"{self.net.in_size} -> {self.net.out_size}")
        if len(grads) != self.net.num_layers:
            raise ValueError(f"fused_train_step: {len(grads)} gradient entries for {self.net.num_layers} layers")
        memset(&self.t, 0, sizeof(cydnnNetTrain))
        self.batch, self.cluster = batch, cluster
        self.t.batch = batch
        self.t.x = f32(x, "x")
        self.t.labels = i32(labels, "labels")
        self.t.logits = f32(logits, "logits")
        self.t.loss = f32(loss, "loss")
        cdef int i
        for i, g in enumerate(grads):
            if g is not None:
                self.t.grad_w[i] = f32_or_null(g[0], "dweight")
                self.t.grad_b[i] = f32_or_null(g[1], "dbias")
        scratch = empty((max(1, (self.scratch_bytes + 3) // 4),))
        self.t.scratch = <void *>f32(scratch, "scratch")
        self.arrays = (table, x, labels, logits, loss, scratch, grads)

    def clocks(self):
        """The train kernel's phase ends on image 0 (ns, %globaltimer) of the last step run with
        ``$CYDNN_FUSED_TRAIN_CLOCK=1`` (profiling): start, forward, saved inputs, loss, then the backward of
        layer l at [4 + l] (what was not timed holds whatever the scratch held); then the end of the train
        kernel's last block, the start of the weight kernel and the end of its last block, a spare, and the
        forward of layer l at [40 + l] (cpp/fused_train_args.cuh's kClocks)."""
        cdef DeviceArray scratch = self.arrays[5]
        words = scratch.numpy().view(np.uint64)
        return words[len(words) - (8 + 2 * CYDNN_NET_MAX_LAYERS):].copy()

    def enqueue(self):
        check(cydnn_fused_train_step(ctx(), &self.net, &self.t, self.cluster), "fused_train_step")
