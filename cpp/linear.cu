// linear.cu -- fully connected layer: cuBLAS SGEMM on row-major data.
//
//   forward:  y = x W^T + b           x (n, in), W (out, in) as PyTorch, b (out), y (n, out)
//   backward: dx = dy W               dx (n, in)       (skipped when dx is NULL)
//             dW = dy^T x             dW (out, in)
//             db = sum over rows of dy                 (skipped when db is NULL)
//
// How row-major maps onto cuBLAS (which is column-major)
// -------------------------------------------------------
// A row-major r x c matrix A, read as column-major with leading dimension c,
// is the c x r matrix A^T.  No copy is needed: we ask cuBLAS for the transpose
// of each product instead.
//
//   y = x W^T     <=>  y^T = W x^T      (column-major, out x n)
//     W  read column-major is W^T (in x out, ld = in): use it with OP_T -> W
//     x  read column-major is x^T (in x n,   ld = in): OP_N
//     y^T is y read column-major (out x n, ld = out)
//     => cublasSgemm(OP_T, OP_N, m = out, n = n, k = in, W, ld in, x, ld in, y, ld out)
//
//   dx = dy W     <=>  dx^T = W^T dy^T  (column-major, in x n)
//     W  read column-major is W^T (in x out, ld = in): OP_N
//     dy read column-major is dy^T (out x n, ld = out): OP_N
//     => cublasSgemm(OP_N, OP_N, m = in, n = n, k = out, W, ld in, dy, ld out, dx, ld in)
//
//   dW = dy^T x   <=>  dW^T = x^T dy    (column-major, in x out)
//     x  read column-major is x^T (in x n, ld = in): OP_N
//     dy read column-major is dy^T (out x n, ld = out): OP_T -> dy (n x out)
//     => cublasSgemm(OP_N, OP_T, m = in, n = out, k = n, x, ld in, dy, ld out, dW, ld in)
//
// alpha and beta are host pointers (the cuBLAS default pointer mode).
#include "common.cuh"

namespace {

const float kOne = 1.0f;
const float kZero = 0.0f;

// TF32 tensor cores for SGEMM only when the context allows them.
// CUBLAS_DEFAULT_MATH never uses TF32 for float32 SGEMM.  Get/Set only touch
// the handle on the host, so checking every call costs nothing.
cydnnStatus_t set_math_mode(cydnnContext *ctx, const char *op) {
    const cublasMath_t want = ctx->allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
    cublasMath_t have = CUBLAS_DEFAULT_MATH;
    CYDNN_CUBLAS(op, cublasGetMathMode(ctx->cublas, &have));
    if (have != want) CYDNN_CUBLAS(op, cublasSetMathMode(ctx->cublas, want));
    return CYDNN_STATUS_SUCCESS;
}

// Half precision (ctx->fp16, inference): the same product with x and W
// rounded to float16, on tensor cores, accumulated and written in float32.
cydnnStatus_t gemm_fp16(cydnnContext *ctx, const float *x, const float *weight, float *y, int n,
                        int in_features, int out_features) {
    const char *op = "linear_forward";
    const size_t nx = (size_t)n * in_features, nw = (size_t)out_features * in_features;
    void *xh = nullptr, *wh = nullptr;
    cydnnStatus_t st = cydnn::pool_alloc(ctx, 2 * nx, &xh);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::pool_alloc(ctx, 2 * nw, &wh);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::to_half(ctx, x, xh, nx, op);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::to_half(ctx, weight, wh, nw, op);
    if (st == CYDNN_STATUS_SUCCESS) {
        const cublasStatus_t e = cublasGemmEx(ctx->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out_features, n, in_features,
                                              &kOne, wh, CUDA_R_16F, in_features, xh, CUDA_R_16F, in_features,
                                              &kZero, y, CUDA_R_32F, out_features, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT);
        if (e != CUBLAS_STATUS_SUCCESS) st = cydnn::cublas_failure(e, op, "cublasGemmEx (fp16)");
    }
    for (void *p : {xh, wh})
        if (p != nullptr) cydnn::pool_free(ctx, p);
    return st;
}

// --------------------------------------------------------------- kernels
// y[r, j] += bias[j] for the row-major (n, out) y: one thread per element of
// y (grid-stride), the column is the flat index modulo out.
__global__ void add_bias_kernel(float *y, const float *bias, size_t total, int out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride)
        y[i] += bias[i % (size_t)out];
}

