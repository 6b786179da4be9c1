// batchnorm.cu -- batch normalization over the channels of an NCHW tensor (PyTorch's
// BatchNorm1d / BatchNorm2d; 2-D and 3-D inputs come as (n, c, 1, 1) and (n, c, l, 1)).
//
//   training:   y = gamma (x - mu) / sqrt(var + eps) + beta, mu and var (biased) of the batch,
//               per channel over n*h*w values; running statistics updated.    cuDNN
//   inference:  the same with mu = running_mean, var = running_var.          cuDNN
//   backward, training:   dx, dgamma, dbeta through mu and var.              cuDNN
//   backward, inference:  dx = dy gamma / sqrt(var + eps) (constant statistics),
//                         dgamma = sum(dy xhat), dbeta = sum(dy).            custom kernel
//
// cuDNN mode CUDNN_BATCHNORM_SPATIAL (statistics per channel over N, H and W), never
// PER_ACTIVATION (per (c, h, w) position over N only, which is not what BatchNorm1d does on
// (n, c, l)), nor SPATIAL_PERSISTENT (faster but less accurate, which PyTorch also avoids in
// evaluation).
//
// The running statistics (cudnnBatchNormalizationForwardTraining): with f =
// exponentialAverageFactor, cuDNN sets runningMean = f * mu + (1 - f) * runningMean and
// runningVariance = f * var_unbiased + (1 - f) * runningVariance, where var_unbiased =
// var * count / (count - 1) is the *sample* variance: this is PyTorch's momentum rule with
// f = momentum (PyTorch's own cuDNN path passes its running_var straight to this call).
// The header (cudnn_ops.h, 9.x) documents the update and that f = 1 / (1 + n) at the n-th
// call gives the cumulative average (PyTorch's momentum=None); the GPU tests check both
// against the numpy twin and against PyTorch.  Both running pointers may be NULL (no update).
// resultSaveMean / resultSaveInvVariance keep mu and 1 / sqrt(var + eps) (biased var) of the
// batch for the backward.  CUDNN_BN_MIN_EPSILON is 0.0 in cuDNN 9, so any eps >= 0 is taken.
// cuDNN 9 marks these calls deprecated in favour of its graph API, as it does the pooling and
// activation calls used elsewhere in this library; they warn only with CUDNN_WARN_DEPRECATED.
#include <climits>
#include <new>

#include "common.cuh"

namespace {

// The tensor descriptor of x (n, c, h, w) and the derived (1, c, 1, 1) descriptor of the
// per-channel vectors, for one shape.
struct BatchNormPlan : cydnn::Plan {
    cudnnTensorDescriptor_t x_desc = nullptr;
    cudnnTensorDescriptor_t bn_desc = nullptr;

    ~BatchNormPlan() override {
        if (bn_desc) cudnnDestroyTensorDescriptor(bn_desc);
        if (x_desc) cudnnDestroyTensorDescriptor(x_desc);
    }
};

const float kOne = 1.0f;
const float kZero = 0.0f;
constexpr cudnnBatchNormMode_t kMode = CUDNN_BATCHNORM_SPATIAL;

cydnnStatus_t check_shape(const char *op, int n, int c, int h, int w) {
    if (n < 1 || c < 1 || h < 1 || w < 1)
        return cydnn::fail_invalid(op, "sizes must be >= 1 (n=%d c=%d h=%d w=%d)", n, c, h, w);
    if ((long long)n * c * h * w > INT_MAX)
        return cydnn::fail_invalid(op, "%d x %d x %d x %d elements is more than cuDNN takes (INT_MAX)", n,
                                   c, h, w);
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t get_plan(cydnnContext *ctx, const char *op, int n, int c, int h, int w,
                       BatchNormPlan **out) {
    CYDNN_TRY(check_shape(op, n, c, h, w));
    const std::string key = cydnn::format("bn:n=%d,c=%d,h=%d,w=%d", n, c, h, w);
    if (BatchNormPlan *found = cydnn::find_plan<BatchNormPlan>(ctx, key)) {
        *out = found;
        return CYDNN_STATUS_SUCCESS;
    }
    auto plan = std::make_unique<BatchNormPlan>();  // frees its descriptors if we bail out
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->x_desc));
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->bn_desc));
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->x_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c,
                                               h, w));
    CYDNN_CUDNN(op, cudnnDeriveBNTensorDescriptor(plan->bn_desc, plan->x_desc, kMode));
    *out = cydnn::store_plan(ctx, key, std::move(plan));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t host_out_of_memory(const char *op) {
    return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
}

