// fused_net_wsplit.cuh -- the fused network's convolution tile 7 (conv_wsplit): the reduction of a
// block's few work items split between its threads, and, where the table folds it in (L.pool), the
// 2x2 stride-2 pooling after the convolution's epilogue.  Included by fused_net_conv.cuh (it falls
// back to conv_layer), inside the same sm_90 guard.
#pragma once

// The threads of a fused-network block (fused_net.cu's kNetThreads, fused_net_resident.cu's kThreads, the
// generated kernels' launch bounds: each uses or asserts it): a constant, so that in a kernel generated for
// one network the ways below are one too, and the paths a layer does not take are compiled out.
constexpr int kWsplitThreads = 512;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace {

// The ways conv_wsplit splits a block's reduction, for work items of `per` a block: as many as the
// input channels, the threads (one work item and one way a thread) and the scratch (16 partial sums a
// work item and way) allow; below 2, none.  compiler/fused_net.py's _wsplit_ways computes the same number.
__device__ __forceinline__ int wsplit_ways(int channels, long per, int threads, long scratch_cap) {
    if (per < 1) return 0;
    long ways = threads / per;
    if (ways > channels) ways = channels;
    if (ways > scratch_cap / (16 * per)) ways = scratch_cap / (16 * per);
    return ways >= 2 ? (int)ways : 0;
}

// The 4 output channels co0.. of one tap of input channel ci: staged (wt != nullptr; STAGED: always), or through the
// read-only cache, zeros past the layer's K channels.
template <bool STAGED>
__device__ __forceinline__ void tap_weights(const cydnnNetLayer &L, int K, const float *wt, int cs, int wci0, int co0,
                                            int ci, int kk, long ksize, int tap, float (&wv)[4]) {
    if (STAGED || wt != nullptr) {
        staged4<4>(wt + ((ci - wci0) * kk + tap) * cs, wv);
    } else {
#pragma unroll
        for (int a = 0; a < 4; ++a)
            wv[a] = co0 + a < K ? CYDNN_NET_LDW(L.weight + (long)(co0 + a) * ksize + (long)ci * kk + tap) : 0.0f;
    }
}

// One work item's 4 channels x 4 pixels over the input channels ci0, ci0 + step, ... < ci1, added to acc.
// The pixels: POOL == 0, row oy, columns ox0 + p * pxg (pxg apart: the lanes of a warp, on neighbouring
// ox0, read neighbouring inputs); POOL != 0, the 2x2 window at (oy, ox0): pixel p at (oy + p / 2, ox0 + p % 2).
// Weights: staged (wt != nullptr: tap t of input channel ci at wt[((ci - wci0) * kh * kw + t) * cs]) or
// read through the read-only cache (STAGED: always staged, the latter not compiled).  POOL with a 3x3 kernel at
// stride 1 (the zoo's CNN): the window's 4x4 input patch is loaded into registers once an input channel and each
// tap reads its pixels there -- 16 shared-memory loads a channel instead of 36, the same products in the same
// order (the same bits).  benchmarks/dev/wsplit_pairs.cu, H100, session 35, one layer of one image on 16 blocks:
// 3->24 on 32x32 6.18 -> 5.48 us, 24->48 on 16x16 8.73 -> 6.7, 48->96 on 8x8 9.33 -> 7.58, 20->20 on 16x16
// 6.96 -> 5.78 (a lane-pair layout against bank conflicts, measured there too, gained 0.3-0.9 us on wide planes,
// lost on 8x8, and lost to this everywhere).
template <int KS, int POOL, bool STAGED = false>
__device__ __forceinline__ void wsplit_sums(const cydnnNetLayer &L, const float *in, int ci0, int ci1, int step,
                                            int oy, int ox0, int pxg, const float *wt, int cs, int wci0, int co0,
                                            float (&acc)[4][4]) {
    const int H = L.h, W = L.w, K = L.k, SH = L.sh, SW = L.sw, PH = L.ph, PW = L.pw;
    const int KH = KS ? KS : L.kh, KW = KS ? KS : L.kw, kk = KH * KW;
    const long ksize = (long)L.c * kk;
    if constexpr (POOL != 0 && KS == 3) {
        if (SH == 1 && SW == 1) {   // the window's 4x4 input patch, loaded once an input channel: 16 loads, not 36
            for (int ci = ci0; ci < ci1; ci += step) {
                const float *plane = in + ci * H * W;
                float patch[4][4];
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int y = oy - PH + r, ix = ox0 - PW + c;
                        patch[r][c] = (y >= 0 && y < H && ix >= 0 && ix < W) ? plane[y * W + ix] : 0.0f;
                    }
#pragma unroll
                for (int tap = 0; tap < 9; ++tap) {
                    float wv[4];
                    tap_weights<STAGED>(L, K, wt, cs, wci0, co0, ci, kk, ksize, tap, wv);
#pragma unroll
                    for (int a = 0; a < 4; ++a)
#pragma unroll
                        for (int p = 0; p < 4; ++p)   // tap (ky, kx), pixel p: patch row p / 2 + ky, column p % 2 + kx
                            acc[a][p] = fmaf(wv[a], patch[p / 2 + tap / 3][p % 2 + tap % 3], acc[a][p]);
                }
            }
            return;
        }
    }
    for (int ci = ci0; ci < ci1; ci += step) {
        const float *plane = in + ci * H * W;
#pragma unroll
        for (int ky = 0; ky < KH; ++ky) {
            int iy[2];
            iy[0] = oy * SH - PH + ky;
            iy[1] = (oy + 1) * SH - PH + ky;
            if (!POOL && (iy[0] < 0 || iy[0] >= H)) continue;
#pragma unroll
            for (int kx = 0; kx < KW; ++kx) {
                float xv[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const int y = POOL ? iy[p / 2] : iy[0];
                    const int ix = (POOL ? ox0 + p % 2 : ox0 + p * pxg) * SW - PW + kx;
                    xv[p] = (y >= 0 && y < H && ix >= 0 && ix < W) ? plane[y * W + ix] : 0.0f;
                }
                const int tap = ky * KW + kx;
                float wv[4];
                tap_weights<STAGED>(L, K, wt, cs, wci0, co0, ci, kk, ksize, tap, wv);
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int p = 0; p < 4; ++p) acc[a][p] = fmaf(wv[a], xv[p], acc[a][p]);
            }
        }
    }
}

