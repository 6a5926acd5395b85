/* lockstep.c - the forwards around a group's model: rank 0's wrapper that broadcasts each
 * trunk step's plan before running it (worker_bcast_forward_new), a CUDA group's wrapper
 * that ends each trunk step with the NCCL comm's step check (worker_nccl_forward_new), and
 * the step a follower runs for a plan it received (worker_follow_step).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "comm-nccl.h"
#include "log.h"
#include "sampler.h"
#include "worker.h"

/* The model behind a wrapper that adds something to every trunk step (step and its greedy
 * form step_argmax): the lockstep forward broadcasts the step plan to the group first (c,
 * buf, cap; the greedy form with plan.argmax, so that the other ranks run it too); a CUDA
 * group's forward ends it with the NCCL comm's step check (nccl, dcomm).  MTP steps (both
 * forms) and the draft vocabulary pass through: the MTP layers are rank 0's alone. */
struct wrap_fwd {
    struct forward f;
    struct forward *inner;
    bool owns_inner;                /* free() frees the inner forward too */
    struct comm *c;                 /* lockstep: the plan goes over c, encoded into buf */
    void *buf;
    size_t cap;
    const struct comm_nccl_api *nccl;   /* NCCL steps: step_done on dcomm */
    struct comm *dcomm;
    bool no_argmax;                 /* the inner step_argmax answered -ENOTSUP once */
    bool no_topk;                   /* the inner step_topk answered -ENOTSUP once */
};

static int nccl_steps_done(struct wrap_fwd *x, int r)
{
    int r2 = x->nccl->step_done(x->dcomm);

    return r < 0 ? r : r2;
}

enum step_form { FORM_LOGITS, FORM_ARGMAX, FORM_TOPK };

/* The plan to the group, as the step's form */
static int lockstep_send(struct wrap_fwd *x, const struct step_plan *p, enum step_form form)
{
    struct step_plan q = *p;
    int r;

    q.argmax = form == FORM_ARGMAX;
    q.topk = form == FORM_TOPK;
    r = comm_plan_send(x->c, &q, x->buf, x->cap);
    if (r < 0)
        log_error("step %llu: step-plan broadcast failed: %s",
                  (unsigned long long)p->step_id, x->c->error_msg[0] ? x->c->error_msg : err_str(r));
    return r;
}

static int lockstep_ran(struct wrap_fwd *x, const struct step_plan *p, int r)
{
    if (r < 0 && x->c->error)
        log_error("step %llu: %s", (unsigned long long)p->step_id, x->c->error_msg);
    return r;
}

static int wrap_step(struct forward *f, const struct step_plan *p, float *logits)
{
    struct wrap_fwd *x = f->impl;
    int r;

    if (!x->c)
        return nccl_steps_done(x, x->inner->ops->step(x->inner, p, logits));
    r = lockstep_send(x, p, FORM_LOGITS);
    return r < 0 ? r : lockstep_ran(x, p, x->inner->ops->step(x->inner, p, logits));
}

static size_t plan_rows(const struct step_plan *p)
{
    size_t rows = 0;

    for (int s = 0; s < p->n_seqs; s++)
        rows += (size_t)p->seqs[s].n_logits;
    return rows;
}

/* The inner step_argmax (k = 0) or step_topk (k candidates) refused after the plan went
 * out: the other ranks refuse it too and run step() (worker_follow_step), so rank 0 runs
 * it through the logits form and reduces each row on the host (sampler_argmax, sampler_top_k:
 * the choices backend_argmax makes). */
static int lockstep_host_reduce(struct wrap_fwd *x, const struct step_plan *p, int k,
                                int32_t *ids, float *vals)
{
    size_t rows = plan_rows(p), V = (size_t)x->f.vocab_size;
    float *logits;
    int r;

    logits = malloc(sizeof(float) * (rows ? rows : 1) * V);
    if (!logits) {
        /* the step must still run on rank 0: the other ranks wait in its collectives */
        r = x->inner->ops->step(x->inner, p, NULL);
        return r < 0 ? r : -ENOMEM;
    }
    r = x->inner->ops->step(x->inner, p, logits);
    for (size_t i = 0; r >= 0 && i < rows; i++) {
        if (k == 0)
            ids[i] = sampler_argmax(logits + i * V, (int)V);
        else
            sampler_top_k(logits + i * V, (int)V, k, ids + i * (size_t)k, vals + i * (size_t)k);
    }
    free(logits);
    return r;
}

