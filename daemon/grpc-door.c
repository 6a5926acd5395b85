/* grpc-door.c - the gRPC front door: Inference.Generate.  The call's request (a
 * Stepd__V1__GenerateRequest) becomes a struct request (request.c), req_submit() serves
 * it as it serves every door, and this door's client ops (struct req_client_ops) send each
 * chunk and the final back as GenerateResponse messages on the call's stream.  The CQ
 * thread's admission gate (req_generate_cq) refuses a call at once when the server is full.
 * Loop thread only, but for req_generate_cq (the CQ thread). */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "log.h"
#include "media.h"
#include "pb-util.h"

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
    admit_published(&co->admit, &running, &queued);
    transit = atomic_load_explicit(&co->gate.in_transit, memory_order_acquire);
    cap = co->admit.max_running + co->admit.max_queue;      /* constant after start */
    if (running + queued + transit < cap) {
        atomic_fetch_add_explicit(&co->gate.in_transit, 1, memory_order_acq_rel);
        rpc_cq_set_mark(call, GATE_MARK_TRANSIT);
        return false;
    }
    /* full: the same answer the loop gives (req_generate_loop), without waiting for it */
    atomic_fetch_add_explicit(&co->gate.rejected_full, 1, memory_order_relaxed);
    if (transit)
        snprintf(msg, sizeof(msg), "server overloaded: %u running, %u queued and %u arriving (caps %u + %u)",
                 running, queued, transit, co->admit.max_running, co->admit.max_queue);
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

/* ------------------------------------------------------------------ the gRPC door */

/* Inference.Generate's stream as the client side of a request: each chunk and the final
 * rendered as a GenerateResponse. */

/* Send resp (its chunk or final set) with the request's id and, first, its abort token. */
static int grpc_send(struct req *r, Stepd__V1__GenerateResponse *resp)
{
    resp->request_id = r->id;
    if (!r->token_sent) {
        resp->abort_token = r->abort_token;
        r->token_sent = true;
    }
    return rpc_call_send(r->client, &resp->base);
}

static int grpc_chunk(struct req *r, const struct chunk *ch)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Chunk pc = STEPD__V1__CHUNK__INIT;
    Stepd__V1__Usage u = STEPD__V1__USAGE__INIT;
    Stepd__V1__ToolCallDelta tc[ch->n_tools ? ch->n_tools : 1];
    Stepd__V1__ToolCallDelta *ptc[ch->n_tools ? ch->n_tools : 1];
    Stepd__V1__TokenLogprob *lp = NULL, **plp = NULL;
    Stepd__V1__TopLogprob *top = NULL, **ptop = NULL;
    struct rpc_call *c = r->client;
    size_t n_top = 0;
    bool oom = false;
    int e;

    pc.n_token_ids = ch->n_token_ids;
    pc.token_ids = (int32_t *)ch->token_ids;
    pc.text = (char *)ch->text;
    pc.reasoning_delta = (char *)ch->reasoning;
    pc.content_delta = (char *)ch->content;
    for (size_t k = 0; k < ch->n_tools; k++) {
        stepd__v1__tool_call_delta__init(&tc[k]);
        tc[k].index = ch->tools[k].index;
        tc[k].id = (char *)ch->tools[k].id;
        tc[k].name = (char *)ch->tools[k].name;
        tc[k].arguments_delta = (char *)ch->tools[k].arguments;
        ptc[k] = &tc[k];
    }
    pc.n_tool_calls = ch->n_tools;
    pc.tool_calls = ptc;
    if (ch->has_usage) {
        u.prompt_tokens = ch->prompt_tokens;
        u.completion_tokens = ch->completion_tokens;
        pc.usage = &u;
    }
    if (ch->n_logprobs) {
        for (size_t i = 0; i < ch->n_logprobs; i++)
            n_top += ch->logprobs[i].n_top;
        lp = calloc(ch->n_logprobs, sizeof(*lp));
        plp = calloc(ch->n_logprobs, sizeof(*plp));
        top = calloc(n_top + 1, sizeof(*top));
        ptop = calloc(n_top + 1, sizeof(*ptop));
        if (!lp || !plp || !top || !ptop) {
            oom = true;
            e = -ENOMEM;
            goto out;
        }
        n_top = 0;
        for (size_t i = 0; i < ch->n_logprobs; i++) {
            stepd__v1__token_logprob__init(&lp[i]);
            lp[i].token_id = ch->logprobs[i].token_id;
            lp[i].logprob = ch->logprobs[i].logprob;
            lp[i].n_top = ch->logprobs[i].n_top;
            lp[i].top = &ptop[n_top];
            for (size_t k = 0; k < ch->logprobs[i].n_top; k++, n_top++) {
                stepd__v1__top_logprob__init(&top[n_top]);
                top[n_top].token_id = ch->logprobs[i].top[k].token_id;
                top[n_top].logprob = ch->logprobs[i].top[k].logprob;
                ptop[n_top] = &top[n_top];
            }
            plp[i] = &lp[i];
        }
        pc.n_logprobs = ch->n_logprobs;
        pc.logprobs = plp;
    }
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_CHUNK;
    resp.chunk = &pc;
    e = grpc_send(r, &resp);
