/* engine-conn.c - the coordinator's connection to one group's engine (rank 0's
 * stepd.v1.Engine): its channel and lifetime, and its output stream.
 *
 * One connection per group, shared by the requests, aborts and load polls that use it;
 * it outlives its group while calls on it are still ending (refcounted).  The output
 * stream (Engine.OpenOutputs) carries the outputs of every request submitted to the
 * connection (Engine.Submit), one message per engine step; until it is open, and with an
 * engine that lacks it, requests use one Generate call each (req.c).  Loop thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coord-int.h"
#include "err.h"
#include "log.h"

#define ENGINE_OPEN_OUTPUTS "/stepd.v1.Engine/OpenOutputs"
#define OUT_RETRY_MS 1000       /* after an output stream ends, Generate calls for this long */

/* ------------------------------------------------------------------ lifetime */

struct engine_conn *engine_conn_new(struct coord *co, const char *addr)
{
    struct engine_conn *e = calloc(1, sizeof(*e));
    /* the engine checks the cluster key as the control port does */
    struct rpc_channel_opts o = { .keepalive_time_ms = 10000, .keepalive_timeout_ms = 5000,
                                  .max_recv_msg_bytes = 16 << 20, .api_key = co->o.control_key };
    if (!e)
        return NULL;
    if (rpc_channel_create(co->rpc, addr, &o, &e->ch) < 0) {
        free(e);
        return NULL;
    }
    e->refs = 1;
    e->attached = true;
    e->co = co;
    snprintf(e->addr, sizeof(e->addr), "%s", addr);
    return e;
}

void engine_conn_unref(struct engine_conn *e)
{
    if (!e)
        return;
    BUG_ON(e->refs == 0);
    if (--e->refs == 0) {
        BUG_ON(e->out_n != 0);
        rpc_channel_destroy(e->ch);
        free(e->out_tab);
        free(e);
    }
}

void engine_conn_detach(struct engine_conn *e)
{
    e->attached = false;
    e->g = NULL;
    if (e->out_call)
        rpc_client_cancel(e->out_call);     /* its on_done fails what is still on it */
    engine_conn_unref(e);
}

/* ------------------------------------------------------------------ output stream */

static size_t out_hash(const char *id)
{
    uint64_t h = coord_fnv1a(id, strlen(id), COORD_FNV_SEED);
    return (size_t)(h ^ (h >> 32));
}

struct req *engine_out_find(const struct engine_conn *e, const char *id)
{
    if (!e->out_cap)
        return NULL;
    for (struct req *r = e->out_tab[out_hash(id) & (e->out_cap - 1)]; r; r = r->onext)
        if (strcmp(r->id, id) == 0)
            return r;
    return NULL;
}

int engine_out_insert(struct engine_conn *e, struct req *r)
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

void engine_out_remove(struct engine_conn *e, struct req *r)
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
        struct req *r = engine_out_find(e, o->request_id);
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
            r->co->up->engine_output(r, &er);
            break;
        case STEPD__V1__ENGINE_OUTPUT__KIND_FINAL:
            er.response_case = STEPD__V1__GENERATE_RESPONSE__RESPONSE_FINAL;
            er.final = o->final;
            r->co->up->engine_output(r, &er);
            engine_out_remove(e, r);
            r->co->up->engine_ended(r, RPC_OK, "");
            break;
        case STEPD__V1__ENGINE_OUTPUT__KIND_STATUS:
            engine_out_remove(e, r);
            r->co->up->engine_ended(r, o->status->code > 0 && o->status->code < 17 ? o->status->code : RPC_UNKNOWN,
                                    o->status->message);
            break;
        default:
            engine_out_remove(e, r);
            r->co->up->engine_ended(r, RPC_INTERNAL, "an output stream entry with neither chunk, final nor status");
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
            engine_out_remove(e, r);
            r->co->up->engine_ended(r, RPC_UNAVAILABLE, why);
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

