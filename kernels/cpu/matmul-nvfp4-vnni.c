/* matmul-nvfp4-vnni.c - the NVFP4 fast path at level vnni (docs/PERFORMANCE.md §4.3a):
 * MXFP4's int8 path with NVFP4's scales, 16 rows per vector.
 *
 * The activations are quantised exactly as MXFP4's fast path quantises them
 * (cpu_qact_quantize: int8 per 32-block, d = amax / 127, pair order), into the caller's
 * per-thread row buffer, a token block at a time.  The weights are repacked at prepare
 * (cpu_nvfp4_prepare) into one stream in the order the kernel reads it, transposed so that
 * a vector lane is a row: per group of 16 rows and 64-column pair, 8 vectors of 64 bytes,
 * vector h holding in lane r the 4 nibble bytes 4h..4h+3 of row r's 32 bytes of the pair,
 * then the rows' E4M3 group scales, 16 bytes per 16-column group k (byte r: row r's)
 * - 576 bytes, where the checkpoint's row-major bytes were 16 row streams and 16 scale
 * streams.  The nibbles are MXFP4's (low nibble the even column), so through MXFP4's
 * biased vpshufb table (2·E2M1 + 12, unsigned for vpdpbusd) the low nibbles of vector h
 * are the weights of the activations' even-column dword h and the high nibbles those of
 * the odd-column dword h (cpu_qact's pair layout): vpdpbusd with the broadcast activation
 * dword leaves in lane r row r's partial sum, no horizontal add (MXFP4's 16-row kernel,
 * with the transposition done once at prepare).  Group k of the pair is dwords 2k and
 * 2k+1, even and odd: 4 vpdpbusd from -12·Σq of the group (the bias, the quantiser's sums
 * rewritten per group), converted; per 32-block b the two groups' sums times their E4M3
 * scales (decoded 16 at once through fp16 bit fields: value x 2^-8, exact), then times
 * the block's d into the token's accumulator; at the end x the global scale x 2^7 (the
 * fp16 field's 2^-8 and the table's doubling).  Up to NV_NT tokens share one decode.
 * Each (row, token) sum is the same operations in the same order whatever the token
 * count: batch-invariant, like matmul-lowp512.c.  The error is the activation rounding's,
 * as MXFP4's: |err| <= Σ_i |w_i| · d_b(i) / 2 (test-lowp at level vnni).
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

#define NV_ROWS NVFP4_GROUP_ROWS /* rows per vector */
#define NV_NT 8         /* tokens per pass over a group */
#define NV_TB 16        /* tokens quantised per block (fits CPU_LOWP_BUF) */
#define NV_CHUNK 128    /* rows per chunk when the tokens take several blocks */
/* software prefetch distances in the stream: into L1, and further into L2 (32 pairs, 18 KiB:
 * about the bytes MXFP4's 16-row kernel keeps in flight, 4 streams x 4 KiB, where 16 pairs
 * read at 0.85-0.95 of MXFP4's share of the bandwidth; docs/PERFORMANCE.md §4.3a) */
#define NV_PF (4 * NVFP4_PAIR_BYTES)
#define NV_PF2 (32 * NVFP4_PAIR_BYTES)

/* 2·E2M1 + 12 */
static const int8_t nv_lut_biased[16] = { 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 };

bool cpu_nvfp4_vnni_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && w->priv && cpu_isa_has(CPU_ISA_VNNI);
}

/* The repacked bytes of row r's pair p (NVFP4_GROUP_ROWS rows, cpu.h) from the checkpoint's
 * row-major nibbles and scales; rows past the end are zero (scale 0: output 0) */
static void nv_repack_pair(const struct bweight *w, int64_t g, int64_t p, uint8_t *u)
{
    const int64_t rb = w->cols / 2, sb = w->cols / NVFP4_GROUP;
    const uint8_t *data = w->data;

    memset(u, 0, NVFP4_PAIR_BYTES);
    for (int r = 0; r < NV_ROWS; r++) {
        const int64_t row = g * NV_ROWS + r;

        if (row >= w->rows)
            break;
        for (int h = 0; h < 8; h++)
            memcpy(u + 64 * h + 4 * r, data + row * rb + p * 32 + 4 * h, 4);
        for (int k = 0; k < 4; k++)
            u[512 + 16 * k + r] = w->scale[row * sb + p * 4 + k];
    }
}

