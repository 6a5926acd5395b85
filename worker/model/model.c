/* model.c - the Step forward pass as a readable script over the backend ops: the plan's
 * index arrays, one decoder layer (layer_forward, docs/MODEL.md §2.3) and the trunk step (§2).
 * Weights and memory are model-load.c's, the MTP step model-mtp.c's, the per-core parts of
 * a CPU step model-split.c's (model-int.h has the map).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-int.h"

/* ----------------------------------------------------------- plan checks -- */


/* Physical block for (seq, group, logical block b), -1 if released. */
int32_t model__block_of(const struct step_plan *p, const struct step_seq *s, int g, int b)
{
    return p->blocks[g][s->block_off[g] + b];
}

static int check_plan(struct model *m, const struct step_plan *p)
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

/* dst[dst_rows[i]] <- src[src_rows[i]] for i < n, rows of H floats in backend buffers
 * (NULL row list = rows 0..n-1), through the host bounce buffer; runs of consecutive rows
 * move in one transfer. */
int model__copy_rows(struct model *m, float *dst, const int32_t *dst_rows, const float *src,
                     const int32_t *src_rows, int n)
{
    size_t H = (size_t)m->hidden;
    int r = backend_copy_rows(m->be, dst, dst_rows, src, src_rows, n, sizeof(float) * H);

    if (r != -ENOSYS)
        return r;       /* on the device (GPU backends) */
    r = 0;

    for (int i = 0, j; i < n && !r; i = j) {
        int32_t s0 = src_rows ? src_rows[i] : i;
        for (j = i + 1; j < n && (src_rows ? src_rows[j] : j) == s0 + (j - i); j++)
            ;
        r = backend_download(m->be, m->bounce + (size_t)i * H, src + (size_t)s0 * H,
                             sizeof(float) * H * (size_t)(j - i));
    }
    r = r ? r : backend_sync(m->be);
    for (int i = 0, j; i < n && !r; i = j) {
        int32_t d0 = dst_rows ? dst_rows[i] : i;
        for (j = i + 1; j < n && (dst_rows ? dst_rows[j] : j) == d0 + (j - i); j++)
            ;
        r = backend_upload(m->be, dst + (size_t)d0 * H, m->bounce + (size_t)i * H,
                           sizeof(float) * H * (size_t)(j - i));
    }
    return r;
}

/* ---------------------------------------------------------- collectives -- */

static int allreduce(struct model *m, float *buf, size_t n)
{
    if (!m->sharded)
        return 0;
    return m->comm.allreduce_sum(m->comm.ctx, buf, n);
}

/* ------------------------------------------------------------ the script -- */

/* FFN with SwiGLU: out = down(act(gate(x), up(x))). */
static int swiglu_mlp(struct model *m, const struct mlayer *L, const float *x, int n, float limit,
                      float *out)
{
    int r;

    TRY(backend_matmul(m->be, &L->gate, x, n, m->ff_gate));
    TRY(backend_matmul(m->be, &L->up, x, n, m->ff_up));
    TRY(backend_swiglu(m->be, m->ff_gate, m->ff_up, n, L->inter, limit, m->ff_act));
    return backend_matmul(m->be, &L->down, m->ff_act, n, out);
}

/* The dense MLP of the batch: with the other part of a split step where they share it
 * (struct batch_hooks), else swiglu_mlp. */
static int dense_mlp(struct model *m, const struct mlayer *L, const struct batch *b, const float *x,
                     float limit, float *out)
{
    if (b->hooks) {
        int r = b->hooks->dense_mlp(b->hooks->ctx, m, L, x, b->n_tok, limit, out);

        if (r != 0)
            return r < 0 ? r : 0;
    }
    return swiglu_mlp(m, L, x, b->n_tok, limit, out);
}

/* The keys and values of layer L for the batch's rows, from their normed inputs m->a:
 * projected, normed, rotated and stored in L's cache at the rows' slots. */
int model__layer_kv(struct model *m, struct mlayer *L, const struct batch *b)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, hd = L->head_dim;
    int r;

    TRY(backend_matmul(m->be, &L->wk, m->a, n, m->k));
    TRY(backend_matmul(m->be, &L->wv, m->a, n, m->v));
    if (cfg->use_qk_norm)
        TRY(backend_rmsnorm(m->be, m->k, &L->k_norm, n * L->n_kv_heads, hd, cfg->rms_norm_eps, m->k));
    if (L->freqs.rotary_dims > 0)
        TRY(backend_rope(m->be, m->k, n, L->n_kv_heads, hd, b->pos, &L->freqs));
    TRY(backend_kv_store(m->be, &L->kv, m->k, m->v, n, b->slots[L->group]));
    if (b->hooks)
        b->hooks->kv_stored(b->hooks->ctx);
    return 0;
}