// A 2x2 window's 4 sums s[0..3] (row by row) of channel co after the epilogue, max- or average-pooled as
// pool_layer pools them (the same order and operations: the same bits as the two layers unfolded).
template <int POOL>
__device__ __forceinline__ float pool4(const cydnnNetLayer &L, const float (&s)[4], int co) {
    float v = POOL == CYDNN_NET_MAX_POOL ? -INFINITY : 0.0f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const float e = epilogue(L, s[p], co);
        if (POOL == CYDNN_NET_MAX_POOL) {
            if (e > v) v = e;
        } else {
            v += e;
        }
    }
    return POOL == CYDNN_NET_MAX_POOL ? v : v / 4.0f;
}

// Tile 7 with a pooling folded in and one way (no scratch: the fused training step; or too many work
// items a block): each thread a whole 2x2 window of 4 channels, weights through the read-only cache.
template <int KS, int POOL>
__device__ __forceinline__ void one_way_pooled(const cydnnNetLayer &L, const float *in, float *next,
                                               cg::cluster_group &cluster, int ranks, long lo, long hi, int QH,
                                               int QW, int pxg, long row_items) {
    for (long it = lo + threadIdx.x; it < hi; it += blockDim.x) {
        const int g = (int)(it / row_items), rest = (int)(it - g * row_items);
        const int py = rest / pxg, px = rest - py * pxg, co0 = g * 4;
        float acc[4][4] = {};
        wsplit_sums<KS, POOL>(L, in, 0, L.c, 1, 2 * py, 2 * px, 0, nullptr, 0, 0, co0, acc);
#pragma unroll
        for (int a = 0; a < 4; ++a)
            if (co0 + a < L.k)
                store_all(cluster, next, ranks, ((long)(co0 + a) * QH + py) * QW + px, pool4<POOL>(L, acc[a], co0 + a));
    }
}

