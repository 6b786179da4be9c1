/* 2 x 2 max pooling with stride 2 and no padding, float32 (LeNet's): forward and backward.
 * Included by _kernels.pyx (wrappers in _kernels_pool.pxi).  x and dx (n, c, h, w), y, arg and dy
 * (n, c, h / 2, w / 2), all C-contiguous.
 *
 * The rule of the twin (pool.max_pool_forward): scanning the window (0,0), (0,1), (1,0), (1,1) from
 * best = -inf, the last value strictly greater than best wins (so the first maximum wins ties, a
 * NaN never wins, an all -inf/NaN window gives -inf at offset 0); arg = p*2 + q.  Backward:
 * dx[2i + p, 2j + q] = dy[i, j] * (arg[i, j] == p*2 + q) (a product, as the twin: 0 * inf is NaN),
 * and 0 in the last row / column when h / w is odd.  Both bit for bit as the twin.
 *
 * AVX2 (cy_isa() >= 1): 8 windows at a time (then 4, 128 bits wide), the even and odd columns
 * of two input rows split with shuffles, compared and blended branch-free; backward multiplies
 * by the 0/1 masks and interleaves them back.  Baseline and the last 0-3 windows of a row:
 * plain loops.  Parallel over planes.
 */
#ifndef CYDNN_KERNELS_POOL_H
#define CYDNN_KERNELS_POOL_H

#include "_kernels_isa.h"

static inline void cy_max4_plain(const float *r0, const float *r1, float *y, int *arg)
{
    const float v[4] = {r0[0], r0[1], r1[0], r1[1]};
    float best = -INFINITY;
    int at = 0;
    for (int e = 0; e < 4; e++)
        if (v[e] > best) {
            best = v[e];
            at = e;
        }
    *y = best;
    *arg = at;
}

#if CY_X86
/* Even and odd elements of the 16 floats at r: (r0 r2 .. r14), (r1 r3 .. r15). */
CY_AVX2 static inline void cy_split16(const float *r, __m256 *even, __m256 *odd)
{
    const __m256 lo = _mm256_loadu_ps(r), hi = _mm256_loadu_ps(r + 8);
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8));
}

/* Outputs [0, ow8) of one row (ow8 a multiple of 8). */
CY_AVX2 static void cy_max2x2_row8(const float *r0, const float *r1, float *y, int *arg, long ow8)
{
    for (long j = 0; j < ow8; j += 8) {
        __m256 v[4];
        cy_split16(r0 + 2 * j, &v[0], &v[1]);
        cy_split16(r1 + 2 * j, &v[2], &v[3]);
        __m256 best = _mm256_set1_ps(-INFINITY);
        __m256 at = _mm256_setzero_ps();  /* the int32 offsets, as bits */
        for (int e = 0; e < 4; e++) {
            const __m256 gt = _mm256_cmp_ps(v[e], best, _CMP_GT_OQ);
            best = _mm256_blendv_ps(best, v[e], gt);
            at = _mm256_blendv_ps(at, _mm256_castsi256_ps(_mm256_set1_epi32(e)), gt);
        }
        _mm256_storeu_ps(y + j, best);
        _mm256_storeu_si256((__m256i *)(arg + j), _mm256_castps_si256(at));
    }
}

/* Outputs [j0, j0 + 4) of one row, 128 bits wide (the rest of a row after the chunks of 8). */
CY_AVX2 static void cy_max2x2_4(const float *r0, const float *r1, float *y, int *arg, long j0)
{
    const __m128 a = _mm_loadu_ps(r0 + 2 * j0), b = _mm_loadu_ps(r0 + 2 * j0 + 4);
    const __m128 c = _mm_loadu_ps(r1 + 2 * j0), d = _mm_loadu_ps(r1 + 2 * j0 + 4);
    const __m128 v[4] = {_mm_shuffle_ps(a, b, 0x88), _mm_shuffle_ps(a, b, 0xDD), _mm_shuffle_ps(c, d, 0x88),
                         _mm_shuffle_ps(c, d, 0xDD)};
    __m128 best = _mm_set1_ps(-INFINITY), at = _mm_setzero_ps();
    for (int e = 0; e < 4; e++) {
        const __m128 gt = _mm_cmp_ps(v[e], best, _CMP_GT_OQ);
        best = _mm_blendv_ps(best, v[e], gt);
        at = _mm_blendv_ps(at, _mm_castsi128_ps(_mm_set1_epi32(e)), gt);
    }
    _mm_storeu_ps(y + j0, best);
    _mm_storeu_si128((__m128i *)(arg + j0), _mm_castps_si128(at));
}

