/* stepctl.c - command-line client for stepd (what a person types to try it).
 *
 *   stepctl [global options] generate [--max-tokens N] [--temperature T] [--top-p P]
 *                                     [--seed S] [--stop STR]... [--ids] PROMPT|IDS
 *   stepctl chat [--system TEXT] [--effort low|medium|high] [--max-tokens N] MESSAGE
 *   stepctl health [SERVICE]          exit 0 when SERVING
 *   stepctl wait-ready [--timeout S]  poll readiness (50 ms) until SERVING; say why not
 *   stepctl info | loads | groups
 *   stepctl drain [--timeout S] [--stay]
 *
 * Global options: --addr HOST:PORT (default $STEPD_ADDR or 127.0.0.1:20051),
 * --admin-addr (default $STEPD_ADMIN_ADDR or 127.0.0.1:20053), --api-key-file F
 * (or $STEPD_API_KEY), --tls-ca F, --timeout S (deadline per call; default 300 s for
 * generate, 5 s otherwise).
 *
 * Generate streams text to stdout as it arrives (token ids with --ids input or when
 * no text comes back), then prints the finish reason, usage and timings to stderr.
 * Exit status: 0 ok, 1 RPC error (status printed), 2 usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "file.h"
#include "stepd-config.h"
#include "log.h"
#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"
#include "health.pb-c.h"

struct ctl {
    uv_loop_t *loop;
    struct rpc_ctx *rpc;
    struct rpc_channel *ch;
    bool done;
    int status;
    char details[1024];
    bool saw_text;
    bool print_ids;
    bool in_reasoning;
    bool tty;
    const ProtobufCMessageDescriptor *resp_desc;
    void (*on_resp)(struct ctl *c, const ProtobufCMessage *m);
    void *ud;                       /* for on_resp */
};

static void usage(FILE *f)
{
    fprintf(f,
        "usage: stepctl [--addr A] [--admin-addr A] [--api-key-file F] [--tls-ca F] [--timeout S] COMMAND ...\n"
        "  --addr HOST:PORT       public port (default $STEPD_ADDR or 127.0.0.1:20051)\n"
        "  --admin-addr HOST:PORT Admin port (default $STEPD_ADMIN_ADDR or 127.0.0.1:20053)\n"
        "  --api-key-file F       API key (or $STEPD_API_KEY)\n"
        "  --tls-ca F             TLS to the server, verified with this CA\n"
        "  --timeout S            deadline per call (generate 300 s, others 5 s)\n"
        "  --version, --help\n"
        "commands:\n"
        "  generate [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
        "           [--stop STR]... [--ids] [--request-id ID] PROMPT   stream a completion (--ids: PROMPT\n"
        "                         is \"1,2,3\"; --request-id: the id the server logs and aborts by)\n"
        "  chat [--system TEXT] [--effort low|medium|high] [--max-tokens N] [--request-id ID] MESSAGE\n"
        "  health [SERVICE]       \"\" liveness (default), readiness, stepd.v1.Inference\n"
        "  wait-ready [--timeout S]   poll readiness every 50 ms (default 60 s); while not ready,\n"
        "                         say why (the groups' states and messages, Admin port); exit 1\n"
        "                         at the timeout, or at once when every group was given up\n"
        "  info                   server and model information\n"
        "  loads                  per-group load\n"
        "  groups                 worker groups and ranks (Admin port)\n"
        "  drain [--timeout S] [--stay]   stop admitting; exit stepd when drained unless --stay\n");
}

static void on_msg(struct rpc_client_call *call, const ProtobufCMessage *m, void *ud)
{
    struct ctl *c = ud;
    if (c->on_resp)
        c->on_resp(c, m);
}

static void on_done(struct rpc_client_call *call, int status, const char *details, void *ud)
{
    struct ctl *c = ud;
    c->done = true;
    c->status = status;
    snprintf(c->details, sizeof(c->details), "%s", details);
}

