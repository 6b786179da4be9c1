// compiled.cu -- the kernels the compiler (python/cydnn/compiler/) adds to the per-op library.
//
// A compiled step is the reference ops, called with buffers planned once, captured
// in one CUDA graph.  What a graph replays cannot take new host scalars, and each
// kernel boundary costs ~1.5-2 us even inside a graph, so the compiler adds:
//
//   (compiled_act.cu: bias_act_forward, bias_act_backward, max_pool_act_backward -- the
//    activation epilogues and their backward; compiled_norm.cu: batch norm)
//   flat_update         one launch updates every parameter (SGD / Adam / AdamW) over
//                       flat parameter, gradient and state buffers; lr and the step
//                       number come from device memory (a schedule needs no re-capture)
//   step_bookkeeping    after the update: loss sum, correct count, step counters
//   dropout_step        dropout whose seed mixes in the device step counter, so a
//                       replayed graph draws a new mask every step
//   direct_conv_forward convolution + bias + activation in one kernel (small problems: chosen
//                       over cuDNN + bias_act by measurement, per plan)
//   fold_batch_norm     inference: a batch norm's running statistics folded into the weights
//                       and bias of the layer before it (computed in the graph, so it is fresh)
//
// Activations (act, act_math.cuh): 0 identity, 1 relu, 2 tanh, 3 sigmoid, 4 leaky relu (slope).
// The optimizer formulas are optimizer.cu's (PyTorch's), element by element.
#include <cmath>

#include "act_math.cuh"
#include "common.cuh"
#include "launch.cuh"
#include "conv_plan.cuh"   // check_geometry

namespace {

using cydnn::activate;
using cydnn::fits_32;

// The update of every parameter in one launch (optimizer.cu's formulas).  The step
// number t (from 1) is counters->global_step + 1; the learning rate is
// lr_table[counters->step_in_epoch % lr_len].
__global__ void flat_update_kernel(cydnnFlatUpdate u) {
    cydnn::pdl_wait();
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

constexpr int kReduceThreads = 256;   // the bookkeeping's one block

// One block: the batch's correct count (argmax, first maximum on ties, as numpy),
// then thread 0 adds it and the loss to the epoch totals and advances the counters.
__global__ void bookkeeping_kernel(const float *logits, const int32_t *labels, int n, int c,
                                   const float *loss, cydnnStepCounters *counters) {
    cydnn::pdl_wait();
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
    cydnn::pdl_wait();
    const uint64_t s = cydnn::splitmix64(seed ^ (uint64_t)counters->global_step);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const uint64_t r = cydnn::splitmix64(s ^ cydnn::splitmix64((uint64_t)i));
        const float m = (r >> 40) >= (uint64_t)threshold ? scale : 0.0f;
        mask[i] = m;
        y[i] = x[i] * m;
    }
}

// w_out[o, k] = w[o, k] * s[o] and b_out[o] = (b[o] - mean[o]) * s[o] + beta[o], s = gamma / sqrt(var + eps):
// a batch norm in inference (running statistics) folded into the layer before it.
__global__ void fold_batch_norm_kernel(const float *w, const float *b, const float *gamma, const float *beta,
                                       const float *mean, const float *var, float eps, int out, size_t per_out,
                                       float *w_out, float *b_out) {
    cydnn::pdl_wait();
    const size_t total = (size_t)out * per_out;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const size_t o = i / per_out;
        const float s = gamma[o] / sqrtf(var[o] + eps);
        w_out[i] = w[i] * s;
        if (i % per_out == 0) b_out[o] = ((b != nullptr ? b[o] : 0.0f) - mean[o]) * s + beta[o];
    }
}

