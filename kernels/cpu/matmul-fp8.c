/* matmul-fp8.c - block-scaled FP8 weights (WFMT_FP8: E4M3 codes, one F32 scale per
 * blk_rows x blk_cols block; docs/MODEL.md §5.6), and the decoded-row driver the NVFP4
 * kernel (matmul-nvfp4.c) shares with its fused driver (cpu_matmul_fused_rows).  The
 * weights stay in their format: each row is decoded on the fly into a per-thread buffer of
 * cols values, never up-converted in memory.
 *
 * Exact path (backend_cfg.mxfp4_exact, or no AVX2): the row decoded to fp64 (code x scale
 * is exact there: 4 + 24 significant bits), every product exact in fp64, the MXFP4 exact
 * path's 16-lane fp64 accumulation order (lane = col % 16, folded l += l+8, +4, +2, +1),
 * one rounding to fp32: the scalar and AVX2 dots are bit-identical, and an fp64 reference
 * of the same sum matches to its rounding.  Fast path at level avx2 (fp8_rows_avx2, every
 * token count, batch-invariant): a scale block of a row at a time, its E4M3 codes made
 * fp16 bit fields (value x 2^-8, exact) in the row buffer, then widened by vcvtph2ps from
 * there into 4 FMA chains per token, up to 3 tokens a pass, the block scale x 2^8 once per
 * block: per 16 codes one shuffle-port op (the sign extension), where widening in
 * registers took four (docs/PERFORMANCE.md §4.3a, "AVX2 level"); the next row's same
 * columns prefetched into L2 (a 4096-column row is a 4 KiB page, where the L2 streamer
 * stops).  With cpu_lowp_fused_off, CPU_LOWP_TILE rows decoded to fp32 and the F32 kernel
 * over them.
 * Above AVX2 cpu_matmul_fp8_rows picks, in order: the AMX tiles (STEPD_CPU_FP8_AMX=1), FP16
 * FMAs (AVX512-FP16, matmul-fp8-fp16.c), vdpbf16ps (AVX512-BF16, matmul-fp8-bf16.c), the
 * AVX-512 fp32 tiles (matmul-lowp512.c). */
#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

float cpu_e4m3[256];
int cpu_lowp_fused_off;

__attribute__((constructor)) static void e4m3_table_init(void)
{
    for (int b = 0; b < 256; b++)
        cpu_e4m3[b] = fp8_e4m3_value((uint8_t)b);
}

static float fp8_scale(const struct bweight *w, int64_t r, int64_t col)
{
    float s;
    int64_t nb = w->cols / w->blk_cols;

    memcpy(&s, w->scale + 4 * ((r / w->blk_rows) * nb + col / w->blk_cols), 4);
    return s;
}

#if defined(__x86_64__)
/* the fp32 row with AVX2: an E4M3 byte's bits moved into an fp32 (sign to bit 31, exponent
 * and mantissa to bits 20-26) are its value times 2^-120, subnormals included; x 2^120 is
 * exact, x scale rounds once: bit for bit the scalar decode.  (NaN codes are refused at
 * prepare.)  blk_cols is a multiple of 16 (model-load), so 8-wide steps stay in a block. */
CPU_FN_AVX2
static void fp8_row_decode32_avx2(const struct bweight *w, int64_t r, float *out)
{
    const uint8_t *q = (const uint8_t *)w->data + r * w->cols;
    const __m256i m7f = _mm256_set1_epi32(0x7f), m80 = _mm256_set1_epi32(0x80);
    const __m256 p120 = _mm256_set1_ps(0x1p120f);

    for (int64_t b = 0; b < w->cols; b += w->blk_cols) {
        const __m256 s = _mm256_set1_ps(fp8_scale(w, r, b));
        for (int64_t j = b; j < b + w->blk_cols; j += 8) {
            __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
            __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, m80), 24),
                                           _mm256_slli_epi32(_mm256_and_si256(c, m7f), 20));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), p120), s));
        }
    }
}
#endif

