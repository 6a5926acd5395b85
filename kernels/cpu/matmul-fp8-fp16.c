/* matmul-fp8-fp16.c - the FP8 fast path on CPUs with AVX512-FP16 (Intel Sapphire Rapids and
 * later; docs/PERFORMANCE.md §4.3a): FP16 products and short FP16 sums, then the block
 * scale in FP32.
 *
 * On those cores vdpbf16ps and vpermi2b issue once per two cycles, so the BF16 form
 * (matmul-fp8-bf16.c) paid more for its decode and dot than MXFP4 does per byte; an FP16
 * FMA issues every cycle.  A row's E4M3 codes become FP16 bit fields, 32 per zmm
 * (vpmovsxbw, shift left 7, and 0xbf80: the code's value times 2^-8, exact, subnormals
 * included), and vfmadd231ph multiplies them into the token's FP16 activations.  Each lane
 * sums the products of one chunk (up to 128 columns of one scale block: 4 products per
 * lane) in FP16, then the 32 lane sums are widened by vcvtph2ps and FMAed in FP32 with the
 * chunk's multiplier m = block scale x 2^8 / prescale into the (row, token) accumulator.
 *
 * Activations: per token and chunk a power of two p (the prescale) from that token's own
 * values in the chunk, so amax|x| · p is in [2^12, 2^13): then |x·p| < 2^13, every product
 * |w·x·p| <= 1.75 · 2^13 and every 4-term lane sum <= 7 · 2^13 = 57344 < 65504 (no
 * overflow), and the large terms of a chunk stay far from FP16's subnormals.  x·p (vscalefps,
 * exact) is rounded once to FP16, packed once per call per token (per row block and token
 * block past FH_TB tokens) into the caller's per-thread row buffer with the chunks' exponents.
 *
 * Error bound (u = 2^-11, FP16's unit roundoff; k <= 4 roundings per lane chain: the product
 * of the first column and 3 FMAs): per rounding |err| <= u·|v| + 2^-25 (2^-25: half of FP16's
 * subnormal spacing), and x·p's rounding likewise, so per chunk of c columns
 *   |err| <= ((k + 1)·u + O(u^2)) · Σ|w·x|  +  m·2^-25 · (32·k + Σ|code·2^-8|)
 * and with 1/p <= amax|x| · 2^-12 the second term is <= scale · amax|x| · c · 2^-27.5; the
 * FP32 steps (exact widening, the multiply-add, the final lane reduction) add fp32 rounding.
 * test-lowp checks 5.05 · 2^-11 · Σ|w·x| + 2^-27 · Σ_chunks scale · amax|x| · c + 1e-5 Σ|w·x|
 * (random and adversarial data).  m = ldexpf(scale, e) (about scale · amax|x| · 2^-4.5) is
 * exact unless it leaves FP32's normal range: below ~2^-121 for scale · amax|x| (the terms
 * are that small too: an absolute error under 2^-128 per chunk), above ~2^132 (the products
 * overflow there, as on the other fast paths).
 *
 * Prefetch: the first token pass over a tile prefetches each of its 4 row streams FH_PF1
 * bytes ahead into L1 and FH_PF2 bytes ahead into L2 (prefetcht1), a stream continuing past
 * its row's end in the same row of the next tiles, as MXFP4's kernel does (1 KiB into L1,
 * 4 KiB into L2).  A row of the 4096-wide projections is one 4 KiB page, and the L2
 * streamer does not cross pages, so every row restarts it; with the L2 prefetch a row's
 * page is requested a whole row before the kernel gets there (the L1 prefetch only 1 KiB
 * before), so the restart is off the critical path.  On the Intel AMX host the L1 prefetch
 * alone put the routed decode at 0.93-0.99 of MXFP4's share of the bandwidth (the BF16
 * kernel's L2 prefetch of the tile 8 ahead: 0.88-0.93, none: 0.75-0.79); the L2 prefetch
 * took bench-kernels' B = 1 from a median of 0.98 to 1.04 of it (CPU time, 6 alternated
 * runs; 2, 8 KiB and prefetcht2 were within the noise of 4 KiB: docs/PERFORMANCE.md §4.3a).
 *
 * Batch invariance: a (row, token) sum is the same chunk sums in the same order into one
 * accumulator, reduced by _mm512_reduce_add_ps, whatever the tile (4 rows x up to 4 tokens),
 * the token count, the row range or the thread; the prescale depends on the token alone.
 */
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

