/* Runtime ISA dispatch for the CPU kernels (included by _kernels.pyx through `cdef extern`).
 *
 * The extension is compiled for the baseline x86-64 ISA; the hot loops of _kernels_direct.h and
 * _kernels_pool.h also have AVX2 + FMA versions (functions with __attribute__((target("avx2,fma"))))
 * chosen at run time:
 *
 *     level 0  baseline: plain C loops (what the compiler makes of them for SSE2)
 *     level 1  AVX2 + FMA: 8-wide float32 intrinsics
 *
 * cy_isa() is the level in use: the highest the CPU supports (__builtin_cpu_supports), unless
 * cy_isa_set() asked for a lower one (the tests force the baseline; Python: _kernels.set_isa,
 * $CYDNN_CPU_ISA).  Only float32 has SIMD versions; float64 always takes the plain loops.
 * The FMA versions round a*b + c once where the plain loops round twice: results differ from
 * the numpy twin within float32 rounding, and the tests compare with tolerances.
 */
#ifndef CYDNN_KERNELS_ISA_H
#define CYDNN_KERNELS_ISA_H

#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CY_X86 1
#else
#define CY_X86 0
#endif

#define CY_AVX2 __attribute__((target("avx2,fma")))

static int cy_isa_max_level = -1;  /* what the CPU supports, found once */
static int cy_isa_level = -1;      /* what the kernels use */

static int cy_isa_detect(void)
{
#if CY_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

/* The level in use (0 baseline, 1 AVX2+FMA). */
static int cy_isa(void)
{
    if (cy_isa_level < 0) {
        cy_isa_max_level = cy_isa_detect();
        cy_isa_level = cy_isa_max_level;
    }
    return cy_isa_level;
}

/* The highest level the CPU supports. */
static int cy_isa_max(void)
{
    cy_isa();
    return cy_isa_max_level;
}

/* Use `level` (clamped to [0, cy_isa_max()]) from now on; returns the level set. */
static int cy_isa_set(int level)
{
    int top = cy_isa_max();
    if (level < 0)
        level = 0;
    if (level > top)
        level = top;
    cy_isa_level = level;
    return level;
}

#if CY_X86
static const int cy_mask_lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

/* A mask with the first m (0..8) of 8 lanes on, for _mm256_maskload_ps / _mm256_maskstore_ps. */
CY_AVX2 static inline __m256i cy_mask8(int m)
{
    return _mm256_loadu_si256((const __m256i *)(cy_mask_lanes + 8 - m));
}

/* The 8 lanes of v added: ((v0+v4) + (v2+v6)) + ((v1+v5) + (v3+v7)). */
CY_AVX2 static inline float cy_hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

#endif /* CYDNN_KERNELS_ISA_H */
