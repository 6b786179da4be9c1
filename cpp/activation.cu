// activation.cu -- elementwise activations, dropout and the elementwise product.
//
//   relu:    y = max(x, 0)               dx = dy * (y > 0)        custom kernels
//   leaky:   y = x > 0 ? x : a x         dx = x > 0 ? dy : a dy   custom kernels (from x)
//   tanh:    y = tanh(x)                 dx = dy * (1 - y^2)      cuDNN
//   sigmoid: y = 1 / (1 + exp(-x))       dx = dy * y * (1 - y)    cuDNN
//   dropout: mask = kept ? scale : 0,  y = x * mask               custom kernel
//   mul:     out = a * b                                          custom kernel
//
// Every buffer is a flat array of `count` floats.  The custom kernels read and
// write four floats at a time (float4) when all their pointers are 16-byte
// aligned, which lets each thread move 16 bytes per instruction; the last
// count % 4 elements (the tail), or all of them when a pointer is not
// aligned, go through a scalar loop in the same kernel.  They may run in
// place (y == x): each element is read and written by the same thread.
#include <climits>
#include <new>

#include "common.cuh"

namespace {

// True when every pointer given is 16-byte aligned (float4 loads are legal).
bool aligned16(const void *a, const void *b, const void *c = nullptr) {
    return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15u) == 0;
}

// Number of float4 vectors the vector loop handles (0: all scalar), and the
// number of threads worth launching: enough for the vector loop and the tail.
size_t vector_count(size_t count, bool aligned) { return aligned ? count / 4 : 0; }
size_t work_items(size_t count, size_t nvec) {
    const size_t scalar = count - 4 * nvec;
    return nvec > scalar ? nvec : scalar;
}

// max(x, 0) as numpy's np.maximum(x, 0): NaN stays NaN, -0 becomes +0.
__device__ __forceinline__ float relu(float v) { return v <= 0.0f ? 0.0f : v; }

// The derivative of relu at the output y: 1 where y > 0, else 0.
__device__ __forceinline__ float relu_mask(float y) { return y > 0.0f ? 1.0f : 0.0f; }

// --------------------------------------------------------------- kernels
// y[i] = relu(x[i]).  Thread t handles float4 vectors t, t + stride, ... of the
// first 4*nvec elements, then elements 4*nvec + t, 4*nvec + t + stride, ... of
// the rest (grid-stride loops, stride = total threads).
__global__ void relu_forward_kernel(const float *x, float *y, size_t count, size_t nvec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    float4 *y4 = reinterpret_cast<float4 *>(y);
    for (size_t i = tid; i < nvec; i += stride) {
        float4 v = x4[i];
        v.x = relu(v.x);
        v.y = relu(v.y);
        v.z = relu(v.z);
        v.w = relu(v.w);
        y4[i] = v;
    }
    for (size_t i = 4 * nvec + tid; i < count; i += stride) y[i] = relu(x[i]);
}

// dx[i] = dy[i] * (y[i] > 0 ? 1 : 0), where y is the forward's output: a real
// product, as numpy's dy * (y > 0), so a masked negative dy gives -0 and a
// masked inf / NaN gives NaN, bit for bit like the twin.  Same thread mapping
// as relu_forward_kernel.
__global__ void relu_backward_kernel(const float *y, const float *dy, float *dx, size_t count,
                                     size_t nvec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 *y4 = reinterpret_cast<const float4 *>(y);
    const float4 *dy4 = reinterpret_cast<const float4 *>(dy);
    float4 *dx4 = reinterpret_cast<float4 *>(dx);
    for (size_t i = tid; i < nvec; i += stride) {
        const float4 yv = y4[i];
        const float4 g = dy4[i];
        float4 r;
        r.x = g.x * relu_mask(yv.x);
        r.y = g.y * relu_mask(yv.y);
        r.z = g.z * relu_mask(yv.z);
        r.w = g.w * relu_mask(yv.w);
        dx4[i] = r;
    }
    for (size_t i = 4 * nvec + tid; i < count; i += stride) dx[i] = dy[i] * relu_mask(y[i]);
}

// Leaky ReLU with slope a, as PyTorch (and np.where(x > 0, x, a * x)): a NaN x gives
// a * NaN = NaN.  The backward reads the forward's input x: dx = x > 0 ? dy : a * dy.
// Same thread mapping as relu_forward_kernel.
__device__ __forceinline__ float leaky(float v, float a) { return v > 0.0f ? v : a * v; }
__device__ __forceinline__ float leaky_grad(float v, float g, float a) { return v > 0.0f ? g : a * g; }

