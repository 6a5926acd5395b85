/* matmul-mxfp4.c - y = x · Wᵀ for MXFP4 weights (docs/MODEL.md §5): repacking at prepare,
 * the exact W4A32 reference path and the fast int8 AVX2 path.
 *
 * Exact path: each weight decodes exactly to fp32 (E2M1 · 2^k); each product with an
 * fp32 activation is exact in fp64 (<= 26 significant bits); products are summed in
 * fp64 in a fixed 16-lane order and rounded once to fp32.  Bit-reproducible and the
 * oracle for tests (checked bit-exactly against decode-then-fp64-dot in test-matmul).
 *
 * Fast path (docs/PERFORMANCE.md §4.2): activations quantised once per 32-block to int8
 * (q = round(x/d), d = amax/127); weights decoded with one vpshufb per 32 nibbles
 * through a biased LUT (2·E2M1 + 12 ∈ [0, 24], unsigned, so vpmaddubsw needs no sign
 * trick; the bias is removed with 12·Σq per block); two blocks per 256-bit register,
 * four interleaved rows per tile reduced with hadd so 8 block sums take one convert
 * and one FMA with a scale vector built by shifting E8M0 into the float exponent
 * ((e-1)<<23 = 2^(e-128), the /2 of the doubled LUT folded in).  Error is bounded by
 * the activation rounding (|err| <= Σ_b 2^(e_b-127)·6·d_b/2·32 per row; ~0.5 % relative
 * on random data).  Blocks whose E8M0 is 0 or 1 (scale <= 2^-126, |w| <= 6*2^-126)
 * contribute 0 on this path (no denormal scale products: they cost microcode assists).
 * Where the CPU has AVX512-VNNI+VL, vpdpbusd (256-bit) replaces vpmaddubsw+vpmaddwd.
 * The weight stream is software-prefetched cpu_mxfp4_pf_bytes ahead into L1 (+20 % from
 * DRAM in this VM; the hardware prefetcher alone stalled) and MXFP4_PF2 ahead into L2 (the
 * routed experts' rows from ~62 % to ~95 % of the read bandwidth).  Multi-token calls
 * decode each tile once per 4 tokens.  The repacked tiles live on transparent huge pages (wmem.c).
 * With AVX-512 BW + VNNI, groups of 4 tiles (16 rows) run a kernel that transposes the
 * packed weights in registers so that one vpdpbusd covers 16 rows with a broadcast
 * activation dword and needs no horizontal reduction (t16_*, below); its results are
 * those of the 4-row kernel bit for bit, which still runs the row ranges' edge tiles.
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "err.h"
#include "log.h"
#include "cpu.h"

const float cpu_e2m1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

/* 2·E2M1 + 12 */
static const int8_t lut_biased[16] = { 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 };

int cpu_mxfp4_prepare(struct bweight *w)
{
    const int64_t rows = w->rows, cols = w->cols;
    const uint8_t *src = w->data, *ssrc = w->scale;
    struct cpu_mxfp4 *m;

    if (cols % 32 != 0 || !src || !ssrc)
        return -EINVAL;
    for (int64_t i = 0; i < rows * (cols / 32); i++) {
        if (ssrc[i] == 255) {
            log_debug("mxfp4: scale byte 255 (reserved NaN) at row %lld block %lld",
                      (long long)(i / (cols / 32)), (long long)(i % (cols / 32)));
            return -EINVAL;
        }
    }
    m = calloc(1, sizeof(*m));
    if (!m)
        return -ENOMEM;
    m->rows = rows;
    m->cols = cols;
    m->nblk = cols / 32;
    m->npair = (m->nblk + 1) / 2;
    m->ntile = (rows + MXFP4_TILE_ROWS - 1) / MXFP4_TILE_ROWS;
    m->qs = cpu_wmem_alloc((size_t)(m->ntile * m->npair * MXFP4_TILE_ROWS * 32), &m->qs_mem);
    m->sc = cpu_wmem_alloc((size_t)(m->ntile * m->npair * MXFP4_TILE_ROWS * 2 + 64), &m->sc_mem);
    if (!m->qs || !m->sc) {
        cpu_wmem_free(m->qs_mem);
        cpu_wmem_free(m->sc_mem);
        free(m);
        return -ENOMEM;
    }
    memset(m->qs, 0, (size_t)(m->ntile * m->npair * MXFP4_TILE_ROWS * 32));
    memset(m->sc, 0, (size_t)(m->ntile * m->npair * MXFP4_TILE_ROWS * 2 + 64));
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / MXFP4_TILE_ROWS, rr = r % MXFP4_TILE_ROWS;

        for (int64_t b = 0; b < m->nblk; b++) {
            int64_t p = b / 2, half = b % 2;
            uint8_t *dq = m->qs + ((t * m->npair + p) * MXFP4_TILE_ROWS + rr) * 32 + half * 16;

            memcpy(dq, src + r * (cols / 2) + b * 16, 16);
            m->sc[(t * m->npair + p) * 2 * MXFP4_TILE_ROWS + half * MXFP4_TILE_ROWS + rr] =
                ssrc[r * m->nblk + b];
        }
    }
    w->priv = m;
    return 0;
}

void cpu_mxfp4_release(struct bweight *w)
{
    struct cpu_mxfp4 *m = w->priv;

    if (!m)
        return;
    cpu_wmem_free(m->qs_mem);
    cpu_wmem_free(m->sc_mem);
    free(m);
    w->priv = NULL;
}

bool cpu_mxfp4_use_fast(const struct cpu_ctx *c, const struct bweight *w)
{
    return w->fmt == WFMT_MXFP4 && w->priv && !c->mxfp4_exact && c->have_avx2;
}

/* 2^(e-127) for every E8M0 byte (255 never reaches a kernel: prepare rejects it) */
static float e8m0_tab[256];

