/* attention.c - attention over a paged KV cache (MODEL.md §2.3 step 5).
 *
 * Token i of sequence s sits at absolute position t = seq_pos0[s] + (i - start[s]) and
 * attends to keys tau in [lo, t], lo = 0 (full causal) or max(0, t - window + 1)
 * (sliding: exactly `window` keys including itself).  Key tau lives in physical slot
 * block_tables[off[s] + tau / block_size] * block_size + tau % block_size.  Query head h
 * reads KV head h / (n_heads / n_kv_heads) (contiguous grouping).  The same code serves
 * prefill chunks, decode and verify runs: the cache must already hold every key up to
 * the last query position (kv_store first).  Softmax is computed online over chunks of
 * keys in fp32 with fp32 exp.  One parallel region; (token, KV head) pairs are cut into
 * coarse contiguous units claimed by the pool's threads, and the query heads sharing a KV head are processed together so
 * each K/V row is read once per group (GQA: 8-12 query heads per KV head).
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

#define KEY_CHUNK 64

struct attn_job {
    const struct attn_args *a;
    _Atomic int err;
};

static inline const float *key_row(const struct kv_layer *kv, const void *base, int64_t slot,
                                   int j, float *tmp)
{
    int64_t off = (slot * kv->n_kv_heads + j) * kv->head_dim;

    if (kv->dtype_f32)
        return (const float *)base + off;
    for (int d = 0; d < kv->head_dim; d++)
        tmp[d] = cpu_bf16_to_f32(((const uint16_t *)base)[off + d]);
    return tmp;
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

/* Attention of the G query heads sharing KV head j, for query token i of sequence s:
 * every K and V row is read (and converted from BF16) once for the whole group.
 * Returns -EINVAL on a bad block id. */
static int attn_group(const struct attn_args *a, int s, int i, int j)
{
    const struct kv_layer *kv = a->kv;
    const int hd = a->head_dim, G = a->n_heads / a->n_kv_heads, bs = kv->block_size;
    const int64_t t = (int64_t)a->seq_pos0[s] + (i - a->seq_tok_start[s]);
    const int64_t lo = a->window > 0 && t - a->window + 1 > 0 ? t - a->window + 1 : 0;
    const float *q = a->q + ((int64_t)i * a->n_heads + (int64_t)j * G) * hd;
    const int32_t *table = a->block_tables + a->block_table_off[s];
    float acc[G][hd], tmp[hd], sc[G][KEY_CHUNK], m[G], l[G];
    int64_t slots[KEY_CHUNK];

    memset(acc, 0, sizeof(acc));
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t c0 = lo; c0 <= t; c0 += KEY_CHUNK) {
        int nk = t + 1 - c0 < KEY_CHUNK ? (int)(t + 1 - c0) : KEY_CHUNK;

        for (int k = 0; k < nk; k++) {
            int64_t tau = c0 + k;
            int32_t blk = table[tau / bs];
            const float *kr;

            if (blk < 0 || blk >= kv->n_blocks) {
                log_debug("attention: position %lld maps to block %d (pool has %d)",
                          (long long)tau, blk, kv->n_blocks);
                return -EINVAL;
            }
            slots[k] = (int64_t)blk * bs + tau % bs;
            kr = key_row(kv, kv->k, slots[k], j, tmp);
            for (int g = 0; g < G; g++)
                sc[g][k] = dot8(q + (int64_t)g * hd, kr, hd) * a->scale;
        }
        for (int g = 0; g < G; g++) {
            float cmax = -INFINITY;

            for (int k = 0; k < nk; k++)
                cmax = fmaxf(cmax, sc[g][k]);
            if (cmax > m[g]) {
                float corr = expf(m[g] - cmax);    /* 0 on the first chunk */

                l[g] *= corr;
                for (int d = 0; d < hd; d++)
                    acc[g][d] *= corr;
                m[g] = cmax;
            }
            for (int k = 0; k < nk; k++) {
                sc[g][k] = expf(sc[g][k] - m[g]);
                l[g] += sc[g][k];
            }
        }
        for (int k = 0; k < nk; k++) {
            const float *vr = key_row(kv, kv->v, slots[k], j, tmp);

            for (int g = 0; g < G; g++) {
                const float p = sc[g][k];

                for (int d = 0; d < hd; d++)
                    acc[g][d] += p * vr[d];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *out = a->out + ((int64_t)i * a->n_heads + (int64_t)j * G + g) * hd;

        for (int d = 0; d < hd; d++)
            out[d] = acc[g][d] / l[g];
    }
    return 0;
}

static void attn_unit(void *arg, int unit, int n_units, int ith)
{
    struct attn_job *jb = arg;
    const struct attn_args *a = jb->a;
    int64_t u0, u1;
    int s = 0;

    /* items are (token, KV head) pairs; a unit is a contiguous range of them */
    cpu_split((int64_t)a->n_tok * a->n_kv_heads, 1, unit, n_units, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        int i = (int)(u / a->n_kv_heads), j = (int)(u % a->n_kv_heads);
        int r;

        while (i >= a->seq_tok_start[s + 1])
            s++;
        r = attn_group(a, s, i, j);
        if (r < 0) {
            atomic_store(&jb->err, r);
            return;
        }
    }
}

int cpu_attention(struct backend *be, const struct attn_args *a)
{
    struct attn_job jb = { .a = a };

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
        int nth = cpu_threads_for(cpu_ctx(be), 2.0 * a->n_tok * a->n_heads * a->head_dim * keys);
        int64_t items = (int64_t)a->n_tok * a->n_kv_heads;
        int units = nth * CPU_UNITS_PER_THREAD;

        units = units < items ? units : (int)items;
        cpu_pool_for(cpu_ctx(be)->pool, attn_unit, &jb, nth > 1 ? units : 1, nth);
    }
    return atomic_load(&jb.err);
}
