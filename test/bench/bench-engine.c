/* bench-engine.c - serving-engine benchmark on the tiny checkpoint (or the mock).
 *
 *   bench-engine [MODEL_DIR | --mock] [--threads T] [--tokens N] [--draft-quant auto|none|mxfp4]
 *
 * --draft-quant: the MTP draft weights of the K=3 engine, as the speculative config's
 * "draft_quantization" (default auto: MXFP4 copies on this CPU backend); the other kind
 * runs beside it for comparison.
 * --threads: CPU backend threads; default 0, the production default (stepd-worker
 * --threads 0): one per CPU this process may run on.
 * --profile K S: only batch-1 decode with K drafts, over and over for S seconds (to run
 * under perf), then its rate.
 * --policy: only the draft policies: adaptive (spec-policy.h, max K = 3) against every fixed
 * K in 0..3 at concurrency 1, 4 and 16, interleaved rounds, medians and per-round ratios,
 * the depths the adaptive one chose, and its greedy outputs checked against K = 0's.
 * --policy-control: the same table with fixed K = 0 in the adaptive engine's place: the
 * noise floor of the comparison (an A/A run; its ratio to K = 0 should be 1 within noise).
 * --rounds N: the interleaved rounds of those tables (odd, 3..15; default 9).
 * --draft-vocab N: the same with K = 1 and K = 3 drafting over the engine's N most frequent
 * output tokens (engine_config.draft_vocab) beside the whole head, and the adaptive policy
 * with it: speed, acceptance per position and MTP time with and without.
 * --mock-mtp-usec U, --mock-accuracy A: the mock's cost of an MTP call and its drafts'
 * accuracy (defaults 300 us, 0.8), to put the policy where drafts pay or do not;
 * --sim (with --mock): the mock's costs and every engine's clock on simulated time (the
 * mock's nominal costs, nothing else): tok/s of a machine whose speed never wanders, the
 * policy's decisions alone, the same however loaded the host.
 * --mock-step-usec U, --mock-token-usec U: its step cost, fixed and per token (defaults
 * 2000 and 20: memory-bound, drafts pay at every batch size; a high per-token cost is a
 * compute-bound model, where they pay at batch 1 and lose in large batches).
 *
 * Prints, in one run: decode tokens/s at batch 1 with K = 0 and K = 3 and their ratio;
 * mean acceptance length and per-position acceptance; output throughput at concurrency
 * 1, 4 and 16 (closed loop: each client resubmits when its request ends) with the ratio
 * to concurrency 1; time to first token.  Figures only, no thresholds (targets on the
 * 2-core CI box: K=3 >= 1.5x at batch 1; concurrency 16 >= 4x concurrency 1).
 * --mock replaces the forward by worker/engine/mock.c with a memory-bound cost model (fixed
 * 2 ms per step + 20 us per token, 0.3 ms per MTP layer call, 80 % draft accuracy).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "benchlib.h"
#include "engine.h"
#include "log.h"
#include "spec.h"
#include "mock.h"
#include "../engine/model-rig.h"

struct client {
    struct bench *b;
    int id;
    int done_reqs;
    char rid[32];
    int seq;                /* the running request's prompt index */
    uint64_t hash;          /* FNV-1a of its output tokens so far */
};

#define MAX_HASHES 1024

struct bench {
    struct engine *e;
    int vocab;
    int n_prompt;
    int n_out;
    int k;
    int reqs_per_client;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int clients_left;
    long tokens;
    double ttft_sum;
    int ttft_n;
    double decode_tps_sum;
    int decode_n;
    struct spec_stats mtp;
    int seq;
    uint64_t hashes[MAX_HASHES];    /* output hash per prompt index (the run's seq) */
};

static void submit_next(struct client *c);

static void on_out(void *ud, const struct engine_output *o)
{
    struct client *c = ud;
    struct bench *b = c->b;
    for (int i = 0; i < o->n_tokens; i++)
        c->hash = (c->hash ^ (uint32_t) o->tokens[i]) * 0x100000001b3ull;
    if (!o->finished)
        return;
    pthread_mutex_lock(&b->lock);
    if (c->seq < MAX_HASHES)
        b->hashes[c->seq] = c->hash;
    b->tokens += o->n_completion;
    b->ttft_sum += o->timings.first_token_s;
    b->ttft_n++;
    if (o->n_completion > 1 && o->timings.decode_s > 0) {
        b->decode_tps_sum += (o->n_completion - 1) / o->timings.decode_s;
        b->decode_n++;
    }
    spec_stats_add(&b->mtp, &o->mtp);
    c->done_reqs++;
    bool more = c->done_reqs < b->reqs_per_client;
    if (!more && --b->clients_left == 0)
        pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
    if (more)
        submit_next(c);
}

