# _C.pxd -- the C ABI of cpp/cydnn.h, as Cython sees it, and the DeviceArray type.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t


cdef extern from "cydnn.h" nogil:
    ctypedef enum cydnnStatus_t:
        CYDNN_STATUS_SUCCESS
        CYDNN_STATUS_CUDA_ERROR
        CYDNN_STATUS_CUDNN_ERROR
        CYDNN_STATUS_CUBLAS_ERROR
        CYDNN_STATUS_OUT_OF_MEMORY
        CYDNN_STATUS_DEVICE_UNAVAILABLE
        CYDNN_STATUS_INVALID_ARGUMENT

    const char *cydnn_last_error_message()
    int cydnn_last_library_status()
    void cydnn_clear_error()

    int cydnn_device_count()
    cydnnStatus_t cydnn_check_device(int device)
    cydnnStatus_t cydnn_device_name(int device, char *buf, size_t len)
    cydnnStatus_t cydnn_device_memory_info(int device, size_t *free_bytes, size_t *total_bytes)

    ctypedef struct cydnnVersions:
        int cuda_runtime
        int cuda_driver
        size_t cudnn
        int cublas
        int compiled_cudnn
    void cydnn_versions(cydnnVersions *out)

    ctypedef struct cydnnContext:
        pass
    cydnnStatus_t cydnn_context_get(int device, cydnnContext **ctx)
    int cydnn_context_device(const cydnnContext *ctx)
    void *cydnn_context_stream(const cydnnContext *ctx)
    cydnnStatus_t cydnn_context_synchronize(cydnnContext *ctx)
    size_t cydnn_context_plan_count(const cydnnContext *ctx)
    cydnnStatus_t cydnn_context_set_math(cydnnContext *ctx, int allow_tf32, int deterministic)
    cydnnStatus_t cydnn_context_set_workspace_limit(cydnnContext *ctx, size_t bytes)
    cydnnStatus_t cydnn_context_set_fp16(cydnnContext *ctx, int on)

    cydnnStatus_t cydnn_debug_fail(cydnnContext *ctx, int which)

    ctypedef struct cydnnMemoryStats:
        size_t allocated_bytes
        size_t reserved_bytes
        size_t peak_allocated_bytes
        size_t peak_reserved_bytes
        size_t requested_bytes
        uint64_t num_allocs
        uint64_t num_frees
        uint64_t num_device_mallocs
        uint64_t num_device_frees
        uint64_t num_cache_hits
        uint64_t num_ooms
    cydnnStatus_t cydnn_malloc(cydnnContext *ctx, size_t nbytes, void **ptr)
    cydnnStatus_t cydnn_free(cydnnContext *ctx, void *ptr)
    cydnnStatus_t cydnn_empty_cache(cydnnContext *ctx)
    cydnnStatus_t cydnn_memory_stats(cydnnContext *ctx, cydnnMemoryStats *out)
    cydnnStatus_t cydnn_reset_peak_memory_stats(cydnnContext *ctx)
    cydnnStatus_t cydnn_set_poison(cydnnContext *ctx, int on)
    cydnnStatus_t cydnn_memcpy_h2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes)
    cydnnStatus_t cydnn_memcpy_d2h(cydnnContext *ctx, void *dst, const void *src, size_t nbytes)
    cydnnStatus_t cydnn_memcpy_d2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes)
    cydnnStatus_t cydnn_copy2_d2d(cydnnContext *ctx, void *dst0, const void *src0, size_t nbytes0, void *dst1,
                                  const void *src1, size_t nbytes1)
    cydnnStatus_t cydnn_memset(cydnnContext *ctx, void *dst, int byte_value, size_t nbytes)
    cydnnStatus_t cydnn_host_alloc_mapped(cydnnContext *ctx, size_t nbytes, void **host, void **device)
    cydnnStatus_t cydnn_host_free(void *host)

    ctypedef struct cydnnConvGeometry:
        int n, c, h, w
        int k, kh, kw
        int stride_h, stride_w
        int pad_h, pad_w
    cydnnStatus_t cydnn_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                     const float *weight, const float *bias, float *y)
    cydnnStatus_t cydnn_conv_backward_data(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy,
                                           const float *weight, float *dx)
    cydnnStatus_t cydnn_conv_backward_filter(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                             const float *dy, float *dweight)
    cydnnStatus_t cydnn_conv_backward_bias(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy,
                                           float *dbias)
    cydnnStatus_t cydnn_conv_backward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                      const float *weight, const float *dy, float *dx, float *dweight,
                                      float *dbias)
    cydnnStatus_t cydnn_conv_backward_tiles(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                            const float *weight, const float *dy, float *dx, float *dweight,
                                            float *dbias, int dx_tile, int dw_tile)
    int cydnn_conv_wgrad_tile_count()
    cydnnStatus_t cydnn_conv_wgrad_tile(int tile, int *channels, int *reductions, int *threads, int *splits)

    ctypedef struct cydnnPoolGeometry:
        int n, c, h, w
        int kh, kw
        int stride_h, stride_w
        int pad_h, pad_w
    cydnnStatus_t cydnn_max_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x, float *y)
    cydnnStatus_t cydnn_max_pool_tiled_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x, float *y)
    cydnnStatus_t cydnn_max_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                                          const float *dy, float *dx)
    cydnnStatus_t cydnn_avg_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x, float *y)
    cydnnStatus_t cydnn_avg_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                                          const float *y, const float *dy, float *dx)

    cydnnStatus_t cydnn_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count)
    cydnnStatus_t cydnn_relu_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx, size_t count)
    cydnnStatus_t cydnn_leaky_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count,
                                           float negative_slope)
    cydnnStatus_t cydnn_leaky_relu_backward(cydnnContext *ctx, const float *x, const float *dy, float *dx,
                                            size_t count, float negative_slope)
    cydnnStatus_t cydnn_tanh_forward(cydnnContext *ctx, const float *x, float *y, size_t count)
    cydnnStatus_t cydnn_tanh_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx, size_t count)
    cydnnStatus_t cydnn_sigmoid_forward(cydnnContext *ctx, const float *x, float *y, size_t count)
    cydnnStatus_t cydnn_sigmoid_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                         size_t count)
    cydnnStatus_t cydnn_dropout_forward(cydnnContext *ctx, const float *x, float *y, float *mask, size_t count,
                                        uint32_t threshold, float scale, uint64_t seed)
    cydnnStatus_t cydnn_mul(cydnnContext *ctx, const float *a, const float *b, float *out, size_t count)

    cydnnStatus_t cydnn_batch_norm_forward_training(cydnnContext *ctx, int n, int c, int h, int w,
                                                    const float *x, const float *gamma, const float *beta,
                                                    double factor, float *running_mean, float *running_var,
                                                    double eps, float *y, float *save_mean, float *save_inv_std)
    cydnnStatus_t cydnn_batch_norm_forward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                     const float *x, const float *gamma, const float *beta,
                                                     const float *running_mean, const float *running_var,
                                                     double eps, float *y, float *save_mean,
                                                     float *save_inv_std)
    cydnnStatus_t cydnn_batch_norm_backward(cydnnContext *ctx, int n, int c, int h, int w, const float *x,
                                            const float *dy, const float *gamma, const float *save_mean,
                                            const float *save_inv_std, double eps, float *dx, float *dgamma,
                                            float *dbeta)
    cydnnStatus_t cydnn_batch_norm_backward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                      const float *x, const float *dy, const float *gamma,
                                                      const float *save_mean, const float *save_inv_std,
                                                      float *dx, float *dgamma, float *dbeta)

    cydnnStatus_t cydnn_linear_forward(cydnnContext *ctx, const float *x, const float *weight, const float *bias,
                                       float *y, int n, int in_features, int out_features)
    cydnnStatus_t cydnn_linear_forward_act(cydnnContext *ctx, const float *x, const float *weight, const float *bias,
                                           float *y, int n, int in_features, int out_features, int act)
    cydnnStatus_t cydnn_linear_backward(cydnnContext *ctx, const float *x, const float *weight, const float *dy,
                                        float *dx, float *dweight, float *dbias, int n, int in_features,
                                        int out_features)
    cydnnStatus_t cydnn_linear_backward_ex(cydnnContext *ctx, const float *x, const float *weight, const float *dy,
                                           float *dx, float *dweight, float *dbias, int n, int in_features,
                                           int out_features, int dx_tile)

    cydnnStatus_t cydnn_softmax_forward(cydnnContext *ctx, const float *x, float *y, int n, int c, int log)
    cydnnStatus_t cydnn_softmax_cross_entropy(cydnnContext *ctx, const float *logits, const int32_t *labels,
                                              int n, int c, float *loss, float *dlogits, int32_t *bad_labels)

    cydnnStatus_t cydnn_sgd_update(cydnnContext *ctx, float *param, const float *grad, float *momentum_buf,
                                   size_t count, float lr, float momentum, float dampening, float weight_decay,
                                   int nesterov, int first_step)
    cydnnStatus_t cydnn_adam_update(cydnnContext *ctx, float *param, const float *grad, float *m, float *v,
                                    size_t count, float lr, double beta1, double beta2, float eps,
                                    float weight_decay, int decoupled, int step)

    cydnnStatus_t cydnn_gather_batch(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                     int n_images, int h, int w, const int32_t *indices, int batch,
                                     float mean, float std, int pad, int max_shift, uint64_t seed,
                                     float *out_images, int32_t *out_labels)
    cydnnStatus_t cydnn_gather_batch_chw(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                         int n_images, int channels, int h, int w, const int32_t *indices,
                                         int batch, const float *mean, const float *std, int pad,
                                         int max_shift, int flip, uint64_t seed, float *out_images,
                                         int32_t *out_labels)


