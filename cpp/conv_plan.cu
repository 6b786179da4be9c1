// conv_plan.cu -- building convolution plans and choosing their algorithms (conv_plan.cuh).
//
// Everything cuDNN needs for one geometry lives in a ConvPlan, built on the first call that sees the
// geometry and cached in the context: the tensor / filter / convolution
// descriptors and, per direction, the algorithm cuDNN measured to be the
// fastest together with its workspace size.  The forward algorithm is measured
// on the first forward call, the backward ones on the first backward call
// (the forward has no dy to measure with).  After that warm-up a call creates
// no descriptor and allocates nothing from the driver.
//
// Math settings (read from the context at every call and part of the plan key):
//   allow_tf32 = 0: the descriptor asks for CUDNN_FMA_MATH and any measured
//                   result that used tensor-op math is skipped, and so are
//                   the Winograd algorithms (see is_winograd): plain fp32.
//   allow_tf32 = 1: the descriptor asks for CUDNN_DEFAULT_MATH while measuring,
//                   then each direction runs with the math type of its winner.
//   deterministic:  only results with determinism == CUDNN_DETERMINISTIC count.
#include <climits>
#include <cstdlib>
#include <cstring>
#include <new>

#include "conv_plan.cuh"

namespace cydnn {
namespace conv {
namespace {

const float kOne = 1.0f;
const float kZero = 0.0f;

bool is_tensor_op_math(cudnnMathType_t m) {
    return m == CUDNN_TENSOR_OP_MATH || m == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

// Winograd algorithms trade accuracy for speed, even in FMA math.  Measured on
// an H100 with cuDNN 9.19 against a float64 reference (error relative to the
// largest output): the non-fused variant is off by ~1e-5 with 3x3 filters and
// by ~4e-3 with 5x5 filters (LeNet's), as coarse as TF32, where implicit GEMM
// and FFT stay near 1e-6.  With allow_tf32 = 0 the caller asked for float32
// accuracy, so they are skipped; with allow_tf32 = 1 they compete.
bool is_winograd(cudnnConvolutionFwdAlgo_t a) {
    return a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool is_winograd(cudnnConvolutionBwdDataAlgo_t a) {
    return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool is_winograd(cudnnConvolutionBwdFilterAlgo_t a) {
    return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD ||
           a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// The workspace to measure algorithms with: as large as the context allows;
// if the device cannot give that much, measure with none (algorithms that
// need no workspace always exist).
cydnnStatus_t search_workspace(cydnnContext *ctx, const char *op, void **ws, size_t *bytes) {
    *bytes = ctx->workspace_limit;
    cydnnStatus_t s = cydnn::get_workspace(ctx, *bytes, ws, op);
    if (s == CYDNN_STATUS_OUT_OF_MEMORY) {
        cydnn_clear_error();  // recovered below: not a failure of the op
        *bytes = 0;
        s = cydnn::get_workspace(ctx, 0, ws, op);
    }
    return s;
}

// A result of a Find call is usable when it ran (status SUCCESS), fits the workspace it was measured
// with, is deterministic if the plan asks for that, and, unless TF32 is allowed, uses neither tensor-op
// math nor Winograd.
template <class Perf>
bool usable(const ConvPlan *plan, const Perf &p, size_t workspace_bytes) {
    if (p.status != CUDNN_STATUS_SUCCESS) return false;
    if (p.memory > workspace_bytes) return false;
    if (plan->deterministic && p.determinism != CUDNN_DETERMINISTIC) return false;
    if (!plan->allow_tf32 && (is_tensor_op_math(p.mathType) || is_winograd(p.algo))) return false;
    return true;
}

cydnnStatus_t no_algorithm(const ConvPlan *plan, const char *op, int returned) {
    return cydnn::fail(CYDNN_STATUS_CUDNN_ERROR, CUDNN_STATUS_NOT_SUPPORTED,
                       "%s: none of the %d algorithms cuDNN measured is usable "
                       "(allow_tf32=%d, deterministic=%d)",
                       op, returned, plan->allow_tf32 ? 1 : 0, plan->deterministic ? 1 : 0);
}

// The math type a direction runs with: the winner's when TF32 is allowed,
// else FMA (the winner was measured under FMA and is not a tensor-op one).
cudnnMathType_t run_math(const ConvPlan *plan, cudnnMathType_t winner) {
    return plan->allow_tf32 ? winner : CUDNN_FMA_MATH;
}

// Find times each algorithm once, cold (its first run of this shape), and with the host's cost of the
// call in it.  A step runs its convolutions replayed in a CUDA graph, warm, with no host cost.  So the
// fastest kRetime usable results (within kRetimeSpan of Find's best) are timed again as a step runs
// them: kRetimeRuns calls captured into a graph, replayed once to warm up and once between two events.
// A result whose calls cannot be captured is dropped (the step's capture would fail with it).  The
// fastest wins; a result must beat Find's pick by kRetimeMargin to displace it, and where Find's pick is
// deterministic only deterministic results compete: the retiming must not make a run's bits vary where
// they did not (cuDNN's filter gradients ALGO_0 and ALGO_3 add by atomics).  $CYDNN_CONV_RETIME=0 keeps
// Find's pick (a switch to measure what the retiming gives: docs/performance.md, session 22).
constexpr int kRetime = 4, kRetimeRuns = 5;
constexpr float kRetimeSpan = 4.0f, kRetimeMargin = 0.97f;

bool retime_enabled() {
    const char *v = std::getenv("CYDNN_CONV_RETIME");
    return v == nullptr || std::strcmp(v, "0") != 0;
}

// One candidate's time per call, replayed in a graph; -1 where its calls fail or cannot be captured.
template <class Run, class Algo>
float replayed_ms(cydnnContext *ctx, Run &run, Algo algo, size_t memory, cudaEvent_t start, cudaEvent_t stop) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    if (cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) return -1.0f;
    bool ok = true;
    for (int r = 0; ok && r < kRetimeRuns; ++r) ok = run(algo, memory) == CUDNN_STATUS_SUCCESS;
    ok = cudaStreamEndCapture(ctx->stream, &graph) == cudaSuccess && ok && graph != nullptr;
    ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    float t = -1.0f;
    if (ok && cudaGraphLaunch(exec, ctx->stream) == cudaSuccess && cudaEventRecord(start, ctx->stream) == cudaSuccess &&
        cudaGraphLaunch(exec, ctx->stream) == cudaSuccess && cudaEventRecord(stop, ctx->stream) == cudaSuccess &&
        cudaEventSynchronize(stop) == cudaSuccess && cudaEventElapsedTime(&t, start, stop) == cudaSuccess)
        t /= kRetimeRuns;
    else
        t = -1.0f;
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return t;
}

// Time the candidates `idx` (Find's order) with run(algo, workspace bytes); returns the position in idx of
// the winner.
template <class Perf, class Run>
int retime(cydnnContext *ctx, ConvPlan *plan, const Perf *perf, const int *idx, int n, float *ms, Run run,
           const char *op) {
    for (int j = 0; j < n; ++j) ms[j] = -1.0f;
    if (n < 2 || ctx->capturing || !retime_enabled()) return 0;
    cudaEvent_t start = nullptr, stop = nullptr;
    if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
        if (start) cudaEventDestroy(start);
        cudaGetLastError();
        return 0;
    }
    for (int j = 0; j < n; ++j) {
        const Perf &p = perf[idx[j]];
        if (use_math(plan, run_math(plan, p.mathType), op) != CYDNN_STATUS_SUCCESS) {
            cydnn_clear_error();
            continue;
        }
        ms[j] = replayed_ms(ctx, run, p.algo, p.memory, start, stop);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    int best = 0;
    for (int j = 1; j < n; ++j)
        if (ms[j] >= 0.0f && (ms[best] < 0.0f || ms[j] < kRetimeMargin * ms[best])) best = j;
    return best;
}

// Keep the fastest usable result of a Find call, timed again (retime), as the direction's choice (algorithm,
// workspace, math type) and record everything measured for cydnn_conv_algorithms.  run(algo, workspace
// bytes) makes the direction's cuDNN call on the search workspace.
template <class Perf, class Algo, class Run>
cydnnStatus_t keep_fastest(cydnnContext *ctx, ConvPlan *plan, int direction, const Perf *perf, int count,
                           size_t workspace_bytes, const char *op, Run run, Algo *algo, size_t *workspace,
                           cudnnMathType_t *math, bool *found) {
    int idx[kRetime], n = 0;
    for (int pass = 0; pass < 2; ++pass)           // Find's best first, then the next fastest in its span
        for (int i = 0; i < count && n < kRetime; ++i) {
            if (!usable(plan, perf[i], workspace_bytes)) continue;
            if (pass == 0) {
                if (n == 0 || perf[i].time < perf[idx[0]].time) { idx[0] = i; n = 1; }
            } else if (i != idx[0] && perf[i].time <= kRetimeSpan * perf[idx[0]].time &&
                       (perf[idx[0]].determinism != CUDNN_DETERMINISTIC || perf[i].determinism == CUDNN_DETERMINISTIC)) {
                idx[n++] = i;      // never a non-deterministic result in place of Find's deterministic pick
            }
        }
    if (n == 0) return no_algorithm(plan, op, count);
    float ms[kRetime];
    const int best = idx[retime(ctx, plan, perf, idx, n, ms, run, op)];
    *algo = perf[best].algo;
    *workspace = perf[best].memory;
    *math = run_math(plan, perf[best].mathType);
    *found = true;
    plan->measured[direction].clear();
    for (int i = 0; i < count; ++i) {
        float again = -1.0f;
        for (int j = 0; j < n; ++j)
            if (idx[j] == i) again = ms[j];
        plan->measured[direction].push_back({(int)perf[i].algo, perf[i].time, (int)perf[i].status, perf[i].memory,
                                             again});
    }
    return CYDNN_STATUS_SUCCESS;
}

// Before a Find call: its workspace, and the descriptor in the math type to measure with.
cydnnStatus_t begin_search(cydnnContext *ctx, ConvPlan *plan, const char *op, void **ws,
                           size_t *ws_bytes) {
    CYDNN_TRY(search_workspace(ctx, op, ws, ws_bytes));
    return use_math(plan, plan->search_math, op);
}

}  // namespace

cydnnStatus_t check_geometry(const char *op, const cydnnConvGeometry *g) {
    if (g == nullptr)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: geometry is NULL", op);
    if (g->n < 1 || g->c < 1 || g->h < 1 || g->w < 1 || g->k < 1 || g->kh < 1 || g->kw < 1)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: sizes must be >= 1 (n=%d c=%d h=%d w=%d k=%d kh=%d kw=%d)", op,
                           g->n, g->c, g->h, g->w, g->k, g->kh, g->kw);
    if (g->stride_h < 1 || g->stride_w < 1 || g->pad_h < 0 || g->pad_w < 0)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: strides must be >= 1 and pads >= 0 (stride %dx%d, pad %dx%d)", op,
                           g->stride_h, g->stride_w, g->pad_h, g->pad_w);
    // In 64 bits so that huge pads cannot overflow.
    if ((long long)g->h + 2LL * g->pad_h > INT_MAX || (long long)g->w + 2LL * g->pad_w > INT_MAX)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: padded size overflows int", op);
    if ((long long)g->h + 2LL * g->pad_h < g->kh || (long long)g->w + 2LL * g->pad_w < g->kw)
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0,
                           "%s: the %dx%d filter is larger than the padded %lldx%lld input", op,
                           g->kh, g->kw, (long long)g->h + 2LL * g->pad_h,
                           (long long)g->w + 2LL * g->pad_w);
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t use_math(ConvPlan *plan, cudnnMathType_t math, const char *op) {
    if (plan->desc_math != math) {
        CYDNN_CUDNN(op, cudnnSetConvolutionMathType(plan->conv_desc, math));
        plan->desc_math = math;
    }
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t get_plan(cydnnContext *ctx, const cydnnConvGeometry *g, const char *op,
                       ConvPlan **out, bool fp16) {
    const std::string key = cydnn::format(
        "conv:n=%d,c=%d,h=%d,w=%d,k=%d,kh=%d,kw=%d,sh=%d,sw=%d,ph=%d,pw=%d,tf32=%d,det=%d,ws=%zu%s",
        g->n, g->c, g->h, g->w, g->k, g->kh, g->kw, g->stride_h, g->stride_w, g->pad_h, g->pad_w,
        ctx->allow_tf32 ? 1 : 0, ctx->deterministic ? 1 : 0, ctx->workspace_limit, fp16 ? ",fp16" : "");
    if (ConvPlan *found = cydnn::find_plan<ConvPlan>(ctx, key)) {
        *out = found;
        return CYDNN_STATUS_SUCCESS;
    }

    // Built into a unique_ptr: on any failure below its destructor frees
    // whatever descriptors were created so far.
    auto plan = std::make_unique<ConvPlan>();
    // Half precision asked for tensor cores: any math type may win then.
    plan->allow_tf32 = ctx->allow_tf32 != 0 || fp16;
    const cudnnDataType_t dt = fp16 ? CUDNN_DATA_HALF : CUDNN_DATA_FLOAT;
    plan->deterministic = ctx->deterministic != 0;
    plan->search_math = plan->allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;

    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->x_desc));
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->y_desc));
    CYDNN_CUDNN(op, cudnnCreateTensorDescriptor(&plan->bias_desc));
    CYDNN_CUDNN(op, cudnnCreateFilterDescriptor(&plan->w_desc));
    CYDNN_CUDNN(op, cudnnCreateConvolutionDescriptor(&plan->conv_desc));

    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->x_desc, CUDNN_TENSOR_NCHW, dt,
                                               g->n, g->c, g->h, g->w));
    CYDNN_CUDNN(op, cudnnSetFilter4dDescriptor(plan->w_desc, dt, CUDNN_TENSOR_NCHW,
                                               g->k, g->c, g->kh, g->kw));
    CYDNN_CUDNN(op, cudnnSetConvolution2dDescriptor(plan->conv_desc, g->pad_h, g->pad_w,
                                                    g->stride_h, g->stride_w, 1, 1,
                                                    CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CYDNN_CUDNN(op, cudnnSetConvolutionMathType(plan->conv_desc, plan->search_math));
    plan->desc_math = plan->search_math;

    // cuDNN's output size must agree with the formula in cydnn.h, which is
    // what the caller allocated y / dy with.
    int yn = 0, yk = 0, oh = 0, ow = 0;
    CYDNN_CUDNN(op, cudnnGetConvolution2dForwardOutputDim(plan->conv_desc, plan->x_desc,
                                                          plan->w_desc, &yn, &yk, &oh, &ow));
    const int expect_oh = (g->h + 2 * g->pad_h - g->kh) / g->stride_h + 1;
    const int expect_ow = (g->w + 2 * g->pad_w - g->kw) / g->stride_w + 1;
    if (yn != g->n || yk != g->k || oh != expect_oh || ow != expect_ow)
        return cydnn::fail(CYDNN_STATUS_CUDNN_ERROR, 0,
                           "%s: cuDNN output shape (%d, %d, %d, %d) differs from (%d, %d, %d, %d)",
                           op, yn, yk, oh, ow, g->n, g->k, expect_oh, expect_ow);
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->y_desc, CUDNN_TENSOR_NCHW, dt,
                                               yn, yk, oh, ow));
    CYDNN_CUDNN(op, cudnnSetTensor4dDescriptor(plan->bias_desc, CUDNN_TENSOR_NCHW,
                                               CUDNN_DATA_FLOAT, 1, g->k, 1, 1));

    *out = cydnn::store_plan(ctx, key, std::move(plan));
    return CYDNN_STATUS_SUCCESS;
}

