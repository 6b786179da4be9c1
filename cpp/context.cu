// context.cu -- errors, device queries and the per-device context.
//
// The context is what every op needs to run: one stream, one cuDNN handle and
// one cuBLAS handle bound to that stream, the memory pool, a shared workspace
// and the per-shape plans.  It is created on first use of a device and kept
// for the life of the process.
#include <cstdio>
#include <cstring>
#include <new>

#include "common.cuh"
#include "memory.cuh"

// ===================================================================== errors
namespace {
thread_local char g_message[2048] = "";
thread_local int g_library_status = 0;
}  // namespace

extern "C" const char *cydnn_last_error_message(void) { return g_message; }
extern "C" int cydnn_last_library_status(void) { return g_library_status; }
extern "C" void cydnn_clear_error(void) {
    g_message[0] = '\0';
    g_library_status = 0;
}

namespace cydnn {

cydnnStatus_t fail(cydnnStatus_t status, int library_status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(g_message, sizeof(g_message), fmt, args);
    va_end(args);
    g_library_status = library_status;
    return status;
}

cydnnStatus_t fail_invalid(const char *op, const char *fmt, ...) {
    char text[1536];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof(text), fmt, args);
    va_end(args);
    return fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: %s", op, text);
}

std::string format(const char *fmt, ...) {
    char buf[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    return std::string(buf);
}

cydnnStatus_t cuda_failure(cudaError_t err, const char *op, const char *call) {
    // The runtime also keeps the error in its per-thread state; clear it so the
    // launch check of the next op does not report it again (sticky errors,
    // such as an illegal address, stay whatever we do).
    cudaGetLastError();
    cydnnStatus_t status = CYDNN_STATUS_CUDA_ERROR;
    if (err == cudaErrorMemoryAllocation) status = CYDNN_STATUS_OUT_OF_MEMORY;
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) status = CYDNN_STATUS_DEVICE_UNAVAILABLE;
    return fail(status, (int)err, "%s: %s failed: %s: %s", op, call, cudaGetErrorName(err),
                cudaGetErrorString(err));
}

cydnnStatus_t cudnn_failure(cudnnStatus_t err, const char *op, const char *call) {
    char detail[1024] = "";
    cudnnGetLastErrorString(detail, sizeof(detail));  // cuDNN 9: the reason, when it has one
    cydnnStatus_t status = err == CUDNN_STATUS_ALLOC_FAILED ? CYDNN_STATUS_OUT_OF_MEMORY : CYDNN_STATUS_CUDNN_ERROR;
    return fail(status, (int)err, "%s: %s failed: %s%s%s", op, call, cudnnGetErrorString(err),
                detail[0] ? ": " : "", detail);
}

cydnnStatus_t cublas_failure(cublasStatus_t err, const char *op, const char *call) {
    cydnnStatus_t status = err == CUBLAS_STATUS_ALLOC_FAILED ? CYDNN_STATUS_OUT_OF_MEMORY : CYDNN_STATUS_CUBLAS_ERROR;
    return fail(status, (int)err, "%s: %s failed: %s: %s", op, call, cublasGetStatusName(err),
                cublasGetStatusString(err));
}

}  // namespace cydnn

// ============================================================ device queries
extern "C" int cydnn_device_count(void) {
    int n = 0;  // cudaGetDeviceCount leaves it unwritten when there is no driver
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();  // do not leave the failure for the next call to find
        return 0;
    }
    return n;
}