static void submit_next(struct client *c)
{
    struct bench *b = c->b;
    int32_t prompt[512];
    static int global_seq;      /* ids unique over the whole benchmark */
    pthread_mutex_lock(&b->lock);
    int seq = b->seq++;
    int uid = global_seq++;
    pthread_mutex_unlock(&b->lock);
    c->seq = seq;
    c->hash = 0xcbf29ce484222325ull;
    for (int i = 0; i < b->n_prompt; i++)
        prompt[i] = (int32_t) ((i * 131 + seq * 977 + 7) % b->vocab);
    snprintf(c->rid, sizeof(c->rid), "c%d-%d", c->id, uid);
    struct engine_request q;
    struct err_buf err;
    engine_request_init(&q);
    q.id = c->rid;
    q.prompt = prompt;
    q.n_prompt = b->n_prompt;
    q.max_tokens = b->n_out;
    q.ignore_eos = true;
    q.num_speculative_tokens = b->k;
    if (engine_submit(b->e, &q, on_out, c, &err) < 0) {
        fprintf(stderr, "bench-engine: submit: %s\n", err.msg);
        exit(1);
    }
}

/* --sim: the mock's costs on a simulated clock that the engines read too (its calls advance
 * it by their nominal costs; the engine's own work takes no time there): the policy's
 * choices against the fixed K on a machine whose speed does not wander, the same on any
 * host however loaded */
static struct clk_sim bench_sim = { .us = 1000000 };
static bool use_sim;

/* An engine's thread: under --sim none (run_from steps the engine itself once every
 * request of a run is in, as a server's batch would hold them) */
static void start(struct engine *e)
{
    if (!use_sim)
        engine_start(e);
}

static double now_s(void)
{
    return use_sim ? (double) clk_sim_now_us(&bench_sim) * 1e-6 : bench_now();
}

struct result {
    double secs;
    double fwd_ms, mtp_ms, eng_ms; /* per engine step */
    double tok_per_step;
    double tokens, steps;   /* output tokens, engine steps */
    double out_tps;         /* output tokens / wall second over the run */
    double decode_tps;      /* mean per-request decode tokens/s */
    double ttft;
    struct spec_stats mtp;
    int n_reqs;
    uint64_t hashes[MAX_HASHES];
};

/* conc clients, each submitting reqs_per_client requests one after another; the prompts
 * are those of indices seq0, seq0 + 1, ... in the order the requests are submitted */
static struct result run_from(struct engine *e, int vocab, int conc, int k, int n_prompt,
                              int n_out, int reqs_per_client, int seq0)
{
    struct bench b = {
        .e = e, .vocab = vocab, .n_prompt = n_prompt, .n_out = n_out, .k = k,
        .reqs_per_client = reqs_per_client, .clients_left = conc, .seq = seq0,
    };
    pthread_mutex_init(&b.lock, NULL);
    pthread_cond_init(&b.cond, NULL);
    struct client *cl = calloc((size_t) conc, sizeof(*cl));
    struct engine_loads l0, l1;
    engine_get_loads(e, &l0);
    double t0 = now_s();
    for (int i = 0; i < conc; i++) {
        cl[i].b = &b;
        cl[i].id = i;
        submit_next(&cl[i]);
    }
    if (use_sim && engine_run_until_idle(e) < 0) {   /* every request in before the first step */
        fprintf(stderr, "bench-engine: a simulated run failed.\n");
        exit(1);
    }
    pthread_mutex_lock(&b.lock);
    while (b.clients_left > 0)
        pthread_cond_wait(&b.cond, &b.lock);
    pthread_mutex_unlock(&b.lock);
    struct result r = {
        .secs = now_s() - t0,
        .mtp = b.mtp,
    };
    r.out_tps = b.tokens / r.secs;
    r.tokens = (double) b.tokens;
    engine_get_loads(e, &l1);
    double steps = (double) (l1.n_steps - l0.n_steps);
    r.steps = steps;
    if (steps > 0) {
        r.fwd_ms = (l1.forward_s - l0.forward_s) * 1e3 / steps;
        r.mtp_ms = (l1.mtp_s - l0.mtp_s) * 1e3 / steps;
        r.eng_ms = (l1.engine_s - l0.engine_s) * 1e3 / steps;
        r.tok_per_step = (double) b.tokens / steps;
    }
    r.decode_tps = b.decode_n ? b.decode_tps_sum / b.decode_n : 0;
    r.ttft = b.ttft_n ? b.ttft_sum / b.ttft_n : 0;
    r.n_reqs = b.seq < MAX_HASHES ? b.seq : MAX_HASHES;
    memcpy(r.hashes, b.hashes, sizeof(r.hashes));
    free(cl);
    pthread_cond_destroy(&b.cond);
    pthread_mutex_destroy(&b.lock);
    return r;
}

static struct result run(struct engine *e, int vocab, int conc, int k, int n_prompt, int n_out,
                         int reqs_per_client)
{
    return run_from(e, vocab, conc, k, n_prompt, n_out, reqs_per_client, 0);
}

