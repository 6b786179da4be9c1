/*
 * cydnn.h -- the C ABI of the cydnn CUDA library.
 *
 * Plain C on purpose: the Cython layer includes this header and is compiled by
 * the host C++ compiler, without CUDA headers.  Pointers to device memory are
 * plain `float *` / `void *`; the CUDA stream is handed out as `void *`.
 *
 * Conventions
 *   - Every function returns a cydnnStatus_t.  On failure the library keeps a
 *     message (thread-local) readable with cydnn_last_error_message() and the
 *     status of the library that failed (cudaError_t, cudnnStatus_t or
 *     cublasStatus_t) with cydnn_last_library_status().
 *   - Nothing in this library exits, aborts or prints.
 *   - Tensors are dense, row-major (NCHW for images), float32 unless stated.
 *   - Every op is enqueued on the context's stream and returns without
 *     synchronising the host, except the explicit copies to host memory.
 *   - Callers validate shapes before calling (the Python layer does); the C
 *     layer still refuses what would corrupt memory (null pointers, sizes < 1).
 */
#ifndef CYDNN_H
#define CYDNN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status */
typedef enum {
    CYDNN_STATUS_SUCCESS = 0,
    CYDNN_STATUS_CUDA_ERROR = 1,         /* a CUDA runtime call or a kernel launch failed */
    CYDNN_STATUS_CUDNN_ERROR = 2,        /* a cuDNN call failed */
    CYDNN_STATUS_CUBLAS_ERROR = 3,       /* a cuBLAS call failed */
    CYDNN_STATUS_OUT_OF_MEMORY = 4,      /* the pool could not get device memory, even after emptying its cache */
    CYDNN_STATUS_DEVICE_UNAVAILABLE = 5, /* no driver, no device, or a driver too old */
    CYDNN_STATUS_INVALID_ARGUMENT = 6    /* a null pointer or an impossible size reached the C layer */
} cydnnStatus_t;

/* The message of the last failure on this thread ("" if none). */
const char *cydnn_last_error_message(void);
/* The failing library's own status code for the last failure on this thread. */
int cydnn_last_library_status(void);
/* Forget the last failure on this thread. */
void cydnn_clear_error(void);

/* --------------------------------------------------------- device queries */
/* Number of usable CUDA devices; 0 when there is no driver or no device. Never fails. */
int cydnn_device_count(void);
/* SUCCESS if device `device` can be used, else DEVICE_UNAVAILABLE with the reason. */
cydnnStatus_t cydnn_check_device(int device);
cydnnStatus_t cydnn_device_name(int device, char *buf, size_t len);
/* Memory on the device as the driver sees it. */
cydnnStatus_t cydnn_device_memory_info(int device, size_t *free_bytes, size_t *total_bytes);

typedef struct {
    int cuda_runtime;    /* e.g. 13000 */
    int cuda_driver;     /* 0 when no driver is installed */
    size_t cudnn;        /* cudnnGetVersion(), e.g. 91900 */
    int cublas;          /* major*10000 + minor*100 + patch, from cublasGetProperty */
    int compiled_cudnn;  /* CUDNN_VERSION this library was compiled against */
} cydnnVersions;
/* Works without a GPU. */
void cydnn_versions(cydnnVersions *out);

/* ---------------------------------------------------------------- context */
/* One context per device: a non-blocking stream, one cuDNN handle and one
 * cuBLAS handle bound to that stream, the caching memory pool, pinned host
 * staging buffers and the per-shape descriptor caches.  Created lazily on
 * first use and kept for the life of the process (device arrays may be freed
 * at any time up to interpreter exit, so the context is never torn down). */
typedef struct cydnnContext cydnnContext;

cydnnStatus_t cydnn_context_get(int device, cydnnContext **ctx);
int cydnn_context_device(const cydnnContext *ctx);
void *cydnn_context_stream(const cydnnContext *ctx); /* a cudaStream_t */
cydnnStatus_t cydnn_context_synchronize(cydnnContext *ctx);

/* Math settings, read by every op at call time.
 *  allow_tf32:    let cuDNN/cuBLAS use TF32 tensor cores for float32 (default 0).
 *  deterministic: pick only deterministic convolution algorithms (default 0). */
cydnnStatus_t cydnn_context_set_math(cydnnContext *ctx, int allow_tf32, int deterministic);
/* Half precision for inference (default 0): when on, conv_forward and
 * linear_forward convert x and the weights to float16, run cuDNN / cuBLAS on
 * tensor cores with float32 accumulation, and return float32 (conv's output
 * passes through float16; linear's does not).  Backward ops are unaffected. */
cydnnStatus_t cydnn_context_set_fp16(cydnnContext *ctx, int on);
/* Number of per-shape plans (descriptor sets, chosen algorithms) built so far:
 * constant once every shape has been seen (no descriptor is made after warm-up). */
size_t cydnn_context_plan_count(const cydnnContext *ctx);
/* Upper bound of the convolution workspace, in bytes (default 64 MiB). */
cydnnStatus_t cydnn_context_set_workspace_limit(cydnnContext *ctx, size_t bytes);

/* Test hook: make one harmless call that the named library refuses, so each
 * error path (status, message, Python exception) can be tested for real.
 * which: 1 CUDA (cudaSetDevice of a device that does not exist), 2 cuDNN (a
 * tensor descriptor with a negative size), 3 cuBLAS (a GEMM with m = -1),
 * 4 the pool (freeing a pointer it never handed out). */
cydnnStatus_t cydnn_debug_fail(cydnnContext *ctx, int which);

/* ----------------------------------------------------------------- memory */
/* Caching allocator.  Sizes are rounded up to size classes; a freed block goes
 * back to the pool and is reused by the next request of its class (best fit
 * among cached blocks no more than twice the request).  When cudaMalloc fails
 * the pool frees its whole cache and retries once before OUT_OF_MEMORY. */
