/* matmul-nvfp4.c - NVFP4 weights (WFMT_NVFP4: E2M1 nibbles packed as MXFP4's, one E4M3
 * scale per 16 in-features, one F32 global scale; docs/MODEL.md §5.7) through the
 * decoded-row driver of matmul-fp8.c: the exact path decodes to fp64 (e2m1 x e4m3 x the
 * F32 global scale is exact there: 3 + 4 + 24 bits); the fast path decodes in registers
 * and FMAs at once (nvfp4_row_fused_avx2, at every token count and in the same order:
 * batch-invariant), except where the int8 path of matmul-nvfp4-vnni.c fits (levels vnni
 * and avx2, columns a multiple of 64) and at level avx512 (matmul-lowp512.c). */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <string.h>

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

#if defined(__x86_64__)
/* Fused fast path: per 8 columns, the row's 32-bit word of 8 nibbles broadcast and shifted
 * so lane k holds nibble k (column order, no interleave); vpermps picks |E2M1| by its low 3
 * bits, and the sign comes from xoring in the nibble shifted to bits 28-31 (the table
 * entries carry bits 28-30 pre-xored with their index, so only bit 31 changes).  The
 * decoded 16 values are scaled by the group's E4M3 scale and FMAed into up to
 * CPU_FUSED_NT tokens at once; the global scale multiplies each sum once at the end.  One
 * row (cols / 2 bytes) stays in L1 while every token tile reads it. */
static uint32_t nvfp4_lut_x[8];

__attribute__((constructor)) static void nvfp4_lut_init(void)
{
    for (uint32_t i = 0; i < 8; i++) {
        uint32_t b;
        memcpy(&b, &cpu_e2m1[i], 4);
        nvfp4_lut_x[i] = b ^ (i << 28);
    }
}

/* group g of the row into c0[t] (columns 0-7) and c1[t] (8-15) of each token */
CPU_FN_AVX2
static inline void nvfp4_group_fused(const uint32_t *q, const uint8_t *sc, int64_t g, __m256 lut, __m256i sh,
                                     const float *const *xt, int nt, __m256 *c0, __m256 *c1)
{
    const __m256 s = _mm256_broadcast_ss(&cpu_e4m3[sc[g]]);
    uint32_t u0, u1;
    memcpy(&u0, q + 2 * g, 4);
    memcpy(&u1, q + 2 * g + 1, 4);
    __m256i n0 = _mm256_srlv_epi32(_mm256_set1_epi32((int)u0), sh);
    __m256i n1 = _mm256_srlv_epi32(_mm256_set1_epi32((int)u1), sh);
    __m256 w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, n0), _mm256_castsi256_ps(_mm256_slli_epi32(n0, 28)));
    __m256 w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, n1), _mm256_castsi256_ps(_mm256_slli_epi32(n1, 28)));
    w0 = _mm256_mul_ps(w0, s);
    w1 = _mm256_mul_ps(w1, s);
    for (int t = 0; t < nt; t++) {
        c0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt[t] + g * NVFP4_GROUP), c0[t]);
        c1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[t] + g * NVFP4_GROUP + 8), c1[t]);
    }
}

CPU_FN_AVX2
static inline void nvfp4_row_fused_avx2(const struct bweight *w, int64_t r, const float *const *xt, int nt,
                                        float *acc_out)
{
    const uint32_t *q = (const uint32_t *)((const uint8_t *)w->data + r * (w->cols / 2));
    const uint8_t *sc = w->scale + r * (w->cols / NVFP4_GROUP);
    const __m256 lut = _mm256_loadu_ps((const float *)nvfp4_lut_x);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256 a[4][CPU_FUSED_NT];
    int64_t ng = w->cols / NVFP4_GROUP, g = 0;

    for (int k = 0; k < 4; k++)
        for (int t = 0; t < nt; t++)
            a[k][t] = _mm256_setzero_ps();
    /* even and odd groups on separate chains: 4 FMA chains per token hide the FMA latency,
     * which bounded one token at ~4 weights per cycle; the same chains at every nt, so that
     * a token's sum does not depend on the tokens beside it (batch-invariant) */
    for (; g + 1 < ng; g += 2) {
        nvfp4_group_fused(q, sc, g, lut, sh, xt, nt, a[0], a[1]);
        nvfp4_group_fused(q, sc, g + 1, lut, sh, xt, nt, a[2], a[3]);
    }
    if (g < ng)
        nvfp4_group_fused(q, sc, g, lut, sh, xt, nt, a[0], a[1]);
    for (int t = 0; t < nt; t++) {
        float f[8];
        _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(a[0][t], a[1][t]), _mm256_add_ps(a[2][t], a[3][t])));
        acc_out[t] = cpu_lowp_hsum8(f) * w->gscale;
    }
}

/* nt tokens (1..CPU_FUSED_NT), each count compiled with its accumulators in registers */
CPU_FN_AVX2
static void nvfp4_row_fused(const struct bweight *w, int64_t r, const float *const *xt, int nt, float *out)
{
    switch (nt) {
    case 1: nvfp4_row_fused_avx2(w, r, xt, 1, out); break;
    case 2: nvfp4_row_fused_avx2(w, r, xt, 2, out); break;
    case 3: nvfp4_row_fused_avx2(w, r, xt, 3, out); break;
    default: nvfp4_row_fused_avx2(w, r, xt, CPU_FUSED_NT, out); break;
    }
}
#endif

void cpu_matmul_nvfp4_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf)
{
#if defined(__x86_64__)
    if (!exact && !cpu_lowp_fused_off && cpu_nvfp4_int8_fits(w)) {
        cpu_matmul_nvfp4_int8_rows(w, x, xidx, n, y, ldy, r0, r1, rowbuf);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_isa_has(CPU_ISA_AVX512)) {
        cpu_matmul_lowp512_rows(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
    if (!exact && !cpu_lowp_fused_off && cpu_isa_has(CPU_ISA_AVX2)) {
        cpu_matmul_fused_rows(w, nvfp4_row_fused, x, xidx, n, y, ldy, r0, r1);
        return;
    }
#endif
    cpu_matmul_decoded_rows(w, nvfp4_weight_row, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