int cpu_nvfp4_prepare(struct bweight *w)
{
    struct cpu_nvfp4 *m;
    int rc = cpu_lowp_check(w);

    if (rc < 0 || w->cols % 64 != 0 || !cpu_isa_has(CPU_ISA_VNNI))
        return rc;          /* the other paths read the checkpoint's rows in place */
    m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->npair = w->cols / 64;
    m->group_bytes = m->npair * NVFP4_PAIR_BYTES;
    const int64_t ngroup = (w->rows + NV_ROWS - 1) / NV_ROWS;
    m->pk = cpu_wmem_alloc((size_t)(ngroup * m->group_bytes), &m->mem);
    if (!m->pk) {
        free(m);
        return -ENOMEM;
    }
    for (int64_t g = 0; g < ngroup; g++)
        for (int64_t p = 0; p < m->npair; p++)
            nv_repack_pair(w, g, p, m->pk + g * m->group_bytes + p * NVFP4_PAIR_BYTES);
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

/* corr8 of token row i rewritten per 16-column group: c[k] = -12 x Σq of group k (the
 * bias, the vpdpbusd chains' start), k = 0..3; group k's bytes in the pair (even columns,
 * then odd): 8k..8k+7 and 32+8k..32+8k+7, summed by psadbw as q + 128 (SSE2: every level
 * alike, exact integers) */
static void nv_group_corr(struct cpu_qact *qa, int64_t i)
{
    const __m128i bias = _mm_set1_epi8((char)0x80), zero = _mm_setzero_si128();

    for (int64_t p = 0; p < qa->npair; p++) {
        const int8_t *q = qa->q + (i * qa->npair + p) * 64;
        int32_t *c = qa->corr8 + (i * qa->npair + p) * 8;
        __m128i v[4];

        for (int h = 0; h < 4; h++)
            v[h] = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(q + 16 * h)), bias), zero);
        /* groups 0, 1 (low, high quadword) from bytes 0-15 and 32-47; 2, 3 from 16-31 and 48-63 */
        const __m128i s01 = _mm_add_epi64(v[0], v[2]), s23 = _mm_add_epi64(v[1], v[3]);

        c[0] = -12 * (_mm_cvtsi128_si32(s01) - 16 * 128);
        c[1] = -12 * (_mm_cvtsi128_si32(_mm_srli_si128(s01, 8)) - 16 * 128);
        c[2] = -12 * (_mm_cvtsi128_si32(s23) - 16 * 128);
        c[3] = -12 * (_mm_cvtsi128_si32(_mm_srli_si128(s23, 8)) - 16 * 128);
    }
}

static inline int32_t nv_i32(const void *p)
{
    int32_t v;

    memcpy(&v, p, 4);
    return v;
}

/* group gp's 16 rows (repacked, cpu_nvfp4_prepare) against nt tokens xrow[] of qa: out[j]
 * the rows' sums (lane r: row r) times the global scale; pf: prefetch the stream ahead,
 * NV_PF bytes into L1 and NV_PF2 into L2 (the first token pass; the stream runs on into the
 * next group) */
CPU_FN_VNNI static inline __attribute__((always_inline)) void
nv_group(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa, const int64_t *xrow, const int nt,
         __m512 out[], bool pf)
{
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)nv_lut_biased));
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m256i fmask = _mm256_set1_epi16((short)0xbf80);
    __m512 acc[NV_NT];

#pragma GCC unroll 8
    for (int j = 0; j < nt; j++)
        acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < qa->npair; p++) {
        const uint8_t *u = gp + p * NVFP4_PAIR_BYTES;
        __m512 s[4];

        if (pf)
#pragma GCC unroll 9
            for (int l = 0; l < NVFP4_PAIR_BYTES / 64; l++) {
                _mm_prefetch((const char *)u + NV_PF + 64 * l, _MM_HINT_T0);
                _mm_prefetch((const char *)u + NV_PF2 + 64 * l, _MM_HINT_T1);
            }
        /* E4M3 -> fp16 bit fields (sign, 4 exponent and 3 mantissa bits shifted in) */
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(u + 512 + 16 * k)));
            s[k] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(h, 7), fmask));
        }
