// gemm_skinny.cuh -- what linear.cu calls in gemm_skinny.cu: a product with few rows, the reduction split over
// the blocks of a thread-block cluster.
#pragma once

#include "common.cuh"

namespace cydnn {

// c (m x n) = act(a (m x k) . B + bias) on `stream` by tile `tile` (cydnn_skinny_gemm_tile): B[r, j] = w[j, r]
// (b_kn = 0, w (n, k)) or w[r, j] (b_kn = 1, w (k, n)).  Refuses a tile out of range, NULL operands, sizes
// beyond 32-bit offsets, and a device without thread-block clusters.
cydnnStatus_t skinny_gemm(cydnnContext *ctx, const float *a, const float *w, const float *bias, float *c, int m,
                          int n, int k, int b_kn, int act, float slope, int tile, cudaStream_t stream,
                          const char *op);

}  // namespace cydnn
