/* call.c - server calls: the decoded request, the send queue and its pump, trailers and
 * status, cancellation, authorization, and the calls answered on the CQ thread. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "err.h"
#include "log.h"
#include "rpc-int.h"

static void call_pump(struct rpc_call *c);
static void call_send_failed(struct rpc_call *c, grpc_call_error e);
static void call_on_new(struct rpc_op *op, bool ok);

static void call_free(struct rpc_call *c)
{
    struct rpc_server *s = c->s;

    if (c->handed) {
        if (c->prev)
            c->prev->next = c->next;
        else
            s->calls = c->next;
        if (c->next)
            c->next->prev = c->prev;
        s->ctx->live_calls--;
    }
    while (c->sq_len) {
        grpc_byte_buffer_destroy(c->sq[c->sq_head]);
        c->sq_head = (c->sq_head + 1) % c->sq_cap;
        c->sq_len--;
    }
    free(c->sq);
    if (c->req)
        protobuf_c_message_free_unpacked(c->req, NULL);
    if (c->payload)
        grpc_byte_buffer_destroy(c->payload);
    grpc_metadata_array_destroy(&c->md);
    if (!c->rm)
        grpc_call_details_destroy(&c->details);
    for (int i = 0; i < c->n_trailers; i++) {
        grpc_slice_unref(c->trailers[i].key);
        grpc_slice_unref(c->trailers[i].value);
    }
    if (c->finish_requested)
        grpc_slice_unref(c->status_details);
    if (c->call && !rpc__sender_defer_unref(s->ctx, c->call))
        grpc_call_unref(c->call);
    free(c);
}

static void call_maybe_free(struct rpc_call *c)
{
    if (!c->close_started || c->close_done)
        if (c->finish_requested && c->status_done && !c->send_in_flight)
            call_free(c);
}

static void call_on_close(struct rpc_op *op, bool ok)
{
    struct rpc_call *c = (struct rpc_call *)((char *)op - offsetof(struct rpc_call, op_close));

    c->close_done = true;
    if (c->close_cancelled || !ok) {
        c->cancelled = true;
        if (!c->finish_requested) {
            if (c->cancel_fn) {
                rpc_cancel_fn fn = c->cancel_fn;
                c->cancel_fn = NULL;
                fn(c, c->cancel_ud);   /* may call rpc_call_finish() (and free c) */
            }
            return;                    /* rpc_call_finish() releases the call */
        }
        call_pump(c);                  /* drops queued messages */
    }
    call_maybe_free(c);
}

static void call_on_send(struct rpc_op *op, bool ok)
{
    struct rpc_call *c = (struct rpc_call *)((char *)op - offsetof(struct rpc_call, op_send));

    c->send_in_flight = false;
    if (c->cur_send) {
        grpc_byte_buffer_destroy(c->cur_send);
        c->cur_send = NULL;
        c->queued_bytes -= c->cur_send_len;
    }
    if (c->status_in_batch)
        c->status_done = true;
    if (!ok)
        c->cancelled = true;          /* transport gone; drop the rest */
    call_pump(c);
    call_maybe_free(c);
}

/* What a send batch of a call carries (call_pump decides, rpc__call_send_ops builds it). */
enum { SEND_MD = 1, SEND_MSG = 2, SEND_STATUS = 4 };

/* The ops of a send batch, from the call's fields: c->cur_send and the status do not
 * change while the send is in flight (send_in_flight), so the sender thread may build
 * them too (rpc_ctx_uncork). */
size_t rpc__call_send_ops(struct rpc_call *c, unsigned what, grpc_op ops[3])
{
    size_t n = 0;

    memset(ops, 0, 3 * sizeof(*ops));
    if (what & SEND_MD)
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (what & SEND_MSG) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->cur_send;
    }
    if (what & SEND_STATUS) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = (grpc_status_code)c->status;
        ops[n].data.send_status_from_server.status_details = &c->status_details;
        ops[n].data.send_status_from_server.trailing_metadata_count = (size_t)c->n_trailers;
        ops[n].data.send_status_from_server.trailing_metadata = c->trailers;
        n++;
    }
    return n;
}