typedef struct {
    size_t allocated_bytes;       /* in blocks handed out now (rounded sizes) */
    size_t reserved_bytes;        /* obtained from cudaMalloc and not yet freed */
    size_t peak_allocated_bytes;
    size_t peak_reserved_bytes;
    size_t requested_bytes;       /* sum of the sizes asked for, blocks handed out now */
    uint64_t num_allocs;          /* cydnn_malloc calls that succeeded */
    uint64_t num_frees;
    uint64_t num_device_mallocs;  /* cudaMalloc calls made by the pool */
    uint64_t num_device_frees;    /* cudaFree calls made by the pool */
    uint64_t num_cache_hits;      /* allocations served from the cache */
    uint64_t num_ooms;            /* OUT_OF_MEMORY returned */
} cydnnMemoryStats;

cydnnStatus_t cydnn_malloc(cydnnContext *ctx, size_t nbytes, void **ptr);
cydnnStatus_t cydnn_free(cydnnContext *ctx, void *ptr);
cydnnStatus_t cydnn_empty_cache(cydnnContext *ctx);
cydnnStatus_t cydnn_memory_stats(cydnnContext *ctx, cydnnMemoryStats *out);
cydnnStatus_t cydnn_reset_peak_memory_stats(cydnnContext *ctx);
/* Debug aid: when on, every block handed out is filled with 0xFF bytes (a NaN
 * for float32, -1 for int32) so that an element an op forgot to write shows. */
cydnnStatus_t cydnn_set_poison(cydnnContext *ctx, int on);

/* Copies.  Host->device goes through a pinned staging buffer when it fits
 * (8 MiB), then returns without waiting for the device.  Device->host waits
 * for the stream (the data is needed on the host).  Device->device and memset
 * are asynchronous. */
cydnnStatus_t cydnn_memcpy_h2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes);
cydnnStatus_t cydnn_memcpy_d2h(cydnnContext *ctx, void *dst, const void *src, size_t nbytes);
cydnnStatus_t cydnn_memcpy_d2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes);
/* Two device-to-device copies (dst0 <- src0, dst1 <- src1) in one kernel launch on the context's stream; the
 * regions must not overlap.  Either size may be 0. */
cydnnStatus_t cydnn_copy2_d2d(cydnnContext *ctx, void *dst0, const void *src0, size_t nbytes0, void *dst1,
                              const void *src1, size_t nbytes1);
cydnnStatus_t cydnn_memset(cydnnContext *ctx, void *dst, int byte_value, size_t nbytes);
/* Pinned host memory mapped into the device's address space (cudaHostAllocMapped): a kernel
 * reads and writes it over PCIe through *device, with no copy on the stream (for inputs and
 * outputs of a few KB, where a copy's latency is most of the cost).  Free with cydnn_host_free. */
cydnnStatus_t cydnn_host_alloc_mapped(cydnnContext *ctx, size_t nbytes, void **host, void **device);
cydnnStatus_t cydnn_host_free(void *host);

/* A copy pipe (pipe.cu): two slots, each a pinned input and output buffer, so that
 * the host copies one chunk of a numpy array into pinned memory while the device
 * computes the previous one.  upload: wait until the slot's last upload has left its
 * buffer, copy src (host) into it, queue its DMA on the pipe's own stream (overlapping the
 * library's stream) into the slot's device buffer, then on the library's stream, after
 * the DMA, a device copy to dst.  download: queue the copy of src (device) into the slot's output buffer.
 * finish: wait for that copy, copy the buffer to dst (host). */
typedef struct cydnnPipe cydnnPipe;
cydnnStatus_t cydnn_pipe_create(cydnnContext *ctx, size_t in_bytes, size_t out_bytes, int threads,
                                cydnnPipe **out);   /* threads: 0 = automatic */
int cydnn_pipe_threads(const cydnnPipe *p);   /* host threads that fill a slot */
cydnnStatus_t cydnn_pipe_upload(cydnnPipe *p, int slot, void *dst, const void *src, size_t nbytes);
cydnnStatus_t cydnn_pipe_download(cydnnPipe *p, int slot, const void *src, size_t nbytes);
cydnnStatus_t cydnn_pipe_finish(cydnnPipe *p, int slot, void *dst, size_t nbytes);
void cydnn_pipe_destroy(cydnnPipe *p);
/* The pipe's fill alone (host memory only, no device): dst <- src, split over up to `threads` threads (0: as a
 * pipe) in slices of 1 MiB or more, the calling thread taking one.  Returns how: 0 one memcpy, 1 the process's
 * pool of copy threads, 2 threads started for this copy (the pool was busy with another caller's fill). */
int cydnn_host_copy(void *dst, const void *src, size_t nbytes, int threads);

/* ------------------------------------------------------------ convolution */
/* x (n, c, h, w), weight (k, c, kh, kw), bias (k) or NULL, y (n, k, oh, ow) with
 * oh = (h + 2*pad_h - kh) / stride_h + 1 and likewise ow.  cuDNN, cross-correlation
 * (as PyTorch).  Algorithms are found by measurement once per geometry and
 * math setting, then cached with their descriptors. */
typedef struct {
    int n, c, h, w;       /* input */
    int k, kh, kw;        /* filters */
    int stride_h, stride_w;
    int pad_h, pad_w;
} cydnnConvGeometry;

cydnnStatus_t cydnn_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g,
                                 const float *x, const float *weight, const float *bias, float *y);
cydnnStatus_t cydnn_conv_backward_data(cydnnContext *ctx, const cydnnConvGeometry *g,
                                       const float *dy, const float *weight, float *dx);
cydnnStatus_t cydnn_conv_backward_filter(cydnnContext *ctx, const cydnnConvGeometry *g,
                                         const float *x, const float *dy, float *dweight);
cydnnStatus_t cydnn_conv_backward_bias(cydnnContext *ctx, const cydnnConvGeometry *g,
                                       const float *dy, float *dbias);
/* The three at once: dx (may be NULL), dweight, dbias (may be NULL).  With dx asked, dweight and
 * dbias are computed on the context's second stream beside dx (a fork and a join by events; in a
 * captured graph, two branches).  On return the context's stream has joined the second. */
cydnnStatus_t cydnn_conv_backward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                  const float *weight, const float *dy, float *dx, float *dweight,
                                  float *dbias);
