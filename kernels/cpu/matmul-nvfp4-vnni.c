/* matmul-nvfp4-vnni.c - the NVFP4 fast path at level vnni (docs/PERFORMANCE.md §4.3a):
 * MXFP4's int8 path with NVFP4's scales.
 *
 * The activations are quantised exactly as MXFP4's fast path quantises them
 * (cpu_qact_quantize: int8 per 32-block, d = amax / 127, pair order), into the caller's
 * per-thread row buffer, a token block at a time.  The weights stay in the checkpoint: the
 * nibbles are MXFP4's (low nibble the even column), so one row's 32 bytes of a 64-column
 * pair decode with MXFP4's biased vpshufb table (2·E2M1 + 12, unsigned for vpdpbusd) into
 * exactly the pair layout of the quantised activations.  vpdpbusd gives int32 lanes of 4
 * products; one vphaddd per two rows folds them into the 16-column groups,
 * [r0 g0, r0 g1, r1 g0, r1 g1 | r0 g2, r0 g3, r1 g2, r1 g3], minus 12·Σq of each group
 * (the bias), converted and FMAed with (group E4M3 scale / 2) x (block's d) per lane - the
 * E4M3 scales of 4 rows decoded at once through fp16 bit fields (exact).  Each (row, token)
 * sum is the same lane order whatever the tile, folded at the end and multiplied by the
 * global scale: batch-invariant, like matmul-lowp512.c.  The error is the activation
 * rounding's, as MXFP4's: |err| <= Σ_i |w_i| · d_b(i) / 2 (test-lowp at level vnni).
 */
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

int cpu_lowp_vnni_off;

#if defined(__x86_64__)

#define NV_TILE 4       /* rows decoded together */
#define NV_NT 4         /* tokens per pass over a tile */
#define NV_TB 12        /* tokens quantised per block (fits CPU_LOWP_BUF) */
#define NV_CHUNK 128    /* rows per chunk when the tokens take several blocks */

/* 2·E2M1 + 12 */
static const int8_t nv_lut_biased[16] = { 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 };

bool cpu_nvfp4_vnni_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && w->cols % 64 == 0 && cpu_isa_has(CPU_ISA_VNNI);
}

/* corr8 of pair p (cpu_qact's bias lanes) rewritten per 16-column group, in the lane order
 * of the kernel's folded sums: 12 x [Σq g0, Σq g1, g0, g1 | g2, g3, g2, g3]; the groups'
 * bytes in the pair (even columns, then odd): g k = bytes 8k..8k+7 and 32+8k..32+8k+7 */
static void nv_group_corr(struct cpu_qact *qa, int64_t i)
{
    for (int64_t p = 0; p < qa->npair; p++) {
        const int8_t *q = qa->q + (i * qa->npair + p) * 64;
        int32_t *c = qa->corr8 + (i * qa->npair + p) * 8, s[4];

        for (int g = 0; g < 4; g++) {
            s[g] = 0;
            for (int k = 0; k < 8; k++)
                s[g] += q[8 * g + k] + q[32 + 8 * g + k];
            s[g] *= 12;
        }
        c[0] = c[2] = s[0];
        c[1] = c[3] = s[1];
        c[4] = c[6] = s[2];
        c[5] = c[7] = s[3];
    }
}

/* rows rw[0..3] (the same row repeated past a range's end) against nt tokens xrow[] of qa:
 * out[j][rr] the row sums times the global scale; pf: the next tile's rows, prefetched */
CPU_FN_VNNI static inline __attribute__((always_inline)) void
nv_tile(const struct bweight *w, const uint8_t *const *rw, const uint8_t *const *rs, const struct cpu_qact *qa,
        const int64_t *xrow, const int nt, float out[][NV_TILE], const uint8_t *pf)
{
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nv_lut_biased));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m128i sperm = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i fmask = _mm256_set1_epi16((short)0xbf80);
    /* fp16 field = E4M3 value x 2^-8; the table's doubling: x 2^8 / 2 */
    const __m512 s7 = _mm512_set1_ps(0x1p7f);
    __m256 acc[NV_NT][2];

#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
        acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < qa->npair; p++) {
        __m256i wlo[NV_TILE], whi[NV_TILE];

        if (pf) {
            _mm_prefetch((const char *)pf + p * 128, _MM_HINT_T0);
            _mm_prefetch((const char *)pf + p * 128 + 64, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < NV_TILE; rr++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(rw[rr] + p * 32));
            wlo[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
            whi[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        /* the 4 rows' 4 group scales each, in the folded sums' lane order */
        int32_t u[NV_TILE];
        for (int rr = 0; rr < NV_TILE; rr++)
            memcpy(&u[rr], rs[rr] + p * 4, 4);
        __m128i sb = _mm_shuffle_epi8(_mm_setr_epi32(u[0], u[1], u[2], u[3]), sperm);
        __m256i h16 = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(sb), 7), fmask);
        __m512 sf = _mm512_mul_ps(_mm512_cvtph_ps(h16), s7);
        const __m256 sa = _mm512_castps512_ps256(sf);
        const __m256 sbv = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sf), 1));

