// gemm_skinny.cu -- float32 products with few rows (a linear layer at a small batch) on the CUDA cores, the
// reduction split over the blocks of a thread-block cluster and summed through distributed shared memory.
//
//   c (m x n) = act(a (m x k) . B + bias),  B[r, j] = w[j, r] (b_kn = 0: w (n, k), a linear layer's forward)
//                                           B[r, j] = w[r, j] (b_kn = 1: w (k, n), its data gradient dy . W)
//
// Why: at batch 64 a 1024 -> 1024 layer is 64 x 1024 outputs.  cuBLASLt's fp32 kernels cover that with 8-32
// blocks of 64x64 or 128x32 and split the reduction through a second kernel: 14-21 us for 67 M multiply-adds
// (docs/performance.md, session 21; PyTorch's graph calls the same kernels), ~6 TFLOP/s of the H100's 60.
// Here a block computes a BM x BN tile over a share of the reduction; the S blocks of a cluster (S = 1..16)
// own the S shares of one tile, leave their partial tiles in shared memory, and each block then adds one S-th
// of the tile from all S partial tiles (DSMEM), in rank order -- the same bits every run -- and writes it with
// the bias and the activation.  No second kernel, no workspace.
//
// The loads: chunks of 16 reductions, four consecutive floats a thread (a float4 where the rows are
// whole float4s), fetched into registers while the block multiplies the previous chunk, then stored
// transposed into shared memory (As[r][m], Bs[r][j]); a thread owns 4 x 4 outputs (float4 reads of As, Bs).
#include <atomic>
#include <cooperative_groups.h>
#include <cstdint>

#include "act_math.cuh"
#include "cluster_launch.cuh"
#include "common.cuh"
#include "launch.cuh"
#include "gemm_skinny.cuh"

namespace cg = cooperative_groups;

namespace {

using cydnn::activate;

constexpr int kBK = 16;

struct SkinnyArgs {
    const float *a;        // (m, k)
    const float *w;        // (n, k) or (k, n)
    const float *bias;     // (n) or NULL
    float *c;              // (m, n)
    int m, n, k;
    int b_kn;
    int act;
    float slope;
    int vec_a, vec_b;      // the rows a thread loads are 16-byte aligned float4s
    int per_split;         // chunks of kBK a block sums
};

template <int BM, int BN>
struct Smem {
    static constexpr int kLda = BM + 4, kLdb = BN + 4;          // + 4: the transposing stores spread over banks
    static constexpr int kStage = kBK * (kLda + kLdb);
    static constexpr int kFloats = 2 * kStage > BM * BN ? 2 * kStage : BM * BN;
};

// Four consecutive floats of row `row` from column `col` (< cols) of a row-major (rows x ld) matrix; zeros
// outside.  `vec`: the four are one aligned float4 whenever col < cols (ld % 4 == 0, base aligned).
__device__ __forceinline__ float4 load4(const float *p, int row, int rows, int col, int cols, int ld, int vec) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row >= rows || col >= cols) return v;
    const float *q = p + (long)row * ld + col;
    if (vec) return __ldg(reinterpret_cast<const float4 *>(q));
    v.x = __ldg(q);
    if (col + 1 < cols) v.y = __ldg(q + 1);
    if (col + 2 < cols) v.z = __ldg(q + 2);
    if (col + 3 < cols) v.w = __ldg(q + 3);
    return v;
}

template <int BM, int BN, int T>
struct Loads {
    // A: BM rows x kBK reductions as float4s along the reduction; B likewise (b_kn = 0: rows j along r) or
    // kBK rows r x BN columns j (b_kn = 1: float4s along j).
    static constexpr int kA = BM * kBK / 4 / T, kB = BN * kBK / 4 / T;
    static_assert(kA >= 1 && kA * T * 4 == BM * kBK, "A loads");
    static_assert(kB >= 1 && kB * T * 4 == BN * kBK, "B loads");
    float4 ra[kA], rb[kB];

    __device__ __forceinline__ void load(const SkinnyArgs &s, int m0, int n0, int chunk) {
        const int r0 = chunk * kBK, tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < kA; ++i) {
            const int e = tid + i * T, row = e / (kBK / 4), q = e % (kBK / 4);
            ra[i] = load4(s.a, m0 + row, s.m, r0 + 4 * q, s.k, s.k, s.vec_a);
        }
#pragma unroll
        for (int i = 0; i < kB; ++i) {
            const int e = tid + i * T;
            if (s.b_kn) {
                const int row = e / (BN / 4), q = e % (BN / 4);
                rb[i] = load4(s.w, r0 + row, s.k, n0 + 4 * q, s.n, s.n, s.vec_b);
            } else {
                const int row = e / (kBK / 4), q = e % (kBK / 4);
                rb[i] = load4(s.w, n0 + row, s.n, r0 + 4 * q, s.k, s.k, s.vec_b);
            }
        }
    }

    __device__ __forceinline__ void store(const SkinnyArgs &s, float *As, float *Bs) const {
        constexpr int lda = Smem<BM, BN>::kLda, ldb = Smem<BM, BN>::kLdb;
        const int tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < kA; ++i) {
            const int e = tid + i * T, row = e / (kBK / 4), q = e % (kBK / 4);
            As[(4 * q + 0) * lda + row] = ra[i].x;
            As[(4 * q + 1) * lda + row] = ra[i].y;
            As[(4 * q + 2) * lda + row] = ra[i].z;
            As[(4 * q + 3) * lda + row] = ra[i].w;
        }
