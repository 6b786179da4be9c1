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
//
// The float32 products run on cuBLASLt, one plan per shape (LtGemm): its
// heuristic's candidates for the product and the epilogue (the bias), timed
// once on the first call outside a capture; the fastest serves from then on
// (deterministic mode: the heuristic's first, untimed, so that a run gives the
// same bits as the last).  TF32 is the compute type where the context allows
// it.  At batch 64 the chosen algorithm is 0-35 % faster than cublasSgemm's
// choice (H100, benchmarks/lt_candidates.cu).  The candidates are those that take any
// float pointer (4-byte alignment): one algorithm per shape whatever the
// arrays' addresses, so that the same numbers give the same bits in a view
// into a flat buffer and in an array of their own (asking for the pointers'
// real alignment let a model and its saved-and-loaded copy run different
// algorithms, 1 ulp apart; with 4 bytes the fastest candidates measured as
// fast as with 256).  The forward's bias is Lt's BIAS epilogue.
// The backward's two products are independent: the weight gradient runs on a
// second stream (ctx->side, its own workspace) between a fork and a join, so
// a captured step has them as two branches of its graph.
#include <new>

#include "common.cuh"
#include "gemm_skinny.cuh"
#include "memory.cuh"

namespace {

const float kOne = 1.0f;
const float kZero = 0.0f;

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

// --------------------------------------------------------------- cuBLASLt
constexpr size_t kLtWorkspace = size_t(8) << 20;   // per stream
constexpr int kLtCandidates = 8;

// The handle, the second stream, the fork and join events and the two workspaces, made once per context.
// Allowed inside a (relaxed) capture, where none of these calls is enqueued.
cydnnStatus_t lt_setup(cydnnContext *ctx, const char *op) {
    if (ctx->lt != nullptr) return CYDNN_STATUS_SUCCESS;
    CYDNN_TRY(cydnn::side_stream(ctx, op));
    for (void *&ws : ctx->lt_workspace)
        if (ws == nullptr) CYDNN_TRY(ctx->pool->allocate(kLtWorkspace, &ws));   // kept for the context's life
    cublasLtHandle_t h = nullptr;
    CYDNN_CUBLAS(op, cublasLtCreate(&h));
    ctx->lt = h;                       // last: a setup that failed half-way is completed by the next call
    return CYDNN_STATUS_SUCCESS;
}

struct LtGemm : cydnn::Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulHeuristicResult_t found[kLtCandidates] = {};
    int count = 0, chosen = -1;
    ~LtGemm() override {
        for (cublasLtMatrixLayout_t l : {a, b, c})
            if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
        if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    }
};

// C (m x n, column-major) = op(A) op(B) [+ bias per row], the operands as cublasSgemm takes them.
struct GemmArgs {
    cublasOperation_t ta, tb;
    int m, n, k;
    const float *A; int lda;
    const float *B; int ldb;
    float *C; int ldc;
    const float *bias;
    bool relu;         // max(., 0) after the bias, in the same epilogue
};

cydnnStatus_t build_gemm(cydnnContext *ctx, const GemmArgs &g, LtGemm *p, const char *op) {
    const cublasComputeType_t compute = ctx->allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CYDNN_CUBLAS(op, cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
    CYDNN_CUBLAS(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)));
    CYDNN_CUBLAS(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)));
    if (g.bias != nullptr || g.relu) {
        const cublasLtEpilogue_t epi = g.bias == nullptr ? CUBLASLT_EPILOGUE_RELU
                                       : g.relu          ? CUBLASLT_EPILOGUE_RELU_BIAS
                                                         : CUBLASLT_EPILOGUE_BIAS;
        CYDNN_CUBLAS(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    }
    if (g.bias != nullptr)
        CYDNN_CUBLAS(op, cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                        sizeof(g.bias)));
    const bool an = g.ta == CUBLAS_OP_N, bn = g.tb == CUBLAS_OP_N;
    CYDNN_CUBLAS(op, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_32F, an ? g.m : g.k, an ? g.k : g.m, g.lda));
    CYDNN_CUBLAS(op, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_32F, bn ? g.k : g.n, bn ? g.n : g.k, g.ldb));
    CYDNN_CUBLAS(op, cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, g.m, g.n, g.ldc));
    cublasLtMatmulPreference_t pref = nullptr;
    CYDNN_CUBLAS(op, cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kLtWorkspace;
    const uint32_t any_float = 4;            // see the top of the file
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasStatus_t e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof(ws));
    for (int i = 0; i < 4 && e == CUBLAS_STATUS_SUCCESS; ++i)
        e = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &any_float, sizeof(any_float));
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulAlgoGetHeuristic(ctx->lt, p->desc, p->a, p->b, p->c, p->c, pref, kLtCandidates,
                                           p->found, &p->count);
    cublasLtMatmulPreferenceDestroy(pref);
    if (e != CUBLAS_STATUS_SUCCESS) return cydnn::cublas_failure(e, op, "cublasLtMatmulAlgoGetHeuristic");
    if (p->count < 1)
        return cydnn::fail(CYDNN_STATUS_CUBLAS_ERROR, CUBLAS_STATUS_NOT_SUPPORTED, "%s: cuBLASLt has no algorithm for %d x %d x %d", op,
                           g.m, g.n, g.k);
    return CYDNN_STATUS_SUCCESS;
}

