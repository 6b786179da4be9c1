// fused_train_weights.cuh -- the fused training step's second kernel (fused_train.cu launches it): the
// batch's weight and bias gradients from what the train kernel left in L2, in a fixed summation order,
// and the batch's mean loss (block 0).
#pragma once

#include "fused_train_args.cuh"

namespace {

// ------------------------------------------------------------ the weight kernel
// The block's sums of v[0..N) (each: warp shuffles, then the warps in order) into out (shared memory).
// red: (blockDim / 32) * N floats.
template <int N>
__device__ void block_sums(const float (&v)[N], float *red, float *out) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = v[i];
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) red[warp * N + i] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w) s += red[w * N + i];
        out[i] = s;
    }
    __syncthreads();
}

// A convolution's work item (KB output channels k0 = kg * KB.., input channel c), chunk `chunk` of the
// batch's images: for each of its channels the sums over (image, output position) of d * x for the
// KS * KS taps, and of d (the bias: the item with c == 0 writes it), into res[b * (T + 1) + tap].
// A thread owns output positions (p0, p0 + P, ...) and every S-th image of the chunk: a position's taps,
// their bounds and their offsets are worked out once and serve every image (the loop over images is KB
// loads of d, KS * KS loads of x, each serving the KB channels' multiply-adds).  The mapping is fixed: the
// same sums every run, each channel's the same whatever KB is.
template <int KS, int KB>
__device__ void conv_weight_sums(const WLayer &W, int batch, const float *x, long item, int chunk, float *red,
                                 float *res) {
    constexpr int T = KS * KS;
    const int kg = (int)(item / W.c), c = (int)(item - (long)kg * W.c);
    const int k0 = kg * KB;
    const int plane = W.oh * W.ow;
    const int per = (batch + W.chunks - 1) / W.chunks;
    const int n0 = per * chunk, n1 = n0 + per < batch ? n0 + per : batch;
    const int P = plane < (int)blockDim.x ? plane : (int)blockDim.x;
    const int S = (int)blockDim.x / P;
    float acc[KB * (T + 1)];
#pragma unroll
    for (int i = 0; i < KB * (T + 1); ++i) acc[i] = 0.0f;
    if ((int)threadIdx.x < P * S) {
        const int s = (int)threadIdx.x / P;
        for (int p = (int)threadIdx.x % P; p < plane; p += P) {
            const int oy = p / W.ow, ox = p - (p / W.ow) * W.ow;
            const int iy0 = oy * W.sh - W.ph, ix0 = ox * W.sw - W.pw;
            unsigned long long valid = 0;            // tap ky * KS + kx inside the plane
#pragma unroll
            for (int ky = 0; ky < KS; ++ky)
#pragma unroll
                for (int kx = 0; kx < KS; ++kx)
                    if (iy0 + ky >= 0 && iy0 + ky < W.h && ix0 + kx >= 0 && ix0 + kx < W.w)
                        valid |= 1ull << (ky * KS + kx);
            const long base = (long)c * W.h * W.w + (long)iy0 * W.w + ix0;   // tap (0, 0), maybe outside
            const float *dp = W.d + (long)k0 * plane + p;
            for (int n = n0 + s; n < n1; n += S) {
                float dy[KB];
#pragma unroll
                for (int b = 0; b < KB; ++b) dy[b] = k0 + b < W.k ? dp[(long)n * W.out_stride + b * plane] : 0.0f;
                const float *xp = x + (long)n * W.in_stride + base;
#pragma unroll
                for (int ky = 0; ky < KS; ++ky)
#pragma unroll
                    for (int kx = 0; kx < KS; ++kx)
                        if (valid >> (ky * KS + kx) & 1ull) {
                            const float xv = __ldg(xp + ky * W.w + kx);
#pragma unroll
                            for (int b = 0; b < KB; ++b)
                                acc[b * (T + 1) + ky * KS + kx] = fmaf(dy[b], xv, acc[b * (T + 1) + ky * KS + kx]);
                        }
#pragma unroll
                for (int b = 0; b < KB; ++b) acc[b * (T + 1) + T] += dy[b];
            }
        }
    }
    block_sums<KB * (T + 1)>(acc, red, res);
}

