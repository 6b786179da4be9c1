// benchmarks/persistent_latency.cu -- what a one-image call could cost without a launch: a resident
// ("persistent") cluster kernel that polls a request word in mapped pinned host memory, against
// launch + cudaStreamSynchronize and launch + spinning on a mapped "done" word.  Each variant reads a
// 784-float image from mapped memory in every block of a 16-block cluster (one share each, stored
// nowhere: the PCIe round trip is what counts) and writes 10 floats back.  p50 / p99 of 5,000 calls.
// Standalone (no cydnn): on the GPU machine
//     nvcc -std=c++17 -O2 -arch=sm_90 -o /tmp/pl benchmarks/persistent_latency.cu && /tmp/pl
// Results: docs/performance.md, "Session 18".
#include <cstdio>
#include <cstring>
#include <chrono>
#include <vector>
#include <algorithm>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

constexpr int kIn = 784, kOut = 10, kCl = 16;

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// the body of one call: every block reads its share of x (cv: never a stale line), a cluster barrier,
// rank 0 writes y
__device__ void body(const float *x, float *y, cg::cluster_group &cl, float *s) {
    const int rank = cl.block_rank();
    const int per = (kIn + kCl - 1) / kCl;
    float v = 0.f;
    for (int i = rank * per + threadIdx.x; i < min(kIn, rank * per + per); i += blockDim.x) v += __ldcv(x + i);
    s[threadIdx.x] = v;
    cl.sync();
    if (rank == 0 && threadIdx.x < kOut) y[threadIdx.x] = s[threadIdx.x] + 1.f;
}

__global__ void __launch_bounds__(512) k_once(const float *x, float *y, unsigned long long *done,
                                              unsigned long long seq) {
    extern __shared__ float s[];
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    body(x, y, cl, s);
    if (cl.block_rank() == 0 && threadIdx.x == 0 && done) {
        __threadfence_system();
        st_release_sys(done, seq);
    }
}

// resident: rank 0's thread 0 polls req; a cluster barrier hands the news to every block
template <bool kFence>
__global__ void __launch_bounds__(512) k_resident(const float *x, float *y, unsigned long long *req,
                                                  unsigned long long *ack, unsigned long long idle_ns) {
    extern __shared__ float s[];
    __shared__ unsigned long long next;
    cg::cluster_group cl = cg::this_cluster();
    unsigned long long served = 0;
    cl.sync();
    for (;;) {
        if (cl.block_rank() == 0 && threadIdx.x == 0) {
            const unsigned long long t0 = globaltimer();
            unsigned long long r;
            while ((r = ld_acquire_sys(req)) == served && globaltimer() - t0 < idle_ns) {
            }
            next = r;
        }
        cl.sync();
        const unsigned long long r = *cl.map_shared_rank(&next, 0);
        if (r == served || r == ~0ull) {           // idle for idle_ns, or told to stop
            cl.sync();                             // rank 0's shared memory stays until every block read it
            return;
        }
        body(x, y, cl, s);
        if (cl.block_rank() == 0) {
            __syncthreads();
            if (threadIdx.x == 0) {
                if (kFence) __threadfence_system();
                st_release_sys(ack, r);
            }
        }
        served = r;
        cl.sync();
    }
}

double pct(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[(size_t)(q * (v.size() - 1))];
}
template <class F> void bench(const char *name, F f) {
    for (int i = 0; i < 300; ++i) f();
    std::vector<double> t;
    for (int i = 0; i < 5000; ++i) {
        auto a = std::chrono::high_resolution_clock::now();
        f();
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::high_resolution_clock::now() - a).count());
    }
    cudaError_t e = cudaGetLastError();
    printf("%-56s p50 %6.2f  p99 %6.2f us  %s\n", name, pct(t, 0.5), pct(t, 0.99), e ? cudaGetErrorString(e) : "");
    fflush(stdout);
}

