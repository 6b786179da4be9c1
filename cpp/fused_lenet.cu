// fused_lenet.cu -- LeNet-5 in a few kernels: the fast path's compute.
//
// The reference path runs LeNet-5 as ~12 ops (cuDNN convolution, bias, ReLU,
// pooling, cuBLAS GEMMs, the loss), each a launch or two, each its own pass
// over memory.  Here one thread block takes G images (G <= kGMax) through the
// whole network with every activation in shared memory:
//
//   load (gather, shift, pad, normalise) -> conv1+bias+act -> pool1 -> conv2+bias+act
//   -> pool2 -> fc1+act -> fc2+act -> fc3 -> softmax (inference) or loss (training)
//
// and, for training, back again: each block writes the gradient of its own
// images into its slice of a "partial" buffer (no atomics), then
// update_kernel sums the slices in a fixed order and applies the optimizer to
// every parameter in one launch, and counters_kernel does the bookkeeping.
// The formulas are the reference ops' (cydnn.h); only the order of the
// floating-point sums differs, which the tests bound.
//
// Per block, smem holds, per image, in floats (modern / classic):
//   x 784/1024, a1 3456/4704, p1 864/1176, a2 1024/1600, p2 256/400, h1 120,
//   h2 84, z 32 (forward), then dp1, dp2, dh1, dh2, dz and the max-pool
//   argmax bytes (training).  Backward overwrites a1/a2 with their gradients.
#include <climits>
#include <cmath>
#include <cstdlib>

#include "common.cuh"

namespace {

constexpr int kMaxThreads = 1024;   // the kernels take any multiple of 32 up to this
constexpr int kGMax = 4;        // images per block at most
constexpr int KS = 5, K1 = 6, K2 = 16, F1 = 120, F2 = 84, ZPAD = 32;

enum Act { kRelu = 0, kTanh = 1, kNone = 2 };

template <bool CLASSIC>
struct Net {
    static constexpr int PAD = CLASSIC ? 2 : 0;
    static constexpr int IN = 28 + 2 * PAD;       // 28 / 32
    static constexpr int C1 = IN - KS + 1;        // 24 / 28
    static constexpr int P1 = C1 / 2;             // 12 / 14
    static constexpr int C2 = P1 - KS + 1;        // 8 / 10
    static constexpr int P2 = C2 / 2;             // 4 / 5
    static constexpr int FLAT = K2 * P2 * P2;     // 256 / 400
    static constexpr int ACT = CLASSIC ? kTanh : kRelu;
    static constexpr bool MAXPOOL = !CLASSIC;
    // smem offsets (floats) inside one image's slot
    static constexpr int X = 0;
    static constexpr int A1 = X + IN * IN;
    static constexpr int PL1 = A1 + K1 * C1 * C1;
    static constexpr int A2 = PL1 + K1 * P1 * P1;
    static constexpr int PL2 = A2 + K2 * C2 * C2;
    static constexpr int H1 = PL2 + FLAT;
    static constexpr int H2 = H1 + F1;
    static constexpr int Z = H2 + F2;
    static constexpr int FWD_END = Z + ZPAD;
    static constexpr int DP1 = FWD_END;
    static constexpr int DP2 = DP1 + K1 * P1 * P1;
    static constexpr int DH1 = DP2 + FLAT;
    static constexpr int DH2 = DH1 + F1;
    static constexpr int DZ = DH2 + F2;
    static constexpr int ARG1 = DZ + ZPAD;                       // bytes start here (as floats)
    static constexpr int ARG2_BYTE = K1 * P1 * P1;               // byte offset of pool2's argmax
    static constexpr int TRAIN_END = ARG1 + (K1 * P1 * P1 + FLAT + 3) / 4;
    // slot sizes rounded to an odd multiple of... keep 4-float alignment
    static constexpr int FWD_SLOT = (FWD_END + 3) / 4 * 4;
    // inference-only slot (conv and pool fused: no a1 / a2)
    static constexpr int I_X = 0;
    static constexpr int I_P1 = I_X + IN * IN;
    static constexpr int I_P2 = I_P1 + K1 * P1 * P1;
    static constexpr int I_H1 = I_P2 + FLAT;
    static constexpr int I_H2 = I_H1 + F1;
    static constexpr int I_Z = I_H2 + F2;
    static constexpr int INFER_SLOT = (I_Z + ZPAD + 3) / 4 * 4;
    static constexpr int TRAIN_SLOT = (TRAIN_END + 3) / 4 * 4;
};

__host__ __device__ inline long param_size(bool classic, int nc, int i) {
    const long flat = classic ? 400 : 256;
    switch (i) {
        case 0: return K1 * KS * KS;
        case 1: return K1;
        case 2: return (long)K2 * K1 * KS * KS;
        case 3: return K2;
        case 4: return F1 * flat;
        case 5: return F1;
        case 6: return (long)F2 * F1;
        case 7: return F2;
        case 8: return (long)nc * F2;
        case 9: return nc;
        default: return -1;
    }
}

__host__ __device__ inline long param_total(bool classic, int nc) {
    long t = 0;
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) t += param_size(classic, nc, i);
    return t;
}

template <int ACT>
__device__ __forceinline__ float activate(float v) {
    if (ACT == kRelu) return fmaxf(v, 0.0f);
    if (ACT == kTanh) return tanhf(v);
    return v;
}

