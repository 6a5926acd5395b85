/* spec.h - MTP speculative decoding on rank 0 (docs/ARCHITECTURE.md §6, docs/MODEL.md §3.2).
 *
 * After a trunk step the engine asks spec_propose() for up to K drafts per sequence:
 * it chains forward_ops.mtp_step over depths 0 .. K-1 (layer 45 + k), picking each draft
 * from the depth's logits with the request's own processors (greedy: processed argmax;
 * sampled: a seeded draw whose distribution q is kept for verification).  The next step
 * scores [last token, d1 .. dK] in one trunk pass; spec_verify() then accepts the longest
 * prefix matching the target argmax (greedy) or runs rejection sampling (sampled), so
 * output is distributed exactly as without speculation, and greedy output is identical.
 *
 * Prompt chunks that stop short of the last known token also run the chain (fill_only)
 * with the known prompt tokens as inputs, so the MTP layers' KV covers every position.
 * No trace of rejected drafts: MTP layer k >= 1 writes its last k positions with draft
 * tokens among its shifted inputs (and layer k-1 outputs computed from them).  The
 * forward repairs this itself (model.h, model_mtp_step): at the next step layer k first
 * re-runs those of positions pos0-k .. pos0-1 whose inputs changed (from the earliest on)
 * with the now-known tokens and layer k-1's corrected outputs, then runs the new
 * positions, so after every step the MTP caches equal those of a fresh prefill of the
 * accepted history (test/model/test-mtp-repair).  Nothing extra is passed: the true
 * tokens are this step's run and tok_in; the forward keeps each slot's last n_mtp layer
 * ids and outputs and restarts a slot's history with each new sequence (STEP_SEQ_NEW).  The
 * engine's KV pool keeps n_mtp positions beyond the sliding window for those re-run
 * queries, and reuses cached prefixes only where the MTP layers' KV is final (kv.h).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "err.h"
#include "forward.h"
#include "sampler.h"
#include "specconf.h"

#ifdef __cplusplus
extern "C" {
#endif

struct spec_stats {
    uint64_t n_drafts;                       /* verification steps that carried drafts */
    uint64_t n_draft_tokens;
    uint64_t n_accepted;
    uint64_t accepted_per_pos[SPEC_MAX_K];   /* [k] = drafts accepted at position k */
    uint64_t steps_by_drafts[SPEC_MAX_K + 1];/* [k] = decode steps that verified k drafts
                                                (the depth actually used; k = 0: none) */
};

/* One sequence's state in the draft policy (spec-policy.h): decayed counts of the drafts
 * tried and accepted at each position (all, and those drafted while the MTP layers' caches
 * were complete over their window), and how many positions each MTP layer has written in
 * a row (0 after a step that did not run it). */
struct spec_accept {
    float tried[SPEC_MAX_K], hit[SPEC_MAX_K];
    float tried_c[SPEC_MAX_K], hit_c[SPEC_MAX_K];
    int32_t covered[SPEC_MAX_K];
    int32_t pos;                  /* positions known to the sequence's MTP chain */
};

struct spec_policy;

void spec_stats_add(struct spec_stats *dst, const struct spec_stats *src);
/* Mean tokens emitted per verification step: 1 + accepted / drafts (1 when no drafts). */
double spec_stats_mean_accept_len(const struct spec_stats *st);

/* One sequence's view for propose/verify.  hist.tokens must have room for SPEC_MAX_K
 * tokens after hist.n_prompt + hist.n_output (drafts are appended there temporarily). */
