// compiled_head.cu -- a training plan's head: the last linear layer (no activation) and the softmax
// cross-entropy, forward and backward, in two kernels (python/cydnn/compiler/passes.py's fuse_head):
//
//   z[i, :]     = x[i, :] W^T + b                       logits (n, c), kept for the step's bookkeeping
//   row_loss[i] = logsumexp(z[i, :]) - z[i, t_i]
//   loss        = mean_i row_loss[i]
//   g[i, :]     = (softmax(z[i, :]) - onehot(t_i)) / n  the logits' gradient
//   dbias       = sum_i g[i, :]                         (may be NULL)
//   dx          = g W                                   the layer input's gradient (may be NULL)
//   dw          = g^T x
//
// What it replaces: the layer's product (cuBLASLt or gemm_skinny.cu), the two cross-entropy kernels
// (loss.cu), the bias gradient's kernel (compiled_act.cu), and the backward's two products -- six
// launches, four of them one after another on the step's critical path; each of the products ran at
// 6-10 us for 64 rows of 10 classes (docs/performance/zoo-session-32.md).
//
//   1. linear_xent_rows_kernel: a block per row.  Each thread sums its columns' x * W for every class
//      (c <= 32 accumulators in registers), the warps' sums in shuffles, the block's in warp order; the
//      first warp (a lane per class) then takes the row's softmax, loss and gradient exactly as
//      loss.cu's cross_entropy_rows_kernel does.
//   2. linear_xent_grads_kernel: block 0 averages the row losses (mean_kernel's order: the same bits)
//      and sums dbias (each warp an eighth of the rows, then the warps in order); every other block owns 32 columns of x, a lane per column
//      keeping W's column in registers: each of its 8 warps walks an eighth of the rows in order, writing
//      dx[i, col] and adding g[i, j] * x[i, col] into its dw sums; the warps' sums are then added in
//      warp order in shared memory -- a fixed order, so the same bits every run, no atomics, no second
//      pass.
//
// Both kernels load several columns (rows) before they multiply: the step is bound by the loads' latency, with
// 64 blocks of 10 classes at batch 64; written with one load in flight a thread, the two took 8 and 12 us on the
// H100 where the replaced steps took 19 (session 32).
//
// A label outside [0, c) makes its row's loss and gradient NaN (as cross_entropy_rows_kernel), and
// therefore the loss, dbias, dw and that row of dx.
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "launch.cuh"
#include "mean_tree.cuh"
#include "warp_reduce.cuh"

namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = 512;          // 16 warps a row: more loads in flight on its SM
constexpr int kRowWarps = kRowThreads / kWarp;
constexpr int kRowUnroll = 4;              // columns a thread loads before it multiplies (loads in flight)
constexpr int kGradThreads = cydnn::kMeanThreads;   // also the loss tree's width (mean_tree.cuh)
constexpr int kGradWarps = kGradThreads / kWarp;
constexpr int kGradRows = 8;               // rows of x a warp loads before it multiplies
constexpr int kMaxClasses = 32;            // a lane per class in the softmax

using cydnn::warp_max;   // loss.cu's butterflies (warp_reduce.cuh): its bits
using cydnn::warp_sum;

