// pool.cu -- 2-D max and average pooling.
//
//   x (n, c, h, w) -> y (n, c, oh, ow),  oh = (h + 2*pad_h - kh) / stride_h + 1 (likewise ow)
//
// Forward passes and the average backward go through cuDNN, with a PoolPlan
// per geometry and mode caching the descriptors.  Max pooling ignores the
// padding (a padded position never wins); average pooling divides by kh*kw,
// padding included (PyTorch's count_include_pad=True).  NaNs are not
// propagated (CUDNN_NOT_PROPAGATE_NAN).
//
// The max backward is a custom kernel, so that it is deterministic and its
// tie rule is documented: each gradient dy goes to the FIRST maximum of its
// window in row-major order.  The compiler's plans pool windows that tile the
// input (kernel == stride, no padding) with a custom forward kernel too
// (max_pool_tiled_forward: the same values, the twin's rule for NaN).
#include <climits>
#include <cstdint>
#include <new>

#include "act_math.cuh"   // fits_32
#include "common.cuh"
#include "launch.cuh"
#include "pool_tiles.cuh"

namespace {

struct PoolPlan : cydnn::Plan {
    cudnnTensorDescriptor_t x_desc = nullptr;  // (n, c, h, w)
    cudnnTensorDescriptor_t y_desc = nullptr;  // (n, c, oh, ow)
    cudnnPoolingDescriptor_t pool_desc = nullptr;

    ~PoolPlan() override {
        if (pool_desc) cudnnDestroyPoolingDescriptor(pool_desc);
        if (y_desc) cudnnDestroyTensorDescriptor(y_desc);
        if (x_desc) cudnnDestroyTensorDescriptor(x_desc);
    }
};

const float kOne = 1.0f;
const float kZero = 0.0f;

int out_size(int in, int pad, int k, int stride) { return (in + 2 * pad - k) / stride + 1; }

cydnnStatus_t check_geometry(const char *op, const cydnnPoolGeometry *g) {
    if (g == nullptr)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: geometry is NULL", op);
    if (g->n < 1 || g->c < 1 || g->h < 1 || g->w < 1 || g->kh < 1 || g->kw < 1)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: sizes must be >= 1 (n=%d c=%d h=%d w=%d kh=%d kw=%d)", op, g->n,
                           g->c, g->h, g->w, g->kh, g->kw);
    if (g->stride_h < 1 || g->stride_w < 1 || g->pad_h < 0 || g->pad_w < 0)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: strides must be >= 1 and pads >= 0 (stride %dx%d, pad %dx%d)", op,
                           g->stride_h, g->stride_w, g->pad_h, g->pad_w);
    const long long ph = (long long)g->h + 2LL * g->pad_h, pw = (long long)g->w + 2LL * g->pad_w;
    if (ph > INT_MAX || pw > INT_MAX)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: padded size overflows int", op);
    if (ph < g->kh || pw < g->kw)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: the %dx%d window is larger than the padded %lldx%lld input", op,
                           g->kh, g->kw, ph, pw);
    return CYDNN_STATUS_SUCCESS;
}

// Descriptors for one geometry and mode, built once and cached in the context.
cydnnStatus_t get_plan(cydnnContext *ctx, const cydnnPoolGeometry *g, cudnnPoolingMode_t mode,
                       const char *op, PoolPlan **out) {
    const std::string key = cydnn::format(
        "pool:mode=%d,n=%d,c=%d,h=%d,w=%d,kh=%d,kw=%d,sh=%d,sw=%d,ph=%d,pw=%d", (int)mode, g->n,
        g->c, g->h, g->w, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h, g->pad_w);
    if (PoolPlan *found = cydnn::find_plan<PoolPlan>(ctx, key)) {
        *out = found;
        return CYDNN_STATUS_SUCCESS;
    }

    auto plan = std::make_unique<PoolPlan>();  // frees its descriptors if we bail out
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->x_desc));
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->y_desc));
    CYDNN_CUDNN(op, cudnnCreatePoolingDescriptor(&plan->pool_desc));

    CYDNN_CUDNN(op, cudnnSetPooling2dDescriptor(plan->pool_desc, mode, CUDNN_NOT_PROPAGATE_NAN,
                                                g->kh, g->kw, g->pad_h, g->pad_w, g->stride_h,
                                                g->stride_w));
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->x_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                               g->n, g->c, g->h, g->w));
    const int oh = out_size(g->h, g->pad_h, g->kh, g->stride_h);
    const int ow = out_size(g->w, g->pad_w, g->kw, g->stride_w);
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->y_desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                               g->n, g->c, oh, ow));

    *out = cydnn::store_plan(ctx, key, std::move(plan));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, cudnnPoolingMode_t mode,
                           const char *op, const float *x, float *y) {
    PoolPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, mode, op, &plan));
    CYDNN_CUDNN(op, cudnnPoolingForward(ctx->cudnn, plan->pool_desc, &kOne, plan->x_desc, x,
                                        &kZero, plan->y_desc, y));
    return CYDNN_STATUS_SUCCESS;
}

