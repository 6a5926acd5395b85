/* req.c - the life of one Generate request in the coordinator: validation,
 * tokenization, admission, routing to a group's engine, streaming back (with the
 * text pipeline), cancellation (exactly one Abort to the engine), failover. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord-int.h"
#include "err.h"
#include "log.h"
#include "pb-util.h"

#define ENGINE_GENERATE "/stepd.v1.Engine/Generate"
#define ENGINE_ABORT "/stepd.v1.Engine/Abort"
#define ENGINE_SUBMIT "/stepd.v1.Engine/Submit"
#define ENGINE_OPEN_OUTPUTS "/stepd.v1.Engine/OpenOutputs"
#define OUT_RETRY_MS 1000       /* after an output stream ends, Generate calls for this long */

/* ------------------------------------------------------------------ validation */

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

static bool id_valid(const char *s)
{
    size_t n = strlen(s);
    if (n > 128)
        return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x21 || s[i] > 0x7e)
            return false;
    return true;
}

static bool blank(const char *s)
{
    for (; *s; s++)
        if (!isspace((unsigned char)*s))
            return false;
    return true;
}

static int validate_sampling(const struct coord *co, const Stepd__V1__SamplingParams *sp, bool text_input,
                             uint32_t vocab, char *msg, size_t len)
{
    const struct coord_opts *o = &co->o;

    if (!sp)
        return 0;
    if (PB_HAS(sp, temperature) && !(isfinite(sp->temperature) && sp->temperature >= 0.0f))
        BAD("sampling_params.temperature: must be finite and >= 0 (got %g)", (double)sp->temperature);
    if (PB_HAS(sp, temperature) && sp->temperature > 100.0f)
        BAD("sampling_params.temperature: must be <= 100 (got %g)", (double)sp->temperature);
    if (PB_HAS(sp, top_p) && !(sp->top_p > 0.0f && sp->top_p <= 1.0f))
        BAD("sampling_params.top_p: must be in (0, 1] (got %g)", (double)sp->top_p);
    if (PB_HAS(sp, top_k) && sp->top_k < 0)
        BAD("sampling_params.top_k: must be >= 0, 0 = disabled (got %d)", sp->top_k);
    if (PB_HAS(sp, top_k) && vocab && (uint32_t)sp->top_k > vocab)
        BAD("sampling_params.top_k: must be <= vocabulary size %u (got %d)", vocab, sp->top_k);
    if (PB_HAS(sp, min_p) && !(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        BAD("sampling_params.min_p: must be in [0, 1] (got %g)", (double)sp->min_p);
    if (PB_HAS(sp, repetition_penalty) &&
        !(isfinite(sp->repetition_penalty) && sp->repetition_penalty > 0.0f && sp->repetition_penalty <= 10.0f))
        BAD("sampling_params.repetition_penalty: must be in (0, 10] (got %g)", (double)sp->repetition_penalty);
    if (PB_HAS(sp, presence_penalty) && !(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        BAD("sampling_params.presence_penalty: must be in [-2, 2] (got %g)", (double)sp->presence_penalty);
    if (PB_HAS(sp, frequency_penalty) && !(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        BAD("sampling_params.frequency_penalty: must be in [-2, 2] (got %g)", (double)sp->frequency_penalty);
    if (PB_HAS(sp, max_tokens) && sp->max_tokens < 1)
        BAD("sampling_params.max_tokens: must be >= 1 (got %" PRId64 ")", sp->max_tokens);
    if (PB_HAS(sp, max_tokens) && sp->max_tokens > (int64_t)o->max_tokens_cap)
        BAD("sampling_params.max_tokens: must be <= %u (got %" PRId64 ")", o->max_tokens_cap, sp->max_tokens);
    if (PB_HAS(sp, min_tokens) && sp->min_tokens < 0)
        BAD("sampling_params.min_tokens: must be >= 0 (got %" PRId64 ")", sp->min_tokens);
    if (PB_HAS(sp, min_tokens)) {
        int64_t mx = PB_HAS(sp, max_tokens) ? sp->max_tokens : (int64_t)o->default_max_tokens;
        if (sp->min_tokens > mx)
            BAD("sampling_params.min_tokens: must be <= max_tokens %" PRId64 " (got %" PRId64 ")", mx,
                sp->min_tokens);
    }
    if (PB_HAS(sp, seed) && sp->seed < 0)
        BAD("sampling_params.seed: must be in [0, 2^63) (got %" PRId64 ")", sp->seed);
    if (PB_HAS(sp, logprobs) && (sp->logprobs < 0 || (unsigned)sp->logprobs > o->max_logprobs))
        BAD("sampling_params.logprobs: must be in [0, %u] (got %d)", o->max_logprobs, sp->logprobs);
    if (PB_HAS(sp, n) && sp->n != 1)
        BAD("sampling_params.n: only 1 is served (got %d)", sp->n);
    if (sp->n_stop > o->max_stop)
        BAD("sampling_params.stop: at most %u stop strings (got %zu)", o->max_stop, sp->n_stop);
    for (size_t i = 0; i < sp->n_stop; i++) {
        size_t sl = strlen(sp->stop[i]);
        if (sl == 0)
            BAD("sampling_params.stop[%zu]: empty stop string", i);
        if (sl > o->max_stop_len)
            BAD("sampling_params.stop[%zu]: longer than %u bytes (%zu)", i, o->max_stop_len, sl);
    }
    if (sp->n_stop && !text_input)
        BAD("sampling_params.stop: stop strings need text or chat input (use stop_token_ids with token input)");
    if (sp->n_stop_token_ids > o->max_stop_token_ids)
        BAD("sampling_params.stop_token_ids: at most %u ids (got %zu)", o->max_stop_token_ids,
            sp->n_stop_token_ids);
    for (size_t i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] < 0 || (vocab && (uint32_t)sp->stop_token_ids[i] >= vocab))
            BAD("sampling_params.stop_token_ids[%zu]: %d is outside the vocabulary [0, %u)", i,
                sp->stop_token_ids[i], vocab);
    if (sp->n_logit_bias > o->max_logit_bias)
        BAD("sampling_params.logit_bias: at most %u entries (got %zu)", o->max_logit_bias, sp->n_logit_bias);
    for (size_t i = 0; i < sp->n_logit_bias; i++) {
        const Stepd__V1__SamplingParams__LogitBiasEntry *e = sp->logit_bias[i];
        if (e->key < 0 || (vocab && (uint32_t)e->key >= vocab))
            BAD("sampling_params.logit_bias: key %d is outside the vocabulary [0, %u)", e->key, vocab);
        if (!(e->value >= -100.0f && e->value <= 100.0f))
            BAD("sampling_params.logit_bias[%d]: must be in [-100, 100] (got %g)", e->key, (double)e->value);
    }
    return 0;
}

static bool json_kind_ok(const char *s, char open)
{
    while (isspace((unsigned char)*s))
        s++;
    return *s == open;
}

static int validate_chat(const struct coord *co, const Stepd__V1__ChatInput *c, char *msg, size_t len)
{
    size_t total = 0;

    if (c->n_messages == 0)
        BAD("chat.messages: at least one message is required");
    if (c->n_messages > 4096)
        BAD("chat.messages: at most 4096 messages (got %zu)", c->n_messages);
    for (size_t i = 0; i < c->n_messages; i++) {
        const Stepd__V1__ChatMessage *m = c->messages[i];
        if (strcmp(m->role, "system") && strcmp(m->role, "user") && strcmp(m->role, "assistant") &&
            strcmp(m->role, "tool"))
            BAD("chat.messages[%zu].role: must be system, user, assistant or tool (got \"%.32s\")", i, m->role);
        if (strcmp(m->role, "assistant") && m->n_tool_calls)
            BAD("chat.messages[%zu].tool_calls: only assistant messages carry tool calls", i);
        for (size_t k = 0; k < m->n_tool_calls; k++)
            if (m->tool_calls[k]->arguments_json[0] && !json_kind_ok(m->tool_calls[k]->arguments_json, '{'))
                BAD("chat.messages[%zu].tool_calls[%zu].arguments_json: must be a JSON object", i, k);
        total += strlen(m->content) + strlen(m->reasoning_content);
    }
    if (total > co->o.max_prompt_bytes)
        BAD("chat.messages: %zu bytes of content, more than the %u byte cap", total, co->o.max_prompt_bytes);
    if (c->tools_json[0] && !json_kind_ok(c->tools_json, '['))
        BAD("chat.tools_json: must be a JSON array of tool definitions");
    if (c->chat_template_kwargs_json[0] && !json_kind_ok(c->chat_template_kwargs_json, '{'))
        BAD("chat.chat_template_kwargs_json: must be a JSON object");
    if (PB_HAS(c, reasoning_effort) && strcmp(c->reasoning_effort, "low") &&
        strcmp(c->reasoning_effort, "medium") && strcmp(c->reasoning_effort, "high"))
        BAD("chat.reasoning_effort: must be low, medium or high (got \"%.32s\")", c->reasoning_effort);
    return 0;
}

int req_validate(const struct coord *co, const Stepd__V1__GenerateRequest *in, char *msg, size_t len)
{
    uint32_t vocab = coord_vocab_size(co);
    uint32_t ctx = coord_max_model_len(co);
    bool text_input = false;

    if (!id_valid(in->request_id))
        BAD("request_id: at most 128 printable ASCII characters without spaces");
    if (in->model[0] && co->model.known && strcmp(in->model, co->model.name) != 0 &&
        !(co->o.model_name && strcmp(in->model, co->o.model_name) == 0))
        BAD("model: \"%.64s\" is not served here (serving \"%s\")", in->model,
            co->o.model_name ? co->o.model_name : co->model.name);
    switch (in->input_case) {
    case STEPD__V1__GENERATE_REQUEST__INPUT_TEXT:
        text_input = true;
        if (blank(in->text))
            BAD("text: prompt is empty");
        if (strlen(in->text) > co->o.max_prompt_bytes)
            BAD("text: %zu bytes, more than the %u byte cap", strlen(in->text), co->o.max_prompt_bytes);
        break;
    case STEPD__V1__GENERATE_REQUEST__INPUT_CHAT:
        text_input = true;
        if (validate_chat(co, in->chat, msg, len) < 0)
            return -EINVAL;
        break;
    case STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS: {
        const Stepd__V1__TokenIds *t = in->token_ids;
        if (t->n_ids == 0)
            BAD("token_ids.ids: prompt is empty");
        uint32_t max_in = co->o.max_input_tokens ? co->o.max_input_tokens : ctx > 1 ? ctx - 1 : 0;
        if (max_in && t->n_ids > max_in)
            BAD("token_ids.ids: %zu tokens, more than max_input_tokens %u", t->n_ids, max_in);
        for (size_t i = 0; i < t->n_ids; i++)
            if (t->ids[i] < 0 || (vocab && (uint32_t)t->ids[i] >= vocab))
                BAD("token_ids.ids[%zu]: %d is outside the vocabulary [0, %u)", i, t->ids[i], vocab);
        break;
    }
    default:
        BAD("input: one of text, chat or token_ids is required");
    }
    if (validate_sampling(co, in->sampling_params, text_input, vocab, msg, len) < 0)
        return -EINVAL;
    if (PB_HAS(in, num_speculative_tokens) && (in->num_speculative_tokens < 0 || in->num_speculative_tokens > 3))
        BAD("num_speculative_tokens: must be in [0, 3] (got %d)", in->num_speculative_tokens);
    if (in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS && ctx) {
        const Stepd__V1__SamplingParams *sp = in->sampling_params;
        int64_t mt = sp && PB_HAS(sp, max_tokens) ? sp->max_tokens : 1;
        if ((int64_t)in->token_ids->n_ids + mt > (int64_t)ctx)
            BAD("sampling_params.max_tokens: prompt (%zu tokens) + max_tokens (%" PRId64
                ") exceeds the context length %u", in->token_ids->n_ids, mt, ctx);
    }
    return 0;
}
#undef BAD

/* ------------------------------------------------------------------ lifetime */

static void req_finishv(struct req *r, int status, const char *fmt, va_list ap)
{
    char msg[768] = "";

    if (!r->call)
        return;
    if (fmt)
        vsnprintf(msg, sizeof(msg), fmt, ap);
    struct rpc_call *c = r->call;
    r->call = NULL;
    rpc_call_on_cancel(c, NULL, NULL);
    rpc_call_finish(c, status, "%s", msg);
    if (status >= 0 && status < 17)
        r->co->m.status[status]++;
    if (status == RPC_OK)
        log_req_info(r->id, "done: %u tokens in %.1f ms (group %s)", r->n_out,
                     (double)(rpc_now_ms() - r->t_arrival), r->grp_name);
    else
        log_req_info(r->id, "ended %s: %s", rpc_status_name(status), msg);
}

static void req_finish(struct req *r, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void req_finish(struct req *r, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    req_finishv(r, status, fmt, ap);
    va_end(ap);
}

static void req_maybe_free(struct req *r)
{
    struct coord *co = r->co;

    if (r->call || !r->engine_done || r->ecall || r->bi.running || r->bi.queued)
        return;
    if (r->prev)
        r->prev->next = r->next;
    else
        co->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    co->n_reqs--;
#ifdef STEPD_HAVE_TOK
    if (r->text_mode) {
        tok_stream_done(&r->ts);
        if (r->has_stop)
            tok_stop_done(&r->stop);
    }
    tok_parser_free(r->parser);
    json_decref(r->tools);
#endif
    free(r->prompt);
    free(r);
    coord_check_drained(co);
}

static void group_unlink(struct req *r)
{
    struct group *g = r->grp;
    if (!g)
        return;
    if (r->gprev)
        r->gprev->gnext = r->gnext;
    else
        g->reqs = r->gnext;
    if (r->gnext)
        r->gnext->gprev = r->gprev;
    r->gprev = r->gnext = NULL;
    g->in_flight--;
    r->grp = NULL;
}

static void abort_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct engine_conn *e = ud;
    if (status != RPC_OK)
        log_debug("engine %s: Abort failed: %s %s", e->addr, rpc_status_name(status), details);
    engine_conn_unref(e);
}

/* Exactly one Abort per request, and only while the engine may still hold it. */
static void req_send_abort(struct req *r)
{
    Stepd__V1__AbortRequest ar = STEPD__V1__ABORT_REQUEST__INIT;
    char *ids[1] = { r->id };

    if (r->abort_sent || r->engine_done || !r->eng)
        return;
    if (r->submit_eng) {
        /* Submit still in flight: an Abort could overtake it and find nothing */
        r->abort_pending = true;
        return;
    }
    r->abort_sent = true;
    ar.n_request_ids = 1;
    ar.request_ids = ids;
    r->eng->refs++;
    if (rpc_client_start(r->eng->ch, ENGINE_ABORT, &ar.base, &stepd__v1__abort_response__descriptor,
                         rpc_now_ms() + 2000, NULL, abort_done, r->eng, NULL) < 0) {
        r->eng->refs--;
        return;
    }
    r->co->m.aborts_sent++;
    if (r->grp)
        r->grp->aborts_sent++;
}

/* Stop the engine side early (client gone, stop string, slow client). */
static void req_stop_engine(struct req *r)
{
    req_send_abort(r);
    if (r->ecall && !r->submit_eng)     /* a Generate call (a Submit is left to finish) */
        rpc_client_cancel(r->ecall);
}

/* ------------------------------------------------------------------ engine stream */

static int send_chunk(struct req *r, Stepd__V1__Chunk *ch)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = r->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = ch;
    int e = rpc_call_send(r->call, &resp.base);
    if (e == -ENOBUFS) {
        /* A6: a client that stopped reading; queued messages would never let a normal
         * status through, so the stream is reset with the status */
        char msg[160];
        struct rpc_call *c = r->call;
        snprintf(msg, sizeof(msg), "client is not reading its stream (%zu bytes buffered, cap reached)",
                 rpc_call_queued_bytes(c));
        req_stop_engine(r);
        r->call = NULL;
        rpc_call_on_cancel(c, NULL, NULL);
        rpc_call_abort(c, RPC_RESOURCE_EXHAUSTED, msg);
        r->co->m.status[RPC_RESOURCE_EXHAUSTED]++;
        log_req_info(r->id, "ended RESOURCE_EXHAUSTED: %s", msg);
        return e;
    }
    return e;
}

static void send_final(struct req *r, const Stepd__V1__Final *ef, int finish_reason, const char *stop_str)
{
    struct coord *co = r->co;
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Final f = STEPD__V1__FINAL__INIT;
    Stepd__V1__Usage u = STEPD__V1__USAGE__INIT;
    Stepd__V1__Timings t = STEPD__V1__TIMINGS__INIT;
    Stepd__V1__MtpStats mtp = STEPD__V1__MTP_STATS__INIT;
    int64_t now = rpc_now_ms();

    if (ef && ef->usage)
        u = *ef->usage;
    u.prompt_tokens = (uint32_t)r->n_prompt;
    u.completion_tokens = r->n_out;
    if (ef && ef->timings)
        t = *ef->timings;
    t.queue_s = (double)(r->t_dispatch - r->t_arrival) / 1000.0 + t.queue_s;
    t.first_token_s = r->t_first ? (double)(r->t_first - r->t_arrival) / 1000.0 : 0.0;
    t.decode_s = r->t_first ? (double)(r->t_last - r->t_first) / 1000.0 : 0.0;
    t.mean_inter_token_s = r->n_out > 1 && r->t_first ? t.decode_s / (r->n_out - 1) : 0.0;
    t.e2e_s = (double)(now - r->t_arrival) / 1000.0;
    if (ef && ef->mtp)
        mtp = *ef->mtp;
    f.finish_reason = finish_reason;
    f.message = ef ? ef->message : "";
    f.usage = &u;
    f.timings = &t;
    f.mtp = &mtp;
    f.group = r->grp_name;
    f.request_id = r->id;
    if (stop_str) {
        f.matched_stop_case = STEPD__V1__FINAL__MATCHED_STOP_STOP_STRING;
        f.stop_string = (char *)stop_str;
    } else if (ef && ef->matched_stop_case == STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID) {
        f.matched_stop_case = ef->matched_stop_case;
        f.stop_token_id = ef->stop_token_id;
    }
    resp.request_id = r->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
    resp.final = &f;

    /* metrics */
    if (finish_reason >= 0 && finish_reason < 5)
        co->m.finished[finish_reason]++;
    co->m.prompt_tokens += r->n_prompt;
    co->m.generation_tokens += r->n_out;
    metrics_observe(&co->m.e2e, t.e2e_s);
    metrics_observe(&co->m.prompt_len, (double)r->n_prompt);
    metrics_observe(&co->m.gen_len, (double)r->n_out);
    co->m.spec_drafts += mtp.num_drafts;
    co->m.spec_draft_tokens += mtp.num_draft_tokens;
    co->m.spec_accepted += mtp.num_accepted_tokens;
    for (size_t i = 0; i < mtp.n_accepted_per_position && i < METRICS_MAX_POS; i++)
        co->m.spec_accepted_pos[i] += mtp.accepted_per_position[i];

    r->final_sent = true;
    (void)rpc_call_send(r->call, &resp.base);
    req_finish(r, RPC_OK, NULL);
}

#ifdef STEPD_HAVE_TOK
/* Run ids through detokenizer and stop strings; returns 1 when a stop string matched. */
static bool is_stop_id(const struct req *r, int32_t id)
{
    const struct model_info *mi = &r->co->model;
    const Stepd__V1__SamplingParams *sp = r->in->sampling_params;
    for (size_t i = 0; i < mi->n_eos; i++)
        if (mi->eos[i] == id)
            return true;
    for (size_t i = 0; sp && i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == id)
            return true;
    return false;
}

static int text_push(struct req *r, const int32_t *ids, size_t n, char **buf, size_t *blen, size_t *bcap)
{
    for (size_t i = 0; i < n; i++) {
        const char *d, *o;
        size_t dl, ol;
        if (is_stop_id(r, ids[i]))
            continue;   /* EOS / stop ids end the text; they are not part of it */
        if (tok_stream_push(&r->ts, ids[i], &d, &dl) < 0)
            continue;
        if (r->has_stop) {
            int m = tok_stop_feed(&r->stop, d, dl, &o, &ol);
            if (m < 0)
                return m;
            d = o;
            dl = ol;
        }
        if (*blen + dl + 1 > *bcap) {
            size_t nc = (*blen + dl + 1) * 2;
            char *nb = realloc(*buf, nc);
            if (!nb)
                return -ENOMEM;
            *buf = nb;
            *bcap = nc;
        }
        memcpy(*buf + *blen, d, dl);
        *blen += dl;
        (*buf)[*blen] = '\0';
        if (r->has_stop && r->stop.finish == TOK_FINISH_STOP)
            return 1;
    }
    return 0;
}

static int text_flush(struct req *r, char **buf, size_t *blen, size_t *bcap)
{
    const char *d, *o;
    size_t dl, ol;
    char *tmp = NULL;
    size_t tl = 0;

    if (tok_stream_finish(&r->ts, &d, &dl) < 0)
        dl = 0;
    if (dl) {
        tmp = malloc(dl + 1);
        if (!tmp)
            return -ENOMEM;
        memcpy(tmp, d, dl);
        tl = dl;
    }
    if (r->has_stop) {
        if (tl && r->stop.finish != TOK_FINISH_STOP) {
            if (tok_stop_feed(&r->stop, tmp, tl, &o, &ol) < 0)
                ol = 0;
            free(tmp);
            tmp = NULL;
            tl = 0;
            if (ol) {
                tmp = malloc(ol + 1);
                if (!tmp)
                    return -ENOMEM;
                memcpy(tmp, o, ol);
                tl = ol;
            }
        }
        if (r->stop.finish != TOK_FINISH_STOP && tok_stop_finish(&r->stop, &o, &ol) == 0 && ol) {
            char *n = realloc(tmp, tl + ol + 1);
            if (!n) {
                free(tmp);
                return -ENOMEM;
            }
            tmp = n;
            memcpy(tmp + tl, o, ol);
            tl += ol;
        }
    }
    if (tl) {
        char *nb = realloc(*buf, *blen + tl + 1);
        if (!nb) {
            free(tmp);
            return -ENOMEM;
        }
        *buf = nb;
        *bcap = *blen + tl + 1;
        memcpy(*buf + *blen, tmp, tl);
        *blen += tl;
        (*buf)[*blen] = '\0';
    }
    free(tmp);
    return 0;
}
#endif

#ifdef STEPD_HAVE_TOK
struct sb {
    char *p;
    size_t len;
};

static int sb_add(struct sb *b, const char *s, size_t n)
{
    char *np = realloc(b->p, b->len + n + 1);
    if (!np)
        return -ENOMEM;
    b->p = np;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

#define MAX_TC_DELTAS 16

struct parse_acc {
    struct req *r;
    struct sb reasoning, content;
    Stepd__V1__ToolCallDelta tc[MAX_TC_DELTAS];
    Stepd__V1__ToolCallDelta *ptc[MAX_TC_DELTAS];
    struct sb args[MAX_TC_DELTAS];
    char ids[MAX_TC_DELTAS][48];
    char *names[MAX_TC_DELTAS];
    size_t n_tc;
};

static int parse_ev(void *ud, const struct tok_ev *ev)
{
    struct parse_acc *a = ud;
    switch (ev->kind) {
    case TOK_EV_REASONING:
        return sb_add(&a->reasoning, ev->text, ev->len);
    case TOK_EV_CONTENT:
        return sb_add(&a->content, ev->text, ev->len);
    case TOK_EV_TOOL_START:
    case TOK_EV_TOOL_ARGS: {
        Stepd__V1__ToolCallDelta *t = a->n_tc ? &a->tc[a->n_tc - 1] : NULL;
        if (ev->kind == TOK_EV_TOOL_START || !t || t->index != (uint32_t)ev->tool_index) {
            if (a->n_tc == MAX_TC_DELTAS)
                return -ENOSPC;
            t = &a->tc[a->n_tc];
            stepd__v1__tool_call_delta__init(t);
            t->index = (uint32_t)ev->tool_index;
            t->id = "";
            t->name = "";
            t->arguments_delta = "";
            a->ptc[a->n_tc] = t;
            a->n_tc++;
        }
        size_t k = (size_t)(t - a->tc);
        if (ev->kind == TOK_EV_TOOL_START) {
            snprintf(a->ids[k], sizeof(a->ids[k]), "call-%d", ev->tool_index);
            t->id = a->ids[k];
            a->names[k] = strndup(ev->text, ev->len);
            if (!a->names[k])
                return -ENOMEM;
            t->name = a->names[k];
        } else {
            if (sb_add(&a->args[k], ev->text, ev->len) < 0)
                return -ENOMEM;
            t->arguments_delta = a->args[k].p;
        }
        return 0;
    }
    case TOK_EV_TOOL_END:
        return 0;
    }
    return 0;
}

static void parse_acc_done(struct parse_acc *a)
{
    free(a->reasoning.p);
    free(a->content.p);
    for (size_t i = 0; i < MAX_TC_DELTAS; i++) {
        free(a->args[i].p);
        free(a->names[i]);
    }
}

/* Fill the parsed fields of ch from text (chat input) or copy it as content. */
static int chunk_parse(struct req *r, struct parse_acc *a, Stepd__V1__Chunk *ch, const char *text, size_t len,
                       bool finish)
{
    if (!r->parser) {
        ch->content_delta = (char *)text;
        return 0;
    }
    int e = 0;
    if (len)
        e = tok_parser_feed(r->parser, text, len, parse_ev, a);
    if (e >= 0 && finish)
        e = tok_parser_finish(r->parser, parse_ev, a);
    if (e < 0)
        return e;
    ch->reasoning_delta = a->reasoning.p ? a->reasoning.p : "";
    ch->content_delta = a->content.p ? a->content.p : "";
    ch->n_tool_calls = a->n_tc;
    ch->tool_calls = a->ptc;
    return 0;
}
#endif

/* One output of the engine for r (from its Generate call or the output stream). */
static void req_engine_resp(struct req *r, const Stepd__V1__GenerateResponse *er)
{
    struct coord *co = r->co;
    int64_t now = rpc_now_ms();

    if (!r->call || r->final_sent)
        return;
    if (er->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
        const Stepd__V1__Chunk *ec = er->chunk;
        Stepd__V1__Chunk ch = STEPD__V1__CHUNK__INIT;
        Stepd__V1__Usage u = STEPD__V1__USAGE__INIT;
        /* the model's own vocabulary (lm_head may be padded past the tokenizer's) */
        uint32_t vocab = co->model.known ? co->model.vocab_size : 0;
        size_t n = ec->n_token_ids;

        for (size_t i = 0; i < n; i++) {
            if (ec->token_ids[i] < 0 || (vocab && (uint32_t)ec->token_ids[i] >= vocab)) {
                /* RELIABILITY C11: never trust the engine's token ids */
                log_req_error(r->id, "engine of group %s sent token id %d outside [0, %u)", r->grp_name,
                              ec->token_ids[i], vocab);
                req_stop_engine(r);
                req_finish(r, RPC_INTERNAL, "worker group '%s' sent an invalid token id", r->grp_name);
                return;
            }
        }
        if (n) {
            if (!r->t_first) {
                r->t_first = now;
                metrics_observe(&co->m.ttft, (double)(now - r->t_arrival) / 1000.0);
                metrics_observe(&co->m.queue, (double)(r->t_dispatch - r->t_arrival) / 1000.0);
            } else {
                double gap = (double)(now - r->t_last) / 1000.0;
                metrics_observe(&co->m.itl, gap);
            }
            r->t_last = now;
            r->n_out += (uint32_t)n;
        }
        if (r->want_ids || !r->text_mode) {
            ch.n_token_ids = n;
            ch.token_ids = ec->token_ids;
        }
        ch.n_logprobs = ec->n_logprobs;
        ch.logprobs = ec->logprobs;
        if (r->continuous_usage) {
            u.prompt_tokens = (uint32_t)r->n_prompt;
            u.completion_tokens = r->n_out;
            ch.usage = &u;
        }
#ifdef STEPD_HAVE_TOK
        char *buf = NULL;
        size_t blen = 0, bcap = 0;
        int stopped = 0;
        if (r->text_mode) {
            stopped = text_push(r, ec->token_ids, n, &buf, &blen, &bcap);
            if (stopped < 0) {
                free(buf);
                req_stop_engine(r);
                req_finish(r, RPC_INTERNAL, "out of memory in the text pipeline");
                return;
            }
            ch.text = buf ? buf : "";
        }
        struct parse_acc acc = { .r = r };
        if (r->text_mode && chunk_parse(r, &acc, &ch, ch.text, blen, false) < 0) {
            parse_acc_done(&acc);
            free(buf);
            req_stop_engine(r);
            req_finish(r, RPC_INTERNAL, "reasoning/tool-call parser failed");
            return;
        }
        int e = send_chunk(r, &ch);
        parse_acc_done(&acc);
        free(buf);
        if (e == 0 && stopped == 1) {
            const char *s = r->in->sampling_params->stop[r->stop.matched];
            log_req_debug(r->id, "stop string %d matched", r->stop.matched);
            req_stop_engine(r);
            send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_STOP, s);
        }
#else
        (void)send_chunk(r, &ch);
#endif
        return;
    }
    if (er->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL) {
#ifdef STEPD_HAVE_TOK
        if (r->text_mode) {
            char *buf = NULL;
            size_t blen = 0, bcap = 0;
            if (text_flush(r, &buf, &blen, &bcap) == 0 && (blen || r->parser)) {
                Stepd__V1__Chunk ch = STEPD__V1__CHUNK__INIT;
                struct parse_acc acc = { .r = r };
                ch.text = buf ? buf : "";
                int pe = chunk_parse(r, &acc, &ch, ch.text, blen, true);
                int se = 0;
                if (pe == 0 && (blen || ch.n_tool_calls || (ch.reasoning_delta && ch.reasoning_delta[0]) ||
                                (ch.content_delta && ch.content_delta[0])))
                    se = send_chunk(r, &ch);
                parse_acc_done(&acc);
                if (se < 0) {
                    free(buf);
                    return;
                }
            }
            free(buf);
        }
#endif
        send_final(r, er->final, er->final->finish_reason, NULL);
    }
}

static void on_engine_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    req_engine_resp(ud, (const Stepd__V1__GenerateResponse *)msg);
}

/* The engine is done with r (its Generate call ended, or its end came on the output
 * stream): status OK means a Final was sent before. */
static void req_engine_end(struct req *r, int status, const char *details)
{
    struct coord *co = r->co;
    struct group *g = r->grp;

    r->engine_done = true;
    if (g) {
        if (status == RPC_OK && r->final_sent)
            g->completed++;
        else
            g->failed++;
        group_unlink(r);
    }
    if (r->call) {
        if (status == RPC_OK) {
            req_finish(r, RPC_INTERNAL, "worker group '%s' ended the stream without a final message",
                       r->grp_name);
        } else if (status == RPC_DEADLINE_EXCEEDED) {
            req_finish(r, RPC_DEADLINE_EXCEEDED, "deadline exceeded while generating");
        } else if (status == RPC_INVALID_ARGUMENT || status == RPC_RESOURCE_EXHAUSTED ||
                   status == RPC_OUT_OF_RANGE || status == RPC_ALREADY_EXISTS) {
            req_finish(r, status, "worker group '%s': %s", r->grp_name, details);
        } else if (status == RPC_UNAVAILABLE || status == RPC_CANCELLED || status == RPC_ABORTED) {
            req_finish(r, RPC_UNAVAILABLE, "worker group '%s' is unavailable: %s", r->grp_name, details);
        } else {
            req_finish(r, RPC_INTERNAL, "worker group '%s' failed the request: %s: %s", r->grp_name,
                       rpc_status_name(status), details);
        }
    }
    engine_conn_unref(r->eng);
    r->eng = NULL;
    if (r->bi.running)
        coord_slot_release(co, r);
    req_maybe_free(r);
}

static void on_engine_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct req *r = ud;
    r->ecall = NULL;
    req_engine_end(r, status, details);
}

/* ------------------------------------------------------------------ engine output stream */

static size_t out_hash(const char *id)
{
    uint64_t h = coord_fnv1a(id, strlen(id), COORD_FNV_SEED);
    return (size_t)(h ^ (h >> 32));
}

static struct req *out_find(const struct engine_conn *e, const char *id)
{
    if (!e->out_cap)
        return NULL;
    for (struct req *r = e->out_tab[out_hash(id) & (e->out_cap - 1)]; r; r = r->onext)
        if (strcmp(r->id, id) == 0)
            return r;
    return NULL;
}

static int out_insert(struct engine_conn *e, struct req *r)
{
    if (e->out_n >= e->out_cap) {
        size_t ncap = e->out_cap ? e->out_cap * 2 : 256;
        struct req **nt = calloc(ncap, sizeof(*nt));
        if (!nt)
            return -ENOMEM;
        for (size_t i = 0; i < e->out_cap; i++) {
            struct req *q = e->out_tab[i];
            while (q) {
                struct req *next = q->onext;
                size_t b = out_hash(q->id) & (ncap - 1);
                q->onext = nt[b];
                nt[b] = q;
                q = next;
            }
        }
        free(e->out_tab);
        e->out_tab = nt;
        e->out_cap = ncap;
    }
    size_t b = out_hash(r->id) & (e->out_cap - 1);
    r->onext = e->out_tab[b];
    e->out_tab[b] = r;
    r->in_out_tab = true;
    e->out_n++;
    return 0;
}

static void out_remove(struct engine_conn *e, struct req *r)
{
    if (!r->in_out_tab)
        return;
    for (struct req **pp = &e->out_tab[out_hash(r->id) & (e->out_cap - 1)]; *pp; pp = &(*pp)->onext) {
        if (*pp == r) {
            *pp = r->onext;
            break;
        }
    }
    r->onext = NULL;
    r->in_out_tab = false;
    e->out_n--;
}

static void on_out_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    struct engine_conn *e = ud;
    const Stepd__V1__OutputBatch *b = (const void *)msg;

    if (e->out_state == OUT_OPENING) {
        e->out_state = OUT_READY;
        log_info("engine %s: output stream %s open", e->addr, e->out_id);
    }
    /* one engine step's tokens for many client streams: started together */
    rpc_ctx_cork(e->co->rpc);
    for (size_t i = 0; i < b->n_outputs; i++) {
        const Stepd__V1__EngineOutput *o = b->outputs[i];
        struct req *r = out_find(e, o->request_id);
        if (!r) {
            log_debug("engine %s: output for request %s, which is not on its stream", e->addr,
                      o->request_id);
            continue;
        }
        Stepd__V1__GenerateResponse er = STEPD__V1__GENERATE_RESPONSE__INIT;
        er.request_id = o->request_id;
        switch (o->kind_case) {
        case STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK:
            er.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
            er.chunk = o->chunk;
            req_engine_resp(r, &er);
            break;
        case STEPD__V1__ENGINE_OUTPUT__KIND_FINAL:
            er.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
            er.final = o->final;
            req_engine_resp(r, &er);
            out_remove(e, r);
            req_engine_end(r, RPC_OK, "");
            break;
        case STEPD__V1__ENGINE_OUTPUT__KIND_STATUS:
            out_remove(e, r);
            req_engine_end(r, o->status->code > 0 && o->status->code < 17 ? o->status->code : RPC_UNKNOWN,
                           o->status->message);
            break;
        default:
            out_remove(e, r);
            req_engine_end(r, RPC_INTERNAL, "an output stream entry with neither chunk, final nor status");
            break;
        }
    }
    rpc_ctx_uncork(e->co->rpc);
}

static void on_out_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct engine_conn *e = ud;
    enum out_state was = e->out_state;
    char why[400];

    e->out_call = NULL;
    if (status == RPC_UNIMPLEMENTED) {
        e->out_state = OUT_UNSUPPORTED;
        log_info("engine %s has no output streams: one Generate call per request", e->addr);
    } else {
        e->out_state = OUT_CLOSED;
        e->out_retry_ms = rpc_now_ms() + OUT_RETRY_MS;
        if (e->attached && was == OUT_READY)
            log_warn("engine %s: output stream ended: %s: %s", e->addr, rpc_status_name(status), details);
    }
    snprintf(why, sizeof(why), "output stream ended: %s: %.300s", rpc_status_name(status), details);
    for (size_t i = 0; e->out_n && i < e->out_cap; i++) {
        while (e->out_tab[i]) {
            struct req *r = e->out_tab[i];
            out_remove(e, r);
            req_engine_end(r, RPC_UNAVAILABLE, why);
        }
    }
    engine_conn_unref(e);
}