static void fp8_row_decode(const struct bweight *w, int64_t r, double *out64, float *out32)
{
    const uint8_t *q = (const uint8_t *)w->data + r * w->cols;

#if defined(__x86_64__)
    if (!out64 && cpu_isa_has(CPU_ISA_AVX2)) {
        fp8_row_decode32_avx2(w, r, out32);
        return;
    }
#endif

    for (int64_t b = 0; b < w->cols; b += w->blk_cols) {
        float s = fp8_scale(w, r, b);
        for (int64_t j = b; j < b + w->blk_cols; j++) {
            if (out64)
                out64[j] = (double)cpu_e4m3[q[j]] * (double)s;
            else
                out32[j] = cpu_e4m3[q[j]] * s;
        }
    }
}

float cpu_fp8_get(const struct bweight *w, int64_t row, int64_t col)
{
    return cpu_e4m3[((const uint8_t *)w->data)[row * w->cols + col]] * fp8_scale(w, row, col);
}

static void exact_dot64_scalar(const double *row, const float *xi, int64_t cols, double *acc)
{
    for (int64_t j = 0; j < cols; j += MXFP4_EXACT_LANES)
        for (int l = 0; l < MXFP4_EXACT_LANES; l++)
            acc[l] += row[j + l] * (double)xi[j + l];
}

#if defined(__x86_64__)
/* the scalar lanes, four at a time (products exact in fp64: fma == mul + add) */
CPU_FN_AVX2
static void exact_dot64_avx2(const double *row, const float *xi, int64_t cols, double *acc)
{
    __m256d a[4];

    for (int k = 0; k < 4; k++)
        a[k] = _mm256_loadu_pd(acc + 4 * k);
    for (int64_t j = 0; j < cols; j += 16)
        for (int k = 0; k < 4; k++)
            a[k] = _mm256_fmadd_pd(_mm256_loadu_pd(row + j + 4 * k), _mm256_cvtps_pd(_mm_loadu_ps(xi + j + 4 * k)),
                                   a[k]);
    for (int k = 0; k < 4; k++)
        _mm256_storeu_pd(acc + 4 * k, a[k]);
}
#endif

void cpu_matmul_decoded_rows(const struct bweight *w, cpu_row_decode_fn decode, const float *x,
                             const int32_t *xidx, int n, float *y, int64_t ldy, int64_t r0, int64_t r1,
                             bool exact, void *rowbuf)
{
    const int64_t cols = w->cols;
    const bool avx2 = cpu_isa_has(CPU_ISA_AVX2);

    for (int64_t r = r0; r < r1; r++) {
        if (exact) {
            double *row = rowbuf;
            decode(w, r, row, NULL);
            for (int i = 0; i < n; i++) {
                const float *xi = x + (int64_t)(xidx ? xidx[i] : i) * cols;
                double acc[MXFP4_EXACT_LANES] = { 0 };
#if defined(__x86_64__)
                if (avx2)
                    exact_dot64_avx2(row, xi, cols, acc);
                else
#endif
                    exact_dot64_scalar(row, xi, cols, acc);
                y[(int64_t)i * ldy + (r - r0)] = cpu_exact_fold(acc);
            }
        } else {
            /* CPU_LOWP_TILE rows decoded, then one F32 call (its register blocking spans rows) */
            int64_t k = r1 - r < CPU_LOWP_TILE ? r1 - r : CPU_LOWP_TILE;
            struct bweight f = { .fmt = WFMT_F32, .rows = k, .cols = cols, .data = rowbuf };
            for (int64_t t = 0; t < k; t++)
                decode(w, r + t, NULL, (float *)rowbuf + t * cols);
            cpu_matmul_f32_rows(&f, x, xidx, n, y + (r - r0), ldy, 0, k, avx2);
            r += k - 1;
        }
    }
}

int cpu_lowp_check(const struct bweight *w)
{
    const uint8_t *p = w->fmt == WFMT_FP8 ? w->data : w->scale;
    int64_t n = w->fmt == WFMT_FP8 ? w->rows * w->cols : w->rows * (w->cols / 16);

    if (w->fmt == WFMT_FP8 && (w->blk_rows <= 0 || w->blk_cols <= 0 || w->rows % w->blk_rows ||
                               w->cols % w->blk_cols || w->blk_cols % 16))
        return -EINVAL;
    if (w->fmt == WFMT_NVFP4 && (w->cols % 16 || !isfinite(w->gscale)))
        return -EINVAL;
    /* E4M3 NaN (0x7f, 0xff) marks a corrupt file, as an E8M0 255 does for MXFP4 */
    for (int64_t i = 0; i < n; i++)
        if ((p[i] & 0x7f) == 0x7f)
            return -EINVAL;
    return 0;
}