__attribute__((constructor)) static void e8m0_tab_init(void)
{
    for (int e = 0; e < 256; e++)
        e8m0_tab[e] = ldexpf(1.0f, e - 127);
}

/* Locate block b of row r: nibbles and scale byte, repacked or on-disk layout. */
static inline const uint8_t *mxfp4_block(const struct bweight *w, int64_t r, int64_t b, uint8_t *e)
{
    const struct cpu_mxfp4 *m = w->priv;

    if (m) {
        int64_t t = r / MXFP4_TILE_ROWS, rr = r % MXFP4_TILE_ROWS, p = b / 2, half = b % 2;

        *e = m->sc[(t * m->npair + p) * 2 * MXFP4_TILE_ROWS + half * MXFP4_TILE_ROWS + rr];
        return m->qs + ((t * m->npair + p) * MXFP4_TILE_ROWS + rr) * 32 + half * 16;
    }
    *e = w->scale[r * (w->cols / 32) + b];
    return (const uint8_t *)w->data + r * (w->cols / 2) + b * 16;
}

/* Decode row r exactly into out[cols] (every value E2M1 * 2^k is exact in fp32). */
static void mxfp4_row_decode_scalar(const struct bweight *w, int64_t r, float *out)
{
    for (int64_t b = 0; b < w->cols / 32; b++) {
        uint8_t e;
        const uint8_t *qs = mxfp4_block(w, r, b, &e);
        float s = e8m0_tab[e];

        for (int j = 0; j < 16; j++) {
            out[b * 32 + 2 * j] = cpu_e2m1[qs[j] & 15] * s;
            out[b * 32 + 2 * j + 1] = cpu_e2m1[qs[j] >> 4] * s;
        }
    }
}

static void exact_dot_scalar(const float *rowbuf, const float *xi, int64_t cols, double *acc)
{
    for (int64_t j = 0; j < cols; j += MXFP4_EXACT_LANES)
        for (int l = 0; l < MXFP4_EXACT_LANES; l++)
            acc[l] += (double)rowbuf[j + l] * (double)xi[j + l];
}

#if defined(__x86_64__)
/* doubled E2M1 as int8; the /2 goes into the (power-of-two, so exact) scale */
static const int8_t lut_doubled[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

CPU_FN_AVX2
static void mxfp4_row_decode_avx2(const struct bweight *w, int64_t r, float *out)
{
    const __m128i lut = _mm_loadu_si128((const __m128i *)lut_doubled);
    const __m128i m4 = _mm_set1_epi8(0x0f);

    for (int64_t b = 0; b < w->cols / 32; b++) {
        uint8_t e;
        const uint8_t *qs = mxfp4_block(w, r, b, &e);
        __m256 s = _mm256_set1_ps(e8m0_tab[e] * 0.5f);   /* e = 0: 2^-128 is still exact */
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, m4));
        __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
        float *o = out + b * 32;

        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), s));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8))), s));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), s));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8))), s));
    }
}

/* same lanes as exact_dot_scalar: acc[0..3], [4..7], [8..11], [12..15] */
CPU_FN_AVX2
static void exact_dot_avx2(const float *rowbuf, const float *xi, int64_t cols, double *acc)
{
    __m256d a0 = _mm256_loadu_pd(acc), a1 = _mm256_loadu_pd(acc + 4);
    __m256d a2 = _mm256_loadu_pd(acc + 8), a3 = _mm256_loadu_pd(acc + 12);

    for (int64_t j = 0; j < cols; j += 16) {
        /* products are exact in fp64, so fma == mul + add here */
        a0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(rowbuf + j)), _mm256_cvtps_pd(_mm_loadu_ps(xi + j)), a0);
        a1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(rowbuf + j + 4)), _mm256_cvtps_pd(_mm_loadu_ps(xi + j + 4)), a1);
        a2 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(rowbuf + j + 8)), _mm256_cvtps_pd(_mm_loadu_ps(xi + j + 8)), a2);
        a3 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(rowbuf + j + 12)), _mm256_cvtps_pd(_mm_loadu_ps(xi + j + 12)), a3);
    }
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2);
    _mm256_storeu_pd(acc + 12, a3);
}
#endif

void cpu_matmul_mxfp4_exact_rows(const struct bweight *w, const float *x, const int32_t *xidx,
                                 int n, float *y, int64_t ldy, int64_t r0, int64_t r1,
                                 float *rowbuf)
{
    const int64_t cols = w->cols;
    const bool avx2 = cpu_isa_has(CPU_ISA_AVX2);

    for (int64_t r = r0; r < r1; r++) {
#if defined(__x86_64__)
        if (avx2)
            mxfp4_row_decode_avx2(w, r, rowbuf);
        else
#endif
            mxfp4_row_decode_scalar(w, r, rowbuf);
        for (int i = 0; i < n; i++) {
            const float *xi = x + (xidx ? xidx[i] : i) * cols;
            double acc[MXFP4_EXACT_LANES] = { 0 };

#if defined(__x86_64__)
            if (avx2)
                exact_dot_avx2(rowbuf, xi, cols, acc);
            else
#endif
                exact_dot_scalar(rowbuf, xi, cols, acc);
            y[(int64_t)i * ldy + (r - r0)] = cpu_exact_fold(acc);
        }
    }
}

/* ---- activation quantisation ---- */

size_t cpu_qact_bytes(int64_t n, int64_t cols)
{
    int64_t npair = (cols / 32 + 1) / 2;

    return (size_t)(n * npair * (64 + 32 + 32) + 64);
}

