/* forward.h - what the engine needs from a forward pass: the real model (model.c) and
 * the mock (mock.c, deterministic fake logits with a configurable step time) both
 * implement struct forward_ops, so scheduling and fault tests run without weights.
 *
 * Protocol per engine step (rank 0):
 *   1. step(plan, logits): run the trunk over every run of the plan; write trunk logits
 *      for the last n_logits tokens of each run, rows in plan order, [rows, vocab] FP32.
 *      The trunk's pre-final-norm hidden states of this step are kept inside the forward
 *      for step 2.  KV entries are written for every token of the plan.
 *   2. After the engine has decided what is accepted (verify) and sampled the next token,
 *      for seqs with mtp_depth > 0, for k = 0 .. depth-1:
 *        mtp_step(k, plan, n_valid, tok_in, logits_k)
 *      n_valid[s]  = how many leading tokens of seq s's run are accepted (their trunk
 *                    hidden states feed MTP layer 0 at those same positions);
 *      tok_in[s]   = the token appended after them at depth k (k = 0: the newly sampled
 *                    token; k > 0: the draft chosen from the previous depth's logits);
 *      logits_k    = [n_seqs, vocab] draft logits from the last valid position, rows in
 *                    plan order (rows of seqs with mtp_depth <= k are left untouched).
 *      MTP layer k runs over positions pos0 .. pos0+n_valid-1 of the run with input ids
 *      shifted left by k+1 (docs/MODEL.md §3.2); its KV at those positions is (re)written.
 *      n_valid must be the same at every depth of a step.
 * No trace of rejected drafts: KV of rejected trunk positions is simply overwritten by
 * later steps (attention never reads a position beyond the query's own).  MTP layer k's
 * last k positions of a step were computed from drafts (tok_in of depths >= 1); a
 * forward must rewrite them at the next step once the true tokens are known (the real
 * model re-runs the changed ones of positions pos0-k .. pos0-1 at depth k, see model.h;
 * the mock has no KV).
 * So the engine keeps its sliding KV blocks n_mtp positions beyond the window, and a
 * run flagged STEP_SEQ_NEW (or at pos0 == 0) starts a new sequence in its slot (new
 * request, recompute): pos0 > 0 then means the positions before it come from the prefix
 * cache, MTP layers included, final (no draft among their inputs), so the forward must
 * start the slot's MTP history at pos0 with nothing to repair.
 */
#pragma once

#include <stdint.h>

#include "err.h"
#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

struct forward;

struct forward_ops {
    const char *name;
    int (*step)(struct forward *f, const struct step_plan *p, float *logits);
    int (*mtp_step)(struct forward *f, int k, const struct step_plan *p, const int32_t *n_valid,
                    const int32_t *tok_in, float *logits);
    void (*free)(struct forward *f);
    /* Optional (NULL: not offered): install the draft vocabulary ids[0 .. n) that MTP
     * steps of plans with draft_sub score instead of the whole vocabulary (model.h,
     * model_set_draft_vocab); n = 0 removes it.  Between steps, engine thread. */
    int (*set_draft_vocab)(struct forward *f, const int32_t *ids, int n, struct err_buf *e);
    /* Optional (NULL: not offered): the greedy forms of step and mtp_step (model.h,
     * model_step_argmax): the same step, with every logits row reduced where it was computed
     * to its argmax (the lowest id of the largest logit, NaN never: sampler_argmax), so ids
     * [rows] (plan order) / ids [n_seqs] (seqs with mtp_depth <= k untouched) reach the
     * caller and no row is copied.  -ENOTSUP before anything runs where the forward cannot
     * (the rows are not whole there): the caller runs step / mtp_step instead.  For rows
     * whose token is their raw argmax only (sampler_takes_argmax, no logprobs, no grammar). */
    int (*step_argmax)(struct forward *f, const struct step_plan *p, int32_t *ids);
    int (*mtp_step_argmax)(struct forward *f, int k, const struct step_plan *p,
                           const int32_t *n_valid, const int32_t *tok_in, int32_t *ids);
    /* Optional (NULL: not offered): the sampled form of step (model.h, model_step_topk):
     * every logits row reduced where it was computed to its k best (value, id) pairs, in
     * backend_argmax's order (place 0 is step_argmax's id), ids and vals [rows, k] (plan
     * order); where temps is not NULL, sums [rows] each row's softmax mass at temps[row]
     * (worker/engine/sampler.h, sampler_cands.sum; 0 where temps[row] <= 0).  -ENOTSUP
     * before anything runs where the forward cannot (with temps: perhaps only with them).
     * For rows whose token sampler_takes_cands (no logprobs, no grammar). */
    int (*step_topk)(struct forward *f, const struct step_plan *p, int k, const float *temps,
                     int32_t *ids, float *vals, double *sums);
};

struct forward {
    const struct forward_ops *ops;
    int vocab_size;         /* logits row length */
    int n_mtp;              /* MTP layers available (0 = no speculation) */
    int max_tokens_per_step;/* capacity reserved at start-up */
    int max_seqs;
    int block_size;
    int n_blocks[2];        /* KV blocks per group (enum kv_group) */
    unsigned mtp_kv_groups; /* bit g set: some MTP layer keeps its KV in group g (whose
                               cached blocks must then hold final MTP KV to be reused) */
    void *impl;
};

#ifdef __cplusplus
}
#endif
