// compiled_norm.cu -- batch normalization in training with its activation, for compiled steps.
//
// The reference path (batchnorm.cu) calls cuDNN's batch-norm training forward and backward, and
// the compiler used to add an activation pass on each side.  Profiled on the H100 (a SmallCNN-like
// network, batch 64, tools/profile_step.py), cuDNN's kernels took 32 us forward and 57 us backward
// on a 32-channel 28x28 layer: 6.4 MB, which the memory moves in ~2 us a pass.  Here the same
// maths in passes that read each tensor as few times as it must, the activation folded in:
//
//   forward (training), per channel c over the M = n * inner values x of the channel:
//     1. partial shifted sums, chunk by chunk: s1 = sum (x - K), s2 = sum (x - K)^2 with K the
//        channel's first value (shifting keeps var = E[(x-K)^2] - E[x-K]^2 accurate when the
//        mean is far from 0);
//     2. per channel, the chunks added in order in double: mean, biased var, inv_std =
//        1 / sqrt(var + eps); running_mean += f (mean - running_mean), running_var likewise with
//        the unbiased var * M / (M - 1) (PyTorch's momentum rule, as batchnorm.cu's header says of
//        cuDNN; f = momentum);
//     3. y = act(gamma (x - mean) inv_std + beta), element-wise.
//     Steps 2 and 3 are one kernel when the statistics of every channel fit a block's shared memory
//     (at most kInBlockChannels): each block of the element-wise pass adds the partial sums itself,
//     in the same order (so every block computes the same bits), and block 0 writes the saved and
//     running statistics.  A kernel boundary costs ~1.5-2 us in a graph; at batch 64 that was most of
//     what a separate finalisation kernel cost.  Wider layers get the separate kernel.
//   backward, with g = dy * act'(y) (act' from the output y) and xhat = (x - mean) inv_std:
//     1. partial sums of g and g xhat, chunk by chunk;
//     2. per channel, in order: dbeta = sum g, dgamma = sum g xhat;
//     3. dx = gamma inv_std (g - (dbeta + xhat dgamma) / M), element-wise (when dx is NULL -- the
//        network's first layer needs no input gradient -- one block that only writes dgamma, dbeta).
//        dx may be dy (same element read before it is written).  Steps 2 and 3 are one kernel as in
//        the forward.
// Every sum has a fixed order (a block's tree, then the chunks in order): the same bits every run.
// The saved statistics are cuDNN's (mean and 1 / sqrt(var + eps)), so either backward can follow
// either forward.
#include <cmath>

#include "act_math.cuh"
#include "common.cuh"

namespace {

using cydnn::activate;
using cydnn::derivative;
using cydnn::fits_32;

constexpr int kBlock = 256;         // threads of the reduction blocks
constexpr unsigned kChunk = 8192;      // values of one channel per block in the partial sums
constexpr int kInBlockChannels = 4096; // per-channel pairs a block keeps in shared memory (32 KB)
constexpr unsigned kMaxGrid = 1024;    // element-wise grids: enough to fill the GPU, few stats recomputations

// (a, b) summed over the block in a fixed order; the result in thread 0.
__device__ float2 block_sum2(float a, float b) {
    __shared__ float2 sh[kBlock];
    sh[threadIdx.x] = make_float2(a, b);
    __syncthreads();
    for (int half = kBlock / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) {
            sh[threadIdx.x].x += sh[threadIdx.x + half].x;
            sh[threadIdx.x].y += sh[threadIdx.x + half].y;
        }
        __syncthreads();
    }
    return sh[0];
}