void cpu_qact_init(struct cpu_qact *qa, void *mem, int64_t n, int64_t cols)
{
    uint8_t *p = (uint8_t *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);

    qa->nblk = cols / 32;
    qa->npair = (qa->nblk + 1) / 2;
    qa->q = (int8_t *)p;
    qa->d8 = (float *)(p + n * qa->npair * 64);
    qa->corr8 = (int32_t *)(p + n * qa->npair * (64 + 32));
    if (qa->nblk % 2) {
        /* the pad block of the last pair: zero values, zero scale */
        for (int64_t i = 0; i < n; i++) {
            int64_t pp = i * qa->npair + qa->npair - 1;

            memset(qa->q + pp * 64 + 16, 0, 16);
            memset(qa->q + pp * 64 + 48, 0, 16);
            memset(qa->d8 + pp * 8 + 4, 0, 16);
            memset(qa->corr8 + pp * 8 + 4, 0, 16);
        }
    }
}

/* x * (1/d) to an int8 level: clamped to [-127, 127] in float (so a denormal d, whose
 * inverse overflows, still gives the block's signs), rounded to nearest even; NaN (a NaN
 * input, or inf * 0 in a block that holds an infinity) gives 0. */
static inline int qact_round(float p)
{
    if (p != p)
        return 0;
    p = p > 127.0f ? 127.0f : (p < -127.0f ? -127.0f : p);
    return (int)lrintf(p);
}

static void qact_block_scalar(const float *xb, int8_t *qe, int8_t *qo, float *ret_d,
                              int32_t *ret_sum)
{
    float amax = 0.0f, d, id;
    int32_t sum = 0;

    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(xb[j]));
    d = amax / 127.0f;
    id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 16; j++) {
        int a = qact_round(xb[2 * j] * id), c = qact_round(xb[2 * j + 1] * id);

        qe[j] = (int8_t)a;
        qo[j] = (int8_t)c;
        sum += a + c;
    }
    *ret_d = d;
    *ret_sum = sum;
}

#if defined(__x86_64__)
/* The same block with AVX-512F, bit for bit: amax ignores NaN like fmaxf (max_ps returns
 * its second operand, the running max, when the element is NaN), the clamp happens in
 * float before cvtps (round to nearest even like lrintf in the default mode), NaN lanes
 * are zeroed by mask, and the integer sum is exact. */
CPU_FN_AVX512
static void qact_block_avx512(const float *xb, int8_t *qe, int8_t *qo, float *ret_d,
                              int32_t *ret_sum)
{
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                            26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    __m512 m = _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_setzero_ps());
    __m512i q0, q1, e, o;
    float amax, d, id;

    m = _mm512_max_ps(_mm512_and_ps(x1, absmask), m);
    amax = _mm512_reduce_max_ps(m);
    d = amax / 127.0f;
    id = d > 0.0f ? 1.0f / d : 0.0f;
    __m512 p0 = _mm512_mul_ps(x0, _mm512_set1_ps(id)), p1 = _mm512_mul_ps(x1, _mm512_set1_ps(id));
    __mmask16 ok0 = _mm512_cmp_ps_mask(p0, p0, _CMP_ORD_Q), ok1 = _mm512_cmp_ps_mask(p1, p1, _CMP_ORD_Q);

    p0 = _mm512_min_ps(_mm512_max_ps(p0, lo), hi);
    p1 = _mm512_min_ps(_mm512_max_ps(p1, lo), hi);
    q0 = _mm512_maskz_cvtps_epi32(ok0, p0);
    q1 = _mm512_maskz_cvtps_epi32(ok1, p1);
    e = _mm512_permutex2var_epi32(q0, evens, q1);
    o = _mm512_permutex2var_epi32(q0, odds, q1);
    _mm_storeu_si128((__m128i *)qe, _mm512_cvtsepi32_epi8(e));
    _mm_storeu_si128((__m128i *)qo, _mm512_cvtsepi32_epi8(o));
    *ret_d = d;
    *ret_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}
#endif

static void qact_quantize(struct cpu_qact *qa, int64_t i, const float *x, int64_t b0, int64_t b1,
                          bool v)
{

    for (int64_t b = b0; b < b1; b++) {
        int64_t pp = i * qa->npair + b / 2, half = b % 2;
        int8_t *qe = qa->q + pp * 64 + half * 16, *qo = qe + 32;
        float d;
        int32_t sum;

#if defined(__x86_64__)
        if (v)
            qact_block_avx512(x + b * 32, qe, qo, &d, &sum);
        else
#endif
            qact_block_scalar(x + b * 32, qe, qo, &d, &sum);
        for (int l = 0; l < 4; l++) {
            qa->d8[pp * 8 + half * 4 + l] = d;
            qa->corr8[pp * 8 + half * 4 + l] = 12 * sum;
        }
    }
}

void cpu_qact_quantize(struct cpu_qact *qa, int64_t i, const float *x, int64_t b0, int64_t b1)
{
#if defined(__x86_64__)
    qact_quantize(qa, i, x, b0, b1, cpu_isa_has(CPU_ISA_AVX512));
#else
    qact_quantize(qa, i, x, b0, b1, false);
#endif
}

void cpu_qact_quantize_scalar(struct cpu_qact *qa, int64_t i, const float *x, int64_t b0,
                              int64_t b1)
{
    qact_quantize(qa, i, x, b0, b1, false);
}

/* ---- fast kernel ---- */

#if defined(__x86_64__)
/* prefetch distance of the fast kernel in bytes (0 = hardware prefetch only) */
int cpu_mxfp4_pf_bytes = 1024;
/* and further ahead into L2, in bytes of each tile's stream (32 pairs; docs/PERFORMANCE.md §4.2) */
#define MXFP4_PF2 (32 * 128)

/* Dot products of one row's 64 biased weights (wlo/whi) with 64 int8 activations:
 * int32 lanes, each the sum of 4 adjacent byte products of lo and of hi. */
#define DOT_AVX2(wl, wh, xl, xh) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((wl), (xl)), \
                                       _mm256_maddubs_epi16((wh), (xh))), ones)
