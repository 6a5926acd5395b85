/* affinity.c - the prefix-affinity table (see affinity.h): open hashing over a fixed array
 * of entries, an intrusive LRU list, both by index (no allocation after affinity_new).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "affinity.h"
#include "prefix.h"
#include "slab.h"

#define NIL UINT32_MAX

struct aff_entry {
    uint64_t key;
    uint64_t group;
    uint32_t next;                  /* bucket chain */
    uint32_t prev_lru, next_lru;    /* most recent at the head */
};

struct affinity {                   /* heads one slab with e and bucket */
    struct aff_entry *e;
    uint32_t *bucket;
    uint32_t cap, n, mask;
    uint32_t head, tail;            /* LRU list */
    uint32_t free;                  /* free entries, chained by next */
};

int affinity_new(uint32_t max_entries, struct affinity **ret)
{
    struct affinity *a;
    uint32_t nb = 1;

    *ret = NULL;
    if (max_entries == 0)
        return 0;
    while (nb < max_entries && nb < (1u << 30))
        nb <<= 1;
    struct affinity t = { 0 };
    const struct slab_part parts[] = { SLAB_PART(t.e, max_entries), SLAB_PART(t.bucket, nb) };
    int r = slab_new(&t, sizeof(t), parts, SLAB_N(parts), &a);
    if (r < 0)
        return r;
    memset(a->bucket, 0xff, nb * sizeof(*a->bucket));
    a->cap = max_entries;
    a->mask = nb - 1;
    a->head = a->tail = NIL;
    for (uint32_t i = 0; i < max_entries; i++)
        a->e[i].next = i + 1 < max_entries ? i + 1 : NIL;
    a->free = 0;
    *ret = a;
    return 0;
}

void affinity_free(struct affinity *a)
{
    free(a);
}

uint32_t affinity_size(const struct affinity *a)
{
    return a ? a->n : 0;
}

size_t affinity_chain(const int32_t *prompt, size_t n, int block, const char *cache_salt,
                      uint64_t *keys, size_t max)
{
    static const uint8_t no_salt[PREFIX_DIGEST_BYTES];
    uint8_t d[PREFIX_DIGEST_BYTES];
    size_t k = 0;

    if (block <= 0)
        return 0;
    prefix_root(no_salt, cache_salt, cache_salt ? strlen(cache_salt) : 0, d);
    for (; k < max && (k + 1) * (size_t)block <= n; k++) {
        prefix_block_digest(d, prompt + k * (size_t)block, block, d);
        memcpy(&keys[k], d, sizeof(keys[k]));
    }
    return k;
}

static uint32_t *slot_of(struct affinity *a, uint64_t key)
{
    return &a->bucket[(uint32_t)(key ^ (key >> 32)) & a->mask];
}

static uint32_t lookup(struct affinity *a, uint64_t key)
{
    for (uint32_t i = *slot_of(a, key); i != NIL; i = a->e[i].next)
        if (a->e[i].key == key)
            return i;
    return NIL;
}

static void lru_unlink(struct affinity *a, uint32_t i)
{
    struct aff_entry *x = &a->e[i];

    if (x->prev_lru != NIL)
        a->e[x->prev_lru].next_lru = x->next_lru;
    else
        a->head = x->next_lru;
    if (x->next_lru != NIL)
        a->e[x->next_lru].prev_lru = x->prev_lru;
    else
        a->tail = x->prev_lru;
}

static void lru_push(struct affinity *a, uint32_t i)
{
    struct aff_entry *x = &a->e[i];

    x->prev_lru = NIL;
    x->next_lru = a->head;
    if (a->head != NIL)
        a->e[a->head].prev_lru = i;
    a->head = i;
    if (a->tail == NIL)
        a->tail = i;
}

/* Take the least recently used entry out of the table. */
static uint32_t evict(struct affinity *a)
{
    uint32_t i = a->tail, *pp;

    lru_unlink(a, i);
    for (pp = slot_of(a, a->e[i].key); *pp != i; pp = &a->e[*pp].next)
        ;
    *pp = a->e[i].next;
    a->n--;
    return i;
}

uint64_t affinity_find(struct affinity *a, const uint64_t *keys, size_t n,
                       bool (*usable)(uint64_t group, void *ctx), void *ctx, size_t *ret_depth)
{
    *ret_depth = 0;
    if (!a)
        return 0;
    for (size_t k = n; k-- > 0;) {
        uint32_t i = lookup(a, keys[k]);

        if (i == NIL || !usable(a->e[i].group, ctx))
            continue;
        lru_unlink(a, i);
        lru_push(a, i);
        *ret_depth = k + 1;
        return a->e[i].group;
    }
    return 0;
}

void affinity_note(struct affinity *a, const uint64_t *keys, size_t n, uint64_t group)
{
    if (!a)
        return;
    /* the shallow keys last, so they are the most recent: a prefix's head outlives its tail */
    for (size_t k = n; k-- > 0;) {
        uint32_t i = lookup(a, keys[k]);

        if (i != NIL) {
            lru_unlink(a, i);
        } else {
            uint32_t *slot;

            if (a->free != NIL) {
                i = a->free;
                a->free = a->e[i].next;
            } else {
                i = evict(a);
            }
            slot = slot_of(a, keys[k]);     /* after evict: it may have changed this chain */
            a->e[i].key = keys[k];
            a->e[i].next = *slot;
            *slot = i;
            a->n++;
        }
        a->e[i].group = group;
        lru_push(a, i);
    }
}