void engine_out_open(struct engine_conn *e)
{
    static uint64_t seq;
    Stepd__V1__OpenOutputsRequest rq = STEPD__V1__OPEN_OUTPUTS_REQUEST__INIT;

    if (!e || !e->attached || e->out_state != OUT_CLOSED || rpc_now_ms() < e->out_retry_ms)
        return;
    snprintf(e->out_id, sizeof(e->out_id), "stepd-%ld-%" PRIu64 "-%" PRIx64, (long)getpid(), ++seq,
             (uint64_t)rpc_now_us());
    rq.stream_id = e->out_id;
    e->refs++;
    if (rpc_client_start(e->ch, ENGINE_OPEN_OUTPUTS, &rq.base, &stepd__v1__output_batch__descriptor, INT64_MAX,
                         on_out_msg, on_out_done, e, &e->out_call) < 0) {
        e->refs--;
        e->out_retry_ms = rpc_now_ms() + OUT_RETRY_MS;
        return;
    }
    e->out_state = OUT_OPENING;
}

static void on_submit_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct req *r = ud;
    struct engine_conn *e = r->submit_eng;

    r->ecall = NULL;
    r->submit_eng = NULL;
    if (status != RPC_OK && r->in_out_tab) {
        /* not admitted: its end will not come on the stream */
        out_remove(e, r);
        if (status == RPC_FAILED_PRECONDITION) {
            /* the engine does not know our stream (it restarted?): open a new one */
            if (e->out_call)
                rpc_client_cancel(e->out_call);
            req_engine_end(r, RPC_UNAVAILABLE, details);
        } else {
            req_engine_end(r, status, details);
        }
    } else if (status == RPC_OK && r->abort_pending && !r->engine_done) {
        req_send_abort(r);
    }
    engine_conn_unref(e);
    req_maybe_free(r);
}

