// benchmarks/lt_epilogues.cu -- whether cuBLASLt's backward epilogues take fp32 without TF32 (CUBLAS_COMPUTE_32F)
// on the zoo's linear layers, and what each costs against the plain product: the forward with RELU_AUX_BIAS (the
// ReLU's bit mask kept for backward) against RELU_BIAS; the input gradient with DRELU and DRELU_BGRAD (the ReLU's
// derivative, and the bias gradient of the layer below, in the product's epilogue) against none; the weight
// gradient with BGRADB (this layer's bias gradient) against none.  Each: the heuristic's candidate count (up to
// 16, any float pointer) and the best time of back-to-back calls between two events, µs.
// Standalone (no cydnn): on the GPU machine, with the NVIDIA wheels' cuBLAS
//     NV=$(python3 -c "import nvidia,os;print([p for p in nvidia.__path__ if os.path.isdir(p+'/cu13')][0])")/cu13
//     nvcc -std=c++20 -O2 -arch=sm_90 -I$NV/include -o /tmp/lte benchmarks/lt_epilogues.cu -L$NV/lib \
//          -l:libcublasLt.so.13 && LD_LIBRARY_PATH=$NV/lib /tmp/lte
#include <cstdio>
#include <vector>
#include <cublasLt.h>
#include "lt_bench.cuh"


// One product with epilogue epi; aux: the bit mask (ld auxld elements), bias: the bias or bias gradient vector.
static void run(cublasLtHandle_t lt, cudaStream_t s, G g, cublasLtEpilogue_t epi, const char *ename, float *A,
                float *B, float *C, void *aux, float *bias, void *ws, size_t wsb) {
    const float one = 1.f, zero = 0.f;
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    if (bias != nullptr) cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    int64_t auxld = (g.m + 127) / 128 * 128;
    if (aux != nullptr) {
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &auxld, sizeof(auxld));
    }
    int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
    int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, ar, ac, g.lda);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, br, bc, g.ldb);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, g.m, g.n, g.ldc);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    uint32_t al = 4;
    for (auto a : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                   CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        cublasLtMatmulPreferenceSetAttribute(pref, a, &al, sizeof(al));
    cublasLtMatmulHeuristicResult_t res[16];
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 16, res, &found);
    float best = -1;
    for (int i = 0; i < found; i++) {
        float t = timeit(s, 200, [&] {
            cublasLtMatmul(lt, op, &one, A, la, B, lb, &zero, C, lc, C, lc, &res[i].algo, ws, wsb, s);
        });
        if (cudaGetLastError() != cudaSuccess) continue;
        if (best < 0 || t < best) best = t;
    }
    printf("%-22s %-14s heuristic status %d, %2d candidates, best %6.2f us\n", g.name, ename, (int)hs, found, best);
}

int main() {
    cublasLtHandle_t lt;
    cublasLtCreate(&lt);
    cudaStream_t s;
    cudaStreamCreate(&s);
    size_t wsb = 8 << 20;
    void *ws;
    cudaMalloc(&ws, wsb);
    float *A, *B, *C, *bias;
    void *aux;
    cudaMalloc(&A, 64 << 20); cudaMalloc(&B, 64 << 20); cudaMalloc(&C, 64 << 20);
    cudaMalloc(&aux, 16 << 20); cudaMalloc(&bias, 1 << 20);
    cudaMemset(A, 0, 64 << 20); cudaMemset(B, 0, 64 << 20); cudaMemset(aux, 0, 16 << 20);
    const int n = 64;
    struct L { int in, out; } layers[] = {{784, 1024}, {1024, 1024}, {1024, 10}, {1536, 128}, {128, 10}};
    for (L l : layers) {
        char f[48], dx[48], dw[48];
        snprintf(f, 48, "%d->%d fwd", l.in, l.out);
        snprintf(dx, 48, "%d->%d dx", l.in, l.out);
        snprintf(dw, 48, "%d->%d dw", l.in, l.out);
        G fwd{f, CUBLAS_OP_T, CUBLAS_OP_N, l.out, n, l.in, l.in, l.in, l.out};
        G gdx{dx, CUBLAS_OP_N, CUBLAS_OP_N, l.in, n, l.out, l.in, l.out, l.in};
        G gdw{dw, CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, n, l.in, l.out, l.in};
        run(lt, s, fwd, CUBLASLT_EPILOGUE_RELU_BIAS, "RELU_BIAS", A, B, C, nullptr, bias, ws, wsb);
        run(lt, s, fwd, CUBLASLT_EPILOGUE_RELU_AUX_BIAS, "RELU_AUX_BIAS", A, B, C, aux, bias, ws, wsb);
        run(lt, s, gdx, CUBLASLT_EPILOGUE_DEFAULT, "none", A, B, C, nullptr, nullptr, ws, wsb);
        run(lt, s, gdx, CUBLASLT_EPILOGUE_DRELU, "DRELU", A, B, C, aux, nullptr, ws, wsb);
        run(lt, s, gdx, CUBLASLT_EPILOGUE_DRELU_BGRAD, "DRELU_BGRAD", A, B, C, aux, bias, ws, wsb);
        run(lt, s, gdw, CUBLASLT_EPILOGUE_DEFAULT, "none", A, B, C, nullptr, nullptr, ws, wsb);
        run(lt, s, gdw, CUBLASLT_EPILOGUE_BGRADB, "BGRADB", A, B, C, nullptr, bias, ws, wsb);
    }
    return 0;
}
