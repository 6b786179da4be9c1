// conv_wgrad_kernels.cuh -- the filter gradient's kernels and tile table (conv_wgrad.cu's header comment says
// what they compute), apart from the library's context so that benchmarks/dev/wgrad_variants.cu times these very
// kernels as its baseline.  Included by one translation unit each (an anonymous namespace).
#pragma once

#include <cuda_runtime.h>

#include "launch.cuh"   // pdl_wait

namespace {

constexpr int kBK = 16;           // m's a chunk

struct WgradArgs {
    const float *x;            // (n, c, h, w)
    const float *dy;           // (n, k, oh, ow)
    float *out;                // dw (k, c, kh, kw), or the split's slice of the partial sums
    int c, h, w, k, oh, ow, kh, kw, sh, sw, ph, pw;
    int r, m;                  // c * kh * kw; n * oh * ow
    int per_split;             // chunks of kBK m's a block sums
};

template <int BO, int BR>
__global__ void __launch_bounds__((BO / 4) * (BR / 4))
wgrad_kernel(const WgradArgs a) {
    cydnn::pdl_wait();
    constexpr int T = (BO / 4) * (BR / 4);
    constexpr int kD = BO * kBK / T, kA = BR * kBK / T;          // loads a thread, of dy and of A, a chunk
    constexpr int kStep = T / kBK;                                // o (or r) between a thread's loads
    static_assert(T % kBK == 0 && kD * T == BO * kBK && kA * T == BR * kBK, "loads");
    __shared__ __align__(16) float Ds[2][kBK][BO + 4];
    __shared__ __align__(16) float As[2][kBK][BR + 4];
    __shared__ int t_off[BR], t_ky[BR], t_kx[BR];

    const int r0 = blockIdx.x * BR, o0 = blockIdx.y * BO, tid = threadIdx.x;
    const int khw = a.kh * a.kw, plane = a.h * a.w, opix = a.oh * a.ow;
    for (int i = tid; i < BR; i += T) {
        const int r = r0 + i, ci = r / khw, t = r - ci * khw, ky = t / a.kw, kx = t - ky * a.kw;
        t_off[i] = ci * plane + ky * a.w + kx;
        t_ky[i] = r < a.r ? ky : -(1 << 20);                       // past r: every load falls outside
        t_kx[i] = kx;
    }
    __syncthreads();

    const int mi = tid % kBK, li = tid / kBK;                    // this thread's m of a chunk; its first o / r
    float rd[kD], ra[kA];
    auto load = [&](int chunk) {
        const int m = chunk * kBK + mi;
        int img = 0, p = 0, iy0 = 0, ix0 = 0;
        const bool ok = m < a.m;
        if (ok) {
            img = m / opix;
            p = m - img * opix;
            const int oy = p / a.ow;
            iy0 = oy * a.sh - a.ph;
            ix0 = (p - oy * a.ow) * a.sw - a.pw;
        }
#pragma unroll
        for (int j = 0; j < kD; ++j) {
            const int o = o0 + li + j * kStep;
            rd[j] = ok && o < a.k ? __ldg(a.dy + ((long)img * a.k + o) * opix + p) : 0.0f;
        }
        const float *xb = a.x + (long)img * a.c * plane + iy0 * a.w + ix0;
#pragma unroll
        for (int j = 0; j < kA; ++j) {
            const int i = li + j * kStep, iy = iy0 + t_ky[i], ix = ix0 + t_kx[i];
            ra[j] = ok && (unsigned)iy < (unsigned)a.h && (unsigned)ix < (unsigned)a.w ? __ldg(xb + t_off[i]) : 0.0f;
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int j = 0; j < kD; ++j) Ds[buf][mi][li + j * kStep] = rd[j];
#pragma unroll
        for (int j = 0; j < kA; ++j) As[buf][mi][li + j * kStep] = ra[j];
    };

    const int to = tid % (BO / 4), tr = tid / (BO / 4);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    const int all = (a.m + kBK - 1) / kBK, c0 = blockIdx.z * a.per_split;
    const int c1 = c0 + a.per_split < all ? c0 + a.per_split : all;
    const int chunks = c1 > c0 ? c1 - c0 : 0;
    if (chunks > 0) {
        load(c0);
        store(0);
    }
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
        const int buf = c & 1;
        if (c + 1 < chunks) load(c0 + c + 1);
#pragma unroll
        for (int k = 0; k < kBK; ++k) {
            const float4 dv = *reinterpret_cast<const float4 *>(&Ds[buf][k][to * 4]);
            const float4 av = *reinterpret_cast<const float4 *>(&As[buf][k][tr * 4]);
            const float d4[4] = {dv.x, dv.y, dv.z, dv.w}, a4[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(d4[i], a4[j], acc[i][j]);
        }
        if (c + 1 < chunks) store(buf ^ 1);
        __syncthreads();
    }

    float *out = a.out + (long)blockIdx.z * a.k * a.r;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int o = o0 + to * 4 + i;
        if (o >= a.k) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + tr * 4 + j;
            if (r < a.r) out[(long)o * a.r + r] = acc[i][j];
        }
    }
}

// The splits' partial sums added in a fixed order: dw[i] = sum_z partial[z * size + i].  A block takes 32
// consecutive outputs (threadIdx.x) and kSumGroups groups of splits (threadIdx.y): group g adds splits g, g + G, ...
// in order, then lane x adds the groups' sums in order.  A thread per output adding every split one after the
// other (session 29's kernel) kept a first layer's 400-648 outputs on 2-3 blocks for 512 dependent loads each.
constexpr int kSumGroups = 16;
__global__ void __launch_bounds__(32 * kSumGroups) wgrad_split_sum(const float *partial, int splits, float *dw,
                                                                   int size) {
    cydnn::pdl_wait();
    __shared__ float sums[kSumGroups][33];
    const int i = blockIdx.x * 32 + threadIdx.x;
    float v = 0.0f;
    if (i < size) {
#pragma unroll 4
        for (int z = threadIdx.y; z < splits; z += kSumGroups) v += partial[(long)z * size + i];
    }
    sums[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && i < size) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < kSumGroups; ++g) total += sums[g][threadIdx.x];
        dw[i] = total;
    }
}

struct Tile {
    int bo, br, splits;
    void (*kernel)(const WgradArgs);
};

template <int BO, int BR>
constexpr Tile tile(int splits) {
    return {BO, BR, splits, wgrad_kernel<BO, BR>};
}

// The tiles the compiler times (cydnn_conv_wgrad_tile describes them): output channels x reductions a block (4 x 4
// a thread), and the blocks the m's are split over (fewer where a layer has fewer chunks of 16 m's).
// The layers with many output pixels and few channels (a first layer: 16-32 x 25-27 outputs over 36,864-65,536
// pixels) are bound by each block's chain of chunks, not by arithmetic: they take the 512-way splits (8 chunks a
// block) and the one-warp 16x32 tile (H100, b64: LeNet 16/32's conv1 22.9 us with 16x64 split 128, cuDNN 20.1).
const Tile kTiles[] = {
    tile<16, 32>(128), tile<16, 32>(512),
    tile<16, 64>(32),  tile<16, 64>(128), tile<16, 64>(512),
    tile<32, 32>(32),  tile<32, 32>(128), tile<32, 32>(512),
    tile<32, 64>(16),  tile<32, 64>(64),
    tile<64, 64>(8),   tile<64, 64>(32),
};
constexpr int kTileCount = sizeof(kTiles) / sizeof(kTiles[0]);

}  // namespace
