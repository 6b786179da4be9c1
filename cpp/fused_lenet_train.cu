// fused_lenet_train.cu -- the LeNet-5 training step in three kernels (see fused_lenet.cu's
// header for the whole design): train_kernel (gather + shift + forward + loss + backward, each
// block writing the gradient of its own images into its slice of a "partial" buffer, no
// atomics), update_kernel (the slices summed in a fixed order, then SGD / Adam / AdamW on every
// parameter in one launch, the lr read from a device table) and counters_kernel (loss and
// accuracy counters).
#include "fused_lenet_layers.cuh"

namespace {

template <bool CL>
__device__ void forward(float *sm, int S, int G, const float *const *w, const float *cw, unsigned char *arg,
                        int nc) {
    using N = Net<CL>;
    conv_forward<1, N::IN, K1, K1, N::ACT>(sm + N::X, sm + N::A1, S, G, cw, cw + 150);
    __syncthreads();
    pool_forward<K1, N::C1, N::MAXPOOL>(sm + N::A1, sm + N::PL1, arg, S, G);
    __syncthreads();
    conv_forward<K1, N::P1, K2, 4, N::ACT>(sm + N::PL1, sm + N::A2, S, G, cw + 156, cw + 2556);
    __syncthreads();
    pool_forward<K2, N::C2, N::MAXPOOL>(sm + N::A2, sm + N::PL2,
                                        arg == nullptr ? nullptr : arg + N::ARG2_BYTE, S, G);
    __syncthreads();
    fc_forward<N::FLAT, N::ACT>(sm + N::PL2, sm + N::H1, S, G, w[4], w[5], F1);
    __syncthreads();
    fc_forward<F1, N::ACT>(sm + N::H1, sm + N::H2, S, G, w[6], w[7], F2);
    __syncthreads();
    fc_forward<F2, kNone>(sm + N::H2, sm + N::Z, S, G, w[8], w[9], nc);
    __syncthreads();
}

// ------------------------------------------------------------ training
struct TrainScratch {
    float *partial;   // (blocks, P)
    float *loss;      // (batch)
    int *correct;     // (batch)
};

int images_per_block(int batch) {
    // Enough blocks to fill the GPU with one image each, then up to kGMax.
    int g = (batch + 131) / 132;
    return g < 1 ? 1 : (g > kGMax ? kGMax : g);
}

TrainScratch scratch_layout(void *base, bool classic, int nc, int batch) {
    const int G = images_per_block(batch);
    const long blocks = (batch + G - 1) / G;
    TrainScratch t;
    t.partial = (float *)base;
    t.loss = t.partial + blocks * param_total(classic, nc);
    t.correct = (int *)(t.loss + batch);
    return t;
}

size_t scratch_bytes(bool classic, int nc, int batch) {
    const int G = images_per_block(batch);
    const long blocks = (batch + G - 1) / G;
    return sizeof(float) * (size_t)(blocks * param_total(classic, nc) + 2 * (long)batch);
}

template <bool CL>
__global__ void __launch_bounds__(kMaxThreads)
    train_kernel(cydnnLeNetTrainStep a, TrainScratch t, int G) {
    using N = Net<CL>;
    extern __shared__ float smem[];
    float *cw = smem, *sm = smem + kConvW;
    __shared__ int labels[kGMax];
    const int S = N::TRAIN_SLOT;
    const int nc = a.num_classes;
    const int step = a.counters->step_in_epoch;
    const int first = blockIdx.x * G;
    const int Gb = min(G, a.batch - first);
    unsigned char *arg = (unsigned char *)(sm + N::ARG1);
    float *part = t.partial + (long)blockIdx.x * param_total(CL, nc);
    float *pg[CYDNN_LENET_NUM_PARAMS];
    {
        long off = 0;
        for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) {
            pg[i] = part + off;
            off += param_size(CL, nc, i);
        }
    }
    const float *w[CYDNN_LENET_NUM_PARAMS];
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) w[i] = a.param[i];

    load_conv_weights(w, cw);
    load_batch<CL>(a, step, first, Gb, S, sm, labels);
    __syncthreads();
    forward<CL>(sm, S, Gb, w, cw, arg, nc);

    // Loss and dLoss/dz, one warp per image, as the reference fused
    // cross-entropy: dz = (softmax - onehot) / batch.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < Gb) {
        const float *z = sm + warp * S + N::Z;
        float *dz = sm + warp * S + N::DZ;
        const int label = labels[warp];
        const float v = lane < nc ? z[lane] : -INFINITY;
        const float m = warp_max(v);
        const float e = lane < nc ? expf(v - m) : 0.0f;
        const float s = warp_sum(e);
        const unsigned at_max = __ballot_sync(0xffffffffu, lane < nc && v == m);
        const bool good = label >= 0 && label < nc;
        if (lane < ZPAD)
            dz[lane] = lane < nc ? (good ? (e / s - (lane == label ? 1.0f : 0.0f)) / (float)a.batch
                                         : __int_as_float(0x7fc00000))
                                 : 0.0f;
        if (lane == 0) {
            t.loss[first + warp] = good ? logf(s) - (z[label] - m) : __int_as_float(0x7fc00000);
            t.correct[first + warp] = good && (__ffs(at_max) - 1) == label;
        }
    }
    __syncthreads();

    // fc3: z = W3 h2 + b3
    fc_backward_params<F2>(sm + N::H2, sm + N::DZ, S, Gb, pg[8], pg[9], nc);
    fc_backward_input<F2, N::ACT>(sm + N::DZ, sm + N::H2, sm + N::DH2, S, Gb, w[8], nc);
    __syncthreads();
    // fc2: h2 = act(W2 h1 + b2)
    fc_backward_params<F1>(sm + N::H1, sm + N::DH2, S, Gb, pg[6], pg[7], F2);
    fc_backward_input<F1, N::ACT>(sm + N::DH2, sm + N::H1, sm + N::DH1, S, Gb, w[6], F2);
    __syncthreads();
    // fc1: h1 = act(W1 flat + b1); the flat input is pool2's output (no activation)
    fc_backward_params<N::FLAT>(sm + N::PL2, sm + N::DH1, S, Gb, pg[4], pg[5], F1);
    fc_backward_input<N::FLAT, kNone>(sm + N::DH1, sm + N::PL2, sm + N::DP2, S, Gb, w[4], F1);
    __syncthreads();
    // pool2 and act2: a2 <- dLoss/d(conv2 output)
    pool_act_backward<K2, N::C2, N::MAXPOOL, N::ACT>(sm + N::DP2, sm + N::A2, arg + N::ARG2_BYTE, S, Gb);
    __syncthreads();
    // conv2
    conv_backward_params<K1, N::P1, K2, 1>(sm + N::PL1, sm + N::A2, S, Gb, pg[2], pg[3], nullptr);
    conv_backward_input<K1, N::P1, K2>(sm + N::A2, sm + N::DP1, S, Gb, cw + 156);
    __syncthreads();
    // pool1 and act1
    pool_act_backward<K1, N::C1, N::MAXPOOL, N::ACT>(sm + N::DP1, sm + N::A1, arg, S, Gb);
    __syncthreads();
    // conv1 (no gradient for the input)
    conv_backward_params<1, N::IN, K1, 4>(sm + N::X, sm + N::A1, S, Gb, pg[0], pg[1], sm + N::DP1);
}