// C: the accumulators a thread keeps (16 or 32), c <= C the classes.  The rows of W past c are read as row c - 1
// (no predicate between a load and its issue: every load of an unrolled step is in flight at once); their sums are
// never used.  A column past k is read as column 0 and its bits masked to +0 after the load: x there is 0, and
// 0 * W[j, 0] would be NaN where that weight is infinite (numpy's logit is then +-inf, not NaN).
template <int C>
__global__ void __launch_bounds__(kRowThreads)
linear_xent_rows_kernel(const float *__restrict__ x, const float *__restrict__ w, const float *__restrict__ bias,
                        const int32_t *__restrict__ labels, int n, int k, int c, float *__restrict__ logits,
                        float *__restrict__ row_loss, float *__restrict__ g) {
    cydnn::pdl_wait();
    __shared__ float part[kRowWarps][C];
    const int row = blockIdx.x, t = threadIdx.x, lane = t % kWarp, warp = t / kWarp;
    const float *xr = x + (size_t)row * k;
    float acc[C];
#pragma unroll
    for (int j = 0; j < C; ++j) acc[j] = 0.0f;
    for (int base = t; base < k; base += kRowThreads * kRowUnroll) {
        float xv[kRowUnroll], wv[kRowUnroll][C];
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u) {
            const int col = base + u * kRowThreads;
            const bool in = col < k;
            const int at = in ? col : 0;
            const unsigned keep = in ? ~0u : 0u;      // a column past k: W read as +0 (0 * inf would be NaN)
            xv[u] = in ? xr[at] : 0.0f;
#pragma unroll
            for (int j = 0; j < C; ++j) wv[u][j] = __uint_as_float(__float_as_uint(w[(size_t)min(j, c - 1) * k + at]) & keep);
        }
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u)
#pragma unroll
            for (int j = 0; j < C; ++j) acc[j] = fmaf(xv[u], wv[u][j], acc[j]);
    }
#pragma unroll
    for (int j = 0; j < C; ++j) {
        if (j < c) {
            const float v = warp_sum(acc[j]);
            if (lane == 0) part[warp][j] = v;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    float z = -INFINITY;
    if (lane < c) {
        float s = 0.0f;
        for (int q = 0; q < kRowWarps; ++q) s += part[q][lane];
        z = s + (bias != nullptr ? bias[lane] : 0.0f);
        logits[(size_t)row * c + lane] = z;
    }
    const int label = labels[row];
    float *gr = g + (size_t)row * c;
    if (label < 0 || label >= c) {
        if (lane < c) gr[lane] = NAN;
        if (lane == 0) row_loss[row] = NAN;
        return;
    }
    const float m = warp_max(z);
    const float e = lane < c ? expf(z - m) : 0.0f;
    const float s = warp_sum(e);
    if (lane < c) gr[lane] = (e / s - (lane == label ? 1.0f : 0.0f)) / (float)n;
    const float z_label = __shfl_sync(0xffffffffu, z, label);
    if (lane == 0) row_loss[row] = logf(s) - (z_label - m);
}

// Block 0: the loss and dbias.  Block b > 0: columns [32 (b - 1), 32 b) of x, a lane per column; warp q takes rows
// [q R, (q + 1) R) (R = ceil(n / 8)), kGradRows of x loaded at a time, and writes dx there; the warps' dw sums are
// then added in warp order (shared memory).  g's rows are read by every lane of a warp at once (one broadcast).
template <int C>
__global__ void __launch_bounds__(kGradThreads)
linear_xent_grads_kernel(const float *__restrict__ x, const float *__restrict__ w, const float *__restrict__ g,
                         const float *__restrict__ row_loss, int n, int k, int c, float *__restrict__ loss,
                         float *__restrict__ dbias, float *__restrict__ dx, float *__restrict__ dw) {
    cydnn::pdl_wait();
    const int t = threadIdx.x;
    if (blockIdx.x == 0) {
        __shared__ float partial[kGradThreads];
        const float mean = cydnn::mean_tree(row_loss, n, partial);      // mean_kernel's order: the same bits
        if (t == 0) *loss = mean;
        if (dbias == nullptr) return;
        // dbias: warp q sums rows q, q + 8, ... of class `lane`; then the 8 warps' sums in warp order
        __shared__ float bsum[kGradWarps][kWarp];
        const int lane = t % kWarp, warp = t / kWarp;
        float b = 0.0f;
        if (lane < c)
            for (int i = warp; i < n; i += kGradWarps) b += g[(size_t)i * c + lane];
        bsum[warp][lane] = b;
        __syncthreads();
        if (t < c) {
            float total = 0.0f;
            for (int q = 0; q < kGradWarps; ++q) total += bsum[q][t];
            dbias[t] = total;
        }
        return;
    }
    __shared__ float part[kGradWarps][C][kWarp];
    const int lane = t % kWarp, warp = t / kWarp;
    const int col = (blockIdx.x - 1) * kWarp + lane;
    const bool in = col < k;
    const int at = in ? col : 0;
    const int per_warp = (n + kGradWarps - 1) / kGradWarps;
    const int first = warp * per_warp, last = min(n, first + per_warp);
    float wc[C], acc[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
        wc[j] = j < c ? w[(size_t)j * k + at] : 0.0f;
        acc[j] = 0.0f;
    }
    for (int i0 = first; i0 < last; i0 += kGradRows) {
        float xv[kGradRows];
#pragma unroll
        for (int r = 0; r < kGradRows; ++r) xv[r] = i0 + r < last ? x[(size_t)(i0 + r) * k + at] : 0.0f;
#pragma unroll
        for (int r = 0; r < kGradRows; ++r) {
            if (i0 + r >= last) break;
            const float *gi = g + (size_t)(i0 + r) * c;
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < C; ++j) {
                if (j < c) {
                    const float gij = gi[j];
                    acc[j] = fmaf(gij, xv[r], acc[j]);
                    d = fmaf(gij, wc[j], d);
                }
            }
            if (dx != nullptr && in) dx[(size_t)(i0 + r) * k + col] = d;
        }
    }
#pragma unroll
    for (int j = 0; j < C; ++j) part[warp][j][lane] = acc[j];
    __syncthreads();
    for (int idx = t; idx < C * kWarp; idx += kGradThreads) {
        const int j = idx / kWarp, l = idx % kWarp, cl = (blockIdx.x - 1) * kWarp + l;
        if (j >= c || cl >= k) continue;
        float s = 0.0f;
        for (int q = 0; q < kGradWarps; ++q) s += part[q][j][l];
        dw[(size_t)j * k + cl] = s;
    }
}

