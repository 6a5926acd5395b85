/* test-sampler.c - logits processors, seeded sampling, and rejection sampling: the
 * tokens emitted by speculative verification are distributed as the target's
 * (chi-square, fixed seed, p > 0.001), even when the draft distribution is far off. */
#include <math.h>
#include <stdlib.h>

#include "chisq.h"
#include "harness.h"
#include "sampler.h"
#include "spec.h"

#define V 8

static struct sampler *smp(int vocab)
{
    struct sampler *s = NULL;
    ASSERT_OK(sampler_new(vocab, &s));
    return s;
}

static void test_params_check(void)
{
    struct sampling_params sp;
    const char *field = NULL;
    sampling_params_init(&sp);
    ASSERT_OK(sampling_params_check(&sp, V, &field));
    sp.top_p = 0.0f;
    ASSERT_ERR(sampling_params_check(&sp, V, &field), -EINVAL);
    ASSERT_STREQ(field, "top_p");
    sampling_params_init(&sp);
    sp.temperature = -1.0f;
    ASSERT_ERR(sampling_params_check(&sp, V, &field), -EINVAL);
    ASSERT_STREQ(field, "temperature");
    sampling_params_init(&sp);
    sp.temperature = NAN;
    ASSERT_ERR(sampling_params_check(&sp, V, &field), -EINVAL);
    sampling_params_init(&sp);
    struct sampler_bias b = { .token = V, .bias = 1.0f };
    sp.logit_bias = &b;
    sp.n_logit_bias = 1;
    ASSERT_ERR(sampling_params_check(&sp, V, &field), -EINVAL);
    ASSERT_STREQ(field, "logit_bias");
    sampling_params_init(&sp);
    sp.frequency_penalty = 2.5f;
    ASSERT_ERR(sampling_params_check(&sp, V, &field), -EINVAL);
    ASSERT_STREQ(field, "frequency_penalty");
}

