/* engine-rpc.c - the stepd.v1.Engine gRPC service of rank 0 over the engine's C API.
 *
 * Two threads meet here.  The service thread runs a libuv loop with the rpc/ glue;
 * every gRPC callback and every rpc_* call happens on it.  The engine thread calls
 * on_engine_out, which copies the output into an event, queues it under s->lock and
 * wakes the loop with uv_async_send.  A struct gen (one request) lives until the
 * engine's final output for it has been handled on the loop, so the engine never holds a
 * pointer to freed memory.  A Generate gen owns its call and finishes it then.
 *
 * Output streams (OpenOutputs + Submit): a struct ostream owns one OpenOutputs call and
 * the gens submitted to it.  handle_event appends their outputs to the stream's pending
 * batch (protobuf structs pointing into the events); on_wake sends one OutputBatch per
 * stream once every event of the wake-up is handled, then frees the events.  When the
 * stream ends (client cancel, client not reading, shutdown) its call is finished at once
 * and its gens are aborted; their later events are dropped, and the ostream is freed with
 * its last gen.  Generated protobuf-c names stay in this file.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "engine.h"
#include "log.h"
#include "pb-util.h"
#include "rpc.h"
#include "splitmix.h"
#include "stepd.pb-c.h"

#define P_GENERATE "/stepd.v1.Engine/Generate"
#define P_ABORT "/stepd.v1.Engine/Abort"
#define P_GETLOADS "/stepd.v1.Engine/GetLoads"
#define P_MODELINFO "/stepd.v1.Engine/GetModelInfo"
#define P_OPENOUTPUTS "/stepd.v1.Engine/OpenOutputs"
#define P_SUBMIT "/stepd.v1.Engine/Submit"

#define OSTREAM_MAX_ID_LEN 128
#define OSTREAM_BUFFER_BYTES ((size_t) 64 << 20)   /* queued send bytes before RESOURCE_EXHAUSTED */
#define OSTREAM_BATCH_BYTES ((size_t) 1 << 20)     /* a pending batch is split past this */

struct gen {
    struct engine_rpc *s;
    struct rpc_call *call;            /* Generate; NULL for a gen of an output stream */
    struct ostream *os;               /* Submit: the stream its outputs go to */
    struct gen *prev, *next;          /* s->gens, loop thread */
    struct gen *os_prev, *os_next;    /* os->gens */
    char id[ENGINE_MAX_ID_LEN + 1];
    bool usage_each;
    bool cancelled;
    bool overflow;
    bool ended;                       /* Generate: its call already finished (engine_rpc_fail_all) */
    int logprobs;                     /* top-N per token; -1 = none */
};

struct ev {
    struct ev *next;
    struct gen *g;
    bool finished;
    enum engine_finish finish;
    int32_t stop_token;
    char message[256];
    int n_prompt, n_cached, n_completion;
    struct spec_stats mtp;
    struct engine_timings tm;
    int n_tokens;
    /* the chunk's logprobs (requests that asked): protobuf messages built on the engine
     * thread, pointing into this allocation, after tokens[] */
    Stepd__V1__TokenLogprob **lp;
    size_t n_lp;
    int32_t tokens[];
};

/* A Final and the messages it points to (final_build). */
struct final_msg {
    Stepd__V1__Final fin;
    Stepd__V1__Usage usage;
    Stepd__V1__MtpStats mtp;
    Stepd__V1__Timings tm;
    uint32_t per_pos[SPEC_MAX_K];
    uint32_t by_k[SPEC_MAX_K + 1];
};

/* One EngineOutput of a pending batch.  Its pointers are set by out_link just before the
 * batch is sent (the array may move while it grows); token ids and messages point into
 * the wake-up's events. */
struct out {
    Stepd__V1__EngineOutput o;
    Stepd__V1__Chunk chunk;
    Stepd__V1__Usage usage;           /* the chunk's, when usage_each */
    Stepd__V1__EngineStatus status;
    struct final_msg fin;
    bool usage_each;
    size_t size_est;                  /* ~ packed bytes, for splitting batches */
    char id[ENGINE_MAX_ID_LEN + 1];   /* copied: the gen may be freed before the send */
};

/* One OpenOutputs call and the requests submitted to it (loop thread). */
struct ostream {
    struct engine_rpc *s;
    struct rpc_call *call;            /* NULL once the stream ended */
    struct ostream *prev, *next;      /* s->streams, while open */
    struct gen *gens;                 /* its gens not yet finished */
    int n_gens;
    struct out *outs;                 /* pending batch; storage kept between wake-ups */
    Stepd__V1__EngineOutput **ptrs;
    size_t n_outs, n_outs_max;
    char id[OSTREAM_MAX_ID_LEN + 1];
};

struct engine_rpc {
    struct engine *e;
    struct engine_rpc_opts o;
    char *strs[6];                    /* owned copies of the option strings */
    pthread_t thread;
    uv_loop_t loop;
    uv_async_t wake;
    uv_async_t stop;
    uv_async_t fail;                  /* engine_rpc_fail_all */
    char fail_msg[256];               /* under lock */
    struct rpc_ctx *ctx;
    struct rpc_server *srv;
    pthread_mutex_t lock;             /* events, start handshake */
    pthread_cond_t cond;
    struct ev *ev_head, *ev_tail;
    bool start_done;
    int start_rc;
    int port;
    struct err_buf start_err;
    /* loop thread */
    struct gen *gens;
    int n_gens;
    struct ostream *streams;          /* open output streams */
    int n_streams;                    /* ostreams not yet freed (open or draining) */
    bool stopping;
    bool srv_down;
    uint64_t id_ctr;
};

/* --- engine thread side --- */

/* Room for n tokens' logprobs with n_top alternatives each: pointers, messages, tops. */
static size_t lp_size(int n, int n_top)
{
    return (size_t) n * (sizeof(Stepd__V1__TokenLogprob *) + sizeof(Stepd__V1__TokenLogprob) +
                         (size_t) n_top * (sizeof(Stepd__V1__TopLogprob *) + sizeof(Stepd__V1__TopLogprob)));
}

