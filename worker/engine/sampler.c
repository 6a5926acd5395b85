/* sampler.c - logits processors, counter-based sampling and rejection verification. */
#include "sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
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

/* The draw of sampler_draw over probs[0 .. n), answering ids[i] (ids NULL: i). */
static int32_t draw(const float *probs, const int32_t *ids, int n, double u)
{
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += probs[i];
    double target = u * total, cum = 0.0;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (probs[i] <= 0.0f)
            continue;
        cum += probs[i];
        last = i;
        if (cum > target)
            return ids ? ids[i] : i;
    }
    return last < 0 ? 0 : ids ? ids[last] : last;
}

int32_t sampler_draw(const float *probs, int vocab, double u)
{
    return draw(probs, NULL, vocab, u);
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

void sampler_top_k(const float *x, int n, int k, int32_t *ids, float *vals)
{
    int m = 0;      /* places filled, in order */

    for (int i = 0; i < n; i++) {
        float v = x[i];
        if (isnan(v) || (m == k && !(v > vals[k - 1])))
            continue;           /* equal to the last place: a lower id holds it */
        int p = m < k ? m++ : k - 1;
        while (p > 0 && v > vals[p - 1]) {
            vals[p] = vals[p - 1];
            ids[p] = ids[p - 1];
            p--;
        }
        vals[p] = v;
        ids[p] = i;
    }
    for (int j = m; j < k; j++) {
        ids[j] = j == 0 ? 0 : -1;
        vals[j] = NAN;
    }
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

/* The top-p cut of ids[0 .. m), in rank order: how many to keep, the first prefix whose
 * weights w (unnormalised, summed in double) reach top_p of total; 0 when none does. */
static int top_p_keep(const int32_t *ids, int m, const float *w, double top_p, double total)
{
    double cum = 0.0, need = top_p * total;

    for (int i = 0; i < m; i++) {
        cum += w[ids[i]];
        if (cum >= need)
            return i + 1;
    }
    return 0;
}

/* Keep the top-k / top-p nucleus of the weights w (unnormalised, summing to total over
 * the vocabulary); zero the rest.  Ranked by the processed logits x (then by id): w is
 * monotone in x, so this is the order of the weights with their ties broken the way a
 * top-k of the logits breaks them (backend_argmax), which lets a step sample from its
 * candidates alone (sampler_sample_cands).  Same result as sorting the whole vocabulary,
 * but only the head is ever sorted: it grows 64, 256, 1024, ... until it holds the
 * nucleus. */
static void truncate_sorted(struct sampler *s, const struct sampling_params *sp, float *w,
                            double total)
{
    const float *x = s->x;
    int v = s->vocab;
    int n = 0;
    for (int i = 0; i < v; i++)
        if (w[i] > 0.0f)
            s->idx[n++] = i;
    int limit = n;
    if (sp->top_k > 0 && sp->top_k < limit)
        limit = sp->top_k;
    int keep = limit;
    if (sp->top_p >= 1.0f) {
        if (limit < n)
            select_best(s->idx, n, limit, x);
        goto out_zero;
    }
    for (int m = limit < 64 ? limit : 64;; m = m * 4 < limit ? m * 4 : limit) {
        if (m < n)
            select_best(s->idx, n, m, x);
        qsort_r(s->idx, (size_t) m, sizeof(int32_t), cmp_desc, (void *) x);
        int i = top_p_keep(s->idx, m, w, sp->top_p, total);
        if (i > 0 || m == limit) {
            keep = i > 0 ? i : limit;
            break;
        }
    }
out_zero:
    for (int i = keep; i < n; i++)
        w[s->idx[i]] = 0.0f;
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

/* w[0 .. n) /= their sum (in double, in index order): a distribution. */
static void normalize(float *w, int n)
{
    double sum = 0.0;

    for (int i = 0; i < n; i++)
        sum += w[i];
    for (int i = 0; i < n; i++)
        w[i] = (float) (w[i] / sum);
}

/* min_p: the weights below min_p of the largest become 0. */
static void min_p_cut(const struct sampling_params *sp, float *w, int n)
{
    float wmax = 0.0f;

    if (sp->min_p <= 0.0f)
        return;
    for (int i = 0; i < n; i++)
        if (w[i] > wmax)
            wmax = w[i];
    float thr = sp->min_p * wmax;
    for (int i = 0; i < n; i++)
        if (w[i] < thr)
            w[i] = 0.0f;
}

/* The weight of logit x at temperature t against the row's maximum mx (1 at the maximum). */
static inline float weight(float x, float mx, float t)
{
    return expf((x - mx) / t);
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
    /* unnormalised weights first: min-p and top-k read only their ratios and order, top-p
     * their sum (sampler_sample_cands repeats this arithmetic on a row's candidates) */
    float mx = s->x[argmax(s->x, v)];
    double sum = 0.0;
    for (int i = 0; i < v; i++) {
        probs[i] = weight(s->x[i], mx, sp->temperature);
        sum += probs[i];
    }
    min_p_cut(sp, probs, v);
    if ((sp->top_k > 0 && sp->top_k < v) || sp->top_p < 1.0f)
        truncate_sorted(s, sp, probs, sum);
    normalize(probs, v);
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
static bool no_processor(const struct sampling_params *sp, const struct sampler_hist *h)
{
    return sp->n_logit_bias == 0 && sp->repetition_penalty == 1.0f &&
           sp->presence_penalty == 0.0f && sp->frequency_penalty == 0.0f &&
           (!h || h->n_output >= sp->min_tokens || sp->n_ban == 0);
}

static bool plain_greedy(const struct sampling_params *sp, const struct sampler_hist *h)
{
    return sampling_params_greedy(sp) && no_processor(sp, h);
}

bool sampler_takes_argmax(const struct sampling_params *sp, int n_output)
{
    struct sampler_hist h = { .n_output = n_output };

    return !sp->allow && plain_greedy(sp, &h);
}

bool sampler_takes_cands(const struct sampling_params *sp, int n_output, int vocab, int k_max)
{
    struct sampler_hist h = { .n_output = n_output };

    if (k_max > SAMPLER_CANDS_MAX)
        k_max = SAMPLER_CANDS_MAX;
    if (sampler_takes_argmax(sp, n_output))
        return true;
    return !sp->allow && no_processor(sp, &h) && sp->top_k >= 1 && sp->top_k <= k_max &&
           sp->top_k < vocab;
}

int32_t sampler_sample_cands(const struct sampling_params *sp, const struct sampler_cands *c,
                             uint64_t index, uint32_t stream)
{
    float w[SAMPLER_CANDS_MAX];
    int32_t id[SAMPLER_CANDS_MAX], ord[SAMPLER_CANDS_MAX];
    int m = sp->top_k < c->k ? sp->top_k : c->k, n = 0;

    if (sampling_params_greedy(sp) || c->k < 1)
        return c->k < 1 ? 0 : c->ids[0];       /* place 0 is the row's argmax */
    BUG_ON(sp->top_k < 1 || m > SAMPLER_CANDS_MAX);
    /* sampler_probs's weights of the row's top_k places, in its rank order: the places
     * with a weight are the same prefix of it there (every weight is monotone in the logit) */
    for (int j = 0; j < m && c->ids[j] >= 0; j++) {
        w[n] = weight(c->vals[j], c->vals[0], sp->temperature);
        id[n++] = c->ids[j];
    }
    min_p_cut(sp, w, n);
    int keep = 0;
    while (keep < n && w[keep] > 0.0f)
        keep++;
    if (sp->top_p < 1.0f) {
        int32_t rank[SAMPLER_CANDS_MAX];
        for (int j = 0; j < keep; j++)
            rank[j] = j;
        int k = top_p_keep(rank, keep, w, sp->top_p, c->sum);
        if (k > 0)
            keep = k;
    }
    /* normalise and draw in id order, as over the whole vocabulary (insertion sort) */
    for (int j = 0; j < keep; j++) {
        int p = j;
        while (p > 0 && id[ord[p - 1]] > id[j]) {
            ord[p] = ord[p - 1];
            p--;
        }
        ord[p] = j;
    }
    float pw[SAMPLER_CANDS_MAX];
    int32_t pid[SAMPLER_CANDS_MAX];
    for (int j = 0; j < keep; j++) {
        pw[j] = w[ord[j]];
        pid[j] = id[ord[j]];
    }
    normalize(pw, keep);
    return draw(pw, pid, keep, sampler_uniform(sp->seed, index, stream));
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
