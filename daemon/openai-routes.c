/* openai-routes.c - the OpenAI-compatible HTTP API: the second front door of the coordinator.
 *
 * Routes (http.c serves them): POST /v1/chat/completions and /v1/completions (JSON or
 * server-sent events), GET /v1/models, the agent doors (doors.h: /v1/responses,
 * /v1/messages), POST /tokenize and /detokenize (vLLM's shapes),
 * GET /health (liveness), /ready and /healthz (readiness), /metrics (Prometheus text).
 *
 * The door only converts: a body becomes a struct request (openai-parse.c: field names as the
 * client wrote them), req_submit() serves it exactly as it serves a gRPC call (admission,
 * routing, deadlines, the text pipeline, metrics, aborts) through the generation's life of
 * reply.c, and openai-render.c turns each chunk and final into OpenAI JSON.  n > 1 is n
 * requests sharing the prompt, one per choice, behind one HTTP answer.  Loop thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "coord-int.h"
#include "door.h"
#include "doors.h"
#include "err.h"
#include "http.h"
#include "json.h"
#include "log.h"
#include "media.h"
#include "openai-int.h"
#include "openai.h"
#include "strbuf.h"
#include "stepd-config.h"

/* ------------------------------------------------------------------ generation endpoints */

/* The parsed body served (or refused): fetched holds its images prepared off the loop (NULL: none). */
static void generate(struct http_req *hr, struct coord *co, bool chat, json_t *body, struct request *in,
                     struct media_fetch *fetched)
{
    struct oai_opts x = { .fetched = fetched };
    char msg[768] = "";
    int r = openai_body_conv(co, body, chat, in, &x, msg, sizeof(msg));

    if (r == -ENOMEM) {
        snprintf(msg, sizeof(msg), "out of memory");
        goto bad;
    }
    if (r < 0) {
        co->m.rejected_invalid++;
        goto bad;
    }
    if ((co->o.model_name || co->model.known) && !model_known(co, in->model)) {
        co->m.rejected_invalid++;
        json_decref(body);
        log_req_info(in->id[0] ? in->id : "-", "rejected: model \"%.64s\" is not served", in->model);
        http_respond_error(hr, 404, "model", "model: \"%.64s\" is not served here (GET /v1/models lists the names)",
                           in->model);
        request_free(in);
        return;
    }
    if ((r = openai_reply_start(co, hr, in, &x, chat)) < 0) {
        snprintf(msg, sizeof(msg), "out of memory");
        goto bad;
    }
    json_decref(body);
    return;
bad:
    json_decref(body);
    log_req_info(in->id[0] ? in->id : "-", "rejected: %s", msg);
    request_free(in);
    respond_status(hr, r == -ENOMEM ? RPC_INTERNAL : RPC_INVALID_ARGUMENT, 0, msg);
}

/* A request held while its images are prepared (door_hold): generate's or tokenize's. */
struct held {
    struct door_hold h;             /* first: door_hold frees it */
    json_t *body;
    struct request *in;             /* generate's */
};

static void held_drop(struct door_hold *h)
{
    struct held *p = (struct held *)h;

    json_decref(p->body);
    request_free(p->in);
}

/* The body's images (OpenAI messages) prepared off the loop before resume runs: 1 when held
 * (body and in owned from here), 0 when there are none (nothing taken), or an answer given
 * (body and in freed) and -1. */
static int hold_for_images(struct http_req *hr, struct coord *co, json_t *body, struct request *in,
                           void (*resume)(struct door_hold *h, struct media_fetch *f))
{
    struct held *p = calloc(1, sizeof(*p));
    char msg[160];
    int r = -ENOMEM;

    if (p) {
        *p = (struct held){ .h = { .co = co, .hr = hr, .resume = resume, .drop = held_drop }, .body = body, .in = in };
        if ((r = door_hold_start(&p->h, json_object_get(body, "messages"), msg, sizeof(msg))) > 0)
            return 1;
    } else {
        snprintf(msg, sizeof(msg), "out of memory");
    }
    free(p);
    if (r == 0)
        return 0;
    json_decref(body);
    request_free(in);
    respond_status(hr, r == -EBUSY ? RPC_UNAVAILABLE : RPC_INTERNAL, 0, msg);
    return -1;
}

