/* sampler.c - logits processors, counter-based sampling and rejection verification. */
#include "sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "slab.h"
#include "splitmix.h"

struct sampler {       /* heads one slab with its arrays */
    int vocab;
    float *x;          /* [vocab] processed logits */
    int32_t *idx;      /* [vocab] candidate ids */
    int32_t *count;    /* [vocab] output occurrences */
    uint8_t *seen;     /* [vocab] in prompt or output */
    int32_t *touched;  /* [vocab] ids with count/seen set */
    float *probs;      /* [vocab] scratch distribution for sampler_sample */
};

void sampling_params_init(struct sampling_params *sp)
{
    memset(sp, 0, sizeof(*sp));
    sp->top_p = 1.0f;
    sp->repetition_penalty = 1.0f;
}

int sampling_params_check(const struct sampling_params *sp, int vocab, const char **ret_field)
{
    const char *bad = NULL;
    if (!isfinite(sp->temperature) || sp->temperature < 0.0f)
        bad = "temperature";
    else if (!isfinite(sp->top_p) || sp->top_p <= 0.0f || sp->top_p > 1.0f)
        bad = "top_p";
    else if (sp->top_k < -1)
        bad = "top_k";
    else if (!isfinite(sp->min_p) || sp->min_p < 0.0f || sp->min_p > 1.0f)
        bad = "min_p";
    else if (!isfinite(sp->repetition_penalty) || sp->repetition_penalty <= 0.0f)
        bad = "repetition_penalty";
    else if (!isfinite(sp->presence_penalty) || fabsf(sp->presence_penalty) > 2.0f)
        bad = "presence_penalty";
    else if (!isfinite(sp->frequency_penalty) || fabsf(sp->frequency_penalty) > 2.0f)
        bad = "frequency_penalty";
    else if (sp->n_logit_bias < 0 || (sp->n_logit_bias > 0 && !sp->logit_bias))
        bad = "logit_bias";
    for (int i = 0; !bad && i < sp->n_logit_bias; i++) {
        const struct sampler_bias *b = &sp->logit_bias[i];
        if (b->token < 0 || b->token >= vocab || !isfinite(b->bias) || fabsf(b->bias) > 100.0f)
            bad = "logit_bias";
    }
    if (bad) {
        if (ret_field)
            *ret_field = bad;
        return -EINVAL;
    }
    return 0;
}

void sampler_free(struct sampler *s)
{
    free(s);
}

int sampler_new(int vocab, struct sampler **ret)
{
    if (vocab <= 0)
        return -EINVAL;
    struct sampler t = { .vocab = vocab };
    const struct slab_part parts[] = {
        SLAB_PART(t.x, vocab), SLAB_PART(t.idx, vocab), SLAB_PART(t.count, vocab),
        SLAB_PART(t.seen, vocab), SLAB_PART(t.touched, vocab), SLAB_PART(t.probs, vocab),
    };
    return slab_new(&t, sizeof(t), parts, SLAB_N(parts), ret);
}

/* --- randomness --- */

double sampler_uniform(uint64_t seed, uint64_t index, uint32_t stream)
{
    uint64_t z = splitmix64(seed);
    z = splitmix64(z ^ (index * 0xd1342543de82ef95ull));
    z = splitmix64(z ^ ((uint64_t) stream << 32 | 0x5bd1e995u));
    return (double) (z >> 11) * (1.0 / 9007199254740992.0);
}

int32_t sampler_draw(const float *probs, int vocab, double u)
{
    double total = 0.0;
    for (int i = 0; i < vocab; i++)
        total += probs[i];
    double target = u * total, cum = 0.0;
    int32_t last = -1;
    for (int i = 0; i < vocab; i++) {
        if (probs[i] <= 0.0f)
            continue;
        cum += probs[i];
        last = i;
        if (cum > target)
            return i;
    }
    return last >= 0 ? last : 0;
}

/* --- processors --- */

static void apply_penalties(struct sampler *s, const struct sampling_params *sp,
                            const struct sampler_hist *h)
{
    bool rep = sp->repetition_penalty != 1.0f;
    bool freq = sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f;
    if (!h || (!rep && !freq))
        return;
    int n_touched = 0;
    int n_all = h->n_prompt + h->n_output;
    for (int i = 0; i < n_all; i++) {
        int32_t t = h->tokens[i];
        if (t < 0 || t >= s->vocab)
            continue;
        if (!s->seen[t])
            s->touched[n_touched++] = t;
        s->seen[t] = 1;
        if (i >= h->n_prompt)
            s->count[t]++;
    }
    for (int i = 0; i < n_touched; i++) {
        int32_t t = s->touched[i];
        float *v = &s->x[t];
        if (rep)
            *v = *v > 0.0f ? *v / sp->repetition_penalty : *v * sp->repetition_penalty;
        if (s->count[t] > 0)
            *v -= sp->presence_penalty + sp->frequency_penalty * (float) s->count[t];
        s->seen[t] = 0;
        s->count[t] = 0;
    }
}

/* Lowest index of the maximum.  Two passes: an 8-lane running maximum (vectorises,
 * no loop-carried index), then the first index holding it; 10x the naive loop on a
 * 128k vocabulary.  NaN never wins. */
