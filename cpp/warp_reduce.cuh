// warp_reduce.cuh -- butterfly reductions inside one warp (internal): after the five steps every lane holds the
// result, in the same order on every lane and every run.  All 32 lanes must take part.  Shared by loss.cu's
// cross-entropy, compiled_head.cu's head (which must give loss.cu's bits) and the fused LeNet-5 kernels.
#pragma once

namespace cydnn {

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

}  // namespace cydnn
