// fastpath.cu -- CUDA graphs and the numpy-in / numpy-out predictor.
//
// Graphs: cydnn_graph_begin / _end capture whatever is enqueued on the
// context's stream in between (kernels, copies) into a cudaGraphExec that
// cydnn_graph_launch replays with one call.  Capture uses the relaxed mode
// (other threads may keep allocating), and _end always ends the capture, so
// a failure while capturing leaves the stream as it was.
//
// The predictor turns host images into host probabilities with as little
// host work as the hardware allows:
//   small n (<= kSmallMax): one mapped pinned buffer [n | images], one
//     captured graph per size bucket (1, 2, 4, ..., 64) holding the fused
//     forward, which reads n and the images from that host buffer and writes
//     the probabilities to another over PCIe.  A call is memcpy into pinned
//     memory, one graph launch, one wait (for the outputs themselves where n
//     fills its bucket: mapped_wait.h), memcpy out.
//   large n: chunks of kChunk images through two pinned buffers, so that the
//     host copy of chunk i+1 overlaps the GPU's copy, forward and copy back
//     of chunk i.
// The graphs hold the weights' device addresses: they are rebuilt when the
// caller passes other addresses (the values may change freely: training in
// place is seen by the next call).
#include <cstring>
#include <new>

#include "common.cuh"
#include "host_copy.h"
#include "mapped_wait.h"
#include "memory.cuh"

struct cydnnGraph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    int kernels = 0;
    cydnnContext *ctx = nullptr;
    std::vector<void *> keep;   // pool blocks freed during the capture: the graph may use them
};

namespace {

const char *kGraphOp = "cuda_graph";

// Blocks kept for a graph go back to the pool (after the graph's last replay
// in stream order: the pool hands them to work queued later on the same stream).
void release_kept(cydnnContext *ctx, std::vector<void *> &keep) {
    for (void *p : keep) ctx->pool->release(p);
    keep.clear();
}

void destroy_graph(cydnnGraph *g) {
    if (g == nullptr) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    if (g->ctx) release_kept(g->ctx, g->keep);
    delete g;
}

constexpr size_t kCublasWorkspace = size_t(8) << 20;

}  // namespace