/* 0: dispatched; <0: failed (client finished, slot still held by the caller). */
static int req_dispatch_one(struct req *r)
{
    struct coord *co = r->co;
    const Stepd__V1__GenerateRequest *in = r->in;
    Stepd__V1__GenerateRequest er = STEPD__V1__GENERATE_REQUEST__INIT;
    Stepd__V1__TokenIds ti = STEPD__V1__TOKEN_IDS__INIT;
    Stepd__V1__SamplingParams sp = STEPD__V1__SAMPLING_PARAMS__INIT;
    struct group *g;

    if (!r->call)
        return -ECANCELED;
    const Stepd__V1__SamplingParams *isp = in->sampling_params;
    int64_t need = (int64_t)r->n_prompt + (isp && PB_HAS(isp, max_tokens) ? isp->max_tokens : 1);
    g = wpool_pick(co, r->prompt, r->n_prompt, need > UINT32_MAX ? UINT32_MAX : (uint32_t)need);
    if (!g) {
        co->m.rejected_unavailable++;
        if (wpool_ready_count(co))
            req_finish(r, RPC_UNAVAILABLE, "no ready worker group has a context of %" PRId64
                       " tokens (prompt + max_tokens)", need);
        else
            req_finish(r, RPC_UNAVAILABLE, "no worker group is ready");
        return -EAGAIN;
    }
    if (in->sampling_params)
        sp = *in->sampling_params;
    sp.n_stop = 0;          /* stop strings are applied here, on text */
    sp.stop = NULL;
    if (!PB_HAS(&sp, max_tokens)) {
        int64_t mt = co->o.default_max_tokens;
        uint32_t ctx = coord_max_model_len(co);
        if (ctx && (int64_t)r->n_prompt + mt > ctx)
            mt = (int64_t)ctx - (int64_t)r->n_prompt;
        PB_SET(&sp, max_tokens, mt < 1 ? 1 : mt);
    }
    ti.n_ids = r->n_prompt;
    ti.ids = r->prompt;
    er.request_id = r->id;
    er.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    er.token_ids = &ti;
    er.sampling_params = &sp;
    er.priority = in->priority;
    if (PB_HAS(in, num_speculative_tokens))
        PB_SET(&er, num_speculative_tokens, in->num_speculative_tokens);
    er.cache_salt = in->cache_salt;     /* the engine validates it */
    struct engine_conn *ec = g->eng;
    engine_out_open(ec);
    if (ec->out_state == OUT_READY && out_find(ec, r->id)) {
        req_finish(r, RPC_ALREADY_EXISTS, "request_id: '%s' is still ending on worker group '%s'", r->id,
                   g->name);
        return -EEXIST;
    }
    r->t_dispatch = rpc_now_ms();
    r->grp = g;
    snprintf(r->grp_name, sizeof(r->grp_name), "%s", g->name);
    r->eng = ec;
    r->eng->refs++;
    r->engine_done = false;
    int e;
    if (ec->out_state == OUT_READY && (e = out_insert(ec, r)) == 0) {
        Stepd__V1__SubmitRequest sr = STEPD__V1__SUBMIT_REQUEST__INIT;
        sr.stream_id = ec->out_id;
        sr.request = &er;
        r->submit_eng = ec;
        ec->refs++;
        e = rpc_client_start(ec->ch, ENGINE_SUBMIT, &sr.base, &stepd__v1__submit_response__descriptor,
                             r->deadline_ms, NULL, on_submit_done, r, &r->ecall);
        if (e < 0) {
            out_remove(ec, r);
            r->submit_eng = NULL;
            ec->refs--;
        }
    } else {
        e = rpc_client_start(ec->ch, ENGINE_GENERATE, &er.base, &stepd__v1__generate_response__descriptor,
                             r->deadline_ms, on_engine_msg, on_engine_done, r, &r->ecall);
    }
    if (e < 0) {
        r->engine_done = true;
        r->grp = NULL;
        engine_conn_unref(r->eng);
        r->eng = NULL;
        req_finish(r, RPC_UNAVAILABLE, "worker group '%s': cannot start a call: %s", g->name, err_str(e));
        return e;
    }
    r->gnext = g->reqs;
    r->gprev = NULL;
    if (g->reqs)
        g->reqs->gprev = r;
    g->reqs = r;
    g->in_flight++;
    g->routed++;
    log_req_debug(r->id, "routed to group %s (%zu prompt tokens)", g->name, r->n_prompt);
    return 0;
}