/* The same with dx (stride 1) by the implicit-GEMM kernel's tile dx_tile (below) where dx_tile >= 0, and the
 * filter gradient by conv_wgrad.cu's tile dw_tile (below) where dw_tile >= 0; cuDNN where a tile is -1 (the bias
 * gradient stays cuDNN's). */
cydnnStatus_t cydnn_conv_backward_tiles(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                        const float *weight, const float *dy, float *dx, float *dweight,
                                        float *dbias, int dx_tile, int dw_tile);
/* A convolution's filter gradient as a GEMM on the CUDA cores (conv_wgrad.cu): a block computes `channels` output
 * channels x `reductions` (c, ky, kx) indices of dw over a share of the n*oh*ow output pixels, the pixels split over
 * `splits` blocks whose partial sums a second kernel adds in a fixed order (through the context's workspace).  The
 * compiler times the tiles against cuDNN's filter gradient. */
int cydnn_conv_wgrad_tile_count(void);
cydnnStatus_t cydnn_conv_wgrad_tile(int tile, int *channels, int *reductions, int *threads, int *splits);

/* What cuDNN's measurement chose for each convolution plan, as text: one line
 * per measured direction, "<plan key>\t<forward|backward_data|backward_filter>
 * \t<chosen algo>\t<algo>:<ms>:<status>:<workspace bytes>:<retimed ms>,..."
 * (every candidate cuDNN timed; retimed: the library's own timing of the
 * fastest few usable ones replayed in a CUDA graph, which chooses among them,
 * -1 for the others).
 * Writes at most len bytes (NUL-terminated) and returns the size needed, NUL
 * included. */
size_t cydnn_conv_algorithms(cydnnContext *ctx, char *buf, size_t len);

/* ---------------------------------------------------------------- pooling */
/* x (n, c, h, w), y (n, c, oh, ow), oh = (h + 2*pad_h - kh) / stride_h + 1.
 * Max pooling ignores padding; average pooling counts the padding (as PyTorch's
 * default count_include_pad=True).  Max backward is a custom kernel that routes
 * each gradient to the first maximum of its window (row-major order). */
typedef struct {
    int n, c, h, w;
    int kh, kw;
    int stride_h, stride_w;
    int pad_h, pad_w;
} cydnnPoolGeometry;

cydnnStatus_t cydnn_max_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                     const float *x, float *y);
cydnnStatus_t cydnn_max_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                      const float *x, const float *dy, float *dx);
/* Max pooling whose windows tile x (kernel == stride, no padding, h % kh == 0, w % kw == 0) by a custom
 * kernel: each window's maximum, NaN never taken (a window of -inf / NaN only gives -inf), as the CPU twin. */
cydnnStatus_t cydnn_max_pool_tiled_forward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                           const float *x, float *y);
cydnnStatus_t cydnn_avg_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                     const float *x, float *y);
cydnnStatus_t cydnn_avg_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                      const float *x, const float *y, const float *dy, float *dx);

/* ------------------------------------------------------------ activations */
/* Elementwise over `count` floats.  ReLU: custom kernels (float4 loads when
 * aligned).  Tanh and sigmoid: cuDNN activation.  Backward of each takes the
 * forward's output y: relu' = (y > 0), tanh' = 1 - y^2, sigmoid' = y (1 - y). */
cydnnStatus_t cydnn_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count);
cydnnStatus_t cydnn_relu_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx, size_t count);
/* Leaky ReLU (custom kernels, float4 loads when aligned), as PyTorch: y = x > 0 ? x : a * x;
 * its backward takes the forward's INPUT x (the slope a may be 0 or negative, so y does not
 * tell the sign of x): dx = x > 0 ? dy : a * dy. */
cydnnStatus_t cydnn_leaky_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count,
                                       float negative_slope);
cydnnStatus_t cydnn_leaky_relu_backward(cydnnContext *ctx, const float *x, const float *dy, float *dx,
                                        size_t count, float negative_slope);
cydnnStatus_t cydnn_tanh_forward(cydnnContext *ctx, const float *x, float *y, size_t count);
cydnnStatus_t cydnn_tanh_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx, size_t count);
cydnnStatus_t cydnn_sigmoid_forward(cydnnContext *ctx, const float *x, float *y, size_t count);
cydnnStatus_t cydnn_sigmoid_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx, size_t count);
/* Dropout with a counter-based hash (see cydnn_hash in kernels): element i is
 * kept when (splitmix64(seed ^ splitmix64(i)) >> 40) >= threshold, where
 * threshold = round(p * 2^24).  mask[i] = kept ? 1/(1-p) : 0; y = x * mask. */
cydnnStatus_t cydnn_dropout_forward(cydnnContext *ctx, const float *x, float *y, float *mask,
                                    size_t count, uint32_t threshold, float scale, uint64_t seed);
/* dx = dy * mask (also the generic elementwise product). */
cydnnStatus_t cydnn_mul(cydnnContext *ctx, const float *a, const float *b, float *out, size_t count);

/* ---------------------------------------------------- batch normalization */
/* PyTorch's BatchNorm1d/2d (batchnorm.cu).  x, y, dy, dx (n, c, h, w), float32 NCHW; a 2-D
 * input (n, c) is passed as (n, c, 1, 1), a 3-D one (n, c, l) as (n, c, l, 1).  Every other
 * array is one float per channel (c).  Channel k's statistics are over its count = n*h*w
 * values: mu = mean, var = biased variance (divided by count).
 *   y = gamma (x - mu) / sqrt(var + eps) + beta
 * Training (cuDNN forward training, mode SPATIAL; needs count > 1): mu, var of the batch;
 * save_mean = mu, save_inv_std = 1 / sqrt(var + eps) (for the backward); when the running
 * statistics are given (both, or both NULL) they are updated in place, with f = factor:
 *   running_mean = (1 - f) running_mean + f mu
 *   running_var  = (1 - f) running_var  + f var * count / (count - 1)    (unbiased)
 * (PyTorch's momentum rule with f = momentum; f = 1 / num_batches_tracked for its cumulative
 * average).  Inference (cuDNN forward inference): mu = running_mean, var = running_var;
 * save_mean / save_inv_std (both or neither) receive them for a backward.  eps >= 0. */
