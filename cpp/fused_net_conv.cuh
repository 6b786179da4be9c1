// fused_net_conv.cuh -- the fused network's per-value helpers (epilogue, distributed stores,
// work shares) and its convolutions, as block-cooperative __device__ functions of one cluster
// (fused_net_layers.cuh's forward_image calls conv_dispatch for a CYDNN_NET_CONV layer).  Included
// through fused_net_layers.cuh, inside its sm_90 guard: clusters and distributed shared memory are sm_90's.
#pragma once

#ifdef __CUDACC_RTC__             // NVRTC, a kernel generated for one network (fused_net_gen.py)
#include "cydnn.h"
#include "fused_net_rtc.cuh"
#else
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;
#endif

// How the kernels read what does not change within a call: weights, biases, batch norm's statistics
// (CYDNN_NET_LDW), and the input image (CYDNN_NET_LDX).  A kernel launched per call reads the former
// through the read-only cache and the latter plainly (fused_net.cu).  The resident kernel
// (fused_net_resident.cu) lives across calls, between which a training step may change the weights
// and the host writes a new image: it defines both before including this header, to loads that
// cannot return a line cached by an earlier call (__ldcg: L2, coherent on the device; __ldcv: fetched
// again from host memory).
#ifndef CYDNN_NET_LDW
#define CYDNN_NET_LDW(p) __ldg(p)
#endif
#ifndef CYDNN_NET_LDX
#define CYDNN_NET_LDX(p) (*(p))
#endif
// The layer functions' qualifiers: a kernel specialised for one network defines it as
// __device__ __forceinline__, so that the shapes it passes as constants reach every loop.
#ifndef CYDNN_NET_FN
#define CYDNN_NET_FN __device__
#endif

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace {

__device__ __forceinline__ float activate(float v, int act, float slope) {
    switch (act) {
        case CYDNN_ACT_RELU: return fmaxf(v, 0.0f);
        case CYDNN_ACT_TANH: return tanhf(v);
        case CYDNN_ACT_SIGMOID: return 1.0f / (1.0f + expf(-v));
        case CYDNN_ACT_LEAKY: return v > 0.0f ? v : v * slope;
        default: return v;
    }
}

// The layer's epilogue on output value v of channel c: bias, then the listed
// steps in order (batch norm with the running statistics, or the activation).
__device__ __forceinline__ float epilogue(const cydnnNetLayer &L, float v, int c) {
    if (L.bias != nullptr) v += CYDNN_NET_LDW(L.bias + c);
    for (int s = 0; s < L.num_epi; ++s) {
        if (L.epi[s] == CYDNN_NET_EPI_BN) {
            const float inv = rsqrtf(CYDNN_NET_LDW(L.bn_var + c) + L.bn_eps);
            v = (v - CYDNN_NET_LDW(L.bn_mean + c)) * inv * CYDNN_NET_LDW(L.bn_weight + c) + CYDNN_NET_LDW(L.bn_bias + c);
        } else {
            v = activate(v, L.act, L.slope);
        }
    }
    return v;
}

// Store v at index i of the next activation in every block of the cluster.
__device__ __forceinline__ void store_all(cg::cluster_group &cluster, float *next, int ranks, long i, float v) {
    for (int r = 0; r < ranks; ++r) cluster.map_shared_rank(next, r)[i] = v;
}

// This block's share [lo, hi) of `items` work items.
__device__ __forceinline__ void share(long items, int rank, int ranks, long &lo, long &hi) {
    const long per = (items + ranks - 1) / ranks;
    lo = per * rank;
    hi = lo + per < items ? lo + per : items;
}

// A tap's TCO staged weights, one float4 of four channels (TCO == 4: the caller's rows are 16-byte aligned).
template <int TCO>
__device__ __forceinline__ void staged4(const float *p, float (&wv)[TCO]) {
    const float4 w4 = *reinterpret_cast<const float4 *>(p);
    wv[0] = w4.x;
    wv[TCO > 1 ? 1 : 0] = w4.y;
    wv[TCO > 2 ? 2 : 0] = w4.z;
    wv[TCO > 3 ? 3 : 0] = w4.w;
}

// Stage the weights of the output channels work items [lo, hi) touch (item / row_items is the
// channel group of tco channels) into wbuf, transposed to [c * kh * kw][channel] with rows of cs
// channels (a multiple of 4: a tap's four channels are one float4), if they fit in wcap floats.
// Returns whether they were staged; c_lo is the first staged channel.  Block-uniform (it syncs).
CYDNN_NET_FN bool stage_weights(const cydnnNetLayer &L, long lo, long hi, long row_items, int tco, int ksize,
                              float *wbuf, long wcap, int &c_lo, int &cs) {
    c_lo = (int)(lo / row_items) * tco;
    const int c_hi_raw = (int)((hi - 1) / row_items + 1) * tco;
    const int c_span = (c_hi_raw < L.k ? c_hi_raw : L.k) - c_lo;
    cs = (c_span + 3) / 4 * 4;
    if ((long)cs * ksize > wcap) return false;
    const float *g = L.weight + (long)c_lo * ksize;
    const int n = c_span * ksize;
    for (int i0 = threadIdx.x; i0 < n; i0 += 4 * blockDim.x) {     // four loads in flight a thread
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = i0 + u * (int)blockDim.x < n ? CYDNN_NET_LDW(g + i0 + u * blockDim.x) : 0.0f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * (int)blockDim.x, co = i / ksize;
            if (i < n) wbuf[(i - co * ksize) * cs + co] = v[u];
        }
    }
    __syncthreads();
    return true;
}