/* The greedy trunk step: the plan goes to the group with argmax set, and every rank runs
 * the greedy form (a vocab-sharded trunk all-gathers one pair per row and rank instead of
 * the rows, model_step_argmax).  The inner forward answers -ENOTSUP before it runs anything
 * (a backend without the argmax op), but in a lockstep group only after the broadcast:
 * that step then runs through the logits form (lockstep_host_reduce) and later calls answer
 * -ENOTSUP before broadcasting, so the engine takes its logits path. */
static int wrap_step_argmax(struct forward *f, const struct step_plan *p, int32_t *ids)
{
    struct wrap_fwd *x = f->impl;
    struct forward *in = x->inner;
    int r;

    if (!in->ops->step_argmax || x->no_argmax)
        return -ENOTSUP;
    if (!x->c) {
        r = in->ops->step_argmax(in, p, ids);
        return r == -ENOTSUP ? r : nccl_steps_done(x, r);
    }
    r = lockstep_send(x, p, FORM_ARGMAX);
    if (r < 0)
        return r;
    r = in->ops->step_argmax(in, p, ids);
    if (r == -ENOTSUP) {
        log_info("step %llu: the group's model has no greedy trunk step (%s): the rows are "
                 "copied", (unsigned long long)p->step_id, in->ops->name);
        x->no_argmax = true;
        r = lockstep_host_reduce(x, p, 0, ids, NULL);
    }
    return lockstep_ran(x, p, r);
}

/* The sampled trunk step (candidates): a CUDA group's step passes through with the NCCL
 * step check.  A lockstep group's plan goes out with topk set and every rank runs the
 * sampled form with STEP_PLAN_TOPK_K candidates a row (a vocab-sharded head all-gathers
 * them), of which the caller gets its k; without sums (the followers have no temperatures:
 * -ENOTSUP with temps, before broadcasting).  The inner forward's -ENOTSUP after the
 * broadcast: that step runs through the logits form (lockstep_host_reduce), later calls
 * answer -ENOTSUP before broadcasting. */
static int wrap_step_topk(struct forward *f, const struct step_plan *p, int k, const float *temps,
                          int32_t *ids, float *vals, double *sums)
{
    struct wrap_fwd *x = f->impl;
    struct forward *in = x->inner;
    const size_t K = STEP_PLAN_TOPK_K, rows = plan_rows(p);
    int32_t *gi;
    float *gv;
    int r;

    if (!in->ops->step_topk || x->no_topk || k > STEP_PLAN_TOPK_K)
        return -ENOTSUP;
    if (!x->c) {
        r = in->ops->step_topk(in, p, k, temps, ids, vals, sums);
        return r == -ENOTSUP ? r : nccl_steps_done(x, r);
    }
    if (temps)
        return -ENOTSUP;
    gi = malloc(sizeof(int32_t) * K * (rows ? rows : 1));
    gv = malloc(sizeof(float) * K * (rows ? rows : 1));
    if (!gi || !gv) {
        free(gi);
        free(gv);
        return -ENOMEM;
    }
    r = lockstep_send(x, p, FORM_TOPK);
    if (r >= 0) {
        r = in->ops->step_topk(in, p, (int)K, NULL, gi, gv, NULL);
        if (r == -ENOTSUP) {
            log_info("step %llu: the group's model has no sampled trunk step (%s): the rows "
                     "are copied", (unsigned long long)p->step_id, in->ops->name);
            x->no_topk = true;
            r = lockstep_host_reduce(x, p, (int)K, gi, gv);
        }
        r = lockstep_ran(x, p, r);
    }
    for (size_t i = 0; r >= 0 && i < rows; i++) {
        memcpy(ids + i * (size_t)k, gi + i * K, sizeof(int32_t) * (size_t)k);
        memcpy(vals + i * (size_t)k, gv + i * K, sizeof(float) * (size_t)k);
    }
    free(gi);
    free(gv);
    return r;
}

