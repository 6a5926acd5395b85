/* loadgen.c - gRPC load generator for stepd (and for an engine directly), built on
 * rpc/ (gRPC C core on one libuv loop, so the client is cheap per stream).
 *
 *   loadgen --addr HOST:PORT[,HOST:PORT...] [--method /stepd.v1.Inference/Generate] [--streams N]
 *           [--tokens T] [--prompt-len P] [--deadline-s S] [--api-key K] [--send-log F]
 *           [--rate R] [--connections C]
 *
 * Starts N Generate streams at once (token-id prompts, max_tokens T), records per
 * stream the status, time to first token and every inter-chunk gap, and prints
 *   status counts, TTFT p50/p99/max, inter-token gap p50/p99/max,
 *   latency of rejected calls p50/p99 (RESOURCE_EXHAUSTED), wall time, tokens/s
 * as text and as one final "JSON {...}" line for scripts.
 *
 * Arrival times are taken on the client's completion-queue thread (rpc_ctx_event_us),
 * not when this program's loop gets round to the callback; the loop's own delay
 * (the client's share) is printed separately ("client loop lag").
 *
 * --send-log F: F is a mock engine's --send-log (the time each token chunk was handed
 * to gRPC in the engine). Every token of an OK stream is matched to its send time
 * and "delivery" = client arrival - engine send is printed (p50/p99/max): the
 * per-token latency between engine and client, whatever is in between (stepd or
 * nothing). Both processes read the same CLOCK_MONOTONIC.
 *
 * --rate R: start the calls at R per second (paced) instead of all at once.
 * --connections C: C channels, each with a connection of its own, to each address
 * (default 1), the calls spread over them round-robin: many clients at once.
 * Calls that end with another status than OK or RESOURCE_EXHAUSTED are timed too
 * ("failed ms"), e.g. an UNIMPLEMENTED method as the floor of an answer-at-once server.
 * LOADGEN_DUMP=FILE (environment): per stream "index status t_start_us start_ms end_ms".
 *
 * Faults from the client's side (docs/RELIABILITY.md A3, A4): --deadline-ms LO[,HI] gives
 * each call its own deadline, uniform in [LO, HI] ms after it starts; --cancel-after-ms
 * LO[,HI] cancels each call (RST_STREAM) that long after it was started (0: on the next
 * turn of the loop, right after its headers went out); --concurrency N keeps at most N
 * calls in flight (the next one starts when one ends), for bursts of thousands.  Every
 * stream is checked to end with exactly one terminal status: an OK stream carries exactly
 * one Final and nothing after it, no stream more than one ("violations" counts the others).
 * --logprobs N asks for the sampled token's logprob and the top N (checked: one entry per
 * token, N alternatives each), --temperature T.
 * Exit 0 always (the caller judges the figures), 2 on usage errors.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"

struct stream {
    int64_t t0_us, t_last_us;
    int64_t ttft_us;
    uint32_t tokens;
    int64_t *t_tok;                 /* --send-log: arrival time of each token */
    int status;
    int64_t end_us;
    bool done;
    struct rpc_client_call *call;   /* until on_done */
    uv_timer_t cancel;              /* --cancel-after-ms */
    bool cancel_init;
    unsigned n_final;
    bool after_final;               /* a message came after the Final */
    bool bad_logprobs;              /* --logprobs: an entry missing or malformed */
};

static struct stream *S;
static unsigned n_streams, n_done, n_tokens_req;
static double *gaps;
static size_t n_gaps, cap_gaps;
static struct rpc_ctx *ctx;
static bool want_tok_times;
static double *lag;                 /* client loop lag per message, us */
static size_t n_lag, cap_lag;
static int want_logprobs = -1;      /* --logprobs N */
static unsigned n_inflight;