// Sum the blocks' partial gradients (fixed order), write the gradient, and
// update the parameter with the same formulas as optimizer.cu.
__global__ void update_kernel(cydnnLeNetTrainStep a, TrainScratch t, int blocks) {
    const long P = param_total(a.classic != 0, a.num_classes);
    const long stride = (long)gridDim.x * blockDim.x;
    const float lr = a.lr_table[a.counters->step_in_epoch];
    const long long step = a.counters->global_step;
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < P; e += stride) {
        int seg = 0;
        long off = 0;
        while (seg < CYDNN_LENET_NUM_PARAMS - 1 && e >= off + param_size(a.classic != 0, a.num_classes, seg)) {
            off += param_size(a.classic != 0, a.num_classes, seg);
            ++seg;
        }
        const long i = e - off;
        float g = 0.0f;
        for (int b = 0; b < blocks; ++b) g += t.partial[(long)b * P + e];
        a.grad[seg][i] = g;
        float p = a.param[seg][i];
        if (a.optimizer == CYDNN_OPT_SGD) {
            if (a.weight_decay != 0.0f) g = g + a.weight_decay * p;
            if (a.momentum != 0.0f) {
                float *mb = a.state1[seg];
                const float buf = step == 0 ? g : a.momentum * mb[i] + (1.0f - a.dampening) * g;
                mb[i] = buf;
                g = a.nesterov ? g + a.momentum * buf : buf;
            }
            p = p - lr * g;
        } else {
            const int decoupled = a.optimizer == CYDNN_OPT_ADAMW;
            const double t1 = (double)(step + 1);
            const float bc1 = (float)(1.0 - pow(a.beta1, t1));
            const float bc2 = (float)(1.0 - pow(a.beta2, t1));
            if (decoupled)
                p = p * (float)(1.0 - (double)lr * (double)a.weight_decay);
            else if (a.weight_decay != 0.0f)
                g = g + a.weight_decay * p;
            float *m = a.state1[seg], *v = a.state2[seg];
            const float mi = (float)a.beta1 * m[i] + (float)(1.0 - a.beta1) * g;
            const float vi = (float)a.beta2 * v[i] + (float)(1.0 - a.beta2) * g * g;
            m[i] = mi;
            v[i] = vi;
            p = p - lr * (mi / bc1) / (sqrtf(vi / bc2) + a.eps);
        }
        a.param[seg][i] = p;
    }
}

