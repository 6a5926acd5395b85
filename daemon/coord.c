/* coord.c - the coordinator's top object: servers, Inference/Admin/Health
 * handlers, readiness, drain and shutdown. Requests live in req.c, workers in
 * wpool.c, metrics in metrics.c. */
#include <arpa/inet.h>
#include <malloc.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "coord-int.h"
#include "err.h"
#include "log.h"
#include "net.h"
#include "notify.h"
#include "openai.h"
#include "pb-util.h"
#include "serve.h"
#include "stepd-config.h"


void coord_opts_default(struct coord_opts *o)
{
    memset(o, 0, sizeof(*o));
    /* below Linux's ephemeral range (32768-60999), so that a restart can bind them */
    o->listen = "127.0.0.1:20051";
    o->control_listen = "127.0.0.1:20052";
    o->admin_listen = "127.0.0.1:20053";
    o->metrics_listen = "127.0.0.1:9464";
    o->http_host = "127.0.0.1";
    o->http_port = 8000;
    o->reasoning_parser = true;
    o->tool_parser = true;
    o->max_n = 16;
    o->responses_store_size = 1024;
    o->responses_store_ttl_s = 3600;
    o->http_max_body_bytes = 4 << 20;
    o->http_max_header_bytes = 32 << 10;
    o->http_max_connections = 1024;
    o->http_max_connections_per_ip = 256;
    o->http_header_timeout_ms = 10000;
    o->http_timeout_ms = 30000;
    o->max_running = 1024;
    o->prefix_affinity = 16;        /* the engines' default KV block size */
    o->prefix_affinity_entries = 1u << 16;
    o->max_queue = 1024;
    o->max_tokens_cap = 32768;
    o->default_max_tokens = 256;
    o->max_stop = 16;
    o->max_stop_len = 256;
    o->max_logprobs = 20;
    o->max_logit_bias = 1024;
    o->max_stop_token_ids = 64;
    o->max_prompt_bytes = 1 << 20;
    o->drain_timeout_ms = 30000;
    o->heartbeat_ms = 1000;
    o->worker_timeout_ms = 10000;
    o->loads_poll_ms = 250;
    o->max_recv_msg_bytes = 4 << 20;
    o->max_concurrent_streams = 1024;
    o->max_call_buffer_bytes = 1 << 20;
}

/* ------------------------------------------------------------------ shutdown */

static void shutdown_servers(struct coord *co);
static void force_cb(uv_timer_t *t);

void coord_check_drained(struct coord *co)
{
    if (co->draining && !co->exiting && co->n_reqs == 0) {
        log_info("drain complete: no requests in flight");
        shutdown_servers(co);
    }
}

static void drain_timeout_cb(uv_timer_t *t)
{
    struct coord *co = t->data;
    if (co->exiting)
        return;
    log_warn("drain timeout: %u requests still in flight; ending them", co->n_reqs);
    req_fail_all(co, RPC_UNAVAILABLE, "server shutting down (drain timeout)");
    shutdown_servers(co);
}

static void coord_drain(struct coord *co, unsigned timeout_ms, const char *why)
{
    if (co->draining)
        return;
    co->draining = true;
    log_notice("draining (%s): %u requests in flight, timeout %u ms", why, co->n_reqs, timeout_ms);
    notify_stopping();
    coord_health_update(co);   /* readiness NOT_SERVING first */
    uv_timer_start(&co->t_drain, drain_timeout_cb, timeout_ms, 0);
    coord_check_drained(co);
}

static void on_signal(uv_signal_t *h, int sig)
{
    struct coord *co = h->data;
    co->signals++;
    if (co->signals == 1) {
        coord_drain(co, co->o.drain_timeout_ms, sig == SIGTERM ? "SIGTERM" : "SIGINT");
        return;
    }
    log_warn("second signal: forcing exit");
    co->exit_code = 1;
    co->draining = true;
    req_fail_all(co, RPC_UNAVAILABLE, "server shutting down (forced)");
    shutdown_servers(co);
    if (co->srv_pub)
        force_cb(&co->t_force);
}

static void exit_poll_cb(uv_timer_t *t);

static void servers_down(void *ud)
{
    struct coord *co = ud;
    if (--co->servers_live > 0)
        return;
    /* wait (bounded) for client calls (aborts, load polls) to finish */
    co->start_ms = rpc_now_ms();
    uv_timer_start(&co->t_drain, exit_poll_cb, 0, 10);
}

