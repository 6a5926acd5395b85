/* kv.c - paged KV block manager: per group a plain free stack, an LRU list of cached
 * blocks and reference counts; per slot its tables; the FULL group's digest index with
 * the SLIDING blocks attached to its entries.
 *
 * A FULL block's key lives in its metadata from kv_seq_commit until it is taken again:
 * digest, tokens, parent (id and generation) or root.  Evicting an indexed FULL block
 * bumps its generation, which orphans every block keyed below it (their parent no longer
 * matches, so no walk reaches them) and detaches its SLIDING block.
 */
#include "kv.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "prefix.h"
#include "slab.h"

enum { B_FREE, B_CACHED, B_HELD };

struct kv_group_state {
    int n_total;
    int n_free, n_cached, n_held;
    int32_t *free_stack;     /* [n_total], top at n_free - 1 */
    uint8_t *state;          /* [n_total] B_* */
    uint8_t *keyed;          /* [n_total] FULL: in the index; SLIDING: attached to an entry */
    uint8_t *mtp;            /* [n_total] leading MTP layers final over the whole block */
    int32_t *refs;           /* [n_total] table entries naming the block */
    int32_t *lru_prev, *lru_next;   /* cached blocks, head = next to evict */
    int32_t lru_head, lru_tail;
    int32_t *tables;         /* [max_seqs * max_blocks] */
    int32_t *held;           /* [max_seqs] blocks held per slot */
};

struct slot_state {
    int32_t n_logical;       /* logical blocks covered */
    int32_t lo_sliding;      /* first logical sliding block not yet released */
    bool cacheable;          /* started with a root: commit keys its blocks */
    bool chain_lost;         /* the canonical entry of its last keyed block was evicted */
    uint8_t root[KV_DIGEST_BYTES];
    int32_t n_keyed;         /* leading blocks whose chain digest is known */
    uint8_t last_digest[KV_DIGEST_BYTES];   /* digest of block n_keyed - 1 */
    int32_t last_canon;      /* indexed FULL block of chain position n_keyed - 1 (-1: none) */
    uint32_t last_canon_gen;
    int32_t n_shared;        /* leading blocks taken from the cache (computed by others) */
    int32_t mtp_open;        /* first own block whose MTP count may still rise */
};

struct kv_pool {             /* heads one slab with every array it and its groups hold */
    int block_size;
    int window;
    int max_seqs;
    int max_blocks;          /* table capacity per slot */
    bool prefix_cache;
    bool mtp_group[_KV_GROUP_MAX];
    int digest_bits;         /* leading bits of each digest kept (256 in service) */
    struct slot_state *slots;
    struct kv_group_state g[_KV_GROUP_MAX];
    /* FULL blocks' keys */
    uint8_t (*digest)[KV_DIGEST_BYTES];
    uint8_t (*root)[KV_DIGEST_BYTES];       /* block 0 of a chain: its root */
    int32_t *tokens;         /* [n_total * block_size] */
    int32_t *parent;         /* -1 for block 0 of a chain */
    uint32_t *parent_gen;
    uint32_t *gen;
    int32_t *sliding;        /* attached SLIDING block or -1 */
    int32_t *bucket, *chain; /* index: bucket heads [n_buckets], next in bucket [n_total] */
    uint32_t bucket_mask;
    /* SLIDING blocks' attachment */
    int32_t *owner;          /* FULL entry or -1 */
    uint32_t *owner_gen;
    int32_t *walk;           /* [max_blocks] scratch of kv_seq_begin */
    uint64_t n_evictions;
};

void kv_pool_free(struct kv_pool *kv)
{
    free(kv);
}

static void slot_reset(struct slot_state *st)
{
    memset(st, 0, sizeof(*st));
    st->last_canon = -1;
}

