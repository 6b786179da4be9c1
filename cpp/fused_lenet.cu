// fused_lenet.cu -- LeNet-5 in a few kernels: the fast path's compute.
//
// The reference path runs LeNet-5 as ~12 ops (cuDNN convolution, bias, ReLU,
// pooling, cuBLAS GEMMs, the loss), each a launch or two, each its own pass
// over memory.  Here one thread block takes G images (G <= kGMax) through the
// whole network with every activation in shared memory:
//
//   load (gather, shift, pad, normalise) -> conv1+bias+act -> pool1 -> conv2+bias+act
//   -> pool2 -> fc1+act -> fc2+act -> fc3 -> softmax (inference) or loss (training)
//
// and, for training, back again: each block writes the gradient of its own
// images into its slice of a "partial" buffer (no atomics), then
// update_kernel sums the slices in a fixed order and applies the optimizer to
// every parameter in one launch, and counters_kernel does the bookkeeping.
// The formulas are the reference ops' (cydnn.h); only the order of the
// floating-point sums differs, which the tests bound.
//
// Per block, smem holds, per image, in floats (modern / classic):
//   x 784/1024, a1 3456/4704, p1 864/1176, a2 1024/1600, p2 256/400, h1 120,
//   h2 84, z 32 (forward), then dp1, dp2, dh1, dh2, dz and the max-pool
//   argmax bytes (training).  Backward overwrites a1/a2 with their gradients.
//
// This file: inference.  forward_kernel: G images a block; cluster_forward_kernel, for a few images (n <=
// cluster_max(): 4 modern, 16 classic, on sm_90): one image on a cluster of four blocks that split every layer
// (fused_lenet_cluster.cuh), the one-image predict's latency.  The training step's kernels are in
// fused_lenet_train.cu; what both use is in fused_lenet.cuh and fused_lenet_layers.cuh.
#include <cstdio>

#include "cluster_launch.cuh"
#include "fused_lenet_cluster.cuh"
#include "fused_lenet_layers.cuh"