static void close_handles(struct coord *co)
{
    uv_close((uv_handle_t *)&co->t_heartbeat, NULL);
    uv_close((uv_handle_t *)&co->t_loads, NULL);
    uv_close((uv_handle_t *)&co->t_watchdog, NULL);
    uv_close((uv_handle_t *)&co->t_drain, NULL);
    uv_close((uv_handle_t *)&co->t_force, NULL);
    uv_close((uv_handle_t *)&co->sigterm, NULL);
    uv_close((uv_handle_t *)&co->sigint, NULL);
    /* closing the last uv_signal_t restores the default action: a SIGTERM that arrives now
     * (a supervisor's stop after an Admin drain already under way) would kill the process
     * and replace its exit code; the exit is decided, so the signals are ignored */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    openai_stop(co);
}

static void exit_poll_cb(uv_timer_t *t)
{
    struct coord *co = t->data;
    if ((rpc_ctx_live_calls(co->rpc) > 0 || openai_active(co) > 0) && rpc_now_ms() - co->start_ms < 3000)
        return;
    uv_timer_stop(t);
    uv_timer_stop(&co->t_force);
    rpc_server_destroy(co->srv_pub);
    rpc_server_destroy(co->srv_admin);
    rpc_server_destroy(co->srv_ctl);
    co->srv_pub = co->srv_admin = co->srv_ctl = NULL;
    wpool_done(co);
    close_handles(co);
    rpc_ctx_destroy(co->rpc);
    co->rpc = NULL;
    log_info("stopped");
}

static void force_cb(uv_timer_t *t)
{
    struct coord *co = t->data;
    log_warn("shutdown: cancelling calls still open after 2 s");
    rpc_server_cancel_all(co->srv_pub);
    rpc_server_cancel_all(co->srv_admin);
    rpc_server_cancel_all(co->srv_ctl);
}

static void shutdown_servers(struct coord *co)
{
    if (co->exiting)
        return;
    co->exiting = true;
    co->draining = true;
    notify_stopping();
    coord_health_update(co);
    uv_timer_stop(&co->t_drain);
    uv_timer_stop(&co->t_heartbeat);
    uv_timer_stop(&co->t_loads);
    health_watches_end(co);
    serve_shutdown(co->serve);      /* before the sessions end: it looks who has one */
    wpool_shutdown_sessions(co);
    openai_quiesce(co);
    co->servers_live = 3;
    rpc_server_shutdown(co->srv_pub, servers_down, co);
    rpc_server_shutdown(co->srv_admin, servers_down, co);
    rpc_server_shutdown(co->srv_ctl, servers_down, co);
    /* graceful first (the last unary answers, e.g. Admin.Drain, still go out);
     * whatever is left after 2 s is cancelled */
    uv_timer_start(&co->t_force, force_cb, 2000, 0);
}

/* ------------------------------------------------------------------ Inference unary */

/* Only the caller's own requests: another client's are as if they did not exist (the
 * count says nothing about them). */
static void h_abort(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__V1__AbortRequest *r = (const void *)msg;
    Stepd__V1__AbortResponse resp = STEPD__V1__ABORT_RESPONSE__INIT;
    char owner[REQ_OWNER_LEN];

    if (r->n_request_ids > 1024) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request_ids: at most 1024 ids (got %zu)", r->n_request_ids);
        return;
    }
    if (r->n_abort_tokens > 1024) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "abort_tokens: at most 1024 tokens (got %zu)", r->n_abort_tokens);
        return;
    }
    coord_call_owner(co, call, owner, sizeof(owner));
    for (size_t i = 0; i < r->n_request_ids; i++)
        resp.aborted += (uint32_t)req_abort_by_id(co, r->request_ids[i], owner, r->abort_tokens, r->n_abort_tokens);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_model_info(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    Stepd__V1__GetModelInfoResponse resp = STEPD__V1__GET_MODEL_INFO_RESPONSE__INIT;
    const struct model_info *mi = &co->model;

    if (!mi->known) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "no worker group has reported model information yet");
        return;
    }
    resp.model_name = co->o.model_name ? (char *)co->o.model_name : (char *)mi->name;
    resp.model_type = (char *)mi->type;
    resp.vocab_size = mi->vocab_size;
    resp.max_model_len = coord_max_model_len(co);
    resp.n_eos_token_ids = mi->n_eos;
    resp.eos_token_ids = (int32_t *)mi->eos;
    resp.num_layers = mi->num_layers;
    resp.hidden_size = mi->hidden_size;
    resp.num_experts = mi->num_experts;
    resp.num_experts_per_tok = mi->num_experts_per_tok;
    resp.quantization = (char *)mi->quantization;
    resp.num_mtp_layers = mi->num_mtp_layers;
    resp.max_num_speculative_tokens = mi->max_num_speculative_tokens;
    resp.supports_text = co->tok != NULL;
    resp.supports_chat = co->tok != NULL;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void fill_limits(struct coord *co, Stepd__V1__ServerLimits *l)
{
    l->max_queue = co->o.max_queue;
    l->max_running = co->o.max_running;
    l->max_input_tokens = co->o.max_input_tokens;
    l->max_total_tokens = coord_max_model_len(co);
    l->max_tokens_cap = co->o.max_tokens_cap;
    l->max_stop = co->o.max_stop;
    l->max_stop_len = co->o.max_stop_len;
    l->max_logprobs = co->o.max_logprobs;
    l->max_receive_message_bytes = (uint32_t)co->o.max_recv_msg_bytes;
}

