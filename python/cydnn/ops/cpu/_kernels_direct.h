/* Direct convolution, float32, stride 1, no padding (the caller pads x): the forward pass and the
 * weight gradient without im2col.  Included by _kernels.pyx (wrappers in _kernels_direct.pxi).
 *
 *     y[b, o, i, j]  = bias[o] + sum_{c, p, q} w[o, c, p, q] * x[b, c, i + p, j + q]
 *     dw[o, c, p, q] = sum_{b, i, j} dy[b, o, i, j] * x[b, c, i + p, j + q]
 *     db[o]          = sum_{b, i, j} dy[b, o, i, j]
 *
 * x (n, c, h, w), w (k, c, kh, kw), y and dy (n, k, oh, ow), oh = h - kh + 1, ow = w - kw + 1;
 * all C-contiguous.
 *
 * AVX2 (cy_isa() >= 1): the output plane is cut into "tiles", 8 consecutive outputs of one row
 * (the last of a row masked to ow % 8 lanes).  The forward takes two tiles and up to 6 output
 * channels at a time: 12 accumulators in registers, each input vector loaded once per (c, p, q)
 * and used for 6 FMAs -- parallel over (image, block of channels).  The weight gradient keeps,
 * for two output channels and up to 5 kernel columns q, 10 accumulators over every output row
 * (8 at a time, the end of a row masked) of the images of a slice of the batch, for one input
 * channel, in the slice's partial sums (8 lanes each), reduced in slice order at the end; tasks
 * (slice, channel pair, input channel) run in parallel.  How many slices depends on the shapes
 * alone, so the gradient's bits do not change with the threads the caller passes (which follow the
 * machine's load: a seeded run must repeat exactly).  Baseline: the same sums in plain
 * loops (the forward parallel over (image, channel), the gradient over output channels).
 * The accumulator arrays are unrolled by pragmas, so that GCC keeps them in registers.
 *
 * Returns 0, or -1 when memory for the tiles / partial sums could not be had.
 */
#ifndef CYDNN_KERNELS_DIRECT_H
#define CYDNN_KERNELS_DIRECT_H

#include "_kernels_isa.h"
#include <omp.h>

typedef struct {
    long in;   /* offset of the tile's first input pixel (i, j0) in an input plane: i*w + j0 */
    long out;  /* offset of its first output (i, j0) in an output plane: i*ow + j0 */
    int m;     /* how many of its 8 lanes are outputs (8, or ow % 8 at the end of a row) */
} cy_tile;

/* The tiles of an (oh, ow) output plane of an input plane w wide, row by row (NULL: no memory). */
static cy_tile *cy_make_tiles(long oh, long ow, long w, long *count)
{
    long per_row = (ow + 7) / 8, t = 0;
    cy_tile *tiles = (cy_tile *)malloc(sizeof(cy_tile) * (size_t)(oh * per_row > 0 ? oh * per_row : 1));
    if (tiles == NULL)
        return NULL;
    for (long i = 0; i < oh; i++)
        for (long j = 0; j < ow; j += 8, t++) {
            tiles[t].in = i * w + j;
            tiles[t].out = i * ow + j;
            tiles[t].m = (int)(ow - j < 8 ? ow - j : 8);
        }
    *count = t;
    return tiles;
}

#if CY_X86
/* ------------------------------------------------------------------ forward, AVX2 */

/* Output channels [o0, o0 + OB) of tiles t0 and t1 (t1 may be t0) of one image.
 * x: the image (c, h, w); w: w[o0] (k's stride w_o); y: the image's y[o0]. */
