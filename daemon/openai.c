/* openai.c - the OpenAI-compatible HTTP API: the second front door of the coordinator.
 *
 * Routes (http.c serves them): POST /v1/chat/completions and /v1/completions (JSON or
 * server-sent events), GET /v1/models, the agent doors (doors.h: /v1/responses,
 * /v1/messages), POST /tokenize and /detokenize (vLLM's shapes),
 * GET /health (liveness), /ready and /healthz (readiness), /metrics (Prometheus text).
 *
 * The door only converts: a body becomes a struct request (field names as the client wrote
 * them: the HTTP name tables), req_submit() serves it exactly as it serves a gRPC call
 * (admission, routing, deadlines, the text pipeline, metrics, aborts), and the door's client
 * ops (struct req_client_ops) turn each Chunk and Final into OpenAI JSON.  n > 1 is n
 * requests sharing the prompt, one per choice, behind one HTTP answer (struct oai_gen).
 *
 * Lifetime of an oai_gen: from its handler until every choice has ended (final or end) and
 * the answer is handed to http.c, or the client went away and every choice was cancelled;
 * it is freed through its timer's close (the timer carries the request's deadline and the
 * deferred cancellation of the other choices when one fails).  Loop thread only.
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
#include "doors.h"
#include "err.h"
#include "http.h"
#include "json.h"
#include "log.h"
#include "media.h"
#include "openai.h"
#include "strbuf.h"
#include "stepd-config.h"

/* ------------------------------------------------------------------ field names */

/* The two APIs name every field alike but the prompt (PROMPT: RN_TEXT, RN_MESSAGES,
 * RN_TOKEN_IDS, RN_INPUT), the number of top logprobs (LOGPROBS) and the output cap (MAXT:
 * a chat may name it max_completion_tokens). */
#define OPENAI_NAMES(PROMPT, LOGPROBS, MAXT) {                 \
    [RN_REQUEST_ID] = "request_id",                             \
    [RN_MODEL] = "model",                                       \
    [RN_TEXT] = PROMPT,                                         \
    [RN_MESSAGES] = PROMPT,                                     \
    [RN_TOOLS] = "tools",                                       \
    [RN_CHAT_TEMPLATE_KWARGS] = "chat_template_kwargs",         \
    [RN_REASONING_EFFORT] = "reasoning_effort",                 \
    [RN_TOKEN_IDS] = PROMPT,                                    \
    [RN_TEMPERATURE] = "temperature",                           \
    [RN_TOP_P] = "top_p",                                       \
    [RN_TOP_K] = "top_k",                                       \
    [RN_MIN_P] = "min_p",                                       \
    [RN_REPETITION_PENALTY] = "repetition_penalty",             \
    [RN_PRESENCE_PENALTY] = "presence_penalty",                 \
    [RN_FREQUENCY_PENALTY] = "frequency_penalty",               \
    [RN_MAX_TOKENS] = MAXT,                                     \
    [RN_MIN_TOKENS] = "min_tokens",                             \
    [RN_SEED] = "seed",                                         \
    [RN_LOGPROBS] = LOGPROBS,                                   \
    [RN_N] = "n",                                               \
    [RN_STOP] = "stop",                                         \
    [RN_STOP_TOKEN_IDS] = "stop_token_ids",                     \
    [RN_LOGIT_BIAS] = "logit_bias",                             \
    [RN_NUM_SPECULATIVE_TOKENS] = "num_speculative_tokens",     \
    [RN_CACHE_SALT] = "cache_salt",                             \
    [RN_TOOL_CHOICE] = "tool_choice",                           \
    [RN_INPUT] = PROMPT,                                        \
}

const char *const names_chat[_RN_MAX] = OPENAI_NAMES("messages", "top_logprobs", "max_tokens");
/* a chat that gave max_completion_tokens: its errors name that field */
static const char *const names_chat_mct[_RN_MAX] = OPENAI_NAMES("messages", "top_logprobs", "max_completion_tokens");
static const char *const names_completion[_RN_MAX] = OPENAI_NAMES("prompt", "logprobs", "max_tokens");

#undef OPENAI_NAMES

/* ------------------------------------------------------------------ JSON text */

/* s as a JSON string (quoted) onto b: valid UTF-8 is copied, control characters escaped,
 * invalid bytes replaced by U+FFFD (the pipeline's text is valid UTF-8; token bytes in
 * logprobs need not be). */
static void json_str(struct strbuf *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    size_t i = 0, run = 0;

    strbuf_add(b, "\"", 1);
    while (i < n) {
        unsigned char ch = (unsigned char)s[i];
        size_t ok;

        if (ch >= 0x20 && ch != '"' && ch != '\\' && ch < 0x80) {
            run++;
            i++;
            continue;
        }
        if (run) {
            strbuf_add(b, s + i - run, run);
            run = 0;
        }
        if (ch >= 0x80) {
            ok = tok_utf8_valid_prefix(s + i, n - i);
            if (ok) {
                /* copy the valid stretch of multi-byte characters up to the next ASCII byte */
                size_t k = 0;

                while (k < ok && (unsigned char)s[i + k] >= 0x80)
                    k++;
                if (k == 0)
                    k = ok;
                strbuf_add(b, s + i, k);
                i += k;
            } else {
                strbuf_add(b, "\xef\xbf\xbd", 3);
                i++;
            }
            continue;
        }
        switch (ch) {
        case '"': strbuf_add(b, "\\\"", 2); break;
        case '\\': strbuf_add(b, "\\\\", 2); break;
        case '\n': strbuf_add(b, "\\n", 2); break;
        case '\r': strbuf_add(b, "\\r", 2); break;
        case '\t': strbuf_add(b, "\\t", 2); break;
        default: {
            char u[6] = { '\\', 'u', '0', '0', hex[ch >> 4], hex[ch & 15] };
            strbuf_add(b, u, 6);
        }
        }
        i++;
    }
    if (run)
        strbuf_add(b, s + i - run, run);
    strbuf_add(b, "\"", 1);
}

static void json_strz(struct strbuf *b, const char *s)
{
    json_str(b, s, strlen(s));
}

/* A number as JSON ("null" for what JSON cannot hold). */
static void json_num(struct strbuf *b, double v)
{
    if (isfinite(v))
        strbuf_printf(b, "%.9g", v);
    else
        strbuf_adds(b, v < 0 ? "-9999.0" : "null");
}

/* ------------------------------------------------------------------ status mapping */

unsigned http_status_of(int rpc)
{
    switch (rpc) {
    case RPC_OK: return 200;
    case RPC_INVALID_ARGUMENT: case RPC_FAILED_PRECONDITION: case RPC_OUT_OF_RANGE: return 400;
    case RPC_UNAUTHENTICATED: return 401;
    case RPC_PERMISSION_DENIED: return 403;
    case RPC_NOT_FOUND: return 404;
    case RPC_ALREADY_EXISTS: case RPC_ABORTED: return 409;
    case RPC_RESOURCE_EXHAUSTED: return 429;
    case RPC_CANCELLED: return 499;
    case RPC_UNIMPLEMENTED: return 501;
    case RPC_UNAVAILABLE: return 503;
    case RPC_DEADLINE_EXCEEDED: return 504;
    default: return 500;
    }
}

/* The field a validation message names ("temperature: must be ...", "messages[0].role: ..."):
 * its text before ": " when that is one word. */
static const char *param_of(const char *msg, char *buf, size_t n)
{
    size_t k = strcspn(msg, ": ");

    if (k == 0 || k >= n || msg[k] != ':' || msg[k + 1] != ' ')
        return NULL;
    memcpy(buf, msg, k);
    buf[k] = '\0';
    return buf;
}

int respond_status(struct http_req *hr, int rpc, int retry_ms, const char *msg)
{
    char param[128];
    unsigned st = http_status_of(rpc);
    const char *p = st == 400 ? param_of(msg, param, sizeof(param)) : NULL;

    if (retry_ms > 0) {
        char *body;
        json_t *o;
        int r;
        static const char *const hdrs[] = { "Retry-After", "1", NULL };

        /* the same error object, with Retry-After */
        o = json_pack("{s:{s:s, s:s, s:n, s:s}}", "error", "message", msg, "type",
                      st == 429 ? "rate_limit_error" : "service_unavailable_error", "param", "code",
                      st == 429 ? "server_overloaded" : "unavailable");
        body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        r = body ? http_respond(hr, st, "application/json", body, strlen(body), hdrs) : -ENOMEM;
        free(body);
        return r;
    }
    return http_respond_error(hr, st, p, "%s", msg);
}

/* ------------------------------------------------------------------ a request in progress */

/* Completions' logprobs: the parallel arrays {tokens, token_logprobs, top_logprobs,
 * text_offset}, built up chunk by chunk (the items comma-separated). */
struct lp_parts {
    struct strbuf tokens, vals, tops, offs;
    size_t n;
};

struct oai_call {
    char id[40];
    char *name;
    struct strbuf args;
};

struct oai_choice {
    struct oai_gen *g;
    uint32_t index;
    struct req *r;                  /* watched (admitted) and not yet ended */
    bool ended;
    /* non-streaming: the whole output */
    struct strbuf text, reasoning, content;
    struct oai_call *calls;
    size_t n_calls;
    size_t calls_started;           /* tool calls seen (streaming too) */
    struct strbuf logprobs;         /* chat: the entries, comma-separated */
    size_t n_lp;
    struct lp_parts lpp;            /* completions */
    struct strbuf ids;              /* return_token_ids: the output's ids, comma-separated */
    size_t text_off;                /* completions: bytes of output so far */
    /* the Final */
    int finish;                     /* Stepd__V1__FinishReason */
    char *stop_str;
    int32_t stop_id;
    bool has_stop_id;
    uint32_t prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens;
    struct strbuf ext;              /* the choice's "stepd" object */
};