// dbias[j] = sum over rows r of dy[r, j], without atomics.
// A block is 32 x kBiasRows threads and owns 32 adjacent columns: thread
// (tx, ty) sums column blockIdx.x * 32 + tx over rows ty, ty + kBiasRows, ...
// (a warp reads 32 adjacent floats of one row: coalesced), then the threads
// of row ty = 0 add the kBiasRows partial sums in a fixed order.  The order of
// every addition is fixed by the launch shape: the same bits every run.
constexpr int kBiasRows = 16;

__global__ void bias_grad_kernel(const float *dy, float *dbias, int n, int out) {
    __shared__ float partial[kBiasRows][32];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (col < out)
        for (size_t r = threadIdx.y; r < (size_t)n; r += kBiasRows) sum += dy[r * out + col];
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && col < out) {
        float total = 0.0f;
        for (int k = 0; k < kBiasRows; ++k) total += partial[k][threadIdx.x];
        dbias[col] = total;
    }
}

}  // namespace

// ------------------------------------------------------------------ ops

cydnnStatus_t cydnn_linear_forward(cydnnContext *ctx, const float *x, const float *weight,
                                   const float *bias, float *y, int n, int in_features,
                                   int out_features) {
    const char *op = "linear_forward";
    CYDNN_REQUIRE_CTX("linear_forward", ctx);
    CYDNN_REQUIRE("linear_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("linear_forward", weight != nullptr, "weight is NULL");
    CYDNN_REQUIRE("linear_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("linear_forward", n >= 1 && in_features >= 1 && out_features >= 1,
                  "sizes must be >= 1 (n=%d, in_features=%d, out_features=%d)", n, in_features,
                  out_features);

    CYDNN_TRY(set_math_mode(ctx, op));
    if (ctx->fp16) {
        CYDNN_TRY(gemm_fp16(ctx, x, weight, y, n, in_features, out_features));
    } else {
        // y^T (out x n) = W (OP_T of W^T) * x^T; see the top of the file.
        CYDNN_CUBLAS(op, cublasSgemm(ctx->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out_features, n,
                                     in_features, &kOne, weight, in_features, x, in_features, &kZero,
                                     y, out_features));
    }
    if (bias != nullptr) {
        const size_t total = (size_t)n * out_features;
        add_bias_kernel<<<cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream>>>(
            y, bias, total, out_features);
        CYDNN_LAUNCH_CHECK("linear_forward", "add_bias_kernel");
    }
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_linear_backward(cydnnContext *ctx, const float *x, const float *weight,
                                    const float *dy, float *dx, float *dweight, float *dbias,
                                    int n, int in_features, int out_features) {
    const char *op = "linear_backward";
    CYDNN_REQUIRE_CTX("linear_backward", ctx);
    CYDNN_REQUIRE("linear_backward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("linear_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("linear_backward", dweight != nullptr, "dweight is NULL");
    CYDNN_REQUIRE("linear_backward", dx == nullptr || weight != nullptr,
                  "weight is NULL but dx is requested");
    CYDNN_REQUIRE("linear_backward", n >= 1 && in_features >= 1 && out_features >= 1,
                  "sizes must be >= 1 (n=%d, in_features=%d, out_features=%d)", n, in_features,
                  out_features);

    CYDNN_TRY(set_math_mode(ctx, op));
    if (dx != nullptr) {
        // dx^T (in x n) = W^T * dy^T.
        CYDNN_CUBLAS(op, cublasSgemm(ctx->cublas, CUBLAS_OP_N, CUBLAS_OP_N, in_features, n,
                                     out_features, &kOne, weight, in_features, dy, out_features,
                                     &kZero, dx, in_features));
    }
    // dW^T (in x out) = x^T * dy.
    CYDNN_CUBLAS(op, cublasSgemm(ctx->cublas, CUBLAS_OP_N, CUBLAS_OP_T, in_features,
                                 out_features, n, &kOne, x, in_features, dy, out_features, &kZero,
                                 dweight, in_features));
    if (dbias != nullptr) {
        const dim3 block(32, kBiasRows);
        const dim3 grid((unsigned int)(((long long)out_features + 31) / 32));
        bias_grad_kernel<<<grid, block, 0, ctx->stream>>>(dy, dbias, n, out_features);
        CYDNN_LAUNCH_CHECK("linear_backward", "bias_grad_kernel");
    }
    return CYDNN_STATUS_SUCCESS;
}