__global__ void leaky_relu_forward_kernel(const float *x, float *y, size_t count, size_t nvec,
                                          float a) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    float4 *y4 = reinterpret_cast<float4 *>(y);
    for (size_t i = tid; i < nvec; i += stride) {
        const float4 v = x4[i];
        y4[i] = make_float4(leaky(v.x, a), leaky(v.y, a), leaky(v.z, a), leaky(v.w, a));
    }
    for (size_t i = 4 * nvec + tid; i < count; i += stride) y[i] = leaky(x[i], a);
}

__global__ void leaky_relu_backward_kernel(const float *x, const float *dy, float *dx, size_t count,
                                           size_t nvec, float a) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    const float4 *dy4 = reinterpret_cast<const float4 *>(dy);
    float4 *dx4 = reinterpret_cast<float4 *>(dx);
    for (size_t i = tid; i < nvec; i += stride) {
        const float4 v = x4[i];
        const float4 g = dy4[i];
        dx4[i] = make_float4(leaky_grad(v.x, g.x, a), leaky_grad(v.y, g.y, a), leaky_grad(v.z, g.z, a),
                             leaky_grad(v.w, g.w, a));
    }
    for (size_t i = 4 * nvec + tid; i < count; i += stride) dx[i] = leaky_grad(x[i], dy[i], a);
}

// out[i] = a[i] * b[i].  Same thread mapping as relu_forward_kernel.
__global__ void mul_kernel(const float *a, const float *b, float *out, size_t count,
                           size_t nvec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const float4 *a4 = reinterpret_cast<const float4 *>(a);
    const float4 *b4 = reinterpret_cast<const float4 *>(b);
    float4 *out4 = reinterpret_cast<float4 *>(out);
    for (size_t i = tid; i < nvec; i += stride) {
        const float4 u = a4[i];
        const float4 v = b4[i];
        out4[i] = make_float4(u.x * v.x, u.y * v.y, u.z * v.z, u.w * v.w);
    }
    for (size_t i = 4 * nvec + tid; i < count; i += stride) out[i] = a[i] * b[i];
}

// Dropout, one thread per element (grid-stride).  Element i is kept when the
// top 24 bits of splitmix64(seed ^ splitmix64(i)) are >= threshold
// (threshold = round(p * 2^24), so it is dropped with probability p).
// mask[i] = kept ? scale : 0 (scale = 1 / (1 - p)); y[i] = x[i] * mask[i], one
// float32 product as numpy's x * mask.  The mask is kept for the backward
// (dx = dy * mask, through cydnn_mul).  Counter-based: the result depends on
// (seed, i) only, not on the launch shape.
__global__ void dropout_forward_kernel(const float *x, float *y, float *mask, size_t count,
                                       uint32_t threshold, float scale, uint64_t seed) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const uint64_t r = cydnn::splitmix64(seed ^ cydnn::splitmix64((uint64_t)i));
        const bool kept = (r >> 40) >= (uint64_t)threshold;
        const float m = kept ? scale : 0.0f;
        mask[i] = m;
        y[i] = x[i] * m;
    }
}

// ------------------------------------------------- tanh / sigmoid (cuDNN)
// A flat buffer of `count` floats described to cuDNN as a (count, 1, 1, 1)
// tensor, and the activation descriptor; one plan per (mode, count).
struct ActivationPlan : cydnn::Plan {
    cudnnTensorDescriptor_t desc = nullptr;
    cudnnActivationDescriptor_t act = nullptr;

    ~ActivationPlan() override {
        if (act) cudnnDestroyActivationDescriptor(act);
        if (desc) cudnnDestroyTensorDescriptor(desc);
    }
};

const float kOne = 1.0f;
const float kZero = 0.0f;

cydnnStatus_t get_activation_plan(cydnnContext *ctx, cudnnActivationMode_t mode, size_t count,
                                  const char *op, ActivationPlan **out) {
    const std::string key = cydnn::format("act:mode=%d,count=%zu", (int)mode, count);
    if (ActivationPlan *found = cydnn::find_plan<ActivationPlan>(ctx, key)) {
        *out = found;
        return CYDNN_STATUS_SUCCESS;
    }
    auto plan = std::make_unique<ActivationPlan>();  // frees its descriptors if we bail out
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->desc));
    CYDNN_CUDNN(op, cudnnCreateActivationDescriptor(&plan->act));
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                               (int)count, 1, 1, 1));
    CYDNN_CUDNN(op, cudnnSetActivationDescriptor(plan->act, mode, CUDNN_NOT_PROPAGATE_NAN, 0.0));
    *out = cydnn::store_plan(ctx, key, std::move(plan));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t activation_forward(cydnnContext *ctx, cudnnActivationMode_t mode, const char *op,
                                 const float *x, float *y, size_t count) {
    ActivationPlan *plan = nullptr;
    CYDNN_TRY(get_activation_plan(ctx, mode, count, op, &plan));
    CYDNN_CUDNN(op, cudnnActivationForward(ctx->cudnn, plan->act, &kOne, plan->desc, x, &kZero,
                                           plan->desc, y));
    return CYDNN_STATUS_SUCCESS;
}