struct oai_gen {
    struct coord *co;
    struct http_req *hr;            /* NULL once the client is gone or the answer is given */
    bool chat, stream, include_usage, continuous_usage, logprobs, return_ids;
    bool tools_parsed;              /* chat through the tool-call parser: content may stay null */
    bool started;                   /* stream: headers and role chunks sent */
    bool failed, busy, answered, freeing, cancel_pending;
    int fail_status;
    char fail_msg[768];
    char id[160];
    char model[160];
    int64_t created;
    uint32_t n, live;
    uv_timer_t timer;
    struct oai_choice *ch;
};

static void gen_done_check(struct oai_gen *g);
static void lp_parts_done(struct lp_parts *p);

static void gen_freed(uv_handle_t *h)
{
    struct oai_gen *g = h->data;

    for (uint32_t i = 0; i < g->n; i++) {
        struct oai_choice *c = &g->ch[i];

        strbuf_done(&c->text);
        strbuf_done(&c->reasoning);
        strbuf_done(&c->content);
        strbuf_done(&c->logprobs);
        lp_parts_done(&c->lpp);
        strbuf_done(&c->ids);
        strbuf_done(&c->ext);
        for (size_t k = 0; k < c->n_calls; k++) {
            free(c->calls[k].name);
            strbuf_done(&c->calls[k].args);
        }
        free(c->calls);
        free(c->stop_str);
    }
    free(g->ch);
    free(g);
}

static void gen_free(struct oai_gen *g)
{
    if (g->freeing)
        return;
    g->freeing = true;
    if (g->hr)
        http_req_on_close(g->hr, NULL, NULL);
    g->hr = NULL;
    uv_timer_stop(&g->timer);
    uv_close((uv_handle_t *)&g->timer, gen_freed);
}

/* Cancel every choice still running (an entry point: the timer, the client's close). */
static void gen_cancel_all(struct oai_gen *g)
{
    g->busy = true;
    for (uint32_t i = 0; i < g->n; i++) {
        struct req *r = g->ch[i].r;

        if (r)
            req_client_cancel(r);   /* its end op runs: ch[i].r = NULL */
    }
    g->busy = false;
    gen_done_check(g);
}

static void gen_timer_cb(uv_timer_t *t)
{
    struct oai_gen *g = t->data;

    g->cancel_pending = false;
    gen_cancel_all(g);
}

static void gen_on_close(struct http_req *hr, bool completed, void *ud)
{
    struct oai_gen *g = ud;

    (void)hr;
    g->hr = NULL;
    if (!completed && g->live)
        log_req_info(g->id, "client closed the connection: cancelling");
    gen_cancel_all(g);
}

/* One choice failed: the others are cancelled, later (never from inside req.c). */
static void gen_fail(struct oai_gen *g, int status, const char *msg)
{
    if (!g->failed) {
        g->failed = true;
        g->fail_status = status;
        snprintf(g->fail_msg, sizeof(g->fail_msg), "%s", msg);
    }
    if (g->live && !g->cancel_pending && !g->freeing) {
        g->cancel_pending = true;
        uv_timer_start(&g->timer, gen_timer_cb, 0, 0);
    }
}

/* ------------------------------------------------------------------ rendering */

static const char *finish_name(const struct oai_gen *g, const struct oai_choice *c)
{
    switch (c->finish) {
    case STEPD__V1__FINISH_REASON__FINISH_REASON_STOP:
        return c->calls_started && g->chat ? "tool_calls" : "stop";
    case STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH:
        return "length";
    case STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT:
        return "abort";
    default:
        return "error";
    }
}

static void stop_reason(struct strbuf *b, const struct oai_choice *c)
{
    if (c->stop_str)
        json_strz(b, c->stop_str);
    else if (c->has_stop_id)
        strbuf_printf(b, "%d", c->stop_id);
    else
        strbuf_adds(b, "null");
}

/* One token's logprob entry.  Chat: {token, logprob, bytes, top_logprobs}; completions:
 * the parallel arrays are built at the end from the same entries. */
static void token_json(struct strbuf *b, const struct tokenizer *tok, int32_t id)
{
    size_t n = 0;
    const char *p = tok ? tok_id_bytes(tok, id, &n) : NULL;

    if (!p) {
        strbuf_printf(b, "\"token_id:%d\"", id);
        return;
    }
    json_str(b, p, n);
}

static void bytes_json(struct strbuf *b, const struct tokenizer *tok, int32_t id)
{
    size_t n = 0;
    const char *p = tok ? tok_id_bytes(tok, id, &n) : NULL;

    strbuf_adds(b, "[");
    for (size_t i = 0; p && i < n; i++)
        strbuf_printf(b, "%s%u", i ? "," : "", (unsigned char)p[i]);
    strbuf_adds(b, "]");
}

static void chat_logprobs(struct strbuf *b, const struct tokenizer *tok, const Stepd__V1__Chunk *ch, bool first)
{
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const Stepd__V1__TokenLogprob *lp = ch->logprobs[i];

        if (!first || i)
            strbuf_adds(b, ",");
        strbuf_adds(b, "{\"token\":");
        token_json(b, tok, lp->token_id);
        strbuf_adds(b, ",\"logprob\":");
        json_num(b, lp->logprob);
        strbuf_adds(b, ",\"bytes\":");
        bytes_json(b, tok, lp->token_id);
        strbuf_adds(b, ",\"top_logprobs\":[");
        for (size_t k = 0; k < lp->n_top; k++) {
            strbuf_adds(b, k ? ",{\"token\":" : "{\"token\":");
            token_json(b, tok, lp->top[k]->token_id);
            strbuf_adds(b, ",\"logprob\":");
            json_num(b, lp->top[k]->logprob);
            strbuf_adds(b, ",\"bytes\":");
            bytes_json(b, tok, lp->top[k]->token_id);
            strbuf_adds(b, "}");
        }
        strbuf_adds(b, "]}");
    }
}

static void lp_parts_add(struct lp_parts *p, const struct tokenizer *tok, const Stepd__V1__Chunk *ch, size_t *off)
{
    for (size_t i = 0; i < ch->n_logprobs; i++, p->n++) {
        const Stepd__V1__TokenLogprob *lp = ch->logprobs[i];
        const char *sep = p->n ? "," : "";
        size_t n = 0;

        strbuf_adds(&p->tokens, sep);
        token_json(&p->tokens, tok, lp->token_id);
        strbuf_adds(&p->vals, sep);
        json_num(&p->vals, lp->logprob);
        strbuf_adds(&p->tops, p->n ? ",{" : "{");
        for (size_t k = 0; k < lp->n_top; k++) {
            if (k)
                strbuf_adds(&p->tops, ",");
            token_json(&p->tops, tok, lp->top[k]->token_id);
            strbuf_adds(&p->tops, ":");
            json_num(&p->tops, lp->top[k]->logprob);
        }
        strbuf_adds(&p->tops, "}");
        strbuf_printf(&p->offs, "%s%zu", sep, *off);
        if (tok && tok_id_bytes(tok, lp->token_id, &n))
            *off += n;
    }
}

static void lp_parts_render(struct strbuf *b, const struct lp_parts *p)
{
    strbuf_adds(b, "{\"tokens\":[");
    strbuf_add(b, strbuf_str(&p->tokens), p->tokens.len);
    strbuf_adds(b, "],\"token_logprobs\":[");
    strbuf_add(b, strbuf_str(&p->vals), p->vals.len);
    strbuf_adds(b, "],\"top_logprobs\":[");
    strbuf_add(b, strbuf_str(&p->tops), p->tops.len);
    strbuf_adds(b, "],\"text_offset\":[");
    strbuf_add(b, strbuf_str(&p->offs), p->offs.len);
    strbuf_adds(b, "]}");
}

static void lp_parts_done(struct lp_parts *p)
{
    strbuf_done(&p->tokens);
    strbuf_done(&p->vals);
    strbuf_done(&p->tops);
    strbuf_done(&p->offs);
}

static void usage_json(struct strbuf *b, const struct oai_gen *g)
{
    uint32_t completion = 0, reasoning = 0;

    for (uint32_t i = 0; i < g->n; i++) {
        completion += g->ch[i].completion_tokens;
        reasoning += g->ch[i].reasoning_tokens;
    }
    strbuf_printf(b, "{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u,"
                  "\"prompt_tokens_details\":{\"cached_tokens\":%u},"
                  "\"completion_tokens_details\":{\"reasoning_tokens\":%u}}",
                  g->ch[0].prompt_tokens, completion, g->ch[0].prompt_tokens + completion,
                  g->ch[0].cached_tokens, reasoning);
}

/* The choice's "stepd" extension: the request behind it, MTP statistics, timings. */
static void ext_json(struct strbuf *b, const struct req *r, const Stepd__V1__Final *f)
{
    const Stepd__V1__MtpStats *m = f->mtp;
    const Stepd__V1__Timings *t = f->timings;

    strbuf_adds(b, "{\"request_id\":");
    json_strz(b, r->id);
    strbuf_adds(b, ",\"group\":");
    json_strz(b, f->group ? f->group : "");
    strbuf_adds(b, ",\"mtp\":{");
    if (m) {
        strbuf_printf(b, "\"num_drafts\":%u,\"num_draft_tokens\":%u,\"num_accepted_tokens\":%u,"
                      "\"accepted_per_position\":[", m->num_drafts, m->num_draft_tokens, m->num_accepted_tokens);
        for (size_t i = 0; i < m->n_accepted_per_position; i++)
            strbuf_printf(b, "%s%u", i ? "," : "", m->accepted_per_position[i]);
        strbuf_adds(b, "],\"acceptance_length\":");
        if (m->num_drafts)
            json_num(b, 1.0 + (double)m->num_accepted_tokens / m->num_drafts);
        else
            strbuf_adds(b, "null");
    }
    strbuf_adds(b, "},\"timings\":{");
    if (t)
        strbuf_printf(b, "\"queue_s\":%.6f,\"prefill_s\":%.6f,\"first_token_s\":%.6f,\"decode_s\":%.6f,"
                      "\"mean_inter_token_s\":%.6f,\"e2e_s\":%.6f", t->queue_s, t->prefill_s, t->first_token_s,
                      t->decode_s, t->mean_inter_token_s, t->e2e_s);
    strbuf_adds(b, "}}");
}