#define DOT_VNNI(wl, wh, xl, xh) \
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), (wl), (xl)), (wh), (xh))

/* tile_dot_<sfx>: NT tokens against one 4-row tile over all pairs; acc[j] lanes are
 * [r0..r3 of b0 | r0..r3 of b1], reduced at the end to 4 row sums per token.
 * fast_rows_<sfx>: the row-range driver (token blocks, then tiles, then 4-token groups). */
#define DEFINE_MXFP4_KERNELS(sfx, target_str, DOT)                                                  \
__attribute__((target(target_str))) static inline void                                             \
tile_dot_##sfx(const struct cpu_mxfp4 *m, int64_t t, const struct cpu_qact *qa,                    \
               const int64_t *xrow, int nt, float out[][MXFP4_TILE_ROWS])                          \
{                                                                                                  \
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut_biased)); \
    const __m256i m4 = _mm256_set1_epi8(0x0f);                                                     \
    const __m256i ones = _mm256_set1_epi16(1);                                                     \
    const __m256i one32 = _mm256_set1_epi32(1);                                                    \
    const __m256i zero = _mm256_setzero_si256();                                                   \
    const uint8_t *qs = m->qs + t * m->npair * MXFP4_TILE_ROWS * 32;                               \
    const uint8_t *sc = m->sc + t * m->npair * MXFP4_TILE_ROWS * 2;                                \
    const int pf = cpu_mxfp4_pf_bytes;                                                             \
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),               \
                      _mm256_setzero_ps() };                                                       \
    (void)ones;                                                                                    \
    for (int64_t p = 0; p < m->npair; p++) {                                                       \
        __m256i wlo[4], whi[4];                                                                    \
        /* software prefetch: the weights are one stream, but a VM's hardware prefetcher     */  \
        /* alone left GEMV at ~45 % of the read bandwidth; this tile's next pairs, then the */  \
        /* next tile (contiguous), cpu_mxfp4_pf_bytes ahead                                 */  \
        if (pf) {                                                                                  \
            _mm_prefetch((const char *)(qs + p * 128) + pf, _MM_HINT_T0);                          \
            _mm_prefetch((const char *)(qs + p * 128) + pf + 64, _MM_HINT_T0);                     \
            if ((p & 7) == 0)                                                                      \
                _mm_prefetch((const char *)(sc + p * 8) + pf / 16, _MM_HINT_T0);                   \
            _mm_prefetch((const char *)(qs + p * 128) + MXFP4_PF2, _MM_HINT_T1);                   \
            _mm_prefetch((const char *)(qs + p * 128) + MXFP4_PF2 + 64, _MM_HINT_T1);              \
            if ((p & 7) == 0)                                                                      \
                _mm_prefetch((const char *)(sc + p * 8) + MXFP4_PF2 / 16, _MM_HINT_T1);            \
        }                                                                                          \
        __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + p * 8)));          \
        /* (e-1)<<23 = 2^(e-128): the E8M0 scale with the LUT's doubling folded in */              \
        __m256 sw = _mm256_castsi256_ps(                                                           \
            _mm256_slli_epi32(_mm256_max_epi32(_mm256_sub_epi32(e, one32), zero), 23));            \
        for (int rr = 0; rr < 4; rr++) {                                                           \
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + (p * 4 + rr) * 32));             \
            wlo[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));                           \
            whi[rr] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));     \
        }                                                                                          \
        for (int j = 0; j < nt; j++) {                                                             \
            const int64_t xo = xrow[j] * qa->npair + p;                                            \
            const int8_t *q = qa->q + xo * 64;                                                     \
            __m256i xlo = _mm256_load_si256((const __m256i *)q);                                   \
            __m256i xhi = _mm256_load_si256((const __m256i *)(q + 32));                            \
            __m256i d0 = DOT(wlo[0], whi[0], xlo, xhi), d1 = DOT(wlo[1], whi[1], xlo, xhi);        \
            __m256i d2 = DOT(wlo[2], whi[2], xlo, xhi), d3 = DOT(wlo[3], whi[3], xlo, xhi);        \
            __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));   \
            h = _mm256_sub_epi32(h, _mm256_load_si256((const __m256i *)(qa->corr8 + xo * 8)));     \
            __m256 sx = _mm256_mul_ps(sw, _mm256_load_ps(qa->d8 + xo * 8));                        \
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sx, acc[j]);                           \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < nt; j++) {                                                                 \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));   \
        _mm_storeu_ps(out[j], s);                                                                  \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
