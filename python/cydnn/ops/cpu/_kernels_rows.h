/* The input gradient of a stride-1 convolution, float32, row by row (no im2col, no col2im).
 * Included by _kernels.pyx (wrapper in _kernels_direct.pxi).
 *
 *     dx[b, c, y, x] = sum_{o, p, q} w[o, c, p, q] * dy[b, o, y - p, x - q]
 *
 * over the (p, q) with 0 <= y - p < oh, 0 <= x - q < ow; dx (n, c, h, w) is the gradient of the
 * (padded) input, h = oh + kh - 1, w = ow + kw - 1; every element of it is written.
 *
 * AVX2 (cy_isa() >= 1): for an input row y and 8 consecutive columns j0.. of dy (a "tile" of a
 * dy row, masked at the end of the row), two images at once and up to 5 kernel columns q:
 *
 *     acc[image][q] = sum_{o, p} w[o, c, p, q] * dy[image, o, y - p, j0 : j0 + 8]
 *
 * (10 accumulators; each dy vector loaded once and used for 5 FMAs), then
 * dx[image, c, y, j0 + q : j0 + q + 8] += acc[image][q], one q after the other.  Parallel over
 * (pair of images, input channel): no two threads write one plane.  Baseline: plain loops
 * adding w * dy into dx, parallel over (image, channel).
 */
#ifndef CYDNN_KERNELS_ROWS_H
#define CYDNN_KERNELS_ROWS_H

#include "_kernels_isa.h"

#if CY_X86
/* Row y of dx for images dy0 / dy1 (their (k, oh, ow) planes; dx1 NULL: one image), input
 * channel c (w points at w[0, c, 0, q0], w_o = c_in*kh*kw), columns j0 .. j0 + m - 1 of dy,
 * kernel columns q0 .. q0 + QB - 1; dx0 / dx1 point at dx[image, c, y, j0 + q0]. */
#define CY_ROWS_QB(QB)                                                                                   \
    CY_AVX2 static void cy_rows8_qb##QB(const float *dy0, const float *dy1, const float *w, long w_o,    \
                                        long k, int kh, int kw, long oh, long ow, long y, long j0,       \
                                        int m, float *dx0, float *dx1)                                   \
    {                                                                                                    \
        __m256 a0[QB], a1[QB];                                                                           \
        const float *d1p = dx1 != NULL ? dy1 : dy0;                                                      \
        const __m256i mk = cy_mask8(m);                                                                  \
        const int full = m == 8;                                                                         \
        const long p_lo = y - oh + 1 > 0 ? y - oh + 1 : 0, p_hi = y < kh - 1 ? y : kh - 1;               \
        _Pragma("GCC unroll 8")                                                                          \
        for (int q = 0; q < QB; q++)                                                                     \
            a0[q] = a1[q] = _mm256_setzero_ps();                                                         \
        for (long o = 0; o < k; o++)                                                                     \
            for (long p = p_lo; p <= p_hi; p++) {                                                        \
                const long off = (o * oh + y - p) * ow + j0;                                             \
                const __m256 d0 = full ? _mm256_loadu_ps(dy0 + off) : _mm256_maskload_ps(dy0 + off, mk); \
                const __m256 d1 = full ? _mm256_loadu_ps(d1p + off) : _mm256_maskload_ps(d1p + off, mk); \
                const float *wr = w + o * w_o + p * kw;                                                  \
                _Pragma("GCC unroll 8")                                                                  \
                for (int q = 0; q < QB; q++) {                                                           \
                    __m256 wv = _mm256_broadcast_ss(wr + q);                                             \
                    a0[q] = _mm256_fmadd_ps(wv, d0, a0[q]);                                              \
                    a1[q] = _mm256_fmadd_ps(wv, d1, a1[q]);                                              \
                }                                                                                        \
            }                                                                                            \
        _Pragma("GCC unroll 8")                                                                          \
        for (int q = 0; q < QB; q++) {                                                                   \
            if (full) {                                                                                  \
                _mm256_storeu_ps(dx0 + q, _mm256_add_ps(_mm256_loadu_ps(dx0 + q), a0[q]));               \
                if (dx1 != NULL)                                                                         \
                    _mm256_storeu_ps(dx1 + q, _mm256_add_ps(_mm256_loadu_ps(dx1 + q), a1[q]));           \
            } else {                                                                                     \
                _mm256_maskstore_ps(dx0 + q, mk, _mm256_add_ps(_mm256_maskload_ps(dx0 + q, mk), a0[q])); \
                if (dx1 != NULL)                                                                         \
                    _mm256_maskstore_ps(dx1 + q, mk,                                                     \
                                        _mm256_add_ps(_mm256_maskload_ps(dx1 + q, mk), a1[q]));          \
            }                                                                                            \
        }                                                                                                \
    }

