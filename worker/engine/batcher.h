/* batcher.h - the continuous-batching scheduler of rank 0 (vLLM V1 style).
 *
 * Each step gets a token budget (--max-num-batched-tokens) and at most max_seqs
 * sequences.  Running sequences are served first in priority order (lower value first,
 * then arrival): a decode wants 1 + its pending drafts, a prefill the rest of its known
 * tokens, cut into chunks that fit the budget, so prefills mix with decodes.  Waiting
 * sequences are then admitted in the same order while the budget, a slot and KV blocks
 * last (the waiting queue is bounded).  When a running sequence cannot get blocks, the
 * lowest-priority running sequence is preempted by recompute: its blocks and slot are
 * released and it goes back to the front of the waiting queue with every token it has
 * (prompt + output) to prefill again.  A waiting sequence of strictly better priority
 * may also preempt the worst running one.
 * Prefix cache: admission first takes the longest cached prefix of the sequence's known
 * tokens (kv_seq_begin); only the rest counts against the token budget and gets new
 * blocks, and a preempted sequence finds again what it had committed.
 * Engine thread only; owns nothing but pointers to the caller's batch_seq objects.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "kv.h"

#ifdef __cplusplus
extern "C" {
#endif

enum batch_state {
    BATCH_STATE_NEW,
    BATCH_STATE_WAITING,
    BATCH_STATE_RUNNING,
};

struct batch_seq {
    /* public: set by the owner */
    int priority;             /* lower = served first */
    uint64_t arrival;         /* FIFO tie-break (monotonic counter) */
    int32_t n_known;          /* prompt + accepted output tokens */
    int n_draft;              /* drafts pending verification after the known tokens */
    const int32_t *tokens;    /* the n_known tokens (read at admission for the prefix cache) */
    const uint8_t *cache_root;/* prefix-cache chain root (kv_prefix_root); NULL = none */
    int mtp_depth;            /* drafts it proposes per step (bounds its prefix reuse) */
    bool mtp_exact;           /* its drafts must equal those of its own fresh prefill: reuse
                                 only where the MTP KV is final (else the trunk's prefix) */
    /* read-only: scheduler state */
    enum batch_state state;
    int slot;                 /* -1 unless running */
    int32_t n_computed;       /* positions whose KV is valid */
    int n_preempted;          /* times preempted */
    int32_t n_cached;         /* tokens reused from the prefix cache at the last admission */
    int32_t n_cached_mtp;     /* ... below which its MTP layers' KV is final (<= n_cached) */
    /* read-only: this step (valid after batch_schedule) */
    int32_t sched_tokens;     /* tokens scheduled, drafts included (0 = not scheduled) */
    int sched_drafts;         /* drafts included (may be fewer than n_draft when tight) */
    bool sched_final;         /* the run reaches the last known token (logits wanted) */
    bool sched_new;           /* the run starts the sequence in its slot (just admitted) */
};

struct batcher_config {
    int max_num_batched_tokens;
    int max_seqs;
    int max_waiting;
};

struct batcher;

int batcher_new(const struct batcher_config *cfg, struct kv_pool *kv, struct batcher **ret);
void batcher_free(struct batcher *b);

/* Queue a new sequence (state NEW, n_computed 0).  The owner keeps at most max_waiting
 * never-admitted and max_waiting + max_seqs sequences in total (preempted ones return
 * to the queue); -EAGAIN when max_waiting + max_seqs are waiting.  The caller keeps s
 * alive until batcher_remove. */
int batcher_add(struct batcher *b, struct batch_seq *s);
/* Drop s wherever it is (waiting or running): releases its blocks and slot at once. */
void batcher_remove(struct batcher *b, struct batch_seq *s);

/* Plan one step.  Writes the scheduled sequences, in plan order, to *ret_seqs (an array
 * owned by the batcher, valid until the next call) and returns how many.  KV blocks for
 * the scheduled tokens are allocated.  Never fails: an empty step returns 0. */
int batcher_schedule(struct batcher *b, struct batch_seq ***ret_seqs);

int batcher_n_running(const struct batcher *b);
int batcher_n_waiting(const struct batcher *b);
uint64_t batcher_n_preemptions(const struct batcher *b);
/* Prefix cache since batcher_new: known tokens of admitted sequences that have a cache
 * root (queries) and the tokens reused from cached blocks among them (hits). */
void batcher_prefix_stats(const struct batcher *b, uint64_t *ret_queries, uint64_t *ret_hits);

#ifdef __cplusplus
}
#endif