template <int C>
cydnnStatus_t launch_head(cydnnContext *ctx, const float *x, const float *w, const float *bias,
                          const int32_t *labels, int n, int k, int c, float *logits, float *row_loss, float *loss,
                          float *g, float *dbias, float *dx, float *dw) {
    const char *op = "linear_xent";
    CYDNN_LAUNCH(linear_xent_rows_kernel<C>, (unsigned)n, kRowThreads, 0, ctx->stream, x, w, bias, labels, n, k, c,
                 logits, row_loss, g);
    CYDNN_LAUNCH_CHECK(op, "linear_xent_rows_kernel");
    const unsigned blocks = 1u + (unsigned)((k + kWarp - 1) / kWarp);
    CYDNN_LAUNCH(linear_xent_grads_kernel<C>, blocks, kGradThreads, 0, ctx->stream, x,
                 w, (const float *)g, (const float *)row_loss, n, k, c, loss, dbias, dx, dw);
    CYDNN_LAUNCH_CHECK(op, "linear_xent_grads_kernel");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

// ------------------------------------------------------- the C boundary

cydnnStatus_t cydnn_linear_xent(cydnnContext *ctx, const float *x, const float *w, const float *bias,
                                const int32_t *labels, int n, int k, int c, float *logits, float *row_loss,
                                float *loss, float *g, float *dbias, float *dx, float *dw) {
    const char *op = "linear_xent";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && w != nullptr && labels != nullptr, "x, w or labels is NULL");
    CYDNN_REQUIRE(op, logits != nullptr && row_loss != nullptr && loss != nullptr && g != nullptr && dw != nullptr,
                  "logits, row_loss, loss, g or dw is NULL");
    CYDNN_REQUIRE(op, n >= 1 && k >= 1 && c >= 1, "sizes must be >= 1 (n=%d, k=%d, c=%d)", n, k, c);
    CYDNN_REQUIRE(op, c <= kMaxClasses, "at most %d classes, got %d", kMaxClasses, c);
    if (c <= 16)
        return launch_head<16>(ctx, x, w, bias, labels, n, k, c, logits, row_loss, loss, g, dbias, dx, dw);
    return launch_head<32>(ctx, x, w, bias, labels, n, k, c, logits, row_loss, loss, g, dbias, dx, dw);
}