int kv_pool_new(const struct kv_pool_config *cfg, struct kv_pool **ret)
{
    if (!cfg || cfg->block_size <= 0 || cfg->max_seqs <= 0 || cfg->max_seq_len <= 0 ||
        cfg->sliding_window < 0 || cfg->test_digest_cut_bits < 0 ||
        cfg->test_digest_cut_bits > 8 * KV_DIGEST_BYTES)
        return -EINVAL;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (cfg->n_blocks[g] <= 0)
            return -EINVAL;

    struct kv_pool t = { 0 }, *kv;
    t.block_size = cfg->block_size;
    t.window = cfg->sliding_window;
    t.max_seqs = cfg->max_seqs;
    t.max_blocks = (cfg->max_seq_len + cfg->block_size - 1) / cfg->block_size;
    t.prefix_cache = cfg->prefix_cache;
    memcpy(t.mtp_group, cfg->mtp_group, sizeof(t.mtp_group));
    t.digest_bits = 8 * KV_DIGEST_BYTES - cfg->test_digest_cut_bits;
    size_t tab = (size_t) t.max_seqs * (size_t) t.max_blocks;
    size_t nf = (size_t) cfg->n_blocks[KV_GROUP_FULL], ns = (size_t) cfg->n_blocks[KV_GROUP_SLIDING];
    size_t nb = 1;
    while (nb < nf)
        nb <<= 1;
    t.bucket_mask = (uint32_t) (nb - 1);
    /* every array in one slab: the pool's, then each group's */
    enum { POOL_PARTS = 13, GROUP_PARTS = 9 };
    struct slab_part parts[POOL_PARTS + GROUP_PARTS * _KV_GROUP_MAX];
    const struct slab_part pool_parts[] = {
        SLAB_PART(t.slots, t.max_seqs), SLAB_PART(t.walk, t.max_blocks),
        SLAB_PART(t.digest, nf), SLAB_PART(t.root, nf), SLAB_PART(t.parent, nf),
        SLAB_PART(t.parent_gen, nf), SLAB_PART(t.gen, nf), SLAB_PART(t.sliding, nf),
        SLAB_PART(t.chain, nf), SLAB_PART(t.tokens, nf * (size_t) t.block_size),
        SLAB_PART(t.bucket, nb), SLAB_PART(t.owner, ns), SLAB_PART(t.owner_gen, ns),
    };
    _Static_assert(SLAB_N(pool_parts) == POOL_PARTS, "parts[] is sized for the pool's arrays");
    memcpy(parts, pool_parts, sizeof(pool_parts));
    size_t np = POOL_PARTS;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        struct kv_group_state *s = &t.g[g];
        size_t n = (size_t) cfg->n_blocks[g];
        const struct slab_part group_parts[] = {
            SLAB_PART(s->free_stack, n), SLAB_PART(s->state, n), SLAB_PART(s->keyed, n),
            SLAB_PART(s->mtp, n), SLAB_PART(s->refs, n), SLAB_PART(s->lru_prev, n),
            SLAB_PART(s->lru_next, n), SLAB_PART(s->tables, tab), SLAB_PART(s->held, t.max_seqs),
        };
        _Static_assert(SLAB_N(group_parts) == GROUP_PARTS, "parts[] is sized for a group's arrays");
        memcpy(parts + np, group_parts, sizeof(group_parts));
        np += GROUP_PARTS;
    }
    int r = slab_new(&t, sizeof(t), parts, np, &kv);
    if (r < 0)
        return r;
    for (int i = 0; i < kv->max_seqs; i++)
        slot_reset(&kv->slots[i]);
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        struct kv_group_state *s = &kv->g[g];
        s->n_total = s->n_free = cfg->n_blocks[g];
        s->lru_head = s->lru_tail = -1;
        /* lowest ids on top so a fresh pool hands out 0, 1, 2, ... */
        for (int i = 0; i < s->n_total; i++) {
            s->free_stack[i] = s->n_total - 1 - i;
            s->lru_prev[i] = s->lru_next[i] = -1;
        }
        for (size_t i = 0; i < tab; i++)
            s->tables[i] = -1;
    }
    for (size_t i = 0; i < nf; i++)
        kv->parent[i] = kv->sliding[i] = kv->chain[i] = -1;
    for (size_t i = 0; i < nb; i++)
        kv->bucket[i] = -1;
    for (size_t i = 0; i < ns; i++)
        kv->owner[i] = -1;
    *ret = kv;
    return 0;
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

/* ------------------------------------------------------------- digests -- */

void kv_prefix_root(const uint8_t deploy_salt[KV_DIGEST_BYTES], const char *cache_salt, size_t n,
                    uint8_t ret_root[KV_DIGEST_BYTES])
{
    prefix_root(deploy_salt, cache_salt, n, ret_root);
}

/* d = SHA-256(prev, little-endian token ids of one block) (common/prefix.h), cut to
 * digest_bits. */