/* The chunk's TokenLogprob messages for o, laid out in mem (lp_size bytes, pointer-aligned). */
static Stepd__V1__TokenLogprob **lp_build(const struct engine_output *o, void *mem)
{
    int n = o->n_tokens, n_top = o->logprobs[0].n_top;
    Stepd__V1__TokenLogprob **pp = mem;
    Stepd__V1__TokenLogprob *m = (void *) (pp + n);
    Stepd__V1__TopLogprob **tp = (void *) (m + n);
    Stepd__V1__TopLogprob *t = (void *) (tp + (size_t) n * (size_t) n_top);

    for (int i = 0; i < n; i++) {
        const struct engine_logprob *lp = &o->logprobs[i];

        stepd__v1__token_logprob__init(&m[i]);
        m[i].token_id = lp->token;
        m[i].logprob = lp->logprob;
        m[i].n_top = (size_t) lp->n_top;
        m[i].top = tp;
        for (int k = 0; k < lp->n_top; k++) {
            stepd__v1__top_logprob__init(t);
            t->token_id = lp->top_ids[k];
            t->logprob = lp->top_logprobs[k];
            *tp++ = t++;
        }
        pp[i] = &m[i];
    }
    return pp;
}

static void on_engine_out(void *ud, const struct engine_output *o)
{
    struct gen *g = ud;
    struct engine_rpc *s = g->s;
    size_t toks = ((size_t) o->n_tokens * sizeof(int32_t) + sizeof(void *) - 1) & ~(sizeof(void *) - 1);
    int n_top = o->logprobs && o->n_tokens ? o->logprobs[0].n_top : 0;
    size_t lps = o->logprobs && o->n_tokens ? lp_size(o->n_tokens, n_top) : 0;
    struct ev *ev = malloc(sizeof(*ev) + toks + lps);
    BUG_ON(!ev);
    ev->lp = lps ? lp_build(o, (char *) ev->tokens + toks) : NULL;
    ev->n_lp = lps ? (size_t) o->n_tokens : 0;
    ev->next = NULL;
    ev->g = g;
    ev->finished = o->finished;
    ev->finish = o->finish;
    ev->stop_token = o->stop_token;
    snprintf(ev->message, sizeof(ev->message), "%s", o->message ? o->message : "");
    ev->n_prompt = o->n_prompt;
    ev->n_cached = o->n_cached;
    ev->n_completion = o->n_completion;
    ev->mtp = o->mtp;
    ev->tm = o->timings;
    ev->n_tokens = o->n_tokens;
    memcpy(ev->tokens, o->tokens, (size_t) o->n_tokens * sizeof(int32_t));
    pthread_mutex_lock(&s->lock);
    if (s->ev_tail)
        s->ev_tail->next = ev;
    else
        s->ev_head = ev;
    s->ev_tail = ev;
    /* under the lock: teardown takes it before closing `wake`, so a final event handled
     * (and s freed) before this send returned cannot happen */
    uv_async_send(&s->wake);
    pthread_mutex_unlock(&s->lock);
}

/* --- loop thread: outputs --- */

static void maybe_exit(struct engine_rpc *s)
{
    if (s->stopping && s->srv_down && s->n_gens == 0 && s->n_streams == 0)
        uv_stop(&s->loop);
}

static Stepd__V1__FinishReason finish_reason(enum engine_finish f)
{
    switch (f) {
    case ENGINE_FINISH_STOP:
        return STEPD__V1__FINISH_REASON__FINISH_REASON_STOP;
    case ENGINE_FINISH_LENGTH:
        return STEPD__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    case ENGINE_FINISH_ABORT:
        return STEPD__V1__FINISH_REASON__FINISH_REASON_ABORT;
    default:
        return STEPD__V1__FINISH_REASON__FINISH_REASON_ERROR;
    }
}

static void usage_fill(Stepd__V1__Usage *u, const struct ev *ev)
{
    *u = (Stepd__V1__Usage) STEPD__V1__USAGE__INIT;
    u->prompt_tokens = (uint32_t) ev->n_prompt;
    u->completion_tokens = (uint32_t) ev->n_completion;
    u->cached_tokens = (uint32_t) ev->n_cached;
}

static void send_chunk(struct gen *g, const struct ev *ev)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Chunk chunk = STEPD__V1__CHUNK__INIT;
    Stepd__V1__Usage usage;
    resp.request_id = g->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = &chunk;
    chunk.n_token_ids = (size_t) ev->n_tokens;
    chunk.token_ids = (int32_t *) ev->tokens;
    chunk.n_logprobs = ev->n_lp;
    chunk.logprobs = ev->lp;
    if (g->usage_each) {
        usage_fill(&usage, ev);
        chunk.usage = &usage;
    }
    int r = rpc_call_send(g->call, &resp.base);
    if (r == -ENOBUFS && !g->overflow) {
        /* the client does not read: stop generating for it */
        g->overflow = true;
        const char *ids[1] = { g->id };
        engine_abort(g->s->e, ids, 1);
    }
}

/* Point m's Final at its sub-messages (again whenever m moved). */
static void final_link(struct final_msg *m)
{
    m->fin.usage = &m->usage;
    m->fin.mtp = &m->mtp;
    m->fin.timings = &m->tm;
    m->mtp.accepted_per_position = m->per_pos;
    m->mtp.steps_by_num_drafts = m->by_k;
}

/* Fill m with the Final of request id from its final event (Generate and output streams
 * alike); the strings point into id, ev and s. */
static void final_build(struct final_msg *m, struct engine_rpc *s, char *id, const struct ev *ev)
{
    *m = (struct final_msg) {
        .fin = STEPD__V1__FINAL__INIT,
        .usage = STEPD__V1__USAGE__INIT,
        .mtp = STEPD__V1__MTP_STATS__INIT,
        .tm = STEPD__V1__TIMINGS__INIT,
    };
    final_link(m);
    m->fin.finish_reason = finish_reason(ev->finish);
    m->fin.message = (char *) ev->message;
    m->fin.request_id = id;
    m->fin.group = (char *) (s->o.group ? s->o.group : "");
    if (ev->finish == ENGINE_FINISH_STOP && ev->stop_token >= 0) {
        m->fin.matched_stop_case = STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID;
        m->fin.stop_token_id = ev->stop_token;
    }
    usage_fill(&m->usage, ev);
    m->mtp.num_drafts = (uint32_t) ev->mtp.n_drafts;
    m->mtp.num_draft_tokens = (uint32_t) ev->mtp.n_draft_tokens;
    m->mtp.num_accepted_tokens = (uint32_t) ev->mtp.n_accepted;
    int k = engine_max_spec(s->e);
    for (int i = 0; i < k; i++)
        m->per_pos[i] = (uint32_t) ev->mtp.accepted_per_pos[i];
    m->mtp.n_accepted_per_position = (size_t) k;
    for (int i = 0; i <= k; i++)
        m->by_k[i] = (uint32_t) ev->mtp.steps_by_drafts[i];
    m->mtp.n_steps_by_num_drafts = (size_t) k + 1;
    m->tm.queue_s = ev->tm.queue_s;
    m->tm.prefill_s = ev->tm.prefill_s;
    m->tm.first_token_s = ev->tm.first_token_s;
    m->tm.decode_s = ev->tm.decode_s;
    m->tm.mean_inter_token_s = ev->tm.mean_inter_token_s;
    m->tm.e2e_s = ev->tm.e2e_s;
}

