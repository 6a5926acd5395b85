/* matmul-lowp512.c - the AVX-512 fast path of the FP8 (matmul-fp8.c) and NVFP4
 * (matmul-nvfp4.c) matmuls: the decode fused into a rows x tokens register-blocked GEMM
 * (docs/PERFORMANCE.md §4.3a).
 *
 * A tile of LOWP512_NR rows is decoded 16 columns at a time into zmm registers - FP8: the
 * E4M3 bytes shifted into fp16 bit fields and widened by vcvtph2ps (code x 2^-8, exact),
 * times the 128-column block's scale x 2^8 (one rounding: the buffered decode's value bit
 * for bit); NVFP4: the group's 8 bytes spread so lane k holds nibble k, vpermps through
 * the 16-entry signed E2M1 table, times the group's E4M3 scale (exact) - and each decoded
 * vector is FMAed into up to LOWP512_NT tokens, so one decode serves every token of the
 * block and the tile's rows (a few KiB) stay in L1 while further token blocks reread them.
 * Each (row, token) sum is one FMA chain over the columns in order, reduced by
 * _mm512_reduce_add_ps (NVFP4: times the global scale): the same whatever the tile shape,
 * so a token's outputs do not depend on how many tokens share the call (batch
 * invariance), and an expert reached by one token computes what it would with sixteen.
 */
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

#if defined(__x86_64__)

/* 20 accumulators + 4 decoded rows + 1 activation + the decode's constants fit the 32
 * zmm registers */
#define LOWP512_NR 4
#define LOWP512_NT 5

#define AI __attribute__((always_inline))

/* FP8 codes q[0..15] times s (the block scale x 2^8) */
CPU_FN_AVX512 static inline AI __m512 fp8_dec16(const uint8_t *q, __m256i mask, __m512 s)
{
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));

    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), mask);
    return _mm512_mul_ps(_mm512_cvtph_ps(h), s);
}

/* the 16 nibbles of q[0..7] in column order times s (the group's E4M3 scale) */
CPU_FN_AVX512 static inline AI __m512 nvfp4_dec16(const uint8_t *q, __m512i idx, __m512i sh, __m512 lut, __m512 s)
{
    __m512i v = _mm512_zextsi128_si512(_mm_loadl_epi64((const __m128i *)q));

    v = _mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, v), sh);
    return _mm512_mul_ps(_mm512_permutexvar_ps(v, lut), s);
}

static inline float fp8_block_scale(const struct bweight *w, int64_t r, int64_t col)
{
    float s;

    memcpy(&s, w->scale + 4 * ((r / w->blk_rows) * (w->cols / w->blk_cols) + col / w->blk_cols), 4);
    return s;
}

/* rows r..r+nr-1 against tokens xt[0..nt-1]: out[i * LOWP512_NT + t]; nr and nt are
 * compile-time constants at every call (lowp512_tile's switch), so acc stays in registers.
 * pf (the first token block): prefetch the next nr rows (contiguous after these) into L1
 * at nr times this tile's pace, so they arrive as this tile ends */
