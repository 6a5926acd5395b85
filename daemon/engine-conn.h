/* engine-conn.h - the coordinator's connection to a group's engine and its output stream
 * (engine-conn.c).  Loop thread only. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc.h"

struct coord;
struct req;

/* The engine's output stream (Engine.OpenOutputs): one per connection carries the
 * outputs of every request submitted to it (Engine.Submit), one message per engine
 * step instead of one per token per request. Until it is open, and with an engine
 * that lacks it, requests use one Generate call each. */
enum out_state {
    OUT_CLOSED,
    OUT_OPENING,            /* OpenOutputs sent, its first (empty) batch not yet in */
    OUT_READY,
    OUT_UNSUPPORTED,        /* the engine answered UNIMPLEMENTED */
};

struct engine_conn {
    struct rpc_channel *ch;
    unsigned refs;          /* group (while attached) + each live call */
    bool attached;
    struct coord *co;
    struct group *g;        /* while attached: its group (calls reach it only this way) */
    char addr[256];
    enum out_state out_state;
    struct rpc_client_call *out_call;
    char out_id[64];
    int64_t out_retry_ms;   /* no new OpenOutputs before this */
    struct req **out_tab;   /* requests submitted to the stream, by id; chained by onext */
    size_t out_cap, out_n;
};

/* A connection to addr with one reference (the group's, attached); NULL on failure. */
struct engine_conn *engine_conn_new(struct coord *co, const char *addr);
void engine_conn_unref(struct engine_conn *e);
/* The group lets go of its connection: closes the output stream, drops the ref. */
void engine_conn_detach(struct engine_conn *e);
/* Open e's output stream (no-op unless closed and not backing off). */
void engine_out_open(struct engine_conn *e);
/* The requests submitted to e's output stream, by request id. */
struct req *engine_out_find(const struct engine_conn *e, const char *id);
int engine_out_insert(struct engine_conn *e, struct req *r);
void engine_out_remove(struct engine_conn *e, struct req *r);