static void block_digest(const struct kv_pool *kv, const uint8_t prev[KV_DIGEST_BYTES],
                         const int32_t *tokens, uint8_t d[KV_DIGEST_BYTES])
{
    prefix_block_digest(prev, tokens, kv->block_size, d);
    int bits = kv->digest_bits;
    for (int i = 0; i < KV_DIGEST_BYTES; i++, bits -= 8)
        if (bits < 8)
            d[i] &= bits <= 0 ? 0 : (uint8_t) (0xff00u >> bits);
}

static uint32_t bucket_of(const struct kv_pool *kv, const uint8_t d[KV_DIGEST_BYTES])
{
    uint32_t h = (uint32_t) d[0] | (uint32_t) d[1] << 8 | (uint32_t) d[2] << 16 |
                 (uint32_t) d[3] << 24;
    return h & kv->bucket_mask;
}

/* The indexed FULL block with this whole key, or -1: digest d, tokens, and parent
 * (parent >= 0 with its generation) or root (parent == -1). */
static int32_t index_find(const struct kv_pool *kv, const uint8_t d[KV_DIGEST_BYTES],
                          const int32_t *tokens, int32_t parent, uint32_t parent_gen,
                          const uint8_t root[KV_DIGEST_BYTES])
{
    size_t bs = (size_t) kv->block_size;
    for (int32_t id = kv->bucket[bucket_of(kv, d)]; id >= 0; id = kv->chain[id]) {
        if (memcmp(kv->digest[id], d, KV_DIGEST_BYTES) != 0 || kv->parent[id] != parent)
            continue;
        if (parent >= 0 ? kv->parent_gen[id] != parent_gen
                        : memcmp(kv->root[id], root, KV_DIGEST_BYTES) != 0)
            continue;
        if (memcmp(kv->tokens + (size_t) id * bs, tokens, bs * sizeof(int32_t)) == 0)
            return id;
    }
    return -1;
}

/* ------------------------------------------------------- block states -- */

static void lru_push(struct kv_group_state *s, int32_t id)
{
    s->lru_prev[id] = s->lru_tail;
    s->lru_next[id] = -1;
    if (s->lru_tail >= 0)
        s->lru_next[s->lru_tail] = id;
    else
        s->lru_head = id;
    s->lru_tail = id;
}

static void lru_remove(struct kv_group_state *s, int32_t id)
{
    if (s->lru_prev[id] >= 0)
        s->lru_next[s->lru_prev[id]] = s->lru_next[id];
    else
        s->lru_head = s->lru_next[id];
    if (s->lru_next[id] >= 0)
        s->lru_prev[s->lru_next[id]] = s->lru_prev[id];
    else
        s->lru_tail = s->lru_prev[id];
    s->lru_prev[id] = s->lru_next[id] = -1;
}

static void to_free(struct kv_group_state *s, int32_t id)
{
    s->state[id] = B_FREE;
    s->free_stack[s->n_free++] = id;
}

static void sliding_detach(struct kv_pool *kv, int32_t id)
{
    int32_t f = kv->owner[id];
    if (f >= 0 && kv->sliding[f] == id)
        kv->sliding[f] = -1;
    kv->owner[id] = -1;
    kv->g[KV_GROUP_SLIDING].keyed[id] = 0;
}

/* Detach sliding block id from its entry; an unreferenced one becomes plain free. */
static void sliding_unkey(struct kv_pool *kv, int32_t id)
{
    struct kv_group_state *s = &kv->g[KV_GROUP_SLIDING];
    sliding_detach(kv, id);
    if (s->state[id] == B_CACHED) {
        lru_remove(s, id);
        s->n_cached--;
        to_free(s, id);
    }
}

/* Drop FULL block id from the index (orphaning what was keyed below it). */
static void full_unkey(struct kv_pool *kv, int32_t id)
{
    int32_t *pp = &kv->bucket[bucket_of(kv, kv->digest[id])];
    while (*pp != id)
        pp = &kv->chain[*pp];
    *pp = kv->chain[id];
    kv->chain[id] = -1;
    kv->g[KV_GROUP_FULL].keyed[id] = 0;
    kv->gen[id]++;
    if (kv->sliding[id] >= 0)
        sliding_unkey(kv, kv->sliding[id]);
}

/* A fresh block of group g held once (by the caller): plain free first, else evict the
 * least recently released cached block.  The caller checked availability. */