// Element k of channel c's M values (k over n, then inner) -> index in the (n, channels, inner) tensor.
template <typename I>
__device__ __forceinline__ I channel_index(I k, I c, I channels, I inner) {
    return ((k / inner) * channels + c) * inner + k % inner;
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    bn_stats_partial_kernel(const float *x, float2 *partial, I channels, I inner, I per_channel, int chunks) {
    const I c = blockIdx.y;
    const I begin = (I)blockIdx.x * kChunk;
    const I end = begin + kChunk < per_channel ? begin + kChunk : per_channel;
    const float shift = x[c * inner];
    float s1 = 0.0f, s2 = 0.0f;
    for (I k = begin + threadIdx.x; k < end; k += kBlock) {
        const float d = x[channel_index(k, c, channels, inner)] - shift;
        s1 += d;
        s2 += d * d;
    }
    const float2 s = block_sum2(s1, s2);
    if (threadIdx.x == 0) partial[(size_t)c * chunks + blockIdx.x] = s;
}

// Channel c's statistics from its chunks' partial sums, added in order in double: (mean, inv_std);
// block 0 (or the finalize kernel) also writes the saved and running statistics.
__device__ float2 channel_stats(const float *x, const float2 *partial, int c, size_t inner, int chunks, double count,
                                double factor, double eps, bool write, float *save_mean, float *save_inv_std,
                                float *running_mean, float *running_var) {
    double s1 = 0.0, s2 = 0.0;
    for (int p = 0; p < chunks; ++p) {
        s1 += partial[(size_t)c * chunks + p].x;
        s2 += partial[(size_t)c * chunks + p].y;
    }
    const double m = s1 / count;
    const double var = fmax(s2 / count - m * m, 0.0);
    const double mean = (double)x[(size_t)c * inner] + m;
    const float2 out = make_float2((float)mean, (float)(1.0 / sqrt(var + eps)));
    if (write) {
        save_mean[c] = out.x;
        save_inv_std[c] = out.y;
        if (running_mean != nullptr) {
            const double unbiased = count > 1.0 ? var * count / (count - 1.0) : var;
            running_mean[c] = (float)((1.0 - factor) * running_mean[c] + factor * mean);
            running_var[c] = (float)((1.0 - factor) * running_var[c] + factor * unbiased);
        }
    }
    return out;
}

// Channel c's (dgamma, dbeta) from the chunks' partial sums, in order, in double.
__device__ float2 channel_grads(const float2 *partial, int c, int chunks) {
    double s1 = 0.0, s2 = 0.0;
    for (int p = 0; p < chunks; ++p) {
        s1 += partial[(size_t)c * chunks + p].x;
        s2 += partial[(size_t)c * chunks + p].y;
    }
    return make_float2((float)s2, (float)s1);
}

// Wide layers (more than kInBlockChannels channels): the statistics in a kernel of their own.
__global__ void bn_stats_finalize_kernel(const float *x, const float2 *partial, int channels, size_t inner,
                                         int chunks, double count, double factor, double eps, float *save_mean,
                                         float *save_inv_std, float *running_mean, float *running_var) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels)
        channel_stats(x, partial, c, inner, chunks, count, factor, eps, true, save_mean, save_inv_std, running_mean,
                      running_var);
}

// y = act(gamma (x - mean) inv_std + beta).  With `partial`, every block first computes the statistics
// of all channels into shared memory (block 0 writing them out); without, it reads save_mean/_inv_std.
template <typename I>
__global__ void bn_apply_kernel(const float *x, float *y, I total, I channels, I inner, const float *gamma,
                                const float *beta, const float2 *partial, int chunks, double count, double factor,
                                double eps, float *save_mean, float *save_inv_std, float *running_mean,
                                float *running_var, int act, float slope) {
    extern __shared__ float2 stats[];
    if (partial != nullptr) {
        for (int c = threadIdx.x; c < (int)channels; c += blockDim.x)
            stats[c] = channel_stats(x, partial, c, inner, chunks, count, factor, eps, blockIdx.x == 0, save_mean,
                                     save_inv_std, running_mean, running_var);
        __syncthreads();
    }
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const I c = (i / inner) % channels;
        const float2 st = partial != nullptr ? stats[c] : make_float2(save_mean[c], save_inv_std[c]);
        y[i] = activate(gamma[c] * ((x[i] - st.x) * st.y) + beta[c], act, slope);
    }
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    bn_grad_partial_kernel(const float *x, const float *y, const float *dy, const float *mean, const float *inv_std,
                        float2 *partial, I channels, I inner, I per_channel, int chunks, int act, float slope) {
    const I c = blockIdx.y;
    const I begin = (I)blockIdx.x * kChunk;
    const I end = begin + kChunk < per_channel ? begin + kChunk : per_channel;
    const float mu = mean[c], is = inv_std[c];
    float s1 = 0.0f, s2 = 0.0f;
    for (I k = begin + threadIdx.x; k < end; k += kBlock) {
        const I i = channel_index(k, c, channels, inner);
        const float g = act ? dy[i] * derivative(y[i], act, slope) : dy[i];
        s1 += g;
        s2 += g * ((x[i] - mu) * is);
    }
    const float2 s = block_sum2(s1, s2);
    if (threadIdx.x == 0) partial[(size_t)c * chunks + blockIdx.x] = s;
}

