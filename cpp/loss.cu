// loss.cu -- softmax, log_softmax and the fused softmax cross-entropy.
//
//   softmax:      y[i, j] = exp(x[i, j]) / sum_k exp(x[i, k])        cuDNN, accurate mode
//   log_softmax:  y[i, j] = x[i, j] - log(sum_k exp(x[i, k]))        cuDNN, log mode
//   cross-entropy with labels t (int32):
//     loss       = mean_i (logsumexp(x[i, :]) - x[i, t_i])
//     dlogits    = (softmax(x) - onehot(t)) / n
//
// The cross-entropy is two kernels: one warp per row computes the row's loss
// and gradient; then one block averages the per-row losses with a fixed
// reduction tree (deterministic: no atomics on the loss).
#include <new>

#include "common.cuh"
#include "launch.cuh"
#include "mean_tree.cuh"
#include "warp_reduce.cuh"

namespace {

// ------------------------------------------------------ softmax (cuDNN)
// x and y (n, c) described to cuDNN as (n, c, 1, 1): INSTANCE mode then takes
// the softmax over c for each of the n rows.  One plan per (n, c).
struct SoftmaxPlan : cydnn::Plan {
    cudnnTensorDescriptor_t desc = nullptr;
    ~SoftmaxPlan() override {
        if (desc) cudnnDestroyTensorDescriptor(desc);
    }
};

const float kOne = 1.0f;
const float kZero = 0.0f;

cydnnStatus_t softmax_forward(cydnnContext *ctx, const float *x, float *y, int n, int c,
                              int log) {
    const char *op = "softmax_forward";
    const std::string key = cydnn::format("softmax:n=%d,c=%d", n, c);
    SoftmaxPlan *plan = cydnn::find_plan<SoftmaxPlan>(ctx, key);
    if (plan == nullptr) {
        auto fresh = std::make_unique<SoftmaxPlan>();  // frees its descriptor if we bail out
        CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&fresh->desc));
        CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(fresh->desc, CUDNN_TENSOR_NCHW,
                                                   CUDNN_DATA_FLOAT, n, c, 1, 1));
        plan = cydnn::store_plan(ctx, key, std::move(fresh));
    }
    const cudnnSoftmaxAlgorithm_t algo = log ? CUDNN_SOFTMAX_LOG : CUDNN_SOFTMAX_ACCURATE;
    CYDNN_CUDNN(op, cudnnSoftmaxForward(ctx->cudnn, algo, CUDNN_SOFTMAX_MODE_INSTANCE, &kOne,
                                        plan->desc, x, &kZero, plan->desc, y));
    return CYDNN_STATUS_SUCCESS;
}

// -------------------------------------------------- fused cross-entropy

constexpr int kWarp = 32;

using cydnn::warp_max;   // butterflies inside a warp (warp_reduce.cuh)
using cydnn::warp_sum;

// Kernel 1: one warp per row (grid-stride over rows; a row index is the same
// for all 32 lanes, so the whole warp takes the same branches).  Lane l reads
// columns l, l + 32, ... of the row (coalesced), in three passes:
//   1. m = max_j x[j]                         (warp_max)
//   2. s = sum_j exp(x[j] - m)                (warp_sum; subtracting m keeps exp <= 1)
//   3. dlogits[j] = (exp(x[j] - m) / s - (j == label)) / n
// and lane 0 writes row_loss = log(s) - (x[label] - m), i.e. -log_softmax[label]
// rounded as the numpy twin's -((x - m) - log(s)).
// A label outside [0, c) makes the row's loss and gradient NaN and adds 1 to
// *bad_labels (if given).
__global__ void cross_entropy_rows_kernel(const float *logits, const int32_t *labels, int n,
                                          int c, float *row_loss, float *dlogits,
                                          int32_t *bad_labels) {
    cydnn::pdl_wait();
    const int lane = threadIdx.x % kWarp;
    const size_t first_row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
    const size_t row_stride = (size_t)gridDim.x * blockDim.x / kWarp;
    const float n_float = (float)n;  // the divisor of the gradient

    for (size_t row = first_row; row < (size_t)n; row += row_stride) {
        const float *x = logits + row * c;
        float *dx = dlogits + row * c;
        const int label = labels[row];

        if (label < 0 || label >= c) {
            for (int j = lane; j < c; j += kWarp) dx[j] = NAN;
            if (lane == 0) {
                row_loss[row] = NAN;
                if (bad_labels != nullptr) atomicAdd(bad_labels, 1);
            }
            continue;
        }

        float m = -INFINITY;
        for (int j = lane; j < c; j += kWarp) m = fmaxf(m, x[j]);
        m = warp_max(m);

        float s = 0.0f;
        for (int j = lane; j < c; j += kWarp) s += expf(x[j] - m);
        s = warp_sum(s);

        for (int j = lane; j < c; j += kWarp) {
            const float p = expf(x[j] - m) / s;
            dx[j] = (p - (j == label ? 1.0f : 0.0f)) / n_float;
        }
        if (lane == 0) row_loss[row] = logf(s) - (x[label] - m);
    }
}

