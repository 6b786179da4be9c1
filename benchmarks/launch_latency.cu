// benchmarks/launch_latency.cu -- launch + cudaStreamSynchronize latency (p50 of 2,000) of an empty kernel
// under the launch configurations the fused network uses (cluster attribute, 1-16 blocks, up to
// 124 KB of dynamic shared memory, a 4.4 KB __grid_constant__ parameter), beside a plain launch.
// Standalone (no cydnn): on the GPU machine
//     nvcc -std=c++17 -O2 -arch=sm_90 -o /tmp/ll benchmarks/launch_latency.cu && /tmp/ll
// Results and what they mean: docs/performance.md, "Session 17".
#include <cstdio>
#include <chrono>
#include <vector>
#include <algorithm>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
__global__ void k_plain(float *y) { if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = 1.f; }
__global__ void __launch_bounds__(512) k_cluster(float *y) {
    extern __shared__ float s[];
    cg::cluster_group c = cg::this_cluster();
    c.sync();
    if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = 1.f;
}
struct Big { char b[4384]; };
__global__ void k_bigparam(const __grid_constant__ Big p, float *y) { if (threadIdx.x == 0 && blockIdx.x == 0) y[0] = p.b[7]; }
double p50(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
template <class F> void bench(const char *name, F f) {
    for (int i = 0; i < 200; ++i) { f(); cudaStreamSynchronize(0); }
    std::vector<double> t;
    for (int i = 0; i < 2000; ++i) {
        auto a = std::chrono::high_resolution_clock::now();
        f(); cudaStreamSynchronize(0);
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::high_resolution_clock::now() - a).count());
    }
    cudaError_t e = cudaGetLastError();
    printf("%-48s p50 %6.2f us  %s\n", name, p50(t), e ? cudaGetErrorString(e) : "");
}
int main() {
    float *y; cudaMalloc(&y, 4);
    int maxs = 0; cudaDeviceGetAttribute(&maxs, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    cudaFuncSetAttribute(k_cluster, cudaFuncAttributeMaxDynamicSharedMemorySize, maxs - 1024);
    cudaFuncSetAttribute(k_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    bench("plain <<<1,32>>>", [&] { k_plain<<<1, 32>>>(y); });
    bench("plain <<<1,512>>>", [&] { k_plain<<<1, 512>>>(y); });
    Big b{}; bench("4.4 KB grid_constant param <<<1,32>>>", [&] { k_bigparam<<<1, 32>>>(b, y); });
    for (int cl : {1, 8, 16}) for (size_t smem : {size_t(0), size_t(51328), size_t(123904)}) for (int ex = 0; ex < 2; ++ex) {
        if (ex == 0 && cl > 1) continue;
        char name[128]; snprintf(name, sizeof name, "%s cluster %d smem %zu x%d", ex ? "Ex" : "<<<>>>", cl, smem, cl);
        bench(name, [&] {
            if (!ex) { k_cluster<<<1, 512, smem>>>(y); return; }
            cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(cl); cfg.blockDim = dim3(512); cfg.dynamicSmemBytes = smem;
            cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension;
            at[0].val.clusterDim.x = cl; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
            cfg.attrs = at; cfg.numAttrs = 1;
            cudaLaunchKernelEx(&cfg, k_cluster, y);
        });
    }
    // a small kernel in between (as a relu would be), then the cluster kernel
    bench("Ex cluster 16 smem 123904 after a plain kernel", [&] {
        k_plain<<<1, 32>>>(y);
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(16); cfg.blockDim = dim3(512); cfg.dynamicSmemBytes = 123904;
        cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 16; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
        cfg.attrs = at; cfg.numAttrs = 1;
        cudaLaunchKernelEx(&cfg, k_cluster, y);
    });
    return 0;
}
