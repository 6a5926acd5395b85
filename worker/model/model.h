/* model.h - the Step forward pass (trunk + MTP) over the backend ops (docs/MODEL.md §2, §3).
 *
 * A struct model holds this rank's weights as views into the loader's buffers (prepared
 * once with backend_weight_prepare), one KV cache per layer (full-attention layers in
 * KV group FULL, sliding layers and sliding MTP layers in group SLIDING, block tables
 * from the step plan), and activations/scratch reserved at creation for the largest
 * step (max_tokens_per_step tokens, max_seqs sequences): a step allocates nothing.
 *
 * The real model is handed to the engine as a struct forward (worker/forward.h):
 * model_forward_new() builds both; forward->ops->free() frees the model.
 *
 * Sharding seams (docs/ARCHITECTURE.md §2): the model runs on the rank's slice of heads,
 * experts and vocab as returned by ckpt_get().  It calls the collective hooks of
 * struct model_comm at exactly three places:
 *   - allreduce_sum after o_proj of every layer (partial sums over the rank's heads),
 *   - allreduce_sum after the FFN of every layer (dense MLP / shared expert partials
 *     plus the rank's routed experts),
 *   - allgather of the lm_head rows of the wanted positions (vocab slices), or in the
 *     greedy form (model_step_argmax) of each slice's (value, id) pair per row.
 * MTP layers run on rank 0 only, unsharded (ckpt plans them there), so they call none.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "err.h"
#include "forward.h"
#include "loader.h"
#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Collectives used by the forward.  Pass NULL (or world == 1) for a single rank: every
 * hook is then a no-op.  Buffers are backend activation buffers: host memory on the CPU
 * backend, device memory on CUDA (pair it with a device-aware comm such as NCCL; the UCX
 * comm moves host buffers and pairs with the CPU backend).
 *   allreduce_sum(ctx, buf, n): buf[0..n) <- element-wise sum over ranks, in place.
 *   allgather(ctx, in, out, n): out[r*n .. r*n+n) <- rank r's in[0..n), for r = 0..world-1
 *                                (every rank receives all; rank order).
 * Both are collective (every rank calls them in the same order) and return 0 or a
 * negative errno; an error aborts the step (the group must re-form). */
struct model_comm {
    void *ctx;
    int rank, world;
    int (*allreduce_sum)(void *ctx, float *buf, size_t n);
    int (*allgather)(void *ctx, const float *in, float *out, size_t n);
};

/* How the MTP draft layers hold their projection weights (speculative config
 * "draft_quantization").  Drafts are only proposals: greedy verification keeps the longest
 * prefix equal to the target's argmax and rejection sampling uses the distribution the
 * drafts were actually sampled from, so any draft precision leaves outputs exact; it only
 * changes how many drafts are accepted and what a draft costs.
 *   CHECKPOINT: the checkpoint's BF16 weights as they are.
 *   MXFP4: the MTP layer's attention (q/k/v/o/g), MLP and shared head re-quantised at load
 *   to MXFP4 (mxfp4_row_quantize, 32-element blocks): ~3.3x fewer bytes per draft, and
 *   batch-1 drafting is weight-bandwidth bound.  eh_proj (the input projection, 6 % of
 *   the weights, whose error reaches everything after it) and the norms stay as they are. */
enum model_draft_quant {
    MODEL_DRAFT_CHECKPOINT = 0,
    MODEL_DRAFT_MXFP4,
};

struct model_opts {
    int max_tokens_per_step;    /* token capacity of one step (sum of run lengths) */
    int max_seqs;               /* sequences per step; slots are 0 .. max_seqs-1 */
    int max_logit_rows;         /* trunk logits rows per step (0 = max_seqs * (1 + n_mtp), capped) */
    int block_size;             /* KV block size in tokens */
    int n_blocks[_KV_GROUP_MAX];/* KV blocks per group (every layer of a group has this many) */
    int max_seq_len;            /* longest sequence (0 = config max_position_embeddings); sizes
                                   the block-table capacity */
    bool kv_f32;                /* store KV in FP32 (default BF16; attention accumulates in
                                   FP32 either way): the exact oracle path of the model tests */
    bool mtp_no_repair;         /* diagnostics only: skip the MTP re-run of draft positions
                                   (model_mtp_step), leaving stale MTP KV as before the repair */
    enum model_draft_quant draft_quant; /* weights of the MTP draft layers (see below) */
    bool no_split;              /* never run a trunk step as per-core parts (see model_step) */
    bool split_any_size;        /* benchmarks: per-core parts even when the trunk's shared
                                   weights are too big for them (model-split.c) */
    bool no_mtp_tp;             /* MTP layers whole, not as per-core halves (mtp_tp_run);
                                   drafts then differ in the order of some fp32 sums */
    bool no_mtp_tail;           /* diagnostics only: the last MTP depth runs every row
                                   through the whole layer (model_mtp_tails) */
    /* Sizes the KV pools once the weights and activations are reserved and only the KV
     * caches are left (model_new calls it right before reserving them), given what one
     * block costs per group over every layer of the group (MTP layers included): writes
     * n_blocks[g] > 0 or returns a negative errno with a sentence in e.  The worker sizes a
     * device's pools from the memory left there (backend_mem_info).  NULL: n_blocks. */
    int (*kv_blocks)(void *ctx, const int64_t block_bytes[_KV_GROUP_MAX],
                     int n_blocks[_KV_GROUP_MAX], struct err_buf *e);
    void *kv_blocks_ctx;
};

