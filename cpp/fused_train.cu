// fused_train.cu -- a training step's forward, loss and backward for any network the fused network's
// table describes (no batch norm), in two kernels, where the compiled step's plan takes ~20-60 library
// calls.  The optimizer update and the counters stay the plan's (cydnn_flat_update, cydnn_step_bookkeeping).
//
// 1. train kernel: one thread-block cluster (1-16 blocks) per image, as the fused inference forward
//    (fused_net.cu): the image and every layer's output stay in shared memory; the forward layers are
//    fused_net_layers.cuh's; then the softmax cross-entropy and, layer by layer backwards, the gradient
//    of each layer's input (fused_train_layers.cuh).  What the weight gradients need leaves for global
//    memory (L2): the input of every convolution / linear layer (but the first, whose input is x) and
//    dLoss/d(its output before the activation).
// 2. weight kernel: the batch's weight and bias gradients from those, in a fixed summation order (the
//    same bits every run): a linear layer as a small GEMM over tiles of 32 outputs x 64 inputs (the
//    batch staged through shared memory); a convolution as one work item per (output, input channel)
//    pair, each thread summing its terms (image, output position) into kh * kw accumulators, the
//    terms of a big layer split over several blocks whose partial sums the last block to finish adds
//    in chunk order (a ticket per item, zeroed by the train kernel).  Block 0 takes the batch's mean
//    loss (loss.cu's tree).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cluster_launch.cuh"
#include "common.cuh"
#include "fused_net_table.cuh"
#include "fused_train_args.cuh"      // the two kernels' arguments, the profiling clocks
#include "fused_train_layers.cuh"    // the backward layers; fused_net_layers.cuh: the forward ones
#include "fused_train_weights.cuh"   // the weight kernel

