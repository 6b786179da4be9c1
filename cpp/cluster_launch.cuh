// cluster_launch.cuh -- what every thread-block-cluster kernel of the library sets up before its
// launch: the device's opt-in shared memory limit, the kernel's attributes (dynamic shared memory
// up to that limit, clusters of 16 blocks: beyond the portable 8, which sm_90 allows), and the
// launch configuration with the cluster attribute.  Used by fused_net.cu (the interpreted and the
// generated forward), fused_net_resident.cu, fused_train.cu and gemm_skinny.cu.
#pragma once

#include <atomic>

#include "common.cuh"

namespace cydnn {

// Whether the device has thread-block clusters (compute capability 9.0 or newer): an error saying so if not.
inline cydnnStatus_t cluster_capable(const char *op, int device) {
    int major = 0;
    CYDNN_CUDA(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CYDNN_REQUIRE(op, major >= 9, "thread-block clusters need compute capability 9.0 or newer, this device "
                  "has %d.x", major);
    return CYDNN_STATUS_SUCCESS;
}

// The shared memory one block may opt in to on the context's device (bytes), checking first that
// the device has thread-block clusters.
inline cydnnStatus_t cluster_smem_limit(const char *op, int device, int *limit) {
    CYDNN_TRY(cluster_capable(op, device));
    CYDNN_CUDA(op, cudaDeviceGetAttribute(limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return CYDNN_STATUS_SUCCESS;
}

// A cluster kernel's attributes: dynamic shared memory up to `limit` less the `reserved` bytes of
// its static shared memory, and clusters of up to 16 blocks.  Idempotent: two threads racing here
// do no harm.  Returns the CUDA error and names the failed call in *call (for a caller that must
// undo something before it reports).
inline cudaError_t cluster_attributes(const void *kernel, int limit, int reserved, const char **call) {
    *call = "cudaFuncSetAttribute (shared memory)";
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit - reserved);
    if (e != cudaSuccess) return e;
    *call = "cudaFuncSetAttribute (cluster size)";
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// Once per kernel (`done` its flag): the device's limit into *limit and the kernel's attributes, for a kernel
// launched from the library (a launch of a few microseconds: attribute calls on every launch would cost a
// measurable part of it).  Racing threads set the same values.
inline cydnnStatus_t cluster_prepare_once(const char *op, int device, const void *kernel, int reserved,
                                          std::atomic<int> &limit) {
    if (limit.load() != 0) return CYDNN_STATUS_SUCCESS;
    int l = 0;
    const char *call = nullptr;
    CYDNN_TRY(cluster_smem_limit(op, device, &l));
    const cudaError_t e = cluster_attributes(kernel, l, reserved, &call);
    if (e != cudaSuccess) return cuda_failure(e, op, call);
    limit.store(l);
    return CYDNN_STATUS_SUCCESS;
}

// The configuration of a launch of a grid of `blocks` (clusters along x) of `threads` threads in clusters of
// `cluster` blocks (attr: storage for the one attribute, alive until the launch).
inline cudaLaunchConfig_t cluster_config(dim3 blocks, unsigned threads, size_t smem, cudaStream_t stream,
                                         int cluster, cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = blocks;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

inline bool cluster_size_ok(int cluster) {
    return cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8 || cluster == 16;
}

}  // namespace cydnn
