// fused_train_args.cuh -- what the fused training step's two kernels are given (fused_train.cu builds it
// from the table: layout()): the train kernel's TrainArgs, the weight kernel's WArgs with one WLayer per
// layer with weights, their block sizes, and the profiling clocks both write when asked.
#pragma once

#include "common.cuh"

namespace {

constexpr int kTrainThreads = 512;     // as the forward layers' tiles assume (fused_net.cu's kNetThreads)
constexpr int kWThreads = 256;
constexpr int kLossThreads = 256;      // loss.cu's kReduceThreads (the same tree)
constexpr int kMaxTaps = 49;           // kh * kw of a convolution's weight gradient (templates below)
// Output channels a work item of a convolution's weight gradient sums for (each x read serves them all):
// two up to 5x5 kernels (2 x 26 sums a thread), one for 7x7 (49 + 1).
__host__ __device__ constexpr int conv_kb(int ks) { return ks <= 5 ? 2 : 1; }
constexpr int kMaxSums = 2 * (25 + 1);  // the most sums a work item has: conv_kb(ks) * (ks * ks + 1)
constexpr int kTermsPerBlock = 2048;   // of a convolution's weight gradient, before its terms are split
constexpr int kMaxChunks = 64;

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
// last block of the train kernel to end, the weight kernel's start (its block 0) and its last block's end,
// a spare (an even count fills its 16 bytes); then after each layer's forward, at kForward + l.
constexpr int kClocks = 4 + CYDNN_NET_MAX_LAYERS + 4 + CYDNN_NET_MAX_LAYERS;
constexpr int kTrainEnd = 4 + CYDNN_NET_MAX_LAYERS, kWeightStart = kTrainEnd + 1, kWeightEnd = kTrainEnd + 2;
constexpr int kForward = kTrainEnd + 4;

__device__ __forceinline__ void tick(unsigned long long *clock, int i) {
    if (clock == nullptr || blockIdx.x != 0) return;
    __syncthreads();
    if (threadIdx.x == 0) clock[i] = cydnn::globaltimer_ns();
}

// The latest end over the blocks (slot i must hold 0 or an earlier time first).
__device__ __forceinline__ void tick_last(unsigned long long *clock, int i) {
    if (clock == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(clock + i, cydnn::globaltimer_ns());
}

// One weighted layer's share of the weight kernel.
struct WLayer {
    int layer, op, k, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw;
    int chunks;                  // convolution: blocks a work item's terms are split over
    int kb;                      // convolution: output channels a work item sums for (conv_kb)
    long first, blocks;          // the layer's blocks [first, first + blocks)
    long in_stride, out_stride;  // floats per image of x / d
    const float *x, *d;
    float *gw, *gb;
    float *partial;              // chunks > 1: (items, chunks, kb * (taps + 1))
    int *ticket;                 // chunks > 1: (items); items: ceil(k / kb) * c
};

struct WArgs {
    int batch, num;
    const float *row_loss;
    float *loss;
    unsigned long long *clock;   // profiling, as TrainArgs's
    WLayer L[CYDNN_NET_MAX_LAYERS];
};


}  // namespace