// y[img, o, oy, ox] = act(b[o] + sum_{ci, i, j} x[img, ci, oy*sh - ph + i, ox*sw - pw + j] w[o, ci, i, j]):
// a direct convolution with its bias and activation, one thread per output element.  For the small
// problems of small batches it beats cuDNN's general kernels (one launch instead of two, no im2col);
// the executor times both on the plan's own buffers and keeps the faster.
__global__ void direct_conv_kernel(const float *x, const float *w, const float *b, float *y,
                                   cydnnConvGeometry g, int oh, int ow, int act, float slope) {
    cydnn::pdl_wait();
    const size_t total = (size_t)g.n * g.k * oh * ow;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int ox = (int)(idx % ow);
        const int oy = (int)((idx / ow) % oh);
        const int o = (int)((idx / ((size_t)ow * oh)) % g.k);
        const size_t img = idx / ((size_t)ow * oh * g.k);
        float sum = b != nullptr ? b[o] : 0.0f;
        const int y0 = oy * g.stride_h - g.pad_h, x0 = ox * g.stride_w - g.pad_w;
        for (int ci = 0; ci < g.c; ++ci) {
            const float *xp = x + (img * g.c + ci) * (size_t)g.h * g.w;
            const float *wp = w + ((size_t)o * g.c + ci) * g.kh * g.kw;
            for (int i = 0; i < g.kh; ++i) {
                const int iy = y0 + i;
                if (iy < 0 || iy >= g.h) continue;
                for (int j = 0; j < g.kw; ++j) {
                    const int ix = x0 + j;
                    if (ix >= 0 && ix < g.w) sum += xp[(size_t)iy * g.w + ix] * wp[i * g.kw + j];
                }
            }
        }
        y[idx] = activate(sum, act, slope);
    }
}

}  // namespace

cydnnStatus_t cydnn_direct_conv_forward(cydnnContext *ctx, const cydnnConvGeometry *g, const float *x,
                                        const float *w, const float *b, float *y, int act, float slope) {
    const char *op = "direct_conv_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_TRY(cydnn::conv::check_geometry(op, g));     // conv_plan.cu's, as the cuDNN ops check
    CYDNN_REQUIRE(op, x != nullptr && w != nullptr && y != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, act >= 0 && act <= 4, "act must be 0..4, got %d", act);
    const int oh = (g->h + 2 * g->pad_h - g->kh) / g->stride_h + 1;
    const int ow = (g->w + 2 * g->pad_w - g->kw) / g->stride_w + 1;
    const size_t total = (size_t)g->n * g->k * oh * ow;
    CYDNN_LAUNCH(direct_conv_kernel, cydnn::blocks_for(total, 128), 128, 0, ctx->stream, x, w, b, y, *g, oh, ow,
                 act, slope);
    CYDNN_LAUNCH_CHECK(op, "direct_conv_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_fold_batch_norm(cydnnContext *ctx, const float *w, const float *b, const float *gamma,
                                    const float *beta, const float *mean, const float *var, float eps, int out,
                                    size_t per_out, float *w_out, float *b_out) {
    const char *op = "fold_batch_norm";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, w && gamma && beta && mean && var && w_out && b_out, "a pointer is NULL");
    CYDNN_REQUIRE(op, out >= 1 && per_out >= 1, "sizes must be >= 1 (out=%d, per_out=%zu)", out, per_out);
    const size_t total = (size_t)out * per_out;
    CYDNN_LAUNCH(fold_batch_norm_kernel, cydnn::blocks_for(total), cydnn::kThreads, 0, ctx->stream,
        w, b, gamma, beta, mean, var, eps, out, per_out, w_out, b_out);
    CYDNN_LAUNCH_CHECK(op, "fold_batch_norm_kernel");
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
    CYDNN_LAUNCH(flat_update_kernel, cydnn::blocks_for(u->count), cydnn::kThreads, 0, ctx->stream, *u);
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
    CYDNN_LAUNCH(bookkeeping_kernel, 1, kReduceThreads, 0, ctx->stream, logits, labels, n, c, loss, counters);
    CYDNN_LAUNCH_CHECK(op, "bookkeeping_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_dropout_step(cydnnContext *ctx, const float *x, float *y, float *mask, size_t count,
                                 uint32_t threshold, float scale, uint64_t seed, const cydnnStepCounters *counters) {
    const char *op = "dropout_step";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr && mask != nullptr && counters != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, count >= 1, "count must be >= 1");
    CYDNN_LAUNCH(dropout_step_kernel, cydnn::blocks_for(count), cydnn::kThreads, 0, ctx->stream,
        x, y, mask, count, threshold, scale, seed, counters);
    CYDNN_LAUNCH_CHECK(op, "dropout_step_kernel");
    return CYDNN_STATUS_SUCCESS;
}
