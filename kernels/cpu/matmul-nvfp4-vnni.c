/* matmul-nvfp4-vnni.c - the NVFP4 fast path at levels vnni and avx2 (docs/PERFORMANCE.md
 * §4.3a): MXFP4's int8 path with NVFP4's scales, 16 rows per vector (avx2: 8, bit for bit
 * the vnni kernel's outputs; level avx512 keeps matmul-lowp512.c).
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
 *
 * Level avx2 (AVX2-only hosts: AMD Zen 2/3) reads the same stream, each 64-byte vector as
 * two 256-bit halves (rows 0-7 and 8-15 of the group; both halves of a pair before the
 * next, so its 576 bytes are read once, the same prefetches), the scales' 8 bytes per half
 * through the same fp16 bit fields (vcvtph2ps: F16C, part of the avx2 level).  Each
 * vpdpbusd becomes vpmaddubsw (biased weight x int8, pairs <= 2·24·127 = 6096), the four of
 * a chain summed in 16 bits (<= 24384: no saturation) and widened by one vpmaddwd with
 * ones, then added to the chain's start: integer sums equal to vpdpbusd's, followed by the
 * same float operations in the same order, so each output is the vnni kernel's bit for bit
 * (test-lowp-avx2 checks it against level vnni where the host has it, and batch
 * invariance).  Up to NV2_NT tokens share one decode (16 ymm registers).  cpu_nvfp4_prepare
 * repacks where either level is active; the repacked stream is a second copy of the
 * weight's bytes beside the checkpoint's mapping (as MXFP4's), whose pages the other paths
 * (the exact one, level avx512) still read.
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

/* the levels whose NVFP4 fast path is the int8 one: vnni and up, and avx2 (level avx512
 * keeps matmul-lowp512.c's tiles, which read the checkpoint's rows) */
static bool nv_int8_level(void)
{
    return cpu_isa_has(CPU_ISA_VNNI) || cpu_isa() == CPU_ISA_AVX2;
}

bool cpu_nvfp4_int8_fits(const struct bweight *w)
{
    return !cpu_lowp_vnni_off && w->priv && nv_int8_level();
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

    if (rc < 0 || w->cols % 64 != 0 || !nv_int8_level())
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

/* token row x's activations for block b of pair p: its 16 bytes of even, then (at +32) of
 * odd columns, the two 16-column groups' chain starts, the block's d */
struct nv_tok {
    const int8_t *q;
    const int32_t *c;
    float d;
};

static inline struct nv_tok nv_tok(const struct cpu_qact *qa, int64_t x, int64_t p, int b)
{
    const int64_t xo = x * qa->npair + p;

    return (struct nv_tok){ qa->q + xo * 64 + 16 * b, qa->corr8 + xo * 8 + 2 * b, qa->d8[xo * 8 + 4 * b] };
}

/* a pair's stream NV_PF bytes on into L1 and NV_PF2 on into L2 */
static inline __attribute__((always_inline)) void nv_prefetch(const uint8_t *u)
{
#pragma GCC unroll 9
    for (int l = 0; l < NVFP4_PAIR_BYTES / 64; l++) {
        _mm_prefetch((const char *)u + NV_PF + 64 * l, _MM_HINT_T0);
        _mm_prefetch((const char *)u + NV_PF2 + 64 * l, _MM_HINT_T1);
    }
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
            nv_prefetch(u);
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
                const struct nv_tok t = nv_tok(qa, xrow[j], p, b);
                const int8_t *q = t.q;
                __m512i i0 = _mm512_set1_epi32(t.c[0]), i1 = _mm512_set1_epi32(t.c[1]);

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
                acc[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(t.d), acc[j]);
            }
        }
    }
    const __m512 gs = _mm512_set1_ps(w->gscale * 0x1p7f);
#pragma GCC unroll 8
    for (int j = 0; j < nt; j++)
        out[j] = _mm512_mul_ps(acc[j], gs);
}