static int run_call(struct ctl *c, const char *method, const ProtobufCMessage *req, double timeout_s)
{
    c->done = false;
    int r = rpc_client_start(c->ch, method, req, c->resp_desc, rpc_now_ms() + (int64_t)(timeout_s * 1000),
                             on_msg, on_done, c, NULL);
    if (r < 0) {
        fprintf(stderr, "stepctl: cannot start %s: %s\n", method, strerror(-r));
        return 1;
    }
    while (!c->done)
        uv_run(c->loop, UV_RUN_ONCE);
    if (c->status != RPC_OK) {
        fprintf(stderr, "stepctl: %s: %s: %s\n", method, rpc_status_name(c->status), c->details);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ generate / chat */

static const char *finish_name(int r)
{
    switch (r) {
    case STEPD__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    case STEPD__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    }
    return "unspecified";
}

static void gen_resp(struct ctl *c, const ProtobufCMessage *m)
{
    const Stepd__V1__GenerateResponse *r = (const void *)m;

    if (r->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
        const Stepd__V1__Chunk *ch = r->chunk;
        if (ch->reasoning_delta[0]) {
            if (!c->in_reasoning && c->tty)
                fputs("\033[2m", stdout);
            c->in_reasoning = true;
            fputs(ch->reasoning_delta, stdout);
            c->saw_text = true;
        }
        if (ch->content_delta[0] || ch->n_tool_calls) {
            if (c->in_reasoning) {
                fputs(c->tty ? "\033[0m\n" : "\n", stdout);
                c->in_reasoning = false;
            }
            fputs(ch->content_delta, stdout);
            for (size_t i = 0; i < ch->n_tool_calls; i++) {
                const Stepd__V1__ToolCallDelta *t = ch->tool_calls[i];
                if (t->name[0])
                    printf("\n[tool call %u: %s] ", t->index, t->name);
                fputs(t->arguments_delta, stdout);
            }
            c->saw_text = true;
        } else if (!ch->reasoning_delta[0] && ch->text[0]) {
            fputs(ch->text, stdout);
            c->saw_text = true;
        }
        if (c->print_ids || (!c->saw_text && ch->n_token_ids && !ch->text[0])) {
            for (size_t i = 0; i < ch->n_token_ids; i++)
                printf("%d ", ch->token_ids[i]);
        }
        fflush(stdout);
        return;
    }
    if (r->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL) {
        const Stepd__V1__Final *f = r->final;
        if (c->in_reasoning && c->tty)
            fputs("\033[0m", stdout);
        fputs("\n", stdout);
        fflush(stdout);
        fprintf(stderr, "[%s] finish=%s%s%s prompt=%u completion=%u ttft=%.1fms e2e=%.1fms group=%s",
                f->request_id, finish_name(f->finish_reason), f->message[0] ? " (" : "", f->message[0] ? f->message : "",
                f->usage ? f->usage->prompt_tokens : 0, f->usage ? f->usage->completion_tokens : 0,
                f->timings ? f->timings->first_token_s * 1000 : 0, f->timings ? f->timings->e2e_s * 1000 : 0, f->group);
        if (f->message[0])
            fputs(")", stderr);
        if (f->mtp && f->mtp->num_draft_tokens)
            fprintf(stderr, " mtp=%u/%u accepted", f->mtp->num_accepted_tokens, f->mtp->num_draft_tokens);
        fputs("\n", stderr);
    }
}

static int parse_ids(const char *s, int32_t **ret, size_t *n)
{
    size_t cap = 16;
    int32_t *v = malloc(cap * sizeof(*v));
    *n = 0;
    while (v && *s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s) {
            free(v);
            return -EINVAL;
        }
        if (*n == cap) {
            int32_t *nv = realloc(v, (cap *= 2) * sizeof(*v));
            if (!nv) {
                free(v);
                return -ENOMEM;
            }
            v = nv;
        }
        v[(*n)++] = (int32_t)x;
        s = end;
        while (*s == ',' || *s == ' ')
            s++;
    }
    if (!v)
        return -ENOMEM;
    *ret = v;
    return 0;
}

static int cmd_generate(struct ctl *c, int argc, char **argv, double timeout_s, bool chat)
{
    static const struct option lo[] = {
        { "max-tokens", required_argument, NULL, 'm' }, { "temperature", required_argument, NULL, 't' },
        { "top-p", required_argument, NULL, 'p' }, { "top-k", required_argument, NULL, 'k' },
        { "seed", required_argument, NULL, 's' }, { "stop", required_argument, NULL, 'S' },
        { "ids", no_argument, NULL, 'i' }, { "system", required_argument, NULL, 'y' },
        { "effort", required_argument, NULL, 'e' }, { "request-id", required_argument, NULL, 'r' },
        { NULL, 0, NULL, 0 },
    };
    Stepd__V1__GenerateRequest req = STEPD__V1__GENERATE_REQUEST__INIT;
    Stepd__V1__SamplingParams sp = STEPD__V1__SAMPLING_PARAMS__INIT;
    Stepd__V1__TokenIds ti = STEPD__V1__TOKEN_IDS__INIT;
    Stepd__V1__ChatInput ci = STEPD__V1__CHAT_INPUT__INIT;
    Stepd__V1__ChatMessage msgs[2], *pm[2];
    char *stops[16];
    size_t n_stops = 0;
    bool ids = false;
    const char *system = NULL;
    int o, rc;

    optind = 1;
    while ((o = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (o) {
        case 'm': PB_SET(&sp, max_tokens, strtoll(optarg, NULL, 10)); break;
        case 't': PB_SET(&sp, temperature, strtof(optarg, NULL)); break;
        case 'p': PB_SET(&sp, top_p, strtof(optarg, NULL)); break;
        case 'k': PB_SET(&sp, top_k, atoi(optarg)); break;
        case 's': PB_SET(&sp, seed, strtoll(optarg, NULL, 10)); break;
        case 'S':
            if (n_stops == 16) {
                fprintf(stderr, "stepctl: at most 16 --stop\n");
                return 2;
            }
            stops[n_stops++] = optarg;
            break;
        case 'i': ids = true; break;
        case 'y': system = optarg; break;
        case 'e': PB_SET(&ci, reasoning_effort, optarg); break;
        case 'r': req.request_id = optarg; break;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "stepctl: %s needs exactly one %s argument\n", chat ? "chat" : "generate",
                chat ? "MESSAGE" : "PROMPT");
        return 2;
    }
    sp.n_stop = n_stops;
    sp.stop = stops;
    req.sampling_params = &sp;
    if (chat) {
        size_t n = 0;
        if (system) {
            stepd__v1__chat_message__init(&msgs[n]);
            msgs[n].role = "system";
            msgs[n].content = (char *)system;
            pm[n] = &msgs[n];
            n++;
        }
        stepd__v1__chat_message__init(&msgs[n]);
        msgs[n].role = "user";
        msgs[n].content = argv[optind];
        pm[n] = &msgs[n];
        n++;
        ci.n_messages = n;
        ci.messages = pm;
        req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_CHAT;
        req.chat = &ci;
    } else if (ids) {
        if (parse_ids(argv[optind], &ti.ids, &ti.n_ids) < 0) {
            fprintf(stderr, "stepctl: --ids: PROMPT must be comma-separated integers\n");
            return 2;
        }
        req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
        req.token_ids = &ti;
        c->print_ids = true;
    } else {
        req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TEXT;
        req.text = argv[optind];
    }
    c->tty = isatty(1);
    c->resp_desc = &stepd__v1__generate_response__descriptor;
    c->on_resp = gen_resp;
    rc = run_call(c, "/stepd.v1.Inference/Generate", &req.base, timeout_s);
    free(ti.ids);
    return rc;
}

/* ------------------------------------------------------------------ others */

static int health_status;

static void health_resp(struct ctl *c, const ProtobufCMessage *m)
{
    health_status = ((const Grpc__Health__V1__HealthCheckResponse *)m)->status;
}

static const char *health_name(int s)
{
    switch (s) {
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    }
    return "UNKNOWN";
}

static int cmd_health(struct ctl *c, const char *svc, double timeout_s, bool quiet)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)svc;
    c->resp_desc = &grpc__health__v1__health_check_response__descriptor;
    c->on_resp = health_resp;
    health_status = 0;
    if (quiet) {
        c->done = false;
        if (rpc_client_start(c->ch, "/grpc.health.v1.Health/Check", &req.base, c->resp_desc,
                             rpc_now_ms() + (int64_t)(timeout_s * 1000), on_msg, on_done, c, NULL) < 0)
            return 1;
        while (!c->done)
            uv_run(c->loop, UV_RUN_ONCE);
        return c->status == RPC_OK && health_status == 1 ? 0 : 1;
    }
    int rc = run_call(c, "/grpc.health.v1.Health/Check", &req.base, timeout_s);
    if (rc)
        return rc;
    printf("%s: %s\n", svc[0] ? svc : "(liveness)", health_name(health_status));
    return health_status == 1 ? 0 : 1;
}