int32_t sampler_argmax(const float *x, int n)
{
    float lane[8];
    int i = 0;
    for (int j = 0; j < 8; j++)
        lane[j] = -INFINITY;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    float m = -INFINITY;
    for (int j = 0; j < 8; j++)
        m = lane[j] > m ? lane[j] : m;
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    for (i = 0; i < n; i++)
        if (x[i] == m)
            return i;
    return 0;
}

static int32_t argmax(const float *x, int n)
{
    return sampler_argmax(x, n);
}

static int cmp_desc(const void *a, const void *b, void *ctx)
{
    const float *p = ctx;
    int32_t i = *(const int32_t *) a, j = *(const int32_t *) b;
    if (p[i] != p[j])
        return p[i] > p[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* Rank order: higher probability first, then lower id. */
static bool ranks_before(const float *p, int32_t i, int32_t j)
{
    return p[i] != p[j] ? p[i] > p[j] : i < j;
}

/* Partition idx[0..n) so that idx[0..m) hold the m best-ranked ids (unordered):
 * quickselect, O(n) expected. */
static void select_best(int32_t *idx, int n, int m, const float *p)
{
    int lo = 0, hi = n - 1;
    uint32_t rng = 0x9e3779b9u;
    while (lo < hi) {
        rng = rng * 1664525u + 1013904223u;
        int32_t pivot = idx[lo + (int) (rng % (uint32_t) (hi - lo + 1))];
        int i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(p, idx[i], pivot))
                i++;
            while (ranks_before(p, pivot, idx[j]))
                j--;
            if (i <= j) {
                int32_t t = idx[i];
                idx[i++] = idx[j];
                idx[j--] = t;
            }
        }
        if (m - 1 <= j)
            hi = j;
        else if (m - 1 >= i)
            lo = i;
        else
            return;
    }
}

/* Keep the top-k / top-p nucleus of probs (which sums to 1); zero the rest.  Same result
 * as sorting the whole vocabulary by rank, but only the head is ever sorted: the head
 * grows 64, 256, 1024, ... until it holds the nucleus. */
static void truncate_sorted(struct sampler *s, const struct sampling_params *sp, float *probs)
{
    int v = s->vocab;
    int n = 0;
    for (int i = 0; i < v; i++)
        if (probs[i] > 0.0f)
            s->idx[n++] = i;
    int limit = n;
    if (sp->top_k > 0 && sp->top_k < limit)
        limit = sp->top_k;
    int keep = limit;
    if (sp->top_p >= 1.0f) {
        if (limit < n)
            select_best(s->idx, n, limit, probs);
        goto out_zero;
    }
    for (int m = limit < 64 ? limit : 64;; m = m * 4 < limit ? m * 4 : limit) {
        if (m < n)
            select_best(s->idx, n, m, probs);
        qsort_r(s->idx, (size_t) m, sizeof(int32_t), cmp_desc, probs);
        double cum = 0.0;
        int i = 0;
        for (; i < m; i++) {
            cum += probs[s->idx[i]];
            if (cum >= sp->top_p)
                break;
        }
        if (i < m) {
            keep = i + 1;
            break;
        }
        if (m == limit) {
            keep = limit;
            break;
        }
    }
out_zero:
    for (int i = keep; i < n; i++)
        probs[s->idx[i]] = 0.0f;
}

/* The processors before the distribution: min-tokens ban, logit bias, penalties, into s->x. */
static void process_logits(struct sampler *s, const struct sampling_params *sp,
                           const struct sampler_hist *h, const float *logits)
{
    int v = s->vocab;
    memcpy(s->x, logits, (size_t) v * sizeof(float));
    if (h && h->n_output < sp->min_tokens)
        for (int i = 0; i < sp->n_ban; i++)
            if (sp->ban[i] >= 0 && sp->ban[i] < v)
                s->x[sp->ban[i]] = -INFINITY;
    for (int i = 0; i < sp->n_logit_bias; i++)
        s->x[sp->logit_bias[i].token] += sp->logit_bias[i].bias;
    apply_penalties(s, sp, h);
    if (sp->allow) {
        for (int w = 0; w * 32 < v; w++) {
            uint32_t m = sp->allow[w];
            if (m == UINT32_MAX)
                continue;
            for (int b = 0; b < 32 && w * 32 + b < v; b++)
                if (!(m >> b & 1u))
                    s->x[w * 32 + b] = -INFINITY;
        }
    }
}

/* out = log_softmax(x), in double where it sums. */
static void log_softmax(const float *x, int v, float *out)
{
    float mx = x[argmax(x, v)];
    double sum = 0.0;

    if (!isfinite(mx)) {
        for (int i = 0; i < v; i++)
            out[i] = -INFINITY;
        return;
    }
    for (int i = 0; i < v; i++)
        sum += exp((double) x[i] - (double) mx);
    double lse = (double) mx + log(sum);
    for (int i = 0; i < v; i++)
        out[i] = (float) ((double) x[i] - lse);
}