#pragma GCC unroll 2
        for (int b = 0; b < 2; b++) {
            __m512i wl[4], wh[4];

#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                const __m512i v = _mm512_loadu_si512(u + 64 * (4 * b + h));
                wl[h] = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
                wh[h] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
#pragma GCC unroll 8
            for (int j = 0; j < nt; j++) {
                const int64_t xo = xrow[j] * qa->npair + p;
                const int8_t *q = qa->q + xo * 64 + 16 * b;
                const int32_t *c = qa->corr8 + xo * 8 + 2 * b;
                __m512i i0 = _mm512_set1_epi32(c[0]), i1 = _mm512_set1_epi32(c[1]);

                i0 = _mm512_dpbusd_epi32(i0, wl[0], _mm512_set1_epi32(nv_i32(q)));
                i1 = _mm512_dpbusd_epi32(i1, wl[2], _mm512_set1_epi32(nv_i32(q + 8)));
                i0 = _mm512_dpbusd_epi32(i0, wh[0], _mm512_set1_epi32(nv_i32(q + 32)));
                i1 = _mm512_dpbusd_epi32(i1, wh[2], _mm512_set1_epi32(nv_i32(q + 40)));
                i0 = _mm512_dpbusd_epi32(i0, wl[1], _mm512_set1_epi32(nv_i32(q + 4)));
                i1 = _mm512_dpbusd_epi32(i1, wl[3], _mm512_set1_epi32(nv_i32(q + 12)));
                i0 = _mm512_dpbusd_epi32(i0, wh[1], _mm512_set1_epi32(nv_i32(q + 36)));
                i1 = _mm512_dpbusd_epi32(i1, wh[3], _mm512_set1_epi32(nv_i32(q + 44)));
                __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), s[2 * b]);
                x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), s[2 * b + 1], x);
                acc[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(qa->d8[xo * 8 + 4 * b]), acc[j]);
            }
        }
    }
    const __m512 gs = _mm512_set1_ps(w->gscale * 0x1p7f);
#pragma GCC unroll 8
    for (int j = 0; j < nt; j++)
        out[j] = _mm512_mul_ps(acc[j], gs);
}

CPU_FN_VNNI static void nv_group_any(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa,
                                     const int64_t *xrow, int nt, __m512 out[], bool pf)
{
    switch (nt) {
    case 1: nv_group(w, gp, qa, xrow, 1, out, pf); break;
    case 2: nv_group(w, gp, qa, xrow, 2, out, pf); break;
    case 3: nv_group(w, gp, qa, xrow, 3, out, pf); break;
    case 4: nv_group(w, gp, qa, xrow, 4, out, pf); break;
    case 5: nv_group(w, gp, qa, xrow, 5, out, pf); break;
    case 6: nv_group(w, gp, qa, xrow, 6, out, pf); break;
    case 7: nv_group(w, gp, qa, xrow, 7, out, pf); break;
    default: nv_group(w, gp, qa, xrow, NV_NT, out, pf); break;
    }
}

/* rows [r0, r1) against the block's tokens i0..i1-1 (qa rows 0..i1-i0-1): the repacked
 * groups that hold them, whole (a group's rows outside the range are computed, not stored) */
CPU_FN_VNNI static void nv_rows(const struct bweight *w, const struct cpu_qact *qa, int i0, int i1, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, int64_t ybase)
{
    const struct cpu_nvfp4 *m = w->priv;
    const int64_t g1 = (r1 + NV_ROWS - 1) / NV_ROWS;

    for (int64_t g = r0 / NV_ROWS; g < g1; g++) {
        const uint8_t *gp = m->pk + g * m->group_bytes;
        const int64_t ra = g * NV_ROWS > r0 ? g * NV_ROWS : r0;
        const int64_t rz = (g + 1) * NV_ROWS < r1 ? (g + 1) * NV_ROWS : r1;
        /* lanes 0..rz-ra-1 where the range starts at the group (else a copy) */
        const __mmask16 keep = (__mmask16)((1u << (rz - ra)) - 1);

        for (int i = i0; i < i1; i += NV_NT) {
            const int nt = i1 - i < NV_NT ? i1 - i : NV_NT;
            int64_t xrow[NV_NT];
            __m512 out[NV_NT];

            for (int j = 0; j < nt; j++)
                xrow[j] = i - i0 + j;
            nv_group_any(w, gp, qa, xrow, nt, out, i == i0 && g + 1 < g1);
            for (int j = 0; j < nt; j++) {
                float *yr = y + (int64_t)(i + j) * ldy + (ra - ybase);

                if (ra == g * NV_ROWS) {
                    _mm512_mask_storeu_ps(yr, keep, out[j]);
                } else {
                    float o[NV_ROWS];

                    _mm512_storeu_ps(o, out[j]);
                    memcpy(yr, o + (ra - g * NV_ROWS), sizeof(float) * (size_t)(rz - ra));
                }
            }
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
