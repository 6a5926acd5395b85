/* bench-prefix.c - the prefix cache on a shared-prefix workload, tiny checkpoint (CPU).
 *
 *   bench-prefix [MODEL_DIR] [--threads T] [--requests N] [--concurrency C]
 *                [--prefix P] [--own U] [--tokens O] [--mtp K] [--rounds R]
 *                [--batched-tokens T] [--verbose]
 *
 * Workload (defaults): 64 requests, each a 2048-token system prompt shared by all plus 32
 * tokens of its own, 128 output tokens (greedy, EOS ignored), 16 clients in a closed loop
 * (each submits its next request when the last one ends), 256 tokens per step (the
 * worker's default --max-batched-tokens).  The same workload runs with
 * the prefix cache off and on, alternating, R rounds (default 3), each on a fresh engine
 * (empty cache) over the same model; printed per run and as medians: TTFT p50 and p99
 * (engine timings: arrival to first token), output tokens/s over the wall time, and the
 * prompt tokens served from the cache, each round's on/off ratios; then the medians and the
 * medians of the pair ratios.  Greedy
 * outputs of the two must be equal (checked, request by request).  Figures only, no
 * thresholds (target on the tiny model: TTFT p50 >= 5x better with the cache).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "benchlib.h"
#include "engine.h"
#include "../engine/model-rig.h"

#define MAX_REQ 1024
#define MAX_OUT 1024

static bool verbose;            /* --verbose: every request's TTFT, in request order */

struct bench {
    struct engine *e;
    int vocab, n_req, conc, prefix, own, n_out, k;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int next, done;
    double ttft[MAX_REQ];
    int cached[MAX_REQ];
    int32_t *out;               /* [n_req * n_out] */
    int n_got[MAX_REQ];
};

struct client {
    struct bench *b;
    int req;                    /* the request it waits for */
    char rid[32];
};

static void submit_next(struct client *c);

static void on_out(void *ud, const struct engine_output *o)
{
    struct client *c = ud;
    struct bench *b = c->b;
    int i = c->req;
    if (b->n_got[i] + o->n_tokens <= b->n_out)
        memcpy(b->out + (size_t) i * b->n_out + b->n_got[i], o->tokens,
               (size_t) o->n_tokens * sizeof(int32_t));
    b->n_got[i] += o->n_tokens;
    if (!o->finished)
        return;
    pthread_mutex_lock(&b->lock);
    b->ttft[i] = o->timings.first_token_s;
    b->cached[i] = o->n_cached;
    b->done++;
    bool more = b->next < b->n_req;
    if (b->done == b->n_req)
        pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
    if (more)
        submit_next(c);
}

static void submit_next(struct client *c)
{
    struct bench *b = c->b;
    static int32_t prompt[1 << 16];
    static pthread_mutex_t plock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&b->lock);
    int i = b->next++;
    pthread_mutex_unlock(&b->lock);
    if (i >= b->n_req)
        return;
    c->req = i;
    snprintf(c->rid, sizeof(c->rid), "p%d", i);
    pthread_mutex_lock(&plock);         /* the engine copies the prompt at submit */
    for (int t = 0; t < b->prefix; t++)
        prompt[t] = (int32_t) ((t * 389 + 11) % b->vocab);
    for (int t = 0; t < b->own; t++)
        prompt[b->prefix + t] = (int32_t) ((t * 131 + i * 977 + 7) % b->vocab);
    struct engine_request q;
    struct err_buf err;
    engine_request_init(&q);
    q.id = c->rid;
    q.prompt = prompt;
    q.n_prompt = b->prefix + b->own;
    q.max_tokens = b->n_out;
    q.ignore_eos = true;
    q.num_speculative_tokens = b->k;
    int r = engine_submit(b->e, &q, on_out, c, &err);
    pthread_mutex_unlock(&plock);
    if (r < 0) {
        fprintf(stderr, "bench-prefix: submit: %s\n", err.msg);
        exit(1);
    }
}