cydnnStatus_t cydnn_batch_norm_forward_training(cydnnContext *ctx, int n, int c, int h, int w,
                                                const float *x, const float *gamma, const float *beta,
                                                double factor, float *running_mean, float *running_var,
                                                double eps, float *y, float *save_mean, float *save_inv_std);
cydnnStatus_t cydnn_batch_norm_forward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                 const float *x, const float *gamma, const float *beta,
                                                 const float *running_mean, const float *running_var,
                                                 double eps, float *y, float *save_mean, float *save_inv_std);
/* Backward of a training forward (cuDNN, from save_mean / save_inv_std): dx through mu and
 * var; dgamma = sum(dy xhat), dbeta = sum(dy) per channel, xhat = (x - mu) save_inv_std. */
cydnnStatus_t cydnn_batch_norm_backward(cydnnContext *ctx, int n, int c, int h, int w, const float *x,
                                        const float *dy, const float *gamma, const float *save_mean,
                                        const float *save_inv_std, double eps, float *dx, float *dgamma,
                                        float *dbeta);
/* Backward of an inference forward (custom kernel, one block per channel): the statistics are
 * constants, dx = dy gamma save_inv_std; dgamma and dbeta as above. */
cydnnStatus_t cydnn_batch_norm_backward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                  const float *x, const float *dy, const float *gamma,
                                                  const float *save_mean, const float *save_inv_std,
                                                  float *dx, float *dgamma, float *dbeta);

/* ----------------------------------------------------------------- linear */
/* x (n, in), weight (out, in) as PyTorch, bias (out) or NULL, y (n, out):
 * y = x weight^T + bias.  cuBLASLt on row-major data, the bias in its epilogue.  Backward writes
 * dx (n, in), dweight (out, in), dbias (out); dx and dbias may be NULL (dweight runs on a second
 * stream beside dx, joined before the call returns).  _act: act 0 (none) or CYDNN_ACT_RELU (1)
 * applied in the same epilogue: y = max(x weight^T + bias, 0). */
cydnnStatus_t cydnn_linear_forward(cydnnContext *ctx, const float *x, const float *weight,
                                   const float *bias, float *y, int n, int in_features, int out_features);
cydnnStatus_t cydnn_linear_forward_act(cydnnContext *ctx, const float *x, const float *weight,
                                       const float *bias, float *y, int n, int in_features, int out_features,
                                       int act);
cydnnStatus_t cydnn_linear_backward(cydnnContext *ctx, const float *x, const float *weight,
                                    const float *dy, float *dx, float *dweight, float *dbias,
                                    int n, int in_features, int out_features);
/* The same, dx (when asked) by gemm_skinny.cu's tile dx_tile (-1: cuBLASLt) beside cuBLASLt's dweight. */
cydnnStatus_t cydnn_linear_backward_ex(cydnnContext *ctx, const float *x, const float *weight,
                                       const float *dy, float *dx, float *dweight, float *dbias,
                                       int n, int in_features, int out_features, int dx_tile);

/* ------------------------------------------------------------ losses, softmax */
/* x, y (n, c).  cuDNN softmax over each row, accurate mode; log=1 gives log_softmax. */
cydnnStatus_t cydnn_softmax_forward(cydnnContext *ctx, const float *x, float *y, int n, int c, int log);
/* One fused kernel: loss = mean_i(logsumexp(logits_i) - logits_i[label_i]) and
 * dlogits = (softmax(logits) - onehot(labels)) / n.  loss is one device float.
 * labels are int32 in [0, c); a label out of range makes its row's loss and
 * gradient NaN and is counted in *bad_labels (one device int32, may be NULL). */
cydnnStatus_t cydnn_softmax_cross_entropy(cydnnContext *ctx, const float *logits, const int32_t *labels,
                                          int n, int c, float *loss, float *dlogits, int32_t *bad_labels);

/* -------------------------------------------------------------- optimizers */
/* One fused kernel per parameter tensor, in place.
 * SGD as PyTorch: g = grad + weight_decay * p; with momentum: buf = first_step ? g
 * : momentum * buf + (1 - dampening) * g; g = nesterov ? g + momentum * buf : buf;
 * p -= lr * g.  momentum_buf may be NULL when momentum == 0. */
cydnnStatus_t cydnn_sgd_update(cydnnContext *ctx, float *param, const float *grad, float *momentum_buf,
                               size_t count, float lr, float momentum, float dampening,
                               float weight_decay, int nesterov, int first_step);
/* Adam (decoupled = 0: g += weight_decay * p) and AdamW (decoupled = 1:
 * p *= 1 - lr * weight_decay) as PyTorch; step counts from 1.  The betas are double
 * so that 1 - beta is formed before rounding to float, as numpy does. */
cydnnStatus_t cydnn_adam_update(cydnnContext *ctx, float *param, const float *grad, float *m, float *v,
                                size_t count, float lr, double beta1, double beta2, float eps,
                                float weight_decay, int decoupled, int step);

/* -------------------------------------------------------------------- data */
/* Builds a training batch from a dataset kept on the device.
 * images (n_images, h, w) uint8, labels (n_images) int32, indices (batch) int32
 * (each in [0, n_images), validated by the caller).  out_images (batch, 1, h +
 * 2 pad, w + 2 pad) float32: pixel / 255, shifted by (sy, sx) in [-max_shift,
 * max_shift] per image (zero fill), placed with `pad` zero pixels around, then
 * normalised (v - mean) / std.  The shift of batch row b comes from
 * r = splitmix64(seed ^ splitmix64(b)): sx = (r & 0xffffffff) % (2 max_shift + 1)
 * - max_shift, sy = (r >> 32) % (2 max_shift + 1) - max_shift.
 * out_labels (batch) int32 = labels[indices]; may be NULL with labels NULL. */
cydnnStatus_t cydnn_gather_batch(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                 int n_images, int h, int w, const int32_t *indices, int batch,
                                 float mean, float std, int pad, int max_shift, uint64_t seed,
                                 float *out_images, int32_t *out_labels);