#pragma unroll
        for (int i = 0; i < kB; ++i) {
            const int e = tid + i * T;
            if (s.b_kn) {
                const int row = e / (BN / 4), q = e % (BN / 4);
                *reinterpret_cast<float4 *>(&Bs[row * ldb + 4 * q]) = rb[i];
            } else {
                const int row = e / (kBK / 4), q = e % (kBK / 4);
                Bs[(4 * q + 0) * ldb + row] = rb[i].x;
                Bs[(4 * q + 1) * ldb + row] = rb[i].y;
                Bs[(4 * q + 2) * ldb + row] = rb[i].z;
                Bs[(4 * q + 3) * ldb + row] = rb[i].w;
            }
        }
    }
};

// Grid (S, column tiles, row tiles), clusters of (S, 1, 1): blockIdx.x is the block's share of the reduction.
template <int BM, int BN>
__global__ void __launch_bounds__((BM / 4) * (BN / 4))
skinny_gemm_kernel(const SkinnyArgs s) {
    cydnn::pdl_wait();
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900          // clusters: sm_90 (the host refuses older devices)
    constexpr int T = (BM / 4) * (BN / 4), lda = Smem<BM, BN>::kLda, ldb = Smem<BM, BN>::kLdb;
    constexpr int kStage = Smem<BM, BN>::kStage;
    __shared__ __align__(16) float smem[Smem<BM, BN>::kFloats];
    cg::cluster_group cluster = cg::this_cluster();
    const int splits = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
    const int n0 = blockIdx.y * BN, m0 = blockIdx.z * BM, tid = threadIdx.x;
    const int tm = tid % (BM / 4), tn = tid / (BM / 4);

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    const int all = (s.k + kBK - 1) / kBK, c0 = rank * s.per_split;
    const int c1 = c0 + s.per_split < all ? c0 + s.per_split : all;
    const int chunks = c1 > c0 ? c1 - c0 : 0;
    Loads<BM, BN, T> ld;
    if (chunks > 0) {
        ld.load(s, m0, n0, c0);
        ld.store(s, smem, smem + kBK * lda);
    }
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
        float *As = smem + (c & 1) * kStage, *Bs = As + kBK * lda;
        if (c + 1 < chunks) ld.load(s, m0, n0, c0 + c + 1);
#pragma unroll
        for (int r = 0; r < kBK; ++r) {
            const float4 av = *reinterpret_cast<const float4 *>(&As[r * lda + tm * 4]);
            const float4 bv = *reinterpret_cast<const float4 *>(&Bs[r * ldb + tn * 4]);
            const float a4[4] = {av.x, av.y, av.z, av.w}, b4[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a4[i], b4[j], acc[i][j]);
        }
        if (c + 1 < chunks) {
            float *Nx = smem + ((c + 1) & 1) * kStage;
            ld.store(s, Nx, Nx + kBK * lda);
        }
        __syncthreads();
    }

    // The partial tile into this block's shared memory (row-major BM x BN), then every block of the cluster
    // adds its S-th of the tile over the S partial tiles in rank order and writes it with bias and activation.
    float *part = smem;
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<float4 *>(&part[(tm * 4 + i) * BN + tn * 4]) =
            make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    cluster.sync();
    constexpr int kTile = BM * BN;
    const int share = (kTile / splits + 3) / 4 * 4;     // a whole number of float4s
    const int e0 = rank * share, e1 = e0 + share < kTile ? e0 + share : kTile;
    for (int e = e0 + 4 * tid; e < e1; e += 4 * T) {
        float4 v = *reinterpret_cast<const float4 *>(cluster.map_shared_rank(part, 0) + e);
        for (int q = 1; q < splits; ++q) {
            const float4 u = *reinterpret_cast<const float4 *>(cluster.map_shared_rank(part, q) + e);
            v.x += u.x;
            v.y += u.y;
            v.z += u.z;
            v.w += u.w;
        }
        const int row = m0 + e / BN, col = n0 + e % BN;
        if (row >= s.m) continue;
        const float vals[4] = {v.x, v.y, v.z, v.w};
        float *out = s.c + (long)row * s.n;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (col + j >= s.n) break;
            const float b = s.bias != nullptr ? __ldg(s.bias + col + j) : 0.0f;
            out[col + j] = activate(vals[j] + b, s.act, s.slope);
        }
    }
    cluster.sync();          // no block leaves while another still reads its partial tile