static void generate_resume(struct door_hold *h, struct media_fetch *f)
{
    struct held *p = (struct held *)h;

    generate(h->hr, h->co, true, p->body, p->in, f);
}

static void h_generate(struct http_req *hr, struct coord *co, bool chat)
{
    struct request *in = request_new(chat ? names_chat : names_completion);
    json_error_t je;
    json_t *body = NULL;
    char msg[768] = "";
    size_t blen;
    const char *b = http_req_body(hr, &blen);

    if (!in) {
        http_respond_error(hr, 500, NULL, "out of memory");
        return;
    }
    body = json_loadb(b, blen, JSON_REJECT_DUPLICATES, &je);
    if (!body) {
        bad_json(b, blen, &je, msg, sizeof(msg));
        co->m.rejected_invalid++;
        log_req_info("-", "rejected: %s", msg);
        request_free(in);
        respond_status(hr, RPC_INVALID_ARGUMENT, 0, msg);
        return;
    }
    /* images: fetched and decoded off the loop, the parse resumed when they are */
    if (chat && json_is_object(body) && hold_for_images(hr, co, body, in, generate_resume) != 0)
        return;
    generate(hr, co, chat, body, in, NULL);
}

static void h_chat(struct http_req *hr, void *ud)
{
    h_generate(hr, ud, true);
}

static void h_completions(struct http_req *hr, void *ud)
{
    h_generate(hr, ud, false);
}

/* ------------------------------------------------------------------ other endpoints */

static void respond_json(struct http_req *hr, unsigned status, json_t *o)
{
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;

    if (body)
        http_respond(hr, status, "application/json", body, strlen(body), NULL);
    else
        http_respond_error(hr, 500, NULL, "out of memory");
    free(body);
    json_decref(o);
}