cdef class _Allocation:
    cdef void *ptr
    cdef size_t nbytes
    cdef cydnnContext *ctx


cdef class DeviceArray:
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly size_t size
    cdef _Allocation _alloc
    cdef size_t _offset
    cdef void *data(self)


# ------------------------------------------------ the fast path (fused_lenet.cu, fastpath.cu)
cdef extern from "cydnn.h" nogil:
    enum: CYDNN_LENET_MAX_CLASSES
    enum: CYDNN_LENET_MAX_TRAIN_BATCH
    enum: CYDNN_LENET_NUM_PARAMS
    enum: CYDNN_INPUT_U8
    enum: CYDNN_INPUT_F32
    enum: CYDNN_INPUT_F32_FULL
    enum: CYDNN_OPT_SGD
    enum: CYDNN_OPT_ADAM
    enum: CYDNN_OPT_ADAMW

    ctypedef struct cydnnLeNetWeights:
        const float *p[10]
    long cydnn_lenet_param_size(int classic, int num_classes, int i)
    cydnnStatus_t cydnn_lenet_forward(cydnnContext *ctx, int classic, int num_classes,
                                      const cydnnLeNetWeights *w, const void *images, int input_kind,
                                      int n, const int *n_dev, float mean, float std, int softmax,
                                      float *out)

    ctypedef struct cydnnLeNetCounters:
        long long global_step
        int step_in_epoch
        int correct
        double loss_sum

    ctypedef struct cydnnLeNetTrainStep:
        int classic, num_classes, batch
        const uint8_t *images
        const int32_t *labels
        int n_images
        const int32_t *order
        int order_stride
        const uint64_t *shift_seeds
        int max_shift
        float mean, std
        float *param[10]
        float *grad[10]
        float *state1[10]
        float *state2[10]
        int optimizer
        float momentum, dampening, weight_decay
        int nesterov
        double beta1, beta2
        float eps
        const float *lr_table
        cydnnLeNetCounters *counters
        void *scratch
    size_t cydnn_lenet_train_scratch_bytes(int classic, int num_classes, int batch)
    cydnnStatus_t cydnn_lenet_train_step(cydnnContext *ctx, const cydnnLeNetTrainStep *s)

    ctypedef struct cydnnGraph:
        pass
    cydnnStatus_t cydnn_graph_begin(cydnnContext *ctx)
    cydnnStatus_t cydnn_graph_end(cydnnContext *ctx, int discard, cydnnGraph **graph)
    cydnnStatus_t cydnn_graph_launch(cydnnContext *ctx, cydnnGraph *graph)
    int cydnn_graph_kernel_count(const cydnnGraph *graph)
    void cydnn_graph_destroy(cydnnGraph *graph)

    ctypedef struct cydnnPredictor:
        pass
    cydnnStatus_t cydnn_predictor_create(cydnnContext *ctx, int classic, int num_classes, float mean,
                                         float std, int use_graphs, cydnnPredictor **out)
    cydnnStatus_t cydnn_predictor_run(cydnnPredictor *p, const cydnnLeNetWeights *w,
                                      const void *host_images, int input_kind, int n, float *host_probs)
    int cydnn_predictor_graph_count(const cydnnPredictor *p)
    void cydnn_predictor_destroy(cydnnPredictor *p)
    cydnnStatus_t cydnn_fused_mlp_forward(cydnnContext *ctx, const float *x, int n, int num_layers,
                                          const int *dims, const float *const *weights,
                                          const float *const *biases, float *y)
    size_t cydnn_conv_algorithms(cydnnContext *ctx, char *buf, size_t len)

    # ---- the compiler's kernels (compiled.cu)
    enum:
        CYDNN_ACT_NONE
        CYDNN_ACT_RELU
        CYDNN_ACT_TANH
        CYDNN_ACT_SIGMOID
        CYDNN_ACT_LEAKY
    cydnnStatus_t cydnn_bias_act_forward(cydnnContext *ctx, const float *x, const float *bias, float *y,
                                         int n, int channels, size_t inner, int act, float slope)
    cydnnStatus_t cydnn_bias_act_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                          float *dbias, int n, int channels, size_t inner, int act, float slope)
    cydnnStatus_t cydnn_max_pool_act_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *y,
                                              const float *dy, float *dx, float *dbias, int act, float slope)
    cydnnStatus_t cydnn_linear_xent(cydnnContext *ctx, const float *x, const float *w, const float *bias,
                                    const int32_t *labels, int n, int k, int c, float *logits, float *row_loss,
                                    float *loss, float *g, float *dbias, float *dx, float *dw)
    cydnnStatus_t cydnn_bn_act_forward_train(cydnnContext *ctx, const float *x, const float *gamma,
                                             const float *beta, float *running_mean, float *running_var,
                                             double factor, double eps, float *y, float *save_mean,
                                             float *save_inv_std, int n, int channels, size_t inner, int act,
                                             float slope)
    cydnnStatus_t cydnn_bn_act_backward(cydnnContext *ctx, const float *x, const float *y, const float *dy,
                                        const float *gamma, const float *save_mean, const float *save_inv_std,
                                        float *dx, float *dgamma, float *dbeta, int n, int channels, size_t inner,
                                        int act, float slope)
    ctypedef cydnnLeNetCounters cydnnStepCounters
    ctypedef struct cydnnFlatUpdate:
        float *param
        const float *grad
        float *state1
        float *state2
        size_t count
        int optimizer
        float momentum, dampening, weight_decay
        int nesterov
        double beta1, beta2
        float eps
        const float *lr_table
        int lr_len
        const cydnnStepCounters *counters
    cydnnStatus_t cydnn_flat_update(cydnnContext *ctx, const cydnnFlatUpdate *u)
    cydnnStatus_t cydnn_step_bookkeeping(cydnnContext *ctx, const float *logits, const int32_t *labels, int n,
                                         int c, const float *loss, cydnnStepCounters *counters)
    cydnnStatus_t cydnn_dropout_step(cydnnContext *ctx, const float *x, float *y, float *mask, size_t count,
                                     uint32_t threshold, float scale, uint64_t seed,
                                     const cydnnStepCounters *counters)
    cydnnStatus_t cydnn_fold_batch_norm(cydnnContext *ctx, const float *w, const float *b, const float *gamma,
                                        const float *beta, const float *mean, const float *var, float eps, int out,
                                        size_t per_out, float *w_out, float *b_out)
    cydnnStatus_t cydnn_direct_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                            const float *w, const float *b, float *y, int act, float slope)
    int cydnn_skinny_gemm_tile_count()
    cydnnStatus_t cydnn_skinny_gemm_tile(int tile, int *rows, int *cols, int *threads, int *splits)
    cydnnStatus_t cydnn_skinny_gemm(cydnnContext *ctx, const float *a, const float *w, const float *bias, float *c,
                                    int m, int n, int k, int b_kn, int act, float slope, int tile)
    int cydnn_igemm_conv_tile_count()
    cydnnStatus_t cydnn_igemm_conv_tile(int tile, int *rows, int *channels, int *threads, int *chunk, int *splits)
    cydnnStatus_t cydnn_igemm_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                           const float *w, const float *b, float *y, int act, float slope, int tile)


