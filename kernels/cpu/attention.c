/* attention.c - attention over a paged KV cache (docs/MODEL.md §2.3 step 5).
 *
 * Token i of sequence s sits at absolute position t = seq_pos0[s] + (i - start[s]) and
 * attends to keys tau in [lo, t], lo = 0 (full causal) or max(0, t - window + 1)
 * (sliding: exactly `window` keys including itself).  Key tau lives in physical slot
 * block_tables[off[s] + tau / block_size] * block_size + tau % block_size.  Query head h
 * reads KV head h / (n_heads / n_kv_heads) (contiguous grouping).  The same code serves
 * prefill chunks, decode and verify runs: the cache must already hold every key up to
 * the last query position (kv_store first).  Softmax is computed online over chunks of
 * keys in fp32 with the kernels' exp polynomial (vexp.h, exp_shift_sum).  One parallel region over
 * work items (sequence, block of its query tokens, KV head), cut into coarse contiguous
 * units claimed by the pool's threads.  The query heads sharing a KV head AND a block of
 * up to ATTN_MAX_ROWS / G consecutive query tokens of one sequence (prefill, verify) are
 * processed together, so each K/V row is read and converted once per such block; a run
 * is cut into blocks of equal size so that the items cost about the same.
 *
 * Split-K: a row's keys are cut into segments at absolute multiples of ATTN_SPLIT_KEYS,
 * each with a softmax state of its own, folded in key order (attn_fold).  A long decode
 * (or short verify run) with fewer than ATTN_SPLIT_ITEMS items a thread runs each segment
 * as an item, which leaves its state (max, sum, unnormalised output) per row in scratch,
 * and attn_merge_unit folds them afterwards; otherwise one item folds its segments as it
 * goes.  The split points depend on the positions only, so the output is the same bits
 * for any thread count, with the split or without, and for decode, verify and prefill.
 *
 * A pass (one KV head over one key chunk) prefetches the K and V rows of a later pass: a
 * head's rows are a slot apart, a stride the hardware prefetchers do not follow.  Into L1
 * the next pass in processing order (Intel, several KV heads an item: the group's next
 * head, or the next chunk's first), else into L2 the same head's rows of the next chunk,
 * which the AVX-512 P.V kernel then brings into L1 ATTN_PV_PF keys ahead.  With a BF16
 * cache the scores and P.V kernels read the cache rows themselves, converting each vector
 * in registers once for up to 8 query rows (AVX2 P.V: 4) (scores_bf16_*, pv_bf16_*;
 * bit-identical to converting the rows into fp32 buffers first, which an FP32 cache and
 * cpu_attn_no_fused do).
 *
 * The AVX-512 kernels (chosen at run time, cpu_isa_has; STEPD_CPU_ISA=avx2 forces the AVX2
 * ones) do the AVX2 path's arithmetic on zmm registers, bit for bit: each lane takes the
 * same 8-lane FMA partials over d (two keys, or two query rows, per register) and the same
 * reduction tree per score, the same per-element exp (vexp.h) and 8-lane sum, and per-lane
 * FMAs in key order for P.V.  test-attention compares the paths.
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define KEY_CHUNK 64     /* a multiple of 32 */
/* keys ahead at which the AVX-512 P.V kernel prefetches its own V rows into L1 where the
 * lines came into L2 a chunk ahead (struct next_rows; docs/PERFORMANCE.md §8.2), not where
 * the pass before brought them into L1 (§8.6) */
#define ATTN_PV_PF 16
/* Keys per split-K segment (a multiple of KEY_CHUNK and of the usual block sizes): a row's
 * keys are cut at absolute multiples of it, each piece's softmax state kept apart and the
 * pieces merged in key order (attn_fold), whether one item runs them all or an item runs
 * each (cpu_attention) */
#define ATTN_SPLIT_KEYS 2048
/* split a long context's keys over items when there are fewer than this many items a
 * thread without (cpu_attention) */
#define ATTN_SPLIT_ITEMS 2
/* most scratch the segments' states may take where the split is chosen (cpu_attention):
 * 64 MiB, 8 verify runs of 4 tokens x 64 heads at 128k keys */
#define ATTN_SPLIT_MAX_BYTES ((size_t)64 << 20)

/* nonzero: one KV head per work item, as before head groups (benchmarks; cpu.h) */
int cpu_attn_no_groups;
/* nonzero: BF16 rows go through fp32 buffers first (tests; cpu.h) */
int cpu_attn_no_fused;
/* split-K segments: keys per segment (a multiple of KEY_CHUNK), and 0 = split where it
 * pays, > 0 = always, < 0 = never (tests, benchmarks; cpu.h) */
int cpu_attn_split_keys = ATTN_SPLIT_KEYS;
int cpu_attn_split;
/* the next chunk's K and V rows (fused BF16 kernels, items of several KV heads) into L1
 * (> 0) or L2 only (0); < 0: into L1 on Intel CPUs, L2 elsewhere (cpu_attn_pf_l1_on; cpu.h) */
int cpu_attn_pf_l1 = -1;
#define ATTN_WORK 8.0    /* split decision: multiply-add equivalents per query row x dim x key */

struct attn_job {
    const struct attn_args *a;
    bool avx2;
    bool pf_l1;             /* cpu_attn_pf_l1_on() at the call */
    int avx512;             /* cpu_attn_avx512_level: 0, or 1 (the AVX-512 path) */
    int qb;                 /* query tokens per block (ATTN_MAX_ROWS / G) */
    int n_groups;           /* KV head groups per (sequence, block) */
    int64_t n_items;        /* (sequence, block, KV head group[, segment]) work items */
    int64_t seg_keys;       /* keys per segment (cpu_attn_split_keys at the call) */
    bool split;             /* an item per segment, its state into part, merged after */
    int nsmax;              /* segments of the longest sequence (split) */
    float *part;            /* split: per (token, query head, segment) m, l, acc[hd] */
    _Atomic int err;
};

#if defined(__x86_64__)
/* BF16 -> fp32 of one cache row, 8 at a time (exact: the bits move up by 16). */
CPU_FN_AVX2 static void bf16_row_avx2(const uint16_t *src, int n, float *dst)
{
    int d = 0;

    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d))), 16)));
    for (; d < n; d++)
        dst[d] = cpu_bf16_to_f32(src[d]);
}
#endif

/* Element offset of row (slot, KV head j) in a K or V cache. */
static inline int64_t kv_row_off(const struct kv_layer *kv, int64_t slot, int j)
{
    return (slot * kv->n_kv_heads + j) * kv->head_dim;
}

/* Row (slot, KV head j) of a K or V cache as fp32: the cache row itself (FP32 cache) or
 * buf[head_dim] filled from BF16. */