static int send_final(struct gen *g, const struct ev *ev)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    struct final_msg m;
    final_build(&m, g->s, g->id, ev);
    resp.request_id = g->id;
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
    resp.final = &m.fin;
    return rpc_call_send(g->call, &resp.base);
}

/* --- loop thread: output streams --- */

static void ostream_free(struct ostream *os)
{
    struct engine_rpc *s = os->s;
    free(os->outs);
    free(os->ptrs);
    free(os);
    s->n_streams--;
    maybe_exit(s);
}

/* End the stream: finish its call with status (hard: at once, dropping what is queued,
 * for a client that does not read), abort its requests in the engine and drop their
 * later outputs.  The ostream is freed with its last gen.  No-op once ended. */
static void ostream_end(struct ostream *os, int status, const char *msg, bool hard)
{
    struct engine_rpc *s = os->s;
    struct rpc_call *call = os->call;
    if (!call)
        return;
    os->call = NULL;
    os->n_outs = 0;
    if (os->prev)
        os->prev->next = os->next;
    else
        s->streams = os->next;
    if (os->next)
        os->next->prev = os->prev;
    os->prev = os->next = NULL;
    const char *ids[64];
    int n = 0;
    for (struct gen *g = os->gens; g; g = g->os_next) {
        ids[n++] = g->id;
        if (n == (int) ARRAY_SIZE(ids)) {
            engine_abort(s->e, ids, n);
            n = 0;
        }
    }
    if (n)
        engine_abort(s->e, ids, n);
    if (os->n_gens)
        log_info("output stream %s ended (%s): aborting its %d requests", os->id, msg, os->n_gens);
    if (hard)
        rpc_call_abort(call, status, msg);
    else
        rpc_call_finish(call, status, "%s", msg);
    if (os->n_gens == 0)
        ostream_free(os);
}

/* rpc_call_send failed on the stream's call */
static void ostream_send_failed(struct ostream *os, int r)
{
    char msg[192];
    if (r == -ECANCELED) {
        ostream_end(os, RPC_CANCELLED, "output stream cancelled", false);
        return;
    }
    if (r == -ENOBUFS)
        snprintf(msg, sizeof(msg), "output stream %s: client is not reading it", os->id);
    else
        snprintf(msg, sizeof(msg), "output stream %s: %s", os->id, err_str(r));
    ostream_end(os, RPC_RESOURCE_EXHAUSTED, msg, true);
}

static void on_os_cancel(struct rpc_call *call, void *ud)
{
    ostream_end(ud, RPC_CANCELLED, "output stream cancelled by the client", false);
}

static struct ostream *ostream_find(struct engine_rpc *s, const char *id)
{
    for (struct ostream *os = s->streams; os; os = os->next)
        if (strcmp(os->id, id) == 0)
            return os;
    return NULL;
}

/* A new output of gen g in the stream's pending batch (kind and id set), or NULL when out
 * of memory: the stream has ended then. */
static struct out *ostream_add(struct ostream *os, const struct gen *g,
                               Stepd__V1__EngineOutput__KindCase kind)
{
    if (os->n_outs == os->n_outs_max) {
        size_t n = os->n_outs_max ? os->n_outs_max * 2 : 16;
        struct out *outs = realloc(os->outs, n * sizeof(*outs));
        if (outs)
            os->outs = outs;
        Stepd__V1__EngineOutput **ptrs = outs ? realloc(os->ptrs, n * sizeof(*ptrs)) : NULL;
        if (!ptrs) {
            char msg[192];
            snprintf(msg, sizeof(msg), "output stream %s: out of memory", os->id);
            ostream_end(os, RPC_RESOURCE_EXHAUSTED, msg, true);
            return NULL;
        }
        os->ptrs = ptrs;
        os->n_outs_max = n;
    }
    struct out *x = &os->outs[os->n_outs++];
    size_t len = strlen(g->id);
    x->o = (Stepd__V1__EngineOutput) STEPD__V1__ENGINE_OUTPUT__INIT;
    x->o.kind_case = kind;
    memcpy(x->id, g->id, len + 1);
    x->size_est = 16 + len;
    return x;
}

static void out_link(struct out *x)
{
    x->o.request_id = x->id;
    switch (x->o.kind_case) {
    case STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK:
        x->chunk.usage = x->usage_each ? &x->usage : NULL;
        x->o.chunk = &x->chunk;
        break;
    case STEPD__V1__ENGINE_OUTPUT__KIND_FINAL:
        final_link(&x->fin);
        x->fin.fin.request_id = x->id;
        x->o.final = &x->fin.fin;
        break;
    default:
        x->o.status = &x->status;
        break;
    }
}

static void ostream_add_status(struct ostream *os, const struct gen *g, int code, const char *msg)
{
    struct out *x = ostream_add(os, g, STEPD__V1__ENGINE_OUTPUT__KIND_STATUS);
    if (!x)
        return;
    x->status = (Stepd__V1__EngineStatus) STEPD__V1__ENGINE_STATUS__INIT;
    x->status.code = code;
    x->status.message = (char *) msg;
    x->size_est += 8 + strlen(msg);
}

/* An event of a gen of an output stream: its outputs join the pending batch. */
static void ostream_handle_event(struct engine_rpc *s, struct gen *g, const struct ev *ev)
{
    struct ostream *os = g->os;
    if (os->call && ev->n_tokens > 0) {
        struct out *x = ostream_add(os, g, STEPD__V1__ENGINE_OUTPUT__KIND_CHUNK);
        if (x) {
            x->chunk = (Stepd__V1__Chunk) STEPD__V1__CHUNK__INIT;
            x->chunk.n_token_ids = (size_t) ev->n_tokens;
            x->chunk.token_ids = (int32_t *) ev->tokens;
            x->chunk.n_logprobs = ev->n_lp;
            x->chunk.logprobs = ev->lp;
            x->usage_each = g->usage_each;
            if (g->usage_each)
                usage_fill(&x->usage, ev);
            x->size_est += 8 + 5 * (size_t) ev->n_tokens;
            if (ev->n_lp)
                x->size_est += ev->n_lp * (12 + 12 * ev->lp[0]->n_top);
        }
    }
    if (!ev->finished)
        return;
    if (!os->call)
        ;                             /* the stream ended: dropped */
    else if (ev->finish == ENGINE_FINISH_DEADLINE)
        ostream_add_status(os, g, RPC_DEADLINE_EXCEEDED, ev->message);
    else if (ev->finish == ENGINE_FINISH_ERROR)
        ostream_add_status(os, g, RPC_UNAVAILABLE, ev->message);
    else if (ev->finish == ENGINE_FINISH_ABORT && s->stopping)
        ostream_add_status(os, g, RPC_UNAVAILABLE, "engine is shutting down");
    else {
        struct out *x = ostream_add(os, g, STEPD__V1__ENGINE_OUTPUT__KIND_FINAL);
        if (x) {
            final_build(&x->fin, s, x->id, ev);
            x->size_est += 160 + strlen(ev->message);
        }
    }
}

