// dev_util.cuh -- what every benchmarks/dev program shares on the host: a CUDA error ends the program with status 2
// (a dev program may exit; the library never does), and a host vector copied to a new device buffer.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

static void check(cudaError_t e, const char *what, int line) {
    if (e != cudaSuccess) fprintf(stderr, "line %d: %s: %s\n", line, what, cudaGetErrorString(e)), exit(2);
}
#define CK(x) check((x), #x, __LINE__)

static float *to_device(const std::vector<float> &h) {
    float *d;
    CK(cudaMalloc(&d, h.size() * 4));
    CK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
}