static void h_server_info(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    Stepd__V1__GetServerInfoResponse resp = STEPD__V1__GET_SERVER_INFO_RESPONSE__INIT;
    Stepd__V1__ServerLimits lim = STEPD__V1__SERVER_LIMITS__INIT;

    resp.version = STEPD_VERSION;
    resp.uptime_s = (double)(rpc_now_ms() - co->start_ms) / 1000.0;
    resp.groups_total = wpool_count(co);
    resp.groups_ready = wpool_ready_count(co);
    resp.running = co->admit.running;
    resp.waiting = co->admit.queued;
    resp.draining = co->draining;
    fill_limits(co, &lim);
    resp.limits = &lim;
    resp.role = "coordinator";
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_loads(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    Stepd__V1__GetLoadsResponse resp = STEPD__V1__GET_LOADS_RESPONSE__INIT;
    unsigned n = wpool_count(co), i = 0;
    struct group_load_msg *ls = calloc(n ? n : 1, sizeof(*ls));
    Stepd__V1__GroupLoad **pl = calloc(n ? n : 1, sizeof(*pl));

    if (!ls || !pl) {
        free(ls);
        free(pl);
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    for (struct group *g = co->groups; g; g = g->next, i++) {
        wpool_load_fill(g, &ls[i]);
        pl[i] = &ls[i].l;
    }
    resp.n_loads = n;
    resp.loads = pl;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
    free(ls);
    free(pl);
}

static void h_tokenize(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__V1__TokenizeRequest *r = (const void *)msg;
    Stepd__V1__TokenizeResponse resp = STEPD__V1__TOKENIZE_RESPONSE__INIT;
    struct tok_ids ids = { 0 };
    struct err_buf eb;
    char err[512];
    int e;

    if (!co->tok) {
        rpc_call_finish(call, RPC_FAILED_PRECONDITION, "no tokenizer loaded (start stepd with --tokenizer)");
        return;
    }
    if (r->input_case == STEPD__V1__TOKENIZE_REQUEST__INPUT_TEXT) {
        if (strlen(r->text) > co->o.max_prompt_bytes) {
            rpc_call_finish(call, RPC_INVALID_ARGUMENT, "text: more than %u bytes", co->o.max_prompt_bytes);
            return;
        }
        bool add = !PB_HAS(r, add_special_tokens) || r->add_special_tokens;
        e = tok_encode(co->tok, r->text, strlen(r->text), add ? TOK_ENCODE_ADD_SPECIAL : 0, &ids, &eb);
    } else if (r->input_case == STEPD__V1__TOKENIZE_REQUEST__INPUT_CHAT) {
        struct request *in = NULL;
        char *text = NULL;

        e = request_from_proto_chat(r->chat, &in, err, sizeof(err));
        e = e ? e : request_validate_chat(co, in, err, sizeof(err));
        e = e ? e : coord_chat_render(co, in, &text, err, sizeof(err));
        request_free(in);
        if (e < 0) {
            rpc_call_finish(call, RPC_INVALID_ARGUMENT, "%s", err);
            return;
        }
        e = tok_encode(co->tok, text, strlen(text), TOK_ENCODE_SPECIAL, &ids, &eb);
        free(text);
    } else {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "input: one of text or chat is required");
        return;
    }
    if (e < 0) {
        tok_ids_done(&ids);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "input: %s", eb.msg);
        return;
    }
    resp.n_token_ids = ids.n;
    resp.token_ids = ids.ids;
    resp.count = (uint32_t)ids.n;
    resp.max_model_len = coord_max_model_len(co);
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
    tok_ids_done(&ids);
}

