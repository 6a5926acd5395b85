/* mock.h - a fake forward pass behind struct forward_ops (worker/forward.h).
 *
 * Logits are a deterministic function of the token history as the mock itself reads it
 * back from its own paged KV store through the plan's block tables: every step writes
 * (position, token, chain hash of the history up to it) into the blocks the plan names,
 * continuing the chain of the cell before the run, and every logits row hashes the last
 * `context` tokens (read through the SLIDING table) and the first token (read through
 * the FULL table), or with full_history the chain of the whole history.  The window's
 * cells must chain into each other and agree with the FULL cell of the row's position,
 * so a wrong, stale or released block is detected (-EUCLEAN) instead of silently
 * producing plausible output, while a block shared by sequences with the same history
 * (prefix cache) reads back correctly: the mock checks the engine's KV bookkeeping.
 *
 * MTP: at depth k the draft row is the exact target row of the drafted context with
 * probability mtp_accuracy (a deterministic coin of the context), otherwise an
 * unrelated row, so acceptance rates can be dialled in tests.
 * Step time: step_usec + token_usec * tokens per step (and mtp_usec per MTP step), from
 * the call's start to its return: the mock sleeps what its own work (hashing the rows)
 * left of it, so a call costs its nominal time whatever the host's load as long as that
 * work fits in it (mock_stats.overruns counts the calls it did not); or with a simulated
 * clock added to it (the engine reading the same clock: engine_config.clock), so
 * throughput experiments cost little CPU and, simulated, no wall time and come out the
 * same on any machine.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "clock.h"
#include "forward.h"

#ifdef __cplusplus
extern "C" {
#endif

struct mock_config {
    int vocab_size;
    int n_mtp;                 /* 0 .. 3 */
    int max_tokens_per_step;
    int max_seqs;
    int block_size;
    int n_blocks[_KV_GROUP_MAX];
    int context;               /* tokens hashed per row (1 .. 8); must fit the window */
    float logit_scale;         /* spread of the fake logits */
    float mtp_accuracy;        /* [0, 1] */
    bool full_history;         /* rows depend on every token of the history (a block with
                                  another history anywhere changes the output) */
    uint64_t seed;
    long step_usec;
    long token_usec;
    long mtp_usec;
    struct clk_sim *clock;     /* NULL: sleep the step times; else advance this clock */
    const struct clk_src *wall; /* without `clock`: what a call's start and its work are
                                  measured on (NULL: the monotonic clock) */
    unsigned mtp_kv_groups;    /* forward.mtp_kv_groups: the groups the engine's prefix cache
                                  takes to hold MTP KV (the mock keeps none; 0: none) */
};

struct mock_stats {
    uint64_t steps;
    uint64_t tokens;
    uint64_t mtp_steps;
    int max_seqs_in_step;
    int max_tokens_in_step;
    uint64_t slept_us;         /* slept, summed (without `clock`) */
    uint64_t overruns;         /* calls whose own work took longer than their nominal time */
};

/* Defaults for tests: vocab 256, context 3, scale 4, accuracy 0.8, no sleeping. */
void mock_config_init(struct mock_config *cfg);
/* Build a mock forward.  -EINVAL on a bad config, -ENOMEM. */
int mock_forward_new(const struct mock_config *cfg, struct forward **ret);
/* Counters of a mock forward (zeroes for a forward that is not a mock). */
void mock_forward_stats(const struct forward *f, struct mock_stats *ret);
/* The target logits the mock would produce for a sequence ending in tokens[0..n-1]
 * (for tests that compute expected output independently of the engine). */
void mock_forward_row(const struct forward *f, const int32_t *tokens, int n, float *logits);

#ifdef __cplusplus
}
#endif