int model__step_inputs(struct model *m, const struct batch *b, const struct step_plan *p,
                       bool graph)
{
    struct backend_step st = {
        .n_tok = b->n_tok, .n_seqs = b->n_seqs, .ids = b->ids, .pos = b->pos,
        .seq_start = b->seq_start, .seq_pos0 = b->seq_pos0, .graph = graph,
    };

    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        if (!m->group_used[g])
            continue;
        st.slots[g] = b->slots[g];
        st.boff[g] = b->boff[g];
        st.tables[g] = b->tables[g];
        st.n_table[g] = p->n_block_ids[g];
    }
    for (int i = 0; i < b->n_seqs; i++) {
        int len = b->seq_start[i + 1] - b->seq_start[i];
        st.max_run = len > st.max_run ? len : st.max_run;
    }
    return backend_step_begin(m->be, &st);
}

/* The two halves of layer L fused on the backend (backend.h attn_block / ffn_block: the
 * same script as below, BF16 inside); -ENOTSUP before any work when the backend cannot
 * run this shape, and the script runs instead. */
static int attn_fused(struct model *m, struct mlayer *L, float *x, const struct batch *b,
                      bool reduce)
{
    const struct model_config *cfg = m->cfg;
    size_t nh = (size_t)b->n_tok * m->hidden;
    int g = L->group, r;
    struct attn_block_args aa = {
        .x = x, .out = reduce ? m->tmp : NULL, .n_tok = b->n_tok, .hidden = m->hidden,
        .n_heads = L->n_heads, .n_kv_heads = L->n_kv_heads, .head_dim = L->head_dim,
        .eps = cfg->rms_norm_eps, .scale = 1.0f / sqrtf((float)L->head_dim), .w = &L->aw,
        .freqs = L->freqs.rotary_dims > 0 ? &L->freqs : NULL, .pos = b->pos,
        .slots = b->slots[g], .kv = &L->kv, .window = L->window, .n_seqs = b->n_seqs,
        .seq_tok_start = b->seq_start, .seq_pos0 = b->seq_pos0, .block_tables = b->tables[g],
        .block_table_off = b->boff[g],
    };

    TRY(backend_attn_block(m->be, &aa));
    if (reduce) {
        TRY(allreduce(m, m->tmp, nh));                             /* [all-reduce 1] */
        TRY(backend_add(m->be, x, m->tmp, nh));
    }
    return 0;
}

static int ffn_fused(struct model *m, struct mlayer *L, float *x, const struct batch *b,
                     bool reduce)
{
    const struct model_config *cfg = m->cfg;
    size_t nh = (size_t)b->n_tok * m->hidden;
    int r;
    struct ffn_block_args fa = {
        .x = x, .out = reduce ? m->tmp : NULL, .n_tok = b->n_tok, .hidden = m->hidden,
        .eps = cfg->rms_norm_eps, .limit_dense = L->limit_shared, .limit_routed = L->limit_routed,
        .route_scale = cfg->router_scaling_factor, .top_k = cfg->top_k,
        .renorm = cfg->norm_expert_weight, .w = &L->fw,
    };

    TRY(backend_ffn_block(m->be, &fa));
    if (reduce) {
        TRY(allreduce(m, m->tmp, nh));                             /* [all-reduce 2] */
        TRY(backend_add(m->be, x, m->tmp, nh));
    }
    return 0;
}

/* The attention half of a decoder layer: x += o_proj(attention(norm(x))), reduced over
 * the ranks where the layer is sharded.  A backend with fused layer halves runs it as one
 * call (backend_attn_block) unless the step runs as per-core parts. */