bool cpu_lowp_exact(const struct cpu_ctx *c)
{
    return c->mxfp4_exact || !c->have_avx2;
}

#if defined(__x86_64__)
#define F8_ROWS 4       /* rows a token pass shares from 3 tokens on (one row below) */
#define F8_NT 3         /* tokens per pass: 4 accumulators each, 12 of the 16 ymm */
#define F8_TB 16        /* tokens per block (their accumulators in memory) */
#define F8_PF1 1024     /* bytes ahead in each row's stream prefetched into L1 */

float cpu_lowp_hsum8(const float *f)
{
    float s = 0.0f;

    for (int k = 0; k < 8; k++)
        s += f[k];
    return s;
}

/* codes [0, len) at q (len a multiple of 16) as fp16 bit fields into h: sign-extended to
 * 16 bits, shifted left 7 and masked, the code's value times 2^-8 (exponent and mantissa at
 * bits 7-13, the sign at 15; E4M3 subnormals land on fp16 subnormals, the same factor).
 * Per 64 bytes prefetches F8_PF1 bytes ahead into L1 (below l1_end) and d2 bytes ahead into
 * L2 (below end). */
CPU_FN_AVX2
static inline __attribute__((always_inline)) void fp8_h16_decode(const uint8_t *q, int64_t len, uint16_t *h,
                                                                uintptr_t l1_end, int64_t d2, uintptr_t end)
{
    const __m256i mask = _mm256_set1_epi16((short)0xbf80);

    for (int64_t j = 0; j < len; j += 64) {
        /* addresses as integers: past the weights they are not pointers into them */
        const uintptr_t p1 = (uintptr_t)(q + j) + F8_PF1, p2 = (uintptr_t)(q + j) + (uintptr_t)d2;
        const int64_t e = len - j < 64 ? len - j : 64;

        if (p1 < l1_end)
            _mm_prefetch((const char *)p1, _MM_HINT_T0);
        if (p2 < end)
            _mm_prefetch((const char *)p2, _MM_HINT_T1);
        for (int64_t k = 0; k < e; k += 16) {
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + j + k)));
            _mm256_storeu_si256((__m256i *)(h + j + k), _mm256_and_si256(_mm256_slli_epi16(v, 7), mask));
        }
    }
}

/* row r's scales: block k's at 4 k */
static const uint8_t *fp8_scale_row(const struct bweight *w, int64_t r)
{
    return w->scale + 4 * (r / w->blk_rows) * (w->cols / w->blk_cols);
}

static inline float fp8_scale_k(const uint8_t *sc, int64_t k)
{
    float s;

    memcpy(&s, sc + 4 * k, 4);
    return s * 0x1p8f;
}

/* one row's block (fp16 fields h, bc columns) against nt tokens' columns xt[t] (the block's
 * first), the block scale s (x 2^8) into acc[t]: per token 4 FMA chains (32-column steps:
 * columns +0..7, +8..15, +16..23, +24..31; a last 16 on the first two), summed as
 * (c0 + c1) + (c2 + c3) and FMAed with s into the token's accumulator.  nt is a constant
 * at each call, so the 4 nt chains stay in registers. */