static inline const float *kv_row_f32(const struct kv_layer *kv, const void *base, int64_t slot,
                                      int j, float *buf, bool avx2)
{
    int64_t off = kv_row_off(kv, slot, j);

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
 * vexp1 (vexp.h) instead of a libm call per score; exp_shift_sum_avx2 and _avx512 are the
 * vector forms, element for element the same.  Arguments below -87.3 (results near
 * FLT_MIN) give 0. */
static float exp_shift_sum(float *v, int n, float m)
{
    float l8[8] = { 0 };
    int k = 0;

    for (int i = 0; i < n; i++) {
        const float x0 = v[i] - m;

        v[i] = x0 < VEXP_MIN ? 0.0f : vexp1(x0);
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
#define AVX2_FN CPU_FN_AVX2

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

/* The K and V rows (BF16) of this pass's head in the next key chunk: prefetched during this
 * pass, so that they come from the caches.  A
 * head's rows are a slot apart (n_kv_heads rows), a stride the hardware prefetchers do not
 * follow: without this, every row was a wait on memory (AVX2, 1 thread, 64 heads at 1k
 * keys: about 2 GB/s). */
struct next_rows {
    const uint16_t *k[KEY_CHUNK], *v[KEY_CHUNK];
    int n;
    bool l1;                /* prefetcht0 instead of prefetcht2 (cpu_attn_pf_l1) */
    bool k_only;            /* the K rows only (the AVX-512 P.V kernel takes the V rows) */
};

/* one line of the next pass's rows: into L1 where nx->l1 (prefetcht0: Intel hosts), else
 * into L2 only (prefetcht2; see attn_chunk and cpu_attn_pf_l1) */
static inline void next_line(const struct next_rows *nx, const uint16_t *p)
{
    if (nx->l1)
        __builtin_prefetch(p, 0, 3);
    else
        __builtin_prefetch(p, 0, 1);
}

/* 64 bytes of each of the rows [k0, k1) of nx: K and V, or K alone where nx->k_only */
static inline void next_rows_prefetch(const struct next_rows *nx, int k0, int k1, int hd)
{
    for (int k = k0; k < k1 && k < nx->n; k++)
        for (int o = 0; o < hd; o += 32) {
            next_line(nx, nx->k[k] + o);
            if (!nx->k_only)
                next_line(nx, nx->v[k] + o);
        }
}

/* The V rows [k0, k1) of nx alone (next_rows_prefetch's V half) */
static inline void next_rows_prefetch_v(const struct next_rows *nx, int k0, int k1, int hd)
{
    for (int k = k0; k < k1 && k < nx->n; k++)
        for (int o = 0; o < hd; o += 32)
            next_line(nx, nx->v[k] + o);
}

/* BF16 -> fp32 of 8 values at p (exact: the bits move up by 16) */
#define BF16X8(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* scores_avx2 straight from a BF16 cache, bit for bit (the same 8-lane FMA partial over d
 * and reduction tree per score): nr (1..4) query rows x 2 keys per step, each key vector
 * converted in registers once for the nr rows, 8 independent FMA chains; no fp32 copy of
 * the keys (converting a chunk into a buffer first cost a store and a reload per value,
 * and the chunk's two buffers did not fit in L1). */
__attribute__((target(CPU_TARGET_AVX2), always_inline)) static inline void
scores_bf16_rows(const float *q, int nr, int hd, const uint16_t *const *kr, int nk, float *sc,
                 const struct next_rows *nx)
{
    for (int k0 = 0; k0 < nk; k0 += 2) {
        const uint16_t *p0 = kr[k0], *p1 = k0 + 1 < nk ? kr[k0 + 1] : p0;
        __m256 a[4][2];

        if (nx)
            next_rows_prefetch(nx, k0, k0 + 2 < nk ? k0 + 2 : nk, hd);
        for (int i = 0; i < nr; i++)
            a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m256 k0v = BF16X8(p0 + d), k1v = BF16X8(p1 + d);

            for (int i = 0; i < nr; i++) {
                const __m256 qv = _mm256_loadu_ps(q + (int64_t)i * hd + d);

                a[i][0] = _mm256_fmadd_ps(qv, k0v, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qv, k1v, a[i][1]);
            }
        }
        for (int i = 0; i < nr; i++) {
            /* per key ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as scores_avx2 */
            const __m256 h = _mm256_hadd_ps(a[i][0], a[i][1]), h2 = _mm256_hadd_ps(h, h);
            const __m128 s2 = _mm_add_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1));
            float *o = sc + (int64_t)i * KEY_CHUNK + k0;

            o[0] = _mm_cvtss_f32(s2);
            if (k0 + 1 < nk)
                o[1] = _mm_cvtss_f32(_mm_movehdup_ps(s2));
        }
    }
}

/* scores_bf16_rows for 8 query rows (the query heads of a KV head at decode) x 1 key per
 * step, so that each key row is read and converted once for all of them: 8 FMA chains
 * (the 16 of 8 rows x 2 keys do not fit in 16 ymm registers), each row's partials reduced
 * by the same tree as scores_avx2, four rows at a time. */
__attribute__((target(CPU_TARGET_AVX2), always_inline)) static inline void
scores_bf16_rows8(const float *q, int hd, const uint16_t *const *kr, int nk, float *sc,
                  const struct next_rows *nx)
{
    for (int k = 0; k < nk; k++) {
        const uint16_t *p = kr[k];
        __m256 a[8];
        float t[8];

        if (nx)
            next_rows_prefetch(nx, k, k + 1, hd);
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m256 kv = BF16X8(p + d);

            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (int64_t)i * hd + d), kv, a[i]);
        }
        for (int i = 0; i < 8; i += 4) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i], a[i + 1]),
                                            _mm256_hadd_ps(a[i + 2], a[i + 3]));

            _mm_storeu_ps(t + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        }
        for (int i = 0; i < 8; i++)
            sc[(int64_t)i * KEY_CHUNK + k] = t[i];
    }
}

AVX2_FN static void scores_bf16_avx2(const float *qs, int R, int hd, const uint16_t *const *kr,
                                     int nk, float *sc, const struct next_rows *nx)
{
    int r = 0;

    /* the first rows' pass prefetches the next pass's rows, spread over its keys */
    for (; r + 8 <= R; r += 8, nx = NULL)
        scores_bf16_rows8(qs + (int64_t)r * hd, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx);
    for (; r + 4 <= R; r += 4, nx = NULL)
        scores_bf16_rows(qs + (int64_t)r * hd, 4, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx);
    switch (R - r) {
    case 3: scores_bf16_rows(qs + (int64_t)r * hd, 3, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx); break;
    case 2: scores_bf16_rows(qs + (int64_t)r * hd, 2, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx); break;
    case 1: scores_bf16_rows(qs + (int64_t)r * hd, 1, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx); break;
    default: break;
    }
}

/* pv_avx2 straight from a BF16 cache for nr (1..4) rows over the same keys [ka, kb), bit for
 * bit (per lane the same FMAs in key order): 16 output columns of the nr rows in registers,
 * each V vector converted once for them. */
__attribute__((target(CPU_TARGET_AVX2), always_inline)) static inline void
pv_bf16_rows(const float *sc, int nr, int ka, int kb, const uint16_t *const *vr, int hd, float *acc)
{
    for (int d0 = 0; d0 < hd; d0 += 16) {
        __m256 a[4][2];

        for (int i = 0; i < nr; i++) {
            a[i][0] = _mm256_loadu_ps(acc + (int64_t)i * hd + d0);
            a[i][1] = _mm256_loadu_ps(acc + (int64_t)i * hd + d0 + 8);
        }
        for (int k = ka; k < kb; k++) {
            const __m256 v0 = BF16X8(vr[k] + d0), v1 = BF16X8(vr[k] + d0 + 8);

            for (int i = 0; i < nr; i++) {
                const __m256 pk = _mm256_set1_ps(sc[(int64_t)i * KEY_CHUNK + k]);

                a[i][0] = _mm256_fmadd_ps(pk, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(pk, v1, a[i][1]);
            }
        }
        for (int i = 0; i < nr; i++) {
            _mm256_storeu_ps(acc + (int64_t)i * hd + d0, a[i][0]);
            _mm256_storeu_ps(acc + (int64_t)i * hd + d0 + 8, a[i][1]);
        }
    }
}

/* P.V of R rows (scores sc, KEY_CHUNK apart; accumulators acc, hd apart; hd % 16 == 0) from
 * a BF16 cache: runs of up to 4 consecutive rows with the same key range share the pass (8
 * rows as 8 x 8 output columns, each V vector converted once for all 8, ran 3-5 % slower:
 * a broadcast per FMA; docs/PERFORMANCE.md §8.2). */
AVX2_FN static void pv_bf16_avx2(const float *sc, int R, const int *ka, const int *kb,
                                 const uint16_t *const *vr, int hd, float *acc)
{
    for (int r = 0; r < R;) {
        int n = 1;

        while (n < 4 && r + n < R && ka[r + n] == ka[r] && kb[r + n] == kb[r])
            n++;
        if (ka[r] < kb[r]) {
            const float *s = sc + (int64_t)r * KEY_CHUNK;
            float *ac = acc + (int64_t)r * hd;

            switch (n) {
            case 4: pv_bf16_rows(s, 4, ka[r], kb[r], vr, hd, ac); break;
            case 3: pv_bf16_rows(s, 3, ka[r], kb[r], vr, hd, ac); break;
            case 2: pv_bf16_rows(s, 2, ka[r], kb[r], vr, hd, ac); break;
            default: pv_bf16_rows(s, 1, ka[r], kb[r], vr, hd, ac); break;
            }
        }
        r += n;
    }
}

/* exp_shift_sum 8 lanes at a time (vexp8; plain C does not vectorise). */
AVX2_FN static float exp_shift_sum_avx2(float *v, int n, float m)
{
    const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(VEXP_MIN);
    __m256 sum = _mm256_setzero_ps(), h;
    __m128 s4;
    int i = 0;

    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_sub_ps(_mm256_loadu_ps(v + i), mv);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x0, lo, _CMP_LT_OQ),
                                          vexp8(_mm256_max_ps(lo, x0)));

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

