// pool_tiles.cuh -- the one check of a pooling whose windows tile its input, shared by the kernels that take only
// such a pooling: pool.cu's tiled max pooling forward and compiled_act.cu's max pooling + activation backward.
#pragma once

#include "common.cuh"

namespace cydnn {

// kernel == stride, no padding, and the plane a whole number of windows (at least one).
inline cydnnStatus_t check_pool_tiles(const char *op, const cydnnPoolGeometry *g) {
    CYDNN_REQUIRE(op, g->stride_h == g->kh && g->stride_w == g->kw && g->pad_h == 0 && g->pad_w == 0,
                  "the windows must tile the input: kernel (%d, %d) == stride (%d, %d), padding (%d, %d) == 0",
                  g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h, g->pad_w);
    CYDNN_REQUIRE(op, g->kh >= 1 && g->kw >= 1 && g->h >= g->kh && g->w >= g->kw && g->h % g->kh == 0 &&
                  g->w % g->kw == 0, "the input (%d, %d) must be a whole number of (%d, %d) windows", g->h, g->w,
                  g->kh, g->kw);
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace cydnn
