// fused_lenet_cluster.cuh -- one image's LeNet-5 forward on a thread-block cluster of kClusterBlocks blocks
// (sm_90), the latency path of a few images (fused_lenet.cu picks it; one block per image otherwise).
//
// One block of 1,024 threads leaves most of its threads idle in the fully-connected layers and runs the
// convolutions in one or two passes; four blocks (on four SMs, or sharing them) split every layer's outputs
// and give each other their shares through distributed shared memory (DSMEM):
//
//   every rank: stage the image (load_raw) and both convolutions' weights in its own shared memory
//   conv1 + bias + act + pool  rank r computes pooled outputs [r*n/4, (r+1)*n/4) and stores each into all
//   conv2 + bias + act + pool  four blocks' copies (DSMEM stores), then cluster.sync()
//   fc1 + act                  the same split over the 120 neurons, stored into every rank
//   fc2 + act                  over the 84 neurons, stored into rank 0 only
//   fc3, softmax               rank 0 alone (the other ranks have returned)
//
// Every buffer is written once, so no rank can overwrite what another still reads.  The first DSMEM store
// waits for a cluster barrier that every block arrived at when it started (a block's shared memory exists only
// once it runs), and no block exits before the barrier after the last store into it.
//
// Work items.  A convolution item is (pooled output, its 2x2 window position q, part s of S of the CIN*5 kernel
// rows); a pooled output's 4*S items are adjacent lanes of one warp: the S parts are summed and the window
// reduced by shuffles, after the bias and activation (as the block kernel: act then max, or the mean).  A
// fully-connected neuron is L adjacent lanes, each summing inputs s, s + L, ... with its weight loads unrolled.
// S and L are the largest that keep a rank's items within one pass of its threads where that is possible.
// First measured as benchmarks/dev/lenet_cluster.cu (the modern network, one image, H100: four blocks of 512
// threads, pushing, 18.1 us p50 a synchronised launch against one block's 24.6).  In the library (H100, session
// 33): the kernel queued 12.9 us against the one-block kernel's 16.2 (classic 14.2 against 23.0); the numpy
// predictor of one image 20.2-20.5 us against 22.6-24.4 (classic 21.5 against 29.4-29.8).
#pragma once

#include <cooperative_groups.h>

#include "fused_lenet.cuh"

