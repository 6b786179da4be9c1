// fused_net_rtc.cuh -- what the fused network's layer code needs when NVRTC compiles it
// (python/cydnn/compiler/fused_net_gen.py: a kernel generated for one network), where neither
// <cooperative_groups.h> (it needs the CCCL headers, which the NVIDIA wheels do not ship) nor
// <math.h> is at hand: the few cluster operations the layers use, as the PTX they compile to, and
// INFINITY.  nvcc builds never include it (fused_net_conv.cuh takes the real cooperative groups).
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace cg {

// The calls of cooperative_groups::cluster_group the layers make, on the same sm_90 intrinsics the
// real one calls (crt/sm_90_rt.h, which NVRTC has built in): the compiler knows what they do, so it
// may hoist a mapping out of a loop and order memory around the barrier as it does for nvcc's build
// (the first generated kernels used inline PTX for these and ran slower than the interpreter).
struct cluster_group {
    __device__ unsigned num_blocks() const { return __clusterSizeInBlocks(); }
    __device__ unsigned block_rank() const { return __clusterRelativeBlockRank(); }
    __device__ void sync() const {
        __cluster_barrier_arrive();
        __cluster_barrier_wait();
    }
    template <class T>
    __device__ T *map_shared_rank(T *p, int rank) const {
        return static_cast<T *>(__cluster_map_shared_rank(p, (unsigned)rank));
    }
};

__device__ inline cluster_group this_cluster() { return cluster_group(); }

}  // namespace cg
