// conv.cu -- 2-D convolution through cuDNN's legacy convolution API.
//
//   y = conv(x, weight) + bias        x (n, c, h, w), weight (k, c, kh, kw), y (n, k, oh, ow)
//   dx = conv_backward_data(dy, weight)
//   dweight = conv_backward_filter(x, dy)
//   dbias[k] = sum of dy over n, oh, ow
//   conv_backward: all three, the filter and bias gradients on the second stream beside dx
//                  (dx by cuDNN or by an implicit-GEMM tile of conv_igemm.cu, dw by cuDNN or by a tile of
//                  conv_wgrad.cu: cydnn_conv_backward_tiles)
//
// Cross-correlation (no kernel flip), as PyTorch.  Each op gets the geometry's
// ConvPlan (descriptors, and per direction the algorithm cuDNN measured to be
// the fastest, measured on the first call of that direction), a workspace from
// the pool, and makes one cuDNN call.  The plans, the algorithm search and the
// math settings (TF32, determinism) are in conv_plan.cu / conv_plan.cuh.
#include <new>

#include "conv_igemm.cuh"
#include "conv_wgrad.cuh"
#include "conv_plan.cuh"

namespace {

using cydnn::conv::ConvPlan;
using cydnn::conv::check_geometry;
using cydnn::conv::find_backward_data;
using cydnn::conv::find_backward_filter;
using cydnn::conv::find_forward;
using cydnn::conv::get_plan;
using cydnn::conv::use_math;

const float kOne = 1.0f;
const float kZero = 0.0f;

// ------------------------------------------------------------------ ops

// Half precision (ctx->fp16, inference): x and weight to float16 in pool
// temporaries, cuDNN in half with float accumulation (tensor cores), the
// half output back to float32 with the bias added in the same pass.
cydnnStatus_t conv_forward_fp16(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                const float *weight, const float *bias, float *y) {
    const char *op = "conv_forward";
    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan, true));
    const int oh = (g->h + 2 * g->pad_h - g->kh) / g->stride_h + 1;
    const int ow = (g->w + 2 * g->pad_w - g->kw) / g->stride_w + 1;
    const size_t nx = (size_t)g->n * g->c * g->h * g->w, nw = (size_t)g->k * g->c * g->kh * g->kw;
    const size_t ny = (size_t)g->n * g->k * oh * ow;
    void *xh = nullptr, *wh = nullptr, *yh = nullptr;
    cydnnStatus_t st = cydnn::pool_alloc(ctx, 2 * nx, &xh);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::pool_alloc(ctx, 2 * nw, &wh);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::pool_alloc(ctx, 2 * ny, &yh);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::to_half(ctx, x, xh, nx, op);
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::to_half(ctx, weight, wh, nw, op);
    if (st == CYDNN_STATUS_SUCCESS && !plan->fwd_found)
        st = find_forward(ctx, plan, (const float *)xh, (const float *)wh, (float *)yh, op);
    void *ws = nullptr;
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn::get_workspace(ctx, plan->fwd_workspace, &ws, op);
    if (st == CYDNN_STATUS_SUCCESS) st = use_math(plan, plan->fwd_math, op);
    if (st == CYDNN_STATUS_SUCCESS) {
        const cudnnStatus_t e = cudnnConvolutionForward(ctx->cudnn, &kOne, plan->x_desc, xh, plan->w_desc, wh,
                                                        plan->conv_desc, plan->fwd_algo, ws, plan->fwd_workspace,
                                                        &kZero, plan->y_desc, yh);
        if (e != CUDNN_STATUS_SUCCESS) st = cydnn::cudnn_failure(e, op, "cudnnConvolutionForward (fp16)");
    }
    if (st == CYDNN_STATUS_SUCCESS)
        st = cydnn::from_half_bias(ctx, yh, bias, y, ny, (size_t)oh * ow, g->k, op);
    // Freed in stream order: the pool reuses them only for later work.
    for (void *p : {xh, wh, yh})
        if (p != nullptr) cydnn::pool_free(ctx, p);
    return st;
}