namespace {

namespace lcg = cooperative_groups;

constexpr int kClusterBlocks = 4;      // blocks per image
constexpr int kClusterThreads = 512;   // threads per block (the measured best of 512 and 1,024)

// Rank r of cs owns outputs [share(n, cs, r), share(n, cs, r + 1)).
__host__ __device__ constexpr int share(int n, int cs, int r) { return r * n / cs; }

// S: parts per convolution output (a power of 2, <= 8 and <= the kernel rows); L: lanes per neuron.
__host__ __device__ constexpr int conv_split(int pooled, int rows, int cs, int t, int s = 1) {
    return 2 * s <= 8 && 2 * s <= rows && pooled * 4 * 2 * s / cs <= t ? conv_split(pooled, rows, cs, t, 2 * s) : s;
}
__host__ __device__ constexpr int fc_lanes(int n, int t, int l = 32) {
    return l > 1 && n * l > t ? fc_lanes(n, t, l / 2) : l;
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

// v into element i of buf in every rank's shared memory (to < 0) or in rank `to`'s.
template <int CS>
__device__ __forceinline__ void put_all(float *buf, int i, float v, int to) {
    lcg::cluster_group cluster = lcg::this_cluster();
#pragma unroll
    for (int q = 0; q < CS; ++q)
        if (to < 0 || q == to) *cluster.map_shared_rank(buf + i, q) = v;
}

// conv (CIN x H x H in, COUT channels, 5x5, stride 1) + bias + ACT + 2x2 pool (max or mean): rank's share.
template <int CIN, int H, int COUT, int S, int CS, int T, int ACT, bool MAX>
__device__ __forceinline__ void cluster_conv_pool(const float *in, const float *w, const float *b, float *out,
                                                  int rank) {
    constexpr int PH = (H - KS + 1) / 2, POOLED = COUT * PH * PH, ROWS = CIN * KS, G = 4 * S;
    static_assert(32 % G == 0, "a pooled output's items must lie in one warp");
    const int lane = threadIdx.x & 31;
    const int begin = share(POOLED, CS, rank) * G, end = share(POOLED, CS, rank + 1) * G;
    for (int e0 = begin + (threadIdx.x & ~31); e0 < end; e0 += T) {   // warp-uniform: all lanes shuffle
        const int e = min(e0 + lane, end - 1);                          // lanes past the end: a copy, not written
        const int po = e / G, q = e / S % 4, s = e % S, p = po % (PH * PH), k = po / (PH * PH);
        const int oy = p / PH * 2 + (q >> 1), ox = p % PH * 2 + (q & 1);
        const int t0 = s * ROWS / S, t1 = (s + 1) * ROWS / S;
        float acc = 0.0f;
        for (int t = t0; t < t1; ++t) {       // kernel row t = (input channel c, row i)
            const int c = t / KS, i = t - c * KS;
            const float *ip = in + (c * H + oy + i) * H + ox, *wp = w + (k * ROWS + t) * KS;
#pragma unroll
            for (int j = 0; j < KS; ++j) acc = fmaf(ip[j], wp[j], acc);
        }
#pragma unroll
        for (int o = 1; o < S; o *= 2) acc += __shfl_xor_sync(~0u, acc, o);   // the S parts
        float v = activate<ACT>(acc + b[k]);
        if (MAX) {
            v = fmaxf(v, __shfl_xor_sync(~0u, v, S));
            v = fmaxf(v, __shfl_xor_sync(~0u, v, 2 * S));
        } else {
            v += __shfl_xor_sync(~0u, v, S);
            v = (v + __shfl_xor_sync(~0u, v, 2 * S)) * 0.25f;
        }
        if (e0 + lane < end && lane % G == 0) put_all<CS>(out, po, v, -1);
    }
}

// Neuron o, lane s of L: inputs s, s + L, ... (a fixed trip count, unrolled: every weight load in flight at once).
template <int IN_F, int L>
__device__ __forceinline__ float fc_part(const float *in, const float *__restrict__ W, int o, int s) {
    constexpr int N = IN_F / L;
    const float *w = W + (long)o * IN_F + s;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) acc = fmaf(__ldg(w + j * L), in[s + j * L], acc);
    if (IN_F % L != 0 && s < IN_F % L) acc = fmaf(__ldg(w + N * L), in[s + N * L], acc);
    return acc;
}

// out[o] = act(b[o] + sum_i W[o][i] in[i]) for the rank's share of OUT neurons (CS = 1: all of them, stored
// locally); stored into every rank (to < 0) or into rank `to`.
template <int IN_F, int L, int CS, int T, int ACT>
__device__ __forceinline__ void cluster_fc(const float *in, const float *__restrict__ W, const float *__restrict__ b,
                                           float *out, int OUT, int rank, int to) {
    const int lane = threadIdx.x & 31, o0 = share(OUT, CS, rank), n = (share(OUT, CS, rank + 1) - o0) * L;
    for (int e0 = threadIdx.x & ~31; e0 < n; e0 += T) {   // warp-uniform: every lane reaches the shuffles
        const int e = e0 + lane, o = o0 + e / L;
        float v = e < n ? fc_part<IN_F, L>(in, W, o, e % L) : 0.0f;
#pragma unroll
        for (int off = L / 2; off > 0; off /= 2) v += __shfl_xor_sync(~0u, v, off);
        if (e < n && e % L == 0) {
            v = activate<ACT>(v + __ldg(b + o));
            if (CS == 1) out[o] = v;
            else put_all<CS>(out, o, v, to);
        }
    }
}

#endif  // sm_90

}  // namespace
