/* spec.c - MTP draft chain, verification and acceptance counters. */
#include "spec.h"

#include <errno.h>
#include <string.h>

#include "clock.h"
#include "err.h"
#include "grammar.h"
#include "spec-policy.h"

void spec_stats_add(struct spec_stats *dst, const struct spec_stats *src)
{
    dst->n_drafts += src->n_drafts;
    dst->n_draft_tokens += src->n_draft_tokens;
    dst->n_accepted += src->n_accepted;
    for (int k = 0; k < SPEC_MAX_K; k++)
        dst->accepted_per_pos[k] += src->accepted_per_pos[k];
    for (int k = 0; k <= SPEC_MAX_K; k++)
        dst->steps_by_drafts[k] += src->steps_by_drafts[k];
}

double spec_stats_mean_accept_len(const struct spec_stats *st)
{
    if (!st->n_drafts)
        return 1.0;
    return 1.0 + (double) st->n_accepted / (double) st->n_drafts;
}

static int32_t *draft_slot(struct spec_seq *s, int k)
{
    return (int32_t *) s->hist.tokens + s->hist.n_prompt + s->hist.n_output + k;
}

/* Whether every sequence of the chain drafts the raw argmax of its rows: prompt fills do;
 * others when sampler_takes_argmax holds (the output count only grows along the chain) and
 * no grammar masks the drafts. */
static bool chain_takes_argmax(const struct step_plan *plan, const struct spec_seq *seqs)
{
    for (int i = 0; i < plan->n_seqs; i++) {
        const struct spec_seq *s = &seqs[i];
        if (s->depth > 0 && !s->fill_only &&
            (s->gm || !sampler_takes_argmax(s->sp, s->hist.n_output)))
            return false;
    }
    return true;
}

int spec_propose(struct forward *f, struct sampler *smp, const struct step_plan *plan,
                 struct spec_seq *seqs, const int32_t *n_valid, const int32_t *tok_in,
                 float *logits_buf, int32_t *tok_scratch, int32_t *ids_buf,
                 struct spec_policy *pol)
{
    int max_depth = 0;
    for (int i = 0; i < plan->n_seqs; i++)
        if (seqs[i].depth > max_depth)
            max_depth = seqs[i].depth;
    size_t v = (size_t) f->vocab_size;
    bool use_ids = ids_buf && f->ops->mtp_step_argmax && chain_takes_argmax(plan, seqs);
    for (int k = 0; k < max_depth; k++) {
        int64_t t0 = spec_policy_now_us(pol);      /* on the policy's clock */
        int n_at = 0;
        bool fill = false;

        for (int i = 0; i < plan->n_seqs; i++) {
            const struct spec_seq *s = &seqs[i];
            if (k == 0)
                tok_scratch[i] = tok_in[i];
            else if (s->depth <= k)
                tok_scratch[i] = 0;
            else if (s->fill_only && k - 1 < s->n_forced)
                tok_scratch[i] = s->forced[k - 1];
            else
                tok_scratch[i] = s->drafts[k - 1];
        }
        int r = -ENOTSUP;
        if (use_ids)
            r = f->ops->mtp_step_argmax(f, k, plan, n_valid, tok_scratch, ids_buf);
        use_ids = r != -ENOTSUP;
        if (!use_ids)
            r = f->ops->mtp_step(f, k, plan, n_valid, tok_scratch, logits_buf);
        if (r < 0)
            return r;
        for (int i = 0; i < plan->n_seqs; i++) {
            struct spec_seq *s = &seqs[i];
            if (s->depth <= k)
                continue;
            if (use_ids) {      /* every drafter takes the argmax (chain_takes_argmax) */
                s->drafts[k] = ids_buf[i];
                if (!s->fill_only)
                    *draft_slot(s, k) = ids_buf[i];
                continue;
            }
            struct sampler_hist h = s->hist;
            h.n_output += k;
            const float *row = logits_buf + (size_t) i * v;
            int32_t d;
            if (s->fill_only) {
                s->drafts[k] = sampler_argmax(row, (int) v);
                continue;
            }
            /* structured output: drafts under the grammar too (the matcher follows them
             * and is rolled back below), so that they can be accepted */
            struct sampling_params sp = *s->sp;
            if (s->gm && s->gm_drafted == k)
                sp.allow = grammar_matcher_mask(s->gm);
            if (sampling_params_greedy(&sp)) {
                d = sampler_sample(smp, &sp, &h, row, 0, SAMPLER_STREAM_DRAFT);
            } else {
                float *q = s->q + (size_t) k * v;
                sampler_probs(smp, &sp, &h, row, q);
                d = sampler_draw(q, (int) v, sampler_uniform(s->sp->seed, s->out_index + (uint64_t) k,
                                                             SAMPLER_STREAM_DRAFT));
            }
            if (s->gm && s->gm_drafted == k && grammar_matcher_accept(s->gm, d) == 0)
                s->gm_drafted++;
            s->drafts[k] = d;
            *draft_slot(s, k) = d;
        }
        for (int i = 0; i < plan->n_seqs; i++) {
            n_at += seqs[i].depth > k;
            fill |= seqs[i].depth > k && seqs[i].fill_only;
        }
        spec_policy_draft_cost(pol, k, n_at, fill, (double)(spec_policy_now_us(pol) - t0) * 1e-6);
    }
    for (int i = 0; i < plan->n_seqs; i++) {
        if (seqs[i].gm && seqs[i].gm_drafted) {
            BUG_ON(grammar_matcher_rollback(seqs[i].gm, seqs[i].gm_drafted) < 0);
            grammar_matcher_prefetch(seqs[i].gm);
        }
        seqs[i].gm_drafted = 0;
    }
    return 0;
}

