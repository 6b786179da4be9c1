// benchmarks/lt_bench.cuh -- what benchmarks/lt_candidates.cu and lt_epilogues.cu share: a timing of
// back-to-back calls between two events (5 warm-up calls first), and a product's shape as cublasSgemm takes it.
#pragma once
#include <cuda_runtime.h>
#include <cublas_v2.h>

static float timeit(cudaStream_t s, int iters, auto fn) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 5; i++) fn();
    cudaEventRecord(a, s);
    for (int i = 0; i < iters; i++) fn();
    cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    return 1000.f * ms / iters;
}

struct G { const char *name; cublasOperation_t ta, tb; int m, n, k, lda, ldb, ldc; };