// cuDNN's backward asks for the forward's input x too, but for tanh and
// sigmoid the derivative is computed from y alone (1 - y^2, y (1 - y)); we
// only keep y, so y is passed in x's place.
cydnnStatus_t activation_backward(cydnnContext *ctx, cudnnActivationMode_t mode, const char *op,
                                  const float *y, const float *dy, float *dx, size_t count) {
    ActivationPlan *plan = nullptr;
    CYDNN_TRY(get_activation_plan(ctx, mode, count, op, &plan));
    CYDNN_CUDNN(op, cudnnActivationBackward(ctx->cudnn, plan->act, &kOne, plan->desc, y,
                                            plan->desc, dy, plan->desc, y, &kZero, plan->desc,
                                            dx));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t host_out_of_memory(const char *op) {
    return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", op);
}

}  // namespace

// ------------------------------------------------------------------ relu

cydnnStatus_t cydnn_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count) {
    CYDNN_REQUIRE_CTX("relu_forward", ctx);
    CYDNN_REQUIRE("relu_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("relu_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("relu_forward", count >= 1, "count must be >= 1");
    const size_t nvec = vector_count(count, aligned16(x, y));
    relu_forward_kernel<<<cydnn::blocks_for(work_items(count, nvec)), cydnn::kThreads, 0,
                          ctx->stream>>>(x, y, count, nvec);
    CYDNN_LAUNCH_CHECK("relu_forward", "relu_forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_relu_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                  size_t count) {
    CYDNN_REQUIRE_CTX("relu_backward", ctx);
    CYDNN_REQUIRE("relu_backward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("relu_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("relu_backward", dx != nullptr, "dx is NULL");
    CYDNN_REQUIRE("relu_backward", count >= 1, "count must be >= 1");
    const size_t nvec = vector_count(count, aligned16(y, dy, dx));
    relu_backward_kernel<<<cydnn::blocks_for(work_items(count, nvec)), cydnn::kThreads, 0,
                           ctx->stream>>>(y, dy, dx, count, nvec);
    CYDNN_LAUNCH_CHECK("relu_backward", "relu_backward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

// ------------------------------------------------------------ leaky relu

cydnnStatus_t cydnn_leaky_relu_forward(cydnnContext *ctx, const float *x, float *y, size_t count,
                                       float negative_slope) {
    CYDNN_REQUIRE_CTX("leaky_relu_forward", ctx);
    CYDNN_REQUIRE("leaky_relu_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("leaky_relu_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("leaky_relu_forward", count >= 1, "count must be >= 1");
    const size_t nvec = vector_count(count, aligned16(x, y));
    leaky_relu_forward_kernel<<<cydnn::blocks_for(work_items(count, nvec)), cydnn::kThreads, 0,
                                ctx->stream>>>(x, y, count, nvec, negative_slope);
    CYDNN_LAUNCH_CHECK("leaky_relu_forward", "leaky_relu_forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_leaky_relu_backward(cydnnContext *ctx, const float *x, const float *dy, float *dx,
                                        size_t count, float negative_slope) {
    CYDNN_REQUIRE_CTX("leaky_relu_backward", ctx);
    CYDNN_REQUIRE("leaky_relu_backward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("leaky_relu_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("leaky_relu_backward", dx != nullptr, "dx is NULL");
    CYDNN_REQUIRE("leaky_relu_backward", count >= 1, "count must be >= 1");
    const size_t nvec = vector_count(count, aligned16(x, dy, dx));
    leaky_relu_backward_kernel<<<cydnn::blocks_for(work_items(count, nvec)), cydnn::kThreads, 0,
                                 ctx->stream>>>(x, dy, dx, count, nvec, negative_slope);
    CYDNN_LAUNCH_CHECK("leaky_relu_backward", "leaky_relu_backward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

// -------------------------------------------------------- tanh, sigmoid

cydnnStatus_t cydnn_tanh_forward(cydnnContext *ctx, const float *x, float *y, size_t count) {
    CYDNN_REQUIRE_CTX("tanh_forward", ctx);
    CYDNN_REQUIRE("tanh_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("tanh_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("tanh_forward", count >= 1 && count <= INT_MAX,
                  "count must be in [1, INT_MAX], got %zu", count);
    try {
        return activation_forward(ctx, CUDNN_ACTIVATION_TANH, "tanh_forward", x, y, count);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("tanh_forward");
    }
}

cydnnStatus_t cydnn_tanh_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                  size_t count) {
    CYDNN_REQUIRE_CTX("tanh_backward", ctx);
    CYDNN_REQUIRE("tanh_backward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("tanh_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("tanh_backward", dx != nullptr, "dx is NULL");
    CYDNN_REQUIRE("tanh_backward", count >= 1 && count <= INT_MAX,
                  "count must be in [1, INT_MAX], got %zu", count);
    try {
        return activation_backward(ctx, CUDNN_ACTIVATION_TANH, "tanh_backward", y, dy, dx, count);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("tanh_backward");
    }
}

cydnnStatus_t cydnn_sigmoid_forward(cydnnContext *ctx, const float *x, float *y, size_t count) {
    CYDNN_REQUIRE_CTX("sigmoid_forward", ctx);
    CYDNN_REQUIRE("sigmoid_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("sigmoid_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("sigmoid_forward", count >= 1 && count <= INT_MAX,
                  "count must be in [1, INT_MAX], got %zu", count);
    try {
        return activation_forward(ctx, CUDNN_ACTIVATION_SIGMOID, "sigmoid_forward", x, y, count);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("sigmoid_forward");
    }
}

cydnnStatus_t cydnn_sigmoid_backward(cydnnContext *ctx, const float *y, const float *dy,
                                     float *dx, size_t count) {
    CYDNN_REQUIRE_CTX("sigmoid_backward", ctx);
    CYDNN_REQUIRE("sigmoid_backward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("sigmoid_backward", dy != nullptr, "dy is NULL");
    CYDNN_REQUIRE("sigmoid_backward", dx != nullptr, "dx is NULL");
    CYDNN_REQUIRE("sigmoid_backward", count >= 1 && count <= INT_MAX,
                  "count must be in [1, INT_MAX], got %zu", count);
    try {
        return activation_backward(ctx, CUDNN_ACTIVATION_SIGMOID, "sigmoid_backward", y, dy, dx,
                                   count);
    } catch (const std::bad_alloc &) {
        return host_out_of_memory("sigmoid_backward");
    }
}

// ---------------------------------------------------------- dropout, mul

cydnnStatus_t cydnn_dropout_forward(cydnnContext *ctx, const float *x, float *y, float *mask,
                                    size_t count, uint32_t threshold, float scale,
                                    uint64_t seed) {
    CYDNN_REQUIRE_CTX("dropout_forward", ctx);
    CYDNN_REQUIRE("dropout_forward", x != nullptr, "x is NULL");
    CYDNN_REQUIRE("dropout_forward", y != nullptr, "y is NULL");
    CYDNN_REQUIRE("dropout_forward", mask != nullptr, "mask is NULL");
    CYDNN_REQUIRE("dropout_forward", count >= 1, "count must be >= 1");
    dropout_forward_kernel<<<cydnn::blocks_for(count), cydnn::kThreads, 0, ctx->stream>>>(
        x, y, mask, count, threshold, scale, seed);
    CYDNN_LAUNCH_CHECK("dropout_forward", "dropout_forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_mul(cydnnContext *ctx, const float *a, const float *b, float *out,
                        size_t count) {
    CYDNN_REQUIRE_CTX("mul", ctx);
    CYDNN_REQUIRE("mul", a != nullptr, "a is NULL");
    CYDNN_REQUIRE("mul", b != nullptr, "b is NULL");
    CYDNN_REQUIRE("mul", out != nullptr, "out is NULL");
    CYDNN_REQUIRE("mul", count >= 1, "count must be >= 1");
    const size_t nvec = vector_count(count, aligned16(a, b, out));
    mul_kernel<<<cydnn::blocks_for(work_items(count, nvec)), cydnn::kThreads, 0, ctx->stream>>>(
        a, b, out, count, nvec);
    CYDNN_LAUNCH_CHECK("mul", "mul_kernel");
    return CYDNN_STATUS_SUCCESS;
}