static void call_pump(struct rpc_call *c)
{
    unsigned what = 0;

    if (c->send_in_flight || c->status_done)
        return;
    if (c->cancelled) {
        while (c->sq_len) {
            grpc_byte_buffer_destroy(c->sq[c->sq_head]);
            c->sq_head = (c->sq_head + 1) % c->sq_cap;
            c->sq_len--;
        }
        c->queued_bytes = 0;
        if (c->finish_requested)
            c->status_done = true;
        return;
    }
    if (c->sq_len == 0 && !c->finish_requested)
        return;
    if (!c->md_sent) {
        what |= SEND_MD;
        c->md_sent = true;
    }
    if (c->sq_len) {
        c->cur_send = c->sq[c->sq_head];
        c->cur_send_len = grpc_byte_buffer_length(c->cur_send);
        c->sq_head = (c->sq_head + 1) % c->sq_cap;
        c->sq_len--;
        what |= SEND_MSG;
    }
    if (c->sq_len == 0 && c->finish_requested) {
        what |= SEND_STATUS;
        c->status_in_batch = true;
    }
    c->send_in_flight = true;
    if (c->s->ctx->corked && rpc__pend_add(c->s->ctx, c, what) == 0)
        return;
    grpc_op ops[3];
    size_t n = rpc__call_send_ops(c, what, ops);
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->op_send, NULL);
    if (e != GRPC_CALL_OK)
        call_send_failed(c, e);
}

static void call_send_failed(struct rpc_call *c, grpc_call_error e)
{
    log_error("rpc: %s: start_batch(send) failed: %d", c->method_name, (int)e);
    c->send_in_flight = false;
    c->cancelled = true;
    if (c->cur_send) {
        grpc_byte_buffer_destroy(c->cur_send);
        c->cur_send = NULL;
    }
    if (c->finish_requested)
        c->status_done = true;
}

void rpc_call_on_cancel(struct rpc_call *c, rpc_cancel_fn fn, void *ud)
{
    c->cancel_fn = fn;
    c->cancel_ud = ud;
}

int rpc_call_send(struct rpc_call *c, const ProtobufCMessage *msg)
{
    size_t len;

    if (c->finish_requested)
        return -EINVAL;
    if (c->cancelled)
        return -ECANCELED;
    if (c->queued_bytes > (c->buffer_cap ? c->buffer_cap : c->s->opts.max_call_buffer_bytes))
        return -ENOBUFS;
    if (c->sq_len == c->sq_cap) {
        size_t ncap = c->sq_cap ? c->sq_cap * 2 : 8;
        grpc_byte_buffer **n = malloc(ncap * sizeof(*n));
        if (!n)
            return -ENOMEM;
        for (size_t i = 0; i < c->sq_len; i++)
            n[i] = c->sq[(c->sq_head + i) % c->sq_cap];
        free(c->sq);
        c->sq = n;
        c->sq_head = 0;
        c->sq_cap = ncap;
    }
    grpc_byte_buffer *bb = rpc__bb_encode(msg, &len);
    c->sq[(c->sq_head + c->sq_len) % c->sq_cap] = bb;
    c->sq_len++;
    c->queued_bytes += len;
    call_pump(c);
    return 0;
}

int rpc_call_add_trailer(struct rpc_call *c, const char *key, const char *value)
{
    if (c->n_trailers >= RPC_MAX_TRAILERS || c->finish_requested)
        return -ENOSPC;
    c->trailers[c->n_trailers].key = grpc_slice_from_copied_string(key);
    c->trailers[c->n_trailers].value = grpc_slice_from_copied_string(value);
    c->n_trailers++;
    return 0;
}

