// benchmarks/dev/wsplit_pairs.cu -- does tile 7 (cpp/fused_net_wsplit.cuh: a one-image convolution with its 2x2 max
// pooling folded in, the reduction split S ways between a block's threads) get faster when a lane pair shares a
// window? benchmarks/dev/wsplit_banks.py (a CPU model of the loads) says the CNN's 24->48 and 48->96 layers spend
// 5,364 and 4,644 shared-memory wavefronts where the pairs would spend 1,296 and 1,656: a lane's 2x2 window reads
// columns 2j + dx, so a warp's lanes hit half the banks, and rows two apart fall on the same ones.
//
//   today   the library's conv_wsplit<3, max pool, SPLIT, STAGED> (from cpp/, or an older copy with -I first): since
//           session 36 it takes the pairs itself on planes of kWpairsMinWidth (32) columns or more, the 4x4 patch
//           (wsplit_sums) on narrower ones
//   pairs   the library's conv_wpairs at every width: a thread keeps 8 channels x one column (dx) of its window's two
//           rows, its partner the other column, so a warp reads consecutive columns; the upper half-warp loads the
//           window's rows in the other order (rows 2W + W apart: the other banks), a select puts them back.  Two
//           float4 of staged weights a tap.  A way's input channels s, s + S, ... of the layer, taps, then the ways
//           in order: tile 7's order (the same bits) wherever both split the reduction the same S ways and tile 7's
//           chunks of staged weights hold all the channels or a multiple of S (tile 7 restarts at c0 + s each chunk)
//
// One cluster of 16 blocks x 512 threads (one image, as the fused network runs it): every block holds the whole
// input in shared memory; the layer's pooled outputs go to every block (store_all), rank 0 writes them out.  Checks:
// each variant against a double-precision reference (conv + bias + ReLU + 2x2 max pool), and pairs' bits against
// today's where their order agrees.  Times: per layer, (launch of 11 layers - launch of 1) / 10, best of 5 rounds
// of 200.  Exit status: 0 all checks passed, 1 a check failed, 2 a CUDA error.
//
//   INC=$(ls -d build/temp*/cuda_include | head -1)     # the library's build: cudnn/cublas headers for common.cuh
//   nvcc -O3 -std=c++17 -arch=sm_90 -I cpp -I $INC -o /tmp/wsplit_pairs benchmarks/dev/wsplit_pairs.cu && /tmp/wsplit_pairs
//   /tmp/wsplit_pairs --wcap 3456   # another size of staged weights (floats a block; 6912 the default)
//   /tmp/wsplit_pairs --cpu     # the pairs' index math emulated on the host against the reference: runs without a GPU
//
// Session 35, H100, all checks ok (us; today before the 4x4 patch / pairs / today with it, the old headers put
// first with -I): 3->24 on 32x32 6.18 / 5.86 / 5.48, 24->48 on 16x16 8.73 / 7.78 / 6.7, 48->96 on 8x8
// 9.33 / 9.64 / 7.58, 20->20 on 16x16 6.96 / 6.62 / 5.78; with --wcap 3456 (48->96's weights in two chunks) the
// pairs' 48->96 10.2.  Here the patch beat the pairs everywhere; in the CNN's generated kernel (session 36,
// benchmarks/fused_net_phases.py --headers) the pairs won on the 32x32 plane (3.39 against 4.00 us), so the library
// has them there (the pairs' own copy that lived here until then is gone: the pairs column is the library's code).
// The host-side emulation (--cpu) mirrors conv_wpairs' geometry with pair_geo / pair_thread / pair_item.
#include <cooperative_groups.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cydnn.h"
#include "fused_net_conv.cuh"   // conv_wsplit, store_all, pool4, kWsplitThreads (the library's)
#include "dev_util.cuh"

namespace cg = cooperative_groups;

constexpr int kRanks = 16, kThreads = kWsplitThreads;
constexpr long kBuf = 6144;   // the CNN's table at 16 blocks: activation buffers (floats)
static long g_wcap = 6912;    // staged weights (floats): room for 48->96's in one chunk; --wcap N another

