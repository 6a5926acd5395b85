/* model-plan.c - the step plan as the forward reads it: the plan's checks and the index
 * arrays of a batch (token ids, positions, KV slots, runs).  Calls kernels/ only.
 */
#include <errno.h>

#include "model-int.h"

/* Physical block for (seq, group, logical block b), -1 if released. */
int32_t model__block_of(const struct step_plan *p, const struct step_seq *s, int g, int b)
{
    return p->blocks[g][s->block_off[g] + b];
}

/* The plan against the model's capacities and pools: a sentence in m->last_err and a
 * negative errno for the first thing wrong. */
int model__check_plan(struct model *m, const struct step_plan *p)
{
    int bs = m->o.block_size;

    if (!p || p->n_seqs <= 0 || p->n_seqs > m->o.max_seqs)
        return PLAN_ERR(m, -EINVAL, "plan: %d sequences (1 .. %d allowed)", p ? p->n_seqs : 0,
                        m->o.max_seqs);
    if (p->n_tokens <= 0 || p->n_tokens > m->o.max_tokens_per_step)
        return PLAN_ERR(m, p->n_tokens > 0 ? -E2BIG : -EINVAL,
                        "plan: %d tokens (1 .. %d reserved per step)", p->n_tokens,
                        m->o.max_tokens_per_step);
    if (!p->seqs || !p->tokens)
        return PLAN_ERR(m, -EINVAL, "plan: seqs or tokens missing");
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        if (!m->group_used[g])
            continue;
        if (p->n_block_ids[g] < 0 || p->n_block_ids[g] > m->table_cap)
            return PLAN_ERR(m, -E2BIG, "plan: %d block ids in group %d (capacity %d)",
                            p->n_block_ids[g], g, m->table_cap);
        if (p->n_block_ids[g] > 0 && !p->blocks[g])
            return PLAN_ERR(m, -EINVAL, "plan: block table of group %d missing", g);
    }
    int32_t sum = 0, n_rows = 0;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        int64_t end = (int64_t)s->pos0 + s->n_tokens;

        if (s->slot < 0 || s->slot >= m->o.max_seqs)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: slot %d out of range 0 .. %d", i, s->slot,
                            m->o.max_seqs - 1);
        if (s->n_tokens <= 0 || s->pos0 < 0 || end > m->o.max_seq_len)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: positions %d .. %lld outside 0 .. %d", i,
                            s->pos0, (long long)end - 1, m->o.max_seq_len - 1);
        if (s->tok_off < 0 || (int64_t)s->tok_off + s->n_tokens > p->n_tokens)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: tokens [%d, %d) outside the plan's %d", i,
                            s->tok_off, s->tok_off + s->n_tokens, p->n_tokens);
        if (s->n_logits < 0 || s->n_logits > s->n_tokens)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: n_logits %d with %d tokens", i, s->n_logits,
                            s->n_tokens);
        if (s->mtp_depth < 0)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: mtp_depth %d", i, s->mtp_depth);
        if (s->flags & ~STEP_SEQ_FLAGS_KNOWN)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: unknown flags 0x%x", i, (unsigned)s->flags);
        if ((int64_t)s->n_blocks * bs < end)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: %d blocks of %d do not cover position %lld",
                            i, s->n_blocks, bs, (long long)end - 1);
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            int first_needed;
            if (!m->group_used[g])
                continue;
            if (s->block_off[g] < 0 || (int64_t)s->block_off[g] + s->n_blocks > p->n_block_ids[g])
                return PLAN_ERR(m, -EINVAL, "plan seq %d: block table [%d, +%d) outside group %d's %d ids",
                                i, s->block_off[g], s->n_blocks, g, p->n_block_ids[g]);
            /* blocks attention may read: full = all, sliding = the window of the first query */
            first_needed = 0;
            if (g == KV_GROUP_SLIDING && m->cfg->sliding_window > 0) {
                int lo = s->pos0 - m->cfg->sliding_window + 1;
                first_needed = lo > 0 ? lo / bs : 0;
            }
            for (int b = first_needed; b <= (int)((end - 1) / bs); b++) {
                int32_t id = model__block_of(p, s, g, b);
                if (id < 0 || id >= m->o.n_blocks[g])
                    return PLAN_ERR(m, -EINVAL, "plan seq %d: group %d logical block %d -> %d "
                                    "(pool has %d blocks)", i, g, b, id, m->o.n_blocks[g]);
            }
        }
        sum += s->n_tokens;
        n_rows += s->n_logits;
    }
    if (sum != p->n_tokens)
        return PLAN_ERR(m, -EINVAL, "plan: runs hold %d tokens, plan says %d", sum, p->n_tokens);
    /* attention takes runs as [start[s], start[s+1]): contiguous, in plan order */
    for (int i = 0; i < p->n_seqs; i++) {
        int32_t start = i ? p->seqs[i - 1].tok_off + p->seqs[i - 1].n_tokens : 0;
        if (p->seqs[i].tok_off != start)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: run starts at token %d, expected %d (runs "
                            "must be contiguous in plan order)", i, p->seqs[i].tok_off, start);
    }
    if (n_rows > m->max_logit_rows)
        return PLAN_ERR(m, -E2BIG, "plan: %d logit rows (%d reserved per step)", n_rows,
                        m->max_logit_rows);
    for (int t = 0; t < p->n_tokens; t++)
        if (p->tokens[t] < 0 || p->tokens[t] >= m->vocab)
            return PLAN_ERR(m, -EINVAL, "plan: token %d at index %d outside the vocab (%d)",
                            p->tokens[t], t, m->vocab);
    if (!p->img_emb != !p->img_row || (p->img_row_next && !p->img_row))
        return PLAN_ERR(m, -EINVAL, "plan: image rows without their index (or the reverse)");
    for (int t = 0; p->img_row_next && t < p->n_seqs * STEP_PLAN_IMG_NEXT; t++)
        if (p->img_row_next[t] < -1 || p->img_row_next[t] >= p->n_img_emb)
            return PLAN_ERR(m, -EINVAL, "plan seq %d: MTP input %d takes image row %d of %d",
                            t / STEP_PLAN_IMG_NEXT, t % STEP_PLAN_IMG_NEXT, p->img_row_next[t],
                            p->n_img_emb);
    if (p->img_row && p->img_width && p->img_width != m->hidden)
        return PLAN_ERR(m, -EINVAL, "plan: image rows of width %d, the model's hidden size is %d",
                        p->img_width, m->hidden);
    for (int t = 0; p->img_row && t < p->n_tokens; t++)
        if (p->img_row[t] < -1 || p->img_row[t] >= p->n_img_emb)
            return PLAN_ERR(m, -EINVAL, "plan: token %d takes image row %d of %d image embeddings",
                            t, p->img_row[t], p->n_img_emb);
    return 0;
}