static void push(double **v, size_t *n, size_t *cap, double x)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 65536;
        double *nv = realloc(*v, nc * sizeof(**v));
        if (!nv)
            return;
        *v = nv;
        *cap = nc;
    }
    (*v)[(*n)++] = x;
}

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void on_msg(struct rpc_client_call *c, const ProtobufCMessage *m, void *ud)
{
    struct stream *s = ud;
    const Stepd__V1__GenerateResponse *r = (const void *)m;
    int64_t t = rpc_ctx_event_us(ctx);

    push(&lag, &n_lag, &cap_lag, (double)(now_us() - t));
    if (s->n_final)
        s->after_final = true;
    if (r->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL)
        s->n_final++;
    if (r->response_case != STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK || r->chunk->n_token_ids == 0)
        return;
    if (want_logprobs >= 0) {
        if (r->chunk->n_logprobs != r->chunk->n_token_ids)
            s->bad_logprobs = true;
        for (size_t k = 0; k < r->chunk->n_logprobs && !s->bad_logprobs; k++) {
            const Stepd__V1__TokenLogprob *lp = r->chunk->logprobs[k];
            if (lp->token_id != r->chunk->token_ids[k] || lp->n_top != (size_t)want_logprobs ||
                !(lp->logprob <= 0.0f))
                s->bad_logprobs = true;
        }
    }
    if (!s->ttft_us)
        s->ttft_us = t - s->t0_us;
    else
        push(&gaps, &n_gaps, &cap_gaps, (double)(t - s->t_last_us));
    s->t_last_us = t;
    for (size_t k = 0; k < r->chunk->n_token_ids; k++) {
        if (s->t_tok && s->tokens < n_tokens_req)
            s->t_tok[s->tokens] = t;
        s->tokens++;
    }
}

static void on_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct stream *s = ud;
    s->status = status;
    s->end_us = rpc_ctx_event_us(ctx);
    s->done = true;
    s->call = NULL;
    if (s->cancel_init)
        uv_timer_stop(&s->cancel);
    n_done++;
    n_inflight--;
    if (status != RPC_OK && status != RPC_RESOURCE_EXHAUSTED && n_done < 5)
        fprintf(stderr, "loadgen: stream ended %s: %s\n", rpc_status_name(status), details);
}

/* Match the engine's send times (mock-engine --send-log) to our arrival times. */
static int delivery_read(const char *path, const char *prefix, double **ret, size_t *ret_n)
{
    FILE *f = fopen(path, "r");
    double *v = NULL;
    size_t n = 0, cap = 0, plen = strlen(prefix);
    char *line = NULL;
    size_t lcap = 0;

    if (!f) {
        fprintf(stderr, "loadgen: --send-log %s: %s\n", path, strerror(errno));
        return -errno;
    }
    while (getline(&line, &lcap, f) > 0) {
        char *p = line, *end;
        if (strncmp(p, prefix, plen) != 0)
            continue;
        unsigned long i = strtoul(p + plen, &end, 10);
        if (end == p + plen || *end != ' ' || i >= n_streams)
            continue;
        struct stream *s = &S[i];
        if (s->status != RPC_OK || !s->t_tok)
            continue;
        p = end;
        for (uint32_t k = 0; k < s->tokens && k < n_tokens_req; k++) {
            long long t = strtoll(p, &end, 10);
            if (end == p)
                break;
            p = end;
            push(&v, &n, &cap, (double)(s->t_tok[k] - t));
        }
    }
    free(line);
    fclose(f);
    *ret = v;
    *ret_n = n;
    return 0;
}

static void pace_cb(uv_timer_t *t)
{
    (void)t;
}

static void cancel_cb(uv_timer_t *t)
{
    struct stream *s = t->data;

    if (!s->done && s->call)
        rpc_client_cancel(s->call);
}

/* LO[,HI] in ms */
static int parse_range(const char *arg, double *lo, double *hi)
{
    char *end;

    *lo = strtod(arg, &end);
    *hi = *lo;
    if (*end == ',')
        *hi = strtod(end + 1, &end);
    return *end || *lo < 0 || *hi < *lo ? -1 : 0;
}