/* the q-quantile (nearest rank) of n sorted values */
static double quantile(const double *v, int n, double q)
{
    int i = (int) (q * n + 0.999999) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

struct result {
    double p50, p99, tps, secs;
    long cached;
};

static struct result run(struct model_rig *rig, bool cache, int n_req, int conc, int prefix,
                         int own, int n_out, int k, int32_t *out)
{
    struct engine_config ec;
    struct err_buf err;
    struct bench b = {
        .vocab = rig->f->vocab_size, .n_req = n_req, .conc = conc, .prefix = prefix,
        .own = own, .n_out = n_out, .k = k, .out = out,
    };
    engine_config_init(&ec);
    ec.max_num_batched_tokens = rig->f->max_tokens_per_step;
    ec.max_num_seqs = conc;
    ec.max_model_len = prefix + own + n_out + 8;
    ec.max_waiting = n_req;
    ec.sliding_window = rig->cfg->sliding_window;
    ec.num_speculative_tokens = k;
    ec.enable_prefix_caching = cache;
    if (engine_new(rig->f, &ec, &b.e, &err) < 0) {
        fprintf(stderr, "bench-prefix: engine: %s\n", err.msg);
        exit(1);
    }
    pthread_mutex_init(&b.lock, NULL);
    pthread_cond_init(&b.cond, NULL);
    struct client *cl = calloc((size_t) conc, sizeof(*cl));
    if (engine_start(b.e) < 0)
        exit(1);
    double t0 = bench_now();
    for (int i = 0; i < conc; i++) {
        cl[i].b = &b;
        submit_next(&cl[i]);
    }
    pthread_mutex_lock(&b.lock);
    while (b.done < n_req)
        pthread_cond_wait(&b.cond, &b.lock);
    pthread_mutex_unlock(&b.lock);
    struct result r = { .secs = bench_now() - t0 };
    engine_stop(b.e);
    if (engine_check(b.e) < 0) {
        fprintf(stderr, "bench-prefix: KV accounting broken at idle\n");
        exit(1);
    }
    engine_free(b.e);
    for (int i = 0; i < n_req; i++) {
        r.cached += b.cached[i];
        if (b.n_got[i] != n_out) {
            fprintf(stderr, "bench-prefix: request %d: %d tokens of %d\n", i, b.n_got[i], n_out);
            exit(1);
        }
    }
    if (verbose) {
        for (int i = 0; i < n_req; i++)
            fprintf(stderr, "%s%.0f", i ? " " : "ttft ms: ", b.ttft[i] * 1e3);
        fprintf(stderr, "\n");
    }
    qsort(b.ttft, (size_t) n_req, sizeof(double), bench_cmp_double);
    r.p50 = quantile(b.ttft, n_req, 0.50);
    r.p99 = quantile(b.ttft, n_req, 0.99);
    r.tps = (double) n_req * n_out / r.secs;
    free(cl);
    pthread_cond_destroy(&b.cond);
    pthread_mutex_destroy(&b.lock);
    return r;
}

static double median3(double *v, int n)
{
    qsort(v, (size_t) n, sizeof(double), bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    const char *dir = "models/tiny-step";
    int threads = 0, n_req = 64, conc = 16, prefix = 2048, own = 32, n_out = 128, k = 0;
    int rounds = 3, step_tokens = 256;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--threads") && v)
            threads = atoi(argv[++i]);
        else if (!strcmp(a, "--requests") && v)
            n_req = atoi(argv[++i]);
        else if (!strcmp(a, "--concurrency") && v)
            conc = atoi(argv[++i]);
        else if (!strcmp(a, "--prefix") && v)
            prefix = atoi(argv[++i]);
        else if (!strcmp(a, "--own") && v)
            own = atoi(argv[++i]);
        else if (!strcmp(a, "--tokens") && v)
            n_out = atoi(argv[++i]);
        else if (!strcmp(a, "--mtp") && v)
            k = atoi(argv[++i]);
        else if (!strcmp(a, "--rounds") && v)
            rounds = atoi(argv[++i]);
        else if (!strcmp(a, "--batched-tokens") && v)
            step_tokens = atoi(argv[++i]);
        else if (!strcmp(a, "--verbose"))
            verbose = true;
        else if (a[0] != '-')
            dir = a;
        else {
            fprintf(stderr, "usage: bench-prefix [MODEL_DIR] [--threads T] [--requests N] "
                    "[--concurrency C] [--prefix P] [--own U] [--tokens O] [--mtp K] [--rounds R] "
                    "[--batched-tokens T] [--verbose]\n");
            return 2;
        }
    }
    if (n_req < 1 || n_req > MAX_REQ || conc < 1 || conc > n_req || prefix < 0 || own < 1 ||
        prefix + own > (1 << 16) || n_out < 1 || n_out > MAX_OUT || k < 0 || k > 3 ||
        rounds < 1 || rounds > 15 || step_tokens < 8 || step_tokens > 8192) {
        fprintf(stderr, "bench-prefix: a value is out of range\n");
        return 2;
    }
    struct model_rig rig;
    struct err_buf err = { { 0 } };
    static const int pools[2] = { 0, 0 };
    int r = model_rig_open_kv(&rig, dir, threads, conc, step_tokens, prefix + own + n_out + 8, pools,
                              MODEL_DRAFT_CHECKPOINT, &err);
    if (r == -ENOENT) {
        printf("no checkpoint at %s: skipped\n", dir);
        return 77;
    }
    if (r < 0) {
        fprintf(stderr, "bench-prefix: %s: %s\n", dir, err.msg);
        return 1;
    }
    int32_t *out_off = calloc((size_t) n_req * n_out, sizeof(int32_t));
    int32_t *out_on = calloc((size_t) n_req * n_out, sizeof(int32_t));
    double p50[2][16], p99[2][16], tps[2][16], pr[3][16];
    printf("prefix cache: %d requests x (%d shared + %d own prompt tokens) -> %d tokens, %d "
           "concurrent (closed loop), K=%d, %d tokens per step, BF16 KV; %d rounds off/on\n",
           n_req, prefix, own, n_out, conc, k, step_tokens, rounds);
    for (int round = 0; round < rounds; round++) {
        for (int c = 0; c < 2; c++) {
            struct result res = run(&rig, c == 1, n_req, conc, prefix, own, n_out, k,
                                    c ? out_on : out_off);
            p50[c][round] = res.p50;
            p99[c][round] = res.p99;
            tps[c][round] = res.tps;
            printf("  round %d cache %-3s: TTFT p50 %8.1f ms  p99 %8.1f ms  %7.1f output tok/s  "
                   "wall %6.2f s  prompt tokens from the cache %ld of %ld\n", round + 1,
                   c ? "on" : "off", res.p50 * 1e3, res.p99 * 1e3, res.tps, res.secs, res.cached,
                   (long) n_req * (prefix + own));
        }
        printf("  round %d ratio on/off: TTFT p50 %.1fx lower, p99 %.1fx lower, throughput %.2fx\n",
               round + 1, p50[0][round] / p50[1][round], p99[0][round] / p99[1][round],
               tps[1][round] / tps[0][round]);
        pr[0][round] = p50[0][round] / p50[1][round];
        pr[1][round] = p99[0][round] / p99[1][round];
        pr[2][round] = tps[1][round] / tps[0][round];
        if (memcmp(out_on, out_off, (size_t) n_req * n_out * sizeof(int32_t)) != 0) {
            fprintf(stderr, "bench-prefix: greedy outputs differ with the cache on\n");
            return 1;
        }
    }
    double m[2][3];
    for (int c = 0; c < 2; c++) {
        m[c][0] = median3(p50[c], rounds);
        m[c][1] = median3(p99[c], rounds);
        m[c][2] = median3(tps[c], rounds);
        printf("median cache %-3s: TTFT p50 %8.1f ms  p99 %8.1f ms  %7.1f output tok/s\n",
               c ? "on" : "off", m[c][0] * 1e3, m[c][1] * 1e3, m[c][2]);
    }
    printf("ratio (cache on vs off, medians of the rounds' pair ratios): TTFT p50 %.1fx lower, "
           "p99 %.1fx lower, throughput %.2fx; greedy outputs identical\n", median3(pr[0], rounds),
           median3(pr[1], rounds), median3(pr[2], rounds));
    free(out_off);
    free(out_on);
    model_rig_close(&rig);
    return 0;
}