/* The head of a streamed chunk, up to the choices array's opening. */
static void chunk_head(struct strbuf *b, const struct oai_gen *g)
{
    strbuf_adds(b, "data: {\"id\":");
    json_strz(b, g->id);
    strbuf_printf(b, ",\"object\":\"%s\",\"created\":%" PRId64 ",\"model\":",
                  g->chat ? "chat.completion.chunk" : "text_completion", g->created);
    json_strz(b, g->model);
    strbuf_adds(b, ",\"choices\":[");
}

static int gen_write(struct oai_gen *g, struct strbuf *b)
{
    int e;

    if (b->oom)
        return -ENOMEM;
    e = g->hr ? http_stream_write(g->hr, b->p, b->len) : -ECANCELED;
    return e;
}

/* Headers and the first chunk of every choice (the assistant role). */
static int stream_begin(struct oai_gen *g)
{
    struct strbuf b = STRBUF_INIT;
    int e;

    if (g->started)
        return 0;
    g->started = true;
    if ((e = http_stream_start(g->hr, 200, "text/event-stream")) < 0)
        return e;
    if (!g->chat)
        return 0;
    for (uint32_t i = 0; i < g->n; i++) {
        chunk_head(&b, g);
        /* as OpenAI's: content null until there is some when the reply may be tool calls only */
        strbuf_printf(&b, "{\"index\":%u,\"delta\":{\"role\":\"assistant\",\"content\":%s},\"logprobs\":null,"
                      "\"finish_reason\":null}]%s}\n\n", i, g->tools_parsed ? "null" : "\"\"",
                      g->include_usage ? ",\"usage\":null" : "");
    }
    e = gen_write(g, &b);
    strbuf_done(&b);
    return e;
}

/* The streamed delta of one engine chunk for choice c (nothing when it carries nothing). */
static void stream_delta(struct oai_gen *g, struct oai_choice *c, const Stepd__V1__Chunk *ch, struct strbuf *b)
{
    const struct tokenizer *tok = g->co->tok;
    bool any = ch->n_logprobs || ch->n_tool_calls || (g->return_ids && ch->n_token_ids) ||
               (g->chat ? ch->content_delta[0] || ch->reasoning_delta[0] : ch->text[0] != 0);

    if (!any && !(g->continuous_usage && ch->usage))
        return;
    chunk_head(b, g);
    strbuf_printf(b, "{\"index\":%u,", c->index);
    if (g->return_ids) {
        strbuf_adds(b, "\"token_ids\":[");
        for (size_t i = 0; i < ch->n_token_ids; i++)
            strbuf_printf(b, "%s%d", i ? "," : "", ch->token_ids[i]);
        strbuf_adds(b, "],");
    }
    if (g->chat) {
        bool comma = false;

        strbuf_adds(b, "\"delta\":{");
        if (ch->reasoning_delta[0]) {
            strbuf_adds(b, "\"reasoning_content\":");
            json_strz(b, ch->reasoning_delta);
            comma = true;
        }
        if (ch->content_delta[0]) {
            strbuf_adds(b, comma ? ",\"content\":" : "\"content\":");
            json_strz(b, ch->content_delta);
            comma = true;
        }
        if (ch->n_tool_calls) {
            strbuf_adds(b, comma ? ",\"tool_calls\":[" : "\"tool_calls\":[");
            for (size_t k = 0; k < ch->n_tool_calls; k++) {
                const Stepd__V1__ToolCallDelta *t = ch->tool_calls[k];

                strbuf_printf(b, "%s{\"index\":%u,", k ? "," : "", t->index);
                if (t->id[0]) {
                    strbuf_adds(b, "\"id\":");
                    json_strz(b, t->id);
                    strbuf_adds(b, ",\"type\":\"function\",\"function\":{\"name\":");
                    json_strz(b, t->name);
                    strbuf_adds(b, ",\"arguments\":");
                } else {
                    strbuf_adds(b, "\"function\":{\"arguments\":");
                }
                json_strz(b, t->arguments_delta);
                strbuf_adds(b, "}}");
            }
            strbuf_adds(b, "]");
        }
        strbuf_adds(b, "},\"logprobs\":");
        if (ch->n_logprobs) {
            strbuf_adds(b, "{\"content\":[");
            chat_logprobs(b, tok, ch, true);
            strbuf_adds(b, "]}");
        } else {
            strbuf_adds(b, "null");
        }
    } else {
        strbuf_adds(b, "\"text\":");
        json_strz(b, ch->text);
        strbuf_adds(b, ",\"logprobs\":");
        if (ch->n_logprobs) {
            struct lp_parts p = { STRBUF_INIT, STRBUF_INIT, STRBUF_INIT, STRBUF_INIT, 0 };

            lp_parts_add(&p, tok, ch, &c->text_off);
            lp_parts_render(b, &p);
            lp_parts_done(&p);
        } else {
            strbuf_adds(b, "null");
        }
    }
    strbuf_adds(b, ",\"finish_reason\":null}]");
    if (g->continuous_usage && ch->usage)
        strbuf_printf(b, ",\"usage\":{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u}",
                      ch->usage->prompt_tokens, ch->usage->completion_tokens,
                      ch->usage->prompt_tokens + ch->usage->completion_tokens);
    else if (g->include_usage)
        strbuf_adds(b, ",\"usage\":null");
    strbuf_adds(b, "}\n\n");
}

static void stream_finish_chunk(struct oai_gen *g, struct oai_choice *c, struct strbuf *b)
{
    chunk_head(b, g);
    strbuf_printf(b, "{\"index\":%u,%s,\"logprobs\":null,\"finish_reason\":\"%s\",\"stop_reason\":", c->index,
                  g->chat ? "\"delta\":{}" : "\"text\":\"\"", finish_name(g, c));
    stop_reason(b, c);
    strbuf_adds(b, "}]");
    if (g->include_usage)
        strbuf_adds(b, ",\"usage\":null");
    strbuf_adds(b, ",\"stepd\":");
    strbuf_add(b, c->ext.p ? c->ext.p : "{}", c->ext.p ? c->ext.len : 2);
    strbuf_adds(b, "}\n\n");
}

/* Non-streaming: the whole answer. */
static void respond_whole(struct oai_gen *g)
{
    struct strbuf b = STRBUF_INIT;

    strbuf_adds(&b, "{\"id\":");
    json_strz(&b, g->id);
    strbuf_printf(&b, ",\"object\":\"%s\",\"created\":%" PRId64 ",\"model\":",
                  g->chat ? "chat.completion" : "text_completion", g->created);
    json_strz(&b, g->model);
    strbuf_adds(&b, ",\"choices\":[");
    for (uint32_t i = 0; i < g->n; i++) {
        struct oai_choice *c = &g->ch[i];

        strbuf_printf(&b, "%s{\"index\":%u,", i ? "," : "", i);
        if (g->return_ids)
            strbuf_printf(&b, "\"token_ids\":[%s],", strbuf_str(&c->ids));
        if (g->chat) {
            strbuf_adds(&b, "\"message\":{\"role\":\"assistant\",\"content\":");
            if (c->content.len || !c->n_calls)
                json_str(&b, strbuf_str(&c->content), c->content.len);
            else
                strbuf_adds(&b, "null");
            strbuf_adds(&b, ",\"reasoning_content\":");
            if (c->reasoning.len)
                json_str(&b, c->reasoning.p, c->reasoning.len);
            else
                strbuf_adds(&b, "null");
            if (c->n_calls) {
                strbuf_adds(&b, ",\"tool_calls\":[");
                for (size_t k = 0; k < c->n_calls; k++) {
                    strbuf_adds(&b, k ? ",{\"id\":" : "{\"id\":");
                    json_strz(&b, c->calls[k].id);
                    strbuf_adds(&b, ",\"type\":\"function\",\"function\":{\"name\":");
                    json_strz(&b, c->calls[k].name ? c->calls[k].name : "");
                    strbuf_adds(&b, ",\"arguments\":");
                    json_str(&b, c->calls[k].args.len ? c->calls[k].args.p : "{}",
                             c->calls[k].args.len ? c->calls[k].args.len : 2);
                    strbuf_adds(&b, "}}");
                }
                strbuf_adds(&b, "]");
            }
            strbuf_adds(&b, "},\"logprobs\":");
            if (g->logprobs) {
                strbuf_adds(&b, "{\"content\":[");
                strbuf_add(&b, strbuf_str(&c->logprobs), c->logprobs.len);
                strbuf_adds(&b, "]}");
            } else {
                strbuf_adds(&b, "null");
            }
        } else {
            strbuf_adds(&b, "\"text\":");
            json_str(&b, strbuf_str(&c->text), c->text.len);
            strbuf_adds(&b, ",\"logprobs\":");
            if (g->logprobs)
                lp_parts_render(&b, &c->lpp);
            else
                strbuf_adds(&b, "null");
        }
        strbuf_printf(&b, ",\"finish_reason\":\"%s\",\"stop_reason\":", finish_name(g, c));
        stop_reason(&b, c);
        strbuf_adds(&b, "}");
    }
    strbuf_adds(&b, "],\"usage\":");
    usage_json(&b, g);
    strbuf_adds(&b, ",\"stepd\":{\"choices\":[");
    for (uint32_t i = 0; i < g->n; i++) {
        if (i)
            strbuf_adds(&b, ",");
        strbuf_add(&b, g->ch[i].ext.p ? g->ch[i].ext.p : "{}", g->ch[i].ext.p ? g->ch[i].ext.len : 2);
    }
    strbuf_adds(&b, "]}}");
    if (b.oom)
        http_respond_error(g->hr, 500, NULL, "out of memory");
    else
        http_respond(g->hr, 200, "application/json", b.p, b.len, NULL);
    strbuf_done(&b);
}

