// conv_igemm.cu -- convolutions as implicit GEMMs on the CUDA cores (fp32): the forward with its bias and
// activation in the epilogue, and the data gradient of a stride-1 convolution.  For the small layers of
// the zoo's CNNs cuDNN's fp32 kernels reach ~10 % of the GPU's peak (docs/performance.md, session 22);
// the compiler times these tiles against cuDNN on the plan's own buffers, replayed as a step runs them,
// and keeps the fastest (python/cydnn/compiler/executor.py).
//
// The GEMM: out[m, o] = sum_r A[m, r] B[r, o], m = (image, output pixel), o = output channel, r = (input
// channel, kernel row, kernel column) -- im2col without the copy:
//   forward        A[m, r] = x[img, ci, oy*sh - ph + ky, ox*sw - pw + kx] (0 outside),  B[r, o] = w[o, r]
//   data gradient  the same with x := dy, padding kh-1-ph, and the filters flipped and transposed:
//                  B[(k, ky, kx), c] = w[k, c, kh-1-ky, kw-1-kx]   (stride 1: dx is then a plain convolution)
// A block computes a BM x BN tile of out over chunks of BK (8, 16 or 24) reductions, staged in shared memory (double-
// buffered: the next chunk's global loads are in flight while this one is multiplied); a thread owns TM x TN
// outputs.  Each reduction index's offsets (into A's image, its kernel row and column, into B) are
// computed once per block into a table in shared memory, so the loads need no division.
#include <atomic>
#include <cstdint>

#include "act_math.cuh"
#include "common.cuh"
#include "launch.cuh"
#include "conv_plan.cuh"   // check_geometry

namespace {

using cydnn::activate;

constexpr int kMaxReduction = 2304;     // c * kh * kw: the table's entries (27 KB of shared memory)

struct IgemmArgs {
    const float *src;          // x (forward) or dy (data gradient): (n, c, h, w)
    const float *w;            // the filters as the layer holds them, (k, c, kh, kw)
    const float *bias;         // (cout) or NULL
    float *y;                  // (n, cout, oh, ow)
    int c, h, w_;              // src's channels and plane
    int cout, oh, ow;          // the output's channels and plane
    int kh, kw, sh, sw, ph, pw;
    int r, m;                  // reduction length c * kh * kw; rows n * oh * ow
    int flip;                  // 0: B[r, o] = w[o * r_len + r]; 1: the data gradient's (see above)
    int act;
    float slope;
    int vec;                   // y's planes are whole float4s (oh * ow % 4 == 0, y 16-byte aligned)
    int per_split;             // chunks a block sums: all of them, or (split reduction) a share of them
    float *partial;            // split reduction: blockIdx.z's raw sums, y's layout, at partial + z * y's size
};

// The operands' loads: the offset table (built once per block: construct before the block's first
// __syncthreads), this thread's fixed A row, and a chunk of BK reductions fetched into
// registers (load: global loads in flight while the block multiplies the previous chunk) then stored into
// shared memory as As[k][m] and Bs[k][o] (row strides lda, ldb floats).
template <int BM, int BN, int BK, int T>
struct Loader {
    static constexpr int kALoads = BM * BK / T, kBLoads = BN * BK / T;
    static constexpr int kARowStep = T / BM, kBColStep = T / BK;
    static_assert(T % BM == 0 && kALoads * T == BM * BK, "A tile loads");
    static_assert(T % BK == 0 && kBLoads * T == BN * BK && kBColStep <= BN, "B tile loads");
    const IgemmArgs &a;
    const int *a_off, *kyx, *b_off;
    int b_stride, am, ar0, bk, bo0, o0, a_base = 0, iy0 = 0, ix0 = 0;
    bool a_row;
    float ra[kALoads], rb[kBLoads];

