// launch.cuh -- programmatic dependent launch (PDL, sm_90) for the library's own kernels.
//
// A kernel launched with launch_pdl may start while the kernel before it on the stream is still finishing: its
// blocks are scheduled, and they wait in pdl_wait() -- griddepcontrol.wait, the first statement of every such kernel
// -- until every grid it depends on has completed and its memory is visible.  What overlaps is the launch itself
// (the grid's setup and the blocks' scheduling), about 0.3 us of each boundary between two kernels in a replayed
// graph on the H100 (docs/performance/zoo-session-29.md: 1.63 -> 1.35 us a tiny kernel, measured with
// .diag/pdl.cu).  A training step of the zoo launches 25-35 kernels, most of them ours.
//
// Rules: a kernel launched by launch_pdl calls pdl_wait() before it reads or writes global memory (then nothing it
// touches can race with the kernel before it); a kernel launched the plain way may call it too (it returns at
// once).  The attribute is recorded by stream capture (a programmatic edge in the graph).  $CYDNN_PDL=0 (read once)
// launches every kernel the plain way, for comparison and as a way out.
#pragma once

#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

namespace cydnn {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launches use the attribute: not where $CYDNN_PDL is "0" (read at the first launch).
inline bool pdl_on() {
    static const bool on = [] {
        const char *v = std::getenv("CYDNN_PDL");
        return v == nullptr || std::strcmp(v, "0") != 0;
    }();
    return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where pdl_on();
// `extra` (may be null): one more attribute (a cluster's dimensions).  The caller checks the launch as before
// (CYDNN_LAUNCH_CHECK: a failed launch is the runtime's last error).
template <typename... KArgs, typename... Args>
inline cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              const cudaLaunchAttribute *extra, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attrs[2];
    unsigned n = 0;
    if (extra != nullptr) attrs[n++] = *extra;
    if (pdl_on()) {
        attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    cfg.attrs = attrs;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

}  // namespace cydnn

// kernel<<<grid, block, smem, stream>>>(...) as a programmatic dependent launch (launch.cuh).
#define CYDNN_LAUNCH(kernel, grid, block, smem, stream, ...) \
    (void)cydnn::launch_pdl(kernel, dim3(grid), dim3(block), (size_t)(smem), stream, nullptr, __VA_ARGS__)