// save_mean[k] = running_mean[k], save_inv_std[k] = 1 / sqrt(running_var[k] + eps): the
// statistics an evaluation forward used, kept for its backward (in the twin's float32
// arithmetic: one rounded add, sqrt and division).
__global__ void snapshot_kernel(const float *running_mean, const float *running_var, float eps,
                                float *save_mean, float *save_inv_std, int c) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < c; k += gridDim.x * blockDim.x) {
        save_mean[k] = running_mean[k];
        save_inv_std[k] = 1.0f / sqrtf(running_var[k] + eps);
    }
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); the result in thread 0.
__device__ float block_sum(float v, float *shared) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = (int)threadIdx.x < warps ? shared[threadIdx.x] : 0.0f;
    if (warp == 0)
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// The backward of evaluation mode, one block per channel k: with s = inv_std[k], over the
// channel's n * inner values i, dx[i] = dy[i] * (gamma[k] s), dbeta[k] = sum(dy[i]),
// dgamma[k] = s * sum(dy[i] (x[i] - mean[k])).
__global__ void backward_inference_kernel(const float *x, const float *dy, const float *gamma,
                                          const float *mean, const float *inv_std, float *dx,
                                          float *dgamma, float *dbeta, int n, int c, int inner) {
    __shared__ float shared[32];
    const int k = blockIdx.x;
    const float m = mean[k], s = inv_std[k], g = gamma[k] * s;
    const size_t count = (size_t)n * inner, plane = (size_t)c * inner;
    float sum_dy = 0.0f, sum_dy_xc = 0.0f;
    for (size_t j = threadIdx.x; j < count; j += blockDim.x) {
        const size_t i = (j / inner) * plane + (size_t)k * inner + j % inner;
        const float d = dy[i];
        sum_dy += d;
        sum_dy_xc += d * (x[i] - m);
        dx[i] = d * g;
    }
    sum_dy = block_sum(sum_dy, shared);
    __syncthreads();  // shared is reused by the second sum
    sum_dy_xc = block_sum(sum_dy_xc, shared);
    if (threadIdx.x == 0) {
        dbeta[k] = sum_dy;
        dgamma[k] = sum_dy_xc * s;
    }
}

}  // namespace

cydnnStatus_t cydnn_batch_norm_forward_training(cydnnContext *ctx, int n, int c, int h, int w,
                                                const float *x, const float *gamma,
                                                const float *beta, double factor,
                                                float *running_mean, float *running_var,
                                                double eps, float *y, float *save_mean,
                                                float *save_inv_std) {
    const char *op = "batch_norm_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x && gamma && beta && y && save_mean && save_inv_std,
                  "x, gamma, beta, y, save_mean and save_inv_std must not be NULL");
    CYDNN_REQUIRE(op, (running_mean == nullptr) == (running_var == nullptr),
                  "running_mean and running_var must both be NULL or both be given");
    CYDNN_REQUIRE(op, factor >= 0.0 && factor <= 1.0, "the average factor must be in [0, 1], got %g",
                  factor);
    CYDNN_REQUIRE(op, eps >= CUDNN_BN_MIN_EPSILON, "eps must be >= %g, got %g", CUDNN_BN_MIN_EPSILON,
                  eps);
    CYDNN_REQUIRE(op, (long long)n * h * w > 1, "training needs more than 1 value per channel");
    try {
        BatchNormPlan *plan = nullptr;
        CYDNN_TRY(get_plan(ctx, op, n, c, h, w, &plan));
        CYDNN_CUDNN(op, cudnnBatchNormalizationForwardTraining(
                            ctx->cudnn, kMode, &kOne, &kZero, plan->x_desc, x, plan->x_desc, y,
                            plan->bn_desc, gamma, beta, factor, running_mean, running_var, eps,
                            save_mean, save_inv_std));
        return CYDNN_STATUS_SUCCESS;
    } catch (const std::bad_alloc &) {
        return host_out_of_memory(op);
    }
}