__global__ void bn_grad_finalize_kernel(const float2 *partial, int channels, int chunks, float *dgamma, float *dbeta) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float2 g = channel_grads(partial, c, chunks);
    dgamma[c] = g.x;
    dbeta[c] = g.y;
}

// dx = gamma inv_std (g - (dbeta + xhat dgamma) / M).  With `partial`, every block first adds the
// channels' (dgamma, dbeta) into shared memory (block 0 writing them out); dx may then be NULL
// (a grid of one block that writes dgamma and dbeta only).
template <typename I>
__global__ void bn_dx_kernel(const float *x, const float *y, const float *dy, float *dx, I total, I channels, I inner,
                             const float *gamma, const float *mean, const float *inv_std, const float2 *partial,
                             int chunks, float *dgamma, float *dbeta, float inv_count, int act, float slope) {
    extern __shared__ float2 grads[];
    if (partial != nullptr) {
        for (int c = threadIdx.x; c < (int)channels; c += blockDim.x) {
            grads[c] = channel_grads(partial, c, chunks);
            if (blockIdx.x == 0) {
                dgamma[c] = grads[c].x;
                dbeta[c] = grads[c].y;
            }
        }
        __syncthreads();
    }
    if (dx == nullptr) return;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const I c = (i / inner) % channels;
        const float2 gr = partial != nullptr ? grads[c] : make_float2(dgamma[c], dbeta[c]);
        const float g = act ? dy[i] * derivative(y[i], act, slope) : dy[i];
        const float xhat = (x[i] - mean[c]) * inv_std[c];
        dx[i] = gamma[c] * inv_std[c] * (g - (gr.y + xhat * gr.x) * inv_count);
    }
}

cydnnStatus_t check_sizes(const char *op, int n, int channels, size_t inner, int act) {
    CYDNN_REQUIRE(op, n >= 1 && channels >= 1 && inner >= 1, "sizes must be >= 1 (n=%d, channels=%d, inner=%zu)",
                  n, channels, inner);
    CYDNN_REQUIRE(op, channels <= 65535, "at most 65535 channels, got %d", channels);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    CYDNN_REQUIRE(op, fits_32((size_t)n * channels * inner), "%d x %d x %zu values: more than 2^32", n, channels,
                  inner);
    return CYDNN_STATUS_SUCCESS;
}

int chunks_of(int n, size_t inner) { return (int)(((size_t)n * inner + kChunk - 1) / kChunk); }

unsigned grid_for(size_t total) {
    const unsigned b = cydnn::blocks_for(total);
    return b < kMaxGrid ? b : kMaxGrid;
}

}  // namespace