/* Send the pending batch: one OutputBatch, or several of ~OSTREAM_BATCH_BYTES. */
static void ostream_flush(struct ostream *os)
{
    size_t i = 0;
    while (i < os->n_outs) {
        Stepd__V1__OutputBatch b = STEPD__V1__OUTPUT_BATCH__INIT;
        size_t j = i, bytes = 0;
        while (j < os->n_outs && bytes < OSTREAM_BATCH_BYTES) {
            out_link(&os->outs[j]);
            os->ptrs[j] = &os->outs[j].o;
            bytes += os->outs[j].size_est;
            j++;
        }
        b.n_outputs = j - i;
        b.outputs = &os->ptrs[i];
        int r = rpc_call_send(os->call, &b.base);
        if (r < 0) {
            ostream_send_failed(os, r);   /* may free os */
            return;
        }
        i = j;
    }
    os->n_outs = 0;
}

static void gen_done(struct engine_rpc *s, struct gen *g)
{
    if (g->prev)
        g->prev->next = g->next;
    else
        s->gens = g->next;
    if (g->next)
        g->next->prev = g->prev;
    s->n_gens--;
    struct ostream *os = g->os;
    if (os) {
        if (g->os_prev)
            g->os_prev->os_next = g->os_next;
        else
            os->gens = g->os_next;
        if (g->os_next)
            g->os_next->os_prev = g->os_prev;
        os->n_gens--;
        if (!os->call && os->n_gens == 0)
            ostream_free(os);
    }
    free(g);
    maybe_exit(s);
}

static void handle_event(struct engine_rpc *s, struct ev *ev)
{
    struct gen *g = ev->g;
    if (g->os) {
        ostream_handle_event(s, g, ev);
        if (ev->finished)
            gen_done(s, g);
        return;
    }
    if (ev->n_tokens > 0 && !g->cancelled && !g->overflow && !g->ended)
        send_chunk(g, ev);
    if (!ev->finished)
        return;
    if (g->ended)
        ;                             /* finished by engine_rpc_fail_all */
    else if (g->cancelled)
        rpc_call_finish(g->call, RPC_CANCELLED, "request cancelled by the client");
    else if (g->overflow)
        rpc_call_finish(g->call, RPC_RESOURCE_EXHAUSTED, "request %s: client is not reading its stream",
                        g->id);
    else if (ev->finish == ENGINE_FINISH_DEADLINE)
        rpc_call_finish(g->call, RPC_DEADLINE_EXCEEDED, "request %s: %s", g->id, ev->message);
    else if (ev->finish == ENGINE_FINISH_ERROR)
        rpc_call_finish(g->call, RPC_UNAVAILABLE, "%s", ev->message);
    else if (ev->finish == ENGINE_FINISH_ABORT && s->stopping)
        rpc_call_finish(g->call, RPC_UNAVAILABLE, "engine is shutting down");
    else if (send_final(g, ev) < 0)
        rpc_call_finish(g->call, RPC_RESOURCE_EXHAUSTED, "request %s: client is not reading "
                        "its stream", g->id);
    else
        rpc_call_finish(g->call, RPC_OK, NULL);
    gen_done(s, g);
}

static void on_wake(uv_async_t *a)
{
    struct engine_rpc *s = a->data;
    pthread_mutex_lock(&s->lock);
    struct ev *ev = s->ev_head;
    s->ev_head = s->ev_tail = NULL;
    pthread_mutex_unlock(&s->lock);
    for (struct ev *e = ev; e; e = e->next)
        handle_event(s, e);
    /* the pending batches point into the events: free them after the sends */
    for (struct ostream *os = s->streams, *next; os; os = next) {
        next = os->next;
        if (os->n_outs)
            ostream_flush(os);
    }
    while (ev) {
        struct ev *next = ev->next;
        free(ev);
        ev = next;
    }
}

/* engine_rpc_fail_all on the loop: every output stream ends (aborting its requests), every
 * Generate call is finished and its request aborted; their gens stay until their finals. */
static void on_fail(uv_async_t *a)
{
    struct engine_rpc *s = a->data;
    char msg[256];
    int n = 0;

    pthread_mutex_lock(&s->lock);
    snprintf(msg, sizeof(msg), "%s", s->fail_msg);
    pthread_mutex_unlock(&s->lock);
    if (s->stopping)
        return;
    while (s->streams)
        ostream_end(s->streams, RPC_UNAVAILABLE, msg, false);
    for (struct gen *g = s->gens; g; g = g->next) {
        const char *ids[1] = { g->id };

        if (!g->call || g->ended || g->cancelled)
            continue;
        g->ended = true;
        rpc_call_on_cancel(g->call, NULL, NULL);
        rpc_call_finish(g->call, RPC_UNAVAILABLE, "request %s: %s", g->id, msg);
        engine_abort(s->e, ids, 1);
        n++;
    }
    log_warn("engine service: %s: in-flight requests failed UNAVAILABLE (%d Generate calls, "
             "every output stream)", msg, n);
}

void engine_rpc_fail_all(struct engine_rpc *s, const char *msg)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    snprintf(s->fail_msg, sizeof(s->fail_msg), "%s", msg);
    pthread_mutex_unlock(&s->lock);
    uv_async_send(&s->fail);
}

/* --- loop thread: handlers --- */

static void on_cancel(struct rpc_call *call, void *ud)
{
    struct gen *g = ud;
    if (g->cancelled)
        return;
    g->cancelled = true;
    const char *ids[1] = { g->id };
    engine_abort(g->s->e, ids, 1);
}