/* Grammar-constrained verification (seq->gm): position i is drawn under the mask after the
 * drafts accepted before it, so greedy output is the same for every K; a draft the mask
 * forbids ends the drafts checked (the token at its place is drawn from the masked target).  The
 * matcher consumes drafts while they are allowed, is rolled back to the accepted prefix,
 * then takes the token that follows. */
static int verify_constrained(struct sampler *smp, struct spec_seq *seq, const float *rows,
                              int n_draft, int vocab, float *probs_buf, int32_t *ret_next)
{
    size_t v = (size_t) vocab;
    struct sampling_params sp = *seq->sp;
    int accepted = 0, consumed = 0;
    int32_t next;

    if (n_draft == 0 || sampling_params_greedy(&sp)) {
        for (;;) {
            struct sampler_hist h = seq->hist;
            h.n_output += accepted;
            sp.allow = grammar_matcher_mask(seq->gm);
            next = sampler_sample(smp, &sp, &h, rows + (size_t) accepted * v,
                                  n_draft == 0 ? seq->out_index : 0, SAMPLER_STREAM_TOKEN);
            if (accepted == n_draft || next != seq->drafts[accepted] ||
                grammar_matcher_accept(seq->gm, next) < 0)
                break;
            accepted++;
        }
    } else {
        const float *p[SPEC_MAX_K + 1], *q[SPEC_MAX_K];
        int n_check = n_draft;
        for (int i = 0; i <= n_check; i++) {
            struct sampler_hist h = seq->hist;
            h.n_output += i;
            float *pi = probs_buf + (size_t) i * v;
            sp.allow = grammar_matcher_mask(seq->gm);
            sampler_probs(smp, &sp, &h, rows + (size_t) i * v, pi);
            p[i] = pi;
            if (i == n_check)
                break;
            q[i] = seq->q + (size_t) i * v;
            if (grammar_matcher_accept(seq->gm, seq->drafts[i]) < 0) {
                /* the grammar forbids draft i: only the drafts before it are verified, and
                 * p[i] (under the mask) draws the token after them */
                n_check = i;
                break;
            }
            consumed++;
        }
        float *tmp = probs_buf + (size_t) (SPEC_MAX_K + 1) * v;
        accepted = sampler_verify(p, q, seq->drafts, n_check, vocab, seq->sp->seed, seq->out_index,
                                  tmp, &next);
        BUG_ON(grammar_matcher_rollback(seq->gm, consumed - accepted) < 0);
    }
    /* a token the grammar refuses (only when every allowed one was banned, e.g. EOS under
     * min_tokens) leaves the matcher where it was */
    (void) grammar_matcher_accept(seq->gm, next);
    grammar_matcher_prefetch(seq->gm);     /* the next draw's mask, during the next forward */
    *ret_next = next;
    return accepted;
}

