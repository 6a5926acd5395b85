/* model-gpu.c - the fast paths of a GPU backend over the forward script (model.c): a
 * step's index arrays in one transfer, each layer's two halves fused (backend.h attn_block
 * / ffn_block, prepared once at load) and the trunk's layers captured and replayed as a
 * graph.  On a backend without them (the CPU) every call here falls through to the script,
 * which stays the oracle of both.
 */
#include <errno.h>
#include <math.h>

#include "model-int.h"

/* The batch's index arrays to the backend in one go (backend_step_begin). */
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

/* ------------------------------------------------------------ fused halves -- */

/* The fused halves of every layer a GPU backend can run fused (backend_has_blocks);
 * layers it cannot (-ENOTSUP: e.g. MXFP4 drafts) keep the op script. */
int model__gpu_prepare(struct model *m, struct err_buf *e)
{
    const struct model_config *cfg = m->cfg;
    int r;

    if (!backend_has_blocks(m->be) || m->split_parts > 1)
        return 0;
    for (int i = 0; i < m->n_layers + m->n_mtp; i++) {
        struct mlayer *L = &m->layers[i];

        L->aw = (struct attn_weights){
            .in_norm = &L->in_norm, .wq = &L->wq, .wk = &L->wk, .wv = &L->wv,
            .wg = cfg->use_head_wise_attn_gate ? &L->wg : NULL,
            .q_norm = cfg->use_qk_norm ? &L->q_norm : NULL,
            .k_norm = cfg->use_qk_norm ? &L->k_norm : NULL, .wo = &L->wo,
            .freqs = L->freqs.rotary_dims > 0 ? &L->freqs : NULL,
        };
        L->fw = (struct ffn_weights){
            .post_norm = &L->post_norm, .gate = L->has_ffn_dense ? &L->gate : NULL,
            .up = L->has_ffn_dense ? &L->up : NULL, .down = L->has_ffn_dense ? &L->down : NULL,
            .inter = L->inter, .router = L->is_moe ? &L->router : NULL,
            .router_bias = L->router_bias, .experts = L->experts, .expert_first = L->expert_first,
            .n_local = L->n_local, .n_experts = cfg->n_experts,
            .moe_inter = cfg->moe_intermediate_size,
        };
        r = backend_attn_prepare(m->be, &L->aw);
        if (r == -ENOTSUP)
            continue;
        if (r < 0)
            return err_set(e, r, "layer %d: fused attention weights: %s", L->idx, err_str(r));
        r = backend_ffn_prepare(m->be, &L->fw);
        if (r == -ENOTSUP) {
            backend_attn_release(m->be, &L->aw);
            continue;
        }
        if (r < 0)
            return err_set(e, r, "layer %d: fused FFN weights: %s", L->idx, err_str(r));
        L->blocks = true;
    }
    return 0;
}

/* Release what model__gpu_prepare prepared (model_free). */
void model__gpu_release(struct model *m)
{
    for (int i = 0; m->layers && i < m->n_layers + m->n_mtp; i++) {
        backend_attn_release(m->be, &m->layers[i].aw);
        backend_ffn_release(m->be, &m->layers[i].fw);
    }
}

/* The two halves of layer L fused on the backend (backend.h attn_block / ffn_block: the
 * same script as model.c's, BF16 inside); -ENOTSUP before any work when the backend cannot
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
        TRY(model__allreduce(m, m->tmp, nh));                      /* [all-reduce 1] */
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
        TRY(model__allreduce(m, m->tmp, nh));                      /* [all-reduce 2] */
        TRY(backend_add(m->be, x, m->tmp, nh));
    }
    return 0;
}

/* model__layer_forward with each half fused where the backend prepared L's fused weights
 * (and the batch is whole, not a part of a split step); the script otherwise. */
int model__layer_forward_fused(struct model *m, struct mlayer *L, float *x, const struct batch *b)
{
    bool reduce = m->sharded && !L->is_mtp, fused = L->blocks && !b->hooks;
    int r = fused ? attn_fused(m, L, x, b, reduce) : -ENOTSUP;

    if (r == -ENOTSUP)
        r = model__attention_half(m, L, x, b, reduce);
    if (r < 0)
        return r;
    r = fused ? ffn_fused(m, L, x, b, reduce) : -ENOTSUP;
    if (r == -ENOTSUP)
        r = model__ffn_half(m, L, x, b, reduce);
    return r;
}

/* ------------------------------------------------------------------ graphs -- */

/* The trunk of a whole step (plan p, batch b) into m->hid: the inputs in one transfer,
 * the embedding and the layers (fused halves where prepared) as a graph where the step's
 * shape has one (a failed capture leaves graphs off: the layers run again). */
int model__trunk_graph(struct model *m, const struct batch *b, const struct step_plan *p)
{
    int r = model__step_inputs(m, b, p, true);

    for (int tries = 0; r >= 0 && tries < 2; tries++) {
        int replay = backend_capture_begin(m->be), r2;

        r = replay;
        if (replay == 0) {
            r = model__embed(m, b, m->hid);
            for (int l = 0; l < m->n_layers && r >= 0; l++)
                r = model__layer_forward_fused(m, &m->layers[l], m->hid, b);
        }
        r2 = replay < 0 ? 0 : backend_capture_end(m->be, r >= 0);
        if (r2 != -EAGAIN) {
            r = r < 0 ? r : r2;
            break;
        }
        r = 0;
    }
    return r;
}
