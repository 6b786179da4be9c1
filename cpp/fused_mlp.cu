// fused_mlp.cu -- a chain of Linear (+ ReLU) layers in one launch.
//
// The per-layer path is one cuBLAS GEMM, one bias kernel and one ReLU kernel
// per layer, each a trip through device memory.  Here a block takes kRows
// rows of x through every layer with the activations in shared memory (two
// buffers, ping-pong), in the manner of tiny-cuda-nn's fully fused MLPs:
// one warp per output feature, the lanes split the input features (a
// coalesced row of W, read once for the block's rows), a warp reduction.
// Same formula as linear_forward + relu_forward; only the summation order
// differs.
#include "common.cuh"

namespace {

constexpr int kThreadsMlp = 1024;
constexpr int kRows = 4;

struct MlpArgs {
    const float *w[CYDNN_MLP_MAX_LAYERS];
    const float *b[CYDNN_MLP_MAX_LAYERS];
    int dims[CYDNN_MLP_MAX_LAYERS + 1];
    int layers;
    int width;  // max of dims: the stride of a row in shared memory
};

__global__ void __launch_bounds__(kThreadsMlp)
    fused_mlp_kernel(MlpArgs a, const float *__restrict__ x, int n, float *__restrict__ y) {
    extern __shared__ float buf[];  // [2][kRows][width]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int W = a.width;
    for (int first = blockIdx.x * kRows; first < n; first += gridDim.x * kRows) {
        const int rows = min(kRows, n - first);
        float *cur = buf, *next = buf + kRows * W;
        for (int idx = threadIdx.x; idx < rows * a.dims[0]; idx += blockDim.x) {
            const int r = idx / a.dims[0], i = idx - r * a.dims[0];
            cur[r * W + i] = x[(long)(first + r) * a.dims[0] + i];
        }
        __syncthreads();
        for (int l = 0; l < a.layers; ++l) {
            const int in = a.dims[l], out = a.dims[l + 1];
            const bool last = l == a.layers - 1;
            for (int o = warp; o < out; o += warps) {
                float acc[kRows];
#pragma unroll
                for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
                const float *wr = a.w[l] + (long)o * in;
                for (int i = lane; i < in; i += 32) {
                    const float wv = __ldg(wr + i);
#pragma unroll
                    for (int r = 0; r < kRows; ++r)
                        if (r < rows) acc[r] = fmaf(wv, cur[r * W + i], acc[r]);
                }
#pragma unroll
                for (int r = 0; r < kRows; ++r)
                    for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
                if (lane == 0) {
                    const float bias = a.b[l] != nullptr ? __ldg(a.b[l] + o) : 0.0f;
                    for (int r = 0; r < rows; ++r) {
                        const float v = acc[r] + bias;
                        if (last)
                            y[(long)(first + r) * out + o] = v;
                        else
                            next[r * W + o] = fmaxf(v, 0.0f);
                    }
                }
            }
            __syncthreads();
            float *t = cur;
            cur = next;
            next = t;
        }
    }
}

}  // namespace

cydnnStatus_t cydnn_fused_mlp_forward(cydnnContext *ctx, const float *x, int n, int num_layers,
                                      const int *dims, const float *const *weights,
                                      const float *const *biases, float *y) {
    const char *op = "fused_mlp_forward";
    CYDNN_REQUIRE_CTX(op, ctx);
    CYDNN_REQUIRE(op, x != nullptr && y != nullptr && dims != nullptr && weights != nullptr, "a pointer is NULL");
    CYDNN_REQUIRE(op, n >= 1, "n must be >= 1, got %d", n);
    CYDNN_REQUIRE(op, num_layers >= 1 && num_layers <= CYDNN_MLP_MAX_LAYERS,
                  "num_layers must be in [1, %d], got %d", CYDNN_MLP_MAX_LAYERS, num_layers);
    MlpArgs a{};
    a.layers = num_layers;
    a.width = 1;
    for (int i = 0; i <= num_layers; ++i) {
        CYDNN_REQUIRE(op, dims[i] >= 1 && dims[i] <= CYDNN_MLP_MAX_WIDTH,
                      "width %d of layer boundary %d is outside [1, %d]", dims[i], i, CYDNN_MLP_MAX_WIDTH);
        a.dims[i] = dims[i];
        if (dims[i] > a.width) a.width = dims[i];
    }
    for (int i = 0; i < num_layers; ++i) {
        CYDNN_REQUIRE(op, weights[i] != nullptr, "weight %d is NULL", i);
        a.w[i] = weights[i];
        a.b[i] = biases != nullptr ? biases[i] : nullptr;
    }
    const size_t smem = sizeof(float) * 2 * kRows * (size_t)a.width;
    CYDNN_CUDA(op, cudaFuncSetAttribute(fused_mlp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const long want = (n + kRows - 1) / kRows;
    const int blocks = (int)(want < 4L * sms ? want : 4L * sms);
    fused_mlp_kernel<<<blocks, kThreadsMlp, smem, ctx->stream>>>(a, x, n, y);
    CYDNN_LAUNCH_CHECK(op, "fused_mlp_kernel");
    return CYDNN_STATUS_SUCCESS;
}