// -------------------------------------------------------- max backward
// dx for max pooling, one thread per INPUT element (n, c, iy, ix); a
// grid-stride loop covers the rest.  The thread visits every output window
// that covers its element, recomputes that window's argmax from x, and adds
// the window's dy when the argmax is its own element.  Each dx is written
// exactly once, by one thread, summing in ascending (oy, ox) order: no atomics,
// no pre-zeroing, the same bits every run.
//
// Argmax rule: scan the window's in-bounds positions in row-major order,
// starting from best = -inf at the first in-bounds position, and move only
// on a strictly greater value.  So the first maximum wins ties, padded
// positions never win, and a NaN never wins (as cuDNN without NaN
// propagation); a window holding only -inf / NaN picks its first in-bounds
// position.
//
// Output window (oy, ox) covers input rows oy*stride_h - pad_h ...
// oy*stride_h - pad_h + kh - 1, so row iy is covered by the windows
//   ceil((iy + pad_h - kh + 1) / stride_h) <= oy <= floor((iy + pad_h) / stride_h),
// clipped to [0, oh - 1]; likewise for columns.
//
// I is the index type: unsigned when the tensor has fewer than 2^32 elements (a 64-bit division
// is a long instruction sequence, and there are three per element), size_t beyond.
template <typename I>
__global__ void max_pool_backward_kernel(const float *x, const float *dy, float *dx,
                                         I planes, int h, int w, int oh, int ow, int kh,
                                         int kw, int stride_h, int stride_w, int pad_h,
                                         int pad_w) {
    cydnn::pdl_wait();
    const I plane_size = (I)h * (I)w;
    const I total = planes * plane_size;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I idx = (I)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int ix = (int)(idx % (I)w);
        const int iy = (int)((idx / (I)w) % (I)h);
        const I plane = idx / plane_size;  // n * c + channel
        const float *xp = x + plane * plane_size;
        const float *dyp = dy + plane * (size_t)oh * ow;

        const int first_y = iy + pad_h - kh + 1;  // may be negative
        const int first_x = ix + pad_w - kw + 1;
        const int oy_lo = first_y <= 0 ? 0 : (first_y + stride_h - 1) / stride_h;
        const int ox_lo = first_x <= 0 ? 0 : (first_x + stride_w - 1) / stride_w;
        const int oy_hi = min((iy + pad_h) / stride_h, oh - 1);
        const int ox_hi = min((ix + pad_w) / stride_w, ow - 1);

        float grad = 0.0f;
        for (int oy = oy_lo; oy <= oy_hi; ++oy) {
            const int y0 = oy * stride_h - pad_h;  // window rows [y0, y0 + kh), clipped
            const int ys = max(y0, 0), ye = min(y0 + kh, h);
            for (int ox = ox_lo; ox <= ox_hi; ++ox) {
                const int x0 = ox * stride_w - pad_w;
                const int xs = max(x0, 0), xe = min(x0 + kw, w);
                float best = -INFINITY;
                int best_y = ys, best_x = xs;
                for (int yy = ys; yy < ye; ++yy) {
                    for (int xx = xs; xx < xe; ++xx) {
                        const float v = xp[(size_t)yy * w + xx];
                        if (v > best) {
                            best = v;
                            best_y = yy;
                            best_x = xx;
                        }
                    }
                }
                if (best_y == iy && best_x == ix) grad += dyp[(size_t)oy * ow + ox];
            }
        }
        dx[idx] = grad;
    }
}

// Max pooling whose windows tile x (kernel == stride, no padding, h and w whole numbers of windows): an output a
// thread, the same first-maximum rule as the backward and the CPU twin (strictly greater from -inf: NaN never
// wins, a window of -inf / NaN only gives -inf).  Output o = (plane * oh + oy) * ow + ox reads rows
// (plane * oh + oy) * kh .. + kh of x's (n * c * h, w) rows (h = oh * kh).  vec2: a 2x2 window as two float2.
// cuDNN's pooling kernel took 4.3-5.8 us a layer in the CNN's step at batch 64 (session 30, ncu).
template <typename I>
__global__ void max_pool_tiled_kernel(const float *x, float *y, I total, int ow, int kh, int kw, int w, int vec2) {
    cydnn::pdl_wait();
    const I stride = (I)gridDim.x * blockDim.x;
    for (I o = (I)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
        const I row = o / (I)ow;
        const int ox = (int)(o - row * (I)ow);
        const float *p = x + row * (I)kh * (I)w + (I)ox * (I)kw;
        float best = -INFINITY;
        if (vec2) {
            const float2 a = *reinterpret_cast<const float2 *>(p), b = *reinterpret_cast<const float2 *>(p + w);
            if (a.x > best) best = a.x;
            if (a.y > best) best = a.y;
            if (b.x > best) best = b.x;
            if (b.y > best) best = b.y;
        } else {
            for (int yy = 0; yy < kh; ++yy)
                for (int xx = 0; xx < kw; ++xx) {
                    const float v = p[(I)yy * (I)w + xx];
                    if (v > best) best = v;
                }
        }
        y[o] = best;
    }
}