int cpu_fp8_fp16_off;

#if defined(__x86_64__)

#define FH_TILE 4       /* rows decoded together */
#define FH_NT 4         /* tokens per pass over a tile */
#define FH_TB 12        /* tokens packed per block (fits CPU_LOWP_BUF with the chunk arrays) */
#define FH_CHUNK 128    /* columns of a chunk (at most 4 FP16 products per lane) */
#define FH_PF1 1024     /* bytes ahead in each row's stream that the first token pass
                         * prefetches into L1 (past the row's end: the next tile's row) */
#define FH_PF2 4096     /* and into L2 (prefetcht1): a 4096-column row's page ahead */

#define FH_FN __attribute__((target(CPU_TARGET_VNNI ",avx512fp16")))
#define FH_AI __attribute__((always_inline))

bool cpu_fp8_fp16_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && !cpu_fp8_fp16_off && cpu_avx512fp16() && w->cols % 32 == 0 &&
           w->blk_cols % 32 == 0;
}

/* the chunk geometry: chunks per scale block and in a row */
struct fh_geo {
    int64_t cols, bc, cpb, nch;
    bool l4;            /* every chunk is FH_CHUNK columns (blk_cols % 128 == 0) */
};

static struct fh_geo fh_geo(const struct bweight *w)
{
    struct fh_geo g = { .cols = w->cols, .bc = w->blk_cols, .cpb = (w->blk_cols + FH_CHUNK - 1) / FH_CHUNK };

    g.nch = w->cols / w->blk_cols * g.cpb;
    g.l4 = w->blk_cols % FH_CHUNK == 0;
    return g;
}

/* columns of chunk ch */
static inline int64_t fh_len(const struct fh_geo *g, int64_t ch)
{
    const int64_t off = ch % g->cpb * FH_CHUNK;

    return g->bc - off < FH_CHUNK ? g->bc - off : FH_CHUNK;
}

/* token row x (cols floats) as FP16 x·p per chunk into xh, and each chunk's exponent
 * e (m = scale · 2^e) into eo */
FH_FN static void fh_pack(const struct fh_geo *g, const float *x, uint16_t *xh, int32_t *eo)
{
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    int64_t c = 0;

    for (int64_t ch = 0; ch < g->nch; ch++) {
        const int64_t len = fh_len(g, ch);
        __m512 mx = _mm512_setzero_ps();
        int ex;

        for (int64_t k = 0; k < len; k += 16)
            mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(x + c + k), absm));
        /* amax in [2^(ex-1), 2^ex): p = 2^(13 - ex), m = scale · 2^8 / p */
        frexpf(_mm512_reduce_max_ps(mx), &ex);
        const __m512 pv = _mm512_set1_ps((float)(13 - ex));
        for (int64_t k = 0; k < len; k += 16)
            _mm256_storeu_si256((__m256i *)(xh + c + k),
                                _mm512_cvtps_ph(_mm512_scalef_ps(_mm512_loadu_ps(x + c + k), pv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        eo[ch] = ex - 5;
        c += len;
    }
}

/* 32 E4M3 codes at q as FP16 of code · 2^-8, exact */
FH_FN static inline FH_AI __m512h fh_dec32(const uint8_t *q, __m512i mask)
{
    const __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));

    return _mm512_castsi512_ph(_mm512_and_si512(_mm512_slli_epi16(h, 7), mask));
}

/* a prefetch stream of fh_tile: its offset from its row's current position and the bytes
 * from there to the row's end.  A row's stream continues past its end in the same row of
 * the next tiles, (FH_TILE - 1) rows further. */