/* The same for images (n_images, channels, h, w) uint8, channels in [1,
 * CYDNN_GATHER_MAX_CHANNELS]: out_images (batch, channels, h + 2 pad, w + 2 pad),
 * normalised per channel with mean[c], std[c] (HOST arrays of `channels` floats, each
 * std > 0, copied at the call).  With flip != 0, batch row b is mirrored left-right when
 * splitmix64(r) >> 63 is 1 (r as above; the shift uses the same r); the flip comes first,
 * then the shift: out(iy, ix) reads the flipped image at (iy - sy, ix - sx).  Shift and
 * zero padding together make the usual random crop of a padded image. */
#define CYDNN_GATHER_MAX_CHANNELS 64
cydnnStatus_t cydnn_gather_batch_chw(cydnnContext *ctx, const uint8_t *images, const int32_t *labels,
                                     int n_images, int channels, int h, int w, const int32_t *indices,
                                     int batch, const float *mean, const float *std, int pad,
                                     int max_shift, int flip, uint64_t seed, float *out_images,
                                     int32_t *out_labels);


/* ============================================================ the fast path
 * The reference path above is one call per op, each with its own checks.
 * The fast path (fused_lenet.cu, fused_lenet_train.cu, fastpath.cu) is built from the same
 * formulas for one model family, LeNet-5, and is checked against the
 * reference path by the tests:
 *   - one kernel runs the whole LeNet-5 forward (conv, bias, activation,
 *     pooling, the three fully-connected layers, softmax) with the
 *     activations in shared memory;
 *   - one training step is three kernels: gather + forward + loss + backward
 *     (per-block partial gradients), reduce + optimizer update of every
 *     parameter, and a one-warp bookkeeping kernel (loss, accuracy, counters);
 *   - CUDA-graph capture of any sequence of those launches, replayed later;
 *   - a numpy-in / numpy-out predictor: pinned staging, one copy up, one
 *     kernel, one copy down, a captured graph per small batch bucket.
 * "modern": 28x28 input, ReLU, max-pool; "classic": 32x32 (28 + pad 2), tanh,
 * average pool.  Layers: conv1 1->6 5x5, pool 2, conv2 6->16 5x5, pool 2,
 * fc1 (256 or 400)->120, fc2 120->84, fc3 84->num_classes. */
#define CYDNN_LENET_MAX_CLASSES 32
#define CYDNN_LENET_MAX_TRAIN_BATCH 1024
#define CYDNN_LENET_NUM_PARAMS 10   /* conv1.w, conv1.b, conv2.w, conv2.b, fc1.w, ..., fc3.b */

typedef struct {
    const float *p[CYDNN_LENET_NUM_PARAMS];   /* in the order above */
} cydnnLeNetWeights;

/* Inputs of the LeNet-5 kernels: raw 28x28 images, uint8 (pixel / 255) or float32 (as is),
 * padded by the kernel (classic: 2 pixels); or float32 at the network's own input size (classic
 * 32x32, modern 28x28), padding included, taken as they are (CYDNN_INPUT_F32_FULL). */
enum { CYDNN_INPUT_U8 = 0, CYDNN_INPUT_F32 = 1, CYDNN_INPUT_F32_FULL = 2 };

/* Number of floats of parameter i (0..9) of a LeNet-5; -1 for a bad i. */
long cydnn_lenet_param_size(int classic, int num_classes, int i);

/* The whole forward, device in, device out.  images (n, 28, 28): uint8
 * (pixel / 255) or float32 (taken as is), padded (classic: 2 pixels);
 * CYDNN_INPUT_F32_FULL: (n, 32, 32) classic / (n, 28, 28) modern float32, not
 * padded again; then normalised (v - mean) / std.  out (n, num_classes): logits, or
 * probabilities when softmax = 1.  n_dev: if not NULL, the image count is
 * read from this device int (at most n) -- what a captured graph replays. */
cydnnStatus_t cydnn_lenet_forward(cydnnContext *ctx, int classic, int num_classes,
                                  const cydnnLeNetWeights *w, const void *images, int input_kind,
                                  int n, const int *n_dev, float mean, float std, int softmax,
                                  float *out);

/* Device-side counters of a compiled training step (read once per epoch). */
typedef struct {
    long long global_step;   /* optimizer steps done (SGD's first step, Adam's t) */
    int step_in_epoch;       /* selects the batch, its shift seed and its lr */
    int correct;             /* training images classified right, this epoch */
    double loss_sum;         /* sum of the steps' mean losses, this epoch */
} cydnnLeNetCounters;

enum { CYDNN_OPT_SGD = 0, CYDNN_OPT_ADAM = 1, CYDNN_OPT_ADAMW = 2 };

typedef struct {
    int classic, num_classes, batch;
    /* data, on the device: the dataset, the epoch's order, one shift seed per step */
    const uint8_t *images;        /* (n_images, 28, 28) */
    const int32_t *labels;        /* (n_images) */
    int n_images;
    const int32_t *order;         /* (n_images): batch s row b is order[s * batch + b] */
    int order_stride;             /* the batch size of the full steps (s * order_stride) */
    const uint64_t *shift_seeds;  /* per step of the epoch; NULL: no shift */
    int max_shift;
    float mean, std;
    /* parameters, their gradients (written: the last step's), optimizer state */
    float *param[CYDNN_LENET_NUM_PARAMS];
    float *grad[CYDNN_LENET_NUM_PARAMS];
    float *state1[CYDNN_LENET_NUM_PARAMS];   /* SGD momentum buffer / Adam m (may be NULL for SGD without momentum) */
    float *state2[CYDNN_LENET_NUM_PARAMS];   /* Adam v */
    int optimizer;
    float momentum, dampening, weight_decay;
    int nesterov;
    double beta1, beta2;
    float eps;
    const float *lr_table;        /* lr of step s of the epoch (device) */
    cydnnLeNetCounters *counters; /* device */
    void *scratch;                /* cydnn_lenet_train_scratch_bytes(classic, num_classes, batch) */
} cydnnLeNetTrainStep;

size_t cydnn_lenet_train_scratch_bytes(int classic, int num_classes, int batch);
/* Enqueue one training step (three kernels); nothing is allocated, so it can be captured. */
cydnnStatus_t cydnn_lenet_train_step(cydnnContext *ctx, const cydnnLeNetTrainStep *s);