__attribute__((target(target_str))) static void                                                    \
fast_rows_##sfx(const struct bweight *w, const struct cpu_qact *qa, const int32_t *xidx, int n,    \
                float *y, int64_t ldy, int64_t r0, int64_t r1)                                     \
{                                                                                                  \
    const struct cpu_mxfp4 *m = w->priv;                                                           \
    const int64_t t0 = r0 / MXFP4_TILE_ROWS, t1 = (r1 + MXFP4_TILE_ROWS - 1) / MXFP4_TILE_ROWS;    \
    /* token block: keep its quantised activations (~1.5 B/col) within ~256 KiB */                 \
    int64_t tb = (256 * 1024) / (m->cols * 3 / 2 + 64);                                            \
                                                                                                   \
    ASSERT(r0 % MXFP4_TILE_ROWS == 0);                                                             \
    tb = tb < 4 ? 4 : (tb > 256 ? 256 : tb) / 4 * 4;                                               \
    for (int64_t i0 = 0; i0 < n; i0 += tb) {                                                       \
        int64_t i1 = i0 + tb < n ? i0 + tb : n;                                                    \
                                                                                                   \
        for (int64_t t = t0; t < t1; t++) {                                                        \
            for (int64_t i = i0; i < i1; i += 4) {                                                 \
                int nt = i1 - i < 4 ? (int)(i1 - i) : 4;                                           \
                int64_t xrow[4];                                                                   \
                float out[4][MXFP4_TILE_ROWS];                                                     \
                                                                                                   \
                for (int j = 0; j < nt; j++)                                                       \
                    xrow[j] = xidx ? xidx[i + j] : i + j;                                          \
                /* constant nt lets the compiler keep accumulators in registers */                 \
                switch (nt) {                                                                      \
                case 1: tile_dot_##sfx(m, t, qa, xrow, 1, out); break;                             \
                case 2: tile_dot_##sfx(m, t, qa, xrow, 2, out); break;                             \
                case 3: tile_dot_##sfx(m, t, qa, xrow, 3, out); break;                             \
                default: tile_dot_##sfx(m, t, qa, xrow, 4, out); break;                            \
                }                                                                                  \
                for (int j = 0; j < nt; j++) {                                                     \
                    for (int rr = 0; rr < MXFP4_TILE_ROWS; rr++) {                                 \
                        int64_t r = t * MXFP4_TILE_ROWS + rr;                                      \
                                                                                                   \
                        if (r >= r0 && r < r1)                                                     \
                            y[(i + j) * ldy + (r - r0)] = out[j][rr];                              \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_MXFP4_KERNELS(avx2, CPU_TARGET_AVX2, DOT_AVX2)
DEFINE_MXFP4_KERNELS(vnni, CPU_TARGET_VNNI, DOT_VNNI)

/* ---- 16-row kernel (AVX-512 VNNI): multi-token calls ----
 * The old kernel reduces every (row, pair) dot product horizontally (3 hadd) for every
 * token.  This one takes 16 rows (4 consecutive repacked tiles) at a time and transposes
 * their packed nibbles in registers, per pair, into 8 vectors Y[b][h] (block b of the
 * pair, 4-byte group h of the block's 16 bytes): lane L holds the 4 bytes 4h..4h+3 of
 * row bitrev4(L).  Decoded through the biased LUT, the low nibbles of Y[b][h] are the
 * weights of the even columns 8h, 8h+2, 8h+4, 8h+6 and the high nibbles those of the odd
 * columns 8h+1..8h+7 - exactly the 4-byte groups of the quantised activations' even and
 * odd halves (cpu_qact), so vpdpbusd with a broadcast activation dword leaves in lane L
 * the block's integer dot product for its row: 8 vpdpbusd per token per 16 rows x 32
 * columns, no reduction.  The transposition (24 vpermt2d per pair) and the decode are
 * paid once per 16-row group and call: on the fly for up to T16_NT tokens, else into a
 * decoded chunk of T16_CHUNK pairs that every group of T16_NT tokens then reads.
 * The layout of the repacked weight is unchanged (cpu_weight_get and the exact path
 * read it as before); a 16-row layout built at prepare would save the transposition.
 * Numerics are those of tile_dot bit for bit: the integer block sums are exact whatever
 * their order, and the float part is the same operations in the same order per (row,
 * token): acc_even over the pairs' first blocks, acc_odd over their second, each
 * fma((float)(isum - 12*qsum), sw * d, acc) from +0, then acc_even + acc_odd.
 * The transposition is 3 stages of vpermt2d; stage s swaps bit s of the vector index
 * (which starts as row bits 3..1) with bit 2-s of the lane (which starts as [row bit 0,
 * block, h1, h0]), leaving vector (h0 << 2 | h1 << 1 | b) and lane bits (r0 r1 r2 r3). */
#define T16_TARGET CPU_TARGET_VNNI
#define T16_NT 4

/* nonzero: multi-token calls keep the 4-row kernel (tests, benchmarks) */
int cpu_mxfp4_t16_off;
/* calls with fewer tokens keep the 4-row kernel */
int cpu_mxfp4_t16_min_n = 1;

static int32_t t16_perm[3][2][16];     /* stage, output half: vpermt2d index */
static int32_t t16_sidx[2][16];        /* block of the pair: scale bytes -> lane order */
static int32_t t16_bitrev[16];

static int bitrev4(int l)
{
    return ((l & 1) << 3) | ((l & 2) << 1) | ((l & 4) >> 1) | ((l & 8) >> 3);
}

__attribute__((constructor)) static void t16_init(void)
{
    for (int s = 0; s < 3; s++) {
        int bit = 1 << (2 - s);

        for (int l = 0; l < 16; l++) {
            t16_perm[s][0][l] = (l & bit) ? (16 | (l & ~bit)) : l;
            t16_perm[s][1][l] = (l & bit) ? (16 | l) : (l | bit);
        }
    }
    for (int l = 0; l < 16; l++) {
        int r = bitrev4(l), j = r >> 2, rr = r & 3;

        t16_bitrev[l] = r;
        for (int b = 0; b < 2; b++)
            t16_sidx[b][l] = (j >= 2 ? 16 : 0) | (8 * (j & 1) + 4 * b + rr);
    }
}

static inline int32_t load_i32(const void *p)
{
    int32_t v;

    memcpy(&v, p, 4);
    return v;
}

static inline int64_t load_i64(const void *p)
{
    int64_t v;

    memcpy(&v, p, 8);
    return v;
}

/* Constants of the 16-row kernel, loaded once per call of a driver. */
struct t16_k {
    __m512i lut, m4, one32, zero;
    __m512i perm[3][2], sidx[2];
};

__attribute__((target(T16_TARGET))) static inline void t16_k_load(struct t16_k *k)
{
    k->lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lut_biased));
    k->m4 = _mm512_set1_epi8(0x0f);
    k->one32 = _mm512_set1_epi32(1);
    k->zero = _mm512_setzero_si512();
    for (int s = 0; s < 3; s++)
        for (int o = 0; o < 2; o++)
            k->perm[s][o] = _mm512_loadu_si512(t16_perm[s][o]);
    k->sidx[0] = _mm512_loadu_si512(t16_sidx[0]);
    k->sidx[1] = _mm512_loadu_si512(t16_sidx[1]);
}

/* Pair p of rows 16g..16g+15: the packed nibbles transposed into z[(h0 << 2) | (h1 << 1)
 * | b] (see above) and the two blocks' scale vectors sw[b] (lane order bitrev4). */
__attribute__((target(T16_TARGET))) static inline void
t16_pair_load(const struct t16_k *k, const struct cpu_mxfp4 *m, int64_t g, int64_t p, __m512i z[8],
              __m512 sw[2])
{
    const int64_t qstride = m->npair * MXFP4_TILE_ROWS * 32, sstride = m->npair * MXFP4_TILE_ROWS * 2;
    const uint8_t *qs = m->qs + 4 * g * qstride + p * 128;
    const uint8_t *sc = m->sc + 4 * g * sstride + p * 8;
    const int pf = cpu_mxfp4_pf_bytes;

    /* software prefetch as in tile_dot, in each of the 4 tiles' streams, pf ahead into L1 and
     * MXFP4_PF2 into L2; a stream that runs past its tile continues in the same tile of the
     * next group (the next tile in memory is another stream of this group, already being
     * read), k tiles' lengths past it k groups on */
    if (pf) {
        const int64_t qo = p * 128 + pf >= qstride ? pf + 3 * qstride : pf;
        const int64_t so = p * 8 + pf / 16 >= sstride ? pf / 16 + 3 * sstride : pf / 16;
        int64_t qo2 = MXFP4_PF2, so2 = MXFP4_PF2 / 16;

        for (int64_t o = p * 128 + MXFP4_PF2; o >= qstride; o -= qstride) {
            qo2 += 3 * qstride;
            so2 += 3 * sstride;
        }
        for (int t = 0; t < 4; t++) {
            const char *q = (const char *)(qs + t * qstride), *s = (const char *)(sc + t * sstride);

            _mm_prefetch(q + qo, _MM_HINT_T0);
            _mm_prefetch(q + qo + 64, _MM_HINT_T0);
            _mm_prefetch(q + qo2, _MM_HINT_T1);
            _mm_prefetch(q + qo2 + 64, _MM_HINT_T1);
            if ((p & 7) == 0) {
                _mm_prefetch(s + so, _MM_HINT_T0);
                _mm_prefetch(s + so2, _MM_HINT_T1);
            }
        }
    }
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_loadu_si512(qs + (i >> 1) * qstride + (i & 1) * 64);
    for (int i = 0; i < 8; i += 2) {
        __m512i a = z[i], b = z[i + 1];

        z[i] = _mm512_permutex2var_epi32(a, k->perm[0][0], b);
        z[i + 1] = _mm512_permutex2var_epi32(a, k->perm[0][1], b);
    }
    for (int i = 0; i < 8; i++) {
        if (i & 2)
            continue;
        __m512i a = z[i], b = z[i + 2];

        z[i] = _mm512_permutex2var_epi32(a, k->perm[1][0], b);
        z[i + 2] = _mm512_permutex2var_epi32(a, k->perm[1][1], b);
    }
    for (int i = 0; i < 4; i++) {
        __m512i a = z[i], b = z[i + 4];

        z[i] = _mm512_permutex2var_epi32(a, k->perm[2][0], b);
        z[i + 4] = _mm512_permutex2var_epi32(a, k->perm[2][1], b);
    }
    {
        __m128i lo = _mm_set_epi64x(load_i64(sc + sstride), load_i64(sc));
        __m128i hi = _mm_set_epi64x(load_i64(sc + 3 * sstride), load_i64(sc + 2 * sstride));
        __m512i elo = _mm512_cvtepu8_epi32(lo), ehi = _mm512_cvtepu8_epi32(hi);

        for (int b = 0; b < 2; b++) {
            __m512i e = _mm512_permutex2var_epi32(elo, k->sidx[b], ehi);

            /* (e-1)<<23 = 2^(e-128), 0 for e <= 1: as tile_dot */
            sw[b] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_max_epi32(_mm512_sub_epi32(e, k->one32), k->zero), 23));
        }
    }
}

/* Block b's 8 weight vectors from the transposed nibbles: wv[2h] = even columns of group h
 * (low nibbles), wv[2h+1] = odd columns (high nibbles), biased u8. */
__attribute__((target(T16_TARGET))) static inline void
t16_block_decode(const struct t16_k *k, const __m512i z[8], int b, __m512i wv[8])
{
    for (int h = 0; h < 4; h++) {
        __m512i v = z[((h & 1) << 2) | ((h >> 1) << 1) | b];

        wv[2 * h] = _mm512_shuffle_epi8(k->lut, _mm512_and_si512(v, k->m4));
        wv[2 * h + 1] = _mm512_shuffle_epi8(k->lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), k->m4));
    }
}