static int wrap_mtp_step(struct forward *f, int k, const struct step_plan *p, const int32_t *n_valid,
                         const int32_t *tok_in, float *logits)
{
    struct forward *in = ((struct wrap_fwd *)f->impl)->inner;

    return in->ops->mtp_step(in, k, p, n_valid, tok_in, logits);
}

static int wrap_mtp_step_argmax(struct forward *f, int k, const struct step_plan *p,
                                const int32_t *n_valid, const int32_t *tok_in, int32_t *ids)
{
    struct forward *in = ((struct wrap_fwd *)f->impl)->inner;

    if (!in->ops->mtp_step_argmax)
        return -ENOTSUP;
    return in->ops->mtp_step_argmax(in, k, p, n_valid, tok_in, ids);
}

static int wrap_set_draft_vocab(struct forward *f, const int32_t *ids, int n, struct err_buf *e)
{
    struct forward *inner = ((struct wrap_fwd *)f->impl)->inner;

    if (!inner->ops->set_draft_vocab)
        return err_set(e, -ENOSYS, "forward '%s' has no draft vocabulary", inner->ops->name);
    return inner->ops->set_draft_vocab(inner, ids, n, e);
}

static void wrap_free(struct forward *f)
{
    struct wrap_fwd *x;

    if (!f)
        return;
    x = f->impl;
    if (x->owns_inner)
        x->inner->ops->free(x->inner);
    free(x->buf);
    free(x);
}

static const struct forward_ops wrap_ops = {
    .name = "rank 0",
    .step = wrap_step,
    .mtp_step = wrap_mtp_step,
    .free = wrap_free,
    .set_draft_vocab = wrap_set_draft_vocab,
    .step_argmax = wrap_step_argmax,
    .mtp_step_argmax = wrap_mtp_step_argmax,
    .step_topk = wrap_step_topk,
};

/* A wrapper of inner (owned or borrowed), with plan_cap bytes of plan buffer (0: none). */
static struct wrap_fwd *wrap_new(struct forward *inner, bool owns, size_t plan_cap)
{
    struct wrap_fwd *x = calloc(1, sizeof(*x));

    if (!x)
        return NULL;
    x->buf = plan_cap ? malloc(plan_cap) : NULL;
    if (plan_cap && !x->buf) {
        free(x);
        return NULL;
    }
    x->inner = inner;
    x->owns_inner = owns;
    x->cap = plan_cap;
    x->f = *inner;
    x->f.ops = &wrap_ops;
    x->f.impl = x;
    if (!inner->ops->mtp_step)
        x->f.n_mtp = 0;
    return x;
}

int worker_bcast_forward_new(struct forward *inner, struct comm *c, size_t plan_cap,
                             struct forward **ret)
{
    struct wrap_fwd *x = wrap_new(inner, false, plan_cap > 0 ? plan_cap : 1);

    if (!x)
        return -ENOMEM;
    x->c = c;
    *ret = &x->f;
    return 0;
}

int worker_nccl_forward_new(struct forward *inner, const struct comm_nccl_api *nccl,
                            struct comm *dcomm, struct forward **ret)
{
    struct wrap_fwd *x = wrap_new(inner, true, 0);

    if (!x)
        return -ENOMEM;
    x->nccl = nccl;
    x->dcomm = dcomm;
    *ret = &x->f;
    return 0;
}

int worker_follow_step(struct forward *f, const struct step_plan *p, float *logits, int32_t *ids)
{
    if (p->topk && f->ops->step_topk) {
        const size_t n = STEP_PLAN_TOPK_K * (plan_rows(p) ? plan_rows(p) : 1);
        int32_t *gi = malloc(sizeof(int32_t) * n);
        float *gv = malloc(sizeof(float) * n);
        int r = gi && gv ? f->ops->step_topk(f, p, STEP_PLAN_TOPK_K, NULL, gi, gv, NULL)
                         : -ENOMEM;

        free(gi);
        free(gv);
        if (r != -ENOTSUP)
            return r;
    }
    if (p->argmax && f->ops->step_argmax) {
        int r = f->ops->step_argmax(f, p, ids);

        if (r != -ENOTSUP)
            return r;
    }
    return f->ops->step(f, p, logits);
}
