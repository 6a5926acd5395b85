/* spec.c - MTP draft chain, verification and acceptance counters. */
#include "spec.h"

#include <errno.h>
#include <string.h>

#include "clock.h"
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

int spec_propose(struct forward *f, struct sampler *smp, const struct step_plan *plan,
                 struct spec_seq *seqs, const int32_t *n_valid, const int32_t *tok_in,
                 float *logits_buf, int32_t *tok_scratch, struct spec_policy *pol)
{
    int max_depth = 0;
    for (int i = 0; i < plan->n_seqs; i++)
        if (seqs[i].depth > max_depth)
            max_depth = seqs[i].depth;
    size_t v = (size_t) f->vocab_size;
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
        int r = f->ops->mtp_step(f, k, plan, n_valid, tok_scratch, logits_buf);
        if (r < 0)
            return r;
        for (int i = 0; i < plan->n_seqs; i++) {
            struct spec_seq *s = &seqs[i];
            if (s->depth <= k)
                continue;
            struct sampler_hist h = s->hist;
            h.n_output += k;
            const float *row = logits_buf + (size_t) i * v;
            int32_t d;
            if (s->fill_only) {
                s->drafts[k] = sampler_argmax(row, (int) v);
                continue;
            }
            if (sampling_params_greedy(s->sp)) {
                d = sampler_sample(smp, s->sp, &h, row, 0, SAMPLER_STREAM_DRAFT);
            } else {
                float *q = s->q + (size_t) k * v;
                sampler_probs(smp, s->sp, &h, row, q);
                d = sampler_draw(q, (int) v, sampler_uniform(s->sp->seed, s->out_index + (uint64_t) k,
                                                             SAMPLER_STREAM_DRAFT));
            }
            s->drafts[k] = d;
            *draft_slot(s, k) = d;
        }
        for (int i = 0; i < plan->n_seqs; i++) {
            n_at += seqs[i].depth > k;
            fill |= seqs[i].depth > k && seqs[i].fill_only;
        }
        spec_policy_draft_cost(pol, k, n_at, fill, (double)(spec_policy_now_us(pol) - t0) * 1e-6);
    }
    return 0;
}

int spec_verify(struct sampler *smp, struct spec_seq *seq, const float *rows, int n_draft,
                int vocab, float *probs_buf, struct spec_stats *st, int32_t *ret_next)
{
    size_t v = (size_t) vocab;
    int accepted = 0;
    int32_t next;
    for (int k = 0; k < n_draft; k++)
        *draft_slot(seq, k) = seq->drafts[k];
    if (n_draft == 0) {
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
