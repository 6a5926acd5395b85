/* attention.c - attention over a paged KV cache (MODEL.md §2.3 step 5).
 *
 * Token i of sequence s sits at absolute position t = seq_pos0[s] + (i - start[s]) and
 * attends to keys tau in [lo, t], lo = 0 (full causal) or max(0, t - window + 1)
 * (sliding: exactly `window` keys including itself).  Key tau lives in physical slot
 * block_tables[off[s] + tau / block_size] * block_size + tau % block_size.  Query head h
 * reads KV head h / (n_heads / n_kv_heads) (contiguous grouping).  The same code serves
 * prefill chunks, decode and verify runs: the cache must already hold every key up to
 * the last query position (kv_store first).  Softmax is computed online over chunks of
 * keys in fp32 with a vectorised fp32 exp (exp_shift_sum).  One parallel region over
 * work items (sequence, block of its query tokens, KV head), cut into coarse contiguous
 * units claimed by the pool's threads.  The query heads sharing a KV head AND a block of
 * up to ATTN_MAX_ROWS / G consecutive query tokens of one sequence (prefill, verify) are
 * processed together, so each K/V row is read and converted once per such block; a run
 * is cut into blocks of equal size so that the items cost about the same.
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define KEY_CHUNK 64     /* a multiple of 32 */
#define ATTN_WORK 8.0    /* split decision: multiply-add equivalents per query row x dim x key */

struct attn_job {
    const struct attn_args *a;
    bool avx2;
    int qb;                 /* query tokens per block (ATTN_MAX_ROWS / G) */
    int64_t n_items;        /* (sequence, block, KV head) work items */
    _Atomic int err;
};

#if defined(__x86_64__)
/* BF16 -> fp32 of one cache row, 8 at a time (exact: the bits move up by 16). */
__attribute__((target("avx2"))) static void bf16_row_avx2(const uint16_t *src, int n, float *dst)
{
    int d = 0;

    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d))), 16)));
    for (; d < n; d++)
        dst[d] = cpu_bf16_to_f32(src[d]);
}
#endif

/* Row (slot, KV head j) of a K or V cache as fp32: the cache row itself (FP32 cache) or
 * buf[head_dim] filled from BF16. */
static inline const float *kv_row_f32(const struct kv_layer *kv, const void *base, int64_t slot,
                                      int j, float *buf, bool avx2)
{
    int64_t off = (slot * kv->n_kv_heads + j) * kv->head_dim;

    if (kv->dtype_f32)
        return (const float *)base + off;
#if defined(__x86_64__)
    if (avx2) {
        bf16_row_avx2((const uint16_t *)base + off, kv->head_dim, buf);
        return buf;
    }
#else
    (void)avx2;
#endif
    for (int d = 0; d < kv->head_dim; d++)
        buf[d] = cpu_bf16_to_f32(((const uint16_t *)base)[off + d]);
    return buf;
}

/* v[k] = exp(v[k] - m) for k in [0, n) where every v[k] <= m (or NaN); returns their sum.
 * Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial, 2^n built in
 * the exponent bits; under 1 ulp measured on [-87, 0]) instead of a libm call per score;
 * exp_shift_sum_avx2 is the 8-lane form.  Arguments below -87.3 (results near FLT_MIN)
 * give 0. */
static float exp_shift_sum(float *v, int n, float m)
{
    float l8[8] = { 0 };
    int k = 0;

    for (int i = 0; i < n; i++) {
        const float x0 = v[i] - m, x = x0 < -87.3f ? -87.3f : x0;
        const float fn = floorf(x * 1.44269504088896341f + 0.5f);
        const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        int32_t bits;
        float two_n;

        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * (r * r) + r + 1.0f;
        bits = ((int32_t)fn + 127) * (1 << 23);
        memcpy(&two_n, &bits, sizeof(two_n));
        v[i] = x0 < -87.3f ? 0.0f : p * two_n;
    }
    for (; k + 8 <= n; k += 8)
        for (int e = 0; e < 8; e++)
            l8[e] += v[k + e];
    for (; k < n; k++)
        l8[0] += v[k];
    return ((l8[0] + l8[4]) + (l8[1] + l8[5])) + ((l8[2] + l8[6]) + (l8[3] + l8[7]));
}

/* Largest of v[0, n) (n >= 1) in 8 independent lanes (a single compare chain is
 * latency-bound); NaN-free input, as scores of finite q and k are. */
static inline float max_of(const float *v, int n)
{
    float l8[8], r;
    int k = 8;

    if (n < 8) {
        r = v[0];
        for (int i = 1; i < n; i++)
            r = v[i] > r ? v[i] : r;
        return r;
    }
    memcpy(l8, v, sizeof(l8));
    for (; k + 8 <= n; k += 8)
        for (int e = 0; e < 8; e++)
            l8[e] = v[k + e] > l8[e] ? v[k + e] : l8[e];
    for (; k < n; k++)
        l8[0] = v[k] > l8[0] ? v[k] : l8[0];
    r = l8[0];
    for (int e = 1; e < 8; e++)
        r = l8[e] > r ? l8[e] : r;
    return r;
}