/* acc += block b of pair p for token row xrow: the float steps of tile_dot, per lane.
 * One vpdpbusd chain when other tokens give the core independent work, two otherwise
 * (integer sums: the same value either way). */
__attribute__((target(T16_TARGET))) static inline __m512
t16_block_acc(const struct t16_k *k, const struct cpu_qact *qa, int64_t xrow, int64_t p, int b,
              const __m512i wv[8], __m512 sw, __m512 acc, bool two_chains)
{
    const int64_t xo = xrow * qa->npair + p;
    const int8_t *q = qa->q + xo * 64 + b * 16;     /* even columns; odd ones at +32 */
    __m512i s0, s1;

    s0 = _mm512_dpbusd_epi32(k->zero, wv[0], _mm512_set1_epi32(load_i32(q)));
    if (two_chains) {
        s1 = _mm512_dpbusd_epi32(k->zero, wv[1], _mm512_set1_epi32(load_i32(q + 32)));
        for (int h = 1; h < 4; h++) {
            s0 = _mm512_dpbusd_epi32(s0, wv[2 * h], _mm512_set1_epi32(load_i32(q + 4 * h)));
            s1 = _mm512_dpbusd_epi32(s1, wv[2 * h + 1], _mm512_set1_epi32(load_i32(q + 32 + 4 * h)));
        }
        s0 = _mm512_add_epi32(s0, s1);
    } else {
        s0 = _mm512_dpbusd_epi32(s0, wv[1], _mm512_set1_epi32(load_i32(q + 32)));
        for (int h = 1; h < 4; h++) {
            s0 = _mm512_dpbusd_epi32(s0, wv[2 * h], _mm512_set1_epi32(load_i32(q + 4 * h)));
            s0 = _mm512_dpbusd_epi32(s0, wv[2 * h + 1], _mm512_set1_epi32(load_i32(q + 32 + 4 * h)));
        }
    }
    s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(qa->corr8[xo * 8 + b * 4]));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0),
                           _mm512_mul_ps(sw, _mm512_set1_ps(qa->d8[xo * 8 + b * 4])), acc);
}