struct fh_pfs {
    int64_t d, e;
};

FH_FN static inline FH_AI struct fh_pfs fh_pfs_at(int64_t dist, int64_t cols)
{
    return (struct fh_pfs){ dist / cols * (FH_TILE - 1) * cols + dist, cols - dist % cols };
}

/* the rows moved n bytes on */
FH_FN static inline FH_AI void fh_pfs_step(struct fh_pfs *s, int64_t n, int64_t cols)
{
    s->d += n;
    if ((s->e -= n) <= 0) {
        s->d += (FH_TILE - 1) * cols;
        s->e += cols;
    }
}

/* rows rw[0..3] against nt tokens' FP16 activations xt[] and chunk multipliers mt[]:
 * out[j][rr]; l4: every chunk 128 columns (compile-time at the call); pf: prefetch each
 * row's stream FH_PF1 bytes ahead into L1 and FH_PF2 ahead into L2, past its end into the
 * same row of the next tiles, as long as that is before end (the row range's end) */
FH_FN static inline FH_AI void fh_tile(const uint8_t *const *rw, const struct fh_geo *g,
                                       const uint16_t *const *xt, const float *const *mt, const int nt,
                                       const bool l4, float out[][FH_TILE], const bool pf, const uintptr_t end)
{
    const __m512i mask = _mm512_set1_epi16((short)0xbf80);
    __m512 acc[FH_NT][FH_TILE];
    int64_t c = 0;
    struct fh_pfs s1 = fh_pfs_at(FH_PF1, g->cols), s2 = fh_pfs_at(FH_PF2, g->cols);

#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FH_TILE; rr++)
            acc[j][rr] = _mm512_setzero_ps();
    for (int64_t ch = 0; ch < g->nch; ch++) {
        const int nv = l4 ? 4 : (int)(fh_len(g, ch) / 32);

        if (pf) {
#pragma GCC unroll 4
            for (int rr = 0; rr < FH_TILE; rr++) {
                /* addresses as integers: past the weights they are not pointers into them */
                const uintptr_t p1 = (uintptr_t)rw[rr] + (uintptr_t)s1.d, p2 = (uintptr_t)rw[rr] + (uintptr_t)s2.d;

                if (p1 < end) {
#pragma GCC unroll 2
                    for (int k = 0; k < (nv + 1) / 2; k++)
                        _mm_prefetch((const char *)(p1 + 64 * k), _MM_HINT_T0);
                }
                if (p2 < end) {
#pragma GCC unroll 2
                    for (int k = 0; k < (nv + 1) / 2; k++)
                        _mm_prefetch((const char *)(p2 + 64 * k), _MM_HINT_T1);
                }
            }
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < FH_TILE; rr++) {
            __m512h wv[4] = { _mm512_setzero_ph(), _mm512_setzero_ph(), _mm512_setzero_ph(), _mm512_setzero_ph() };

#pragma GCC unroll 4
            for (int v = 0; v < nv; v++)
                wv[v] = fh_dec32(rw[rr] + c + 32 * v, mask);
#pragma GCC unroll 4
            for (int j = 0; j < nt; j++) {
                const __m512 m = _mm512_set1_ps(mt[j][ch]);
                __m512h p = _mm512_mul_ph(wv[0], _mm512_loadu_ph(xt[j] + c));
                __m512i pi;

#pragma GCC unroll 3
                for (int v = 1; v < nv; v++)
                    p = _mm512_fmadd_ph(wv[v], _mm512_loadu_ph(xt[j] + c + 32 * v), p);
                pi = _mm512_castph_si512(p);
                acc[j][rr] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(pi)), m, acc[j][rr]);
                acc[j][rr] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(pi, 1)), m, acc[j][rr]);
            }
        }
        c += 32 * nv;
        fh_pfs_step(&s1, 32 * nv, g->cols);
        fh_pfs_step(&s2, 32 * nv, g->cols);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
#pragma GCC unroll 4
        for (int rr = 0; rr < FH_TILE; rr++)
            out[j][rr] = _mm512_reduce_add_ps(acc[j][rr]);
}