struct model;

/* Build the model for the rank/MTP depth the checkpoint was opened with.  The model
 * borrows c and be (both must outlive it) and copies comm.  On error returns a negative
 * errno with one sentence in e (which tensor, which shape, which option). */
int model_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
              const struct model_opts *opts, struct model **ret, struct err_buf *e);
void model_free(struct model *m);

/* The forward_ops protocol (worker/forward.h).  On a bad plan these return -EINVAL (or
 * -E2BIG over capacity) and model_last_error() says why.
 *
 * model_step: every rank runs it with the same plan (collectives inside); logits
 *   [rows, vocab] are written on every rank that passes a non-NULL buffer (ranks > 0 may
 *   pass NULL).  Runs must be laid out contiguously in plan order (seq i's tokens start
 *   where seq i-1's end).  KV is written for every token; attention reads, per layer, the
 *   blocks of its group (FULL: all blocks up to the token; SLIDING: the window), which
 *   must be valid ids (other sliding entries may be -1).
 * model_mtp_step: rank 0 only, after model_step of the SAME plan, depths 0, 1, .. in
 *   order.  MTP layer k writes its KV at positions pos0 .. pos0+n_valid-1 of each seq with
 *   mtp_depth > k; its input id at position pos0+t is the token k+1 further along: the
 *   run's own tokens while t+k+1 < n_valid, then tok_in of depths 0..k.  To keep the MTP
 *   caches complete, call it after prefill chunks too (n_valid = chunk length, tok_in =
 *   the prompt tokens that follow the chunk).
 *   Repair ("no trace"): the last k positions layer k wrote in the previous step had
 *   draft tokens (tok_in of depths >= 1) among their inputs, and layer k-1's outputs
 *   computed from drafts.  Layer k therefore first RE-RUNS positions pos0-r .. pos0-1
 *   (t = -r .. -1 in the formula above, so their inputs are now this run's accepted
 *   tokens and the new tok_in) with layer k-1's corrected outputs, rewriting their KV,
 *   then runs the new positions.  r <= k starts at the earliest of those positions whose
 *   input id changed (rejected or new draft) or whose g changed (layer k-1 re-ran it);
 *   all-accepted drafts need no re-run.  Afterwards each layer's KV equals that of a
 *   fresh prefill of the accepted history with the same tok_in.  The model keeps per
 *   slot and layer the ids and outputs of the last n_mtp positions and where the layer's
 *   contiguous history starts; a sequence starts afresh at pos0 == 0 or with
 *   STEP_SEQ_NEW (new request, preemption by recompute, a prefix-cache hit whose
 *   positions below pos0 are final: nothing before pos0 is re-run).  Positions are
 *   re-run only where the layer wrote pos0-1 last (a step without the chain leaves a
 *   hole that is not repaired) and where the sliding window's blocks of the re-run
 *   queries are still in the plan; both count as missed in model_mtp_repair_stats. */
int model_step(struct model *m, const struct step_plan *p, float *logits);
int model_mtp_step(struct model *m, int k, const struct step_plan *p, const int32_t *n_valid,
                   const int32_t *tok_in, float *logits);
const char *model_last_error(const struct model *m);
/* The greedy forms: model_step / model_mtp_step with every logits row reduced on the
 * backend to its argmax (backend_argmax: the lowest id of the largest logit, NaN never,
 * as sampler_argmax), so one id per row reaches the host instead of the FP32 row:
 * ids [rows] (trunk rows in plan order) / [n_seqs] (MTP drafts in plan order; seqs with
 * mtp_depth <= k untouched).  For plain greedy rows only (temperature 0, no logprobs,
 * penalties, bias or grammar mask: their processors need the row).  A vocab-sharded trunk
 * reduces each rank's slice and all-gathers one (value, id) pair per row and rank
 * (model_argmax_pick): a collective, so every rank of the group calls model_step_argmax
 * for that step (the others' ids are the same).  -ENOTSUP before anything runs where the
 * backend has no argmax op; for MTP also per-core halves (CPU) and plans scoring the
 * draft vocabulary (draft_sub): use the logits forms there. */
