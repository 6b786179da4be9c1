// fused_net_resident.cu -- the fused network as a *resident* kernel, for one-image calls from the host.
//
// A one-image call through fused_net.cu pays a launch and a stream synchronisation each time: ~9 us
// of a ~40 us call (benchmarks/launch_latency.cu), before the kernel's first instruction.  Here the
// kernel stays on the GPU between calls: one cluster (the same 1-16 blocks, the same layer code,
// fused_net_layers.cuh) polls a request word in mapped pinned host memory; the host writes the
// image into mapped memory, bumps the request word and spins on an acknowledgement word, which the
// kernel writes after the probabilities (benchmarks/persistent_latency.cu measured the protocol).
//
// The rules that keep it honest:
//  - Order with the library's stream: a call is served by the resident kernel only when the stream
//    has nothing queued (cudaStreamQuery); else it is one ordinary launch on the stream, after what
//    is queued (a training step's weight update, say), exactly as fused_net.cu's path.
//  - Nothing stale across calls: the kernel reads weights through L2 (__ldcg, coherent with the
//    writes of other kernels) and the image with __ldcv (fetched again), never through the
//    read-only cache, whose lines may outlive a training step that ran between two calls.
//  - It gives its SMs back: after idle_us without a request the kernel returns (and announces it in
//    the exit word); the next call launches it again.  One resident kernel per process: a network
//    that needs one stops another's first.  The host's wait is bounded (an error after 30 s) and
//    checks the kernel's stream for faults.
//  - Requests are sequence numbers the host alone writes; acknowledgements and exits the kernel
//    alone writes: no atomics across PCIe.
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include "cluster_launch.cuh"
#include "common.cuh"

// the loads of a kernel that outlives a call (fused_net_conv.cuh says why)
#define CYDNN_NET_LDW(p) __ldcg(p)
#define CYDNN_NET_LDX(p) __ldcv(p)
#include "fused_net_layers.cuh"

namespace {

constexpr int kThreads = 512;              // as fused_net.cu's kNetThreads
static_assert(kThreads == kWsplitThreads, "tile 7 splits a block's reduction between kWsplitThreads threads");
constexpr const char *kOp = "fused_net_resident";
constexpr unsigned long long kStop = ~0ull;
constexpr double kWaitLimitS = 30.0;

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}


// ctl[0]: the request (host writes: 1, 2, 3, ... or kStop); ctl[1]: the last request served (kernel
// writes); ctl[2]: the launch id of the kernel that returned last (kernel writes).  served: the
// request already answered when this launch starts.
__global__ void __launch_bounds__(kThreads)
    fused_net_resident_kernel(const __grid_constant__ cydnnNet net, const float *x, float *y, int buf_floats,
                              unsigned long long *ctl, unsigned long long served, unsigned long long launch_id,
                              unsigned long long idle_ns) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    extern __shared__ float smem[];
    __shared__ float red[32];
    __shared__ unsigned long long request;
    cg::cluster_group cluster = cg::this_cluster();
    const int ranks = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
    const bool leader = rank == 0 && threadIdx.x == 0;
    for (;;) {
        if (leader) {                      // poll; one PCIe read a round
            const unsigned long long t0 = cydnn::globaltimer_ns();
            unsigned long long r;
            while ((r = load_acquire_sys(ctl)) == served && cydnn::globaltimer_ns() - t0 < idle_ns) {
            }
            request = r;
        }
        cluster.sync();
        const unsigned long long r = *cluster.map_shared_rank(&request, 0);
        if (r == served || r == kStop) {
            cluster.sync();                // rank 0's shared memory stays until every block has read it
            if (leader) store_release_sys(ctl + 2, launch_id);
            return;
        }
        // rank 0 rewrites `request` only after forward_image's cluster barriers: every block has read it
        forward_image(net, x, y, smem, red, buf_floats, cluster, rank, ranks);
        if (rank == 0) {
            __syncthreads();               // y written by the whole block
            if (threadIdx.x == 0) {
                __threadfence_system();
                store_release_sys(ctl + 1, r);
            }
        }
        served = r;
    }
#endif
}

std::mutex g_mu;                          // every call below; one resident kernel per process
cydnnResident *g_active = nullptr;

}  // namespace

