// compiled.cu -- the kernels the compiler (python/cydnn/compiler/) adds to the per-op library.
//
// A compiled step is the reference ops, called with buffers planned once, captured
// in one CUDA graph.  What a graph replays cannot take new host scalars, and each
// kernel boundary costs ~1.5-2 us even inside a graph, so the compiler adds:
//
//   bias_act_forward    y = act(x + bias[c])             replaces add-bias + activation
//   bias_act_backward   g = dy * act'(y); dbias[c] = sum g   replaces activation backward
//                                                         + bias gradient
//   flat_update         one launch updates every parameter (SGD / Adam / AdamW) over
//                       flat parameter, gradient and state buffers; lr and the step
//                       number come from device memory (a schedule needs no re-capture)
//   step_bookkeeping    after the update: loss sum, correct count, step counters
//   dropout_step        dropout whose seed mixes in the device step counter, so a
//                       replayed graph draws a new mask every step
//
// Activations (act): 0 identity, 1 relu, 2 tanh, 3 sigmoid, 4 leaky relu (slope).
// Each derivative is written in terms of the output y, as the per-op backward kernels:
//   relu' = (y > 0), tanh' = 1 - y^2, sigmoid' = y (1 - y), leaky' = y > 0 ? 1 : slope.
// The optimizer formulas are optimizer.cu's (PyTorch's), element by element.
#include <cmath>

#include "common.cuh"

namespace {

__device__ __forceinline__ float activate(float v, int act, float slope) {
    switch (act) {
        case 1: return v <= 0.0f ? 0.0f : v;          // as relu_forward (NaN stays NaN)
        case 2: return tanhf(v);
        case 3: return 1.0f / (1.0f + expf(-v));
        case 4: return v > 0.0f ? v : v * slope;
        default: return v;
    }
}

__device__ __forceinline__ float derivative(float y, int act, float slope) {
    switch (act) {
        case 1: return y > 0.0f ? 1.0f : 0.0f;
        case 2: return 1.0f - y * y;
        case 3: return y * (1.0f - y);
        case 4: return y > 0.0f ? 1.0f : slope;
        default: return 1.0f;
    }
}

// y[n, c, i] = act(x[n, c, i] + bias[c]); bias may be NULL.  May run in place.
__global__ void bias_act_forward_kernel(const float *x, const float *bias, float *y, size_t total,
                                        int channels, size_t inner, int act, float slope) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float v = x[i];
        if (bias != nullptr) v += bias[(i / inner) % (size_t)channels];
        y[i] = activate(v, act, slope);
    }
}

// One block per channel c: g = dy * act'(y) over the (n, inner) elements of the
// channel, written to dx, and their sum to dbias[c] (fixed reduction order: the
// same bits every run).  dbias may be NULL (then it is an activation backward).
constexpr int kReduceThreads = 256;

__global__ void bias_act_backward_kernel(const float *y, const float *dy, float *dx, float *dbias,
                                         int n, int channels, size_t inner, int act, float slope) {
    __shared__ float partial[kReduceThreads];
    const int c = blockIdx.x;
    const size_t per_channel = (size_t)n * inner;
    float sum = 0.0f;
    for (size_t k = threadIdx.x; k < per_channel; k += blockDim.x) {
        const size_t row = k / inner, col = k % inner;
        const size_t i = (row * channels + c) * inner + col;
        const float g = dy[i] * derivative(y[i], act, slope);
        if (dx != nullptr) dx[i] = g;
        sum += g;
    }
    if (dbias == nullptr) return;
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) dbias[c] = partial[0];
}

// The update of every parameter in one launch (optimizer.cu's formulas).  The step
// number t (from 1) is counters->global_step + 1; the learning rate is
// lr_table[counters->step_in_epoch % lr_len].
__global__ void flat_update_kernel(cydnnFlatUpdate u) {
    const long long t = u.counters->global_step + 1;
    const float lr = u.lr_table[u.counters->step_in_epoch % u.lr_len];
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    float bc1 = 1.0f, bc2 = 1.0f, decay = 1.0f;
    if (u.optimizer != CYDNN_OPT_SGD) {
        bc1 = (float)(1.0 - pow(u.beta1, (double)t));
        bc2 = (float)(1.0 - pow(u.beta2, (double)t));
        if (u.optimizer == CYDNN_OPT_ADAMW) decay = (float)(1.0 - (double)lr * (double)u.weight_decay);
    }
    const float b1 = (float)u.beta1, b2 = (float)u.beta2;
    const float omb1 = (float)(1.0 - u.beta1), omb2 = (float)(1.0 - u.beta2);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < u.count; i += stride) {
        float p = u.param[i];
        float g = u.grad[i];
        if (u.optimizer == CYDNN_OPT_SGD) {
            if (u.weight_decay != 0.0f) g = g + u.weight_decay * p;
            if (u.momentum != 0.0f) {
                const float buf = t == 1 ? g : u.momentum * u.state1[i] + (1.0f - u.dampening) * g;
                u.state1[i] = buf;
                g = u.nesterov ? g + u.momentum * buf : buf;
            }
            u.param[i] = p - lr * g;
        } else {
            if (u.optimizer == CYDNN_OPT_ADAMW)
                p = p * decay;
            else if (u.weight_decay != 0.0f)
                g = g + u.weight_decay * p;
            const float mi = b1 * u.state1[i] + omb1 * g;
            const float vi = b2 * u.state2[i] + omb2 * g * g;
            u.state1[i] = mi;
            u.state2[i] = vi;
            u.param[i] = p - lr * (mi / bc1) / (sqrtf(vi / bc2) + u.eps);
        }
    }
}