/* Every choice has ended: give the answer (once), then let go. */
static void gen_done_check(struct oai_gen *g)
{
    if (g->live || g->busy || g->freeing)
        return;
    if (g->hr && !g->answered) {
        g->answered = true;
        if (g->stream && g->started) {
            struct strbuf b = STRBUF_INIT;

            if (g->failed) {
                char *e;
                json_t *o = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", g->fail_msg, "type",
                                      http_status_of(g->fail_status) >= 500 ? "server_error" : "invalid_request_error",
                                      "param", "code", (int)http_status_of(g->fail_status));

                e = o ? json_dumps(o, JSON_COMPACT) : NULL;
                json_decref(o);
                if (e) {
                    strbuf_printf(&b, "data: %s\n\n", e);
                    free(e);
                }
            } else if (g->include_usage) {
                chunk_head(&b, g);
                strbuf_adds(&b, "],\"usage\":");
                usage_json(&b, g);
                strbuf_adds(&b, "}\n\n");
            }
            strbuf_adds(&b, "data: [DONE]\n\n");
            if (gen_write(g, &b) == 0)
                http_stream_end(g->hr);
            else
                http_req_abort(g->hr);
            strbuf_done(&b);
        } else if (g->failed) {
            respond_status(g->hr, g->fail_status, g->fail_status == RPC_RESOURCE_EXHAUSTED ? 100 : 0, g->fail_msg);
        } else if (g->stream) {
            /* every choice ended without output before the stream began */
            if (stream_begin(g) == 0) {
                g->answered = false;
                gen_done_check(g);
                return;
            }
        } else {
            respond_whole(g);
        }
    }
    gen_free(g);
}

/* ------------------------------------------------------------------ the client ops */

static int oai_chunk(struct req *r, const Stepd__V1__Chunk *ch)
{
    struct oai_choice *c = r->client;
    struct oai_gen *g = c->g;
    int e = 0;

    for (size_t k = 0; k < ch->n_tool_calls; k++)
        c->calls_started += ch->tool_calls[k]->id[0] != 0;
    if (g->stream) {
        struct strbuf b = STRBUF_INIT;

        if (!g->hr)
            return 0;       /* the client is gone: its cancel is on its way */
        e = stream_begin(g);
        if (e == 0) {
            stream_delta(g, c, ch, &b);
            if (b.len || b.oom)
                e = gen_write(g, &b);
        }
        strbuf_done(&b);
        if (e == -ENOBUFS) {
            char msg[160];

            snprintf(msg, sizeof(msg), "client is not reading its stream (%zu bytes buffered, cap reached)",
                     g->co->o.max_call_buffer_bytes);
            c->r = NULL;
            c->ended = true;
            g->live--;
            req_client_detach(r, RPC_RESOURCE_EXHAUSTED, msg);
            g->failed = true;
            http_req_abort(g->hr);  /* the other choices end with the connection */
            return e;
        }
        return 0;
    }
    /* non-streaming: keep it all */
    for (size_t i = 0; g->return_ids && i < ch->n_token_ids; i++)
        strbuf_printf(&c->ids, "%s%d", c->ids.len ? "," : "", ch->token_ids[i]);
    strbuf_add(&c->text, ch->text, strlen(ch->text));
    strbuf_add(&c->reasoning, ch->reasoning_delta, strlen(ch->reasoning_delta));
    strbuf_add(&c->content, ch->content_delta, strlen(ch->content_delta));
    for (size_t k = 0; k < ch->n_tool_calls; k++) {
        const Stepd__V1__ToolCallDelta *t = ch->tool_calls[k];
        struct oai_call *call = NULL;

        for (size_t j = 0; j < c->n_calls; j++)
            if (t->index == j)
                call = &c->calls[j];
        if (!call) {
            struct oai_call *nc = realloc(c->calls, (c->n_calls + 1) * sizeof(*nc));

            if (!nc)
                return -ENOMEM;
            c->calls = nc;
            call = &c->calls[c->n_calls++];
            memset(call, 0, sizeof(*call));
        }
        if (t->id[0]) {
            snprintf(call->id, sizeof(call->id), "%s", t->id);
            free(call->name);
            call->name = strdup(t->name);
        }
        strbuf_adds(&call->args, t->arguments_delta);
    }
    if (ch->n_logprobs) {
        if (g->chat)
            chat_logprobs(&c->logprobs, g->co->tok, ch, c->n_lp == 0);
        else
            lp_parts_add(&c->lpp, g->co->tok, ch, &c->text_off);
        c->n_lp += ch->n_logprobs;
    }
    return 0;
}

static void oai_final(struct req *r, const Stepd__V1__Final *f)
{
    struct oai_choice *c = r->client;
    struct oai_gen *g = c->g;

    c->finish = f->finish_reason;
    if (f->matched_stop_case == STEPD__V1__FINAL__MATCHED_STOP_STOP_STRING)
        c->stop_str = strdup(f->stop_string);
    else if (f->matched_stop_case == STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID) {
        c->has_stop_id = true;
        c->stop_id = f->stop_token_id;
    }
    if (f->usage) {
        c->prompt_tokens = f->usage->prompt_tokens;
        c->completion_tokens = f->usage->completion_tokens;
        c->cached_tokens = f->usage->cached_tokens;
        c->reasoning_tokens = f->usage->reasoning_tokens;
    }
    ext_json(&c->ext, r, f);
    c->r = NULL;
    c->ended = true;
    g->live--;
    if (g->stream && g->hr && !g->failed) {
        struct strbuf b = STRBUF_INIT;

        if (stream_begin(g) == 0) {
            stream_finish_chunk(g, c, &b);
            if (gen_write(g, &b) < 0)
                http_req_abort(g->hr);
        }
        strbuf_done(&b);
    }
    gen_done_check(g);
}

static void oai_end(struct req *r, int status, int retry_ms, const char *msg)
{
    struct oai_choice *c = r->client;
    struct oai_gen *g = c->g;

    (void)retry_ms;
    c->r = NULL;
    c->ended = true;
    g->live--;
    gen_fail(g, status, msg);
    gen_done_check(g);
}

static void oai_watch(struct req *r)
{
    struct oai_choice *c = r->client;

    c->r = r;
}

static const struct req_client_ops oai_ops = {
    .chunk = oai_chunk, .final = oai_final, .end = oai_end, .watch = oai_watch,
};

/* ------------------------------------------------------------------ requests from JSON */

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* A field: absent or null is unset (0); 1 with the value; -EINVAL naming the field. */
static int get_num(const json_t *o, const char *key, double *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_number(j))
        BAD("%s: must be a number (got %s)", key, json_type_describe(j));
    *v = json_number_value(j);
    return 1;
}

static int get_int(const json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_integer(j))
        BAD("%s: must be an integer (got %s)", key, json_type_describe(j));
    *v = json_integer_value(j);
    if (*v < lo || *v > hi)
        BAD("%s: must be in [%" PRId64 ", %" PRId64 "] (got %" PRId64 ")", key, lo, hi, *v);
    return 1;
}

static int get_bool(const json_t *o, const char *key, bool *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_boolean(j))
        BAD("%s: must be true or false (got %s)", key, json_type_describe(j));
    *v = json_is_true(j);
    return 1;
}

static int get_str(const json_t *o, const char *key, const char **v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_string(j))
        BAD("%s: must be a string (got %s)", key, json_type_describe(j));
    *v = json_string_value(j);
    return 1;
}

/* The text of a message's content: a string, or an array of text parts (joined by "\n"). */
static int content_text(const json_t *c, size_t mi, char **ret, char *msg, size_t len)
{
    struct strbuf b = STRBUF_INIT;
    size_t k;
    json_t *part;

    if (json_is_string(c)) {
        *ret = strdup(json_string_value(c));
        return *ret ? 0 : -ENOMEM;
    }
    if (!json_is_array(c))
        BAD("messages[%zu].content: must be a string or an array of content parts (got %s)", mi,
            json_type_describe(c));
    json_array_foreach(c, k, part) {
        const json_t *t = json_object_get(part, "type"), *text = json_object_get(part, "text");
        const char *type = json_is_string(t) ? json_string_value(t) : NULL;

        if (!json_is_object(part) || !type) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu]: must be a content part object with a \"type\"", mi, k);
        }
        if (strcmp(type, "text")) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu].type: \"%.32s\" parts are not supported (this server serves a "
                "text-only model: text parts only)", mi, k, type);
        }
        if (!json_is_string(text)) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu].text: must be a string", mi, k);
        }
        if (b.len)
            strbuf_add(&b, "\n", 1);
        strbuf_adds(&b, json_string_value(text));
    }
    if (b.oom)
        return -ENOMEM;
    *ret = b.p ? strbuf_take(&b) : strdup("");
    return *ret ? 0 : -ENOMEM;
}

/* An OpenAI tool call of the history as the template takes it: arguments parsed. */
static int tool_call_conv(const json_t *tc, size_t mi, size_t k, json_t **ret, char *msg, size_t len)
{
    const json_t *fn = json_object_get(tc, "function");
    const json_t *id = json_object_get(tc, "id"), *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    const json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
    json_t *a;
    json_error_t je;

    if (!json_is_object(tc) || !json_is_object(fn))
        BAD("messages[%zu].tool_calls[%zu]: must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
            "\"arguments\"}}", mi, k);
    if (!json_is_string(name) || !json_string_length(name))
        BAD("messages[%zu].tool_calls[%zu].function.name: must be a non-empty string", mi, k);
    if (id && !json_is_null(id) && !json_is_string(id))
        BAD("messages[%zu].tool_calls[%zu].id: must be a string", mi, k);
    if (!args || json_is_null(args)) {
        a = json_object();
    } else if (json_is_string(args)) {
        a = json_string_length(args) ? json_loads(json_string_value(args), JSON_REJECT_DUPLICATES, &je)
                                     : json_object();
        if (!a)
            BAD("messages[%zu].tool_calls[%zu].function.arguments: not valid JSON (%s)", mi, k, je.text);
    } else {
        a = json_incref((json_t *)args);
    }
    if (!json_is_object(a)) {
        json_decref(a);
        BAD("messages[%zu].tool_calls[%zu].function.arguments: must be a JSON object", mi, k);
    }
    *ret = json_pack("{s:s, s:s, s:{s:O, s:o}}", "id", json_is_string(id) ? json_string_value(id) : "",
                     "type", "function", "function", "name", name, "arguments", a);
    return *ret ? 0 : -ENOMEM;
}