cublasStatus_t run_gemm(cydnnContext *ctx, const GemmArgs &g, const LtGemm *p, int algo, int side) {
    if (g.bias != nullptr) {           // the pointer is part of the descriptor: this call's bias
        const cublasStatus_t e = cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                                sizeof(g.bias));
        if (e != CUBLAS_STATUS_SUCCESS) return e;
    }
    return cublasLtMatmul(ctx->lt, p->desc, &kOne, g.A, p->a, g.B, p->b, &kZero, g.C, p->c, g.C, p->c,
                          &p->found[algo].algo, ctx->lt_workspace[side], kLtWorkspace, side ? ctx->side : ctx->stream);
}

// The fastest candidate on this call's own operands: each run once, then timed over 3 calls.
cydnnStatus_t time_candidates(cydnnContext *ctx, const GemmArgs &g, LtGemm *p, int side, const char *op) {
    cudaStream_t stream = side ? ctx->side : ctx->stream;
    cudaEvent_t t0 = nullptr, t1 = nullptr;
    CYDNN_CUDA(op, cudaEventCreate(&t0));
    cudaError_t ce = cudaEventCreate(&t1);
    float best = 0.0f;
    for (int i = 0; i < p->count && ce == cudaSuccess; ++i) {
        if (run_gemm(ctx, g, p, i, side) != CUBLAS_STATUS_SUCCESS) continue;   // not for these operands
        ce = cudaEventRecord(t0, stream);
        for (int r = 0; r < 3 && ce == cudaSuccess; ++r) run_gemm(ctx, g, p, i, side);
        if (ce == cudaSuccess) ce = cudaEventRecord(t1, stream);
        if (ce == cudaSuccess) ce = cudaEventSynchronize(t1);
        float ms = 0.0f;
        if (ce == cudaSuccess) ce = cudaEventElapsedTime(&ms, t0, t1);
        if (ce == cudaSuccess && (p->chosen < 0 || ms < best)) best = ms, p->chosen = i;
    }
    cudaEventDestroy(t0);
    if (t1 != nullptr) cudaEventDestroy(t1);
    if (ce != cudaSuccess) return cydnn::cuda_failure(ce, op, "timing cuBLASLt's algorithms");
    if (p->chosen < 0)
        return cydnn::fail(CYDNN_STATUS_CUBLAS_ERROR, CUBLAS_STATUS_NOT_SUPPORTED, "%s: none of cuBLASLt's %d algorithms ran %d x %d x %d",
                           op, p->count, g.m, g.n, g.k);
    return CYDNN_STATUS_SUCCESS;
}

// One float32 product on stream `side` (0: the context's stream, 1: the second one).
cydnnStatus_t gemm_planned(cydnnContext *ctx, const GemmArgs &g, int side, const char *op) {
    CYDNN_TRY(lt_setup(ctx, op));
    const std::string key = cydnn::format(
        "lt:%d%d,m=%d,n=%d,k=%d,ld=%d/%d/%d,bias=%d,relu=%d,tf32=%d,det=%d", (int)g.ta, (int)g.tb, g.m, g.n, g.k,
        g.lda, g.ldb, g.ldc, g.bias != nullptr ? 1 : 0, g.relu ? 1 : 0, ctx->allow_tf32, ctx->deterministic);
    LtGemm *p = cydnn::find_plan<LtGemm>(ctx, key);
    if (p == nullptr) {
        auto fresh = std::make_unique<LtGemm>();
        CYDNN_TRY(build_gemm(ctx, g, fresh.get(), op));
        p = cydnn::store_plan(ctx, key, std::move(fresh));
    }
    if (p->chosen < 0) {
        if (ctx->capturing || ctx->deterministic || p->count == 1) p->chosen = 0;   // the heuristic's first
        else CYDNN_TRY(time_candidates(ctx, g, p, side, op));
    }
    const cublasStatus_t e = run_gemm(ctx, g, p, p->chosen, side);
    if (e != CUBLAS_STATUS_SUCCESS) return cydnn::cublas_failure(e, op, "cublasLtMatmul");
    return CYDNN_STATUS_SUCCESS;
}