static int attention_half(struct model *m, struct mlayer *L, float *x, const struct batch *b,
                          bool reduce)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, H = m->hidden, hd = L->head_dim;
    int g = L->group;
    float eps = cfg->rms_norm_eps;
    int r;

    if (L->blocks && !b->hooks) {
        r = attn_fused(m, L, x, b, reduce);
        if (r != -ENOTSUP)
            return r;
    }
    TRY(backend_rmsnorm(m->be, x, &L->in_norm, n, H, eps, m->a));
    TRY(model__layer_kv(m, L, b));
    TRY(backend_matmul(m->be, &L->wq, m->a, n, m->q));
    if (cfg->use_head_wise_attn_gate)
        TRY(backend_matmul(m->be, &L->wg, m->a, n, m->g));
    if (cfg->use_qk_norm)
        TRY(backend_rmsnorm(m->be, m->q, &L->q_norm, n * L->n_heads, hd, eps, m->q));
    if (L->freqs.rotary_dims > 0)
        TRY(backend_rope(m->be, m->q, n, L->n_heads, hd, b->pos, &L->freqs));
    if (b->hooks)
        TRY(b->hooks->attention_wait(b->hooks->ctx));

    struct attn_args aa = {
        .q = m->q,
        .out = m->att,
        .n_tok = n,
        .n_heads = L->n_heads,
        .n_kv_heads = L->n_kv_heads,
        .head_dim = hd,
        .scale = 1.0f / sqrtf((float)hd),
        .window = L->window,
        .kv = &L->kv,
        .n_seqs = b->n_seqs,
        .seq_tok_start = b->seq_start,
        .seq_pos0 = b->seq_pos0,
        .block_tables = b->tables[g],
        .block_table_off = b->boff[g],
    };
    TRY(backend_attention(m->be, &aa));
    if (cfg->use_head_wise_attn_gate)
        TRY(backend_head_gate(m->be, m->att, m->g, n, L->n_heads, hd));
    TRY(backend_matmul(m->be, &L->wo, m->att, n, m->tmp));
    if (reduce)
        TRY(allreduce(m, m->tmp, (size_t)n * H));                  /* [all-reduce 1] */
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* The FFN half: x += FFN(norm(x)) - the routed experts and the shared expert of a MoE layer,
 * the dense MLP otherwise - reduced over the ranks where the layer is sharded. */
static int ffn_half(struct model *m, struct mlayer *L, float *x, const struct batch *b, bool reduce)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, H = m->hidden;
    float eps = cfg->rms_norm_eps;
    int r;

    if (L->blocks && !b->hooks) {
        r = ffn_fused(m, L, x, b, reduce);
        if (r != -ENOTSUP)
            return r;
    }
    TRY(backend_rmsnorm(m->be, x, &L->post_norm, n, H, eps, m->a));
    if (L->is_moe) {
        TRY(backend_matmul(m->be, &L->router, m->a, n, m->rlogits));
        TRY(backend_router(m->be, m->rlogits, L->router_bias, n, cfg->n_experts, cfg->top_k,
                           cfg->norm_expert_weight, cfg->router_scaling_factor, m->rids,
                           m->rweights));
        if (L->has_ffn_dense)
            TRY(swiglu_mlp(m, L, m->a, n, L->limit_shared, m->tmp));   /* shared expert */
        else
            TRY(backend_upload(m->be, m->tmp, m->zeros, sizeof(float) * (size_t)n * H));
        struct moe_args ma = {
            .x = m->a,
            .out = m->tmp,
            .n_tok = n,
            .hidden = H,
            .inter = cfg->moe_intermediate_size,
            .top_k = cfg->top_k,
            .ids = m->rids,
            .weights = m->rweights,
            .experts = L->experts,
            .expert_first = L->expert_first,
            .n_local = L->n_local,
            .limit = L->limit_routed,
        };
        TRY(backend_moe(m->be, &ma));                                  /* routed experts */
    } else {
        TRY(dense_mlp(m, L, b, m->a, L->limit_shared, m->tmp));        /* dense MLP */
    }
    if (reduce)
        TRY(allreduce(m, m->tmp, (size_t)n * H));                  /* [all-reduce 2] */
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* One decoder layer (docs/MODEL.md §2.3) over the batch, in place on the residual x [n, H].
 * Trunk layers reduce over ranks at the two marked points; MTP layers are unsharded. */
int model__layer_forward(struct model *m, struct mlayer *L, float *x, const struct batch *b)
{
    bool reduce = m->sharded && !L->is_mtp;
    int r;

    TRY(attention_half(m, L, x, b, reduce));
    return ffn_half(m, L, x, b, reduce);
}

/* logits[rows, vocab] = lm_head · final_norm(hid[rows]), gathered over the vocab slices. */
static int trunk_logits(struct model *m, const int32_t *rows, int n_rows, float *logits)
{
    int H = m->hidden, V = m->vocab, Vl = m->vocab_local;
    int r;

    TRY(model__copy_rows(m, m->rows_h, NULL, m->hid, rows, n_rows));
    TRY(backend_rmsnorm(m->be, m->rows_h, &m->final_norm, n_rows, H, m->cfg->rms_norm_eps,
                        m->rows_h));
    TRY(backend_matmul(m->be, &m->lm_head, m->rows_h, n_rows, m->rows_logits));
    if (!m->sharded) {
        if (logits)
            TRY(backend_download(m->be, logits, m->rows_logits,
                                 sizeof(float) * (size_t)n_rows * (size_t)V));
        return 0;
    }
    /* [all-gather]: gather[w] = rank w's [n_rows, Vl]; row i = concat over w */
    TRY(m->comm.allgather(m->comm.ctx, m->rows_logits, m->gather, (size_t)n_rows * Vl));
    if (!logits)
        return 0;
    for (int w = 0; w < m->comm.world; w++)
        for (int i = 0; i < n_rows; i++)
            TRY(backend_download(m->be, logits + (size_t)i * V + (size_t)w * Vl,
                                 m->gather + ((size_t)w * n_rows + i) * Vl, sizeof(float) * (size_t)Vl));
    return 0;
}