extern "C" cydnnStatus_t cydnn_check_device(int device) {
    const char *op = "check_device";
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    if (driver == 0)
        return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)cudaErrorInsufficientDriver,
                           "%s: no NVIDIA driver found (libcuda.so could not be loaded): "
                           "this machine cannot run CUDA", op);
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        if (err == cudaErrorInsufficientDriver)
            return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)err,
                               "%s: the NVIDIA driver supports CUDA %d.%d but cydnn uses the CUDA %d.%d "
                               "runtime: update the driver", op, driver / 1000, (driver % 1000) / 10,
                               runtime / 1000, (runtime % 1000) / 10);
        if (err == cudaErrorNoDevice)
            return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)err, "%s: no CUDA device found", op);
        return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)err, "%s: CUDA initialisation failed: %s: %s",
                           op, cudaGetErrorName(err), cudaGetErrorString(err));
    }
    if (n == 0)
        return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)cudaErrorNoDevice, "%s: no CUDA device found", op);
    if (device < 0 || device >= n)
        return cydnn::fail(CYDNN_STATUS_DEVICE_UNAVAILABLE, (int)cudaErrorInvalidDevice,
                           "%s: device %d requested but %d device(s) present", op, device, n);
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_device_name(int device, char *buf, size_t len) {
    CYDNN_REQUIRE("device_name", buf != nullptr && len > 0, "buf is NULL or empty");
    CYDNN_TRY(cydnn_check_device(device));
    cudaDeviceProp prop;
    CYDNN_CUDA("device_name", cudaGetDeviceProperties(&prop, device));
    snprintf(buf, len, "%s", prop.name);
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_device_memory_info(int device, size_t *free_bytes, size_t *total_bytes) {
    CYDNN_REQUIRE("device_memory_info", free_bytes && total_bytes, "output pointer is NULL");
    CYDNN_TRY(cydnn_check_device(device));
    int current = 0;
    CYDNN_CUDA("device_memory_info", cudaGetDevice(&current));
    CYDNN_CUDA("device_memory_info", cudaSetDevice(device));
    cudaError_t err = cudaMemGetInfo(free_bytes, total_bytes);
    cudaSetDevice(current);
    if (err != cudaSuccess) return cydnn::cuda_failure(err, "device_memory_info", "cudaMemGetInfo");
    return CYDNN_STATUS_SUCCESS;
}

extern "C" void cydnn_versions(cydnnVersions *out) {
    if (!out) return;
    memset(out, 0, sizeof(*out));
    cudaRuntimeGetVersion(&out->cuda_runtime);
    cudaDriverGetVersion(&out->cuda_driver);
    out->cudnn = cudnnGetVersion();
    int major = 0, minor = 0, patch = 0;
    cublasGetProperty(MAJOR_VERSION, &major);
    cublasGetProperty(MINOR_VERSION, &minor);
    cublasGetProperty(PATCH_LEVEL, &patch);
    out->cublas = major * 10000 + minor * 100 + patch;
    out->compiled_cudnn = CUDNN_VERSION;
}

// =================================================================== context
namespace {
constexpr int kMaxDevices = 64;
cydnnContext *g_contexts[kMaxDevices] = {};
std::mutex g_contexts_mutex;

// Undo a partly built context (creation failed half-way).
void destroy_partial(cydnnContext *ctx) {
    if (ctx->cublas) cublasDestroy(ctx->cublas);
    if (ctx->cudnn) cudnnDestroy(ctx->cudnn);
    if (ctx->staging_free) cudaEventDestroy(ctx->staging_free);
    if (ctx->stream) cudaStreamDestroy(ctx->stream);
    delete ctx->pool;
    delete ctx;
}

cydnnStatus_t create_context(int device, cydnnContext **out) {
    const char *op = "context";
    cydnnContext *ctx = new (std::nothrow) cydnnContext();
    if (!ctx) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: host allocation failed", op);
    ctx->device = device;
    cydnnStatus_t st = CYDNN_STATUS_SUCCESS;
    cudaError_t cerr;
    cudnnStatus_t dnn;
    cublasStatus_t blas;
    if ((cerr = cudaSetDevice(device)) != cudaSuccess) { st = cydnn::cuda_failure(cerr, op, "cudaSetDevice"); goto fail; }
    // A non-blocking stream: it does not wait for the legacy default stream.
    if ((cerr = cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        st = cydnn::cuda_failure(cerr, op, "cudaStreamCreateWithFlags"); goto fail;
    }
    if ((cerr = cudaEventCreateWithFlags(&ctx->staging_free, cudaEventDisableTiming)) != cudaSuccess) {
        st = cydnn::cuda_failure(cerr, op, "cudaEventCreateWithFlags"); goto fail;
    }
    if ((dnn = cudnnCreate(&ctx->cudnn)) != CUDNN_STATUS_SUCCESS) { st = cydnn::cudnn_failure(dnn, op, "cudnnCreate"); goto fail; }
    if ((dnn = cudnnSetStream(ctx->cudnn, ctx->stream)) != CUDNN_STATUS_SUCCESS) { st = cydnn::cudnn_failure(dnn, op, "cudnnSetStream"); goto fail; }
    if ((blas = cublasCreate(&ctx->cublas)) != CUBLAS_STATUS_SUCCESS) { st = cydnn::cublas_failure(blas, op, "cublasCreate"); goto fail; }
    if ((blas = cublasSetStream(ctx->cublas, ctx->stream)) != CUBLAS_STATUS_SUCCESS) { st = cydnn::cublas_failure(blas, op, "cublasSetStream"); goto fail; }
    // Scalars (alpha, beta) are passed from the host.
    if ((blas = cublasSetPointerMode(ctx->cublas, CUBLAS_POINTER_MODE_HOST)) != CUBLAS_STATUS_SUCCESS) {
        st = cydnn::cublas_failure(blas, op, "cublasSetPointerMode"); goto fail;
    }
    ctx->pool = new (std::nothrow) cydnn::MemoryPool(device, ctx->stream);
    if (!ctx->pool) { st = cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: host allocation failed", op); goto fail; }
    *out = ctx;
    return CYDNN_STATUS_SUCCESS;
fail:
    destroy_partial(ctx);
    return st;
}
}  // namespace

extern "C" cydnnStatus_t cydnn_context_get(int device, cydnnContext **ctx) {
    CYDNN_REQUIRE("context", ctx != nullptr, "output pointer is NULL");
    CYDNN_REQUIRE("context", device >= 0 && device < kMaxDevices, "device %d out of range", device);
    std::lock_guard<std::mutex> lock(g_contexts_mutex);
    if (!g_contexts[device]) {
        CYDNN_TRY(cydnn_check_device(device));
        CYDNN_TRY(create_context(device, &g_contexts[device]));
    }
    *ctx = g_contexts[device];
    return CYDNN_STATUS_SUCCESS;
}

extern "C" int cydnn_context_device(const cydnnContext *ctx) { return ctx ? ctx->device : -1; }
extern "C" void *cydnn_context_stream(const cydnnContext *ctx) { return ctx ? (void *)ctx->stream : nullptr; }

extern "C" size_t cydnn_context_plan_count(const cydnnContext *ctx) { return ctx ? ctx->plans.size() : 0; }

extern "C" cydnnStatus_t cydnn_context_synchronize(cydnnContext *ctx) {
    CYDNN_REQUIRE_CTX("synchronize", ctx);
    CYDNN_CUDA("synchronize", cudaStreamSynchronize(ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_context_set_math(cydnnContext *ctx, int allow_tf32, int deterministic) {
    CYDNN_REQUIRE_CTX("set_math", ctx);
    ctx->allow_tf32 = allow_tf32 ? 1 : 0;
    ctx->deterministic = deterministic ? 1 : 0;
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_context_set_fp16(cydnnContext *ctx, int on) {
    CYDNN_REQUIRE_CTX("set_fp16", ctx);
    ctx->fp16 = on ? 1 : 0;
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_context_set_workspace_limit(cydnnContext *ctx, size_t bytes) {
    CYDNN_REQUIRE_CTX("set_workspace_limit", ctx);
    ctx->workspace_limit = bytes;
    return CYDNN_STATUS_SUCCESS;
}

extern "C" cydnnStatus_t cydnn_debug_fail(cydnnContext *ctx, int which) {
    const char *op = "debug_fail";
    CYDNN_REQUIRE_CTX(op, ctx);
    if (which == 1) {
        CYDNN_CUDA(op, cudaSetDevice(1 << 20));
    } else if (which == 2) {
        cudnnTensorDescriptor_t desc;
        CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&desc));
        cudnnStatus_t st = cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, -1, 1, 1, 1);
        cudnnDestroyTensorDescriptor(desc);
        if (st != CUDNN_STATUS_SUCCESS) return cydnn::cudnn_failure(st, op, "cudnnSetTensor4dDescriptor(n=-1)");
    } else if (which == 3) {
        float one = 1.0f;
        CYDNN_CUBLAS(op, cublasSgemm(ctx->cublas, CUBLAS_OP_N, CUBLAS_OP_N, -1, 1, 1, &one, nullptr, 1, nullptr, 1,
                                     &one, nullptr, 1));
    } else if (which == 4) {
        return cydnn_free(ctx, (void *)(uintptr_t)0x10);
    }
    return cydnn::fail_invalid(op, "which = %d: expected 1 (CUDA), 2 (cuDNN), 3 (cuBLAS) or 4 (pool)", which);
}

namespace cydnn {

cydnnStatus_t get_workspace(cydnnContext *ctx, size_t bytes, void **ptr, const char *op, int which) {
    if (bytes == 0) {
        *ptr = nullptr;
        return CYDNN_STATUS_SUCCESS;
    }
    if (bytes > ctx->workspace_limit)
        return fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: needs %zu bytes of workspace, over the limit of %zu",
                    op, bytes, ctx->workspace_limit);
    cydnnContext::Workspace &ws = ctx->workspaces[which == kSideWorkspace ? kSideWorkspace : kMainWorkspace];
    if (bytes > ws.size) {
        // The old block goes back to the pool; stream order keeps it safe for
        // kernels still queued that use it (the second stream's work has joined
        // the stream before the next op asks).  Unless a captured graph may use
        // it: then it is retired (kept), since a replay would write into it later.
        if (ws.block) {
            if (ws.captured || ctx->capturing)
                ctx->retired_workspaces.push_back(ws.block);
            else
                CYDNN_TRY(ctx->pool->release(ws.block));
        }
        ws.block = nullptr;
        ws.size = 0;
        CYDNN_TRY(ctx->pool->allocate(bytes, &ws.block));
        ws.size = bytes;
        ws.captured = ctx->capturing != 0;
    }
    *ptr = ws.block;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t side_stream(cydnnContext *ctx, const char *op) {
    if (ctx->side == nullptr) CYDNN_CUDA(op, cudaStreamCreateWithFlags(&ctx->side, cudaStreamNonBlocking));
    if (ctx->fork == nullptr) CYDNN_CUDA(op, cudaEventCreateWithFlags(&ctx->fork, cudaEventDisableTiming));
    if (ctx->join == nullptr) CYDNN_CUDA(op, cudaEventCreateWithFlags(&ctx->join, cudaEventDisableTiming));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t fork_side(cydnnContext *ctx, const char *op) {
    CYDNN_CUDA(op, cudaEventRecord(ctx->fork, ctx->stream));
    CYDNN_CUDA(op, cudaStreamWaitEvent(ctx->side, ctx->fork, 0));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t join_side(cydnnContext *ctx, const char *op) {
    CYDNN_CUDA(op, cudaEventRecord(ctx->join, ctx->side));
    CYDNN_CUDA(op, cudaStreamWaitEvent(ctx->stream, ctx->join, 0));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t pool_alloc(cydnnContext *ctx, size_t bytes, void **ptr) { return ctx->pool->allocate(bytes, ptr); }
cydnnStatus_t pool_free(cydnnContext *ctx, void *ptr) {
    if (ptr != nullptr && ctx->capturing) {   // the graph being captured may use it: keep it
        try {
            ctx->capture_keep.push_back(ptr);
            return CYDNN_STATUS_SUCCESS;
        } catch (const std::bad_alloc &) {
            return fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "free: host allocation failed");
        }
    }
    return ctx->pool->release(ptr);
}

}  // namespace cydnn
