/* mapped_wait.h -- waiting for a small kernel's outputs in mapped pinned memory instead of for its stream.
 *
 * A numpy call of a few images (the fused network's run_mapped, the LeNet-5 predictor's small path) has its kernel
 * write the outputs into pinned host memory mapped into the device's address space.  The host sets every output
 * word to CYDNN_MAPPED_PENDING before the launch -- a NaN payload no kernel computes (the GPU's arithmetic gives the
 * canonical NaN) -- and spins until each one was overwritten: each is written once, at its image's end, after that
 * image's reads of the input.  Past limit_ns it gives up, and the caller synchronises the stream instead, which is
 * also where a kernel's error is raised.  On the H100 the spin returned 1.2-2.8 us sooner than
 * cudaStreamSynchronize (docs/performance.md, session 29).  Host code only: included by fastpath.cu and, through
 * Cython, by python/cydnn/_fused_net.pxi.
 */
#pragma once

#include <stddef.h>
#include <time.h>

#define CYDNN_MAPPED_PENDING 0x7FBADBADu
#define CYDNN_MAPPED_SPIN_NS 2000000LL

/* Set the n 32-bit words at p to CYDNN_MAPPED_PENDING. */
static inline void cydnn_mapped_clear(void *p, size_t n) {
    unsigned int *w = (unsigned int *)p;
    for (size_t i = 0; i < n; ++i) w[i] = CYDNN_MAPPED_PENDING;
}

/* 1 when none of the n words at p holds CYDNN_MAPPED_PENDING any more, 0 when limit_ns passed first. */
static inline int cydnn_mapped_written(const void *p, size_t n, long long limit_ns) {
    const volatile unsigned int *w = (const volatile unsigned int *)p;
    struct timespec t0, t;
    size_t i = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        while (i < n && w[i] != CYDNN_MAPPED_PENDING) ++i;   /* a word once written stays written */
        if (i == n) {
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            return 1;
        }
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((long long)(t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) > limit_ns) return 0;
    }
}