// One block: the batch's correct count (argmax, first maximum on ties, as numpy),
// then thread 0 adds it and the loss to the epoch totals and advances the counters.
__global__ void bookkeeping_kernel(const float *logits, const int32_t *labels, int n, int c,
                                   const float *loss, cydnnStepCounters *counters) {
    __shared__ int right[kReduceThreads];
    int mine = 0;
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        const float *row = logits + (size_t)r * c;
        int best = 0;
        for (int j = 1; j < c; ++j)
            if (row[j] > row[best]) best = j;
        mine += best == labels[r];
    }
    right[threadIdx.x] = mine;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) right[threadIdx.x] += right[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        counters->correct += right[0];
        counters->loss_sum += (double)*loss;
        counters->step_in_epoch += 1;
        counters->global_step += 1;
    }
}

// activation.cu's dropout, with the seed mixed with the device step counter.
__global__ void dropout_step_kernel(const float *x, float *y, float *mask, size_t count,
                                    uint32_t threshold, float scale, uint64_t seed,
                                    const cydnnStepCounters *counters) {
    const uint64_t s = cydnn::splitmix64(seed ^ (uint64_t)counters->global_step);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const uint64_t r = cydnn::splitmix64(s ^ cydnn::splitmix64((uint64_t)i));
        const float m = (r >> 40) >= (uint64_t)threshold ? scale : 0.0f;
        mask[i] = m;
        y[i] = x[i] * m;
    }
}

}  // namespace

cydnnStatus_t cydnn_bias_act_forward(cydnnContext *ctx, const float *x, const float *bias, float *y,
                                     int n, int channels, size_t inner, int act, float slope) {
    const char *op = "bias_act_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr, "x or y is NULL");
    CYDNN_REQUIRE(op, n >= 1 && channels >= 1 && inner >= 1, "sizes must be >= 1 (n=%d, channels=%d, inner=%zu)",
                  n, channels, inner);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    const size_t total = (size_t)n * channels * inner;
    bias_act_forward_kernel<<<cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream>>>(
        x, bias, y, total, channels, inner, act, slope);
    CYDNN_LAUNCH_CHECK(op, "bias_act_forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_bias_act_backward(cydnnContext *ctx, const float *y, const float *dy, float *dx,
                                      float *dbias, int n, int channels, size_t inner, int act, float slope) {
    const char *op = "bias_act_backward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, y != nullptr && dy != nullptr, "y or dy is NULL");
    CYDNN_REQUIRE(op, dx != nullptr || dbias != nullptr, "nothing to write (dx and dbias are NULL)");
    CYDNN_REQUIRE(op, n >= 1 && channels >= 1 && inner >= 1, "sizes must be >= 1 (n=%d, channels=%d, inner=%zu)",
                  n, channels, inner);
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    bias_act_backward_kernel<<<channels, kReduceThreads, 0, ctx->stream>>>(y, dy, dx, dbias, n, channels,
                                                                          inner, act, slope);
    CYDNN_LAUNCH_CHECK(op, "bias_act_backward_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_flat_update(cydnnContext *ctx, const cydnnFlatUpdate *u) {
    const char *op = "flat_update";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, u != nullptr, "update is NULL");
    CYDNN_REQUIRE(op, u->param != nullptr && u->grad != nullptr, "param or grad is NULL");
    CYDNN_REQUIRE(op, u->count >= 1, "count must be >= 1");
    CYDNN_REQUIRE(op, u->lr_table != nullptr && u->lr_len >= 1, "lr_table is NULL or empty");
    CYDNN_REQUIRE(op, u->counters != nullptr, "counters is NULL");
    CYDNN_REQUIRE(op, u->optimizer >= CYDNN_OPT_SGD && u->optimizer <= CYDNN_OPT_ADAMW, "optimizer %d unknown",
                  u->optimizer);
    CYDNN_REQUIRE(op, u->optimizer != CYDNN_OPT_SGD || u->momentum == 0.0f || u->state1 != nullptr,
                  "SGD with momentum needs state1");
    CYDNN_REQUIRE(op, u->optimizer == CYDNN_OPT_SGD || (u->state1 != nullptr && u->state2 != nullptr),
                  "Adam needs state1 and state2");
    flat_update_kernel<<<cydnn::blocks_for(u->count), cydnn::kThreads, 0, ctx->stream>>>(*u);
    CYDNN_LAUNCH_CHECK(op, "flat_update_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_step_bookkeeping(cydnnContext *ctx, const float *logits, const int32_t *labels, int n,
                                     int c, const float *loss, cydnnStepCounters *counters) {
    const char *op = "step_bookkeeping";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, logits != nullptr && labels != nullptr && loss != nullptr && counters != nullptr,
                  "a pointer is NULL");
    CYDNN_REQUIRE(op, n >= 1 && c >= 1, "sizes must be >= 1 (n=%d, c=%d)", n, c);
    bookkeeping_kernel<<<1, kReduceThreads, 0, ctx->stream>>>(logits, labels, n, c, loss, counters);
    CYDNN_LAUNCH_CHECK(op, "bookkeeping_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_dropout_step(cydnnContext *ctx, const float *x, float *y, float *mask, size_t count,
                                 uint32_t threshold, float scale, uint64_t seed, const cydnnStepCounters *counters) {
    const char *op = "dropout_step";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr && mask != nullptr && counters != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, count >= 1, "count must be >= 1");
    dropout_step_kernel<<<cydnn::blocks_for(count), cydnn::kThreads, 0, ctx->stream>>>(
        x, y, mask, count, threshold, scale, seed, counters);
    CYDNN_LAUNCH_CHECK(op, "dropout_step_kernel");
    return CYDNN_STATUS_SUCCESS;
}
