/* matmul-fp8.c - block-scaled FP8 weights (WFMT_FP8: E4M3 codes, one F32 scale per
 * blk_rows x blk_cols block; docs/MODEL.md §5.6), and the decoded-row driver the NVFP4
 * kernel (matmul-nvfp4.c) shares.  The weights stay in their format: each row is decoded
 * on the fly into a per-thread buffer of cols values, never up-converted in memory.
 *
 * Exact path (backend_cfg.mxfp4_exact, or no AVX2): the row decoded to fp64 (code x scale
 * is exact there: 4 + 24 significant bits), every product exact in fp64, the MXFP4 exact
 * path's 16-lane fp64 accumulation order (lane = col % 16, folded l += l+8, +4, +2, +1),
 * one rounding to fp32: the scalar and AVX2 dots are bit-identical, and an fp64 reference
 * of the same sum matches to its rounding.  Fast path: the row decoded to fp32, then the
 * F32 matmul kernel (AVX2 FMA where the CPU has it). */
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

float cpu_e4m3[256];

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

static void fp8_row_decode(const struct bweight *w, int64_t r, double *out64, float *out32)
{
    const uint8_t *q = (const uint8_t *)w->data + r * w->cols;

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
            struct bweight f = { .fmt = WFMT_F32, .rows = 1, .cols = cols, .data = rowbuf };
            decode(w, r, NULL, rowbuf);
            cpu_matmul_f32_rows(&f, x, xidx, n, y + (r - r0), ldy, 0, 1, avx2);
        }
    }
}

bool cpu_lowp_exact(const struct cpu_ctx *c)
{
    return c->mxfp4_exact || !c->have_avx2;
}

void cpu_matmul_fp8_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                         int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf)
{
    cpu_matmul_decoded_rows(w, fp8_row_decode, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