static int32_t block_take(struct kv_pool *kv, int g)
{
    struct kv_group_state *s = &kv->g[g];
    int32_t id;
    if (s->n_free > 0) {
        id = s->free_stack[--s->n_free];
    } else {
        id = s->lru_head;
        lru_remove(s, id);
        s->n_cached--;
        if (g == KV_GROUP_FULL)
            full_unkey(kv, id);
        else
            sliding_detach(kv, id);
        kv->n_evictions++;
    }
    s->state[id] = B_HELD;
    s->refs[id] = 1;
    s->mtp[id] = 0;
    s->n_held++;
    return id;
}

/* One more reference to a keyed block (cached or held). */
static void block_ref(struct kv_pool *kv, int g, int32_t id)
{
    struct kv_group_state *s = &kv->g[g];
    if (s->state[id] == B_CACHED) {
        lru_remove(s, id);
        s->n_cached--;
        s->n_held++;
        s->state[id] = B_HELD;
    }
    s->refs[id]++;
}

/* One reference less: the last one leaves a keyed block cached (last in line for
 * eviction), an unkeyed one plain free. */
static void block_unref(struct kv_pool *kv, int g, int32_t id)
{
    struct kv_group_state *s = &kv->g[g];
    if (--s->refs[id] > 0)
        return;
    s->n_held--;
    if (s->keyed[id]) {
        s->state[id] = B_CACHED;
        s->n_cached++;
        lru_push(s, id);
    } else {
        s->mtp[id] = 0;
        to_free(s, id);
    }
}

/* ------------------------------------------------------------ sequences -- */

/* Released sliding blocks (below block lo) that only this slot holds. */
static int sole_released(const struct kv_pool *kv, int slot, int32_t lo)
{
    const struct slot_state *st = &kv->slots[slot];
    const struct kv_group_state *s = &kv->g[KV_GROUP_SLIDING];
    const int32_t *t = table_of(kv, slot, KV_GROUP_SLIDING);
    int32_t hi = lo < st->n_logical ? lo : st->n_logical;
    int n = 0;
    for (int32_t b = st->lo_sliding; b < hi; b++)
        n += t[b] >= 0 && s->refs[t[b]] == 1;
    return n;
}

void kv_seq_need(const struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos,
                 int ret_need[_KV_GROUP_MAX])
{
    const struct slot_state *st = &kv->slots[slot];
    int32_t want = (n_pos + kv->block_size - 1) / kv->block_size;
    int32_t have = st->n_logical;
    ret_need[KV_GROUP_FULL] = want > have ? want - have : 0;
    /* sliding: new logical blocks at or above the window's first block */
    int32_t lo = sliding_lo_block(kv, pos_lo);
    if (lo < st->lo_sliding)
        lo = st->lo_sliding;
    int32_t from = have > lo ? have : lo;
    int need = want > from ? want - from : 0;
    /* blocks released now come back first and can be reused by this same call */
    int released = sole_released(kv, slot, lo);
    ret_need[KV_GROUP_SLIDING] = need > released ? need - released : 0;
}

static void release_sliding_below(struct kv_pool *kv, int slot, int32_t lo)
{
    struct slot_state *st = &kv->slots[slot];
    int32_t *t = table_of(kv, slot, KV_GROUP_SLIDING);
    int32_t hi = lo < st->n_logical ? lo : st->n_logical;
    for (int32_t b = st->lo_sliding; b < hi; b++) {
        if (t[b] >= 0) {
            block_unref(kv, KV_GROUP_SLIDING, t[b]);
            kv->g[KV_GROUP_SLIDING].held[slot]--;
            t[b] = -1;
        }
    }
    if (lo > st->lo_sliding)
        st->lo_sliding = lo;
}

int kv_seq_grow(struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos)
{
    if (slot < 0 || slot >= kv->max_seqs || n_pos < 0 || pos_lo < 0)
        return -EINVAL;
    struct slot_state *st = &kv->slots[slot];
    int32_t want = (n_pos + kv->block_size - 1) / kv->block_size;
    if (want > kv->max_blocks)
        return -E2BIG;
    int need[_KV_GROUP_MAX];
    kv_seq_need(kv, slot, pos_lo, n_pos, need);
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (need[g] > kv->g[g].n_free + kv->g[g].n_cached)
            return -ENOSPC;

    release_sliding_below(kv, slot, sliding_lo_block(kv, pos_lo));
    int32_t *tf = table_of(kv, slot, KV_GROUP_FULL);
    int32_t *ts = table_of(kv, slot, KV_GROUP_SLIDING);
    for (int32_t b = st->n_logical; b < want; b++) {
        tf[b] = block_take(kv, KV_GROUP_FULL);
        kv->g[KV_GROUP_FULL].held[slot]++;
        if (b >= st->lo_sliding) {
            ts[b] = block_take(kv, KV_GROUP_SLIDING);
            kv->g[KV_GROUP_SLIDING].held[slot]++;
        } else {
            ts[b] = -1;
        }
    }
    if (want > st->n_logical)
        st->n_logical = want;
    return 0;
}