    __device__ Loader(const IgemmArgs &args, int *table, int m0, int o0_) : a(args), o0(o0_) {
        int *ao = table, *kk = table + a.r, *bo = table + 2 * a.r;
        const int tid = threadIdx.x, khw = a.kh * a.kw, plane = a.h * a.w_;
        for (int i = tid; i < a.r; i += T) {
            const int ci = i / khw, t = i - ci * khw, ky = t / a.kw, kx = t - ky * a.kw;
            ao[i] = ci * plane + ky * a.w_ + kx;
            kk[i] = (ky << 16) | kx;
            // flip: i = (k, t) of dy's channel k; the filter of output channel c is w[k, c, khw - 1 - t]
            bo[i] = a.flip ? ci * a.cout * khw + khw - 1 - t : i;
        }
        a_off = ao;
        kyx = kk;
        b_off = bo;
        b_stride = a.flip ? khw : a.r;                     // B[r, o] = w[b_off[r] + o * b_stride]
        am = tid % BM;
        ar0 = tid / BM;
        bk = tid % BK;
        bo0 = tid / BK;
        a_row = m0 + am < a.m;
        if (a_row) {                                       // this thread's A row: its image, its window's corner
            const int opix = a.oh * a.ow, img = (m0 + am) / opix, p = m0 + am - img * opix, oy = p / a.ow;
            iy0 = oy * a.sh - a.ph;
            ix0 = (p - oy * a.ow) * a.sw - a.pw;
            a_base = img * a.c * plane + iy0 * a.w_ + ix0;
        }
    }

    __device__ __forceinline__ void load(int chunk) {
        const int r0 = chunk * BK;
#pragma unroll
        for (int j = 0; j < kALoads; ++j) {
            const int r = r0 + ar0 + j * kARowStep;
            float v = 0.0f;
            if (a_row && r < a.r) {
                const int e = kyx[r], iy = iy0 + (e >> 16), ix = ix0 + (e & 0xffff);
                if ((unsigned)iy < (unsigned)a.h && (unsigned)ix < (unsigned)a.w_) v = __ldg(a.src + a_base + a_off[r]);
            }
            ra[j] = v;
        }
        const int r = r0 + bk;
#pragma unroll
        for (int j = 0; j < kBLoads; ++j) {
            const int o = o0 + bo0 + j * kBColStep;
            rb[j] = r < a.r && o < a.cout ? __ldg(a.w + b_off[r] + (long)o * b_stride) : 0.0f;
        }
    }