// ------------------------------------------------------------------------------------------ the pairs' geometry
// A work item: 8 output channels (two groups of 4) x one 2x2 window; two threads a work item a way (dx = 0, 1).
struct PairGeo {
    int QH, QW, row_items, tpw, S, n_items, c_lo, c_span, cs, chunk, kk;
    long lo;
};

__host__ __device__ inline PairGeo pair_geo(const cydnnNetLayer &L, int rank, int ranks, long wcap, long scratch_cap) {
    PairGeo g;
    g.kk = L.kh * L.kw;
    g.QH = L.oh / 2, g.QW = L.ow / 2;
    g.row_items = g.QH * g.QW;
    const long items = (long)((L.k + 7) / 8) * g.row_items;
    const long per = (items + ranks - 1) / ranks;
    g.tpw = (int)(2 * per);
    long S = kThreads / g.tpw;
    if (S > L.c) S = L.c;
    if (S > scratch_cap / (16L * g.tpw)) S = scratch_cap / (16L * g.tpw);
    g.S = (int)S;
    g.lo = per * rank;
    const long hi = g.lo + per < items ? g.lo + per : items;
    g.n_items = (int)(hi - g.lo);
    g.c_lo = g.n_items > 0 ? (int)(g.lo / g.row_items) * 8 : 0;
    const int c_hi = g.n_items > 0 ? (int)((hi - 1) / g.row_items + 1) * 8 : 0;
    g.c_span = (c_hi < L.k ? c_hi : L.k) - g.c_lo;
    g.cs = (g.c_span + 7) / 8 * 8;                     // rows of 8 channels: a tap's two float4
    const long widest = ((per + g.row_items - 1) / g.row_items + 1) * 8, all = (long)((L.k + 7) / 8) * 8;
    const long fit = wcap / ((widest < all ? widest : all) * g.kk);   // decided for the cluster, as wpairs_geo does
    g.chunk = fit <= 0 ? 0 : (fit < L.c ? (int)fit : L.c);   // 0: does not stage (the dev program refuses it)
    return g;
}

// Thread t's work item m (in the block), column dx, way s, and whether it loads its window's rows swapped.
struct PairThread {
    int m, dx, s, swap;
    bool active;
};

__host__ __device__ inline PairThread pair_thread(const PairGeo &g, int t) {
    PairThread p;
    const int i = t % g.tpw;
    p.s = t / g.tpw, p.m = i / 2, p.dx = i % 2, p.swap = (t >> 4) & 1;
    p.active = p.s < g.S && p.m < g.n_items;
    return p;
}

// Work item m's channel group (of 8), window row and column.
__host__ __device__ inline void pair_item(const PairGeo &g, int m, int &grp, int &wy, int &wx) {
    const long item = g.lo + m;
    grp = (int)(item / g.row_items);
    const int rest = (int)(item - (long)grp * g.row_items);
    wy = rest / g.QW, wx = rest - wy * g.QW;
}

// ------------------------------------------------------------------------------------------ the kernels
// One image: every block loads the whole input; `reps` layers (the same one, a cluster barrier after each, the
// input buffer swapped as the network does: from the second on the values are not checked, only timed).
template <int VARIANT>
__global__ void __launch_bounds__(kThreads, 1) layer_kernel(const cydnnNetLayer L, const float *x, float *y, int reps,
                                                            long wcap) {
    extern __shared__ float4 smem4[];
    float *smem = reinterpret_cast<float *>(smem4);
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), ranks = (int)cluster.num_blocks();
    float *cur = smem, *next = smem + kBuf, *wbuf = smem + 2 * kBuf;
    for (int i = threadIdx.x; i < L.c * L.h * L.w; i += blockDim.x) cur[i] = x[i];
    cluster.sync();
    for (int rep = 0; rep < reps; ++rep) {
        if (VARIANT == 0)
            conv_wsplit<3, CYDNN_NET_MAX_POOL, true, true>(L, cur, next, cluster, rank, ranks, wbuf, wcap, cur, kBuf);
        else
            conv_wpairs<3, CYDNN_NET_MAX_POOL>(L, cur, next, cluster, rank, ranks, wbuf, wcap, cur, kBuf);
        cluster.sync();
        if (rep + 1 < reps) {                                       // the next layer reads what this one wrote
            float *t = cur;
            cur = next;
            next = t;
        }
    }
    if (rank == 0)
        for (int i = threadIdx.x; i < L.k * (L.oh / 2) * (L.ow / 2); i += blockDim.x) y[i] = next[i];
}