void kv_seq_release(struct kv_pool *kv, int slot)
{
    if (slot < 0 || slot >= kv->max_seqs)
        return;
    struct slot_state *st = &kv->slots[slot];
    /* the chain's last blocks first: they are worth the least without the ones before */
    for (int32_t b = st->n_logical - 1; b >= 0; b--) {
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            int32_t *t = table_of(kv, slot, g);
            if (t[b] >= 0) {
                block_unref(kv, g, t[b]);
                t[b] = -1;
            }
        }
    }
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        kv->g[g].held[slot] = 0;
    slot_reset(st);
}

/* Do the MTP counts of the blocks that a sequence at position m*bs reads allow drafting
 * `depth` tokens?  (Sliding blocks [lo, m) were checked to exist.) */
static bool mtp_ok(const struct kv_pool *kv, const int32_t *full, int32_t lo, int32_t m, int depth)
{
    if (depth <= 0)
        return true;
    if (kv->mtp_group[KV_GROUP_FULL])
        for (int32_t b = 0; b < m; b++)
            if (kv->g[KV_GROUP_FULL].mtp[full[b]] < depth)
                return false;
    if (kv->mtp_group[KV_GROUP_SLIDING])
        for (int32_t b = lo; b < m; b++)
            if (kv->g[KV_GROUP_SLIDING].mtp[kv->sliding[full[b]]] < depth)
                return false;
    return true;
}

/* The most leading blocks of kv->walk[0 .. hit) a sequence at a position below
 * reuse_max * bs may reuse when it drafts `depth` tokens: the sliding blocks of its window
 * all cached, and with depth > 0 every block's MTP KV final and the chain verified depth
 * tokens beyond (the MTP layers' KV at a position depends on up to depth tokens after
 * it).  Writes the window's first block to *ret_lo. */
static int32_t reuse_blocks(const struct kv_pool *kv, int32_t hit, int32_t reuse_max, int depth,
                            int32_t *ret_lo)
{
    int32_t bs = kv->block_size, m = hit, lo = 0;
    if (depth > 0)
        m = ((int64_t) hit * bs - depth) / bs;
    if (m > reuse_max)
        m = reuse_max;
    for (; m > 0; m--) {
        lo = sliding_lo_block(kv, m * bs);
        bool ok = true;
        for (int32_t b = lo; b < m && ok; b++)
            ok = kv->sliding[kv->walk[b]] >= 0;
        if (ok && mtp_ok(kv, kv->walk, lo, m, depth))
            break;
    }
    *ret_lo = lo;
    return m;
}