static void info_resp(struct ctl *c, const ProtobufCMessage *m)
{
    if (m->descriptor == &stepd__v1__get_server_info_response__descriptor) {
        const Stepd__V1__GetServerInfoResponse *r = (const void *)m;
        printf("server: stepd %s (%s), up %.0f s, groups ready %u/%u, running %u, waiting %u%s\n", r->version,
               r->role, r->uptime_s, r->groups_ready, r->groups_total, r->running, r->waiting,
               r->draining ? ", DRAINING" : "");
        if (r->limits)
            printf("limits: max_running %u, max_queue %u, max_tokens cap %u, recv %u bytes\n", r->limits->max_running,
                   r->limits->max_queue, r->limits->max_tokens_cap, r->limits->max_receive_message_bytes);
    } else {
        const Stepd__V1__GetModelInfoResponse *r = (const void *)m;
        printf("model: %s (%s), vocab %u, context %u, layers %u, experts %u (top-%u), %s, MTP layers %u\n",
               r->model_name, r->model_type, r->vocab_size, r->max_model_len, r->num_layers, r->num_experts,
               r->num_experts_per_tok, r->quantization, r->num_mtp_layers);
    }
}

static int cmd_info(struct ctl *c, double timeout_s)
{
    Stepd__V1__GetServerInfoRequest a = STEPD__V1__GET_SERVER_INFO_REQUEST__INIT;
    Stepd__V1__GetModelInfoRequest b = STEPD__V1__GET_MODEL_INFO_REQUEST__INIT;
    c->on_resp = info_resp;
    c->resp_desc = &stepd__v1__get_server_info_response__descriptor;
    int rc = run_call(c, "/stepd.v1.Inference/GetServerInfo", &a.base, timeout_s);
    if (rc)
        return rc;
    c->resp_desc = &stepd__v1__get_model_info_response__descriptor;
    return run_call(c, "/stepd.v1.Inference/GetModelInfo", &b.base, timeout_s);
}