// ------------------------------------------------------------------ ops

cydnnStatus_t max_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                               float *y) {
    const char *op = "max_pool_forward";
    CYDNN_REQUIRE_CTX("max_pool_forward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("max_pool_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("max_pool_forward", y != nullptr, "y is NULL");
    return pool_forward(ctx, g, CUDNN_POOLING_MAX, op, x, y);
}

cydnnStatus_t max_pool_tiled_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x, float *y) {
    const char *op = "max_pool_tiled_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr, "x or y is NULL");
    CYDNN_TRY(cydnn::check_pool_tiles(op, g));
    const int oh = g->h / g->kh, ow = g->w / g->kw;
    const size_t total = (size_t)g->n * g->c * oh * ow;
    // 2x2 windows as float2: every row of x starts 8-byte aligned when x is (w is even)
    const int vec2 = g->kh == 2 && g->kw == 2 && reinterpret_cast<uintptr_t>(x) % 8 == 0;
    if (cydnn::fits_32((size_t)g->n * g->c * g->h * g->w))
        CYDNN_LAUNCH(max_pool_tiled_kernel<unsigned>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, y, (unsigned)total, ow, g->kh, g->kw, g->w, vec2);
    else
        CYDNN_LAUNCH(max_pool_tiled_kernel<size_t>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, y, total, ow, g->kh, g->kw, g->w, vec2);
    CYDNN_LAUNCH_CHECK(op, "max_pool_tiled_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t max_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                                const float *dy, float *dx) {
    const char *op = "max_pool_backward";
    CYDNN_REQUIRE_CTX("max_pool_backward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("max_pool_backward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("max_pool_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("max_pool_backward", dx != nullptr, "dx is NULL");

    const int oh = out_size(g->h, g->pad_h, g->kh, g->stride_h);
    const int ow = out_size(g->w, g->pad_w, g->kw, g->stride_w);
    const size_t planes = (size_t)g->n * g->c;
    const size_t total = planes * g->h * g->w;
    if (cydnn::fits_32(total))
        CYDNN_LAUNCH(max_pool_backward_kernel<unsigned>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, dy, dx, (unsigned)planes, g->h, g->w, oh, ow, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h,
            g->pad_w);
    else
        CYDNN_LAUNCH(max_pool_backward_kernel<size_t>, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
            x, dy, dx, planes, g->h, g->w, oh, ow, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h,
            g->pad_w);
    CYDNN_LAUNCH_CHECK("max_pool_backward", "max_pool_backward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t avg_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                               float *y) {
    const char *op = "avg_pool_forward";
    CYDNN_REQUIRE_CTX("avg_pool_forward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("avg_pool_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("avg_pool_forward", y != nullptr, "y is NULL");
    return pool_forward(ctx, g, CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, op, x, y);
}

cydnnStatus_t avg_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                                const float *y, const float *dy, float *dx) {
    const char *op = "avg_pool_backward";
    CYDNN_REQUIRE_CTX("avg_pool_backward", ctx);
    CYDNN_TRY(check_geometry(op, g));
    CYDNN_REQUIRE("avg_pool_backward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("avg_pool_backward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("avg_pool_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("avg_pool_backward", dx != nullptr, "dx is NULL");

    PoolPlan *plan = nullptr;
    CYDNN_TRY(get_plan(ctx, g, CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, op, &plan));
    // dx = each dy spread evenly (1 / (kh*kw)) over its window; dy shares y's descriptor.
    CYDNN_CUDNN(op, cudnnPoolingBackward(ctx->cudnn, plan->pool_desc, &kOne, plan->y_desc, y,
                                         plan->y_desc, dy, plan->x_desc, x, &kZero, plan->x_desc,
                                         dx));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t host_out_of_memory(const char *op) {
    return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
}

}  // namespace

// ------------------------------------------------------- the C boundary

cydnnStatus_t cydnn_max_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                     const float *x, float *y) {
    try {
        return max_pool_forward(ctx, g, x, y);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("max_pool_forward");
    }
}

cydnnStatus_t cydnn_max_pool_tiled_forward(cydnnContext *ctx, const cydnnPoolGeometry *g, const float *x,
                                           float *y) {
    return max_pool_tiled_forward(ctx, g, x, y);  // allocates nothing on the host
}

cydnnStatus_t cydnn_max_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                      const float *x, const float *dy, float *dx) {
    return max_pool_backward(ctx, g, x, dy, dx);  // allocates nothing on the host
}

cydnnStatus_t cydnn_avg_pool_forward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                     const float *x, float *y) {
    try {
        return avg_pool_forward(ctx, g, x, y);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("avg_pool_forward");
    }
}

cydnnStatus_t cydnn_avg_pool_backward(cydnnContext *ctx, const cydnnPoolGeometry *g,
                                      const float *x, const float *y, const float *dy,
                                      float *dx) {
    try {
        return avg_pool_backward(ctx, g, x, y, dy, dx);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("avg_pool_backward");
    }
}