/* dx rows 2i (d0) and 2i + 1 (d1), columns [2*j0, 2*j0 + 8), from dy / arg row i, 128 bits wide. */
CY_AVX2 static void cy_max2x2_back_4(const float *g, const int *arg, float *d0, float *d1, long j0)
{
    const __m128 gv = _mm_loadu_ps(g + j0), one = _mm_set1_ps(1.0f);
    const __m128i a = _mm_loadu_si128((const __m128i *)(arg + j0));
    __m128 v[4];
    for (int e = 0; e < 4; e++)
        v[e] = _mm_mul_ps(gv, _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(a, _mm_set1_epi32(e))), one));
    _mm_storeu_ps(d0 + 2 * j0, _mm_unpacklo_ps(v[0], v[1]));
    _mm_storeu_ps(d0 + 2 * j0 + 4, _mm_unpackhi_ps(v[0], v[1]));
    _mm_storeu_ps(d1 + 2 * j0, _mm_unpacklo_ps(v[2], v[3]));
    _mm_storeu_ps(d1 + 2 * j0 + 4, _mm_unpackhi_ps(v[2], v[3]));
}

/* dx rows 2i (d0) and 2i + 1 (d1), columns [0, 2*ow8), from dy / arg row i. */
CY_AVX2 static void cy_max2x2_back_row8(const float *g, const int *arg, float *d0, float *d1, long ow8)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    for (long j = 0; j < ow8; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(arg + j));
        __m256 v[4];
        for (int e = 0; e < 4; e++)
            v[e] = _mm256_mul_ps(gv, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32(e))),
                                                   one));
        for (int p = 0; p < 2; p++) {
            const __m256 lo = _mm256_unpacklo_ps(v[2 * p], v[2 * p + 1]);
            const __m256 hi = _mm256_unpackhi_ps(v[2 * p], v[2 * p + 1]);
            float *d = p == 0 ? d0 : d1;
            _mm256_storeu_ps(d + 2 * j, _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_storeu_ps(d + 2 * j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
    }
}
#endif /* CY_X86 */

static void cy_max_pool2x2_fwd_f32(const float *x, float *y, int *arg, long planes, long h, long w, int nthreads)
{
    const long oh = h / 2, ow = w / 2;
#if CY_X86
    const long ow8 = cy_isa() >= 1 ? ow / 8 * 8 : 0, ow4 = cy_isa() >= 1 ? ow / 4 * 4 : 0;
#else
    const long ow8 = 0, ow4 = 0;
#endif
    long t;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (t = 0; t < planes; t++)
        for (long i = 0; i < oh; i++) {
            const float *r0 = x + (t * h + 2 * i) * w, *r1 = r0 + w;
            float *yr = y + (t * oh + i) * ow;
            int *ar = arg + (t * oh + i) * ow;
#if CY_X86
            if (ow8 > 0)
                cy_max2x2_row8(r0, r1, yr, ar, ow8);
            if (ow4 > ow8)
                cy_max2x2_4(r0, r1, yr, ar, ow8);
#endif
            for (long j = ow4; j < ow; j++)
                cy_max4_plain(r0 + 2 * j, r1 + 2 * j, yr + j, ar + j);
        }
}

static void cy_max_pool2x2_bwd_f32(const float *dy, const int *arg, float *dx, long planes, long h, long w,
                                   int nthreads)
{
    const long oh = h / 2, ow = w / 2;
#if CY_X86
    const long ow8 = cy_isa() >= 1 ? ow / 8 * 8 : 0, ow4 = cy_isa() >= 1 ? ow / 4 * 4 : 0;
#else
    const long ow8 = 0, ow4 = 0;
#endif
    long t;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (t = 0; t < planes; t++) {
        for (long i = 0; i < oh; i++) {
            const float *g = dy + (t * oh + i) * ow;
            const int *a = arg + (t * oh + i) * ow;
            float *d0 = dx + (t * h + 2 * i) * w, *d1 = d0 + w;
#if CY_X86
            if (ow8 > 0)
                cy_max2x2_back_row8(g, a, d0, d1, ow8);
            if (ow4 > ow8)
                cy_max2x2_back_4(g, a, d0, d1, ow8);
#endif
            for (long j = ow4; j < ow; j++) {
                d0[2 * j] = g[j] * (a[j] == 0 ? 1.0f : 0.0f);
                d0[2 * j + 1] = g[j] * (a[j] == 1 ? 1.0f : 0.0f);
                d1[2 * j] = g[j] * (a[j] == 2 ? 1.0f : 0.0f);
                d1[2 * j + 1] = g[j] * (a[j] == 3 ? 1.0f : 0.0f);
            }
            if (w % 2) {
                d0[w - 1] = 0.0f;
                d1[w - 1] = 0.0f;
            }
        }
        if (h % 2)
            memset(dx + (t * h + h - 1) * w, 0, sizeof(float) * (size_t)w);
    }
}

#endif /* CYDNN_KERNELS_POOL_H */