// Write item's sums (per channel: T taps + the bias), or, when its terms are split, its chunk's partial
// sums, and the last chunk to finish adds them all in chunk order.
__device__ void conv_weight_finish(const WLayer &W, long item, int chunk, int T, const float *res, int *last) {
    const int kb = W.kb, n = kb * (T + 1);
    const int kg = (int)(item / W.c), c = (int)(item - (long)kg * W.c);
    const bool bias = c == 0 && W.gb != nullptr;
    auto put = [&](int i, float v) {             // sum i: channel kg * kb + i / (T + 1), tap (or bias) i % (T + 1)
        const int b = i / (T + 1), t = i - b * (T + 1), k = kg * kb + b;
        if (k >= W.k) return;
        if (t < T) W.gw[((long)k * W.c + c) * T + t] = v;
        else if (bias) W.gb[k] = v;
    };
    if (W.chunks == 1) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) put(i, res[i]);
        return;
    }
    float *mine = W.partial + (item * W.chunks + chunk) * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mine[i] = res[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(W.ticket + item, 1) == W.chunks - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const float *all = W.partial + item * W.chunks * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = 0.0f;
        for (int ch = 0; ch < W.chunks; ++ch) s += __ldcg(all + (long)ch * n + i);
        put(i, s);
    }
}