static void loads_resp(struct ctl *c, const ProtobufCMessage *m)
{
    const Stepd__V1__GetLoadsResponse *r = (const void *)m;
    printf("%-16s %8s %8s %10s %8s\n", "group", "running", "waiting", "kv_blocks", "kv_use");
    for (size_t i = 0; i < r->n_loads; i++) {
        const Stepd__V1__GroupLoad *l = r->loads[i];
        printf("%-16s %8u %8u %5u/%-5u %7.1f%%\n", l->group, l->num_running, l->num_waiting, l->kv_blocks_used,
               l->kv_blocks_total, 100.0 * l->kv_usage);
    }
}

static const char *wstate(int s)
{
    static const char *n[] = { "?", "registered", "loading", "ready", "failed", "gone", "draining" };
    return s >= 0 && s < 7 ? n[s] : "?";
}

static void groups_resp(struct ctl *c, const ProtobufCMessage *m)
{
    const Stepd__V1__GetGroupsResponse *r = (const void *)m;
    for (size_t i = 0; i < r->n_groups; i++) {
        const Stepd__V1__GroupInfo *g = r->groups[i];
        printf("group %s: %s, world %u, epoch %" PRIu64 ", engine %s", g->group, wstate(g->state), g->world_size,
               g->epoch, g->engine_address[0] ? g->engine_address : "-");
        if (g->counters)
            printf(", routed %" PRIu64 ", completed %" PRIu64 ", failed %" PRIu64 ", aborts %" PRIu64
                   ", in flight %u", g->counters->routed, g->counters->completed, g->counters->failed,
                   g->counters->aborts_sent, g->counters->in_flight);
        printf("\n");
        for (size_t k = 0; k < g->n_ranks; k++) {
            const Stepd__V1__RankInfo *rk = g->ranks[k];
            printf("  rank %u: %-10s %-8s pid %-7u host %-16s load %3.0f%% %s\n", rk->rank, wstate(rk->state),
                   rk->device, rk->pid, rk->hostname, 100.0 * rk->load_progress, rk->message);
        }
    }
    if (r->n_groups == 0)
        printf("no worker groups registered\n");
}