static void h_detokenize(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__V1__DetokenizeRequest *r = (const void *)msg;
    Stepd__V1__DetokenizeResponse resp = STEPD__V1__DETOKENIZE_RESPONSE__INIT;
    uint32_t vocab;
    char *text = NULL;

    if (!co->tok) {
        rpc_call_finish(call, RPC_FAILED_PRECONDITION, "no tokenizer loaded (start stepd with --tokenizer)");
        return;
    }
    vocab = (uint32_t)tok_vocab_size(co->tok);
    for (size_t i = 0; i < r->n_token_ids; i++)
        if (r->token_ids[i] < 0 || (uint32_t)r->token_ids[i] >= vocab) {
            rpc_call_finish(call, RPC_INVALID_ARGUMENT, "token_ids[%zu]: %d is outside the vocabulary [0, %u)",
                            i, r->token_ids[i], vocab);
            return;
        }
    bool skip = !PB_HAS(r, skip_special_tokens) || r->skip_special_tokens;
    int e = tok_decode(co->tok, r->token_ids, r->n_token_ids, skip, &text, NULL);
    if (e < 0) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "token_ids: %s", err_str(e));
        return;
    }
    resp.text = text;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
    free(text);
}

/* ------------------------------------------------------------------ Admin */

static void h_drain(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__V1__DrainRequest *r = (const void *)msg;
    Stepd__V1__DrainResponse resp = STEPD__V1__DRAIN_RESPONSE__INIT;

    resp.in_flight = co->admit.running;
    resp.waiting = co->admit.queued;
    /* state first, answer after: health Check is answered on the CQ thread from the
     * published state, so a client that has the answer must already see NOT_SERVING */
    if (!r->exit_when_drained) {
        /* stay up, stop admitting: readiness NOT_SERVING */
        if (!co->draining) {
            co->draining = true;
            log_notice("drain requested over Admin (staying up)");
            coord_health_update(co);
        }
    } else {
        co->draining = false;   /* let coord_drain run its full path */
        coord_drain(co, PB_HAS(r, timeout_ms) ? r->timeout_ms : co->o.drain_timeout_ms, "Admin.Drain");
    }
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_groups(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    Stepd__V1__GetGroupsResponse resp = STEPD__V1__GET_GROUPS_RESPONSE__INIT;
    unsigned n = wpool_count(co), i = 0;
    Stepd__V1__GroupInfo *gi = calloc(n ? n : 1, sizeof(*gi));
    Stepd__V1__GroupInfo **pg = calloc(n ? n : 1, sizeof(*pg));
    Stepd__V1__GroupCounters *gc = calloc(n ? n : 1, sizeof(*gc));
    struct group_load_msg *gl = calloc(n ? n : 1, sizeof(*gl));
    Stepd__V1__RankInfo *ri = calloc((n ? n : 1) * COORD_MAX_WORLD, sizeof(*ri));
    Stepd__V1__RankInfo **pr = calloc((n ? n : 1) * COORD_MAX_WORLD, sizeof(*pr));

    if (!gi || !pg || !gc || !gl || !ri || !pr) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        goto cleanup;
    }
    for (struct group *g = co->groups; g; g = g->next, i++) {
        stepd__v1__group_info__init(&gi[i]);
        stepd__v1__group_counters__init(&gc[i]);
        gi[i].group = g->name;
        gi[i].world_size = g->world;
        gi[i].state = g->state == GROUP_READY ? STEPD__V1__WORKER_STATE__WORKER_STATE_READY
                      : g->state == GROUP_LOADING ? STEPD__V1__WORKER_STATE__WORKER_STATE_LOADING
                      : g->state == GROUP_FAILED ? STEPD__V1__WORKER_STATE__WORKER_STATE_FAILED
                                                 : STEPD__V1__WORKER_STATE__WORKER_STATE_REGISTERED;
        gi[i].epoch = g->epoch;
        gi[i].engine_address = g->engine_addr;
        gc[i].routed = g->routed;
        gc[i].completed = g->completed;
        gc[i].failed = g->failed;
        gc[i].aborts_sent = g->aborts_sent;
        gc[i].in_flight = g->in_flight;
        gi[i].counters = &gc[i];
        wpool_load_fill(g, &gl[i]);
        gi[i].load = &gl[i].l;
        gi[i].ranks = &pr[i * COORD_MAX_WORLD];
        for (unsigned k = 0; k < g->world; k++) {
            Stepd__V1__RankInfo *x = &ri[i * COORD_MAX_WORLD + k];
            struct rank *rk = &g->ranks[k];
            stepd__v1__rank_info__init(x);
            x->rank = k;
            x->device = rk->device;
            x->state = rk->present ? rk->state : STEPD__V1__WORKER_STATE__WORKER_STATE_GONE;
            x->load_progress = rk->progress;
            x->message = rk->message;
            /* a rank without a session: what its supervisor (stepd serve) knows */
            const char *sm = rk->present ? NULL : serve_rank_message(co->serve, g->name, k);
            if (sm)
                x->message = (char *)sm;
            x->pid = rk->pid;
            x->hostname = rk->hostname;
            x->n_experts = rk->n_experts;
            x->experts = rk->experts;
            gi[i].ranks[gi[i].n_ranks++] = x;
        }
        pg[i] = &gi[i];
    }
    resp.n_groups = n;
    resp.groups = pg;
    rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
cleanup:
    free(gi);
    free(pg);
    free(gc);
    free(gl);
    free(ri);
    free(pr);
}