static void test_greedy_and_processors(void)
{
    struct sampler *s = smp(V);
    float logits[V] = { 0.1f, 2.0f, 1.9f, -1.0f, 0.0f, 1.0f, 0.5f, 1.95f };
    float probs[V];
    struct sampling_params sp;
    sampling_params_init(&sp);
    ASSERT_EQ(sampler_sample(s, &sp, NULL, logits, 0, 0), 1);
    /* logit bias moves the argmax */
    struct sampler_bias b = { .token = 3, .bias = 5.0f };
    sp.logit_bias = &b;
    sp.n_logit_bias = 1;
    ASSERT_EQ(sampler_sample(s, &sp, NULL, logits, 0, 0), 3);
    /* repetition penalty on token 1 (seen in the prompt) */
    sampling_params_init(&sp);
    int32_t hist_tokens[4] = { 1, 1, 7, 0 };
    struct sampler_hist h = { .tokens = hist_tokens, .n_prompt = 1, .n_output = 0 };
    sp.repetition_penalty = 1.2f;            /* 2.0 -> 1.667 */
    ASSERT_EQ(sampler_sample(s, &sp, &h, logits, 0, 0), 7);
    /* presence/frequency count output tokens only: 1 twice in output */
    sampling_params_init(&sp);
    h.n_prompt = 0;
    h.n_output = 2;
    sp.frequency_penalty = 0.1f;             /* 2.0 - 0.2 = 1.8 < 1.95 */
    ASSERT_EQ(sampler_sample(s, &sp, &h, logits, 0, 0), 7);
    sp.frequency_penalty = 0.0f;
    sp.presence_penalty = 0.01f;             /* 1.99 > 1.95 */
    ASSERT_EQ(sampler_sample(s, &sp, &h, logits, 0, 0), 1);
    /* min_tokens bans EOS/stop ids while the output is shorter */
    sampling_params_init(&sp);
    int32_t ban[1] = { 1 };
    sp.min_tokens = 3;
    sp.ban = ban;
    sp.n_ban = 1;
    h.n_prompt = 0;
    h.n_output = 2;
    ASSERT_EQ(sampler_sample(s, &sp, &h, logits, 0, 0), 7);
    h.n_output = 3;
    ASSERT_EQ(sampler_sample(s, &sp, &h, logits, 0, 0), 1);
    /* top-k = 2 keeps only 1 and 7 */
    sampling_params_init(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 2;
    sampler_probs(s, &sp, NULL, logits, probs);
    for (int i = 0; i < V; i++)
        ASSERT_TRUE((i == 1 || i == 7) ? probs[i] > 0.0f : probs[i] == 0.0f);
    ASSERT_NEAR(probs[1] + probs[7], 1.0, 1e-6);
    /* top-p small keeps only the argmax */
    sp.top_k = 0;
    sp.top_p = 0.05f;
    sampler_probs(s, &sp, NULL, logits, probs);
    ASSERT_NEAR(probs[1], 1.0, 1e-6);
    /* min-p 0.5: keep tokens with p >= 0.5 * pmax: 1, 2, 7 (e^-0.1 ~ 0.9), not 5 (e^-1) */
    sp.top_p = 1.0f;
    sp.min_p = 0.5f;
    sampler_probs(s, &sp, NULL, logits, probs);
    ASSERT_TRUE(probs[1] > 0 && probs[2] > 0 && probs[7] > 0);
    ASSERT_EQ(probs[5], 0.0f);
    sampler_free(s);
}

static const float *ref_probs;

static int ref_cmp(const void *a, const void *b)
{
    int32_t i = *(const int32_t *) a, j = *(const int32_t *) b;
    if (ref_probs[i] != ref_probs[j])
        return ref_probs[i] > ref_probs[j] ? -1 : 1;
    return i < j ? -1 : 1;
}

/* top-k / top-p by partial selection equal a full sort of the vocabulary, ties included */
static void test_truncation_matches_full_sort(void)
{
    enum { VV = 5000 };
    struct sampler *s = smp(VV);
    static float logits[VV], probs[VV], ref[VV];
    static int32_t order[VV];
    uint64_t z = 7;
    for (int trial = 0; trial < 40; trial++) {
        for (int i = 0; i < VV; i++) {
            z = z * 6364136223846793005ull + 1442695040888963407ull;
            /* coarse values make many exact ties */
            logits[i] = (float) ((z >> 40) % (trial % 2 ? 50 : 100000)) / 10.0f;
        }
        struct sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = 0.7f + 0.1f * (float) (trial % 5);
        static const int ks[] = { 0, 1, 7, 64, 65, 300, 4999, 6000 };
        static const float ps[] = { 1.0f, 0.9f, 0.5f, 0.999f, 0.05f };
        sp.top_k = ks[trial % 8];
        sp.top_p = ps[trial % 5];
        sampler_probs(s, &sp, NULL, logits, probs);
        /* reference: untruncated softmax, full stable sort, cut */
        struct sampling_params plain = sp;
        plain.top_k = 0;
        plain.top_p = 1.0f;
        sampler_probs(s, &plain, NULL, logits, ref);
        for (int i = 0; i < VV; i++)
            order[i] = i;
        ref_probs = ref;
        qsort(order, VV, sizeof(int32_t), ref_cmp);
        int keep = sp.top_k > 0 && sp.top_k < VV ? sp.top_k : VV;
        double cum = 0;
        for (int i = 0; i < keep; i++) {
            cum += ref[order[i]];
            if (sp.top_p < 1.0f && cum >= sp.top_p) {
                keep = i + 1;
                break;
            }
        }
        static bool kept[VV];
        memset(kept, 0, sizeof(kept));
        for (int j = 0; j < keep; j++)
            kept[order[j]] = ref[order[j]] > 0.0f;
        int n_kept = 0;
        for (int i = 0; i < VV; i++) {
            n_kept += kept[i];
            if (kept[i] != (probs[i] > 0.0f))
                FAIL("trial %d (k=%d p=%g): token %d kept=%d expected %d", trial, sp.top_k,
                     (double) sp.top_p, i, probs[i] > 0.0f, kept[i]);
        }
        ASSERT_TRUE(n_kept >= 1);
    }
    sampler_free(s);
}

static void test_seeded(void)
{
    struct sampler *s = smp(V);
    float logits[V] = { 0, 0.1f, 0.2f, 0.3f, 0.2f, 0.1f, 0, -0.1f };
    struct sampling_params sp;
    sampling_params_init(&sp);
    sp.temperature = 1.0f;
    sp.seed = 42;
    int same = 0, diff_seed = 0;
    for (uint64_t i = 0; i < 200; i++) {
        int32_t a = sampler_sample(s, &sp, NULL, logits, i, 0);
        int32_t b = sampler_sample(s, &sp, NULL, logits, i, 0);
        same += a == b;
        sp.seed = 43;
        diff_seed += sampler_sample(s, &sp, NULL, logits, i, 0) != a;
        sp.seed = 42;
    }
    ASSERT_EQ(same, 200);
    ASSERT_TRUE(diff_seed > 50);
    sampler_free(s);
}

/* Target p_i and draft q_i over V tokens for 3 positions, deliberately different. */
static void make_dists(float p[4][V], float q[3][V])
{
    static const float praw[4][V] = {
        { 5, 1, 1, 8, 2, 0, 3, 4 }, { 1, 9, 1, 1, 2, 2, 3, 1 },
        { 3, 3, 3, 0, 1, 6, 2, 2 }, { 2, 2, 2, 2, 2, 2, 2, 6 },
    };
    static const float qraw[3][V] = {
        { 1, 6, 1, 2, 2, 3, 1, 4 }, { 1, 4, 4, 1, 2, 0, 3, 5 }, { 3, 3, 0, 3, 1, 6, 2, 2 },
    };
    for (int i = 0; i < 4; i++) {
        float sum = 0;
        for (int v = 0; v < V; v++)
            sum += praw[i][v];
        for (int v = 0; v < V; v++)
            p[i][v] = praw[i][v] / sum;
    }
    for (int i = 0; i < 3; i++) {
        float sum = 0;
        for (int v = 0; v < V; v++)
            sum += qraw[i][v];
        for (int v = 0; v < V; v++)
            q[i][v] = qraw[i][v] / sum;
    }
}

/* The target rows here do not depend on the prefix, so every emitted position k must be
 * distributed as p_k.  N = 200000 trials, seed 1234; each position's chi-square must have
 * p-value > 0.001 (the statistic is deterministic for the fixed seed). */
static void test_rejection_chi_square(void)
{
    float p[4][V], q[3][V], tmp[V];
    make_dists(p, q);
    const float *pp[4] = { p[0], p[1], p[2], p[3] };
    const float *qq[3] = { q[0], q[1], q[2] };
    enum { N = 200000 };
    long counts[4][V] = { { 0 } };
    long reached[4] = { 0 };
    long accepted = 0;
    uint64_t seed = 1234;
    for (uint64_t t = 0; t < N; t++) {
        int32_t d[3];
        for (int k = 0; k < 3; k++)
            d[k] = sampler_draw(q[k], V, sampler_uniform(seed, t * 8 + (uint64_t) k, SAMPLER_STREAM_DRAFT));
        int32_t next;
        int a = sampler_verify(pp, qq, d, 3, V, seed, t * 8, tmp, &next);
        accepted += a;
        for (int k = 0; k < a; k++) {
            counts[k][d[k]]++;
            reached[k]++;
        }
        counts[a][next]++;
        reached[a]++;
    }
    for (int k = 0; k < 4; k++) {
        double expect[V];
        for (int v = 0; v < V; v++)
            expect[v] = (double) reached[k] * p[k][v];
        int df;
        double x = chisq_stat(counts[k], expect, V, &df);
        double pv = chisq_pvalue(x, df);
        printf("position %d: n=%ld chi2=%.2f df=%d p=%.4f\n", k, reached[k], x, df, pv);
        ASSERT_TRUE(reached[k] > 1000);
        ASSERT_TRUE(pv > 0.001);
    }
    /* the draft is off, so some are rejected, some accepted */
    ASSERT_TRUE(accepted > N / 4 && accepted < 3 * N);
    /* a wrong verifier (always accept) must fail the same test: sanity of the test */
    long bad[V] = { 0 };
    for (uint64_t t = 0; t < N; t++)
        bad[sampler_draw(q[0], V, sampler_uniform(seed, t, SAMPLER_STREAM_DRAFT))]++;
    double expect[V];
    for (int v = 0; v < V; v++)
        expect[v] = (double) N * p[0][v];
    int df;
    double x = chisq_stat(bad, expect, V, &df);
    ASSERT_TRUE(chisq_pvalue(x, df) < 1e-6);
}

/* chisq_pvalue against known quantiles */
static void test_chisq_helper(void)
{
    ASSERT_NEAR(chisq_pvalue(24.322, 7), 0.001, 2e-5);
    ASSERT_NEAR(chisq_pvalue(14.067, 7), 0.05, 2e-4);
    ASSERT_NEAR(chisq_pvalue(3.841, 1), 0.05, 2e-4);
}

static void test_spec_config(void)
{
    struct spec_config c;
    struct err_buf e;
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":3}", &c, &e));
    ASSERT_EQ(c.num_speculative_tokens, 3);
    ASSERT_OK(spec_config_parse(NULL, &c, &e));
    ASSERT_EQ(c.num_speculative_tokens, 0);
    ASSERT_ERR(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":4}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "num_speculative_tokens");
    ASSERT_ERR(spec_config_parse("{\"method\":\"eagle\",\"num_speculative_tokens\":1}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "method");
    ASSERT_ERR(spec_config_parse("{\"method\":\"mtp\",\"k\":1}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "unknown key");
    ASSERT_ERR(spec_config_parse("{\"method\":", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "invalid JSON");
    ASSERT_ERR(spec_config_parse("{\"num_speculative_tokens\":1}", &c, &e), -EINVAL);
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2,"
                                "\"draft_quantization\":\"mxfp4\"}", &c, &e));
    ASSERT_EQ(c.num_speculative_tokens, 2);
    ASSERT_EQ(c.draft_quant, SPEC_DRAFT_MXFP4);
    ASSERT_TRUE(spec_draft_mxfp4(c.draft_quant, "cuda"));
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2,"
                                "\"draft_quantization\":\"none\"}", &c, &e));
    ASSERT_EQ(c.draft_quant, SPEC_DRAFT_NONE);
    ASSERT_TRUE(!spec_draft_mxfp4(c.draft_quant, "cpu"));
    /* no key, null and "auto": MXFP4 drafts on the CPU backend only */
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2}", &c, &e));
    ASSERT_EQ(c.draft_quant, SPEC_DRAFT_AUTO);
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2,"
                                "\"draft_quantization\":\"auto\"}", &c, &e));
    ASSERT_EQ(c.draft_quant, SPEC_DRAFT_AUTO);
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2,"
                                "\"draft_quantization\":null}", &c, &e));
    ASSERT_EQ(c.draft_quant, SPEC_DRAFT_AUTO);
    ASSERT_TRUE(spec_draft_mxfp4(c.draft_quant, "cpu"));
    ASSERT_TRUE(!spec_draft_mxfp4(c.draft_quant, "cuda"));
    ASSERT_ERR(spec_config_parse("{\"method\":\"mtp\",\"num_speculative_tokens\":2,"
                                 "\"draft_quantization\":\"fp8\"}", &c, &e), -EINVAL);
    ASSERT_TRUE(strstr(e.msg, "draft_quantization") != NULL);
}