/* x's run into the sum acc (the policy table's sub-runs): tokens, seconds, steps and their
 * per-step times, MTP counts, and the output hashes of x's prompt indices */
static void result_merge(struct result *acc, const struct result *x)
{
    double steps = acc->steps + x->steps;

    if (steps > 0) {
        acc->fwd_ms = (acc->fwd_ms * acc->steps + x->fwd_ms * x->steps) / steps;
        acc->mtp_ms = (acc->mtp_ms * acc->steps + x->mtp_ms * x->steps) / steps;
        acc->eng_ms = (acc->eng_ms * acc->steps + x->eng_ms * x->steps) / steps;
    }
    acc->steps = steps;
    acc->tokens += x->tokens;
    acc->secs += x->secs;
    acc->out_tps = acc->secs > 0 ? acc->tokens / acc->secs : 0;
    acc->tok_per_step = steps > 0 ? acc->tokens / steps : 0;
    spec_stats_add(&acc->mtp, &x->mtp);
    for (int q = 0; q < x->n_reqs; q++)
        acc->hashes[q] = x->hashes[q];
    acc->n_reqs = x->n_reqs > acc->n_reqs ? x->n_reqs : acc->n_reqs;
}

#define BENCH_REPS 5

#define CONC_REPS 3

static double min_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}

static double max_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

/* median of n values (n odd, at most 16) */
static double median_of(const double *v, int n)
{
    double s[16];
    memcpy(s, v, (size_t) n * sizeof(*s));
    qsort(s, (size_t) n, sizeof(*s), bench_cmp_double);
    return s[n / 2];
}

static int cmp_decode(const void *a, const void *b)
{
    double x = ((const struct result *) a)->decode_tps, y = ((const struct result *) b)->decode_tps;
    return x < y ? -1 : x > y;
}

/* the round with the median batch-1 decode rate (n odd) */
static struct result median_result(const struct result *r, int n)
{
    struct result s[BENCH_REPS];
    memcpy(s, r, (size_t) n * sizeof(*s));
    qsort(s, (size_t) n, sizeof(*s), cmp_decode);
    return s[n / 2];
}

static void print_acceptance(const char *what, const struct spec_stats *m)
{
    printf("%s acceptance: mean acceptance length %.3f (tokens per verification step); "
           "drafts %llu, draft tokens %llu, accepted %llu; per position", what,
           spec_stats_mean_accept_len(m), (unsigned long long) m->n_drafts,
           (unsigned long long) m->n_draft_tokens, (unsigned long long) m->n_accepted);
    for (int p = 0; p < 3; p++)
        printf(" %d: %.3f", p + 1,
               m->n_drafts ? (double) m->accepted_per_pos[p] / (double) m->n_drafts : 0.0);
    printf("\n");
}

/* The model's draft weights for q on the (CPU) backend of the rig. */
static enum model_draft_quant dq_of(enum spec_draft_quant q)
{
    return spec_draft_mxfp4(q, "cpu") ? MODEL_DRAFT_MXFP4 : MODEL_DRAFT_CHECKPOINT;
}

static const char *dq_name(enum model_draft_quant dq)
{
    return dq == MODEL_DRAFT_MXFP4 ? "MXFP4 drafts" : "the checkpoint's BF16 drafts";
}

/* The adaptive policy's own counts (spec_policy_stats), over the engine's life (the
 * learning runs included): per batch-size bucket the decode steps, the share that drafted
 * and that probed, and the gate's measured ratio (drafting / none, from its window pairs);
 * "in the better arm": the share of the steps that drafted where the pairs measured drafting
 * faster, or that did not where they measured it slower.  Counted in decisions, not seconds:
 * it does not move with the host's load the way tok/s does. */
static void print_policy(const char *name, const struct spec_policy_stats *st)
{
    if (!st->decisions)
        return;
    printf("%s: %llu decisions, %llu probes, %llu gate switches\n", name,
           (unsigned long long) st->decisions, (unsigned long long) st->probes,
           (unsigned long long) st->gate_switches);
    for (int b = 0; b < SPEC_POLICY_BUCKETS; b++) {
        const struct spec_policy_bucket *x = &st->b[b];
        double n = (double) x->cycles;

        if (!x->cycles)
            continue;
        printf("  %3d-%-3d sequences: %7llu steps, drafted %5.1f %%, probes %4.1f %%", 1 << b,
               (2 << b) - 1, (unsigned long long) x->cycles, 100.0 * (double) x->drafted / n,
               100.0 * (double) x->probe_steps / n);
        if (x->pairs)
            printf(", gate: drafting / none %.3f over %u pairs, in the better arm %.1f %%",
                   exp(-x->lq), x->pairs,
                   100.0 * (x->lq < 0 ? (double) x->drafted : n - (double) x->drafted) / n);
        printf("\n");
    }
}

