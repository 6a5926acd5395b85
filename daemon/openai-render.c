/* openai-render.c - the OpenAI door's answers: a chat or text completion's chunks and
 * finals rendered as OpenAI's JSON (whole, or server-sent events), its logprobs and the
 * "stepd" extension, through the generation's life of reply.c (struct reply_ops); and the
 * door's error answers (an enum rpc_status as an HTTP status and OpenAI's error object).
 * n > 1 is n choices behind one answer.  Loop thread only. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "coord-int.h"
#include "http.h"
#include "json.h"
#include "openai-int.h"
#include "openai.h"
#include "reply.h"
#include "strbuf.h"

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

/* The output of one choice (the rendering's state; reply.h drives its life). */
struct oai_choice {
    uint32_t index;
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
    /* the final */
    enum chunk_finish finish;
    char *stop_str;
    int32_t stop_id;
    bool has_stop_id;
    uint32_t prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens;
    struct strbuf ext;              /* the choice's "stepd" object */
};

/* A chat or text completion's rendering: the reply's ud. */
struct oai_gen {
    struct reply *rp;               /* the generation's life: co, hr, id, model, created, n */
    bool chat, include_usage, continuous_usage, logprobs, return_ids;
    bool tools_parsed;              /* chat through the tool-call parser: content may stay null */
    uint32_t n;
    struct oai_choice *ch;
};

static void lp_parts_done(struct lp_parts *p);

