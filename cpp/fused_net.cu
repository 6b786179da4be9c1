// fused_net.cu -- a whole network's inference forward in one launch, for any
// layer list the compiler hands over (python/cydnn/compiler/fused_net.py).
//
// The LeNet-5 kernels (fused_lenet*.cu) are written for one shape.  This one
// reads its layers from a table (cydnnNet, passed by value as a
// __grid_constant__ parameter): convolution, linear, max/average pooling,
// global average pooling, and an "epilogue only" layer, each followed by an
// epilogue of up to three of bias / batch norm (running statistics) /
// activation.  The activations of one image stay in shared memory (two
// buffers, ping-pong) from the input to the logits.
//
// One image is the work of one thread-block *cluster* of 1-16 blocks on as many
// SMs (sm_90): every block computes a slice of each layer's outputs and
// stores each value into the shared memory of every block of the cluster
// (distributed shared memory), so that after one cluster barrier every block
// holds the whole activation for the next layer.  Few images: a cluster of 8-16
// per image cuts the latency of a one-image call; many images: clusters of 1,
// one image per SM, for throughput.  The host picks (cydnn_fused_net_forward's
// `cluster`); the planner measures.
//
// Same formulas as the per-op path (conv_forward + bias + activation,
// max/avg pooling with PyTorch's rules, batch norm in eval mode); only the
// summation order differs.
#include <atomic>

#include "common.cuh"
#include "fused_net_conv.cuh"   // the epilogue, distributed stores, work shares and the convolutions

namespace {

constexpr int kNetThreads = 512;
constexpr const char *kOp = "fused_net_forward";

// Thread-block clusters and distributed shared memory are sm_90's: for older targets the kernel
// is an empty body the host never launches (cydnn_fused_net_forward refuses those devices first).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CYDNN_FUSED_NET_CLUSTERS 1

// Linear: a warp takes ROWS output features at once, the lanes split the inputs (coalesced rows
// of the weight, float4 where every row starts on 16 bytes), a warp reduction per row: many
// loads in flight, which a one-image forward needs (it reads each weight once: latency-bound).
constexpr int ROWS = 4;

__device__ void linear_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                             int rank, int ranks) {
    const int IN = L.c, OUT = L.k;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    long lo, hi;
    share(OUT, rank, ranks, lo, hi);
    const bool vec = IN % 4 == 0 && (reinterpret_cast<uintptr_t>(L.weight) & 15) == 0;
    for (long o0 = lo + (long)warp * ROWS; o0 < hi; o0 += (long)warps * ROWS) {
        float acc[ROWS];
        const float *wr[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = 0.0f;
            wr[r] = L.weight + (o0 + r < hi ? o0 + r : o0) * IN;      // a row past the share: read, not stored
        }
        if (vec) {
            const float4 *x4 = reinterpret_cast<const float4 *>(in);
#pragma unroll 2
            for (int i = lane; i < IN / 4; i += 32) {
                const float4 x = x4[i];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const float4 w = __ldg(reinterpret_cast<const float4 *>(wr[r]) + i);
                    acc[r] = fmaf(w.x, x.x, fmaf(w.y, x.y, fmaf(w.z, x.z, fmaf(w.w, x.w, acc[r]))));
                }
            }
        } else {
#pragma unroll 4
            for (int i = lane; i < IN; i += 32) {
                const float x = in[i];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(__ldg(wr[r] + i), x, acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
            const long o = o0 + r;
            if (o < hi && lane < ranks) cluster.map_shared_rank(next, lane)[o] = epilogue(L, acc[r], (int)o);
        }
    }
}

// Max or average pooling with PyTorch's rules: max ignores padding and NaN
// (strictly greater wins, from -inf); average divides by kh*kw, padding
// counted as zeros (count_include_pad).  Global average pooling is the
// average over the whole plane.
__device__ void pool_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                           int rank, int ranks, bool is_max) {
    const int H = L.h, W = L.w, OH = L.oh, OW = L.ow;
    long lo, hi;
    share((long)L.c * OH * OW, rank, ranks, lo, hi);
    for (long o = lo + threadIdx.x; o < hi; o += blockDim.x) {
        const int c = (int)(o / ((long)OH * OW));
        const int rest = (int)(o - (long)c * OH * OW);
        const int oy = rest / OW, ox = rest - oy * OW;
        const float *plane = in + (long)c * H * W;
        float v = is_max ? -INFINITY : 0.0f;
        for (int ky = 0; ky < L.kh; ++ky) {
            const int iy = oy * L.sh - L.ph + ky;
            if (iy < 0 || iy >= H) continue;
            for (int kx = 0; kx < L.kw; ++kx) {
                const int ix = ox * L.sw - L.pw + kx;
                if (ix < 0 || ix >= W) continue;
                const float x = plane[(long)iy * W + ix];
                if (is_max) {
                    if (x > v) v = x;
                } else {
                    v += x;
                }
            }
        }
        if (!is_max) v /= (float)(L.kh * L.kw);
        store_all(cluster, next, ranks, o, epilogue(L, v, c));
    }
}

