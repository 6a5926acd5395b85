/* matmul-fp8-bf16.c - the FP8 fast path at level vnni on CPUs with AVX-512 BF16 and without
 * AVX512-FP16 in use (AMD Zen 4 / Zen 5; hosts with it take matmul-fp8-fp16.c) (docs/PERFORMANCE.md
 * §4.3a): BF16 dot products (vdpbf16ps) with the block scale moved onto the activations.
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
 * matmul-lowp512.c.  With AVX-512 VBMI and 64-column multiples (fb_fits64), a 64-column
 * form decodes 64 codes with two vpermi2b byte lookups (fb_dec64), its columns in an
 * interleaved order that the activations are written in (fb_act): a third of the
 * decode's instructions, which were most of the cost at the 1-3 tokens an expert gets.  The
 * first token pass over a tile prefetches the tile FB_PF2 ahead into L2 and nothing into L1
 * (the hardware's L1 streams follow the 4 rows): a software L1 prefetch of the whole next
 * tile, 16 KiB in a 32 KiB L1 beside the activations, and a nearer L2 one left the routed
 * decode at 0.85-0.9 of MXFP4's share of the bandwidth (docs/PERFORMANCE.md §4.3a).  The
 * error is the activations' rounding to BF16: |err| <= 2^-8 · Σ|w·x| plus fp32 accumulation
 * (test-lowp at level vnni).  At level amx the 64-column form runs its products on AMX-BF16
 * tiles instead (cpu_matmul_fp8_amx_rows, below; test-lowp at level amx).
 */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

int cpu_fp8_amx_on;

__attribute__((constructor)) static void fa_env(void)
{
    const char *e = getenv("STEPD_CPU_FP8_AMX");

    cpu_fp8_amx_on = e && *e && strcmp(e, "0") != 0;
}

#if defined(__x86_64__)

#define FB_TILE 4       /* rows decoded together */
#define FB_NT 4         /* tokens per pass over a tile */
#define FB_TB 16        /* tokens converted per block (fits CPU_LOWP_BUF) */
#define FB_PF2 8        /* tiles ahead that the first token pass prefetches into L2 */

#define FB_TARGET CPU_TARGET_VNNI ",avx512bf16"
#define FB_FN __attribute__((target(FB_TARGET)))

#define FB64_TARGET FB_TARGET ",avx512vbmi"
#define FB64_FN __attribute__((target(FB64_TARGET)))

static uint16_t fb_sub_tab[32];    /* BF16 of E4M3 subnormal m: m · 2^-9 (0 for m = 0) */
/* the BF16 of every E4M3 magnitude (7 bits; 0x7f, NaN, never reaches a kernel), its high
 * and its low byte: fb_dec64's vpermi2b tables */
static uint8_t fb_hi_tab[128], fb_lo_tab[128];
static bool fb_host, fb_vbmi;

__attribute__((constructor)) static void fb_init(void)
{
    for (int m = 0; m < 8; m++) {
        float f = (float)m * 0x1p-9f;
        uint32_t b;

        memcpy(&b, &f, 4);
        fb_sub_tab[m] = (uint16_t)(b >> 16);
    }
    for (int mag = 0; mag < 128; mag++) {
        uint16_t b = mag < 8 ? fb_sub_tab[mag] : (uint16_t)((mag << 4) + (120 << 7));

        fb_hi_tab[mag] = (uint8_t)(b >> 8);
        fb_lo_tab[mag] = (uint8_t)b;
    }
    __builtin_cpu_init();
    fb_host = __builtin_cpu_supports("avx512bf16");
    fb_vbmi = __builtin_cpu_supports("avx512vbmi");
}

/* the 64-column form (fb_rows64) where the host has AVX-512 VBMI and the columns and the
 * scale blocks' width are multiples of 64 */
static bool fb_fits64(const struct bweight *w)
{
    return fb_vbmi && w->cols % 64 == 0 && w->blk_cols % 64 == 0;
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

/* the accumulators of fb_tile and fb_tile64: nt tokens x FB_TILE rows, from +0 */
FB_FN static inline __attribute__((always_inline)) void fb_acc_zero(__m512 acc[][FB_TILE], const int nt)
{
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++)
            acc[j][rr] = _mm512_setzero_ps();
}

/* out[j][rr]: each accumulator's lanes summed (_mm512_reduce_add_ps's fixed order) */
FB_FN static inline __attribute__((always_inline)) void fb_acc_out(__m512 acc[][FB_TILE], const int nt,
                                                                   float out[][FB_TILE])
{
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++)
            out[j][rr] = _mm512_reduce_add_ps(acc[j][rr]);
}