static void drain_resp(struct ctl *c, const ProtobufCMessage *m)
{
    const Stepd__V1__DrainResponse *r = (const void *)m;
    printf("draining: %u in flight, %u waiting\n", r->in_flight, r->waiting);
}

/* ------------------------------------------------------------------ wait-ready */

#define WAIT_READY_POLL_MS 50

/* Why the server is not ready, from Admin.GetGroups: each group not ready with its state and
 * its ranks' messages ("not restarted: ...", "loading 40%"); *ret_hopeless when every group
 * was given up (failed: the supervisor will not start it again). */
struct why_ctx {
    char *buf;
    size_t n;
    bool hopeless;
};

static void why_resp(struct ctl *c, const ProtobufCMessage *m)
{
    const Stepd__V1__GetGroupsResponse *r = (const void *)m;
    struct why_ctx *w = c->ud;
    size_t off = 0, failed = 0;

    w->buf[0] = '\0';
    if (r->n_groups == 0)
        snprintf(w->buf, w->n, "no worker group has registered");
    for (size_t i = 0; i < r->n_groups && off + 1 < w->n; i++) {
        const Stepd__V1__GroupInfo *g = r->groups[i];
        const char *msg = "";
        float prog = 0;

        if (g->state == STEPD__V1__WORKER_STATE__WORKER_STATE_READY)
            continue;
        failed += g->state == STEPD__V1__WORKER_STATE__WORKER_STATE_FAILED;
        for (size_t k = 0; k < g->n_ranks; k++) {
            prog += g->ranks[k]->load_progress / (float)g->n_ranks;
            if (!msg[0] && g->ranks[k]->message[0])
                msg = g->ranks[k]->message;
        }
        off += (size_t)snprintf(w->buf + off, w->n - off, "%sgroup %s: %s", off ? "; " : "", g->group,
                                wstate(g->state));
        if (g->state == STEPD__V1__WORKER_STATE__WORKER_STATE_LOADING && off < w->n)
            off += (size_t)snprintf(w->buf + off, w->n - off, " %.0f%%", 100.0 * prog);
        if (msg[0] && off < w->n)
            off += (size_t)snprintf(w->buf + off, w->n - off, " (%s)", msg);
    }
    w->hopeless = r->n_groups > 0 && failed == r->n_groups;
}

static int ask_why(struct ctl *c, struct rpc_channel *adm, struct why_ctx *w)
{
    Stepd__V1__GetGroupsRequest req = STEPD__V1__GET_GROUPS_REQUEST__INIT;

    c->resp_desc = &stepd__v1__get_groups_response__descriptor;
    c->on_resp = why_resp;
    c->ud = w;
    c->done = false;
    if (rpc_client_start(adm, "/stepd.v1.Admin/GetGroups", &req.base, c->resp_desc, rpc_now_ms() + 1000, on_msg,
                         on_done, c, NULL) < 0)
        return -1;
    while (!c->done)
        uv_run(c->loop, UV_RUN_ONCE);
    return c->status == RPC_OK ? 0 : -1;
}

