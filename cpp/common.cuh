// common.cuh -- what every op family shares: the context, error reporting,
// checked calls, the descriptor/plan cache and the launch geometry helpers.
// Internal to the library (the public ABI is cydnn.h).
#pragma once

#include <cstdarg>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>
#include <cublas_v2.h>
#include <cublasLt.h>

#include "cydnn.h"

namespace cydnn {

class MemoryPool;  // memory.cu

// Anything an op wants to build once per shape and reuse (descriptors, chosen
// algorithms) derives from Plan; the context owns it and destroys it.
struct Plan {
    virtual ~Plan() = default;
};

}  // namespace cydnn

struct cydnnContext {
    int device = 0;
    cudaStream_t stream = nullptr;
    cudnnHandle_t cudnn = nullptr;
    cublasHandle_t cublas = nullptr;
    int allow_tf32 = 0;
    int fp16 = 0;   // inference: conv and linear forwards in half precision on tensor cores
    int deterministic = 0;
    size_t workspace_limit = size_t(64) << 20;

    cydnn::MemoryPool *pool = nullptr;

    // The workspaces of the ops, one per stream: [kMainWorkspace] shared by every op on
    // the context's stream (stream order makes the reuse safe), [kSideWorkspace] by the
    // work forked onto the second stream.  Grown on demand, never past workspace_limit;
    // `captured`: a captured graph may use the block (get_workspace then retires it).
    struct Workspace {
        void *block = nullptr;
        size_t size = 0;
        bool captured = false;
    } workspaces[2];

    // Pinned host buffer for host<->device copies, and the event recorded
    // after its last use so the next copy does not overwrite it too early.
    void *staging = nullptr;
    size_t staging_size = 0;
    cudaEvent_t staging_free = nullptr;

    // CUDA-graph capture safety (fastpath.cu's cydnn_graph_begin/_end).  A
    // captured graph keeps the device addresses it was recorded with, so:
    //  - pool blocks freed while a capture is under way (an op's temporaries,
    //    arrays Python drops) are kept for the graph, not handed out again
    //    (capture_keep moves into the graph; its destruction frees them);
    //  - a workspace a graph may use is never given back when it must grow:
    //    it is retired (kept for the life of the context) instead;
    //  - cuBLAS gets a workspace of ours before the first capture, so it never
    //    allocates one inside a graph.
    int capturing = 0;
    std::vector<void *> capture_keep;
    std::vector<void *> retired_workspaces;
    void *cublas_workspace = nullptr;

    // A second stream on which a layer's weight gradient runs beside its input gradient (a fork and a
    // join by events: eager, two streams; captured, two branches of the graph), made on first use by
    // side_stream().  Linear layers (linear.cu) and convolutions (conv.cu) fork onto it.
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    // cuBLASLt (linear.cu), made on a linear layer's first call: its handle and a workspace for each
    // of the two streams.
    cublasLtHandle_t lt = nullptr;
    void *lt_workspace[2] = {nullptr, nullptr};
    // cuDNN bound to the second stream (conv.cu's filter gradient beside the data gradient), made on
    // the first forked convolution backward; its workspace is workspaces[kSideWorkspace].
    cudnnHandle_t cudnn_side = nullptr;

    // Plans built once per shape, keyed by a readable string, e.g.
    // "conv:n=64,c=1,h=28,w=28,k=6,...".
    std::unordered_map<std::string, std::unique_ptr<cydnn::Plan>> plans;
};