/* OpenAI messages as the request's chat JSON (roles are checked by validate.c). */
static int messages_conv(const json_t *ms, json_t **ret, char *msg, size_t len)
{
    json_t *out, *m;
    size_t i;
    int r = 0;

    if (!ms)
        BAD("messages: required");
    if (!json_is_array(ms))
        BAD("messages: must be an array of messages (got %s)", json_type_describe(ms));
    if (!(out = json_array()))
        return -ENOMEM;
    json_array_foreach(ms, i, m) {
        const json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        const json_t *tcs = json_object_get(m, "tool_calls");
        const char *rk[] = { "reasoning_content", "reasoning", "name", "tool_call_id" };
        json_t *o;

        if (!json_is_object(m)) {
            json_decref(out);
            BAD("messages[%zu]: must be an object (got %s)", i, json_type_describe(m));
        }
        if (!json_is_string(role)) {
            json_decref(out);
            BAD("messages[%zu].role: must be a string", i);
        }
        o = json_object();
        r = o && json_array_append_new(out, o) == 0 ? 0 : -ENOMEM;
        if (!r)
            r = json_object_set_new(o, "role", json_string(!strcmp(json_string_value(role), "developer")
                                                          ? "system" : json_string_value(role)));
        if (!r && content && !json_is_null(content)) {
            char *text = NULL;

            r = content_text(content, i, &text, msg, len);
            if (!r)
                r = json_object_set_new(o, "content", json_string(text)) ? -ENOMEM : 0;
            free(text);
        }
        for (size_t k = 0; !r && k < 4; k++) {
            const json_t *v = json_object_get(m, rk[k]);

            if (!v || json_is_null(v))
                continue;
            if (!json_is_string(v)) {
                snprintf(msg, len, "messages[%zu].%s: must be a string", i, rk[k]);
                r = -EINVAL;
                break;
            }
            r = json_object_set(o, k == 1 ? "reasoning_content" : rk[k], (json_t *)v) ? -ENOMEM : 0;
        }
        if (!r && tcs && !json_is_null(tcs)) {
            json_t *arr = json_array(), *tc;
            size_t k;

            if (!json_is_array(tcs)) {
                json_decref(arr);
                snprintf(msg, len, "messages[%zu].tool_calls: must be an array", i);
                r = -EINVAL;
            } else if (!arr || json_object_set_new(o, "tool_calls", arr)) {
                r = -ENOMEM;
            }
            json_array_foreach(tcs, k, tc) {
                json_t *c = NULL;

                if (r || (r = tool_call_conv(tc, i, k, &c, msg, len)) < 0)
                    break;
                if (json_array_append_new(arr, c)) {
                    r = -ENOMEM;
                    break;
                }
            }
        }
        if (r) {
            json_decref(out);
            if (r == -ENOMEM)
                snprintf(msg, len, "out of memory");
            return r;
        }
    }
    *ret = out;
    return 0;
}

static int stops_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *st = json_object_get(body, "stop"), *v;
    size_t i;

    if (!st || json_is_null(st))
        return 0;
    if (json_is_string(st))
        return request_add_stop(&in->sp, json_string_value(st), json_string_length(st));
    if (!json_is_array(st))
        BAD("stop: must be a string or an array of strings (got %s)", json_type_describe(st));
    if (json_array_size(st) > 1024)
        BAD("stop: at most %u stop strings (got %zu)", 1024u, json_array_size(st));
    json_array_foreach(st, i, v) {
        if (!json_is_string(v))
            BAD("stop[%zu]: must be a string (got %s)", i, json_type_describe(v));
        if (request_add_stop(&in->sp, json_string_value(v), json_string_length(v)) < 0)
            return -ENOMEM;
    }
    return 0;
}

static int ids_conv(const json_t *a, const char *key, int32_t **ret, size_t *n, size_t max, char *msg, size_t len)
{
    const json_t *v;
    size_t i;

    if (!json_is_array(a))
        BAD("%s: must be an array of token ids (got %s)", key, json_type_describe(a));
    if (json_array_size(a) > max)
        BAD("%s: at most %zu ids (got %zu)", key, max, json_array_size(a));
    *ret = malloc((json_array_size(a) ? json_array_size(a) : 1) * sizeof(int32_t));
    if (!*ret)
        return -ENOMEM;
    *n = 0;
    json_array_foreach(a, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            free(*ret);
            *ret = NULL;
            BAD("%s[%zu]: must be a token id (a non-negative integer)", key, i);
        }
        (*ret)[(*n)++] = (int32_t)json_integer_value(v);
    }
    return 0;
}

static int logit_bias_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *lb = json_object_get(body, "logit_bias"), *v;
    const char *key;

    if (!lb || json_is_null(lb))
        return 0;
    if (!json_is_object(lb))
        BAD("logit_bias: must be an object of token id -> bias (got %s)", json_type_describe(lb));
    if (json_object_size(lb) > 1024)
        BAD("logit_bias: at most 1024 entries (got %zu)", json_object_size(lb));
    json_object_foreach((json_t *)lb, key, v) {
        char *end;
        long id = strtol(key, &end, 10);

        if (end == key || *end || id < 0 || id > INT32_MAX)
            BAD("logit_bias: key \"%.32s\" is not a token id", key);
        if (!json_is_number(v))
            BAD("logit_bias[%ld]: must be a number (got %s)", id, json_type_describe(v));
        if (request_add_logit_bias(&in->sp, (int32_t)id, (float)json_number_value(v)) < 0)
            return -ENOMEM;
    }
    return 0;
}

static int tool_choice_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *tc = json_object_get(body, "tool_choice");
    bool have_tools = in->tools && json_array_size(in->tools);

    in->tool_choice = have_tools ? REQUEST_TOOLS_AUTO : REQUEST_TOOLS_NONE;
    if (!tc || json_is_null(tc))
        return 0;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);

        if (!strcmp(s, "none"))
            in->tool_choice = REQUEST_TOOLS_NONE;
        else if (!strcmp(s, "auto"))
            in->tool_choice = have_tools ? REQUEST_TOOLS_AUTO : REQUEST_TOOLS_NONE;
        else if (!strcmp(s, "required"))
            in->tool_choice = REQUEST_TOOLS_REQUIRED;
        else
            BAD("tool_choice: must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                "{\"name\": ...}} (got \"%.32s\")", s);
    } else if (json_is_object(tc)) {
        const json_t *fn = json_object_get(tc, "function");
        const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;

        if (!json_is_string(name))
            BAD("tool_choice.function.name: required (a named tool choice)");
        in->tool_choice = REQUEST_TOOLS_NAMED;
        if (!(in->tool_choice_name = strdup(json_string_value(name))))
            return -ENOMEM;
    } else {
        BAD("tool_choice: must be a string or an object (got %s)", json_type_describe(tc));
    }
    if ((in->tool_choice == REQUEST_TOOLS_REQUIRED || in->tool_choice == REQUEST_TOOLS_NAMED) && !have_tools)
        BAD("tool_choice: \"%s\" needs tools", in->tool_choice == REQUEST_TOOLS_REQUIRED ? "required"
                                                                                         : in->tool_choice_name);
    if (in->tool_choice == REQUEST_TOOLS_NAMED) {
        size_t i;
        const json_t *t;
        bool found = false;

        json_array_foreach(in->tools, i, t) {
            const json_t *f = json_object_get(t, "function");
            const json_t *n = json_is_object(f) ? json_object_get(f, "name") : NULL;

            found |= json_is_string(n) && !strcmp(json_string_value(n), in->tool_choice_name);
        }
        if (!found)
            BAD("tool_choice.function.name: \"%.64s\" is not one of the tools", in->tool_choice_name);
        if (strspn(in->tool_choice_name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.") !=
            strlen(in->tool_choice_name))
            BAD("tool_choice.function.name: not a valid function name");
    }
    return 0;
}

struct oai_opts {
    bool stream, include_usage, continuous_usage, logprobs, return_ids;
    int64_t n;
    const char *model;
};

/* Every field a client may send to /v1/chat/completions or /v1/completions (OpenAI's and
 * vLLM's ChatCompletionRequest / CompletionRequest), and what stepd does with it
 * (docs/OPERATIONS.md §12 has the same table).  A field that would change the output is
 * read by body_conv or refused with a 400 naming it; one that cannot change the output is
 * accepted and left unread; a field of neither list is refused, never ignored. */
enum field_use {
    FU_READ,                /* body_conv reads it (and refuses what it cannot do) */
    FU_INERT,               /* cannot change the output */
    FU_REFUSED,             /* refused with any value but null */
    FU_REFUSED_SET,         /* refused unless null, false or empty ("", [], {}) */
    FU_REFUSED_UNSET,       /* refused unless null or true */
    FU_TEXT_ONLY,           /* refused unless null or ["text"] */
};

#define FD_CHAT 1u
#define FD_COMPLETIONS 2u
#define FD_BOTH 3u

struct field_rule {
    const char *name;
    unsigned doors;
    enum field_use use;
    const char *why;        /* refused: what stepd lacks */
};