// Measure the forward algorithms on the caller's buffers (y is overwritten,
// then rewritten by the real call that follows).
cydnnStatus_t find_forward(cydnnContext *ctx, ConvPlan *plan, const float *x, const float *w,
                           float *y, const char *op) {
    void *ws = nullptr;
    size_t ws_bytes = 0;
    CYDNN_TRY(begin_search(ctx, plan, op, &ws, &ws_bytes));

    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int returned = 0;
    CYDNN_CUDNN(op, cudnnFindConvolutionForwardAlgorithmEx(
                        ctx->cudnn, plan->x_desc, x, plan->w_desc, w, plan->conv_desc,
                        plan->y_desc, y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perf, ws,
                        ws_bytes));
    auto run = [&](cudnnConvolutionFwdAlgo_t a, size_t bytes) {
        return cudnnConvolutionForward(ctx->cudnn, &kOne, plan->x_desc, x, plan->w_desc, w, plan->conv_desc, a,
                                       ws, bytes, &kZero, plan->y_desc, y);
    };
    return keep_fastest(ctx, plan, 0, perf, returned, ws_bytes, op, run, &plan->fwd_algo,
                        &plan->fwd_workspace, &plan->fwd_math, &plan->fwd_found);
}

cydnnStatus_t find_backward_data(cydnnContext *ctx, ConvPlan *plan, const float *dy,
                                 const float *w, float *dx, const char *op) {
    void *ws = nullptr;
    size_t ws_bytes = 0;
    CYDNN_TRY(begin_search(ctx, plan, op, &ws, &ws_bytes));

    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    int returned = 0;
    CYDNN_CUDNN(op, cudnnFindConvolutionBackwardDataAlgorithmEx(
                        ctx->cudnn, plan->w_desc, w, plan->y_desc, dy, plan->conv_desc,
                        plan->x_desc, dx, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &returned, perf,
                        ws, ws_bytes));
    auto run = [&](cudnnConvolutionBwdDataAlgo_t a, size_t bytes) {
        return cudnnConvolutionBackwardData(ctx->cudnn, &kOne, plan->w_desc, w, plan->y_desc, dy, plan->conv_desc,
                                            a, ws, bytes, &kZero, plan->x_desc, dx);
    };
    return keep_fastest(ctx, plan, 1, perf, returned, ws_bytes, op, run, &plan->bwd_data_algo,
                        &plan->bwd_data_workspace, &plan->bwd_data_math, &plan->bwd_data_found);
}