// Tile 7 with a 2x2 pooling folded in, on lane pairs: a work item is 8 output channels x one window, and two
// threads take it, thread dx the window's column dx of both rows, so that a warp's lanes read consecutive columns;
// the upper half-warp loads the window's rows in the other order and a select puts them back.  It runs on planes of
// kWpairsMinWidth columns or more, where it beats the 4x4 patch of wsplit_sums: session 36, the CNN's generated
// kernel (benchmarks/fused_net_phases.py --headers, one process), conv1 (3 -> 24 on 32x32) 3.39 us against 4.00
// and the whole kernel 23.5 against 23.9 us queued, the same bits.  On narrower planes the patch measured faster
// (session 35, benchmarks/dev/wsplit_pairs.cu: 24 -> 48 on 16x16 6.7 against 7.8 us, 48 -> 96 on 8x8 7.6 against 9.6).
// The sums' order is a way's input channels s, s + S, ... of the layer, taps, then the ways in order: tile 7's
// where both split the reduction the same S ways (the same bits).  Returns false, having done nothing
// (block-uniform), where it cannot run: fewer than 2 ways, or the block's weights do not stage; tile 7 then runs.
constexpr int kWpairsMinWidth = 32;

struct WpairsGeo {
    int QH, QW, row_items, tpw, S, n_items, c_lo, c_span, cs, chunk;
    long lo;
};

__device__ __forceinline__ WpairsGeo wpairs_geo(const cydnnNetLayer &L, int rank, int ranks, long wcap,
                                                long scratch_cap) {
    WpairsGeo g;
    g.QH = L.oh / 2, g.QW = L.ow / 2;
    g.row_items = g.QH * g.QW;
    const long items = (long)((L.k + 7) / 8) * g.row_items;
    const long per = (items + ranks - 1) / ranks;
    g.tpw = (int)(2 * per);
    long S = g.tpw > 0 ? kWsplitThreads / g.tpw : 0;
    if (S > L.c) S = L.c;
    if (g.tpw > 0 && S > scratch_cap / (16L * g.tpw)) S = scratch_cap / (16L * g.tpw);
    g.S = S >= 2 ? (int)S : 0;
    g.lo = per * rank;
    const long hi = g.lo + per < items ? g.lo + per : items;
    g.n_items = hi > g.lo ? (int)(hi - g.lo) : 0;
    g.c_lo = (int)(g.lo / g.row_items) * 8;
    const int c_hi = g.n_items > 0 ? (int)((hi - 1) / g.row_items + 1) * 8 : g.c_lo;
    g.c_span = (c_hi < L.k ? c_hi : L.k) - g.c_lo;
    g.cs = (g.c_span + 7) / 8 * 8;                           // rows of 8 channels: a tap's two float4
    // Whether the weights stage is decided for the whole cluster, on the widest row any block can have (its items
    // spanning ceil(per / row_items) + 1 groups of 8): were it decided block by block, a block that stages would
    // take the pairs' share of the work items and one that does not tile 7's other share -- outputs computed twice
    // or never.
    const long kk = (long)L.kh * L.kw;
    const long widest = ((per + g.row_items - 1) / g.row_items + 1) * 8;
    const long rows = widest < ((L.k + 7) / 8) * 8 ? widest : ((L.k + 7) / 8) * 8;
    const long fit = rows * kk > 0 ? wcap / (rows * kk) : 0;
    g.chunk = fit <= 0 ? 0 : (fit < L.c ? (int)fit : L.c);   // 0: the weights do not stage (in no block)
    return g;
}