// ------------------------------------------------------------------------------------------ host side
struct Case { int c, h, w, k; };

static cydnnNetLayer make_layer(const Case &cs, const float *weight, const float *bias) {
    cydnnNetLayer L;
    std::memset(&L, 0, sizeof(L));
    L.op = CYDNN_NET_CONV, L.tile = 7, L.pool = CYDNN_NET_MAX_POOL;
    L.c = cs.c, L.h = cs.h, L.w = cs.w, L.k = cs.k, L.oh = cs.h, L.ow = cs.w;
    L.kh = L.kw = 3, L.sh = L.sw = 1, L.ph = L.pw = 1;
    L.weight = weight, L.bias = bias;
    L.num_epi = 1, L.epi[0] = CYDNN_NET_EPI_ACT, L.act = CYDNN_ACT_RELU;
    return L;
}

// conv 3x3 (padding 1) + bias + ReLU + 2x2 max pool, in double: (k, h/2, w/2)
static std::vector<double> reference(const Case &cs, const std::vector<float> &x, const std::vector<float> &wt,
                                     const std::vector<float> &b) {
    const int QH = cs.h / 2, QW = cs.w / 2;
    std::vector<double> out((size_t)cs.k * QH * QW);
    for (int k = 0; k < cs.k; ++k)
        for (int qy = 0; qy < QH; ++qy)
            for (int qx = 0; qx < QW; ++qx) {
                double best = -INFINITY;
                for (int p = 0; p < 4; ++p) {
                    const int oy = 2 * qy + p / 2, ox = 2 * qx + p % 2;
                    double s = b[k];
                    for (int c = 0; c < cs.c; ++c)
                        for (int ky = 0; ky < 3; ++ky)
                            for (int kx = 0; kx < 3; ++kx) {
                                const int iy = oy - 1 + ky, ix = ox - 1 + kx;
                                if (iy >= 0 && iy < cs.h && ix >= 0 && ix < cs.w)
                                    s += (double)wt[((k * cs.c + c) * 3 + ky) * 3 + kx] * x[(c * cs.h + iy) * cs.w + ix];
                            }
                    best = std::max(best, std::max(s, 0.0));
                }
                out[((size_t)k * QH + qy) * QW + qx] = best;
            }
    return out;
}

static double max_err(const std::vector<float> &got, const std::vector<double> &want) {
    double e = 0;
    for (size_t i = 0; i < want.size(); ++i) e = std::max(e, std::fabs((double)got[i] - want[i]));
    return e;
}