// Derivative of the activation, from its output y (as the reference backward ops).
template <int ACT>
__device__ __forceinline__ float activate_grad(float y) {
    if (ACT == kRelu) return y > 0.0f ? 1.0f : 0.0f;
    if (ACT == kTanh) return 1.0f - y * y;
    return 1.0f;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ------------------------------------------------------------ layers
// Every layer is block-cooperative over the G images of the block (slot
// stride S floats); the caller puts a __syncthreads() between layers.

// out[g][k][oy][ox] = act(b[k] + sum_{c,i,j} w[k][c][i][j] in[g][c][oy+i][ox+j])
// A thread computes KT output channels at one position: each input value it
// loads serves KT multiply-adds (w and b are in shared memory: the loads of a
// warp, which share k, are broadcasts).
template <int CIN, int H, int COUT, int KT, int ACT>
__device__ void conv_forward(const float *in, float *out, int S, int G, const float *w, const float *b) {
    constexpr int OH = H - KS + 1, GROUPS = COUT / KT, PER = GROUPS * OH * OH;
    static_assert(COUT % KT == 0, "KT must divide COUT");
    for (int idx = threadIdx.x; idx < G * PER; idx += blockDim.x) {
        const int g = idx / PER, r = idx - g * PER;
        const int kg = r / (OH * OH), p = r - kg * OH * OH;
        const int oy = p / OH, ox = p - oy * OH;
        const float *ip = in + g * S + oy * H + ox;
        const float *wp = w + kg * KT * CIN * KS * KS;
        float acc[KT];
#pragma unroll
        for (int t = 0; t < KT; ++t) acc[t] = 0.0f;
        for (int c = 0; c < CIN; ++c) {
#pragma unroll
            for (int i = 0; i < KS; ++i)
#pragma unroll
                for (int j = 0; j < KS; ++j) {
                    const float v = ip[(c * H + i) * H + j];
#pragma unroll
                    for (int t = 0; t < KT; ++t)
                        acc[t] = fmaf(v, wp[((t * CIN + c) * KS + i) * KS + j], acc[t]);
                }
        }
#pragma unroll
        for (int t = 0; t < KT; ++t)
            out[g * S + (kg * KT + t) * OH * OH + p] = activate<ACT>(acc[t] + b[kg * KT + t]);
    }
}

// Inference only: conv + bias + activation + 2x2 pool in one pass.  A thread
// computes KT channels of one pooled output: the 6x6 input patch under its
// four conv windows is loaded once per input channel (36 loads for 100*KT
// multiply-adds); the four values are activated, then max-ed or averaged, as
// the reference's conv -> act -> pool.
template <int CIN, int H, int COUT, int KT, int ACT, bool MAX>
__device__ void conv_pool_forward(const float *in, float *out, int S, int G, const float *w, const float *b) {
    constexpr int OH = H - KS + 1, PH = OH / 2, GROUPS = COUT / KT, PER = GROUPS * PH * PH;
    static_assert(COUT % KT == 0, "KT must divide COUT");
    for (int idx = threadIdx.x; idx < G * PER; idx += blockDim.x) {
        const int g = idx / PER, r = idx - g * PER;
        const int kg = r / (PH * PH), p = r - kg * PH * PH;
        const int py = p / PH, px = p - py * PH;
        const float *ip = in + g * S + (2 * py) * H + 2 * px;
        const float *wp = w + kg * KT * CIN * KS * KS;
        float acc[KT][4];
#pragma unroll
        for (int t = 0; t < KT; ++t)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[t][q] = 0.0f;
        for (int c = 0; c < CIN; ++c) {
            float v[KS + 1][KS + 1];
#pragma unroll
            for (int i = 0; i <= KS; ++i)
#pragma unroll
                for (int j = 0; j <= KS; ++j) v[i][j] = ip[(c * H + i) * H + j];
#pragma unroll
            for (int i = 0; i < KS; ++i)
#pragma unroll
                for (int j = 0; j < KS; ++j)
#pragma unroll
                    for (int t = 0; t < KT; ++t) {
                        const float wv = wp[((t * CIN + c) * KS + i) * KS + j];
                        acc[t][0] = fmaf(v[i][j], wv, acc[t][0]);
                        acc[t][1] = fmaf(v[i][j + 1], wv, acc[t][1]);
                        acc[t][2] = fmaf(v[i + 1][j], wv, acc[t][2]);
                        acc[t][3] = fmaf(v[i + 1][j + 1], wv, acc[t][3]);
                    }
        }
#pragma unroll
        for (int t = 0; t < KT; ++t) {
            const float bias = b[kg * KT + t];
            const float a0 = activate<ACT>(acc[t][0] + bias), a1 = activate<ACT>(acc[t][1] + bias);
            const float a2 = activate<ACT>(acc[t][2] + bias), a3 = activate<ACT>(acc[t][3] + bias);
            out[g * S + (kg * KT + t) * PH * PH + p] =
                MAX ? fmaxf(fmaxf(a0, a1), fmaxf(a2, a3)) : (a0 + a1 + a2 + a3) * 0.25f;
        }
    }
}

// 2x2 windows, stride 2: max (first maximum, row-major; its position 0..3
// kept in arg when arg != NULL) or mean.
template <int C, int H, bool MAX>
__device__ void pool_forward(const float *in, float *out, unsigned char *arg, int S, int G) {
    constexpr int OH = H / 2, PER = C * OH * OH;
    for (int idx = threadIdx.x; idx < G * PER; idx += blockDim.x) {
        const int g = idx / PER, r = idx - g * PER;
        const int c = r / (OH * OH), p = r - c * OH * OH;
        const int oy = p / OH, ox = p - oy * OH;
        const float *ip = in + g * S + (c * H + 2 * oy) * H + 2 * ox;
        const float v0 = ip[0], v1 = ip[1], v2 = ip[H], v3 = ip[H + 1];
        if (MAX) {
            float best = v0;
            int a = 0;
            if (v1 > best) { best = v1; a = 1; }
            if (v2 > best) { best = v2; a = 2; }
            if (v3 > best) { best = v3; a = 3; }
            out[g * S + r] = best;
            if (arg != nullptr) arg[g * S * 4 + r] = (unsigned char)a;
        } else {
            out[g * S + r] = (v0 + v1 + v2 + v3) * 0.25f;
        }
    }
}

// out[g][o] = act(b[o] + sum_i W[o][i] in[g][i]): one warp per output, the
// lanes split i (coalesced rows of W, read once for all G images).
template <int IN_F, int ACT>
__device__ void fc_forward(const float *in, float *out, int S, int G, const float *__restrict__ W,
                           const float *__restrict__ b, int OUT) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int o = warp; o < OUT; o += blockDim.x / 32) {
        float acc[kGMax];
#pragma unroll
        for (int g = 0; g < kGMax; ++g) acc[g] = 0.0f;
        const float *wr = W + (long)o * IN_F;
        for (int i = lane; i < IN_F; i += 32) {
            const float wv = __ldg(wr + i);
#pragma unroll
            for (int g = 0; g < kGMax; ++g)
                if (g < G) acc[g] = fmaf(wv, in[g * S + i], acc[g]);
        }
#pragma unroll
        for (int g = 0; g < kGMax; ++g) acc[g] = warp_sum(acc[g]);
        if (lane == 0)
            for (int g = 0; g < G; ++g) out[g * S + o] = activate<ACT>(acc[g] + __ldg(b + o));
    }
}

