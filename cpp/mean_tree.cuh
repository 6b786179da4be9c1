// mean_tree.cuh -- the mean of n per-row losses by one block, in a fixed order: the same bits every run, and the
// same bits wherever it is called (loss.cu's mean_kernel, compiled_head.cu's gradient kernel).
#pragma once

#include <cstddef>

namespace cydnn {

constexpr int kMeanThreads = 256;   // the block that calls mean_tree: a power of two (the tree halves it)

// All kMeanThreads threads of the block call it, with `partial` kMeanThreads floats of shared memory: thread t
// sums values t, t + kMeanThreads, ... in order, then a shared-memory tree halves the partial sums until one is
// left.  Returns the mean in thread 0 (the other threads' return values are not meaningful).
__device__ __forceinline__ float mean_tree(const float *values, int n, float *partial) {
    const int t = threadIdx.x;
    float sum = 0.0f;
    for (size_t i = t; i < (size_t)n; i += kMeanThreads) sum += values[i];
    partial[t] = sum;
    __syncthreads();
    for (int half = kMeanThreads / 2; half > 0; half /= 2) {
        if (t < half) partial[t] += partial[t + half];
        __syncthreads();
    }
    return partial[0] / (float)n;
}

}  // namespace cydnn