/* Poll readiness every WAIT_READY_POLL_MS until SERVING (0) or the timeout (1), then say why
 * not: the groups' states and messages (Admin port), or that the server cannot be reached.
 * Ends early when every group was given up.  A channel whose connection failed is made anew
 * (a new connection is tried at once, not after gRPC's reconnect backoff of ~1 s). */
static int cmd_wait_ready(struct ctl *c, const char *addr, struct rpc_channel *adm, double t,
                          const char *target, const struct rpc_channel_opts *co)
{
    int64_t end = rpc_now_ms() + (int64_t)(t * 1000), next_why = 0;
    char why[1024] = "", last[1024] = "";
    struct why_ctx w = { why, sizeof(why), false };

    for (;;) {
        int64_t now = rpc_now_ms();

        if (cmd_health(c, "readiness", 1, true) == 0) {
            printf("ready\n");
            return 0;
        }
        if (c->status != RPC_OK) {
            snprintf(why, sizeof(why), "cannot reach %s: %s: %.600s", addr, rpc_status_name(c->status), c->details);
            rpc_channel_destroy(c->ch);
            c->ch = NULL;
            if (rpc_channel_create(c->rpc, target, co, &c->ch) < 0) {
                fprintf(stderr, "stepctl: cannot create a channel to %s\n", target);
                return 1;
            }
        } else if (now >= next_why) {
            next_why = now + 500;
            if (ask_why(c, adm, &w) < 0)
                snprintf(why, sizeof(why), "readiness NOT_SERVING (the Admin port says no more: %s)",
                         rpc_status_name(c->status));
            if (w.hopeless) {
                fprintf(stderr, "stepctl: not ready and will not be: %s\n", why);
                return 1;
            }
        }
        if (why[0] && strcmp(why, last) != 0) {
            fprintf(stderr, "stepctl: not ready: %s\n", why);
            snprintf(last, sizeof(last), "%s", why);
        }
        if (now >= end)
            break;
        usleep(WAIT_READY_POLL_MS * 1000);
    }
    fprintf(stderr, "stepctl: not ready before the timeout (%.0f s): %s\n", t, why[0] ? why : "no answer");
    return 1;
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "addr", required_argument, NULL, 'a' }, { "admin-addr", required_argument, NULL, 'A' },
        { "api-key-file", required_argument, NULL, 'K' }, { "tls-ca", required_argument, NULL, 'C' },
        { "timeout", required_argument, NULL, 'T' }, { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, 'V' }, { NULL, 0, NULL, 0 },
    };
    struct ctl c = { 0 };
    const char *addr = getenv("STEPD_ADDR") ? getenv("STEPD_ADDR") : "127.0.0.1:20051";
    const char *admin = getenv("STEPD_ADMIN_ADDR") ? getenv("STEPD_ADMIN_ADDR") : "127.0.0.1:20053";
    const char *key_file = NULL, *ca = NULL;
    char key[1024] = "";
    double timeout_s = -1;
    int o, rc = 2;

    log_init("stepctl", NULL);
    /* options before the command only */
    while ((o = getopt_long(argc, argv, "+h", lo, NULL)) != -1) {
        switch (o) {
        case 'a': addr = optarg; break;
        case 'A': admin = optarg; break;
        case 'K': key_file = optarg; break;
        case 'C': ca = optarg; break;
        case 'T': timeout_s = strtod(optarg, NULL); break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("stepctl %s\n", STEPD_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    int sargc = argc - optind;
    char **sargv = argv + optind;
    if (key_file) {
        char *k;
        int kr = file_read_secret(key_file, &k);

        if (kr < 0) {
            fprintf(stderr, "stepctl: --api-key-file %s: %s\n", key_file,
                    kr == -ENODATA ? "file is empty" : strerror(-kr));
            return 2;
        }
        snprintf(key, sizeof(key), "%s", k);
        free(k);
    } else if (getenv("STEPD_API_KEY")) {
        snprintf(key, sizeof(key), "%s", getenv("STEPD_API_KEY"));
    }
    bool is_admin = !strcmp(cmd, "groups") || !strcmp(cmd, "drain");
    struct rpc_tls_files tls = { .root_file = ca };
    struct rpc_channel_opts co = { .api_key = key[0] ? key : NULL, .tls = ca ? &tls : NULL, .keepalive_time_ms = -1 };
    c.loop = uv_default_loop();
    if (rpc_ctx_create(c.loop, &c.rpc) < 0 || rpc_channel_create(c.rpc, is_admin ? admin : addr, &co, &c.ch) < 0) {
        fprintf(stderr, "stepctl: cannot create a channel to %s\n", is_admin ? admin : addr);
        return 1;
    }
    if (!strcmp(cmd, "generate") || !strcmp(cmd, "chat")) {
        rc = cmd_generate(&c, sargc, sargv, timeout_s > 0 ? timeout_s : 300, !strcmp(cmd, "chat"));
    } else if (!strcmp(cmd, "health")) {
        rc = cmd_health(&c, sargc > 1 ? sargv[1] : "", timeout_s > 0 ? timeout_s : 5, false);
    } else if (!strcmp(cmd, "wait-ready")) {
        double t = timeout_s > 0 ? timeout_s : 60;
        struct rpc_channel *adm = NULL;
        struct rpc_channel_opts wco = co;

        if (sargc == 3 && !strcmp(sargv[1], "--timeout"))
            t = strtod(sargv[2], NULL);
        wco.own_connection = true;
        rpc_channel_destroy(c.ch);
        c.ch = NULL;
        if (rpc_channel_create(c.rpc, addr, &wco, &c.ch) < 0 || rpc_channel_create(c.rpc, admin, &co, &adm) < 0) {
            fprintf(stderr, "stepctl: cannot create a channel to %s or %s\n", addr, admin);
            goto out;
        }
        rc = cmd_wait_ready(&c, addr, adm, t, addr, &wco);
        rpc_channel_destroy(adm);
    } else if (!strcmp(cmd, "info")) {
        rc = cmd_info(&c, timeout_s > 0 ? timeout_s : 5);
    } else if (!strcmp(cmd, "loads")) {
        Stepd__V1__GetLoadsRequest req = STEPD__V1__GET_LOADS_REQUEST__INIT;
        c.resp_desc = &stepd__v1__get_loads_response__descriptor;
        c.on_resp = loads_resp;
        rc = run_call(&c, "/stepd.v1.Inference/GetLoads", &req.base, timeout_s > 0 ? timeout_s : 5);
    } else if (!strcmp(cmd, "groups")) {
        Stepd__V1__GetGroupsRequest req = STEPD__V1__GET_GROUPS_REQUEST__INIT;
        c.resp_desc = &stepd__v1__get_groups_response__descriptor;
        c.on_resp = groups_resp;
        rc = run_call(&c, "/stepd.v1.Admin/GetGroups", &req.base, timeout_s > 0 ? timeout_s : 5);
    } else if (!strcmp(cmd, "drain")) {
        Stepd__V1__DrainRequest req = STEPD__V1__DRAIN_REQUEST__INIT;
        req.exit_when_drained = true;
        for (int i = 1; i < sargc; i++) {
            if (!strcmp(sargv[i], "--stay"))
                req.exit_when_drained = false;
            else if (!strcmp(sargv[i], "--timeout") && i + 1 < sargc)
                PB_SET(&req, timeout_ms, (uint32_t)(strtod(sargv[++i], NULL) * 1000));
            else {
                usage(stderr);
                goto out;
            }
        }
        c.resp_desc = &stepd__v1__drain_response__descriptor;
        c.on_resp = drain_resp;
        rc = run_call(&c, "/stepd.v1.Admin/Drain", &req.base, timeout_s > 0 ? timeout_s : 5);
    } else {
        fprintf(stderr, "stepctl: unknown command '%s'\n", cmd);
        usage(stderr);
    }
out:
    if (c.ch)
        rpc_channel_destroy(c.ch);
    rpc_ctx_destroy(c.rpc);
    uv_run(c.loop, UV_RUN_DEFAULT);
    return rc;
}
