/* req.c - the life of one generation request in the coordinator: admission, routing to a
 * group's engine, streaming back through the text pipeline, cancellation (exactly one
 * Abort to the engine), failover.  The request arrives built (request.h) from one of the
 * front doors, the gRPC Inference.Generate call (grpc-door.c) or the HTTP API (openai-routes.c,
 * door.c), and is validated once (validate.c); its client side is the door's (struct
 * req_client_ops): everything between the door and the engine is the same for all.
 * Loop thread only. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord-int.h"
#include "err.h"
#include "log.h"
#include "media.h"
#include "pb-util.h"
#include "strbuf.h"

#define ENGINE_GENERATE "/stepd.v1.Engine/Generate"
#define ENGINE_ABORT "/stepd.v1.Engine/Abort"
#define ENGINE_SUBMIT "/stepd.v1.Engine/Submit"
/* prefix-affine routing keys at most this many leading blocks of a prompt */
#define REQ_AFFINITY_MAX_BLOCKS 4096

/* ------------------------------------------------------------------ lifetime */

/* The client side of r ended with status (metrics, the log). */
static void req_ended(struct req *r, int status, const char *msg, bool quiet)
{
    if (status >= 0 && status < 17)
        r->co->m.status[status]++;
    if (status == RPC_OK)
        log_req_info(r->id, "done: %u tokens in %.1f ms (group %s)", r->n_out,
                     (double)(rpc_now_ms() - r->t_arrival), r->grp_name);
    else if (quiet)
        log_req_debug(r->id, "refused %s: %s", rpc_status_name(status), msg);
    else
        log_req_info(r->id, "ended %s: %s", rpc_status_name(status), msg);
}

static void req_finishv(struct req *r, int status, int retry_ms, bool quiet, const char *fmt, va_list ap)
{
    char msg[768] = "";

    if (!r->client)
        return;
    if (fmt)
        vsnprintf(msg, sizeof(msg), fmt, ap);
    r->cops->end(r, status, retry_ms, msg);
    r->client = NULL;
    req_ended(r, status, msg, quiet);
}