/* Rows 16g..16g+15 (repacked tiles 4g..4g+3, all present) against nt tokens, decoding
 * each pair on the fly: out[j] = the 16 row results of token xrow[j], in row order. */
__attribute__((target(T16_TARGET))) static inline void
t16_dot(const struct t16_k *k, const struct cpu_mxfp4 *m, int64_t g, const struct cpu_qact *qa,
        const int64_t *xrow, int nt, __m512 *out)
{
    __m512 acc[2][T16_NT];

    for (int j = 0; j < nt; j++) {
        acc[0][j] = _mm512_setzero_ps();
        acc[1][j] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < m->npair; p++) {
        __m512i z[8];
        __m512 sw[2];

        t16_pair_load(k, m, g, p, z, sw);
        for (int b = 0; b < 2; b++) {
            __m512i wv[8];

            t16_block_decode(k, z, b, wv);
            for (int j = 0; j < nt; j++)
                acc[b][j] = t16_block_acc(k, qa, xrow[j], p, b, wv, sw[b], acc[b][j], nt == 1);
        }
    }
    {
        const __m512i br = _mm512_loadu_si512(t16_bitrev);

        for (int j = 0; j < nt; j++)
            out[j] = _mm512_permutexvar_ps(br, _mm512_add_ps(acc[0][j], acc[1][j]));
    }
}

/* Decoded weights of up to T16_CHUNK pairs of one 16-row group, reused by every token
 * group of a call with more than T16_NT tokens. */
#define T16_CHUNK 16
#define T16_TB_MAX 256      /* tokens per block */
struct t16_dec {
    __m512i wv[T16_CHUNK][2][8];
    __m512 sw[T16_CHUNK][2];
};

/* Pairs [p0, p0 + np) of the decoded chunk d against nt tokens; acc[b][j] carried in and
 * out (the same operations in the same order as t16_dot). */
__attribute__((target(T16_TARGET))) static inline void
t16_dot_dec(const struct t16_k *k, const struct t16_dec *d, int64_t p0, int np,
            const struct cpu_qact *qa, const int64_t *xrow, int nt, __m512 acc[2][T16_NT])
{
    __m512 a[2][T16_NT];

    for (int j = 0; j < nt; j++) {
        a[0][j] = acc[0][j];
        a[1][j] = acc[1][j];
    }
    for (int pp = 0; pp < np; pp++)
        for (int b = 0; b < 2; b++)
            for (int j = 0; j < nt; j++)
                a[b][j] = t16_block_acc(k, qa, xrow[j], p0 + pp, b, d->wv[pp][b], d->sw[pp][b],
                                        a[b][j], nt == 1);
    for (int j = 0; j < nt; j++) {
        acc[0][j] = a[0][j];
        acc[1][j] = a[1][j];
    }
}

/* Token rows [i0, i1) (more than T16_NT) against group g: each chunk of pairs decoded once
 * into d, then run for every token group, the accumulators kept in state between chunks. */
__attribute__((target(T16_TARGET))) static void
t16_group_many(const struct t16_k *k, const struct cpu_mxfp4 *m, int64_t g,
               const struct cpu_qact *qa, const int32_t *xidx, int64_t i0, int64_t i1, float *y,
               int64_t ldy, int64_t r0, __mmask16 keep, struct t16_dec *d,
               __m512 (*state)[2][T16_NT])
{
    const __m512i br = _mm512_loadu_si512(t16_bitrev);

    for (int64_t p0 = 0; p0 < m->npair; p0 += T16_CHUNK) {
        const int np = m->npair - p0 < T16_CHUNK ? (int)(m->npair - p0) : T16_CHUNK;

        for (int pp = 0; pp < np; pp++) {
            __m512i z[8];

            t16_pair_load(k, m, g, p0 + pp, z, d->sw[pp]);
            t16_block_decode(k, z, 0, d->wv[pp][0]);
            t16_block_decode(k, z, 1, d->wv[pp][1]);
        }
        for (int64_t i = i0; i < i1; i += T16_NT) {
            int nt = i1 - i < T16_NT ? (int)(i1 - i) : T16_NT;
            __m512 (*acc)[T16_NT] = state[(i - i0) / T16_NT];
            int64_t xrow[T16_NT];

            for (int j = 0; j < nt; j++) {
                xrow[j] = xidx ? xidx[i + j] : i + j;
                if (p0 == 0)
                    acc[0][j] = acc[1][j] = _mm512_setzero_ps();
            }
            switch (nt) {
            case 1: t16_dot_dec(k, d, p0, np, qa, xrow, 1, acc); break;
            case 2: t16_dot_dec(k, d, p0, np, qa, xrow, 2, acc); break;
            case 3: t16_dot_dec(k, d, p0, np, qa, xrow, 3, acc); break;
            default: t16_dot_dec(k, d, p0, np, qa, xrow, T16_NT, acc); break;
            }
            if (p0 + np < m->npair)
                continue;
            for (int j = 0; j < nt; j++)
                _mm512_mask_storeu_ps(y + (i + j) * ldy + (16 * g - r0), keep,
                                      _mm512_permutexvar_ps(br, _mm512_add_ps(acc[0][j], acc[1][j])));
        }
    }
}

