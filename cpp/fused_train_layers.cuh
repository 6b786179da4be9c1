// fused_train_layers.cuh -- the backward half of one image's training step, as block-cooperative
// __device__ functions of one thread-block cluster (fused_train.cu's train kernel calls them after the
// forward layers of fused_net_layers.cuh).  Each takes dLoss/d(layer output before its epilogue) `g`
// (every block of the cluster holds all of it), computes its share of dLoss/d(layer input) and stores
// every value into every block of the cluster, like the forward layers.  Formulas and tie rules are
// the per-op path's (pool.cu's max-pool backward: the first maximum of a window, from -inf; average
// pooling counts padding as zeros; act_math.cuh's derivatives in terms of the output).
#pragma once

#include "fused_net_layers.cuh"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace {

__device__ __forceinline__ float act_derivative(float y, int act, float slope) {
    switch (act) {
        case CYDNN_ACT_RELU: return y > 0.0f ? 1.0f : 0.0f;
        case CYDNN_ACT_TANH: return 1.0f - y * y;
        case CYDNN_ACT_SIGMOID: return y * (1.0f - y);
        case CYDNN_ACT_LEAKY: return y > 0.0f ? 1.0f : slope;
        default: return 1.0f;
    }
}

// g[i] *= act'(out[i]) for the layer's activation (if its epilogue has one; the step refuses batch norm),
// every block on all n values (local: nothing to exchange).
__device__ void epilogue_backward(const cydnnNetLayer &L, const float *out, float *g, long n) {
    bool has_act = false;
    for (int s = 0; s < L.num_epi; ++s) has_act |= L.epi[s] == CYDNN_NET_EPI_ACT;
    if (!has_act || L.act == CYDNN_ACT_NONE) return;
    for (long i = threadIdx.x; i < n; i += blockDim.x) g[i] *= act_derivative(out[i], L.act, L.slope);
}

// Linear, y = W x + b: dx[i] = sum_o W[o, i] g[o].  Where the rows are float4-aligned, a warp takes 32
// inputs: lane = (slice, quad), quad the four inputs 4 * quad.. it reads as one float4 of each row, slice
// the rows o = slice (mod 4) it takes, so that the warp reads four rows of 128 bytes at once and a lane
// has eight loads in flight (a one-image backward reads each weight once: bound by the loads' latency),
// then the four slices added by shuffles.  Otherwise a thread per input, the rows read coalesced.
__device__ void linear_backward_input(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                      int rank, int ranks) {
    const int IN = L.c, OUT = L.k;
    long lo, hi;
    if (IN % 4 == 0 && (reinterpret_cast<uintptr_t>(L.weight) & 15) == 0) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
        const int quad = lane % 8, slice = lane / 8;
        share((IN + 31) / 32, rank, ranks, lo, hi);
        for (long chunk = lo + warp; chunk < hi; chunk += warps) {
            const int i = (int)chunk * 32 + 4 * quad;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (i < IN) {
                const float4 *w = reinterpret_cast<const float4 *>(L.weight + i);
#pragma unroll 8
                for (int o = slice; o < OUT; o += 4) {
                    const float4 v = __ldg(w + (long)o * (IN / 4));
                    const float go = g[o];
                    a.x = fmaf(v.x, go, a.x);
                    a.y = fmaf(v.y, go, a.y);
                    a.z = fmaf(v.z, go, a.z);
                    a.w = fmaf(v.w, go, a.w);
                }
            }
            for (int off = 8; off < 32; off *= 2) {
                a.x += __shfl_xor_sync(0xffffffffu, a.x, off);
                a.y += __shfl_xor_sync(0xffffffffu, a.y, off);
                a.z += __shfl_xor_sync(0xffffffffu, a.z, off);
                a.w += __shfl_xor_sync(0xffffffffu, a.w, off);
            }
            if (slice == 0 && i < IN) {
                store_all(cluster, dx, ranks, i, a.x);
                store_all(cluster, dx, ranks, i + 1, a.y);
                store_all(cluster, dx, ranks, i + 2, a.z);
                store_all(cluster, dx, ranks, i + 3, a.w);
            }
        }
        return;
    }
    share(IN, rank, ranks, lo, hi);
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        const float *w = L.weight + i;
        int o = 0;
        for (; o + 4 <= OUT; o += 4) {
            a0 = fmaf(__ldg(w + (long)o * IN), g[o], a0);
            a1 = fmaf(__ldg(w + (long)(o + 1) * IN), g[o + 1], a1);
            a2 = fmaf(__ldg(w + (long)(o + 2) * IN), g[o + 2], a2);
            a3 = fmaf(__ldg(w + (long)(o + 3) * IN), g[o + 3], a3);
        }
        for (; o < OUT; ++o) a0 = fmaf(__ldg(w + (long)o * IN), g[o], a0);
        store_all(cluster, dx, ranks, i, (a0 + a1) + (a2 + a3));
    }
}

