/* mock-engine.c - a fake worker rank for coordinator tests, built on daemon/rpc.
 *
 * Registers with the coordinator's control service exactly like a worker (Session,
 * ReportState LOADING then READY after the rendezvous) and, as rank 0, serves
 * stepd.v1.Engine: Generate streams deterministic tokens
 *     token[i] = (sum(prompt) + 7 * i + 1) % vocab
 * one per --delay-ms (the first after --ttft-ms), then a Final with finish reason
 * LENGTH (or STOP at --eos-after tokens when set), usage, fake MTP statistics and
 * timings. Abort and client cancellation stop a stream. Counters (generate calls,
 * aborts, cancels, tokens) go to --stats-file after every change of request state,
 * so tests can prove that a rejected request never reached an engine.
 *
 * --send-log FILE appends one line per finished stream, "<request_id> <t_us>...", the
 * rpc_now_us() time at which each token chunk was handed to gRPC, so that a client
 * on the same host can measure per-token delivery latency (loadgen --send-log).
 *
 * Fault hooks: --exit-after-tokens N (exit(3) after N tokens in total: "crash"),
 * --stall-file PATH (while it exists no tokens are produced).
 *
 * When the session ends with ABORTED (group re-forming) the mock registers again;
 * when it ends otherwise (coordinator gone) the mock exits 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"
#include "control.pb-c.h"

struct mock {
    uv_loop_t *loop;
    struct rpc_ctx *rpc;
    struct rpc_server *srv;
    struct rpc_channel *ctl;
    const char *coordinator, *group, *listen, *stats_file, *stall_file;
    int stats_fd;                   /* stats_file, open from the first write on */
    FILE *send_log;
    unsigned rank, world, vocab, max_model_len, delay_ms, ttft_ms, eos_after;
    uint64_t exit_after_tokens;
    int port;
    char engine_addr[64];
    char session_id[128];
    uint64_t n_generate, n_abort, n_cancel, n_tokens, n_finished;
    unsigned running;
    struct mstream *streams;
    uv_timer_t reconnect;
    bool quitting;
};

struct mstream {
    struct mock *m;
    struct mstream *prev, *next;
    struct rpc_call *call;
    uv_timer_t timer;
    char id[136];
    int64_t seed;
    uint32_t n_prompt, max_tokens, n_out;
    int64_t t0, t_first;
    int64_t *t_send;                /* --send-log: per token chunk, rpc_now_us() */
    uint32_t n_send, cap_send;
    bool done;
};

static struct mock M;

/* The counters, rewritten in place at every change: fixed-width fields, so one pwrite
 * of the same length over the same bytes, no new file and no rename (a create and a
 * rename per request state change, two engines in one directory, stalled the loop for
 * tens of ms under 1000 streams: inter-token gaps the coordinator was blamed for).
 * Readers read until two reads agree (stepd_harness.py). */
