// precision.cu -- float32 <-> float16 conversions for the half-precision
// inference path of conv_forward and linear_forward (ctx->fp16).
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

__global__ void to_half_kernel(const float *x, __half *h, size_t count) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        h[i] = __float2half_rn(x[i]);
}

// y[i] = float(h[i]) + bias[(i / inner) % channels]   (bias may be NULL)
__global__ void from_half_bias_kernel(const __half *h, const float *bias, float *y, size_t count, size_t inner,
                                      int channels) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        float v = __half2float(h[i]);
        if (bias != nullptr) v += bias[(i / inner) % (size_t)channels];
        y[i] = v;
    }
}

}  // namespace

namespace cydnn {

cydnnStatus_t to_half(cydnnContext *ctx, const float *x, void *half, size_t count, const char *op) {
    to_half_kernel<<<blocks_for(count), kThreads, 0, ctx->stream>>>(x, (__half *)half, count);
    CYDNN_LAUNCH_CHECK(op, "to_half_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t from_half_bias(cydnnContext *ctx, const void *half, const float *bias, float *y, size_t count,
                             size_t inner, int channels, const char *op) {
    from_half_bias_kernel<<<blocks_for(count), kThreads, 0, ctx->stream>>>((const __half *)half, bias, y, count,
                                                                           inner, channels);
    CYDNN_LAUNCH_CHECK(op, "from_half_bias_kernel");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace cydnn