// Convolution: dx[c, iy, ix] = sum over k and the taps (ky, kx) that reach (iy, ix) from an output
// position of W[k, c, ky, kx] g[k, oy, ox].  A thread per input value, the output positions bounded
// first (no tap tested in vain).
__device__ void conv_backward_input(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                    int rank, int ranks) {
    const int C = L.c, H = L.h, W = L.w, K = L.k, OH = L.oh, OW = L.ow, KH = L.kh, KW = L.kw;
    const int SH = L.sh, SW = L.sw, PH = L.ph, PW = L.pw;
    long lo, hi;
    share((long)C * H * W, rank, ranks, lo, hi);
    for (long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const int c = (int)(e / (H * W));
        const int rest = (int)(e - (long)c * H * W);
        const int iy = rest / W, ix = rest - (rest / W) * W;
        // oy with 0 <= iy + PH - oy * SH < KH
        const int ty = iy + PH - KH + 1, tx = ix + PW - KW + 1;
        const int oy_lo = ty <= 0 ? 0 : (ty + SH - 1) / SH, ox_lo = tx <= 0 ? 0 : (tx + SW - 1) / SW;
        const int oy_hi = min((iy + PH) / SH, OH - 1), ox_hi = min((ix + PW) / SW, OW - 1);
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            const float *wk = L.weight + ((long)k * C + c) * KH * KW;
            const float *gk = g + (long)k * OH * OW;
            for (int oy = oy_lo; oy <= oy_hi; ++oy) {
                const int ky = iy + PH - oy * SH;
                for (int ox = ox_lo; ox <= ox_hi; ++ox)
                    acc = fmaf(__ldg(wk + ky * KW + (ix + PW - ox * SW)), gk[oy * OW + ox], acc);
            }
        }
        store_all(cluster, dx, ranks, e, acc);
    }
}

// Stage the weights of the input channels that work items [lo, hi) of an input gradient touch (item /
// row_items is the group of tco input channels) into wbuf as [k * kk + tap][channel], rows of cs channels
// (a multiple of 4: a tap's four channels are one float4), if they fit in wcap floats; c_lo is the first
// staged channel.  Returns whether they were staged.  Block-uniform (it syncs when it stages).
__device__ __forceinline__ bool stage_dgrad_weights(const cydnnNetLayer &L, long lo, long hi, long row_items, int tco,
                                                    int kk, float *wbuf, long wcap, int &c_lo, int &cs) {
    const int C = L.c, taps = L.k * kk;          // taps per input channel
    c_lo = (int)(lo / row_items) * tco;
    const int c_hi_raw = (int)((hi - 1) / row_items + 1) * tco;
    const int c_span = (c_hi_raw < C ? c_hi_raw : C) - c_lo;
    cs = (c_span + 3) / 4 * 4;
    if ((long)cs * taps > wcap) return false;
    const int n = c_span * taps;
    for (int i0 = threadIdx.x; i0 < n; i0 += 4 * blockDim.x) {     // four loads in flight a thread
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * (int)blockDim.x;
            const int c = i / taps, t = i - c * taps;            // t = k * kk + tap
            const int k = t / kk, tap = t - k * kk;
            v[u] = i < n ? __ldg(L.weight + ((long)k * C + c_lo + c) * kk + tap) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * (int)blockDim.x, c = i / taps;
            if (i < n) wbuf[(i - c * taps) * cs + c] = v[u];
        }
    }
    __syncthreads();
    return true;
}