cydnnStatus_t cydnn_batch_norm_forward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                 const float *x, const float *gamma,
                                                 const float *beta, const float *running_mean,
                                                 const float *running_var, double eps, float *y,
                                                 float *save_mean, float *save_inv_std) {
    const char *op = "batch_norm_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x && gamma && beta && running_mean && running_var && y,
                  "x, gamma, beta, running_mean, running_var and y must not be NULL");
    CYDNN_REQUIRE(op, (save_mean == nullptr) == (save_inv_std == nullptr),
                  "save_mean and save_inv_std must both be NULL or both be given");
    CYDNN_REQUIRE(op, eps >= CUDNN_BN_MIN_EPSILON, "eps must be >= %g, got %g", CUDNN_BN_MIN_EPSILON,
                  eps);
    try {
        BatchNormPlan *plan = nullptr;
        CYDNN_TRY(get_plan(ctx, op, n, c, h, w, &plan));
        CYDNN_CUDNN(op, cudnnBatchNormalizationForwardInference(
                            ctx->cudnn, kMode, &kOne, &kZero, plan->x_desc, x, plan->x_desc, y,
                            plan->bn_desc, gamma, beta, running_mean, running_var, eps));
    } catch (const std::bad_alloc &) {
        return host_out_of_memory(op);
    }
    if (save_mean != nullptr) {
        snapshot_kernel<<<cydnn::blocks_for((size_t)c), cydnn::kThreads, 0, ctx->stream>>>(
            running_mean, running_var, (float)eps, save_mean, save_inv_std, c);
        CYDNN_LAUNCH_CHECK(op, "snapshot_kernel");
    }
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_batch_norm_backward(cydnnContext *ctx, int n, int c, int h, int w,
                                        const float *x, const float *dy, const float *gamma,
                                        const float *save_mean, const float *save_inv_std,
                                        double eps, float *dx, float *dgamma, float *dbeta) {
    const char *op = "batch_norm_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x && dy && gamma && save_mean && save_inv_std && dx && dgamma && dbeta,
                  "no pointer may be NULL");
    CYDNN_REQUIRE(op, eps >= CUDNN_BN_MIN_EPSILON, "eps must be >= %g, got %g", CUDNN_BN_MIN_EPSILON,
                  eps);
    try {
        BatchNormPlan *plan = nullptr;
        CYDNN_TRY(get_plan(ctx, op, n, c, h, w, &plan));
        CYDNN_CUDNN(op, cudnnBatchNormalizationBackward(
                            ctx->cudnn, kMode, &kOne, &kZero, &kOne, &kZero, plan->x_desc, x,
                            plan->x_desc, dy, plan->x_desc, dx, plan->bn_desc, gamma, dgamma,
                            dbeta, eps, save_mean, save_inv_std));
        return CYDNN_STATUS_SUCCESS;
    } catch (const std::bad_alloc &) {
        return host_out_of_memory(op);
    }
}

cydnnStatus_t cydnn_batch_norm_backward_inference(cydnnContext *ctx, int n, int c, int h, int w,
                                                  const float *x, const float *dy,
                                                  const float *gamma, const float *save_mean,
                                                  const float *save_inv_std, float *dx,
                                                  float *dgamma, float *dbeta) {
    const char *op = "batch_norm_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x && dy && gamma && save_mean && save_inv_std && dx && dgamma && dbeta,
                  "no pointer may be NULL");
    CYDNN_TRY(check_shape(op, n, c, h, w));
    backward_inference_kernel<<<(unsigned int)c, cydnn::kThreads, 0, ctx->stream>>>(
        x, dy, gamma, save_mean, save_inv_std, dx, dgamma, dbeta, n, c, h * w);
    CYDNN_LAUNCH_CHECK(op, "backward_inference_kernel");
    return CYDNN_STATUS_SUCCESS;
}