static void stats_write(struct mock *m)
{
    char buf[256];

    if (!m->stats_file)
        return;
    if (m->stats_fd < 0) {
        m->stats_fd = open(m->stats_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (m->stats_fd < 0)
            return;
    }
    int n = snprintf(buf, sizeof(buf), "generate=%020" PRIu64 "\nabort=%020" PRIu64 "\ncancel=%020" PRIu64
                     "\ntokens=%020" PRIu64 "\nfinished=%020" PRIu64 "\nrunning=%010u\n",
                     m->n_generate, m->n_abort, m->n_cancel, m->n_tokens, m->n_finished, m->running);
    if (pwrite(m->stats_fd, buf, (size_t)n, 0) != n)
        fprintf(stderr, "mock-engine: writing %s failed\n", m->stats_file);
}

static void stream_closed(uv_handle_t *h)
{
    struct mstream *s = h->data;
    free(s->t_send);
    free(s);
}

static void send_log_write(struct mock *m, struct mstream *s)
{
    if (!m->send_log || !s->n_send)
        return;
    fputs(s->id, m->send_log);
    for (uint32_t i = 0; i < s->n_send; i++)
        fprintf(m->send_log, " %" PRId64, s->t_send[i]);
    fputc('\n', m->send_log);
    fflush(m->send_log);
}

static void stream_end(struct mstream *s)
{
    struct mock *m = s->m;
    if (s->done)
        return;
    s->done = true;
    uv_timer_stop(&s->timer);
    if (s->prev)
        s->prev->next = s->next;
    else
        m->streams = s->next;
    if (s->next)
        s->next->prev = s->prev;
    m->running--;
    m->n_finished++;
    send_log_write(m, s);
    stats_write(m);
    uv_close((uv_handle_t *)&s->timer, stream_closed);
}

static void send_final(struct mstream *s, int reason, const char *message)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Final f = STEPD__V1__FINAL__INIT;
    Stepd__V1__Usage u = STEPD__V1__USAGE__INIT;
    Stepd__V1__MtpStats mtp = STEPD__V1__MTP_STATS__INIT;
    Stepd__V1__Timings t = STEPD__V1__TIMINGS__INIT;
    uint32_t per_pos[3];

    u.prompt_tokens = s->n_prompt;
    u.completion_tokens = s->n_out;
    mtp.num_drafts = s->n_out / 2;
    mtp.num_draft_tokens = mtp.num_drafts * 3;
    per_pos[0] = mtp.num_drafts;
    per_pos[1] = mtp.num_drafts / 2;
    per_pos[2] = mtp.num_drafts / 4;
    mtp.num_accepted_tokens = per_pos[0] + per_pos[1] + per_pos[2];
    mtp.n_accepted_per_position = 3;
    mtp.accepted_per_position = per_pos;
    t.prefill_s = s->t_first ? (double)(s->t_first - s->t0) / 1000.0 : 0;
    f.finish_reason = reason;
    f.message = (char *)message;
    f.usage = &u;
    f.mtp = &mtp;
    f.timings = &t;
    f.request_id = s->id;
    resp.request_id = s->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
    resp.final = &f;
    rpc_call_send(s->call, &resp.base);
    rpc_call_finish(s->call, RPC_OK, NULL);
    s->call = NULL;
}

static void tick(uv_timer_t *t)
{
    struct mstream *s = t->data;
    struct mock *m = s->m;

    if (m->stall_file && access(m->stall_file, F_OK) == 0)
        return;
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Chunk ch = STEPD__V1__CHUNK__INIT;
    int32_t tok = (int32_t)(((uint64_t)s->seed + 7ull * s->n_out + 1) % m->vocab);
    ch.n_token_ids = 1;
    ch.token_ids = &tok;
    resp.request_id = s->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = &ch;
    if (!s->t_first)
        s->t_first = rpc_now_ms();
    if (m->send_log && s->n_send < s->cap_send)
        s->t_send[s->n_send++] = rpc_now_us();
    if (rpc_call_send(s->call, &resp.base) < 0) {
        rpc_call_finish(s->call, RPC_CANCELLED, "stream gone");
        s->call = NULL;
        stream_end(s);
        return;
    }
    s->n_out++;
    m->n_tokens++;
    if (m->exit_after_tokens && m->n_tokens >= m->exit_after_tokens) {
        fprintf(stderr, "mock-engine: fault hook: exiting after %" PRIu64 " tokens\n", m->n_tokens);
        stats_write(m);
        _exit(3);
    }
    if (m->eos_after && s->n_out >= m->eos_after) {
        send_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_STOP, "eos");
        stream_end(s);
    } else if (s->n_out >= s->max_tokens) {
        send_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH, "");
        stream_end(s);
    }
}

static void on_stream_cancel(struct rpc_call *call, void *ud)
{
    struct mstream *s = ud;
    s->m->n_cancel++;
    rpc_call_finish(call, RPC_CANCELLED, "cancelled");
    s->call = NULL;
    stream_end(s);
}