// One kernel row (output channel k, row ky) of an input-gradient item: its KS taps over TCO input channels
// (c0..) x TP pixels (pxg apart) of dx's row, from `row` (output channel k's gradient row iy + ph - ky),
// the weights staged at wt + tap * cs (tap0: the row's first tap, (k * KS + ky) * KS) or read from L.weight.
template <int TCO, int TP, int KS>
__device__ __forceinline__ void dgrad_row(const cydnnNetLayer &L, int C, int OW, int PW, const float *row, int j,
                                          int pxg, int k, int ky, int tap0, int c0, const float *wt, int cs,
                                          bool staged, float (&acc)[TCO][TP]) {
#pragma unroll
    for (int kx = 0; kx < KS; ++kx) {
        float gv[TP];
#pragma unroll
        for (int p = 0; p < TP; ++p) {
            const int ox = (j + p * pxg) + PW - kx;
            gv[p] = (ox >= 0 && ox < OW) ? row[ox] : 0.0f;
        }
        float wv[TCO];
        if (staged && TCO == 4) {
            staged4(wt + (tap0 + kx) * cs, wv);
        } else {
#pragma unroll
            for (int a = 0; a < TCO; ++a)
                wv[a] = staged ? wt[(tap0 + kx) * cs + a]
                               : (c0 + a < C ? __ldg(L.weight + ((long)k * C + c0 + a) * (KS * KS) + ky * KS + kx)
                                             : 0.0f);
        }
#pragma unroll
        for (int a = 0; a < TCO; ++a)
#pragma unroll
            for (int p = 0; p < TP; ++p) acc[a][p] = fmaf(wv[a], gv[p], acc[a][p]);
    }
}

// Convolution with stride 1, dx = the correlation of g (padded by kh - 1 - ph, kw - 1 - pw) with the
// flipped kernel: conv_layer's loop (fused_net_conv.cuh) with the roles of the channels swapped -- a
// thread computes TCO input channels x TP pixels of one row, the reduction runs over the output
// channels and taps.  The weights of the block's input channels are staged in shared memory as
// [k * kh * kw][channel] (a float4 of four channels per tap) where they fit in wcap, else read through
// the read-only cache.
template <int TCO, int TP, int KS>
__device__ void conv_backward_input_s1(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                       int rank, int ranks, float *wbuf, long wcap) {
    const int C = L.c, H = L.h, W = L.w, K = L.k, OH = L.oh, OW = L.ow;
    const int KH = KS, KW = KS, PH = L.ph, PW = L.pw;
    const int cig = (C + TCO - 1) / TCO, pxg = (W + TP - 1) / TP;
    const long row_items = (long)H * pxg;
    long lo, hi;
    share((long)cig * row_items, rank, ranks, lo, hi);
    if (hi <= lo) return;
    int c_lo, cs;
    const bool staged = stage_dgrad_weights(L, lo, hi, row_items, TCO, KH * KW, wbuf, wcap, c_lo, cs);
    for (long it = lo + threadIdx.x; it < hi; it += blockDim.x) {
        const int gi = (int)(it / row_items);
        const int rest = (int)(it - gi * row_items);
        const int iy = rest / pxg, j = rest - iy * pxg;
        float acc[TCO][TP];
#pragma unroll
        for (int a = 0; a < TCO; ++a)
#pragma unroll
            for (int p = 0; p < TP; ++p) acc[a][p] = 0.0f;
        const int c0 = gi * TCO;
        const float *wt = wbuf + (c0 - c_lo);
        for (int k = 0; k < K; ++k) {
            const float *plane = g + k * OH * OW;
#pragma unroll
            for (int ky = 0; ky < KH; ++ky) {
                const int oy = iy + PH - ky;
                if (oy < 0 || oy >= OH) continue;
                dgrad_row<TCO, TP, KS>(L, C, OW, PW, plane + oy * OW, j, pxg, k, ky, (k * KH + ky) * KW, c0, wt, cs,
                                       staged, acc);
            }
        }
#pragma unroll
        for (int a = 0; a < TCO; ++a) {
            const int c = c0 + a;
            if (c >= C) break;
#pragma unroll
            for (int p = 0; p < TP; ++p) {
                const int ix = j + p * pxg;
                if (ix < W) store_all(cluster, dx, ranks, ((long)c * H + iy) * W + ix, acc[a][p]);
            }
        }
    }
    if (staged) __syncthreads();     // the staging area is free again for the next layer
}