/* CUDA graphs of the context's stream.  Between begin and end only
 * capturable work may be enqueued (no allocation, no synchronisation);
 * end always ends the capture, and instantiates the graph when nothing
 * failed.  A failed capture leaves the stream usable. */
typedef struct cydnnGraph cydnnGraph;
cydnnStatus_t cydnn_graph_begin(cydnnContext *ctx);
cydnnStatus_t cydnn_graph_end(cydnnContext *ctx, int discard, cydnnGraph **graph);
cydnnStatus_t cydnn_graph_launch(cydnnContext *ctx, cydnnGraph *graph);
/* Number of kernel nodes in the graph. */
int cydnn_graph_kernel_count(const cydnnGraph *graph);
void cydnn_graph_destroy(cydnnGraph *graph);

/* numpy in, numpy out: host images (n, 28, 28) uint8 or float32 (or the
 * network's own size with CYDNN_INPUT_F32_FULL: classic (n, 32, 32)), host
 * probabilities (n, num_classes).  Small n: a captured graph per bucket of
 * sizes (copy up, forward, copy down); large n: chunks through two pinned
 * buffers so that the host copy of one chunk overlaps the GPU work of the
 * previous.  Waits for the result. */
typedef struct cydnnPredictor cydnnPredictor;
cydnnStatus_t cydnn_predictor_create(cydnnContext *ctx, int classic, int num_classes, float mean,
                                     float std, int use_graphs, cydnnPredictor **out);
cydnnStatus_t cydnn_predictor_run(cydnnPredictor *p, const cydnnLeNetWeights *w,
                                  const void *host_images, int input_kind, int n, float *host_probs);
/* Graphs built so far (for tests and the notebook). */
int cydnn_predictor_graph_count(const cydnnPredictor *p);
void cydnn_predictor_destroy(cydnnPredictor *p);


/* Fused MLP: y = L_k(relu(... relu(L_1(x)))) with L_i(v) = v W_i^T + b_i, in one
 * launch, activations in shared memory.  x (n, dims[0]), weights[i]
 * (dims[i+1], dims[i]) as PyTorch, biases[i] (dims[i+1]) or NULL, y (n,
 * dims[num_layers]).  ReLU between layers, none after the last.  At most
 * CYDNN_MLP_MAX_LAYERS layers of width at most CYDNN_MLP_MAX_WIDTH. */
#define CYDNN_MLP_MAX_LAYERS 8
#define CYDNN_MLP_MAX_WIDTH 1024
cydnnStatus_t cydnn_fused_mlp_forward(cydnnContext *ctx, const float *x, int n, int num_layers,
                                      const int *dims, const float *const *weights,
                                      const float *const *biases, float *y);

/* ============================================================= the compiler
 * Kernels the compiler (python/cydnn/compiler/) adds to the ops above when it
 * plans a whole step for any Sequential (compiled.cu).  act: 0 identity, 1 relu,
 * 2 tanh, 3 sigmoid, 4 leaky relu with `slope`. */
enum { CYDNN_ACT_NONE = 0, CYDNN_ACT_RELU = 1, CYDNN_ACT_TANH = 2, CYDNN_ACT_SIGMOID = 3, CYDNN_ACT_LEAKY = 4 };

/* x, y (n, channels, inner): y = act(x + bias[channel]); bias may be NULL; may run in place. */
cydnnStatus_t cydnn_bias_act_forward(cydnnContext *ctx, const float *x, const float *bias, float *y,
                                     int n, int channels, size_t inner, int act, float slope);
/* g = dy * act'(y) (act' from the output y); dx = g (may be NULL), dbias[c] = sum of g
 * over n and inner (may be NULL; one block per channel, fixed order). */
cydnnStatus_t cydnn_bias_act_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                      float *dbias, int n, int channels, size_t inner, int act, float slope);
/* Max pooling whose windows tile its input (kernel == stride, padding 0, h and w whole numbers of
 * windows), back-propagated together with the activation before it (compiled_act.cu): y, dx
 * (n, c, h, w) the pooling's input (the activation's output) and the gradient before the
 * activation, dy (n, c, h / kh, w / kw) the pooling's output gradient.  dx = g, where g is the
 * pooling's input gradient (first maximum of each window) times act'(y); dbias[c] = sum of g over
 * n, h, w (may be NULL).  g is bit for bit max_pool_backward followed by bias_act_backward. */
cydnnStatus_t cydnn_max_pool_act_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *y,
                                          const float *dy, float *dx, float *dbias, int act, float slope);

/* A training plan's head (compiled_head.cu): the last linear layer without activation and the softmax
 * cross-entropy, forward and backward.  x (n, k), w (c, k), bias (c) or NULL, labels (n) int32;
 * writes logits (n, c) = x w^T + bias, row_loss (n) (scratch), loss (one float, the mean),
 * g (n, c) = (softmax(logits) - onehot(labels)) / n, dbias (c) = the sum of g's rows (may be NULL),
 * dx (n, k) = g w (may be NULL), dw (c, k) = g^T x.  1 <= c <= 32.  A label out of
 * [0, c) makes its row's loss and gradient NaN (as cydnn_softmax_cross_entropy).  Deterministic. */
cydnnStatus_t cydnn_linear_xent(cydnnContext *ctx, const float *x, const float *w, const float *bias,
                                const int32_t *labels, int n, int k, int c, float *logits, float *row_loss,
                                float *loss, float *g, float *dbias, float *dx, float *dw);

/* Batch normalization in training with its activation (compiled_norm.cu), x, y (n, channels, inner):
 * y = act(gamma (x - mean) inv_std + beta) with the batch's mean and biased var per channel;
 * save_mean / save_inv_std = mean, 1 / sqrt(var + eps) (cuDNN's saved statistics); the running
 * statistics (both NULL: not updated) move by `factor` towards mean and the unbiased var.
 * Backward: g = dy * act'(y) (y may be NULL when act is 0), dgamma = sum g xhat, dbeta = sum g,
 * dx = gamma inv_std (g - (dbeta + xhat dgamma) / (n inner)) (dx may be NULL, or dy itself).
 * Fixed summation order: the same bits every run.  At most 2^32 values. */