    __device__ __forceinline__ void store(float *As, int lda, float *Bs, int ldb) const {
#pragma unroll
        for (int j = 0; j < kALoads; ++j) As[(ar0 + j * kARowStep) * lda + am] = ra[j];
#pragma unroll
        for (int j = 0; j < kBLoads; ++j) Bs[bk * ldb + bo0 + j * kBColStep] = rb[j];
    }
};

// The CUDA cores' kernel: thread (tm, tn) owns rows tm*4 .. +4 (and, TM == 8, BM/2 + tm*4 .. +4: each half a
// float4 that the warp's lanes read side by side) and columns tn*4 .. +4, summed by fmaf.
template <int BM, int BN, int TM, int TN, int kBK>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
igemm_conv_kernel(const IgemmArgs a) {
    cydnn::pdl_wait();
    constexpr int kT = (BM / TM) * (BN / TN);
    static_assert(TM == 4 || TM == 8, "TM");
    static_assert(TN == 4, "TN");
    __shared__ __align__(16) float As[2][kBK][BM];
    __shared__ __align__(16) float Bs[2][kBK][BN + 4];    // + 4: the transposing stores hit distinct banks
    extern __shared__ int table[];                         // a_off[r], kyx[r], b_off[r]
    const int m0 = blockIdx.x * BM, o0 = blockIdx.y * BN, tid = threadIdx.x;
    Loader<BM, BN, kBK, kT> ld(a, table, m0, o0);
    __syncthreads();                                       // the table

    const int tm = tid % (BM / TM), tn = tid / (BM / TM);
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    // This block's chunks [c0, c1): all of them, or blockIdx.z's share where the reduction is split.
    const int all = (a.r + kBK - 1) / kBK, c0 = blockIdx.z * a.per_split;
    const int c1 = c0 + a.per_split < all ? c0 + a.per_split : all;
    const int chunks = c1 - c0;
    ld.load(c0);
    ld.store(&As[0][0][0], BM, &Bs[0][0][0], BN + 4);
    __syncthreads();
    for (int c = 0; c < chunks; ++c) {
        const int buf = c & 1;
        if (c + 1 < chunks) ld.load(c0 + c + 1);
#pragma unroll
        for (int k = 0; k < kBK; ++k) {
            float av[TM], bv[TN];
#pragma unroll
            for (int h = 0; h < TM / 4; ++h) {
                const float4 v = *reinterpret_cast<const float4 *>(&As[buf][k][h * (BM / 2) + tm * 4]);
                av[h * 4 + 0] = v.x;
                av[h * 4 + 1] = v.y;
                av[h * 4 + 2] = v.z;
                av[h * 4 + 3] = v.w;
            }
            const float4 v = *reinterpret_cast<const float4 *>(&Bs[buf][k][tn * 4]);
            bv[0] = v.x;
            bv[1] = v.y;
            bv[2] = v.z;
            bv[3] = v.w;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        if (c + 1 < chunks) ld.store(&As[buf ^ 1][0][0], BM, &Bs[buf ^ 1][0][0], BN + 4);
        __syncthreads();
    }

    // Epilogue: bias, activation, y[img, o, p]; four rows at once where they are one plane's aligned float4.  A
    // split reduction writes its raw sums to its slice of the partial buffer instead (igemm_split_sum adds them).
    const int opix = a.oh * a.ow;
    const bool split = a.partial != nullptr;
    float *out = split ? a.partial + (long)blockIdx.z * a.m * a.cout : a.y;
#pragma unroll
    for (int h = 0; h < TM / 4; ++h) {
        const int mb = m0 + h * (BM / 2) + tm * 4;
        if (mb >= a.m) continue;
        const int img = mb / opix, p = mb - img * opix;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int o = o0 + tn * 4 + j;
            if (o >= a.cout) continue;
            const float b = !split && a.bias != nullptr ? __ldg(a.bias + o) : 0.0f;
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = split ? acc[h * 4 + i][j] : activate(acc[h * 4 + i][j] + b, a.act, a.slope);
            if (a.vec && mb + 3 < a.m) {
                *reinterpret_cast<float4 *>(out + ((long)img * a.cout + o) * opix + p) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
                for (int i = 0; i < 4 && mb + i < a.m; ++i) {
                    const int mi = mb + i, im = mi / opix, pi = mi - im * opix;
                    out[((long)im * a.cout + o) * opix + pi] = v[i];
                }
            }
        }
    }
}

// A split reduction's second pass: y = act(bias + the splits' sums, added in split order), element-wise.
__global__ void igemm_split_sum(const float *partial, int splits, const float *bias, float *y, long size,
                                int opix, int cout, int act, float slope) {
    cydnn::pdl_wait();
    const long stride = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < size; i += stride) {
        float v = 0.0f;
        for (int z = 0; z < splits; ++z) v += partial[z * size + i];
        if (bias != nullptr) v += __ldg(bias + (int)((i / opix) % cout));
        y[i] = activate(v, act, slope);
    }
}

struct Tile {
    int bm, bn, bk;
    void (*kernel)(const IgemmArgs);
    int threads;
    int splits;                // the reduction split over this many blocks (a second pass adds them), or 1
};

template <int BM, int BN, int TM, int TN, int BK, int S = 1>
constexpr Tile tile() {
    return {BM, BN, BK, igemm_conv_kernel<BM, BN, TM, TN, BK>, (BM / TM) * (BN / TN), S};
}