/* the group's rows against nt tokens (1..nt_max of the level's kernel): out[j][r] row r's
 * sum for token j */
typedef void (*nv_group_fn)(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa,
                            const int64_t *xrow, int nt, float (*out)[NV_ROWS], bool pf);

CPU_FN_VNNI static void nv_group_any(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa,
                                     const int64_t *xrow, int nt, float (*out)[NV_ROWS], bool pf)
{
    __m512 o[NV_NT];

    switch (nt) {
    case 1: nv_group(w, gp, qa, xrow, 1, o, pf); break;
    case 2: nv_group(w, gp, qa, xrow, 2, o, pf); break;
    case 3: nv_group(w, gp, qa, xrow, 3, o, pf); break;
    case 4: nv_group(w, gp, qa, xrow, 4, o, pf); break;
    case 5: nv_group(w, gp, qa, xrow, 5, o, pf); break;
    case 6: nv_group(w, gp, qa, xrow, 6, o, pf); break;
    case 7: nv_group(w, gp, qa, xrow, 7, o, pf); break;
    default: nv_group(w, gp, qa, xrow, NV_NT, o, pf); break;
    }
    for (int j = 0; j < nt; j++)
        _mm512_storeu_ps(out[j], o[j]);
}

/* Level avx2: nv_group's 16 rows as two halves of 8 (half hf of each 64-byte vector: rows
 * 8hf..8hf+7), its vpdpbusd chains as vpmaddubsw summed in 16 bits and one vpmaddwd (the
 * header); out[j] as nv_group_any's.  Loops left to unroll fully: with the hf loop kept
 * rolled it cost ~3 % more in cache. */
#define NV2_NT 4        /* tokens per pass over a group */

CPU_FN_AVX2 static inline __attribute__((always_inline)) void
nv2_group(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa, const int64_t *xrow, const int nt,
          float (*out)[NV_ROWS], bool pf)
{
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)nv_lut_biased));
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m128i fmask = _mm_set1_epi16((short)0xbf80);
    __m256 acc[2][NV2_NT];

#pragma GCC unroll 4
    for (int j = 0; j < nt; j++)
        acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < qa->npair; p++) {
        const uint8_t *u = gp + p * NVFP4_PAIR_BYTES;

        if (pf)
            nv_prefetch(u);
#pragma GCC unroll 2
        for (int hf = 0; hf < 2; hf++)
#pragma GCC unroll 2
            for (int b = 0; b < 2; b++) {
                __m256i wl[4], wh[4];
                __m256 s[2];

                /* E4M3 -> fp16 bit fields, as nv_group */
#pragma GCC unroll 2
                for (int k = 0; k < 2; k++) {
                    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(u + 512 + 16 * (2 * b + k) + 8 * hf)));
                    s[k] = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(h, 7), fmask));
                }
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(u + 64 * (4 * b + h) + 32 * hf));
                    wl[h] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
                    wh[h] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                }
#pragma GCC unroll 4
                for (int j = 0; j < nt; j++) {
                    const struct nv_tok t = nv_tok(qa, xrow[j], p, b);
                    const int8_t *q = t.q;
                    __m256i t0 = _mm256_maddubs_epi16(wl[0], _mm256_set1_epi32(nv_i32(q)));
                    __m256i t1 = _mm256_maddubs_epi16(wl[2], _mm256_set1_epi32(nv_i32(q + 8)));

                    t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(wh[0], _mm256_set1_epi32(nv_i32(q + 32))));
                    t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(wh[2], _mm256_set1_epi32(nv_i32(q + 40))));
                    t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(wl[1], _mm256_set1_epi32(nv_i32(q + 4))));
                    t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(wl[3], _mm256_set1_epi32(nv_i32(q + 12))));
                    t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(wh[1], _mm256_set1_epi32(nv_i32(q + 36))));
                    t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(wh[3], _mm256_set1_epi32(nv_i32(q + 44))));
                    const __m256i i0 = _mm256_add_epi32(_mm256_set1_epi32(t.c[0]), _mm256_madd_epi16(t0, ones));
                    const __m256i i1 = _mm256_add_epi32(_mm256_set1_epi32(t.c[1]), _mm256_madd_epi16(t1, ones));
                    __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), s[0]);
                    x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), s[1], x);
                    acc[hf][j] = _mm256_fmadd_ps(x, _mm256_set1_ps(t.d), acc[hf][j]);
                }
            }
    }
    const __m256 gs = _mm256_set1_ps(w->gscale * 0x1p7f);
