// fused_lenet.cuh -- what the fused LeNet-5 kernels share (fused_lenet.cu: inference,
// fused_lenet_train.cu: the training step): the network's shape and shared-memory layout,
// activations, warp reductions, loading the images, and the launch helpers.  The layer
// functions are in fused_lenet_layers.cuh.
#pragma once

#include <climits>
#include <cmath>
#include <cstdlib>

#include "common.cuh"
#include "warp_reduce.cuh"

namespace {

constexpr int kMaxThreads = 1024;   // the kernels take any multiple of 32 up to this
constexpr int kGMax = 4;        // images per block at most
constexpr int KS = 5, K1 = 6, K2 = 16, F1 = 120, F2 = 84, ZPAD = 32;

enum Act { kRelu = 0, kTanh = 1, kNone = 2 };

template <bool CLASSIC>
struct Net {
    static constexpr int PAD = CLASSIC ? 2 : 0;
    static constexpr int IN = 28 + 2 * PAD;       // 28 / 32
    static constexpr int C1 = IN - KS + 1;        // 24 / 28
    static constexpr int P1 = C1 / 2;             // 12 / 14
    static constexpr int C2 = P1 - KS + 1;        // 8 / 10
    static constexpr int P2 = C2 / 2;             // 4 / 5
    static constexpr int FLAT = K2 * P2 * P2;     // 256 / 400
    static constexpr int ACT = CLASSIC ? kTanh : kRelu;
    static constexpr bool MAXPOOL = !CLASSIC;
    // smem offsets (floats) inside one image's slot
    static constexpr int X = 0;
    static constexpr int A1 = X + IN * IN;
    static constexpr int PL1 = A1 + K1 * C1 * C1;
    static constexpr int A2 = PL1 + K1 * P1 * P1;
    static constexpr int PL2 = A2 + K2 * C2 * C2;
    static constexpr int H1 = PL2 + FLAT;
    static constexpr int H2 = H1 + F1;
    static constexpr int Z = H2 + F2;
    static constexpr int FWD_END = Z + ZPAD;
    static constexpr int DP1 = FWD_END;
    static constexpr int DP2 = DP1 + K1 * P1 * P1;
    static constexpr int DH1 = DP2 + FLAT;
    static constexpr int DH2 = DH1 + F1;
    static constexpr int DZ = DH2 + F2;
    static constexpr int ARG1 = DZ + ZPAD;                       // bytes start here (as floats)
    static constexpr int ARG2_BYTE = K1 * P1 * P1;               // byte offset of pool2's argmax
    static constexpr int TRAIN_END = ARG1 + (K1 * P1 * P1 + FLAT + 3) / 4;
    // slot sizes rounded to an odd multiple of... keep 4-float alignment
    static constexpr int FWD_SLOT = (FWD_END + 3) / 4 * 4;
    // inference-only slot (conv and pool fused: no a1 / a2)
    static constexpr int I_X = 0;
    static constexpr int I_P1 = I_X + IN * IN;
    static constexpr int I_P2 = I_P1 + K1 * P1 * P1;
    static constexpr int I_H1 = I_P2 + FLAT;
    static constexpr int I_H2 = I_H1 + F1;
    static constexpr int I_Z = I_H2 + F2;
    static constexpr int INFER_SLOT = (I_Z + ZPAD + 3) / 4 * 4;
    static constexpr int TRAIN_SLOT = (TRAIN_END + 3) / 4 * 4;
};

__host__ __device__ inline long param_size(bool classic, int nc, int i) {
    const long flat = classic ? 400 : 256;
    switch (i) {
        case 0: return K1 * KS * KS;
        case 1: return K1;
        case 2: return (long)K2 * K1 * KS * KS;
        case 3: return K2;
        case 4: return F1 * flat;
        case 5: return F1;
        case 6: return (long)F2 * F1;
        case 7: return F2;
        case 8: return (long)nc * F2;
        case 9: return nc;
        default: return -1;
    }
}

__host__ __device__ inline long param_total(bool classic, int nc) {
    long t = 0;
    for (int i = 0; i < CYDNN_LENET_NUM_PARAMS; ++i) t += param_size(classic, nc, i);
    return t;
}

template <int ACT>
__device__ __forceinline__ float activate(float v) {
    if (ACT == kRelu) return fmaxf(v, 0.0f);
    if (ACT == kTanh) return tanhf(v);
    return v;
}

// Derivative of the activation, from its output y (as the reference backward ops).
template <int ACT>
__device__ __forceinline__ float activate_grad(float y) {
    if (ACT == kRelu) return y > 0.0f ? 1.0f : 0.0f;
    if (ACT == kTanh) return 1.0f - y * y;
    return 1.0f;
}

using cydnn::warp_max;   // butterflies inside a warp (warp_reduce.cuh)
using cydnn::warp_sum;

// ------------------------------------------------------------ inputs
// Raw images (28x28, uint8 / 255 or float as is) -> padded, normalised x; or float images of
// the network's own input size (CYDNN_INPUT_F32_FULL) -> normalised x.
template <bool CL>
__device__ void load_raw(const void *images, int kind, int first, int G, int S, float mean,
                         float std, float *sm) {
    using N = Net<CL>;
    for (int idx = threadIdx.x; idx < G * N::IN * N::IN; idx += blockDim.x) {
        const int g = idx / (N::IN * N::IN), p = idx - g * N::IN * N::IN;
        const int iy = p / N::IN - N::PAD, ix = p % N::IN - N::PAD;
        float v = 0.0f;
        if (kind == CYDNN_INPUT_F32_FULL) {          // the network's own input size, padding included
            v = ((const float *)images)[(long)(first + g) * N::IN * N::IN + p];
        } else if (iy >= 0 && iy < 28 && ix >= 0 && ix < 28) {
            const long src = (long)(first + g) * 784 + iy * 28 + ix;
            v = kind == CYDNN_INPUT_U8 ? (float)((const uint8_t *)images)[src] / 255.0f
                                       : ((const float *)images)[src];
        }
        sm[g * S + N::X + p] = (v - mean) / std;
    }
}

// A training batch from the dataset on the device: the same pixels, shifts and
// floats as gather_batch_kernel (data.cu), so both paths see the same batch.
template <bool CL>
__device__ void load_batch(const cydnnLeNetTrainStep &a, int step, int first, int G, int S,
                           float *sm, int *labels_out) {
    using N = Net<CL>;
    const uint64_t seed = a.shift_seeds != nullptr ? a.shift_seeds[step] : 0;
    const uint64_t span = 2 * (uint64_t)a.max_shift + 1;
    const long base = (long)step * a.order_stride;
    for (int idx = threadIdx.x; idx < G * N::IN * N::IN; idx += blockDim.x) {
        const int g = idx / (N::IN * N::IN), p = idx - g * N::IN * N::IN;
        const int b = first + g;  // row in the batch
        const int index = a.order[base + b];
        const int iy = p / N::IN - N::PAD, ix = p % N::IN - N::PAD;
        float v = 0.0f;
        if (index < 0 || index >= a.n_images) {
            v = __int_as_float(0x7fc00000);
        } else if (iy >= 0 && iy < 28 && ix >= 0 && ix < 28) {
            const uint64_t r = cydnn::splitmix64(seed ^ cydnn::splitmix64((uint64_t)b));
            const int sx = (int)((r & 0xffffffffull) % span) - a.max_shift;
            const int sy = (int)((r >> 32) % span) - a.max_shift;
            const int src_y = iy - sy, src_x = ix - sx;
            if (src_y >= 0 && src_y < 28 && src_x >= 0 && src_x < 28)
                v = (float)a.images[(long)index * 784 + src_y * 28 + src_x] / 255.0f;
        }
        sm[g * S + N::X + p] = (v - a.mean) / a.std;
    }
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
        const int index = a.order[base + first + g];
        labels_out[g] = (index >= 0 && index < a.n_images) ? a.labels[index] : -1;
    }
}