int32_t kv_seq_begin(struct kv_pool *kv, int slot, const uint8_t *root, const int32_t *tokens,
                     int32_t n_tokens, int mtp_depth, int32_t *ret_mtp_final)
{
    if (ret_mtp_final)
        *ret_mtp_final = 0;
    if (slot < 0 || slot >= kv->max_seqs || n_tokens <= 0)
        return 0;
    struct slot_state *st = &kv->slots[slot];
    int bs = kv->block_size;
    kv_seq_release(kv, slot);
    if (!kv->prefix_cache || !root)
        return 0;
    st->cacheable = true;
    memcpy(st->root, root, KV_DIGEST_BYTES);
    if (!kv->mtp_group[KV_GROUP_FULL] && !kv->mtp_group[KV_GROUP_SLIDING])
        mtp_depth = 0;          /* no MTP KV in the blocks: nothing to bound */

    /* walk the chain: blocks wholly inside the known tokens that the reuse may need
     * (at least one token left to compute; a drafting sequence verifies one block more) */
    int32_t reuse_max = (n_tokens - 1) / bs;
    int32_t walk_max = reuse_max + (mtp_depth > 0 ? 1 : 0);
    if (walk_max > n_tokens / bs)
        walk_max = n_tokens / bs;
    if (walk_max > kv->max_blocks)
        walk_max = kv->max_blocks;
    uint8_t d[KV_DIGEST_BYTES];
    int32_t hit = 0, parent = -1;
    uint32_t parent_gen = 0;
    for (; hit < walk_max; hit++) {
        const int32_t *tok = tokens + (size_t) hit * (size_t) bs;
        block_digest(kv, hit ? kv->digest[parent] : root, tok, d);
        int32_t id = index_find(kv, d, tok, parent, parent_gen, root);
        if (id < 0)
            break;
        kv->walk[hit] = id;
        parent = id;
        parent_gen = kv->gen[id];
    }
    /* the MTP layers' KV at a position depends on up to mtp_depth tokens after it */
    int32_t lo, m_mtp = reuse_blocks(kv, hit, reuse_max, mtp_depth, &lo);
    int32_t m = m_mtp;
    if (ret_mtp_final) {
        /* the trunk's longest prefix; the MTP layers' KV is final below m_mtp's */
        m = reuse_blocks(kv, hit, reuse_max, 0, &lo);
        *ret_mtp_final = m_mtp * bs;
    }
    if (m <= 0)
        return 0;

    int32_t *tf = table_of(kv, slot, KV_GROUP_FULL);
    int32_t *ts = table_of(kv, slot, KV_GROUP_SLIDING);
    for (int32_t b = 0; b < m; b++) {
        int32_t f = kv->walk[b];
        block_ref(kv, KV_GROUP_FULL, f);
        tf[b] = f;
        kv->g[KV_GROUP_FULL].held[slot]++;
        if (b >= lo) {
            block_ref(kv, KV_GROUP_SLIDING, kv->sliding[f]);
            ts[b] = kv->sliding[f];
            kv->g[KV_GROUP_SLIDING].held[slot]++;
        } else {
            ts[b] = -1;
        }
    }
    st->n_logical = m;
    st->lo_sliding = lo;
    st->n_keyed = st->n_shared = st->mtp_open = m;
    memcpy(st->last_digest, kv->digest[tf[m - 1]], KV_DIGEST_BYTES);
    st->last_canon = tf[m - 1];
    st->last_canon_gen = kv->gen[tf[m - 1]];
    return m * bs;
}

/* How many leading MTP layers entry f holds final, over the groups that keep MTP KV. */
static int canon_mtp(const struct kv_pool *kv, int32_t f)
{
    int n = 256;
    if (kv->mtp_group[KV_GROUP_FULL] && kv->g[KV_GROUP_FULL].mtp[f] < n)
        n = kv->g[KV_GROUP_FULL].mtp[f];
    if (kv->mtp_group[KV_GROUP_SLIDING]) {
        int32_t sid = kv->sliding[f];
        int c = sid >= 0 ? kv->g[KV_GROUP_SLIDING].mtp[sid] : 0;
        if (c < n)
            n = c;
    }
    return n;
}

/* Attach sliding block sid (held by the committing slot) to entry f if f has none. */
static void sliding_key(struct kv_pool *kv, int32_t f, int32_t sid)
{
    if (sid < 0 || kv->sliding[f] >= 0 || kv->g[KV_GROUP_SLIDING].keyed[sid])
        return;
    kv->sliding[f] = sid;
    kv->owner[sid] = f;
    kv->owner_gen[sid] = kv->gen[f];
    kv->g[KV_GROUP_SLIDING].keyed[sid] = 1;
}