cydnnStatus_t cydnn_bn_act_forward_train(cydnnContext *ctx, const float *x, const float *gamma, const float *beta,
                                         float *running_mean, float *running_var, double factor, double eps,
                                         float *y, float *save_mean, float *save_inv_std, int n, int channels,
                                         size_t inner, int act, float slope);
cydnnStatus_t cydnn_bn_act_backward(cydnnContext *ctx, const float *x, const float *y, const float *dy,
                                    const float *gamma, const float *save_mean, const float *save_inv_std,
                                    float *dx, float *dgamma, float *dbeta, int n, int channels, size_t inner,
                                    int act, float slope);

/* The step counters a compiled step keeps on the device (the LeNet step's layout). */
typedef cydnnLeNetCounters cydnnStepCounters;

/* Every parameter updated in one launch, over flat buffers of `count` floats:
 * param, grad, state1 (SGD momentum / Adam m), state2 (Adam v).  The step t
 * (from 1) is counters->global_step + 1 and the learning rate
 * lr_table[counters->step_in_epoch % lr_len], both read on the device, so a
 * replayed graph follows a schedule.  Formulas: cydnn_sgd_update / cydnn_adam_update
 * (SGD's first step, t = 1, sets the momentum buffer to g). */
typedef struct {
    float *param;
    const float *grad;
    float *state1, *state2;
    size_t count;
    int optimizer;                 /* CYDNN_OPT_SGD / _ADAM / _ADAMW */
    float momentum, dampening, weight_decay;
    int nesterov;
    double beta1, beta2;
    float eps;
    const float *lr_table;
    int lr_len;
    const cydnnStepCounters *counters;
} cydnnFlatUpdate;
cydnnStatus_t cydnn_flat_update(cydnnContext *ctx, const cydnnFlatUpdate *u);

/* After the update: counters->correct += rows whose argmax (first maximum) is
 * the label, loss_sum += *loss, step_in_epoch += 1, global_step += 1. */
cydnnStatus_t cydnn_step_bookkeeping(cydnnContext *ctx, const float *logits, const int32_t *labels, int n,
                                     int c, const float *loss, cydnnStepCounters *counters);

/* Convolution (the geometry of cydnn_conv_forward), bias (may be NULL) and activation in one direct
 * kernel, one thread per output element: for small problems, where cuDNN's kernels are slow. */
cydnnStatus_t cydnn_direct_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                        const float *w, const float *b, float *y, int act, float slope);

/* Convolution, bias (may be NULL) and activation as an implicit GEMM on the CUDA cores (conv_igemm.cu): a
 * block computes `rows` output pixels x `channels` output channels over `chunk` reductions at a time, the
 * reduction split over `splits` blocks where splits > 1 (their sums added by a second kernel, through the
 * context's workspace) (tile 0 .. count - 1, described by cydnn_igemm_conv_tile).  For c*kh*kw (forward) and
 * k*kh*kw (data gradient) up to 2304; the compiler times the tiles against cuDNN. */
int cydnn_igemm_conv_tile_count(void);
cydnnStatus_t cydnn_igemm_conv_tile(int tile, int *rows, int *channels, int *threads, int *chunk, int *splits);
cydnnStatus_t cydnn_igemm_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                       const float *w, const float *b, float *y, int act, float slope, int tile);

/* A product with few rows on the CUDA cores (gemm_skinny.cu): c (m x n) = act(a (m x k) . B + bias), B[r, j] =
 * w[j, r] (b_kn = 0: w (n, k), a linear layer's forward) or w[r, j] (b_kn = 1: w (k, n), its data gradient).  A
 * block computes `rows` x `cols` outputs over a share of the reduction; the `splits` blocks of a thread-block
 * cluster (compute capability 9.0) add their shares through distributed shared memory, in a fixed order.
 * act as cydnn_bias_act_forward's.  The compiler times the tiles against cuBLASLt. */
int cydnn_skinny_gemm_tile_count(void);
cydnnStatus_t cydnn_skinny_gemm_tile(int tile, int *rows, int *cols, int *threads, int *splits);
cydnnStatus_t cydnn_skinny_gemm(cydnnContext *ctx, const float *a, const float *w, const float *bias, float *c,
                                int m, int n, int k, int b_kn, int act, float slope, int tile);

/* Inference: a batch norm after a convolution / linear layer, folded into it.  w (out, per_out),
 * b (out) or NULL; s = gamma / sqrt(var + eps); w_out = w * s[o], b_out = (b - mean) * s + beta. */
cydnnStatus_t cydnn_fold_batch_norm(cydnnContext *ctx, const float *w, const float *b, const float *gamma,
                                    const float *beta, const float *mean, const float *var, float eps, int out,
                                    size_t per_out, float *w_out, float *b_out);

/* cydnn_dropout_forward with the seed splitmix64(seed ^ counters->global_step):
 * a new mask every replayed step. */
cydnnStatus_t cydnn_dropout_step(cydnnContext *ctx, const float *x, float *y, float *mask, size_t count,
                                 uint32_t threshold, float scale, uint64_t seed,
                                 const cydnnStepCounters *counters);

/* ======================================================= the fused network
 * A whole network's inference forward in one launch (fused_net.cu): the layers
 * of a table, one image's activations in shared memory, one thread-block
 * cluster of `cluster` (1, 2, 4, 8, 16) blocks per image.  Each layer reads the
 * previous one's output, (c, h, w) flattened, and ends with an epilogue: + bias
 * (if not NULL), then epi[0..num_epi) in order: CYDNN_NET_EPI_BN (eval-mode
 * batch norm: (v - mean) / sqrt(var + eps) * weight + bias, per channel) or
 * CYDNN_NET_EPI_ACT (act with slope).  Conv: weight (k, c, kh, kw); linear:
 * weight (k, c) with h = w = 1; pools: window kh x kw, stride, padding, max
 * ignoring padding and NaN, average counting padding; global average pool:
 * (c, h, w) -> c; epilogue: the epilogue alone.  tile: a convolution's work
 * per thread, 0: 1 channel x 1 pixel, 1: 1 x 4, 2: 4 x 1, 3: 4 x 4; 4, 5, 6: 4 x 1 shared by 4, 8,
 * 16 lanes, each taking every 4th, 8th, 16th input channel; 7: 4 x 4, a block's reduction split
 * between its threads (fused_net_wsplit.cuh).  A block stages the weights
 * of the output channels it computes in wcap floats of shared memory where they fit.
 * A linear layer's tile: 0, or 1 on the last layer only, a "tail": each block multiplies
 * its own share of the input and rank 0 adds the blocks' partial sums (a linear layer
 * right before it then keeps its outputs in its own block: no distributed stores and no
 * cluster barrier after it); the same values in another summation order
 * (fused_net_layers.cuh, linear_tail).  Inference only: the fused training step refuses it. */