CPU_FN_AVX512 static inline AI void lowp512_tile(const struct bweight *w, bool fp8, int64_t r, const int nr,
                                                const float *const *xt, const int nt, float *out, bool pf)
{
    __m512 acc[LOWP512_NR][LOWP512_NT], wv[LOWP512_NR], s[LOWP512_NR];
    const int64_t cols = w->cols;

#pragma GCC unroll 4
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++)
            acc[i][t] = _mm512_setzero_ps();
    if (fp8) {
        const uint8_t *q = (const uint8_t *)w->data + r * cols;
        const __m256i mask = _mm256_set1_epi16((short)0xbf80);

        for (int64_t b = 0; b < cols; b += w->blk_cols) {
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                s[i] = _mm512_set1_ps(fp8_block_scale(w, r + i, b) * 0x1p8f);
            for (int64_t j = b; j < b + w->blk_cols; j += 16) {
                if (pf)
                    _mm_prefetch((const char *)q + nr * cols + nr * j, _MM_HINT_T0);
#pragma GCC unroll 4
                for (int i = 0; i < nr; i++)
                    wv[i] = fp8_dec16(q + i * cols + j, mask, s[i]);
#pragma GCC unroll 5
                for (int t = 0; t < nt; t++) {
                    const __m512 xv = _mm512_loadu_ps(xt[t] + j);
#pragma GCC unroll 4
                    for (int i = 0; i < nr; i++)
                        acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
                }
            }
        }
    } else {
        const uint8_t *q = (const uint8_t *)w->data + r * (cols / 2);
        const uint8_t *sc = w->scale + r * (cols / NVFP4_GROUP);
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        const __m512 lut = _mm512_loadu_ps(cpu_e2m1);

        for (int64_t g = 0; g < cols / NVFP4_GROUP; g++) {
            if (pf && g % 2 == 0)
                _mm_prefetch((const char *)q + nr * (cols / 2) + nr * g * 8, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                wv[i] = nvfp4_dec16(q + i * (cols / 2) + g * 8, idx, sh, lut,
                                    _mm512_set1_ps(cpu_e4m3[sc[i * (cols / NVFP4_GROUP) + g]]));
#pragma GCC unroll 5
            for (int t = 0; t < nt; t++) {
                const __m512 xv = _mm512_loadu_ps(xt[t] + g * NVFP4_GROUP);
#pragma GCC unroll 4
                for (int i = 0; i < nr; i++)
                    acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++)
#pragma GCC unroll 5
        for (int t = 0; t < nt; t++)
            out[i * LOWP512_NT + t] = fp8 ? _mm512_reduce_add_ps(acc[i][t])
                                          : _mm512_reduce_add_ps(acc[i][t]) * w->gscale;
}

#define TILE_CASE(NRV, NTV)                                                                       \
    case (NRV) * 8 + (NTV):                                                                       \
        if (fp8)                                                                                  \
            lowp512_tile(w, true, r, NRV, xt, NTV, out, pf);                                          \
        else                                                                                      \
            lowp512_tile(w, false, r, NRV, xt, NTV, out, pf);                                         \
        break;
#define TILE_CASES(NRV) TILE_CASE(NRV, 1) TILE_CASE(NRV, 2) TILE_CASE(NRV, 3) TILE_CASE(NRV, 4) TILE_CASE(NRV, 5)

CPU_FN_AVX512 static void lowp512_tile_any(const struct bweight *w, bool fp8, int64_t r, int nr,
                                           const float *const *xt, int nt, float *out, bool pf)
{
    switch (nr * 8 + nt) {
    TILE_CASES(1)
    TILE_CASES(2)
    TILE_CASES(3)
    TILE_CASES(4)
    default:
        break;
    }
}

void cpu_matmul_lowp512_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1)
{
    const bool fp8 = w->fmt == WFMT_FP8;

    for (int64_t r = r0; r < r1; r += LOWP512_NR) {
        const int nr = r1 - r < LOWP512_NR ? (int)(r1 - r) : LOWP512_NR;

        for (int i0 = 0; i0 < n; i0 += LOWP512_NT) {
            const int nt = n - i0 < LOWP512_NT ? n - i0 : LOWP512_NT;
            const float *xt[LOWP512_NT];
            float out[LOWP512_NR * LOWP512_NT];

            for (int t = 0; t < nt; t++)
                xt[t] = x + (int64_t)(xidx ? xidx[i0 + t] : i0 + t) * w->cols;
            lowp512_tile_any(w, fp8, r, nr, xt, nt, out, i0 == 0);
            for (int i = 0; i < nr; i++)
                for (int t = 0; t < nt; t++)
                    y[(int64_t)(i0 + t) * ldy + (r + i - r0)] = out[i * LOWP512_NT + t];
        }
    }
}

#endif
