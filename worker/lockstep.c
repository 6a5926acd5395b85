/* lockstep.c - the forwards around a group's model: rank 0's wrapper that broadcasts each
 * trunk step's plan before running it (worker_bcast_forward_new), a CUDA group's wrapper
 * that ends each trunk step with the NCCL comm's step check (worker_nccl_forward_new), and
 * the step a follower runs for a plan it received (worker_follow_step).
 */
#include <errno.h>
#include <stdlib.h>

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
};

static int nccl_steps_done(struct wrap_fwd *x, int r)
{
    int r2 = x->nccl->step_done(x->dcomm);

    return r < 0 ? r : r2;
}

/* The plan to the group, as the step's form (argmax: the greedy one) */
static int lockstep_send(struct wrap_fwd *x, const struct step_plan *p, bool argmax)
{
    struct step_plan q = *p;
    int r;

    q.argmax = argmax;
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
    r = lockstep_send(x, p, false);
    return r < 0 ? r : lockstep_ran(x, p, x->inner->ops->step(x->inner, p, logits));
}

/* The inner step_argmax refused after the greedy plan went out: the other ranks refuse it
 * too and run step() (worker_follow_step), so rank 0 runs it through the logits form and
 * takes each row's argmax on the host (sampler_argmax: the choice backend_argmax makes). */
static int lockstep_host_argmax(struct wrap_fwd *x, const struct step_plan *p, int32_t *ids)
{
    size_t rows = 0, V = (size_t)x->f.vocab_size;
    float *logits;
    int r;

    for (int s = 0; s < p->n_seqs; s++)
        rows += (size_t)p->seqs[s].n_logits;
    logits = malloc(sizeof(float) * (rows ? rows : 1) * V);
    if (!logits) {
        /* the step must still run on rank 0: the other ranks wait in its collectives */
        r = x->inner->ops->step(x->inner, p, NULL);
        return r < 0 ? r : -ENOMEM;
    }
    r = x->inner->ops->step(x->inner, p, logits);
    for (size_t i = 0; r >= 0 && i < rows; i++)
        ids[i] = sampler_argmax(logits + i * V, (int)V);
    free(logits);
    return r;
}

/* The greedy trunk step: the plan goes to the group with argmax set, and every rank runs
 * the greedy form (a vocab-sharded trunk all-gathers one pair per row and rank instead of
 * the rows, model_step_argmax).  The inner forward answers -ENOTSUP before it runs anything
 * (a backend without the argmax op), but in a lockstep group only after the broadcast:
 * that step then runs through the logits form (lockstep_host_argmax) and later calls answer
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
    r = lockstep_send(x, p, true);
    if (r < 0)
        return r;
    r = in->ops->step_argmax(in, p, ids);
    if (r == -ENOTSUP) {
        log_info("step %llu: the group's model has no greedy trunk step (%s): the rows are "
                 "copied", (unsigned long long)p->step_id, in->ops->name);
        x->no_argmax = true;
        r = lockstep_host_argmax(x, p, ids);
    }
    return lockstep_ran(x, p, r);
}

/* The sampled trunk step (candidates): a CUDA group's step passes through with the NCCL
 * step check.  A lockstep group refuses it before broadcasting (the plan's wire kinds name
 * no candidates form), so its sampled steps copy the rows; its greedy ones do not. */
static int wrap_step_topk(struct forward *f, const struct step_plan *p, int k, const float *temps,
                          int32_t *ids, float *vals, double *sums)
{
    struct wrap_fwd *x = f->impl;
    struct forward *in = x->inner;
    int r;

    if (!in->ops->step_topk || x->c)
        return -ENOTSUP;
    r = in->ops->step_topk(in, p, k, temps, ids, vals, sums);
    return r == -ENOTSUP ? r : nccl_steps_done(x, r);
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
    if (p->argmax && f->ops->step_argmax) {
        int r = f->ops->step_argmax(f, p, ids);

        if (r != -ENOTSUP)
            return r;
    }
    return f->ops->step(f, p, logits);
}