static void h_generate(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__V1__GenerateRequest *r = (const void *)msg;
    struct mstream *s;

    m->n_generate++;
    if (r->input_case != STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS || r->token_ids->n_ids == 0) {
        stats_write(m);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "input: the engine takes token_ids only");
        return;
    }
    s = calloc(1, sizeof(*s));
    s->m = m;
    s->call = call;
    snprintf(s->id, sizeof(s->id), "%s", r->request_id);
    for (size_t i = 0; i < r->token_ids->n_ids; i++)
        s->seed += r->token_ids->ids[i];
    s->n_prompt = (uint32_t)r->token_ids->n_ids;
    s->max_tokens = r->sampling_params && PB_HAS(r->sampling_params, max_tokens)
                        ? (uint32_t)r->sampling_params->max_tokens : 16;
    s->t0 = rpc_now_ms();
    if (m->send_log) {
        s->cap_send = s->max_tokens < 65536 ? s->max_tokens : 65536;
        s->t_send = malloc(s->cap_send * sizeof(*s->t_send));
        if (!s->t_send)
            s->cap_send = 0;
    }
    uv_timer_init(m->loop, &s->timer);
    s->timer.data = s;
    s->next = m->streams;
    if (m->streams)
        m->streams->prev = s;
    m->streams = s;
    m->running++;
    stats_write(m);
    rpc_call_on_cancel(call, on_stream_cancel, s);
    uv_timer_start(&s->timer, tick, m->ttft_ms ? m->ttft_ms : m->delay_ms, m->delay_ms ? m->delay_ms : 1);
}

static void h_abort(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__V1__AbortRequest *r = (const void *)msg;
    Stepd__V1__AbortResponse resp = STEPD__V1__ABORT_RESPONSE__INIT;

    for (size_t i = 0; i < r->n_request_ids; i++) {
        m->n_abort++;
        for (struct mstream *s = m->streams; s; s = s->next) {
            if (strcmp(s->id, r->request_ids[i]) == 0) {
                if (s->call) {
                    rpc_call_on_cancel(s->call, NULL, NULL);
                    send_final(s, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT, "aborted");
                }
                stream_end(s);
                resp.aborted++;
                break;
            }
        }
    }
    stats_write(m);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_loads(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    Stepd__V1__GetLoadsResponse resp = STEPD__V1__GET_LOADS_RESPONSE__INIT;
    Stepd__V1__GroupLoad l = STEPD__V1__GROUP_LOAD__INIT;
    Stepd__V1__GroupLoad *pl = &l;
    l.group = (char *)m->group;
    l.num_running = m->running;
    l.kv_blocks_total = 1024;
    l.kv_blocks_used = m->running > 1024 ? 1024 : m->running;
    l.kv_usage = l.kv_blocks_used / 1024.0;
    resp.n_loads = 1;
    resp.loads = &pl;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void fill_model(struct mock *m, Stepd__Ctl__V1__ModelSummary *ms, int32_t *eos)
{
    ms->model_name = "mock-step";
    ms->model_type = "step3p7";
    ms->vocab_size = m->vocab;
    ms->max_model_len = m->max_model_len;
    eos[0] = 1;
    ms->n_eos_token_ids = 1;
    ms->eos_token_ids = eos;
    ms->num_layers = 4;
    ms->hidden_size = 64;
    ms->num_experts = 8;
    ms->num_experts_per_tok = 2;
    ms->quantization = "mock";
    ms->num_mtp_layers = 3;
    ms->max_num_speculative_tokens = 3;
}

static void h_model_info(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    Stepd__V1__GetModelInfoResponse resp = STEPD__V1__GET_MODEL_INFO_RESPONSE__INIT;
    int32_t eos = 1;
    resp.model_name = "mock-step";
    resp.model_type = "step3p7";
    resp.vocab_size = m->vocab;
    resp.max_model_len = m->max_model_len;
    resp.n_eos_token_ids = 1;
    resp.eos_token_ids = &eos;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

/* ------------------------------------------------------------------ control client */

static void session_start(struct mock *m);

static void report_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    if (status != RPC_OK)
        fprintf(stderr, "mock-engine: ReportState: %s %s\n", rpc_status_name(status), details);
}

static void report(struct mock *m, int state, float progress)
{
    Stepd__Ctl__V1__StateReport r = STEPD__CTL__V1__STATE_REPORT__INIT;
    r.session_id = m->session_id;
    r.state = state;
    r.load_progress = progress;
    r.kv_blocks_total = 1024;
    rpc_client_start(m->ctl, "/stepd.ctl.v1.Control/ReportState", &r.base,
                     &stepd__ctl__v1__state_ack__descriptor, rpc_now_ms() + 5000, NULL, report_done, m, NULL);
}

static void session_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct mock *m = ud;
    const Stepd__Ctl__V1__ControlEvent *ev = (const void *)msg;

    switch (ev->event_case) {
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED:
        snprintf(m->session_id, sizeof(m->session_id), "%s", ev->registered->session_id);
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_RENDEZVOUS:
        report(m, STEPD__CTL__V1__RANK_STATE__RANK_STATE_LOADING, 0.5f);
        report(m, STEPD__CTL__V1__RANK_STATE__RANK_STATE_READY, 1.0f);
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT:
        fprintf(stderr, "mock-engine: group abort: %s\n", ev->group_abort->reason);
        break;
    default:
        break;
    }
}

static void reconnect_cb(uv_timer_t *t)
{
    session_start(t->data);
}

static void quit(struct mock *m);

static void session_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct mock *m = ud;
    if (m->quitting)
        return;
    if (status == RPC_ABORTED || (status == RPC_UNAVAILABLE && !m->session_id[0])) {
        /* group re-forming, or coordinator not up yet: register again */
        m->session_id[0] = '\0';
        uv_timer_start(&m->reconnect, reconnect_cb, 200, 0);
        return;
    }
    fprintf(stderr, "mock-engine: control session ended (%s: %s); exiting\n", rpc_status_name(status), details);
    quit(m);
}

