/* test-cuda-logits.c - the CUDA forward against the CPU backend on a real checkpoint: the
 * tiny model, or a synthetic full-width one from stepd-mkmodel.
 *
 *   test-cuda-logits MODEL_DIR [fast|exact] [--steps N] [--prompt P] [--seqs S]
 *   test-cuda-logits MODEL_DIR [fast|exact] --greedy N [--mtp K] [--argmax] [--greedy-prompt IDS]
 *   test-cuda-logits MODEL_DIR [fast|exact] --sampled N [--greedy-prompt IDS]
 *
 * Both models run the same plans: S sequences with prompts of P (and P+3, P+6, ..) random
 * tokens in one prefill step, then N decode steps of all of them at once, the next token
 * of each the CPU's argmax (greedy).  Every step's logits rows are compared:
 *   relative RMS error  rms(gpu - cpu) / rms(cpu)   <= TOL_RMS (fast: BF16 activations,
 *                                                      exact: FP32 op path TOL_RMS_EXACT)
 *   top-1 agreement     on every row whose CPU top-2 margin exceeds MARGIN * rms(cpu)
 * Decode steps of S sequences are graph shapes (bucket S), so with graphs on (the default)
 * the check covers capture and replay; STEPD_CUDA_NO_GRAPHS=1 runs them eagerly.
 * --greedy: both models decode N tokens greedily from a fixed prompt, speculatively with K
 * MTP drafts (verify runs of K + 1 tokens, the longest prefix equal to the argmax kept):
 * the GPU's tokens must equal the CPU exact path's: token for token on the exact path; on
 * the fast path (BF16 activations, logits within TOL_RMS) up to the first token whose CPU
 * top-2 margin is at most MARGIN * rms(cpu logits), where a flip is within the tolerance
 * and the two sequences may part (margin-aware; the tiny model's margin at token 28 is
 * 0.71 % of the RMS).  The prompt: 17 fixed ids, or --greedy-prompt's comma-separated ids
 * (at most 17; on the emulator a short prompt saves most of the run: each prompt token costs
 * the trunk and every MTP depth a row).
 * --argmax: the second model chooses its tokens and drafts on the backend (model_step_argmax,
 * model_mtp_step_argmax: backend_argmax), and must have copied no logits to the host.
 * --sampled: the second model decodes N sampled tokens (temperatures, top_k 50 and 64, top_p,
 * min_p varying by step) from the prompt; every step runs twice on the same plan, through
 * model_step (the FP32 row to the host) and model_step_topk (k pairs and the row's softmax
 * mass): the candidates must equal the CPU op's (backend_argmax, the oracle) on the copied
 * row bit for bit, the sum the CPU op's within FP32 rounding (1e-6 relative), and the token
 * sampler_sample_cands draws the one sampler_sample draws from the row for the same seed;
 * the bytes each form copied per step are printed (both must be exact: V x 4 and k x 8 + 8).
 * STEPD_TEST_CPU_ONLY=1 puts the second model on the CPU backend too (a check of the test
 * itself where there is no GPU: K drafts must not change the greedy tokens).
 * Exits 77 without a GPU or the plugin.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "harness.h"
#include "loader.h"
#include "model.h"
#include "sampler.h"

#define BS 16
#define MAXLEN 512
#define NSEQ 8
#define TPLAN_SEED 0x853c49e6748fea9bull
#include "tplan.h"

#define TOL_RMS 0.05
#define TOL_RMS_EXACT 2e-4
#define MARGIN 0.05

static double now_sec(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int argmax(const float *v, int n, float *ret_margin)
{
    int b = 0, s = -1;

    for (int i = 1; i < n; i++)
        if (v[i] > v[b])
            b = i;
    for (int i = 0; i < n; i++)
        if (i != b && (s < 0 || v[i] > v[s]))
            s = i;
    *ret_margin = s < 0 ? INFINITY : v[b] - v[s];
    return b;
}

/* Compare rows of logits; returns the worst relative RMS error, counts top-1 checks. */
static double compare_rows(const char *what, const float *cpu, const float *gpu, int rows, int V,
                           int *n_checked, int *n_agree)
{
    double worst = 0;

    for (int r = 0; r < rows; r++) {
        const float *c = cpu + (size_t)r * V, *g = gpu + (size_t)r * V;
        double se = 0, sc = 0;
        float margin, gm;
        int ac, ag;

        for (int i = 0; i < V; i++) {
            double d = (double)g[i] - c[i];
            if (isnan(g[i]))
                FAIL("%s row %d: GPU logit %d is NaN", what, r, i);
            se += d * d;
            sc += (double)c[i] * c[i];
        }
        double rel = sqrt(se / (sc > 0 ? sc : 1));
        worst = rel > worst ? rel : worst;
        ac = argmax(c, V, &margin);
        ag = argmax(g, V, &gm);
        if (margin > MARGIN * sqrt(sc / V)) {
            (*n_checked)++;
            *n_agree += ac == ag;
            if (ac != ag)
                printf("  %s row %d: top-1 %d (CPU) vs %d (GPU), margin %.4g\n", what, r, ac, ag,
                       margin);
        }
    }
    return worst;
}

