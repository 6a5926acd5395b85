/* matmul-fp8-bf16.c - the FP8 fast path at level vnni on CPUs with AVX-512 BF16
 * (docs/PERFORMANCE.md §4.3a): BF16 dot products (vdpbf16ps) with the block scale moved
 * onto the activations.
 *
 * A 128x128 block's scale is shared by the rows of its row block, so for each row block
 * the tokens' activations are multiplied by the scales of its column blocks and rounded
 * to BF16 once (one multiply per token and column per row block, in the caller's
 * per-thread row buffer), and the rows' E4M3 codes enter the dot product unscaled.  E4M3
 * converts to BF16 exactly: the magnitude's 7 bits shifted into the BF16 fields and the
 * exponent rebiased (+120) for normal codes, the 8 subnormal codes (and 0) through a table
 * (vdpbf16ps treats BF16 subnormals as zero; m·2^-9 is a BF16 normal), the sign xored in.
 * A tile of 4 rows is decoded 32 columns at a time and each decoded vector is multiplied
 * into up to 4 tokens; each (row, token) sum is one vdpbf16ps chain over the columns in
 * order, reduced by _mm512_reduce_add_ps, whatever the tile: batch-invariant, like
 * matmul-lowp512.c.  The error is the activations' rounding to BF16: |err| <= 2^-8 ·
 * Σ|w·x| plus fp32 accumulation (test-lowp at level vnni).
 */
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

#if defined(__x86_64__)

#define FB_TILE 4       /* rows decoded together */
#define FB_NT 4         /* tokens per pass over a tile */
#define FB_TB 12        /* tokens converted per block (fits CPU_LOWP_BUF) */

#define FB_TARGET CPU_TARGET_VNNI ",avx512bf16"
#define FB_FN __attribute__((target(FB_TARGET)))

static uint16_t fb_sub_tab[32];    /* BF16 of E4M3 subnormal m: m · 2^-9 (0 for m = 0) */
static bool fb_host;

__attribute__((constructor)) static void fb_init(void)
{
    for (int m = 0; m < 8; m++) {
        float f = (float)m * 0x1p-9f;
        uint32_t b;

        memcpy(&b, &f, 4);
        fb_sub_tab[m] = (uint16_t)(b >> 16);
    }
    __builtin_cpu_init();
    fb_host = __builtin_cpu_supports("avx512bf16");
}

bool cpu_fp8_bf16_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && fb_host && cpu_isa_has(CPU_ISA_VNNI) && w->cols % 32 == 0 &&
           w->blk_cols % 32 == 0;
}

/* 32 E4M3 codes at q as BF16, exact */
FB_FN static inline __attribute__((always_inline)) __m512i fb_dec32(const uint8_t *q, __m512i tab)
{
    const __m512i sx = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
    const __m512i mag = _mm512_and_si512(sx, _mm512_set1_epi16(0x7f));
    __m512i t = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(sx, _mm512_set1_epi16(0x78));

    t = _mm512_mask_permutexvar_epi16(t, sub, mag, tab);
    /* t | (sx & 0x8000): the sign */
    return _mm512_ternarylogic_epi32(t, sx, _mm512_set1_epi16((short)0x8000), 0xf8);
}

/* rows rw[0..3] against nt tokens' BF16 activations xt[]: out[j][rr] */
FB_FN static inline __attribute__((always_inline)) void
fb_tile(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, const int nt, float out[][FB_TILE],
        const uint8_t *pf)
{
    const __m512i tab = _mm512_loadu_si512(fb_sub_tab);
    __m512 acc[FB_NT][FB_TILE];

#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++)
            acc[j][rr] = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 32) {
        __m512i wv[FB_TILE];

        if (pf) {
            _mm_prefetch((const char *)pf + 4 * c, _MM_HINT_T0);
            _mm_prefetch((const char *)pf + 4 * c + 64, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++)
            wv[rr] = fb_dec32(rw[rr] + c, tab);
#pragma GCC unroll 4
        for (int j = 0; j < nt; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xt[j] + c);
#pragma GCC unroll 4
            for (int rr = 0; rr < FB_TILE; rr++)
                acc[j][rr] = _mm512_dpbf16_ps(acc[j][rr], (__m512bh)wv[rr], xv);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++)
            out[j][rr] = _mm512_reduce_add_ps(acc[j][rr]);
}

FB_FN static void fb_tile_any(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, int nt,
                              float out[][FB_TILE], const uint8_t *pf)
{
    switch (nt) {
    case 1: fb_tile(rw, cols, xt, 1, out, pf); break;
    case 2: fb_tile(rw, cols, xt, 2, out, pf); break;
    case 3: fb_tile(rw, cols, xt, 3, out, pf); break;
    default: fb_tile(rw, cols, xt, 4, out, pf); break;
    }
}

/* token row x (cols floats) times row block rb's column-block scales, as BF16 into xb */
FB_FN static void fb_act(const struct bweight *w, int64_t rb, const float *x, uint16_t *xb)
{
    const int64_t ncb = w->cols / w->blk_cols;

    for (int64_t cb = 0; cb < ncb; cb++) {
        float s;

        memcpy(&s, w->scale + 4 * (rb * ncb + cb), 4);
        const __m512 sv = _mm512_set1_ps(s);
        for (int64_t c = cb * w->blk_cols; c < (cb + 1) * w->blk_cols; c += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + c + 16), sv),
                                             _mm512_mul_ps(_mm512_loadu_ps(x + c), sv));
            _mm512_storeu_si512(xb + c, (__m512i)v);
        }
    }
}

FB_FN void cpu_matmul_fp8_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                    int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    const int64_t cols = w->cols;
    const uint8_t *data = w->data;
    uint16_t *xb = (uint16_t *)rowbuf;

    /* row blocks (one set of scales each), then token blocks within them */
    for (int64_t b0 = r0; b0 < r1;) {
        const int64_t rb = b0 / w->blk_rows;
        const int64_t b1 = (rb + 1) * w->blk_rows < r1 ? (rb + 1) * w->blk_rows : r1;

        for (int i0 = 0; i0 < n; i0 += FB_TB) {
            const int i1 = n - i0 < FB_TB ? n : i0 + FB_TB;

            for (int i = i0; i < i1; i++)
                fb_act(w, rb, x + (int64_t)(xidx ? xidx[i] : i) * cols, xb + (int64_t)(i - i0) * cols);
            for (int64_t r = b0; r < b1; r += FB_TILE) {
                const int nr = b1 - r < FB_TILE ? (int)(b1 - r) : FB_TILE;
                const uint8_t *rw[FB_TILE];
                const uint8_t *pf = r + FB_TILE < r1 ? data + (r + FB_TILE) * cols : NULL;

                for (int rr = 0; rr < FB_TILE; rr++)
                    rw[rr] = data + (r + (rr < nr ? rr : nr - 1)) * cols;
                for (int i = i0; i < i1; i += FB_NT) {
                    const int nt = i1 - i < FB_NT ? i1 - i : FB_NT;
                    const uint16_t *xt[FB_NT];
                    float out[FB_NT][FB_TILE];

                    for (int j = 0; j < nt; j++)
                        xt[j] = xb + (int64_t)(i - i0 + j) * cols;
                    fb_tile_any(rw, cols, xt, nt, out, i == i0 ? pf : NULL);
                    for (int j = 0; j < nt; j++)
                        for (int rr = 0; rr < nr; rr++)
                            y[(int64_t)(i + j) * ldy + (r + rr - r0)] = out[j][rr];
                }
            }
        }
        b0 = b1;
    }
}

#else

bool cpu_fp8_bf16_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

#endif