// Convolution: a thread computes TCO output channels x TP output pixels of one row, the pixels
// pxg apart (pxg = ceil(OW / TP)), so that the lanes of a warp read neighbouring inputs (no bank
// conflicts).  The weights of the output channels a block computes are staged in shared memory
// where they fit, transposed to [c * kh * kw][channel] so that a thread's TCO weights of one tap
// are one float4 (the same for the lanes of a warp: a broadcast); else they come through the
// read-only cache in their (k, c, kh, kw) layout.
// KS > 0: a KS x KS kernel known at compile time (the tap loops unroll); 0: any, read from the table.
// STAGED: the caller knows that every block stages its weights (a kernel generated for one network:
// compiler/fused_tiles.py's stages_all computes it as stage_weights does), so the reads through the
// read-only cache are not compiled (NVRTC made a second copy of the inner loop for them).  Were it wrong,
// the block would store nothing and the generated kernel's self-test against the interpreter would refuse it.
template <int TCO, int TP, int KS, bool STAGED = false>
CYDNN_NET_FN void conv_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                           int rank, int ranks, float *wbuf, long wcap) {
    const int C = L.c, H = L.h, W = L.w, K = L.k, OH = L.oh, OW = L.ow;
    const int KH = KS ? KS : L.kh, KW = KS ? KS : L.kw, SH = L.sh, SW = L.sw, PH = L.ph, PW = L.pw;
    const int cog = (K + TCO - 1) / TCO, pxg = (OW + TP - 1) / TP;
    const long row_items = (long)OH * pxg;
    long lo, hi;
    share((long)cog * row_items, rank, ranks, lo, hi);
    if (hi <= lo) return;
    const int ksize = C * KH * KW;
    int c_lo, cs;
    const bool fits = stage_weights(L, lo, hi, row_items, TCO, ksize, wbuf, wcap, c_lo, cs);
    if (STAGED && !fits) return;       // block-uniform (never, where STAGED is right)
    const bool staged = STAGED || fits;
    for (long it = lo + threadIdx.x; it < hi; it += blockDim.x) {
        const int g = (int)(it / row_items);
        const int rest = (int)(it - g * row_items);
        const int oy = rest / pxg, j = rest - oy * pxg;
        float acc[TCO][TP];
#pragma unroll
        for (int a = 0; a < TCO; ++a)
#pragma unroll
            for (int p = 0; p < TP; ++p) acc[a][p] = 0.0f;
        const int co0 = g * TCO;
        const float *wt = wbuf + (co0 - c_lo);                 // staged: tap t's weights at wt[t * cs]
        for (int ci = 0; ci < C; ++ci) {
            const float *plane = in + ci * H * W;
#pragma unroll
            for (int ky = 0; ky < KH; ++ky) {
                const int iy = oy * SH - PH + ky;
                if (iy < 0 || iy >= H) continue;
                const float *row = plane + iy * W;
                const int tap0 = (ci * KH + ky) * KW;
#pragma unroll
                for (int kx = 0; kx < KW; ++kx) {
                    float xv[TP];
#pragma unroll
                    for (int p = 0; p < TP; ++p) {
                        const int ix = (j + p * pxg) * SW - PW + kx;
                        xv[p] = (ix >= 0 && ix < W) ? row[ix] : 0.0f;
                    }
                    float wv[TCO];
                    if (staged && TCO == 4) {
                        staged4(wt + (tap0 + kx) * cs, wv);
                    } else {
#pragma unroll
                        for (int a = 0; a < TCO; ++a)
                            wv[a] = staged ? wt[(tap0 + kx) * cs + a]
                                           : (co0 + a < K ? CYDNN_NET_LDW(L.weight + (long)(co0 + a) * ksize + tap0 + kx)
                                                          : 0.0f);
                    }
#pragma unroll
                    for (int a = 0; a < TCO; ++a)
#pragma unroll
                        for (int p = 0; p < TP; ++p) acc[a][p] = fmaf(wv[a], xv[p], acc[a][p]);
                }
            }
        }
#pragma unroll
        for (int a = 0; a < TCO; ++a) {
            const int co = co0 + a;
            if (co >= K) break;
#pragma unroll
            for (int p = 0; p < TP; ++p) {
                const int ox = j + p * pxg;
                if (ox < OW) store_all(cluster, next, ranks, ((long)co * OH + oy) * OW + ox, epilogue(L, acc[a][p], co));
            }
        }
    }
}