/* Greedy decoding of n_gen tokens after `prompt`, with K MTP drafts per verify step
 * (model.h: model_mtp_step after each trunk step of the same plan). */
static double rms_of(const float *v, int n)
{
    double s = 0;

    for (int i = 0; i < n; i++)
        s += (double)v[i] * v[i];
    return sqrt(s / n);
}

/* out[i]: the greedy tokens; rel_margin[i] (when not NULL): the top-2 margin of the row
 * that chose out[i] over that row's RMS.  on_dev: the model's greedy forms choose on the
 * backend (model_step_argmax, model_mtp_step_argmax), no logits row reaches the host. */
static void greedy(struct model *m, int V, const int32_t *prompt, int n_prompt, int n_gen, int K,
                   bool on_dev, int32_t *out, double *rel_margin)
{
    float *logits = malloc(sizeof(float) * (size_t)(K + 1) * V), *ml = malloc(sizeof(float) * V);
    int32_t run[16], drafts[16], dev_ids[16];
    int n_out = 0, pos = 0, n_valid;
    struct tplan tp;
    float mg;

    ASSERT_TRUE(logits && ml && K < 16);
    tp_init(&tp);
    tp_add_run(&tp, 0, 0, prompt, n_prompt, 1, K, 0);
    if ((on_dev ? model_step_argmax(m, &tp.p, dev_ids) : model_step(m, &tp.p, logits)) < 0)
        FAIL("prefill: %s", model_last_error(m));
    out[n_out++] = on_dev ? dev_ids[0] : argmax(logits, V, &mg);
    if (rel_margin)
        rel_margin[n_out - 1] = mg / rms_of(logits, V);
    n_valid = n_prompt;
    while (n_out < n_gen) {
        /* drafts from the MTP chain of the step just run: depth 0 reads the token that
         * follows the run's valid part, depth k > 0 the draft of depth k - 1 */
        int32_t tok = out[n_out - 1];
        for (int k = 0; k < K; k++) {
            if ((on_dev ? model_mtp_step_argmax(m, k, &tp.p, &n_valid, &tok, dev_ids)
                        : model_mtp_step(m, k, &tp.p, &n_valid, &tok, ml)) < 0)
                FAIL("mtp depth %d: %s", k, model_last_error(m));
            drafts[k] = on_dev ? dev_ids[0] : argmax(ml, V, &mg);
            tok = drafts[k];
        }
        pos += n_valid;
        run[0] = out[n_out - 1];
        for (int k = 0; k < K; k++)
            run[1 + k] = drafts[k];
        tp_init(&tp);
        tp_add_run(&tp, 0, pos, run, K + 1, K + 1, K, 0);
        if ((on_dev ? model_step_argmax(m, &tp.p, dev_ids) : model_step(m, &tp.p, logits)) < 0)
            FAIL("verify at %d: %s", pos, model_last_error(m));
        /* row i predicts the token after run[i]: keep drafts while they match */
        n_valid = 1;
        for (int i = 0; i <= K && n_out < n_gen; i++) {
            int32_t g = on_dev ? dev_ids[i] : argmax(logits + (size_t)i * V, V, &mg);
            if (rel_margin)
                rel_margin[n_out] = mg / rms_of(logits + (size_t)i * V, V);
            out[n_out++] = g;
            if (i == K || run[i + 1] != g)
                break;
            n_valid++;
        }
    }
    free(logits);
    free(ml);
}

