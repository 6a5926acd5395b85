/* model.c - the Step forward pass as a script over the backend ops (docs/MODEL.md §2, §3):
 * the embedding, per decoder layer its attention half and its MoE / dense half
 * (layer_forward, §2.3), the final norm and the head; the MTP layer's input mix and head
 * (§3.2).  This file calls kernels/ only: the other files of worker/model/ build on it
 * (model-int.h has the map), none lies below it.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-int.h"

/* ---------------------------------------------------------- collectives -- */

int model__allreduce(struct model *m, float *buf, size_t n)
{
    if (!m->sharded)
        return 0;
    return m->comm.allreduce_sum(m->comm.ctx, buf, n);
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

/* The attention half of a decoder layer: x += o_proj(attention(norm(x))), reduced over
 * the ranks where the layer is sharded. */
int model__attention_half(struct model *m, struct mlayer *L, float *x, const struct batch *b,
                          bool reduce)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, H = m->hidden, hd = L->head_dim;
    int g = L->group;
    float eps = cfg->rms_norm_eps;
    int r;

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
        TRY(model__allreduce(m, m->tmp, (size_t)n * H));           /* [all-reduce 1] */
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* The FFN half: x += FFN(norm(x)) - the routed experts and the shared expert of a MoE layer,
 * the dense MLP otherwise - reduced over the ranks where the layer is sharded. */
int model__ffn_half(struct model *m, struct mlayer *L, float *x, const struct batch *b, bool reduce)
{
    const struct model_config *cfg = m->cfg;
    int n = b->n_tok, H = m->hidden;
    float eps = cfg->rms_norm_eps;
    int r;

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
        TRY(model__allreduce(m, m->tmp, (size_t)n * H));           /* [all-reduce 2] */
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* One decoder layer (docs/MODEL.md §2.3) over the batch, in place on the residual x [n, H].
 * Trunk layers reduce over ranks at the two marked points; MTP layers are unsharded. */
int model__layer_forward(struct model *m, struct mlayer *L, float *x, const struct batch *b)
{
    bool reduce = m->sharded && !L->is_mtp;
    int r;

    TRY(model__attention_half(m, L, x, b, reduce));
    return model__ffn_half(m, L, x, b, reduce);
}

/* The embedding step: x [n, H] = E[ids], then the tokens the plan gives an image row
 * (the vision encoder's output, issue 40; model__check_plan checked the indices) take it. */
int model__embed(struct model *m, const struct batch *b, float *x)
{
    size_t row = sizeof(float) * (size_t)m->hidden;
    int r = backend_embed(m->be, &m->embed, b->ids, b->n_tok, x);

    for (int t = 0; b->img_row && t < b->n_tok && r >= 0; t++)
        if (b->img_row[t] >= 0)
            r = backend_upload(m->be, x + (size_t)t * m->hidden,
                               b->img_emb + (size_t)b->img_row[t] * m->hidden, row);
    return r;
}

/* The trunk over batch b: x [n, H] = embed(ids), then every decoder layer in place. */
int model__trunk_forward(struct model *m, const struct batch *b, float *x)
{
    int r = model__embed(m, b, x);

    for (int l = 0; l < m->n_layers && r >= 0; l++)
        r = model__layer_forward(m, &m->layers[l], x, b);
    return r;
}

int32_t model_argmax_pick(const float *vals, const int32_t *ids, int n)
{
    int best = -1;

    for (int i = 0; i < n; i++) {
        if (isnan(vals[i]))
            continue;
        if (best < 0 || vals[i] > vals[best] || (vals[i] == vals[best] && ids[i] < ids[best]))
            best = i;
    }
    return best < 0 ? 0 : ids[best];
}

/* The k best of a row from its slices' k best: list w (w < W) has k_each places in
 * backend_argmax's order (value vals[w * k_each + j] at global id ids[...], id -1 and NaN
 * past the slice's non-NaN elements).  Merged in that order into out_ids / out_vals [k]:
 * the larger value first, on equal values (-0.0 equals +0.0) the lower id; places past the
 * row's candidates id -1 and NaN, except that an all-NaN row's place 0 is id 0 (the
 * backend's and sampler_argmax's answer). */
void model_topk_merge(const float *vals, const int32_t *ids, int W, int k_each, int k,
                      int32_t *out_ids, float *out_vals)
{
    int head[W];

    for (int w = 0; w < W; w++)
        head[w] = 0;
    for (int j = 0; j < k; j++) {
        int best = -1;

        for (int w = 0; w < W; w++) {
            int o = w * k_each + head[w];
            if (head[w] >= k_each || ids[o] < 0 || isnan(vals[o]))
                continue;
            int b = best < 0 ? 0 : best * k_each + head[best];
            if (best < 0 || vals[o] > vals[b] || (vals[o] == vals[b] && ids[o] < ids[b]))
                best = w;
        }
        if (best < 0) {
            out_ids[j] = j == 0 ? 0 : -1;
            out_vals[j] = NAN;
            continue;
        }
        out_ids[j] = ids[best * k_each + head[best]];
        out_vals[j] = vals[best * k_each + head[best]];
        head[best]++;
    }
}

/* The greedy (k = 1) and sampled (topk_k) rows of a vocab-sharded trunk (rows_logits
 * [n_rows, Vl], this rank's slice): each rank reduces its slice to k (value, global id)
 * pairs per row on the backend, the ranks all-gather the pairs (2k floats a row instead of
 * Vl; staged in rows_h, whose rows the head has read, gathered into gather) and every rank
 * merges each row's from them (model_argmax_pick, model_topk_merge).  Collective: every
 * rank of the group runs it in the same step (the plan's argmax or topk, plan-wire.c). */
static int trunk_argmax_sharded(struct model *m, int n_rows)
{
    const int W = m->comm.world, Vl = m->vocab_local, k = m->topk_k > 0 ? m->topk_k : 1;
    const int32_t off = (int32_t)m->comm.rank * Vl;
    float *pairs = m->am_pairs;
    size_t nk = (size_t)n_rows * k, n2 = nk * 2;
    int r;

    TRY(backend_argmax(m->be, m->rows_logits, n_rows, Vl, k, m->am_id, m->am_val));
    for (size_t i = 0; i < nk; i++) {
        int32_t id = m->am_id[i] < 0 ? -1 : m->am_id[i] + off;

        pairs[2 * i] = m->am_val[i];
        memcpy(&pairs[2 * i + 1], &id, sizeof(id));
    }
    TRY(backend_upload(m->be, m->rows_h, pairs, sizeof(float) * n2));
    /* [all-gather]: gather[w] = rank w's [n_rows, k, 2] */
    TRY(m->comm.allgather(m->comm.ctx, m->rows_h, m->gather, n2));
    TRY(backend_download(m->be, pairs, m->gather, sizeof(float) * n2 * (size_t)W));
    TRY(backend_sync(m->be));
    if (m->topk_k > 0)          /* every rank's pairs (the greedy form counts none) */
        m->logits_host_bytes += (uint64_t)n2 * (uint64_t)W * sizeof(float);
    for (int i = 0; i < n_rows; i++) {
        float v[W * k];
        int32_t id[W * k];

        for (int w = 0; w < W; w++) {
            for (int j = 0; j < k; j++) {
                const float *p = pairs + (size_t)w * n2 + 2 * ((size_t)i * k + j);

                v[w * k + j] = p[0];
                memcpy(&id[w * k + j], &p[1], sizeof(id[0]));
            }
        }
        if (m->topk_k > 0)
            model_topk_merge(v, id, W, k, k, m->argmax_ids + (size_t)i * k,
                             m->topk_vals + (size_t)i * k);
        else
            m->argmax_ids[i] = model_argmax_pick(v, id, W);
    }
    return 0;
}

/* The sampled rows of a whole head (model_step_topk): each row's k best (value, id) pairs
 * and, with temps, its softmax mass at temps[row] (backend_row_expsum) reach the host; the
 * bytes count as logits copied (model_logits_host_bytes). */
static int trunk_topk(struct model *m, int n_rows)
{
    const int V = m->vocab, k = m->topk_k;
    float *mx;
    int r;

    TRY(backend_argmax(m->be, m->rows_logits, n_rows, V, k, m->argmax_ids, m->topk_vals));
    m->logits_host_bytes += (uint64_t)n_rows * (uint64_t)k * (sizeof(float) + sizeof(int32_t));
    if (!m->topk_temps || n_rows == 0)
        return 0;
    mx = malloc(sizeof(float) * (size_t)n_rows);
    if (!mx)
        return PLAN_ERR(m, -ENOMEM, "step_topk: out of memory");
    for (int i = 0; i < n_rows; i++)
        mx[i] = m->topk_vals[(size_t)i * k];
    r = backend_row_expsum(m->be, m->rows_logits, n_rows, V, mx, m->topk_temps, m->topk_sums);
    free(mx);
    m->logits_host_bytes += (uint64_t)n_rows * sizeof(double);
    return r;
}

/* logits[rows, vocab] = lm_head · final_norm(hid[rows]), gathered over the vocab slices;
 * with argmax_ids, each row's argmax instead (no row to the host). */
int model__trunk_logits(struct model *m, const int32_t *rows, int n_rows, float *logits)
{
    int H = m->hidden, V = m->vocab, Vl = m->vocab_local;
    int r;

    TRY(model__copy_rows(m, m->rows_h, NULL, m->hid, rows, n_rows));
    TRY(backend_rmsnorm(m->be, m->rows_h, &m->final_norm, n_rows, H, m->cfg->rms_norm_eps,
                        m->rows_h));
    TRY(backend_matmul(m->be, &m->lm_head, m->rows_h, n_rows, m->rows_logits));
    if (!m->sharded) {
        if (m->argmax_ids && m->topk_k > 0)
            return trunk_topk(m, n_rows);
        if (m->argmax_ids)
            return backend_argmax(m->be, m->rows_logits, n_rows, V, 1, m->argmax_ids, NULL);
        if (logits) {
            TRY(backend_download(m->be, logits, m->rows_logits,
                                 sizeof(float) * (size_t)n_rows * (size_t)V));
            m->logits_host_bytes += sizeof(float) * (size_t)n_rows * (size_t)V;
        }
        return 0;
    }
    if (m->argmax_ids)
        return trunk_argmax_sharded(m, n_rows);
    /* [all-gather]: gather[w] = rank w's [n_rows, Vl]; row i = concat over w */
    TRY(m->comm.allgather(m->comm.ctx, m->rows_logits, m->gather, (size_t)n_rows * Vl));
    if (!logits)
        return 0;
    for (int w = 0; w < m->comm.world; w++)
        for (int i = 0; i < n_rows; i++)
            TRY(backend_download(m->be, logits + (size_t)i * V + (size_t)w * Vl,
                                 m->gather + ((size_t)w * n_rows + i) * Vl, sizeof(float) * (size_t)Vl));
    m->logits_host_bytes += sizeof(float) * (size_t)n_rows * (size_t)V;
    return 0;
}

/* Whether the greedy steps can reduce logits rows on this model's backend: the op is
 * there (a call on 0 rows answers -ENOSYS where it is not).  A vocab-sharded trunk reduces
 * each rank's slice and all-gathers the pairs (trunk_argmax_sharded); the MTP heads are
 * whole on rank 0. */
int model__argmax_check(struct model *m, const char *what)
{
    float none = 0.0f;
    int32_t id;

    if (backend_argmax(m->be, &none, 0, 1, 1, &id, NULL) == -ENOSYS)
        return PLAN_ERR(m, -ENOTSUP, "%s: the backend has no argmax op", what);
    return 0;
}

uint64_t model_logits_host_bytes(const struct model *m)
{
    return m->logits_host_bytes;
}

/* ------------------------------------------------------------ MTP layers -- */

/* The MTP layer's input mix (docs/MODEL.md §3.2): x = We·enorm(E[ids]) + Wh·hnorm(g), g the
 * batch's rows of g_rows.  me, mn: scratch rows [n, H]. */
int model__mtp_input(struct model *m, struct mlayer *L, const struct batch *b,
                     const float *g_rows, float *me, float *mn, float *x)
{
    int n = b->n_tok, H = m->hidden, r;

    TRY(model__embed(m, b, me));
    TRY(backend_rmsnorm(m->be, me, &L->enorm, n, H, m->cfg->rms_norm_eps, me));
    TRY(backend_rmsnorm(m->be, g_rows, &L->hnorm, n, H, m->cfg->rms_norm_eps, mn));
    TRY(backend_matmul(m->be, &L->eh_e, me, n, x));
    TRY(backend_matmul(m->be, &L->eh_h, mn, n, m->tmp));
    return backend_add(m->be, x, m->tmp, (size_t)n * H);
}

/* MTP layer L over batch b: the input mix, then the decoder layer on x. */
int model__mtp_layer_run(struct model *m, struct mlayer *L, const struct batch *b,
                         const float *g_rows, float *me, float *mn, float *x)
{
    int r;

    TRY(model__mtp_input(m, L, b, g_rows, me, mn, x));
    return model__layer_forward(m, L, x, b);
}

/* The MTP head: out[n, rows of head] = head · head_norm(x), x [n, H] normed in place;
 * head is L's full head, its draft-vocabulary rows or a half's rows. */
int model__mtp_head(struct model *m, const struct mlayer *L, const struct bweight *head, float *x,
                    int n, float *out)
{
    int r;

    TRY(backend_rmsnorm(m->be, x, &L->head_norm, n, m->hidden, m->cfg->rms_norm_eps, x));
    return backend_matmul(m->be, head, x, n, out);
}
