/* bpe.c - byte-pair merging of one pre-tokenized word, with a word cache.
 *
 * Symbols start as the single-byte tokens of the word and live in a doubly linked list; a
 * binary heap holds candidate pairs ordered by (merge rank, position), so the lowest-ranked
 * pair, leftmost first, is merged next, exactly as the tokenizers library's Word::merge_all.
 * Stale heap entries are recognised by re-checking the pair's ids.  Words that appear again
 * are served from a hash cache (cleared wholesale when half full).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct sym {
    int32_t id;
    int32_t prev;       /* index, -1 none */
    int32_t next;
};

struct cand {
    int32_t rank;
    int32_t pos;        /* left symbol index */
    int32_t left;       /* ids expected at pos and its next, to detect stale entries */
    int32_t right;
    int32_t merged;
};

static inline bool cand_less(const struct cand *a, const struct cand *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct cand *h, size_t *n, struct cand c)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static struct cand heap_pop(struct cand *h, size_t *n)
{
    struct cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const struct cand *best = &last;
        if (l < *n && cand_less(&h[l], best))
            m = l, best = &h[l];
        if (r < *n && cand_less(&h[r], best))
            m = r;
        if (m == i)
            break;
        h[i] = h[m];
        i = m;
    }
    if (*n)
        h[i] = last;
    return top;
}

static void try_pair(const struct tokenizer *tok, const struct sym *s, int32_t pos,
                     struct cand *h, size_t *nh)
{
    int32_t nx = s[pos].next, merged;
    if (nx < 0)
        return;
    int32_t rank = tok__merge_lookup(tok, s[pos].id, s[nx].id, &merged);
    if (rank < 0)
        return;
    heap_push(h, nh, (struct cand){ rank, pos, s[pos].id, s[nx].id, merged });
}

static int bpe_merge(const struct tokenizer *tok, const char *w, size_t n, struct tok_ids *out)
{
    struct sym stack_syms[64];
    struct cand stack_heap[3 * 64];
    struct sym *s = stack_syms;
    struct cand *h = stack_heap;
    size_t ns = 0, nh = 0;
    int r = 0;

    if (n > 64) {
        s = malloc(n * sizeof(*s));
        h = malloc(3 * n * sizeof(*h));
        if (!s || !h) {
            r = -ENOMEM;
            goto out;
        }
    }
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[(unsigned char) w[i]];
        if (id < 0)
            id = tok->unk_id;
        if (id < 0)
            continue;           /* no token for this byte and no unk: dropped, as upstream */
        s[ns] = (struct sym){ id, (int32_t) ns - 1, (int32_t) ns + 1 };
        ns++;
    }
    if (!ns)
        goto out;
    s[ns - 1].next = -1;
    for (size_t i = 0; i + 1 < ns; i++)
        try_pair(tok, s, (int32_t) i, h, &nh);
    while (nh) {
        struct cand c = heap_pop(h, &nh);
        int32_t nx = s[c.pos].next;
        if (s[c.pos].id != c.left || nx < 0 || s[nx].id != c.right)
            continue;
        s[c.pos].id = c.merged;
        s[c.pos].next = s[nx].next;
        if (s[nx].next >= 0)
            s[s[nx].next].prev = c.pos;
        s[nx].id = -1;          /* dead */
        s[nx].next = -1;
        if (s[c.pos].prev >= 0)
            try_pair(tok, s, s[c.pos].prev, h, &nh);
        try_pair(tok, s, c.pos, h, &nh);
    }
    for (int32_t i = 0; i >= 0; i = s[i].next)
        if ((r = tok__ids_push(out, s[i].id)) < 0)
            goto out;
out:
    if (s != stack_syms)
        free(s);
    if (h != stack_heap)
        free(h);
    return r;
}

/* --- cache --------------------------------------------------------------------------------- */

void tok__cache_clear(struct tokenizer *tok)
{
    for (size_t i = 0; i <= tok->cache_mask; i++) {
        free(tok->cache[i]);
        tok->cache[i] = NULL;
    }
    tok->cache_used = 0;
}