static void req_finish(struct req *r, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void req_finish(struct req *r, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    req_finishv(r, status, 0, false, fmt, ap);
    va_end(ap);
}

/* queue full: the client may retry after retry_ms */
static void req_finish_retry(struct req *r, int status, int retry_ms, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void req_finish_retry(struct req *r, int status, int retry_ms, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    req_finishv(r, status, retry_ms, false, fmt, ap);
    va_end(ap);
}

void req_client_detach(struct req *r, int status, const char *msg)
{
    if (!r->client)
        return;
    r->client = NULL;
    req_ended(r, status, msg, false);
}

/* The held list (coord->held): requests with an admission slot that no group has room for
 * yet, in priority order, FIFO among equals. */
static bool req_held(const struct req *r)
{
    return r->hold.queued;
}

static struct req *held_head(const struct coord *co)
{
    return co->held.head ? (struct req *)((char *)co->held.head - offsetof(struct req, hold)) : NULL;
}

static void held_insert(struct req *r)
{
    r->hold.priority = r->in->priority;
    admit_list_insert(&r->co->held, &r->hold);
}

void req_free_if_done(struct req *r)
{
    struct coord *co = r->co;

    if (r->client || !r->engine_done || r->ecall || r->ai.running || r->ai.queued || req_held(r))
        return;
    if (r->prev)
        r->prev->next = r->next;
    else
        co->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    co->n_reqs--;
    tok_gen_free(r->gen);
    free(r->ws_held);
    request_free(r->in);
    free(r->aff_keys);
    free(r->prompt);
    free(r->image_pos);
    free(r);
    co->up->req_freed(co);
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

/* ------------------------------------------------------------------ admission */

/* A running request ended: its admission slot goes to the next queued one. */
static void req_slot_release(struct coord *co, struct req *r)
{
    struct admit_item *it = admit_release(&co->admit, &r->ai);

    /* a promoted request that cannot be dispatched gives its slot on: loop, not recurse */
    while (it) {
        struct req *n = (struct req *)((char *)it - offsetof(struct req, ai));
        if (req_dispatch_promoted(n) == 0)
            return;
        it = admit_release(&co->admit, &n->ai);
        req_free_if_done(n);
    }
}

/* ------------------------------------------------------------------ engine stream */

static int send_chunk(struct req *r, const struct chunk *ch)
{
    int e = r->cops->chunk(r, ch);

    if (e < 0 && !r->client)
        req_stop_engine(r);     /* the door gave up on its client (a slow reader) */
    return e;
}

/* The request's final (ef: the engine's, NULL when the coordinator ended it) to the door. */
static void send_final(struct req *r, const Stepd__V1__Final *ef, int finish_reason, const char *stop_str)
{
    struct coord *co = r->co;
    struct chunk_final f = { .finish = (enum chunk_finish)finish_reason, .message = "", .stop_string = "" };
    const Stepd__V1__Timings *et = ef ? ef->timings : NULL;
    const Stepd__V1__MtpStats *em = ef ? ef->mtp : NULL;
    int64_t now = rpc_now_ms();

    f.prompt_tokens = (uint32_t)r->n_prompt;
    f.completion_tokens = r->n_out;
    f.cached_tokens = ef && ef->usage ? ef->usage->cached_tokens : 0;
    f.reasoning_tokens = r->n_reasoning;
    f.prefill_s = et ? et->prefill_s : 0.0;
    f.queue_s = (double)(r->t_dispatch - r->t_arrival) / 1000.0 + (et ? et->queue_s : 0.0);
    f.first_token_s = r->t_first ? (double)(r->t_first - r->t_arrival) / 1000.0 : 0.0;
    f.decode_s = r->t_first ? (double)(r->t_last - r->t_first) / 1000.0 : 0.0;
    f.mean_inter_token_s = r->n_out > 1 && r->t_first ? f.decode_s / (r->n_out - 1) : 0.0;
    f.e2e_s = (double)(now - r->t_arrival) / 1000.0;
    if (em) {
        f.num_drafts = em->num_drafts;
        f.num_draft_tokens = em->num_draft_tokens;
        f.num_accepted_tokens = em->num_accepted_tokens;
        f.accepted_per_position = em->accepted_per_position;
        f.n_accepted_per_position = em->n_accepted_per_position;
        f.steps_by_num_drafts = em->steps_by_num_drafts;
        f.n_steps_by_num_drafts = em->n_steps_by_num_drafts;
    }
    if (ef && ef->message)
        f.message = ef->message;
    f.group = r->grp_name;
    f.request_id = r->id;
    if (stop_str) {
        f.stop = CHUNK_STOP_STRING;
        f.stop_string = stop_str;
    } else if (ef && ef->matched_stop_case == STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID) {
        f.stop = CHUNK_STOP_TOKEN;
        f.stop_token_id = ef->stop_token_id;
    }
    /* metrics */
    if (finish_reason >= 0 && finish_reason < 5)
        co->m.finished[finish_reason]++;
    co->m.prompt_tokens += r->n_prompt;
    co->m.generation_tokens += r->n_out;
    metrics_observe(&co->m.e2e, f.e2e_s);
    metrics_observe(&co->m.prompt_len, (double)r->n_prompt);
    metrics_observe(&co->m.gen_len, (double)r->n_out);
    co->m.spec_drafts += f.num_drafts;
    co->m.spec_draft_tokens += f.num_draft_tokens;
    co->m.spec_accepted += f.num_accepted_tokens;
    for (size_t i = 0; i < f.n_accepted_per_position && i < METRICS_MAX_POS; i++)
        co->m.spec_accepted_pos[i] += f.accepted_per_position[i];
    for (size_t i = 0; i < f.n_steps_by_num_drafts && i < METRICS_MAX_POS; i++)
        co->m.spec_steps_by_drafts[i] += f.steps_by_num_drafts[i];

    r->final_sent = true;
    if (!r->client)
        return;
    r->cops->final(r, &f);
    r->client = NULL;
    req_ended(r, RPC_OK, "", false);
}

/* ------------------------------------------------------------------ text pipeline */

/* Text and chat input: the engine's ids go through common/tok's output pipeline (struct
 * tok_gen: stop ids hidden, detokenizer, stop strings, the step3p5 reasoning and tool-call
 * parsers for chat input), and each engine message's events fill one chunk. */

#define MAX_TC_DELTAS 16

struct chunk_acc {
    struct req *r;
    struct strbuf text, reasoning, content;
    struct chunk_tool tc[MAX_TC_DELTAS];
    struct strbuf args[MAX_TC_DELTAS];
    char ids[MAX_TC_DELTAS][40];
    char *names[MAX_TC_DELTAS];
    size_t n_tc;
};

/* A tool call's id: stable for the request and the call's index, unique across requests
 * ("call_" and 24 hex digits, as OpenAI's clients expect an opaque string). */
static void tool_call_id(const struct req *r, int index, char *buf, size_t n)
{
    uint64_t h = coord_fnv1a(r->id, strlen(r->id), COORD_FNV_SEED);

    h = coord_fnv1a(&r->co->start_ms, sizeof(r->co->start_ms), h);
    snprintf(buf, n, "call_%016" PRIx64 "%08x", h, (unsigned)index);
}

static bool all_space(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\t' && s[i] != '\r')
            return false;
    return true;
}

/* Content when the tool-call parser runs: whitespace before any other content is held
 * back, sent with the content that follows it, dropped when a tool call follows it (so a
 * reply of tool calls only has no content, as OpenAI's), sent at the end otherwise. */
static int acc_content(struct chunk_acc *a, const char *text, size_t len)
{
    struct req *r = a->r;

    if (!r->tools_parsed || r->content_seen)
        return strbuf_add(&a->content, text, len);
    if (all_space(text, len)) {
        char *p = realloc(r->ws_held, r->n_ws_held + len);

        if (!p)
            return -ENOMEM;
        memcpy(p + r->n_ws_held, text, len);
        r->ws_held = p;
        r->n_ws_held += len;
        return 0;
    }
    r->content_seen = true;
    if (r->n_ws_held && strbuf_add(&a->content, r->ws_held, r->n_ws_held) < 0)
        return -ENOMEM;
    r->n_ws_held = 0;
    return strbuf_add(&a->content, text, len);
}

static int acc_event(void *ud, const struct tok_ev *ev)
{
    struct chunk_acc *a = ud;
    struct chunk_tool *t;
    size_t k;

    if (a->r->calls_cut && ev->kind != TOK_EV_TEXT)
        return 0;
    if (a->r->in->single_tool_call && ev->tool_index >= 1 &&
        (ev->kind == TOK_EV_TOOL_START || ev->kind == TOK_EV_TOOL_ARGS)) {
        a->r->calls_cut = true;     /* parallel_tool_calls false: the output ends before it */
        return 0;
    }
    switch (ev->kind) {
    case TOK_EV_TEXT:
        return strbuf_add(&a->text, ev->text, ev->len);
    case TOK_EV_REASONING:
        return strbuf_add(&a->reasoning, ev->text, ev->len);
    case TOK_EV_CONTENT:
        return acc_content(a, ev->text, ev->len);
    case TOK_EV_TOOL_START:
    case TOK_EV_TOOL_ARGS:
        a->r->calls_seen = true;
        a->r->n_ws_held = 0;
        t = a->n_tc ? &a->tc[a->n_tc - 1] : NULL;
        if (ev->kind == TOK_EV_TOOL_START || !t || t->index != (uint32_t)ev->tool_index) {
            if (a->n_tc == MAX_TC_DELTAS)
                return -ENOSPC;
            t = &a->tc[a->n_tc];
            t->index = (uint32_t)ev->tool_index;
            t->id = "";
            t->name = "";
            t->arguments = "";
            a->n_tc++;
        }
        k = (size_t)(t - a->tc);
        if (ev->kind == TOK_EV_TOOL_START) {
            tool_call_id(a->r, ev->tool_index, a->ids[k], sizeof(a->ids[k]));
            t->id = a->ids[k];
            a->names[k] = strndup(ev->text, ev->len);
            if (!a->names[k])
                return -ENOMEM;
            t->name = a->names[k];
        } else {
            if (strbuf_add(&a->args[k], ev->text, ev->len) < 0)
                return -ENOMEM;
            t->arguments = a->args[k].p;
        }
        return 0;
    case TOK_EV_TOOL_END:
        return 0;
    }
    return 0;
}

static void acc_done(struct chunk_acc *a)
{
    strbuf_done(&a->text);
    strbuf_done(&a->reasoning);
    strbuf_done(&a->content);
    for (size_t i = 0; i < MAX_TC_DELTAS; i++) {
        strbuf_done(&a->args[i]);
        free(a->names[i]);
    }
}

/* The chunk's text fields from the events (borrowed from a). */
static void acc_fill(struct chunk_acc *a, struct chunk *ch)
{
    ch->text = strbuf_str(&a->text);
    ch->reasoning = strbuf_str(&a->reasoning);
    ch->content = strbuf_str(&a->content);
    ch->n_tools = a->n_tc;
    ch->tools = a->tc;
}

/* The engine's logprobs as the chunk's (one allocation, freed by the caller). */
static int chunk_logprobs(const Stepd__V1__Chunk *ec, struct chunk *ch, void **mem)
{
    size_t n_top = 0;
    struct chunk_logprob *lp;
    struct chunk_top *top;

    *mem = NULL;
    if (!ec->n_logprobs)
        return 0;
    for (size_t i = 0; i < ec->n_logprobs; i++)
        n_top += ec->logprobs[i]->n_top;
    lp = malloc(ec->n_logprobs * sizeof(*lp) + n_top * sizeof(*top));
    if (!lp)
        return -ENOMEM;
    top = (struct chunk_top *)(lp + ec->n_logprobs);
    for (size_t i = 0; i < ec->n_logprobs; i++) {
        const Stepd__V1__TokenLogprob *e = ec->logprobs[i];

        lp[i].token_id = e->token_id;
        lp[i].logprob = e->logprob;
        lp[i].n_top = e->n_top;
        lp[i].top = top;
        for (size_t k = 0; k < e->n_top; k++, top++) {
            top->token_id = e->top[k]->token_id;
            top->logprob = e->top[k]->logprob;
        }
    }
    ch->logprobs = lp;
    ch->n_logprobs = ec->n_logprobs;
    *mem = lp;
    return 0;
}

static bool acc_empty(const struct chunk_acc *a)
{
    return !a->text.len && !a->reasoning.len && !a->content.len && !a->n_tc;
}

/* The parsers first see what the prompt forced of the output (an opened tool call). */
static int req_prime(struct req *r, struct chunk_acc *a)
{
    char pre[128];
    size_t n;

    if (r->primed)
        return 0;
    r->primed = true;
    n = coord_chat_forced_prefix(r->in, pre, sizeof(pre));
    return n ? tok_gen_prime(r->gen, pre, n, acc_event, a) : 0;
}

/* The request's pipeline: what the engine ends the request on is hidden from the text
 * (EOS unless ignore_eos, stop_token_ids), stop strings cut it, and chat output keeps
 * its special tokens for the parsers. */
static int req_text_start(struct req *r)
{
    const struct request *in = r->in;
    const struct model_info *mi = &r->co->model;
    struct tok_gen_opts o = { .text_events = true };
    int32_t *ids = NULL;
    size_t n = 0;
    int e;

    ids = malloc((mi->n_eos + in->sp.n_stop_token_ids + 1) * sizeof(*ids));
    if (!ids)
        return -ENOMEM;
    if (!(REQUEST_HAS(&in->sp, RO_IGNORE_EOS) && in->sp.ignore_eos))
        for (size_t i = 0; i < mi->n_eos; i++)
            ids[n++] = mi->eos[i];
    for (size_t i = 0; i < in->sp.n_stop_token_ids; i++)
        ids[n++] = in->sp.stop_token_ids[i];
    o.stop_ids = ids;
    o.n_stop_ids = n;
    o.stops = (const char *const *)in->sp.stop;
    o.n_stops = in->sp.n_stop;
    o.include_stop = REQUEST_HAS(&in->sp, RO_INCLUDE_STOP_STR) && in->sp.include_stop_str;
    o.skip_special = !REQUEST_HAS(&in->sp, RO_SKIP_SPECIAL_TOKENS) || in->sp.skip_special_tokens;
    if (in->input == REQUEST_INPUT_CHAT) {
        o.parser.reasoning = r->co->o.reasoning_parser;
        o.parser.tools = r->co->o.tool_parser && in->tool_choice != REQUEST_TOOLS_NONE;
        o.parser.tools_json = in->tools;
        r->tools_parsed = o.parser.tools;
    }
    e = tok_gen_new(r->co->tok, &o, &r->gen);
    free(ids);
    return e;
}

/* Reasoning tokens (usage): the output before the reasoning ends (</think>, or a tool call
 * the parser takes as its end), the tags not counted. */
static void req_count_reasoning(struct req *r, int32_t id)
{
    const struct coord *co = r->co;

    if (id == co->tok_think_end || id == co->tok_tool_call)
        r->in_reasoning = false;
    else if (id != co->tok_think_start)
        r->n_reasoning++;
}

/* One output of the engine for r (from its Generate call or the output stream). */
void req_engine_output(struct req *r, const Stepd__V1__GenerateResponse *er)
{
    struct coord *co = r->co;
    int64_t now = rpc_now_ms();

    if (!r->client || r->final_sent)
        return;
    if (er->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK) {
        const Stepd__V1__Chunk *ec = er->chunk;
        struct chunk ch = { .text = "", .reasoning = "", .content = "" };
        void *lp_mem = NULL;
        /* the model's own vocabulary (lm_head may be padded past the tokenizer's) */
        uint32_t vocab = co->model.known ? co->model.vocab_size : 0;
        size_t n = ec->n_token_ids;

        for (size_t i = 0; i < n; i++) {
            if (ec->token_ids[i] < 0 || (vocab && (uint32_t)ec->token_ids[i] >= vocab)) {
                /* docs/RELIABILITY.md C11: never trust the engine's token ids */
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
        if (chunk_logprobs(ec, &ch, &lp_mem) < 0) {
            req_stop_engine(r);
            req_finish(r, RPC_INTERNAL, "out of memory");
            return;
        }
        if (r->continuous_usage) {
            ch.has_usage = true;
            ch.prompt_tokens = (uint32_t)r->n_prompt;
            ch.completion_tokens = r->n_out;
        }
        if (!r->text_mode) {
            (void)send_chunk(r, &ch);
            free(lp_mem);
            return;
        }
        struct chunk_acc acc = { .r = r };
        int e = req_prime(r, &acc);
        for (size_t i = 0; i < n && e == 0 && !r->calls_cut; i++) {
            if (r->in_reasoning)
                req_count_reasoning(r, ec->token_ids[i]);
            e = tok_gen_push(r->gen, ec->token_ids[i], acc_event, &acc);
            if (e == -EINVAL || e == -EALREADY)
                e = 0;      /* past the tokenizer's vocabulary, or after the pipeline ended */
        }
        if (e == 1 && r->n_ws_held && !r->calls_seen) {
            /* a stop string ended the output: the held whitespace was its content */
            if (strbuf_add(&acc.content, r->ws_held, r->n_ws_held) < 0)
                e = -ENOMEM;
            r->n_ws_held = 0;
        }
        if (e < 0) {
            acc_done(&acc);
            free(lp_mem);
            req_stop_engine(r);
            req_finish(r, RPC_INTERNAL, "text pipeline failed: %s", err_str(e));
            return;
        }
        acc_fill(&acc, &ch);
        int se = send_chunk(r, &ch);
        acc_done(&acc);
        free(lp_mem);
        int idx;
        if (se == 0 && r->calls_cut && !r->final_sent) {
            log_req_debug(r->id, "a second tool call with parallel_tool_calls false: the output ends");
            req_stop_engine(r);
            send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_STOP, NULL);
            return;
        }
        if (se == 0 && e == 1 && tok_gen_finish_reason(r->gen, &idx) == TOK_FINISH_STOP) {
            log_req_debug(r->id, "stop string %d matched", idx);
            req_stop_engine(r);
            send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_STOP, r->in->sp.stop[idx]);
        }
        return;
    }
    if (er->response_case == STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL) {
        if (r->text_mode) {
            struct chunk_acc acc = { .r = r };
            struct chunk ch = { .text = "", .reasoning = "", .content = "" };
            int se = 0;

            if (req_prime(r, &acc) == 0 && tok_gen_finish(r->gen, acc_event, &acc) == 0 &&
                (r->calls_seen || !r->n_ws_held || strbuf_add(&acc.content, r->ws_held, r->n_ws_held) == 0) &&
                !acc_empty(&acc)) {
                acc_fill(&acc, &ch);
                se = send_chunk(r, &ch);
            }
            acc_done(&acc);
            if (se < 0)
                return;
        }
        send_final(r, er->final, er->final->finish_reason, NULL);
    }
}

static void on_engine_msg(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud)
{
    req_engine_output(ud, (const Stepd__V1__GenerateResponse *)msg);
}

/* The engine is done with r (its Generate call ended, or its end came on the output
 * stream): status OK means a Final was sent before. */
void req_engine_end(struct req *r, int status, const char *details)
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
    if (r->client) {
        /* the engine's status is the request's, whatever it is, with a message naming it */
        int retry = status == RPC_RESOURCE_EXHAUSTED ? 100 : 0;

        if (status == RPC_OK)
            req_finish(r, RPC_INTERNAL, "worker group '%s' ended the stream without a final message",
                       r->grp_name);
        else if (r->n_out == 0)
            req_finish_retry(r, status, retry, "worker group '%s' refused the request: %s: %s",
                             r->grp_name, rpc_status_name(status), details);
        else
            req_finish_retry(r, status, retry, "worker group '%s' failed the request after %u tokens: "
                             "%s: %s", r->grp_name, r->n_out, rpc_status_name(status), details);
    }
    engine_conn_unref(r->eng);
    r->eng = NULL;
    if (r->ai.running)
        req_slot_release(co, r);
    if (g)
        req_held_kick(co);      /* r's place in g is free */
}

void req_engine_ended(struct req *r, int status, const char *details)
{
    req_engine_end(r, status, details);
    req_free_if_done(r);
}

static void on_engine_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct req *r = ud;
    r->ecall = NULL;
    req_engine_ended(r, status, details);
}

static void on_submit_done(struct rpc_client_call *c, int status, const char *details, void *ud)
{
    struct req *r = ud;
    struct engine_conn *e = r->submit_eng;

    r->ecall = NULL;
    r->submit_eng = NULL;
    if (status != RPC_OK && r->in_out_tab) {
        /* not admitted: its end will not come on the stream.  (FAILED_PRECONDITION, the
         * engine does not know the stream: the stream has ended on the engine's side, and
         * its end reaches us on the stream itself.) */
        engine_out_remove(e, r);
        req_engine_end(r, status, details);
    } else if (status == RPC_OK && r->abort_pending && !r->engine_done) {
        req_send_abort(r);
    }
    engine_conn_unref(e);
    req_free_if_done(r);
}

/* The group for r: one with room, or NULL with *ret_full (every group that would hold r
 * is at its engine's capacity: r waits) or the client finished UNAVAILABLE. */
static struct group *req_pick(struct req *r, bool *ret_full)
{
    struct coord *co = r->co;
    const struct request *in = r->in;
    int64_t need = (int64_t)r->n_prompt + (REQUEST_HAS(&in->sp, RO_MAX_TOKENS) ? in->sp.max_tokens : 1);
    struct group *g;

    if (co->o.prefix_affinity && !r->aff_keys && r->n_prompt >= co->o.prefix_affinity) {
        size_t max = r->n_prompt / co->o.prefix_affinity;

        if (max > REQ_AFFINITY_MAX_BLOCKS)
            max = REQ_AFFINITY_MAX_BLOCKS;
        r->aff_keys = malloc(max * sizeof(*r->aff_keys));
        if (r->aff_keys)
            r->n_aff_keys = affinity_chain(r->prompt, r->n_prompt, (int)co->o.prefix_affinity,
                                           in->cache_salt, r->aff_keys, max);
    }
    g = wpool_pick(co, r->aff_keys, r->n_aff_keys, need > UINT32_MAX ? UINT32_MAX : (uint32_t)need,
                   in->n_images > 0, ret_full);

    if (g || *ret_full)
        return g;
    co->m.rejected_unavailable++;
    if (in->n_images && !wpool_serves_images(co))
        req_finish(r, RPC_UNAVAILABLE, "no ready worker group serves images");
    else if (wpool_ready_count(co))
        req_finish(r, RPC_UNAVAILABLE, "no ready worker group has a context of %" PRId64
                   " tokens (prompt + max_tokens)", need);
    else
        req_finish(r, RPC_UNAVAILABLE, "no worker group is ready");
    return NULL;
}

/* Start r's engine call on g. 0: sent; <0: failed (client finished, slot still held). */
static int req_send(struct req *r, struct group *g)
{
    struct coord *co = r->co;
    const struct request *in = r->in;
    Stepd__V1__GenerateRequest er = STEPD__V1__GENERATE_REQUEST__INIT;
    Stepd__V1__TokenIds ti = STEPD__V1__TOKEN_IDS__INIT;
    Stepd__V1__SamplingParams sp = STEPD__V1__SAMPLING_PARAMS__INIT;
    struct engine_sampling es;

    if (engine_sampling_build(&in->sp, &es, &sp) < 0) {
        req_finish(r, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return -ENOMEM;
    }
    if (r->choice && PB_HAS(&sp, seed))     /* n > 1: each choice its own draws */
        sp.seed = (int64_t)(((uint64_t)sp.seed + r->choice) & INT64_MAX);
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
    if (in->has_num_speculative_tokens)
        PB_SET(&er, num_speculative_tokens, in->num_speculative_tokens);
    er.cache_salt = in->cache_salt;     /* the engine validates it */
    Stepd__V1__StructuredOutput so = STEPD__V1__STRUCTURED_OUTPUT__INIT;
    if (in->so_kind) {
        so.kind = (char *)in->so_kind;
        so.text = in->so_text;
        /* reasoning is free: the constraint starts after </think> (the forced prefix of a
         * required tool call has closed it already) */
        if (in->so_start >= 0)
            PB_SET(&so, start_token, in->so_start);
        else if (r->in_reasoning && co->tok_think_end >= 0)
            PB_SET(&so, start_token, co->tok_think_end);
        er.structured_output = &so;
    }
    /* the images: the engine checks each layout at its position and encodes the views */
    size_t n_views = 0;
    for (size_t i = 0; i < in->n_images; i++)
        n_views += in->images[i].n_views;
    Stepd__V1__ImageInput im[in->n_images ? in->n_images : 1], *pim[in->n_images ? in->n_images : 1];
    Stepd__V1__ImageView vw[n_views ? n_views : 1], *pvw[n_views ? n_views : 1];
    for (size_t i = 0, v = 0; i < in->n_images && r->image_pos; i++) {
        const struct image_prep *p = &in->images[i];
        stepd__v1__image_input__init(&im[i]);
        im[i].sha256.data = (uint8_t *)p->hash;
        im[i].sha256.len = sizeof(p->hash);
        im[i].token_ids = p->tokens;
        im[i].n_token_ids = p->n_tokens;
        im[i].token_position = r->image_pos[i];
        im[i].views = &pvw[v];
        im[i].n_views = p->n_views;
        for (uint32_t j = 0; j < p->n_views; j++, v++) {
            stepd__v1__image_view__init(&vw[v]);
            vw[v].width = p->views[j].w;
            vw[v].height = p->views[j].h;
            vw[v].rgb.data = p->views[j].rgb;
            vw[v].rgb.len = (size_t)p->views[j].w * p->views[j].h * 3;
            pvw[v] = &vw[v];
        }
        pim[i] = &im[i];
    }
    if (r->image_pos) {
        er.n_images = in->n_images;
        er.images = pim;
    }
    struct engine_conn *ec = g->eng;
    engine_out_open(ec);
    if (ec->out_state == OUT_READY && engine_out_find(ec, r->id)) {
        engine_sampling_done(&es);
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
    if (ec->out_state == OUT_READY && (e = engine_out_insert(ec, r)) == 0) {
        Stepd__V1__SubmitRequest sr = STEPD__V1__SUBMIT_REQUEST__INIT;
        sr.stream_id = ec->out_id;
        sr.request = &er;
        r->submit_eng = ec;
        ec->refs++;
        e = rpc_client_start(ec->ch, ENGINE_SUBMIT, &sr.base, &stepd__v1__submit_response__descriptor,
                             r->deadline_ms, NULL, on_submit_done, r, &r->ecall);
        if (e < 0) {
            engine_out_remove(ec, r);
            r->submit_eng = NULL;
            ec->refs--;
        }
    } else {
        e = rpc_client_start(ec->ch, ENGINE_GENERATE, &er.base, &stepd__v1__generate_response__descriptor,
                             r->deadline_ms, on_engine_msg, on_engine_done, r, &r->ecall);
    }
    engine_sampling_done(&es);      /* the call has serialised its message */
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
    affinity_note(co->aff, r->aff_keys, r->n_aff_keys, g->id);
    log_req_debug(r->id, "routed to group %s (%zu prompt tokens)", g->name, r->n_prompt);
    return 0;
}

/* 0: sent to a group, or held until one has room; <0: failed (client finished, slot
 * still held by the caller). */
static int req_dispatch_one(struct req *r)
{
    struct group *g;
    bool full = false;

    if (!r->client)
        return -ECANCELED;
    if (r->co->held.n) {
        /* earlier requests wait for room: this one queues behind them */
        held_insert(r);
        return 0;
    }
    g = req_pick(r, &full);
    if (!g && full) {
        held_insert(r);
        log_req_debug(r->id, "every worker group is at its engine's capacity: held (%u held)", r->co->held.n);
        return 0;
    }
    if (!g)
        return -EAGAIN;
    return req_send(r, g);
}

int req_dispatch_promoted(struct req *r)
{
    return req_dispatch_one(r);
}

void req_held_kick(struct coord *co)
{
    struct req *r;

    while ((r = held_head(co))) {
        bool full = false;
        struct group *g = req_pick(r, &full);

        if (!g && full)
            return;         /* still no room: the head keeps its place */
        admit_list_unlink(&co->held, &r->hold);
        if (g && req_send(r, g) == 0)
            continue;
        /* no group for it any more (its client is finished) */
        req_slot_release(co, r);
        req_free_if_done(r);
    }
}

/* ------------------------------------------------------------------ client side */

/* End r, which no engine holds (in the admission queue, or held for a group with room),
 * with status, or with a Final ABORT for RPC_OK, and free it: the tail of the entry points
 * (a client's cancel, Inference.Abort, a forced shutdown) for such a request. */
static void req_end_waiting(struct req *r, int status, const char *why)
{
    struct coord *co = r->co;
    bool held = req_held(r);

    if (held)
        admit_list_unlink(&co->held, &r->hold);
    else
        admit_remove(&co->admit, &r->ai);
    if (status == RPC_OK)
        send_final(r, NULL, STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT, NULL);
    else
        req_finish(r, status, "%s", why);
    if (held)
        req_slot_release(co, r);
    req_free_if_done(r);
}

void req_client_cancel(struct req *r)
{
    bool expired = rpc_now_ms() >= r->deadline_ms;

    r->cancelled = true;
    if (r->ai.queued || req_held(r)) {
        req_end_waiting(r, expired ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                        expired ? "deadline exceeded while queued" : "cancelled by the client");
        return;
    }
    req_stop_engine(r);
    req_finish(r, expired ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
               expired ? "deadline exceeded" : "cancelled by the client");
    req_free_if_done(r);
}

int coord_prompt_encode(struct coord *co, const struct request *in, struct tok_ids *ids, uint32_t **image_pos,
                        char *msg, size_t len)
{
    const char *field = in->names[in->input == REQUEST_INPUT_TEXT ? RN_TEXT : RN_MESSAGES];
    struct err_buf eb;
    char *text = NULL;
    int e;

    *image_pos = NULL;
    if (!co->tok) {
        snprintf(msg, len, "%s: text input needs a tokenizer (start stepd with --tokenizer)", field);
        return -ENOTSUP;
    }
    if (in->input == REQUEST_INPUT_TEXT) {
        e = media_text_encode(in, co->tok, in->text, TOK_ENCODE_ADD_SPECIAL, ids, &eb);
    } else {
        e = coord_chat_render(co, in, &text, msg, len);
        if (e < 0)
            return e;
        e = tok_encode(co->tok, text, strlen(text), TOK_ENCODE_SPECIAL, ids, &eb);
        free(text);
    }
    if (e < 0) {
        tok_ids_done(ids);
        snprintf(msg, len, "%s: %.600s", field, eb.msg);
        return -EINVAL;
    }
    /* the images: each placeholder token becomes the image's token layout */
    if ((e = media_prompt_expand(in, co->tok, &ids->ids, &ids->n, image_pos, msg, len)) < 0) {
        tok_ids_done(ids);
        return e;
    }
    return 0;
}

static int req_build_prompt(struct req *r, char *msg, size_t len)
{
    struct request *in = r->in;
    struct tok_ids ids = { 0 };
    int e;

    if (in->input == REQUEST_INPUT_TOKENS) {
        r->n_prompt = in->n_token_ids;
        r->prompt = in->token_ids;      /* handed over: the request keeps no copy */
        in->token_ids = NULL;
        in->n_token_ids = 0;
        return 0;
    }
    if ((e = coord_prompt_encode(r->co, in, &ids, &r->image_pos, msg, len)) < 0)
        return e;
    r->prompt = ids.ids;
    r->n_prompt = ids.n;
    return 0;
}

/* A server-assigned request id: unguessable (128 random bits), so that no client can
 * name another's request. */
void req_id_assign(char *buf, size_t n)
{
    char hex[COORD_RANDOM_HEX];

    coord_random_hex(hex);
    snprintf(buf, n, "stepd-%s", hex);
}

/* ------------------------------------------------------------------ submission (both doors) */

/* Refuse every choice of a request that has no struct req yet: through its door, as a
 * request would end. */
static void refuse_all(struct coord *co, const struct req_origin *o, const char *id, int status,
                       int retry_ms, bool quiet, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static void refuse_all(struct coord *co, const struct req_origin *o, const char *id, int status,
                       int retry_ms, bool quiet, const char *fmt, ...)
{
    for (uint32_t i = 0; i < o->n; i++) {
        struct req t = { .co = co, .cops = o->ops, .client = o->clients[i], .choice = i };
        va_list ap;

        snprintf(t.id, sizeof(t.id), "%s", id[0] ? id : "-");
        va_start(ap, fmt);
        req_finishv(&t, status, retry_ms, quiet, fmt, ap);
        va_end(ap);
    }
}

/* Choice i's id: the request's own for n = 1, "<id>-<i>" for n > 1. */
static void choice_id(const char *base, uint32_t n, uint32_t i, char *buf, size_t len)
{
    if (n == 1)
        snprintf(buf, len, "%s", base);
    else
        snprintf(buf, len, "%.120s-%u", base, i);
}

static bool id_in_flight(const struct coord *co, const char *id)
{
    for (const struct req *o = co->reqs; o; o = o->next)
        if (o->client && strcmp(o->id, id) == 0)
            return true;
    return false;
}

/* The prompt's checks that need its tokens (the context), for text and chat input. */
static int prompt_check(const struct req *r, char *err, size_t len)
{
    const struct coord *co = r->co;
    const struct request *in = r->in;
    uint32_t ctx = coord_max_model_len(co);
    int64_t mt = REQUEST_HAS(&in->sp, RO_MAX_TOKENS) ? in->sp.max_tokens : 1;
    const char *field = in->names[in->input == REQUEST_INPUT_TEXT ? RN_TEXT : RN_MESSAGES];

    if (r->n_prompt == 0)
        snprintf(err, len, "%s: prompt is empty after tokenization", field);
    else if (co->o.max_input_tokens ? r->n_prompt > co->o.max_input_tokens : (ctx > 1 && r->n_prompt > ctx - 1))
        snprintf(err, len, "%s: %zu prompt tokens, more than max_input_tokens %u", field, r->n_prompt,
                 co->o.max_input_tokens ? co->o.max_input_tokens : ctx - 1);
    else if (ctx && (int64_t)r->n_prompt + mt > (int64_t)ctx)
        snprintf(err, len, "%s: prompt (%zu tokens) + max_tokens (%" PRId64 ") exceeds the context length %u",
                 in->names[RN_MAX_TOKENS], r->n_prompt, mt, ctx);
    else
        return 0;
    return -EINVAL;
}

static struct req *req_new(struct coord *co, struct request *in, const struct req_origin *o, uint32_t i,
                           const char *base_id)
{
    struct req *r = calloc(1, sizeof(*r));

    if (!r)
        return NULL;
    r->co = co;
    r->cops = o->ops;
    r->client = o->clients[i];
    r->choice = i;
    if (o->caller)
        r->caller = *o->caller;
    req_caller_owner(co, &r->caller, r->owner, sizeof(r->owner));
    coord_random_hex(r->abort_token);
    r->in = request_ref(in);
    r->engine_done = true;      /* nothing dispatched yet */
    r->t_arrival = rpc_now_ms();
    r->deadline_ms = o->deadline_ms;
    choice_id(base_id, o->n, i, r->id, sizeof(r->id));
    r->text_mode = in->input != REQUEST_INPUT_TOKENS || (in->text_output && co->tok);
    r->want_ids = in->include_token_ids;
    r->continuous_usage = in->continuous_usage_stats;
    r->in_reasoning = in->input == REQUEST_INPUT_CHAT && co->o.reasoning_parser &&
                      (in->tool_choice == REQUEST_TOOLS_AUTO || in->tool_choice == REQUEST_TOOLS_NONE);
    r->next = co->reqs;
    if (co->reqs)
        co->reqs->prev = r;
    co->reqs = r;
    co->n_reqs++;
    return r;
}

/* Admit r (its prompt and pipeline ready): dispatch, queue, or refuse. */
static void req_admit(struct req *r)
{
    struct coord *co = r->co;

    r->ai.priority = r->in->priority;
    switch (admit_add(&co->admit, &r->ai)) {
    case ADMIT_RUN:
        co->m.accepted++;
        r->cops->watch(r);
        if (req_dispatch_one(r) < 0) {
            req_slot_release(co, r);
            req_free_if_done(r);
        }
        return;
    case ADMIT_QUEUED:
        co->m.accepted++;
        r->cops->watch(r);
        log_req_debug(r->id, "queued (%u waiting)", co->admit.queued);
        return;
    case ADMIT_FULL:
        co->m.rejected_full++;
        req_finish_retry(r, RPC_RESOURCE_EXHAUSTED, 100, "server overloaded: %u running and %u queued (the caps)",
                         co->admit.running, co->admit.queued);
        req_free_if_done(r);
        return;
    }
}

void req_submit(struct coord *co, struct request *in, const struct req_origin *o)
{
    char err[768] = "", base[136];
    int rc;
    struct req **rs = NULL;
    int e;

    if (co->draining) {
        co->m.rejected_draining++;
        refuse_all(co, o, in->id, RPC_UNAVAILABLE, 0, true, "server is draining; retry on another replica");
        goto out;
    }
    /* nothing useful fits in under 2 ms: answer now instead of touching an engine */
    if (o->deadline_ms - rpc_now_ms() < 2) {
        refuse_all(co, o, in->id, RPC_DEADLINE_EXCEEDED, 0, true, "deadline expired (or under 2 ms) on arrival");
        goto out;
    }
    /* full: answer before any tokenization work (A2: fast, cheap rejections) */
    if (co->admit.queued + o->n > co->admit.max_queue &&
        (co->admit.running + o->n > co->admit.max_running || co->admit.queued > 0)) {
        co->m.rejected_full++;
        refuse_all(co, o, in->id, RPC_RESOURCE_EXHAUSTED, 100, true,
                   "server overloaded: %u running and %u queued (the caps)", co->admit.running, co->admit.queued);
        goto out;
    }
    if (request_validate(co, in, err, sizeof(err)) < 0) {
        co->m.rejected_invalid++;
        log_req_info(in->id[0] ? in->id : "-", "rejected: %s", err);
        refuse_all(co, o, in->id, RPC_INVALID_ARGUMENT, 0, true, "%s", err);
        goto out;
    }
    if ((rc = door_tool_constraint(in, co->o.tool_parser ? co->tok_tool_call : -1,
                                   co->tok ? tok_added_id(co->tok, "</tool_call>") : -1, err,
                                   sizeof(err))) < 0 ||
        (rc = coord_structured_check(co, in, err, sizeof(err))) < 0) {
        co->m.rejected_invalid++;
        log_req_info(in->id[0] ? in->id : "-", "rejected: %s", err);
        refuse_all(co, o, in->id, rc == -EOPNOTSUPP ? RPC_UNAVAILABLE : RPC_INVALID_ARGUMENT, 0,
                   true, "%s", err);
        goto out;
    }
    if (wpool_ready_count(co) == 0) {
        co->m.rejected_unavailable++;
        refuse_all(co, o, in->id, RPC_UNAVAILABLE, 0, true, "no worker group is ready");
        goto out;
    }
    if (in->id[0]) {
        snprintf(base, sizeof(base), "%s", in->id);
        for (uint32_t i = 0; i < o->n; i++) {
            char id[136];

            choice_id(base, o->n, i, id, sizeof(id));
            if (id_in_flight(co, id)) {
                refuse_all(co, o, in->id, RPC_ALREADY_EXISTS, 0, false, "%s: '%s' is already in flight",
                           in->names[RN_REQUEST_ID], id);
                goto out;
            }
        }
    } else {
        req_id_assign(base, sizeof(base));
    }
    rs = calloc(o->n, sizeof(*rs));
    for (uint32_t i = 0; rs && i < o->n; i++)
        if (!(rs[i] = req_new(co, in, o, i, base)))
            break;
    if (!rs || !rs[o->n - 1]) {
        for (uint32_t i = 0; i < o->n; i++) {
            if (rs && rs[i]) {
                req_finish(rs[i], RPC_RESOURCE_EXHAUSTED, "out of memory");
                req_free_if_done(rs[i]);
            } else {
                struct req t = { .co = co, .cops = o->ops, .client = o->clients[i], .choice = i };

                snprintf(t.id, sizeof(t.id), "%s", base);
                req_finish(&t, RPC_RESOURCE_EXHAUSTED, "out of memory");
            }
        }
        goto out;
    }
    /* the prompt, once for the n choices */
    struct req *r0 = rs[0];
    e = req_build_prompt(r0, err, sizeof(err));
    if (e == 0 && r0->text_mode && in->input != REQUEST_INPUT_TOKENS)
        e = prompt_check(r0, err, sizeof(err));
    for (uint32_t i = 1; e == 0 && i < o->n; i++) {
        rs[i]->prompt = malloc(r0->n_prompt * sizeof(int32_t));
        if (!rs[i]->prompt) {
            e = -ENOMEM;
            snprintf(err, sizeof(err), "out of memory");
            break;
        }
        memcpy(rs[i]->prompt, r0->prompt, r0->n_prompt * sizeof(int32_t));
        rs[i]->n_prompt = r0->n_prompt;
    }
    for (uint32_t i = 0; e == 0 && i < o->n; i++)
        if (rs[i]->text_mode && req_text_start(rs[i]) < 0) {
            e = -ENOMEM;
            snprintf(err, sizeof(err), "out of memory");
        }
    if (e < 0) {
        int st = e == -ENOTSUP ? RPC_FAILED_PRECONDITION : e == -ENOMEM ? RPC_RESOURCE_EXHAUSTED
                                                                        : RPC_INVALID_ARGUMENT;

        if (st == RPC_INVALID_ARGUMENT)
            co->m.rejected_invalid++;
        for (uint32_t i = 0; i < o->n; i++) {
            rs[i]->text_mode = false;   /* nothing to tear down */
            req_finish(rs[i], st, "%s", err[0] ? err : err_str(e));
            req_free_if_done(rs[i]);
        }
        goto out;
    }
    for (uint32_t i = 0; i < o->n; i++)
        req_admit(rs[i]);
out:
    free(rs);
    request_free(in);
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

/* A listed token equal to r's (rpc_secret_equal: the token is a secret). */
static bool token_listed(const struct req *r, char *const *tokens, size_t n)
{
    bool hit = false;

    for (size_t i = 0; i < n; i++)
        hit |= rpc_secret_equal(r->abort_token, tokens[i]);
    return hit;
}

int req_abort_by_id(struct coord *co, const char *id, const char *owner, char *const *tokens, size_t n_tokens)
{
    for (struct req *r = co->reqs; r; r = r->next) {
        if (!r->client || strcmp(r->id, id) != 0)
            continue;
        if (strcmp(r->owner, owner) != 0 && !token_listed(r, tokens, n_tokens))
            continue;
        if (r->ai.queued || req_held(r)) {
            req_end_waiting(r, RPC_OK, NULL);
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

    /* ending r may free others (the promotions of its slot and its place in the group):
     * after each one the scan starts again (ended requests are off their stream) */
    while (r) {
        if (r->in_out_tab && !r->ecall && r->deadline_ms != INT64_MAX && now > r->deadline_ms + 1000) {
            struct engine_conn *e = r->eng;
            log_req_warn(r->id, "engine %s did not end the request %" PRId64 " ms after its deadline",
                         e->addr, now - r->deadline_ms);
            req_send_abort(r);
            engine_out_remove(e, r);
            req_engine_end(r, RPC_DEADLINE_EXCEEDED, "the engine did not end the request by its deadline");
            req_free_if_done(r);
            r = co->reqs;
            continue;
        }
        r = r->next;
    }
}

void req_fail_all(struct coord *co, int status, const char *why)
{
    struct admit_item *it;

    /* the queue first, so that no slot freed below promotes a request */
    while ((it = admit_pop(&co->admit))) {
        struct req *r = (struct req *)((char *)it - offsetof(struct req, ai));

        req_finish(r, status, "%s", why);
        req_free_if_done(r);
    }
    while (co->held.n)
        req_end_waiting(held_head(co), status, why);
    /* nothing is freed in this loop: the requests end when their engine calls do */
    for (struct req *r = co->reqs; r; r = r->next) {
        if (r->client) {
            req_stop_engine(r);
            req_finish(r, status, "%s", why);
        }
    }
}