/* ------------------------------------------------------------------ timers */

static void heartbeat_cb(uv_timer_t *t)
{
    wpool_heartbeat(t->data);
    req_sweep_deadlines(t->data);
}

/* idle: trim again once this much more heap is free than after the last trim */
#define IDLE_TRIM_STEP ((size_t)128 << 10)

static void loads_cb(uv_timer_t *t)
{
    struct coord *co = t->data;
    int64_t now = rpc_now_ms();

    wpool_poll_loads(co);
    health_tick(co);        /* belt and braces: every state change already publishes */
    /* Give memory freed after a burst back to the system while idle: after 1 s of
     * idle, then every 0.5 s up to 4 s, then at 8, 16 ... s, and whenever
     * IDLE_TRIM_STEP more heap is free than after the last trim. gRPC frees a closed
     * connection's buffers and finished calls' arenas some time after the last
     * request ended (seen: ~13 MiB that one early trim missed), and tearing a
     * connection down dirties trimmed pages again without freeing more than it took
     * (seen: ~1 MiB) */
    if (co->n_reqs) {
        co->busy_ms = now;
        co->trim_free = 0;
        co->trim_idle_ms = 1000;
    } else if (now - co->busy_ms > 1000) {
        int64_t idle = now - co->busy_ms;
        size_t free_b = mallinfo2().fordblks;
        if (idle >= co->trim_idle_ms || free_b > co->trim_free + IDLE_TRIM_STEP) {
            rpc_ctx_compact(co->rpc);
            malloc_trim(0);
            co->m.idle_trims++;
            co->trim_free = free_b;
            co->trim_idle_ms = idle < 4000 ? idle + 500 : 2 * idle;
        } else if (free_b < co->trim_free) {
            co->trim_free = free_b;     /* reused since: count from the dip */
        }
    }
}

static void watchdog_cb(uv_timer_t *t)
{
    struct coord *co = t->data;
    notify_watchdog();
    health_status_line(co);
}

/* ------------------------------------------------------------------ setup */

static int add_inference(struct coord *co, struct rpc_server *s)
{
    struct rpc_method ms[] = {
        /* many calls kept requested: a burst of Generate calls is matched by gRPC's own
         * threads without a round trip through the loop for each */
        { "/stepd.v1.Inference/Generate", &stepd__v1__generate_request__descriptor, true, false, req_generate, co,
          512, req_generate_cq, req_generate_unmark },
        { "/stepd.v1.Inference/Abort", &stepd__v1__abort_request__descriptor, false, false, h_abort, co },
        { "/stepd.v1.Inference/GetModelInfo", &stepd__v1__get_model_info_request__descriptor, false, false,
          h_model_info, co },
        { "/stepd.v1.Inference/GetServerInfo", &stepd__v1__get_server_info_request__descriptor, false, false,
          h_server_info, co },
        { "/stepd.v1.Inference/GetLoads", &stepd__v1__get_loads_request__descriptor, false, false, h_loads, co },
        { "/stepd.v1.Inference/Tokenize", &stepd__v1__tokenize_request__descriptor, false, false, h_tokenize, co },
        { "/stepd.v1.Inference/Detokenize", &stepd__v1__detokenize_request__descriptor, false, false,
          h_detokenize, co },
    };
    for (size_t i = 0; i < ARRAY_SIZE(ms); i++) {
        int r = rpc_server_add_method(s, &ms[i]);
        if (r < 0)
            return r;
    }
    return 0;
}