// gW[o][i] = sum_g dout[g][o] in[g][i],  gB[o] = sum_g dout[g][o]
template <int IN_F>
__device__ void fc_backward_params(const float *in, const float *dout, int S, int G, float *gW,
                                   float *gB, int OUT) {
    for (int idx = threadIdx.x; idx < OUT * IN_F; idx += blockDim.x) {
        const int o = idx / IN_F, i = idx - o * IN_F;
        float acc = 0.0f;
        for (int g = 0; g < G; ++g) acc = fmaf(dout[g * S + o], in[g * S + i], acc);
        gW[idx] = acc;
    }
    for (int o = threadIdx.x; o < OUT; o += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; ++g) acc += dout[g * S + o];
        gB[o] = acc;
    }
}

// din[g][i] = act'(y[g][i]) * sum_o W[o][i] dout[g][o]   (y: the layer input's activation output)
template <int IN_F, int ACT>
__device__ void fc_backward_input(const float *dout, const float *y, float *din, int S, int G,
                                  const float *__restrict__ W, int OUT) {
    for (int idx = threadIdx.x; idx < G * IN_F; idx += blockDim.x) {
        const int g = idx / IN_F, i = idx - g * IN_F;
        float acc = 0.0f;
        for (int o = 0; o < OUT; ++o) acc = fmaf(__ldg(W + (long)o * IN_F + i), dout[g * S + o], acc);
        din[g * S + i] = acc * activate_grad<ACT>(y[g * S + i]);
    }
}

// In place: a[g][c][y][x] (activation output) becomes dLoss/d(pre-activation):
// the window's gradient (to its argmax for max, a quarter each for mean)
// times act'(a).  Each element reads only itself, dp and arg: safe in place.
template <int C, int H, bool MAX, int ACT>
__device__ void pool_act_backward(const float *dp, float *a, const unsigned char *arg, int S, int G) {
    constexpr int OH = H / 2, PER = C * H * H;
    for (int idx = threadIdx.x; idx < G * PER; idx += blockDim.x) {
        const int g = idx / PER, r = idx - g * PER;
        const int c = r / (H * H), p = r - c * H * H;
        const int y = p / H, x = p - y * H;
        const int pr = (c * OH + y / 2) * OH + x / 2;
        float d = dp[g * S + pr];
        if (MAX)
            d = (arg[g * S * 4 + pr] == ((y & 1) * 2 + (x & 1))) ? d : 0.0f;
        else
            d *= 0.25f;
        a[g * S + r] = d * activate_grad<ACT>(a[g * S + r]);
    }
}

