// fused_lenet_layers.cuh -- the layers of the fused LeNet-5 kernels, forward and backward, as
// block-cooperative __device__ functions over the G images of a block.
#pragma once

#include "fused_lenet.cuh"

namespace {

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

}  // namespace