#define NO_SO "structural tags are not supported (response_format, structured_outputs and guided_* are)"
static const struct field_rule field_rules[] = {
    /* read */
    { "model", FD_BOTH, FU_READ, NULL },
    { "messages", FD_CHAT, FU_READ, NULL },
    { "prompt", FD_COMPLETIONS, FU_READ, NULL },
    { "request_id", FD_BOTH, FU_READ, NULL },
    { "tools", FD_CHAT, FU_READ, NULL },
    { "tool_choice", FD_CHAT, FU_READ, NULL },
    { "parallel_tool_calls", FD_CHAT, FU_READ, NULL },
    { "chat_template_kwargs", FD_CHAT, FU_READ, NULL },
    { "reasoning_effort", FD_CHAT, FU_READ, NULL },
    { "add_generation_prompt", FD_CHAT, FU_READ, NULL },
    { "logprobs", FD_BOTH, FU_READ, NULL },
    { "top_logprobs", FD_CHAT, FU_READ, NULL },
    { "echo", FD_COMPLETIONS, FU_READ, NULL },
    { "best_of", FD_COMPLETIONS, FU_READ, NULL },
    { "suffix", FD_COMPLETIONS, FU_READ, NULL },
    { "response_format", FD_BOTH, FU_READ, NULL },
    /* structured output (daemon/structured.c) */
    { "structured_outputs", FD_BOTH, FU_READ, NULL },
    { "guided_json", FD_BOTH, FU_READ, NULL },
    { "guided_regex", FD_BOTH, FU_READ, NULL },
    { "guided_choice", FD_BOTH, FU_READ, NULL },
    { "guided_grammar", FD_BOTH, FU_READ, NULL },
    { "guided_decoding_backend", FD_BOTH, FU_READ, NULL },
    { "guided_whitespace_pattern", FD_BOTH, FU_READ, NULL },
    { "temperature", FD_BOTH, FU_READ, NULL },
    { "top_p", FD_BOTH, FU_READ, NULL },
    { "top_k", FD_BOTH, FU_READ, NULL },
    { "min_p", FD_BOTH, FU_READ, NULL },
    { "presence_penalty", FD_BOTH, FU_READ, NULL },
    { "frequency_penalty", FD_BOTH, FU_READ, NULL },
    { "repetition_penalty", FD_BOTH, FU_READ, NULL },
    { "max_tokens", FD_BOTH, FU_READ, NULL },
    { "max_completion_tokens", FD_BOTH, FU_READ, NULL },
    { "min_tokens", FD_BOTH, FU_READ, NULL },
    { "seed", FD_BOTH, FU_READ, NULL },
    { "ignore_eos", FD_BOTH, FU_READ, NULL },
    { "skip_special_tokens", FD_BOTH, FU_READ, NULL },
    { "include_stop_str_in_output", FD_BOTH, FU_READ, NULL },
    { "stop", FD_BOTH, FU_READ, NULL },
    { "stop_token_ids", FD_BOTH, FU_READ, NULL },
    { "logit_bias", FD_BOTH, FU_READ, NULL },
    { "n", FD_BOTH, FU_READ, NULL },
    { "priority", FD_BOTH, FU_READ, NULL },
    { "num_speculative_tokens", FD_BOTH, FU_READ, NULL },
    { "cache_salt", FD_BOTH, FU_READ, NULL },
    { "stream", FD_BOTH, FU_READ, NULL },
    { "stream_options", FD_BOTH, FU_READ, NULL },
    { "return_token_ids", FD_BOTH, FU_READ, NULL },
    { "user", FD_BOTH, FU_READ, NULL },
    /* cannot change the output */
    { "metadata", FD_BOTH, FU_INERT, NULL },
    { "store", FD_BOTH, FU_INERT, NULL },
    { "service_tier", FD_BOTH, FU_INERT, NULL },
    { "session_id", FD_BOTH, FU_INERT, NULL },
    { "prediction", FD_CHAT, FU_INERT, NULL },
    { "stream_interval", FD_BOTH, FU_INERT, NULL },
    { "length_penalty", FD_BOTH, FU_INERT, NULL },
    { "truncation_side", FD_BOTH, FU_INERT, NULL },
    { "mm_processor_kwargs", FD_BOTH, FU_INERT, NULL },
    { "media_io_kwargs", FD_CHAT, FU_INERT, NULL },
    { "return_token_offsets", FD_BOTH, FU_INERT, NULL },
    { "return_mm_kwargs", FD_BOTH, FU_INERT, NULL },
    { "routed_experts_prompt_start", FD_BOTH, FU_INERT, NULL },
    /* would change the output: refused until supported */
    { "structural_tag", FD_BOTH, FU_REFUSED, NO_SO },
    { "prompt_logprobs", FD_BOTH, FU_REFUSED, "prompt logprobs are not supported" },
    { "logprob_token_ids", FD_BOTH, FU_REFUSED, "logprobs of chosen token ids are not supported" },
    { "truncate_prompt_tokens", FD_BOTH, FU_REFUSED, "prompts are never truncated" },
    { "thinking_token_budget", FD_BOTH, FU_REFUSED, "a reasoning budget is not supported" },
    { "repetition_detection", FD_BOTH, FU_REFUSED, "repetition detection is not supported" },
    { "kv_transfer_params", FD_BOTH, FU_REFUSED, "disaggregated KV transfer is not supported" },
    { "ec_transfer_params", FD_BOTH, FU_REFUSED, "disaggregated encoder-cache transfer is not supported" },
    { "chat_template", FD_CHAT, FU_REFUSED, "the model's own chat template is the only one" },
    { "documents", FD_CHAT, FU_REFUSED, "the chat template has no documents" },
    { "prompt_embeds", FD_COMPLETIONS, FU_REFUSED, "prompt embeddings are not supported" },
    { "functions", FD_CHAT, FU_REFUSED, "the legacy function-calling fields are not supported, tools are" },
    { "function_call", FD_CHAT, FU_REFUSED, "the legacy function-calling fields are not supported, tool_choice is" },
    { "audio", FD_CHAT, FU_REFUSED, "audio output is not supported" },
    { "web_search_options", FD_CHAT, FU_REFUSED, "web search is not supported" },
    { "verbosity", FD_CHAT, FU_REFUSED, "verbosity is not supported" },
    { "use_beam_search", FD_BOTH, FU_REFUSED_SET, "beam search is not supported" },
    { "allowed_token_ids", FD_BOTH, FU_REFUSED_SET, "restricting the vocabulary is not supported" },
    { "bad_words", FD_BOTH, FU_REFUSED_SET, "bad words are not supported" },
    { "logits_processors", FD_BOTH, FU_REFUSED_SET, "logits processors are not supported" },
    { "vllm_xargs", FD_BOTH, FU_REFUSED_SET, "vLLM extension arguments are not supported" },
    { "watermarking", FD_BOTH, FU_REFUSED_SET, "watermarking is not supported" },
    { "return_tokens_as_token_ids", FD_BOTH, FU_REFUSED_SET, "logprob tokens are always strings" },
    { "return_prompt_text", FD_BOTH, FU_REFUSED_SET, "the rendered prompt is not returned, POST /tokenize gives it" },
    { "echo", FD_CHAT, FU_REFUSED_SET, "the answer never repeats the last message" },
    { "continue_final_message", FD_CHAT, FU_REFUSED_SET, "continuing the final message is not supported" },
    { "add_special_tokens", FD_CHAT, FU_REFUSED_SET, "the chat template places the special tokens" },
    { "add_special_tokens", FD_COMPLETIONS, FU_REFUSED_UNSET, "a text prompt always starts with BOS" },
    { "include_reasoning", FD_CHAT, FU_REFUSED_UNSET, "the reasoning is always returned, in reasoning_content" },
    { "spaces_between_special_tokens", FD_BOTH, FU_REFUSED_UNSET, "the detokenizer adds no spaces" },
    { "modalities", FD_CHAT, FU_TEXT_ONLY, "text is the only output" },
};
#undef NO_SO

static bool json_is_unset(const json_t *v)
{
    return json_is_null(v) || json_is_false(v) || (json_is_string(v) && !json_string_length(v)) ||
           (json_is_array(v) && !json_array_size(v)) || (json_is_object(v) && !json_object_size(v));
}

/* Every key of body against field_rules: 0, or -EINVAL naming the first one refused. */
static int fields_check(const json_t *body, bool chat, char *msg, size_t len)
{
    unsigned door = chat ? FD_CHAT : FD_COMPLETIONS;
    const char *key;
    json_t *v;

    json_object_foreach((json_t *)body, key, v) {
        const struct field_rule *f = NULL;
        bool other_door = false;

        for (size_t i = 0; i < sizeof(field_rules) / sizeof(field_rules[0]) && !f; i++) {
            if (strcmp(field_rules[i].name, key))
                continue;
            if (field_rules[i].doors & door)
                f = &field_rules[i];
            else
                other_door = true;
        }
        if (!f && other_door)
            BAD("%.64s: not a field of %s", key, chat ? "/v1/chat/completions" : "/v1/completions");
        if (!f)
            BAD("%.64s: not a request field stepd knows (refused rather than ignored; docs/OPERATIONS.md "
                "§12 lists them)", key);
        switch (f->use) {
        case FU_READ:
        case FU_INERT:
            break;
        case FU_REFUSED:
            if (!json_is_null(v))
                BAD("%s: %s", key, f->why);
            break;
        case FU_REFUSED_SET:
            if (!json_is_unset(v))
                BAD("%s: %s (only null, false or empty)", key, f->why);
            break;
        case FU_REFUSED_UNSET:
            if (!json_is_null(v) && !json_is_true(v))
                BAD("%s: only true: %s", key, f->why);
            break;
        case FU_TEXT_ONLY:
            if (!json_is_null(v) && !(json_is_array(v) && json_array_size(v) == 1 &&
                                      json_is_string(json_array_get(v, 0)) &&
                                      !strcmp(json_string_value(json_array_get(v, 0)), "text")))
                BAD("%s: only [\"text\"]: %s", key, f->why);
            break;
        }
    }
    return 0;
}

/* The request's fields (OpenAI's, vLLM's extensions, stepd's num_speculative_tokens) onto in. */
static int body_conv(const struct coord *co, const json_t *body, bool chat, struct request *in,
                     struct oai_opts *x, char *msg, size_t len)
{
    struct request_sampling *sp = &in->sp;
    const json_t *so, *j;
    const char *s = NULL;
    double d;
    int64_t v;
    bool bv;
    int r;

