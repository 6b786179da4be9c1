// conv_igemm.cuh -- what conv.cu calls in conv_igemm.cu: the implicit-GEMM data gradient.
#pragma once

#include "common.cuh"

namespace cydnn {

// dx of a stride-1 convolution (g its forward geometry) by the implicit-GEMM kernel's tile `tile`, on the
// context's stream.  Refuses another stride, a tile out of range, or a layer beyond the kernel's tables.
cydnnStatus_t igemm_data_gradient(cydnnContext *ctx, const cydnnConvGeometry *g, const float *dy, const float *w,
                                  float *dx, int tile, const char *op);

}  // namespace cydnn