namespace {

// The inference forward: LAT (one image, latency) spreads the convolutions
// over more, shorter work items; otherwise each item does more multiply-adds
// per load (throughput).
template <bool CL, bool LAT>
__device__ void forward_infer(float *sm, int S, int G, const float *const *w, const float *cw, int nc) {
    using N = Net<CL>;
    conv_pool_forward<1, N::IN, K1, LAT ? 1 : 3, N::ACT, N::MAXPOOL>(sm + N::I_X, sm + N::I_P1, S, G, cw, cw + 150);
    __syncthreads();
    conv_pool_forward<K1, N::P1, K2, LAT ? 1 : 2, N::ACT, N::MAXPOOL>(sm + N::I_P1, sm + N::I_P2, S, G, cw + 156,
                                                                   cw + 2556);
    __syncthreads();
    fc_forward<N::FLAT, N::ACT>(sm + N::I_P2, sm + N::I_H1, S, G, w[4], w[5], F1);
    __syncthreads();
    fc_forward<F1, N::ACT>(sm + N::I_H1, sm + N::I_H2, S, G, w[6], w[7], F2);
    __syncthreads();
    fc_forward<F2, kNone>(sm + N::I_H2, sm + N::I_Z, S, G, w[8], w[9], nc);
    __syncthreads();
}

// One warp: an image's nc logits z -> its row o of the output, probabilities (as the reference softmax:
// exp(x - max) / sum) or the logits themselves.
__device__ __forceinline__ void write_output(const float *z, float *o, int nc, int softmax, int lane) {
    const float v = lane < nc ? z[lane] : -INFINITY;
    if (softmax) {
        const float m = warp_max(v);
        const float e = lane < nc ? expf(v - m) : 0.0f;
        const float s = warp_sum(e);
        if (lane < nc) o[lane] = e / s;
    } else if (lane < nc) {
        o[lane] = v;
    }
}

template <bool CL, bool LAT>
__global__ void __launch_bounds__(kMaxThreads)
    forward_kernel(cydnnLeNetWeights w, const void *images, int kind, int n, const int *n_dev,
                   float mean, float std, int nc, int softmax, float *out, int G) {
    using N = Net<CL>;
    extern __shared__ float smem[];
    float *cw = smem, *sm = smem + kConvW;
    if (n_dev != nullptr) n = min(n, *n_dev);
    const int S = N::INFER_SLOT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_conv_weights(w.p, cw);
    for (int first = blockIdx.x * G; first < n; first += gridDim.x * G) {
        const int Gb = min(G, n - first);
        load_raw<CL>(images, kind, first, Gb, S, mean, std, sm);
        __syncthreads();
        forward_infer<CL, LAT>(sm, S, Gb, w.p, cw, nc);
        if (warp < Gb) write_output(sm + warp * S + N::I_Z, out + (long)(first + warp) * nc, nc, softmax, lane);
        __syncthreads();
    }
}

// A few images (n <= cluster_max(CL)): one image per cluster of kClusterBlocks blocks, every layer split between
// them (fused_lenet_cluster.cuh).  Thread-block clusters are sm_90's: for older targets the body is empty and the
// host never launches it (clusters_available).
template <bool CL, int CS, int T>
__global__ void __launch_bounds__(T)
    cluster_forward_kernel(cydnnLeNetWeights w, const void *images, int kind, int n, const int *n_dev, float mean,
                           float std, int nc, int softmax, float *out) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    using N = Net<CL>;
    constexpr int POOL1 = K1 * N::P1 * N::P1;
    constexpr int S1 = conv_split(POOL1, KS, CS, T), S2 = conv_split(N::FLAT, K1 * KS, CS, T);
    constexpr int L1 = fc_lanes((F1 + CS - 1) / CS, T), L2 = fc_lanes((F2 + CS - 1) / CS, T);
    __shared__ __align__(16) float x[N::IN * N::IN], cw[kConvW];
    __shared__ float p1[POOL1], p2[N::FLAT], h1[F1], h2[F2], z[ZPAD];
    lcg::cluster_group cluster = lcg::this_cluster();
    const int rank = (int)cluster.block_rank(), image = blockIdx.x / CS;
    if (n_dev != nullptr) n = min(n, *n_dev);
    if (image >= n) return;           // whole clusters: every block of a cluster takes this branch alike
    cluster.barrier_arrive();         // waited for before the first DSMEM store
    load_raw<CL>(images, kind, image, 1, 0, mean, std, x);
    load_conv_weights(w.p, cw);
    __syncthreads();
    cluster.barrier_wait();           // every block of the cluster runs: its shared memory exists
    cluster_conv_pool<1, N::IN, K1, S1, CS, T, N::ACT, N::MAXPOOL>(x, cw, cw + 150, p1, rank);
    cluster.sync();
    cluster_conv_pool<K1, N::P1, K2, S2, CS, T, N::ACT, N::MAXPOOL>(p1, cw + 156, cw + 2556, p2, rank);
    cluster.sync();
    cluster_fc<N::FLAT, L1, CS, T, N::ACT>(p2, w.p[4], w.p[5], h1, F1, rank, -1);
    cluster.sync();
    cluster_fc<F1, L2, CS, T, N::ACT>(h1, w.p[6], w.p[7], h2, F2, rank, 0);
    cluster.sync();                   // after it nothing reads or writes another block's shared memory
    if (rank != 0) return;
    cluster_fc<F2, 32, 1, T, kNone>(h2, w.p[8], w.p[9], z, nc, 0, 0);
    __syncthreads();
    if (threadIdx.x < 32) write_output(z, out + (long)image * nc, nc, softmax, threadIdx.x);
#endif
}

// Whether this device has thread-block clusters (compute capability 9.0 or newer), asked once.
bool clusters_available() {
    static const bool yes = [] {
        int dev = 0, major = 0;
        return cudaGetDevice(&dev) == cudaSuccess &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
    }();
    return yes;
}

// The most images the cluster kernel takes; 0 switches it off.  CYDNN_LENET_CLUSTER_MAX overrides it for
// experiments and tests.  Measured on two H100 machines (the numpy predictor's p50, both kernels in one process:
// docs/performance/zoo-session-33.md): the modern network's cluster kernel wins at 1-2 images, ties at 4 and loses
// by 1.6-3.6 us at 8-16 on one of them; the classic one's wins up to 16 (by 3-6 us) and loses at 32.
int cluster_max(bool classic) {
    const char *v = getenv("CYDNN_LENET_CLUSTER_MAX");
    return v != nullptr ? atoi(v) : classic ? 16 : 4;
}