static void oai_free(void *ud)
{
    struct oai_gen *g = ud;

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

/* ------------------------------------------------------------------ rendering */

static const char *finish_name(const struct oai_gen *g, const struct oai_choice *c)
{
    switch (c->finish) {
    case CHUNK_FINISH_STOP:
        return c->calls_started && g->chat ? "tool_calls" : "stop";
    case CHUNK_FINISH_LENGTH:
        return "length";
    case CHUNK_FINISH_ABORT:
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

static void chat_logprobs(struct strbuf *b, const struct tokenizer *tok, const struct chunk *ch, bool first)
{
    for (size_t i = 0; i < ch->n_logprobs; i++) {
        const struct chunk_logprob *lp = &ch->logprobs[i];

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
            token_json(b, tok, lp->top[k].token_id);
            strbuf_adds(b, ",\"logprob\":");
            json_num(b, lp->top[k].logprob);
            strbuf_adds(b, ",\"bytes\":");
            bytes_json(b, tok, lp->top[k].token_id);
            strbuf_adds(b, "}");
        }
        strbuf_adds(b, "]}");
    }
}

static void lp_parts_add(struct lp_parts *p, const struct tokenizer *tok, const struct chunk *ch, size_t *off)
{
    for (size_t i = 0; i < ch->n_logprobs; i++, p->n++) {
        const struct chunk_logprob *lp = &ch->logprobs[i];
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
            token_json(&p->tops, tok, lp->top[k].token_id);
            strbuf_adds(&p->tops, ":");
            json_num(&p->tops, lp->top[k].logprob);
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
static void ext_json(struct strbuf *b, const struct chunk_final *f)
{
    strbuf_adds(b, "{\"request_id\":");
    json_strz(b, f->request_id);
    strbuf_adds(b, ",\"group\":");
    json_strz(b, f->group ? f->group : "");
    strbuf_printf(b, ",\"mtp\":{\"num_drafts\":%u,\"num_draft_tokens\":%u,\"num_accepted_tokens\":%u,"
                  "\"accepted_per_position\":[", f->num_drafts, f->num_draft_tokens, f->num_accepted_tokens);
    for (size_t i = 0; i < f->n_accepted_per_position; i++)
        strbuf_printf(b, "%s%u", i ? "," : "", f->accepted_per_position[i]);
    strbuf_adds(b, "],\"acceptance_length\":");
    if (f->num_drafts)
        json_num(b, 1.0 + (double)f->num_accepted_tokens / f->num_drafts);
    else
        strbuf_adds(b, "null");
    strbuf_printf(b, "},\"timings\":{\"queue_s\":%.6f,\"prefill_s\":%.6f,\"first_token_s\":%.6f,\"decode_s\":%.6f,"
                  "\"mean_inter_token_s\":%.6f,\"e2e_s\":%.6f}}", f->queue_s, f->prefill_s, f->first_token_s,
                  f->decode_s, f->mean_inter_token_s, f->e2e_s);
}

/* The head of a streamed chunk, up to the choices array's opening. */
static void chunk_head(struct strbuf *b, const struct oai_gen *g)
{
    strbuf_adds(b, "data: {\"id\":");
    json_strz(b, g->rp->id);
    strbuf_printf(b, ",\"object\":\"%s\",\"created\":%" PRId64 ",\"model\":",
                  g->chat ? "chat.completion.chunk" : "text_completion", g->rp->created);
    json_strz(b, g->rp->model);
    strbuf_adds(b, ",\"choices\":[");
}

/* Streaming: the first chunk of every choice (the assistant role). */
static void oai_begin(struct reply *rp, struct strbuf *b)
{
    struct oai_gen *g = rp->ud;

    if (!g->chat)
        return;
    for (uint32_t i = 0; i < g->n; i++) {
        chunk_head(b, g);
        /* as OpenAI's: content null until there is some when the reply may be tool calls only */
        strbuf_printf(b, "{\"index\":%u,\"delta\":{\"role\":\"assistant\",\"content\":%s},\"logprobs\":null,"
                      "\"finish_reason\":null}]%s}\n\n", i, g->tools_parsed ? "null" : "\"\"",
                      g->include_usage ? ",\"usage\":null" : "");
    }
}

/* The streamed delta of one engine chunk for choice c (nothing when it carries nothing). */
static void stream_delta(struct oai_gen *g, struct oai_choice *c, const struct chunk *ch, struct strbuf *b)
{
    const struct tokenizer *tok = g->rp->co->tok;
    bool any = ch->n_logprobs || ch->n_tools || (g->return_ids && ch->n_token_ids) ||
               (g->chat ? ch->content[0] || ch->reasoning[0] : ch->text[0] != 0);

    if (!any && !(g->continuous_usage && ch->has_usage))
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
        if (ch->reasoning[0]) {
            strbuf_adds(b, "\"reasoning_content\":");
            json_strz(b, ch->reasoning);
            comma = true;
        }
        if (ch->content[0]) {
            strbuf_adds(b, comma ? ",\"content\":" : "\"content\":");
            json_strz(b, ch->content);
            comma = true;
        }
        if (ch->n_tools) {
            strbuf_adds(b, comma ? ",\"tool_calls\":[" : "\"tool_calls\":[");
            for (size_t k = 0; k < ch->n_tools; k++) {
                const struct chunk_tool *t = &ch->tools[k];

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
                json_strz(b, t->arguments);
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
    if (g->continuous_usage && ch->has_usage)
        strbuf_printf(b, ",\"usage\":{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u}",
                      ch->prompt_tokens, ch->completion_tokens, ch->prompt_tokens + ch->completion_tokens);
    else if (g->include_usage)
        strbuf_adds(b, ",\"usage\":null");
    strbuf_adds(b, "}\n\n");
}

/* Streaming: choice i's last chunk (its finish reason). */
static void oai_final_event(struct reply *rp, uint32_t i, struct strbuf *b)
{
    struct oai_gen *g = rp->ud;
    struct oai_choice *c = &g->ch[i];

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
static void oai_whole(struct reply *rp)
{
    struct oai_gen *g = rp->ud;
    struct strbuf b = STRBUF_INIT;

    strbuf_adds(&b, "{\"id\":");
    json_strz(&b, rp->id);
    strbuf_printf(&b, ",\"object\":\"%s\",\"created\":%" PRId64 ",\"model\":",
                  g->chat ? "chat.completion" : "text_completion", rp->created);
    json_strz(&b, rp->model);
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
        http_respond_error(rp->hr, 500, NULL, "out of memory");
    else
        http_respond(rp->hr, 200, "application/json", b.p, b.len, NULL);
    strbuf_done(&b);
}

/* Streaming, every choice ended: the usage chunk (asked for) and [DONE]. */
static void oai_end(struct reply *rp, struct strbuf *b)
{
    struct oai_gen *g = rp->ud;

    if (g->include_usage) {
        chunk_head(b, g);
        strbuf_adds(b, "],\"usage\":");
        usage_json(b, g);
        strbuf_adds(b, "}\n\n");
    }
    strbuf_adds(b, "data: [DONE]\n\n");
}

/* Streaming, a choice failed after the start: the error as an event, and [DONE]. */
static void oai_fail_event(struct reply *rp, struct strbuf *b)
{
    char *e;
    json_t *o = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", rp->fail_msg, "type",
                          http_status_of(rp->fail_status) >= 500 ? "server_error" : "invalid_request_error",
                          "param", "code", (int)http_status_of(rp->fail_status));

    e = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (e) {
        strbuf_printf(b, "data: %s\n\n", e);
        free(e);
    }
    strbuf_adds(b, "data: [DONE]\n\n");
}

static void oai_error(struct reply *rp, int rpc, const char *msg)
{
    respond_status(rp->hr, rpc, rpc == RPC_RESOURCE_EXHAUSTED ? 100 : 0, msg);
}

/* A chunk of choice i: streaming, its delta onto b; else kept. */
static int oai_chunk(struct reply *rp, uint32_t i, const struct chunk *ch, struct strbuf *b)
{
    struct oai_gen *g = rp->ud;
    struct oai_choice *c = &g->ch[i];

    for (size_t k = 0; k < ch->n_tools; k++)
        c->calls_started += ch->tools[k].id[0] != 0;
    if (rp->stream) {
        stream_delta(g, c, ch, b);
        return 0;
    }
    /* non-streaming: keep it all */
    for (size_t k = 0; g->return_ids && k < ch->n_token_ids; k++)
        strbuf_printf(&c->ids, "%s%d", c->ids.len ? "," : "", ch->token_ids[k]);
    strbuf_add(&c->text, ch->text, strlen(ch->text));
    strbuf_add(&c->reasoning, ch->reasoning, strlen(ch->reasoning));
    strbuf_add(&c->content, ch->content, strlen(ch->content));
    for (size_t k = 0; k < ch->n_tools; k++) {
        const struct chunk_tool *t = &ch->tools[k];
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
        strbuf_adds(&call->args, t->arguments);
    }
    if (ch->n_logprobs) {
        if (g->chat)
            chat_logprobs(&c->logprobs, rp->co->tok, ch, c->n_lp == 0);
        else
            lp_parts_add(&c->lpp, rp->co->tok, ch, &c->text_off);
        c->n_lp += ch->n_logprobs;
    }
    return 0;
}

static void oai_final(struct reply *rp, uint32_t i, const struct chunk_final *f)
{
    struct oai_gen *g = rp->ud;
    struct oai_choice *c = &g->ch[i];

    c->finish = f->finish;
    if (f->stop == CHUNK_STOP_STRING)
        c->stop_str = strdup(f->stop_string);
    else if (f->stop == CHUNK_STOP_TOKEN) {
        c->has_stop_id = true;
        c->stop_id = f->stop_token_id;
    }
    c->prompt_tokens = f->prompt_tokens;
    c->completion_tokens = f->completion_tokens;
    c->cached_tokens = f->cached_tokens;
    c->reasoning_tokens = f->reasoning_tokens;
    ext_json(&c->ext, f);
}

static const struct reply_ops oai_reply_ops = {
    .begin = oai_begin, .chunk = oai_chunk, .final = oai_final, .final_event = oai_final_event, .end = oai_end,
    .fail_event = oai_fail_event, .whole = oai_whole, .error = oai_error, .free_ud = oai_free,
};

/* ------------------------------------------------------------------ the answer */

int openai_reply_start(struct coord *co, struct http_req *hr, struct request *in, const struct oai_opts *x,
                       bool chat)
{
    struct oai_gen *g = calloc(1, sizeof(*g));

    g = calloc(1, sizeof(*g));
    if (g)
        g->ch = calloc((size_t)x->n, sizeof(*g->ch));
    if (g && g->ch)
        g->rp = reply_new(co, hr, (uint32_t)x->n, x->stream, &oai_reply_ops, g);
    if (!g || !g->ch || !g->rp) {
        if (g)
            free(g->ch);
        free(g);
        return -ENOMEM;
    }
    g->chat = chat;
    g->include_usage = x->include_usage;
    g->continuous_usage = x->continuous_usage;
    g->logprobs = x->logprobs;
    g->return_ids = x->return_ids;
    g->tools_parsed = chat && co->o.tool_parser && in->tool_choice != REQUEST_TOOLS_NONE;
    g->n = (uint32_t)x->n;
    for (uint32_t i = 0; i < g->n; i++)
        g->ch[i].index = i;
    reply_start(g->rp, in, chat ? "chatcmpl-" : "cmpl-");
    return 0;
}