// The tiles the compiler times (cydnn_igemm_conv_tile describes them): rows x output channels a block, the
// outputs a thread, the reductions a chunk, the splits of the reduction.
const Tile kTiles[] = {
    tile<128, 32, 4, 4, 8>(),      // 256 threads; chunks of 8 reductions (few input channels)
    tile<64, 32, 4, 4, 8>(),       // 128 threads
    tile<128, 16, 4, 4, 8>(),      // 128 threads: few output channels
    tile<128, 64, 8, 4, 16>(),     // 256 threads, 32 outputs each; chunks of 16 (more in flight a sync)
    tile<64, 64, 4, 4, 16>(),      // 256 threads
    tile<128, 32, 4, 4, 16>(),     // 256 threads
    tile<64, 32, 4, 4, 16>(),      // 128 threads
    // the reduction split over 2 or 4 blocks: few rows (small batches, small planes) leave most SMs idle with
    // one block per tile -- ncu on the CNN's conv3 at b64 (64x64, 128 blocks): 2 warps a scheduler, 0.44 issued
    // a cycle, a third of the stalls on shared-memory loads (docs/performance.md, session 23)
    tile<64, 64, 4, 4, 16, 2>(),
    tile<64, 64, 4, 4, 16, 4>(),
    tile<64, 32, 4, 4, 16, 4>(),
    tile<128, 32, 4, 4, 16, 4>(),
    // split 8: a layer of 1,024 rows (all-conv's third, 64 x 4 x 4 pixels) makes 16-32 blocks a split
    tile<64, 64, 4, 4, 16, 8>(),
    tile<64, 32, 4, 4, 16, 8>(),
    // 48 and 96 output channels a block (192 and 384 threads; chunks of 24, which their threads divide): the zoo
    // CNN's 48- and 96-channel layers ran on 64-channel tiles, a quarter of each block's products on padding
    // (ncu, H100: the CNN's conv 2 at b64 on the 64x64 tile took 25.9 us, half its instructions FFMA)
    tile<64, 48, 4, 4, 24>(),
    tile<64, 48, 4, 4, 24, 2>(),
    tile<64, 48, 4, 4, 24, 4>(),
    tile<64, 96, 4, 4, 24>(),
    tile<64, 96, 4, 4, 24, 2>(),
    tile<64, 96, 4, 4, 24, 4>(),
};
constexpr int kTileCount = sizeof(kTiles) / sizeof(kTiles[0]);

// Once per tile (racing threads set the same value): dynamic shared memory for the largest table (27 KB), which
// with the 128x64 tile's static buffers (25 KB) is more than the 48 KB a launch gets without asking.
std::atomic<bool> g_prepared[kTileCount];

cydnnStatus_t launch(cydnnContext *ctx, IgemmArgs a, int tile, const char *op) {
    const Tile &t = kTiles[tile];
    if (!g_prepared[tile].load(std::memory_order_acquire)) {
        CYDNN_CUDA(op, cudaFuncSetAttribute(reinterpret_cast<const void *>(t.kernel),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            3 * kMaxReduction * (int)sizeof(int)));
        g_prepared[tile].store(true, std::memory_order_release);
    }
    a.vec = (a.oh * a.ow) % 4 == 0 && reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
    const int chunks = (a.r + t.bk - 1) / t.bk;
    const int splits = t.splits < chunks ? t.splits : chunks;
    a.per_split = (chunks + splits - 1) / splits;
    const int used = (chunks + a.per_split - 1) / a.per_split;       // no block without chunks
    a.partial = nullptr;
    const long size = (long)a.m * a.cout;
    if (used > 1) {
        void *ws = nullptr;
        CYDNN_TRY(cydnn::get_workspace(ctx, (size_t)used * size * sizeof(float), &ws, op));
        a.partial = static_cast<float *>(ws);
    }
    const dim3 grid((unsigned)((a.m + t.bm - 1) / t.bm), (unsigned)((a.cout + t.bn - 1) / t.bn), (unsigned)used);
    CYDNN_LAUNCH(t.kernel, grid, t.threads, 3 * a.r * sizeof(int), ctx->stream, a);
    CYDNN_LAUNCH_CHECK(op, "igemm_conv_kernel");
    if (used > 1) {
        CYDNN_LAUNCH(igemm_split_sum, cydnn::blocks_for(size), cydnn::kThreads, 0, ctx->stream,
            a.partial, used, a.bias, a.y, size, a.oh * a.ow, a.cout, a.act, a.slope);
        CYDNN_LAUNCH_CHECK(op, "igemm_split_sum");
    }
    return CYDNN_STATUS_SUCCESS;
}