template <int KS, int POOL, bool STAGED = false>
__device__ __forceinline__ bool conv_wpairs(const cydnnNetLayer &L, const float *in, float *next,
                                            cg::cluster_group &cluster, int rank, int ranks, float *wbuf, long wcap,
                                            float *scratch, long scratch_cap) {
    const int C = L.c, H = L.h, W = L.w, K = L.k, PH = L.ph, PW = L.pw;
    const int KH = KS ? KS : L.kh, KW = KS ? KS : L.kw, kk = KH * KW, ksize = C * kk;
    const WpairsGeo g = wpairs_geo(L, rank, ranks, wcap, scratch_cap);
    if (g.S == 0 || g.chunk == 0) return false;   // block-uniform: tile 7's layout runs (STAGED: nothing; self-test)
    if (g.n_items == 0) return true;                           // nothing for this block
    const int t = threadIdx.x, i = t % g.tpw, s = t / g.tpw, m = i / 2, dx = i % 2, swap = (t >> 4) & 1;
    const bool active = s < g.S && m < g.n_items;
    const long item = g.lo + (active ? m : 0);
    const int grp = (int)(item / g.row_items), rest = (int)(item - (long)grp * g.row_items);
    const int wy = rest / g.QW, wx = rest - wy * g.QW, co0 = grp * 8;
    float acc[8][2];
#pragma unroll
    for (int a = 0; a < 8; ++a) acc[a][0] = acc[a][1] = 0.0f;
    for (int c0 = 0; c0 < C; c0 += g.chunk) {
        const int c1 = c0 + g.chunk < C ? c0 + g.chunk : C;
        if (c0 > 0) __syncthreads();                           // the last chunk's weights are read
        const int row = (c1 - c0) * kk, n = g.cs * row;        // [c_lo, c_lo + cs) x [c0, c1) as [tap][cs],
        for (int e = t; e < n; e += blockDim.x) {              // zeros past the layer's channels
            const int co = e / row, r = e - co * row;
            wbuf[r * g.cs + co] =
                co < g.c_span ? CYDNN_NET_LDW(L.weight + (long)(g.c_lo + co) * ksize + (long)c0 * kk + r) : 0.0f;
        }
        __syncthreads();
        if (!active) continue;
        for (int ci = c0 + (s - c0 % g.S + g.S) % g.S; ci < c1; ci += g.S) {   // the layer's s, s + S, ...
            const float *plane = in + ci * H * W;
#pragma unroll
            for (int ky = 0; ky < KH; ++ky) {
#pragma unroll
                for (int kx = 0; kx < KW; ++kx) {
                    const float *wp = wbuf + ((ci - c0) * kk + ky * KW + kx) * g.cs + (co0 - g.c_lo);
                    const float4 wa = *reinterpret_cast<const float4 *>(wp);
                    const float4 wb = *reinterpret_cast<const float4 *>(wp + 4);
                    const float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
                    const int x = (2 * wx + dx) * L.sw - PW + kx;
                    const int ya = (2 * wy + swap) * L.sh - PH + ky, yb = (2 * wy + 1 - swap) * L.sh - PH + ky;
                    const bool xin = x >= 0 && x < W;
                    const float va = xin && ya >= 0 && ya < H ? plane[ya * W + x] : 0.0f;   // loaded first
                    const float vb = xin && yb >= 0 && yb < H ? plane[yb * W + x] : 0.0f;
                    const float x0 = swap ? vb : va, x1 = swap ? va : vb;                  // the window's rows
#pragma unroll
                    for (int a = 0; a < 8; ++a) {
                        acc[a][0] = fmaf(w[a], x0, acc[a][0]);
                        acc[a][1] = fmaf(w[a], x1, acc[a][1]);
                    }
                }
            }
        }
    }
    __syncthreads();                                           // every thread has read `in`: it is scratch now
    if (active) {
#pragma unroll
        for (int a = 0; a < 8; ++a)
#pragma unroll
            for (int r = 0; r < 2; ++r) scratch[((long)s * 16 + a * 2 + r) * g.tpw + i] = acc[a][r];
    }
    __syncthreads();
    for (int o = t; o < g.n_items * 8; o += blockDim.x) {
        const int v = o / g.n_items, mm = o - v * g.n_items;   // channel v of the block's work item mm
        const long it2 = g.lo + mm;
        const int gm = (int)(it2 / g.row_items), rm = (int)(it2 - (long)gm * g.row_items);
        const int ym = rm / g.QW, xm = rm - ym * g.QW, co = gm * 8 + v;
        if (co >= K) continue;
        float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};             // the window's pixels row by row: (q / 2, q % 2)
#pragma unroll 4
        for (int w = 0; w < g.S; ++w)
#pragma unroll
            for (int q = 0; q < 4; ++q) sums[q] += scratch[((long)w * 16 + v * 2 + q / 2) * g.tpw + 2 * mm + q % 2];
        store_all(cluster, next, ranks, ((long)co * g.QH + ym) * g.QW + xm, pool4<POOL>(L, sums, co));
    }
    return true;
}