// gW[k][c][i][j] = sum_{g,oy,ox} da[g][k][oy][ox] in[g][c][oy+i][ox+j];  gB[k] = sum da[g][k]
// The weights' and biases' COUT*(CIN*25 + 1) sums are each split into RS
// bands of rows (more threads at work for conv1's 156 long sums): band sums
// go to `scratch` (shared memory, free at this point) and are then added in
// a fixed order.  With RS = 1 the sums are written directly.
template <int CIN, int H, int COUT, int RS>
__device__ void conv_backward_params(const float *in, const float *da, int S, int G, float *gW,
                                     float *gB, float *scratch) {
    constexpr int OH = H - KS + 1, NW = COUT * CIN * KS * KS, NE = NW + COUT;
    constexpr int BAND = (OH + RS - 1) / RS;
    for (int idx = threadIdx.x; idx < NE * RS; idx += blockDim.x) {
        const int e = idx / RS, band = idx - e * RS;
        const int y0 = band * BAND, y1 = min(OH, y0 + BAND);
        float acc = 0.0f;
        if (e < NW) {
            const int k = e / (CIN * KS * KS), r = e - k * CIN * KS * KS;
            const int c = r / (KS * KS), q = r - c * KS * KS;
            const int i = q / KS, j = q - i * KS;
            for (int g = 0; g < G; ++g) {
                const float *dap = da + g * S + k * OH * OH;
                const float *ip = in + g * S + (c * H + i) * H + j;
                for (int oy = y0; oy < y1; ++oy)
#pragma unroll
                    for (int ox = 0; ox < OH; ++ox) acc = fmaf(dap[oy * OH + ox], ip[oy * H + ox], acc);
            }
        } else {
            const int k = e - NW;
            for (int g = 0; g < G; ++g)
                for (int p = y0 * OH; p < y1 * OH; ++p) acc += da[g * S + k * OH * OH + p];
        }
        if (RS == 1)
            (e < NW ? gW[e] : gB[e - NW]) = acc;
        else
            scratch[idx] = acc;
    }
    if (RS > 1) {
        __syncthreads();
        for (int e = threadIdx.x; e < NE; e += blockDim.x) {
            float acc = 0.0f;
            for (int band = 0; band < RS; ++band) acc += scratch[e * RS + band];
            (e < NW ? gW[e] : gB[e - NW]) = acc;
        }
    }
}

// din[g][c][y][x] = sum_{k,i,j} da[g][k][y-i][x-j] w[k][c][i][j]   (the "full" correlation;
// only the (i, j) with y-i, x-j inside the output are visited)
template <int CIN, int H, int COUT>
__device__ void conv_backward_input(const float *da, float *din, int S, int G, const float *w) {
    constexpr int OH = H - KS + 1, PER = CIN * H * H;
    for (int idx = threadIdx.x; idx < G * PER; idx += blockDim.x) {
        const int g = idx / PER, r = idx - g * PER;
        const int c = r / (H * H), p = r - c * H * H;
        const int y = p / H, x = p - y * H;
        const int i0 = max(0, y - (OH - 1)), i1 = min(KS - 1, y);
        const int j0 = max(0, x - (OH - 1)), j1 = min(KS - 1, x);
        float acc = 0.0f;
        for (int k = 0; k < COUT; ++k) {
            const float *dap = da + g * S + k * OH * OH + y * OH + x;   // dap[-(i*OH + j)] = da[y-i][x-j]
            const float *wp = w + (k * CIN + c) * KS * KS;
            for (int i = i0; i <= i1; ++i)
                for (int j = j0; j <= j1; ++j) acc = fmaf(dap[-(i * OH + j)], wp[i * KS + j], acc);
        }
        din[g * S + r] = acc;
    }
}

// ------------------------------------------------------------ inputs
// Raw images (28x28, uint8 / 255 or float as is) -> padded, normalised x.
template <bool CL>
__device__ void load_raw(const void *images, int kind, int first, int G, int S, float mean,
                         float std, float *sm) {
    using N = Net<CL>;
    for (int idx = threadIdx.x; idx < G * N::IN * N::IN; idx += blockDim.x) {
        const int g = idx / (N::IN * N::IN), p = idx - g * N::IN * N::IN;
        const int iy = p / N::IN - N::PAD, ix = p % N::IN - N::PAD;
        float v = 0.0f;
        if (iy >= 0 && iy < 28 && ix >= 0 && ix < 28) {
            const long src = (long)(first + g) * 784 + iy * 28 + ix;
            v = kind == CYDNN_INPUT_U8 ? (float)((const uint8_t *)images)[src] / 255.0f
                                       : ((const float *)images)[src];
        }
        sm[g * S + N::X + p] = (v - mean) / std;
    }
}

// A training batch from the dataset on the device: the same pixels, shifts and
// floats as gather_batch_kernel (data.cu), so both paths see the same batch.
template <bool CL>
__device__ void load_batch(const cydnnLeNetTrainStep &a, int step, int first, int G, int S,
                           float *sm, int *labels_out) {
    using N = Net<CL>;
    const uint64_t seed = a.shift_seeds != nullptr ? a.shift_seeds[step] : 0;
    const uint64_t span = 2 * (uint64_t)a.max_shift + 1;
    const long base = (long)step * a.order_stride;
    for (int idx = threadIdx.x; idx < G * N::IN * N::IN; idx += blockDim.x) {
        const int g = idx / (N::IN * N::IN), p = idx - g * N::IN * N::IN;
        const int b = first + g;  // row in the batch
        const int index = a.order[base + b];
        const int iy = p / N::IN - N::PAD, ix = p % N::IN - N::PAD;
        float v = 0.0f;
        if (index < 0 || index >= a.n_images) {
            v = __int_as_float(0x7fc00000);
        } else if (iy >= 0 && iy < 28 && ix >= 0 && ix < 28) {
            const uint64_t r = cydnn::splitmix64(seed ^ cydnn::splitmix64((uint64_t)b));
            const int sx = (int)((r & 0xffffffffull) % span) - a.max_shift;
            const int sy = (int)((r >> 32) % span) - a.max_shift;
            const int src_y = iy - sy, src_x = ix - sx;
            if (src_y >= 0 && src_y < 28 && src_x >= 0 && src_x < 28)
                v = (float)a.images[(long)index * 784 + src_y * 28 + src_x] / 255.0f;
        }
        sm[g * S + N::X + p] = (v - a.mean) / a.std;
    }
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        const int index = a.order[base + first + g];
        labels_out[g] = (index >= 0 && index < a.n_images) ? a.labels[index] : -1;
    }
}