/* rows rw[0..3] against nt tokens' BF16 activations xt[]: out[j][rr]; pf2: the tile FB_PF2
 * ahead, to prefetch into L2 at 4x the tile's pace (its rows are contiguous), or NULL */
FB_FN static inline __attribute__((always_inline)) void
fb_tile(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, const int nt, float out[][FB_TILE],
        const uint8_t *pf2)
{
    const __m512i tab = _mm512_loadu_si512(fb_sub_tab);
    __m512 acc[FB_NT][FB_TILE];

    fb_acc_zero(acc, nt);
    for (int64_t c = 0; c < cols; c += 32) {
        __m512i wv[FB_TILE];

        if (pf2) {
            _mm_prefetch((const char *)pf2 + 4 * c, _MM_HINT_T1);
            _mm_prefetch((const char *)pf2 + 4 * c + 64, _MM_HINT_T1);
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
    fb_acc_out(acc, nt, out);
}

/* tile(...) for nt tokens (1..FB_NT), each count compiled with its accumulators in registers */
#define FB_BY_NT(tile)                                          \
    switch (nt) {                                               \
    case 1: tile(rw, cols, xt, 1, out, pf2); break;             \
    case 2: tile(rw, cols, xt, 2, out, pf2); break;             \
    case 3: tile(rw, cols, xt, 3, out, pf2); break;             \
    default: tile(rw, cols, xt, FB_NT, out, pf2); break;        \
    }

FB_FN static void fb_tile_any(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, int nt,
                              float out[][FB_TILE], const uint8_t *pf2)
{
    FB_BY_NT(fb_tile)
}

/* token row x (cols floats) times row block rb's column-block scales, as BF16 into xb; w64:
 * in fb_dec64's column order, per 64 columns [c0-7, c16-23, c32-39, c48-55] then [c8-15,
 * c24-31, c40-47, c56-63] (the same BF16 values, rearranged by two vpermt2w) */
/* fb_act64's word indices: *ia [0-7, 16-23, 32-39, 48-55], *ib [8-15, 24-31, 40-47, 56-63] */
FB_FN static inline __attribute__((always_inline)) void fb_act_idx(__m512i *ia, __m512i *ib)
{
    uint16_t ka[32], kb[32];

    for (int k = 0; k < 32; k++) {
        ka[k] = (uint16_t)(16 * (k / 8) + k % 8);
        kb[k] = (uint16_t)(ka[k] + 8);
    }
    *ia = _mm512_loadu_si512(ka);
    *ib = _mm512_loadu_si512(kb);
}

/* 64 columns at x times sv, as BF16 in fb_dec64's order: *a and *b (fb_act_idx's ia, ib) */
FB_FN static inline __attribute__((always_inline)) void fb_act64(const float *x, __m512 sv, __m512i ia, __m512i ib,
                                                                 __m512i *a, __m512i *b)
{
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), sv),
                                                   _mm512_mul_ps(_mm512_loadu_ps(x), sv));
    const __m512i q = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 48), sv),
                                                   _mm512_mul_ps(_mm512_loadu_ps(x + 32), sv));

    *a = _mm512_permutex2var_epi16(v, ia, q);
    *b = _mm512_permutex2var_epi16(v, ib, q);
}

/* row block rb's scale of column block cb */
static inline float fb_scale(const struct bweight *w, int64_t rb, int64_t cb)
{
    float s;

    memcpy(&s, w->scale + 4 * (rb * (w->cols / w->blk_cols) + cb), 4);
    return s;
}

FB_FN static void fb_act(const struct bweight *w, int64_t rb, const float *x, uint16_t *xb, bool w64)
{
    const int64_t ncb = w->cols / w->blk_cols;
    __m512i ia, ib;

    fb_act_idx(&ia, &ib);
    for (int64_t cb = 0; cb < ncb; cb++) {
        const __m512 sv = _mm512_set1_ps(fb_scale(w, rb, cb));

        for (int64_t c = cb * w->blk_cols; c < (cb + 1) * w->blk_cols; c += w64 ? 64 : 32) {
            if (w64) {
                __m512i a, b;

                fb_act64(x + c, sv, ia, ib, &a, &b);
                _mm512_storeu_si512(xb + c, a);
                _mm512_storeu_si512(xb + c + 32, b);
                continue;
            }
            _mm512_storeu_si512(xb + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + c + 16), sv),
                                                                     _mm512_mul_ps(_mm512_loadu_ps(x + c), sv)));
        }
    }
}