/* The end of a verification: its counts in seq and st, the token after the accepted. */
static int verify_done(struct spec_seq *seq, int n_draft, int accepted, int32_t next,
                       struct spec_stats *st, int32_t *ret_next)
{
    seq->verified = n_draft;
    seq->accepted = accepted;
    if (st)
        st->steps_by_drafts[n_draft]++;
    if (n_draft > 0 && st) {
        st->n_drafts++;
        st->n_draft_tokens += (uint64_t) n_draft;
        st->n_accepted += (uint64_t) accepted;
        for (int k = 0; k < accepted; k++)
            st->accepted_per_pos[k]++;
    }
    *ret_next = next;
    return accepted;
}

int spec_verify_ids(struct spec_seq *seq, const int32_t *ids, int n_draft, struct spec_stats *st,
                    int32_t *ret_next)
{
    int accepted = 0;

    BUG_ON(seq->gm || !sampler_takes_argmax(seq->sp, seq->hist.n_output));
    for (int k = 0; k < n_draft; k++)
        *draft_slot(seq, k) = seq->drafts[k];
    while (accepted < n_draft && ids[accepted] == seq->drafts[accepted])
        accepted++;
    return verify_done(seq, n_draft, accepted, ids[accepted], st, ret_next);
}

int spec_verify_cands(struct spec_seq *seq, const struct sampler_cands *c, int n_draft,
                      struct spec_stats *st, int32_t *ret_next)
{
    BUG_ON(seq->gm || n_draft != 0 ||
           !sampler_takes_cands(seq->sp, seq->hist.n_output, INT32_MAX, c->k));
    return verify_done(seq, 0, 0,
                       sampler_sample_cands(seq->sp, c, seq->out_index, SAMPLER_STREAM_TOKEN),
                       st, ret_next);
}

int spec_verify(struct sampler *smp, struct spec_seq *seq, const float *rows, int n_draft,
                int vocab, float *probs_buf, struct spec_stats *st, int32_t *ret_next)
{
    size_t v = (size_t) vocab;
    int accepted = 0;
    int32_t next;
    for (int k = 0; k < n_draft; k++)
        *draft_slot(seq, k) = seq->drafts[k];
    if (seq->gm) {
        accepted = verify_constrained(smp, seq, rows, n_draft, vocab, probs_buf, &next);
    } else if (n_draft == 0) {
        next = sampler_sample(smp, seq->sp, &seq->hist, rows, seq->out_index, SAMPLER_STREAM_TOKEN);
    } else if (sampling_params_greedy(seq->sp)) {
        for (;;) {
            struct sampler_hist h = seq->hist;
            h.n_output += accepted;
            next = sampler_sample(smp, seq->sp, &h, rows + (size_t) accepted * v, 0,
                                  SAMPLER_STREAM_TOKEN);
            if (accepted == n_draft || next != seq->drafts[accepted])
                break;
            accepted++;
        }
    } else {
        const float *p[SPEC_MAX_K + 1], *q[SPEC_MAX_K];
        for (int i = 0; i <= n_draft; i++) {
            struct sampler_hist h = seq->hist;
            h.n_output += i;
            float *pi = probs_buf + (size_t) i * v;
            sampler_probs(smp, seq->sp, &h, rows + (size_t) i * v, pi);
            p[i] = pi;
            if (i < n_draft)
                q[i] = seq->q + (size_t) i * v;
        }
        float *tmp = probs_buf + (size_t) (SPEC_MAX_K + 1) * v;
        accepted = sampler_verify(p, q, seq->drafts, n_draft, vocab, seq->sp->seed, seq->out_index,
                                  tmp, &next);
    }
    return verify_done(seq, n_draft, accepted, next, st, ret_next);
}
