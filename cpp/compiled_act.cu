// compiled_act.cu -- the compiler's activation epilogues and their backward (python/cydnn/compiler/
// lower.py, passes.py), beside the other kernels it adds (compiled.cu, compiled_norm.cu):
//
//   bias_act_forward       y = act(x + bias[c])               replaces add-bias + activation
//   bias_act_backward      g = dy * act'(y); dbias[c] = sum g replaces activation backward + bias
//                          gradient (chunks of a channel in parallel, then their sums in order;
//                          without a bias, one element-wise pass)
//   max_pool_act_backward  the max pooling's backward and then bias_act_backward's, in one pass,
//                          where the pooling windows tile its input (kernel == stride, no padding,
//                          the plane a whole number of windows): a thread per window finds the
//                          window's first maximum and writes g = (its dy there, 0 elsewhere) * act'(y)
//                          to all of the window's inputs, and the chunk's sum of g for the bias.
//
// Activations (act): 0 identity, 1 relu, 2 tanh, 3 sigmoid, 4 leaky relu (slope).
// Each derivative is written in terms of the output y, as the per-op backward kernels:
//   relu' = (y > 0), tanh' = 1 - y^2, sigmoid' = y (1 - y), leaky' = y > 0 ? 1 : slope.
#include <cmath>
#include <cstdint>

#include "act_math.cuh"
#include "common.cuh"
#include "launch.cuh"
#include "pool_tiles.cuh"

namespace {

using cydnn::activate;
using cydnn::derivative;
using cydnn::fits_32;

// y[n, c, i] = act(x[n, c, i] + bias[c]); bias may be NULL.  May run in place.
template <typename I>
__global__ void bias_act_forward_kernel(const float *x, const float *bias, float *y, I total,
                                        I channels, I inner, int act, float slope) {
    cydnn::pdl_wait();
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float v = x[i];
        if (bias != nullptr) v += bias[(i / inner) % channels];
        y[i] = activate(v, act, slope);
    }
}

// dx = dy * act'(y) element by element: the activation backward when there is no bias to sum
// (a convolution without bias followed by batch norm, or a layer whose bias has no gradient).
template <typename I>
__global__ void act_backward_kernel(const float *y, const float *dy, float *dx, I total, int act,
                                    float slope) {
    cydnn::pdl_wait();
    const I stride = (I)gridDim.x * blockDim.x;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride)
        dx[i] = dy[i] * derivative(y[i], act, slope);
}

// g = dy * act'(y) for the elements of channel c (blockIdx.y) in chunk p (blockIdx.x) of
// kChunk elements, written to dx; the chunk's sum of g goes to partial[c * chunks + p]
// (or straight to dbias[c] when one chunk covers the channel).  Fixed reduction order in
// the block, and bias_sum_kernel adds a channel's chunks in a fixed order: the same bits every run.
// kChunk is small (4 values a thread; a 2x2 pooling window a thread) so that a step's layers fill the GPU: at
// 8,192 the CNN's first pooling backward ran 192 blocks of 8 windows a thread, its third 96 blocks, 11-20 us
// each in session 30's profile, several times their bytes' time.
constexpr int kReduceThreads = 256;
constexpr size_t kChunk = 1024;

// The block's threads' sums added in a fixed tree order (the same bits every run); thread 0 stores the total.
// Block-uniform: every thread of the block calls it.
__device__ __forceinline__ void store_block_sum(float sum, float *out) {
    __shared__ float sums[kReduceThreads];
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = sums[0];
}

template <typename I>
__global__ void act_backward_partial_kernel(const float *y, const float *dy, float *dx, float *partial,
                                            I channels, I inner, I per_channel, int chunks,
                                            int act, float slope) {
    cydnn::pdl_wait();
    const I c = blockIdx.y;
    const I begin = (I)blockIdx.x * (I)kChunk;
    const I end = begin + (I)kChunk < per_channel ? begin + (I)kChunk : per_channel;
    float sum = 0.0f;
    for (I k = begin + threadIdx.x; k < end; k += blockDim.x) {
        const I row = k / inner, col = k % inner;
        const I i = (row * channels + c) * inner + col;
        const float g = dy[i] * derivative(y[i], act, slope);
        if (dx != nullptr) dx[i] = g;
        sum += g;
    }
    if (partial != nullptr) store_block_sum(sum, partial + (size_t)c * chunks + blockIdx.x);
}

