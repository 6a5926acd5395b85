/* kv.c - paged KV block manager: two free stacks (FULL, SLIDING) and per-slot tables.
 *
 * Ownership is exclusive (no prefix sharing yet), so an owner array per block is enough
 * for kv_pool_check to prove that each block is either free or held by exactly one slot.
 */
#include "kv.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct kv_group_state {
    int n_total;
    int n_free;
    int32_t *free_stack;     /* [n_total], top at n_free - 1 */
    int32_t *owner;          /* [n_total] slot or -1 */
    int32_t *tables;         /* [max_seqs * max_blocks] */
    int32_t *held;           /* [max_seqs] blocks held per slot */
};

struct kv_pool {
    int block_size;
    int window;
    int max_seqs;
    int max_blocks;          /* table capacity per slot */
    int32_t *n_logical;      /* [max_seqs] logical blocks covered */
    int32_t *lo_sliding;     /* [max_seqs] first logical sliding block not yet released */
    struct kv_group_state g[_KV_GROUP_MAX];
};

void kv_pool_free(struct kv_pool *kv)
{
    if (!kv)
        return;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        free(kv->g[g].free_stack);
        free(kv->g[g].owner);
        free(kv->g[g].tables);
        free(kv->g[g].held);
    }
    free(kv->n_logical);
    free(kv->lo_sliding);
    free(kv);
}

int kv_pool_new(const struct kv_pool_config *cfg, struct kv_pool **ret)
{
    if (!cfg || cfg->block_size <= 0 || cfg->max_seqs <= 0 || cfg->max_seq_len <= 0 ||
        cfg->sliding_window < 0)
        return -EINVAL;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (cfg->n_blocks[g] <= 0)
            return -EINVAL;

    struct kv_pool *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return -ENOMEM;
    kv->block_size = cfg->block_size;
    kv->window = cfg->sliding_window;
    kv->max_seqs = cfg->max_seqs;
    kv->max_blocks = (cfg->max_seq_len + cfg->block_size - 1) / cfg->block_size;
    kv->n_logical = calloc((size_t) kv->max_seqs, sizeof(int32_t));
    kv->lo_sliding = calloc((size_t) kv->max_seqs, sizeof(int32_t));
    if (!kv->n_logical || !kv->lo_sliding)
        goto out_nomem;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        struct kv_group_state *s = &kv->g[g];
        s->n_total = s->n_free = cfg->n_blocks[g];
        s->free_stack = malloc((size_t) s->n_total * sizeof(int32_t));
        s->owner = malloc((size_t) s->n_total * sizeof(int32_t));
        s->tables = malloc((size_t) kv->max_seqs * (size_t) kv->max_blocks * sizeof(int32_t));
        s->held = calloc((size_t) kv->max_seqs, sizeof(int32_t));
        if (!s->free_stack || !s->owner || !s->tables || !s->held)
            goto out_nomem;
        /* lowest ids on top so a fresh pool hands out 0, 1, 2, ... */
        for (int i = 0; i < s->n_total; i++) {
            s->free_stack[i] = s->n_total - 1 - i;
            s->owner[i] = -1;
        }
        for (size_t i = 0; i < (size_t) kv->max_seqs * (size_t) kv->max_blocks; i++)
            s->tables[i] = -1;
    }
    *ret = kv;
    return 0;

out_nomem:
    kv_pool_free(kv);
    return -ENOMEM;
}

static int32_t *table_of(const struct kv_pool *kv, int slot, int g)
{
    return kv->g[g].tables + (size_t) slot * (size_t) kv->max_blocks;
}

/* First logical sliding block still needed when pos_lo is the lowest query position. */
static int32_t sliding_lo_block(const struct kv_pool *kv, int32_t pos_lo)
{
    if (kv->window <= 0)
        return 0;
    int32_t first_key = pos_lo - kv->window + 1;
    return first_key <= 0 ? 0 : first_key / kv->block_size;
}

void kv_seq_need(const struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos,
                 int ret_need[_KV_GROUP_MAX])
{
    int32_t want = (n_pos + kv->block_size - 1) / kv->block_size;
    int32_t have = kv->n_logical[slot];
    ret_need[KV_GROUP_FULL] = want > have ? want - have : 0;
    /* sliding: new logical blocks at or above the window's first block */
    int32_t lo = sliding_lo_block(kv, pos_lo);
    if (lo < kv->lo_sliding[slot])
        lo = kv->lo_sliding[slot];
    int32_t from = have > lo ? have : lo;
    int need = want > from ? want - from : 0;
    /* blocks released now come back first and can be reused by this same call */
    int32_t rel_hi = lo < have ? lo : have;
    int released = 0;
    const int32_t *t = table_of(kv, slot, KV_GROUP_SLIDING);
    for (int32_t b = kv->lo_sliding[slot]; b < rel_hi; b++)
        released += t[b] >= 0;
    ret_need[KV_GROUP_SLIDING] = need > released ? need - released : 0;
}

