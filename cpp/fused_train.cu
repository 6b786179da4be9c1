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
#include <new>

#include "cluster_launch.cuh"
#include "common.cuh"
#include "fused_net_table.cuh"
#include "fused_train_layers.cuh"   // the backward layers; fused_net_layers.cuh: the forward ones

namespace {

constexpr int kTrainThreads = 512;     // as the forward layers' tiles assume (fused_net.cu's kNetThreads)
constexpr int kWThreads = 256;
constexpr int kLossThreads = 256;      // loss.cu's kReduceThreads (the same tree)
constexpr int kMaxTaps = 49;           // kh * kw of a convolution's weight gradient (templates below)
constexpr int kTermsPerBlock = 2048;   // of a convolution's weight gradient, before its terms are split
constexpr int kMaxChunks = 64;
constexpr const char *kOp = "fused_train_step";

__host__ __device__ bool weighted(const cydnnNetLayer &L) { return L.op == CYDNN_NET_CONV || L.op == CYDNN_NET_LINEAR; }

long round4(long n) { return (n + 3) / 4 * 4; }

// What the train kernel needs beside the table.
struct TrainArgs {
    int batch, lowest;                       // lowest: the first layer with weights (backward stops there)
    long act[CYDNN_NET_MAX_LAYERS + 1];      // shared memory offsets (floats): [0] the image, [l + 1] layer l's output
    long g0, g1, wbuf;                       // the two gradient buffers, the convolutions' weight staging
    const float *x;
    const int32_t *labels;
    float *logits, *row_loss;
    float *saved_x[CYDNN_NET_MAX_LAYERS];    // weighted layer l > 0: its input, (batch, in_size)
    float *saved_d[CYDNN_NET_MAX_LAYERS];    // weighted layer l: dLoss/d(output before activation), (batch, out)
    int *tickets;
    long num_tickets;
    unsigned long long *clock;               // profiling ($CYDNN_FUSED_TRAIN_CLOCK): phase ends of image 0, else NULL
};

// The train kernel's phases, timed on image 0's rank 0 when asked (%globaltimer, ns): the start, after the
// forward, after the saved inputs, after the loss, after each layer's backward (from the last); then the
// last block of the train kernel to end, the weight kernel's start (its block 0) and its last block's end.
constexpr int kClocks = 4 + CYDNN_NET_MAX_LAYERS + 4;   // (one spare: an even count fills its 16 bytes)
constexpr int kTrainEnd = 4 + CYDNN_NET_MAX_LAYERS, kWeightStart = kTrainEnd + 1, kWeightEnd = kTrainEnd + 2;

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void tick(unsigned long long *clock, int i) {
    if (clock == nullptr || blockIdx.x != 0) return;
    __syncthreads();
    if (threadIdx.x == 0) clock[i] = now();
}

// The latest end over the blocks (slot i must hold 0 or an earlier time first).
__device__ __forceinline__ void tick_last(unsigned long long *clock, int i) {
    if (clock == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(clock + i, now());
}

// One weighted layer's share of the weight kernel.
struct WLayer {
    int layer, op, k, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw;
    int chunks;                  // convolution: blocks a work item's terms are split over
    long first, blocks;          // the layer's blocks [first, first + blocks)
    long in_stride, out_stride;  // floats per image of x / d
    const float *x, *d;
    float *gw, *gb;
    float *partial;              // chunks > 1: (items, chunks, taps + 1)
    int *ticket;                 // chunks > 1: (items)
};

struct WArgs {
    int batch, num;
    const float *row_loss;
    float *loss;
    unsigned long long *clock;   // profiling, as TrainArgs's
    WLayer L[CYDNN_NET_MAX_LAYERS];
};

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
            const long items = (long)L.k * L.c;
            W.blocks = items * W.chunks;
            if (W.chunks > 1) {
                W.partial = (float *)take(W.blocks * (L.kh * L.kw + 1));
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
            if (tk) tk += (long)w.L[i].k * w.L[i].c;
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

// ------------------------------------------------------------ the weight kernel
// The block's sums of v[0..N) (each: warp shuffles, then the warps in order) into out (shared memory).
// red: (blockDim / 32) * N floats.
template <int N>
__device__ void block_sums(const float (&v)[N], float *red, float *out) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = v[i];
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) red[warp * N + i] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < warps; ++w) s += red[w * N + i];
        out[i] = s;
    }
    __syncthreads();
}

