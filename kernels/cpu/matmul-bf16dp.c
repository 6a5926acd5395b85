/* matmul-bf16dp.c - the BF16 fast path on CPUs with AVX-512 BF16 and no AMX (AMD Zen 4;
 * here: STEPD_CPU_NO_AMX=1): y = x · Wᵀ by vdpbf16ps, two products per lane and instruction.
 *
 * The activations are rounded once to BF16 (round to nearest even, VCVTNE2PS2BF16) and
 * packed per call, one row of cols BF16 values per token (cpu_bf16_act_pack; the matmul
 * op packs once for all threads, other callers into a per-thread buffer); the weights are
 * read straight from the loader's memory (no repack: a BF16 row is already the pair
 * layout vdpbf16ps takes, 32 values per zmm).  A register tile of DP_ROWS weight rows x
 * up to DP_TOKS tokens: 24 accumulators + 4 weight vectors + 1 activation vector, 10 loads
 * per 24 vdpbf16ps; one token runs 8-row tiles (8 independent chains).  Each (row, token)
 * sum is one 16-lane fp32 chain over the columns in increasing order from zero, reduced by
 * _mm512_reduce_add_ps, whatever the tile, the token block and the thread: a token's
 * outputs never depend on n (batch invariance).  Tokens are blocked so that their BF16
 * rows (DP_TOKEN_BLOCK_BYTES) stay in L2 while a tile's rows stream by; the first token
 * tile of a row tile prefetches the rows DP_PF_TILES tiles ahead at the rate it reads its
 * own.  cols % 32 == 0 (cpu_bf16_dp_fits); other shapes keep the FP32 kernels.
 *
 * Error: the activations' rounding, |err| <= 2^-8 · Σ|w·x| plus fp32 accumulation
 * (test-matmul at level vnni); vdpbf16ps treats denormal inputs as zero and flushes
 * denormal results, as the AMX path does.
 */
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

int cpu_bf16_fast_off;

bool cpu_bf16_fast(const struct cpu_ctx *c, const struct bweight *w)
{
    return !cpu_bf16_fast_off && !cpu_lowp_exact(c) && !(w && w->exact);
}

size_t cpu_bf16_act_bytes(int n, int64_t cols)
{
    return (size_t)n * (size_t)cols * 2;
}

#if defined(__x86_64__)

#define DP_ROWS 4
#define DP_ROWS1 8              /* rows per tile for one token */
#define DP_TOKS 6
#define DP_PF_TILES 2
#define DP_TOKEN_BLOCK_BYTES (1024 * 1024)

#define DP_TARGET CPU_TARGET_VNNI ",avx512bf16"
#define DP_FN __attribute__((target(DP_TARGET)))
#define DP_INLINE __attribute__((target(DP_TARGET), always_inline)) static inline

static bool dp_host;

__attribute__((constructor)) static void dp_init(void)
{
    __builtin_cpu_init();
    dp_host = __builtin_cpu_supports("avx512bf16");
}

bool cpu_bf16_dp_fits(const struct bweight *w)
{
    return w->fmt == WFMT_BF16 && w->cols > 0 && w->cols % 32 == 0 && dp_host &&
           cpu_isa_has(CPU_ISA_VNNI);
}

DP_FN void cpu_bf16_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols)
{
    uint16_t *out = buf;

    for (int i = 0; i < n; i++) {
        const float *xi = x + (xidx ? xidx[i] : i) * cols;
        uint16_t *o = out + (int64_t)i * cols;

        for (int64_t c = 0; c < cols; c += 32)
            _mm512_storeu_si512(o + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xi + c + 16),
                                                                    _mm512_loadu_ps(xi + c)));
    }
}

/* rows rw[0 .. R-1] x tokens xs[0 .. T-1] -> out[r * DP_TOKS + t]; pf: the region to
 * prefetch at this tile's pace (the rows DP_PF_TILES tiles ahead), or NULL */