out:
    free(lp);
    free(plp);
    free(top);
    free(ptop);
    if (oom) {
        /* the door gives up on its client as on a slow one */
        rpc_call_on_cancel(c, NULL, NULL);
        rpc_call_abort(c, RPC_INTERNAL, "out of memory");
        req_client_detach(r, RPC_INTERNAL, "out of memory");
    }
    if (e == -ENOBUFS) {
        /* A6: a client that stopped reading; queued messages would never let a normal
         * status through, so the stream is reset with the status */
        char msg[160];

        snprintf(msg, sizeof(msg), "client is not reading its stream (%zu bytes buffered, cap reached)",
                 rpc_call_queued_bytes(c));
        rpc_call_on_cancel(c, NULL, NULL);
        rpc_call_abort(c, RPC_RESOURCE_EXHAUSTED, msg);
        req_client_detach(r, RPC_RESOURCE_EXHAUSTED, msg);
    }
    return e;
}

static void grpc_final(struct req *r, const struct chunk_final *f)
{
    Stepd__V1__GenerateResponse resp = STEPD__V1__GENERATE_RESPONSE__INIT;
    Stepd__V1__Final pf = STEPD__V1__FINAL__INIT;
    Stepd__V1__Usage u = STEPD__V1__USAGE__INIT;
    Stepd__V1__Timings t = STEPD__V1__TIMINGS__INIT;
    Stepd__V1__MtpStats m = STEPD__V1__MTP_STATS__INIT;
    struct rpc_call *c = r->client;

    pf.finish_reason = (Stepd__V1__FinishReason)f->finish;
    pf.message = (char *)f->message;
#define U(x) u.x = f->x;
#define T(x) t.x = f->x;
#define M(x) m.x = f->x;
    CHUNK_USAGE_FIELDS(U)
    CHUNK_TIMING_FIELDS(T)
    CHUNK_MTP_FIELDS(M)
#undef U
#undef T
#undef M
    pf.usage = &u;
    pf.timings = &t;
    m.n_accepted_per_position = f->n_accepted_per_position;
    m.accepted_per_position = (uint32_t *)f->accepted_per_position;
    m.n_steps_by_num_drafts = f->n_steps_by_num_drafts;
    m.steps_by_num_drafts = (uint32_t *)f->steps_by_num_drafts;
    pf.mtp = &m;
    pf.group = (char *)f->group;
    pf.request_id = (char *)f->request_id;
    if (f->stop == CHUNK_STOP_STRING) {
        pf.matched_stop_case = STEPD__V1__FINAL__MATCHED_STOP_STOP_STRING;
        pf.stop_string = (char *)f->stop_string;
    } else if (f->stop == CHUNK_STOP_TOKEN) {
        pf.matched_stop_case = STEPD__V1__FINAL__MATCHED_STOP_STOP_TOKEN_ID;
        pf.stop_token_id = f->stop_token_id;
    }
    resp.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
    resp.final = &pf;
    (void)grpc_send(r, &resp);
    rpc_call_on_cancel(c, NULL, NULL);
    rpc_call_finish(c, RPC_OK, NULL);
}

static void grpc_end(struct req *r, int status, int retry_ms, const char *msg)
{
    struct rpc_call *c = r->client;
    char v[16];

    if (retry_ms > 0) {
        snprintf(v, sizeof(v), "%d", retry_ms);
        (void)rpc_call_add_trailer(c, "grpc-retry-pushback-ms", v);
    }
    rpc_call_on_cancel(c, NULL, NULL);
    rpc_call_finish(c, status, "%s", msg);
}

static void grpc_on_cancel(struct rpc_call *call, void *ud)
{
    req_client_cancel(ud);
}

static void grpc_watch(struct req *r)
{
    rpc_call_on_cancel(r->client, grpc_on_cancel, r);
}

static const struct req_client_ops grpc_ops = {
    .chunk = grpc_chunk, .final = grpc_final, .end = grpc_end, .watch = grpc_watch,
};

static void grpc_caller(const struct coord *co, const struct rpc_call *call, struct req_caller *c)
{
    char auth[512];

    memset(c, 0, sizeof(*c));
    if (co->o.api_key && rpc_call_metadata(call, "authorization", auth, sizeof(auth)) == 0 &&
        strncmp(auth, "Bearer ", 7) == 0) {
        c->keyed = true;
        c->key_hash = coord_fnv1a(auth + 7, strlen(auth + 7), COORD_FNV_SEED);
    }
    if (rpc_call_peer(call, c->peer, sizeof(c->peer)) < 0)
        snprintf(c->peer, sizeof(c->peer), "unknown");
}

/* pb's request in (e: request_from_proto's result, err its reason) with its images taken
 * (daemon/media.c: each decoded, checked and preprocessed as the chat door's; fetched: those
 * prepared off the loop), submitted or refused. */