// The pairs' layer on the host, block by block, thread by thread, with pair_geo / pair_thread / pair_item and the
// kernel's loops and order (float arithmetic, fmaf): what --cpu checks without a GPU.
static std::vector<float> emulate_pairs(const Case &cs, const std::vector<float> &x, const std::vector<float> &wt,
                                        const std::vector<float> &b, int &ways) {
    const cydnnNetLayer L = make_layer(cs, wt.data(), b.data());
    const int QH = cs.h / 2, QW = cs.w / 2, kk = 9, ksize = cs.c * kk;
    std::vector<float> out((size_t)cs.k * QH * QW, NAN);
    std::vector<int> written(out.size(), 0);
    for (int rank = 0; rank < kRanks; ++rank) {
        const PairGeo g = pair_geo(L, rank, kRanks, g_wcap, kBuf);
        ways = g.S;
        if (g.n_items <= 0) continue;
        if (g.chunk == 0) return {};
        std::vector<float> scratch((size_t)g.S * 16 * g.tpw, NAN);
        for (int t = 0; t < kThreads; ++t) {
            const PairThread p = pair_thread(g, t);
            if (!p.active) continue;
            int grp, wy, wx;
            pair_item(g, p.m, grp, wy, wx);
            float acc[8][2] = {};
            for (int c0 = 0; c0 < cs.c; c0 += g.chunk) {
                const int c1 = std::min(c0 + g.chunk, cs.c);
                std::vector<float> wbuf((size_t)(c1 - c0) * kk * g.cs);   // staged as the kernel stages
                const int row = (c1 - c0) * kk;
                for (int e = 0; e < g.cs * row; ++e) {
                    const int co = e / row, r = e - co * row;
                    wbuf[(size_t)r * g.cs + co] = co < g.c_span ? wt[(size_t)(g.c_lo + co) * ksize + (size_t)c0 * kk + r] : 0.0f;
                }
                for (int ci = c0 + (p.s - c0 % g.S + g.S) % g.S; ci < c1; ci += g.S)
                    for (int ky = 0; ky < 3; ++ky)
                        for (int kx = 0; kx < 3; ++kx) {
                            const float *wp = wbuf.data() + ((size_t)(ci - c0) * kk + ky * 3 + kx) * g.cs + (grp * 8 - g.c_lo);
                            const int xx = 2 * wx + p.dx - 1 + kx;
                            float v[2];
                            for (int r = 0; r < 2; ++r) {
                                const int yy = 2 * wy + r - 1 + ky;
                                v[r] = xx >= 0 && xx < cs.w && yy >= 0 && yy < cs.h ? x[((size_t)ci * cs.h + yy) * cs.w + xx] : 0.0f;
                            }
                            for (int a = 0; a < 8; ++a)
                                for (int r = 0; r < 2; ++r) acc[a][r] = std::fmaf(wp[a], v[r], acc[a][r]);
                        }
            }
            const int i = t % g.tpw;
            for (int a = 0; a < 8; ++a)
                for (int r = 0; r < 2; ++r) scratch[((size_t)p.s * 16 + a * 2 + r) * g.tpw + i] = acc[a][r];
        }
        for (int o = 0; o < g.n_items * 8; ++o) {
            const int v = o / g.n_items, m = o - v * g.n_items;
            int gm, ym, xm;
            pair_item(g, m, gm, ym, xm);
            const int co = gm * 8 + v;
            if (co >= cs.k) continue;
            float sums[4] = {0, 0, 0, 0};
            for (int w = 0; w < g.S; ++w)
                for (int q = 0; q < 4; ++q) sums[q] += scratch[((size_t)w * 16 + v * 2 + q / 2) * g.tpw + 2 * m + q % 2];
            float best = -INFINITY;                                   // pool4: the epilogue, then strictly greater wins
            for (int q = 0; q < 4; ++q) {
                const float e = std::max(sums[q] + b[co], 0.0f);
                if (e > best) best = e;
            }
            const size_t at = ((size_t)co * QH + ym) * QW + xm;
            out[at] = best;
            ++written[at];
        }
    }
    for (int n : written)
        if (n != 1) return {};                                        // an output written twice or never
    return out;
}