void kv_seq_commit(struct kv_pool *kv, int slot, const int32_t *tokens, int32_t n_computed,
                   const int32_t *mtp_final, int n_mtp)
{
    if (slot < 0 || slot >= kv->max_seqs || !kv->slots[slot].cacheable)
        return;
    struct slot_state *st = &kv->slots[slot];
    size_t bs = (size_t) kv->block_size;
    int32_t n_full = n_computed / (int32_t) bs;
    if (n_full > st->n_logical)
        n_full = st->n_logical;
    const int32_t *tf = table_of(kv, slot, KV_GROUP_FULL);
    const int32_t *ts = table_of(kv, slot, KV_GROUP_SLIDING);
    for (int32_t b = st->n_keyed; b < n_full && !st->chain_lost; b++) {
        const int32_t *tok = tokens + (size_t) b * bs;
        int32_t f = tf[b], parent = b ? st->last_canon : -1;
        uint32_t pgen = b ? st->last_canon_gen : 0;
        uint8_t d[KV_DIGEST_BYTES];
        if (b && (parent < 0 || kv->gen[parent] != pgen || !kv->g[KV_GROUP_FULL].keyed[parent])) {
            st->chain_lost = true;      /* its canonical entry was evicted: unreachable */
            break;
        }
        block_digest(kv, b ? st->last_digest : st->root, tok, d);
        int32_t canon = index_find(kv, d, tok, parent, pgen, st->root);
        if (canon >= 0 && kv->g[KV_GROUP_FULL].state[canon] == B_CACHED &&
            (canon_mtp(kv, canon) < n_mtp || (kv->sliding[canon] < 0 && ts[b] >= 0))) {
            /* a cached copy that lost its sliding block, or whose MTP layers are less final
             * than this slot's will be (written by a sequence drafting less deep): this
             * one replaces it */
            struct kv_group_state *fs = &kv->g[KV_GROUP_FULL];
            lru_remove(fs, canon);
            fs->n_cached--;
            full_unkey(kv, canon);
            to_free(fs, canon);
            canon = -1;
        }
        if (canon < 0) {
            canon = f;
            memcpy(kv->digest[f], d, KV_DIGEST_BYTES);
            memcpy(kv->root[f], st->root, KV_DIGEST_BYTES);
            memcpy(kv->tokens + (size_t) f * bs, tok, bs * sizeof(int32_t));
            kv->parent[f] = parent;
            kv->parent_gen[f] = pgen;
            kv->sliding[f] = -1;
            uint32_t h = bucket_of(kv, d);
            kv->chain[f] = kv->bucket[h];
            kv->bucket[h] = f;
            kv->g[KV_GROUP_FULL].keyed[f] = 1;
        }
        sliding_key(kv, canon, ts[b]);
        memcpy(st->last_digest, d, KV_DIGEST_BYTES);
        st->last_canon = canon;
        st->last_canon_gen = kv->gen[canon];
        st->n_keyed = b + 1;
    }
    /* MTP layers final over the blocks this slot computed */
    if (n_mtp <= 0 || !mtp_final)
        return;
    int32_t top = mtp_final[0] / (int32_t) bs, done = mtp_final[n_mtp - 1] / (int32_t) bs;
    if (top > n_full)
        top = n_full;
    for (int32_t b = st->mtp_open > st->n_shared ? st->mtp_open : st->n_shared; b < top; b++) {
        int32_t end = (b + 1) * (int32_t) bs;
        uint8_t n = 0;
        while (n < n_mtp && mtp_final[n] >= end)
            n++;
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            int32_t id = table_of(kv, slot, g)[b];
            if (kv->mtp_group[g] && id >= 0 && kv->g[g].mtp[id] < n)
                kv->g[g].mtp[id] = n;
        }
    }
    if (done > st->mtp_open)
        st->mtp_open = done < n_full ? done : n_full;
}

const int32_t *kv_seq_table(const struct kv_pool *kv, int slot, enum kv_group g, int *ret_n)
{
    *ret_n = kv->slots[slot].n_logical;
    return table_of(kv, slot, g);
}

int kv_seq_held(const struct kv_pool *kv, int slot, enum kv_group g)
{
    return kv->g[g].held[slot];
}

bool kv_seq_writable(const struct kv_pool *kv, int slot, int32_t pos)
{
    const struct slot_state *st = &kv->slots[slot];
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        const int32_t *t = table_of(kv, slot, g);
        for (int32_t b = pos / kv->block_size; b < st->n_logical; b++)
            if (t[b] >= 0 && (kv->g[g].refs[t[b]] != 1 || kv->g[g].keyed[t[b]]))
                return false;
    }
    return true;
}

/* ------------------------------------------------------------- counters -- */

int kv_pool_total(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_total;
}

int kv_pool_free_count(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_free;
}

int kv_pool_cached_count(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_cached;
}

int kv_pool_held_count(const struct kv_pool *kv, enum kv_group g)
{
    return kv->g[g].n_held;
}

double kv_pool_usage(const struct kv_pool *kv)
{
    int total = 0, used = 0;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        total += kv->g[g].n_total;
        used += kv->g[g].n_held;
    }
    return total ? (double) used / total : 0.0;
}

uint64_t kv_pool_evictions(const struct kv_pool *kv)
{
    return kv->n_evictions;
}

/* ---------------------------------------------------------------- check -- */