int req_dispatch_promoted(struct req *r)
{
    return req_dispatch_one(r);
}

void req_free_if_done(struct req *r)
{
    req_maybe_free(r);
}

/* ------------------------------------------------------------------ client side */

static void on_client_cancel(struct rpc_call *call, void *ud)
{
    struct req *r = ud;
    struct coord *co = r->co;
    bool expired = rpc_now_ms() >= r->deadline_ms;

    r->cancelled = true;
    if (r->bi.queued) {
        batch_remove(&co->batch, &r->bi);
        req_finish(r, expired ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                   expired ? "deadline exceeded while queued" : "cancelled by the client");
        req_maybe_free(r);
        return;
    }
    req_stop_engine(r);
    req_finish(r, expired ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
               expired ? "deadline exceeded" : "cancelled by the client");
    req_maybe_free(r);
}

static int req_build_prompt(struct req *r, char *msg, size_t len)
{
    struct coord *co = r->co;
    const Stepd__V1__GenerateRequest *in = r->in;

    if (in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS) {
        r->n_prompt = in->token_ids->n_ids;
        r->prompt = malloc(r->n_prompt * sizeof(int32_t));
        if (!r->prompt)
            return -ENOMEM;
        memcpy(r->prompt, in->token_ids->ids, r->n_prompt * sizeof(int32_t));
        return 0;
    }
#ifdef STEPD_HAVE_TOK
    if (!co->tok) {
        snprintf(msg, len, "%s: text input needs a tokenizer (start stepd with --tokenizer)",
                 in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TEXT ? "text" : "chat");
        return -ENOTSUP;
    }
    struct tok_ids ids = { 0 };
    struct err_buf eb;
    int e;
    if (in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TEXT) {
        e = tok_encode(co->tok, in->text, strlen(in->text), TOK_ENCODE_ADD_SPECIAL, &ids, &eb);
    } else {
        char *text = NULL;
        e = coord_chat_render(co, in->chat, &text, msg, len);
        if (e < 0) {
            tok_ids_done(&ids);
            return e;
        }
        e = tok_encode(co->tok, text, strlen(text), TOK_ENCODE_SPECIAL, &ids, &eb);
        free(text);
    }
    if (e < 0) {
        tok_ids_done(&ids);
        snprintf(msg, len, "%s: %.600s", in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TEXT ? "text" : "chat",
                 eb.msg);
        return -EINVAL;
    }
    r->prompt = ids.ids;
    r->n_prompt = ids.n;
    return 0;
#else
    (void)co;
    snprintf(msg, len, "input: text and chat input need the tokenizer, which this build lacks");
    return -ENOTSUP;
#endif
}