namespace cydnn {

// ---------------------------------------------------------------- errors
// Record a failure in the thread-local buffer and return `status`.
cydnnStatus_t fail(cydnnStatus_t status, int library_status, const char *fmt, ...);
// An INVALID_ARGUMENT failure, message "<op>: <formatted text>".
cydnnStatus_t fail_invalid(const char *op, const char *fmt, ...);

cydnnStatus_t cuda_failure(cudaError_t err, const char *op, const char *call);
cydnnStatus_t cudnn_failure(cudnnStatus_t err, const char *op, const char *call);
cydnnStatus_t cublas_failure(cublasStatus_t err, const char *op, const char *call);

// Half precision (precision.cu): x (float) -> half; y (float) = half + bias[channel].
cydnnStatus_t to_half(cydnnContext *ctx, const float *x, void *half, size_t count, const char *op);
cydnnStatus_t from_half_bias(cydnnContext *ctx, const void *half, const float *bias, float *y, size_t count,
                             size_t inner, int channels, const char *op);

// Workspace of at least `bytes` (from the pool); fails if over the limit.  Two of them: the stream's
// (kMainWorkspace) and the second stream's (kSideWorkspace), so that work forked onto the second
// stream never shares one with the work it runs beside.
constexpr int kMainWorkspace = 0, kSideWorkspace = 1;
cydnnStatus_t get_workspace(cydnnContext *ctx, size_t bytes, void **ptr, const char *op, int which = kMainWorkspace);

// The second stream and its fork / join events (made once, kept for the context's life).
cydnnStatus_t side_stream(cydnnContext *ctx, const char *op);
// Work enqueued on ctx->side after fork_side() starts after what the stream has before it;
// join_side() makes the stream wait for all of it (eager: two streams; captured: two branches
// of the graph, joined).  Call join_side() whatever the side's work did, so that a capture is
// never left with a branch that does not return.
cydnnStatus_t fork_side(cydnnContext *ctx, const char *op);
cydnnStatus_t join_side(cydnnContext *ctx, const char *op);

// Pool allocations for temporaries inside an op (freed back to the pool at
// the end of the op; stream order makes the reuse safe).
cydnnStatus_t pool_alloc(cydnnContext *ctx, size_t bytes, void **ptr);
cydnnStatus_t pool_free(cydnnContext *ctx, void *ptr);

// Look up a plan by key; nullptr when not built yet.
template <class P>
P *find_plan(cydnnContext *ctx, const std::string &key) {
    auto it = ctx->plans.find(key);
    return it == ctx->plans.end() ? nullptr : static_cast<P *>(it->second.get());
}

template <class P>
P *store_plan(cydnnContext *ctx, const std::string &key, std::unique_ptr<P> plan) {
    P *raw = plan.get();
    ctx->plans[key] = std::move(plan);
    return raw;
}

std::string format(const char *fmt, ...);

// ------------------------------------------------------------- launches
constexpr int kThreads = 256;

inline unsigned int blocks_for(size_t count, int threads = kThreads) {
    size_t b = (count + threads - 1) / threads;
    // A grid-stride loop covers whatever a capped grid leaves.
    return (unsigned int)(b < 65535 * 32 ? (b == 0 ? 1 : b) : 65535 * 32);
}

// The counter-based hash behind dropout and augmentation (splitmix64).  The
// numpy twin computes the same numbers.
// The GPU's global nanosecond clock (%globaltimer): the resident kernel's idle deadline, the fused training
// step's profiling clocks.
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__host__ __device__ inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

}  // namespace cydnn

// ------------------------------------------------------------ check macros
// Each returns from the enclosing function (which returns cydnnStatus_t) with
// the library's status and message recorded, prefixed by the op's name.
#define CYDNN_CUDA(op, call)                                                   \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) return cydnn::cuda_failure(e_, op, #call);      \
    } while (0)

#define CYDNN_CUDNN(op, call)                                                  \
    do {                                                                       \
        cudnnStatus_t e_ = (call);                                             \
        if (e_ != CUDNN_STATUS_SUCCESS) return cydnn::cudnn_failure(e_, op, #call); \
    } while (0)

#define CYDNN_CUBLAS(op, call)                                                 \
    do {                                                                       \
        cublasStatus_t e_ = (call);                                            \
        if (e_ != CUBLAS_STATUS_SUCCESS) return cydnn::cublas_failure(e_, op, #call); \
    } while (0)

// After every kernel launch (as llm.c does): catches bad launch configurations.
#define CYDNN_LAUNCH_CHECK(op, kernel)                                         \
    do {                                                                       \
        cudaError_t e_ = cudaGetLastError();                                   \
        if (e_ != cudaSuccess) return cydnn::cuda_failure(e_, op, "launch of " kernel); \
    } while (0)

// Propagate a cydnnStatus_t from a helper.
#define CYDNN_TRY(call)                                                        \
    do {                                                                       \
        cydnnStatus_t s_ = (call);                                             \
        if (s_ != CYDNN_STATUS_SUCCESS) return s_;                             \
    } while (0)

// Refuse what would corrupt memory before touching the device.
#define CYDNN_REQUIRE(op, cond, ...)                                           \
    do {                                                                       \
        if (!(cond))                                                           \
            return cydnn::fail_invalid(op, __VA_ARGS__);                       \
    } while (0)

#define CYDNN_REQUIRE_CTX(op, ctx) CYDNN_REQUIRE(op, (ctx) != nullptr, "context is NULL")