/* --sampled: n_gen tokens sampled on m from prompt, each step through both forms (above);
 * the CPU backend cpu is the oracle of the candidates and sums. */
static void sampled(struct model *m, struct backend *cpu, int V, const int32_t *prompt,
                    int n_prompt, int n_gen)
{
    enum { KC = 64 };
    static const float temps[] = { 0.8f, 1.2f, 0.6f, 1.0f };
    static const float top_ps[] = { 0.9f, 1.0f, 0.7f, 0.95f };
    static const float min_ps[] = { 0.0f, 0.05f, 0.0f, 0.1f };
    float *logits = malloc(sizeof(float) * V), vals[KC], cv[KC];
    int32_t ids[KC], ci[KC], tok = 0;
    struct sampler *smp;
    struct tplan tp;
    int pos = 0, n_top_p = 0, last_k = 0;
    bool last_sum = false;
    uint64_t full_b = 0, cand_b = 0;

    ASSERT_TRUE(logits);
    ASSERT_OK(sampler_new(V, &smp));
    for (int i = 0; i < n_gen; i++) {
        struct sampling_params sp;
        sampling_params_init(&sp);
        sp.temperature = temps[i % 4];
        sp.top_k = i % 3 ? 50 : KC;
        sp.top_p = top_ps[i % 4];
        sp.min_p = min_ps[i % 4];
        sp.seed = 4242;
        ASSERT_TRUE(sampler_takes_cands(&sp, i, V, KC));
        tp_init(&tp);
        if (i == 0)
            tp_add_run(&tp, 0, 0, prompt, n_prompt, 1, 0, 0);
        else
            tp_add_run(&tp, 0, pos, &tok, 1, 1, 0, 0);
        uint64_t b0 = model_logits_host_bytes(m);
        if (model_step(m, &tp.p, logits) < 0)
            FAIL("sampled step %d: %s", i, model_last_error(m));
        uint64_t b1 = model_logits_host_bytes(m);
        double sum, ref_sum;
        const float *tp_temps = sp.top_p < 1.0f ? &sp.temperature : NULL;
        if (model_step_topk(m, &tp.p, sp.top_k, tp_temps, ids, vals, &sum) < 0)
            FAIL("sampled step %d (candidates): %s", i, model_last_error(m));
        uint64_t b2 = model_logits_host_bytes(m);
        full_b = b1 - b0;
        cand_b = b2 - b1;
        ASSERT_EQ(full_b, (uint64_t)V * 4);
        ASSERT_EQ(cand_b, (uint64_t)sp.top_k * 8 + (tp_temps ? 8 : 0));
        /* the candidates: the CPU op's on the row the same step copied */
        ASSERT_OK(backend_argmax(cpu, logits, 1, V, sp.top_k, ci, cv));
        for (int j = 0; j < sp.top_k; j++)
            if (ids[j] != ci[j] || memcmp(&vals[j], &cv[j], 4))
                FAIL("sampled step %d place %d: device %d (%g), cpu %d (%g)", i, j, ids[j],
                     vals[j], ci[j], cv[j]);
        if (tp_temps) {
            ASSERT_OK(backend_row_expsum(cpu, logits, 1, V, &cv[0], tp_temps, &ref_sum));
            if (!(fabs(sum - ref_sum) <= 1e-6 * ref_sum))
                FAIL("sampled step %d: softmax mass %.9g on the device, %.9g on the cpu", i, sum,
                     ref_sum);
            n_top_p++;
        }
        const struct sampler_cands c = { .k = sp.top_k, .vals = vals, .ids = ids,
                                         .sum = tp_temps ? sum : 0.0 };
        int32_t full = sampler_sample(smp, &sp, NULL, logits, (uint64_t)i, SAMPLER_STREAM_TOKEN);
        int32_t cand = sampler_sample_cands(&sp, &c, (uint64_t)i, SAMPLER_STREAM_TOKEN);
        if (full != cand)
            FAIL("sampled token %d: %d from the row, %d from the candidates", i, full, cand);
        pos += i == 0 ? n_prompt : 1;
        tok = full;
        last_k = sp.top_k;
        last_sum = tp_temps != NULL;
    }
    printf("sampled: %d tokens from candidates equal the row's (%d steps with a top_p sum); "
           "bytes copied to the host by the last step: %llu (row) -> %llu (top-%d pairs%s)\n", n_gen,
           n_top_p, (unsigned long long)full_b, (unsigned long long)cand_b, last_k,
           last_sum ? " and a sum" : "");
    printf("sampled: at the full vocabulary (128896) a row is %d bytes, top-50 pairs and a sum "
           "%d\n", 128896 * 4, 50 * 8 + 8);
    sampler_free(smp);
    free(logits);
}

