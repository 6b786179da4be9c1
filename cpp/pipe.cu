// pipe.cu -- copies that overlap the device's work: numpy in, numpy out for many chunks.
//
// cydnn_memcpy_h2d / _d2h (memory.cu) use one pinned staging buffer and make the
// host wait for each copy, so a large numpy inference runs copy up, compute, copy
// down, chunk after chunk, with the device idle while the host copies into pinned
// memory (the slowest step: one core's memcpy).  A pipe has two slots, each with a
// pinned input and output buffer and two events; with the chunks alternating
// between the slots, the host fills one slot's input while the device computes the
// chunk of the other.  Stream order keeps the device side correct (an upload into
// a network's input buffer runs after the previous chunk's forward has read it);
// the events keep the host side correct (a slot's pinned buffer is refilled only
// after the device has copied out of it, and read only after the device has
// copied into it).
//
// The DMA runs on a copy stream of its own, into a device buffer of the slot, so that it overlaps the
// graph of the chunk before (on the library's stream, stream order would put each upload after the
// previous chunk's compute); the library's stream then waits for it and moves the chunk into the
// network's input buffer with a device-to-device copy (~1 us for 3 MB).  Events: `uploaded` (the DMA out
// of the slot's pinned buffer is done: the host may refill it), `consumed` (the device copy out of the
// slot's device buffer is done: the next DMA may overwrite it).
//
// One core's memcpy into pinned memory (6-10 GB/s) is slower than the DMA that follows it
// (20+ GB/s on PCIe 5), so a slot's fill is split over up to `threads` threads (host_copy.h).
#include <cstring>
#include <new>

#include "common.cuh"
#include "host_copy.h"

struct cydnnPipe {
    cydnnContext *ctx = nullptr;
    size_t in_bytes = 0, out_bytes = 0;
    int threads = 1;                                // host threads that fill a slot
    void *in[2] = {nullptr, nullptr};
    void *out[2] = {nullptr, nullptr};
    void *dev_in[2] = {nullptr, nullptr};           // the slot's input on the device, before the network's buffer
    cudaStream_t copy = nullptr;                    // the uploads' stream
    cudaEvent_t uploaded[2] = {nullptr, nullptr};   // the slot's input has left its pinned buffer
    cudaEvent_t consumed[2] = {nullptr, nullptr};   // the slot's device buffer has been copied out of
    cudaEvent_t downloaded[2] = {nullptr, nullptr}; // the slot's output has arrived in its pinned buffer
};

namespace {
constexpr const char *kOp = "pipe";

void release(cydnnPipe *p) {
    for (int s = 0; s < 2; ++s) {
        if (p->in[s]) cudaFreeHost(p->in[s]);
        if (p->out[s]) cudaFreeHost(p->out[s]);
        if (p->dev_in[s]) cudaFree(p->dev_in[s]);
        if (p->uploaded[s]) cudaEventDestroy(p->uploaded[s]);
        if (p->consumed[s]) cudaEventDestroy(p->consumed[s]);
        if (p->downloaded[s]) cudaEventDestroy(p->downloaded[s]);
    }
    if (p->copy) cudaStreamDestroy(p->copy);
    delete p;
}

}  // namespace

