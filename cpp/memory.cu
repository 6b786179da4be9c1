// memory.cu -- the caching device memory pool and host<->device copies.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>

#include "common.cuh"
#include "memory.cuh"

namespace cydnn {

size_t MemoryPool::round_size(size_t nbytes) {
    const size_t kSmallStep = 512, kLargeStep = size_t(2) << 20, kSmallLimit = size_t(1) << 20;
    if (nbytes == 0) nbytes = 1;  // every allocation gets its own address
    size_t step = nbytes <= kSmallLimit ? kSmallStep : kLargeStep;
    return (nbytes + step - 1) / step * step;
}

cydnnStatus_t MemoryPool::allocate(size_t nbytes, void **ptr) {
    const char *op = "malloc";
    if (!ptr) return fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: output pointer is NULL", op);
    *ptr = nullptr;
    if (nbytes > (size_t(1) << 60))  // rounding would overflow; no device has this much
        return fail(CYDNN_STATUS_OUT_OF_MEMORY, (int)cudaErrorMemoryAllocation,
                    "out of memory on device %d: tried to allocate %zu bytes, more than any device has",
                    device_, nbytes);
    size_t size = round_size(nbytes);
    try {
        std::lock_guard<std::mutex> lock(mutex_);
        void *p = nullptr;
        // 1. Best fit among cached blocks: the smallest >= size, if <= 2 size.
        auto it = cached_.lower_bound(size);
        if (it != cached_.end() && it->first <= 2 * size) {
            p = it->second;
            cached_.erase(it);
            stats_.num_cache_hits++;
        } else {
            // 2. A new block from the driver; on failure free the cache and retry once.
            cudaError_t err = cudaMalloc(&p, size);
            if (err == cudaErrorMemoryAllocation) {
                cudaGetLastError();  // clear it
                CYDNN_TRY(empty_cache_locked());
                err = cudaMalloc(&p, size);
            }
            if (err != cudaSuccess) {
                cudaGetLastError();
                if (err != cudaErrorMemoryAllocation) return cuda_failure(err, op, "cudaMalloc");
                size_t free_b = 0, total_b = 0;
                cudaMemGetInfo(&free_b, &total_b);
                cudaGetLastError();
                stats_.num_ooms++;
                return fail(CYDNN_STATUS_OUT_OF_MEMORY, (int)err,
                            "out of memory on device %d: tried to allocate %zu bytes (%.2f MiB); "
                            "the device has %.2f MiB free of %.2f MiB; this pool holds %.2f MiB "
                            "(cache already freed and retried)",
                            device_, nbytes, nbytes / 1048576.0, free_b / 1048576.0, total_b / 1048576.0,
                            stats_.reserved_bytes / 1048576.0);
            }
            blocks_[p] = Block{size, 0};
            stats_.num_device_mallocs++;
            stats_.reserved_bytes += size;
            if (stats_.reserved_bytes > stats_.peak_reserved_bytes) stats_.peak_reserved_bytes = stats_.reserved_bytes;
        }
        Block &b = blocks_[p];
        b.requested = nbytes;
        live_[p] = true;
        stats_.num_allocs++;
        stats_.allocated_bytes += b.size;
        stats_.requested_bytes += nbytes;
        if (stats_.allocated_bytes > stats_.peak_allocated_bytes) stats_.peak_allocated_bytes = stats_.allocated_bytes;
        if (poison_) CYDNN_CUDA(op, cudaMemsetAsync(p, 0xFF, b.size, stream_));
        *ptr = p;
        return CYDNN_STATUS_SUCCESS;
    } catch (const std::bad_alloc &) {
        return fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: host allocation failed", op);
    }
}

cydnnStatus_t MemoryPool::release(void *ptr) {
    if (!ptr) return CYDNN_STATUS_SUCCESS;
    try {
        std::lock_guard<std::mutex> lock(mutex_);
        auto live = live_.find(ptr);
        if (live == live_.end())
            return fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "free: %p was not allocated by this pool (or freed twice)", ptr);
        live_.erase(live);
        Block &b = blocks_[ptr];
        stats_.num_frees++;
        stats_.allocated_bytes -= b.size;
        stats_.requested_bytes -= b.requested;
        cached_.emplace(b.size, ptr);
        return CYDNN_STATUS_SUCCESS;
    } catch (const std::bad_alloc &) {
        return fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "free: host allocation failed");
    }
}