/* --policy / --draft-vocab: arms (an engine and the K its requests ask for) at concurrency
 * 1, 4 and 16, over policy_reps interleaved rounds (--rounds N: odd, 3..15, default 9; each
 * round runs every arm at every concurrency, the arms taking turns in short sub-runs); arm 0
 * is fixed K = 0.  The engines learn first (what
 * they measure, and the draft vocabulary's counts).  Greedy outputs of every run are
 * checked against K = 0's of the same round (the same prompts): returns the number of
 * requests whose output differed.  "best fixed": the fastest arm (median) that is fixed
 * over the whole vocabulary (fixed_full). */
#define POLICY_REPS_MAX 15
static int policy_reps = 9;     /* --rounds */
#define MAX_ARMS 8
struct arm {
    struct engine *e;
    int k;
    const char *name;
    bool fixed_full;            /* a fixed K over the whole vocabulary */
    int twin;                   /* >= 0: the arm it is compared with (the same K, whole head) */
};

static int arms_table(const struct arm *arms, int na, int vocab, int n_out)
{
    static const int concs[3] = { 1, 4, 16 };
    static struct result res[3][MAX_ARMS][POLICY_REPS_MAX];
    int bad = 0;

    for (int i = 0; i < 3; i++)     /* the engines learn their costs, acceptance, counts */
        for (int a = 1; a < na; a++)
            if (arms[a].e != arms[0].e)
                (void) run(arms[a].e, vocab, concs[i], arms[a].k, 32, n_out, 4);
    /* a round of one concurrency c: every arm serves the same S * c requests (S = 6 at
     * c = 1, else 3), in S sub-runs of one request per client, the arms taking turns in an
     * order that rotates from sub-run to sub-run: each arm's time is spread over the whole
     * round, so that a load that comes and goes on a shared machine falls on every arm
     * alike (one run per arm and round, one after the other, gave an A/A pair 0.75-1.26) */
    memset(res, 0, sizeof(res));
    for (int rep = 0; rep < policy_reps; rep++)
        for (int i = 0; i < 3; i++) {
            int c = concs[i], S = c == 1 ? 6 : 3;

            for (int sub = 0; sub < S; sub++)
                for (int j = 0; j < na; j++) {
                    int a = (j + sub + rep) % na;
                    struct result x = run_from(arms[a].e, vocab, c, arms[a].k, 32, n_out, 1,
                                               sub * c);

                    result_merge(&res[i][a][rep], &x);
                }
        }
    for (int i = 0; i < 3; i++) {
        double med[MAX_ARMS], tps[POLICY_REPS_MAX], r_best[POLICY_REPS_MAX], r_k0[POLICY_REPS_MAX],
               r_twin[POLICY_REPS_MAX];
        int best = 0;

        for (int a = 0; a < na; a++) {
            for (int rep = 0; rep < policy_reps; rep++)
                tps[rep] = res[i][a][rep].out_tps;
            med[a] = median_of(tps, policy_reps);
            if (arms[a].fixed_full && med[a] > med[best])
                best = a;
        }
        printf("concurrency %2d: output tok/s (median of %d interleaved rounds):", concs[i],
               policy_reps);
        for (int a = 0; a < na; a++)
            printf(" %s %.1f%s", arms[a].name, med[a], a + 1 < na ? "," : "\n");
        for (int a = 0; a < na; a++) {
            struct spec_stats st = { 0 };
            uint64_t tot = 0;
            double fwd = 0, mtp = 0, eng = 0, tpstep = 0, wall = 0;

            for (int rep = 0; rep < policy_reps; rep++) {
                const struct result *x = &res[i][a][rep];
                for (int q = 0; a > 0 && q < x->n_reqs && q < res[i][0][rep].n_reqs; q++)
                    bad += x->hashes[q] != res[i][0][rep].hashes[q];
                r_best[rep] = x->out_tps / res[i][best][rep].out_tps;
                r_k0[rep] = x->out_tps / res[i][0][rep].out_tps;
                r_twin[rep] = arms[a].twin >= 0 ? x->out_tps / res[i][arms[a].twin][rep].out_tps : 0;
                spec_stats_add(&st, &x->mtp);
                fwd += x->fwd_ms / policy_reps;
                mtp += x->mtp_ms / policy_reps;
                eng += x->eng_ms / policy_reps;
                tpstep += x->tok_per_step / policy_reps;
                wall += x->steps > 0 ? x->secs * 1e3 / x->steps / policy_reps : 0.0;
            }
            for (int k = 0; k <= SPEC_MAX_K; k++)
                tot += st.steps_by_drafts[k];
            printf("  %-14s %8.1f tok/s; / best fixed (%s) %.3f (%.3f .. %.3f); / K=0 %.3f "
                   "(%.3f .. %.3f)", arms[a].name, med[a], arms[best].name,
                   median_of(r_best, policy_reps), min_of(r_best, policy_reps),
                   max_of(r_best, policy_reps), median_of(r_k0, policy_reps),
                   min_of(r_k0, policy_reps), max_of(r_k0, policy_reps));
            if (arms[a].twin >= 0)
                printf("; / %s %.3f (%.3f .. %.3f)", arms[arms[a].twin].name,
                       median_of(r_twin, policy_reps), min_of(r_twin, policy_reps),
                       max_of(r_twin, policy_reps));
            printf("\n  %-14s per step %.2f + %.2f + %.2f ms (forward + MTP + engine) of %.2f "
                   "wall, %.1f output tokens", "", fwd, mtp, eng, wall, tpstep);
            if (st.n_drafts) {
                printf("; drafts per decode step");
                for (int k = 0; k <= SPEC_MAX_K; k++)
                    printf(" %d: %.1f %%", k, tot ? 100.0 * (double) st.steps_by_drafts[k] / tot : 0.0);
                printf("; acceptance per position");
                for (int k = 0; k < SPEC_MAX_K; k++)
                    printf(" %.3f", (double) st.accepted_per_pos[k] / (double) st.n_drafts);
            }
            printf("\n");
        }
    }
    for (int a = 0; a < na; a++) {
        struct engine_loads l;
        engine_get_loads(arms[a].e, &l);
        print_policy(arms[a].name, &l.policy);
        if (l.draft_vocab_installs && (a == 0 || arms[a].e != arms[a - 1].e))
            printf("%s: draft vocabulary of %d ids, %llu installs, the last covering %.1f %% of "
                   "the output tokens counted\n", arms[a].name, l.draft_vocab,
                   (unsigned long long) l.draft_vocab_installs, 100.0 * l.draft_vocab_cover);
    }
    printf("greedy outputs %s K=0's (%d requests differ)\n", bad ? "DIFFER from" : "identical to",
           bad);
    return bad;
}