cydnnStatus_t conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                           const float *weight, const float *bias, float *y) {
    const char *op = "conv_forward";
    CYDNN_REQUIRE_CTX("conv_forward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("conv_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("conv_forward", weight != nullptr, "weight is NULL");
    CYDNN_REQUIRE("conv_forward", y != nullptr, "y is NULL");

    if (ctx->fp16) return conv_forward_fp16(ctx, g, x, weight, bias, y);

    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan));
    if (!plan->fwd_found) CYDNN_TRY(find_forward(ctx, plan, x, weight, y, op));

    void *ws = nullptr;
    CYDNN_TRY(cydnn::get_workspace(ctx, plan->fwd_workspace, &ws, op));
    CYDNN_TRY(use_math(plan, plan->fwd_math, op));
    CYDNN_CUDNN(op, cudnnConvolutionForward(ctx->cudnn, &kOne, plan->x_desc, x, plan->w_desc,
                                            weight, plan->conv_desc, plan->fwd_algo, ws,
                                            plan->fwd_workspace, &kZero, plan->y_desc, y));
    // y += bias, broadcast over n, oh, ow.
    if (bias != nullptr)
        CYDNN_CUDNN(op, cudnnAddTensor(ctx->cudnn, &kOne, plan->bias_desc, bias, &kOne,
                                       plan->y_desc, y));
    return CYDNN_STATUS_SUCCESS;
}

// The data gradient with cuDNN handle h (the context's: its stream) and workspace ws.
cydnnStatus_t data_gradient(cudnnHandle_t h, ConvPlan *plan, const float *weight, const float *dy, float *dx,
                            void *ws, const char *op) {
    CYDNN_TRY(use_math(plan, plan->bwd_data_math, op));
    CYDNN_CUDNN(op, cudnnConvolutionBackwardData(h, &kOne, plan->w_desc, weight, plan->y_desc, dy, plan->conv_desc,
                                                 plan->bwd_data_algo, ws, plan->bwd_data_workspace, &kZero,
                                                 plan->x_desc, dx));
    return CYDNN_STATUS_SUCCESS;
}