#define CYDNN_NET_MAX_LAYERS 32
enum { CYDNN_NET_CONV = 0, CYDNN_NET_LINEAR = 1, CYDNN_NET_MAX_POOL = 2, CYDNN_NET_AVG_POOL = 3,
       CYDNN_NET_GLOBAL_AVG_POOL = 4, CYDNN_NET_EPILOGUE = 5 };
enum { CYDNN_NET_EPI_ACT = 0, CYDNN_NET_EPI_BN = 1 };
typedef struct {
    int op, tile;
    int pool;                      /* a convolution of tile 7: 0, or CYDNN_NET_MAX_POOL / _AVG_POOL, a 2x2
                                      stride-2 pooling of its epilogue's outputs folded in: it gives
                                      (k, oh / 2, ow / 2) */
    int c, h, w;                   /* input */
    int k, oh, ow;                 /* output channels (conv) / features (linear), output plane */
    int kh, kw, sh, sw, ph, pw;
    const float *weight, *bias;
    int num_epi, epi[3];
    int act;
    float slope;
    const float *bn_mean, *bn_var, *bn_weight, *bn_bias;
    float bn_eps;
} cydnnNetLayer;
typedef struct {
    int num_layers, softmax;       /* softmax over the last layer's outputs */
    long in_size, out_size;        /* per image */
    long wcap;                     /* floats of shared memory for a convolution's weights (0: none) */
    cydnnNetLayer layers[CYDNN_NET_MAX_LAYERS];
} cydnnNet;
/* Validates the table (shapes chain, windows fit, pointers present) and gives the
 * shared memory a block needs (two buffers of the widest activation). */
cydnnStatus_t cydnn_fused_net_check(const cydnnNet *net, size_t *smem_bytes);
/* y (n, out_size) = the network on x (n, in_size), device pointers, on the library's stream. */
cydnnStatus_t cydnn_fused_net_forward(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                      int cluster);

/* A fused-network kernel generated for one network and one cluster size (compiler/fused_net_gen.py:
 * NVRTC's cubin, `name` its kernel, with cydnn_fused_net_forward's kernel's parameters), loaded as a
 * library; cydnn_fused_net_launch runs it on the same table (its arrays, sizes and shared memory). */
typedef struct cydnnNetKernel cydnnNetKernel;
cydnnStatus_t cydnn_net_kernel_load(cydnnContext *ctx, const void *image, const char *name, int cluster,
                                    cydnnNetKernel **out);
void cydnn_net_kernel_destroy(cydnnNetKernel *k);
cydnnStatus_t cydnn_fused_net_launch(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                     int cluster, const cydnnNetKernel *kernel);

/* The fused training step (fused_train.cu): forward, softmax cross-entropy and backward of a batch on
 * the fused network's table (no batch norm; at most one activation a layer; softmax 0), one
 * thread-block cluster of `cluster` blocks per image with the image's activations in shared memory,
 * then the weight and bias gradients of the batch in a fixed summation order: two kernels.  The
 * optimizer update and the counters are the compiled step's (cydnn_flat_update, cydnn_step_bookkeeping).
 * cydnn_fused_train_check: the shared memory a block needs and the scratch bytes of one step. */
typedef struct {
    int batch;
    const float *x;                           /* (batch, in_size) */
    const int32_t *labels;                    /* (batch); a label out of range gives NaN (loss and gradients) */
    float *logits;                            /* (batch, out_size), written */
    float *loss;                              /* the batch's mean cross-entropy, written */
    float *grad_w[CYDNN_NET_MAX_LAYERS];      /* conv / linear layer l: dLoss/dweight, written */
    float *grad_b[CYDNN_NET_MAX_LAYERS];      /* dLoss/dbias, written (NULL exactly where the layer has no bias) */
    void *scratch;                            /* the check's scratch bytes (saved inputs, gradients, partial sums) */
} cydnnNetTrain;
cydnnStatus_t cydnn_fused_train_check(const cydnnNet *net, int batch, int cluster, size_t *smem_bytes,
                                      size_t *scratch_bytes);
cydnnStatus_t cydnn_fused_train_step(cydnnContext *ctx, const cydnnNet *net, const cydnnNetTrain *t, int cluster);

/* The resident fused network (fused_net_resident.cu): one-image calls from host memory served by a
 * kernel that stays on the GPU between calls (no launch, no stream synchronisation), returning
 * after idle_us microseconds without a request.  One runs at a time per process.
 * cydnn_resident_run: y (out_size floats, host) = the network on x (in_size floats, host); *served
 * is 1 when the resident kernel answered, 0 when the call was one ordinary launch on the library's
 * stream (work was queued there: its order is kept).  The table's arrays must outlive the object. */
typedef struct cydnnResident cydnnResident;
cydnnStatus_t cydnn_resident_create(cydnnContext *ctx, const cydnnNet *net, int cluster, long idle_us,
                                    cydnnResident **out);
cydnnStatus_t cydnn_resident_run(cydnnResident *r, const float *x, float *y, int *served);
cydnnStatus_t cydnn_resident_stop(cydnnResident *r);     /* the kernel returns now; waits for it */
int cydnn_resident_running(cydnnResident *r);            /* 1 while a kernel is launched and has not returned */
void cydnn_resident_destroy(cydnnResident *r);           /* stops it first */

#ifdef __cplusplus
}
#endif

#endif /* CYDNN_H */