static void generate_images(struct coord *co, struct rpc_call *call, const Stepd__V1__GenerateRequest *pb,
                            struct request *in, int e, struct media_fetch *fetched, char *err, size_t len)
{
    struct req_caller caller;
    void *client = call;

    if (e == 0 && (e = media_proto_images(pb, co->tok, wpool_serves_images(co), fetched, in, err, len)) < 0) {
        request_free(in);
        if (e == -ENOMEM)
            snprintf(err, len, "out of memory");
    }
    if (e < 0) {
        int st = e == -ENOMEM ? RPC_RESOURCE_EXHAUSTED : e == -EBUSY ? RPC_UNAVAILABLE : RPC_INVALID_ARGUMENT;

        if (st == RPC_INVALID_ARGUMENT)
            co->m.rejected_invalid++;
        co->m.status[st]++;
        log_req_info("-", "rejected: %s", err);
        rpc_call_finish(call, st, "%s", err);
        return;
    }
    grpc_caller(co, call, &caller);
    req_submit(co, in, &(struct req_origin){ .ops = &grpc_ops, .clients = &client, .n = 1,
                                             .deadline_ms = rpc_call_deadline_ms(call), .caller = &caller });
}

/* A call held while its images are decoded off the loop (media_proto_start). */
struct images_held {
    struct coord *co;
    struct rpc_call *call;
    const Stepd__V1__GenerateRequest *pb;   /* the call's: valid until it is finished */
    struct request *in;
    bool cancelled;
    struct media_fetch *f;
};

static void images_cancel(struct rpc_call *call, void *ud)
{
    struct images_held *h = ud;

    (void)call;
    log_req_info("-", "cancelling: the client went away while its images were decoded");
    h->cancelled = true;
    media_fetch_cancel(h->f);
}

static void images_done(struct media_fetch *f, void *ud)
{
    struct images_held *h = ud;
    char err[768] = "";

    if (h->cancelled) {
        log_req_info("-", "dropped: the client went away while its images were decoded");
        request_free(h->in);
        rpc_call_finish(h->call, RPC_CANCELLED, "cancelled while its images were decoded");
    } else {
        rpc_call_on_cancel(h->call, NULL, NULL);
        generate_images(h->co, h->call, h->pb, h->in, 0, f, err, sizeof(err));
    }
    media_fetch_free(f);
    free(h);
}

/* in's images (pb's) decoded off the loop: true when held (images_done goes on), else false
 * with *e 0 (none to decode) or the error (-EBUSY, -ENOMEM; in freed) and its reason in err. */
static bool images_hold(struct coord *co, struct rpc_call *call, const Stepd__V1__GenerateRequest *pb,
                        struct request *in, int *e, char *err, size_t len)
{
    struct images_held *h = calloc(1, sizeof(*h));
    int r = -ENOMEM;

    if (h) {
        *h = (struct images_held){ .co = co, .call = call, .pb = pb, .in = in };
        if ((r = media_proto_start(&co->loop, pb, co->tok, images_done, h, &h->f)) > 0) {
            rpc_call_on_cancel(call, images_cancel, h);
            return true;
        }
    }
    free(h);
    if (r < 0) {
        media_start_error(r, err, len);
        request_free(in);
    }
    *e = r < 0 ? r : 0;
    return false;
}

static void req_generate_loop(struct rpc_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct coord *co = ud;
    struct request *in = NULL;
    char err[768];
    int e;

    /* the cheapest refusals first, before the request is even converted */
    if (co->draining) {
        co->m.rejected_draining++;
        co->m.status[RPC_UNAVAILABLE]++;
        rpc_call_finish(call, RPC_UNAVAILABLE, "server is draining; retry on another replica");
        return;
    }
    if (rpc_call_deadline_ms(call) - rpc_now_ms() < 2) {
        co->m.status[RPC_DEADLINE_EXCEEDED]++;
        rpc_call_finish(call, RPC_DEADLINE_EXCEEDED, "deadline expired (or under 2 ms) on arrival");
        return;
    }
    if (co->admit.queued >= co->admit.max_queue &&
        (co->admit.running >= co->admit.max_running || co->admit.queued > 0)) {
        co->m.rejected_full++;
        co->m.status[RPC_RESOURCE_EXHAUSTED]++;
        rpc_call_add_trailer(call, "grpc-retry-pushback-ms", "100");
        rpc_call_finish(call, RPC_RESOURCE_EXHAUSTED, "server overloaded: %u running and %u queued (the caps)",
                        co->admit.running, co->admit.queued);
        return;
    }
    e = request_from_proto((const Stepd__V1__GenerateRequest *)msg, &in, err, sizeof(err));
    if (e == 0 && images_hold(co, call, (const Stepd__V1__GenerateRequest *)msg, in, &e, err, sizeof(err)))
        return;
    generate_images(co, call, (const Stepd__V1__GenerateRequest *)msg, in, e, NULL, err, sizeof(err));
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