# ------------------------------------------------ the fused network (fused_net.cu)
cdef extern from "cydnn.h" nogil:
    enum: CYDNN_NET_MAX_LAYERS
    enum:
        CYDNN_NET_CONV
        CYDNN_NET_LINEAR
        CYDNN_NET_MAX_POOL
        CYDNN_NET_AVG_POOL
        CYDNN_NET_GLOBAL_AVG_POOL
        CYDNN_NET_EPILOGUE
    enum:
        CYDNN_NET_EPI_ACT
        CYDNN_NET_EPI_BN
    ctypedef struct cydnnNetLayer:
        int op, tile, pool
        int c, h, w
        int k, oh, ow
        int kh, kw, sh, sw, ph, pw
        const float *weight
        const float *bias
        int num_epi
        int epi[3]
        int act
        float slope
        const float *bn_mean
        const float *bn_var
        const float *bn_weight
        const float *bn_bias
        float bn_eps
    ctypedef struct cydnnNet:
        int num_layers, softmax
        long in_size, out_size
        long wcap
        cydnnNetLayer layers[32]
    cydnnStatus_t cydnn_fused_net_check(const cydnnNet *net, size_t *smem_bytes)
    cydnnStatus_t cydnn_fused_net_forward(cydnnContext *ctx, const cydnnNet *net, const float *x, int n,
                                          float *y, int cluster)
    ctypedef struct cydnnNetKernel:
        pass
    cydnnStatus_t cydnn_net_kernel_load(cydnnContext *ctx, const void *image, const char *name, int cluster,
                                        cydnnNetKernel **out)
    void cydnn_net_kernel_destroy(cydnnNetKernel *k)
    cydnnStatus_t cydnn_fused_net_launch(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                         int cluster, const cydnnNetKernel *kernel)
    ctypedef struct cydnnNetTrain:
        int batch
        const float *x
        const int32_t *labels
        float *logits
        float *loss
        float *grad_w[32]
        float *grad_b[32]
        void *scratch
    cydnnStatus_t cydnn_fused_train_check(const cydnnNet *net, int batch, int cluster, size_t *smem_bytes,
                                          size_t *scratch_bytes)
    cydnnStatus_t cydnn_fused_train_step(cydnnContext *ctx, const cydnnNet *net, const cydnnNetTrain *t, int cluster)
    ctypedef struct cydnnResident:
        pass
    cydnnStatus_t cydnn_resident_create(cydnnContext *ctx, const cydnnNet *net, int cluster, long idle_us,
                                        cydnnResident **out)
    cydnnStatus_t cydnn_resident_run(cydnnResident *r, const float *x, float *y, int *served)
    cydnnStatus_t cydnn_resident_stop(cydnnResident *r)
    int cydnn_resident_running(cydnnResident *r)
    void cydnn_resident_destroy(cydnnResident *r)


# ------------------------------------------------ the copy pipe (pipe.cu)
cdef extern from "cydnn.h" nogil:
    ctypedef struct cydnnPipe:
        pass
    cydnnStatus_t cydnn_pipe_create(cydnnContext *ctx, size_t in_bytes, size_t out_bytes, int threads,
                                    cydnnPipe **out)
    int cydnn_pipe_threads(const cydnnPipe *p)
    cydnnStatus_t cydnn_pipe_upload(cydnnPipe *p, int slot, void *dst, const void *src, size_t nbytes)
    cydnnStatus_t cydnn_pipe_download(cydnnPipe *p, int slot, const void *src, size_t nbytes)
    cydnnStatus_t cydnn_pipe_finish(cydnnPipe *p, int slot, void *dst, size_t nbytes)
    void cydnn_pipe_destroy(cydnnPipe *p)
    int cydnn_host_copy(void *dst, const void *src, size_t nbytes, int threads)