// One warp: the step's mean loss (fixed order), correct count, counters.
__global__ void counters_kernel(cydnnLeNetTrainStep a, TrainScratch t) {
    const int lane = threadIdx.x;
    float s = 0.0f;
    int c = 0;
    for (int i = lane; i < a.batch; i += 32) {
        s += t.loss[i];
        c += t.correct[i];
    }
    s = warp_sum(s);
    for (int o = 16; o > 0; o /= 2) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) {
        cydnnLeNetCounters *k = a.counters;
        k->loss_sum += (double)(s / (float)a.batch);
        k->correct += c;
        k->step_in_epoch += 1;
        k->global_step += 1;
    }
}

template <bool CL>
cydnnStatus_t launch_train(cydnnContext *ctx, const cydnnLeNetTrainStep *s) {
    const char *op = "lenet_train_step";
    const int G = images_per_block(s->batch);
    const int blocks = (s->batch + G - 1) / G;
    const size_t smem = sizeof(float) * ((size_t)G * Net<CL>::TRAIN_SLOT + kConvW);
    CYDNN_TRY(allow_smem(train_kernel<CL>, smem, op));
    const TrainScratch t = scratch_layout(s->scratch, CL, s->num_classes, s->batch);
    train_kernel<CL><<<blocks, threads_for("CYDNN_TRAIN_THREADS", 1024), smem, ctx->stream>>>(*s, t, G);
    CYDNN_LAUNCH_CHECK(op, "train_kernel");
    const long P = param_total(CL, s->num_classes);
    update_kernel<<<(unsigned)((P + 255) / 256), 256, 0, ctx->stream>>>(*s, t, blocks);
    CYDNN_LAUNCH_CHECK(op, "update_kernel");
    counters_kernel<<<1, 32, 0, ctx->stream>>>(*s, t);
    CYDNN_LAUNCH_CHECK(op, "counters_kernel");
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

// ------------------------------------------------------------ the C boundary
size_t cydnn_lenet_train_scratch_bytes(int classic, int num_classes, int batch) {
    if (batch < 1 || batch > CYDNN_LENET_MAX_TRAIN_BATCH || num_classes < 1 ||
        num_classes > CYDNN_LENET_MAX_CLASSES)
        return 0;
    return scratch_bytes(classic != 0, num_classes, batch);
}

cydnnStatus_t cydnn_lenet_train_step(cydnnContext *ctx, const cydnnLeNetTrainStep *s) {
    const char *op = "lenet_train_step";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, s != nullptr, "step is NULL");
    CYDNN_REQUIRE(op, s->batch >= 1 && s->batch <= CYDNN_LENET_MAX_TRAIN_BATCH,
                  "batch must be in [1, %d], got %d", CYDNN_LENET_MAX_TRAIN_BATCH, s->batch);
    CYDNN_REQUIRE(op, s->num_classes >= 1 && s->num_classes <= CYDNN_LENET_MAX_CLASSES,
                  "num_classes must be in [1, %d], got %d", CYDNN_LENET_MAX_CLASSES, s->num_classes);
    CYDNN_REQUIRE(op, s->images && s->labels && s->order && s->lr_table && s->counters && s->scratch,
                  "a data, table or scratch pointer is NULL");
    CYDNN_REQUIRE(op, s->n_images >= 1 && s->max_shift >= 0 && s->order_stride >= s->batch,
                  "n_images=%d max_shift=%d order_stride=%d batch=%d", s->n_images, s->max_shift,
                  s->order_stride, s->batch);
    CYDNN_REQUIRE(op, s->optimizer >= CYDNN_OPT_SGD && s->optimizer <= CYDNN_OPT_ADAMW,
                  "unknown optimizer %d", s->optimizer);
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) {
        CYDNN_REQUIRE(op, s->param[i] != nullptr && s->grad[i] != nullptr, "parameter %d is NULL", i);
        const bool need1 = s->optimizer != CYDNN_OPT_SGD || s->momentum != 0.0f;
        CYDNN_REQUIRE(op, !need1 || s->state1[i] != nullptr, "optimizer state of parameter %d is NULL", i);
        CYDNN_REQUIRE(op, s->optimizer == CYDNN_OPT_SGD || s->state2[i] != nullptr,
                      "Adam's v of parameter %d is NULL", i);
    }
    return s->classic ? launch_train<true>(ctx, s) : launch_train<false>(ctx, s);
}