/* ------------------------------------------------------------------ admission on the CQ thread */

#define GATE_MARK_TRANSIT 1

bool req_generate_cq(struct rpc_call *call, void *ud)
{
    struct coord *co = ud;
    unsigned running, queued, transit, cap;
    char msg[160];

    /* draining or a deadline too short: the loop gives those their own answers */
    if (atomic_load_explicit(&co->gate.closed, memory_order_acquire))
        return false;
    if (rpc_cq_deadline_ms(call) - rpc_now_ms() < 2)
        return false;
    batch_published(&co->batch, &running, &queued);
    transit = atomic_load_explicit(&co->gate.in_transit, memory_order_acquire);
    cap = co->batch.max_running + co->batch.max_queue;      /* constant after start */
    if (running + queued + transit < cap) {
        atomic_fetch_add_explicit(&co->gate.in_transit, 1, memory_order_acq_rel);
        rpc_cq_set_mark(call, GATE_MARK_TRANSIT);
        return false;
    }
    /* full: the same answer the loop gives (req_generate_loop), without waiting for it */
    atomic_fetch_add_explicit(&co->gate.rejected_full, 1, memory_order_relaxed);
    if (transit)
        snprintf(msg, sizeof(msg), "server overloaded: %u running, %u queued and %u arriving (caps %u + %u)",
                 running, queued, transit, co->batch.max_running, co->batch.max_queue);
    else
        snprintf(msg, sizeof(msg), "server overloaded: %u running and %u queued (the caps)", running, queued);
    rpc_cq_reply(call, NULL, RPC_RESOURCE_EXHAUSTED, msg, "grpc-retry-pushback-ms", "100");
    return true;
}

