/* plan.h - the step plan: what one engine step computes (docs/ARCHITECTURE.md §1, §6).
 *
 * Rank 0's scheduler builds a plan per step; the forward pass (worker/model/) executes
 * it; in a group, rank 0 broadcasts it (serialised with step_plan_pack) to ranks 1..N-1,
 * which execute it in lockstep.  Everything is ids and offsets, never pointers, so the
 * packed form crosses process boundaries.  A sequence contributes a run of consecutive
 * tokens: a prefill chunk, one decode token, or 1 + K tokens to verify K MTP drafts.
 *
 * KV addressing: two block groups, because sliding-window layers release blocks that fall
 * out of the window while full-attention layers keep all of theirs.  Logical block b of a
 * sequence covers positions [b*block_size, (b+1)*block_size).  -1 marks a released
 * (sliding) block.  MTP layers use the sliding group's tables (their layers are sliding in
 * Step-3.7; model.c maps a full-kind MTP layer to the full group).
 * A run with STEP_SEQ_NEW starts a new sequence in its slot (a new request, or one
 * preempted by recompute).  Its pos0 may be above 0: the positions before it are a prefix
 * the engine took from its prefix cache, complete in both groups and for the MTP layers
 * the sequence drafts with (worker/engine/kv.h).  A run at pos0 == 0 always starts anew.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kv_group {
    KV_GROUP_FULL,
    KV_GROUP_SLIDING,
    _KV_GROUP_MAX,
};

struct step_seq {
    int32_t slot;           /* engine sequence slot, 0 .. max_seqs-1 (stable for the request's life) */
    int32_t pos0;           /* absolute position of the first token of this run */
    int32_t n_tokens;       /* tokens in this run */
    int32_t n_logits;       /* trunk logits wanted for the LAST n_logits tokens of the run (0 = none) */
    int32_t tok_off;        /* offset of this run's token ids in step_plan.tokens */
    int32_t n_blocks;       /* logical blocks covering positions 0 .. pos0+n_tokens-1 */
    int32_t block_off[_KV_GROUP_MAX]; /* offset of this seq's table in step_plan.blocks[group] */
    int32_t mtp_depth;      /* MTP drafts to propose after this step (0 = none); rank 0 only */
    int32_t flags;          /* STEP_SEQ_* */
};

#define STEP_PLAN_IMG_NEXT 4   /* tok_in depths step_plan.img_row_next covers per seq */
#define STEP_PLAN_TOPK_K 64    /* candidates a row of a group's sampled step (plan.topk): every
                                  rank runs step_topk with this k (SAMPLER_CANDS_MAX) */
#define STEP_SEQ_NEW 1      /* the run starts a new sequence in its slot (see above) */
#define STEP_SEQ_FLAGS_KNOWN STEP_SEQ_NEW

struct step_plan {
    uint64_t step_id;
    int32_t n_seqs;
    int32_t n_tokens;       /* sum of n_tokens */
    struct step_seq *seqs;  /* [n_seqs] */
    int32_t *tokens;        /* [n_tokens] */
    int32_t n_block_ids[_KV_GROUP_MAX];
    int32_t *blocks[_KV_GROUP_MAX]; /* concatenated block tables per group */
    bool draft_sub;         /* rank 0 only, not on the wire: this step's MTP depths score
                               the installed draft vocabulary (forward.h set_draft_vocab) */
    bool argmax;            /* the step runs its greedy form (forward.h step_argmax): each
                               logits row reduced to its argmax where it was computed.  Set by
                               rank 0's group wrapper; on the wire as the message kind
                               (plan-wire.c), so that every rank of a vocab-sharded group
                               meets in the same collective (the argmax pairs' all-gather) */
    bool topk;              /* the step runs its sampled form (forward.h step_topk) with
                               STEP_PLAN_TOPK_K candidates a row and no sums: set by rank 0's
                               group wrapper, on the wire as the message kind STEP_TOPK, so
                               that every rank meets in the candidates' all-gather */
    /* image embeddings, rows of the text hidden (the vision encoder's output, rank 0's), and
     * per plan token the row it embeds as instead of its id's (img_row[t] in
     * 0 .. n_img_emb-1) or -1.  NULL: every token embeds its id.  On the wire (plan-wire.c,
     * version 2) with img_width, so every rank of a group splices the same rows. */
    const float *img_emb;
    const int32_t *img_row;     /* [n_tokens] */
    int32_t n_img_emb;
    int32_t img_width;          /* floats per img_emb row (the text hidden; the wire's) */
    /* with img_row: per seq the image row of the MTP chain's tok_in at depths
     * 0 .. STEP_PLAN_IMG_NEXT-1 (a prompt chunk's fills are the prompt tokens after its
     * run, which may be image tokens), or -1; NULL: all text.  On the wire too, though
     * only rank 0 runs the MTP layers: a follower's plan is rank 0's whole. */
    const int32_t *img_row_next;    /* [n_seqs * STEP_PLAN_IMG_NEXT] */
};

#ifdef __cplusplus
}
#endif