int main(int argc, char **argv)
{
    struct err_buf e = {{0}};
    struct backend *cpu, *gpu;
    struct ckpt *ck;
    struct model *mc, *mg;
    bool exact = false;
    int steps = 6, prompt = 12, n_seqs = 2, n_greedy = 0, n_sampled = 0, K = 0, r;
    bool on_dev = false;
    const char *greedy_prompt = NULL;

    if (argc < 2)
        FAIL("usage: test-cuda-logits MODEL_DIR [fast|exact] [--steps N] [--prompt P] [--seqs S]");
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "exact") == 0)
            exact = true;
        else if (strcmp(argv[i], "fast") == 0)
            exact = false;
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--prompt") == 0 && i + 1 < argc)
            prompt = atoi(argv[++i]);
        else if (strcmp(argv[i], "--seqs") == 0 && i + 1 < argc)
            n_seqs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--greedy") == 0 && i + 1 < argc)
            n_greedy = atoi(argv[++i]);
        else if (strcmp(argv[i], "--mtp") == 0 && i + 1 < argc)
            K = atoi(argv[++i]);
        else if (strcmp(argv[i], "--sampled") == 0 && i + 1 < argc)
            n_sampled = atoi(argv[++i]);
        else if (strcmp(argv[i], "--argmax") == 0)
            on_dev = true;
        else if (strcmp(argv[i], "--greedy-prompt") == 0 && i + 1 < argc)
            greedy_prompt = argv[++i];
        else
            FAIL("unknown argument '%s'", argv[i]);
    }
    ASSERT_TRUE(n_seqs >= 1 && n_seqs <= NSEQ && prompt >= 1 && steps >= 0);
    ASSERT_TRUE(prompt + 3 * (n_seqs - 1) + steps + 1 <= MAXLEN);

    ASSERT_TRUE(n_greedy >= 0 && n_greedy < MAXLEN / 2 && K >= 0 && K <= 8);
    const bool cpu_only = getenv("STEPD_TEST_CPU_ONLY") != NULL;
    struct backend_cfg gc = { .n_threads = 1, .device = 0, .mxfp4_exact = exact || cpu_only };
    r = backend_new(cpu_only ? "cpu" : "cuda", &gc, &gpu);
    if (r == -ENODEV || r == -EINVAL) {
        printf("SKIP: no CUDA backend here (%s)\n", strerror(-r));
        return TEST_SKIP;
    }
    ASSERT_OK(r);
    struct backend_cfg cc = { .n_threads = 0, .mxfp4_exact = true };
    ASSERT_OK(backend_new("cpu", &cc, &cpu));
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = K };
    if (ckpt_open(argv[1], &co, &ck, &e) < 0)
        FAIL("ckpt_open %s: %s", argv[1], e.msg);
    const struct model_config *cfg = ckpt_config(ck);
    const int V = cfg->vocab_size;
    struct model_opts mo = {
        .max_tokens_per_step = MAXLEN, .max_seqs = NSEQ, .max_logit_rows = NSEQ + 8,
        .block_size = BS, .n_blocks = { NBLK, NBLK }, .max_seq_len = MAXLEN,
        .kv_f32 = true,         /* the CPU oracle keeps FP32 KV */
    };
    double t0 = now_sec();
    if (model_new(ck, cpu, NULL, &mo, &mc, &e) < 0)
        FAIL("model_new (cpu): %s", e.msg);
    double t1 = now_sec();
    mo.kv_f32 = exact;      /* the GPU's fast path on BF16 pages, its exact path on FP32 */
    if (model_new(ck, gpu, NULL, &mo, &mg, &e) < 0)
        FAIL("model_new (cuda): %s", e.msg);
    printf("%s: hidden %d, %d layers, vocab %d; loaded in %.1f s (cpu) and %.1f s (cuda, %s)\n",
           argv[1], cfg->hidden_size, cfg->n_layers, V, t1 - t0, now_sec() - t1,
           exact ? "exact" : "fast");

    tables_shuffle();
    if (n_sampled > 0) {
        int32_t pr[1] = { 31 % V };

        if (greedy_prompt)
            pr[0] = (int32_t)(atoi(greedy_prompt) % V);
        ASSERT_TRUE(n_sampled < MAXLEN / 2);
        sampled(mg, cpu, V, pr, 1, n_sampled);
        model_free(mg);
        model_free(mc);
        ckpt_close(ck);
        backend_free(gpu);
        backend_free(cpu);
        return 0;
    }
    if (n_greedy > 0) {
        static const int32_t ids[] = { 0, 11, 523, 97, 1024, 77, 5, 900, 31, 2047, 12, 400, 401,
                                       402, 88, 19, 3000 };
        int np = (int)(sizeof(ids) / sizeof(ids[0]));
        int32_t *oc = malloc(sizeof(int32_t) * n_greedy), *og = malloc(sizeof(int32_t) * n_greedy);
        double *mc_rel = malloc(sizeof(double) * n_greedy);
        const bool strict = cpu_only || exact;
        const char *who = cpu_only ? "cpu" : exact ? "cuda exact" : "cuda fast";
        int32_t pr[17];
        int same = n_greedy;

        ASSERT_TRUE(oc && og && mc_rel && ckpt_mtp_depth(ck) >= K);
        for (int i = 0; i < np; i++)
            pr[i] = ids[i] % V;
        if (greedy_prompt) {
            char *end;
            const char *p = greedy_prompt;

            for (np = 0;; p = end + 1) {
                long id = strtol(p, &end, 10);
                if (end == p || id < 0 || id >= V || np == 17 || (*end && *end != ','))
                    FAIL("--greedy-prompt '%s': expected up to 17 comma-separated ids below %d",
                         greedy_prompt, V);
                pr[np++] = (int32_t)id;
                if (!*end)
                    break;
            }
        }
        greedy(mc, V, pr, np, n_greedy, 0, false, oc, mc_rel); /* the reference: no drafts */
        greedy(mg, V, pr, np, n_greedy, K, on_dev, og, NULL);
        /* --argmax: every choice was made on the backend, no logits row was copied */
        printf("greedy: %llu bytes of logits copied to the host (cpu reference), %llu (%s%s)\n",
               (unsigned long long)model_logits_host_bytes(mc),
               (unsigned long long)model_logits_host_bytes(mg), cpu_only ? "cpu" : "cuda",
               on_dev ? ", greedy forms" : "");
        if (on_dev && model_logits_host_bytes(mg) != 0)
            FAIL("greedy forms copied %llu bytes of logits to the host",
                 (unsigned long long)model_logits_host_bytes(mg));
        for (int i = 0; i < n_greedy; i++) {
            if (oc[i] == og[i])
                continue;
            if (strict || mc_rel[i] > MARGIN)
                FAIL("greedy token %d: %d (cpu exact, K = 0) vs %d (%s, K = %d), CPU top-2 "
                     "margin %.2f%% of the logit RMS", i, oc[i], og[i], who, K, 100 * mc_rel[i]);
            printf("greedy token %d: %d (cpu exact) vs %d (%s, K = %d) where the CPU top-2 margin "
                   "is %.2f%% of the logit RMS (<= %.0f%%: within the fast path's tolerance)\n",
                   i, oc[i], og[i], who, K, 100 * mc_rel[i], 100 * MARGIN);
            same = i;
            break;
        }
        int lo = 0;
        for (int i = 1; i < n_greedy; i++)
            lo = mc_rel[i] < mc_rel[lo] ? i : lo;
        printf("greedy: the CPU's smallest top-2 margin is %.2f%% of the logit RMS, at token %d\n",
               100 * mc_rel[lo], lo);
        if (same == n_greedy)
            printf("greedy: %d tokens with K = %d on %s equal the CPU exact path's\n", n_greedy, K,
                   cpu_only ? "the CPU" : "CUDA");
        else
            printf("greedy: %d of %d tokens with K = %d on %s equal the CPU exact path's, then a "
                   "near-tie\n", same, n_greedy, K, who);
        free(mc_rel);
        model_free(mg);
        model_free(mc);
        ckpt_close(ck);
        backend_free(gpu);
        backend_free(cpu);
        free(oc);
        free(og);
        return 0;
    }
    float *lc = malloc(sizeof(float) * (size_t)NSEQ * V), *lg = malloc(sizeof(float) * (size_t)NSEQ * V);
    int32_t toks[NSEQ][MAXLEN], len[NSEQ];
    ASSERT_TRUE(lc && lg);
    for (int s = 0; s < n_seqs; s++) {
        len[s] = prompt + 3 * s;
        for (int i = 0; i < len[s]; i++)
            toks[s][i] = (int32_t)(rnd() % (uint32_t)V);
    }
    int n_checked = 0, n_agree = 0;
    double worst = 0, tc = 0, tg = 0;
    for (int step = 0; step <= steps; step++) {
        struct tplan tp;
        char what[32];

        tp_init(&tp);
        for (int s = 0; s < n_seqs; s++) {
            if (step == 0)
                tp_add_run(&tp, s, 0, toks[s], len[s], 1, 0, 0);
            else
                tp_add_run(&tp, s, len[s] - 1, &toks[s][len[s] - 1], 1, 1, 0, 0);
        }
        for (int i = 0; i < n_seqs * V; i++)
            lg[i] = NAN;        /* poisoned: every row must be written */
        double a = now_sec();
        r = model_step(mc, &tp.p, lc);
        if (r < 0)
            FAIL("cpu step %d: %s", step, model_last_error(mc));
        double b = now_sec();
        r = model_step(mg, &tp.p, lg);
        if (r < 0)
            FAIL("cuda step %d: %s", step, model_last_error(mg));
        double c = now_sec();
        if (step > 1) {         /* the first decode step captures the graph */
            tc += b - a;
            tg += c - b;
        }
        snprintf(what, sizeof(what), step ? "decode %d" : "prefill", step);
        double w = compare_rows(what, lc, lg, n_seqs, V, &n_checked, &n_agree);
        printf("%-10s %d rows: relative RMS error %.3g\n", what, n_seqs, w);
        worst = w > worst ? w : worst;
        for (int s = 0; s < n_seqs; s++) {
            float m;
            toks[s][len[s]++] = argmax(lc + (size_t)s * V, V, &m);
        }
    }
    if (steps > 1)
        printf("decode step, %d sequences: cpu %.2f ms, cuda %.2f ms (medians not taken: means "
               "of %d)\n", n_seqs, 1e3 * tc / (steps - 1), 1e3 * tg / (steps - 1), steps - 1);
    const double tol = exact ? TOL_RMS_EXACT : TOL_RMS;
    printf("worst relative RMS error %.3g (tolerance %.3g); top-1 agreed on %d of %d rows with "
           "a margin\n", worst, tol, n_agree, n_checked);
    if (!(worst <= tol))
        FAIL("relative RMS error %.3g above %.3g", worst, tol);
    if (n_agree != n_checked)
        FAIL("top-1 differs on %d rows with a margin", n_checked - n_agree);
    model_free(mg);
    model_free(mc);
    ckpt_close(ck);
    backend_free(gpu);
    backend_free(cpu);
    free(lc);
    free(lg);
    return 0;
}