enum { CACHE_MAX_WORD = 256 };

static int cache_get(const struct tokenizer *tok_c, uint64_t hash, const char *w, size_t n,
                     struct tok_ids *out, bool *ret_hit)
{
    struct tokenizer *tok = (struct tokenizer *) tok_c;   /* the cache is the mutable part */
    int r = 0;

    *ret_hit = false;
    pthread_mutex_lock(&tok->cache_lock);
    for (size_t i = hash & tok->cache_mask;; i = (i + 1) & tok->cache_mask) {
        struct tok_cache_entry *c = tok->cache[i];
        if (!c)
            break;
        if (c->hash == hash && c->len == n && memcmp(c->word, w, n) == 0) {
            for (uint32_t k = 0; k < c->n_ids && r == 0; k++)
                r = tok__ids_push(out, c->ids[k]);
            *ret_hit = true;
            break;
        }
    }
    pthread_mutex_unlock(&tok->cache_lock);
    return r;
}

static void cache_put(const struct tokenizer *tok_c, uint64_t hash, const char *w, size_t n,
                      const int32_t *ids, size_t n_ids)
{
    struct tokenizer *tok = (struct tokenizer *) tok_c;
    size_t off = (n + 1 + 3) & ~(size_t) 3;
    struct tok_cache_entry *c = malloc(sizeof(*c) + off + n_ids * sizeof(int32_t));
    if (!c)
        return;                 /* the cache is an optimisation; skip on OOM */
    c->hash = hash;
    c->len = (uint32_t) n;
    c->n_ids = (uint32_t) n_ids;
    memcpy(c->word, w, n);
    c->word[n] = '\0';
    c->ids = (int32_t *)(void *)(c->word + off);
    memcpy(c->ids, ids, n_ids * sizeof(int32_t));
    pthread_mutex_lock(&tok->cache_lock);
    if (tok->cache_used * 2 >= tok->cache_mask)
        tok__cache_clear(tok);
    size_t i = hash & tok->cache_mask;
    for (;; i = (i + 1) & tok->cache_mask) {
        struct tok_cache_entry *o = tok->cache[i];
        if (!o)
            break;
        if (o->hash == hash && o->len == n && memcmp(o->word, w, n) == 0) {
            free(c);            /* another thread got there first */
            c = NULL;
            break;
        }
    }
    if (c) {
        tok->cache[i] = c;
        tok->cache_used++;
    }
    pthread_mutex_unlock(&tok->cache_lock);
}

/* ignore_merges: a word that is itself a vocab token is emitted whole. */
static int whole_word(const struct tokenizer *tok, const char *w, size_t n, int32_t *ret_id)
{
    char small[256 * 2];
    size_t m = 0;
    if (n > 256)
        return -ENOENT;
    for (size_t i = 0; i < n; i++)
        m += (size_t) tok__utf8_put(small + m, tok__byte_to_cp[(unsigned char) w[i]]);
    int32_t id = tok__str_lookup(tok, small, m);
    if (id < 0 || tok->tokens[id].added)
        return -ENOENT;
    *ret_id = id;
    return 0;
}

int tok__bpe_word(const struct tokenizer *tok, const char *w, size_t n, struct tok_ids *out)
{
    size_t n0 = out->n;
    uint64_t hash = 0;
    bool hit;
    int32_t id;
    int r;

    if (tok->ignore_merges && whole_word(tok, w, n, &id) == 0)
        return tok__ids_push(out, id);
    if (n <= CACHE_MAX_WORD) {
        hash = tok__hash(w, n);
        if ((r = cache_get(tok, hash, w, n, out, &hit)) < 0 || hit)
            return r;
    }
    if ((r = bpe_merge(tok, w, n, out)) < 0)
        return r;
    if (n <= CACHE_MAX_WORD)
        cache_put(tok, hash, w, n, out->ids + n0, out->n - n0);
    return 0;
}