template <bool CL>
cydnnStatus_t launch_forward(cydnnContext *ctx, int nc, const cydnnLeNetWeights *w,
                             const void *images, int kind, int n, const int *n_dev, float mean,
                             float std, int softmax, float *out) {
    const char *op = "lenet_forward";
    if (n <= cluster_max(CL) && clusters_available()) {
        int cs = kClusterBlocks, t = kClusterThreads;
        // Experiments: CYDNN_LENET_CLUSTER=4x1024 or 8x512 (blocks x threads).  Measured on an H100 with 8x256 and
        // 2x1024 as well (docs/performance/zoo-session-33.md): none beat 4x512 on the numpy predictor's p50.
        if (const char *v = getenv("CYDNN_LENET_CLUSTER")) sscanf(v, "%dx%d", &cs, &t);
        cudaLaunchAttribute attr[1];
        const cudaLaunchConfig_t cfg = cydnn::cluster_config(dim3((unsigned)(n * cs)), (unsigned)t, 0, ctx->stream,
                                                             cs, attr);
#define CYDNN_CLUSTER_VARIANT(CS_, T_)                                                                         \
    if (cs == CS_ && t == T_) {                                                                                 \
        CYDNN_CUDA(op, cudaLaunchKernelEx(&cfg, cluster_forward_kernel<CL, CS_, T_>, *w, images, kind, n, n_dev, \
                                          mean, std, nc, softmax, out));                                        \
        CYDNN_LAUNCH_CHECK(op, "cluster_forward_kernel");                                                       \
        return CYDNN_STATUS_SUCCESS;                                                                            \
    }
        CYDNN_CLUSTER_VARIANT(4, 512)
        CYDNN_CLUSTER_VARIANT(4, 1024)
        CYDNN_CLUSTER_VARIANT(8, 512)
#undef CYDNN_CLUSTER_VARIANT
        return cydnn::fail(CYDNN_STATUS_INVALID_ARGUMENT, 0, "%s: CYDNN_LENET_CLUSTER: no cluster kernel %dx%d", op,
                           cs, t);
    }
    const bool lat = n < 2 * sm_count();   // fewer images than the GPU has room for: one per block
    const int G = lat ? 1 : kGMax;
    const size_t smem = sizeof(float) * ((size_t)G * Net<CL>::INFER_SLOT + kConvW);
    const long want = (n + G - 1) / G;
    const long cap = 4L * sm_count();
    const int blocks = (int)(want < cap ? want : cap);
    if (lat) {
        CYDNN_TRY(allow_smem(forward_kernel<CL, true>, smem, op));
        forward_kernel<CL, true><<<blocks, threads_for("CYDNN_FWD1_THREADS", 1024), smem, ctx->stream>>>(
            *w, images, kind, n, n_dev, mean, std, nc, softmax, out, G);
    } else {
        CYDNN_TRY(allow_smem(forward_kernel<CL, false>, smem, op));
        forward_kernel<CL, false><<<blocks, threads_for("CYDNN_FWD_THREADS", 512), smem, ctx->stream>>>(
            *w, images, kind, n, n_dev, mean, std, nc, softmax, out, G);
    }
    CYDNN_LAUNCH_CHECK(op, "forward_kernel");
    return CYDNN_STATUS_SUCCESS;
}


}  // namespace

// ------------------------------------------------------------ the C boundary
long cydnn_lenet_param_size(int classic, int num_classes, int i) {
    return param_size(classic != 0, num_classes, i);
}

cydnnStatus_t cydnn_lenet_forward(cydnnContext *ctx, int classic, int num_classes,
                                  const cydnnLeNetWeights *w, const void *images, int input_kind,
                                  int n, const int *n_dev, float mean, float std, int softmax,
                                  float *out) {
    const char *op = "lenet_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, w != nullptr && images != nullptr && out != nullptr, "a pointer is NULL");
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i)
        CYDNN_REQUIRE(op, w->p[i] != nullptr, "weight %d is NULL", i);
    CYDNN_REQUIRE(op, n >= 1, "n must be >= 1, got %d", n);
    CYDNN_REQUIRE(op, num_classes >= 1 && num_classes <= CYDNN_LENET_MAX_CLASSES,
                  "num_classes must be in [1, %d], got %d", CYDNN_LENET_MAX_CLASSES, num_classes);
    CYDNN_REQUIRE(op, input_kind == CYDNN_INPUT_U8 || input_kind == CYDNN_INPUT_F32 ||
                          input_kind == CYDNN_INPUT_F32_FULL,
                  "unknown input kind %d", input_kind);
    return classic ? launch_forward<true>(ctx, num_classes, w, images, input_kind, n, n_dev, mean, std,
                                          softmax, out)
                   : launch_forward<false>(ctx, num_classes, w, images, input_kind, n, n_dev, mean, std,
                                           softmax, out);
}