cydnnStatus_t cydnn_pipe_create(cydnnContext *ctx, size_t in_bytes, size_t out_bytes, int threads,
                                cydnnPipe **out) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, out != nullptr, "out is NULL");
    CYDNN_REQUIRE(op, in_bytes > 0 && out_bytes > 0, "buffer sizes must be positive, got %zu and %zu", in_bytes,
                  out_bytes);
    CYDNN_REQUIRE(op, threads >= 0 && threads <= cydnn::kMaxCopyThreads, "threads must be 0 (automatic) to %d, got %d",
                  cydnn::kMaxCopyThreads, threads);
    *out = nullptr;
    cydnnPipe *p = new (std::nothrow) cydnnPipe;
    if (p == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: no host memory for the pipe", op);
    p->ctx = ctx;
    p->in_bytes = in_bytes;
    p->out_bytes = out_bytes;
    p->threads = threads > 0 ? threads : cydnn::copy_threads();
    cudaError_t e = cudaStreamCreateWithFlags(&p->copy, cudaStreamNonBlocking);
    for (int s = 0; s < 2 && e == cudaSuccess; ++s) {
        e = cudaHostAlloc(&p->in[s], in_bytes, cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaHostAlloc(&p->out[s], out_bytes, cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaMalloc(&p->dev_in[s], in_bytes);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->uploaded[s], cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->consumed[s], cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->downloaded[s], cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        release(p);
        return cydnn::cuda_failure(e, op, "cudaStreamCreate / cudaHostAlloc / cudaMalloc / cudaEventCreate");
    }
    *out = p;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_pipe_upload(cydnnPipe *p, int slot, void *dst, const void *src, size_t nbytes) {
    const char *op = kOp;
    CYDNN_REQUIRE(op, p != nullptr && dst != nullptr && src != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, slot == 0 || slot == 1, "slot must be 0 or 1, got %d", slot);
    CYDNN_REQUIRE(op, nbytes <= p->in_bytes, "%zu bytes do not fit the pipe's %zu", nbytes, p->in_bytes);
    CYDNN_CUDA(op, cudaEventSynchronize(p->uploaded[slot]));      // the slot's last upload has left
    cydnn::parallel_copy(p->in[slot], src, nbytes, p->threads);           // overlaps the device's work
    CYDNN_CUDA(op, cudaStreamWaitEvent(p->copy, p->consumed[slot], 0));   // the slot's device buffer is free
    CYDNN_CUDA(op, cudaMemcpyAsync(p->dev_in[slot], p->in[slot], nbytes, cudaMemcpyHostToDevice, p->copy));
    CYDNN_CUDA(op, cudaEventRecord(p->uploaded[slot], p->copy));
    CYDNN_CUDA(op, cudaStreamWaitEvent(p->ctx->stream, p->uploaded[slot], 0));
    CYDNN_CUDA(op, cudaMemcpyAsync(dst, p->dev_in[slot], nbytes, cudaMemcpyDeviceToDevice, p->ctx->stream));
    CYDNN_CUDA(op, cudaEventRecord(p->consumed[slot], p->ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_pipe_download(cydnnPipe *p, int slot, const void *src, size_t nbytes) {
    const char *op = kOp;
    CYDNN_REQUIRE(op, p != nullptr && src != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, slot == 0 || slot == 1, "slot must be 0 or 1, got %d", slot);
    CYDNN_REQUIRE(op, nbytes <= p->out_bytes, "%zu bytes do not fit the pipe's %zu", nbytes, p->out_bytes);
    CYDNN_CUDA(op, cudaMemcpyAsync(p->out[slot], src, nbytes, cudaMemcpyDeviceToHost, p->ctx->stream));
    CYDNN_CUDA(op, cudaEventRecord(p->downloaded[slot], p->ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_pipe_finish(cydnnPipe *p, int slot, void *dst, size_t nbytes) {
    const char *op = kOp;
    CYDNN_REQUIRE(op, p != nullptr && dst != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, slot == 0 || slot == 1, "slot must be 0 or 1, got %d", slot);
    CYDNN_REQUIRE(op, nbytes <= p->out_bytes, "%zu bytes do not fit the pipe's %zu", nbytes, p->out_bytes);
    CYDNN_CUDA(op, cudaEventSynchronize(p->downloaded[slot]));
    std::memcpy(dst, p->out[slot], nbytes);
    return CYDNN_STATUS_SUCCESS;
}

int cydnn_pipe_threads(const cydnnPipe *p) { return p == nullptr ? 0 : p->threads; }

int cydnn_host_copy(void *dst, const void *src, size_t nbytes, int threads) {
    if (dst == nullptr || src == nullptr || nbytes == 0) return 0;
    const int most = cydnn::kMaxCopyThreads;
    return cydnn::parallel_copy(dst, src, nbytes,
                                threads > 0 ? (threads < most ? threads : most) : cydnn::copy_threads());
}

void cydnn_pipe_destroy(cydnnPipe *p) {
    if (p == nullptr) return;
    cudaStreamSynchronize(p->copy);            // copies queued on its buffers must be done first
    cudaStreamSynchronize(p->ctx->stream);
    release(p);
}