/* The grammar mask (sampling_params.allow): only allowed ids are drawn, greedy (its fast path
 * and the processors' path agree, lowest id on ties) and sampled; none allowed gives id 0. */
#define NV 1000
static void test_allow_mask(void)
{
    struct sampler *s;
    struct sampling_params sp;
    struct sampler_bias nop = { .token = 3, .bias = 0.0f };
    float x[NV];
    uint32_t allow[(NV + 31) / 32];

    ASSERT_OK(sampler_new(NV, &s));
    for (int round = 0; round < 50; round++) {
        memset(allow, 0, sizeof(allow));
        for (int i = 0; i < NV; i++) {
            x[i] = (float) ((i * 7919 + round * 104729) % 97) * 0.1f;   /* ties on purpose */
            if ((i * 31 + round) % 13 == 0)
                allow[i / 32] |= 1u << (i % 32);
        }
        sampling_params_init(&sp);
        sp.allow = allow;
        int32_t fast = sampler_sample(s, &sp, NULL, x, 0, 0);
        sp.n_logit_bias = 1;                /* a no-op processor: the full path */
        sp.logit_bias = &nop;
        int32_t full = sampler_sample(s, &sp, NULL, x, 0, 0);
        ASSERT_EQ(fast, full);
        ASSERT_TRUE(allow[fast / 32] >> (fast % 32) & 1u);
        for (int i = 0; i < NV; i++)
            if (allow[i / 32] >> (i % 32) & 1u)
                ASSERT_TRUE(x[i] < x[fast] || (x[i] == x[fast] && i >= fast));
        sp.n_logit_bias = 0;
        sp.temperature = 1.0f;
        sp.seed = (uint64_t) round;
        for (int k = 0; k < 20; k++) {
            int32_t t = sampler_sample(s, &sp, NULL, x, (uint64_t) k, 0);
            ASSERT_TRUE(allow[t / 32] >> (t % 32) & 1u);
        }
    }
    memset(allow, 0, sizeof(allow));
    sampling_params_init(&sp);
    sp.allow = allow;
    ASSERT_EQ(sampler_sample(s, &sp, NULL, x, 0, 0), 0);
    sampler_free(s);
}