// conv_backward_input_s1 for layers with few work items (a small image's deep layers: one item of 4
// channels x 4 pixels a thread would leave most of the block idle, and the kernel waits on one warp's
// latency): G lanes of a warp share an item, lane l taking the kernel rows r = k * KS + ky = l, l + G, ...
// (each row's KS taps unrolled; neighbouring rows, so the G lanes read different pixel rows: no bank
// conflicts), then a butterfly of shuffles adds the G partial sums (a fixed order: deterministic) and
// lane l stores the item's values l, l + G, ...  A warp whose groups all fall past the block's share
// skips the round (a warp-uniform test: the shuffles still see every lane of the warps that run).
// Weights staged as in conv_backward_input_s1, or read through the read-only cache.
template <int TCO, int TP, int KS, int G>
__device__ void conv_backward_input_split(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                          int rank, int ranks, float *wbuf, long wcap) {
    constexpr int KK = KS * KS;
    const int C = L.c, H = L.h, W = L.w, K = L.k, OH = L.oh, OW = L.ow, PH = L.ph, PW = L.pw;
    const int cig = (C + TCO - 1) / TCO, pxg = (W + TP - 1) / TP;
    const long row_items = (long)H * pxg;
    long lo, hi;
    share((long)cig * row_items, rank, ranks, lo, hi);
    if (hi <= lo) return;
    int c_lo, cs;
    const bool staged = stage_dgrad_weights(L, lo, hi, row_items, TCO, KK, wbuf, wcap, c_lo, cs);
    const int groups = blockDim.x / G, gid = threadIdx.x / G, l = threadIdx.x % G;
    const int warp_gid = (threadIdx.x & ~31) / G;          // the first group of this lane's warp
    const int rows = K * KS;
    for (long base = lo; base < hi; base += groups) {
        if (base + warp_gid >= hi) break;                 // the whole warp is idle from here on
        const long it = base + gid;
        const bool active = it < hi;
        const long item = active ? it : lo;
        const int gi = (int)(item / row_items);
        const int rest = (int)(item - gi * row_items);
        const int iy = rest / pxg, j = rest - iy * pxg;
        const int c0 = gi * TCO;
        const float *wt = wbuf + (c0 - c_lo);
        float acc[TCO][TP];
#pragma unroll
        for (int a = 0; a < TCO; ++a)
#pragma unroll
            for (int p = 0; p < TP; ++p) acc[a][p] = 0.0f;
        for (int r = l; r < (active ? rows : 0); r += G) {      // an idle group only joins the shuffles
            const int k = r / KS, ky = r - k * KS;
            const int oy = iy + PH - ky;
            if (oy < 0 || oy >= OH) continue;
            dgrad_row<TCO, TP, KS>(L, C, OW, PW, g + ((long)k * OH + oy) * OW, j, pxg, k, ky, r * KS, c0, wt, cs,
                                   staged, acc);
        }
#pragma unroll
        for (int off = G / 2; off > 0; off /= 2)
#pragma unroll
            for (int a = 0; a < TCO; ++a)
#pragma unroll
                for (int p = 0; p < TP; ++p) acc[a][p] += __shfl_xor_sync(0xffffffffu, acc[a][p], off);
#pragma unroll
        for (int a = 0; a < TCO; ++a)
#pragma unroll
            for (int p = 0; p < TP; ++p) {
                const int c = c0 + a, ix = j + p * pxg;
                if ((a * TP + p) % G == l && active && c < C && ix < W)
                    store_all(cluster, dx, ranks, ((long)c * H + iy) * W + ix, acc[a][p]);
            }
    }
    if (staged) __syncthreads();     // the staging area is free again for the next layer
}

