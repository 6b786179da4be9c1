// conv_wgrad.cu -- a convolution's filter gradient as a GEMM on the CUDA cores (fp32), the long reduction split
// over many blocks whose partial sums a second kernel adds in a fixed order (the same bits every run).
//
//   dw[o, r] = sum_m dy[m, o] A[m, r],   m = (image, output pixel): n * oh * ow of them,
//                                        r = (input channel, kernel row, kernel column): c * kh * kw,
//   A[m, r] = x[img, ci, oy*sh - ph + ky, ox*sw - pw + kx] (0 outside) -- conv_igemm.cu's im2col rows.
//
// Why: in a small network's step cuDNN's filter gradient (wgrad_alg0_engine and kin) takes 15-38 us a layer at
// batch 64 on the H100, and on the second stream it bounds each convolution's backward (docs/performance.md,
// sessions 22-23).  Its outputs are few (16 x 25 .. 96 x 432) and its reduction long (4,096 .. 65,536 rows): a
// GEMM whose parallelism has to come from splitting the reduction.
//
// A block computes a BO x BR tile of dw (output channels x reductions; 4 x 4 a thread) over its share of the
// m's, in chunks of 16 m's staged in shared memory (double-buffered through registers, as conv_igemm.cu): dy's
// values as Ds[k][o] and A's as As[k][r], both loaded along m (a warp's lanes read consecutive output pixels).
// The block's BR reduction indices are decoded once into a table in shared memory (offset into the image, kernel
// row, kernel column); each thread decodes its m of a chunk (image, window corner) once per chunk.
#include <atomic>
#include <cstdint>

#include "common.cuh"
#include "launch.cuh"
#include "conv_plan.cuh"   // check_geometry
#include "conv_wgrad.cuh"
#include "conv_wgrad_kernels.cuh"   // the kernels and the tile table (kBK .. kTileCount)

namespace cydnn {

cydnnStatus_t conv_wgrad(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x, const float *dy,
                         float *dw, int tile, cudaStream_t stream, int workspace, const char *op) {
    CYDNN_TRY(cydnn::conv::check_geometry(op, g));
    CYDNN_REQUIRE(op, x != nullptr && dy != nullptr && dw != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    const int oh = (g->h + 2 * g->pad_h - g->kh) / g->stride_h + 1;
    const int ow = (g->w + 2 * g->pad_w - g->kw) / g->stride_w + 1;
    const long r = (long)g->c * g->kh * g->kw, m = (long)g->n * oh * ow;
    const long big = (long)g->n * (g->c > g->k ? g->c : g->k) *
                     ((long)g->h * g->w > (long)oh * ow ? (long)g->h * g->w : (long)oh * ow);
    CYDNN_REQUIRE(op, big < (1L << 31) - (1L << 20) && m < (1L << 31) && (long)g->k * r < (1L << 31),
                  "the tensors are too large for 32-bit offsets");
    const Tile &t = kTiles[tile];
    WgradArgs a{x, dy, dw, g->c, g->h, g->w, g->k, oh, ow, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h,
                g->pad_w, (int)r, (int)m, 0};
    const int chunks = (int)((m + kBK - 1) / kBK);
    const int splits = t.splits < chunks ? t.splits : chunks;
    a.per_split = (chunks + splits - 1) / splits;
    const int used = (chunks + a.per_split - 1) / a.per_split;       // no block without chunks
    const int size = (int)(g->k * r);
    if (used > 1) {
        void *ws = nullptr;
        CYDNN_TRY(cydnn::get_workspace(ctx, (size_t)used * size * sizeof(float), &ws, op, workspace));
        a.out = static_cast<float *>(ws);
    }
    const dim3 grid((unsigned)((r + t.br - 1) / t.br), (unsigned)((g->k + t.bo - 1) / t.bo), (unsigned)used);
    CYDNN_LAUNCH(t.kernel, grid, (t.bo / 4) * (t.br / 4), 0, stream, a);
    CYDNN_LAUNCH_CHECK(op, "wgrad_kernel");
    if (used > 1) {
        CYDNN_LAUNCH(wgrad_split_sum, (unsigned)((size + 31) / 32), dim3(32, kSumGroups), 0, stream, a.out, used, dw,
                     size);
        CYDNN_LAUNCH_CHECK(op, "wgrad_split_sum");
    }
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace cydnn

int cydnn_conv_wgrad_tile_count(void) { return kTileCount; }

cydnnStatus_t cydnn_conv_wgrad_tile(int tile, int *channels, int *reductions, int *threads, int *splits) {
    const char *op = "conv_wgrad_tile";
    CYDNN_REQUIRE(op, tile >= 0 && tile < kTileCount, "tile must be 0..%d, got %d", kTileCount - 1, tile);
    CYDNN_REQUIRE(op, channels != nullptr && reductions != nullptr && threads != nullptr && splits != nullptr,
                  "a pointer is NULL");
    *channels = kTiles[tile].bo;
    *reductions = kTiles[tile].br;
    *threads = (kTiles[tile].bo / 4) * (kTiles[tile].br / 4);
    *splits = kTiles[tile].splits;
    return CYDNN_STATUS_SUCCESS;
}