cydnnStatus_t cydnn_bn_act_forward_train(cydnnContext *ctx, const float *x, const float *gamma, const float *beta,
                                         float *running_mean, float *running_var, double factor, double eps,
                                         float *y, float *save_mean, float *save_inv_std, int n, int channels,
                                         size_t inner, int act, float slope) {
    const char *op = "bn_act_forward_train";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_TRY(check_sizes(op, n, channels, inner, act));
    CYDNN_REQUIRE(op, x && gamma && beta && y && save_mean && save_inv_std, "a pointer is NULL");
    CYDNN_REQUIRE(op, (running_mean == nullptr) == (running_var == nullptr),
                  "running_mean and running_var must both be given or both be NULL");
    CYDNN_REQUIRE(op, factor >= 0.0 && factor <= 1.0 && eps >= 0.0, "factor must be in [0, 1] and eps >= 0, got %g, %g",
                  factor, eps);
    const unsigned per_channel = (unsigned)((size_t)n * inner), total = per_channel * (unsigned)channels;
    const int chunks = chunks_of(n, inner);
    void *scratch = nullptr;
    CYDNN_TRY(cydnn::pool_alloc(ctx, sizeof(float2) * (size_t)channels * chunks, &scratch));
    float2 *partial = static_cast<float2 *>(scratch);
    bn_stats_partial_kernel<unsigned><<<dim3(chunks, channels), kBlock, 0, ctx->stream>>>(
        x, partial, (unsigned)channels, (unsigned)inner, per_channel, chunks);
    cudaError_t e = cudaGetLastError();
    const bool in_block = channels <= kInBlockChannels;
    if (e == cudaSuccess && !in_block) {
        bn_stats_finalize_kernel<<<(channels + kBlock - 1) / kBlock, kBlock, 0, ctx->stream>>>(
            x, partial, channels, inner, chunks, (double)per_channel, factor, eps, save_mean, save_inv_std,
            running_mean, running_var);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        bn_apply_kernel<unsigned><<<grid_for(total), cydnn::kThreads, in_block ? sizeof(float2) * channels : 0,
                                    ctx->stream>>>(
            x, y, total, (unsigned)channels, (unsigned)inner, gamma, beta, in_block ? partial : nullptr, chunks,
            (double)per_channel, factor, eps, save_mean, save_inv_std, running_mean, running_var, act, slope);
        e = cudaGetLastError();
    }
    cydnn::pool_free(ctx, scratch);     // stream order (or the graph) keeps it safe
    if (e != cudaSuccess)
        return cydnn::cuda_failure(e, op, "launch of bn_stats_partial_kernel / bn_stats_finalize_kernel / bn_apply_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_bn_act_backward(cydnnContext *ctx, const float *x, const float *y, const float *dy,
                                    const float *gamma, const float *save_mean, const float *save_inv_std,
                                    float *dx, float *dgamma, float *dbeta, int n, int channels, size_t inner,
                                    int act, float slope) {
    const char *op = "bn_act_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_TRY(check_sizes(op, n, channels, inner, act));
    CYDNN_REQUIRE(op, x && dy && gamma && save_mean && save_inv_std && dgamma && dbeta, "a pointer is NULL");
    CYDNN_REQUIRE(op, act == 0 || y != nullptr, "y is NULL (the activation's derivative needs it)");
    const unsigned per_channel = (unsigned)((size_t)n * inner), total = per_channel * (unsigned)channels;
    const int chunks = chunks_of(n, inner);
    void *scratch = nullptr;
    CYDNN_TRY(cydnn::pool_alloc(ctx, sizeof(float2) * (size_t)channels * chunks, &scratch));
    float2 *partial = static_cast<float2 *>(scratch);
    bn_grad_partial_kernel<unsigned><<<dim3(chunks, channels), kBlock, 0, ctx->stream>>>(
        x, y, dy, save_mean, save_inv_std, partial, (unsigned)channels, (unsigned)inner, per_channel, chunks, act,
        slope);
    cudaError_t e = cudaGetLastError();
    const bool in_block = channels <= kInBlockChannels;
    if (e == cudaSuccess && !in_block) {
        bn_grad_finalize_kernel<<<(channels + kBlock - 1) / kBlock, kBlock, 0, ctx->stream>>>(
            partial, channels, chunks, dgamma, dbeta);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess && (dx != nullptr || in_block)) {
        bn_dx_kernel<unsigned><<<dx != nullptr ? grid_for(total) : 1, cydnn::kThreads,
                                 in_block ? sizeof(float2) * channels : 0, ctx->stream>>>(
            x, y, dy, dx, total, (unsigned)channels, (unsigned)inner, gamma, save_mean, save_inv_std,
            in_block ? partial : nullptr, chunks, dgamma, dbeta, 1.0f / (float)per_channel, act, slope);
        e = cudaGetLastError();
    }
    cydnn::pool_free(ctx, scratch);
    if (e != cudaSuccess)
        return cydnn::cuda_failure(e, op, "launch of bn_grad_partial_kernel / bn_grad_finalize_kernel / bn_dx_kernel");
    return CYDNN_STATUS_SUCCESS;
}