static void h_models(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    json_t *data = json_array();
    const char *root = co->model.known ? co->model.name : co->o.model_name;
    uint32_t ctx = coord_max_model_len(co);

    if (!root) {
        /* no name given and no group has reported one yet: nothing to list */
        respond_json(hr, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
        return;
    }
    for (size_t i = 0; i <= co->o.n_model_aliases && data; i++) {
        const char *id = i == 0 ? (co->o.model_name ? co->o.model_name : root) : co->o.model_aliases[i - 1];

        json_array_append_new(data, json_pack("{s:s, s:s, s:I, s:s, s:s, s:I}", "id", id, "object", "model",
                                              "created", (json_int_t)(co->start_ms / 1000 + time(NULL) -
                                                                      rpc_now_ms() / 1000),
                                              "owned_by", "stepd", "root", root, "max_model_len",
                                              (json_int_t)ctx));
    }
    respond_json(hr, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* The body as a JSON object, or an answer (400) and NULL. */
static json_t *body_object(struct http_req *hr)
{
    size_t blen;
    const char *b = http_req_body(hr, &blen);
    json_error_t je;
    json_t *o = json_loadb(b, blen, JSON_REJECT_DUPLICATES, &je);
    char msg[512];

    if (!o) {
        bad_json(b, blen, &je, msg, sizeof(msg));
        http_respond_error(hr, 400, NULL, "%s", msg);
        return NULL;
    }
    if (!json_is_object(o)) {
        http_respond_error(hr, 400, NULL, "the request body must be a JSON object (got %s)", json_type_describe(o));
        json_decref(o);
        return NULL;
    }
    return o;
}

/* The tokenizer for /tokenize and /detokenize: true, or an answer (503) given and body freed. */
static bool have_tokenizer(struct http_req *hr, const struct coord *co, json_t *body)
{
    if (co->tok)
        return true;
    json_decref(body);
    http_respond_error(hr, 503, NULL, "no tokenizer loaded (start stepd with --tokenizer)");
    return false;
}

/* POST /tokenize (vLLM): {"prompt": text} or {"messages": [...]}, "add_special_tokens",
 * "add_generation_prompt", "return_token_strs" -> {"count", "max_model_len", "tokens",
 * "token_strs"}.  A chat's images (image_url parts, prepared off the loop in fetched) count
 * as generation counts them: each its token layout (coord_prompt_encode). */
static void tokenize(struct http_req *hr, struct coord *co, json_t *body, struct media_fetch *fetched)
{
    json_t *out, *ids, *strs = NULL;
    struct tok_ids t = { 0 };
    struct err_buf eb;
    char msg[768] = "";
    bool add_special = true, want_strs = false;
    const char *model = NULL;
    int e;

    if ((e = openai_get_bool(body, "add_special_tokens", &add_special, msg, sizeof(msg))) < 0 ||
        (e = openai_get_bool(body, "return_token_strs", &want_strs, msg, sizeof(msg))) < 0 ||
        (e = openai_get_str(body, "model", &model, msg, sizeof(msg))) < 0)
        goto bad;
    if (model && (co->o.model_name || co->model.known) && !model_known(co, model)) {
        json_decref(body);
        http_respond_error(hr, 404, "model", "model: \"%.64s\" is not served here", model);
        return;
    }
    if (json_object_get(body, "messages")) {
        const json_t *ms = json_object_get(body, "messages");
        struct request *in = request_new(names_chat);
        uint32_t *pos = NULL;
        bool agp = true;
        const char *eff = NULL;

        e = in ? 0 : -ENOMEM;
        if (!e) {
            in->input = REQUEST_INPUT_CHAT;
            /* no encoder needed to count: "served" */
            e = media_chat_images(ms, co->tok, true, fetched, in, msg, sizeof(msg));
        }
        if (!e)
            e = openai_messages_conv(ms, in->n_images > 0, &in->messages, msg, sizeof(msg));
        if (!e && (e = openai_get_bool(body, "add_generation_prompt", &agp, msg, sizeof(msg))) >= 0)
            in->add_generation_prompt = agp;
        if (e >= 0 && (e = openai_get_str(body, "reasoning_effort", &eff, msg, sizeof(msg))) > 0)
            in->reasoning_effort = strdup(eff);
        if (e >= 0 && json_is_array(json_object_get(body, "tools")))
            in->tools = json_incref(json_object_get(body, "tools"));
        if (e >= 0 && json_is_object(json_object_get(body, "chat_template_kwargs")))
            in->chat_template_kwargs = json_incref(json_object_get(body, "chat_template_kwargs"));
        if (e >= 0)
            e = request_validate_chat(co, in, msg, sizeof(msg));
        if (e >= 0)
            e = coord_prompt_encode(co, in, &t, &pos, msg, sizeof(msg));
        free(pos);
        request_free(in);
        if (e < 0)
            goto bad;
    } else {
        const char *p = NULL;

        if ((e = openai_get_str(body, "prompt", &p, msg, sizeof(msg))) < 0)
            goto bad;
        if (!p) {
            snprintf(msg, sizeof(msg), "prompt: required (or messages)");
            goto bad;
        }
        if (strlen(p) > co->o.max_prompt_bytes) {
            snprintf(msg, sizeof(msg), "prompt: more than %u bytes", co->o.max_prompt_bytes);
            goto bad;
        }
        e = tok_encode(co->tok, p, strlen(p), add_special ? TOK_ENCODE_ADD_SPECIAL : 0, &t, &eb);
        if (e < 0) {
            snprintf(msg, sizeof(msg), "prompt: %.600s", eb.msg);
            tok_ids_done(&t);
            goto bad;
        }
    }
    ids = json_array();
    if (want_strs)
        strs = json_array();
    for (size_t i = 0; i < t.n && ids; i++) {
        json_array_append_new(ids, json_integer(t.ids[i]));
        if (strs) {
            const char *ts = tok_id_to_token(co->tok, t.ids[i]);
            json_array_append_new(strs, json_string(ts ? ts : ""));
        }
    }
    out = json_pack("{s:I, s:I, s:o}", "count", (json_int_t)t.n, "max_model_len",
                    (json_int_t)coord_max_model_len(co), "tokens", ids);
    if (out && strs)
        json_object_set_new(out, "token_strs", strs);
    tok_ids_done(&t);
    json_decref(body);
    respond_json(hr, 200, out);
    return;
bad:
    json_decref(body);
    respond_status(hr, e == -ENOMEM ? RPC_INTERNAL : RPC_INVALID_ARGUMENT, 0, msg[0] ? msg : "out of memory");
}

static void tokenize_resume(struct door_hold *h, struct media_fetch *f)
{
    struct held *p = (struct held *)h;

    tokenize(h->hr, h->co, p->body, f);
}

static void h_tokenize(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    json_t *body = body_object(hr);

    if (!body || !have_tokenizer(hr, co, body))
        return;
    /* a chat's images: fetched and decoded off the loop, counted when they are */
    if (hold_for_images(hr, co, body, NULL, tokenize_resume) != 0)
        return;
    tokenize(hr, co, body, NULL);
}

/* POST /detokenize (vLLM): {"tokens": [ids]} -> {"prompt": text}. */
static void h_detokenize(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    json_t *body = body_object(hr);
    const json_t *tj;
    int32_t *ids = NULL;
    size_t n = 0;
    char msg[512] = "", *text = NULL;
    int e;

    if (!body || !have_tokenizer(hr, co, body))
        return;
    tj = json_object_get(body, "tokens");
    if (!tj) {
        json_decref(body);
        http_respond_error(hr, 400, "tokens", "tokens: required");
        return;
    }
    e = openai_ids_conv(tj, "tokens", &ids, &n, 1u << 22, msg, sizeof(msg));
    for (size_t i = 0; e == 0 && i < n; i++)
        if ((size_t)ids[i] >= tok_vocab_size(co->tok)) {
            snprintf(msg, sizeof(msg), "tokens[%zu]: %d is outside the vocabulary [0, %zu)", i, ids[i],
                     tok_vocab_size(co->tok));
            e = -EINVAL;
        }
    if (e == 0 && (e = tok_decode(co->tok, ids, n, true, &text, NULL)) < 0)
        snprintf(msg, sizeof(msg), "tokens: %s", err_str(e));
    free(ids);
    json_decref(body);
    if (e < 0) {
        respond_status(hr, RPC_INVALID_ARGUMENT, 0, msg);
        return;
    }
    respond_json(hr, 200, json_pack("{s:s}", "prompt", text));
    free(text);
}

/* GET /health: liveness (vLLM's: 200 and an empty body while the process serves). */
static void h_health(struct http_req *hr, void *ud)
{
    struct coord *co = ud;

    if (co->exiting)
        http_respond_error(hr, 503, NULL, "shutting down");
    else
        http_respond(hr, 200, "application/json", "{}", 2, NULL);
}

/* GET /ready: readiness as JSON; 503 with the reason while draining or with no ready group. */
static void h_ready(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    char why[600];

    coord_unready_reason(co, why, sizeof(why));
    if (!why[0])
        respond_json(hr, 200, json_pack("{s:s, s:i}", "status", "ready", "groups_ready", (int)wpool_ready_count(co)));
    else
        http_respond_error(hr, 503, NULL, "not ready: %s", why);
}

/* GET /healthz: the same as text ("ready", "not ready: REASON"), as the metrics port always had. */
static void h_healthz(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    char why[600], text[640];

    coord_unready_reason(co, why, sizeof(why));
    snprintf(text, sizeof(text), why[0] ? "not ready: %s\n" : "ready\n", why);
    http_respond(hr, why[0] ? 503 : 200, "text/plain", text, strlen(text), NULL);
}

static void h_metrics(struct http_req *hr, void *ud)
{
    size_t n = 0;
    char *text = metrics_render(ud, &n);

    if (!text) {
        http_respond_error(hr, 500, NULL, "out of memory");
        return;
    }
    http_respond(hr, 200, "text/plain; version=0.0.4; charset=utf-8", text, n, NULL);
    free(text);
}

static const struct http_route api_routes[] = {
    { "POST", "/v1/chat/completions", true, h_chat, NULL },
    { "POST", "/v1/completions", true, h_completions, NULL },
    { "GET", "/v1/models", true, h_models, NULL },
    { "POST", "/v1/responses", true, responses_create, NULL },
    { "GET", "/v1/responses/*", true, responses_get, NULL },
    { "DELETE", "/v1/responses/*", true, responses_get, NULL },
    { "POST", "/v1/messages", true, messages_create, messages_error_body },
    { "POST", "/v1/messages/count_tokens", true, messages_count_tokens, messages_error_body },
    { "POST", "/tokenize", true, h_tokenize, NULL },
    { "POST", "/detokenize", true, h_detokenize, NULL },
    { "GET", "/health", false, h_health, NULL },
    { "GET", "/ready", false, h_ready, NULL },
    { "GET", "/healthz", false, h_healthz, NULL },
    { "GET", "/metrics", false, h_metrics, NULL },
};

static const struct http_route metrics_routes[] = {
    { "GET", "/metrics", false, h_metrics, NULL },
    { "GET", "/healthz", false, h_healthz, NULL },
    { "GET", "/health", false, h_health, NULL },
    { "GET", "/ready", false, h_ready, NULL },
};

/* host:port (or [v6]:port) into host and port. */
static int split_hostport(const char *addr, char *host, size_t hn, int *port)
{
    const char *colon;
    size_t hl;
    char *end;
    long p;

    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');

        if (!rb || rb[1] != ':')
            return -EINVAL;
        hl = (size_t)(rb - addr - 1);
        if (hl >= hn)
            return -EINVAL;
        memcpy(host, addr + 1, hl);
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon)
            return -EINVAL;
        hl = (size_t)(colon - addr);
        if (hl >= hn)
            return -EINVAL;
        memcpy(host, addr, hl);
    }
    host[hl] = '\0';
    p = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || p < 0 || p > 65535)
        return -EINVAL;
    *port = (int)p;
    return 0;
}