// Global average pooling: a warp per channel.
__device__ void gap_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                          int rank, int ranks) {
    const int HW = L.h * L.w;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    long lo, hi;
    share(L.c, rank, ranks, lo, hi);
    for (long c = lo + warp; c < hi; c += warps) {
        float acc = 0.0f;
        for (int i = lane; i < HW; i += 32) acc += in[c * HW + i];
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane < ranks) cluster.map_shared_rank(next, lane)[c] = epilogue(L, acc / (float)HW, (int)c);
    }
}

// Epilogue only (an activation or batch norm with nothing before it to ride on).
__device__ void epilogue_layer(const cydnnNetLayer &L, const float *in, float *next, cg::cluster_group &cluster,
                               int rank, int ranks) {
    const long inner = (long)L.h * L.w, total = (long)L.c * inner;
    long lo, hi;
    share(total, rank, ranks, lo, hi);
    for (long i = lo + threadIdx.x; i < hi; i += blockDim.x)
        store_all(cluster, next, ranks, i, epilogue(L, in[i], (int)(i / inner)));
}

// The image into `cur` of every block.  Each block reads only its share of the input (x may be
// mapped host memory, read over PCIe: a round trip of a microsecond or more) and stores it into
// every block of the cluster.  The reads are issued before the first cluster barrier (a block
// may write another's shared memory only once that block has started), so that their latency
// overlaps the barrier's; a thread holds up to kInRegs of them, which covers a share of
// kInRegs * kNetThreads values (16 K: any cluster size for a 3x32x32 image).  Plain loads: the
// read-only path is not for mapped memory.
constexpr int kInRegs = 8;

__device__ void load_input(const float *src, long in_size, float *cur, cg::cluster_group &cluster, int rank,
                           int ranks) {
    long lo, hi;
    share(in_size, rank, ranks, lo, hi);
    if (hi - lo <= (long)kInRegs * blockDim.x) {
        float v[kInRegs];
#pragma unroll
        for (int u = 0; u < kInRegs; ++u) {
            const long i = lo + threadIdx.x + (long)u * blockDim.x;
            v[u] = i < hi ? src[i] : 0.0f;
        }
        cluster.sync();   // every block has started: its shared memory may be written
#pragma unroll
        for (int u = 0; u < kInRegs; ++u) {
            const long i = lo + threadIdx.x + (long)u * blockDim.x;
            if (i < hi) store_all(cluster, cur, ranks, i, v[u]);
        }
    } else {
        cluster.sync();
        for (long i = lo + threadIdx.x; i < hi; i += blockDim.x) store_all(cluster, cur, ranks, i, src[i]);
    }
    cluster.sync();       // every block holds the whole image
}

#endif  // clusters

