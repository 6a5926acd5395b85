/* matmul-nvfp4.c - NVFP4 weights (WFMT_NVFP4: E2M1 nibbles packed as MXFP4's, one E4M3
 * scale per 16 in-features, one F32 global scale; docs/MODEL.md §5.7) through the
 * decoded-row driver of matmul-fp8.c: the exact path decodes to fp64 (e2m1 x e4m3 x the
 * F32 global scale is exact there: 3 + 4 + 24 bits), the fast path to fp32. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

#if defined(__x86_64__)
/* doubled E2M1 as int8; the /2 goes into the group scale (exact): the scalar decode's bits */
static const int8_t lut_doubled[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

CPU_FN_AVX2
static void nvfp4_row_decode32_avx2(const struct bweight *w, int64_t r, float *out)
{
    const uint8_t *q = (const uint8_t *)w->data + r * (w->cols / 2);
    const uint8_t *sc = w->scale + r * (w->cols / NVFP4_GROUP);
    const __m128i lut = _mm_loadu_si128((const __m128i *)lut_doubled), m4 = _mm_set1_epi8(0x0f);

    for (int64_t g = 0; g < w->cols / NVFP4_GROUP; g++) {
        const __m256 s = _mm256_set1_ps(cpu_e4m3[sc[g]] * w->gscale * 0.5f);
        __m128i v = _mm_loadl_epi64((const __m128i *)(q + g * 8));
        __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, m4));
        __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        __m128i c = _mm_unpacklo_epi8(lo, hi);
        float *o = out + g * NVFP4_GROUP;

        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))), s));
    }
}
#endif

static void nvfp4_weight_row(const struct bweight *w, int64_t r, double *out64, float *out32)
{
    const uint8_t *q = (const uint8_t *)w->data + r * (w->cols / 2);
    const uint8_t *sc = w->scale + r * (w->cols / NVFP4_GROUP);

#if defined(__x86_64__)
    if (!out64 && cpu_isa_has(CPU_ISA_AVX2)) {
        nvfp4_row_decode32_avx2(w, r, out32);
        return;
    }
#endif

    for (int64_t g = 0; g < w->cols / NVFP4_GROUP; g++) {
        double s64 = (double)cpu_e4m3[sc[g]] * (double)w->gscale;
        float s32 = cpu_e4m3[sc[g]] * w->gscale;
        for (int j = 0; j < NVFP4_GROUP; j++) {
            int64_t c = g * NVFP4_GROUP + j;
            float v = cpu_e2m1[(q[c / 2] >> (4 * (c % 2))) & 15];
            if (out64)
                out64[c] = (double)v * s64;
            else
                out32[c] = v * s32;
        }
    }
}

float cpu_nvfp4_get(const struct bweight *w, int64_t row, int64_t col)
{
    uint8_t b = ((const uint8_t *)w->data)[row * (w->cols / 2) + col / 2];
    return cpu_e2m1[(b >> (4 * (col % 2))) & 15] * cpu_e4m3[w->scale[row * (w->cols / NVFP4_GROUP) + col / NVFP4_GROUP]] *
           w->gscale;
}

void cpu_matmul_nvfp4_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf)
{
    cpu_matmul_decoded_rows(w, nvfp4_weight_row, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