// A convolution's work item (k, c), chunk `chunk` of the batch's images: the sums over (image, output
// position) of d * x for the KS * KS taps, and of d (the bias: the item with c == 0 writes it), into res.
// A thread owns output positions (p0, p0 + P, ...) and every S-th image of the chunk: a position's taps,
// their bounds and their offsets are worked out once and serve every image (the loop over images is a
// load of d, KS * KS loads of x and as many multiply-adds).  The mapping is fixed: the same sums every run.
template <int KS>
__device__ void conv_weight_sums(const WLayer &W, int batch, const float *x, long item, int chunk, float *red,
                                 float *res) {
    constexpr int T = KS * KS;
    const int k = (int)(item / W.c), c = (int)(item - (long)k * W.c);
    const int plane = W.oh * W.ow;
    const int per = (batch + W.chunks - 1) / W.chunks;
    const int n0 = per * chunk, n1 = n0 + per < batch ? n0 + per : batch;
    const int P = plane < (int)blockDim.x ? plane : (int)blockDim.x;
    const int S = (int)blockDim.x / P;
    float acc[T + 1];
#pragma unroll
    for (int i = 0; i <= T; ++i) acc[i] = 0.0f;
    if ((int)threadIdx.x < P * S) {
        const int s = (int)threadIdx.x / P;
        for (int p = (int)threadIdx.x % P; p < plane; p += P) {
            const int oy = p / W.ow, ox = p - (p / W.ow) * W.ow;
            const int iy0 = oy * W.sh - W.ph, ix0 = ox * W.sw - W.pw;
            unsigned long long valid = 0;            // tap ky * KS + kx inside the plane
#pragma unroll
            for (int ky = 0; ky < KS; ++ky)
#pragma unroll
                for (int kx = 0; kx < KS; ++kx)
                    if (iy0 + ky >= 0 && iy0 + ky < W.h && ix0 + kx >= 0 && ix0 + kx < W.w)
                        valid |= 1ull << (ky * KS + kx);
            const long base = (long)c * W.h * W.w + (long)iy0 * W.w + ix0;   // tap (0, 0), maybe outside
            const float *dp = W.d + (long)k * plane + p;
            for (int n = n0 + s; n < n1; n += S) {
                const float dy = dp[(long)n * W.out_stride];
                const float *xp = x + (long)n * W.in_stride + base;
#pragma unroll
                for (int ky = 0; ky < KS; ++ky)
#pragma unroll
                    for (int kx = 0; kx < KS; ++kx)
                        if (valid >> (ky * KS + kx) & 1ull)
                            acc[ky * KS + kx] = fmaf(dy, __ldg(xp + ky * W.w + kx), acc[ky * KS + kx]);
                acc[T] += dy;
            }
        }
    }
    block_sums<T + 1>(acc, red, res);
}