// ------------------------------------------------------------ forward
// conv1's and conv2's weights and biases, copied once per block to the front
// of shared memory: cw[0:150] w1, [150:156] b1, [156:2556] w2, [2556:2572] b2.
constexpr int kConvW = 2576;   // 2572 rounded up to a multiple of 4

__device__ void load_conv_weights(const float *const *w, float *cw) {
    for (int i = threadIdx.x; i < 2572; i += blockDim.x) {
        const float *src = i < 150 ? w[0] + i : i < 156 ? w[1] + (i - 150) : i < 2556 ? w[2] + (i - 156)
                                                                                     : w[3] + (i - 2556);
        cw[i] = __ldg(src);
    }
}

template <bool CL>
__device__ void forward(float *sm, int S, int G, const float *const *w, const float *cw, unsigned char *arg,
                        int nc) {
    using N = Net<CL>;
    conv_forward<1, N::IN, K1, K1, N::ACT>(sm + N::X, sm + N::A1, S, G, cw, cw + 150);
    __syncthreads();
    pool_forward<K1, N::C1, N::MAXPOOL>(sm + N::A1, sm + N::PL1, arg, S, G);
    __syncthreads();
    conv_forward<K1, N::P1, K2, 4, N::ACT>(sm + N::PL1, sm + N::A2, S, G, cw + 156, cw + 2556);
    __syncthreads();
    pool_forward<K2, N::C2, N::MAXPOOL>(sm + N::A2, sm + N::PL2,
                                        arg == nullptr ? nullptr : arg + N::ARG2_BYTE, S, G);
    __syncthreads();
    fc_forward<N::FLAT, N::ACT>(sm + N::PL2, sm + N::H1, S, G, w[4], w[5], F1);
    __syncthreads();
    fc_forward<F1, N::ACT>(sm + N::H1, sm + N::H2, S, G, w[6], w[7], F2);
    __syncthreads();
    fc_forward<F2, kNone>(sm + N::H2, sm + N::Z, S, G, w[8], w[9], nc);
    __syncthreads();
}

// The inference forward: LAT (one image, latency) spreads the convolutions
// over more, shorter work items; otherwise each item does more multiply-adds
// per load (throughput).
template <bool CL, bool LAT>
__device__ void forward_infer(float *sm, int S, int G, const float *const *w, const float *cw, int nc) {
    using N = Net<CL>;
    conv_pool_forward<1, N::IN, K1, LAT ? 1 : 3, N::ACT, N::MAXPOOL>(sm + N::I_X, sm + N::I_P1, S, G, cw, cw + 150);
    __syncthreads();
    conv_pool_forward<K1, N::P1, K2, LAT ? 1 : 2, N::ACT, N::MAXPOOL>(sm + N::I_P1, sm + N::I_P2, S, G, cw + 156,
                                                                   cw + 2556);
    __syncthreads();
    fc_forward<N::FLAT, N::ACT>(sm + N::I_P2, sm + N::I_H1, S, G, w[4], w[5], F1);
    __syncthreads();
    fc_forward<F1, N::ACT>(sm + N::I_H1, sm + N::I_H2, S, G, w[6], w[7], F2);
    __syncthreads();
    fc_forward<F2, kNone>(sm + N::I_H2, sm + N::I_Z, S, G, w[8], w[9], nc);
    __syncthreads();
}

template <bool CL, bool LAT>
__global__ void __launch_bounds__(kMaxThreads)
    forward_kernel(cydnnLeNetWeights w, const void *images, int kind, int n, const int *n_dev,
                   float mean, float std, int nc, int softmax, float *out, int G) {
    using N = Net<CL>;
    extern __shared__ float smem[];
    float *cw = smem, *sm = smem + kConvW;
    if (n_dev != nullptr) n = min(n, *n_dev);
    const int S = N::INFER_SLOT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_conv_weights(w.p, cw);
    for (int first = blockIdx.x * G; first < n; first += gridDim.x * G) {
        const int Gb = min(G, n - first);
        load_raw<CL>(images, kind, first, Gb, S, mean, std, sm);
        __syncthreads();
        forward_infer<CL, LAT>(sm, S, Gb, w.p, cw, nc);
        if (warp < Gb) {
            const float *z = sm + warp * S + N::I_Z;
            const float v = lane < nc ? z[lane] : -INFINITY;
            float *o = out + (long)(first + warp) * nc;
            if (softmax) {
                // As the reference softmax: exp(x - max) / sum.
                const float m = warp_max(v);
                const float e = lane < nc ? expf(v - m) : 0.0f;
                const float s = warp_sum(e);
                if (lane < nc) o[lane] = e / s;
            } else if (lane < nc) {
                o[lane] = v;
            }
        }
        __syncthreads();
    }
}