/* 64 E4M3 codes at q as BF16, exact, in the order [c0-7, c16-23, c32-39, c48-55] (*a) and
 * [c8-15, c24-31, c40-47, c56-63] (*b): the high and the low byte of each magnitude's BF16
 * through one vpermi2b each (the index's bit 7, the sign, is ignored), the sign put into
 * the high byte, and the bytes interleaved per 128-bit lane */
FB64_FN static inline __attribute__((always_inline)) void
fb_dec64(const uint8_t *q, __m512i th0, __m512i th1, __m512i tl0, __m512i tl1, __m512i *a, __m512i *b)
{
    const __m512i v = _mm512_loadu_si512(q);
    __m512i hi = _mm512_permutex2var_epi8(th0, v, th1);
    const __m512i lo = _mm512_permutex2var_epi8(tl0, v, tl1);

    hi = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8((char)0x80), 0xf8);
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}

/* fb_tile on the 64-column form: xt[j] holds token j's activations in fb_dec64's order */
FB64_FN static inline __attribute__((always_inline)) void
fb_tile64(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, const int nt, float out[][FB_TILE],
          const uint8_t *pf2)
{
    const __m512i th0 = _mm512_loadu_si512(fb_hi_tab), th1 = _mm512_loadu_si512(fb_hi_tab + 64);
    const __m512i tl0 = _mm512_loadu_si512(fb_lo_tab), tl1 = _mm512_loadu_si512(fb_lo_tab + 64);
    __m512 acc[FB_NT][FB_TILE];

    fb_acc_zero(acc, nt);
    for (int64_t c = 0; c < cols; c += 64) {
        if (pf2) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                _mm_prefetch((const char *)pf2 + 4 * c + 64 * k, _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < FB_TILE; rr++) {
            __m512i wa, wb;

            fb_dec64(rw[rr] + c, th0, th1, tl0, tl1, &wa, &wb);
#pragma GCC unroll 4
            for (int j = 0; j < nt; j++) {
                acc[j][rr] = _mm512_dpbf16_ps(acc[j][rr], (__m512bh)wa, (__m512bh)_mm512_loadu_si512(xt[j] + c));
                acc[j][rr] = _mm512_dpbf16_ps(acc[j][rr], (__m512bh)wb,
                                              (__m512bh)_mm512_loadu_si512(xt[j] + c + 32));
            }
        }
    }
    fb_acc_out(acc, nt, out);
}

FB64_FN static void fb_tile64_any(const uint8_t *const *rw, int64_t cols, const uint16_t *const *xt, int nt,
                                  float out[][FB_TILE], const uint8_t *pf2)
{
    FB_BY_NT(fb_tile64)
}

FB_FN void cpu_matmul_fp8_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                    int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    const int64_t cols = w->cols;
    const uint8_t *data = w->data;
    uint16_t *xb = (uint16_t *)rowbuf;
    const bool w64 = fb_fits64(w);

    /* row blocks (one set of scales each), then token blocks within them */
    for (int64_t b0 = r0; b0 < r1;) {
        const int64_t rb = b0 / w->blk_rows;
        const int64_t b1 = (rb + 1) * w->blk_rows < r1 ? (rb + 1) * w->blk_rows : r1;

        for (int i0 = 0; i0 < n; i0 += FB_TB) {
            const int i1 = n - i0 < FB_TB ? n : i0 + FB_TB;

            for (int i = i0; i < i1; i++)
                fb_act(w, rb, x + (int64_t)(xidx ? xidx[i] : i) * cols, xb + (int64_t)(i - i0) * cols, w64);
            for (int64_t r = b0; r < b1; r += FB_TILE) {
                const int nr = b1 - r < FB_TILE ? (int)(b1 - r) : FB_TILE;
                const uint8_t *rw[FB_TILE];
                const uint8_t *pf2 = r + FB_PF2 * FB_TILE < r1 ? data + (r + FB_PF2 * FB_TILE) * cols : NULL;

                for (int rr = 0; rr < FB_TILE; rr++)
                    rw[rr] = data + (r + (rr < nr ? rr : nr - 1)) * cols;
                for (int i = i0; i < i1; i += FB_NT) {
                    const int nt = i1 - i < FB_NT ? i1 - i : FB_NT;
                    const uint16_t *xt[FB_NT];
                    float out[FB_NT][FB_TILE];

                    for (int j = 0; j < nt; j++)
                        xt[j] = xb + (int64_t)(i - i0 + j) * cols;
                    (w64 ? fb_tile64_any : fb_tile_any)(rw, cols, xt, nt, out, i == i0 ? pf2 : NULL);
                    for (int j = 0; j < nt; j++)
                        for (int rr = 0; rr < nr; rr++)
                            y[(int64_t)(i + j) * ldy + (r + rr - r0)] = out[j][rr];
                }
            }
        }
        b0 = b1;
    }
}