#define CY_FWD_OB(OB)                                                                                  \
    CY_AVX2 static void cy_fwd8_ob##OB(const float *x, long c_in, long plane_in, long w_in, int kh,    \
                                       int kw, const float *w, long w_o, const float *bias, float *y,  \
                                       long plane_out, const cy_tile *t0, const cy_tile *t1)           \
    {                                                                                                  \
        __m256 a0[OB], a1[OB];                                                                         \
        _Pragma("GCC unroll 8")                                                                        \
        for (int k = 0; k < OB; k++)                                                                   \
            a0[k] = a1[k] = _mm256_set1_ps(bias != NULL ? bias[k] : 0.0f);                             \
        const int full = t0->m == 8 && t1->m == 8;                                                     \
        const __m256i m0 = cy_mask8(t0->m), m1 = cy_mask8(t1->m);                                      \
        for (long c = 0; c < c_in; c++)                                                                \
            for (int p = 0; p < kh; p++) {                                                             \
                const float *r0 = x + c * plane_in + p * w_in + t0->in;                                \
                const float *r1 = x + c * plane_in + p * w_in + t1->in;                                \
                const float *wr = w + (c * kh + p) * kw;                                               \
                for (int q = 0; q < kw; q++) {                                                         \
                    const __m256 v0 = full ? _mm256_loadu_ps(r0 + q) : _mm256_maskload_ps(r0 + q, m0); \
                    const __m256 v1 = full ? _mm256_loadu_ps(r1 + q) : _mm256_maskload_ps(r1 + q, m1); \
                    _Pragma("GCC unroll 8")                                                            \
                    for (int k = 0; k < OB; k++) {                                                     \
                        __m256 wv = _mm256_broadcast_ss(wr + k * w_o + q);                             \
                        a0[k] = _mm256_fmadd_ps(wv, v0, a0[k]);                                        \
                        a1[k] = _mm256_fmadd_ps(wv, v1, a1[k]);                                        \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        _Pragma("GCC unroll 8")                                                                        \
        for (int k = 0; k < OB; k++) {                                                                 \
            if (full) {                                                                                \
                _mm256_storeu_ps(y + k * plane_out + t0->out, a0[k]);                                  \
                _mm256_storeu_ps(y + k * plane_out + t1->out, a1[k]);                                  \
            } else {                                                                                   \
                _mm256_maskstore_ps(y + k * plane_out + t0->out, m0, a0[k]);                           \
                _mm256_maskstore_ps(y + k * plane_out + t1->out, m1, a1[k]);                           \
            }                                                                                          \
        }                                                                                              \
    }

CY_FWD_OB(1)
CY_FWD_OB(2)
CY_FWD_OB(3)
CY_FWD_OB(4)
CY_FWD_OB(5)
CY_FWD_OB(6)

typedef void (*cy_fwd8_fn)(const float *, long, long, long, int, int, const float *, long, const float *,
                           float *, long, const cy_tile *, const cy_tile *);
static const cy_fwd8_fn cy_fwd8_by_ob[7] = {NULL, cy_fwd8_ob1, cy_fwd8_ob2, cy_fwd8_ob3,
                                            cy_fwd8_ob4, cy_fwd8_ob5, cy_fwd8_ob6};

/* ---------------------------------------------------------- weight gradient, AVX2 */

/* For images 0 .. nimg-1 (x and dy advance by x_img / dy_img per image), output channels o (dy0)
 * and, when dy1 != NULL, o + 1 (dy1 = dy0 + one plane), input channel row p (xr = x[c] + p*w + q0):
 * part0[8*qq ..] += the 8 lanes of sum_{images, i, j} dy0[i, j] * xr[i*w + j + qq], qq < QB
 * (likewise part1 with dy1); sum0 / sum1 (when sum0 != NULL) += sum_{images, i, j} dy.
 * Each output row in chunks of 8 (plain loads), the rest of the row masked. */
#define CY_DW_QB(QB)                                                                                           \
    CY_AVX2 static void cy_dw8_qb##QB(const float *xr, const float *dy0, const float *dy1, long nimg,          \
                                      long x_img, long dy_img, long oh, long ow, long w_in,                    \
                                      float *part0, float *part1, float *sum0, float *sum1)                    \
    {                                                                                                          \
        __m256 a0[QB], a1[QB], s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();                             \
        const long ow8 = ow / 8 * 8;                                                                           \
        const __m256i mk = cy_mask8((int)(ow - ow8));                                                          \
        _Pragma("GCC unroll 8")                                                                                \
        for (int q = 0; q < QB; q++)                                                                           \
            a0[q] = a1[q] = _mm256_setzero_ps();                                                               \
        for (long b = 0; b < nimg; b++)                                                                        \
            for (long i = 0; i < oh; i++) {                                                                    \
                const float *xi = xr + b * x_img + i * w_in, *e0 = dy0 + b * dy_img + i * ow;                  \
                const float *e1 = (dy1 != NULL ? dy1 : dy0) + b * dy_img + i * ow;                             \
                for (long j = 0; j < ow8; j += 8) {                                                            \
                    const __m256 d0 = _mm256_loadu_ps(e0 + j), d1 = _mm256_loadu_ps(e1 + j);                   \
                    _Pragma("GCC unroll 8")                                                                    \
                    for (int q = 0; q < QB; q++) {                                                             \
                        __m256 v = _mm256_loadu_ps(xi + j + q);                                                \
                        __asm__("" : "+x"(v)); /* one load in a register for both FMAs, not folded twice */    \
                        a0[q] = _mm256_fmadd_ps(d0, v, a0[q]);                                                 \
                        a1[q] = _mm256_fmadd_ps(d1, v, a1[q]);                                                 \
                    }                                                                                          \
                    if (sum0 != NULL) {                                                                        \
                        s0 = _mm256_add_ps(s0, d0);                                                            \
                        s1 = _mm256_add_ps(s1, d1);                                                            \
                    }                                                                                          \
                }                                                                                              \
                if (ow8 < ow) {                                                                                \
                    const __m256 d0 = _mm256_maskload_ps(e0 + ow8, mk), d1 = _mm256_maskload_ps(e1 + ow8, mk); \
                    _Pragma("GCC unroll 8")                                                                    \
                    for (int q = 0; q < QB; q++) {                                                             \
                        const __m256 v = _mm256_maskload_ps(xi + ow8 + q, mk);                                 \
                        a0[q] = _mm256_fmadd_ps(d0, v, a0[q]);                                                 \
                        a1[q] = _mm256_fmadd_ps(d1, v, a1[q]);                                                 \
                    }                                                                                          \
                    if (sum0 != NULL) {                                                                        \
                        s0 = _mm256_add_ps(s0, d0);                                                            \
                        s1 = _mm256_add_ps(s1, d1);                                                            \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        _Pragma("GCC unroll 8")                                                                                \
        for (int q = 0; q < QB; q++) {                                                                         \
            _mm256_storeu_ps(part0 + 8 * q, _mm256_add_ps(_mm256_loadu_ps(part0 + 8 * q), a0[q]));             \
            if (part1 != NULL)                                                                                 \
                _mm256_storeu_ps(part1 + 8 * q, _mm256_add_ps(_mm256_loadu_ps(part1 + 8 * q), a1[q]));         \
        }                                                                                                      \
        if (sum0 != NULL) {                                                                                    \
            _mm256_storeu_ps(sum0, _mm256_add_ps(_mm256_loadu_ps(sum0), s0));                                  \
            if (sum1 != NULL)                                                                                  \
                _mm256_storeu_ps(sum1, _mm256_add_ps(_mm256_loadu_ps(sum1), s1));                              \
        }                                                                                                      \
    }

CY_DW_QB(1)
CY_DW_QB(2)
CY_DW_QB(3)
CY_DW_QB(4)
CY_DW_QB(5)

typedef void (*cy_dw8_fn)(const float *, const float *, const float *, long, long, long, long, long, long,
                          float *, float *, float *, float *);
static const cy_dw8_fn cy_dw8_by_qb[6] = {NULL, cy_dw8_qb1, cy_dw8_qb2, cy_dw8_qb3, cy_dw8_qb4, cy_dw8_qb5};

/* out[i] (i < count) = the 8 lanes of the sum, in order, of the `parts` vectors part[t*stride + i]. */
CY_AVX2 static void cy_reduce8(const float *part, long parts, long stride, long count, float *out)
{
    for (long i = 0; i < count; i++) {
        __m256 s = _mm256_loadu_ps(part + 8 * i);
        for (long t = 1; t < parts; t++)
            s = _mm256_add_ps(s, _mm256_loadu_ps(part + 8 * (t * stride + i)));
        out[i] = cy_hsum8(s);
    }
}
#endif /* CY_X86 */

/* ---------------------------------------------------------------------- drivers */

static int cy_conv_direct_fwd_f32(const float *x, const float *w, const float *bias, float *y, long n, long c,
                                  long h, long wd, long k, int kh, int kw, int nthreads)
{
    const long oh = h - kh + 1, ow = wd - kw + 1, plane_in = h * wd, plane_out = oh * ow;
    const long w_o = c * kh * kw;
#if CY_X86
    if (cy_isa() >= 1) {
        long ntiles = 0;
        cy_tile *tiles = cy_make_tiles(oh, ow, wd, &ntiles);
        if (tiles == NULL)
            return -1;
        const long nb = (k + 5) / 6;  /* blocks of at most 6 output channels, sizes as even as can be */
        long u;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (u = 0; u < n * nb; u++) {
            const long b = u / nb, blk = u % nb, o0 = blk * k / nb, o1 = (blk + 1) * k / nb;
            const cy_fwd8_fn fn = cy_fwd8_by_ob[o1 - o0];
            for (long t = 0; t < ntiles; t += 2)
                fn(x + b * c * plane_in, c, plane_in, wd, kh, kw, w + o0 * w_o, w_o,
                   bias != NULL ? bias + o0 : NULL, y + (b * k + o0) * plane_out, plane_out,
                   tiles + t, tiles + (t + 1 < ntiles ? t + 1 : t));
        }
        free(tiles);
        return 0;
    }
#endif
    long u;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (u = 0; u < n * k; u++) {
        const long b = u / k, o = u % k;
        float *yp = y + u * plane_out;
        for (long e = 0; e < plane_out; e++)
            yp[e] = bias != NULL ? bias[o] : 0.0f;
        for (long ci = 0; ci < c; ci++)
            for (int p = 0; p < kh; p++)
                for (int q = 0; q < kw; q++) {
                    const float wv = w[o * w_o + (ci * kh + p) * kw + q];
                    for (long i = 0; i < oh; i++) {
                        const float *r = x + (b * c + ci) * plane_in + (i + p) * wd + q;
                        float *yr = yp + i * ow;
                        for (long j = 0; j < ow; j++)
                            yr[j] += wv * r[j];
                    }
                }
    }
    return 0;
}

/* The weight gradient's tasks to aim at (enough for the threads of a large machine), and its slices of
 * the batch at most (their partial sums: 64 x 256 weights, 0.5 MB a slice). */
#define CY_DW_TASKS 48
#define CY_DW_SLICES 32

static int cy_conv_direct_dw_f32(const float *x, const float *dy, float *dw, float *db, long n, long c, long h,
                                 long wd, long k, int kh, int kw, int nthreads)
{
    const long oh = h - kh + 1, ow = wd - kw + 1, plane_in = h * wd, plane_out = oh * ow;
    const long nw = k * c * kh * kw;
    if (nthreads < 1)
        nthreads = 1;
#if CY_X86
    if (cy_isa() >= 1) {
        /* Tasks: (slice of the batch, item), an item a pair of output channels and one input channel; a
         * task accumulates its images into its slice's partial sums of its item's weights (no two tasks
         * share a sum).  Slices only where items are few (about CY_DW_TASKS tasks in all): their
         * number depends on the shapes alone, never on nthreads. */
        const long len = nw + k;  /* a slice's partial sums: dw, then db, 8 lanes each */
        const long items = (k + 1) / 2 * c;
        long slices = (CY_DW_TASKS + items - 1) / items;
        if (slices > n)
            slices = n;
        if (slices > CY_DW_SLICES)
            slices = CY_DW_SLICES;
        float *part = (float *)calloc((size_t)(slices * len * 8), sizeof(float));
        if (part == NULL)
            return -1;
        long t;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (t = 0; t < slices * items; t++) {
            const long sl = t / items, it = t % items, o = it / c * 2, ci = it % c;
            const long b0 = n * sl / slices, nimg = n * (sl + 1) / slices - b0;
            float *mine = part + sl * len * 8;
            const int two = o + 1 < k;
            const float *dy0 = dy + (b0 * k + o) * plane_out;
            for (int p = 0; p < kh && nimg > 0; p++)
                for (int q0 = 0; q0 < kw; q0 += 5) {
                    const int qb = kw - q0 < 5 ? kw - q0 : 5;
                    const int first = ci == 0 && p == 0 && q0 == 0 && db != NULL;
                    float *p0 = mine + 8 * (((o * c + ci) * kh + p) * kw + q0);
                    cy_dw8_by_qb[qb](x + (b0 * c + ci) * plane_in + p * wd + q0, dy0,
                                     two ? dy0 + plane_out : NULL, nimg, c * plane_in, k * plane_out,
                                     oh, ow, wd, p0, two ? p0 + 8 * c * kh * kw : NULL,
                                     first ? mine + 8 * (nw + o) : NULL,
                                     first && two ? mine + 8 * (nw + o + 1) : NULL);
                }
        }
        cy_reduce8(part, slices, len, nw, dw);
        if (db != NULL)  /* the partial sums of db follow those of dw in each slice's block */
            cy_reduce8(part + 8 * nw, slices, len, k, db);
        free(part);
        return 0;
    }
#endif
    long o;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (o = 0; o < k; o++) {
        if (db != NULL) {
            float s = 0.0f;
            for (long b = 0; b < n; b++)
                for (long e = 0; e < plane_out; e++)
                    s += dy[(b * k + o) * plane_out + e];
            db[o] = s;
        }
        for (long ci = 0; ci < c; ci++)
            for (int p = 0; p < kh; p++)
                for (int q = 0; q < kw; q++) {
                    float s = 0.0f;
                    for (long b = 0; b < n; b++)
                        for (long i = 0; i < oh; i++) {
                            const float *r = x + (b * c + ci) * plane_in + (i + p) * wd + q;
                            const float *d = dy + (b * k + o) * plane_out + i * ow;
                            for (long j = 0; j < ow; j++)
                                s += d[j] * r[j];
                        }
                    dw[((o * c + ci) * kh + p) * kw + q] = s;
                }
    }
    return 0;
}

#endif /* CYDNN_KERNELS_DIRECT_H */