/* The trunk step (forward.h protocol step 1). */
int model_step(struct model *m, const struct step_plan *p, float *logits)
{
    int n_rows = 0, r;

    m->have_step = false;
    r = check_plan(m, p);
    if (r < 0)
        return r;

    /* index arrays: token ids, positions, KV slots per group, runs, table offsets */
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        /* a new sequence in the slot (new request, preemption by recompute, a prefix-cache
         * hit; forward.h): the MTP layers' history of the slot's previous one is void, and
         * the positions before pos0 hold final KV, so the history starts at pos0 with
         * nothing to re-run */
        if (s->pos0 == 0 || (s->flags & STEP_SEQ_NEW))
            for (int j = 0; j < m->n_mtp; j++) {
                m->mtp_end[(size_t)s->slot * m->n_mtp + j] = s->pos0;
                m->mtp_lo[(size_t)s->slot * m->n_mtp + j] = s->pos0;
            }
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
    struct batch b;
    model__batch_fill(m, &b, p, p->n_tokens, p->n_seqs);

    /* the script: the residual stream lives in hid, which keeps the pre-final-norm hidden
     * states for the logits and for MTP depth 0 */
    struct split_cut cut;
    if (model__split_choose(m, &b, &cut)) {
        r = model__split_layers(m, &b, &cut, NULL);
    } else {
        /* GPU backends: the inputs in one transfer, the layers as a graph where the step's
         * shape has one (a failed capture leaves graphs off: the layers run again) */
        r = model__step_inputs(m, &b, p, true);
        for (int tries = 0; r >= 0 && tries < 2; tries++) {
            int replay = backend_capture_begin(m->be), r2;

            r = replay;
            if (replay == 0) {
                r = backend_embed(m->be, &m->embed, b.ids, p->n_tokens, m->hid);
                for (int l = 0; l < m->n_layers && r >= 0; l++)
                    r = model__layer_forward(m, &m->layers[l], m->hid, &b);
            }
            r2 = replay < 0 ? 0 : backend_capture_end(m->be, r >= 0);
            if (r2 != -EAGAIN) {
                r = r < 0 ? r : r2;
                break;
            }
            r = 0;
        }
    }
    if (r < 0)
        return PLAN_ERR(m, r, "step: forward failed: %s", err_str(r));
    if (n_rows > 0) {
        r = trunk_logits(m, m->h_rows, n_rows, logits);
        if (r < 0)
            return PLAN_ERR(m, r, "step: logits failed: %s", err_str(r));
    }
    r = backend_sync(m->be);
    if (r < 0)
        return PLAN_ERR(m, r, "step: backend sync failed: %s", err_str(r));

    m->have_step = true;
    m->last_step_id = p->step_id;
    m->last_n_tokens = p->n_tokens;
    m->last_n_seqs = p->n_seqs;
    m->mtp_next_k = 0;
    return 0;
}

const char *model_last_error(const struct model *m)
{
    return m->last_err.msg;
}

const struct model_config *model_config(const struct model *m)
{
    return m->cfg;
}

int model_vocab_size(const struct model *m)
{
    return m->vocab;
}

int model_n_mtp(const struct model *m)
{
    return m->n_mtp;
}

/* ------------------------------------------------------------- forward -- */

static int fwd_step(struct forward *f, const struct step_plan *p, float *logits)
{
    return model_step(f->impl, p, logits);
}

static int fwd_mtp_step(struct forward *f, int k, const struct step_plan *p, const int32_t *n_valid,
                        const int32_t *tok_in, float *logits)
{
    return model_mtp_step(f->impl, k, p, n_valid, tok_in, logits);
}

static void fwd_free(struct forward *f)
{
    if (f)
        model_free(f->impl);
}

static int fwd_set_draft_vocab(struct forward *f, const int32_t *ids, int n, struct err_buf *e)
{
    return model_set_draft_vocab(f->impl, ids, n, e);
}

const struct forward_ops model__forward_ops = {
    .name = "model",
    .step = fwd_step,
    .mtp_step = fwd_mtp_step,
    .free = fwd_free,
    .set_draft_vocab = fwd_set_draft_vocab,
};

int model_forward_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
                      const struct model_opts *opts, struct forward **ret, struct err_buf *e)
{
    struct model *m;
    int r = model_new(c, be, comm, opts, &m, e);

    if (r < 0)
        return r;
    *ret = &m->fwd;
    return 0;
}

struct model *model_from_forward(struct forward *f)
{
    if (!f || f->ops != &model__forward_ops)
        return NULL;
    return f->impl;
}

