// conv_wgrad.cuh -- what conv.cu calls in conv_wgrad.cu: a convolution's filter gradient as a split GEMM.
#pragma once

#include "common.cuh"

namespace cydnn {

// dw (k, c, kh, kw) of the convolution g by tile `tile` (cydnn_conv_wgrad_tile) on `stream`, the split's partial
// sums in the context's workspace `workspace` (kMainWorkspace or kSideWorkspace: the one of that stream).
cydnnStatus_t conv_wgrad(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x, const float *dy,
                         float *dw, int tile, cudaStream_t stream, int workspace, const char *op);

}  // namespace cydnn