template <int TCO, int TP>
CYDNN_NET_FN void conv_sized(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                           int rank, int ranks, float *wbuf, long wcap) {
    const int ks = L.kh == L.kw ? L.kh : 0;
    if (ks == 3) conv_layer<TCO, TP, 3>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (ks == 5) conv_layer<TCO, TP, 5>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (ks == 1) conv_layer<TCO, TP, 1>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else conv_layer<TCO, TP, 0>(L, in, next, cluster, rank, ranks, wbuf, wcap);
}

// Convolution for deep layers on small planes (few outputs, long reductions): G lanes of a warp
// share one work item of 4 output channels x 1 pixel, lane l taking the input channels l, l + G,
// ...; a butterfly of shuffles inside the group adds their sums (a fixed order: deterministic).
// The weights are staged as in conv_layer (4-channel rows) or read through the read-only cache
// (STAGED: as conv_layer's).
template <int G, int KS, bool STAGED = false>
CYDNN_NET_FN void conv_split(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                           int rank, int ranks, float *wbuf, long wcap) {
    const int C = L.c, H = L.h, W = L.w, K = L.k, OH = L.oh, OW = L.ow;
    const int KH = KS ? KS : L.kh, KW = KS ? KS : L.kw, SH = L.sh, SW = L.sw, PH = L.ph, PW = L.pw;
    const int cog = (K + 3) / 4;
    const long row_items = (long)OH * OW;
    long lo, hi;
    share((long)cog * row_items, rank, ranks, lo, hi);
    if (hi <= lo) return;
    const int ksize = C * KH * KW;
    int c_lo, cs;
    const bool fits = stage_weights(L, lo, hi, row_items, 4, ksize, wbuf, wcap, c_lo, cs);
    if (STAGED && !fits) return;       // block-uniform (never, where STAGED is right)
    const bool staged = STAGED || fits;
    const int groups = blockDim.x / G, gid = threadIdx.x / G, l = threadIdx.x % G;
    const int warp_gid = (threadIdx.x & ~31) / G;          // the first group of this lane's warp
    // every lane of a warp runs the same number of rounds (the shuffles need them all); a warp whose
    // groups all fall past the block's share stops (warp-uniform)
    for (long base = lo; base < hi; base += groups) {
        if (base + warp_gid >= hi) break;
        const long it = base + gid;
        const bool active = it < hi;
        const long item = active ? it : lo;
        const int g = (int)(item / row_items);
        const int rest = (int)(item - g * row_items);
        const int oy = rest / OW, ox = rest - oy * OW;
        const int co0 = g * 4;
        const float *wt = wbuf + (co0 - c_lo);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int ci = l; ci < (active ? C : 0); ci += G) {     // an idle group only joins the shuffles
            const float *plane = in + ci * H * W;
#pragma unroll
            for (int ky = 0; ky < KH; ++ky) {
                const int iy = oy * SH - PH + ky;
                if (iy < 0 || iy >= H) continue;
                const int tap0 = (ci * KH + ky) * KW;
#pragma unroll
                for (int kx = 0; kx < KW; ++kx) {
                    const int ix = ox * SW - PW + kx;
                    const float x = (ix >= 0 && ix < W) ? plane[iy * W + ix] : 0.0f;
                    float wv[4];
                    if (staged) {
                        staged4(wt + (tap0 + kx) * cs, wv);
                    } else {
#pragma unroll
                        for (int a = 0; a < 4; ++a)
                            wv[a] = co0 + a < K ? CYDNN_NET_LDW(L.weight + (long)(co0 + a) * ksize + tap0 + kx) : 0.0f;
                    }
#pragma unroll
                    for (int a = 0; a < 4; ++a) acc[a] = fmaf(wv[a], x, acc[a]);
                }
            }
        }
#pragma unroll
        for (int off = G / 2; off > 0; off /= 2)
#pragma unroll
            for (int a = 0; a < 4; ++a) acc[a] += __shfl_xor_sync(0xffffffffu, acc[a], off);
        // lane a of the group stores channel co0 + a
        float mine = acc[0];
#pragma unroll
        for (int a = 1; a < 4; ++a)
            if (l == a) mine = acc[a];
        if (active && l < 4 && co0 + l < K)
            store_all(cluster, next, ranks, ((long)(co0 + l) * OH + oy) * OW + ox, epilogue(L, mine, co0 + l));
    }
}

