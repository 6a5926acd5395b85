/* matmul-nvfp4-vnni.c - the NVFP4 fast path at level vnni (docs/PERFORMANCE.md §4.3a):
 * MXFP4's int8 path with NVFP4's scales.
 *
 * The activations are quantised exactly as MXFP4's fast path quantises them
 * (cpu_qact_quantize: int8 per 32-block, d = amax / 127, pair order), into the caller's
 * per-thread row buffer, a token block at a time.  The weights are repacked at prepare
 * (cpu_nvfp4_prepare) into one stream in the order the kernel reads it: per tile of 4 rows
 * and 64-column pair, the rows' 32 nibble bytes and then their 16 group scales (144 bytes),
 * where the checkpoint's row-major bytes were 4 row streams and 4 scale streams.  The
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
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"
#include "tensor.h"

int cpu_lowp_vnni_off;

#if defined(__x86_64__)

#define NV_TILE NVFP4_TILE_ROWS /* rows decoded together */
#define NV_NT 4         /* tokens per pass over a tile */
#define NV_TB 16        /* tokens quantised per block (fits CPU_LOWP_BUF) */
#define NV_CHUNK 128    /* rows per chunk when the tokens take several blocks */

/* 2·E2M1 + 12 */
static const int8_t nv_lut_biased[16] = { 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 };

bool cpu_nvfp4_vnni_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && w->priv && cpu_isa_has(CPU_ISA_VNNI);
}

int cpu_nvfp4_prepare(struct bweight *w)
{
    const int64_t rb = w->cols / 2, sb = w->cols / NVFP4_GROUP;
    const uint8_t *data = w->data;
    struct cpu_nvfp4 *m;
    int rc = cpu_lowp_check(w);

    if (rc < 0 || w->cols % 64 != 0 || !cpu_isa_has(CPU_ISA_VNNI))
        return rc;          /* the other paths read the checkpoint's rows in place */
    m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->npair = w->cols / 64;
    m->tile_bytes = m->npair * NVFP4_PAIR_BYTES;
    const int64_t ntile = (w->rows + NV_TILE - 1) / NV_TILE;
    m->pk = cpu_wmem_alloc((size_t)(ntile * m->tile_bytes), &m->mem);
    if (!m->pk) {
        free(m);
        return -ENOMEM;
    }
    for (int64_t t = 0; t < ntile; t++)
        for (int rr = 0; rr < NV_TILE; rr++) {
            const int64_t row = t * NV_TILE + rr;

            for (int64_t p = 0; p < m->npair; p++) {
                uint8_t *u = m->pk + t * m->tile_bytes + p * NVFP4_PAIR_BYTES;

                if (row < w->rows) {
                    memcpy(u + rr * 32, data + row * rb + p * 32, 32);
                    memcpy(u + NV_TILE * 32 + rr * 4, w->scale + row * sb + p * 4, 4);
                } else {
                    memset(u + rr * 32, 0, 32);
                    memset(u + NV_TILE * 32 + rr * 4, 0, 4);
                }
            }
        }
    w->priv = m;
    return 0;
}

void cpu_nvfp4_release(struct bweight *w)
{
    struct cpu_nvfp4 *m = w->priv;

    if (!m)
        return;
    cpu_wmem_free(m->mem);
    free(m);
    w->priv = NULL;
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

/* tile tp's 4 rows (repacked, cpu_nvfp4_prepare) against nt tokens xrow[] of qa: out[j][rr]
 * the row sums times the global scale; pf: the next tile, prefetched at this one's pace */
CPU_FN_VNNI static inline __attribute__((always_inline)) void
nv_tile(const struct bweight *w, const uint8_t *tp, const struct cpu_qact *qa, const int64_t *xrow, const int nt,
        float out[][NV_TILE], const uint8_t *pf)
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
        const uint8_t *u = tp + p * NVFP4_PAIR_BYTES;
        __m256i wlo[NV_TILE], whi[NV_TILE];

        if (pf) {
            /* the pair's 144 bytes span at most 3 lines from here */
            const char *f = (const char *)pf + p * NVFP4_PAIR_BYTES;
            _mm_prefetch(f, _MM_HINT_T0);
            _mm_prefetch(f + 64, _MM_HINT_T0);
            _mm_prefetch(f + 128, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int rr = 0; rr < NV_TILE; rr++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(u + rr * 32));
            wlo[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
            whi[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        /* the 4 rows' 4 group scales each, in the folded sums' lane order */
        __m128i sb = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(u + NV_TILE * 32)), sperm);
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

CPU_FN_VNNI static void nv_tile_any(const struct bweight *w, const uint8_t *tp, const struct cpu_qact *qa,
                                    const int64_t *xrow, int nt, float out[][NV_TILE], const uint8_t *pf)
{
    switch (nt) {
    case 1: nv_tile(w, tp, qa, xrow, 1, out, pf); break;
    case 2: nv_tile(w, tp, qa, xrow, 2, out, pf); break;
    case 3: nv_tile(w, tp, qa, xrow, 3, out, pf); break;
    default: nv_tile(w, tp, qa, xrow, 4, out, pf); break;
    }
}

/* rows [r0, r1) against the block's tokens i0..i1-1 (qa rows 0..i1-i0-1): the repacked
 * tiles that hold them, whole (a tile's rows outside the range are computed, not stored) */
CPU_FN_VNNI static void nv_rows(const struct bweight *w, const struct cpu_qact *qa, int i0, int i1, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, int64_t ybase)
{
    const struct cpu_nvfp4 *m = w->priv;
    const int64_t t1 = (r1 + NV_TILE - 1) / NV_TILE;

    for (int64_t t = r0 / NV_TILE; t < t1; t++) {
        const uint8_t *tp = m->pk + t * m->tile_bytes;
        const uint8_t *pf = t + 1 < t1 ? tp + m->tile_bytes : NULL;
        const int64_t ra = t * NV_TILE > r0 ? t * NV_TILE : r0;
        const int64_t rz = (t + 1) * NV_TILE < r1 ? (t + 1) * NV_TILE : r1;

        for (int i = i0; i < i1; i += NV_NT) {
            const int nt = i1 - i < NV_NT ? i1 - i : NV_NT;
            int64_t xrow[NV_NT];
            float out[NV_NT][NV_TILE];

            for (int j = 0; j < nt; j++)
                xrow[j] = i - i0 + j;
            nv_tile_any(w, tp, qa, xrow, nt, out, i == i0 ? pf : NULL);
            for (int j = 0; j < nt; j++)
                for (int64_t r = ra; r < rz; r++)
                    y[(int64_t)(i + j) * ldy + (r - ybase)] = out[j][r - t * NV_TILE];
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

int cpu_nvfp4_prepare(struct bweight *w)
{
    return cpu_lowp_check(w);
}

void cpu_nvfp4_release(struct bweight *w)
{
    (void)w;
}

#endif