static void block_put(struct kv_pool *kv, int g, int32_t id)
{
    struct kv_group_state *s = &kv->g[g];
    s->owner[id] = -1;
    s->free_stack[s->n_free++] = id;
}

static int32_t block_get(struct kv_pool *kv, int g, int slot)
{
    struct kv_group_state *s = &kv->g[g];
    int32_t id = s->free_stack[--s->n_free];
    s->owner[id] = slot;
    s->held[slot]++;
    return id;
}

static void release_sliding_below(struct kv_pool *kv, int slot, int32_t lo)
{
    int32_t *t = table_of(kv, slot, KV_GROUP_SLIDING);
    int32_t hi = lo < kv->n_logical[slot] ? lo : kv->n_logical[slot];
    for (int32_t b = kv->lo_sliding[slot]; b < hi; b++) {
        if (t[b] >= 0) {
            block_put(kv, KV_GROUP_SLIDING, t[b]);
            kv->g[KV_GROUP_SLIDING].held[slot]--;
            t[b] = -1;
        }
    }
    if (lo > kv->lo_sliding[slot])
        kv->lo_sliding[slot] = lo;
}

int kv_seq_grow(struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos)
{
    if (slot < 0 || slot >= kv->max_seqs || n_pos < 0 || pos_lo < 0)
        return -EINVAL;
    int32_t want = (n_pos + kv->block_size - 1) / kv->block_size;
    if (want > kv->max_blocks)
        return -E2BIG;
    int need[_KV_GROUP_MAX];
    kv_seq_need(kv, slot, pos_lo, n_pos, need);
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (need[g] > kv->g[g].n_free)
            return -ENOSPC;

    int32_t lo = sliding_lo_block(kv, pos_lo);
    release_sliding_below(kv, slot, lo);
    int32_t *tf = table_of(kv, slot, KV_GROUP_FULL);
    int32_t *ts = table_of(kv, slot, KV_GROUP_SLIDING);
    for (int32_t b = kv->n_logical[slot]; b < want; b++) {
        tf[b] = block_get(kv, KV_GROUP_FULL, slot);
        ts[b] = b >= kv->lo_sliding[slot] ? block_get(kv, KV_GROUP_SLIDING, slot) : -1;
    }
    if (want > kv->n_logical[slot])
        kv->n_logical[slot] = want;
    return 0;
}

void kv_seq_release(struct kv_pool *kv, int slot)
{
    if (slot < 0 || slot >= kv->max_seqs)
        return;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        int32_t *t = table_of(kv, slot, g);
        for (int32_t b = 0; b < kv->n_logical[slot]; b++) {
            if (t[b] >= 0) {
                block_put(kv, g, t[b]);
                t[b] = -1;
            }
        }
        kv->g[g].held[slot] = 0;
    }
    kv->n_logical[slot] = 0;
    kv->lo_sliding[slot] = 0;
}

const int32_t *kv_seq_table(const struct kv_pool *kv, int slot, enum kv_group g, int *ret_n)
{
    *ret_n = kv->n_logical[slot];
    return table_of(kv, slot, g);
}

int kv_seq_held(const struct kv_pool *kv, int slot, enum kv_group g)
{
    return kv->g[g].held[slot];
}

int kv_pool_block_size(const struct kv_pool *kv)
{
    return kv->block_size;
}

int kv_pool_total(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_total;
}

int kv_pool_free_count(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_free;
}

double kv_pool_usage(const struct kv_pool *kv)
{
    int total = 0, used = 0;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        total += kv->g[g].n_total;
        used += kv->g[g].n_total - kv->g[g].n_free;
    }
    return total ? (double) used / total : 0.0;
}

int kv_pool_check(const struct kv_pool *kv)
{
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        const struct kv_group_state *s = &kv->g[g];
        int held_sum = 0;
        for (int slot = 0; slot < kv->max_seqs; slot++) {
            const int32_t *t = table_of(kv, slot, g);
            int n = 0;
            for (int32_t b = 0; b < kv->n_logical[slot]; b++) {
                if (t[b] < 0)
                    continue;
                if (t[b] >= s->n_total || s->owner[t[b]] != slot)
                    return -EUCLEAN;
                n++;
            }
            if (n != s->held[slot])
                return -EUCLEAN;
            held_sum += n;
        }
        if (held_sum + s->n_free != s->n_total)
            return -EUCLEAN;
        for (int i = 0; i < s->n_free; i++)
            if (s->owner[s->free_stack[i]] != -1)
                return -EUCLEAN;
    }
    return 0;
}

bool kv_pool_idle(const struct kv_pool *kv)
{
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (kv->g[g].n_free != kv->g[g].n_total)
            return false;
    return true;
}