template <int G>
CYDNN_NET_FN void split_sized(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                            int rank, int ranks, float *wbuf, long wcap) {
    const int ks = L.kh == L.kw ? L.kh : 0;
    if (ks == 3) conv_split<G, 3>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (ks == 5) conv_split<G, 5>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (ks == 1) conv_split<G, 1>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else conv_split<G, 0>(L, in, next, cluster, rank, ranks, wbuf, wcap);
}

}  // namespace
#endif  // sm_90

#include "fused_net_wsplit.cuh"   // tile 7: the reduction split between the block's threads (uses conv_layer)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace {

// A convolution layer by its tile code (compiler/fused_net.py's _TILES).  scratch: the layer's input
// buffer where the caller lets conv_wsplit use it (nullptr: it may not; tile 7 is then conv_layer<4, 4>).
CYDNN_NET_FN void conv_dispatch(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                              int rank, int ranks, float *wbuf, long wcap, float *scratch = nullptr,
                              long scratch_cap = 0) {
    if (L.tile == 7) wsplit_sized(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else if (L.tile == 6) split_sized<16>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (L.tile == 5) split_sized<8>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (L.tile == 4) split_sized<4>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (L.tile == 3) conv_sized<4, 4>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (L.tile == 2) conv_sized<4, 1>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else if (L.tile == 1) conv_sized<1, 4>(L, in, next, cluster, rank, ranks, wbuf, wcap);
    else conv_sized<1, 1>(L, in, next, cluster, rank, ranks, wbuf, wcap);
}

}  // namespace
#endif  // sm_90