CPU_FN_AVX2
static inline __attribute__((always_inline)) void fp8_h16_dot(const uint16_t *h, int64_t bc, const float *const *xt,
                                                             int64_t b, const int nt, __m256 s, __m256 *acc)
{
    __m256 c[4][F8_NT];
    int64_t j = 0;

    for (int k = 0; k < 4; k++)
        for (int t = 0; t < nt; t++)
            c[k][t] = _mm256_setzero_ps();
    for (; j + 16 < bc; j += 32) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j + 8)));
        const __m256 w2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j + 16)));
        const __m256 w3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j + 24)));

        for (int t = 0; t < nt; t++) {
            const float *x = xt[t] + b + j;
            c[0][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), c[0][t]);
            c[1][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), c[1][t]);
            c[2][t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), c[2][t]);
            c[3][t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), c[3][t]);
        }
    }
    if (j < bc) {
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j + 8)));

        for (int t = 0; t < nt; t++) {
            c[0][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt[t] + b + j), c[0][t]);
            c[1][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[t] + b + j + 8), c[1][t]);
        }
    }
    for (int t = 0; t < nt; t++)
        acc[t] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(c[0][t], c[1][t]), _mm256_add_ps(c[2][t], c[3][t])), s,
                                 acc[t]);
}

/* fp8_h16_dot for nt tokens (1..F8_NT), each count compiled with its chains in registers */
CPU_FN_AVX2
static void fp8_h16_dot_any(const uint16_t *h, int64_t bc, const float *const *xt, int64_t b, int nt, __m256 s,
                            __m256 *acc)
{
    switch (nt) {
    case 1: fp8_h16_dot(h, bc, xt, b, 1, s, acc); break;
    case 2: fp8_h16_dot(h, bc, xt, b, 2, s, acc); break;
    default: fp8_h16_dot(h, bc, xt, b, F8_NT, s, acc); break;
    }
}

/* row q (scales sc) against nt tokens (1 or 2), block by block: the block's codes into the
 * fp16 fields h (prefetching the next row's same columns into L2), then fp8_h16_dot; the
 * sums into out[t] */
CPU_FN_AVX2
static inline __attribute__((always_inline)) void fp8_h16_row(const uint8_t *q, uint16_t *h, int64_t cols, int64_t bc,
                                                             const uint8_t *sc, const float *const *xt, const int nt,
                                                             float *out, uintptr_t end)
{
    __m256 acc[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };

    for (int64_t b = 0, k = 0; b < cols; b += bc, k++) {
        fp8_h16_decode(q + b, bc, h, end, cols, end);
        fp8_h16_dot(h, bc, xt, b, nt, _mm256_set1_ps(fp8_scale_k(sc, k)), acc);
    }
    for (int t = 0; t < nt; t++) {
        float f[8];
        _mm256_storeu_ps(f, acc[t]);
        out[t] = cpu_lowp_hsum8(f);
    }
}

/* The AVX2 fast path, at every token count.  Up to 2 tokens row by row (fp8_h16_row);
 * from 3, blocks of F8_TB tokens over groups of F8_ROWS rows, one scale block at a time
 * (each row's stream prefetching the same row of the next group into L2), F8_NT tokens a
 * pass, so the rows share each block of the tokens' activations from L1.  The fields (2
 * bytes a weight, F8_ROWS blocks at most: within CPU_LOWP_BUF) are widened by vcvtph2ps
 * from memory, so the shuffle port's only work is the sign extension, one per 16 codes.
 * Each (row, token) sum is fp8_h16_dot's chains block after block, then the 8 lanes in
 * order (cpu_lowp_hsum8), whatever the group, the pass, the token block, the row range or
 * the thread: batch-invariant. */