cydnnStatus_t find_backward_filter(cydnnContext *ctx, ConvPlan *plan, const float *x,
                                   const float *dy, float *dw, const char *op) {
    void *ws = nullptr;
    size_t ws_bytes = 0;
    CYDNN_TRY(begin_search(ctx, plan, op, &ws, &ws_bytes));

    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    int returned = 0;
    CYDNN_CUDNN(op, cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        ctx->cudnn, plan->x_desc, x, plan->y_desc, dy, plan->conv_desc,
                        plan->w_desc, dw, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &returned,
                        perf, ws, ws_bytes));
    auto run = [&](cudnnConvolutionBwdFilterAlgo_t a, size_t bytes) {
        return cudnnConvolutionBackwardFilter(ctx->cudnn, &kOne, plan->x_desc, x, plan->y_desc, dy,
                                              plan->conv_desc, a, ws, bytes, &kZero, plan->w_desc, dw);
    };
    return keep_fastest(ctx, plan, 2, perf, returned, ws_bytes, op, run, &plan->bwd_filter_algo,
                        &plan->bwd_filter_workspace, &plan->bwd_filter_math, &plan->bwd_filter_found);
}

}  // namespace conv
}  // namespace cydnn

// ------------------------------------------------ what was chosen, and why
size_t cydnn_conv_algorithms(cydnnContext *ctx, char *buf, size_t len) {
    static const char *kDirections[3] = {"forward", "backward_data", "backward_filter"};
    std::string out;
    try {
        if (ctx != nullptr)
            for (const auto &entry : ctx->plans) {
                const auto *plan = dynamic_cast<const cydnn::conv::ConvPlan *>(entry.second.get());
                if (plan == nullptr) continue;
                const bool found[3] = {plan->fwd_found, plan->bwd_data_found, plan->bwd_filter_found};
                const int chosen[3] = {(int)plan->fwd_algo, (int)plan->bwd_data_algo, (int)plan->bwd_filter_algo};
                for (int d = 0; d < 3; ++d) {
                    if (!found[d]) continue;
                    out += entry.first + "\t" + kDirections[d] + "\t" + std::to_string(chosen[d]) + "\t";
                    for (size_t i = 0; i < plan->measured[d].size(); ++i) {
                        const cydnn::conv::Candidate &c = plan->measured[d][i];
                        out += cydnn::format("%s%d:%.6f:%d:%zu:%.6f", i ? "," : "", c.algo, (double)c.time_ms,
                                             c.status, c.memory, (double)c.retimed_ms);
                    }
                    out += "\n";
                }
            }
    } catch (const std::bad_alloc &) {
        return 0;
    }
    if (buf != nullptr && len > 0) {
        const size_t n = out.size() < len - 1 ? out.size() : len - 1;
        memcpy(buf, out.data(), n);
        buf[n] = '\0';
    }
    return out.size() + 1;
}