cydnnStatus_t MemoryPool::empty_cache_locked() {
    // cudaFree waits for the device, so no queued kernel still uses a block.
    for (auto &entry : cached_) {
        void *p = entry.second;
        cudaError_t err = cudaFree(p);
        if (err != cudaSuccess) return cuda_failure(err, "empty_cache", "cudaFree");
        stats_.reserved_bytes -= blocks_[p].size;
        stats_.num_device_frees++;
        blocks_.erase(p);
    }
    cached_.clear();
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t MemoryPool::empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    return empty_cache_locked();
}

cydnnMemoryStats MemoryPool::stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
}

void MemoryPool::reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

}  // namespace cydnn

// ======================================================================= C ABI
extern "C" cydnnStatus_t cydnn_malloc(cydnnContext *ctx, size_t nbytes, void **ptr) {
    CYDNN_REQUIRE_CTX("malloc", ctx);
    return ctx->pool->allocate(nbytes, ptr);
}

extern "C" cydnnStatus_t cydnn_free(cydnnContext *ctx, void *ptr) {
    CYDNN_REQUIRE_CTX("free", ctx);
    return cydnn::pool_free(ctx, ptr);   // deferred while a graph is being captured
}

extern "C" cydnnStatus_t cydnn_empty_cache(cydnnContext *ctx) {
    CYDNN_REQUIRE_CTX("empty_cache", ctx);
    return ctx->pool->empty_cache();
}

