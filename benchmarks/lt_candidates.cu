// benchmarks/lt_candidates.cu -- cublasSgemm's choice against each of cuBLASLt's heuristic candidates (up to
// 64, timed as back-to-back calls between two events), for the products of the zoo's linear layers: forward,
// input gradient and weight gradient, fp32 without TF32, at batch 64, 256 and 32, first with the candidates
// that assume 256-byte pointers, then with those that take any float pointer (what cpp/linear.cu asks for).
// Standalone (no cydnn): on the GPU machine, with the NVIDIA wheels' cuBLAS
//     NV=$(python3 -c "import nvidia,os;print([p for p in nvidia.__path__ if os.path.isdir(p+'/cu13')][0])")/cu13
//     nvcc -std=c++20 -O2 -arch=sm_90 -I$NV/include -o /tmp/lt benchmarks/lt_candidates.cu -L$NV/lib \
//          -l:libcublasLt.so.13 -l:libcublas.so.13 && LD_LIBRARY_PATH=$NV/lib /tmp/lt
#include <cstdio>
#include <vector>
#include <cublas_v2.h>
#include <cublasLt.h>
#include "lt_bench.cuh"
#define CK(x) do { auto e_ = (x); if ((int)e_ != 0) { printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)e_); return; } } while (0)


static uint32_t g_align = 256;
static void run(cublasHandle_t h, cublasLtHandle_t lt, cudaStream_t s, G g, float* A, float* B, float* C, void* ws, size_t wsb) {
    const float one = 1.f, zero = 0.f;
    float t0 = timeit(s, 200, [&] { cublasSgemm(h, g.ta, g.tb, g.m, g.n, g.k, &one, A, g.lda, B, g.ldb, &zero, C, g.ldc); });
    cublasLtMatmulDesc_t op; CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof(g.ta)));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof(g.tb)));
    int ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
    int br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
    cublasLtMatrixLayout_t la, lb, lc;
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, ar, ac, g.lda));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, br, bc, g.ldb));
    CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, g.m, g.n, g.ldc));
    cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    for (auto a : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                   CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        CK(cublasLtMatmulPreferenceSetAttribute(pref, a, &g_align, sizeof(g_align)));
    cublasLtMatmulHeuristicResult_t res[64]; int found = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 64, res, &found));
    float best = 1e9; int bi = -1;
    std::vector<float> ts;
    for (int i = 0; i < found; i++) {
        float t = timeit(s, 200, [&] { cublasLtMatmul(lt, op, &one, A, la, B, lb, &zero, C, lc, C, lc, &res[i].algo, ws, wsb, s); });
        if (cudaGetLastError() != cudaSuccess) continue;
        ts.push_back(t);
        if (t < best) { best = t; bi = i; }
    }
    printf("%-28s m=%5d n=%5d k=%5d  sgemm %6.2f us | Lt heuristic#0 %6.2f | best of %2d: %6.2f (#%d, ws %zu)\n", g.name, g.m, g.n, g.k, t0,
           ts.empty() ? -1.f : ts[0], found, best, bi, bi >= 0 ? res[bi].workspaceSize : 0);
}

static void layer(cublasHandle_t h, cublasLtHandle_t lt, cudaStream_t s, const char* net, int in, int out, int n, bool dx,
                  float* A, float* B, float* C, void* ws, size_t wsb) {
    char nm[3][64];
    snprintf(nm[0], 64, "%s %d->%d fwd", net, in, out);
    snprintf(nm[1], 64, "%s %d->%d dx", net, in, out);
    snprintf(nm[2], 64, "%s %d->%d dw", net, in, out);
    run(h, lt, s, {nm[0], CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, in, in, out}, A, B, C, ws, wsb);
    if (dx) run(h, lt, s, {nm[1], CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, in, out, in}, A, B, C, ws, wsb);
    run(h, lt, s, {nm[2], CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, in, out, in}, A, B, C, ws, wsb);
}

int main() {
    cublasHandle_t h; cublasCreate(&h);
    cublasLtHandle_t lt; cublasLtCreate(&lt);
    cudaStream_t s; cudaStreamCreate(&s); cublasSetStream(h, s);
    size_t wsb = 32 << 20; void* ws; cudaMalloc(&ws, wsb); cublasSetWorkspace(h, ws, wsb);
    float *A, *B, *C; cudaMalloc(&A, 64 << 20); cudaMalloc(&B, 64 << 20); cudaMalloc(&C, 64 << 20);
    cudaMemset(A, 0, 64 << 20); cudaMemset(B, 0, 64 << 20);
    for (uint32_t al : {256u, 4u}) { g_align = al; printf("=== alignment %u\n", al);
    for (int n : {64, 256, 32}) {
        printf("--- batch %d\n", n);
        layer(h, lt, s, "mlp", 784, 1024, n, false, A, B, C, ws, wsb);
        layer(h, lt, s, "mlp", 1024, 1024, n, true, A, B, C, ws, wsb);
        layer(h, lt, s, "mlp", 1024, 10, n, true, A, B, C, ws, wsb);
        layer(h, lt, s, "cnn", 1536, 128, n, true, A, B, C, ws, wsb);
        layer(h, lt, s, "lenet", 512, 512, n, true, A, B, C, ws, wsb);
    }
    }
    return 0;
}