// The lanes that share an item of conv_backward_input_split: the most (up to 16) that leave every
// block's share of the items one round of the block's threads; 1 (conv_backward_input_s1) where even
// two lanes an item would not.
__device__ __forceinline__ int dgrad_lanes(const cydnnNetLayer &L, int ranks) {
    const long items = (long)((L.c + 3) / 4) * L.h * ((L.w + 3) / 4);
    const long per_block = (items + ranks - 1) / ranks;
    for (int G = 16; G >= 2; G /= 2)
        if (per_block * G <= (long)blockDim.x && G <= L.k * L.kh) return G;
    return 1;
}

template <int KS>
__device__ void conv_backward_input_sized(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                          int rank, int ranks, float *wbuf, long wcap) {
    switch (dgrad_lanes(L, ranks)) {
        case 16: conv_backward_input_split<4, 4, KS, 16>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
        case 8: conv_backward_input_split<4, 4, KS, 8>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
        case 4: conv_backward_input_split<4, 4, KS, 4>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
        case 2: conv_backward_input_split<4, 4, KS, 2>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
        default: conv_backward_input_s1<4, 4, KS>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
    }
}

__device__ void conv_backward_input_any(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                        int rank, int ranks, float *wbuf, long wcap) {
    if (L.sh == 1 && L.sw == 1 && L.kh == L.kw) {
        switch (L.kh) {
            case 1: conv_backward_input_sized<1>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
            case 3: conv_backward_input_sized<3>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
            case 5: conv_backward_input_sized<5>(L, g, dx, cluster, rank, ranks, wbuf, wcap); return;
            default: break;
        }
    }
    conv_backward_input(L, g, dx, cluster, rank, ranks);
}

// Max pooling (pool.cu's max_pool_backward_kernel): each input value gathers g of the windows whose
// first maximum it is.  Average pooling: g / (kh * kw) of every window that covers it.
__device__ void pool_backward_input(const cydnnNetLayer &L, const float *in, const float *g, float *dx,
                                    cg::cluster_group &cluster, int rank, int ranks, bool is_max) {
    const int H = L.h, W = L.w, OH = L.oh, OW = L.ow, KH = L.kh, KW = L.kw;
    const int SH = L.sh, SW = L.sw, PH = L.ph, PW = L.pw;
    const float inv = 1.0f / (float)(KH * KW);
    long lo, hi;
    if (SH == KH && SW == KW && PH == 0 && PW == 0 && OH * KH == H && OW * KW == W) {
        // windows that tile the input (LeNet's 2x2, stride 2): each input is in exactly one window, so a
        // thread per window scans it once (the same first maximum) and writes all its inputs
        share((long)L.c * OH * OW, rank, ranks, lo, hi);
        for (long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
            const int c = (int)(e / (OH * OW));
            const int rest = (int)(e - (long)c * OH * OW);
            const int oy = rest / OW, ox = rest - (rest / OW) * OW;
            const long base = (long)c * H * W + (long)oy * KH * W + ox * KW;
            const float gv = g[e];
            int best_at = 0;
            if (is_max) {
                float best = -INFINITY;
                for (int yy = 0; yy < KH; ++yy)
                    for (int xx = 0; xx < KW; ++xx) {
                        const float v = in[base + yy * W + xx];
                        if (v > best) {
                            best = v;
                            best_at = yy * KW + xx;
                        }
                    }
            }
            for (int yy = 0; yy < KH; ++yy)
                for (int xx = 0; xx < KW; ++xx)
                    store_all(cluster, dx, ranks, base + yy * W + xx,
                              is_max ? (yy * KW + xx == best_at ? gv : 0.0f) : gv * inv);
        }
        return;
    }
    share((long)L.c * H * W, rank, ranks, lo, hi);
    for (long e = lo + threadIdx.x; e < hi; e += blockDim.x) {
        const int c = (int)(e / (H * W));
        const int rest = (int)(e - (long)c * H * W);
        const int iy = rest / W, ix = rest - (rest / W) * W;
        const float *plane = in + (long)c * H * W;
        const float *gp = g + (long)c * OH * OW;
        const int ty = iy + PH - KH + 1, tx = ix + PW - KW + 1;
        const int oy_lo = ty <= 0 ? 0 : (ty + SH - 1) / SH, ox_lo = tx <= 0 ? 0 : (tx + SW - 1) / SW;
        const int oy_hi = min((iy + PH) / SH, OH - 1), ox_hi = min((ix + PW) / SW, OW - 1);
        float grad = 0.0f;
        for (int oy = oy_lo; oy <= oy_hi; ++oy) {
            const int y0 = oy * SH - PH;
            const int ys = max(y0, 0), ye = min(y0 + KH, H);
            for (int ox = ox_lo; ox <= ox_hi; ++ox) {
                if (!is_max) {
                    grad += gp[oy * OW + ox] * inv;
                    continue;
                }
                const int x0 = ox * SW - PW;
                const int xs = max(x0, 0), xe = min(x0 + KW, W);
                float best = -INFINITY;
                int by = ys, bx = xs;
                for (int yy = ys; yy < ye; ++yy)
                    for (int xx = xs; xx < xe; ++xx) {
                        const float v = plane[yy * W + xx];
                        if (v > best) {
                            best = v;
                            by = yy;
                            bx = xx;
                        }
                    }
                if (by == iy && bx == ix) grad += gp[oy * OW + ox];
            }
        }
        store_all(cluster, dx, ranks, e, grad);
    }
}