// ------------------------------------------------------------ forward
// conv1's and conv2's weights and biases, copied once per block to the front
// of shared memory: cw[0:150] w1, [150:156] b1, [156:2556] w2, [2556:2572] b2.
constexpr int kConvW = 2576;   // 2572 rounded up to a multiple of 4

__device__ void load_conv_weights(const float *const *w, float *cw) {
    for (int i = threadIdx.x; i < 2572; i += blockDim.x) {
        const float *src = i < 150 ? w[0] + i : i < 156 ? w[1] + (i - 150) : i < 2556 ? w[2] + (i - 156)
                                                                                     : w[3] + (i - 2556);
        cw[i] = __ldg(src);
    }
}

template <class Kernel>
cydnnStatus_t allow_smem(Kernel kernel, size_t bytes, const char *op) {
    // Once per kernel; cheap enough to repeat (a host-side attribute).
    CYDNN_CUDA(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return CYDNN_STATUS_SUCCESS;
}

// Threads per block: a default measured on an H100, overridable (a multiple of
// 32 up to 1024) by an environment variable for experiments.
int threads_for(const char *env, int fallback) {
    const char *v = getenv(env);
    if (v == nullptr) return fallback;
    const int t = atoi(v);
    return (t >= 32 && t <= kMaxThreads && t % 32 == 0) ? t : fallback;
}

int g_sm_count = 0;

int sm_count() {
    if (g_sm_count == 0) {
        int dev = 0;
        cudaGetDevice(&dev);
        if (cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || g_sm_count < 1)
            g_sm_count = 1;
    }
    return g_sm_count;
}

}  // namespace