// The plan's key, the plan and the map's node are host allocations: a std::bad_alloc must not cross into C.
cydnnStatus_t gemm(cydnnContext *ctx, const GemmArgs &g, int side, const char *op) {
    try {
        return gemm_planned(ctx, g, side, op);
    } catch (const std::bad_alloc &) {
        return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
    }
}

// --------------------------------------------------------------- kernels
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
    return cydnn_linear_forward_act(ctx, x, weight, bias, y, n, in_features, out_features, CYDNN_ACT_NONE);
}

cydnnStatus_t cydnn_linear_forward_act(cydnnContext *ctx, const float *x, const float *weight,
                                       const float *bias, float *y, int n, int in_features,
                                       int out_features, int act) {
    const char *op = "linear_forward";
    CYDNN_REQUIRE_CTX("linear_forward", ctx);
    CYDNN_REQUIRE("linear_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("linear_forward", weight != nullptr, "weight is NULL");
    CYDNN_REQUIRE("linear_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("linear_forward", n >= 1 && in_features >= 1 && out_features >= 1,
                  "sizes must be >= 1 (n=%d, in_features=%d, out_features=%d)", n, in_features,
                  out_features);
    CYDNN_REQUIRE("linear_forward", act == CYDNN_ACT_NONE || act == CYDNN_ACT_RELU,
                  "act must be 0 (none) or %d (relu), got %d", (int)CYDNN_ACT_RELU, act);

    if (ctx->fp16) {
        CYDNN_TRY(gemm_fp16(ctx, x, weight, y, n, in_features, out_features));
    } else {
        // y^T (out x n) = W (OP_T of W^T) * x^T + bias per row; see the top of the file.
        CYDNN_TRY(gemm(ctx, {CUBLAS_OP_T, CUBLAS_OP_N, out_features, n, in_features, weight, in_features, x,
                             in_features, y, out_features, bias, act == CYDNN_ACT_RELU}, 0, op));
    }
    if (ctx->fp16 && (bias != nullptr || act != CYDNN_ACT_NONE))     // half precision: the epilogue as a kernel
        CYDNN_TRY(cydnn_bias_act_forward(ctx, y, bias, y, n, out_features, 1, act, 0.0f));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_linear_backward(cydnnContext *ctx, const float *x, const float *weight,
                                    const float *dy, float *dx, float *dweight, float *dbias,
                                    int n, int in_features, int out_features) {
    return cydnn_linear_backward_ex(ctx, x, weight, dy, dx, dweight, dbias, n, in_features, out_features, -1);
}

cydnnStatus_t cydnn_linear_backward_ex(cydnnContext *ctx, const float *x, const float *weight,
                                       const float *dy, float *dx, float *dweight, float *dbias,
                                       int n, int in_features, int out_features, int dx_tile) {
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

    CYDNN_TRY(lt_setup(ctx, op));
    // dW^T (in x out) = x^T * dy.
    const GemmArgs dw{CUBLAS_OP_N, CUBLAS_OP_T, in_features, out_features, n, x, in_features, dy, out_features,
                      dweight, in_features, nullptr, false};
    if (dx == nullptr) {
        CYDNN_TRY(gemm(ctx, dw, 0, op));
    } else {
        // dx^T (in x n) = W^T * dy^T, on the context's stream; dW beside it on the second stream.
        CYDNN_TRY(cydnn::fork_side(ctx, op));
        const cydnnStatus_t side = gemm(ctx, dw, 1, op);
        // dx = dy (n x out) . W (out x in): cuBLASLt, or gemm_skinny.cu's tile dx_tile.
        const cydnnStatus_t main =
            dx_tile >= 0 ? cydnn::skinny_gemm(ctx, dy, weight, nullptr, dx, n, in_features, out_features, 1,
                                              CYDNN_ACT_NONE, 0.0f, dx_tile, ctx->stream, op)
                         : gemm(ctx, {CUBLAS_OP_N, CUBLAS_OP_N, in_features, n, out_features, weight, in_features,
                                      dy, out_features, dx, in_features, nullptr, false}, 0, op);
        CYDNN_TRY(cydnn::join_side(ctx, op));
        CYDNN_TRY(side);
        CYDNN_TRY(main);
    }
    if (dbias != nullptr) {
        const dim3 block(32, kBiasRows);
        const dim3 grid((unsigned int)(((long long)out_features + 31) / 32));
        bias_grad_kernel<<<grid, block, 0, ctx->stream>>>(dy, dbias, n, out_features);
        CYDNN_LAUNCH_CHECK("linear_backward", "bias_grad_kernel");
    }
    return CYDNN_STATUS_SUCCESS;
}