struct spec_seq {
    const struct sampling_params *sp;
    struct sampler_hist hist;
    uint64_t out_index;       /* output index of the token the drafts follow (next one) */
    int depth;                /* drafts wanted (0 = skip); set by the caller */
    int32_t *drafts;          /* [SPEC_MAX_K] out */
    float *q;                 /* [SPEC_MAX_K * vocab] draft distributions (sampled only) */
    /* prefill chunk that does not reach the end: the chain only (re)writes the MTP
     * layers' KV over the chunk; the input at depth k >= 1 is forced[k-1] while
     * k-1 < n_forced (the known prompt tokens), drafts are raw argmaxes and are not
     * kept, and hist is not touched. */
    bool fill_only;
    const int32_t *forced;
    int n_forced;
    struct spec_accept *acc;  /* the sequence's acceptance counts (NULL: none) */
    int verified, accepted;   /* out of spec_verify: drafts verified, accepted */
    /* structured output (grammar.h; NULL: none): spec_verify draws every token under the
     * matcher's mask after the drafts accepted before it, checks each draft against the
     * grammar (a forbidden draft is rejected), and leaves the matcher advanced by the
     * accepted drafts and the token that follows them; spec_propose drafts under the mask
     * too (the matcher is returned to its state afterwards) */
    struct grammar_matcher *gm;
    int gm_drafted;           /* spec_propose: drafts the matcher follows (0 after it) */
    /* the draft policy leaves depth as the caller set it: a sampled sequence with the
     * client's seed, whose tokens depend on the drafts they were verified against (a seed
     * must give the same tokens whatever the machine's load); every other sequence's
     * output does not (greedy: identical; a drawn seed: the target's distribution) */
    bool keep_depth;
};

/* Run the MTP chain for the plan's sequences (seqs[i] pairs with plan->seqs[i]; depth
 * also written to plan->seqs[i].mtp_depth by the caller).  n_valid/tok_in as in
 * forward.h (tok_in[i] is already the last token of seqs[i].hist).  logits_buf holds
 * n_seqs * vocab floats, tok_scratch n_seqs ids.  ids_buf (n_seqs ids; NULL: never): when
 * every drafting sequence drafts the raw argmax (fill_only, or sampler_takes_argmax and no
 * grammar) and the forward offers mtp_step_argmax, the chain runs that instead and no
 * logits row is copied; a depth it refuses (-ENOTSUP) runs mtp_step, and so do the rest.
 * Each depth's cost goes to pol (spec_policy_draft_cost; NULL: nowhere).  Returns 0 or
 * the forward's error. */
int spec_propose(struct forward *f, struct sampler *smp, const struct step_plan *plan,
                 struct spec_seq *seqs, const int32_t *n_valid, const int32_t *tok_in,
                 float *logits_buf, int32_t *tok_scratch, int32_t *ids_buf,
                 struct spec_policy *pol);

/* Verify n_draft drafts of one sequence against its target rows (n_draft + 1 rows of
 * raw trunk logits, row i following draft i-1).  Writes the accepted count to the
 * return value (and seq->accepted, with seq->verified = n_draft) and the token after them
 * to *ret_next; updates st.  probs_buf holds
 * (SPEC_MAX_K + 2) * vocab floats of scratch. */
int spec_verify(struct sampler *smp, struct spec_seq *seq, const float *rows, int n_draft,
                int vocab, float *probs_buf, struct spec_stats *st, int32_t *ret_next);
/* spec_verify of a sequence whose token at every row is the row's raw argmax
 * (sampler_takes_argmax at hist.n_output, no grammar): ids[0 .. n_draft] are the rows'
 * argmaxes (forward.h, step_argmax).  The same result as spec_verify on the rows. */
/* spec_verify of a sampled sequence without drafts (n_draft 0) whose token
 * sampler_takes_cands, no grammar: from its row's candidates c (forward.h, step_topk).  The
 * same token as spec_verify on the row (sampler_sample_cands). */
int spec_verify_cands(struct spec_seq *seq, const struct sampler_cands *c, int n_draft,
                      struct spec_stats *st, int32_t *ret_next);
int spec_verify_ids(struct spec_seq *seq, const int32_t *ids, int n_draft, struct spec_stats *st,
                    int32_t *ret_next);

#ifdef __cplusplus
}
#endif