#pragma GCC unroll 4
    for (int j = 0; j < nt; j++) {
        _mm256_storeu_ps(out[j], _mm256_mul_ps(acc[0][j], gs));
        _mm256_storeu_ps(out[j] + 8, _mm256_mul_ps(acc[1][j], gs));
    }
}

CPU_FN_AVX2 static void nv2_group_any(const struct bweight *w, const uint8_t *gp, const struct cpu_qact *qa,
                                      const int64_t *xrow, int nt, float (*out)[NV_ROWS], bool pf)
{
    switch (nt) {
    case 1: nv2_group(w, gp, qa, xrow, 1, out, pf); break;
    case 2: nv2_group(w, gp, qa, xrow, 2, out, pf); break;
    case 3: nv2_group(w, gp, qa, xrow, 3, out, pf); break;
    default: nv2_group(w, gp, qa, xrow, NV2_NT, out, pf); break;
    }
}

/* rows [r0, r1) against the block's tokens i0..i1-1 (qa rows 0..i1-i0-1), nt_max at a time
 * through group(): the repacked groups that hold them, whole (a group's rows outside the
 * range are computed, not stored) */
static void nv_rows(const struct bweight *w, nv_group_fn group, int nt_max, const struct cpu_qact *qa, int i0,
                    int i1, float *y, int64_t ldy, int64_t r0, int64_t r1, int64_t ybase)
{
    const struct cpu_nvfp4 *m = w->priv;
    const int64_t g1 = (r1 + NV_ROWS - 1) / NV_ROWS;

    for (int64_t g = r0 / NV_ROWS; g < g1; g++) {
        const uint8_t *gp = m->pk + g * m->group_bytes;
        const int64_t ra = g * NV_ROWS > r0 ? g * NV_ROWS : r0;
        const int64_t rz = (g + 1) * NV_ROWS < r1 ? (g + 1) * NV_ROWS : r1;

        for (int i = i0; i < i1; i += nt_max) {
            const int nt = i1 - i < nt_max ? i1 - i : nt_max;
            int64_t xrow[NV_NT];
            float out[NV_NT][NV_ROWS];

            for (int j = 0; j < nt; j++)
                xrow[j] = i - i0 + j;
            group(w, gp, qa, xrow, nt, out, i == i0 && g + 1 < g1);
            for (int j = 0; j < nt; j++)
                memcpy(y + (int64_t)(i + j) * ldy + (ra - ybase), out[j] + (ra - g * NV_ROWS),
                       sizeof(float) * (size_t)(rz - ra));
        }
    }
}

void cpu_matmul_nvfp4_int8_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, void *rowbuf)
{
    /* one block of tokens when they fit, else row chunks that stay in L2 while each token
     * block is quantised again */
    const int64_t chunk = n <= NV_TB ? r1 - r0 : NV_CHUNK;
    const bool vnni = cpu_isa_has(CPU_ISA_VNNI);

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
            nv_rows(w, vnni ? nv_group_any : nv2_group_any, vnni ? NV_NT : NV2_NT, &qa, i0, i1, y, ldy, c0, c1, r0);
        }
    }
}

#else

bool cpu_nvfp4_int8_fits(const struct bweight *w)
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