/* The groups [g0, g1) with more than T16_NT tokens in a block: decoded chunk and carried
 * accumulators on this stack (50 KiB), apart from the common few-token path. */
__attribute__((target(T16_TARGET))) static void __attribute__((noinline))
t16_groups_many(const struct t16_k *k, const struct cpu_mxfp4 *m, int64_t g0, int64_t g1,
                const struct cpu_qact *qa, const int32_t *xidx, int64_t i0, int64_t i1, float *y,
                int64_t ldy, int64_t r0, int64_t r1)
{
    struct t16_dec d;
    __m512 state[T16_TB_MAX / T16_NT][2][T16_NT];

    ASSERT(i1 - i0 <= T16_TB_MAX);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t rend = 16 * g + 16 < r1 ? 16 * g + 16 : r1;

        t16_group_many(k, m, g, qa, xidx, i0, i1, y, ldy, r0,
                       (__mmask16)((1u << (rend - 16 * g)) - 1), &d, state);
    }
}

__attribute__((target(T16_TARGET))) static void
fast_rows_t16(const struct bweight *w, const struct cpu_qact *qa, const int32_t *xidx, int n,
              float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    const struct cpu_mxfp4 *m = w->priv;
    const int64_t t0 = r0 / MXFP4_TILE_ROWS, t1 = (r1 + MXFP4_TILE_ROWS - 1) / MXFP4_TILE_ROWS;
    /* 16-row groups wholly inside [r0, r1) (the last may end in padding rows) */
    const int64_t g0 = (t0 + 3) / 4, g1 = t1 / 4;
    int64_t tb = (256 * 1024) / (m->cols * 3 / 2 + 64);
    struct t16_k k;

    ASSERT(r0 % MXFP4_TILE_ROWS == 0);
    if (g1 <= g0) {
        fast_rows_vnni(w, qa, xidx, n, y, ldy, r0, r1);
        return;
    }
    if (16 * g0 > r0)
        fast_rows_vnni(w, qa, xidx, n, y, ldy, r0, 16 * g0);
    if (16 * g1 < r1)
        fast_rows_vnni(w, qa, xidx, n, y + (16 * g1 - r0), ldy, 16 * g1, r1);
    /* token block: its quantised activations (~1.5 B/col) within ~256 KiB */
    tb = tb < T16_NT ? T16_NT : (tb > T16_TB_MAX ? T16_TB_MAX : tb) / T16_NT * T16_NT;
    t16_k_load(&k);
    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        int64_t i1 = i0 + tb < n ? i0 + tb : n;

        if (i1 - i0 > T16_NT) {
            t16_groups_many(&k, m, g0, g1, qa, xidx, i0, i1, y, ldy, r0, r1);
            continue;
        }
        for (int64_t g = g0; g < g1; g++) {
            const int64_t rend = 16 * g + 16 < r1 ? 16 * g + 16 : r1;
            const __mmask16 keep = (__mmask16)((1u << (rend - 16 * g)) - 1);
            int nt = (int)(i1 - i0);
            int64_t xrow[T16_NT];
            __m512 out[T16_NT];

            for (int j = 0; j < nt; j++)
                xrow[j] = xidx ? xidx[i0 + j] : i0 + j;
            switch (nt) {
            case 1: t16_dot(&k, m, g, qa, xrow, 1, out); break;
            case 2: t16_dot(&k, m, g, qa, xrow, 2, out); break;
            case 3: t16_dot(&k, m, g, qa, xrow, 3, out); break;
            default: t16_dot(&k, m, g, qa, xrow, T16_NT, out); break;
            }
            for (int j = 0; j < nt; j++)
                _mm512_mask_storeu_ps(y + (i0 + j) * ldy + (16 * g - r0), keep, out[j]);
        }
    }
}

/* The 16-row kernel and the 256-bit VNNI one run at level vnni (cpu-features.h). */
int64_t cpu_mxfp4_row_align(const struct bweight *w)
{
    (void)w;
    return cpu_isa_has(CPU_ISA_VNNI) && !cpu_mxfp4_t16_off ? 16 : MXFP4_TILE_ROWS;
}

void cpu_matmul_mxfp4_fast_rows(const struct bweight *w, const struct cpu_qact *qa,
                                const int32_t *xidx, int n, float *y, int64_t ldy, int64_t r0,
                                int64_t r1)
{
    const bool vnni = cpu_isa_has(CPU_ISA_VNNI);

    if (vnni && !cpu_mxfp4_t16_off && n >= cpu_mxfp4_t16_min_n)
        fast_rows_t16(w, qa, xidx, n, y, ldy, r0, r1);
    else if (vnni)
        fast_rows_vnni(w, qa, xidx, n, y, ldy, r0, r1);
    else
        fast_rows_avx2(w, qa, xidx, n, y, ldy, r0, r1);
}
#else
int cpu_mxfp4_t16_off;
int cpu_mxfp4_t16_min_n = 1;

int64_t cpu_mxfp4_row_align(const struct bweight *w)
{
    (void)w;
    return MXFP4_TILE_ROWS;
}

void cpu_matmul_mxfp4_fast_rows(const struct bweight *w, const struct cpu_qact *qa,
                                const int32_t *xidx, int n, float *y, int64_t ldy, int64_t r0,
                                int64_t r1)
{
    BUG_ON(1);  /* have_avx2 is false off x86_64 */
}
#endif