int model_step_argmax(struct model *m, const struct step_plan *p, int32_t *ids);
/* The sampled form of model_step (forward.h, step_topk): every trunk row reduced on the
 * backend to its k best (value, id) pairs (backend_argmax, k 1 .. BACKEND_ARGMAX_K_MAX),
 * ids and vals [rows, k]; where temps is not NULL, sums [rows] the rows' softmax mass at
 * temps[row] (backend_row_expsum; rows with temps[row] <= 0 get 0).  The pairs and sums
 * count in model_logits_host_bytes.  A vocab-sharded head reduces each rank's slice to k
 * pairs a row, all-gathers them and merges each row's (model_topk_merge): a collective, so
 * every rank calls it for that step with the same k, and without temps (-ENOTSUP with them).
 * -ENOTSUP before anything runs where the backend lacks an op (use model_step there). */
int model_step_topk(struct model *m, const struct step_plan *p, int k, const float *temps,
                    int32_t *ids, float *vals, double *sums);
int model_mtp_step_argmax(struct model *m, int k, const struct step_plan *p,
                          const int32_t *n_valid, const int32_t *tok_in, int32_t *ids);
/* The argmax of a row from its slices' argmaxes: candidate i has value vals[i] at global id
 * ids[i] (i < n, e.g. one per rank of a vocab-sharded head).  sampler_argmax's rules: the
 * largest value, on equal values (-0.0 equals +0.0) the lowest id; a NaN is never chosen;
 * 0 when every value is NaN (an all-NaN row).  Rank 0 of a sharded group picks its greedy
 * rows with it. */
int32_t model_argmax_pick(const float *vals, const int32_t *ids, int n);
/* The k best (value, global id) pairs of a row from W slices' k_each best each (list w at
 * vals/ids + w * k_each, in backend_argmax's order, id -1 past a slice's non-NaN
 * elements), in that order, into out_ids / out_vals [k] (k <= W * k_each): backend_argmax's
 * answer on the whole row. */
void model_topk_merge(const float *vals, const int32_t *ids, int W, int k_each, int k,
                      int32_t *out_ids, float *out_vals);
/* Bytes of logits the model copied to host memory since model_new (trunk and MTP rows,
 * draft-vocabulary rows at their width): 0 after only greedy forms. */
uint64_t model_logits_host_bytes(const struct model *m);

/* The draft vocabulary: ids[0 .. n) (distinct, in 0 .. vocab-1; n a multiple of 64 up to
 * the vocab) become the only tokens the MTP heads score when a plan sets draft_sub
 * (plan.h); the other ids get -inf draft logits.  The heads' rows of those ids are
 * gathered into weights of their own (the full heads stay), so a draft costs n / vocab
 * of the head.  Drafts are verified by the trunk, so outputs do not change; only how
 * many drafts are accepted.  n = 0 removes it.  Rank 0 (the MTP layers), between steps.
 * -EINVAL (bad ids, no MTP layers), -ENOMEM; on error the previous one stays. */
int model_set_draft_vocab(struct model *m, const int32_t *ids, int n, struct err_buf *e);

/* The model as a struct forward for the engine; it owns the model: f->ops->free(f)
 * frees both.  On error nothing is kept and e says why. */
int model_forward_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
                      const struct model_opts *opts, struct forward **ret, struct err_buf *e);
/* The model behind a forward built by model_forward_new (NULL for other forwards). */
struct model *model_from_forward(struct forward *f);

/* KV bytes of one block per group over the layers this model holds (as reserved). */
void model_kv_block_bytes(const struct model *m, int64_t ret[_KV_GROUP_MAX]);
/* Backend buffers reserved in model_new: activations (and scratch) and KV caches. */
void model_reserved_bytes(const struct model *m, int64_t *ret_activations, int64_t *ret_kv);

/* Read-only facts for drivers and tests. */
const struct model_config *model_config(const struct model *m);
int model_n_mtp(const struct model *m);        /* MTP layers loaded (0 on ranks > 0) */
/* Trunk steps run as per-core parts since model_new (model_step; model_opts.no_split). */
uint64_t model_split_steps(const struct model *m);
/* Dense MLPs that both parts of a split step computed together (row halves each). */
uint64_t model_coop_mlps(const struct model *m);
/* MTP layers run as per-core halves (2-thread CPU backend; model_opts.no_mtp_tp). */
bool model_mtp_halves(const struct model *m);
/* Last MTP depths (of halves) since model_new that took only each run's last row past the
 * KV store: no later depth reads that layer's other outputs, only its keys and values. */
uint64_t model_mtp_tails(const struct model *m);
/* MTP repair counters since model_new: positions re-run to erase draft inputs
 * (model_mtp_step), and positions that needed a re-run but could not get one (the layer
 * skipped a step of the sequence, or a re-run query's sliding-window blocks were already
 * released: keep window + n_mtp positions, as the engine's KV pool does).  Either may be
 * NULL. */
void model_mtp_repair_stats(const struct model *m, uint64_t *ret_rerun, uint64_t *ret_missed);

#ifdef __cplusplus
}
#endif
