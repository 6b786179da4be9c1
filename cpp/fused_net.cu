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

#include "cluster_launch.cuh"
#include "common.cuh"
#include "fused_net_layers.cuh"
#include "fused_net_table.cuh"   // the layers (fused_net_conv.cuh: the convolutions) and one image's forward

namespace {

constexpr int kNetThreads = 512;
static_assert(kNetThreads == kWsplitThreads, "tile 7 splits a block's reduction between kWsplitThreads threads");
constexpr const char *kOp = "fused_net_forward";

// Thread-block clusters and distributed shared memory are sm_90's: for older targets the kernel
// is an empty body the host never launches (cydnn_fused_net_forward refuses those devices first).

__global__ void __launch_bounds__(kNetThreads)
    fused_net_kernel(const __grid_constant__ cydnnNet net, const float *__restrict__ x, int n,
                     float *__restrict__ y, int buf_floats) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    extern __shared__ float smem[];
    __shared__ float red[32];
    cg::cluster_group cluster = cg::this_cluster();
    const int ranks = (int)cluster.num_blocks(), rank = (int)cluster.block_rank();
    const long image = blockIdx.x / ranks;
    if (image >= n) return;   // whole clusters only: every block of a cluster takes this branch alike
    forward_image(net, x + image * net.in_size, y + image * net.out_size, smem, red, buf_floats, cluster, rank,
                  ranks);
#endif
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
        CYDNN_REQUIRE(op, cydnn::net_layer_in(L) == prev,
                      "layer %d takes %ld values, the layer before gives %ld", l, cydnn::net_layer_in(L), prev);
        if (L.op == CYDNN_NET_CONV || L.op == CYDNN_NET_LINEAR)
            CYDNN_REQUIRE(op, L.weight != nullptr && L.k >= 1, "layer %d: no weight or no outputs", l);
        if (L.op != CYDNN_NET_LINEAR && L.op != CYDNN_NET_GLOBAL_AVG_POOL && L.op != CYDNN_NET_EPILOGUE)
            CYDNN_REQUIRE(op, L.oh >= 1 && L.ow >= 1 && L.kh >= 1 && L.kw >= 1 && L.sh >= 1 && L.sw >= 1 &&
                              L.ph >= 0 && L.pw >= 0 && (long)(L.oh - 1) * L.sh - L.ph + L.kh <= L.h + L.ph &&
                              (long)(L.ow - 1) * L.sw - L.pw + L.kw <= L.w + L.pw,
                          "layer %d: window %dx%d stride %dx%d padding %dx%d does not give %dx%d from %dx%d",
                          l, L.kh, L.kw, L.sh, L.sw, L.ph, L.pw, L.oh, L.ow, L.h, L.w);
        CYDNN_REQUIRE(op, L.pool == 0 || (L.op == CYDNN_NET_CONV && L.tile == 7 && L.oh >= 2 && L.ow >= 2 &&
                                           (L.pool == CYDNN_NET_MAX_POOL || L.pool == CYDNN_NET_AVG_POOL)),
                      "layer %d: pool %d: a folded pooling is CYDNN_NET_MAX_POOL or _AVG_POOL on a convolution of "
                      "tile 7 with an output plane of 2x2 or more", l, L.pool);
        if (L.op == CYDNN_NET_LINEAR) {
            CYDNN_REQUIRE(op, L.tile == 0 || (L.tile == 1 && l == net->num_layers - 1),
                          "layer %d: a linear layer's tile is 0, or 1 (a tail) on the last layer only, got %d", l,
                          L.tile);
            // a tail's partial sums (linear_tail): one row of k a block, at most 16 blocks, after its input
            if (L.tile == 1 && (long)L.c + 16L * L.k > width) width = (long)L.c + 16L * L.k;
        }
        CYDNN_REQUIRE(op, L.num_epi >= 0 && L.num_epi <= 3, "layer %d: %d epilogue steps", l, L.num_epi);
        for (int s = 0; s < L.num_epi; ++s)
            if (L.epi[s] == CYDNN_NET_EPI_BN)
                CYDNN_REQUIRE(op, L.bn_mean && L.bn_var && L.bn_weight && L.bn_bias,
                              "layer %d: batch norm without its arrays", l);
        prev = cydnn::net_layer_out(L);
        if (prev > width) width = prev;
    }
    CYDNN_REQUIRE(op, prev == net->out_size, "the last layer gives %ld values, out_size is %ld", prev,
                  (long)net->out_size);
    CYDNN_REQUIRE(op, net->wcap >= 0, "wcap must be >= 0, got %ld", (long)net->wcap);
    width = (width + 3) / 4 * 4;          // the weight area after the two buffers is 16-byte aligned
    *smem_bytes = sizeof(float) * (2 * (size_t)width + (size_t)net->wcap);
    return CYDNN_STATUS_SUCCESS;
}

