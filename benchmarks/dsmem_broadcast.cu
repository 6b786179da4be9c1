// What a fused-network layer's broadcast costs (docs/performance.md, session 25): a cluster of R blocks x 512
// threads; each block stores its 1/R share of N floats into every block's shared memory, then a cluster
// barrier, as a one-image layer of the fused network does (cpp/fused_net_conv.cuh's store_all).  Variants:
// scalar stores (store_all's), float4 stores, local stores only (the barrier's cost), the ranks staggered
// (round r to rank + r), and a pull (local stores, a barrier, then float4 reads of every other block's slice).
// Per layer: (11 layers - 1 layer) / 10, each kernel timed over 20 launches with events.
//
//   nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/dsmem benchmarks/dsmem_broadcast.cu && /tmp/dsmem
#include <cstdio>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

template <int MODE>
__global__ void __launch_bounds__(512) bcast(int n, int reps, float *out) {
    extern __shared__ float4 sm4[];
    float *sm = reinterpret_cast<float *>(sm4);
    cg::cluster_group cluster = cg::this_cluster();
    const int R = cluster.num_blocks(), rank = cluster.block_rank();
    const int per = (n + R - 1) / R, lo = per * rank, hi = min(lo + per, n);
    float *buf = sm, *other = sm + n;
    cluster.sync();
    for (int rep = 0; rep < reps; ++rep) {
        float *dst = (rep & 1) ? other : buf;
        if (MODE == 0) {                  // scalar, every rank
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
                for (int r = 0; r < R; ++r) cluster.map_shared_rank(dst, r)[i] = (float)i;
        } else if (MODE == 1) {           // float4, every rank
            for (int i = lo / 4 + threadIdx.x; i < hi / 4; i += blockDim.x)
                for (int r = 0; r < R; ++r)
                    reinterpret_cast<float4 *>(cluster.map_shared_rank(dst, r))[i] = make_float4(i, i, i, i);
        } else if (MODE == 2) {           // local only
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = (float)i;
        } else if (MODE == 3) {           // scalar, staggered: round r goes to rank (rank + r) % R
            for (int r = 0; r < R; ++r) {
                float *d = cluster.map_shared_rank(dst, (rank + r) % R);
                for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = (float)i;
            }
        } else {                          // pull: local stores, barrier, then float4 reads of every other slice
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = (float)i;
            cluster.sync();
            for (int r = 0; r < R; ++r) {
                if (r == rank) continue;
                const float4 *src = reinterpret_cast<const float4 *>(cluster.map_shared_rank(dst, r));
                for (int i = per * r / 4 + threadIdx.x; i < min(per * r + per, n) / 4; i += blockDim.x)
                    reinterpret_cast<float4 *>(dst)[i] = src[i];
            }
        }
        cluster.sync();
    }
    if (threadIdx.x == 0 && rank == 0) out[blockIdx.x] = buf[5];
}

template <int MODE>
float run(int R, int n, int reps) {
    float *out;
    cudaMalloc(&out, 4096 * 4);
    size_t smem = 2 * (size_t)n * 4;
    cudaFuncSetAttribute(bcast<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    cudaFuncSetAttribute(bcast<MODE>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(R);
    cfg.blockDim = dim3(512);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute a[1];
    a[0].id = cudaLaunchAttributeClusterDimension;
    a[0].val.clusterDim.x = R; a[0].val.clusterDim.y = 1; a[0].val.clusterDim.z = 1;
    cfg.attrs = a; cfg.numAttrs = 1;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (int w = 0; w < 3; ++w) cudaLaunchKernelEx(&cfg, bcast<MODE>, n, reps, out);
    cudaEventRecord(e0);
    for (int w = 0; w < 20; ++w) cudaLaunchKernelEx(&cfg, bcast<MODE>, n, reps, out);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) printf("error %s\n", cudaGetErrorString(err));
    cudaFree(out);
    return ms * 1000.0f / 20;
}

int main() {
    const char *names[] = {"scalar", "float4", "local", "staggered", "pull"};
    for (int R : {8, 16}) {
        for (int n : {1536, 6144, 12288, 24576}) {
            printf("R %2d n %6d:", R, n);
            for (int m = 0; m < 5; ++m) {
                float t1 = m == 0 ? run<0>(R, n, 1) : m == 1 ? run<1>(R, n, 1) : m == 2 ? run<2>(R, n, 1) : m == 3 ? run<3>(R, n, 1) : run<4>(R, n, 1);
                float t11 = m == 0 ? run<0>(R, n, 11) : m == 1 ? run<1>(R, n, 11) : m == 2 ? run<2>(R, n, 11) : m == 3 ? run<3>(R, n, 11) : run<4>(R, n, 11);
                printf("  %s %.2f us/layer", names[m], (t11 - t1) / 10);
            }
            printf("\n");
        }
    }
    return 0;
}
