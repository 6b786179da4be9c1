// fused_net_table.cuh -- the sizes of one layer of the fused network's table (cydnnNet): what it takes and
// what it gives per image.  fused_net.cu checks the table with them; fused_train.cu lays out its shared
// memory and scratch with them (and its kernel walks the layers with them).
#pragma once

#include "cydnn.h"

namespace cydnn {

__host__ __device__ inline long net_layer_in(const cydnnNetLayer &L) { return (long)L.c * L.h * L.w; }

__host__ __device__ inline long net_layer_out(const cydnnNetLayer &L) {
    switch (L.op) {
        case CYDNN_NET_LINEAR: return L.k;
        case CYDNN_NET_CONV: return L.pool ? (long)L.k * (L.oh / 2) * (L.ow / 2) : (long)L.k * L.oh * L.ow;
        case CYDNN_NET_GLOBAL_AVG_POOL: return L.c;
        case CYDNN_NET_EPILOGUE: return net_layer_in(L);
        default: return (long)L.c * L.oh * L.ow;
    }
}

}  // namespace cydnn