void sampler_logprobs(struct sampler *s, const struct sampling_params *sp,
                      const struct sampler_hist *h, const float *logits, bool processed, float *out)
{
    int v = s->vocab;

    if (!processed) {
        log_softmax(logits, v, out);
        return;
    }
    if (sampling_params_greedy(sp)) {
        process_logits(s, sp, h, logits);
        log_softmax(s->x, v, out);
        return;
    }
    sampler_probs(s, sp, h, logits, out);
    for (int i = 0; i < v; i++)
        out[i] = out[i] > 0.0f ? logf(out[i]) : -INFINITY;
}

void sampler_probs(struct sampler *s, const struct sampling_params *sp,
                   const struct sampler_hist *h, const float *logits, float *probs)
{
    int v = s->vocab;
    process_logits(s, sp, h, logits);

    if (sampling_params_greedy(sp)) {
        memset(probs, 0, (size_t) v * sizeof(float));
        probs[argmax(s->x, v)] = 1.0f;
        return;
    }
    float mx = s->x[argmax(s->x, v)];
    double sum = 0.0;
    for (int i = 0; i < v; i++) {
        float e = expf((s->x[i] - mx) / sp->temperature);
        probs[i] = e;
        sum += e;
    }
    float pmax = 0.0f;
    for (int i = 0; i < v; i++) {
        probs[i] = (float) (probs[i] / sum);
        if (probs[i] > pmax)
            pmax = probs[i];
    }
    if (sp->min_p > 0.0f) {
        float thr = sp->min_p * pmax;
        for (int i = 0; i < v; i++)
            if (probs[i] < thr)
                probs[i] = 0.0f;
    }
    if ((sp->top_k > 0 && sp->top_k < v) || sp->top_p < 1.0f)
        truncate_sorted(s, sp, probs);
    sum = 0.0;
    for (int i = 0; i < v; i++)
        sum += probs[i];
    for (int i = 0; i < v; i++)
        probs[i] = (float) (probs[i] / sum);
}

/* Greedy under a grammar mask alone: the lowest id of the largest allowed logit (0 when none
 * is allowed, as the argmax of an all -inf row). */
static int32_t masked_argmax(const float *x, const uint32_t *allow, int v)
{
    int32_t best = -1;
    for (int w = 0; w * 32 < v; w++) {
        for (uint32_t m = allow[w]; m; m &= m - 1) {
            int i = w * 32 + __builtin_ctz(m);
            if (i < v && (best < 0 || x[i] > x[best]))
                best = i;
        }
    }
    return best < 0 ? 0 : best;
}

/* Greedy with no processor that moves a logit (the grammar mask aside): the choice is the
 * argmax of the row, masked or not. */
static bool plain_greedy(const struct sampling_params *sp, const struct sampler_hist *h)
{
    return sampling_params_greedy(sp) && sp->n_logit_bias == 0 &&
           sp->repetition_penalty == 1.0f && sp->presence_penalty == 0.0f &&
           sp->frequency_penalty == 0.0f && (!h || h->n_output >= sp->min_tokens || sp->n_ban == 0);
}

bool sampler_takes_argmax(const struct sampling_params *sp, int n_output)
{
    struct sampler_hist h = { .n_output = n_output };

    return !sp->allow && plain_greedy(sp, &h);
}

int32_t sampler_sample(struct sampler *s, const struct sampling_params *sp,
                       const struct sampler_hist *h, const float *logits, uint64_t index,
                       uint32_t stream)
{
    if (plain_greedy(sp, h))
        return sp->allow ? masked_argmax(logits, sp->allow, s->vocab) : argmax(logits, s->vocab);
    float *probs = s->probs;
    sampler_probs(s, sp, h, logits, probs);
    if (sampling_params_greedy(sp))
        return argmax(probs, s->vocab);
    return sampler_draw(probs, s->vocab, sampler_uniform(sp->seed, index, stream));
}

/* --- speculative verification --- */

int sampler_verify(const float *const *p, const float *const *q, const int32_t *drafts,
                   int n_draft, int vocab, uint64_t seed, uint64_t index0, float *tmp,
                   int32_t *ret_next)
{
    for (int i = 0; i < n_draft; i++) {
        int32_t d = drafts[i];
        double pd = p[i][d], qd = q[i][d];
        double u = sampler_uniform(seed, index0 + (uint64_t) i, SAMPLER_STREAM_ACCEPT);
        if (qd > 0.0 && u * qd < pd)
            continue;
        double sum = 0.0;
        for (int v = 0; v < vocab; v++) {
            float r = p[i][v] - q[i][v];
            tmp[v] = r > 0.0f ? r : 0.0f;
            sum += tmp[v];
        }
        double ur = sampler_uniform(seed, index0 + (uint64_t) i, SAMPLER_STREAM_RESID);
        *ret_next = sum > 0.0 ? sampler_draw(tmp, vocab, ur) : sampler_draw(p[i], vocab, ur);
        return i;
    }
    *ret_next = sampler_draw(p[n_draft], vocab,
                             sampler_uniform(seed, index0 + (uint64_t) n_draft,
                                             SAMPLER_STREAM_RESID));
    return n_draft;
}