// Kernel 2: *loss = mean of the n per-row losses, in ONE block of
// kReduceThreads threads.  Thread t first sums rows t, t + kReduceThreads, ...
// in order, then a shared-memory tree halves the partial sums until one is
// left.  Fixed order throughout: the same bits every run (mean_tree.cuh, which compiled_head.cu shares).
constexpr int kReduceThreads = cydnn::kMeanThreads;

__global__ void mean_kernel(const float *row_loss, int n, float *loss) {
    cydnn::pdl_wait();
    __shared__ float partial[kReduceThreads];
    const float mean = cydnn::mean_tree(row_loss, n, partial);
    if (threadIdx.x == 0) *loss = mean;
}

// The two launches, on a temporary row_loss buffer the caller owns.
cydnnStatus_t launch_cross_entropy(cydnnContext *ctx, const float *logits,
                                   const int32_t *labels, int n, int c, float *row_loss,
                                   float *loss, float *dlogits, int32_t *bad_labels) {
    const int rows_per_block = cydnn::kThreads / kWarp;
    CYDNN_LAUNCH(cross_entropy_rows_kernel, cydnn::blocks_for((size_t)n, rows_per_block), cydnn::kThreads, 0,
                 ctx->stream, logits, labels, n, c, row_loss, dlogits, bad_labels);
    CYDNN_LAUNCH_CHECK("softmax_cross_entropy", "cross_entropy_rows_kernel");
    CYDNN_LAUNCH(mean_kernel, 1, kReduceThreads, 0, ctx->stream, row_loss, n, loss);
    CYDNN_LAUNCH_CHECK("softmax_cross_entropy", "mean_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t softmax_cross_entropy(cydnnContext *ctx, const float *logits,
                                    const int32_t *labels, int n, int c, float *loss,
                                    float *dlogits, int32_t *bad_labels) {
    const char *op = "softmax_cross_entropy";
    if (bad_labels != nullptr)
        CYDNN_CUDA(op, cudaMemsetAsync(bad_labels, 0, sizeof(int32_t), ctx->stream));

    float *row_loss = nullptr;
    CYDNN_TRY(cydnn::pool_alloc(ctx, (size_t)n * sizeof(float), (void **)&row_loss));
    const cydnnStatus_t launched =
        launch_cross_entropy(ctx, logits, labels, n, c, row_loss, loss, dlogits, bad_labels);
    // Freed right after the launches: the pool hands the block out again only
    // to work queued later on the same stream, which runs after these kernels.
    const cydnnStatus_t freed = cydnn::pool_free(ctx, row_loss);
    return launched != CYDNN_STATUS_SUCCESS ? launched : freed;
}

cydnnStatus_t host_out_of_memory(const char *op) {
    return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
}

}  // namespace

// ------------------------------------------------------- the C boundary

cydnnStatus_t cydnn_softmax_forward(cydnnContext *ctx, const float *x, float *y, int n, int c,
                                    int log) {
    CYDNN_REQUIRE_CTX("softmax_forward", ctx);
    CYDNN_REQUIRE("softmax_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("softmax_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("softmax_forward", n >= 1 && c >= 1, "sizes must be >= 1 (n=%d, c=%d)", n, c);
    try {
        return softmax_forward(ctx, x, y, n, c, log);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("softmax_forward");
    }
}

cydnnStatus_t cydnn_softmax_cross_entropy(cydnnContext *ctx, const float *logits,
                                          const int32_t *labels, int n, int c, float *loss,
                                          float *dlogits, int32_t *bad_labels) {
    CYDNN_REQUIRE_CTX("softmax_cross_entropy", ctx);
    CYDNN_REQUIRE("softmax_cross_entropy", logits != nullptr, "logits is NULL");
    CYDNN_REQUIRE("softmax_cross_entropy", labels != nullptr, "labels is NULL");
    CYDNN_REQUIRE("softmax_cross_entropy", loss != nullptr, "loss is NULL");
    CYDNN_REQUIRE("softmax_cross_entropy", dlogits != nullptr, "dlogits is NULL");
    CYDNN_REQUIRE("softmax_cross_entropy", n >= 1 && c >= 1, "sizes must be >= 1 (n=%d, c=%d)",
                  n, c);
    try {
        return softmax_cross_entropy(ctx, logits, labels, n, c, loss, dlogits, bad_labels);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("softmax_cross_entropy");
    }
}