struct cydnnResident {
    cydnnContext *ctx = nullptr;
    cydnnNet net{};
    int cluster = 1;
    size_t smem = 0;
    int buf_floats = 0;
    unsigned long long idle_ns = 0;
    cudaStream_t stream = nullptr;
    float *hx = nullptr, *dx = nullptr, *hy = nullptr, *dy = nullptr;
    unsigned long long *hctl = nullptr, *dctl = nullptr;
    unsigned long long seq = 0, launches = 0;
    bool broken = false;                   // a wait timed out: every later call takes the ordinary path
};

namespace {

unsigned long long load(const unsigned long long *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

bool running(const cydnnResident *r) { return r->launches > 0 && load(r->hctl + 2) != r->launches; }

cydnnStatus_t launch(cydnnResident *r) {
    static std::atomic<int> limit{0};
    CYDNN_TRY(cydnn::cluster_prepare_once(kOp, r->ctx->device, (const void *)fused_net_resident_kernel,
                                          64 * sizeof(float), limit));
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg =
        cydnn::cluster_config((unsigned)r->cluster, kThreads, r->smem, r->stream, r->cluster, attr);
    const unsigned long long id = r->launches + 1;
    CYDNN_CUDA(kOp, cudaLaunchKernelEx(&cfg, fused_net_resident_kernel, r->net, (const float *)r->dx, r->dy,
                                       r->buf_floats, r->dctl, r->seq - 1, id, r->idle_ns));
    CYDNN_LAUNCH_CHECK(kOp, "fused_net_resident_kernel");
    r->launches = id;
    return CYDNN_STATUS_SUCCESS;
}

// Tell the kernel to return and wait for it (at most one poll round plus a request in flight).
cydnnStatus_t stop(cydnnResident *r) {
    if (r->launches == 0) return CYDNN_STATUS_SUCCESS;
    if (running(r)) __atomic_store_n(r->hctl, kStop, __ATOMIC_RELEASE);
    CYDNN_CUDA(kOp, cudaStreamSynchronize(r->stream));
    if (g_active == r) g_active = nullptr;
    return CYDNN_STATUS_SUCCESS;
}

// One call the ordinary way: one launch on the library's stream, in its order.
cydnnStatus_t run_launched(cydnnResident *r, const float *x, float *y) {
    std::memcpy(r->hx, x, sizeof(float) * (size_t)r->net.in_size);
    CYDNN_TRY(cydnn_fused_net_forward(r->ctx, &r->net, r->dx, 1, r->dy, r->cluster));
    CYDNN_CUDA(kOp, cudaStreamSynchronize(r->ctx->stream));
    std::memcpy(y, r->hy, sizeof(float) * (size_t)r->net.out_size);
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t run_resident(cydnnResident *r, const float *x, float *y) {
    if (g_active != nullptr && g_active != r) CYDNN_TRY(stop(g_active));
    g_active = r;
    std::memcpy(r->hx, x, sizeof(float) * (size_t)r->net.in_size);
    const unsigned long long want = ++r->seq;
    __atomic_store_n(r->hctl, want, __ATOMIC_RELEASE);
    if (!running(r)) {
        if (r->launches > 0) CYDNN_CUDA(kOp, cudaStreamSynchronize(r->stream));   // the last one has returned
        CYDNN_TRY(launch(r));
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (unsigned long spins = 1; load(r->hctl + 1) != want; ++spins) {
        if (spins % 1024 != 0) continue;
        if (load(r->hctl + 2) == r->launches) {        // it returned (idle) as the request came: again
            CYDNN_CUDA(kOp, cudaStreamSynchronize(r->stream));
            if (load(r->hctl + 1) == want) break;
            CYDNN_TRY(launch(r));
            continue;
        }
        if (spins % (64 * 1024) != 0) continue;
        const cudaError_t e = cudaStreamQuery(r->stream);
        if (e != cudaSuccess && e != cudaErrorNotReady) return cydnn::cuda_failure(e, kOp, "cudaStreamQuery");
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (waited > kWaitLimitS) {
            r->broken = true;
            return cydnn::fail(CYDNN_STATUS_CUDA_ERROR, 0,
                               "%s: the resident kernel did not answer request %llu in %.0f s; later calls are "
                               "launched one by one", kOp, want, kWaitLimitS);
        }
    }
    std::memcpy(y, r->hy, sizeof(float) * (size_t)r->net.out_size);
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" cydnnStatus_t cydnn_resident_create(cydnnContext *ctx, const cydnnNet *net, int cluster, long idle_us,
                                               cydnnResident **out) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, out != nullptr, "a pointer is NULL");
    *out = nullptr;
    CYDNN_REQUIRE(op, cydnn::cluster_size_ok(cluster), "cluster must be 1, 2, 4, 8 or 16, got %d", cluster);
    CYDNN_REQUIRE(op, idle_us >= 1 && idle_us <= 10000000L, "idle_us must be in [1, 10000000], got %ld", idle_us);
    size_t smem = 0;
    CYDNN_TRY(cydnn_fused_net_check(net, &smem));
    int limit = 0;
    CYDNN_TRY(cydnn::cluster_smem_limit(op, ctx->device, &limit));
    CYDNN_REQUIRE(op, smem + 64 * sizeof(float) <= (size_t)limit,
                  "the activations need %zu bytes of shared memory, the device has %d per block", smem, limit);
    auto *r = new (std::nothrow) cydnnResident();
    if (r == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: no host memory", op);
    r->ctx = ctx;
    r->net = *net;
    r->cluster = cluster;
    r->smem = smem;
    r->buf_floats = (int)((smem / sizeof(float) - net->wcap) / 2);
    r->idle_ns = (unsigned long long)idle_us * 1000ull;
    void *d = nullptr;
    cydnnStatus_t st = CYDNN_STATUS_SUCCESS;
    cudaError_t e = cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) st = cydnn::cuda_failure(e, op, "cudaStreamCreateWithFlags");
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn_host_alloc_mapped(ctx, sizeof(float) * (size_t)net->in_size,
                                                                 (void **)&r->hx, &d);
    r->dx = (float *)d;
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn_host_alloc_mapped(ctx, sizeof(float) * (size_t)net->out_size,
                                                                 (void **)&r->hy, &d);
    r->dy = (float *)d;
    if (st == CYDNN_STATUS_SUCCESS) st = cydnn_host_alloc_mapped(ctx, 64, (void **)&r->hctl, &d);
    r->dctl = (unsigned long long *)d;
    if (st != CYDNN_STATUS_SUCCESS) {
        cydnn_resident_destroy(r);
        return st;
    }
    std::memset(r->hctl, 0, 64);
    *out = r;
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_resident_run(cydnnResident *r, const float *x, float *y, int *served) {
    const char *op = kOp;
    CYDNN_REQUIRE(op, r != nullptr && x != nullptr && y != nullptr && served != nullptr, "a pointer is NULL");
    std::lock_guard<std::mutex> lock(g_mu);
    *served = 0;
    if (r->broken) return run_launched(r, x, y);
    const cudaError_t q = cudaStreamQuery(r->ctx->stream);
    if (q == cudaErrorNotReady) return run_launched(r, x, y);      // work queued: keep the stream's order
    if (q != cudaSuccess) return cydnn::cuda_failure(q, op, "cudaStreamQuery");
    CYDNN_TRY(run_resident(r, x, y));
    *served = 1;
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_resident_stop(cydnnResident *r) {
    CYDNN_REQUIRE(kOp, r != nullptr, "a pointer is NULL");
    std::lock_guard<std::mutex> lock(g_mu);
    return stop(r);
}

extern "C" int cydnn_resident_running(cydnnResident *r) {
    if (r == nullptr) return 0;
    std::lock_guard<std::mutex> lock(g_mu);
    return running(r) ? 1 : 0;
}

extern "C" void cydnn_resident_destroy(cydnnResident *r) {
    if (r == nullptr) return;
    {
        std::lock_guard<std::mutex> lock(g_mu);
        if (r->hctl != nullptr) stop(r);   // a failure here (the driver gone at exit) is not actionable
        if (g_active == r) g_active = nullptr;
    }
    cydnn_host_free(r->hx);
    cydnn_host_free(r->hy);
    cydnn_host_free(r->hctl);
    if (r->stream != nullptr) cudaStreamDestroy(r->stream);
    delete r;
}