// A kernel generated for one network (python/cydnn/compiler/fused_net_gen.py): NVRTC's cubin,
// loaded as a library; its one kernel has fused_net_kernel's parameters and serves one cluster size.
struct cydnnNetKernel {
    cudaLibrary_t library = nullptr;
    cudaKernel_t kernel = nullptr;
    int cluster = 0;
};

namespace {

cydnnStatus_t launch(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y, int cluster,
                     const cydnnNetKernel *k) {
    const char *op = kOp;
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, n >= 1, "n must be >= 1, got %d", n);
    CYDNN_REQUIRE(op, cydnn::cluster_size_ok(cluster), "cluster must be 1, 2, 4, 8 or 16, got %d", cluster);
    CYDNN_REQUIRE(op, k == nullptr || k->cluster == cluster,
                  "the generated kernel serves clusters of %d blocks, asked for %d", k ? k->cluster : 0, cluster);
    size_t smem = 0;
    CYDNN_TRY(cydnn_fused_net_check(net, &smem));
    // The device's limit and the kernel's attributes, set once to the most the device allows (a
    // one-image call is ~10 us: attribute calls on every launch cost a measurable part of it).
    // Both calls are idempotent, so two threads racing here do no harm.  (A generated kernel gets
    // its attributes when it is loaded.)
    static std::atomic<int> limit{0};
    CYDNN_TRY(cydnn::cluster_prepare_once(op, ctx->device, (const void *)fused_net_kernel, 32 * sizeof(float), limit));
    CYDNN_REQUIRE(op, smem + 32 * sizeof(float) <= (size_t)limit.load(),
                  "the activations need %zu bytes of shared memory, the device has %d per block", smem,
                  limit.load());
    CYDNN_REQUIRE(op, (long)n * cluster <= 0x7fffffffL, "n = %d images are too many for one launch", n);
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg =
        cydnn::cluster_config((unsigned)(n * cluster), kNetThreads, smem, ctx->stream, cluster, attr);
    int buf_floats = (int)((smem / sizeof(float) - net->wcap) / 2);
    if (k == nullptr) {
        CYDNN_CUDA(op, cudaLaunchKernelEx(&cfg, fused_net_kernel, *net, x, n, y, buf_floats));
        CYDNN_LAUNCH_CHECK(op, "fused_net_kernel");
    } else {
        void *args[] = {(void *)net, (void *)&x, (void *)&n, (void *)&y, (void *)&buf_floats};
        CYDNN_CUDA(op, cudaLaunchKernelExC(&cfg, (const void *)k->kernel, args));
        CYDNN_LAUNCH_CHECK(op, "the generated fused-network kernel");
    }
    return CYDNN_STATUS_SUCCESS;
}

}  // namespace

cydnnStatus_t cydnn_fused_net_forward(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                      int cluster) {
    return launch(ctx, net, x, n, y, cluster, nullptr);
}

cydnnStatus_t cydnn_fused_net_launch(cydnnContext *ctx, const cydnnNet *net, const float *x, int n, float *y,
                                     int cluster, const cydnnNetKernel *kernel) {
    CYDNN_REQUIRE(kOp, kernel != nullptr, "the generated kernel is NULL");
    return launch(ctx, net, x, n, y, cluster, kernel);
}

cydnnStatus_t cydnn_net_kernel_load(cydnnContext *ctx, const void *image, const char *name, int cluster,
                                    cydnnNetKernel **out) {
    const char *op = "fused_net_kernel_load";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, image != nullptr && name != nullptr && out != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, cydnn::cluster_size_ok(cluster), "cluster must be 1, 2, 4, 8 or 16, got %d", cluster);
    *out = nullptr;
    auto *k = new (std::nothrow) cydnnNetKernel();
    if (k == nullptr) return cydnn::fail(CYDNN_STATUS_OUT_OF_MEMORY, 0, "%s: no host memory", op);
    k->cluster = cluster;
    cudaError_t e = cudaLibraryLoadData(&k->library, image, nullptr, nullptr, 0, nullptr, nullptr, 0);
    const char *call = "cudaLibraryLoadData";
    if (e == cudaSuccess) {
        e = cudaLibraryGetKernel(&k->kernel, k->library, name);
        call = "cudaLibraryGetKernel";
    }
    int l = 0;
    if (e == cudaSuccess) {
        e = cudaDeviceGetAttribute(&l, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx->device);
        call = "cudaDeviceGetAttribute";
    }
    if (e == cudaSuccess) e = cydnn::cluster_attributes((const void *)k->kernel, l, 32 * sizeof(float), &call);
    if (e != cudaSuccess) {
        cydnn_net_kernel_destroy(k);
        return cydnn::cuda_failure(e, op, call);
    }
    *out = k;
    return CYDNN_STATUS_SUCCESS;
}

void cydnn_net_kernel_destroy(cydnnNetKernel *k) {
    if (k == nullptr) return;
    if (k->library != nullptr) cudaLibraryUnload(k->library);   // at exit the driver may be gone: nothing to do
    delete k;
}