#define AVX512_FN CPU_FN_AVX512
#define AVX512_INLINE __attribute__((target(CPU_TARGET_AVX512), always_inline)) static inline

/* _mm256_hadd_ps on each 256-bit half: per 128-bit lane [a0+a1, a2+a3, b0+b1, b2+b3] */
AVX512_INLINE __m512 hadd512(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xdd));
}

/* exp(x0) of 16 lanes where x0 = v - m <= 0 (0 below -87.3): exp_shift_sum_avx2's steps,
 * lane for lane */
AVX512_INLINE __m512 exp16(__m512 x0)
{
    const __m512 lo = _mm512_set1_ps(VEXP_MIN);

    return _mm512_mask_mov_ps(vexp16(_mm512_max_ps(lo, x0)), _mm512_cmp_ps_mask(x0, lo, _CMP_LT_OQ),
                              _mm512_setzero_ps());
}

/* exp_shift_sum on n < 8 values with exp16: the same values and the same sequential sum
 * as the scalar exp_shift_sum (vexp1 and vexp16 agree bit for bit).  v has room for 8
 * floats where room (the lanes past n get don't-care values), else exactly n are written
 * (a masked store, which later loads cannot forward from). */
AVX512_FN static float exp_tail_avx512(float *v, int n, float m, bool room)
{
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, v), _mm512_set1_ps(m)));
    float t[16], sum = 0.0f;

    _mm512_storeu_ps(t, e);
    if (room)
        _mm256_storeu_ps(v, _mm512_castps512_ps256(e));
    else
        _mm512_mask_storeu_ps(v, live, e);
    for (int k = 0; k < n; k++)
        sum += t[k];
    return sum;
}

/* exp_shift_sum_avx2, bit for bit: the same per-element steps on 16 lanes, and the 8-lane
 * sum still takes the blocks of 8 one after another (low half, then high half); the last
 * n % 8 values by exp_tail_avx512 (the AVX2 path: the scalar exp_shift_sum, the same
 * values).  v has room for cap >= n floats (see exp_tail_avx512). */
AVX512_FN static float exp_shift_sum_avx512(float *v, int n, float m, int cap)
{
    const __m512 mv = _mm512_set1_ps(m);
    __m256 sum = _mm256_setzero_ps(), h;
    __m128 s4;
    int i = 0;

    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(v + i), mv));

        _mm512_storeu_ps(v + i, e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (i + 8 <= n) {
        /* the high half is computed on zeros and dropped */
        const __m256 e = _mm512_castps512_ps256(
            exp16(_mm512_sub_ps(_mm512_castps256_ps512(_mm256_loadu_ps(v + i)), mv)));

        _mm256_storeu_ps(v + i, e);
        sum = _mm256_add_ps(sum, e);
        i += 8;
    }
    h = _mm256_hadd_ps(sum, sum);
    s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (i == n)
        return _mm_cvtss_f32(_mm_hadd_ps(s4, s4)) + 0.0f;
    return _mm_cvtss_f32(_mm_hadd_ps(s4, s4)) +
           exp_tail_avx512(v + i, n - i, m, cap - i >= 8);
}

/* scores_avx2 for two query rows at once, bit for bit: qp holds the rows in pairs, chunk
 * d of a pair being [row 2i d..d+7, row 2i+1 d..d+7] (an odd last row paired with
 * itself), and every key chunk is broadcast to both halves, so each lane carries the
 * same 8-lane FMA partial over d as scores_avx2.  8 keys per step; their partials are
 * reduced by the same tree (hadd, hadd, low + high half). */
AVX512_FN static void scores_avx512(const float *qp, int R, int hd, const float *const *kp,
                                    int nk, float *sc)
{
    const __m512i perm = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);

    for (int r = 0; r < R; r += 2) {
        const float *q = qp + (int64_t)r * hd;      /* pair r / 2: 2 * hd floats */

        for (int k0 = 0; k0 < nk; k0 += 8) {
            const float *p[8];
            __m512 a[8], u0, u1, s;

            /* past nk: the chunk's first key again (results dropped) */
            for (int e = 0; e < 8; e++) {
                p[e] = k0 + e < nk ? kp[k0 + e] : kp[k0];
                a[e] = _mm512_setzero_ps();
            }
            for (int d = 0; d < hd; d += 8) {
                const __m512 qv = _mm512_loadu_ps(q + 2 * d);

                for (int e = 0; e < 8; e++)
                    a[e] = _mm512_fmadd_ps(qv, _mm512_castpd_ps(_mm512_broadcast_f64x4(
                                                   _mm256_loadu_pd((const double *)(p[e] + d)))),
                                           a[e]);
            }
            /* u0: 128-bit lanes = row A keys 0-3 (d-lanes 0-3 sums), A 0-3 (4-7), B 0-3,
             * B 0-3 (4-7); u1 the same for keys 4-7 */
            u0 = hadd512(hadd512(a[0], a[1]), hadd512(a[2], a[3]));
            u1 = hadd512(hadd512(a[4], a[5]), hadd512(a[6], a[7]));
            s = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
            s = _mm512_permutexvar_ps(perm, s);     /* [A keys 0-7, B keys 0-7] */
            /* k0 + 8 <= KEY_CHUNK: columns past nk are never read */
            _mm256_storeu_ps(sc + (int64_t)r * KEY_CHUNK + k0, _mm512_castps512_ps256(s));
            if (r + 1 < R)
                _mm256_storeu_ps(sc + (int64_t)(r + 1) * KEY_CHUNK + k0,
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
        }
    }
}

/* pv_avx2 for ng (1..4) rows over the same keys [ka, kb), hd % 16 == 0: each V row is
 * loaded once for all of them; every lane still takes its FMAs in key order (zmm or ymm,
 * the per-lane sequence is the same). */