// A warp a channel: lane l adds chunks l, l + 32, ... in order, then the lanes' sums in a fixed shuffle tree (the
// same bits every run).  The warp leaves whole (c is the same for its 32 lanes).
constexpr int kSumWarpsPerBlock = kReduceThreads / 32;
__global__ void bias_sum_kernel(const float *partial, float *dbias, int channels, int chunks) {
    cydnn::pdl_wait();
    const int c = (int)((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = (int)(threadIdx.x % 32);
    if (c >= channels) return;
    float total = 0.0f;
    for (int p = lane; p < chunks; p += 32) total += partial[(size_t)c * chunks + p];
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) dbias[c] = total;
}

// max_pool_act_backward: channel c (blockIdx.y), chunk p (blockIdx.x) of kChunk / (kh * kw) windows of
// the channel's (n, oy, ox) windows.  dy is the pooling's output gradient (n, c, oh, ow); y the pooling's
// input, which is the activation's output (n, c, oh * kh, ow * kw); dx its gradient before the activation.
// The same first-maximum rule as max_pool_backward_kernel (strictly greater from -inf, row-major scan;
// NaN never wins) and the same products as act_backward_partial_kernel: g is bit for bit the two
// unfused passes' (each input lies in one window); the bias sums add in another order.
template <typename I>
__global__ void max_pool_act_backward_kernel(const float *y, const float *dy, float *dx, float *partial,
                                             I channels, int oh, int ow, int kh, int kw, I windows,
                                             I per_block, int chunks, int act, float slope, int vec2) {
    cydnn::pdl_wait();
    const I c = blockIdx.y;
    const int h = oh * kh, w = ow * kw;
    const I plane_windows = (I)oh * (I)ow;
    const I begin = (I)blockIdx.x * per_block;
    const I end = begin + per_block < windows ? begin + per_block : windows;
    float sum = 0.0f;
    for (I k = begin + threadIdx.x; k < end; k += blockDim.x) {
        const I img = k / plane_windows, r = k - img * plane_windows;
        const int oy = (int)(r / (I)ow), ox = (int)(r - (I)oy * (I)ow);
        const I plane = img * channels + c;
        const float *yp = y + plane * (I)h * (I)w;
        float *dxp = dx + plane * (I)h * (I)w;
        const int y0 = oy * kh, x0 = ox * kw;
        if (vec2) {                       // a 2x2 window as two float2 (x0 even, the rows 8-byte aligned)
            const I i0 = (I)y0 * (I)w + (I)x0, i1 = i0 + (I)w;
            const float2 a = *reinterpret_cast<const float2 *>(yp + i0), b = *reinterpret_cast<const float2 *>(yp + i1);
            float best = -INFINITY;
            int arg = 0;
            if (a.x > best) { best = a.x; arg = 0; }
            if (a.y > best) { best = a.y; arg = 1; }
            if (b.x > best) { best = b.x; arg = 2; }
            if (b.y > best) arg = 3;
            const float d = dy[plane * plane_windows + r];
            // the general path's arithmetic: (0 + d or 0) * act'(y), summed in row-major order
            const float2 ga = make_float2((arg == 0 ? 0.0f + d : 0.0f) * derivative(a.x, act, slope),
                                          (arg == 1 ? 0.0f + d : 0.0f) * derivative(a.y, act, slope));
            const float2 gb = make_float2((arg == 2 ? 0.0f + d : 0.0f) * derivative(b.x, act, slope),
                                          (arg == 3 ? 0.0f + d : 0.0f) * derivative(b.y, act, slope));
            *reinterpret_cast<float2 *>(dxp + i0) = ga;
            *reinterpret_cast<float2 *>(dxp + i1) = gb;
            sum += ga.x;
            sum += ga.y;
            sum += gb.x;
            sum += gb.y;
            continue;
        }
        float best = -INFINITY;
        int by = y0, bx = x0;
        for (int yy = y0; yy < y0 + kh; ++yy)
            for (int xx = x0; xx < x0 + kw; ++xx) {
                const float v = yp[(I)yy * (I)w + (I)xx];
                if (v > best) {
                    best = v;
                    by = yy;
                    bx = xx;
                }
            }
        const float d = dy[plane * plane_windows + r];
        for (int yy = y0; yy < y0 + kh; ++yy)
            for (int xx = x0; xx < x0 + kw; ++xx) {
                const I i = (I)yy * (I)w + (I)xx;
                float grad = 0.0f;
                if (yy == by && xx == bx) grad += d;
                const float g = grad * derivative(yp[i], act, slope);
                dxp[i] = g;
                sum += g;
            }
    }
    if (partial != nullptr) store_block_sum(sum, partial + (size_t)c * chunks + blockIdx.x);
}

// A kernel that leaves each block's sum in partial[c * chunks + p]: where a channel spans several
// chunks the sums go to pool scratch and bias_sum_kernel adds each channel's in order into dbias; with
// one chunk (or no dbias) the kernel writes dbias (or nothing) itself.  launch(partial) enqueues it.
template <class Launch>
cydnnStatus_t with_channel_sums(cydnnContext *ctx, float *dbias, int channels, int chunks, const char *op,
                                const char *kernels, Launch launch) {
    float *partial = dbias;
    void *scratch = nullptr;
    if (dbias != nullptr && chunks > 1) {
        CYDNN_TRY(cydnn::pool_alloc(ctx, sizeof(float) * (size_t)channels * chunks, &scratch));
        partial = static_cast<float *>(scratch);
    }
    launch(partial);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && scratch != nullptr) {
        CYDNN_LAUNCH(bias_sum_kernel, (channels + kSumWarpsPerBlock - 1) / kSumWarpsPerBlock, kReduceThreads, 0,
                     ctx->stream, partial, dbias, channels, chunks);
        e = cudaGetLastError();
    }
    if (scratch != nullptr) cydnn::pool_free(ctx, scratch);   // stream order (or the graph) keeps it safe
    if (e != cudaSuccess) return cydnn::cuda_failure(e, op, kernels);
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

cydnnStatus_t cydnn_bias_act_forward(cydnnContext *ctx, const float *x, const float *bias, float *y,
                                     int n, int channels, size_t inner, int act, float slope) {
    const char *op = "bias_act_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr, "x or y is NULL");
    CYDNN_REQUIRE(op, n >= 1 && channels >= 1 && inner >= 1, "sizes must be >= 1 (n=%d, channels=%d, inner=%zu)",
                  n, channels, inner);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    const size_t total = (size_t)n * channels * inner;
    if (fits_32(total))
        CYDNN_LAUNCH(bias_act_forward_kernel<unsigned>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, bias, y, (unsigned)total, (unsigned)channels, (unsigned)inner, act, slope);
    else
        CYDNN_LAUNCH(bias_act_forward_kernel<size_t>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, bias, y, total, (size_t)channels, inner, act, slope);
    CYDNN_LAUNCH_CHECK(op, "bias_act_forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_bias_act_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                      float *dbias, int n, int channels, size_t inner, int act, float slope) {
    const char *op = "bias_act_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, y != nullptr && dy != nullptr, "y or dy is NULL");
    CYDNN_REQUIRE(op, dx != nullptr || dbias != nullptr, "nothing to write (dx and dbias are NULL)");
    CYDNN_REQUIRE(op, n >= 1 && channels >= 1 && inner >= 1, "sizes must be >= 1 (n=%d, channels=%d, inner=%zu)",
                  n, channels, inner);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    const size_t per_channel = (size_t)n * inner;
    const int chunks = (int)((per_channel + kChunk - 1) / kChunk);
    CYDNN_REQUIRE(op, channels <= 65535, "at most 65535 channels, got %d", channels);
    const size_t total = per_channel * channels;
    if (dbias == nullptr) {                       // no sums: one flat element-wise pass
        if (fits_32(total))
            CYDNN_LAUNCH(act_backward_kernel<unsigned>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
                y, dy, dx, (unsigned)total, act, slope);
        else
            CYDNN_LAUNCH(act_backward_kernel<size_t>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
                y, dy, dx, total, act, slope);
        CYDNN_LAUNCH_CHECK(op, "act_backward_kernel");
        return CYDNN_STATUS_SUCCESS;
    }
    return with_channel_sums(ctx, dbias, channels, chunks, op, "launch of act_backward_partial_kernel / bias_sum_kernel",
                             [&](float *partial) {
        if (fits_32(total))
            CYDNN_LAUNCH(act_backward_partial_kernel<unsigned>, dim3(chunks, channels), kReduceThreads, 0, ctx->stream,
                y, dy, dx, partial, (unsigned)channels, (unsigned)inner, (unsigned)per_channel, chunks, act, slope);
        else
            CYDNN_LAUNCH(act_backward_partial_kernel<size_t>, dim3(chunks, channels), kReduceThreads, 0, ctx->stream,
                y, dy, dx, partial, (size_t)channels, inner, per_channel, chunks, act, slope);
    });
}

cydnnStatus_t cydnn_max_pool_act_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *y,
                                          const float *dy, float *dx, float *dbias, int act, float slope) {
    const char *op = "max_pool_act_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, g != nullptr, "geometry is NULL");
    CYDNN_REQUIRE(op, y != nullptr && dy != nullptr && dx != nullptr, "y, dy or dx is NULL");
    CYDNN_REQUIRE(op, g->n >= 1 && g->c >= 1 && g->kh >= 1 && g->kw >= 1,
                  "sizes must be >= 1 (n=%d, c=%d, kh=%d, kw=%d)", g->n, g->c, g->kh, g->kw);
    CYDNN_TRY(cydnn::check_pool_tiles(op, g));
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    CYDNN_REQUIRE(op, g->c <= 65535, "at most 65535 channels, got %d", g->c);
    const int oh = g->h / g->kh, ow = g->w / g->kw;
    const size_t windows = (size_t)g->n * oh * ow;                 // of one channel
    const size_t per_block = kChunk / ((size_t)g->kh * g->kw) > 0 ? kChunk / ((size_t)g->kh * g->kw) : 1;
    const int chunks = (int)((windows + per_block - 1) / per_block);
    const dim3 grid((unsigned)chunks, (unsigned)g->c);
    // 2x2 windows as float2: every row starts 8-byte aligned when the pointers are (w is even)
    const int vec2 = g->kh == 2 && g->kw == 2 && reinterpret_cast<uintptr_t>(y) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(dx) % 8 == 0;
    return with_channel_sums(ctx, dbias, g->c, chunks, op, "launch of max_pool_act_backward_kernel / bias_sum_kernel",
                             [&](float *partial) {
        if (fits_32((size_t)g->n * g->c * g->h * g->w))
            CYDNN_LAUNCH(max_pool_act_backward_kernel<unsigned>, grid, kReduceThreads, 0, ctx->stream,
                y, dy, dx, partial, (unsigned)g->c, oh, ow, g->kh, g->kw, (unsigned)windows, (unsigned)per_block,
                chunks, act, slope, vec2);
        else
            CYDNN_LAUNCH(max_pool_act_backward_kernel<size_t>, grid, kReduceThreads, 0, ctx->stream,
                y, dy, dx, partial, (size_t)g->c, oh, ow, g->kh, g->kw, windows, per_block, chunks, act, slope, vec2);
    });
}