void rpc_call_finish(struct rpc_call *c, int status, const char *fmt, ...)
{
    char msg[1024] = "";

    if (c->finish_requested) {
        log_error("rpc: %s: rpc_call_finish called twice", c->method_name);
        abort();
    }
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
    }
    c->finish_requested = true;
    c->status = status;
    c->status_details = grpc_slice_from_copied_string(msg);
    call_pump(c);
    call_maybe_free(c);
}

void rpc_call_abort(struct rpc_call *c, int status, const char *msg)
{
    if (c->finish_requested) {
        log_error("rpc: %s: rpc_call_abort after finish", c->method_name);
        abort();
    }
    c->finish_requested = true;
    c->status = status;
    c->status_details = grpc_slice_from_copied_string(msg ? msg : "");
    grpc_call_cancel_with_status(c->call, (grpc_status_code)status, msg ? msg : "", NULL);
    c->cancelled = true;
    call_pump(c);
    call_maybe_free(c);
}

int64_t rpc_call_deadline_ms(const struct rpc_call *c)
{
    return rpc__deadline_to_ms(c->deadline);
}

int rpc_call_metadata(const struct rpc_call *c, const char *key, char *buf, size_t len)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == kl && memcmp(GRPC_SLICE_START_PTR(m->key), key, kl) == 0) {
            size_t vl = GRPC_SLICE_LENGTH(m->value);
            if (len == 0)
                return -ENOSPC;
            if (vl >= len)
                vl = len - 1;
            memcpy(buf, GRPC_SLICE_START_PTR(m->value), vl);
            buf[vl] = '\0';
            return 0;
        }
    }
    return -ENOENT;
}

int rpc_call_peer(const struct rpc_call *c, char *buf, size_t len)
{
    char *peer;
    int r = 0;

    if (len == 0)
        return -ENOSPC;
    peer = c->call ? grpc_call_get_peer(c->call) : NULL;
    if (!peer || !peer[0])
        r = -ENOENT;
    else
        snprintf(buf, len, "%s", peer);
    gpr_free(peer);
    if (r < 0)
        buf[0] = '\0';
    return r;
}

void rpc_call_set_buffer_cap(struct rpc_call *c, size_t bytes)
{
    c->buffer_cap = bytes;
}

size_t rpc_call_queued_bytes(const struct rpc_call *c)
{
    return c->queued_bytes;
}

static bool call_authorized(struct rpc_call *c)
{
    char v[1024];
    if (!c->s->api_key || (c->rm && c->rm->m.no_auth))
        return true;
    if (rpc_call_metadata(c, "authorization", v, sizeof(v)) < 0)
        return false;
    if (strncmp(v, "Bearer ", 7) != 0)
        return false;
    return rpc_secret_equal(c->s->api_key, v + 7);
}

static void call_start_close(struct rpc_call *c)
{
    grpc_op op;

    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    c->op_close.fn = call_on_close;
    c->op_send.fn = call_on_send;
    c->op_send.direct = true;
    c->close_started = true;
    if (grpc_call_start_batch(c->call, &op, 1, &c->op_close, NULL) != GRPC_CALL_OK) {
        c->close_started = false;
        c->close_done = true;
    }
}