static void session_start(struct mock *m)
{
    Stepd__Ctl__V1__RegisterRequest r = STEPD__CTL__V1__REGISTER_REQUEST__INIT;
    Stepd__Ctl__V1__ModelSummary ms = STEPD__CTL__V1__MODEL_SUMMARY__INIT;
    int32_t eos[1];
    char host[64];

    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    r.group = (char *)m->group;
    r.rank = m->rank;
    r.world_size = m->world;
    r.device = "cpu";
    r.engine_address = m->rank == 0 ? m->engine_addr : "";
    r.pid = (uint32_t)getpid();
    r.hostname = host;
    r.incarnation = (uint64_t)rpc_now_ms();
    if (m->rank == 0) {
        fill_model(m, &ms, eos);
        r.model = &ms;
    }
    rpc_client_start(m->ctl, "/stepd.ctl.v1.Control/Session", &r.base, &stepd__ctl__v1__control_event__descriptor,
                     0, session_msg, session_done, m, NULL);
}

static void srv_down(void *ud)
{
    struct mock *m = ud;
    rpc_server_destroy(m->srv);
    m->srv = NULL;
    uv_stop(m->loop);
}

static void quit(struct mock *m)
{
    if (m->quitting)
        return;
    m->quitting = true;
    stats_write(m);
    uv_close((uv_handle_t *)&m->reconnect, NULL);
    if (m->srv) {
        rpc_server_shutdown(m->srv, srv_down, m);
        rpc_server_cancel_all(m->srv);
    } else {
        uv_stop(m->loop);
    }
}

static void on_sig(uv_signal_t *h, int sig)
{
    uv_signal_stop(h);
    uv_close((uv_handle_t *)h, NULL);
    quit(h->data);
}