/* q·k with 8 independent lanes (vectorisable without reassociation flags), fixed order */
static inline float dot8(const float *a, const float *b, int n)
{
    float l[8] = { 0 };
    int d = 0;

    for (; d + 8 <= n; d += 8)
        for (int k = 0; k < 8; k++)
            l[k] += a[d + k] * b[d + k];
    for (; d < n; d++)
        l[0] += a[d] * b[d];
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}

/* sc[r][k] = qs[r] · kp[k] for R query rows and nk keys (rows of hd floats). */
static void scores_scalar(const float *qs, int R, int hd, const float *const *kp, int nk,
                          float *sc)
{
    for (int r = 0; r < R; r++)
        for (int k = 0; k < nk; k++)
            sc[(int64_t)r * KEY_CHUNK + k] = dot8(qs + (int64_t)r * hd, kp[k], hd);
}

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma")))

/* Same for hd % 8 == 0: 4 keys per step, their 8-lane sums reduced together. */
AVX2_FN static void scores_avx2(const float *qs, int R, int hd, const float *const *kp, int nk,
                                float *sc)
{
    for (int r = 0; r < R; r++) {
        const float *q = qs + (int64_t)r * hd;

        for (int k0 = 0; k0 < nk; k0 += 4) {
            const int kn = nk - k0 < 4 ? nk - k0 : 4;
            /* past nk: recompute the chunk's first key (result dropped) */
            const float *p0 = kp[k0], *p1 = kn > 1 ? kp[k0 + 1] : p0;
            const float *p2 = kn > 2 ? kp[k0 + 2] : p0, *p3 = kn > 3 ? kp[k0 + 3] : p0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, h;
            __m128 s4;
            float t4[4];

            for (int d = 0; d < hd; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);

                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(p0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(p1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(p2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(p3 + d), a3);
            }
            h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(t4, s4);
            for (int e = 0; e < kn; e++)
                sc[(int64_t)r * KEY_CHUNK + k0 + e] = t4[e];
        }
    }
}

/* exp_shift_sum 8 lanes at a time (the same Cephes steps; plain C does not vectorise). */
AVX2_FN static float exp_shift_sum_avx2(float *v, int n, float m)
{
    const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f);
    __m256 sum = _mm256_setzero_ps(), h;
    __m128 s4;
    int i = 0;

    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_sub_ps(_mm256_loadu_ps(v + i), mv);
        const __m256 x = _mm256_max_ps(lo, x0);
        const __m256 fn = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                          _mm256_set1_ps(0.5f)));
        const __m256 r = _mm256_fmadd_ps(fn, _mm256_set1_ps(2.12194440e-4f),
                                         _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x));
        __m256 p = _mm256_set1_ps(1.9875691500e-4f), e;

        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
        e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
                                 _mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23)));
        e = _mm256_andnot_ps(_mm256_cmp_ps(x0, lo, _CMP_LT_OQ), e);
        _mm256_storeu_ps(v + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    h = _mm256_hadd_ps(sum, sum);
    s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    return _mm_cvtss_f32(_mm_hadd_ps(s4, s4)) + (i < n ? exp_shift_sum(v + i, n - i, m) : 0.0f);
}

/* acc[0, hd) += sum over k in [ka, kb) of p[k] * vp[k][0, hd), 32 (then 8) output columns
 * held in registers across the keys. */
AVX2_FN static void pv_avx2(const float *p, int ka, int kb, const float *const *vp, int hd,
                            float *acc)
{
    int d0 = 0;

    for (; d0 + 32 <= hd; d0 += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d0), a1 = _mm256_loadu_ps(acc + d0 + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d0 + 16), a3 = _mm256_loadu_ps(acc + d0 + 24);

        for (int k = ka; k < kb; k++) {
            const __m256 pk = _mm256_set1_ps(p[k]);
            const float *vr = vp[k] + d0;

            a0 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr + 24), a3);
        }
        _mm256_storeu_ps(acc + d0, a0);
        _mm256_storeu_ps(acc + d0 + 8, a1);
        _mm256_storeu_ps(acc + d0 + 16, a2);
        _mm256_storeu_ps(acc + d0 + 24, a3);
    }
    for (; d0 + 8 <= hd; d0 += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d0);

        for (int k = ka; k < kb; k++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[k]), _mm256_loadu_ps(vp[k] + d0), a0);
        _mm256_storeu_ps(acc + d0, a0);
    }
    for (int k = ka; k < kb; k++)
        for (int d = d0; d < hd; d++)
            acc[d] += p[k] * vp[k][d];
}
#endif