#endif
}

struct Tile {
    int bm, bn, splits;
    void (*kernel)(const SkinnyArgs);
};

template <int BM, int BN>
constexpr Tile tile(int splits) {
    return {BM, BN, splits, skinny_gemm_kernel<BM, BN>};
}

// The tiles the compiler times (cydnn_skinny_gemm_tile describes them): rows x columns a block (4 x 4 a
// thread), the blocks of a cluster the reduction is split over.
const Tile kTiles[] = {
    tile<64, 64>(1), tile<64, 64>(2), tile<64, 64>(4), tile<64, 64>(8),
    tile<64, 32>(2), tile<64, 32>(4), tile<64, 32>(8), tile<64, 32>(16),
    tile<32, 32>(4), tile<32, 32>(8), tile<32, 32>(16),
    tile<16, 64>(8), tile<16, 64>(16),
};
constexpr int kTileCount = sizeof(kTiles) / sizeof(kTiles[0]);
std::atomic<bool> g_prepared[kTileCount];

}  // namespace

namespace cydnn {

cydnnStatus_t skinny_gemm(cydnnContext *ctx, const float *a, const float *w, const float *bias, float *c, int m,
                          int n, int k, int b_kn, int act, float slope, int tile, cudaStream_t stream,
                          const char *op) {
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    CYDNN_REQUIRE(op, a != nullptr && w != nullptr && c != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, m >= 1 && n >= 1 && k >= 1, "sizes must be >= 1 (m=%d, n=%d, k=%d)", m, n, k);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    CYDNN_REQUIRE(op, (long)m * k < (1L << 31) && (long)m * n < (1L << 31) && (long)n * k < (1L << 31),
                  "the matrices are too large for 32-bit offsets (m=%d, n=%d, k=%d)", m, n, k);
    const Tile &t = kTiles[tile];
    if (!g_prepared[tile].load(std::memory_order_acquire)) {
        CYDNN_TRY(cydnn::cluster_capable(op, ctx->device));
        CYDNN_CUDA(op, cudaFuncSetAttribute(reinterpret_cast<const void *>(t.kernel),
                                            cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        g_prepared[tile].store(true, std::memory_order_release);
    }
    SkinnyArgs s{a, w, bias, c, m, n, k, b_kn != 0, act, slope, 0, 0, 0};
    s.vec_a = k % 4 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0;
    s.vec_b = (b_kn ? n : k) % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
    const int chunks = (k + kBK - 1) / kBK;
    s.per_split = (chunks + t.splits - 1) / t.splits;
    cudaLaunchAttribute attr[1];
    const dim3 grid((unsigned)t.splits, (unsigned)((n + t.bn - 1) / t.bn), (unsigned)((m + t.bm - 1) / t.bm));
    const cudaLaunchConfig_t cfg =
        cydnn::cluster_config(grid, (unsigned)((t.bm / 4) * (t.bn / 4)), 0, stream, t.splits, attr);
    // a programmatic dependent launch too (launch.cuh): the kernel waits first
    CYDNN_CUDA(op, cydnn::launch_pdl(t.kernel, cfg.gridDim, cfg.blockDim, 0, stream, &attr[0], s));
    CYDNN_LAUNCH_CHECK(op, "skinny_gemm_kernel");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace cydnn

int cydnn_skinny_gemm_tile_count(void) { return kTileCount; }

cydnnStatus_t cydnn_skinny_gemm_tile(int tile, int *rows, int *cols, int *threads, int *splits) {
    const char *op = "skinny_gemm_tile";
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    CYDNN_REQUIRE(op, rows != nullptr && cols != nullptr && threads != nullptr && splits != nullptr,
                  "a pointer is NULL");
    *rows = kTiles[tile].bm;
    *cols = kTiles[tile].bn;
    *threads = (kTiles[tile].bm / 4) * (kTiles[tile].bn / 4);
    *splits = kTiles[tile].splits;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_skinny_gemm(cydnnContext *ctx, const float *a, const float *w, const float *bias, float *c,
                                int m, int n, int k, int b_kn, int act, float slope, int tile) {
    const char *op = "skinny_gemm";
    CYDNN_REQUIRE_CTX(op, ctx);
    return cydnn::skinny_gemm(ctx, a, w, bias, c, m, n, k, b_kn, act, slope, tile, ctx->stream, op);
}