__global__ void __launch_bounds__(kNetThreads)
    fused_net_kernel(const __grid_constant__ cydnnNet net, const float *__restrict__ x, int n,
                     float *__restrict__ y, int buf_floats) {
#ifdef CYDNN_FUSED_NET_CLUSTERS
    extern __shared__ float smem[];
    __shared__ float red[32];
    cg::cluster_group cluster = cg::this_cluster();
    const int ranks = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
    const long image = blockIdx.x / ranks;
    if (image >= n) return;   // whole clusters only: every block of a cluster takes this branch alike
    float *cur = smem, *next = smem + buf_floats, *wbuf = smem + 2L * buf_floats;
    load_input(x + image * net.in_size, net.in_size, cur, cluster, rank, ranks);
    for (int l = 0; l < net.num_layers; ++l) {
        const cydnnNetLayer &L = net.layers[l];
        switch (L.op) {
            case CYDNN_NET_CONV:
                conv_dispatch(L, cur, next, cluster, rank, ranks, wbuf, net.wcap);
                break;
            case CYDNN_NET_LINEAR: linear_layer(L, cur, next, cluster, rank, ranks); break;
            case CYDNN_NET_MAX_POOL: pool_layer(L, cur, next, cluster, rank, ranks, true); break;
            case CYDNN_NET_AVG_POOL: pool_layer(L, cur, next, cluster, rank, ranks, false); break;
            case CYDNN_NET_GLOBAL_AVG_POOL: gap_layer(L, cur, next, cluster, rank, ranks); break;
            default: epilogue_layer(L, cur, next, cluster, rank, ranks); break;
        }
        cluster.sync();   // every block's slice has landed everywhere; nobody reads `cur` any more
        float *t = cur;
        cur = next;
        next = t;
    }
    if (rank != 0) return;
    const long out_size = net.out_size;
    float *dst = y + image * out_size;
    if (!net.softmax) {
        for (long i = threadIdx.x; i < out_size; i += blockDim.x) dst[i] = cur[i];
        return;
    }
    // softmax over the outputs: the maximum, then the sum of exponentials (block reductions)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    float m = -INFINITY;
    for (long i = threadIdx.x; i < out_size; i += blockDim.x) m = fmaxf(m, cur[i]);
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < warps; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    float s = 0.0f;
    for (long i = threadIdx.x; i < out_size; i += blockDim.x) s += expf(cur[i] - m);
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    s = 0.0f;
    for (int w = 0; w < warps; ++w) s += red[w];
    for (long i = threadIdx.x; i < out_size; i += blockDim.x) dst[i] = expf(cur[i] - m) / s;
#endif
}

long layer_in(const cydnnNetLayer &L) { return (long)L.c * L.h * L.w; }

long layer_out(const cydnnNetLayer &L) {
    switch (L.op) {
        case CYDNN_NET_LINEAR: return L.k;
        case CYDNN_NET_CONV: return (long)L.k * L.oh * L.ow;
        case CYDNN_NET_GLOBAL_AVG_POOL: return L.c;
        case CYDNN_NET_EPILOGUE: return layer_in(L);
        default: return (long)L.c * L.oh * L.ow;
    }
}

}  // namespace