    if (!json_is_object(body))
        BAD("the request body must be a JSON object (got %s)", json_type_describe(body));
    if ((r = fields_check(body, chat, msg, len)) < 0)
        return r;
    if ((r = get_str(body, "model", &x->model, msg, len)) < 0)
        return r;
    if (!x->model)
        BAD("model: required (one of the names of GET /v1/models)");
    free(in->model);
    if (!(in->model = strdup(x->model)))
        return -ENOMEM;
    if ((r = get_str(body, "request_id", &s, msg, len)) < 0)
        return r;
    if (s) {
        if (strlen(s) > 128)
            BAD("request_id: at most 128 printable ASCII characters without spaces");
        snprintf(in->id, sizeof(in->id), "%s", s);
    }
    if (chat) {
        in->input = REQUEST_INPUT_CHAT;
        /* images in (daemon/media.c): each image_url part checked, decoded, preprocessed */
        if ((r = media_chat_images(json_object_get(body, "messages"), co->tok, in, msg, len)) < 0)
            return r;
        if ((r = messages_conv(json_object_get(body, "messages"), &in->messages, msg, len)) < 0)
            return r;
        j = json_object_get(body, "tools");
        if (j && !json_is_null(j)) {
            if (!json_is_array(j))
                BAD("tools: must be an array of tool definitions (got %s)", json_type_describe(j));
            in->tools = json_incref((json_t *)j);
        }
        if ((r = tool_choice_conv(body, in, msg, len)) < 0)
            return r;
        if ((r = get_bool(body, "parallel_tool_calls", &bv, msg, len)) < 0)
            return r;
        if (r)
            in->single_tool_call = !bv;
        if ((in->tool_choice == REQUEST_TOOLS_AUTO || in->tool_choice == REQUEST_TOOLS_REQUIRED ||
             in->tool_choice == REQUEST_TOOLS_NAMED) && !co->o.tool_parser)
            BAD("tool_choice: tool calls need the tool-call parser (stepd runs without it: --tool-call-parser "
                "none)");
        j = json_object_get(body, "chat_template_kwargs");
        if (j && !json_is_null(j))
            in->chat_template_kwargs = json_incref((json_t *)j);
        if ((r = get_str(body, "reasoning_effort", &s, msg, len)) < 0)
            return r;
        if (r && !(in->reasoning_effort = strdup(s)))
            return -ENOMEM;
        if ((r = get_bool(body, "add_generation_prompt", &bv, msg, len)) < 0)
            return r;
        if (r)
            in->add_generation_prompt = bv;
        if ((r = get_bool(body, "logprobs", &x->logprobs, msg, len)) < 0 ||
            (r = get_int(body, "top_logprobs", 0, 20, &v, msg, len)) < 0)
            return r;
        if (r && !x->logprobs)
            BAD("top_logprobs: needs \"logprobs\": true");
        if (x->logprobs)
            REQUEST_SET(sp, RO_LOGPROBS, logprobs, r ? (int32_t)v : 0);
    } else {
        const json_t *p = json_object_get(body, "prompt");

        if (!p || json_is_null(p))
            BAD("prompt: required");
        if (json_is_array(p) && json_array_size(p) == 1 &&
            (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
            p = json_array_get(p, 0);       /* a batch of one */
        if (json_is_string(p)) {
            in->input = REQUEST_INPUT_TEXT;
            if (!(in->text = strdup(json_string_value(p))))
                return -ENOMEM;
            if (strlen(in->text) != json_string_length(p))
                BAD("prompt: must not contain NUL characters");
        } else if (json_is_array(p) && (json_array_size(p) == 0 || json_is_integer(json_array_get(p, 0)))) {
            in->input = REQUEST_INPUT_TOKENS;
            in->text_output = true;
            if ((r = ids_conv(p, "prompt", &in->token_ids, &in->n_token_ids, 1u << 24, msg, len)) < 0)
                return r;
        } else if (json_is_array(p)) {
            BAD("prompt: one prompt per request (a string or an array of token ids; got %zu prompts)",
                json_array_size(p));
        } else {
            BAD("prompt: must be a string or an array of token ids (got %s)", json_type_describe(p));
        }
        if ((r = get_int(body, "logprobs", 0, 20, &v, msg, len)) < 0)
            return r;
        if (r) {
            x->logprobs = true;
            REQUEST_SET(sp, RO_LOGPROBS, logprobs, (int32_t)v);
        }
        if ((r = get_bool(body, "echo", &bv, msg, len)) < 0)
            return r;
        if (r && bv)
            BAD("echo: not supported (the answer never repeats the prompt)");
        if ((r = get_int(body, "best_of", 1, 1, &v, msg, len)) < 0)
            return r;
        if ((j = json_object_get(body, "suffix")) && !json_is_null(j))
            BAD("suffix: not supported");
    }
    if ((r = door_structured_openai(body, in, msg, len)) < 0)
        return r;
    /* sampling */
#define NUM(key, o, f) do { \
        if ((r = get_num(body, key, &d, msg, len)) < 0) \
            return r; \
        if (r) \
            REQUEST_SET(sp, o, f, (float)d); \
    } while (0)
    NUM("temperature", RO_TEMPERATURE, temperature);
    NUM("top_p", RO_TOP_P, top_p);
    NUM("min_p", RO_MIN_P, min_p);
    NUM("presence_penalty", RO_PRESENCE_PENALTY, presence_penalty);
    NUM("frequency_penalty", RO_FREQUENCY_PENALTY, frequency_penalty);
    NUM("repetition_penalty", RO_REPETITION_PENALTY, repetition_penalty);
#undef NUM
    if ((r = get_int(body, "top_k", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_TOP_K, top_k, (int32_t)v);
    if ((r = get_int(body, "max_completion_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r) {
        if (in->names == names_chat)
            in->names = names_chat_mct;
        REQUEST_SET(sp, RO_MAX_TOKENS, max_tokens, v);
    } else if ((r = get_int(body, "max_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0) {
        return r;
    } else if (r) {
        REQUEST_SET(sp, RO_MAX_TOKENS, max_tokens, v);
    }
    if ((r = get_int(body, "min_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_MIN_TOKENS, min_tokens, v);
    if ((r = get_int(body, "seed", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_SEED, seed, v);
    if ((r = get_bool(body, "ignore_eos", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_IGNORE_EOS, ignore_eos, bv);
    if ((r = get_bool(body, "skip_special_tokens", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_SKIP_SPECIAL_TOKENS, skip_special_tokens, bv);
    if ((r = get_bool(body, "include_stop_str_in_output", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_INCLUDE_STOP_STR, include_stop_str, bv);
    if ((r = stops_conv(body, in, msg, len)) < 0 || (r = logit_bias_conv(body, in, msg, len)) < 0)
        return r;
    if ((j = json_object_get(body, "stop_token_ids")) && !json_is_null(j)) {
        int32_t *ids = NULL;
        size_t n = 0;

        if ((r = ids_conv(j, "stop_token_ids", &ids, &n, 1024, msg, len)) < 0)
            return r;
        for (size_t i = 0; i < n && r == 0; i++)
            r = request_add_stop_id(sp, ids[i]);
        free(ids);
        if (r < 0)
            return r;
    }
    x->n = 1;
    if ((r = get_int(body, "n", INT32_MIN, INT32_MAX, &x->n, msg, len)) < 0)
        return r;
    if (x->n < 1 || x->n > co->o.max_n)
        BAD("n: must be in [1, %u] (got %" PRId64 "; the server's --max-n)", co->o.max_n, x->n);
    if ((r = get_int(body, "priority", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        in->priority = (int32_t)v;
    if ((r = get_int(body, "num_speculative_tokens", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r) {
        in->has_num_speculative_tokens = true;
        in->num_speculative_tokens = (int32_t)v;
    }
    if ((r = get_str(body, "cache_salt", &s, msg, len)) < 0)
        return r;
    if (r) {
        free(in->cache_salt);
        if (!(in->cache_salt = strdup(s)))
            return -ENOMEM;
    }
    if ((r = get_str(body, "user", &s, msg, len)) < 0)
        return r;
    if ((r = get_bool(body, "stream", &x->stream, msg, len)) < 0 ||
        (r = get_bool(body, "return_token_ids", &x->return_ids, msg, len)) < 0)
        return r;
    in->include_token_ids = x->return_ids;
    if ((so = json_object_get(body, "stream_options")) && !json_is_null(so)) {
        if (!json_is_object(so))
            BAD("stream_options: must be an object (got %s)", json_type_describe(so));
        if (!x->stream)
            BAD("stream_options: only with \"stream\": true");
        if ((r = get_bool(so, "include_usage", &x->include_usage, msg, len)) < 0 ||
            (r = get_bool(so, "continuous_usage_stats", &x->continuous_usage, msg, len)) < 0)
            return r;
        in->continuous_usage_stats = x->continuous_usage;
    }
    return 0;
}

/* The path ("messages[0].content") of the value the parser was in at byte pos of body, or ""
 * at the top level: a scan that follows only strings, objects and arrays (the body is
 * well-formed up to pos, or the parser would have stopped earlier). */
static void json_path_at(const char *b, size_t pos, char *out, size_t n)
{
    struct { bool arr; size_t idx; char key[48]; } st[12];
    int depth = 0;                  /* open containers */
    bool in_str = false, esc = false, is_key = false, want_key = false;
    size_t kstart = 0, o = 0;

    for (size_t i = 0; i < pos; i++) {
        char ch = b[i];
        int d = depth - 1;

        if (in_str) {
            if (esc) {
                esc = false;
            } else if (ch == '\\') {
                esc = true;
            } else if (ch == '"') {
                in_str = false;
                if (is_key && d >= 0 && d < 12)
                    snprintf(st[d].key, sizeof(st[d].key), "%.*s", (int)(i - kstart), b + kstart);
            }
            continue;
        }
        switch (ch) {
        case '"':
            in_str = true;
            is_key = want_key;
            want_key = false;
            kstart = i + 1;
            break;
        case '{':
        case '[':
            if (depth < 12)
                st[depth] = (typeof(st[0])){ .arr = ch == '[' };
            depth++;
            want_key = ch == '{';
            break;
        case '}':
        case ']':
            depth -= depth > 0;
            break;
        case ',':
            if (d >= 0 && d < 12 && st[d].arr)
                st[d].idx++;
            else
                want_key = true;
            break;
        }
    }
    out[0] = '\0';
    for (int d = 0; d < depth && d < 12 && o < n; d++) {
        if (st[d].arr)
            o += (size_t)snprintf(out + o, n - o, "[%zu]", st[d].idx);
        else if (st[d].key[0])
            o += (size_t)snprintf(out + o, n - o, "%s%s", d ? "." : "", st[d].key);
    }
    if (o >= n || strcspn(out, ": ") != strlen(out))
        out[0] = '\0';             /* too long, or not a name param_of can take */
}

/* A body that is not JSON: where, and, when the bad token is a NaN or an infinity, an integer
 * past 64 bits or an escaped NUL, which field holds it. */
void bad_json(const char *body, size_t blen, const json_error_t *je, char *msg, size_t len)
{
    size_t pos = je->position > 0 && (size_t)je->position <= blen ? (size_t)je->position : 0;
    size_t at = pos;
    char path[160];
    bool big = strstr(je->text, "too big") != NULL, nul = strstr(je->text, "\\u0000") != NULL;

    if (big || nul) {
        json_path_at(body, pos, path, sizeof(path));
        if (path[0]) {
            snprintf(msg, len, "%s: %s", path, big ? "an integer past 64 bits (JSON numbers here are at most "
                     "2^63-1 in magnitude)" : "a NUL character (\\u0000) is not allowed");
            return;
        }
    }

    /* jansson's position is just past the token it could not take: back to its start */
    while (at > 0 && strchr("NaIfinty-", body[at - 1]))
        at--;
    if (!strncmp(body + at, "NaN", 3) || !strncmp(body + at, "Infinity", 8) || !strncmp(body + at, "-Infinity", 9)) {
        /* the key before it: "key" : value */
        size_t e = at;

        while (e > 0 && strchr(" \t\r\n:", body[e - 1]))
            e--;
        if (e > 0 && body[e - 1] == '"') {
            size_t b = e - 1;

            while (b > 0 && body[b - 1] != '"')
                b--;
            if (b > 0 && e - 1 - b < 64) {
                snprintf(msg, len, "%.*s: must be a finite number (JSON has no %.*s)", (int)(e - 1 - b), body + b,
                         body[at] == 'N' ? 3 : body[at] == 'I' ? 8 : 9, body + at);
                return;
            }
        }
    }
    snprintf(msg, len, "the request body is not valid JSON: %s (line %d, column %d)", je->text, je->line,
             je->column);
}

/* ------------------------------------------------------------------ generation endpoints */

bool model_known(const struct coord *co, const char *name)
{
    if (co->o.model_name && !strcmp(name, co->o.model_name))
        return true;
    for (size_t i = 0; i < co->o.n_model_aliases; i++)
        if (!strcmp(name, co->o.model_aliases[i]))
            return true;
    return co->model.known && !strcmp(name, co->model.name);
}

static void h_generate(struct http_req *hr, struct coord *co, bool chat)
{
    struct request *in = request_new(chat ? names_chat : names_completion);
    struct oai_opts x = { 0 };
    struct oai_gen *g = NULL;
    struct req_caller caller = { 0 };
    void **clients = NULL;
    json_error_t je;
    json_t *body = NULL;
    char msg[768] = "";
    size_t blen;
    const char *b = http_req_body(hr, &blen);
    int r = -EINVAL;

    if (!in) {
        http_respond_error(hr, 500, NULL, "out of memory");
        return;
    }
    body = json_loadb(b, blen, JSON_REJECT_DUPLICATES, &je);
    if (!body) {
        bad_json(b, blen, &je, msg, sizeof(msg));
        co->m.rejected_invalid++;
        goto bad;
    }
    r = body_conv(co, body, chat, in, &x, msg, sizeof(msg));
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
    g = calloc(1, sizeof(*g));
    if (g)
        g->ch = calloc((size_t)x.n, sizeof(*g->ch));
    clients = calloc((size_t)x.n, sizeof(*clients));
    if (!g || !g->ch || !clients) {
        snprintf(msg, sizeof(msg), "out of memory");
        if (g)
            free(g->ch);
        free(g);
        g = NULL;
        goto bad;
    }
    g->co = co;
    g->hr = hr;
    g->chat = chat;
    g->stream = x.stream;
    g->include_usage = x.include_usage;
    g->continuous_usage = x.continuous_usage;
    g->logprobs = x.logprobs;
    g->return_ids = x.return_ids;
    g->tools_parsed = chat && co->o.tool_parser && in->tool_choice != REQUEST_TOOLS_NONE;
    g->created = (int64_t)time(NULL);
    g->n = g->live = (uint32_t)x.n;
    snprintf(g->model, sizeof(g->model), "%s", in->model);
    if (!in->id[0])
        req_id_assign(in->id, sizeof(in->id));
    snprintf(g->id, sizeof(g->id), "%s%s", chat ? "chatcmpl-" : "cmpl-", in->id);
    uv_timer_init(&co->loop, &g->timer);
    g->timer.data = g;
    for (uint32_t i = 0; i < g->n; i++) {
        g->ch[i].g = g;
        g->ch[i].index = i;
        clients[i] = &g->ch[i];
    }
    json_decref(body);
    body = NULL;
    http_req_on_close(hr, gen_on_close, g);
    caller.keyed = http_req_keyed(hr, &caller.key_hash);
    snprintf(caller.peer, sizeof(caller.peer), "%s", http_req_peer(hr));
    int64_t deadline = co->o.request_timeout_ms ? rpc_now_ms() + co->o.request_timeout_ms : INT64_MAX;
    g->busy = true;
    req_submit(co, in, &(struct req_origin){ .ops = &oai_ops, .clients = clients, .n = g->n,
                                             .deadline_ms = deadline, .caller = &caller });
    g->busy = false;
    free(clients);
    if (g->live && co->o.request_timeout_ms && !g->cancel_pending) {
        /* from now, not from the loop's cached time: the timer must not fire before the
         * deadline (gen_timer_cb would read it as the client's cancel) */
        uv_update_time(&co->loop);
        uv_timer_start(&g->timer, gen_timer_cb, co->o.request_timeout_ms + 1, 0);
    }
    gen_done_check(g);
    return;
bad:
    json_decref(body);
    free(clients);
    log_req_info(in->id[0] ? in->id : "-", "rejected: %s", msg);
    request_free(in);
    respond_status(hr, r == -ENOMEM ? RPC_INTERNAL : RPC_INVALID_ARGUMENT, 0, msg);
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

/* POST /tokenize (vLLM): {"prompt": text} or {"messages": [...]}, "add_special_tokens",
 * "add_generation_prompt", "return_token_strs" -> {"count", "max_model_len", "tokens",
 * "token_strs"}. */
static void h_tokenize(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    json_t *body = body_object(hr), *out, *ids, *strs = NULL;
    struct tok_ids t = { 0 };
    struct err_buf eb;
    char msg[768] = "";
    bool add_special = true, want_strs = false;
    const char *model = NULL;
    int e;

    if (!body)
        return;
    if (!co->tok) {
        json_decref(body);
        http_respond_error(hr, 503, NULL, "no tokenizer loaded (start stepd with --tokenizer)");
        return;
    }
    if ((e = get_bool(body, "add_special_tokens", &add_special, msg, sizeof(msg))) < 0 ||
        (e = get_bool(body, "return_token_strs", &want_strs, msg, sizeof(msg))) < 0 ||
        (e = get_str(body, "model", &model, msg, sizeof(msg))) < 0)
        goto bad;
    if (model && (co->o.model_name || co->model.known) && !model_known(co, model)) {
        json_decref(body);
        http_respond_error(hr, 404, "model", "model: \"%.64s\" is not served here", model);
        return;
    }
    if (json_object_get(body, "messages")) {
        struct request *in = request_new(names_chat);
        char *text = NULL;
        bool agp = true;
        const char *eff = NULL;

        e = in ? 0 : -ENOMEM;
        if (!e) {
            in->input = REQUEST_INPUT_CHAT;
            e = messages_conv(json_object_get(body, "messages"), &in->messages, msg, sizeof(msg));
        }
        if (!e && (e = get_bool(body, "add_generation_prompt", &agp, msg, sizeof(msg))) >= 0)
            in->add_generation_prompt = agp;
        if (e >= 0 && (e = get_str(body, "reasoning_effort", &eff, msg, sizeof(msg))) > 0)
            in->reasoning_effort = strdup(eff);
        if (e >= 0 && json_is_array(json_object_get(body, "tools")))
            in->tools = json_incref(json_object_get(body, "tools"));
        if (e >= 0 && json_is_object(json_object_get(body, "chat_template_kwargs")))
            in->chat_template_kwargs = json_incref(json_object_get(body, "chat_template_kwargs"));
        if (e >= 0)
            e = request_validate_chat(co, in, msg, sizeof(msg));
        if (e >= 0)
            e = coord_chat_render(co, in, &text, msg, sizeof(msg));
        request_free(in);
        if (e < 0)
            goto bad;
        e = tok_encode(co->tok, text, strlen(text), TOK_ENCODE_SPECIAL, &t, &eb);
        free(text);
    } else {
        const char *p = NULL;

        if ((e = get_str(body, "prompt", &p, msg, sizeof(msg))) < 0)
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
    }
    if (e < 0) {
        snprintf(msg, sizeof(msg), "prompt: %.600s", eb.msg);
        tok_ids_done(&t);
        goto bad;
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

    if (!body)
        return;
    if (!co->tok) {
        json_decref(body);
        http_respond_error(hr, 503, NULL, "no tokenizer loaded (start stepd with --tokenizer)");
        return;
    }
    tj = json_object_get(body, "tokens");
    if (!tj) {
        json_decref(body);
        http_respond_error(hr, 400, "tokens", "tokens: required");
        return;
    }
    e = ids_conv(tj, "tokens", &ids, &n, 1u << 22, msg, sizeof(msg));
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