namespace {

constexpr const char *kOp = "fused_train_step";
// load_input (fused_net_layers.cuh) sizes a thread's share of the image by kWsplitThreads threads a block
static_assert(kTrainThreads == kWsplitThreads, "the train kernel's blocks are the forward layers' 512 threads");

// The layout of the scratch and of the train kernel's shared memory, from the table.
struct Layout {
    TrainArgs t;
    WArgs w;
    long blocks;           // of the weight kernel
    size_t smem, scratch;
};

int taps_supported(int kh, int kw) {
    return kh == kw && (kh == 1 || kh == 2 || kh == 3 || kh == 4 || kh == 5 || kh == 7);
}

cydnnStatus_t layout(const cydnnNet *net, int batch, int cluster, char *base, Layout *out) {
    const char *op = kOp;
    size_t fwd_smem = 0;
    CYDNN_TRY(cydnn_fused_net_check(net, &fwd_smem));
    CYDNN_REQUIRE(op, batch >= 1 && batch <= (1 << 20), "batch must be in [1, 1048576], got %d", batch);
    CYDNN_REQUIRE(op, cydnn::cluster_size_ok(cluster), "cluster must be 1, 2, 4, 8 or 16, got %d", cluster);
    CYDNN_REQUIRE(op, !net->softmax, "the table must give logits (softmax 0): the loss applies its own softmax");
    Layout &Y = *out;
    memset(&Y, 0, sizeof(Y));
    TrainArgs &t = Y.t;
    t.batch = batch;
    t.lowest = -1;
    long off = 0, width = net->in_size;
    t.act[0] = off;
    off += round4(net->in_size);
    for (int l = 0; l < net->num_layers; ++l) {
        const cydnnNetLayer &L = net->layers[l];
        int acts = 0;
        for (int s = 0; s < L.num_epi; ++s) {
            CYDNN_REQUIRE(op, L.epi[s] != CYDNN_NET_EPI_BN, "layer %d: batch norm is not trained here", l);
            ++acts;
        }
        CYDNN_REQUIRE(op, acts <= 1, "layer %d: %d activations in one epilogue", l, acts);
        CYDNN_REQUIRE(op, L.pool == 0, "layer %d: a pooling folded into a convolution is not trained here", l);
        CYDNN_REQUIRE(op, L.op != CYDNN_NET_LINEAR || L.tile == 0,
                      "layer %d: a linear tail (tile 1) is the inference kernel's, not trained here", l);
        if (weighted(L)) {
            if (t.lowest < 0) t.lowest = l;
            if (L.op == CYDNN_NET_CONV)
                CYDNN_REQUIRE(op, taps_supported(L.kh, L.kw), "layer %d: a %dx%d kernel (the weight gradient "
                              "takes square kernels of 1, 2, 3, 4, 5 or 7)", l, L.kh, L.kw);
        }
        t.act[l + 1] = off;
        off += round4(cydnn::net_layer_out(L));
        if (cydnn::net_layer_out(L) > width) width = cydnn::net_layer_out(L);
    }
    CYDNN_REQUIRE(op, t.lowest >= 0, "the network has no weights to train");
    width = round4(width);
    t.g0 = off;
    t.g1 = off + width;
    t.wbuf = off + 2 * width;
    Y.smem = sizeof(float) * (size_t)(t.wbuf + net->wcap);
    // scratch: row losses, saved inputs and output gradients, partial sums, tickets (16-byte aligned each)
    size_t s = 0;
    auto take = [&](long floats) {
        char *p = base ? base + s : nullptr;
        s += sizeof(float) * round4(floats);
        return p;
    };
    t.row_loss = (float *)take(batch);
    WArgs &w = Y.w;
    w.batch = batch;
    w.row_loss = t.row_loss;
    long blocks = 1;   // block 0: the mean loss
    long tickets = 0;
    for (int l = 0; l < net->num_layers; ++l) {
        const cydnnNetLayer &L = net->layers[l];
        if (!weighted(L)) continue;
        if (l > 0) t.saved_x[l] = (float *)take((long)batch * cydnn::net_layer_in(L));
        t.saved_d[l] = (float *)take((long)batch * cydnn::net_layer_out(L));
        WLayer &W = w.L[w.num++];
        W.op = L.op;
        W.k = L.k, W.c = L.c, W.h = L.h, W.w = L.w, W.oh = L.oh, W.ow = L.ow, W.kh = L.kh, W.kw = L.kw;
        W.sh = L.sh, W.sw = L.sw, W.ph = L.ph, W.pw = L.pw;
        W.in_stride = cydnn::net_layer_in(L);
        W.out_stride = cydnn::net_layer_out(L);
        W.layer = l;
        W.x = l > 0 ? t.saved_x[l] : nullptr;    // the first layer reads the step's x
        W.d = t.saved_d[l];
        W.first = blocks;
        if (L.op == CYDNN_NET_LINEAR) {
            W.chunks = 1;
            W.blocks = (long)((L.k + 31) / 32) * ((L.c + 63) / 64);
        } else {
            // the batch's images split into chunks of about kTermsPerBlock terms (image x output position)
            const long terms = (long)batch * L.oh * L.ow;
            long chunks = (terms + kTermsPerBlock - 1) / kTermsPerBlock;
            chunks = chunks < 1 ? 1 : (chunks > kMaxChunks ? kMaxChunks : chunks);
            if (chunks > batch) chunks = batch;
            const long per = (batch + chunks - 1) / chunks;
            W.chunks = (int)((batch + per - 1) / per);          // no empty chunk
            W.kb = conv_kb(L.kh);
            const long items = (long)((L.k + W.kb - 1) / W.kb) * L.c;
            W.blocks = items * W.chunks;
            if (W.chunks > 1) {
                W.partial = (float *)take(W.blocks * W.kb * (L.kh * L.kw + 1));
                tickets += items;
            }
        }
        blocks += W.blocks;
    }
    t.tickets = (int *)take(tickets);
    t.num_tickets = tickets;
    t.clock = (unsigned long long *)take(2 * kClocks);     // the profiling clocks, last (read by offset)
    int *tk = t.tickets;
    for (int i = 0; i < w.num; ++i)
        if (w.L[i].chunks > 1) {
            w.L[i].ticket = tk;
            if (tk) tk += (long)((w.L[i].k + w.L[i].kb - 1) / w.L[i].kb) * w.L[i].c;
        }
    Y.blocks = blocks;
    Y.scratch = s;
    CYDNN_REQUIRE(op, blocks <= 0x7fffffffL, "the weight gradients need %ld blocks, too many for one launch", blocks);
    return CYDNN_STATUS_SUCCESS;
}

// ------------------------------------------------------------ the train kernel
__global__ void __launch_bounds__(kTrainThreads)
    fused_train_kernel(const __grid_constant__ cydnnNet net, const __grid_constant__ TrainArgs a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    extern __shared__ float smem[];
    __shared__ float red[32];
    cg::cluster_group cluster = cg::this_cluster();
    const int ranks = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
    const long image = blockIdx.x / ranks;
    if (image >= a.batch) return;          // whole clusters only
    if (blockIdx.x == 0)                   // the weight kernel's tickets start at 0 each step
        for (long i = threadIdx.x; i < a.num_tickets; i += blockDim.x) a.tickets[i] = 0;
    if (a.clock != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
        a.clock[kTrainEnd] = a.clock[kWeightStart] = a.clock[kWeightEnd] = 0;
    const int L = net.num_layers;
    tick(a.clock, 0);
    load_input(a.x + image * net.in_size, net.in_size, smem + a.act[0], cluster, rank, ranks);
    for (int l = 0; l < L; ++l) {
        const cydnnNetLayer &Ly = net.layers[l];
        const float *in = smem + a.act[l];
        float *out = smem + a.act[l + 1];
        switch (Ly.op) {
            case CYDNN_NET_CONV: conv_dispatch(Ly, in, out, cluster, rank, ranks, smem + a.wbuf, net.wcap); break;
            case CYDNN_NET_LINEAR: linear_layer(Ly, in, out, cluster, rank, ranks); break;
            case CYDNN_NET_MAX_POOL: pool_layer(Ly, in, out, cluster, rank, ranks, true); break;
            case CYDNN_NET_AVG_POOL: pool_layer(Ly, in, out, cluster, rank, ranks, false); break;
            case CYDNN_NET_GLOBAL_AVG_POOL: gap_layer(Ly, in, out, cluster, rank, ranks); break;
            default: epilogue_layer(Ly, in, out, cluster, rank, ranks); break;
        }
        cluster.sync();
        tick(a.clock, kForward + l);
    }
    tick(a.clock, 1);
    // the inputs the weight gradients need, each block its share
    for (int l = 1; l < L; ++l) {
        if (a.saved_x[l] == nullptr) continue;
        const long n = cydnn::net_layer_in(net.layers[l]);
        long lo, hi;
        share(n, rank, ranks, lo, hi);
        const float *src = smem + a.act[l];
        float *dst = a.saved_x[l] + image * n;
        for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = src[i];
    }
    tick(a.clock, 2);
    float *gc = smem + a.g0, *gn = smem + a.g1;
    const long nc = net.out_size;
    loss_backward(smem + a.act[L], nc, a.labels[image], a.batch, gc, a.logits + image * nc, a.row_loss + image,
                  rank == 0, red);
    tick(a.clock, 3);
    for (int l = L - 1; l >= a.lowest; --l) {
        const cydnnNetLayer &Ly = net.layers[l];
        const long n = cydnn::net_layer_out(Ly);
        epilogue_backward(Ly, smem + a.act[l + 1], gc, n);
        __syncthreads();
        if (a.saved_d[l] != nullptr) {
            long lo, hi;
            share(n, rank, ranks, lo, hi);
            float *dst = a.saved_d[l] + image * n;
            for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = gc[i];
        }
        if (l == a.lowest) break;
        layer_backward_input(Ly, smem + a.act[l], gc, gn, cluster, rank, ranks, smem + a.wbuf, net.wcap);
        cluster.sync();
        tick(a.clock, 4 + l);
        float *t = gc;
        gc = gn;
        gn = t;
    }
    tick(a.clock, 4 + a.lowest);
    tick_last(a.clock, kTrainEnd);
#endif
}

}  // namespace

// ------------------------------------------------------------ the C boundary
cydnnStatus_t cydnn_fused_train_check(const cydnnNet *net, int batch, int cluster, size_t *smem_bytes,
                                      size_t *scratch_bytes) {
    CYDNN_REQUIRE(kOp, net != nullptr && smem_bytes != nullptr && scratch_bytes != nullptr, "a pointer is NULL");
    Layout Y;
    CYDNN_TRY(layout(net, batch, cluster, nullptr, &Y));
    *smem_bytes = Y.smem;
    *scratch_bytes = Y.scratch;
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_fused_train_step(cydnnContext *ctx, const cydnnNet *net, const cydnnNetTrain *t, int cluster) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, net != nullptr && t != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, t->x && t->labels && t->logits && t->loss && t->scratch,
                  "x, labels, logits, loss or scratch is NULL");
    Layout Y;
    CYDNN_TRY(layout(net, t->batch, cluster, (char *)t->scratch, &Y));
    for (int i = 0; i < Y.w.num; ++i) {
        WLayer &W = Y.w.L[i];
        const cydnnNetLayer &L = net->layers[W.layer];
        CYDNN_REQUIRE(op, t->grad_w[W.layer] != nullptr, "layer %d: its weight gradient is NULL", W.layer);
        CYDNN_REQUIRE(op, (t->grad_b[W.layer] != nullptr) == (L.bias != nullptr),
                      "layer %d: a bias gradient must be given exactly where the layer has a bias", W.layer);
        W.gw = t->grad_w[W.layer];
        W.gb = t->grad_b[W.layer];
    }
    const char *clk = getenv("CYDNN_FUSED_TRAIN_CLOCK");
    if (clk == nullptr || clk[0] == '\0' || clk[0] == '0') Y.t.clock = nullptr;
    Y.w.clock = Y.t.clock;
    Y.t.x = t->x;
    Y.t.labels = t->labels;
    Y.t.logits = t->logits;
    Y.w.loss = t->loss;
    static std::atomic<int> limit{0};
    CYDNN_TRY(cydnn::cluster_prepare_once(op, ctx->device, (const void *)fused_train_kernel, 32 * sizeof(float),
                                          limit));
    CYDNN_REQUIRE(op, Y.smem + 32 * sizeof(float) <= (size_t)limit.load(),
                  "one image's activations and gradients need %zu bytes of shared memory, the device has %d per "
                  "block", Y.smem, limit.load());
    CYDNN_REQUIRE(op, (long)t->batch * cluster <= 0x7fffffffL, "batch %d is too big for one launch", t->batch);
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg =
        cydnn::cluster_config((unsigned)(t->batch * cluster), kTrainThreads, Y.smem, ctx->stream, cluster, attr);
    CYDNN_CUDA(op, cudaLaunchKernelEx(&cfg, fused_train_kernel, *net, Y.t));
    CYDNN_LAUNCH_CHECK(op, "fused_train_kernel");
    static std::atomic<int> sms{0};
    if (sms.load() == 0) {
        int n = 0;
        CYDNN_CUDA(op, cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, ctx->device));
        sms.store(n);
    }
    const long grid = Y.blocks < 2L * sms.load() ? Y.blocks : 2L * sms.load();
    fused_weight_kernel<<<(unsigned)grid, kWThreads, 0, ctx->stream>>>(Y.w, t->x, Y.blocks);
    CYDNN_LAUNCH_CHECK(op, "fused_weight_kernel");
    return CYDNN_STATUS_SUCCESS;
}