AVX512_INLINE void pv_group(const float *const *pr, float *const *ac, const int ng, int ka,
                            int kb, const float *const *vp, int hd)
{
    int d0 = 0;

    for (; d0 + 32 <= hd; d0 += 32) {
        __m512 a[4][2];

#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            a[g][0] = _mm512_loadu_ps(ac[g] + d0);
            a[g][1] = _mm512_loadu_ps(ac[g] + d0 + 16);
        }
        for (int k = ka; k < kb; k++) {
            const __m512 v0 = _mm512_loadu_ps(vp[k] + d0), v1 = _mm512_loadu_ps(vp[k] + d0 + 16);

#pragma GCC unroll 4
            for (int g = 0; g < ng; g++) {
                const __m512 pk = _mm512_set1_ps(pr[g][k]);

                a[g][0] = _mm512_fmadd_ps(pk, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pk, v1, a[g][1]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            _mm512_storeu_ps(ac[g] + d0, a[g][0]);
            _mm512_storeu_ps(ac[g] + d0 + 16, a[g][1]);
        }
    }
    for (; d0 + 16 <= hd; d0 += 16) {
        __m512 a[4];

#pragma GCC unroll 4
        for (int g = 0; g < ng; g++)
            a[g] = _mm512_loadu_ps(ac[g] + d0);
        for (int k = ka; k < kb; k++) {
            const __m512 v0 = _mm512_loadu_ps(vp[k] + d0);

#pragma GCC unroll 4
            for (int g = 0; g < ng; g++)
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(pr[g][k]), v0, a[g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++)
            _mm512_storeu_ps(ac[g] + d0, a[g]);
    }
}

AVX512_FN static void pv_rows_avx512(const float *const *pr, float *const *ac, int ng, int ka,
                                     int kb, const float *const *vp, int hd)
{
    switch (ng) {
    case 1:
        pv_group(pr, ac, 1, ka, kb, vp, hd);
        break;
    case 2:
        pv_group(pr, ac, 2, ka, kb, vp, hd);
        break;
    case 3:
        pv_group(pr, ac, 3, ka, kb, vp, hd);
        break;
    default:
        pv_group(pr, ac, 4, ka, kb, vp, hd);
        break;
    }
}

/* P.V of a chunk for all R rows: the keys are cut at every row's ka and kb, so that within
 * a segment a fixed set of rows is active; those go through pv_rows_avx512 four at a
 * time.  Each row still takes exactly its keys [ka, kb), in key order. */
static void pv_chunk_avx512(const float *sc, float *acc, int R, const int *ka, const int *kb,
                            const float *const *vp, int hd)
{
    int bnd[2 * R], nb = 0;

    for (int r = 0; r < R; r++) {
        const int v2[2] = { ka[r], kb[r] };

        if (ka[r] >= kb[r])
            continue;
        for (int x = 0; x < 2; x++) {
            int i = nb;

            while (i > 0 && bnd[i - 1] > v2[x])
                i--;
            if (i > 0 && bnd[i - 1] == v2[x])
                continue;
            memmove(bnd + i + 1, bnd + i, sizeof(int) * (size_t)(nb - i));
            bnd[i] = v2[x];
            nb++;
        }
    }
    for (int i = 0; i + 1 < nb; i++) {
        const float *pr[4];
        float *ac[4];
        int ng = 0;

        for (int r = 0; r < R; r++) {
            if (ka[r] > bnd[i] || kb[r] < bnd[i + 1])
                continue;
            pr[ng] = sc + (int64_t)r * KEY_CHUNK;
            ac[ng] = acc + (int64_t)r * hd;
            if (++ng == 4) {
                pv_rows_avx512(pr, ac, ng, bnd[i], bnd[i + 1], vp, hd);
                ng = 0;
            }
        }
        if (ng > 0)
            pv_rows_avx512(pr, ac, ng, bnd[i], bnd[i + 1], vp, hd);
    }
}

/* BF16 -> fp32 of 8 values at p0 and 8 at p1, as [p0's | p1's] (exact) */
#define BF16X8X2(p0, p1) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(           \
    _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0))),     \
                            _mm_loadu_si128((const __m128i *)(p1)), 1)), 16))
/* BF16 -> fp32 of 16 values at p (exact) */
#define BF16X16(p) _mm512_castsi512_ps(_mm512_slli_epi32(                                       \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

/* scores_bf16_rows on zmm, bit for bit: a register holds the 8-lane FMA partials over d of
 * two keys side by side ([key a | key b], each query chunk broadcast to both halves), so
 * every lane takes the FMAs of scores_avx2 at full width, and the partials of 4 keys x 2
 * rows are reduced by the same tree (hadd, hadd, low + high 128 bits).  nr (1..8) query
 * rows x 4 keys per step; each key vector is widened in registers once for the nr rows. */
AVX512_INLINE void scores_bf16_rows512(const float *q, int nr, int hd, const uint16_t *const *kr,
                                       int nk, float *sc, const struct next_rows *nx)
{
    for (int k0 = 0; k0 < nk; k0 += 4) {
        /* past nk: the step's first key again (results dropped) */
        const uint16_t *p0 = kr[k0], *p1 = k0 + 1 < nk ? kr[k0 + 1] : p0;
        const uint16_t *p2 = k0 + 2 < nk ? kr[k0 + 2] : p0, *p3 = k0 + 3 < nk ? kr[k0 + 3] : p0;
        const int kn = nk - k0 < 4 ? nk - k0 : 4;
        __m512 a[8][2];

        if (nx)
            next_rows_prefetch(nx, k0, k0 + kn, hd);
        for (int i = 0; i < nr; i++)
            a[i][0] = a[i][1] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            const __m512 k01 = BF16X8X2(p0 + d, p1 + d), k23 = BF16X8X2(p2 + d, p3 + d);

            for (int i = 0; i < nr; i++) {
                const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + (int64_t)i * hd + d));

                a[i][0] = _mm512_fmadd_ps(qv, k01, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(qv, k23, a[i][1]);
            }
        }
        for (int i = 0; i < nr; i += 2) {
            const int i1 = i + 1 < nr ? i + 1 : i;
            /* 128-bit lanes: [i k0, i k2, i1 k0, i1 k2] (d-lanes 0-3 sums), the same (4-7),
             * then k1 and k3 likewise; + the neighbour lane: the per-key tree of
             * scores_avx2 */
            const __m512 h = hadd512(hadd512(a[i][0], a[i][1]), hadd512(a[i1][0], a[i1][1]));
            const __m512 s = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, 0xb1));
            /* [i k0-k3 | i1 k0-k3] in the low 256 bits, stored 4 columns a row: k0 + 4 <=
             * KEY_CHUNK, and columns past nk are never read (a spill and 8 scalar copies a
             * row before) */
            const __m256 o8 = _mm512_castps512_ps256(_mm512_permutexvar_ps(
                _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), s));
            float *o = sc + (int64_t)i * KEY_CHUNK + k0;

            _mm_storeu_ps(o, _mm256_castps256_ps128(o8));
            if (i + 1 < nr)
                _mm_storeu_ps(o + KEY_CHUNK, _mm256_extractf128_ps(o8, 1));
        }
    }
}

AVX512_FN static void scores_bf16_avx512(const float *qs, int R, int hd,
                                         const uint16_t *const *kr, int nk, float *sc,
                                         const struct next_rows *nx)
{
    int r = 0;

    /* the first rows' pass prefetches the next pass's rows, spread over its keys */
    for (; r + 8 <= R; r += 8, nx = NULL)
        scores_bf16_rows512(qs + (int64_t)r * hd, 8, hd, kr, nk, sc + (int64_t)r * KEY_CHUNK, nx);
    switch (R - r) {
#define SC_CASE(n) case n: scores_bf16_rows512(qs + (int64_t)r * hd, n, hd, kr, nk,                 \
                                               sc + (int64_t)r * KEY_CHUNK, nx); break;
    SC_CASE(7) SC_CASE(6) SC_CASE(5) SC_CASE(4) SC_CASE(3) SC_CASE(2) SC_CASE(1)
#undef SC_CASE
    default: break;
    }
}

/* pv_bf16_rows on zmm for nr (1..8) rows over the same keys [ka, kb), hd % 16 == 0, bit for
 * bit (per lane the same FMAs in key order): 32 (then 16) output columns of the nr rows in
 * registers, each V vector widened once for them; a 32-column block's line of each V row is
 * prefetched into L1 ATTN_PV_PF keys ahead. */