int openai_start(struct coord *co)
{
    const struct coord_opts *o = &co->o;
    bool tls = o->tls.cert_file && o->tls.cert_file[0];
    struct http_server_opts ho = {
        .host = o->http_host,
        .port = o->http_port,
        .tls = tls ? &o->tls : NULL,
        .api_key = o->api_key,
        .max_body_bytes = o->http_max_body_bytes,
        .max_header_bytes = o->http_max_header_bytes,
        .max_connections = o->http_max_connections,
        .max_connections_per_client = o->http_max_connections_per_ip,
        .header_timeout_ms = o->http_header_timeout_ms,
        .timeout_ms = o->http_timeout_ms,
        .stream_buffer_bytes = o->max_call_buffer_bytes,
        .routes = api_routes,
        .n_routes = sizeof(api_routes) / sizeof(api_routes[0]),
        .ud = co,
        .name = "http",
        .allowed_hosts = o->http_allowed_hosts,
        .allowed_origins = o->http_allowed_origins,
    };
    char host[256];
    int r;

    if (o->http_port >= 0) {
        if ((r = http_server_start(&co->loop, &ho, &co->http)) < 0)
            return r;
        co->http_port = http_server_port(co->http);
    }
    if (o->metrics_listen && o->metrics_listen[0]) {
        if (split_hostport(o->metrics_listen, host, sizeof(host), &ho.port) < 0) {
            log_error("--metrics-listen %s: expected HOST:PORT", o->metrics_listen);
            return -EINVAL;
        }
        ho.host = host;
        ho.tls = NULL;
        ho.api_key = NULL;
        ho.max_body_bytes = 0;
        ho.max_header_bytes = 8192;
        ho.max_connections = 64;
        ho.max_connections_per_client = 0;
        ho.timeout_ms = 5000;
        ho.header_timeout_ms = 5000;
        ho.routes = metrics_routes;
        ho.n_routes = sizeof(metrics_routes) / sizeof(metrics_routes[0]);
        ho.name = "metrics";
        if ((r = http_server_start(&co->loop, &ho, &co->http_metrics)) < 0)
            return r;
        co->metrics_port = http_server_port(co->http_metrics);
    }
    return 0;
}

unsigned openai_active(const struct coord *co)
{
    return http_server_active(co->http) + http_server_active(co->http_metrics);
}

void openai_quiesce(struct coord *co)
{
    http_server_quiesce(co->http);
    http_server_quiesce(co->http_metrics);
}

void openai_stop(struct coord *co)
{
    http_server_stop(co->http);
    http_server_stop(co->http_metrics);
    co->http = co->http_metrics = NULL;
    responses_store_free(co);
}
