// optimizer.cu -- fused parameter updates, one kernel launch per tensor.
//
// Each kernel reads a parameter, its gradient and the optimizer state once,
// updates them in registers and writes them back: one thread per element,
// grid-stride.  The formulas follow PyTorch's torch.optim.SGD / Adam / AdamW
// (single-tensor, non-foreach path).
#include <cmath>

#include "common.cuh"
#include "launch.cuh"

namespace {

// SGD, per element:
//   g = grad + weight_decay * p                  (only when weight_decay != 0)
//   if momentum != 0:
//       buf = first_step ? g : momentum * buf + (1 - dampening) * g
//       g   = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
__global__ void sgd_kernel(float *param, const float *grad, float *momentum_buf, size_t count,
                           float lr, float momentum, float dampening, float weight_decay,
                           int nesterov, int first_step) {
    cydnn::pdl_wait();
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        const float p = param[i];
        float g = grad[i];
        if (weight_decay != 0.0f) g = g + weight_decay * p;
        if (momentum != 0.0f) {
            const float buf =
                first_step ? g : momentum * momentum_buf[i] + (1.0f - dampening) * g;
            momentum_buf[i] = buf;
            g = nesterov ? g + momentum * buf : buf;
        }
        param[i] = p - lr * g;
    }
}

// Adam / AdamW, per element (step counts from 1):
//   Adam  (decoupled = 0): g = grad + weight_decay * p     (only when weight_decay != 0)
//   AdamW (decoupled = 1): p = p * decay,  decay = 1 - lr * weight_decay (from the host)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   m_hat = m / bias_correction1,  v_hat = v / bias_correction2
//   p = p - lr * m_hat / (sqrt(v_hat) + eps)
// 1 - beta1, 1 - beta2, bias_correction1 = 1 - beta1^step and bias_correction2 =
// 1 - beta2^step are computed on the host in double and rounded to float once
// (in float, 1 - 0.999f is 0.00099998713: a 1.3e-5 relative error in v).
__global__ void adam_kernel(float *param, const float *grad, float *m, float *v, size_t count,
                            float lr, float beta1, float one_minus_beta1, float beta2,
                            float one_minus_beta2, float eps, float weight_decay, int decoupled,
                            float decay, float bias_correction1, float bias_correction2) {
    cydnn::pdl_wait();
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        float p = param[i];
        float g = grad[i];
        if (decoupled)
            p = p * decay;
        else if (weight_decay != 0.0f)
            g = g + weight_decay * p;
        const float mi = beta1 * m[i] + one_minus_beta1 * g;
        const float vi = beta2 * v[i] + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        const float m_hat = mi / bias_correction1;
        const float v_hat = vi / bias_correction2;
        param[i] = p - lr * m_hat / (sqrtf(v_hat) + eps);
    }
}

}  // namespace

cydnnStatus_t cydnn_sgd_update(cydnnContext *ctx, float *param, const float *grad,
                               float *momentum_buf, size_t count, float lr, float momentum,
                               float dampening, float weight_decay, int nesterov,
                               int first_step) {
    CYDNN_REQUIRE_CTX("sgd_update", ctx);
    CYDNN_REQUIRE("sgd_update", param != nullptr, "param is NULL");
    CYDNN_REQUIRE("sgd_update", grad != nullptr, "grad is NULL");
    CYDNN_REQUIRE("sgd_update", momentum == 0.0f || momentum_buf != nullptr,
                  "momentum_buf is NULL but momentum is %g", (double)momentum);
    CYDNN_REQUIRE("sgd_update", count >= 1, "count must be >= 1");
    CYDNN_LAUNCH(sgd_kernel, cydnn::blocks_for(count), cydnn::kThreads, 0, ctx->stream,
        param, grad, momentum_buf, count, lr, momentum, dampening, weight_decay, nesterov,
        first_step);
    CYDNN_LAUNCH_CHECK("sgd_update", "sgd_kernel");
    return CYDNN_STATUS_SUCCESS;
}

cydnnStatus_t cydnn_adam_update(cydnnContext *ctx, float *param, const float *grad, float *m,
                                float *v, size_t count, float lr, double beta1, double beta2,
                                float eps, float weight_decay, int decoupled, int step) {
    CYDNN_REQUIRE_CTX("adam_update", ctx);
    CYDNN_REQUIRE("adam_update", param != nullptr, "param is NULL");
    CYDNN_REQUIRE("adam_update", grad != nullptr, "grad is NULL");
    CYDNN_REQUIRE("adam_update", m != nullptr, "m is NULL");
    CYDNN_REQUIRE("adam_update", v != nullptr, "v is NULL");
    CYDNN_REQUIRE("adam_update", count >= 1, "count must be >= 1");
    CYDNN_REQUIRE("adam_update", step >= 1, "step must be >= 1 (it counts from 1), got %d", step);

    // Host side, in double, each rounded to float once:
    //   one_minus_beta1  = (float)(1 - beta1),  one_minus_beta2 = (float)(1 - beta2)
    //   bias_correction1 = (float)(1 - beta1 ** step)
    //   bias_correction2 = (float)(1 - beta2 ** step)
    //   decay            = (float)(1 - (double)lr * (double)weight_decay)   (AdamW only)
    const float bias_correction1 = (float)(1.0 - std::pow(beta1, (double)step));
    const float bias_correction2 = (float)(1.0 - std::pow(beta2, (double)step));
    const float decay = decoupled ? (float)(1.0 - (double)lr * (double)weight_decay) : 1.0f;

    CYDNN_LAUNCH(adam_kernel, cydnn::blocks_for(count), cydnn::kThreads, 0, ctx->stream,
        param, grad, m, v, count, lr, (float)beta1, (float)(1.0 - beta1), (float)beta2,
        (float)(1.0 - beta2), eps, weight_decay, decoupled, decay, bias_correction1, bias_correction2);
    CYDNN_LAUNCH_CHECK("adam_update", "adam_kernel");
    return CYDNN_STATUS_SUCCESS;
}
