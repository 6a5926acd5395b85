/* batcher.c - continuous batching: token budget, chunked prefill, admission, preemption. */
#include "batcher.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "slab.h"

struct batcher {                  /* heads one slab with its four arrays */
    struct batcher_config cfg;
    struct kv_pool *kv;
    struct batch_seq **waiting;   /* sorted by (priority, arrival) */
    int n_waiting;
    int cap_waiting;
    struct batch_seq **running;   /* sorted by (priority, arrival) */
    int n_running;
    struct batch_seq **sched;     /* this step, plan order */
    int n_sched;
    int *free_slots;
    int n_free_slots;
    uint64_t n_preemptions;
    uint64_t prefix_queries, prefix_hits;
};

int batcher_new(const struct batcher_config *cfg, struct kv_pool *kv, struct batcher **ret)
{
    if (!cfg || !kv || cfg->max_num_batched_tokens <= 0 || cfg->max_seqs <= 0 ||
        cfg->max_waiting < 0)
        return -EINVAL;
    struct batcher t = { .cfg = *cfg, .kv = kv, .cap_waiting = cfg->max_waiting + cfg->max_seqs };
    const struct slab_part parts[] = {
        SLAB_PART(t.waiting, t.cap_waiting),
        SLAB_PART(t.running, cfg->max_seqs),
        SLAB_PART(t.sched, cfg->max_seqs),
        SLAB_PART(t.free_slots, cfg->max_seqs),
    };
    struct batcher *b;
    int r = slab_new(&t, sizeof(t), parts, SLAB_N(parts), &b);
    if (r < 0)
        return r;
    for (int i = 0; i < cfg->max_seqs; i++)
        b->free_slots[b->n_free_slots++] = cfg->max_seqs - 1 - i;
    *ret = b;
    return 0;
}

void batcher_free(struct batcher *b)
{
    free(b);
}

static bool before(const struct batch_seq *a, const struct batch_seq *c)
{
    if (a->priority != c->priority)
        return a->priority < c->priority;
    return a->arrival < c->arrival;
}

static void list_insert(struct batch_seq **list, int *n, struct batch_seq *s)
{
    int i = *n;
    while (i > 0 && before(s, list[i - 1])) {
        list[i] = list[i - 1];
        i--;
    }
    list[i] = s;
    (*n)++;
}

static bool list_remove(struct batch_seq **list, int *n, struct batch_seq *s)
{
    for (int i = 0; i < *n; i++) {
        if (list[i] == s) {
            memmove(&list[i], &list[i + 1], (size_t) (*n - i - 1) * sizeof(*list));
            (*n)--;
            return true;
        }
    }
    return false;
}

int batcher_add(struct batcher *b, struct batch_seq *s)
{
    /* the owner bounds new arrivals by max_waiting; preempted ones add up to max_seqs */
    if (b->n_waiting >= b->cap_waiting)
        return -EAGAIN;
    s->state = BATCH_STATE_WAITING;
    s->slot = -1;
    s->n_computed = 0;
    s->sched_tokens = 0;
    s->sched_drafts = 0;
    s->sched_final = false;
    s->sched_new = false;
    s->n_cached = 0;
    s->n_cached_mtp = 0;
    list_insert(b->waiting, &b->n_waiting, s);
    return 0;
}

static void unschedule(struct batcher *b, struct batch_seq *s)
{
    if (s->sched_tokens > 0)
        list_remove(b->sched, &b->n_sched, s);
    s->sched_tokens = 0;
    s->sched_drafts = 0;
    s->sched_final = false;
    s->sched_new = false;
}

static void release_running(struct batcher *b, struct batch_seq *s)
{
    unschedule(b, s);
    list_remove(b->running, &b->n_running, s);
    kv_seq_release(b->kv, s->slot);
    b->free_slots[b->n_free_slots++] = s->slot;
    s->slot = -1;
}

void batcher_remove(struct batcher *b, struct batch_seq *s)
{
    if (s->state == BATCH_STATE_RUNNING)
        release_running(b, s);
    else if (s->state == BATCH_STATE_WAITING)
        list_remove(b->waiting, &b->n_waiting, s);
    s->state = BATCH_STATE_NEW;
}

/* Recompute preemption: back to waiting with nothing computed and no drafts. */
static void preempt(struct batcher *b, struct batch_seq *s)
{
    release_running(b, s);
    s->n_computed = 0;
    s->n_draft = 0;
    s->n_preempted++;
    s->state = BATCH_STATE_WAITING;
    BUG_ON(b->n_waiting >= b->cap_waiting);
    list_insert(b->waiting, &b->n_waiting, s);
    b->n_preemptions++;
}

/* Size of s's run this step given the budget; 0 when nothing fits. */
static int32_t run_size(const struct batch_seq *s, int budget, int *ret_drafts, bool *ret_final)
{
    int32_t rem = s->n_known - s->n_computed;
    int drafts = 0;
    int32_t n;
    if (rem == 1) {
        drafts = s->n_draft < budget - 1 ? s->n_draft : budget - 1;
        if (drafts < 0)
            drafts = 0;
        n = budget > 0 ? 1 + drafts : 0;
    } else {
        n = rem < budget ? rem : budget;
    }
    *ret_drafts = drafts;
    *ret_final = n > 0 && n - drafts == rem;
    return n;
}