cydnnStatus_t cydnn_fused_net_check(const cydnnNet *net, size_t *smem_bytes) {
    const char *op = kOp;
    CYDNN_REQUIRE(op, net != nullptr && smem_bytes != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, net->num_layers >= 1 && net->num_layers <= CYDNN_NET_MAX_LAYERS,
                  "num_layers must be in [1, %d], got %d", CYDNN_NET_MAX_LAYERS, net->num_layers);
    long width = net->in_size, prev = net->in_size;
    for (int l = 0; l < net->num_layers; ++l) {
        const cydnnNetLayer &L = net->layers[l];
        CYDNN_REQUIRE(op, L.op >= CYDNN_NET_CONV && L.op <= CYDNN_NET_EPILOGUE, "layer %d: unknown op %d", l, L.op);
        CYDNN_REQUIRE(op, L.c >= 1 && L.h >= 1 && L.w >= 1, "layer %d: input (%d, %d, %d) must be positive",
                      l, L.c, L.h, L.w);
        CYDNN_REQUIRE(op, layer_in(L) == prev, "layer %d takes %ld values, the layer before gives %ld",
                      l, layer_in(L), prev);
        if (L.op == CYDNN_NET_CONV || L.op == CYDNN_NET_LINEAR)
            CYDNN_REQUIRE(op, L.weight != nullptr && L.k >= 1, "layer %d: no weight or no outputs", l);
        if (L.op != CYDNN_NET_LINEAR && L.op != CYDNN_NET_GLOBAL_AVG_POOL && L.op != CYDNN_NET_EPILOGUE)
            CYDNN_REQUIRE(op, L.oh >= 1 && L.ow >= 1 && L.kh >= 1 && L.kw >= 1 && L.sh >= 1 && L.sw >= 1 &&
                              L.ph >= 0 && L.pw >= 0 && (long)(L.oh - 1) * L.sh - L.ph + L.kh <= L.h + L.ph &&
                              (long)(L.ow - 1) * L.sw - L.pw + L.kw <= L.w + L.pw,
                          "layer %d: window %dx%d stride %dx%d padding %dx%d does not give %dx%d from %dx%d",
                          l, L.kh, L.kw, L.sh, L.sw, L.ph, L.pw, L.oh, L.ow, L.h, L.w);
        CYDNN_REQUIRE(op, L.num_epi >= 0 && L.num_epi <= 3, "layer %d: %d epilogue steps", l, L.num_epi);
        for (int s = 0; s < L.num_epi; ++s)
            if (L.epi[s] == CYDNN_NET_EPI_BN)
                CYDNN_REQUIRE(op, L.bn_mean && L.bn_var && L.bn_weight && L.bn_bias,
                              "layer %d: batch norm without its arrays", l);
        prev = layer_out(L);
        if (prev > width) width = prev;
    }
    CYDNN_REQUIRE(op, prev == net->out_size, "the last layer gives %ld values, out_size is %ld", prev,
                  (long)net->out_size);
    CYDNN_REQUIRE(op, net->wcap >= 0, "wcap must be >= 0, got %ld", (long)net->wcap);
    width = (width + 3) / 4 * 4;          // the weight area after the two buffers is 16-byte aligned
    *smem_bytes = sizeof(float) * (2 * (size_t)width + (size_t)net->wcap);
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_fused_net_forward(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                      int cluster) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, n >= 1, "n must be >= 1, got %d", n);
    CYDNN_REQUIRE(op, cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8 || cluster == 16,
                  "cluster must be 1, 2, 4, 8 or 16, got %d", cluster);
    size_t smem = 0;
    CYDNN_TRY(cydnn_fused_net_check(net, &smem));
    // The device's limit and the kernel's attributes, set once to the most the device allows (a
    // one-image call is ~10 us: attribute calls on every launch cost a measurable part of it).
    // Both calls are idempotent, so two threads racing here do no harm.
    static std::atomic<int> limit{0};
    if (limit.load() == 0) {
        int l = 0, major = 0;
        CYDNN_CUDA(op, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx->device));
        CYDNN_REQUIRE(op, major >= 9, "the fused network needs thread-block clusters (compute capability 9.0 or "
                      "newer), this device has %d.x", major);
        CYDNN_CUDA(op, cudaDeviceGetAttribute(&l, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device));
        CYDNN_CUDA(op, cudaFuncSetAttribute(fused_net_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            l - (int)(32 * sizeof(float))));
        // 16 blocks a cluster: beyond the portable 8 (sm_90 has it)
        CYDNN_CUDA(op, cudaFuncSetAttribute(fused_net_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        limit.store(l);
    }
    CYDNN_REQUIRE(op, smem + 32 * sizeof(float) <= (size_t)limit.load(),
                  "the activations need %zu bytes of shared memory, the device has %d per block", smem,
                  limit.load());
    CYDNN_REQUIRE(op, (long)n * cluster <= 0x7fffffffL, "n = %d images are too many for one launch", n);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(n * cluster));
    cfg.blockDim = dim3(kNetThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = ctx->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const int buf_floats = (int)((smem / sizeof(float) - net->wcap) / 2);
    CYDNN_CUDA(op, cudaLaunchKernelEx(&cfg, fused_net_kernel, *net, x, n, y, buf_floats));
    CYDNN_LAUNCH_CHECK(op, "fused_net_kernel");
    return CYDNN_STATUS_SUCCESS;
}