CPU_FN_AVX2
static void fp8_rows_avx2(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y, int64_t ldy,
                          int64_t r0, int64_t r1, void *rowbuf)
{
    const int64_t cols = w->cols, bc = w->blk_cols, nb = cols / bc;
    const uint8_t *data = w->data;
    const uintptr_t end = (uintptr_t)(data + r1 * cols);
    uint16_t *h = rowbuf;
    __m256 acc[F8_ROWS][F8_TB];

    if (n <= 2) {
        const float *xt[2] = { x + (int64_t)(xidx ? xidx[0] : 0) * cols,
                               x + (int64_t)(xidx && n > 1 ? xidx[1] : 1) * cols };
        float out[2];

        for (int64_t r = r0; r < r1; r++) {
            if (n == 1)
                fp8_h16_row(data + r * cols, h, cols, bc, fp8_scale_row(w, r), xt, 1, out, end);
            else
                fp8_h16_row(data + r * cols, h, cols, bc, fp8_scale_row(w, r), xt, 2, out, end);
            for (int t = 0; t < n; t++)
                y[(int64_t)t * ldy + (r - r0)] = out[t];
        }
        return;
    }
    for (int i0 = 0; i0 < n; i0 += F8_TB) {
        const int tb = n - i0 < F8_TB ? n - i0 : F8_TB;
        const float *xt[F8_TB];

        for (int t = 0; t < tb; t++)
            xt[t] = x + (int64_t)(xidx ? xidx[i0 + t] : i0 + t) * cols;
        for (int64_t r = r0; r < r1; r += F8_ROWS) {
            const int nr = r1 - r < F8_ROWS ? (int)(r1 - r) : F8_ROWS;
            const uint8_t *sc[F8_ROWS];

            for (int rr = 0; rr < nr; rr++) {
                sc[rr] = fp8_scale_row(w, r + rr);
                for (int t = 0; t < tb; t++)
                    acc[rr][t] = _mm256_setzero_ps();
            }
            for (int64_t k = 0; k < nb; k++) {
                for (int rr = 0; rr < nr; rr++) {
                    const uint8_t *q = data + (r + rr) * cols;
                    const uintptr_t re = (uintptr_t)(q + cols) < end ? (uintptr_t)(q + cols) : end;
                    fp8_h16_decode(q + k * bc, bc, h + rr * bc, re, F8_ROWS * cols, end);
                }
                for (int rr = 0; rr < nr; rr++) {
                    const __m256 s = _mm256_set1_ps(fp8_scale_k(sc[rr], k));

                    for (int t = 0; t < tb; t += F8_NT)
                        fp8_h16_dot_any(h + rr * bc, bc, xt + t, k * bc, tb - t < F8_NT ? tb - t : F8_NT, s,
                                        acc[rr] + t);
                }
            }
            for (int rr = 0; rr < nr; rr++)
                for (int t = 0; t < tb; t++) {
                    float f[8];
                    _mm256_storeu_ps(f, acc[rr][t]);
                    y[(int64_t)(i0 + t) * ldy + (r + rr - r0)] = cpu_lowp_hsum8(f);
                }
        }
    }
}
#endif

/* The fused fast paths' driver: row by row (the row stays in L1), CPU_FUSED_NT tokens at
 * a time. */
void cpu_matmul_fused_rows(const struct bweight *w, cpu_row_fused_fn row, const float *x, const int32_t *xidx,
                           int n, float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    for (int64_t r = r0; r < r1; r++)
        for (int i0 = 0; i0 < n; i0 += CPU_FUSED_NT) {
            int nt = n - i0 < CPU_FUSED_NT ? n - i0 : CPU_FUSED_NT;
            const float *xt[CPU_FUSED_NT];
            float out[CPU_FUSED_NT];

            for (int t = 0; t < nt; t++)
                xt[t] = x + (int64_t)(xidx ? xidx[i0 + t] : i0 + t) * w->cols;
            row(w, r, xt, nt, out);
            for (int t = 0; t < nt; t++)
                y[(int64_t)(i0 + t) * ldy + (r - r0)] = out[t];
        }
}

void cpu_matmul_fp8_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                         int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf)
{
#if defined(__x86_64__)
    if (!exact && !cpu_lowp_fused_off && cpu_fp8_amx_fits(w)) {
        cpu_matmul_fp8_amx_rows(w, x, xidx, n, y, ldy, r0, r1, rowbuf);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_fp8_fp16_fits(w)) {
        cpu_matmul_fp8_fp16_rows(w, x, xidx, n, y, ldy, r0, r1, rowbuf);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_fp8_bf16_fits(w)) {
        cpu_matmul_fp8_bf16_rows(w, x, xidx, n, y, ldy, r0, r1, rowbuf);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_isa_has(CPU_ISA_AVX512)) {
        cpu_matmul_lowp512_rows(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_isa_has(CPU_ISA_AVX2)) {
        fp8_rows_avx2(w, x, xidx, n, y, ldy, r0, r1, rowbuf);
        return;
    }
#endif
    cpu_matmul_decoded_rows(w, fp8_row_decode, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