DP_INLINE void dp_tile(const uint8_t *const *rw, const uint16_t *const *xs, int64_t cols,
                       float *out, const int R, const int T, const uint8_t *pf)
{
    __m512 acc[DP_ROWS1][DP_TOKS];

#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 32) {
        __m512bh wv[DP_ROWS1];

        if (pf) {
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)pf + j * 2 * R + 64 * r, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_loadu_si512(rw[r] + j * 2);
#pragma GCC unroll 6
        for (int t = 0; t < T; t++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[t] + j);

#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 6
        for (int t = 0; t < T; t++)
            out[r * DP_TOKS + t] = _mm512_reduce_add_ps(acc[r][t]);
}

DP_FN static void dp_tile_any(const uint8_t *const *rw, const uint16_t *const *xs, int64_t cols,
                              float *out, int nt, const uint8_t *pf)
{
    switch (nt) {
    case 1: dp_tile(rw, xs, cols, out, DP_ROWS, 1, pf); break;
    case 2: dp_tile(rw, xs, cols, out, DP_ROWS, 2, pf); break;
    case 3: dp_tile(rw, xs, cols, out, DP_ROWS, 3, pf); break;
    case 4: dp_tile(rw, xs, cols, out, DP_ROWS, 4, pf); break;
    case 5: dp_tile(rw, xs, cols, out, DP_ROWS, 5, pf); break;
    default: dp_tile(rw, xs, cols, out, DP_ROWS, DP_TOKS, pf); break;
    }
}

DP_FN static void dp_tile_one(const uint8_t *const *rw, const uint16_t *const *xs, int64_t cols,
                              float *out, const uint8_t *pf)
{
    dp_tile(rw, xs, cols, out, DP_ROWS1, 1, pf);
}

DP_FN void cpu_matmul_bf16_dp_rows(const struct bweight *w, const void *xb, int n, float *y,
                                   int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t cols = w->cols, stride = cols * 2;
    const uint8_t *wd = w->data;
    const uint16_t *xp = xb;
    const int rt = n == 1 ? DP_ROWS1 : DP_ROWS;
    int64_t tb = DP_TOKEN_BLOCK_BYTES / stride / DP_TOKS * DP_TOKS;

    tb = tb < DP_TOKS ? DP_TOKS : tb;
    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        const int64_t i1 = i0 + tb < n ? i0 + tb : n;

        for (int64_t r = r0; r < r1; r += rt) {
            const int nr = r1 - r < rt ? (int)(r1 - r) : rt;
            const uint8_t *rw[DP_ROWS1];
            /* the rows DP_PF_TILES tiles ahead: one contiguous region (prefetches never
             * fault, so past the matrix end they only cost an address) */
            const uint8_t *pf = wd + (r + DP_PF_TILES * rt) * stride;

            for (int rr = 0; rr < rt; rr++)     /* a short tile repeats its last row */
                rw[rr] = wd + (r + (rr < nr ? rr : nr - 1)) * stride;
            for (int64_t i = i0; i < i1; i += DP_TOKS) {
                const int nt = i1 - i < DP_TOKS ? (int)(i1 - i) : DP_TOKS;
                const uint16_t *xs[DP_TOKS];
                float out[DP_ROWS1 * DP_TOKS];

                for (int k = 0; k < nt; k++)
                    xs[k] = xp + (i + k) * cols;
                if (rt == DP_ROWS1)
                    dp_tile_one(rw, xs, cols, out, pf);
                else
                    dp_tile_any(rw, xs, cols, out, nt, i == i0 ? pf : NULL);
                for (int rr = 0; rr < nr; rr++)
                    for (int k = 0; k < nt; k++)
                        y[(i + k) * ldy + (r + rr - r0)] = out[rr * DP_TOKS + k];
            }
        }
    }
}

#else /* !__x86_64__ */

bool cpu_bf16_dp_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

void cpu_bf16_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols)
{
    (void)buf; (void)x; (void)xidx; (void)n; (void)cols;
}

void cpu_matmul_bf16_dp_rows(const struct bweight *w, const void *xb, int n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1)
{
    (void)w; (void)xb; (void)n; (void)y; (void)ldy; (void)r0; (void)r1;
}

#endif