int main(int argc, char **argv)
{
    const char *dir = NULL;
    bool mock = false, sim = false;
    int threads = 0, n_out = 128, prof_k = -1;
    double prof_s = 0;
    bool policy = false, control = false;
    int dv_n = 0;
    long mock_mtp_usec = 300, mock_step_usec = 2000, mock_token_usec = 20;
    float mock_accuracy = 0.8f;
    /* the MTP draft weights: the speculative config's default ("auto") on this CPU backend */
    enum spec_draft_quant sdq = SPEC_DRAFT_AUTO;
    log_init("bench-engine", NULL);     /* $STEPD_LOG_LEVEL=debug: the engine's debug lines */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mock") == 0)
            mock = true;
        else if (strcmp(argv[i], "--sim") == 0)
            sim = true;
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--draft-quant") == 0 && i + 1 < argc) {
            i++;
            sdq = strcmp(argv[i], "mxfp4") == 0 ? SPEC_DRAFT_MXFP4
                  : strcmp(argv[i], "none") == 0 ? SPEC_DRAFT_NONE : SPEC_DRAFT_AUTO;
        }
        else if (strcmp(argv[i], "--tokens") == 0 && i + 1 < argc)
            n_out = atoi(argv[++i]);
        else if (strcmp(argv[i], "--policy") == 0)
            policy = true;
        else if (strcmp(argv[i], "--policy-control") == 0)
            policy = control = true;
        else if (strcmp(argv[i], "--draft-vocab") == 0 && i + 1 < argc)
            dv_n = atoi(argv[++i]);
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc &&
                 (policy_reps = atoi(argv[i + 1])) >= 3 && policy_reps <= POLICY_REPS_MAX &&
                 policy_reps % 2 == 1)
            i++;
        else if (strcmp(argv[i], "--mock-mtp-usec") == 0 && i + 1 < argc)
            mock_mtp_usec = atol(argv[++i]);
        else if (strcmp(argv[i], "--mock-accuracy") == 0 && i + 1 < argc)
            mock_accuracy = (float) atof(argv[++i]);
        else if (strcmp(argv[i], "--mock-step-usec") == 0 && i + 1 < argc)
            mock_step_usec = atol(argv[++i]);
        else if (strcmp(argv[i], "--mock-token-usec") == 0 && i + 1 < argc)
            mock_token_usec = atol(argv[++i]);
        else if (strcmp(argv[i], "--profile") == 0 && i + 2 < argc) {
            prof_k = atoi(argv[++i]);
            prof_s = atof(argv[++i]);
            if (prof_k < 0 || prof_k > 3 || !(prof_s > 0)) {
                fprintf(stderr, "bench-engine: --profile K SECONDS: K in 0..3, SECONDS > 0\n");
                return 2;
            }
        }
        else if (argv[i][0] != '-')
            dir = argv[i];
        else {
            fprintf(stderr, "usage: bench-engine [MODEL_DIR | --mock [--mock-mtp-usec U] "
                            "[--mock-accuracy A] [--mock-step-usec U] [--mock-token-usec U]] "
                            "[--threads T] [--tokens N] [--draft-quant "
                            "auto|none|mxfp4] [--profile K SECONDS] [--policy | --policy-control "
                            "| --draft-vocab N] [--rounds N] [--sim]\n");
            return 2;
        }
    }
    struct forward *f = NULL;
    struct err_buf err = { { 0 } };
    int window = 0;
    int32_t eos[ENGINE_MAX_EOS];
    int n_eos = 0;
    char mock_what[160];
    const char *what = mock_what;
    snprintf(mock_what, sizeof(mock_what), "mock (%.2f ms/step + %ld us/token, %.2f ms/MTP call, "
             "accuracy %.2f%s)", mock_step_usec / 1000.0, mock_token_usec, mock_mtp_usec / 1000.0,
             mock_accuracy, sim ? "; simulated time" : "");
    struct model_rig rig = { 0 };
    if (!mock) {
        if (!dir)
            dir = "models/tiny-step";
        int r = model_rig_open_q(&rig, dir, threads, 16, 256, 1024, dq_of(sdq), &err);
        if (r < 0) {
            fprintf(stderr, "bench-engine: %s: %s\n", dir, r == -ENOENT ? "no checkpoint" : err.msg);
            return 1;
        }
        f = rig.f;
        window = rig.cfg->sliding_window;
        for (int i = 0; i < rig.cfg->n_eos && i < ENGINE_MAX_EOS; i++)
            eos[n_eos++] = rig.cfg->eos_token_ids[i];
        what = dir;
    }
    if (sim && (!mock || prof_k >= 0)) {
        fprintf(stderr, "bench-engine: --sim needs --mock and no --profile.\n");
        return 2;
    }
    use_sim = sim;
    struct mock_config mc;
    mock_config_init(&mc);
    mc.vocab_size = 4096;
    mc.max_seqs = 16;
    mc.max_tokens_per_step = 256;
    mc.n_blocks[0] = mc.n_blocks[1] = 2048;
    mc.step_usec = mock_step_usec;
    mc.token_usec = mock_token_usec;
    mc.mtp_usec = mock_mtp_usec;
    mc.mtp_accuracy = mock_accuracy;
    mc.clock = sim ? &bench_sim : NULL;
    if (mock) {
        if (mock_forward_new(&mc, &f) < 0)
            return 1;
        window = 64;
    }
    struct engine_config ec;
    engine_config_init(&ec);
    if (sim)
        ec.clock = clk_sim_src(&bench_sim);
    ec.max_num_batched_tokens = 256;
    ec.max_num_seqs = 16;
    ec.max_model_len = 1024;
    ec.sliding_window = window;
    ec.num_speculative_tokens = f->n_mtp < 3 ? f->n_mtp : 3;
    ec.spec_policy = SPEC_POLICY_FIXED;     /* "K = k" below is exactly k drafts per step */
    ec.enable_prefix_caching = !policy && dv_n <= 0;    /* engines that share one forward */
    memcpy(ec.eos_ids, eos, sizeof(eos));
    ec.n_eos = n_eos;
    struct engine *e;
    if (engine_new(f, &ec, &e, &err) < 0) {
        fprintf(stderr, "bench-engine: %s\n", err.msg);
        return 1;
    }
    start(e);
    int vocab = f->vocab_size;
    /* threads 0 resolves as the CPU backend does: the CPUs of this process's affinity mask */
    cpu_set_t cpus;
    int n_cpus = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    if (threads == 0)
        printf("bench-engine: %s, backend threads %d (default 0 = CPUs usable), prompt 32, "
               "%d output tokens, greedy, ignore_eos\n", what, n_cpus, n_out);
    else
        printf("bench-engine: %s, backend threads %d, prompt 32, %d output tokens, greedy, "
               "ignore_eos\n", what, threads, n_out);

    /* warm-up */
    (void) run(e, vocab, 1, 0, 32, 16, 1);

    /* the K = 3 engine with the other draft weights (below) */
    struct engine *eq = NULL;
    struct model_rig rigq = { 0 };
    if (policy || dv_n > 0) {
        /* the adaptive policy (and the draft vocabulary) on the same forward as the fixed
         * runs (the same weights, pages and threads: two copies of the model differed by up
         * to 10 % by themselves), each in an engine of its own so that what it learns comes
         * from its own steps only.  The engines take turns (run() returns when the last
         * request has ended) and none caches prefixes: their block ids name the same KV
         * memory of the one forward.  The draft vocabulary is the forward's: only engines
         * with draft_vocab install one (from the same workload) or score it. */
        struct engine_config c2 = ec;
        struct engine *en[3] = { NULL, NULL, NULL };   /* adaptive, fixed + dv, adaptive + dv */
        struct arm arms[MAX_ARMS];
        int na = 0, kmax = ec.num_speculative_tokens, bad;
        char names[MAX_ARMS][24];

        for (int j = 0; j < 3; j++) {
            if (j > 0 && dv_n <= 0)
                break;
            c2.spec_policy = j == 1 || control ? SPEC_POLICY_FIXED : SPEC_POLICY_ADAPTIVE;
            c2.draft_vocab = j > 0 ? dv_n : 0;
            if (engine_new(f, &c2, &en[j], &err) < 0) {
                fprintf(stderr, "bench-engine: %s\n", err.msg);
                return 1;
            }
            start(en[j]);
        }
        for (int k = 0; k <= kmax; k++) {
            if (dv_n > 0 && k == 2)
                continue;
            snprintf(names[na], sizeof(names[na]), "K=%d", k);
            arms[na] = (struct arm) { e, k, names[na], true, -1 };
            na++;
        }
        if (dv_n > 0)
            for (int k = 1; k <= kmax; k += 2) {
                snprintf(names[na], sizeof(names[na]), "K=%d dv%d", k, dv_n);
                arms[na] = (struct arm) { en[1], k, names[na], false, k == 1 ? 1 : 2 };
                na++;
            }
        arms[na] = (struct arm) { en[0], control ? 0 : kmax,
                                  control ? "K=0 again" : "adaptive", false, -1 };
        na++;
        if (dv_n > 0) {
            snprintf(names[na], sizeof(names[na]), "adaptive dv%d", dv_n);
            arms[na] = (struct arm) { en[2], kmax, names[na], false, na - 1 };
            na++;
        }
        bad = arms_table(arms, na, vocab, n_out);
        for (int j = 0; j < 3; j++)
            if (en[j]) {
                engine_stop(en[j]);
                engine_free(en[j]);
            }
        if (bad)
            return 1;
        goto done;
    }
    if (prof_k >= 0) {
        double t0 = bench_now(), toks = 0, secs = 0;
        while (bench_now() - t0 < prof_s) {
            struct result r = run(e, vocab, 1, prof_k, 32, n_out, 3);
            toks += r.decode_tps > 0 ? 3.0 * n_out : 0;
            secs += r.decode_tps > 0 ? 3.0 * n_out / r.decode_tps : 0;
        }
        printf("profile: batch 1, K=%d: %.1f tok/s decode over %.1f s\n", prof_k, secs > 0 ? toks / secs : 0,
               bench_now() - t0);
        goto done;
    }

    /* batch 1: K = 0, K = 3 and (real model) K = 3 with the other draft weights (the
     * checkpoint's when the config's are MXFP4, else MXFP4), interleaved over BENCH_REPS
     * rounds so that they see the same machine; the median round is printed */
    enum model_draft_quant dq = dq_of(sdq), dq2 = dq == MODEL_DRAFT_MXFP4 ? MODEL_DRAFT_CHECKPOINT
                                                                           : MODEL_DRAFT_MXFP4;
    if (!mock) {
        int r = model_rig_open_q(&rigq, dir, threads, 16, 256, 1024, dq2, &err);
        if (r < 0 || engine_new(rigq.f, &ec, &eq, &err) < 0) {
            fprintf(stderr, "bench-engine: %s: %s\n", dq_name(dq2), err.msg);
            return 1;
        }
        start(eq);
        (void) run(eq, vocab, 1, 3, 32, 16, 1);
    }
    struct result k0r[BENCH_REPS], k3r[BENCH_REPS], kqr[BENCH_REPS];
    for (int rep = 0; rep < BENCH_REPS; rep++) {
        k0r[rep] = run(e, vocab, 1, 0, 32, n_out, 3);
        k3r[rep] = run(e, vocab, 1, 3, 32, n_out, 3);
        if (eq)
            kqr[rep] = run(eq, vocab, 1, 3, 32, n_out, 3);
    }
    /* ratios per round (both runs saw the same machine), then their median */
    double rk3[BENCH_REPS], rkq[BENCH_REPS];
    for (int rep = 0; rep < BENCH_REPS; rep++) {
        rk3[rep] = k0r[rep].decode_tps > 0 ? k3r[rep].decode_tps / k0r[rep].decode_tps : 0;
        rkq[rep] = k0r[rep].decode_tps > 0 && eq ? kqr[rep].decode_tps / k0r[rep].decode_tps : 0;
    }
    struct result k0 = median_result(k0r, BENCH_REPS), k3 = median_result(k3r, BENCH_REPS);
    printf("batch 1 decode (median of %d interleaved rounds): K=0 %.1f tok/s, K=3 %.1f tok/s "
           "(%s%s), speed-up %.2fx (median of the rounds' ratios; range %.2f .. %.2f)\n",
           BENCH_REPS, k0.decode_tps, k3.decode_tps, mock ? "mock" : dq_name(dq),
           mock ? "" : sdq == SPEC_DRAFT_AUTO ? ", the default draft_quantization \"auto\"" : "",
           median_of(rk3, BENCH_REPS),
           min_of(rk3, BENCH_REPS), max_of(rk3, BENCH_REPS));
    printf("  per step: K=0 forward %.3f ms + engine %.3f ms for %.2f tokens; "
           "K=3 forward %.3f ms + MTP %.3f ms + engine %.3f ms for %.2f tokens\n",
           k0.fwd_ms, k0.eng_ms, k0.tok_per_step, k3.fwd_ms, k3.mtp_ms, k3.eng_ms, k3.tok_per_step);
    print_acceptance("K=3", &k3.mtp);
    if (eq) {
        struct result kq = median_result(kqr, BENCH_REPS);
        printf("batch 1 decode, K=3 with %s (draft_quantization \"%s\"): %.1f tok/s, "
               "speed-up %.2fx over K=0 (median of the rounds' ratios; range %.2f .. %.2f)\n",
               dq_name(dq2), dq2 == MODEL_DRAFT_MXFP4 ? "mxfp4" : "none",
               kq.decode_tps, median_of(rkq, BENCH_REPS), min_of(rkq, BENCH_REPS),
               max_of(rkq, BENCH_REPS));
        printf("  per step: forward %.3f ms + MTP %.3f ms + engine %.3f ms for %.2f tokens\n",
               kq.fwd_ms, kq.mtp_ms, kq.eng_ms, kq.tok_per_step);
        print_acceptance(dq2 == MODEL_DRAFT_MXFP4 ? "K=3 MXFP4 drafts" : "K=3 BF16 drafts", &kq.mtp);
    }

    /* concurrency 1, 4, 16 interleaved over CONC_REPS rounds; each line is the round with
     * the median throughput, and the ratio the median of the rounds' ratios to their own
     * concurrency-1 run */
    static const int concs[3] = { 1, 4, 16 };
    for (int kk = 0; kk <= 3; kk += 3) {
        struct result rr[3][BENCH_REPS];
        double ratio[3][BENCH_REPS];
        for (int rep = 0; rep < CONC_REPS; rep++) {
            for (int i = 0; i < 3; i++) {
                int c = concs[i];
                rr[i][rep] = run(e, vocab, c, kk, 32, n_out / 2, c == 1 ? 6 : 3);
                ratio[i][rep] = rr[0][rep].out_tps > 0 ? rr[i][rep].out_tps / rr[0][rep].out_tps : 0;
            }
        }
        for (int i = 0; i < 3; i++) {
            double tps[BENCH_REPS];
            struct result r = rr[i][0];
            for (int rep = 0; rep < CONC_REPS; rep++)
                tps[rep] = rr[i][rep].out_tps;
            for (int rep = 0; rep < CONC_REPS; rep++)
                if (rr[i][rep].out_tps == median_of(tps, CONC_REPS))
                    r = rr[i][rep];
            printf("K=%d concurrency %2d: %8.1f output tok/s (%.2fx of concurrency 1, median of "
                   "%d interleaved rounds' ratios, range %.2f .. %.2f), mean TTFT %.2f ms, mean "
                   "per-request decode %.1f tok/s; per step forward %.2f ms, MTP %.2f ms, engine "
                   "%.3f ms, %.1f output tokens\n",
                   kk, concs[i], r.out_tps, median_of(ratio[i], CONC_REPS), CONC_REPS,
                   min_of(ratio[i], CONC_REPS), max_of(ratio[i], CONC_REPS), r.ttft * 1e3,
                   r.decode_tps, r.fwd_ms, r.mtp_ms, r.eng_ms, r.tok_per_step);
        }
    }
done:
    engine_stop(e);
    struct engine_loads l;
    engine_get_loads(e, &l);
    int inv = engine_check(e);
    printf("engine: %llu steps, %llu tokens, %llu preemptions, KV invariant %s\n",
           (unsigned long long) l.n_steps, (unsigned long long) l.n_generated,
           (unsigned long long) l.n_preemptions, inv == 0 ? "ok" : "VIOLATED");
    if (mock) {
        struct mock_stats ms;

        mock_forward_stats(f, &ms);
        printf("mock: %llu steps and %llu MTP calls, %llu whose own work took longer than "
               "their nominal cost%s\n", (unsigned long long) ms.steps,
               (unsigned long long) ms.mtp_steps, (unsigned long long) ms.overruns,
               sim ? " (simulated time: none counted)" : "");
    }
    engine_free(e);
    if (eq) {
        engine_stop(eq);
        engine_free(eq);
    }
    if (rigq.f)
        model_rig_close(&rigq);
    if (!mock)
        model_rig_close(&rig);
    else
        f->ops->free(f);
    return inv < 0 ? 1 : 0;
}