/* sampler_takes_argmax: true exactly where sampler_sample's choice is the raw argmax; each
 * processor that moves a logit, a ban in force and a grammar mask make it false. */
static void test_takes_argmax(void)
{
    struct sampler *s = smp(V);
    struct sampling_params sp;
    struct sampler_bias b = { .token = 5, .bias = 3.0f };
    const int32_t ban[] = { 2 }, hist[] = { 2, 2, 2, 2 };
    const float x[V] = { 0.1f, 0.2f, 2.0f, 0.3f, 1.9f, 0.0f, 0.4f, 0.5f };
    uint32_t allow = 0xfbu;     /* all but id 2 */
    struct sampler_hist h = { .tokens = hist, .n_prompt = 2, .n_output = 2 };

    sampling_params_init(&sp);
    ASSERT_TRUE(sampler_takes_argmax(&sp, 0));
    ASSERT_EQ(sampler_sample(s, &sp, &h, x, 0, 0), sampler_argmax(x, V));
    sp.temperature = 0.7f;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    sampling_params_init(&sp);
    sp.n_logit_bias = 1;
    sp.logit_bias = &b;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    ASSERT_EQ(sampler_sample(s, &sp, &h, x, 0, 0), 5);
    sampling_params_init(&sp);
    sp.repetition_penalty = 2.0f;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    ASSERT_EQ(sampler_sample(s, &sp, &h, x, 0, 0), 4);
    sampling_params_init(&sp);
    sp.presence_penalty = 0.5f;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    sampling_params_init(&sp);
    sp.frequency_penalty = 0.5f;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    sampling_params_init(&sp);
    sp.min_tokens = 3;          /* id 2 banned while fewer than 3 outputs exist */
    sp.ban = ban;
    sp.n_ban = 1;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 2));
    ASSERT_EQ(sampler_sample(s, &sp, &h, x, 0, 0), 4);
    ASSERT_TRUE(sampler_takes_argmax(&sp, 3));
    sp.n_ban = 0;
    ASSERT_TRUE(sampler_takes_argmax(&sp, 0));
    sampling_params_init(&sp);
    sp.allow = &allow;
    ASSERT_TRUE(!sampler_takes_argmax(&sp, 0));
    ASSERT_EQ(sampler_sample(s, &sp, &h, x, 0, 0), 4);
    sampler_free(s);
}