CY_ROWS_QB(1)
CY_ROWS_QB(2)
CY_ROWS_QB(3)
CY_ROWS_QB(4)
CY_ROWS_QB(5)

typedef void (*cy_rows8_fn)(const float *, const float *, const float *, long, long, int, int, long, long, long,
                            long, int, float *, float *);
static const cy_rows8_fn cy_rows8_by_qb[6] = {NULL, cy_rows8_qb1, cy_rows8_qb2, cy_rows8_qb3, cy_rows8_qb4,
                                              cy_rows8_qb5};
#endif /* CY_X86 */

static int cy_conv_rows_dx_f32(const float *dy, const float *w, float *dx, long n, long c, long h, long wd, long k,
                               int kh, int kw, int nthreads)
{
    const long oh = h - kh + 1, ow = wd - kw + 1, plane_in = h * wd, plane_out = oh * ow;
    const long w_o = c * kh * kw;
#if CY_X86
    if (cy_isa() >= 1) {
        const long pairs = (n + 1) / 2;
        long u;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (u = 0; u < pairs * c; u++) {
            const long b0 = (u / c) * 2, ci = u % c;
            const int two = b0 + 1 < n;
            float *x0 = dx + (b0 * c + ci) * plane_in, *x1 = two ? x0 + c * plane_in : NULL;
            memset(x0, 0, sizeof(float) * (size_t)plane_in);
            if (two)
                memset(x1, 0, sizeof(float) * (size_t)plane_in);
            const float *d0 = dy + b0 * k * plane_out, *d1 = two ? d0 + k * plane_out : NULL;
            for (long y = 0; y < h; y++)
                for (long j0 = 0; j0 < ow; j0 += 8) {
                    const int m = (int)(ow - j0 < 8 ? ow - j0 : 8);
                    for (int q0 = 0; q0 < kw; q0 += 5) {
                        const int qb = kw - q0 < 5 ? kw - q0 : 5;
                        cy_rows8_by_qb[qb](d0, d1, w + ci * kh * kw + q0, w_o, k, kh, kw, oh, ow, y, j0, m,
                                           x0 + y * wd + j0 + q0, two ? x1 + y * wd + j0 + q0 : NULL);
                    }
                }
        }
        return 0;
    }
#endif
    long u;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (u = 0; u < n * c; u++) {
        const long b = u / c, ci = u % c;
        float *xp = dx + u * plane_in;
        memset(xp, 0, sizeof(float) * (size_t)plane_in);
        for (long o = 0; o < k; o++)
            for (int p = 0; p < kh; p++)
                for (int q = 0; q < kw; q++) {
                    const float wv = w[o * w_o + (ci * kh + p) * kw + q];
                    for (long i = 0; i < oh; i++) {
                        const float *d = dy + (b * k + o) * plane_out + i * ow;
                        float *r = xp + (i + p) * wd + q;
                        for (long j = 0; j < ow; j++)
                            r[j] += wv * d[j];
                    }
                }
    }
    return 0;
}

#endif /* CYDNN_KERNELS_ROWS_H */