// Write item's sums (T taps + the bias), or, when its terms are split, its chunk's partial sums, and
// the last chunk to finish adds them all in chunk order.
__device__ void conv_weight_finish(const WLayer &W, long item, int chunk, int T, const float *res, int *last) {
    const int k = (int)(item / W.c), c = (int)(item - (long)k * W.c);
    const bool bias = c == 0 && W.gb != nullptr;
    if (W.chunks == 1) {
        for (int i = threadIdx.x; i < T; i += blockDim.x) W.gw[item * T + i] = res[i];
        if (bias && threadIdx.x == 0) W.gb[k] = res[T];
        return;
    }
    float *mine = W.partial + (item * W.chunks + chunk) * (T + 1);
    for (int i = threadIdx.x; i <= T; i += blockDim.x) mine[i] = res[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(W.ticket + item, 1) == W.chunks - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const float *all = W.partial + item * W.chunks * (T + 1);
    for (int i = threadIdx.x; i <= T; i += blockDim.x) {
        float s = 0.0f;
        for (int ch = 0; ch < W.chunks; ++ch) s += __ldcg(all + (long)ch * (T + 1) + i);
        if (i < T) W.gw[item * T + i] = s;
        else if (bias) W.gb[k] = s;
    }
}

// A linear layer's tile `r` of the weight gradient dW[o, i] = sum_n d[n, o] x[n, i]: 32 outputs x 64
// inputs, the batch in steps of 32 images through shared memory (sm: 32 * 32 + 32 * 64 floats), a thread
// 2 outputs x 4 inputs; the tiles of the first column also sum the bias, sum_n d[n, o], in image order.
__device__ void linear_weight_grad(const WLayer &W, int batch, const float *x, long r, float *sm) {
    const int tiles_i = (W.c + 63) / 64;
    const int o0 = (int)(r / tiles_i) * 32, i0 = (int)(r % tiles_i) * 64;
    float *sd = sm, *sx = sm + 32 * 32;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    float bias[2] = {0.0f, 0.0f};                  // tiles of the first column, lanes tx == 0: sum_n d[n, o]
    const bool sums_bias = i0 == 0 && W.gb != nullptr && tx == 0;
    for (int n0 = 0; n0 < batch; n0 += 32) {
        for (int e = threadIdx.x; e < 32 * 32; e += blockDim.x) {
            const int n = n0 + e / 32, o = o0 + e % 32;
            sd[e] = n < batch && o < W.k ? W.d[(long)n * W.out_stride + o] : 0.0f;
        }
        for (int e = threadIdx.x; e < 32 * 64; e += blockDim.x) {
            const int n = n0 + e / 64, i = i0 + e % 64;
            sx[e] = n < batch && i < W.c ? x[(long)n * W.in_stride + i] : 0.0f;
        }
        __syncthreads();
        const int steps = batch - n0 < 32 ? batch - n0 : 32;
        for (int j = 0; j < steps; ++j) {
            const float d0 = sd[j * 32 + 2 * ty], d1 = sd[j * 32 + 2 * ty + 1];
            const float4 v = *reinterpret_cast<const float4 *>(sx + j * 64 + 4 * tx);
            acc[0][0] = fmaf(d0, v.x, acc[0][0]);
            acc[0][1] = fmaf(d0, v.y, acc[0][1]);
            acc[0][2] = fmaf(d0, v.z, acc[0][2]);
            acc[0][3] = fmaf(d0, v.w, acc[0][3]);
            acc[1][0] = fmaf(d1, v.x, acc[1][0]);
            acc[1][1] = fmaf(d1, v.y, acc[1][1]);
            acc[1][2] = fmaf(d1, v.z, acc[1][2]);
            acc[1][3] = fmaf(d1, v.w, acc[1][3]);
            if (sums_bias) {
                bias[0] += d0;
                bias[1] += d1;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const int o = o0 + 2 * ty + a;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = i0 + 4 * tx + q;
            if (o < W.k && i < W.c) W.gw[(long)o * W.c + i] = acc[a][q];
        }
    }
    if (sums_bias)
#pragma unroll
        for (int a = 0; a < 2; ++a)
            if (o0 + 2 * ty + a < W.k) W.gb[o0 + 2 * ty + a] = bias[a];
}

template <int KS>
__device__ void conv_weight_grad(const WLayer &W, int batch, const float *x, long r, float *sm, float *res,
                                 int *last) {
    const long item = r / W.chunks;
    const int chunk = (int)(r - item * W.chunks);
    conv_weight_sums<KS>(W, batch, x, item, chunk, sm, res);
    conv_weight_finish(W, item, chunk, KS * KS, res, last);
}

__device__ void weight_block(const WArgs &a, const float *x, long b, float *sm, float *res, int *lastp,
                             WLayer *layer) {
    int &last = *lastp;
    if (b == 0) {      // the batch's mean loss, as loss.cu's mean_kernel (one block of kLossThreads)
        float s = 0.0f;
        for (int i = threadIdx.x; i < a.batch; i += kLossThreads) s += a.row_loss[i];
        sm[threadIdx.x] = s;
        __syncthreads();
        for (int half = kLossThreads / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) sm[threadIdx.x] += sm[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) *a.loss = sm[0] / (float)a.batch;
        return;
    }
    int li = 0;
    while (li + 1 < a.num && b >= a.L[li + 1].first) ++li;
    if (threadIdx.x == 0) *layer = a.L[li];      // the layer's fields from shared memory from here on
    __syncthreads();
    const WLayer &W = *layer;
    const long r = b - W.first;
    const float *in = W.x != nullptr ? W.x : x;
    if (W.op == CYDNN_NET_LINEAR) {
        linear_weight_grad(W, a.batch, in, r, sm);
        return;
    }
    switch (W.kh) {
        case 1: conv_weight_grad<1>(W, a.batch, in, r, sm, res, &last); break;
        case 2: conv_weight_grad<2>(W, a.batch, in, r, sm, res, &last); break;
        case 3: conv_weight_grad<3>(W, a.batch, in, r, sm, res, &last); break;
        case 4: conv_weight_grad<4>(W, a.batch, in, r, sm, res, &last); break;
        case 5: conv_weight_grad<5>(W, a.batch, in, r, sm, res, &last); break;
        default: conv_weight_grad<7>(W, a.batch, in, r, sm, res, &last); break;
    }
}

// Each block takes the work blocks b = blockIdx.x, + gridDim.x, ... of the `total` (a grid of a few blocks per
// SM: a work block is small, and a launched block's start costs more than its work).
__global__ void __launch_bounds__(kWThreads)
    fused_weight_kernel(const __grid_constant__ WArgs a, const float *x, long total) {
    __shared__ __align__(16) float sm[32 * 32 + 32 * 64];
    __shared__ float res[kMaxTaps + 1];
    __shared__ int last;
    __shared__ WLayer layer;
    if (a.clock != nullptr && blockIdx.x == 0 && threadIdx.x == 0) a.clock[kWeightStart] = now();
    for (long b = blockIdx.x; b < total; b += gridDim.x) {
        weight_block(a, x, b, sm, res, &last, &layer);
        __syncthreads();
    }
    tick_last(a.clock, kWeightEnd);
}

static_assert(kWThreads == kLossThreads, "block 0 of the weight kernel runs loss.cu's tree");
static_assert((kWThreads / 32) * (kMaxTaps + 1) <= 32 * 32 + 32 * 64, "the tap sums' reduction fits in sm");

}  // namespace

// ------------------------------------------------------------ the C boundary
cydnnStatus_t cydnn_fused_train_check(const cydnnNet *net, int batch, int cluster, size_t *smem_bytes,
                                      size_t *scratch_bytes) {
    CYDNN_REQUIRE(kOp, net != nullptr && smem_bytes != nullptr && scratch_bytes != nullptr, "a pointer is NULL");
    Layout *Y = new (std::nothrow) Layout();
    if (Y == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: no host memory", kOp);
    const cydnnStatus_t st = layout(net, batch, cluster, nullptr, Y);
    if (st == CYDNN_STATUS_SUCCESS) {
        *smem_bytes = Y->smem;
        *scratch_bytes = Y->scratch;
    }
    delete Y;
    return st;
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