static int add_admin(struct coord *co, struct rpc_server *s)
{
    struct rpc_method ms[] = {
        { "/stepd.v1.Admin/Drain", &stepd__v1__drain_request__descriptor, false, false, h_drain, co },
        { "/stepd.v1.Admin/GetGroups", &stepd__v1__get_groups_request__descriptor, false, false, h_groups, co },
    };
    for (size_t i = 0; i < ARRAY_SIZE(ms); i++) {
        int r = rpc_server_add_method(s, &ms[i]);
        if (r < 0)
            return r;
    }
    return 0;
}

static int server_new(struct coord *co, const char *addr, bool tls, const char *key,
                      int (*add)(struct coord *, struct rpc_server *), struct rpc_server **ret, int *ret_port)
{
    bool ctl = add == wpool_register_methods;
    struct rpc_server_opts so = {
        /* control sessions: HTTP/2 keepalive pings detect a hung or partitioned worker
         * (a stopped process cannot answer a PING) within worker_timeout_ms */
        .keepalive_time_ms = ctl ? (int)(co->o.worker_timeout_ms / 2) : 0,
        .keepalive_timeout_ms = ctl ? (int)(co->o.worker_timeout_ms / 2) : 0,
        .max_recv_msg_bytes = co->o.max_recv_msg_bytes,
        .max_concurrent_streams = co->o.max_concurrent_streams,
        .max_call_buffer_bytes = co->o.max_call_buffer_bytes,
        .tls = tls ? &co->o.tls : NULL,
        .api_key = key,
        .key_name = ctl ? "cluster key" : NULL,
        /* clients' connections (not the workers' sessions) end within 1 h + 15 min */
        .max_connection_age_ms = ctl ? 0 : 3600 * 1000,
    };
    int r = rpc_server_create(co->rpc, &so, ret);
    if (r < 0)
        return r;
    if ((r = add(co, *ret)) < 0 || (r = health_register_methods(co, *ret)) < 0)
        return r;
    if ((r = rpc_server_listen(*ret, addr, ret_port)) < 0)
        return r;
    return rpc_server_start(*ret);
}

/* A port another process holds: one line naming the flag that sets it (and --port-offset),
 * before gRPC would log its own error tree for it. */
static int listen_check(const struct coord_opts *o)
{
    static const char hint[] = "address in use (another stepd? --port-offset N moves every port of this one)";
    const struct { const char *flag, *addr; } l[] = {
        { "--listen", o->listen }, { "--admin-listen", o->admin_listen },
        { "--control-listen", o->control_listen }, { "--metrics-listen", o->metrics_listen },
    };

    for (size_t i = 0; i < ARRAY_SIZE(l); i++)
        if (l[i].addr && l[i].addr[0] && net_port_in_use(l[i].addr, -1)) {
            log_error("%s %s: %s", l[i].flag, l[i].addr, hint);
            return -EADDRINUSE;
        }
    if (o->http_port > 0 && net_port_in_use(o->http_host, o->http_port)) {
        log_error("--host/--port %s port %d: %s", o->http_host, o->http_port, hint);
        return -EADDRINUSE;
    }
    return 0;
}

static const struct coord_upcalls coord_upcalls = {
    .group_failed = req_fail_group, .room = req_held_kick, .health_changed = coord_health_update,
    .status_line = health_status_line, .req_freed = coord_check_drained, .engine_output = req_engine_output,
    .engine_ended = req_engine_ended,
};