extern "C" cydnnStatus_t cydnn_memory_stats(cydnnContext *ctx, cydnnMemoryStats *out) {
    CYDNN_REQUIRE_CTX("memory_stats", ctx);
    CYDNN_REQUIRE("memory_stats", out != nullptr, "output pointer is NULL");
    *out = ctx->pool->stats();
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_reset_peak_memory_stats(cydnnContext *ctx) {
    CYDNN_REQUIRE_CTX("reset_peak_memory_stats", ctx);
    ctx->pool->reset_peak();
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_set_poison(cydnnContext *ctx, int on) {
    CYDNN_REQUIRE_CTX("set_poison", ctx);
    ctx->pool->set_poison(on != 0);
    return CYDNN_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- copies
namespace {
constexpr size_t kStagingBytes = size_t(8) << 20;

// The pinned staging buffer, allocated on first use.  Returns nullptr (and
// the caller takes the pageable path) if pinned memory cannot be had.
void *staging(cydnnContext *ctx) {
    if (!ctx->staging) {
        if (cudaHostAlloc(&ctx->staging, kStagingBytes, cudaHostAllocDefault) != cudaSuccess) {
            cudaGetLastError();
            ctx->staging = nullptr;
            return nullptr;
        }
        ctx->staging_size = kStagingBytes;
    }
    return ctx->staging;
}
}  // namespace

extern "C" cydnnStatus_t cydnn_memcpy_h2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes) {
    const char *op = "memcpy_h2d";
    CYDNN_REQUIRE_CTX(op, ctx);
    if (nbytes == 0) return CYDNN_STATUS_SUCCESS;
    CYDNN_REQUIRE(op, dst && src, "NULL pointer");
    void *buf = nbytes <= kStagingBytes ? staging(ctx) : nullptr;
    if (buf) {
        // Wait until the previous copy out of the staging buffer has been done.
        CYDNN_CUDA(op, cudaEventSynchronize(ctx->staging_free));
        memcpy(buf, src, nbytes);
        CYDNN_CUDA(op, cudaMemcpyAsync(dst, buf, nbytes, cudaMemcpyHostToDevice, ctx->stream));
        CYDNN_CUDA(op, cudaEventRecord(ctx->staging_free, ctx->stream));
    } else {
        // Pageable source: the runtime stages it and returns once src may be reused.
        CYDNN_CUDA(op, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, ctx->stream));
        CYDNN_CUDA(op, cudaStreamSynchronize(ctx->stream));
    }
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_memcpy_d2h(cydnnContext *ctx, void *dst, const void *src, size_t nbytes) {
    const char *op = "memcpy_d2h";
    CYDNN_REQUIRE_CTX(op, ctx);
    if (nbytes == 0) return CYDNN_STATUS_SUCCESS;
    CYDNN_REQUIRE(op, dst && src, "NULL pointer");
    void *buf = nbytes <= kStagingBytes ? staging(ctx) : nullptr;
    if (buf) {
        CYDNN_CUDA(op, cudaMemcpyAsync(buf, src, nbytes, cudaMemcpyDeviceToHost, ctx->stream));
        CYDNN_CUDA(op, cudaStreamSynchronize(ctx->stream));
        memcpy(dst, buf, nbytes);
    } else {
        CYDNN_CUDA(op, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, ctx->stream));
        CYDNN_CUDA(op, cudaStreamSynchronize(ctx->stream));
    }
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_memcpy_d2d(cydnnContext *ctx, void *dst, const void *src, size_t nbytes) {
    const char *op = "memcpy_d2d";
    CYDNN_REQUIRE_CTX(op, ctx);
    if (nbytes == 0) return CYDNN_STATUS_SUCCESS;
    CYDNN_REQUIRE(op, dst && src, "NULL pointer");
    CYDNN_CUDA(op, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

namespace {

// Two device-to-device copies in one launch (a compiled step's batch and labels, before its graph): 16 bytes a
// thread where every pointer and size allows, else a byte.  Two cudaMemcpyAsync cost two operations on the
// stream, each ~1.5 us of gap before the next on the H100 (docs/performance/zoo-session-32.md).
__global__ void copy2_kernel(char *__restrict__ d0, const char *__restrict__ s0, size_t n0, char *__restrict__ d1,
                             const char *__restrict__ s1, size_t n1, int vec) {
    const size_t unit = vec ? 16 : 1, u0 = n0 / unit, total = u0 + n1 / unit;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const bool first = i < u0;
        char *d = first ? d0 : d1;
        const char *s = first ? s0 : s1;
        const size_t at = (first ? i : i - u0) * unit;
        if (vec)
            *reinterpret_cast<uint4 *>(d + at) = *reinterpret_cast<const uint4 *>(s + at);
        else
            d[at] = s[at];
    }
}

}  // namespace

extern "C" cydnnStatus_t cydnn_copy2_d2d(cydnnContext *ctx, void *dst0, const void *src0, size_t nbytes0,
                                         void *dst1, const void *src1, size_t nbytes1) {
    const char *op = "copy2_d2d";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, (dst0 && src0) || nbytes0 == 0, "NULL pointer (first copy)");
    CYDNN_REQUIRE(op, (dst1 && src1) || nbytes1 == 0, "NULL pointer (second copy)");
    if (nbytes0 + nbytes1 == 0) return CYDNN_STATUS_SUCCESS;
    auto a16 = [](const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const int vec = a16(dst0) && a16(src0) && a16(dst1) && a16(src1) && nbytes0 % 16 == 0 && nbytes1 % 16 == 0;
    const size_t units = (nbytes0 + nbytes1) / (vec ? 16 : 1);
    const unsigned blocks = (unsigned)std::min<size_t>((units + cydnn::kThreads - 1) / cydnn::kThreads, 1024);
    copy2_kernel<<<blocks, cydnn::kThreads, 0, ctx->stream>>>(static_cast<char *>(dst0), static_cast<const char *>(src0),
                                                       nbytes0, static_cast<char *>(dst1),
                                                       static_cast<const char *>(src1), nbytes1, vec);
    CYDNN_LAUNCH_CHECK(op, "copy2_kernel");
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_memset(cydnnContext *ctx, void *dst, int byte_value, size_t nbytes) {
    const char *op = "memset";
    CYDNN_REQUIRE_CTX(op, ctx);
    if (nbytes == 0) return CYDNN_STATUS_SUCCESS;
    CYDNN_REQUIRE(op, dst != nullptr, "NULL pointer");
    CYDNN_CUDA(op, cudaMemsetAsync(dst, byte_value, nbytes, ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_host_alloc_mapped(cydnnContext *ctx, size_t nbytes, void **host, void **device) {
    const char *op = "host_alloc_mapped";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, host != nullptr && device != nullptr, "NULL pointer");
    CYDNN_REQUIRE(op, nbytes > 0, "nbytes must be > 0");
    *host = *device = nullptr;
    CYDNN_CUDA(op, cudaHostAlloc(host, nbytes, cudaHostAllocMapped));
    const cudaError_t e = cudaHostGetDevicePointer(device, *host, 0);
    if (e != cudaSuccess) {
        cudaFreeHost(*host);
        *host = *device = nullptr;
        return cydnn::cuda_failure(e, op, "cudaHostGetDevicePointer");
    }
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_host_free(void *host) {
    if (host == nullptr) return CYDNN_STATUS_SUCCESS;
    CYDNN_CUDA("host_free", cudaFreeHost(host));
    return CYDNN_STATUS_SUCCESS;
}