// ------------------------------------------------------------ training
struct TrainScratch {
    float *partial;   // (blocks, P)
    float *loss;      // (batch)
    int *correct;     // (batch)
};

int images_per_block(int batch) {
    // Enough blocks to fill the GPU with one image each, then up to kGMax.
    int g = (batch + 131) / 132;
    return g < 1 ? 1 : (g > kGMax ? kGMax : g);
}

TrainScratch scratch_layout(void *base, bool classic, int nc, int batch) {
    const int G = images_per_block(batch);
    const long blocks = (batch + G - 1) / G;
    TrainScratch t;
    t.partial = (float *)base;
    t.loss = t.partial + blocks * param_total(classic, nc);
    t.correct = (int *)(t.loss + batch);
    return t;
}

size_t scratch_bytes(bool classic, int nc, int batch) {
    const int G = images_per_block(batch);
    const long blocks = (batch + G - 1) / G;
    return sizeof(float) * (size_t)(blocks * param_total(classic, nc) + 2 * (long)batch);
}

template <bool CL>
__global__ void __launch_bounds__(kMaxThreads)
    train_kernel(cydnnLeNetTrainStep a, TrainScratch t, int G) {
    using N = Net<CL>;
    extern __shared__ float smem[];
    float *cw = smem, *sm = smem + kConvW;
    __shared__ int labels[kGMax];
    const int S = N::TRAIN_SLOT;
    const int nc = a.num_classes;
    const int step = a.counters->step_in_epoch;
    const int first = blockIdx.x * G;
    const int Gb = min(G, a.batch - first);
    unsigned char *arg = (unsigned char *)(sm + N::ARG1);
    float *part = t.partial + (long)blockIdx.x * param_total(CL, nc);
    float *pg[CYDNN_LENET_NUM_PARAMS];
    {
        long off = 0;
        for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) {
            pg[i] = part + off;
            off += param_size(CL, nc, i);
        }
    }
    const float *w[CYDNN_LENET_NUM_PARAMS];
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) w[i] = a.param[i];

    load_conv_weights(w, cw);
    load_batch<CL>(a, step, first, Gb, S, sm, labels);
    __syncthreads();
    forward<CL>(sm, S, Gb, w, cw, arg, nc);

    // Loss and dLoss/dz, one warp per image, as the reference fused
    // cross-entropy: dz = (softmax - onehot) / batch.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < Gb) {
        const float *z = sm + warp * S + N::Z;
        float *dz = sm + warp * S + N::DZ;
        const int label = labels[warp];
        const float v = lane < nc ? z[lane] : -INFINITY;
        const float m = warp_max(v);
        const float e = lane < nc ? expf(v - m) : 0.0f;
        const float s = warp_sum(e);
        const unsigned at_max = __ballot_sync(0xffffffffu, lane < nc && v == m);
        const bool good = label >= 0 && label < nc;
        if (lane < ZPAD)
            dz[lane] = lane < nc ? (good ? (e / s - (lane == label ? 1.0f : 0.0f)) / (float)a.batch
                                         : __int_as_float(0x7fc00000))
                                 : 0.0f;
        if (lane == 0) {
            t.loss[first + warp] = good ? logf(s) - (z[label] - m) : __int_as_float(0x7fc00000);
            t.correct[first + warp] = good && (__ffs(at_max) - 1) == label;
        }
    }
    __syncthreads();

    // fc3: z = W3 h2 + b3
    fc_backward_params<F2>(sm + N::H2, sm + N::DZ, S, Gb, pg[8], pg[9], nc);
    fc_backward_input<F2, N::ACT>(sm + N::DZ, sm + N::H2, sm + N::DH2, S, Gb, w[8], nc);
    __syncthreads();
    // fc2: h2 = act(W2 h1 + b2)
    fc_backward_params<F1>(sm + N::H1, sm + N::DH2, S, Gb, pg[6], pg[7], F2);
    fc_backward_input<F1, N::ACT>(sm + N::DH2, sm + N::H1, sm + N::DH1, S, Gb, w[6], F2);
    __syncthreads();
    // fc1: h1 = act(W1 flat + b1); the flat input is pool2's output (no activation)
    fc_backward_params<N::FLAT>(sm + N::PL2, sm + N::DH1, S, Gb, pg[4], pg[5], F1);
    fc_backward_input<N::FLAT, kNone>(sm + N::DH1, sm + N::PL2, sm + N::DP2, S, Gb, w[4], F1);
    __syncthreads();
    // pool2 and act2: a2 <- dLoss/d(conv2 output)
    pool_act_backward<K2, N::C2, N::MAXPOOL, N::ACT>(sm + N::DP2, sm + N::A2, arg + N::ARG2_BYTE, S, Gb);
    __syncthreads();
    // conv2
    conv_backward_params<K1, N::P1, K2, 1>(sm + N::PL1, sm + N::A2, S, Gb, pg[2], pg[3], nullptr);
    conv_backward_input<K1, N::P1, K2>(sm + N::A2, sm + N::DP1, S, Gb, cw + 156);
    __syncthreads();
    // pool1 and act1
    pool_act_backward<K1, N::C1, N::MAXPOOL, N::ACT>(sm + N::DP1, sm + N::A1, arg, S, Gb);
    __syncthreads();
    // conv1 (no gradient for the input)
    conv_backward_params<1, N::IN, K1, 4>(sm + N::X, sm + N::A1, S, Gb, pg[0], pg[1], sm + N::DP1);
}