#pragma GCC unroll 4
        for (int j = 0; j < nt; j++) {
            const int64_t xo = xrow[j] * qa->npair + p;
            const int8_t *q = qa->q + xo * 64;
            const __m256i xlo = _mm256_load_si256((const __m256i *)q);
            const __m256i xhi = _mm256_load_si256((const __m256i *)(q + 32));
            __m256i d[NV_TILE];
#pragma GCC unroll 4
            for (int rr = 0; rr < NV_TILE; rr++)
                d[rr] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wlo[rr], xlo), whi[rr], xhi);
            const __m256i c = _mm256_load_si256((const __m256i *)(qa->corr8 + xo * 8));
            const __m256 dx = _mm256_load_ps(qa->d8 + xo * 8);
            __m256i ha = _mm256_sub_epi32(_mm256_hadd_epi32(d[0], d[1]), c);
            __m256i hb = _mm256_sub_epi32(_mm256_hadd_epi32(d[2], d[3]), c);
            acc[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ha), _mm256_mul_ps(sa, dx), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hb), _mm256_mul_ps(sbv, dx), acc[j][1]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++) {
        /* [r0 a, r0 b, r1 a, r1 b] per half-sum, then [r0, r1, r2, r3] */
        __m128 a = _mm_add_ps(_mm256_castps256_ps128(acc[j][0]), _mm256_extractf128_ps(acc[j][0], 1));
        __m128 b = _mm_add_ps(_mm256_castps256_ps128(acc[j][1]), _mm256_extractf128_ps(acc[j][1], 1));
        _mm_storeu_ps(out[j], _mm_mul_ps(_mm_hadd_ps(a, b), _mm_set1_ps(w->gscale)));
    }
}

CPU_FN_VNNI static void nv_tile_any(const struct bweight *w, const uint8_t *const *rw, const uint8_t *const *rs,
                                    const struct cpu_qact *qa, const int64_t *xrow, int nt, float out[][NV_TILE],
                                    const uint8_t *pf)
{
    switch (nt) {
    case 1: nv_tile(w, rw, rs, qa, xrow, 1, out, pf); break;
    case 2: nv_tile(w, rw, rs, qa, xrow, 2, out, pf); break;
    case 3: nv_tile(w, rw, rs, qa, xrow, 3, out, pf); break;
    default: nv_tile(w, rw, rs, qa, xrow, 4, out, pf); break;
    }
}

/* rows [r0, r1) against the block's tokens i0..i1-1 (qa rows 0..i1-i0-1) */
CPU_FN_VNNI static void nv_rows(const struct bweight *w, const struct cpu_qact *qa, int i0, int i1, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, int64_t ybase)
{
    const int64_t rb = w->cols / 2, sb = w->cols / NVFP4_GROUP;
    const uint8_t *data = w->data;

    for (int64_t r = r0; r < r1; r += NV_TILE) {
        const int nr = r1 - r < NV_TILE ? (int)(r1 - r) : NV_TILE;
        const uint8_t *rw[NV_TILE], *rs[NV_TILE];
        const uint8_t *pf = r + NV_TILE < r1 ? data + (r + NV_TILE) * rb : NULL;

        for (int rr = 0; rr < NV_TILE; rr++) {
            int64_t row = r + (rr < nr ? rr : nr - 1);
            rw[rr] = data + row * rb;
            rs[rr] = w->scale + row * sb;
        }
        for (int i = i0; i < i1; i += NV_NT) {
            const int nt = i1 - i < NV_NT ? i1 - i : NV_NT;
            int64_t xrow[NV_NT];
            float out[NV_NT][NV_TILE];

            for (int j = 0; j < nt; j++)
                xrow[j] = i - i0 + j;
            nv_tile_any(w, rw, rs, qa, xrow, nt, out, i == i0 ? pf : NULL);
            for (int j = 0; j < nt; j++)
                for (int rr = 0; rr < nr; rr++)
                    y[(int64_t)(i + j) * ldy + (r + rr - ybase)] = out[j][rr];
        }
    }
}

void cpu_matmul_nvfp4_vnni_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    /* one block of tokens when they fit, else row chunks that stay in L2 while each token
     * block is quantised again */
    const int64_t chunk = n <= NV_TB ? r1 - r0 : NV_CHUNK;

    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        const int64_t c1 = r1 - c0 < chunk ? r1 : c0 + chunk;

        for (int i0 = 0; i0 < n; i0 += NV_TB) {
            const int i1 = n - i0 < NV_TB ? n : i0 + NV_TB;
            struct cpu_qact qa;

            cpu_qact_init(&qa, rowbuf, i1 - i0, w->cols);
            for (int i = i0; i < i1; i++) {
                cpu_qact_quantize(&qa, i - i0, x + (int64_t)(xidx ? xidx[i] : i) * w->cols, 0, w->cols / 32);
                nv_group_corr(&qa, i - i0);
            }
            nv_rows(w, &qa, i0, i1, y, ldy, c0, c1, r0);
        }
    }
}

#else

bool cpu_nvfp4_vnni_fits(const struct bweight *w)
{
    (void)w;
    return false;
}

#endif
