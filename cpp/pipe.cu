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
#include <cstring>

#include "common.cuh"

struct cydnnPipe {
    cydnnContext *ctx = nullptr;
    size_t in_bytes = 0, out_bytes = 0;
    void *in[2] = {nullptr, nullptr};
    void *out[2] = {nullptr, nullptr};
    cudaEvent_t uploaded[2] = {nullptr, nullptr};   // the slot's input has left its pinned buffer
    cudaEvent_t downloaded[2] = {nullptr, nullptr}; // the slot's output has arrived in its pinned buffer
};

namespace {
constexpr const char *kOp = "pipe";

void release(cydnnPipe *p) {
    for (int s = 0; s < 2; ++s) {
        if (p->in[s]) cudaFreeHost(p->in[s]);
        if (p->out[s]) cudaFreeHost(p->out[s]);
        if (p->uploaded[s]) cudaEventDestroy(p->uploaded[s]);
        if (p->downloaded[s]) cudaEventDestroy(p->downloaded[s]);
    }
    delete p;
}
}  // namespace

cydnnStatus_t cydnn_pipe_create(cydnnContext *ctx, size_t in_bytes, size_t out_bytes, cydnnPipe **out) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, out != nullptr, "out is NULL");
    CYDNN_REQUIRE(op, in_bytes > 0 && out_bytes > 0, "buffer sizes must be positive, got %zu and %zu", in_bytes,
                  out_bytes);
    *out = nullptr;
    cydnnPipe *p = new (std::nothrow) cydnnPipe;
    if (p == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: no host memory for the pipe", op);
    p->ctx = ctx;
    p->in_bytes = in_bytes;
    p->out_bytes = out_bytes;
    for (int s = 0; s < 2; ++s) {
        cudaError_t e = cudaHostAlloc(&p->in[s], in_bytes, cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaHostAlloc(&p->out[s], out_bytes, cudaHostAllocDefault);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->uploaded[s], cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->downloaded[s], cudaEventDisableTiming);
        if (e != cudaSuccess) {
            release(p);
            return cydnn::cuda_failure(e, op, "cudaHostAlloc / cudaEventCreateWithFlags");
        }
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
    std::memcpy(p->in[slot], src, nbytes);                         // overlaps the device's work
    CYDNN_CUDA(op, cudaMemcpyAsync(dst, p->in[slot], nbytes, cudaMemcpyHostToDevice, p->ctx->stream));
    CYDNN_CUDA(op, cudaEventRecord(p->uploaded[slot], p->ctx->stream));
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

void cydnn_pipe_destroy(cydnnPipe *p) {
    if (p == nullptr) return;
    cudaStreamSynchronize(p->ctx->stream);     // copies queued on its buffers must be done first
    release(p);
}