void req_generate_unmark(int mark, void *ud)
{
    struct coord *co = ud;
    if (mark == GATE_MARK_TRANSIT)
        atomic_fetch_sub_explicit(&co->gate.in_transit, 1, memory_order_acq_rel);
}

static void req_generate_loop(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    const Stepd__V1__GenerateRequest *in = (const void *)msg;
    char err[768];
    struct req *r;
    int e;

    if (co->draining) {
        co->m.rejected_draining++;
        co->m.status[RPC_UNAVAILABLE]++;
        rpc_call_finish(call, RPC_UNAVAILABLE, "server is draining; retry on another replica");
        return;
    }
    /* nothing useful fits in under 2 ms: answer now instead of touching an engine */
    if (rpc_call_deadline_ms(call) - rpc_now_ms() < 2) {
        co->m.status[RPC_DEADLINE_EXCEEDED]++;
        rpc_call_finish(call, RPC_DEADLINE_EXCEEDED, "deadline expired (or under 2 ms) on arrival");
        return;
    }
    /* full: answer before any validation or tokenization work (A2: fast, cheap rejections) */
    if (co->batch.queued >= co->batch.max_queue &&
        (co->batch.running >= co->batch.max_running || co->batch.queued > 0)) {
        co->m.rejected_full++;
        co->m.status[RPC_RESOURCE_EXHAUSTED]++;
        rpc_call_add_trailer(call, "grpc-retry-pushback-ms", "100");
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "server overloaded: %u running and %u queued (the caps)",
                        co->batch.running, co->batch.queued);
        return;
    }
    if (req_validate(co, in, err, sizeof(err)) < 0) {
        co->m.rejected_invalid++;
        co->m.status[RPC_INVALID_ARGUMENT]++;
        log_req_info(in->request_id[0] ? in->request_id : "-", "rejected: %s", err);
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "%s", err);
        return;
    }
    if (wpool_ready_count(co) == 0) {
        co->m.rejected_unavailable++;
        co->m.status[RPC_UNAVAILABLE]++;
        rpc_call_finish(call, RPC_UNAVAILABLE, "no worker group is ready");
        return;
    }
    if (in->request_id[0]) {
        for (struct req *o = co->reqs; o; o = o->next)
            if (o->call && strcmp(o->id, in->request_id) == 0) {
                co->m.status[RPC_ALREADY_EXISTS]++;
                rpc_call_finish(call, RPC_ALREADY_EXISTS, "request_id: '%s' is already in flight",
                                in->request_id);
                return;
            }
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        co->m.status[RPC_RESOURCE_EXHAUSTED]++;
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    r->co = co;
    r->call = call;
    r->in = in;
    r->engine_done = true;      /* nothing dispatched yet */
    r->t_arrival = rpc_now_ms();
    r->deadline_ms = rpc_call_deadline_ms(call);
    if (in->request_id[0])
        snprintf(r->id, sizeof(r->id), "%s", in->request_id);
    else
        snprintf(r->id, sizeof(r->id), "stepd-%" PRIx64 "-%" PRIu64, (uint64_t)co->start_ms, ++co->next_req_id);
    r->text_mode = in->input_case != STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    r->want_ids = in->stream_options && in->stream_options->include_token_ids;
    r->continuous_usage = in->stream_options && in->stream_options->continuous_usage_stats;
    r->next = co->reqs;
    if (co->reqs)
        co->reqs->prev = r;
    co->reqs = r;
    co->n_reqs++;

    err[0] = '\0';
    e = req_build_prompt(r, err, sizeof(err));
    if (e < 0) {
        co->m.rejected_invalid++;
        r->text_mode = false;   /* nothing to tear down */
        req_finish(r, e == -ENOTSUP ? RPC_FAILED_PRECONDITION : e == -ENOMEM ? RPC_RESOURCE_EXHAUSTED
                                                                            : RPC_INVALID_ARGUMENT,
                   "%s", err[0] ? err : err_str(e));
        req_maybe_free(r);
        return;
    }
    if (r->text_mode) {
        uint32_t ctx = coord_max_model_len(co);
        const Stepd__V1__SamplingParams *sp = in->sampling_params;
        int64_t mt = sp && PB_HAS(sp, max_tokens) ? sp->max_tokens : 1;
        const char *field = in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TEXT ? "text" : "chat";
        if (r->n_prompt == 0)
            snprintf(err, sizeof(err), "%s: prompt is empty after tokenization", field);
        else if (co->o.max_input_tokens ? r->n_prompt > co->o.max_input_tokens : (ctx > 1 && r->n_prompt > ctx - 1))
            snprintf(err, sizeof(err), "%s: %zu prompt tokens, more than max_input_tokens %u", field,
                     r->n_prompt, co->o.max_input_tokens ? co->o.max_input_tokens : ctx - 1);
        else if (ctx && (int64_t)r->n_prompt + mt > (int64_t)ctx)
            snprintf(err, sizeof(err),
                     "sampling_params.max_tokens: prompt (%zu tokens) + max_tokens (%" PRId64
                     ") exceeds the context length %u", r->n_prompt, mt, ctx);
        if (err[0]) {
            co->m.rejected_invalid++;
            r->text_mode = false;
            req_finish(r, RPC_INVALID_ARGUMENT, "%s", err);
            req_maybe_free(r);
            return;
        }
#ifdef STEPD_HAVE_TOK
        /* chat output keeps special tokens: the parser needs <think>, </think>, <tool_call> */
        bool skip = in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_CHAT
                        ? false
                        : !(sp && PB_HAS(sp, skip_special_tokens)) || sp->skip_special_tokens;
        tok_stream_init(&r->ts, co->tok, skip);
        if (sp && sp->n_stop) {
            bool incl = PB_HAS(sp, include_stop_str_in_output) && sp->include_stop_str_in_output;
            if (tok_stop_init(&r->stop, (const char *const *)sp->stop, sp->n_stop, incl) == 0)
                r->has_stop = true;
        }
        if (in->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_CHAT) {
            struct tok_parser_opts po = { .reasoning = true, .tools = true };
            if (in->chat->tools_json[0])
                r->tools = json_loads(in->chat->tools_json, 0, NULL);
            po.tools_json = r->tools;
            if (tok_parser_new(&po, &r->parser) < 0) {
                req_finish(r, RPC_RESOURCE_EXHAUSTED, "out of memory");
                req_maybe_free(r);
                return;
            }
        }
#endif
    }

    r->bi.priority = in->priority;
    switch (batch_admit(&co->batch, &r->bi)) {
    case BATCH_RUN:
        co->m.accepted++;
        rpc_call_on_cancel(call, on_client_cancel, r);
        if (req_dispatch_one(r) < 0) {
            coord_slot_release(co, r);
            req_maybe_free(r);
        }
        return;
    case BATCH_QUEUED:
        co->m.accepted++;
        rpc_call_on_cancel(call, on_client_cancel, r);
        log_req_debug(r->id, "queued (%u waiting)", co->batch.queued);
        return;
    case BATCH_FULL:
        co->m.rejected_full++;
        rpc_call_add_trailer(call, "grpc-retry-pushback-ms", "100");
        req_finish(r, RPC_RESOURCE_EXHAUSTED, "server overloaded: %u running and %u queued (the caps)",
                   co->batch.running, co->batch.queued);
        req_maybe_free(r);
        return;
    }
}