/* Fill q->sampling and friends from the proto; returns 0 or writes the bad field. */
static int convert_sampling(const Stepd__V1__SamplingParams *p, struct engine_request *q,
                            struct sampler_bias *bias, struct err_buf *err)
{
    struct sampling_params *sp = &q->sampling;
    sp->temperature = 1.0f;
    if (!p)
        return 0;
    if (PB_HAS(p, temperature))
        sp->temperature = p->temperature;
    if (PB_HAS(p, top_p))
        sp->top_p = p->top_p;
    if (PB_HAS(p, top_k)) {
        if (p->top_k < -1)
            return err_set(err, -EINVAL, "sampling_params.top_k: must be -1, 0 or >= 1");
        sp->top_k = p->top_k > 0 ? p->top_k : 0;
    }
    if (PB_HAS(p, min_p))
        sp->min_p = p->min_p;
    if (PB_HAS(p, repetition_penalty))
        sp->repetition_penalty = p->repetition_penalty;
    if (PB_HAS(p, presence_penalty))
        sp->presence_penalty = p->presence_penalty;
    if (PB_HAS(p, frequency_penalty))
        sp->frequency_penalty = p->frequency_penalty;
    if (PB_HAS(p, max_tokens)) {
        if (p->max_tokens < 1)
            return err_set(err, -EINVAL, "sampling_params.max_tokens: must be >= 1");
        q->max_tokens = p->max_tokens > INT_MAX ? INT_MAX : (int) p->max_tokens;
    }
    if (PB_HAS(p, min_tokens)) {
        if (p->min_tokens < 0 || p->min_tokens > INT_MAX)
            return err_set(err, -EINVAL, "sampling_params.min_tokens: must be >= 0");
        q->min_tokens = (int) p->min_tokens;
    }
    if (PB_HAS(p, seed)) {
        if (p->seed < 0)
            return err_set(err, -EINVAL, "sampling_params.seed: must be >= 0");
        sp->seed = (uint64_t) p->seed;
    }
    if (PB_HAS(p, logprobs)) {
        if (p->logprobs < 0 || p->logprobs > ENGINE_MAX_LOGPROBS)
            return err_set(err, -EINVAL, "sampling_params.logprobs: must be in [0, %d] (got %d)",
                           ENGINE_MAX_LOGPROBS, p->logprobs);
        q->logprobs = p->logprobs;
    }
    if (PB_HAS(p, n) && p->n != 1)
        return err_set(err, -EINVAL, "sampling_params.n: only 1 is served");
    if (PB_HAS(p, ignore_eos))
        q->ignore_eos = p->ignore_eos;
    if (p->n_stop > 0)
        return err_set(err, -EINVAL, "sampling_params.stop: stop strings need text input; the "
                       "engine takes token ids (use stop_token_ids)");
    if (p->n_stop_token_ids > ENGINE_MAX_STOP_IDS)
        return err_set(err, -EINVAL, "sampling_params.stop_token_ids: at most %d ids",
                       ENGINE_MAX_STOP_IDS);
    q->stop_token_ids = p->stop_token_ids;
    q->n_stop_token_ids = (int) p->n_stop_token_ids;
    if (p->n_logit_bias > 1024)
        return err_set(err, -EINVAL, "sampling_params.logit_bias: at most 1024 entries");
    for (size_t i = 0; i < p->n_logit_bias; i++) {
        bias[i].token = p->logit_bias[i]->key;
        bias[i].bias = p->logit_bias[i]->value;
    }
    sp->logit_bias = bias;
    sp->n_logit_bias = (int) p->n_logit_bias;
    return 0;
}

static int status_of(int rc)
{
    switch (rc) {
    case -EINVAL:
        return RPC_INVALID_ARGUMENT;
    case -EAGAIN:
    case -ENOMEM:
        return RPC_RESOURCE_EXHAUSTED;
    case -EEXIST:
        return RPC_ALREADY_EXISTS;
    case -ESHUTDOWN:
    case -EOPNOTSUPP:           /* structured output without the grammar engine */
        return RPC_UNAVAILABLE;
    default:
        return RPC_INTERNAL;
    }
}

/* The request's images (GenerateRequest.images) as the engine takes them: *ret_images
 * [n_images] followed by their views in one allocation (the pixels stay the message's;
 * engine_submit copies them).  Each image: a 32-byte sha256, views whose rgb holds
 * width x height RGB triplets, and its token_ids where token_position says in the prompt. */
static int images_from_proto(const Stepd__V1__GenerateRequest *in, struct engine_request *q,
                             struct engine_image **ret_images, struct err_buf *err)
{
    size_t nv = 0;
    *ret_images = NULL;
    if (in->n_images == 0)
        return 0;
    if (in->n_images > 64)
        return err_set(err, -EINVAL, "images: %zu images (at most 64)", in->n_images);
    for (size_t i = 0; i < in->n_images; i++)
        nv += in->images[i]->n_views;
    struct engine_image *im = calloc(1, in->n_images * sizeof(*im) + nv * sizeof(struct engine_view));
    if (!im)
        return err_set(err, -ENOMEM, "images: out of memory");
    struct engine_view *v = (struct engine_view *) (im + in->n_images);
    for (size_t i = 0; i < in->n_images; i++) {
        const Stepd__V1__ImageInput *x = in->images[i];
        size_t pos = x->token_position;
        if (x->data.len) {
            free(im);
            return err_set(err, -EINVAL, "images[%zu].data: the engine service takes preprocessed images "
                           "(encoded bytes go to the coordinator)", i);
        }
        if (x->sha256.len != sizeof(im[i].sha256)) {
            free(im);
            return err_set(err, -EINVAL, "images[%zu].sha256: %zu bytes (32 expected)", i, x->sha256.len);
        }
        if (x->n_token_ids && (pos > (size_t) q->n_prompt || x->n_token_ids > (size_t) q->n_prompt - pos ||
                               memcmp(q->prompt + pos, x->token_ids, x->n_token_ids * sizeof(int32_t)))) {
            free(im);
            return err_set(err, -EINVAL, "images[%zu].token_ids: not the prompt's tokens at position "
                           "%zu", i, pos);
        }
        memcpy(im[i].sha256, x->sha256.data, sizeof(im[i].sha256));
        im[i].views = v;
        im[i].n_views = (int) x->n_views;
        for (size_t j = 0; j < x->n_views; j++, v++) {
            const Stepd__V1__ImageView *w = x->views[j];
            if (w->width == 0 || w->height == 0 || w->width > 8192 || w->height > 8192 ||
                w->rgb.len != (size_t) w->width * w->height * 3) {
                free(im);
                return err_set(err, -EINVAL, "images[%zu].views[%zu]: %ux%u with %zu rgb bytes", i, j,
                               w->width, w->height, w->rgb.len);
            }
            *v = (struct engine_view){ (int) w->width, (int) w->height, w->rgb.data };
        }
    }
    q->images = im;
    q->n_images = (int) in->n_images;
    *ret_images = im;
    return 0;
}