cydnnStatus_t cydnn_graph_begin(cydnnContext *ctx) {
    CYDNN_REQUIRE_CTX(kGraphOp, ctx);
    CYDNN_REQUIRE(kGraphOp, !ctx->capturing, "a capture is already under way on this context");
    if (ctx->cublas_workspace == nullptr) {
        // cuBLAS's own workspace could be allocated inside a capture (as memory
        // nodes): give it one of ours first, kept for the life of the context.
        void *ws = nullptr;
        CYDNN_TRY(ctx->pool->allocate(kCublasWorkspace, &ws));
        const cublasStatus_t e = cublasSetWorkspace(ctx->cublas, ws, kCublasWorkspace);
        if (e != CUBLAS_STATUS_SUCCESS) {
            ctx->pool->release(ws);
            return cydnn::cublas_failure(e, kGraphOp, "cublasSetWorkspace");
        }
        ctx->cublas_workspace = ws;
    }
    CYDNN_CUDA(kGraphOp, cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeRelaxed));
    ctx->capturing = 1;
    ctx->capture_keep.clear();
    for (cydnnContext::Workspace &ws : ctx->workspaces)
        if (ws.block != nullptr) ws.captured = true;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_graph_end(cydnnContext *ctx, int discard, cydnnGraph **out) {
    CYDNN_REQUIRE_CTX(kGraphOp, ctx);
    CYDNN_REQUIRE(kGraphOp, out != nullptr, "out is NULL");
    *out = nullptr;
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(ctx->stream, &graph);
    ctx->capturing = 0;
    std::vector<void *> keep;
    keep.swap(ctx->capture_keep);
    if (ended != cudaSuccess || discard) {
        release_kept(ctx, keep);   // no graph will run: the blocks are free again
        if (graph) cudaGraphDestroy(graph);
        if (ended != cudaSuccess) return cydnn::cuda_failure(ended, kGraphOp, "cudaStreamEndCapture");
        cudaGetLastError();
        return CYDNN_STATUS_SUCCESS;
    }
    cydnnGraph *g = new (std::nothrow) cydnnGraph;
    if (g == nullptr) {
        release_kept(ctx, keep);
        cudaGraphDestroy(graph);
        return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", kGraphOp);
    }
    g->graph = graph;
    g->ctx = ctx;
    g->keep.swap(keep);
    size_t count = 0;
    cudaError_t e = cudaGraphGetNodes(graph, nullptr, &count);
    if (e == cudaSuccess && count > 0) {
        cudaGraphNode_t *nodes = new (std::nothrow) cudaGraphNode_t[count];
        if (nodes != nullptr && cudaGraphGetNodes(graph, nodes, &count) == cudaSuccess) {
            for (size_t i = 0; i < count; ++i) {
                cudaGraphNodeType type;
                if (cudaGraphNodeGetType(nodes[i], &type) == cudaSuccess && type == cudaGraphNodeTypeKernel)
                    ++g->kernels;
            }
        }
        delete[] nodes;
    }
    e = cudaGraphInstantiate(&g->exec, graph, 0);
    if (e != cudaSuccess) {
        destroy_graph(g);
        return cydnn::cuda_failure(e, kGraphOp, "cudaGraphInstantiate");
    }
    *out = g;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_graph_launch(cydnnContext *ctx, cydnnGraph *graph) {
    CYDNN_REQUIRE_CTX(kGraphOp, ctx);
    CYDNN_REQUIRE(kGraphOp, graph != nullptr && graph->exec != nullptr, "graph is NULL");
    CYDNN_CUDA(kGraphOp, cudaGraphLaunch(graph->exec, ctx->stream));
    return CYDNN_STATUS_SUCCESS;
}

int cydnn_graph_kernel_count(const cydnnGraph *graph) { return graph ? graph->kernels : 0; }

void cydnn_graph_destroy(cydnnGraph *graph) { destroy_graph(graph); }

// ================================================================ predictor
namespace {

constexpr int kSmallMax = 64;     // graphs for n <= this
constexpr int kBuckets = 7;       // 1, 2, 4, ..., 64
constexpr int kChunk = 4096;      // images per chunk on the large path
constexpr size_t kHeader = 16;    // bytes before the images: int n

size_t elem_size(int kind) { return kind == CYDNN_INPUT_U8 ? 1 : 4; }
constexpr size_t kMaxImageBytes = 32 * 32 * sizeof(float);   // the largest: a classic full-size float image

// Bytes of one input image: 28x28 raw, or the network's own size (classic 32x32) for F32_FULL.
size_t image_bytes(int classic, int kind) {
    return (kind == CYDNN_INPUT_F32_FULL && classic ? 32 * 32 : 28 * 28) * elem_size(kind);
}

struct Small {  // one per input kind: mapped pinned memory, read and written by the kernel itself
    void *h_in = nullptr, *d_in = nullptr;   // [header | kSmallMax images]; d_in is h_in seen from the GPU
    float *h_out = nullptr, *d_out = nullptr;
    cydnnGraph *graphs[kBuckets] = {};
};

struct Large {  // shared by every kind (sized for the largest image)
    void *h_in[2] = {}, *d_in[2] = {};
    float *h_out[2] = {}, *d_out[2] = {};
    cudaEvent_t done[2] = {};
};

}  // namespace

struct cydnnPredictor {
    cydnnContext *ctx = nullptr;
    int classic = 0, nc = 10, use_graphs = 1;
    float mean = 0, std = 1;
    cydnnLeNetWeights weights{};   // what the graphs were captured with
    Small small[3];                // by input kind
    Large large;
};

namespace {

const char *kPredictOp = "predict";

void free_graphs(cydnnPredictor *p) {
    for (auto &s : p->small)
        for (auto &g : s.graphs) {
            destroy_graph(g);
            g = nullptr;
        }
}

cydnnStatus_t host_alloc(void **ptr, size_t bytes) {
    CYDNN_CUDA(kPredictOp, cudaHostAlloc(ptr, bytes, cudaHostAllocDefault));
    return CYDNN_STATUS_SUCCESS;
}

// Small batches skip the copies: the buffers are pinned host memory mapped
// into the GPU's address space, so the kernel reads the images (a few KB)
// and writes the probabilities over PCIe itself -- one graph node, not three.
cydnnStatus_t ensure_small(cydnnPredictor *p, int kind) {
    Small &s = p->small[kind];
    if (s.h_in != nullptr) return CYDNN_STATUS_SUCCESS;
    const size_t in_bytes = kHeader + (size_t)kSmallMax * image_bytes(p->classic, kind);
    const size_t out_bytes = sizeof(float) * (size_t)kSmallMax * p->nc;
    CYDNN_CUDA(kPredictOp, cudaHostAlloc(&s.h_in, in_bytes, cudaHostAllocMapped));
    CYDNN_CUDA(kPredictOp, cudaHostAlloc((void **)&s.h_out, out_bytes, cudaHostAllocMapped));
    CYDNN_CUDA(kPredictOp, cudaHostGetDevicePointer(&s.d_in, s.h_in, 0));
    CYDNN_CUDA(kPredictOp, cudaHostGetDevicePointer((void **)&s.d_out, s.h_out, 0));
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t ensure_large(cydnnPredictor *p) {
    Large &l = p->large;
    if (l.h_in[0] != nullptr) return CYDNN_STATUS_SUCCESS;
    const size_t in_bytes = (size_t)kChunk * kMaxImageBytes;
    const size_t out_bytes = sizeof(float) * (size_t)kChunk * p->nc;
    for (int i = 0; i < 2; ++i) {
        CYDNN_TRY(host_alloc(&l.h_in[i], in_bytes));
        CYDNN_TRY(host_alloc((void **)&l.h_out[i], out_bytes));
        CYDNN_TRY(cydnn_malloc(p->ctx, in_bytes, &l.d_in[i]));
        CYDNN_TRY(cydnn_malloc(p->ctx, out_bytes, (void **)&l.d_out[i]));
        CYDNN_CUDA(kPredictOp, cudaEventCreateWithFlags(&l.done[i], cudaEventDisableTiming));
    }
    return CYDNN_STATUS_SUCCESS;
}

// Enqueue the forward of up to `bucket` images (the count is read from the header).
cydnnStatus_t enqueue_small(cydnnPredictor *p, int kind, int bucket, const cydnnLeNetWeights *w) {
    Small &s = p->small[kind];
    return cydnn_lenet_forward(p->ctx, p->classic, p->nc, w, (char *)s.d_in + kHeader, kind, bucket,
                               (const int *)s.d_in, p->mean, p->std, 1, s.d_out);
}

cydnnStatus_t run_small(cydnnPredictor *p, const cydnnLeNetWeights *w, const void *images, int kind,
                        int n, float *probs) {
    CYDNN_TRY(ensure_small(p, kind));
    Small &s = p->small[kind];
    int b = 0;
    while ((1 << b) < n) ++b;
    const int bucket = 1 << b;
    *(int *)s.h_in = n;
    std::memcpy((char *)s.h_in + kHeader, images, (size_t)n * image_bytes(p->classic, kind));
    // n a whole bucket: every block of the forward has an image, so that once every output was written no block
    // is left to read the header or the images (which the next call rewrites): wait for the outputs
    // (mapped_wait.h), else for the stream
    const bool spin = n == bucket;
    if (spin) cydnn_mapped_clear(s.h_out, (size_t)n * p->nc);
    if (p->use_graphs) {
        if (s.graphs[b] == nullptr) {
            CYDNN_TRY(cydnn_graph_begin(p->ctx));
            const cydnnStatus_t queued = enqueue_small(p, kind, bucket, w);
            cydnnGraph *g = nullptr;
            const cydnnStatus_t ended = cydnn_graph_end(p->ctx, queued != CYDNN_STATUS_SUCCESS, &g);
            CYDNN_TRY(queued);
            CYDNN_TRY(ended);
            s.graphs[b] = g;
        }
        CYDNN_TRY(cydnn_graph_launch(p->ctx, s.graphs[b]));
    } else {
        CYDNN_TRY(enqueue_small(p, kind, bucket, w));
    }
    if (!spin || !cydnn_mapped_written(s.h_out, (size_t)n * p->nc, CYDNN_MAPPED_SPIN_NS))
        CYDNN_CUDA(kPredictOp, cudaStreamSynchronize(p->ctx->stream));
    std::memcpy(probs, s.h_out, sizeof(float) * (size_t)n * p->nc);
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t run_large(cydnnPredictor *p, const cydnnLeNetWeights *w, const void *images, int kind,
                        int n, float *probs) {
    CYDNN_TRY(ensure_large(p));
    Large &l = p->large;
    cudaStream_t st = p->ctx->stream;
    const size_t es = image_bytes(p->classic, kind);   // bytes per image
    const int chunks = (n + kChunk - 1) / kChunk;
    // Copy chunk c's probabilities out of its slot once its event has fired.
    auto drain = [&](int c) -> cydnnStatus_t {
        const int slot = c & 1;
        const int cn = (c == chunks - 1) ? n - c * kChunk : kChunk;
        CYDNN_CUDA(kPredictOp, cudaEventSynchronize(l.done[slot]));
        std::memcpy(probs + (size_t)c * kChunk * p->nc, l.h_out[slot], sizeof(float) * (size_t)cn * p->nc);
        return CYDNN_STATUS_SUCCESS;
    };
    for (int c = 0; c < chunks; ++c) {
        const int slot = c & 1;
        const int cn = (c == chunks - 1) ? n - c * kChunk : kChunk;
        if (c >= 2) CYDNN_TRY(drain(c - 2));   // frees the slot
        cydnn::parallel_copy(l.h_in[slot], (const char *)images + (size_t)c * kChunk * es, (size_t)cn * es,
                             cydnn::copy_threads());   // host_copy.h: a few threads outrun one memcpy
        CYDNN_CUDA(kPredictOp, cudaMemcpyAsync(l.d_in[slot], l.h_in[slot], (size_t)cn * es,
                                               cudaMemcpyHostToDevice, st));
        CYDNN_TRY(cydnn_lenet_forward(p->ctx, p->classic, p->nc, w, l.d_in[slot], kind, cn, nullptr, p->mean,
                                      p->std, 1, l.d_out[slot]));
        CYDNN_CUDA(kPredictOp, cudaMemcpyAsync(l.h_out[slot], l.d_out[slot], sizeof(float) * (size_t)cn * p->nc,
                                               cudaMemcpyDeviceToHost, st));
        CYDNN_CUDA(kPredictOp, cudaEventRecord(l.done[slot], st));
    }
    for (int c = chunks >= 2 ? chunks - 2 : 0; c < chunks; ++c) CYDNN_TRY(drain(c));
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

cydnnStatus_t cydnn_predictor_create(cydnnContext *ctx, int classic, int num_classes, float mean,
                                     float std, int use_graphs, cydnnPredictor **out) {
    CYDNN_REQUIRE_CTX(kPredictOp, ctx);
    CYDNN_REQUIRE(kPredictOp, out != nullptr, "out is NULL");
    CYDNN_REQUIRE(kPredictOp, num_classes >= 1 && num_classes <= CYDNN_LENET_MAX_CLASSES,
                  "num_classes must be in [1, %d], got %d", CYDNN_LENET_MAX_CLASSES, num_classes);
    cydnnPredictor *p = new (std::nothrow) cydnnPredictor;
    if (p == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: out of host memory", kPredictOp);
    p->ctx = ctx;
    p->classic = classic != 0;
    p->nc = num_classes;
    p->mean = mean;
    p->std = std;
    p->use_graphs = use_graphs != 0;
    *out = p;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_predictor_run(cydnnPredictor *p, const cydnnLeNetWeights *w, const void *host_images,
                                  int input_kind, int n, float *host_probs) {
    CYDNN_REQUIRE(kPredictOp, p != nullptr && w != nullptr, "predictor or weights is NULL");
    CYDNN_REQUIRE(kPredictOp, host_images != nullptr && host_probs != nullptr, "a host pointer is NULL");
    CYDNN_REQUIRE(kPredictOp, input_kind == CYDNN_INPUT_U8 || input_kind == CYDNN_INPUT_F32 ||
                                  input_kind == CYDNN_INPUT_F32_FULL,
                  "unknown input kind %d", input_kind);
    CYDNN_REQUIRE(kPredictOp, n >= 1, "n must be >= 1, got %d", n);
    if (std::memcmp(&p->weights, w, sizeof(*w)) != 0) {  // other arrays: the graphs are stale
        free_graphs(p);
        p->weights = *w;
    }
    return n <= kSmallMax ? run_small(p, w, host_images, input_kind, n, host_probs)
                          : run_large(p, w, host_images, input_kind, n, host_probs);
}

int cydnn_predictor_graph_count(const cydnnPredictor *p) {
    int count = 0;
    if (p)
        for (const auto &s : p->small)
            for (const auto *g : s.graphs) count += g != nullptr;
    return count;
}

void cydnn_predictor_destroy(cydnnPredictor *p) {
    if (p == nullptr) return;
    // Work queued on the buffers must be done before they go.
    cudaStreamSynchronize(p->ctx->stream);
    free_graphs(p);
    for (auto &s : p->small) {
        if (s.h_in) cudaFreeHost(s.h_in);
        if (s.h_out) cudaFreeHost(s.h_out);
    }
    for (int i = 0; i < 2; ++i) {
        if (p->large.h_in[i]) cudaFreeHost(p->large.h_in[i]);
        if (p->large.h_out[i]) cudaFreeHost(p->large.h_out[i]);
        if (p->large.d_in[i]) cydnn_free(p->ctx, p->large.d_in[i]);
        if (p->large.d_out[i]) cydnn_free(p->ctx, p->large.d_out[i]);
        if (p->large.done[i]) cudaEventDestroy(p->large.done[i]);
    }
    delete p;
}