// The filter gradient (cuDNN's with workspace ws, or conv_wgrad.cu's tile dw_tile >= 0) and the bias gradient where
// asked, on the context's stream (side 0) or the second one (side 1), with that stream's cuDNN handle and workspace.
cydnnStatus_t filter_and_bias(cydnnContext *ctx, int side, ConvPlan *plan, const cydnnConvGeometry *g, const float *x,
                              const float *dy, float *dweight, float *dbias, int dw_tile, void *ws, const char *op) {
    cudnnHandle_t h = side ? ctx->cudnn_side : ctx->cudnn;
    if (dw_tile >= 0) {
        CYDNN_TRY(cydnn::conv_wgrad(ctx, g, x, dy, dweight, dw_tile, side ? ctx->side : ctx->stream,
                                    side ? cydnn::kSideWorkspace : cydnn::kMainWorkspace, op));
    } else {
        CYDNN_TRY(use_math(plan, plan->bwd_filter_math, op));
        CYDNN_CUDNN(op, cudnnConvolutionBackwardFilter(h, &kOne, plan->x_desc, x, plan->y_desc, dy, plan->conv_desc,
                                                       plan->bwd_filter_algo, ws, plan->bwd_filter_workspace, &kZero,
                                                       plan->w_desc, dweight));
    }
    if (dbias != nullptr)
        CYDNN_CUDNN(op, cudnnConvolutionBackwardBias(h, &kOne, plan->y_desc, dy, &kZero, plan->bias_desc, dbias));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t conv_backward_data(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy,
                                 const float *weight, float *dx) {
    const char *op = "conv_backward_data";
    CYDNN_REQUIRE_CTX("conv_backward_data", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("conv_backward_data", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("conv_backward_data", weight != nullptr, "weight is NULL");
    CYDNN_REQUIRE("conv_backward_data", dx != nullptr, "dx is NULL");

    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan));
    if (!plan->bwd_data_found) CYDNN_TRY(find_backward_data(ctx, plan, dy, weight, dx, op));

    void *ws = nullptr;
    CYDNN_TRY(cydnn::get_workspace(ctx, plan->bwd_data_workspace, &ws, op));
    return data_gradient(ctx->cudnn, plan, weight, dy, dx, ws, op);
}

cydnnStatus_t conv_backward_filter(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                   const float *dy, float *dweight) {
    const char *op = "conv_backward_filter";
    CYDNN_REQUIRE_CTX("conv_backward_filter", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("conv_backward_filter", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("conv_backward_filter", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("conv_backward_filter", dweight != nullptr, "dweight is NULL");

    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan));
    if (!plan->bwd_filter_found) CYDNN_TRY(find_backward_filter(ctx, plan, x, dy, dweight, op));

    void *ws = nullptr;
    CYDNN_TRY(cydnn::get_workspace(ctx, plan->bwd_filter_workspace, &ws, op));
    return filter_and_bias(ctx, 0, plan, g, x, dy, dweight, nullptr, -1, ws, op);
}

cydnnStatus_t conv_backward_bias(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy,
                                 float *dbias) {
    const char *op = "conv_backward_bias";
    CYDNN_REQUIRE_CTX("conv_backward_bias", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("conv_backward_bias", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("conv_backward_bias", dbias != nullptr, "dbias is NULL");

    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan));
    // dbias = sum of dy over n, oh, ow (no algorithm choice involved).
    CYDNN_CUDNN(op, cudnnConvolutionBackwardBias(ctx->cudnn, &kOne, plan->y_desc, dy, &kZero,
                                                 plan->bias_desc, dbias));
    return CYDNN_STATUS_SUCCESS;
}

// cuDNN on the second stream, made on the first forked backward.
cydnnStatus_t side_cudnn(cydnnContext *ctx, const char *op) {
    if (ctx->cudnn_side != nullptr) return CYDNN_STATUS_SUCCESS;
    CYDNN_TRY(cydnn::side_stream(ctx, op));
    cudnnHandle_t h = nullptr;
    CYDNN_CUDNN(op, cudnnCreate(&h));
    const cudnnStatus_t e = cudnnSetStream(h, ctx->side);
    if (e != CUDNN_STATUS_SUCCESS) {
        cudnnDestroy(h);
        return cydnn::cudnn_failure(e, op, "cudnnSetStream");
    }
    ctx->cudnn_side = h;
    return CYDNN_STATUS_SUCCESS;
}

// The whole backward of one convolution.  With dx asked, the filter (and bias) gradient runs on the
// second stream beside the data gradient, between a fork and a join: the two read the same dy and
// write different arrays, and a step of small convolutions leaves most of the GPU idle in each.
// Algorithms are searched, and both workspaces sized, before the fork (a search times on the stream).
// dx_tile >= 0: dx by that implicit-GEMM tile (stride 1) instead of cuDNN; dw_tile >= 0: the filter gradient by
// that tile of conv_wgrad.cu (the bias gradient, where asked, stays cuDNN's).
cydnnStatus_t conv_backward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x, const float *weight,
                            const float *dy, float *dx, float *dweight, float *dbias, int dx_tile, int dw_tile) {
    const char *op = "conv_backward";
    CYDNN_REQUIRE_CTX("conv_backward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("conv_backward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("conv_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("conv_backward", dweight != nullptr, "dweight is NULL");
    CYDNN_REQUIRE("conv_backward", dx == nullptr || weight != nullptr, "weight is NULL but dx is requested");

    ConvPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, op, &plan));
    CYDNN_REQUIRE("conv_backward", dx_tile < 0 || (g->stride_h == 1 && g->stride_w == 1),
                  "the implicit-GEMM data gradient takes stride 1, got %dx%d", g->stride_h, g->stride_w);
    if (dx != nullptr && dx_tile < 0 && !plan->bwd_data_found)
        CYDNN_TRY(find_backward_data(ctx, plan, dy, weight, dx, op));
    if (dw_tile < 0 && !plan->bwd_filter_found) CYDNN_TRY(find_backward_filter(ctx, plan, x, dy, dweight, op));
    if (dx == nullptr) {
        void *ws = nullptr;
        if (dw_tile < 0) CYDNN_TRY(cydnn::get_workspace(ctx, plan->bwd_filter_workspace, &ws, op));
        return filter_and_bias(ctx, 0, plan, g, x, dy, dweight, dbias, dw_tile, ws, op);
    }
    CYDNN_TRY(side_cudnn(ctx, op));
    void *ws_data = nullptr, *ws_filter = nullptr;
    if (dx_tile < 0) CYDNN_TRY(cydnn::get_workspace(ctx, plan->bwd_data_workspace, &ws_data, op));
    if (dw_tile < 0)
        CYDNN_TRY(cydnn::get_workspace(ctx, plan->bwd_filter_workspace, &ws_filter, op, cydnn::kSideWorkspace));
    CYDNN_TRY(cydnn::fork_side(ctx, op));
    const cydnnStatus_t side = filter_and_bias(ctx, 1, plan, g, x, dy, dweight, dbias, dw_tile, ws_filter, op);
    const cydnnStatus_t main = dx_tile < 0 ? data_gradient(ctx->cudnn, plan, weight, dy, dx, ws_data, op)
                                           : cydnn::igemm_data_gradient(ctx, g, dy, weight, dx, dx_tile, op);
    CYDNN_TRY(cydnn::join_side(ctx, op));
    CYDNN_TRY(side);
    return main;
}

cydnnStatus_t host_out_of_memory(const char *op) {
    return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
}

}  // namespace