int coord_new(const struct coord_opts *o, struct coord **ret)
{
    struct coord *co;
    bool tls = o->tls.cert_file && o->tls.cert_file[0];
    int r;

    /* E1: a non-loopback public listen needs TLS and an API key, or an explicit override */
    if (!net_addr_is_loopback(o->listen) && !(tls && o->api_key && o->api_key[0])) {
        if (!o->insecure_listen) {
            log_error("refusing to listen on non-loopback %s without TLS and an API key "
                      "(use --tls-cert/--tls-key with --api-key-file, or --insecure-listen)", o->listen);
            return -EPERM;
        }
        log_warn("listening on non-loopback %s without TLS and API key (--insecure-listen)", o->listen);
    }
    if (!net_addr_is_loopback(o->admin_listen) && !o->insecure_listen) {
        log_error("refusing a non-loopback admin listen %s without --insecure-listen", o->admin_listen);
        return -EPERM;
    }
    if (!net_addr_is_loopback(o->control_listen) && !(o->control_key && o->control_key[0]) &&
        !o->insecure_listen) {
        log_error("refusing a non-loopback control listen %s without a control key "
                  "(STEPD_CONTROL_KEY) or --insecure-listen", o->control_listen);
        return -EPERM;
    }
    if (o->http_port >= 0 && !net_addr_is_loopback(o->http_host) && !(tls && o->api_key && o->api_key[0])) {
        if (!o->insecure_listen) {
            log_error("refusing to serve HTTP on non-loopback %s without TLS and an API key "
                      "(use --tls-cert/--tls-key with --api-key-file, or --insecure-listen)", o->http_host);
            return -EPERM;
        }
        log_warn("HTTP API on non-loopback %s without TLS and API key (--insecure-listen)", o->http_host);
    }
    if (o->metrics_listen && o->metrics_listen[0] && !net_addr_is_loopback(o->metrics_listen) &&
        !o->insecure_listen) {
        log_error("refusing a non-loopback metrics listen %s without --insecure-listen "
                  "(the endpoint has no authentication)", o->metrics_listen);
        return -EPERM;
    }
    if (tls && o->tls.require_client_cert && !o->tls.root_file) {
        log_error("--tls-require-client-cert needs --tls-client-ca");
        return -EINVAL;
    }
    if (o->max_running == 0) {
        log_error("--max-running must be at least 1");
        return -EINVAL;
    }
    /* the cluster key: without it any process that reaches the control port could join
     * as a worker group and be sent traffic, and any that reaches an engine could use it */
    if (!(o->control_key && o->control_key[0])) {
        if (!o->insecure_control) {
            log_error("no control key: workers and engines could not be authenticated; give "
                      "--control-key-file FILE (or $STEPD_CONTROL_KEY) here and to every worker, or "
                      "--insecure-control to accept keyless workers");
            return -EPERM;
        }
        log_warn("no control key (--insecure-control): any process that reaches %s can register "
                 "as a worker group", o->control_listen);
    }
    co = calloc(1, sizeof(*co));
    if (!co)
        return -ENOMEM;
    co->o = *o;
    co->up = &coord_upcalls;
    co->start_ms = rpc_now_ms();
    co->busy_ms = co->start_ms;     /* the idle trims' schedule counts from the start */
    co->last_ready = -1;
    metrics_init(&co->m);
    admit_init(&co->admit, o->max_running, o->max_queue);
    health_publish(co);
    if (o->prefix_affinity && (r = affinity_new(o->prefix_affinity_entries, &co->aff)) < 0) {
        free(co);
        return r;
    }
    if ((r = uv_loop_init(&co->loop)) < 0) {
        affinity_free(co->aff);
        free(co);
        return r;
    }
    if (o->tokenizer_path && o->tokenizer_path[0]) {
        struct err_buf eb;
        if ((r = tok_load(o->tokenizer_path, &co->tok, &eb)) < 0) {
            log_error("tokenizer: %s", eb.msg);
            uv_loop_close(&co->loop);
            affinity_free(co->aff);
            free(co);
            return r;
        }
        log_info("tokenizer %s: %zu ids", o->tokenizer_path, tok_vocab_size(co->tok));
    }
    co->tok_think_start = co->tok ? tok_added_id(co->tok, "<think>") : -1;
    co->tok_think_end = co->tok ? tok_added_id(co->tok, "</think>") : -1;
    co->tok_tool_call = co->tok ? tok_added_id(co->tok, "<tool_call>") : -1;
#ifdef STEPD_HAVE_ABSL_TUNE
    coord_absl_tune();      /* before gRPC starts its threads */
#endif
    if ((r = listen_check(o)) < 0)
        goto fail;
    if ((r = rpc_ctx_create(&co->loop, &co->rpc)) < 0)
        goto fail;
    /* a second thread starts the sends of an engine's output batch (rpc_ctx_cork);
     * STEPD_RPC_SENDER=0 leaves them to one thread (to measure what it buys) */
    const char *sv = getenv("STEPD_RPC_SENDER");
    if (!(sv && strcmp(sv, "0") == 0))
        (void)rpc_ctx_set_sender(co->rpc, true);   /* it logs a failure itself */
    wpool_init(co);
    if ((r = server_new(co, o->listen, tls, o->api_key, add_inference, &co->srv_pub, &co->pub_port)) < 0) {
        log_error("public listen %s failed: %s", o->listen, err_str(r));
        goto fail_servers;
    }
    if ((r = server_new(co, o->admin_listen, false, o->api_key, add_admin, &co->srv_admin, &co->admin_port)) < 0) {
        log_error("admin listen %s failed: %s", o->admin_listen, err_str(r));
        goto fail_servers;
    }
    if ((r = server_new(co, o->control_listen, false, o->control_key, wpool_register_methods, &co->srv_ctl,
                        &co->ctl_port)) < 0) {
        log_error("control listen %s failed: %s", o->control_listen, err_str(r));
        goto fail_servers;
    }
    if ((r = openai_start(co)) < 0) {
        log_error("HTTP listen failed: %s", err_str(r));
        goto fail_servers;
    }
    uv_timer_init(&co->loop, &co->t_heartbeat);
    uv_timer_init(&co->loop, &co->t_loads);
    uv_timer_init(&co->loop, &co->t_watchdog);
    uv_timer_init(&co->loop, &co->t_drain);
    uv_timer_init(&co->loop, &co->t_force);
    co->t_heartbeat.data = co->t_loads.data = co->t_watchdog.data = co->t_drain.data = co->t_force.data = co;
    uv_signal_init(&co->loop, &co->sigterm);
    uv_signal_init(&co->loop, &co->sigint);
    co->sigterm.data = co->sigint.data = co;
    signal(SIGPIPE, SIG_IGN);
    log_info("listening: public %s (port %d%s%s), admin %s (port %d), control %s (port %d), metrics %s (port %d), "
             "http %s (port %d%s%s)", o->listen, co->pub_port, tls ? ", TLS" : "", o->api_key ? ", API key" : "",
             o->admin_listen, co->admin_port, o->control_listen, co->ctl_port,
             o->metrics_listen && o->metrics_listen[0] ? o->metrics_listen : "off", co->metrics_port,
             o->http_port >= 0 ? o->http_host : "off", co->http_port, co->http && tls ? ", TLS" : "",
             co->http && o->api_key ? ", API key" : "");
    *ret = co;
    return 0;

fail_servers:
    /* servers were never started or have no calls: shut them down synchronously */
    {
        struct rpc_server *ss[3] = { co->srv_pub, co->srv_admin, co->srv_ctl };
        int pending = 0;
        for (int i = 0; i < 3; i++)
            if (ss[i]) {
                pending++;
                rpc_server_shutdown(ss[i], servers_down, co);
            }
        co->servers_live = (unsigned)pending + 1000; /* never reach 0 in servers_down */
        int64_t end = rpc_now_ms() + 2000;
        while (rpc_now_ms() < end && co->servers_live > 1000)
            uv_run(&co->loop, UV_RUN_ONCE);
        for (int i = 0; i < 3; i++)
            if (ss[i])
                rpc_server_destroy(ss[i]);
        openai_stop(co);
    }
    rpc_ctx_destroy(co->rpc);
    uv_run(&co->loop, UV_RUN_DEFAULT);
fail:
    tok_free(co->tok);
    uv_loop_close(&co->loop);
    affinity_free(co->aff);
    free(co);
    return r;
}

