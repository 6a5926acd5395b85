/* rpc-int.h - the rpc/ library's internals, shared by its files (not a public header).
 *
 *   context.c  the context: the completion-queue threads, the hand-over to the libuv loop
 *   call.c     server calls: the request, sends and their queue, status, the CQ fast path
 *   cork.c     held sends (rpc_ctx_cork) and the sender thread
 *   server.c   server set-up: credentials, methods, request slots, shutdown
 *   client.c   client channels and calls
 *   codec.c    protobuf <-> byte buffers, UTF-8 checks, deadlines, status names
 */
#pragma once

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>

#include "rpc.h"

#define RPC_MAX_TRAILERS 4

/* A completion-queue tag: every grpc batch carries a pointer to one of these. fn runs
 * on the loop thread; cq_fn, when set, first runs on the CQ thread and returns true
 * when it has handled the event completely (it is then not queued for the loop). When
 * it returns false it may have replaced *opp: that op's fn then runs on the loop. */
struct rpc_op {
    void (*fn)(struct rpc_op *op, bool ok);
    bool (*cq_fn)(struct rpc_op **opp, bool ok);
    /* rpc_ctx_run: fn may run on the CQ thread (ctx_dispatch_direct). Set only for the
     * per-message events of the streaming path (a client call's message received, a
     * server call's send done): their callbacks are short and bounded. Everything
     * else (new calls, ends of calls, shutdown) runs on the loop thread, so the CQ
     * thread stays free to take new calls and answer cq_hooks. */
    bool direct;
};

struct rpc_event {
    struct rpc_op *op;
    bool ok;
    int64_t t_us;               /* CLOCK_MONOTONIC when the CQ thread took it */
};

struct rpc_ctx {
    uv_loop_t *loop;
    uv_async_t async;
    grpc_completion_queue *cq;
    pthread_t thread;
    pthread_mutex_t mu;
    struct rpc_event *q;        /* filled by the CQ thread */
    size_t q_len, q_cap;
    struct rpc_event *work;     /* drained on the loop thread */
    size_t work_cap;
    size_t live_calls;
    int64_t cur_event_us;       /* t_us of the event being dispatched (loop thread) */
    bool thread_started;
    /* rpc_ctx_run(): the loop thread holds loop_mu except while it waits in poll() on
     * the loop's backend fd; the CQ thread takes it (trylock) to dispatch an event
     * itself instead of queueing it and waking the loop. Lock order: loop_mu, then mu. */
    pthread_mutex_t loop_mu;
    _Atomic bool direct;        /* inside rpc_ctx_run (written under loop_mu) */
    _Atomic bool loop_wants;    /* the loop thread is waiting for loop_mu (it goes first) */
    bool in_run;                /* rpc_ctx_run is on the stack: it frees the context */
    bool dead;                  /* rpc_ctx_destroy finished (the async handle closed) */
    uint64_t poll_deadline;     /* uv_now() at which the loop's poll() times out; UINT64_MAX none */
    /* the second CQ and its thread (rpc_method.own_cq), from the first such method on:
     * it answers cq_hooks and queues everything else (never dispatches directly, so
     * the main CQ thread stays the only one that runs loop callbacks itself).  pcq does
     * not poll: the main CQ thread reads the sockets as before (a second poller all the
     * time costs every streamed token a thread hand-off, ~2.5 us); only while the main
     * CQ thread waits for a CPU (PCQ_HOT_PCT) does this one poll too (poll_cq, never
     * given any work), so that calls of pcq's methods are read off their sockets
     * without waiting for the main thread to be scheduled. */
    grpc_completion_queue *pcq, *poll_cq;
    pthread_t pthread;
    bool pthread_started;
    _Atomic int cq_tid;             /* the main CQ thread's kernel thread id */
    _Atomic unsigned cq_turns;      /* its returns from grpc_completion_queue_next ... */
    _Atomic bool cq_inside;         /* ... and whether it is in there now */
    _Atomic uint64_t n_direct, n_queued, n_wakes;
    /* rpc_ctx_cork(): server-call sends held back while corked, started together at
     * uncork by this thread and the sender thread (see rpc_ctx_uncork) */
    int corked;
    struct rpc_held *held;          /* being filled (loop thread); NULL: none yet */
    pthread_t sthread;
    bool sender;                    /* rpc_ctx_set_sender(): the sender thread runs */
    bool sthread_started;
    pthread_mutex_t s_mu;           /* the fields below */
    pthread_cond_t s_cv;
    bool s_quit;
    struct rpc_held *s_work;        /* handed to the sender thread, not taken yet */
    struct rpc_held *s_free;        /* recycled lists (HELD_KEEP at most) */
    int s_n_free;
    grpc_call *s_cur;               /* the sender thread is in start_batch on it */
    grpc_call *s_unref;             /* released meanwhile: the sender unrefs it */
    _Atomic uint64_t n_corked_batches, n_corked_sends, n_sender_sends;
};

/* A grpc_call_start_batch held back by rpc_ctx_cork() (call_pump). */
struct rpc_pending {
    struct rpc_call *c;
    unsigned what;                  /* SEND_* */
};