// ------------------------------------------------------- the C boundary
// Building a plan allocates host memory (the key string, the plan, the map
// node); a std::bad_alloc must not cross into C.

cydnnStatus_t cydnn_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                 const float *weight, const float *bias, float *y) {
    try {
        return conv_forward(ctx, g, x, weight, bias, y);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("conv_forward");
    }
}

cydnnStatus_t cydnn_conv_backward_data(cydnnContext *ctx, const cydnnConvGeometry *g,
                                       const float *dy, const float *weight, float *dx) {
    try {
        return conv_backward_data(ctx, g, dy, weight, dx);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("conv_backward_data");
    }
}

cydnnStatus_t cydnn_conv_backward_filter(cydnnContext *ctx, const cydnnConvGeometry *g,
                                         const float *x, const float *dy, float *dweight) {
    try {
        return conv_backward_filter(ctx, g, x, dy, dweight);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("conv_backward_filter");
    }
}

cydnnStatus_t cydnn_conv_backward_bias(cydnnContext *ctx, const cydnnConvGeometry *g,
                                       const float *dy, float *dbias) {
    try {
        return conv_backward_bias(ctx, g, dy, dbias);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("conv_backward_bias");
    }
}

cydnnStatus_t cydnn_conv_backward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                  const float *weight, const float *dy, float *dx, float *dweight,
                                  float *dbias) {
    return cydnn_conv_backward_tiles(ctx, g, x, weight, dy, dx, dweight, dbias, -1, -1);
}

cydnnStatus_t cydnn_conv_backward_tiles(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                        const float *weight, const float *dy, float *dx, float *dweight,
                                        float *dbias, int dx_tile, int dw_tile) {
    try {
        return conv_backward(ctx, g, x, weight, dy, dx, dweight, dbias, dx_tile, dw_tile);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("conv_backward");
    }
}