/* ---- Level amx: the same products on AMX-BF16 tiles ----
 *
 * Per group of 16 rows (inside one row block) and 64-column step, fb_dec64 decodes each
 * row's 64 codes into two 32-value halves, stored as the rows of two A tiles (16 x 64
 * bytes, on the stack); the B tiles hold the token block's nt (<= 16) tokens' scaled BF16
 * activations in fb_dec64's column order, in VNNI form: dword d (BF16 pair d of a row in
 * that order) of token t at d nt + t (fa_pack), so the B tile of a half is 16 rows of
 * 4 nt bytes, contiguous, and its column t is token t's pairs (the B and C tiles are
 * configured nt columns wide, per token block: a 16-column B tile read with a 4-byte
 * stride at one token cost 6x a contiguous one).  One TDPBF16PS per half, into four C
 * tiles in turn (k-steps 4j .. 4j + 3, so no tile waits on the one before), summed at the
 * end as (C0 + C1) + (C2 + C3).  C[m][t] depends on A row m, B column t and C[m][t] alone,
 * updated in increasing k, so a token's outputs do not depend on the tokens beside it,
 * their count or the tiles' width: batch-invariant like the vdpbf16ps form.  The
 * multiplies leave the vector ports to the decode: on the Intel AMX host vdpbf16ps issues
 * one per 2 cycles (0.8 ns each against 0.19 for an FMA), so that form paid as much for
 * the dot as for the decode at one token and 4x as much at four (docs/PERFORMANCE.md
 * §4.3a).  The tile loads of a step come before the next step's decode stores in program
 * order (two A buffers), so they do not wait for them.  TDPBF16PS treats BF16 denormals as
 * zero and rounds its fp32 sums to nearest even, as vdpbf16ps does: the same error bound.
 * The first token block prefetches the group FA_PF ahead into L2, 1 KiB per step (its 16
 * rows are contiguous).  Each call loads its configuration and puts back the one it found
 * (matmul-amx.c loads its own once per thread and keeps it); none found, its own stays. */

#define FA_ROWS 16      /* rows per C tile */
#define FA_TB 16        /* tokens per B tile (fits CPU_LOWP_BUF) */
#define FA_PF 2         /* groups ahead that the first token block prefetches into L2 */

#define FA_TARGET FB64_TARGET ",amx-tile,amx-bf16"
#define FA_FN __attribute__((target(FA_TARGET)))

bool cpu_fp8_amx_fits(const struct bweight *w)
{
    return cpu_fp8_amx_on && cpu_fp8_bf16_fits(w) && fb_fits64(w) && cpu_isa_has(CPU_ISA_AMX);
}

/* palette 1 for nt tokens: C tiles 0-3 and B tiles 6-7 of 16 rows x nt dwords (a B row, one
 * BF16 pair of nt tokens, is 4 nt contiguous bytes), A tiles 4-5 of 16 rows x 64 bytes */
FA_FN static void fa_config(int nt)
{
    const uint16_t b = (uint16_t)(4 * nt), colsb[8] = {b, b, b, b, 64, 64, b, b};

    cpu_tile_config16(colsb);
}

/* tokens i0 .. i0 + nt - 1 of x (through xidx) times row block rb's scales, as BF16 in
 * fb_dec64's order, into xb in the B tiles' form: dword d of token t at d nt + t */
FA_FN static void fa_pack(const struct bweight *w, int64_t rb, const float *x, const int32_t *xidx, int i0, int nt,
                          uint32_t *xb)
{
    const int64_t cols = w->cols, ncb = cols / w->blk_cols;
    const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(nt));
    __m512i ia, ib;

    fb_act_idx(&ia, &ib);
    for (int t = 0; t < nt; t++) {
        const float *xr = x + (int64_t)(xidx ? xidx[i0 + t] : i0 + t) * cols;

        for (int64_t cb = 0; cb < ncb; cb++) {
            const __m512 sv = _mm512_set1_ps(fb_scale(w, rb, cb));

            for (int64_t c = cb * w->blk_cols; c < (cb + 1) * w->blk_cols; c += 64) {
                __m512i a, b;

                fb_act64(xr + c, sv, ia, ib, &a, &b);
                if (nt == 1) {
                    _mm512_storeu_si512(xb + c / 2, a);
                    _mm512_storeu_si512(xb + c / 2 + 16, b);
                    continue;
                }
                _mm512_i32scatter_epi32(xb + t + c / 2 * nt, step, a, 4);
                _mm512_i32scatter_epi32(xb + t + (c / 2 + 16) * nt, step, b, 4);
            }
        }
    }
}

