/* matmul-fp8.c - block-scaled FP8 weights (WFMT_FP8: E4M3 codes, one F32 scale per
 * blk_rows x blk_cols block; docs/MODEL.md §5.6), and the decoded-row driver the NVFP4
 * kernel (matmul-nvfp4.c) shares.  The weights stay in their format: each row is decoded
 * on the fly into a per-thread buffer of cols values, never up-converted in memory.
 *
 * Exact path (backend_cfg.mxfp4_exact, or no AVX2): the row decoded to fp64 (code x scale
 * is exact there: 4 + 24 significant bits), every product exact in fp64, the MXFP4 exact
 * path's 16-lane fp64 accumulation order (lane = col % 16, folded l += l+8, +4, +2, +1),
 * one rounding to fp32: the scalar and AVX2 dots are bit-identical, and an fp64 reference
 * of the same sum matches to its rounding.  Fast path (AVX2): decode fused into the dot,
 * cpu_matmul_fused_rows (one row's values in registers against up to CPU_FUSED_NT tokens);
 * with cpu_lowp_fused_off, CPU_LOWP_TILE rows decoded to fp32 and the F32 kernel over them.
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
/* Fused fast path: E4M3 bytes sign-extended to 16 bits and shifted left 7, masked, are an
 * fp16 of the code's value times 2^-8 (exponent and mantissa at bits 7-13, the sign at 15;
 * E4M3 subnormals land on fp16 subnormals, the same factor), and vcvtph2ps widens them
 * exactly to normal fp32s, so no denormal reaches the FMAs.  The block scale (times 2^8)
 * multiplies each block's partial sums once per token, so the inner loop is decode + FMA. */
/* codes j..j+15 of the row into c0[t] (j..j+7) and c1[t] (j+8..j+15) of each token */
CPU_FN_AVX2
static inline void fp8_16_fused(const uint8_t *q, int64_t j, __m256i mask, const float *const *xt, int nt,
                                __m256 *c0, __m256 *c1)
{
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + j)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), mask);
    __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));

    for (int t = 0; t < nt; t++) {
        c0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt[t] + j), c0[t]);
        c1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[t] + j + 8), c1[t]);
    }
}

CPU_FN_AVX2
static inline void fp8_row_fused_avx2(const struct bweight *w, int64_t r, const float *const *xt, int nt,
                                      float *acc_out)
{
    const uint8_t *q = (const uint8_t *)w->data + r * w->cols;
    const __m256i mask = _mm256_set1_epi16((short)0xbf80);
    __m256 acc[CPU_FUSED_NT], p[4][CPU_FUSED_NT];

    for (int t = 0; t < nt; t++)
        acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w->cols; b += w->blk_cols) {
        const __m256 s = _mm256_set1_ps(fp8_scale(w, r, b) * 0x1p8f);
        int64_t j = b;

        for (int k = 0; k < 4; k++)
            for (int t = 0; t < nt; t++)
                p[k][t] = _mm256_setzero_ps();
        /* up to 2 tokens, 4 FMA chains per token (blk_cols is a multiple of 16): one token
         * on 2 chains was bound by the FMA latency at ~4 weights per cycle */
        if (nt <= 2)
            for (; j + 16 < b + w->blk_cols; j += 32) {
                fp8_16_fused(q, j, mask, xt, nt, p[0], p[1]);
                fp8_16_fused(q, j + 16, mask, xt, nt, p[2], p[3]);
            }
        for (; j < b + w->blk_cols; j += 16)
            fp8_16_fused(q, j, mask, xt, nt, p[0], p[1]);
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(p[0][t], p[1][t]), _mm256_add_ps(p[2][t], p[3][t])),
                                     s, acc[t]);
    }
    for (int t = 0; t < nt; t++) {
        float f[8];
        _mm256_storeu_ps(f, acc[t]);
        acc_out[t] = cpu_lowp_hsum8(f);
    }
}

float cpu_lowp_hsum8(const float *f)
{
    float s = 0.0f;

    for (int k = 0; k < 8; k++)
        s += f[k];
    return s;
}

/* nt tokens (1..CPU_FUSED_NT), each count compiled with its accumulators in registers */
CPU_FN_AVX2
static void fp8_row_fused(const struct bweight *w, int64_t r, const float *const *xt, int nt, float *out)
{
    switch (nt) {
    case 1: fp8_row_fused_avx2(w, r, xt, 1, out); break;
    case 2: fp8_row_fused_avx2(w, r, xt, 2, out); break;
    case 3: fp8_row_fused_avx2(w, r, xt, 3, out); break;
    default: fp8_row_fused_avx2(w, r, xt, CPU_FUSED_NT, out); break;
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
    if (!exact && !cpu_lowp_fused_off && n <= CPU_FUSED_MAX_N && cpu_isa_has(CPU_ISA_AVX2)) {
        cpu_matmul_fused_rows(w, fp8_row_fused, x, xidx, n, y, ldy, r0, r1);
        return;
    }
#endif
    cpu_matmul_decoded_rows(w, fp8_row_decode, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