/* Slot of position pos of seq s in group g (blocks already checked). */
int32_t model__slot_of(const struct model *m, const struct step_plan *p,
                       const struct step_seq *s, int g, int32_t pos)
{
    int bs = m->o.block_size;
    return model__block_of(p, s, g, pos / bs) * bs + pos % bs;
}

/* Point a batch at the host index arrays (filled for n_tok tokens / n_seqs runs) and the
 * plan's block tables. */
void model__batch_fill(const struct model *m, struct batch *b, const struct step_plan *p,
                       int n_tok, int n_seqs)
{
    *b = (struct batch){ .n_tok = n_tok, .n_seqs = n_seqs };
    b->ids = m->h_ids;
    b->pos = m->h_pos;
    b->seq_start = m->h_seq_start;
    b->seq_pos0 = m->h_seq_pos0;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        b->slots[g] = m->h_slots[g];
        b->boff[g] = m->h_boff[g];
        b->tables[g] = p->blocks[g];
    }
}

/* The trunk step's batch: the index arrays of every plan token (ids, positions, KV slots
 * per group, runs, table offsets) and in m->h_rows the rows that want logits; returns
 * their count. */
int model__trunk_batch(struct model *m, const struct step_plan *p, struct batch *b)
{
    int n_rows = 0;

    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];

        m->h_seq_start[i] = s->tok_off;
        m->h_seq_pos0[i] = s->pos0;
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            m->h_boff[g][i] = s->block_off[g];
        for (int t = 0; t < s->n_tokens; t++) {
            int j = s->tok_off + t;
            m->h_ids[j] = p->tokens[j];
            m->h_pos[j] = s->pos0 + t;
            for (int g = 0; g < _KV_GROUP_MAX; g++)
                if (m->group_used[g])
                    m->h_slots[g][j] = model__slot_of(m, p, s, g, s->pos0 + t);
        }
        for (int t = s->n_tokens - s->n_logits; t < s->n_tokens; t++)
            m->h_rows[n_rows++] = s->tok_off + t;
    }
    m->h_seq_start[p->n_seqs] = p->n_tokens;
    model__batch_fill(m, b, p, p->n_tokens, p->n_seqs);
    b->img_emb = p->img_emb;        /* the trunk's embedding takes image rows */
    b->img_row = p->img_row;
    return n_rows;
}