FA_FN void cpu_matmul_fp8_amx_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                   int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    const int64_t cols = w->cols;
    const uint8_t *data = w->data;
    uint32_t *xb = (uint32_t *)rowbuf;
    const __m512i th0 = _mm512_loadu_si512(fb_hi_tab), th1 = _mm512_loadu_si512(fb_hi_tab + 64);
    const __m512i tl0 = _mm512_loadu_si512(fb_lo_tab), tl1 = _mm512_loadu_si512(fb_lo_tab + 64);
    uint16_t at[2][2][FA_ROWS][32] __attribute__((aligned(64)));
    float ct[4][FA_ROWS][16] __attribute__((aligned(64)));
    struct cpu_tilecfg had;
    int cfg_nt = 0;     /* the token count the loaded configuration is for (0: none yet) */

    cpu_tile_storeconfig(&had);
    memset(at, 0, sizeof(at));  /* the A rows past a short group's: finite, never stored */
    for (int64_t b0 = r0; b0 < r1;) {
        const int64_t rb = b0 / w->blk_rows;
        const int64_t b1 = (rb + 1) * w->blk_rows < r1 ? (rb + 1) * w->blk_rows : r1;

        for (int i0 = 0; i0 < n; i0 += FA_TB) {
            const int nt = n - i0 < FA_TB ? n - i0 : FA_TB;

            if (nt != cfg_nt) {
                fa_config(nt);
                cfg_nt = nt;
            }
            fa_pack(w, rb, x, xidx, i0, nt, xb);
            for (int64_t r = b0; r < b1; r += FA_ROWS) {
                const int nr = b1 - r < FA_ROWS ? (int)(b1 - r) : FA_ROWS;
                const uint8_t *rw = data + r * cols;
                const uint8_t *pf = i0 == 0 && r + FA_PF * FA_ROWS < r1 ? data + (r + FA_PF * FA_ROWS) * cols : NULL;

                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                /* the tiles multiply step c - 64 (decoded into at[(c / 64 + 1) % 2] on the
                 * previous pass, its stores done), then step c is decoded into at[c / 64 % 2]:
                 * the tile loads come before this pass's stores, so they need not wait for
                 * them, and the decode runs while the tiles multiply */
                for (int64_t c = 0; c <= cols; c += 64) {
                    if (c > 0) {
                        uint16_t (*ab)[FA_ROWS][32] = at[(c / 64 + 1) % 2];
                        const uint32_t *bt = xb + (c - 64) / 2 * nt;

                        CPU_TILE_LOADD(4, ab[0], 64);
                        CPU_TILE_LOADD(6, bt, 4 * nt);
                        CPU_TILE_LOADD(5, ab[1], 64);
                        CPU_TILE_LOADD(7, bt + 16 * nt, 4 * nt);
                        if ((c / 64) % 2) {
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 5, 7);
                        } else {
                            _tile_dpbf16ps(2, 4, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    if (c < cols) {
                        uint16_t (*ab)[FA_ROWS][32] = at[c / 64 % 2];

                        if (pf) {
                            /* 16 rows x 64 bytes ahead per step: the group FA_PF ahead over this one */
#pragma GCC unroll 16
                            for (int k = 0; k < 16; k++)
                                _mm_prefetch((const char *)pf + 16 * c + 64 * k, _MM_HINT_T1);
                        }
                        for (int rr = 0; rr < nr; rr++) {
                            __m512i a, b;

                            fb_dec64(rw + rr * cols + c, th0, th1, tl0, tl1, &a, &b);
                            _mm512_store_si512(ab[0][rr], a);
                            _mm512_store_si512(ab[1][rr], b);
                        }
                    }
                }
                _tile_stored(0, ct[0], 64);
                _tile_stored(1, ct[1], 64);
                _tile_stored(2, ct[2], 64);
                _tile_stored(3, ct[3], 64);
                for (int t = 0; t < nt; t++)
                    for (int rr = 0; rr < nr; rr++)
                        y[(int64_t)(i0 + t) * ldy + (r + rr - r0)] = (ct[0][rr][t] + ct[1][rr][t]) +
                                                                     (ct[2][rr][t] + ct[3][rr][t]);
            }
        }
        b0 = b1;
    }
    /* the configuration in place before, if any (matmul-amx.c keeps its own loaded per
     * thread); none: this one stays */
    if (had.palette && cfg_nt)
        cpu_tile_loadconfig(&had);
}


#else

bool cpu_fp8_bf16_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

bool cpu_fp8_amx_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

#endif