// Tile 7: a thread computes 4 output channels x 4 pixels over the input channels s, s + S, s + 2S, ...
// of its way s of S; the block's S partial tiles of a work item are then added in way order
// (deterministic) through `scratch` -- the layer's input buffer, which nobody reads once every thread
// of the block has passed the barrier after the sums, and which no other block writes before the
// cluster barrier at the layer's end -- and stored.  The weights of the block's output channels are
// staged in chunks of input channels, as many as wcap holds (none: read through the read-only cache).
// POOL (CYDNN_NET_MAX_POOL / _AVG_POOL): a work item is a 2x2 window of the convolution's outputs, pooled
// after the epilogue, so that only the pooled values go to the cluster's blocks (the broadcast, not the
// arithmetic, bounds a one-image layer: docs/performance.md, session 25).  Without scratch (the fused
// training step) or with fewer than 2 ways: one way, a work item's whole reduction a thread (POOL == 0:
// conv_layer<4, 4>, which is that).  SPLIT: the caller knows the ways are 2 or more (a kernel generated for
// one network: compiler/fused_net_gen.py computes them as wsplit_ways does), so the one-way paths are not
// compiled at all (they were a third of NVRTC's time for such a kernel).  Were it wrong, no thread would be
// active and the generated kernel's self-test against the interpreter would refuse it.  STAGED: the caller
// knows that every block stages at least one input channel's weights a chunk (fit > 0: compiler/fused_tiles.py's
// stages_all), so the split path's reads through the read-only cache are not compiled (NVRTC made a second
// copy of wsplit_sums' loop for them); were it wrong, the block would store nothing, and the self-test refuse it.
template <int KS, int POOL, bool SPLIT = false, bool STAGED = false>
CYDNN_NET_FN void conv_wsplit(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                            int rank, int ranks, float *wbuf, long wcap, float *scratch, long scratch_cap) {
    if constexpr (POOL != 0) {                                 // lane pairs on wide planes, where they run
        if (scratch != nullptr && L.w >= kWpairsMinWidth &&
            conv_wpairs<KS, POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap))
            return;
    }
    const int C = L.c, K = L.k, OH = L.oh, OW = L.ow;
    const int KH = KS ? KS : L.kh, KW = KS ? KS : L.kw, kk = KH * KW, ksize = C * kk;
    const int QH = POOL ? OH / 2 : OH, QW = POOL ? OW / 2 : OW;       // the stored plane
    const int cog = (K + 3) / 4, pxg = POOL ? QW : (OW + 3) / 4;     // work items a row
    const long row_items = (long)QH * pxg, items = (long)cog * row_items;
    const long per = (items + ranks - 1) / ranks;
    const int S = scratch == nullptr ? 0 : wsplit_ways(C, per, kWsplitThreads, scratch_cap);
    if constexpr (!SPLIT && !POOL) {
        if (S == 0) {
            conv_layer<4, 4, KS>(L, in, next, cluster, rank, ranks, wbuf, wcap);
            return;
        }
    }
    long lo, hi;
    share(items, rank, ranks, lo, hi);
    if (hi <= lo) return;                                      // block-uniform
    if constexpr (!SPLIT && POOL) {
        if (S == 0) {                                          // POOL, one way: no scratch, no staging
            one_way_pooled<KS, POOL>(L, in, next, cluster, ranks, lo, hi, QH, QW, pxg, row_items);
            return;
        }
    }
    const int n_items = (int)(hi - lo);
    const int c_lo = (int)(lo / row_items) * 4;
    const int c_hi_raw = (int)((hi - 1) / row_items + 1) * 4;
    const int c_span = (c_hi_raw < K ? c_hi_raw : K) - c_lo;
    const int cs = (c_span + 3) / 4 * 4;
    const long fit = wcap / ((long)cs * kk);                   // input channels a chunk of staged weights holds
    const int chunk = fit <= 0 ? C : (fit < C ? (int)fit : C);
    if constexpr (STAGED) {
        if (fit <= 0) return;                                  // block-uniform (never, where STAGED is right)
    }
    const int i = (int)(threadIdx.x % per), s = (int)(threadIdx.x / per);   // blockDim.x == kWsplitThreads
    const bool active = s < S && i < n_items;
    const long it = lo + (active ? i : 0);
    const int g = (int)(it / row_items), rest = (int)(it - g * row_items);
    const int y0 = rest / pxg, j = rest - y0 * pxg, co0 = g * 4;
    float acc[4][4] = {};
    for (int c0 = 0; c0 < C; c0 += chunk) {
        const int c1 = c0 + chunk < C ? c0 + chunk : C;
        if (STAGED || fit > 0) {                               // stage [c_lo, c_lo + c_span) x [c0, c1) as [tap][cs]
            if (c0 > 0) __syncthreads();                       // the last chunk's weights are read
            const int row = (c1 - c0) * kk, n = c_span * row;
            for (int e = threadIdx.x; e < n; e += blockDim.x) {
                const int co = e / row, r = e - co * row;
                wbuf[r * cs + co] = CYDNN_NET_LDW(L.weight + (long)(c_lo + co) * ksize + (long)c0 * kk + r);
            }
            __syncthreads();
        }
        if (active)
            wsplit_sums<KS, POOL, STAGED>(L, in, c0 + s, c1, S, POOL ? 2 * y0 : y0, POOL ? 2 * j : j, pxg,
                                          STAGED || fit > 0 ? wbuf + (co0 - c_lo) : nullptr, cs, c0, co0, acc);
    }
    __syncthreads();                                           // every thread has read `in`: it is scratch now
    if (active) {
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int p = 0; p < 4; ++p) scratch[((long)s * 16 + a * 4 + p) * per + i] = acc[a][p];
    }
    __syncthreads();
    const int values = POOL ? 4 : 16;                          // stored a work item: channels (x pixels)
    for (int o = threadIdx.x; o < n_items * values; o += blockDim.x) {
        const int v = o / n_items, m = o - v * n_items;       // value v of the block's work item m
        const long item = lo + m;
        const int gm = (int)(item / row_items), rm = (int)(item - gm * row_items);
        const int ym = rm / pxg, jm = rm - ym * pxg;
        if (POOL) {
            const int co = gm * 4 + v;
            if (co >= K) continue;
            // the S ways added in way order, each of the 4 sums apart (the same order as one sum at a time); the ways'
            // loop held to 4 a round: S is a constant in a generated kernel, fully unrolled it was 13 % of the CNN's
            // SASS and of NVRTC's time
            float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
            for (int w = 0; w < S; ++w)
#pragma unroll
                for (int p = 0; p < 4; ++p) sums[p] += scratch[((long)w * 16 + v * 4 + p) * per + m];
            store_all(cluster, next, ranks, ((long)co * QH + ym) * QW + jm, pool4<POOL>(L, sums, co));
        } else {
            const int co = gm * 4 + v / 4, ox = jm + (v % 4) * pxg;
            if (co >= K || ox >= OW) continue;
            float sum = 0.0f;
#pragma unroll 4
            for (int w = 0; w < S; ++w) sum += scratch[((long)w * 16 + v) * per + m];
            store_all(cluster, next, ranks, ((long)co * OH + ym) * OW + ox, epilogue(L, sum, co));
        }
    }
}

template <int POOL>
CYDNN_NET_FN void wsplit_pooled(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                              int rank, int ranks, float *wbuf, long wcap, float *scratch, long scratch_cap) {
    const int ks = L.kh == L.kw ? L.kh : 0;
    if (ks == 3) conv_wsplit<3, POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else if (ks == 5) conv_wsplit<5, POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else if (ks == 1) conv_wsplit<1, POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else conv_wsplit<0, POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
}

CYDNN_NET_FN void wsplit_sized(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                             int rank, int ranks, float *wbuf, long wcap, float *scratch, long scratch_cap) {
    if (L.pool == CYDNN_NET_MAX_POOL)
        wsplit_pooled<CYDNN_NET_MAX_POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else if (L.pool == CYDNN_NET_AVG_POOL)
        wsplit_pooled<CYDNN_NET_AVG_POOL>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
    else
        wsplit_pooled<0>(L, in, next, cluster, rank, ranks, wbuf, wcap, scratch, scratch_cap);
}

}  // namespace
#endif  // sm_90