static void mark(struct batcher *b, struct batch_seq *s, int32_t n, int drafts, bool final,
                 bool is_new)
{
    s->sched_tokens = n;
    s->sched_drafts = drafts;
    s->sched_final = final;
    s->sched_new = is_new;
    b->sched[b->n_sched++] = s;
}

/* Serve running sequences; returns the budget left and sets *ret_preempted. */
static int schedule_running(struct batcher *b, int budget, bool *ret_preempted)
{
    int i = 0;
    while (i < b->n_running) {
        struct batch_seq *s = b->running[i];
        int drafts;
        bool final;
        int32_t n = run_size(s, budget, &drafts, &final);
        if (n == 0) {
            i++;
            continue;
        }
        int r = kv_seq_grow(b->kv, s->slot, s->n_computed, s->n_computed + n);
        bool self = false;
        while (r == -ENOSPC) {
            struct batch_seq *victim = b->running[b->n_running - 1];
            budget += victim->sched_tokens;
            preempt(b, victim);
            *ret_preempted = true;
            if (victim == s) {
                self = true;
                break;
            }
            r = kv_seq_grow(b->kv, s->slot, s->n_computed, s->n_computed + n);
        }
        if (self)
            continue;
        BUG_ON(r < 0);
        mark(b, s, n, drafts, final, false);
        budget -= n;
        i++;
    }
    return budget;
}

/* Admit s (head of the waiting queue) if a slot and blocks allow, from the longest cached
 * prefix of its tokens; may preempt a running sequence of strictly worse priority.
 * Returns tokens scheduled (0 = stop admitting). */
static int32_t admit(struct batcher *b, struct batch_seq *s, int budget)
{
    for (;;) {
        struct batch_seq *worst = b->n_running ? b->running[b->n_running - 1] : NULL;
        if (b->n_free_slots > 0) {
            int slot = b->free_slots[b->n_free_slots - 1];
            int drafts;
            bool final;
            int32_t mtp_final = 0;
            int32_t cached = kv_seq_begin(b->kv, slot, s->cache_root, s->tokens, s->n_known,
                                          s->mtp_depth, s->mtp_exact ? NULL : &mtp_final);
            s->n_computed = cached;
            int32_t n = run_size(s, budget, &drafts, &final);
            int r = n > 0 ? kv_seq_grow(b->kv, slot, cached, cached + n) : -ENOSPC;
            if (r == 0) {
                b->n_free_slots--;
                list_remove(b->waiting, &b->n_waiting, s);
                s->slot = slot;
                s->state = BATCH_STATE_RUNNING;
                s->n_cached = cached;
                s->n_cached_mtp = s->mtp_exact ? cached : mtp_final;
                if (s->cache_root) {
                    b->prefix_queries += (uint64_t) s->n_known;
                    b->prefix_hits += (uint64_t) cached;
                }
                list_insert(b->running, &b->n_running, s);
                mark(b, s, n, drafts, final, true);
                return n;
            }
            BUG_ON(r != -ENOSPC);
            /* the cached blocks go back where they were (cached, or held by others) */
            kv_seq_release(b->kv, slot);
            s->n_computed = 0;
            if (n == 0)
                return 0;
        }
        if (!worst || worst->priority <= s->priority)
            return 0;
        budget += worst->sched_tokens;
        preempt(b, worst);
    }
}

int batcher_schedule(struct batcher *b, struct batch_seq ***ret_seqs)
{
    for (int i = 0; i < b->n_sched; i++) {
        b->sched[i]->sched_tokens = 0;
        b->sched[i]->sched_drafts = 0;
        b->sched[i]->sched_final = false;
        b->sched[i]->sched_new = false;
    }
    b->n_sched = 0;
    bool preempted = false;
    int budget = schedule_running(b, b->cfg.max_num_batched_tokens, &preempted);
    while (!preempted && budget > 0 && b->n_waiting > 0) {
        struct batch_seq *s = b->waiting[0];
        int32_t n = admit(b, s, budget);
        if (n == 0)
            break;
        /* a priority preemption inside admit may have unscheduled others */
        budget = b->cfg.max_num_batched_tokens;
        for (int i = 0; i < b->n_sched; i++)
            budget -= b->sched[i]->sched_tokens;
    }
    *ret_seqs = b->sched;
    return b->n_sched;
}

int batcher_n_running(const struct batcher *b)
{
    return b->n_running;
}

int batcher_n_waiting(const struct batcher *b)
{
    return b->n_waiting;
}

uint64_t batcher_n_preemptions(const struct batcher *b)
{
    return b->n_preemptions;
}

void batcher_prefix_stats(const struct batcher *b, uint64_t *ret_queries, uint64_t *ret_hits)
{
    *ret_queries = b->prefix_queries;
    *ret_hits = b->prefix_hits;
}