static int build_request(struct engine_rpc *s, const Stepd__V1__GenerateRequest *in,
                         struct engine_request *q, struct sampler_bias *bias, char *id,
                         struct err_buf *err)
{
    engine_request_init(q);
    if (in->input_case != STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS || !in->token_ids)
        return err_set(err, -EINVAL, "input: the engine service takes token_ids only");
    if (in->model && in->model[0] && s->o.model_name && strcmp(in->model, s->o.model_name) != 0)
        return err_set(err, -EINVAL, "model: \"%s\" is not served here (\"%s\")", in->model,
                       s->o.model_name);
    if (in->token_ids->n_ids > INT_MAX)
        return err_set(err, -EINVAL, "token_ids: too many");
    size_t idlen = in->request_id ? strlen(in->request_id) : 0;
    if (idlen > ENGINE_MAX_ID_LEN)
        return err_set(err, -EINVAL, "request_id: longer than %d bytes", ENGINE_MAX_ID_LEN);
    if (idlen)
        memcpy(id, in->request_id, idlen + 1);
    else
        snprintf(id, ENGINE_MAX_ID_LEN + 1, "eng-%" PRIu64, ++s->id_ctr);
    q->id = id;
    q->prompt = in->token_ids->ids;
    q->n_prompt = (int) in->token_ids->n_ids;
    q->priority = in->priority;
    if (PB_HAS(in, num_speculative_tokens))
        q->num_speculative_tokens = in->num_speculative_tokens;
    if (in->cache_salt && in->cache_salt[0])
        q->cache_salt = in->cache_salt;
    int r = convert_sampling(in->sampling_params, q, bias, err);
    if (r < 0)
        return r;
    const Stepd__V1__StructuredOutput *so = in->structured_output;
    if (so && so->kind && so->kind[0]) {
        if (strcmp(so->kind, "json_schema") && strcmp(so->kind, "json_object") &&
            strcmp(so->kind, "regex") && strcmp(so->kind, "lark"))
            return err_set(err, -EINVAL, "structured_output.kind: \"%.32s\" is not one of "
                           "json_schema, json_object, regex, lark", so->kind);
        q->constraint_kind = so->kind;
        q->constraint = so->text ? so->text : "";
        if (PB_HAS(so, start_token))
            q->constraint_start = so->start_token;
    }
    if (!in->sampling_params || !PB_HAS(in->sampling_params, seed)) {
        q->sampling.seed = splitmix64((uint64_t) engine_now_usec() ^ (s->id_ctr++ << 20));
        q->seed_random = true;
    }
    return 0;
}

/* Admit request in for g (g->s and g->call or g->os set): call's deadline is the
 * request's.  On failure finishes call with the admission status (INVALID_ARGUMENT and
 * ALREADY_EXISTS details name the field after field_prefix) and returns < 0; g stays the
 * caller's.  On success the engine holds g until its final output. */
static int gen_submit(struct gen *g, struct rpc_call *call, const Stepd__V1__GenerateRequest *in,
                      const char *field_prefix)
{
    struct engine_rpc *s = g->s;
    struct err_buf err = { { 0 } };
    struct sampler_bias *bias = NULL;
    size_t nb = in->sampling_params ? in->sampling_params->n_logit_bias : 0;
    if (nb && nb <= 1024) {
        bias = calloc(nb, sizeof(*bias));
        if (!bias) {
            rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
            return -ENOMEM;
        }
    }
    struct engine_request q;
    struct engine_image *images = NULL;
    int r = build_request(s, in, &q, bias, g->id, &err);
    if (r == 0)
        r = images_from_proto(in, &q, &images, &err);
    int64_t dl = rpc_call_deadline_ms(call);
    if (r == 0 && dl != INT64_MAX) {
        int64_t left_ms = dl - rpc_now_ms();
        q.deadline_usec = engine_now_usec() + (left_ms > 0 ? left_ms * 1000 : 1);
    }
    g->usage_each = in->stream_options && in->stream_options->continuous_usage_stats;
    if (r == 0)
        r = engine_submit(s->e, &q, on_engine_out, g, &err);
    free(bias);
    free(images);
    if (r < 0) {
        if (r == -EAGAIN)   /* queue full: tell well-behaved clients when to retry */
            (void) rpc_call_add_trailer(call, "grpc-retry-pushback-ms", "100");
        bool field = err.msg[0] && (r == -EINVAL || r == -EEXIST);
        rpc_call_finish(call, status_of(r), "%s%s", field ? field_prefix : "",
                        err.msg[0] ? err.msg : err_str(r));
        return r;
    }
    g->next = s->gens;
    if (s->gens)
        s->gens->prev = g;
    s->gens = g;
    s->n_gens++;
    return 0;
}

static void h_generate(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    const Stepd__V1__GenerateRequest *in = (const void *) req;
    if (s->stopping) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "engine is shutting down");
        return;
    }
    struct gen *g = calloc(1, sizeof(*g));
    if (!g) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    g->s = s;
    g->call = call;
    if (gen_submit(g, call, in, "") < 0) {
        free(g);
        return;
    }
    rpc_call_on_cancel(call, on_cancel, g);
}

static void h_open_outputs(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    const Stepd__V1__OpenOutputsRequest *in = (const void *) req;
    Stepd__V1__OutputBatch ack = STEPD__V1__OUTPUT_BATCH__INIT;
    size_t len = in->stream_id ? strlen(in->stream_id) : 0;
    if (s->stopping) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "engine is shutting down");
        return;
    }
    if (len == 0 || len > OSTREAM_MAX_ID_LEN) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "stream_id: must be 1..%d bytes",
                        OSTREAM_MAX_ID_LEN);
        return;
    }
    if (ostream_find(s, in->stream_id)) {
        rpc_call_finish(call, RPC_ALREADY_EXISTS, "stream_id: '%s' is already open", in->stream_id);
        return;
    }
    struct ostream *os = calloc(1, sizeof(*os));
    if (!os) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    os->s = s;
    os->call = call;
    memcpy(os->id, in->stream_id, len + 1);
    os->next = s->streams;
    if (s->streams)
        s->streams->prev = os;
    s->streams = os;
    s->n_streams++;
    rpc_call_set_buffer_cap(call, s->o.output_stream_buffer ? s->o.output_stream_buffer : OSTREAM_BUFFER_BYTES);
    rpc_call_on_cancel(call, on_os_cancel, os);
    int r = rpc_call_send(call, &ack.base);      /* the stream is open */
    if (r < 0)
        ostream_send_failed(os, r);
}