/* A uniform in [0, 1) from the stream's index and a salt (reproducible runs). */
static double unif(unsigned i, uint64_t salt)
{
    uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + salt;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* v may be NULL when n is 0 (nothing was recorded) */
static void sort_d(double *v, size_t n)
{
    if (n)
        qsort(v, n, sizeof(double), cmp_d);
}

static double pct(double *v, size_t n, double p)
{
    if (!n)
        return 0;
    size_t i = (size_t)ceil(p / 100.0 * (double)n) - 1;
    if (i >= n)
        i = n - 1;
    return v[i];
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "addr", required_argument, NULL, 'a' }, { "method", required_argument, NULL, 'm' },
        { "streams", required_argument, NULL, 'n' }, { "tokens", required_argument, NULL, 't' },
        { "prompt-len", required_argument, NULL, 'p' }, { "deadline-s", required_argument, NULL, 'd' },
        { "api-key", required_argument, NULL, 'k' }, { "send-log", required_argument, NULL, 'l' },
        { "rate", required_argument, NULL, 'r' }, { "connections", required_argument, NULL, 'c' },
        { "deadline-ms", required_argument, NULL, 'D' }, { "cancel-after-ms", required_argument, NULL, 'C' },
        { "concurrency", required_argument, NULL, 'N' }, { "logprobs", required_argument, NULL, 'L' },
        { "temperature", required_argument, NULL, 'T' },
        { NULL, 0, NULL, 0 },
    };
    double dl_lo = -1, dl_hi = -1, cx_lo = -1, cx_hi = -1, temperature = -1;
    unsigned concurrency = 0;
    const char *addr = "127.0.0.1:20051", *method = "/stepd.v1.Inference/Generate", *key = NULL;
    const char *send_log = NULL;
    unsigned tokens = 64, prompt_len = 8;
    double deadline_s = 120, rate = 0;
    int c, n_conn = 1;

    n_streams = 100;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'a': addr = optarg; break;
        case 'm': method = optarg; break;
        case 'n': n_streams = (unsigned)atoi(optarg); break;
        case 't': tokens = (unsigned)atoi(optarg); break;
        case 'p': prompt_len = (unsigned)atoi(optarg); break;
        case 'd': deadline_s = atof(optarg); break;
        case 'k': key = optarg; break;
        case 'l': send_log = optarg; break;
        case 'r': rate = atof(optarg); break;
        case 'c': n_conn = atoi(optarg); break;
        case 'D':
            if (parse_range(optarg, &dl_lo, &dl_hi) < 0) {
                fprintf(stderr, "loadgen: --deadline-ms LO[,HI]: bad range '%s'\n", optarg);
                return 2;
            }
            break;
        case 'C':
            if (parse_range(optarg, &cx_lo, &cx_hi) < 0) {
                fprintf(stderr, "loadgen: --cancel-after-ms LO[,HI]: bad range '%s'\n", optarg);
                return 2;
            }
            break;
        case 'N': concurrency = (unsigned)atoi(optarg); break;
        case 'L': want_logprobs = atoi(optarg); break;
        case 'T': temperature = atof(optarg); break;
        default:
            fprintf(stderr, "usage: loadgen --addr A [--method M] [--streams N] [--tokens T] [--prompt-len P]"
                            " [--connections C]\n");
            return 2;
        }
    }
    if (n_streams == 0 || tokens == 0 || prompt_len == 0 || prompt_len > 4096 || rate < 0 || n_conn < 1 ||
        n_conn > 64) {
        fprintf(stderr, "loadgen: --streams, --tokens, --prompt-len and --connections (<= 64) must be positive\n");
        return 2;
    }
    uv_loop_t *loop = uv_default_loop();
    /* --addr A,B,...: --connections channels (each its own connection) to each, streams
     * spread round-robin */
    struct rpc_channel *chs[64];
    unsigned n_ch = 0;
    struct rpc_channel_opts co = { .api_key = key, .keepalive_time_ms = -1, .max_recv_msg_bytes = 16 << 20,
                                   .own_connection = n_conn > 1 };
    if (rpc_ctx_create(loop, &ctx) < 0) {
        fprintf(stderr, "loadgen: cannot create an RPC context\n");
        return 1;
    }
    char *addrs = strdup(addr), *save = NULL;
    for (char *a = strtok_r(addrs, ",", &save); a; a = strtok_r(NULL, ",", &save)) {
        for (int k = 0; k < n_conn; k++) {
            if (n_ch == 64 || rpc_channel_create(ctx, a, &co, &chs[n_ch]) < 0) {
                fprintf(stderr, "loadgen: cannot create a channel to %s (at most 64 channels in all)\n", a);
                return 1;
            }
            n_ch++;
        }
    }
    free(addrs);
    if (n_ch == 0) {
        fprintf(stderr, "loadgen: --addr: no address\n");
        return 2;
    }
    S = calloc(n_streams, sizeof(*S));
    n_tokens_req = tokens;
    want_tok_times = send_log != NULL;
    for (unsigned i = 0; want_tok_times && i < n_streams; i++)
        S[i].t_tok = malloc(tokens * sizeof(int64_t));
    int32_t *ids = malloc(prompt_len * sizeof(int32_t));
    char (*rid)[32] = calloc(n_streams, 32);
    uv_timer_t pace;
    uv_timer_init(loop, &pace);
    int64_t t_start = now_us();
    int64_t deadline = rpc_now_ms() + (int64_t)(deadline_s * 1000);
    unsigned next = 0;
    while (next < n_streams) {
        unsigned i = next++;
        Stepd__V1__GenerateRequest req = STEPD__V1__GENERATE_REQUEST__INIT;
        Stepd__V1__TokenIds ti = STEPD__V1__TOKEN_IDS__INIT;
        Stepd__V1__SamplingParams sp = STEPD__V1__SAMPLING_PARAMS__INIT;
        for (unsigned k = 0; k < prompt_len; k++)
            ids[k] = (int32_t)((i * 31 + k * 7) % 900 + 10);
        ti.n_ids = prompt_len;
        ti.ids = ids;
        PB_SET(&sp, max_tokens, (int64_t)tokens);
        PB_SET(&sp, ignore_eos, true);
        if (want_logprobs >= 0)
            PB_SET(&sp, logprobs, want_logprobs);
        if (temperature >= 0)
            PB_SET(&sp, temperature, (float)temperature);
        snprintf(rid[i], 32, "lg-%u-%u", (unsigned)(t_start % 100000), i);
        req.request_id = rid[i];
        req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
        req.token_ids = &ti;
        req.sampling_params = &sp;
        if (rate > 0) {
            int64_t target = t_start + (int64_t)((double)i * 1e6 / rate);
            while (now_us() < target) {
                int64_t ms = (target - now_us()) / 1000;
                uv_timer_start(&pace, pace_cb, ms > 0 ? (uint64_t)ms : 0, 0);
                uv_run(loop, UV_RUN_ONCE);
            }
            uv_timer_stop(&pace);
        }
        while (concurrency && n_inflight >= concurrency)
            uv_run(loop, UV_RUN_ONCE);
        int64_t call_deadline = deadline;
        if (dl_lo >= 0)
            call_deadline = rpc_now_ms() + (int64_t)(dl_lo + (dl_hi - dl_lo) * unif(i, 1) + 0.5);
        S[i].t0_us = now_us();
        n_inflight++;
        if (rpc_client_start(chs[i % n_ch], method, &req.base, &stepd__v1__generate_response__descriptor,
                             call_deadline, on_msg, on_done, &S[i], &S[i].call) < 0) {
            S[i].status = RPC_INTERNAL;
            S[i].done = true;
            n_done++;
            n_inflight--;
        } else if (cx_lo >= 0) {
            uv_timer_init(loop, &S[i].cancel);
            S[i].cancel.data = &S[i];
            S[i].cancel_init = true;
            uv_timer_start(&S[i].cancel, cancel_cb, (uint64_t)(cx_lo + (cx_hi - cx_lo) * unif(i, 2) + 0.5), 0);
        }
        /* let completions in while starting many calls, so that a fast answer (a
         * rejection) is not timed as late because this loop was still busy */
        if (i % 8 == 7)
            uv_run(loop, UV_RUN_NOWAIT);
    }
    double issue_ms = (double)(now_us() - t_start) / 1e3;
    while (n_done < n_streams)
        uv_run(loop, UV_RUN_ONCE);
    double wall = (double)(now_us() - t_start) / 1e6;
    double *dl = NULL;
    size_t n_dl = 0;
    if (send_log) {
        char prefix[32];
        snprintf(prefix, sizeof(prefix), "lg-%u-", (unsigned)(t_start % 100000));
        delivery_read(send_log, prefix, &dl, &n_dl);
        sort_d(dl, n_dl);
    }
    sort_d(lag, n_lag);

    unsigned counts[17] = { 0 };
    double *ttft = malloc(n_streams * sizeof(double)), *rej = malloc(n_streams * sizeof(double));
    double *fail = malloc(n_streams * sizeof(double));
    size_t n_ttft = 0, n_rej = 0, n_fail = 0;
    uint64_t total_tokens = 0, short_ok = 0;
    unsigned violations = 0, bad_lp = 0;
    for (unsigned i = 0; i < n_streams; i++) {
        if (S[i].status >= 0 && S[i].status < 17)
            counts[S[i].status]++;
        /* exactly one terminal status: an OK stream ends with one Final and nothing after it */
        if (S[i].n_final > 1 || S[i].after_final || (S[i].status == RPC_OK && S[i].n_final != 1)) {
            if (violations++ < 5)
                fprintf(stderr, "loadgen: stream %u: status %s after %u finals%s\n", i,
                        rpc_status_name(S[i].status), S[i].n_final, S[i].after_final ? ", messages after one" : "");
        }
        bad_lp += S[i].bad_logprobs;
        total_tokens += S[i].tokens;
        if (S[i].status == RPC_OK) {
            ttft[n_ttft++] = (double)S[i].ttft_us;
            if (S[i].tokens != tokens)
                short_ok++;
        }
        if (S[i].status == RPC_RESOURCE_EXHAUSTED)
            rej[n_rej++] = (double)(S[i].end_us - S[i].t0_us);
        else if (S[i].status != RPC_OK)
            fail[n_fail++] = (double)(S[i].end_us - S[i].t0_us);
    }
    if (getenv("LOADGEN_DUMP")) {
        FILE *f = fopen(getenv("LOADGEN_DUMP"), "w");
        for (unsigned i = 0; f && i < n_streams; i++)
            fprintf(f, "%u %d %lld %.3f %.3f\n", i, S[i].status, (long long)t_start, (S[i].t0_us - t_start) / 1e3,
                    (S[i].end_us - t_start) / 1e3);
        if (f)
            fclose(f);
    }
    sort_d(ttft, n_ttft);
    sort_d(rej, n_rej);
    sort_d(fail, n_fail);
    sort_d(gaps, n_gaps);
    printf("streams %u, tokens/stream %u, wall %.3f s, tokens %" PRIu64 " (%.0f tok/s)\n", n_streams, tokens, wall,
           total_tokens, (double)total_tokens / wall);
    printf("status:");
    for (int i = 0; i < 17; i++)
        if (counts[i])
            printf(" %s=%u", rpc_status_name(i), counts[i]);
    printf("%s\n", short_ok ? " (some OK streams were short!)" : "");
    printf("terminal-status violations: %u%s\n", violations, want_logprobs >= 0 ? "" : "");
    if (want_logprobs >= 0)
        printf("streams with malformed logprobs: %u\n", bad_lp);
    printf("ttft ms: p50 %.2f p99 %.2f max %.2f\n", pct(ttft, n_ttft, 50) / 1000, pct(ttft, n_ttft, 99) / 1000,
           n_ttft ? ttft[n_ttft - 1] / 1000 : 0);
    printf("inter-token gap ms: p50 %.2f p99 %.2f max %.2f (%zu gaps)\n", pct(gaps, n_gaps, 50) / 1000,
           pct(gaps, n_gaps, 99) / 1000, n_gaps ? gaps[n_gaps - 1] / 1000 : 0, n_gaps);
    if (n_rej)
        printf("rejected ms: p50 %.2f p99 %.2f max %.2f\n", pct(rej, n_rej, 50) / 1000, pct(rej, n_rej, 99) / 1000,
               rej[n_rej - 1] / 1000);
    if (n_fail)
        printf("failed ms: p50 %.2f p99 %.2f max %.2f\n", pct(fail, n_fail, 50) / 1000, pct(fail, n_fail, 99) / 1000,
               fail[n_fail - 1] / 1000);
    if (send_log)
        printf("delivery (client arrival - engine send) ms: p50 %.3f p99 %.3f max %.3f (%zu of %" PRIu64
               " tokens matched)\n", pct(dl, n_dl, 50) / 1000, pct(dl, n_dl, 99) / 1000,
               n_dl ? dl[n_dl - 1] / 1000 : 0, n_dl, total_tokens);
    printf("issuing the calls took %.2f ms; client loop lag (CQ thread -> callback) ms: p50 %.3f p99 %.3f\n",
           issue_ms, pct(lag, n_lag, 50) / 1000, pct(lag, n_lag, 99) / 1000);
    printf("JSON {\"violations\": %u, \"bad_logprobs\": %u, \"codes\": [", violations, bad_lp);
    for (int i = 0; i < 17; i++)
        printf("%s%u", i ? ", " : "", counts[i]);
    printf("], ");
    printf("\"streams\": %u, \"ok\": %u, \"resource_exhausted\": %u, \"other\": %u, \"short_ok\": %" PRIu64
           ", \"tokens\": %" PRIu64 ", \"wall_s\": %.4f, \"ttft_p50_ms\": %.3f, \"ttft_p99_ms\": %.3f, "
           "\"itl_p50_ms\": %.3f, \"itl_p99_ms\": %.3f, \"itl_max_ms\": %.3f, \"reject_p50_ms\": %.3f, "
           "\"reject_p99_ms\": %.3f, \"issue_ms\": %.3f, \"fail_p50_ms\": %.3f, \"fail_p99_ms\": %.3f, \"lag_p50_ms\": %.3f, \"lag_p99_ms\": %.3f, "
           "\"delivery_n\": %zu, \"delivery_p50_ms\": %.3f, \"delivery_p99_ms\": %.3f, \"delivery_max_ms\": %.3f}\n",
           n_streams, counts[RPC_OK], counts[RPC_RESOURCE_EXHAUSTED],
           n_streams - counts[RPC_OK] - counts[RPC_RESOURCE_EXHAUSTED], short_ok, total_tokens, wall,
           pct(ttft, n_ttft, 50) / 1000, pct(ttft, n_ttft, 99) / 1000, pct(gaps, n_gaps, 50) / 1000,
           pct(gaps, n_gaps, 99) / 1000, n_gaps ? gaps[n_gaps - 1] / 1000 : 0, pct(rej, n_rej, 50) / 1000,
           pct(rej, n_rej, 99) / 1000, issue_ms, pct(fail, n_fail, 50) / 1000, pct(fail, n_fail, 99) / 1000, pct(lag, n_lag, 50) / 1000, pct(lag, n_lag, 99) / 1000, n_dl,
           pct(dl, n_dl, 50) / 1000, pct(dl, n_dl, 99) / 1000, n_dl ? dl[n_dl - 1] / 1000 : 0);
    fflush(stdout);
    uv_close((uv_handle_t *)&pace, NULL);
    for (unsigned i = 0; i < n_streams; i++)
        if (S[i].cancel_init)
            uv_close((uv_handle_t *)&S[i].cancel, NULL);
    for (unsigned i = 0; i < n_ch; i++)
        rpc_channel_destroy(chs[i]);
    rpc_ctx_destroy(ctx);
    uv_run(loop, UV_RUN_DEFAULT);
    for (unsigned i = 0; i < n_streams; i++)
        free(S[i].t_tok);
    free(S);
    free(ids);
    free(rid);
    free(ttft);
    free(rej);
    free(fail);
    free(gaps);
    free(lag);
    free(dl);
    return 0;
}