/* Query rows (token x query head) processed together against one pass over the keys;
 * bounds the per-thread stack (acc, scores, converted keys and values). */
#define ATTN_MAX_ROWS 32

/* Attention of query tokens [i0, i1) of sequence s (consecutive positions) for the G query
 * heads sharing KV head j: every K and V row of the union of their key ranges is read (and
 * converted from BF16 into a chunk buffer) once for all nq x G query rows.  Keys outside
 * a row's own range [lo, t] get no weight.  The P·V update runs per row over the chunk's
 * keys with 32 output columns held in registers.  Returns -EINVAL on a bad block id. */
static int attn_chunk(const struct attn_args *a, bool avx2, int s, int i0, int i1, int j)
{
    const struct kv_layer *kv = a->kv;
    const int hd = a->head_dim, G = a->n_heads / a->n_kv_heads, bs = kv->block_size;
    const int nq = i1 - i0, R = nq * G;
    const int64_t t0 = (int64_t)a->seq_pos0[s] + (i0 - a->seq_tok_start[s]), t_last = t0 + nq - 1;
    const int64_t lo0 = a->window > 0 && t0 - a->window + 1 > 0 ? t0 - a->window + 1 : 0;
    const int32_t *table = a->block_tables + a->block_table_off[s];
    float acc[R][hd], qs[R][hd], kf[KEY_CHUNK][hd], vf[KEY_CHUNK][hd], sc[R][KEY_CHUNK];
    const float *kp[KEY_CHUNK], *vp[KEY_CHUNK];
    float m[R], l[R];
    int ka[R], kb[R];

    memset(acc, 0, sizeof(acc));
    for (int r = 0; r < R; r++) {
        const float *q = a->q + ((int64_t)(i0 + r / G) * a->n_heads + (int64_t)j * G + r % G) * hd;

        for (int d = 0; d < hd; d++)
            qs[r][d] = q[d] * a->scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    /* key chunks are aligned to absolute multiples of KEY_CHUNK, so a row's partition of
     * its keys (and with it every rounding of the online softmax) depends only on its own
     * [lo, t], not on which other tokens share the pass: decode, verify and prefill agree
     * bit for bit */
    for (int64_t cb = lo0 / KEY_CHUNK * KEY_CHUNK; cb <= t_last; cb += KEY_CHUNK) {
        const int64_t c0 = cb > lo0 ? cb : lo0;
        const int64_t ce = cb + KEY_CHUNK < t_last + 1 ? cb + KEY_CHUNK : t_last + 1;
        const int nk = (int)(ce - c0);

        /* walk the chunk's keys block by block (one table lookup and one division per
         * block, not per key) */
        for (int k = 0; k < nk;) {
            const int64_t tau = c0 + k, bi = tau / bs, off = tau - bi * bs;
            const int32_t blk = table[bi];
            const int run = bs - off < nk - k ? (int)(bs - off) : nk - k;
            int64_t slot;

            if (blk < 0 || blk >= kv->n_blocks) {
                log_debug("attention: position %lld maps to block %d (pool has %d)",
                          (long long)tau, blk, kv->n_blocks);
                return -EINVAL;
            }
            slot = (int64_t)blk * bs + off;
            for (int e = 0; e < run; e++, k++, slot++) {
                kp[k] = kv_row_f32(kv, kv->k, slot, j, kf[k], avx2);
                vp[k] = kv_row_f32(kv, kv->v, slot, j, vf[k], avx2);
            }
        }
#if defined(__x86_64__)
        if (avx2 && hd % 8 == 0)
            scores_avx2(&qs[0][0], R, hd, kp, nk, &sc[0][0]);
        else
#endif
            scores_scalar(&qs[0][0], R, hd, kp, nk, &sc[0][0]);
        for (int r = 0; r < R; r++) {
            const int64_t t = t0 + r / G;
            const int64_t lo = a->window > 0 && t - a->window + 1 > 0 ? t - a->window + 1 : 0;
            float *srow = sc[r], cmax;

            /* this row's keys within the chunk: [ka, kb) */
            ka[r] = lo > c0 ? (int)(lo - c0) : 0;
            kb[r] = t + 1 - c0 < nk ? (int)(t + 1 - c0) : nk;
            if (ka[r] >= kb[r])
                continue;
            cmax = max_of(srow + ka[r], kb[r] - ka[r]);
            if (cmax > m[r]) {
                float corr = expf(m[r] - cmax);    /* 0 on the row's first keys */

                l[r] *= corr;
                for (int d = 0; d < hd; d++)
                    acc[r][d] *= corr;
                m[r] = cmax;
            }
#if defined(__x86_64__)
            if (avx2)
                l[r] += exp_shift_sum_avx2(srow + ka[r], kb[r] - ka[r], m[r]);
            else
#endif
                l[r] += exp_shift_sum(srow + ka[r], kb[r] - ka[r], m[r]);
        }
        for (int r = 0; r < R; r++) {
#if defined(__x86_64__)
            if (avx2) {
                pv_avx2(sc[r], ka[r], kb[r], vp, hd, acc[r]);
                continue;
            }
#endif
            for (int k = ka[r]; k < kb[r]; k++)
                for (int d = 0; d < hd; d++)
                    acc[r][d] += sc[r][k] * vp[k][d];
        }
    }
    for (int r = 0; r < R; r++) {
        float *out = a->out + ((int64_t)(i0 + r / G) * a->n_heads + (int64_t)j * G + r % G) * hd;

        for (int d = 0; d < hd; d++)
            out[d] = acc[r][d] / l[r];
    }
    return 0;
}

/* Blocks of sequence s: its run cut into the fewest pieces of at most qb tokens, of equal
 * size (+-1), so that every piece - and with it every work item - costs about the same. */
static int attn_blocks(const struct attn_args *a, int s, int qb)
{
    int len = a->seq_tok_start[s + 1] - a->seq_tok_start[s];

    return (len + qb - 1) / qb;
}

static void attn_unit(void *arg, int unit, int n_units, int ith)
{
    struct attn_job *jb = arg;
    const struct attn_args *a = jb->a;
    const int nkv = a->n_kv_heads;
    int64_t u0, u1, base = 0;
    int s = 0, nb = attn_blocks(a, 0, jb->qb);

    (void)ith;
    /* work items are (sequence, block of its tokens, KV head), in that order; a unit is a
     * contiguous range of the jb->n_items of them.  A block's query tokens share one pass
     * over its keys.  Results do not depend on the blocking (attn_chunk), so neither on
     * the thread count. */
    cpu_split(jb->n_items, 1, unit, n_units, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        int b, j, len, st, r;

        while (u >= base + (int64_t)nb * nkv) {
            base += (int64_t)nb * nkv;
            nb = attn_blocks(a, ++s, jb->qb);
        }
        b = (int)((u - base) / nkv);
        j = (int)((u - base) % nkv);
        st = a->seq_tok_start[s];
        len = a->seq_tok_start[s + 1] - st;
        r = attn_chunk(a, jb->avx2, s, st + (int)((int64_t)len * b / nb),
                       st + (int)((int64_t)len * (b + 1) / nb), j);
        if (r < 0) {
            atomic_store(&jb->err, r);
            return;
        }
    }
}

int cpu_attention(struct backend *be, const struct attn_args *a)
{
    struct attn_job jb = { .a = a, .avx2 = cpu_ctx(be)->have_avx2 };

    if (a->n_seqs == 0 || a->n_tok == 0)
        return 0;
    if (a->seq_tok_start[0] != 0 || a->seq_tok_start[a->n_seqs] != a->n_tok) {
        log_debug("attention: seq_tok_start must run from 0 to n_tok (%d)", a->n_tok);
        return -EINVAL;
    }
    if (a->kv->block_size <= 0 || !(a->scale > 0.0f))
        return -EINVAL;
    for (int s = 0; s < a->n_seqs; s++) {
        if (a->seq_tok_start[s + 1] < a->seq_tok_start[s] || a->seq_pos0[s] < 0 ||
            a->block_table_off[s] < 0) {
            log_debug("attention: sequence %d has a bad token range, position or table offset", s);
            return -EINVAL;
        }
    }
    {
        /* work estimate: every query row against the longest context of the batch */
        double keys = 0;

        for (int s = 0; s < a->n_seqs; s++) {
            double k = a->seq_pos0[s] + (a->seq_tok_start[s + 1] - a->seq_tok_start[s]);
            keys = k > keys ? k : keys;
        }
        if (a->window > 0 && keys > a->window)
            keys = a->window;
        /* per multiply-add, attention also converts and buffers K/V rows and takes an
         * exp: a 1-token pass over 64-100 keys costs about what a 200K-MAC matmul does */
        int nth = cpu_threads_for(cpu_ctx(be),
                                  ATTN_WORK * a->n_tok * a->n_heads * a->head_dim * keys);
        int units = nth * CPU_UNITS_PER_THREAD;
        int G = a->n_heads / a->n_kv_heads;

        jb.qb = ATTN_MAX_ROWS / G > 1 ? ATTN_MAX_ROWS / G : 1;
        for (int s = 0; s < a->n_seqs; s++)
            jb.n_items += (int64_t)attn_blocks(a, s, jb.qb) * a->n_kv_heads;
        units = units < jb.n_items ? units : (int)jb.n_items;
        cpu_pool_for(cpu_ctx(be)->pool, attn_unit, &jb, nth > 1 ? units : 1, nth);
    }
    return atomic_load(&jb.err);
}