// Sum the blocks' partial gradients (fixed order), write the gradient, and
// update the parameter with the same formulas as optimizer.cu.
__global__ void update_kernel(cydnnLeNetTrainStep a, TrainScratch t, int blocks) {
    const long P = param_total(a.classic != 0, a.num_classes);
    const long stride = (long)gridDim.x * blockDim.x;
    const float lr = a.lr_table[a.counters->step_in_epoch];
    const long long step = a.counters->global_step;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < P; e += stride) {
        int seg = 0;
        long off = 0;
        while (seg < CYDNN_LENET_NUM_PARAMS - 1 && e >= off + param_size(a.classic != 0, a.num_classes, seg)) {
            off += param_size(a.classic != 0, a.num_classes, seg);
            ++seg;
        }
        const long i = e - off;
        float g = 0.0f;
        for (int b = 0; b < blocks; ++b) g += t.partial[(long)b * P + e];
        a.grad[seg][i] = g;
        float p = a.param[seg][i];
        if (a.optimizer == CYDNN_OPT_SGD) {
            if (a.weight_decay != 0.0f) g = g + a.weight_decay * p;
            if (a.momentum != 0.0f) {
                float *mb = a.state1[seg];
                const float buf = step == 0 ? g : a.momentum * mb[i] + (1.0f - a.dampening) * g;
                mb[i] = buf;
                g = a.nesterov ? g + a.momentum * buf : buf;
            }
            p = p - lr * g;
        } else {
            const int decoupled = a.optimizer == CYDNN_OPT_ADAMW;
            const double t1 = (double)(step + 1);
            const float bc1 = (float)(1.0 - pow(a.beta1, t1));
            const float bc2 = (float)(1.0 - pow(a.beta2, t1));
            if (decoupled)
                p = p * (float)(1.0 - (double)lr * (double)a.weight_decay);
            else if (a.weight_decay != 0.0f)
                g = g + a.weight_decay * p;
            float *m = a.state1[seg], *v = a.state2[seg];
            const float mi = (float)a.beta1 * m[i] + (float)(1.0 - a.beta1) * g;
            const float vi = (float)a.beta2 * v[i] + (float)(1.0 - a.beta2) * g * g;
            m[i] = mi;
            v[i] = vi;
            p = p - lr * (mi / bc1) / (sqrtf(vi / bc2) + a.eps);
        }
        a.param[seg][i] = p;
    }
}

// One warp: the step's mean loss (fixed order), correct count, counters.
__global__ void counters_kernel(cydnnLeNetTrainStep a, TrainScratch t) {
    const int lane = threadIdx.x;
    float s = 0.0f;
    int c = 0;
    for (int i = lane; i < a.batch; i += 32) {
        s += t.loss[i];
        c += t.correct[i];
    }
    s = warp_sum(s);
    for (int o = 16; o > 0; o /= 2) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) {
        cydnnLeNetCounters *k = a.counters;
        k->loss_sum += (double)(s / (float)a.batch);
        k->correct += c;
        k->step_in_epoch += 1;
        k->global_step += 1;
    }
}