// A linear layer's tile `r` of the weight gradient dW[o, i] = sum_n d[n, o] x[n, i]: 32 outputs x 64
// inputs, the batch in steps of 32 images through shared memory (sm: 32 * 32 + 32 * 64 floats), a thread
// 2 outputs x 4 inputs; the tiles of the first column also sum the bias, sum_n d[n, o], in image order.
__device__ void linear_weight_grad(const WLayer &W, int batch, const float *x, long r, float *sm) {
    const int tiles_i = (W.c + 63) / 64;
    const int o0 = (int)(r / tiles_i) * 32, i0 = (int)(r % tiles_i) * 64;
    float *sd = sm, *sx = sm + 32 * 32;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float bias[2] = {0.0f, 0.0f};                  // tiles of the first column, lanes tx == 0: sum_n d[n, o]
    const bool sums_bias = i0 == 0 && W.gb != nullptr && tx == 0;
    for (int n0 = 0; n0 < batch; n0 += 32) {
        for (int e = threadIdx.x; e < 32 * 32; e += blockDim.x) {
            const int n = n0 + e / 32, o = o0 + e % 32;
            sd[e] = n < batch && o < W.k ? W.d[(long)n * W.out_stride + o] : 0.0f;
        }
        for (int e = threadIdx.x; e < 32 * 64; e += blockDim.x) {
            const int n = n0 + e / 64, i = i0 + e % 64;
            sx[e] = n < batch && i < W.c ? x[(long)n * W.in_stride + i] : 0.0f;
        }
        __syncthreads();
        const int steps = batch - n0 < 32 ? batch - n0 : 32;
        for (int j = 0; j < steps; ++j) {
            const float d0 = sd[j * 32 + 2 * ty], d1 = sd[j * 32 + 2 * ty + 1];
            const float4 v = *reinterpret_cast<const float4 *>(sx + j * 64 + 4 * tx);
            acc[0][0] = fmaf(d0, v.x, acc[0][0]);
            acc[0][1] = fmaf(d0, v.y, acc[0][1]);
            acc[0][2] = fmaf(d0, v.z, acc[0][2]);
            acc[0][3] = fmaf(d0, v.w, acc[0][3]);
            acc[1][0] = fmaf(d1, v.x, acc[1][0]);
            acc[1][1] = fmaf(d1, v.y, acc[1][1]);
            acc[1][2] = fmaf(d1, v.z, acc[1][2]);
            acc[1][3] = fmaf(d1, v.w, acc[1][3]);
            if (sums_bias) {
                bias[0] += d0;
                bias[1] += d1;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int o = o0 + 2 * ty + a;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = i0 + 4 * tx + q;
            if (o < W.k && i < W.c) W.gw[(long)o * W.c + i] = acc[a][q];
        }
    }
    if (sums_bias)
#pragma unroll
        for (int a = 0; a < 2; ++a)
            if (o0 + 2 * ty + a < W.k) W.gb[o0 + 2 * ty + a] = bias[a];
}

template <int KS>
__device__ void conv_weight_grad(const WLayer &W, int batch, const float *x, long r, float *sm, float *res,
                                 int *last) {
    const long item = r / W.chunks;
    const int chunk = (int)(r - item * W.chunks);
    conv_weight_sums<KS, conv_kb(KS)>(W, batch, x, item, chunk, sm, res);
    conv_weight_finish(W, item, chunk, KS * KS, res, last);
}

__device__ void weight_block(const WArgs &a, const float *x, long b, float *sm, float *res, int *lastp,
                             WLayer *layer) {
    int &last = *lastp;
    if (b == 0) {      // the batch's mean loss, as loss.cu's mean_kernel (one block of kLossThreads)
        float s = 0.0f;
        for (int i = threadIdx.x; i < a.batch; i += kLossThreads) s += a.row_loss[i];
        sm[threadIdx.x] = s;
        __syncthreads();
        for (int half = kLossThreads / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) sm[threadIdx.x] += sm[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) *a.loss = sm[0] / (float)a.batch;
        return;
    }
    int li = 0;
    while (li + 1 < a.num && b >= a.L[li + 1].first) ++li;
    if (threadIdx.x == 0) *layer = a.L[li];      // the layer's fields from shared memory from here on
    __syncthreads();
    const WLayer &W = *layer;
    const long r = b - W.first;
    const float *in = W.x != nullptr ? W.x : x;
    if (W.op == CYDNN_NET_LINEAR) {
        linear_weight_grad(W, a.batch, in, r, sm);
        return;
    }
    switch (W.kh) {
        case 1: conv_weight_grad<1>(W, a.batch, in, r, sm, res, &last); break;
        case 2: conv_weight_grad<2>(W, a.batch, in, r, sm, res, &last); break;
        case 3: conv_weight_grad<3>(W, a.batch, in, r, sm, res, &last); break;
        case 4: conv_weight_grad<4>(W, a.batch, in, r, sm, res, &last); break;
        case 5: conv_weight_grad<5>(W, a.batch, in, r, sm, res, &last); break;
        default: conv_weight_grad<7>(W, a.batch, in, r, sm, res, &last); break;
    }
}

// Each block takes the work blocks b = blockIdx.x, + gridDim.x, ... of the `total` (a grid of a few blocks per
// SM: a work block is small, and a launched block's start costs more than its work).
__global__ void __launch_bounds__(kWThreads)
    fused_weight_kernel(const __grid_constant__ WArgs a, const float *x, long total) {
    __shared__ __align__(16) float sm[32 * 32 + 32 * 64];
    __shared__ float res[kMaxSums];
    __shared__ int last;
    __shared__ WLayer layer;
    if (a.clock != nullptr && blockIdx.x == 0 && threadIdx.x == 0) a.clock[kWeightStart] = cydnn::globaltimer_ns();
    for (long b = blockIdx.x; b < total; b += gridDim.x) {
        weight_block(a, x, b, sm, res, &last, &layer);
        __syncthreads();
    }
    tick_last(a.clock, kWeightEnd);
}

static_assert(kWThreads == kLossThreads, "block 0 of the weight kernel runs loss.cu's tree");
static_assert((kWThreads / 32) * kMaxSums <= 32 * 32 + 32 * 64, "the tap sums' reduction fits in sm");
static_assert(conv_kb(7) * (49 + 1) <= kMaxSums && conv_kb(5) * (25 + 1) <= kMaxSums, "res holds an item's sums");

}  // namespace