/* fh_tile for nt tokens (1..FH_NT) and the chunk form, each compiled with its accumulators
 * in registers */
#define FH_CASE(nt_)                                                    \
    case nt_:                                                           \
        if (g->l4)                                                      \
            fh_tile(rw, g, xt, mt, nt_, true, out, pf, end);            \
        else                                                            \
            fh_tile(rw, g, xt, mt, nt_, false, out, pf, end);           \
        break;

FH_FN static void fh_tile_any(const uint8_t *const *rw, const struct fh_geo *g, const uint16_t *const *xt,
                              const float *const *mt, int nt, float out[][FH_TILE], bool pf,
                              uintptr_t end)
{
    switch (nt) {
    FH_CASE(1)
    FH_CASE(2)
    FH_CASE(3)
    default:
    FH_CASE(FH_NT)
    }
}

FH_FN void cpu_matmul_fp8_fp16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                    int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    const int64_t cols = w->cols;
    const uint8_t *data = w->data;
    const struct fh_geo g = fh_geo(w);
    /* rowbuf (CPU_LOWP_BUF(cols) floats, 32 cols + 64 bytes): FH_TB tokens' FP16 rows, then
     * their chunk exponents and multipliers (nch <= cols / 32 each): 27 cols bytes */
    uint16_t *xh = rowbuf;
    int32_t *eo = (int32_t *)(xh + FH_TB * cols);
    float *ms = (float *)(eo + FH_TB * g.nch);
    const bool once = n <= FH_TB;

    for (int i = 0; once && i < n; i++)
        fh_pack(&g, x + (int64_t)(xidx ? xidx[i] : i) * cols, xh + (int64_t)i * cols, eo + (int64_t)i * g.nch);
    /* row blocks (one set of scales each), then token blocks within them */
    for (int64_t b0 = r0; b0 < r1;) {
        const int64_t rb = b0 / w->blk_rows;
        const int64_t b1 = (rb + 1) * w->blk_rows < r1 ? (rb + 1) * w->blk_rows : r1;
        const uint8_t *sc = w->scale + 4 * rb * (cols / g.bc);

        for (int i0 = 0; i0 < n; i0 += FH_TB) {
            const int i1 = n - i0 < FH_TB ? n : i0 + FH_TB;

            for (int i = i0; i < i1; i++) {
                float *mi = ms + (int64_t)(i - i0) * g.nch;
                int32_t *ei = eo + (int64_t)(i - i0) * g.nch;

                if (!once)
                    fh_pack(&g, x + (int64_t)(xidx ? xidx[i] : i) * cols, xh + (int64_t)(i - i0) * cols, ei);
                for (int64_t ch = 0; ch < g.nch; ch++) {
                    float s;

                    memcpy(&s, sc + 4 * (ch / g.cpb), 4);
                    mi[ch] = ldexpf(s, ei[ch]);
                }
            }
            for (int64_t r = b0; r < b1; r += FH_TILE) {
                const int nr = b1 - r < FH_TILE ? (int)(b1 - r) : FH_TILE;
                const uint8_t *rw[FH_TILE];

                for (int rr = 0; rr < FH_TILE; rr++)
                    rw[rr] = data + (r + (rr < nr ? rr : nr - 1)) * cols;
                for (int i = i0; i < i1; i += FH_NT) {
                    const int nt = i1 - i < FH_NT ? i1 - i : FH_NT;
                    const uint16_t *xt[FH_NT];
                    const float *mt[FH_NT];
                    float out[FH_NT][FH_TILE];

                    for (int j = 0; j < nt; j++) {
                        xt[j] = xh + (int64_t)(i - i0 + j) * cols;
                        mt[j] = ms + (int64_t)(i - i0 + j) * g.nch;
                    }
                    fh_tile_any(rw, &g, xt, mt, nt, out, i == i0, (uintptr_t)(data + r1 * cols));
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

bool cpu_fp8_fp16_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

#endif