int main(int argc, char **argv) {
    bool cpu = false;
    for (int a = 1; a < argc; ++a) {
        if (std::string(argv[a]) == "--cpu") cpu = true;
        else if (std::string(argv[a]) == "--wcap" && a + 1 < argc) g_wcap = std::atol(argv[++a]);
    }
    printf("staged weights: %ld floats a block\n", g_wcap);
    const Case cases[] = {{3, 32, 32, 24}, {24, 16, 16, 48}, {48, 8, 8, 96}, {20, 16, 16, 20}};
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int status = 0;
    for (const Case &cs : cases) {
        std::vector<float> x((size_t)cs.c * cs.h * cs.w), wt((size_t)cs.k * cs.c * 9), b(cs.k);
        for (auto &v : x) v = nd(rng);
        for (auto &v : wt) v = nd(rng) / std::sqrt(9.0f * cs.c);
        for (auto &v : b) v = 0.1f * nd(rng);
        const auto want = reference(cs, x, wt, b);
        const double tol = 1e-5 * (1 + std::fabs(*std::max_element(want.begin(), want.end())));
        if (cpu) {
            int ways = 0;
            const auto got = emulate_pairs(cs, x, wt, b, ways);
            const bool ok = !got.empty() && max_err(got, want) <= tol;
            printf("cpu conv %d->%d on %dx%d: pairs, %d ways: max err %.2e  %s\n", cs.c, cs.k, cs.h, cs.w, ways,
                   got.empty() ? -1.0 : max_err(got, want), ok ? "ok" : "FAILED");
            status |= ok ? 0 : 1;
            continue;
        }
        float *dx = to_device(x), *dw = to_device(wt), *db = to_device(b), *dy;
        const size_t outs = (size_t)cs.k * (cs.h / 2) * (cs.w / 2);
        CK(cudaMalloc(&dy, outs * 4));
        const cydnnNetLayer L = make_layer(cs, dw, db);
        const size_t smem = (2 * kBuf + g_wcap) * 4;
        auto run = [&](auto kernel, int reps) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(kRanks), cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = smem;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeClusterDimension;
            at[0].val.clusterDim.x = kRanks, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
            cfg.attrs = at, cfg.numAttrs = 1;
            CK(cudaLaunchKernelEx(&cfg, kernel, L, (const float *)dx, dy, reps, g_wcap));
        };
        auto k0 = layer_kernel<0>, k1 = layer_kernel<1>;
        for (auto k : {k0, k1}) {
            CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        }
        auto kern = [&](int v) { return v == 0 ? k0 : k1; };
        std::vector<float> got[2];
        for (int v = 0; v < 2; ++v) {
            CK(cudaMemset(dy, 0xff, outs * 4));
            run(kern(v), 1);
            CK(cudaDeviceSynchronize());
            got[v].resize(outs);
            CK(cudaMemcpy(got[v].data(), dy, outs * 4, cudaMemcpyDeviceToHost));
        }
        // today's ways (conv_wsplit's wsplit_ways for a block of `per` work items of 4 channels) against the pairs'
        const long per4 = ((long)((cs.k + 3) / 4) * (cs.h / 2) * (cs.w / 2) + kRanks - 1) / kRanks;
        const long today_ways = std::min<long>({kThreads / per4, (long)cs.c, kBuf / (16 * per4)});
        const cydnnNetLayer Lh = make_layer(cs, wt.data(), b.data());
        bool same_order = pair_geo(Lh, 0, kRanks, g_wcap, kBuf).S == today_ways;
        const long rows4 = (long)(cs.h / 2) * (cs.w / 2), items4 = (long)((cs.k + 3) / 4) * rows4;
        for (int r = 0; r < kRanks; ++r) {                         // today's chunks, block by block (conv_wsplit's)
            const long lo = per4 * r, hi = std::min(lo + per4, items4);
            if (hi <= lo) continue;
            const long c_span = std::min<long>(((hi - 1) / rows4 + 1) * 4, cs.k) - lo / rows4 * 4;
            const long chunk = std::min<long>(g_wcap / ((c_span + 3) / 4 * 4 * 9), cs.c);
            if (chunk != cs.c && chunk % today_ways != 0) same_order = false;   // another order: bits may differ
        }
        const bool same = std::memcmp(got[0].data(), got[1].data(), outs * 4) == 0;
        double best[2] = {1e30, 1e30};
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        for (int round = 0; round < 5; ++round)
            for (int v = 0; v < 2; ++v) {
                float ms[2];
                for (int which = 0; which < 2; ++which) {
                    const int reps = which ? 11 : 1;
                    run(kern(v), reps);
                    CK(cudaEventRecord(e0));
                    for (int i = 0; i < 200; ++i) run(kern(v), reps);
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&ms[which], e0, e1));
                }
                best[v] = std::min(best[v], 1e3 * (ms[1] - ms[0]) / 200 / 10);
            }
        const double err0 = max_err(got[0], want), err1 = max_err(got[1], want);
        const bool ok = err0 <= tol && err1 <= tol && (same || !same_order);   // the same order: the same bits
        printf("conv %d->%d on %dx%d +pool: today %.2f us (err %.1e), pairs %.2f us (err %.1e), bits %s  %s\n", cs.c,
               cs.k, cs.h, cs.w, best[0], err0, best[1], err1, same ? "equal" : (same_order ? "differ" : "-"),
               ok ? "ok" : "FAILED");
        status |= ok ? 0 : 1;
        CK(cudaFree(dx));
        CK(cudaFree(dw));
        CK(cudaFree(db));
        CK(cudaFree(dy));
    }
    printf(status ? "a check failed\n" : "all checks passed\n");
    return status;
}