AVX512_INLINE void pv_bf16_rows512(const float *sc, int nr, int ka, int kb,
                                   const uint16_t *const *vr, int hd, float *acc,
                                   const struct next_rows *nx, bool own_pf)
{
    int d0 = 0;

    for (; d0 + 32 <= hd; d0 += 32) {
        __m512 a[8][2];

        for (int i = 0; i < nr; i++) {
            a[i][0] = _mm512_loadu_ps(acc + (int64_t)i * hd + d0);
            a[i][1] = _mm512_loadu_ps(acc + (int64_t)i * hd + d0 + 16);
        }
        for (int k = ka; k < kb; k++) {
            const __m512 v0 = BF16X16(vr[k] + d0), v1 = BF16X16(vr[k] + d0 + 16);

            /* this column block's line of the row ATTN_PV_PF keys on, L2 -> L1: the rows
             * are a slot apart, which the L1 prefetchers do not follow */
            if (own_pf && k + ATTN_PV_PF < kb)
                _mm_prefetch((const char *)(vr[k + ATTN_PV_PF] + d0), _MM_HINT_T0);
            /* and this column block's line of the next pass's V row k (next_rows) */
            if (nx && k < nx->n)
                next_line(nx, nx->v[k] + d0);

            for (int i = 0; i < nr; i++) {
                const __m512 pk = _mm512_set1_ps(sc[(int64_t)i * KEY_CHUNK + k]);

                a[i][0] = _mm512_fmadd_ps(pk, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(pk, v1, a[i][1]);
            }
        }
        for (int i = 0; i < nr; i++) {
            _mm512_storeu_ps(acc + (int64_t)i * hd + d0, a[i][0]);
            _mm512_storeu_ps(acc + (int64_t)i * hd + d0 + 16, a[i][1]);
        }
    }
    if (d0 < hd) {
        __m512 a[8];

        for (int i = 0; i < nr; i++)
            a[i] = _mm512_loadu_ps(acc + (int64_t)i * hd + d0);
        for (int k = ka; k < kb; k++) {
            const __m512 v0 = BF16X16(vr[k] + d0);

            if (nx && k < nx->n)    /* the last 16 columns' line */
                next_line(nx, nx->v[k] + d0);
            for (int i = 0; i < nr; i++)
                a[i] = _mm512_fmadd_ps(_mm512_set1_ps(sc[(int64_t)i * KEY_CHUNK + k]), v0, a[i]);
        }
        for (int i = 0; i < nr; i++)
            _mm512_storeu_ps(acc + (int64_t)i * hd + d0, a[i]);
    }
}

/* pv_bf16_avx2 on zmm: runs of up to 8 consecutive rows with the same key range share the
 * pass.  nx (or NULL): the next pass's V rows, prefetched by the first run over its keys and
 * here for the rest, so that the loads of the next pass spread over this one's scores (K)
 * and P.V (V) instead of all going out during the scores. */
AVX512_FN static void pv_bf16_avx512(const float *sc, int R, const int *ka, const int *kb,
                                     const uint16_t *const *vr, int hd, float *acc,
                                     const struct next_rows *nx)
{
    /* the rows are in L1 already where the pass before prefetched them there (nx->l1) */
    const bool own_pf = !(nx && nx->l1);

    for (int r = 0; r < R;) {
        int n = 1;

        while (n < 8 && r + n < R && ka[r + n] == ka[r] && kb[r + n] == kb[r])
            n++;
        if (ka[r] < kb[r]) {
            const float *s = sc + (int64_t)r * KEY_CHUNK;
            float *ac = acc + (int64_t)r * hd;

            switch (n) {
#define PV_CASE(c) case c: pv_bf16_rows512(s, c, ka[r], kb[r], vr, hd, ac, nx, own_pf); break;
            PV_CASE(8) PV_CASE(7) PV_CASE(6) PV_CASE(5) PV_CASE(4) PV_CASE(3) PV_CASE(2)
#undef PV_CASE
            default: pv_bf16_rows512(s, 1, ka[r], kb[r], vr, hd, ac, nx, own_pf); break;
            }
            if (nx) {       /* the V rows the first run did not prefetch */
                next_rows_prefetch_v(nx, 0, ka[r], hd);
                next_rows_prefetch_v(nx, kb[r], nx->n, hd);
                nx = NULL;
            }
        }
        r += n;
    }
    if (nx)                 /* no run had keys here */
        next_rows_prefetch_v(nx, 0, nx->n, hd);
}
#endif

/* Query rows (token x query head) processed together against one pass over the keys;
 * bounds the per-thread stack (acc, scores, converted keys and values). */
#define ATTN_MAX_ROWS 32
/* floats of per-head state (acc, scaled queries, query pairs) a work item may keep on the
 * stack for its group of KV heads: 256 KiB */
#define ATTN_STATE_FLOATS 65536
/* contexts from which KV heads are grouped (cpu_attention) */
#define ATTN_GROUP_MIN_KEYS 4096

/* Physical slots of the keys of the chunk that starts at cb (a multiple of KEY_CHUNK), from
 * max(cb, lo0) to min(cb + KEY_CHUNK - 1, t_last), into slot[]: returns their count (0 past
 * t_last), or -1 on a block id outside the pool.  One table lookup and one division per
 * block, not per key. */
static int chunk_slots(const struct kv_layer *kv, const int32_t *table, int64_t lo0, int64_t cb,
                       int64_t t_last, int64_t *slot)
{
    const int64_t c0 = cb > lo0 ? cb : lo0;
    const int64_t ce = cb + KEY_CHUNK < t_last + 1 ? cb + KEY_CHUNK : t_last + 1;
    const int nk = ce > c0 ? (int)(ce - c0) : 0, bs = kv->block_size;

    for (int k = 0; k < nk;) {
        const int64_t tau = c0 + k, bi = tau / bs, off = tau - bi * bs;
        const int32_t blk = table[bi];
        const int run = bs - off < nk - k ? (int)(bs - off) : nk - k;

        if (blk < 0 || blk >= kv->n_blocks) {
            log_debug("attention: position %lld maps to block %d (pool has %d)", (long long)tau,
                      blk, kv->n_blocks);
            return -1;
        }
        for (int e = 0; e < run; e++, k++)
            slot[k] = (int64_t)blk * bs + off + e;
    }
    return nk;
}

/* Prefetch row (slot, KV head j) of a K or V cache into the caches (never faults). */
static inline void prefetch_row(const struct kv_layer *kv, const void *base, int64_t slot, int j)
{
    const size_t es = kv->dtype_f32 ? sizeof(float) : sizeof(uint16_t);
    const uintptr_t p = (uintptr_t)base + (uintptr_t)kv_row_off(kv, slot, j) * es;

    for (uintptr_t l = p & ~(uintptr_t)63; l < p + (uintptr_t)kv->head_dim * es; l += 64)
        __builtin_prefetch((const void *)l, 0, 3);
}

/* Fold one key segment's softmax state (max m, sum l, unnormalised output acc[hd]) into the
 * running state (M, L, ACC[hd]) of the segments before it; m = -inf: the segment had none
 * of the row's keys.  The first segment is copied, so a row within one segment gets
 * acc / l exactly as without segments.  One out-of-line copy for both callers (attn_chunk,
 * attn_merge_unit): the same roundings whether one item or several ran the segments. */
__attribute__((noinline)) static void attn_fold(float *M, float *L, float *ACC, float m, float l,
                                                const float *acc, int hd)
{
    if (m == -INFINITY)
        return;
    if (*M == -INFINITY) {
        *M = m;
        *L = l;
        memcpy(ACC, acc, sizeof(float) * (size_t)hd);
    } else if (m > *M) {
        const float c = expf(*M - m);

        *L = *L * c + l;
        for (int d = 0; d < hd; d++)
            ACC[d] = ACC[d] * c + acc[d];
        *M = m;
    } else {
        const float c = expf(m - *M);

        *L = *L + l * c;
        for (int d = 0; d < hd; d++)
            ACC[d] = ACC[d] + acc[d] * c;
    }
}

/* Segment index of key tau (seg_keys a job's segment size) */
static inline int64_t attn_seg(int64_t tau, int64_t seg_keys)
{
    return tau / seg_keys;
}

/* First key of sequence s's first query token (its window's start) */
static inline int64_t attn_lo(const struct attn_args *a, int s)
{
    const int64_t t0 = a->seq_pos0[s];

    return a->window > 0 && t0 - a->window + 1 > 0 ? t0 - a->window + 1 : 0;
}

/* Segments holding sequence s's keys, from attn_lo's to its last token's */
static int attn_nseg(const struct attn_args *a, int s, int64_t seg_keys)
{
    const int len = a->seq_tok_start[s + 1] - a->seq_tok_start[s];

    if (len <= 0)
        return 1;
    return (int)(attn_seg((int64_t)a->seq_pos0[s] + len - 1, seg_keys) -
                 attn_seg(attn_lo(a, s), seg_keys) + 1);
}

/* Attention of query tokens [i0, i1) of sequence s (consecutive positions) for the G query
 * heads sharing each KV head j in [j0, j0 + nj): every K and V row of the union of their key
 * ranges is read (and converted from BF16 into a chunk buffer) once for all nq x G query
 * rows of its head.  Keys outside a row's own range [lo, t] get no weight.  The P·V update
 * runs per row over the chunk's keys with 32 output columns held in registers.  The heads
 * take each key chunk in turn: a head's rows are one cache row apart (the n_kv_heads rows of
 * a slot are contiguous), so chunk after chunk the group reads its slots' rows side by
 * side, where the hardware prefetchers follow, instead of one row per page (a decode at
 * 8-32k context read its keys at about half the machine's read bandwidth with one head per
 * pass, bench-shapes).  Every head's arithmetic is that of a pass of its own, in the same
 * order: the results do not depend on the grouping.
 *
 * A row's keys are cut into segments at absolute multiples of jb->seg_keys; each segment
 * starts a fresh online softmax and is folded into the row's result in key order
 * (attn_fold).  seg < 0: every segment here, the result into a->out; seg >= 0 (split-K):
 * only keys in segment seg, the raw state (m, l, acc) into jb->part for attn_merge_unit,
 * which folds the segments in the same order with the same function - the output bits do
 * not depend on which items ran the segments.  Returns -EINVAL on a bad block id. */
static int attn_chunk(const struct attn_job *jb, int s, int i0, int i1, int j0, int nj,
                      int64_t seg)
{
    const struct attn_args *a = jb->a;
    const bool avx2 = jb->avx2;
    const int avx512 = jb->avx512;
    const int64_t S = jb->seg_keys;
    const struct kv_layer *kv = a->kv;
    const int hd = a->head_dim, G = a->n_heads / a->n_kv_heads;
    const int nq = i1 - i0, R = nq * G;
    const int64_t t0 = (int64_t)a->seq_pos0[s] + (i0 - a->seq_tok_start[s]), t_last = t0 + nq - 1;
    const int64_t lo0 = a->window > 0 && t0 - a->window + 1 > 0 ? t0 - a->window + 1 : 0;
    const int32_t *table = a->block_tables + a->block_table_off[s];
    /* keys run here: [klo, khi] */
    const int64_t klo = seg >= 0 && seg * S > lo0 ? seg * S : lo0;
    const int64_t khi = seg >= 0 && (seg + 1) * S - 1 < t_last ? (seg + 1) * S - 1 : t_last;
    /* several segments in this pass: the finished ones' state in mm, ml, macc */
    const bool multi = seg < 0 && attn_seg(klo, S) != attn_seg(khi, S);
    float macc[multi ? nj : 1][multi ? R : 1][hd], mm[nj][R], ml[nj][R];
    float acc[nj][R][hd], qs[nj][R][hd], kf[KEY_CHUNK][hd], vf[KEY_CHUNK][hd], sc[R][KEY_CHUNK];
    const float *kp[KEY_CHUNK], *vp[KEY_CHUNK];
    const uint16_t *kr[KEY_CHUNK], *vr[KEY_CHUNK];      /* BF16 rows (fused) */
    /* a BF16 cache: scores and P.V read the cache rows themselves (an FP32 cache: fp32
     * rows, the AVX-512 path on row pairs) */
    const bool fused = avx2 && !kv->dtype_f32 && hd % 16 == 0 && !cpu_attn_no_fused;
    const bool pairs = avx512 && !fused;
    float qp[pairs ? nj : 1][pairs ? (R + 1) / 2 : 1][2 * hd];     /* row pairs (avx512) */
    struct next_rows nx;
    float m[nj][R], l[nj][R];
    int ka[R], kb[R];

    memset(acc, 0, sizeof(acc));
    for (int h = 0; h < nj; h++) {
        const int j = j0 + h;

        for (int r = 0; r < R; r++) {
            const float *q = a->q + ((int64_t)(i0 + r / G) * a->n_heads + (int64_t)j * G + r % G) * hd;

            for (int d = 0; d < hd; d++)
                qs[h][r][d] = q[d] * a->scale;
            m[h][r] = mm[h][r] = -INFINITY;
            l[h][r] = ml[h][r] = 0.0f;
        }
        if (pairs) {
            for (int r = 0; r < R; r += 2) {
                const float *qb = qs[h][r + 1 < R ? r + 1 : r];

                for (int d = 0; d < hd; d += 8) {
                    memcpy(&qp[h][r / 2][2 * d], &qs[h][r][d], 8 * sizeof(float));
                    memcpy(&qp[h][r / 2][2 * d + 8], qb + d, 8 * sizeof(float));
                }
            }
        }
    }
    /* key chunks are aligned to absolute multiples of KEY_CHUNK, so a row's partition of
     * its keys (and with it every rounding of the online softmax) depends only on its own
     * [lo, t], not on which other tokens share the pass: decode, verify and prefill agree
     * bit for bit */
    int64_t slots[2][KEY_CHUNK];
    int nk_next = chunk_slots(kv, table, klo, klo / KEY_CHUNK * KEY_CHUNK, khi, slots[0]);

    for (int64_t cb = klo / KEY_CHUNK * KEY_CHUNK, c = 0; cb <= khi; cb += KEY_CHUNK, c ^= 1) {
        const int64_t c0 = cb > klo ? cb : klo;
        const int64_t ce = cb + KEY_CHUNK < khi + 1 ? cb + KEY_CHUNK : khi + 1;
        const int nk = (int)(ce - c0);
        const int64_t *slot = slots[c], *nslot = slots[c ^ 1];

        if (nk_next < 0)
            return -EINVAL;
        if (multi && cb > klo && cb % S == 0) {
            /* a new segment: fold the last one's state, start afresh */
            for (int h = 0; h < nj; h++)
                for (int r = 0; r < R; r++) {
                    attn_fold(&mm[h][r], &ml[h][r], macc[h][r], m[h][r], l[h][r], acc[h][r], hd);
                    m[h][r] = -INFINITY;
                    l[h][r] = 0.0f;
                    memset(acc[h][r], 0, sizeof(float) * (size_t)hd);
                }
        }
        /* the next chunk's slots now: its rows are prefetched during this one */
        nk_next = chunk_slots(kv, table, klo, cb + KEY_CHUNK, khi, slots[c ^ 1]);
        for (int h = 0; h < nj; h++) {
            const int j = j0 + h;

            /* the chunk's K and V rows of head j (the cache's own rows: FP32, or BF16 for the
             * fused kernels; else converted into kf/vf), and the rows of a later pass
             * (struct next_rows): the fused kernels prefetch them spread over their work, the
             * others here.  Into L2 (AMD, and a head per item): head j's rows
             * of the next chunk, nj passes ahead; the group's next head in this chunk, one
             * pass of lead, did not cover the wait on memory there (AVX-512, 1 thread, batch
             * 1 at 32k keys, all 8 KV heads in one item: 5.9 -> 6.8 GB per CPU-second).
             * Into L1 (nx.l1, Intel, several KV heads an item): the next pass in processing
             * order (the group's next head in this chunk; after the last, the first of the
             * next chunk), 32 KiB ahead, so that the rows are still in the L1 (48 KiB) when
             * the pass reads them: a chunk ahead they had left it again for the L2
             * (docs/PERFORMANCE.md §8.6) */
            const bool near = fused && jb->pf_l1 && nj > 1;
            const bool same = near && h + 1 < nj;
            const int64_t *ps = same ? slot : nslot;
            const int pj = near ? j0 + (h + 1) % nj : j, pn = same ? nk : nk_next;

            if (fused) {
                nx.k_only = false;
                nx.n = pn;
                nx.l1 = near;
                /* into L2 only on AMD: from DRAM (EPYC, AVX-512, 1 thread, batch 1 at 32k
                 * keys) 5.0-5.9 GB per CPU-second against 4.1 with prefetches into L1, which
                 * fill the L1's few miss buffers; the AVX2 kernels too, since one item takes a
                 * thread's heads (5.5-5.7 -> 6.7-6.8 GB per CPU-second, docs/PERFORMANCE.md
                 * §8.2).  On the Intel (AMX) host the other way round where an item takes a
                 * group of KV heads (>= 4096 keys): into L1, 1.2-1.6x at 8k keys with the V
                 * rows' prefetches moved into P.V (§8.6), the next pass rather than the next
                 * chunk another ~1.1x; a head per item (short contexts) keeps L2 there too
                 * (L1: 0.85-0.96x) */
                for (int k = 0; k < pn; k++) {
                    nx.k[k] = (const uint16_t *)kv->k + kv_row_off(kv, ps[k], pj);
                    nx.v[k] = (const uint16_t *)kv->v + kv_row_off(kv, ps[k], pj);
                }
            }
            for (int k = 0; k < nk; k++) {
                if (k < pn && !fused) {
                    prefetch_row(kv, kv->k, ps[k], pj);
                    prefetch_row(kv, kv->v, ps[k], pj);
                }
                if (kv->dtype_f32) {
                    kp[k] = (const float *)kv->k + kv_row_off(kv, slot[k], j);
                    vp[k] = (const float *)kv->v + kv_row_off(kv, slot[k], j);
                } else if (fused) {
                    kr[k] = (const uint16_t *)kv->k + kv_row_off(kv, slot[k], j);
                    vr[k] = (const uint16_t *)kv->v + kv_row_off(kv, slot[k], j);
                } else {
                    kp[k] = kv_row_f32(kv, kv->k, slot[k], j, kf[k], avx2);
                    vp[k] = kv_row_f32(kv, kv->v, slot[k], j, vf[k], avx2);
                }
            }
#if defined(__x86_64__)
            if (fused && avx512) {
                /* K rows here, the V rows in pv_bf16_avx512 */
                nx.k_only = true;
                scores_bf16_avx512(&qs[h][0][0], R, hd, kr, nk, &sc[0][0], &nx);
                next_rows_prefetch(&nx, nk, pn, hd);
            } else if (fused) {
                scores_bf16_avx2(&qs[h][0][0], R, hd, kr, nk, &sc[0][0], &nx);
                next_rows_prefetch(&nx, nk, pn, hd);    /* a next chunk longer than this */
            } else if (avx512)
                scores_avx512(&qp[h][0][0], R, hd, kp, nk, &sc[0][0]);
            else if (avx2 && hd % 8 == 0)
                scores_avx2(&qs[h][0][0], R, hd, kp, nk, &sc[0][0]);
            else
#endif
                scores_scalar(&qs[h][0][0], R, hd, kp, nk, &sc[0][0]);
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
                if (cmax > m[h][r]) {
                    float corr = expf(m[h][r] - cmax);    /* 0 on the row's first keys */

                    l[h][r] *= corr;
                    for (int d = 0; d < hd; d++)
                        acc[h][r][d] *= corr;
                    m[h][r] = cmax;
                }
#if defined(__x86_64__)
                if (avx512)
                    l[h][r] += exp_shift_sum_avx512(srow + ka[r], kb[r] - ka[r], m[h][r],
                                                    KEY_CHUNK - ka[r]);
                else if (avx2)
                    l[h][r] += exp_shift_sum_avx2(srow + ka[r], kb[r] - ka[r], m[h][r]);
                else
#endif
                    l[h][r] += exp_shift_sum(srow + ka[r], kb[r] - ka[r], m[h][r]);
            }
#if defined(__x86_64__)
            if (fused) {
                if (avx512)
                    pv_bf16_avx512(&sc[0][0], R, ka, kb, vr, hd, &acc[h][0][0],
                                   nx.k_only ? &nx : NULL);
                else
                    pv_bf16_avx2(&sc[0][0], R, ka, kb, vr, hd, &acc[h][0][0]);
                continue;
            }
            if (avx512) {
                pv_chunk_avx512(&sc[0][0], &acc[h][0][0], R, ka, kb, vp, hd);
                continue;
            }
#endif
            for (int r = 0; r < R; r++) {
#if defined(__x86_64__)
                if (avx2) {
                    pv_avx2(sc[r], ka[r], kb[r], vp, hd, acc[h][r]);
                    continue;
                }
#endif
                for (int k = ka[r]; k < kb[r]; k++)
                    for (int d = 0; d < hd; d++)
                        acc[h][r][d] += sc[r][k] * vp[k][d];
            }
        }
    }
    for (int h = 0; h < nj; h++)
        for (int r = 0; r < R; r++) {
            const int64_t row = (int64_t)(i0 + r / G) * a->n_heads + (int64_t)(j0 + h) * G + r % G;
            float *out = a->out + row * hd;

            if (seg >= 0) {
                /* split-K: this segment's raw state, slot seg - (the sequence's first) */
                float *e = jb->part + (row * jb->nsmax + (seg - attn_seg(attn_lo(a, s), S))) *
                                      (hd + 2);

                e[0] = m[h][r];
                e[1] = l[h][r];
                memcpy(e + 2, acc[h][r], sizeof(float) * (size_t)hd);
                continue;
            }
            if (multi) {
                attn_fold(&mm[h][r], &ml[h][r], macc[h][r], m[h][r], l[h][r], acc[h][r], hd);
                for (int d = 0; d < hd; d++)
                    out[d] = macc[h][r][d] / ml[h][r];
                continue;
            }
            for (int d = 0; d < hd; d++)
                out[d] = acc[h][r][d] / l[h][r];
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
    const int nkv = a->n_kv_heads, ng = jb->n_groups;
    int64_t u0, u1, base = 0;
    int s = 0, nb = attn_blocks(a, 0, jb->qb), ns = jb->split ? attn_nseg(a, 0, jb->seg_keys) : 1;

    (void)ith;
    /* work items are (sequence, block of its tokens, group of KV heads[, key segment]), in
     * that order; a unit is a contiguous range of the jb->n_items of them.  A block's query
     * tokens share one pass over its keys, a group's heads each key chunk in turn.  Results
     * depend on none of these (attn_chunk), so not on the thread count. */
    cpu_split(jb->n_items, 1, unit, n_units, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        int b, g, j0, len, st, r;
        int64_t k;

        while (u >= base + (int64_t)nb * ng * ns) {
            base += (int64_t)nb * ng * ns;
            nb = attn_blocks(a, ++s, jb->qb);
            ns = jb->split ? attn_nseg(a, s, jb->seg_keys) : 1;
        }
        b = (int)((u - base) / ((int64_t)ng * ns));
        g = (int)((u - base) / ns % ng);
        k = (u - base) % ns;
        j0 = nkv * g / ng;
        st = a->seq_tok_start[s];
        len = a->seq_tok_start[s + 1] - st;
        r = attn_chunk(jb, s, st + (int)((int64_t)len * b / nb),
                       st + (int)((int64_t)len * (b + 1) / nb), j0, nkv * (g + 1) / ng - j0,
                       jb->split ? attn_seg(attn_lo(a, s), jb->seg_keys) + k : -1);
        if (r < 0) {
            atomic_store(&jb->err, r);
            return;
        }
    }
}

/* Split-K's second pass: every (token, query head) row's segments folded in key order
 * (attn_fold, as attn_chunk folds them in one pass), divided out into a->out. */
static void attn_merge_unit(void *arg, int unit, int n_units, int ith)
{
    struct attn_job *jb = arg;
    const struct attn_args *a = jb->a;
    const int nh = a->n_heads, hd = a->head_dim;
    int64_t u0, u1;
    int s = 0, ns = 0;
    float acc[hd];

    (void)ith;
    cpu_split((int64_t)a->n_tok * nh, 1, unit, n_units, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        const int i = (int)(u / nh);
        const float *e = jb->part + u * jb->nsmax * (hd + 2);
        float M = -INFINITY, L = 0.0f, *out = a->out + u * hd;

        if (u == u0 || i >= a->seq_tok_start[s + 1]) {
            while (i >= a->seq_tok_start[s + 1])
                s++;
            ns = attn_nseg(a, s, jb->seg_keys);
        }
        for (int k = 0; k < ns; k++, e += hd + 2)
            attn_fold(&M, &L, acc, e[0], e[1], e + 2, hd);
        for (int d = 0; d < hd; d++)
            out[d] = acc[d] / L;
    }
}

int cpu_attn_groups(int n_kv_heads, double keys, int64_t blocks, int64_t rows_floats, int nth)
{
    int ng = cpu_attn_no_groups || keys < ATTN_GROUP_MIN_KEYS ? n_kv_heads : 1;

    /* per head: acc, the folded segments' acc, scaled queries and query pairs, rows_floats
     * each */
    while (ng < n_kv_heads && ((nth > 1 && blocks * ng < nth) ||
                               (double)ATTN_STATE_FLOATS * ng < 4.0 * n_kv_heads * rows_floats))
        ng *= 2;
    return ng < n_kv_heads ? ng : n_kv_heads;
}

bool cpu_attn_use_split(int64_t items, double keys, int64_t seg_keys, size_t bytes, int nth)
{
    return nth > 1 && keys >= 2.0 * (double)seg_keys && items < (int64_t)nth * ATTN_SPLIT_ITEMS &&
           bytes <= ATTN_SPLIT_MAX_BYTES;
}

/* The AVX-512 path (bit-identical to the AVX2 one): 1 where the active level has it. */
int cpu_attn_avx512_level(void)
{
#if defined(__x86_64__)
    return cpu_isa_has(CPU_ISA_AVX512);
#else
    return 0;
#endif
}

bool cpu_attn_pf_l1_on(void)
{
    if (cpu_attn_pf_l1 >= 0)
        return cpu_attn_pf_l1 > 0;
#if defined(__x86_64__)
    return __builtin_cpu_is("intel");
#else
    return false;
#endif
}

int cpu_attention(struct backend *be, const struct attn_args *a)
{
    struct attn_job jb = { .a = a, .avx2 = cpu_ctx(be)->have_avx2, .pf_l1 = cpu_attn_pf_l1_on() };

    jb.avx512 = jb.avx2 && a->head_dim % 16 == 0 ? cpu_attn_avx512_level() : 0;

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

        int64_t blocks = 0;

        int qrows = 1;      /* query tokens of the longest block */

        jb.qb = ATTN_MAX_ROWS / G > 1 ? ATTN_MAX_ROWS / G : 1;
        for (int s = 0; s < a->n_seqs; s++) {
            const int nb = attn_blocks(a, s, jb.qb);
            const int len = a->seq_tok_start[s + 1] - a->seq_tok_start[s];

            blocks += nb;
            if (nb > 0 && (len + nb - 1) / nb > qrows)
                qrows = (len + nb - 1) / nb;
        }
        /* head groups: as few as give every thread of several an item, within the stack
         * budget of attn_chunk's per-head state for the blocks' real rows (a decode: one
         * token); short contexts keep a head per item (their keys come from the caches,
         * where a group's larger state costs more than it saves: bench-shapes, full
         * attention at 1k, groups 0.65-0.75x, at 8k 1.13-1.2x).  One thread at decode
         * takes all KV heads of a sequence in one item, reading its slots' rows whole
         * (cpu_attn_groups) */
        jb.n_groups = cpu_attn_groups(a->n_kv_heads, keys, blocks, qrows * G * a->head_dim, nth);
        jb.n_items = blocks * jb.n_groups;
        /* split-K: with fewer items than ATTN_SPLIT_ITEMS a thread and a long context, an
         * item per key segment of each (sequence, block, group) too, the groups then only
         * as many as the stack budget asks (a batch-1 decode on 2 threads: each thread reads
         * whole slot rows of half the keys, not half of every row).  The segments are the
         * same either way (attn_chunk): the output does not depend on this choice */
        jb.seg_keys = cpu_attn_split_keys;
        if (jb.seg_keys <= 0 || jb.seg_keys % KEY_CHUNK != 0) {
            log_debug("attention: split-K segment of %lld keys is not a multiple of %d",
                      (long long)jb.seg_keys, KEY_CHUNK);
            return -EINVAL;
        }
        if (cpu_attn_split >= 0) {
            int64_t segs = 0;
            size_t bytes;

            for (int s = 0; s < a->n_seqs; s++) {
                const int ns = attn_nseg(a, s, jb.seg_keys);

                segs += (int64_t)attn_blocks(a, s, jb.qb) * ns;
                jb.nsmax = ns > jb.nsmax ? ns : jb.nsmax;
            }
            bytes = sizeof(float) * (size_t)a->n_tok * a->n_heads * jb.nsmax *
                    (size_t)(a->head_dim + 2);
            jb.split = jb.nsmax > 1 &&
                       (cpu_attn_split > 0 ||
                        cpu_attn_use_split(blocks * cpu_attn_groups(a->n_kv_heads, keys, blocks,
                                                                    qrows * G * a->head_dim, 1),
                                           keys, jb.seg_keys, bytes, nth));
            /* no scratch: the same bits without the split */
            if (jb.split && (jb.part = cpu_scratch(cpu_ctx(be), bytes)) == NULL)
                jb.split = false;
            if (jb.split) {
                jb.n_groups = cpu_attn_groups(a->n_kv_heads, keys, segs,
                                              qrows * G * a->head_dim, nth);
                jb.n_items = segs * jb.n_groups;
            }
        }
        units = units < jb.n_items ? units : (int)jb.n_items;
        cpu_pool_for(cpu_ctx(be)->pool, attn_unit, &jb, nth > 1 ? units : 1, nth);
        if (jb.split && atomic_load(&jb.err) == 0) {
            units = nth * CPU_UNITS_PER_THREAD;
            units = units < a->n_tok * a->n_heads ? units : a->n_tok * a->n_heads;
            cpu_pool_for(cpu_ctx(be)->pool, attn_merge_unit, &jb, nth > 1 ? units : 1, nth);
        }
    }
    return atomic_load(&jb.err);
}