int coord_run(struct coord *co)
{
    uint64_t wd = notify_watchdog_usec();

    uv_signal_start(&co->sigterm, on_signal, SIGTERM);
    uv_signal_start(&co->sigint, on_signal, SIGINT);
    uv_timer_start(&co->t_heartbeat, heartbeat_cb, co->o.heartbeat_ms, co->o.heartbeat_ms);
    uv_timer_start(&co->t_loads, loads_cb, co->o.loads_poll_ms, co->o.loads_poll_ms);
    /* WATCHDOG=1 from the loop itself, at half the interval; STATUS every 5 s otherwise */
    uint64_t wd_ms = wd ? (wd / 2000 ? wd / 2000 : 1) : 5000;
    uv_timer_start(&co->t_watchdog, watchdog_cb, 0, wd_ms);
    if (wd)
        log_info("systemd watchdog: WATCHDOG=1 every %" PRIu64 " ms (WatchdogSec %" PRIu64 " ms)", wd_ms,
                 wd / 1000);
    coord_health_update(co);
    /* stepd serve: READY once its groups are ready or given up (serve.c) */
    if (!co->serve)
        notify_ready();
    /* per-token forwarding and every other rpc callback run on the CQ thread while
     * the loop is idle (rpc_ctx_run); the loop still runs timers, signals, metrics */
    int r = rpc_ctx_run(co->rpc);
    if (r < 0) {
        log_error("event loop: %s", err_str(r));
        uv_run(&co->loop, UV_RUN_DEFAULT);
    }
    return co->exit_code;
}

void coord_free(struct coord *co)
{
    if (!co)
        return;
    tok_free(co->tok);
    grammar_vocab_free(co->gv);
    affinity_free(co->aff);
    if (uv_loop_close(&co->loop) < 0)
        log_warn("event loop closed with live handles");
    free(co);
}