static int check_group(const struct kv_pool *kv, int g, int32_t *count)
{
    const struct kv_group_state *s = &kv->g[g];
    int n_free = 0, n_cached = 0, n_held = 0;
    memset(count, 0, (size_t) s->n_total * sizeof(int32_t));
    for (int slot = 0; slot < kv->max_seqs; slot++) {
        const int32_t *t = table_of(kv, slot, g);
        int held = 0;
        for (int32_t b = 0; b < kv->max_blocks; b++) {
            if (t[b] < 0)
                continue;
            if (b >= kv->slots[slot].n_logical || t[b] >= s->n_total)
                return -EUCLEAN;
            count[t[b]]++;
            held++;
        }
        if (held != s->held[slot])
            return -EUCLEAN;
    }
    for (int i = 0; i < s->n_free; i++)
        if (s->state[s->free_stack[i]] != B_FREE)
            return -EUCLEAN;
    int lru_len = 0;
    for (int32_t id = s->lru_head, prev = -1; id >= 0; prev = id, id = s->lru_next[id]) {
        if (s->state[id] != B_CACHED || s->lru_prev[id] != prev || ++lru_len > s->n_total)
            return -EUCLEAN;
    }
    for (int32_t id = 0; id < s->n_total; id++) {
        if (count[id] != s->refs[id])
            return -EUCLEAN;
        switch (s->state[id]) {
        case B_FREE: n_free++; if (s->refs[id] || s->keyed[id]) return -EUCLEAN; break;
        case B_CACHED: n_cached++; if (s->refs[id] || !s->keyed[id]) return -EUCLEAN; break;
        case B_HELD: n_held++; if (s->refs[id] <= 0) return -EUCLEAN; break;
        default: return -EUCLEAN;
        }
    }
    if (n_free != s->n_free || n_cached != s->n_cached || lru_len != n_cached ||
        n_held != s->n_held || n_free + n_cached + n_held != s->n_total)
        return -EUCLEAN;
    return 0;
}

static int check_index(const struct kv_pool *kv)
{
    const struct kv_group_state *f = &kv->g[KV_GROUP_FULL], *s = &kv->g[KV_GROUP_SLIDING];
    size_t bs = (size_t) kv->block_size;
    int n_indexed = 0, n_in_buckets = 0;
    for (int32_t id = 0; id < f->n_total; id++) {
        n_indexed += f->keyed[id];
        int32_t sid = kv->sliding[id];
        if (sid >= 0 && (!f->keyed[id] || sid >= s->n_total || !s->keyed[sid] ||
                         kv->owner[sid] != id || kv->owner_gen[sid] != kv->gen[id]))
            return -EUCLEAN;
    }
    for (int32_t sid = 0; sid < s->n_total; sid++)
        if (s->keyed[sid] && (kv->owner[sid] < 0 || kv->sliding[kv->owner[sid]] != sid))
            return -EUCLEAN;
    for (uint32_t h = 0; h <= kv->bucket_mask; h++) {
        for (int32_t a = kv->bucket[h]; a >= 0; a = kv->chain[a]) {
            if (!f->keyed[a] || bucket_of(kv, kv->digest[a]) != h || ++n_in_buckets > n_indexed)
                return -EUCLEAN;
            /* no two entries with the same whole key */
            for (int32_t c = kv->chain[a]; c >= 0; c = kv->chain[c])
                if (memcmp(kv->digest[a], kv->digest[c], KV_DIGEST_BYTES) == 0 &&
                    kv->parent[a] == kv->parent[c] && kv->parent_gen[a] == kv->parent_gen[c] &&
                    (kv->parent[a] >= 0 ||
                     memcmp(kv->root[a], kv->root[c], KV_DIGEST_BYTES) == 0) &&
                    memcmp(kv->tokens + (size_t) a * bs, kv->tokens + (size_t) c * bs,
                           bs * sizeof(int32_t)) == 0)
                    return -EUCLEAN;
        }
    }
    return n_in_buckets == n_indexed ? 0 : -EUCLEAN;
}

int kv_pool_check(const struct kv_pool *kv)
{
    int n = kv->g[0].n_total > kv->g[1].n_total ? kv->g[0].n_total : kv->g[1].n_total;
    int32_t *count = malloc((size_t) n * sizeof(int32_t));
    if (!count)
        return -ENOMEM;
    int r = 0;
    for (int g = 0; g < _KV_GROUP_MAX && r == 0; g++)
        r = check_group(kv, g, count);
    free(count);
    return r ? r : check_index(kv);
}

bool kv_pool_idle(const struct kv_pool *kv)
{
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        if (kv->g[g].n_held != 0)
            return false;
    return true;
}
