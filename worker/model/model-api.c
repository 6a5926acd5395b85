/* model-api.c - the model as model.h offers it, on top of the other files: model_new() /
 * model_free() (load, split, fused weights, reservation), the trunk step model_step()
 * (forward.h protocol step 1), the facts for drivers and the struct forward glue.  The MTP
 * step, model_mtp_step(), is model-mtp.c's; model-int.h has the map.
 */
#include <errno.h>

#include "model-int.h"

/* ------------------------------------------------------------- new, free -- */

int model_new(struct ckpt *c, struct backend *be, const struct model_comm *comm,
              const struct model_opts *opts, struct model **ret, struct err_buf *e)
{
    struct model *m;
    int r = model__load(c, be, comm, opts, &m, e);

    if (r < 0)
        return r;
    model__split_fit(m);
    r = model__build_mtp_tp(m, e);
    r = r < 0 ? r : model__gpu_prepare(m, e);
    r = r < 0 ? r : model__reserve(m, e);
    if (r < 0) {
        model_free(m);
        return r;
    }

    m->fwd.ops = &model__forward_ops;
    m->fwd.vocab_size = m->vocab;
    m->fwd.n_mtp = m->n_mtp;
    m->fwd.max_tokens_per_step = m->o.max_tokens_per_step;
    m->fwd.max_seqs = m->o.max_seqs;
    m->fwd.block_size = m->o.block_size;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        m->fwd.n_blocks[g] = m->o.n_blocks[g];
    for (int i = m->n_layers; i < m->n_layers + m->n_mtp; i++)
        m->fwd.mtp_kv_groups |= 1u << m->layers[i].group;
    m->fwd.impl = m;
    *ret = m;
    return 0;
}

void model_free(struct model *m)
{
    if (!m)
        return;
    model__draft_vocab_release(m);
    model__gpu_release(m);
    model__unload(m);
}

/* ------------------------------------------------------------ trunk step -- */

/* The trunk step (forward.h protocol step 1): the plan checked and laid out as a batch,
 * the embedding and layers (as per-core parts, or whole with the GPU's fast paths), then
 * the logits of the rows that want them. */
int model_step(struct model *m, const struct step_plan *p, float *logits)
{
    struct split_cut cut;
    struct batch b;
    int n_rows, r;

    m->have_step = false;
    r = model__check_plan(m, p);
    if (r < 0)
        return r;
    model__mtp_restart(m, p);
    n_rows = model__trunk_batch(m, p, &b);

    /* the residual stream lives in hid, which keeps the pre-final-norm hidden states for
     * the logits and for MTP depth 0 */
    if (model__split_choose(m, &b, &cut))
        r = model__split_layers(m, &b, &cut, NULL);
    else
        r = model__trunk_graph(m, &b, p);
    if (r < 0)
        return PLAN_ERR(m, r, "step: forward failed: %s", err_str(r));
    if (n_rows > 0) {
        r = model__trunk_logits(m, m->h_rows, n_rows, logits);
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

/* The trunk step with each row reduced to its argmax on the backend: no logits copied. */
int model_step_argmax(struct model *m, const struct step_plan *p, int32_t *ids)
{
    int r = model__argmax_check(m, "step_argmax");

    if (r < 0)
        return r;
    if (!ids)
        return PLAN_ERR(m, -EINVAL, "step_argmax: ids are required");
    m->argmax_ids = ids;
    r = model_step(m, p, NULL);
    m->argmax_ids = NULL;
    return r;
}

/* The trunk step with each row reduced to its k best logits (and their softmax mass where
 * temps asks for it) on the backend: k pairs a row copied instead of the row. */
int model_step_topk(struct model *m, const struct step_plan *p, int k, const float *temps,
                    int32_t *ids, float *vals, double *sums)
{
    int r = model__argmax_check(m, "step_topk");
    float none = 0.0f, t = 1.0f;
    double s;

    if (r < 0)
        return r;
    if (m->sharded && temps)
        return PLAN_ERR(m, -ENOTSUP, "step_topk: a vocab-sharded head has no rows' sums");
    if (m->sharded && (2 * k > m->hidden || k > m->vocab_local))
        return PLAN_ERR(m, -ENOTSUP, "step_topk: %d pairs a row do not fit a hidden row or "
                        "the vocab slice", k);
    if (temps && backend_row_expsum(m->be, &none, 0, 1, &none, &t, &s) == -ENOSYS)
        return PLAN_ERR(m, -ENOTSUP, "step_topk: the backend has no row_expsum op");
    if (!ids || !vals || (temps && !sums) || k < 1 || k > BACKEND_ARGMAX_K_MAX || k > m->vocab)
        return PLAN_ERR(m, -EINVAL, "step_topk: k %d outside 1 .. %d, or a buffer missing", k,
                        BACKEND_ARGMAX_K_MAX);
    m->argmax_ids = ids;
    m->topk_k = k;
    m->topk_vals = vals;
    m->topk_temps = temps;
    m->topk_sums = sums;
    r = model_step(m, p, NULL);
    m->argmax_ids = NULL;
    m->topk_k = 0;
    m->topk_vals = NULL;
    m->topk_temps = NULL;
    m->topk_sums = NULL;
    return r;
}

/* ----------------------------------------------------------------- facts -- */

const char *model_last_error(const struct model *m)
{
    return m->last_err.msg;
}

const struct model_config *model_config(const struct model *m)
{
    return m->cfg;
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

static int fwd_step_argmax(struct forward *f, const struct step_plan *p, int32_t *ids)
{
    return model_step_argmax(f->impl, p, ids);
}

static int fwd_mtp_step_argmax(struct forward *f, int k, const struct step_plan *p,
                               const int32_t *n_valid, const int32_t *tok_in, int32_t *ids)
{
    return model_mtp_step_argmax(f->impl, k, p, n_valid, tok_in, ids);
}

static int fwd_step_topk(struct forward *f, const struct step_plan *p, int k, const float *temps,
                         int32_t *ids, float *vals, double *sums)
{
    return model_step_topk(f->impl, p, k, temps, ids, vals, sums);
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
    .step_argmax = fwd_step_argmax,
    .mtp_step_argmax = fwd_mtp_step_argmax,
    .step_topk = fwd_step_topk,
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