// What every call checks beyond the geometry (conv_plan.cu's check_geometry, shared with the cuDNN ops): the tile,
// and that the offset table (r reductions) and 32-bit offsets hold the layer.
cydnnStatus_t check(const char *op, const cydnnConvGeometry *g, int tile, int oh, int ow, long r) {
    CYDNN_REQUIRE(op, g->kh < 65536 && g->kw < 65536, "the kernel is %dx%d", g->kh, g->kw);
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    CYDNN_REQUIRE(op, r <= kMaxReduction, "the reduction (%s) is %ld, more than the %d of the offset table in "
                  "shared memory", r == (long)g->c * g->kh * g->kw ? "c*kh*kw" : "k*kh*kw", r, kMaxReduction);
    const long big = (long)g->n * (g->c > g->k ? g->c : g->k) *
                     ((long)g->h * g->w > (long)oh * ow ? (long)g->h * g->w : (long)oh * ow);
    CYDNN_REQUIRE(op, big < (1L << 31) - (1L << 20), "the tensors are too large for 32-bit offsets");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

namespace cydnn {

// dx of a stride-1 convolution by tile `tile` (conv.cu's cydnn_conv_backward_tiles, on the context's stream).
cydnnStatus_t igemm_data_gradient(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy, const float *w,
                                  float *dx, int tile, const char *op) {
    CYDNN_TRY(cydnn::conv::check_geometry(op, g));
    CYDNN_REQUIRE(op, g->stride_h == 1 && g->stride_w == 1, "the implicit-GEMM data gradient takes stride 1, "
                  "got %dx%d", g->stride_h, g->stride_w);
    const int oh = g->h + 2 * g->pad_h - g->kh + 1, ow = g->w + 2 * g->pad_w - g->kw + 1;
    CYDNN_TRY(check(op, g, tile, oh, ow, (long)g->k * g->kh * g->kw));
    IgemmArgs a{dy, w, nullptr, dx, g->k, oh, ow, g->c, g->h, g->w, g->kh, g->kw, 1, 1,
                g->kh - 1 - g->pad_h, g->kw - 1 - g->pad_w, g->k * g->kh * g->kw, g->n * g->h * g->w, 1, 0, 0.0f, 0, 0, nullptr};
    return launch(ctx, a, tile, op);
}

}  // namespace cydnn

int cydnn_igemm_conv_tile_count(void) { return kTileCount; }

cydnnStatus_t cydnn_igemm_conv_tile(int tile, int *rows, int *channels, int *threads, int *chunk, int *splits) {
    const char *op = "igemm_conv_tile";
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    CYDNN_REQUIRE(op, rows != nullptr && channels != nullptr && threads != nullptr && chunk != nullptr &&
                  splits != nullptr, "a pointer is NULL");
    *rows = kTiles[tile].bm;
    *channels = kTiles[tile].bn;
    *threads = kTiles[tile].threads;
    *chunk = kTiles[tile].bk;
    *splits = kTiles[tile].splits;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_igemm_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                       const float *w, const float *b, float *y, int act, float slope, int tile) {
    const char *op = "igemm_conv_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_TRY(cydnn::conv::check_geometry(op, g));
    CYDNN_REQUIRE(op, x != nullptr && w != nullptr && y != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    const int oh = (g->h + 2 * g->pad_h - g->kh) / g->stride_h + 1;
    const int ow = (g->w + 2 * g->pad_w - g->kw) / g->stride_w + 1;
    CYDNN_TRY(check(op, g, tile, oh, ow, (long)g->c * g->kh * g->kw));
    IgemmArgs a{x, w, b, y, g->c, g->h, g->w, g->k, oh, ow, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h,
                g->pad_w, g->c * g->kh * g->kw, g->n * oh * ow, 0, act, slope, 0, 0, nullptr};
    return launch(ctx, a, tile, op);
}