/* The call ends before its handler ran: give a cq_hook's tag back first. */
static void call_end_early(struct rpc_call *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void call_end_early(struct rpc_call *c, int status, const char *fmt, ...)
{
    char msg[512];
    va_list ap;

    if (c->cq_mark && c->rm && c->rm->m.cq_unmark) {
        int mark = c->cq_mark;
        c->cq_mark = 0;
        c->rm->m.cq_unmark(mark, c->rm->m.ud);
    }
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    rpc_call_finish(c, status, "%s", msg);
}

/* Release what a slot's tag brought (a call, if any, its metadata and payload) and
 * give the slot back (either thread). */
static void slot_drop(struct rpc_slot *sl)
{
    if (sl->call)
        grpc_call_unref(sl->call);
    grpc_metadata_array_destroy(&sl->md);
    if (!sl->rm)
        grpc_call_details_destroy(&sl->details);
    if (sl->payload)
        grpc_byte_buffer_destroy(sl->payload);
    rpc__slot_put(sl);
}

/* A call arrived in slot sl: move it into a call of its own and give the slot back
 * (either thread). NULL when out of memory: the call is then cancelled. */
static struct rpc_call *slot_take(struct rpc_slot *sl)
{
    struct rpc_server *s = sl->s;
    struct rpc_call *c = calloc(1, sizeof(*c));

    if (c) {
        c->s = s;
        c->rm = sl->rm;
        c->call = sl->call;
        c->deadline = sl->deadline;
        c->md = sl->md;
        c->payload = sl->payload;
        c->details = sl->details;
        c->op_new.fn = call_on_new;
        rpc__slot_put(sl);
        return c;
    }
    log_error("rpc: out of memory taking a new call");
    grpc_call_cancel_with_status(sl->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
    slot_drop(sl);
    return NULL;
}

/* Loop thread: a slot's tag came back. */
void rpc__slot_on_new(struct rpc_op *op, bool ok)
{
    struct rpc_slot *sl = (struct rpc_slot *)((char *)op - offsetof(struct rpc_slot, op));

    if (!ok || !sl->call) {
        slot_drop(sl);                 /* server shutting down: the tag comes back unused */
        return;
    }
    struct rpc_call *c = slot_take(sl);
    if (c)
        call_on_new(&c->op_new, true);
}

/* Loop thread: a new call, taken out of its slot. */
static void call_on_new(struct rpc_op *op, bool ok)
{
    struct rpc_call *c = (struct rpc_call *)((char *)op - offsetof(struct rpc_call, op_new));
    struct rpc_server *s = c->s;

    (void)ok;
    /* hand over: from here the call is tracked */
    c->handed = true;
    c->next = s->calls;
    if (s->calls)
        s->calls->prev = c;
    s->calls = c;
    s->ctx->live_calls++;
    if (c->rm) {
        snprintf(c->method_name, sizeof(c->method_name), "%s", c->rm->m.path);
    } else {
        c->deadline = c->details.deadline;
        snprintf(c->method_name, sizeof(c->method_name), "%.*s",
                 (int)GRPC_SLICE_LENGTH(c->details.method),
                 (const char *)GRPC_SLICE_START_PTR(c->details.method));
    }
    call_start_close(c);

    if (!c->rm) {
        rpc_call_finish(c, RPC_UNIMPLEMENTED, "method %s is not implemented", c->method_name);
        return;
    }
    if (!call_authorized(c)) {
        call_end_early(c, RPC_UNAUTHENTICATED, "missing or invalid %s",
                       c->s->opts.key_name ? c->s->opts.key_name : "API key");
        return;
    }
    if (rpc_call_deadline_ms(c) <= rpc_now_ms()) {
        call_end_early(c, RPC_DEADLINE_EXCEEDED, "deadline expired before the request was handled");
        return;
    }
    if (!c->cq_decoded) {
        if (!c->payload) {
            call_end_early(c, RPC_INVALID_ARGUMENT, "request message missing");
            return;
        }
        c->req = rpc__bb_decode(c->payload, c->rm->m.req_desc);
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        if (!c->req) {
            call_end_early(c, RPC_INVALID_ARGUMENT, "request is not a valid %s message", c->rm->m.req_desc->name);
            return;
        }
        char path[256] = "";
        if (!rpc__msg_strings_valid(c->req, path, sizeof(path), 0)) {
            call_end_early(c, RPC_INVALID_ARGUMENT, "%s: invalid UTF-8 in string field", path);
            return;
        }
    }
    c->rm->m.handler(c, c->req, c->rm->m.ud);
}

/* ------------------------------------------------------------------ CQ-thread fast path */

/* The batch of a call answered on the CQ thread completed: release it there. */
static bool call_fast_done(struct rpc_op **opp, bool ok)
{
    struct rpc_call *c = (struct rpc_call *)((char *)*opp - offsetof(struct rpc_call, op_send));

    (void)ok;
    if (c->cur_send) {
        grpc_byte_buffer_destroy(c->cur_send);
        c->cur_send = NULL;
    }
    call_free(c);
    return true;
}

/* CQ thread: a new call of a method with a cq_hook. */
bool rpc__slot_new_cq(struct rpc_op **opp, bool ok)
{
    struct rpc_slot *sl = (struct rpc_slot *)((char *)*opp - offsetof(struct rpc_slot, op));

    if (!ok || !sl->call || !sl->rm || !sl->rm->m.cq_hook)
        return false;                  /* rpc__slot_on_new on the loop */
    struct rpc_call *c = slot_take(sl);
    if (!c)
        return true;
    *opp = &c->op_new;                 /* from here on the loop takes the call, not the slot */
    /* what the loop would answer first is left to the loop */
    if (!call_authorized(c) || rpc__deadline_to_ms(c->deadline) <= rpc_now_ms() || (!c->payload && !c->req))
        return false;
    /* once answered, c is not ours any more (the reply's completion frees it) */
    if (c->rm->m.cq_hook(c, c->rm->m.ud))
        return true;
    BUG_ON(c->cq_replied);
    return false;
}

int64_t rpc_cq_deadline_ms(const struct rpc_call *c)
{
    return rpc__deadline_to_ms(c->deadline);
}

const ProtobufCMessage *rpc_cq_request(struct rpc_call *c)
{
    char path[256] = "";

    if (c->cq_decoded)
        return c->req;
    if (!c->payload)
        return NULL;
    ProtobufCMessage *m = rpc__bb_decode(c->payload, c->rm->m.req_desc);
    if (!m)
        return NULL;
    if (!rpc__msg_strings_valid(m, path, sizeof(path), 0)) {
        protobuf_c_message_free_unpacked(m, NULL);
        return NULL;
    }
    grpc_byte_buffer_destroy(c->payload);
    c->payload = NULL;
    c->req = m;
    c->cq_decoded = true;
    return m;
}

void rpc_cq_set_mark(struct rpc_call *c, int mark)
{
    c->cq_mark = mark;
}

int rpc_call_cq_mark(const struct rpc_call *c)
{
    return c->cq_mark;
}

void rpc_cq_reply(struct rpc_call *c, const ProtobufCMessage *resp, int status, const char *msg,
                  const char *trailer_key, const char *trailer_value)
{
    grpc_op ops[4];
    size_t n = 0;

    BUG_ON(c->cq_replied || c->handed);
    c->cq_replied = true;
    snprintf(c->method_name, sizeof(c->method_name), "%s", c->rm->m.path);

    memset(ops, 0, sizeof(ops));
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (resp) {
        c->cur_send = rpc__bb_encode(resp, NULL);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->cur_send;
        n++;
    }
    c->finish_requested = true;
    c->status = status;
    c->status_details = grpc_slice_from_copied_string(msg ? msg : "");
    if (trailer_key) {
        c->trailers[0].key = grpc_slice_from_copied_string(trailer_key);
        c->trailers[0].value = grpc_slice_from_copied_string(trailer_value ? trailer_value : "");
        c->n_trailers = 1;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)status;
    ops[n].data.send_status_from_server.status_details = &c->status_details;
    ops[n].data.send_status_from_server.trailing_metadata_count = (size_t)c->n_trailers;
    ops[n].data.send_status_from_server.trailing_metadata = c->trailers;
    n++;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n].data.recv_close_on_server.cancelled = &c->close_cancelled;
    n++;
    c->op_send.fn = NULL;
    c->op_send.cq_fn = call_fast_done;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->op_send, NULL);
    if (e != GRPC_CALL_OK) {
        log_error("rpc: %s: start_batch(fast reply) failed: %d", c->method_name, (int)e);
        struct rpc_op *op = &c->op_send;
        call_fast_done(&op, false);
    }
}

/* Ask gRPC for a call in slot sl (req_mu held). */