/* The k best of x[0 .. n) in backend_argmax's order (larger value first, equal values by
 * lower id), by a full stable sort: the reference candidates. */
static const float *cand_x;
static int cand_cmp(const void *a, const void *b)
{
    int32_t i = *(const int32_t *) a, j = *(const int32_t *) b;
    if (cand_x[i] != cand_x[j])
        return cand_x[i] > cand_x[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* sampler_sample_cands from a row's top-k pairs (and its softmax mass, added as
 * backend_row_expsum's CPU oracle adds it) draws the token sampler_sample draws from the
 * whole row, for the same seed and index, over mixes of temperature, top_k (up to
 * SAMPLER_CANDS_MAX, past the place count of some steps' k), top_p and min_p, on rows
 * with many exact ties (coarse values) and with -inf entries; greedy rows take place 0. */
static void test_cands_same_tokens(void)
{
    enum { VV = 3000 };
    struct sampler *s = smp(VV);
    static float logits[VV], vals[SAMPLER_CANDS_MAX];
    static int32_t order[VV], ids[SAMPLER_CANDS_MAX];
    static const int ks[] = { 1, 2, 7, 20, 40, 50, 64 };
    static const float ps[] = { 1.0f, 0.9f, 0.5f, 0.97f, 0.2f };
    static const float mps[] = { 0.0f, 0.05f, 0.3f };
    static const float ts[] = { 0.0f, 0.3f, 0.7f, 1.0f, 1.6f };
    uint64_t z = 11;
    int n_draws = 0, n_distinct_ks = 0, n_cut = 0;

    for (int trial = 0; trial < 60; trial++) {
        for (int i = 0; i < VV; i++) {
            z = z * 6364136223846793005ull + 1442695040888963407ull;
            double u = (double) ((z >> 33) % 2000000) / 2000000.0;
            /* coarse (ties), peaked (top_p cuts inside the top_k), flat */
            logits[i] = trial % 3 == 0 ? (float) ((z >> 40) % 40) / 4.0f
                      : trial % 3 == 1 ? (float) (12.0 * pow(u, 40.0)) : (float) (20.0 * u);
            if (trial % 7 == 3 && (z >> 20) % 9 == 0)
                logits[i] = -INFINITY;
        }
        for (int i = 0; i < VV; i++)
            order[i] = i;
        cand_x = logits;
        qsort(order, VV, sizeof(int32_t), cand_cmp);
        struct sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = ts[trial % 5];
        sp.top_k = ks[trial % 7];
        sp.top_p = ps[(trial / 2) % 5];
        sp.min_p = mps[(trial / 3) % 3];
        sp.seed = 1000u + (uint64_t) trial;
        ASSERT_TRUE(sampler_takes_cands(&sp, 0, VV, SAMPLER_CANDS_MAX));
        /* the step's k: this row's top_k or a larger one asked by another row */
        int k = trial % 2 ? sp.top_k : SAMPLER_CANDS_MAX;
        n_distinct_ks += k != sp.top_k;
        for (int j = 0; j < k; j++) {
            ids[j] = order[j];
            vals[j] = logits[order[j]];
        }
        double sum = 0.0;
        for (int i = 0; sp.temperature > 0.0f && i < VV; i++)
            sum += expf((logits[i] - vals[0]) / sp.temperature);
        const struct sampler_cands c = { .k = k, .vals = vals, .ids = ids, .sum = sum };
        for (uint64_t idx = 0; idx < 200; idx++) {
            int32_t full = sampler_sample(s, &sp, NULL, logits, idx, SAMPLER_STREAM_TOKEN);
            int32_t cand = sampler_sample_cands(&sp, &c, idx, SAMPLER_STREAM_TOKEN);
            if (full != cand)
                FAIL("trial %d (T=%g k=%d/%d p=%g min_p=%g) index %llu: full %d, candidates %d",
                     trial, (double) sp.temperature, sp.top_k, k, (double) sp.top_p,
                     (double) sp.min_p, (unsigned long long) idx, full, cand);
            n_draws++;
            n_cut += full != ids[0];
        }
    }
    printf("candidates: %d draws equal to the full row's (%d not the argmax), %d with a "
           "step k above the row's top_k\n", n_draws, n_cut, n_distinct_ks);
    ASSERT_TRUE(n_cut > n_draws / 4);
    sampler_free(s);
}

/* Which rows can be drawn from candidates: a penalty, a logit bias, a min_tokens ban in
 * force, a grammar mask, no top_k, or a top_k above the limit keep the whole row. */
static void test_takes_cands(void)
{
    struct sampling_params sp;
    const struct sampler_bias b = { .token = 3, .bias = 1.0f };
    const int32_t ban = 2;
    const uint32_t allow[1] = { 0xffu };

    sampling_params_init(&sp);
    ASSERT_TRUE(sampler_takes_cands(&sp, 0, V, 4));            /* greedy */
    sp.temperature = 0.8f;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));           /* no top_k */
    sp.top_k = 5;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));           /* above k_max */
    sp.top_k = 4;
    sp.top_p = 0.9f;
    sp.min_p = 0.1f;
    ASSERT_TRUE(sampler_takes_cands(&sp, 0, V, 4));
    sp.top_k = V;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 64));          /* not below the vocabulary */
    sp.top_k = 4;
    sp.repetition_penalty = 1.1f;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));
    sp.repetition_penalty = 1.0f;
    sp.presence_penalty = 0.5f;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));
    sp.presence_penalty = 0.0f;
    sp.frequency_penalty = -0.5f;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));
    sp.frequency_penalty = 0.0f;
    sp.n_logit_bias = 1;
    sp.logit_bias = &b;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 0, V, 4));
    sp.n_logit_bias = 0;
    sp.min_tokens = 2;
    sp.n_ban = 1;
    sp.ban = &ban;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 1, V, 4));           /* ban in force */
    ASSERT_TRUE(sampler_takes_cands(&sp, 2, V, 4));            /* ban over */
    sp.allow = allow;
    ASSERT_TRUE(!sampler_takes_cands(&sp, 2, V, 4));
}

int main(void)
{
    test_params_check();
    test_greedy_and_processors();
    test_truncation_matches_full_sort();
    test_seeded();
    test_chisq_helper();
    test_rejection_chi_square();
    test_spec_config();
    test_allow_mask();
    test_takes_argmax();
    test_cands_same_tokens();
    test_takes_cands();
    printf("sampler: ok\n");
    return 0;
}