// Global average pooling: every value of plane c gets g[c] / (h * w).  An epilogue-only layer: dx = g.
__device__ void spread_backward_input(const cydnnNetLayer &L, const float *g, float *dx, cg::cluster_group &cluster,
                                      int rank, int ranks) {
    const long inner = (long)L.h * L.w;
    const bool gap = L.op == CYDNN_NET_GLOBAL_AVG_POOL;
    long lo, hi;
    share((long)L.c * inner, rank, ranks, lo, hi);
    for (long e = lo + threadIdx.x; e < hi; e += blockDim.x)
        store_all(cluster, dx, ranks, e, gap ? g[e / inner] / (float)inner : g[e]);
}

__device__ void layer_backward_input(const cydnnNetLayer &L, const float *in, const float *g, float *dx,
                                     cg::cluster_group &cluster, int rank, int ranks, float *wbuf, long wcap) {
    switch (L.op) {
        case CYDNN_NET_CONV: conv_backward_input_any(L, g, dx, cluster, rank, ranks, wbuf, wcap); break;
        case CYDNN_NET_LINEAR: linear_backward_input(L, g, dx, cluster, rank, ranks); break;
        case CYDNN_NET_MAX_POOL: pool_backward_input(L, in, g, dx, cluster, rank, ranks, true); break;
        case CYDNN_NET_AVG_POOL: pool_backward_input(L, in, g, dx, cluster, rank, ranks, false); break;
        default: spread_backward_input(L, g, dx, cluster, rank, ranks); break;
    }
}

// Softmax cross-entropy of one image's logits z (n values), as loss.cu's rows kernel: every block of
// the cluster writes g = (softmax(z) - onehot(label)) / batch into its own g (NaN for a label out of
// range); rank 0 also writes the logits and the image's loss.  red: 32 floats of shared memory.
__device__ void loss_backward(const float *z, long n, int label, int batch, float *g, float *logits_out,
                              float *row_loss, bool writer, float *red) {
    float m, s;
    softmax_stats(z, n, red, m, s);
    const bool good = label >= 0 && label < n;
    const float nb = (float)batch;
    for (long i = threadIdx.x; i < n; i += blockDim.x) {
        g[i] = good ? (expf(z[i] - m) / s - (i == label ? 1.0f : 0.0f)) / nb : __int_as_float(0x7fc00000);
        if (writer) logits_out[i] = z[i];
    }
    if (writer && threadIdx.x == 0) *row_loss = good ? logf(s) - (z[label] - m) : __int_as_float(0x7fc00000);
    __syncthreads();
}

}  // namespace
#endif  // sm_90