int main() {
    cudaSetDeviceFlags(cudaDeviceMapHost | cudaDeviceScheduleSpin);
    float *hx, *hy, *dx, *dy;
    unsigned long long *hw, *dw;   // [0] req, [1] ack / done
    cudaHostAlloc((void **)&hx, kIn * 4, cudaHostAllocMapped);
    cudaHostAlloc((void **)&hy, kOut * 4, cudaHostAllocMapped);
    cudaHostAlloc((void **)&hw, 64, cudaHostAllocMapped);
    cudaHostGetDevicePointer((void **)&dx, hx, 0);
    cudaHostGetDevicePointer((void **)&dy, hy, 0);
    cudaHostGetDevicePointer((void **)&dw, hw, 0);
    memset(hw, 0, 64);
    std::vector<float> img(kIn, 0.5f), out(kOut);
    const size_t smem = 123904;
    for (auto k : {(const void *)k_once, (const void *)k_resident<true>, (const void *)k_resident<false>}) {
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    cudaStream_t st, ps;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kCl);
    cfg.blockDim = dim3(512);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = kCl; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cfg.stream = st;
    unsigned long long seq = 0;
    volatile unsigned long long *vw = hw;

    bench("launch + cudaStreamSynchronize (cluster 16, mapped io)", [&] {
        memcpy(hx, img.data(), kIn * 4);
        cudaLaunchKernelEx(&cfg, k_once, (const float *)dx, dy, (unsigned long long *)nullptr, 0ull);
        cudaStreamSynchronize(st);
        memcpy(out.data(), hy, kOut * 4);
    });
    bench("launch + spin on a mapped done word", [&] {
        memcpy(hx, img.data(), kIn * 4);
        ++seq;
        cudaLaunchKernelEx(&cfg, k_once, (const float *)dx, dy, dw + 1, seq);
        while (vw[1] != seq) {
        }
        memcpy(out.data(), hy, kOut * 4);
    });
    cudaStreamSynchronize(st);
    // resident, with and without a system fence before the acknowledgement's release store
    cfg.stream = ps;
    for (int fence = 1; fence >= 0; --fence) {
        hw[0] = hw[1] = 0;
        seq = 0;
        if (fence) cudaLaunchKernelEx(&cfg, k_resident<true>, (const float *)dx, dy, dw, dw + 1, 2000000000ull);
        else cudaLaunchKernelEx(&cfg, k_resident<false>, (const float *)dx, dy, dw, dw + 1, 2000000000ull);
        bench(fence ? "resident kernel: post a request, spin on ack (fence)" : "resident kernel, release store only", [&] {
            memcpy(hx, img.data(), kIn * 4);
            ++seq;
            __atomic_store_n(&hw[0], seq, __ATOMIC_RELEASE);
            while (__atomic_load_n(&hw[1], __ATOMIC_ACQUIRE) != seq) {
            }
            memcpy(out.data(), hy, kOut * 4);
        });
        bench("  + cudaStreamQuery(other stream) per call", [&] {
            cudaStreamQuery(st);
            memcpy(hx, img.data(), kIn * 4);
            ++seq;
            __atomic_store_n(&hw[0], seq, __ATOMIC_RELEASE);
            while (__atomic_load_n(&hw[1], __ATOMIC_ACQUIRE) != seq) {
            }
            memcpy(out.data(), hy, kOut * 4);
        });
        auto a = std::chrono::high_resolution_clock::now();
        __atomic_store_n(&hw[0], ~0ull, __ATOMIC_RELEASE);
        cudaStreamSynchronize(ps);
        printf("stop seen after %.1f us, %s\n",
               std::chrono::duration<double, std::micro>(std::chrono::high_resolution_clock::now() - a).count(),
               cudaGetErrorString(cudaGetLastError()));
    }
    // idle exit: 1 ms
    hw[0] = hw[1] = 0;
    cudaLaunchKernelEx(&cfg, k_resident<true>, (const float *)dx, dy, dw, dw + 1, 1000000ull);
    auto a = std::chrono::high_resolution_clock::now();
    cudaStreamSynchronize(ps);
    printf("idle exit (1 ms) after %.1f us, %s\n",
           std::chrono::duration<double, std::micro>(std::chrono::high_resolution_clock::now() - a).count(),
           cudaGetErrorString(cudaGetLastError()));
    return 0;
}