void req_generate(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    /* The call stops counting as arriving before the loop decides on it: meanwhile the
     * CQ thread may undercount by one and pass a call too many, which the batcher then
     * refuses exactly; counting it twice (arriving and running) could instead refuse a
     * call on the CQ thread while a slot is still free. */
    req_generate_unmark(rpc_call_cq_mark(call), ud);
    req_generate_loop(call, msg, ud);
}

/* ------------------------------------------------------------------ bulk */

void req_fail_group(struct group *g, const char *why)
{
    struct req *r = g->reqs;

    while (r) {
        struct req *n = r->gnext;
        group_unlink(r);
        g->failed++;
        req_finish(r, RPC_UNAVAILABLE, "worker group '%s' is down: %s", g->name, why);
        if (r->ecall)
            rpc_client_cancel(r->ecall);   /* the engine is gone: no Abort */
        r = n;
    }
}

int req_abort_by_id(struct coord *co, const char *id)
{
    for (struct req *r = co->reqs; r; r = r->next) {
        if (!r->call || strcmp(r->id, id) != 0)
            continue;
        if (r->bi.queued) {
            batch_remove(&co->batch, &r->bi);
            send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT, NULL);
            req_maybe_free(r);
            return 1;
        }
        req_stop_engine(r);
        send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT, NULL);
        return 1;
    }
    return 0;
}

void req_sweep_deadlines(struct coord *co)
{
    int64_t now = rpc_now_ms();
    struct req *r = co->reqs;
    while (r) {
        struct req *n = r->next;
        if (r->in_out_tab && !r->ecall && r->deadline_ms != INT64_MAX && now > r->deadline_ms + 1000) {
            struct engine_conn *e = r->eng;
            log_req_warn(r->id, "engine %s did not end the request %" PRId64 " ms after its deadline",
                         e->addr, now - r->deadline_ms);
            req_send_abort(r);
            out_remove(e, r);
            req_engine_end(r, RPC_DEADLINE_EXCEEDED, "the engine did not end the request by its deadline");
        }
        r = n;
    }
}

void req_fail_all(struct coord *co, int status, const char *why)
{
    struct req *r = co->reqs;
    while (r) {
        struct req *n = r->next;
        if (r->bi.queued) {
            batch_remove(&co->batch, &r->bi);
            req_finish(r, status, "%s", why);
            req_maybe_free(r);
        } else if (r->call) {
            req_stop_engine(r);
            req_finish(r, status, "%s", why);
        }
        r = n;
    }
}