/* The sends held by one cork, started by whoever takes them first (v[next++]); the
 * last of its takers to finish recycles it, so neither waits for the other. */
struct rpc_held {
    struct rpc_pending *v;
    size_t len, cap;
    _Atomic size_t next;
    _Atomic int takers;
    struct rpc_held *free_next;
};


/* ---- server objects (server.c, call.c) ---- */

/* Request slots. Each grpc_server_request_*call() tag is a slot that lives as long as
 * the server: when a call arrives, its data moves into a struct rpc_call allocated
 * then (freed when the call ends) and the slot goes back to its pool. A pool asks
 * gRPC again for calls only once half of its slots are back, and then for all of
 * them at once. Both keep the memory that stays allocated between loads compact:
 * a call request allocated one at a time in the middle of a load (ours, and gRPC's
 * own record of it) lands wherever the heap has a hole, and the few hundred of them
 * still waiting when the load ends each keep a page of the freed load in RSS
 * (docs/RELIABILITY.md A1: RSS back to within 5 % after idle). */
struct rpc_slot {
    struct rpc_server *s;
    struct reg_method *rm;          /* NULL: the unregistered-method slot */
    struct slot_pool *pool;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;      /* unregistered only */
    struct rpc_op op;
    struct rpc_slot *next;          /* free list */
};

struct slot_pool {
    struct rpc_slot *slots;         /* n, allocated when the server starts */
    struct rpc_slot *free;          /* not requested; under rpc_server.req_mu */
    int n, n_free;
};

struct reg_method {
    struct rpc_method m;
    void *handle;
    struct rpc_server *s;
    struct slot_pool pool;
};

struct rpc_server {
    struct rpc_ctx *ctx;
    grpc_server *srv;
    grpc_server_credentials *creds;
    struct rpc_server_opts opts;
    char *api_key;
    struct reg_method *methods;
    size_t n_methods;
    bool started;
    bool pcq_registered;            /* the context's second CQ (rpc_method.own_cq) */
    bool shutting_down;             /* written under req_mu (read by the CQ thread) */
    pthread_mutex_t req_mu;         /* CQ-thread re-requests vs shutdown */
    struct rpc_call *calls;         /* live calls (handed to handlers), doubly linked */
    _Atomic size_t requested;       /* outstanding request_call tags (both threads) */
    struct slot_pool unreg_pool;    /* unregistered methods (answered UNIMPLEMENTED) */
    struct rpc_op shutdown_op;
    bool shutdown_done;
    void (*on_shutdown)(void *ud);
    void *shutdown_ud;
};

struct rpc_call {
    struct rpc_server *s;
    struct reg_method *rm;          /* NULL: unregistered method (answered UNIMPLEMENTED) */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details;      /* unregistered only */
    struct rpc_op op_new, op_close, op_send;
    int close_cancelled;
    ProtobufCMessage *req;
    rpc_cancel_fn cancel_fn;
    void *cancel_ud;
    /* send queue (ring of packed messages) */
    grpc_byte_buffer **sq;
    size_t sq_head, sq_len, sq_cap;
    size_t queued_bytes;
    size_t buffer_cap;              /* 0: the server's max_call_buffer_bytes */
    grpc_byte_buffer *cur_send;
    size_t cur_send_len;
    bool send_in_flight, md_sent, finish_requested, status_in_batch, status_done;
    bool cancelled, close_done, close_started, handed;
    bool cq_decoded, cq_replied;    /* request decoded / call answered on the CQ thread */
    int cq_mark;
    int status;
    grpc_slice status_details;
    grpc_metadata trailers[RPC_MAX_TRAILERS];
    int n_trailers;
    struct rpc_call *prev, *next;
    char method_name[128];
};

/* ---- functions one file defines for the others (rpc__: private to rpc/) ---- */
/* call.c */
size_t rpc__call_send_ops(struct rpc_call *c, unsigned what, grpc_op ops[3]);
bool rpc__slot_new_cq(struct rpc_op **opp, bool ok);
void rpc__slot_on_new(struct rpc_op *op, bool ok);
/* codec.c */
ProtobufCMessage *rpc__bb_decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc);
grpc_byte_buffer *rpc__bb_encode(const ProtobufCMessage *msg, size_t *ret_len);
gpr_timespec rpc__deadline_from_ms(int64_t ms);
int64_t rpc__deadline_to_ms(gpr_timespec t);
bool rpc__msg_strings_valid(const ProtobufCMessage *m, char *path, size_t plen, int depth);
/* context.c */
void rpc__ctx_drain(struct rpc_ctx *ctx);
void rpc__ctx_queue(struct rpc_ctx *ctx, struct rpc_op *op, bool ok, int64_t t_us);
void *rpc__pcq_thread_main(void *arg);
/* cork.c */
int rpc__pend_add(struct rpc_ctx *ctx, struct rpc_call *c, unsigned what);
bool rpc__sender_defer_unref(struct rpc_ctx *ctx, grpc_call *gc);
void rpc__sender_stop(struct rpc_ctx *ctx);
/* server.c */
void rpc__slot_put(struct rpc_slot *sl);