int main(int argc, char **argv)
{
    static const struct option lo[] = {
        { "coordinator", required_argument, NULL, 'c' }, { "group", required_argument, NULL, 'g' },
        { "rank", required_argument, NULL, 'r' }, { "world", required_argument, NULL, 'w' },
        { "listen", required_argument, NULL, 'l' }, { "delay-ms", required_argument, NULL, 'd' },
        { "ttft-ms", required_argument, NULL, 't' }, { "vocab", required_argument, NULL, 'v' },
        { "max-model-len", required_argument, NULL, 'L' }, { "stats-file", required_argument, NULL, 's' },
        { "exit-after-tokens", required_argument, NULL, 'x' }, { "eos-after", required_argument, NULL, 'e' },
        { "stall-file", required_argument, NULL, 'S' }, { "send-log", required_argument, NULL, 'T' },
        { NULL, 0, NULL, 0 },
    };
    struct mock *m = &M;
    int c;

    m->coordinator = "127.0.0.1:50052";
    m->group = "g0";
    m->world = 1;
    m->listen = "127.0.0.1:0";
    m->delay_ms = 5;
    m->stats_fd = -1;
    m->vocab = 1000;
    m->max_model_len = 4096;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'c': m->coordinator = optarg; break;
        case 'g': m->group = optarg; break;
        case 'r': m->rank = (unsigned)atoi(optarg); break;
        case 'w': m->world = (unsigned)atoi(optarg); break;
        case 'l': m->listen = optarg; break;
        case 'd': m->delay_ms = (unsigned)atoi(optarg); break;
        case 't': m->ttft_ms = (unsigned)atoi(optarg); break;
        case 'v': m->vocab = (unsigned)atoi(optarg); break;
        case 'L': m->max_model_len = (unsigned)atoi(optarg); break;
        case 's': m->stats_file = optarg; break;
        case 'x': m->exit_after_tokens = strtoull(optarg, NULL, 10); break;
        case 'e': m->eos_after = (unsigned)atoi(optarg); break;
        case 'S': m->stall_file = optarg; break;
        case 'T':
            m->send_log = fopen(optarg, "a");
            if (!m->send_log) {
                fprintf(stderr, "mock-engine: --send-log %s: %s\n", optarg, strerror(errno));
                return 2;
            }
            break;
        default:
            fprintf(stderr, "usage: mock-engine --coordinator ADDR --group G [--rank R --world N] "
                            "[--delay-ms D] [--stats-file F] ...\n");
            return 2;
        }
    }
    log_init("mock-engine", m->group);
    signal(SIGPIPE, SIG_IGN);
    m->loop = uv_default_loop();
    if (rpc_ctx_create(m->loop, &m->rpc) < 0)
        return 1;
    uv_timer_init(m->loop, &m->reconnect);
    m->reconnect.data = m;
    if (m->rank == 0) {
        struct rpc_server_opts so = { 0 };
        struct rpc_method ms[] = {
            { "/stepd.v1.Engine/Generate", &stepd__v1__generate_request__descriptor, true, false, h_generate, m },
            { "/stepd.v1.Engine/Abort", &stepd__v1__abort_request__descriptor, false, false, h_abort, m },
            { "/stepd.v1.Engine/GetLoads", &stepd__v1__get_loads_request__descriptor, false, false, h_loads, m },
            { "/stepd.v1.Engine/GetModelInfo", &stepd__v1__get_model_info_request__descriptor, false, false,
              h_model_info, m },
        };
        if (rpc_server_create(m->rpc, &so, &m->srv) < 0)
            return 1;
        for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++)
            rpc_server_add_method(m->srv, &ms[i]);
        if (rpc_server_listen(m->srv, m->listen, &m->port) < 0)
            return 1;
        rpc_server_start(m->srv);
        snprintf(m->engine_addr, sizeof(m->engine_addr), "127.0.0.1:%d", m->port);
    }
    struct rpc_channel_opts co = { .api_key = getenv("STEPD_CONTROL_KEY"), .keepalive_time_ms = 10000 };
    if (rpc_channel_create(m->rpc, m->coordinator, &co, &m->ctl) < 0)
        return 1;
    uv_signal_t sterm;
    uv_signal_init(m->loop, &sterm);
    sterm.data = m;
    uv_signal_start(&sterm, on_sig, SIGTERM);
    stats_write(m);
    session_start(m);
    uv_run(m->loop, UV_RUN_DEFAULT);
    /* exit without a full teardown: the test harness only needs a clean exit code */
    stats_write(m);
    fprintf(stderr, "mock-engine %s/%u: exit (generate=%" PRIu64 ")\n", m->group, m->rank, m->n_generate);
    return 0;
}