template <class Kernel>
cydnnStatus_t allow_smem(Kernel kernel, size_t bytes, const char *op) {
    // Once per kernel; cheap enough to repeat (a host-side attribute).
    CYDNN_CUDA(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return CYDNN_STATUS_SUCCESS;
}

// Threads per block: a default measured on an H100, overridable (a multiple of
// 32 up to 1024) by an environment variable for experiments.
int threads_for(const char *env, int fallback) {
    const char *v = getenv(env);
    if (v == nullptr) return fallback;
    const int t = atoi(v);
    return (t >= 32 && t <= kMaxThreads && t % 32 == 0) ? t : fallback;
}

int g_sm_count = 0;

int sm_count() {
    if (g_sm_count == 0) {
        int dev = 0;
        cudaGetDevice(&dev);
        if (cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || g_sm_count < 1)
            g_sm_count = 1;
    }
    return g_sm_count;
}

template <bool CL>
cydnnStatus_t launch_forward(cydnnContext *ctx, int nc, const cydnnLeNetWeights *w,
                             const void *images, int kind, int n, const int *n_dev, float mean,
                             float std, int softmax, float *out) {
    const char *op = "lenet_forward";
    const bool lat = n < 2 * sm_count();   // fewer images than the GPU has room for: one per block
    const int G = lat ? 1 : kGMax;
    const size_t smem = sizeof(float) * ((size_t)G * Net<CL>::INFER_SLOT + kConvW);
    const long want = (n + G - 1) / G;
    const long cap = 4L * sm_count();
    const int blocks = (int)(want < cap ? want : cap);
    if (lat) {
        CYDNN_TRY(allow_smem(forward_kernel<CL, true>, smem, op));
        forward_kernel<CL, true><<<blocks, threads_for("CYDNN_FWD1_THREADS", 1024), smem, ctx->stream>>>(
            *w, images, kind, n, n_dev, mean, std, nc, softmax, out, G);
    } else {
        CYDNN_TRY(allow_smem(forward_kernel<CL, false>, smem, op));
        forward_kernel<CL, false><<<blocks, threads_for("CYDNN_FWD_THREADS", 512), smem, ctx->stream>>>(
            *w, images, kind, n, n_dev, mean, std, nc, softmax, out, G);
    }
    CYDNN_LAUNCH_CHECK(op, "forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

template <bool CL>
cydnnStatus_t launch_train(cydnnContext *ctx, const cydnnLeNetTrainStep *s) {
    const char *op = "lenet_train_step";
    const int G = images_per_block(s->batch);
    const int blocks = (s->batch + G - 1) / G;
    const size_t smem = sizeof(float) * ((size_t)G * Net<CL>::TRAIN_SLOT + kConvW);
    CYDNN_TRY(allow_smem(train_kernel<CL>, smem, op));
    const TrainScratch t = scratch_layout(s->scratch, CL, s->num_classes, s->batch);
    train_kernel<CL><<<blocks, threads_for("CYDNN_TRAIN_THREADS", 1024), smem, ctx->stream>>>(*s, t, G);
    CYDNN_LAUNCH_CHECK(op, "train_kernel");
    const long P = param_total(CL, s->num_classes);
    update_kernel<<<(unsigned)((P + 255) / 256), 256, 0, ctx->stream>>>(*s, t, blocks);
    CYDNN_LAUNCH_CHECK(op, "update_kernel");
    counters_kernel<<<1, 32, 0, ctx->stream>>>(*s, t);
    CYDNN_LAUNCH_CHECK(op, "counters_kernel");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

// ------------------------------------------------------------ the C boundary
long cydnn_lenet_param_size(int classic, int num_classes, int i) {
    return param_size(classic != 0, num_classes, i);
}

cydnnStatus_t cydnn_lenet_forward(cydnnContext *ctx, int classic, int num_classes,
                                  const cydnnLeNetWeights *w, const void *images, int input_kind,
                                  int n, const int *n_dev, float mean, float std, int softmax,
                                  float *out) {
    const char *op = "lenet_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, w != nullptr && images != nullptr && out != nullptr, "a pointer is NULL");
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i)
        CYDNN_REQUIRE(op, w->p[i] != nullptr, "weight %d is NULL", i);
    CYDNN_REQUIRE(op, n >= 1, "n must be >= 1, got %d", n);
    CYDNN_REQUIRE(op, num_classes >= 1 && num_classes <= CYDNN_LENET_MAX_CLASSES,
                  "num_classes must be in [1, %d], got %d", CYDNN_LENET_MAX_CLASSES, num_classes);
    CYDNN_REQUIRE(op, input_kind == CYDNN_INPUT_U8 || input_kind == CYDNN_INPUT_F32,
                  "unknown input kind %d", input_kind);
    return classic ? launch_forward<true>(ctx, num_classes, w, images, input_kind, n, n_dev, mean, std,
                                          softmax, out)
                   : launch_forward<false>(ctx, num_classes, w, images, input_kind, n, n_dev, mean, std,
                                           softmax, out);
}

size_t cydnn_lenet_train_scratch_bytes(int classic, int num_classes, int batch) {
    if (batch < 1 || batch > CYDNN_LENET_MAX_TRAIN_BATCH || num_classes < 1 ||
        num_classes > CYDNN_LENET_MAX_CLASSES)
        return 0;
    return scratch_bytes(classic != 0, num_classes, batch);
}

cydnnStatus_t cydnn_lenet_train_step(cydnnContext *ctx, const cydnnLeNetTrainStep *s) {
    const char *op = "lenet_train_step";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, s != nullptr, "step is NULL");
    CYDNN_REQUIRE(op, s->batch >= 1 && s->batch <= CYDNN_LENET_MAX_TRAIN_BATCH,
                  "batch must be in [1, %d], got %d", CYDNN_LENET_MAX_TRAIN_BATCH, s->batch);
    CYDNN_REQUIRE(op, s->num_classes >= 1 && s->num_classes <= CYDNN_LENET_MAX_CLASSES,
                  "num_classes must be in [1, %d], got %d", CYDNN_LENET_MAX_CLASSES, s->num_classes);
    CYDNN_REQUIRE(op, s->images && s->labels && s->order && s->lr_table && s->counters && s->scratch,
                  "a data, table or scratch pointer is NULL");
    CYDNN_REQUIRE(op, s->n_images >= 1 && s->max_shift >= 0 && s->order_stride >= s->batch,
                  "n_images=%d max_shift=%d order_stride=%d batch=%d", s->n_images, s->max_shift,
                  s->order_stride, s->batch);
    CYDNN_REQUIRE(op, s->optimizer >= CYDNN_OPT_SGD && s->optimizer <= CYDNN_OPT_ADAMW,
                  "unknown optimizer %d", s->optimizer);
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) {
        CYDNN_REQUIRE(op, s->param[i] != nullptr && s->grad[i] != nullptr, "parameter %d is NULL", i);
        const bool need1 = s->optimizer != CYDNN_OPT_SGD || s->momentum != 0.0f;
        CYDNN_REQUIRE(op, !need1 || s->state1[i] != nullptr, "optimizer state of parameter %d is NULL", i);
        CYDNN_REQUIRE(op, s->optimizer == CYDNN_OPT_SGD || s->state2[i] != nullptr,
                      "Adam's v of parameter %d is NULL", i);
    }
    return s->classic ? launch_train<true>(ctx, s) : launch_train<false>(ctx, s);
}