static void h_submit(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    const Stepd__V1__SubmitRequest *in = (const void *) req;
    Stepd__V1__SubmitResponse resp = STEPD__V1__SUBMIT_RESPONSE__INIT;
    if (s->stopping) {
        rpc_call_finish(call, RPC_UNAVAILABLE, "engine is shutting down");
        return;
    }
    if (!in->request) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request: required");
        return;
    }
    if (!in->request->request_id || !in->request->request_id[0]) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request.request_id: required with Submit");
        return;
    }
    struct ostream *os = ostream_find(s, in->stream_id ? in->stream_id : "");
    if (!os) {
        rpc_call_finish(call, RPC_FAILED_PRECONDITION, "stream_id: no open output stream '%.*s'",
                        OSTREAM_MAX_ID_LEN, in->stream_id ? in->stream_id : "");
        return;
    }
    struct gen *g = calloc(1, sizeof(*g));
    if (!g) {
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    g->s = s;
    g->os = os;
    if (gen_submit(g, call, in->request, "request.") < 0) {
        free(g);
        return;
    }
    g->os_next = os->gens;
    if (os->gens)
        os->gens->os_prev = g;
    os->gens = g;
    os->n_gens++;
    (void) rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_abort(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    const Stepd__V1__AbortRequest *in = (const void *) req;
    Stepd__V1__AbortResponse resp = STEPD__V1__ABORT_RESPONSE__INIT;
    if (in->n_request_ids > 4096) {
        rpc_call_finish(call, RPC_INVALID_ARGUMENT, "request_ids: at most 4096");
        return;
    }
    resp.aborted = (uint32_t) engine_abort(s->e, (const char *const *) in->request_ids,
                                           (int) in->n_request_ids);
    (void) rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_getloads(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    struct engine_loads l;
    Stepd__V1__GetLoadsResponse resp = STEPD__V1__GET_LOADS_RESPONSE__INIT;
    Stepd__V1__GroupLoad gl = STEPD__V1__GROUP_LOAD__INIT;
    Stepd__V1__GroupLoad *list[1] = { &gl };
    Stepd__V1__KvPoolLoad pool[_KV_GROUP_MAX], *pools[_KV_GROUP_MAX];
    static const char *const kinds[_KV_GROUP_MAX] = {
        [KV_GROUP_FULL] = "full_attention", [KV_GROUP_SLIDING] = "sliding_window",
    };
    engine_get_loads(s->e, &l);
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        pool[g] = (Stepd__V1__KvPoolLoad) STEPD__V1__KV_POOL_LOAD__INIT;
        pool[g].kind = (char *) kinds[g];
        pool[g].blocks_used = (uint32_t) l.kv_pool[g].used;
        pool[g].blocks_total = (uint32_t) l.kv_pool[g].total;
        pool[g].blocks_cached = (uint32_t) l.kv_pool[g].cached;
        pool[g].usage = l.kv_pool[g].total ? (double) l.kv_pool[g].used / l.kv_pool[g].total : 0;
        pools[g] = &pool[g];
    }
    gl.n_kv_pools = _KV_GROUP_MAX;
    gl.kv_pools = pools;
    gl.prefix_cache_queries = l.prefix_queries;
    gl.prefix_cache_hits = l.prefix_hits;
    gl.image_encodes = l.image_encodes;
    gl.image_cache_hits = l.image_cache_hits;
    gl.group = (char *) (s->o.group ? s->o.group : "");
    gl.num_running = (uint32_t) l.n_running;
    gl.num_waiting = (uint32_t) l.n_waiting;
    gl.kv_blocks_used = (uint32_t) l.kv_blocks_used;
    gl.kv_blocks_total = (uint32_t) l.kv_blocks_total;
    gl.kv_usage = l.kv_usage;
    gl.num_preemptions = l.n_preemptions;
    gl.tokens_per_s = l.tokens_per_s;
    gl.mean_acceptance_length = l.mean_accept_len;
    gl.num_requests_alive = (uint32_t) l.n_alive;
    gl.requests_created = l.n_requests_created;
    gl.requests_freed = l.n_requests_freed;
    gl.max_num_seqs = (uint32_t) l.max_num_seqs;
    gl.max_waiting = (uint32_t) l.max_waiting;
    uint64_t by_k[SPEC_MAX_K + 1];
    for (int i = 0; i <= engine_max_spec(s->e); i++)
        by_k[i] = l.mtp.steps_by_drafts[i];
    gl.steps_by_num_drafts = by_k;
    gl.n_steps_by_num_drafts = (size_t) engine_max_spec(s->e) + 1;
    resp.n_loads = 1;
    resp.loads = list;
    (void) rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

static void h_modelinfo(struct rpc_call *call, const ProtobufCMessage *req, void *ud)
{
    struct engine_rpc *s = ud;
    const struct engine_config *c = engine_get_config(s->e);
    Stepd__V1__GetModelInfoResponse resp = STEPD__V1__GET_MODEL_INFO_RESPONSE__INIT;
    int32_t eos[ENGINE_MAX_EOS];
    resp.model_name = (char *) (s->o.model_name ? s->o.model_name : "");
    resp.model_type = (char *) (s->o.model_type ? s->o.model_type : "");
    resp.quantization = (char *) (s->o.quantization ? s->o.quantization : "");
    resp.vocab_size = (uint32_t) engine_vocab_size(s->e);
    resp.max_model_len = (uint32_t) c->max_model_len;
    for (int i = 0; i < c->n_eos; i++)
        eos[i] = c->eos_ids[i];
    resp.n_eos_token_ids = (size_t) c->n_eos;
    resp.eos_token_ids = eos;
    resp.num_layers = (uint32_t) s->o.num_layers;
    resp.hidden_size = (uint32_t) s->o.hidden_size;
    resp.num_experts = (uint32_t) s->o.num_experts;
    resp.num_experts_per_tok = (uint32_t) s->o.num_experts_per_tok;
    resp.num_mtp_layers = (uint32_t) engine_max_spec(s->e);
    resp.max_num_speculative_tokens = (uint32_t) engine_max_spec(s->e);
    resp.supports_chat = false;
    resp.supports_text = false;
    resp.supports_images = c->vision != NULL;
    (void) rpc_call_send(call, &resp.base);
    rpc_call_finish(call, RPC_OK, NULL);
}

/* --- lifecycle --- */

static void on_srv_down(void *ud)
{
    struct engine_rpc *s = ud;
    s->srv_down = true;
    maybe_exit(s);
}

static void on_stop(uv_async_t *a)
{
    struct engine_rpc *s = a->data;
    if (s->stopping)
        return;
    s->stopping = true;
    rpc_server_shutdown(s->srv, on_srv_down, s);
    while (s->streams)
        ostream_end(s->streams, RPC_UNAVAILABLE, "engine is shutting down", false);
    rpc_server_cancel_all(s->srv);
}

static int serve_setup(struct engine_rpc *s)
{
    struct err_buf *err = &s->start_err;
    int r = rpc_ctx_create(&s->loop, &s->ctx);
    if (r < 0)
        return err_set(err, r, "engine service: cannot create the gRPC context: %s", err_str(r));
    struct rpc_server_opts so = { .api_key = s->o.api_key, .key_name = "cluster key",
                                  .max_recv_msg_bytes = s->o.max_recv_msg_bytes };
    r = rpc_server_create(s->ctx, &so, &s->srv);
    if (r < 0)
        return err_set(err, r, "engine service: cannot create the server: %s", err_str(r));
    const struct rpc_method methods[] = {
        { P_GENERATE, &stepd__v1__generate_request__descriptor, true, false, h_generate, s },
        { P_ABORT, &stepd__v1__abort_request__descriptor, false, false, h_abort, s },
        { P_GETLOADS, &stepd__v1__get_loads_request__descriptor, false, false, h_getloads, s },
        { P_MODELINFO, &stepd__v1__get_model_info_request__descriptor, false, false, h_modelinfo, s },
        { P_OPENOUTPUTS, &stepd__v1__open_outputs_request__descriptor, true, false, h_open_outputs, s },
        { P_SUBMIT, &stepd__v1__submit_request__descriptor, false, false, h_submit, s },
    };
    for (size_t i = 0; i < ARRAY_SIZE(methods); i++) {
        r = rpc_server_add_method(s->srv, &methods[i]);
        if (r < 0)
            return err_set(err, r, "engine service: %s: %s", methods[i].path, err_str(r));
    }
    r = rpc_server_listen(s->srv, s->o.addr, &s->port);
    if (r < 0)
        return err_set(err, r, "engine service: cannot listen on %s: %s", s->o.addr, err_str(r));
    r = rpc_server_start(s->srv);
    if (r < 0)
        return err_set(err, r, "engine service: cannot start: %s", err_str(r));
    return 0;
}

static void close_cb(uv_handle_t *h)
{
}

static void serve_teardown(struct engine_rpc *s)
{
    if (s->srv) {
        if (!s->srv_down) {
            rpc_server_shutdown(s->srv, on_srv_down, s);
            while (!s->srv_down)
                uv_run(&s->loop, UV_RUN_ONCE);
        }
        /* The shutdown completes once the connections are gone, which does not wait for
         * the last completions of a call finished just before (an output stream's status
         * sent as cancel_all cut the connection): let them free the call first, as the
         * coordinator's exit_poll_cb does. */
        int64_t end_ms = rpc_now_ms() + 3000;
        while (rpc_ctx_live_calls(s->ctx) > 0 && rpc_now_ms() < end_ms) {
            uv_run(&s->loop, UV_RUN_NOWAIT);
            if (rpc_ctx_live_calls(s->ctx) > 0)
                usleep(1000);
        }
        rpc_server_destroy(s->srv);
        s->srv = NULL;
    }
    if (s->ctx) {
        rpc_ctx_destroy(s->ctx);
        s->ctx = NULL;
    }
    pthread_mutex_lock(&s->lock);     /* waits for an on_engine_out still sending */
    pthread_mutex_unlock(&s->lock);
    uv_close((uv_handle_t *) &s->wake, close_cb);
    uv_close((uv_handle_t *) &s->stop, close_cb);
    uv_close((uv_handle_t *) &s->fail, close_cb);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    (void) uv_loop_close(&s->loop);
}

static void *serve_thread(void *arg)
{
    struct engine_rpc *s = arg;
    int r = serve_setup(s);
    pthread_mutex_lock(&s->lock);
    s->start_rc = r;
    s->start_done = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    if (r == 0)
        uv_run(&s->loop, UV_RUN_DEFAULT);
    serve_teardown(s);
    return NULL;
}

static void rpc_free(struct engine_rpc *s)
{
    for (size_t i = 0; i < ARRAY_SIZE(s->strs); i++)
        free(s->strs[i]);
    pthread_cond_destroy(&s->cond);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static const char *dup_opt(struct engine_rpc *s, int i, const char *v)
{
    if (!v)
        return NULL;
    s->strs[i] = strdup(v);
    return s->strs[i];
}

int engine_rpc_start(struct engine *e, const struct engine_rpc_opts *o, struct engine_rpc **ret,
                     int *ret_port, struct err_buf *err)
{
    if (!e || !o || !o->addr)
        return err_set(err, -EINVAL, "engine service: no address");
    struct engine_rpc *s = calloc(1, sizeof(*s));
    if (!s)
        return -ENOMEM;
    s->e = e;
    s->o = *o;
    s->o.addr = dup_opt(s, 0, o->addr);
    s->o.api_key = dup_opt(s, 1, o->api_key);
    s->o.group = dup_opt(s, 2, o->group);
    s->o.model_name = dup_opt(s, 3, o->model_name);
    s->o.model_type = dup_opt(s, 4, o->model_type);
    s->o.quantization = dup_opt(s, 5, o->quantization);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    int r = uv_loop_init(&s->loop);
    if (r < 0) {
        rpc_free(s);
        return err_set(err, -EIO, "engine service: uv_loop_init: %s", uv_strerror(r));
    }
    uv_async_init(&s->loop, &s->wake, on_wake);
    uv_async_init(&s->loop, &s->stop, on_stop);
    uv_async_init(&s->loop, &s->fail, on_fail);
    s->wake.data = s;
    s->stop.data = s;
    s->fail.data = s;
    r = pthread_create(&s->thread, NULL, serve_thread, s);
    if (r) {
        uv_close((uv_handle_t *) &s->wake, close_cb);
        uv_close((uv_handle_t *) &s->stop, close_cb);
        uv_close((uv_handle_t *) &s->fail, close_cb);
        uv_run(&s->loop, UV_RUN_DEFAULT);
        (void) uv_loop_close(&s->loop);
        rpc_free(s);
        return err_set(err, -r, "engine service: cannot start its thread");
    }
    pthread_mutex_lock(&s->lock);
    while (!s->start_done)
        pthread_cond_wait(&s->cond, &s->lock);
    r = s->start_rc;
    pthread_mutex_unlock(&s->lock);
    if (r < 0) {
        pthread_join(s->thread, NULL);
        if (err)
            *err = s->start_err;
        rpc_free(s);
        return r;
    }
    log_info("engine service listening on %s (port %d)", s->o.addr, s->port);
    if (ret_port)
        *ret_port = s->port;
    *ret = s;
    return 0;
}

void engine_rpc_stop(struct engine_rpc *s)
{
    if (!s)
        return;
    uv_async_send(&s->stop);
    pthread_join(s->thread, NULL);
    /* events left (none when every gen finished) */
    while (s->ev_head) {
        struct ev *ev = s->ev_head;
        s->ev_head = ev->next;
        free(ev);
    }
    rpc_free(s);
}
