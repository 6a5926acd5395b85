/* kvplan.h - how a rank's KV memory divides into the engine's two block pools, shared by
 * stepd-worker (start-up sizing) and stepd-inspect (the memory plan).
 *
 * The FULL pool holds the blocks of full-attention layers, which keep every position;
 * the SLIDING pool those of sliding-window layers and the MTP layers, which keep only the
 * window (plus the positions the MTP repair re-runs) behind the lowest position still to
 * compute.  So the sliding pool is sized by the window and the chunk in flight: with S
 * sequences of at most W' = window + margin positions behind their run each, and runs
 * summing to at most B tokens per step, the sliding blocks held at once never exceed
 * ceil((S*W' + B) / bs) + 2*S; the full pool gets whatever the budget leaves.  The
 * budget must hold the sliding pool plus one sequence of max_model_len (+ drafts) in the
 * full pool, or the engine could never finish such a sequence: kvplan_compute says how
 * much is needed and how much there is.
 * Element sizes: BF16 = 2 bytes (the default KV dtype), FP32 = 4.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { KVPLAN_FULL, KVPLAN_SLIDING, _KVPLAN_POOLS };   /* = enum kv_group */

/* stepd-worker's defaults of the sizes (worker_opts_init; `stepd serve` plans with them) */
#define KVPLAN_DEFAULT_BLOCK_SIZE 16
#define KVPLAN_DEFAULT_MAX_SEQS 8
#define KVPLAN_DEFAULT_MAX_BATCHED_TOKENS 256
#define KVPLAN_DEFAULT_MAX_MODEL_LEN 1024

#define KVPLAN_MAX_DRAFTS 3     /* positions a sequence may hold past max_model_len (SPEC_MAX_K) */

/* KV bytes one token costs on `rank` of a `world`-rank group, per pool: K and V of the
 * rank's KV heads (n_kv_heads / world) x head_dim x elem_bytes, summed over the trunk
 * layers of that kind and, on rank 0, the first n_mtp MTP layers (which run unsharded on
 * rank 0: all their KV heads). */
void kvplan_bytes_per_token(const struct model_config *c, int world, int rank, int n_mtp,
                            int elem_bytes, int64_t ret[_KVPLAN_POOLS]);

struct kvplan_req {
    int block_size;
    int max_num_seqs;
    int max_model_len;
    int max_batched_tokens;         /* tokens per step: the chunk in flight */
    int sliding_window;             /* keys a sliding layer sees; 0 = no sliding layers */
    int mtp_margin;                 /* positions kept beyond the window (MTP repair) */
    int64_t bytes_per_token[_KVPLAN_POOLS];
};

struct kvplan {
    int n_blocks[_KVPLAN_POOLS];
    int64_t block_bytes[_KVPLAN_POOLS];
    int64_t bytes[_KVPLAN_POOLS];   /* n_blocks x block_bytes */
    int64_t min_bytes;              /* the sliding pool + one sequence of max_model_len */
    int64_t all_bytes;              /* the sliding pool + max_num_seqs of them */
    int seq_blocks;                 /* full blocks one sequence of max_model_len needs */
    int full_seqs;                  /* sequences of max_model_len the full pool holds at once */
};

/* Size the pools for a budget of `budget` bytes (< 0: all_bytes, every sequence at full
 * length).  Returns 0, or -ENOSPC with a sentence in e naming what the budget lacks (how
 * much is needed, how much there is, and the flags that change it; *ret then holds the
 * sliding pool and the needs, with no full blocks), -EINVAL on a bad request.  The full
 * pool is capped at 2^24 blocks. */
int kvplan_compute(const struct kvplan_req *q, int64_t budget, struct kvplan *ret,
                   struct err_buf *e);

/* The activation buffers worker/model reserves for a step (model-load.c, reserve(): the
 * model's own buffers, run whole as on a device, no per-core parts): max_tokens tokens,
 * max_seqs sequences, max_logit_rows logit rows, n_mtp MTP layers on rank 0.  Backend
 * scratch (inside its MoE, attention) and the runtime are not included. */
int64_t kvplan_workspace_bytes(const struct model_config *c, int world, int rank, int n_mtp,
                               int max_tokens, int max_seqs, int max_logit_rows);

/* "12.3 GiB" style rendering of n bytes into buf (for messages); returns buf. */
const char *kvplan_fmt_bytes(int64_t n, char *buf, int len);

#ifdef __cplusplus
}
#endif
