// conv_plan.cuh -- what cuDNN needs for one convolution geometry (conv.cu's ops use it):
// the descriptors, and per direction the algorithm cuDNN measured to be the fastest, cached in
// the context.  conv_plan.cu builds plans and measures algorithms; see conv.cu for the ops.
#pragma once

#include <vector>

#include "common.cuh"

namespace cydnn {
namespace conv {

// One result of cuDNN's measurement (kept for cydnn_conv_algorithms).
struct Candidate {
    int algo;
    float time_ms;     // cuDNN's measurement (one cold run)
    int status;
    size_t memory;
    float retimed_ms;  // ours (back-to-back runs, warm), for the fastest few usable; -1 where not timed
};

struct ConvPlan : cydnn::Plan {
    // What Find measured, per direction (0 forward, 1 backward data, 2 backward filter).
    std::vector<Candidate> measured[3];
    cudnnTensorDescriptor_t x_desc = nullptr;     // (n, c, h, w)
    cudnnTensorDescriptor_t y_desc = nullptr;     // (n, k, oh, ow)
    cudnnTensorDescriptor_t bias_desc = nullptr;  // (1, k, 1, 1)
    cudnnFilterDescriptor_t w_desc = nullptr;     // (k, c, kh, kw)
    cudnnConvolutionDescriptor_t conv_desc = nullptr;

    // The math type the convolution descriptor holds right now, the one to
    // measure with, and whether tensor-op results may win (allow_tf32).
    cudnnMathType_t desc_math = CUDNN_DEFAULT_MATH;
    cudnnMathType_t search_math = CUDNN_DEFAULT_MATH;
    bool allow_tf32 = false;
    bool deterministic = false;

    // One chosen algorithm per direction; *_found is false until measured.
    bool fwd_found = false;
    cudnnConvolutionFwdAlgo_t fwd_algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
    size_t fwd_workspace = 0;
    cudnnMathType_t fwd_math = CUDNN_DEFAULT_MATH;

    bool bwd_data_found = false;
    cudnnConvolutionBwdDataAlgo_t bwd_data_algo = CUDNN_CONVOLUTION_BWD_DATA_ALGO_0;
    size_t bwd_data_workspace = 0;
    cudnnMathType_t bwd_data_math = CUDNN_DEFAULT_MATH;

    bool bwd_filter_found = false;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0;
    size_t bwd_filter_workspace = 0;
    cudnnMathType_t bwd_filter_math = CUDNN_DEFAULT_MATH;

    ~ConvPlan() override {
        // Destroy failures cannot be reported from a destructor; ignore them.
        if (conv_desc) cudnnDestroyConvolutionDescriptor(conv_desc);
        if (w_desc) cudnnDestroyFilterDescriptor(w_desc);
        if (bias_desc) cudnnDestroyTensorDescriptor(bias_desc);
        if (y_desc) cudnnDestroyTensorDescriptor(y_desc);
        if (x_desc) cudnnDestroyTensorDescriptor(x_desc);
    }
};

// Refuse a geometry that cannot describe real tensors.
cydnnStatus_t check_geometry(const char *op, const cydnnConvGeometry *g);

// Set the math type on the convolution descriptor, only when it changes.
cydnnStatus_t use_math(ConvPlan *plan, cudnnMathType_t math, const char *op);

// Build the descriptors for this geometry and math setting (fp16: half tensors), or find them
// in the context's cache.  No algorithm is chosen here.
cydnnStatus_t get_plan(cydnnContext *ctx, const cydnnConvGeometry *g, const char *op, ConvPlan **out,
                       bool fp16 = false);

// Measure each direction's algorithms on the caller's buffers (the output is overwritten, then
// rewritten by the real call that follows) and keep the fastest usable one in the plan.
cydnnStatus_t find_forward(cydnnContext *ctx, ConvPlan *plan, const float *x, const float *w, float *y,
                           const char *op);
cydnnStatus_t find_backward_data(cydnnContext *ctx, ConvPlan *plan, const float *dy, const float *w,
                                 float *dx, const char *op);
cydnnStatus_t find_backward_filter(cydnnContext *ctx, ConvPlan *plan, const float *x, const float *dy,
                                   float *dw, const char *op);

}  // namespace conv
}  // namespace cydnn
