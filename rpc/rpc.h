/* rpc.h - reusable gRPC C-core glue for a libuv program (server and client).
 *
 * Threading model: one completion queue (CQ) per struct rpc_ctx, drained by one
 * private thread. That thread moves (tag, ok) events into a mutex-protected queue
 * and wakes the libuv loop with uv_async_send(); every callback below runs on the
 * loop thread, and every function below must be called from the loop thread
 * (except rpc_now_ms(), rpc_now_us() and the rpc_cq_* functions). The one
 * exception is a method's optional cq_hook (see struct rpc_method), which runs on
 * the CQ thread to answer a call without waiting for the loop. No locks are
 * needed by users. A program that runs its loop with rpc_ctx_run() instead of
 * uv_run() lets the CQ thread run callbacks itself while the loop thread is idle,
 * under a lock the loop thread holds otherwise: callbacks (and the libuv calls they
 * make) still never run concurrently with each other or with the loop's own.
 *
 * Messages are protobuf-c messages handled through the generic protobuf-c API
 * (descriptor + ProtobufCMessage*), so this library knows nothing about the
 * stepd protos; it is linked by the coordinator, the engine service on rank 0
 * and the worker control client.
 *
 * Server side
 *   - rpc_server_create() with explicit limits (max receive message size, max
 *     concurrent streams, max metadata size, keepalive enforcement); loopback or
 *     UDS by default, TLS/mTLS optional, an optional API key checked in constant
 *     time on every method not flagged no_auth (UNAUTHENTICATED otherwise).
 *   - A method is unary or server-streaming; the request message is decoded
 *     before the handler runs (decode failure -> INVALID_ARGUMENT, over-size ->
 *     RESOURCE_EXHAUSTED by gRPC core, expired deadline -> DEADLINE_EXCEEDED).
 *   - Contract: the handler (or code it hands the call to) calls
 *     rpc_call_finish() exactly once. Before that it may rpc_call_send() any
 *     number of messages (streaming) or exactly one (unary). If the client
 *     cancels, disconnects or the deadline passes first, the cancel callback
 *     (rpc_call_on_cancel) runs once; the owner must still call
 *     rpc_call_finish() (sends are then dropped cheaply). The call object stays
 *     valid until rpc_call_finish() returns; do not touch it afterwards.
 *
 * Client side
 *   - rpc_channel_create() (insecure or TLS, keepalive, API key metadata) and
 *     rpc_client_start() for unary and server-streaming calls alike: on_msg runs
 *     for each response message (borrowed; valid only during the callback), then
 *     on_done runs exactly once with the final status. rpc_client_cancel() makes
 *     on_done run (with CANCELLED unless the status was already in).
 *
 * Errors: functions return 0 or a negative errno (-EINVAL bad argument,
 * -ENOMEM, -EADDRINUSE/-EIO bind failure, -ENOBUFS per-call send buffer cap,
 * -ECANCELED call already cancelled/finished).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>
#include <protobuf-c/protobuf-c.h>

#ifdef __cplusplus
extern "C" {
#endif

/* gRPC status codes (same values as grpc_status_code) so users need not include grpc headers. */
enum rpc_status {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
};

/* "OK", "INVALID_ARGUMENT", ... */
const char *rpc_status_name(int status);

/* Monotonic milliseconds (the clock used for all deadlines below). Thread-safe. */
int64_t rpc_now_ms(void);
/* CLOCK_MONOTONIC in microseconds: one clock for every process on the host (its
 * origin differs from rpc_now_ms(), so do not mix the two). Thread-safe. */
int64_t rpc_now_us(void);

/* ------------------------------------------------------------------ context */

struct rpc_ctx;

/* Initialises gRPC (grpc_init), creates the CQ, its thread and a uv_async on loop. */
int rpc_ctx_create(uv_loop_t *loop, struct rpc_ctx **ret);
/* Shuts the CQ down, joins its thread and processes the events still queued. All
 * servers, channels and calls must be gone first (rpc_server_destroy,
 * rpc_channel_destroy, every on_done delivered). The uv_async handle is closed and
 * the context freed in its close callback: run the loop once more afterwards
 * (e.g. uv_run(loop, UV_RUN_DEFAULT)) before closing the loop. */
void rpc_ctx_destroy(struct rpc_ctx *ctx);
/* Run the loop (like uv_run(loop, UV_RUN_DEFAULT)) in the mode where the CQ thread
 * runs completion callbacks itself whenever the loop thread is idle in its poll():
 * the loop thread holds a lock except while it waits for I/O, and the CQ thread takes
 * it (without ever waiting for it) to dispatch an event, so every callback still runs
 * with exclusive access to the loop and to everything loop callbacks own, only on one
 * of two threads. An event the CQ thread cannot take the lock for is queued for the
 * loop as usual; queued events always run first, in order. This saves the queue, the
 * uv_async wake-up and two thread switches per event (per streamed token). Only the
 * per-message events take that path: a client call's on_msg and the completion of a
 * server call's send; new calls (handlers), cancellations, on_done and shutdown stay
 * on the loop thread, so the CQ thread stays free for new calls and cq_hook answers
 * (and nothing runs directly while events wait in the queue).
 * Consequences for the program: (1) its callbacks must not depend on which thread
 * runs them (no thread-locals carried between callbacks); (2) rpc_server_destroy()
 * and rpc_ctx_destroy() must be called from a libuv callback (timer, signal, ...),
 * not from an rpc callback, since they wait for the CQ thread; (3) uv_now() is
 * updated before each such dispatch. Returns when the loop has nothing left to run
 * (rpc_ctx_destroy() may be called inside: the context is freed here, and the loop
 * is then run to completion the usual way). -EBUSY if already running. */
int rpc_ctx_run(struct rpc_ctx *ctx);

struct rpc_ctx_stats {
    uint64_t direct;        /* events the CQ thread dispatched itself (rpc_ctx_run) */
    uint64_t queued;        /* events queued for the loop thread */
    uint64_t wakes;         /* loop wake-ups after a direct dispatch (timers, handles) */
    uint64_t corked_batches;    /* rpc_ctx_uncork() calls that started held sends */
    uint64_t corked_sends;      /* sends held and started by them */
    uint64_t sender_sends;      /* of those, started by the sender thread */
};
/* Counters since creation. Thread-safe. */
void rpc_ctx_stats(const struct rpc_ctx *ctx, struct rpc_ctx_stats *ret);

/* Loop thread, while idle: give back the event queues grown under a load (they are
 * grown again, doubling, when needed). */
void rpc_ctx_compact(struct rpc_ctx *ctx);

/* Loop thread: hold back the server calls' sends (rpc_call_send, rpc_call_finish)
 * from here to the matching rpc_ctx_uncork(), which starts them all: on this thread,
 * and with the sender thread (rpc_ctx_set_sender) taking its share too when there are
 * 8 or more.  uncork returns when this thread finds none left to start; it never
 * waits for the sender thread.  For a callback that sends to many calls at once, e.g.
 * one message from an engine that carries a token for each of 90 client streams.
 * Sends to the same call keep their order; completions come as usual (a send gRPC
 * refuses to start completes as failed).  Nests. */
void rpc_ctx_cork(struct rpc_ctx *ctx);
void rpc_ctx_uncork(struct rpc_ctx *ctx);
/* Loop thread: start (on) the sender thread, "rpc-sender", that shares the held sends
 * of each rpc_ctx_uncork(); it stays until rpc_ctx_destroy().  Off: uncork starts them
 * all on its own thread (the thread, once started, stays idle).  -EAGAIN: the thread
 * could not be started (uncork works as with off). */
int rpc_ctx_set_sender(struct rpc_ctx *ctx, bool on);

/* Number of live server calls + client calls (for leak checks and metrics). */
size_t rpc_ctx_live_calls(const struct rpc_ctx *ctx);
/* Inside a callback: rpc_now_us() time at which the CQ thread took the completion
 * being dispatched (a message received, a call ended), i.e. before it waited in
 * the queue for the loop. Clients use it to time arrivals without their own loop's
 * queueing. 0 before the first event. */
int64_t rpc_ctx_event_us(const struct rpc_ctx *ctx);

/* ------------------------------------------------------------------ server */

struct rpc_server;
struct rpc_call;

struct rpc_tls_files {
    const char *cert_file;          /* PEM certificate chain */
    const char *key_file;           /* PEM private key */
    const char *root_file;          /* PEM CA bundle for verifying peers (mTLS / client) */
    bool require_client_cert;       /* server: mTLS; requires root_file (refused otherwise) */
};

struct rpc_server_opts {
    /* Limits; 0 = the default shown. */
    int max_recv_msg_bytes;         /* 4 MiB */
    int max_concurrent_streams;     /* 1024 per connection */
    int max_metadata_bytes;         /* 16 KiB */
    int keepalive_time_ms;          /* server pings idle clients every 60 s */
    int keepalive_timeout_ms;       /* 20 s */
    int min_ping_interval_ms;       /* clients may ping at most every 10 s (enforced) */
    int max_ping_strikes;           /* 2, then GOAWAY ENHANCE_YOUR_CALM */
    /* > 0: every connection gets a GOAWAY after max_connection_age_ms (gRPC adds +-10 %)
     * and is closed max_connection_age_grace_ms later (0: 15 min) - the only bound gRPC 1.51
     * puts on a connection whose header block never ends (a CONTINUATION flood is parsed
     * and dropped for as long as it lasts).  0 = no age (long-lived sessions).  Where set,
     * $STEPD_GRPC_MAX_CONNECTION_AGE_MS and $STEPD_GRPC_MAX_CONNECTION_AGE_GRACE_MS
     * override both (tests inject short ones). */
    int max_connection_age_ms;
    int max_connection_age_grace_ms;
    size_t max_call_buffer_bytes;   /* per-call queued send bytes before -ENOBUFS; 1 MiB */
    /* calls kept requested per method (rpc_method.requests overrides); 8.  Each is a tag
     * the CQ tracks, and a libgrpc built without NDEBUG (Debian's) scans the CQ's
     * outstanding tags on every completion: 64 for each of the ~12 methods cost ~4 % of
     * stepd's CPU per streamed token (bench_coord.py cost), for methods called now and then */
    int requests_per_method;
    /* Security. Without tls the server is plaintext. */
    const struct rpc_tls_files *tls;
    const char *api_key;            /* NULL = no key; else "authorization: Bearer <key>" */
    const char *key_name;           /* what the refusal calls the key (a static string):
                                       NULL "API key"; "cluster key" on internal ports */
};

/* Handler: req is the decoded request (owned by the call; valid until finish). */
typedef void (*rpc_handler_fn)(struct rpc_call *call, const ProtobufCMessage *req, void *ud);
typedef void (*rpc_cancel_fn)(struct rpc_call *call, void *ud);

/* Fast path on the CQ thread (optional, per method). The one exception to "every
 * callback runs on the loop thread": cq_hook runs on the CQ thread for each new call
 * of the method that passed the API-key and expired-deadline checks, before the
 * call is queued for the loop, so it must only read thread-safe state (atomics the
 * loop maintains) and call only the rpc_cq_* functions below. It either
 *   - answers the call right there with rpc_cq_reply() and returns true: the call
 *     never reaches the loop (handler, cancel callback and live-call count never see
 *     it), or
 *   - returns false: the call goes to the loop as usual. It may first tag the call
 *     with rpc_cq_set_mark() (e.g. "holds an admission reservation"); the handler
 *     reads the tag with rpc_call_cq_mark(). If a tagged call ends before its handler
 *     runs (decode failure, deadline expired meanwhile, shutdown), cq_unmark runs on
 *     the loop thread instead, so the tag is never lost.
 * Used for answers that must not wait behind a busy loop: overload rejections
 * (docs/RELIABILITY.md A2) and health checks.
 *
 * own_cq: the method's calls are requested on a second completion queue with a thread
 * of its own (created with the first such method of the context), so its cq_hook
 * answers do not wait behind the main CQ thread's backlog either: under a streaming
 * load that keeps the main CQ thread busy, a health Check is read off its socket and
 * answered by the second thread (docs/RELIABILITY.md A7: health never queues behind
 * inference). Only for methods whose calls are answered in the cq_hook; everything
 * else of such a call still runs on the loop thread, as for any call. */
typedef bool (*rpc_cq_hook_fn)(struct rpc_call *call, void *ud);
typedef void (*rpc_cq_unmark_fn)(int mark, void *ud);

struct rpc_method {
    const char *path;                               /* "/stepd.v1.Inference/Generate" */
    const ProtobufCMessageDescriptor *req_desc;
    bool server_streaming;
    bool no_auth;                                   /* true only for grpc.health.v1 */
    rpc_handler_fn handler;
    void *ud;
    int requests;                                   /* calls kept requested; 0 = server default */
    rpc_cq_hook_fn cq_hook;                         /* NULL = none (see above) */
    rpc_cq_unmark_fn cq_unmark;
    bool own_cq;                                    /* see above */
};

/* CQ-thread functions, valid only inside a cq_hook. */
/* Absolute deadline (rpc_now_ms time); INT64_MAX when none. */
int64_t rpc_cq_deadline_ms(const struct rpc_call *call);
/* The decoded request (decoded here once, then handed to the handler), or NULL when
 * it cannot be decoded or has invalid UTF-8: return false, the loop answers that. */
const ProtobufCMessage *rpc_cq_request(struct rpc_call *call);
void rpc_cq_set_mark(struct rpc_call *call, int mark);
/* Answer the call now: optional response message (packed before this returns),
 * status, message, optional trailing metadata entry (trailer_key NULL = none). */
void rpc_cq_reply(struct rpc_call *call, const ProtobufCMessage *resp, int status, const char *msg,
                  const char *trailer_key, const char *trailer_value);
/* Loop thread: the tag rpc_cq_set_mark() gave the call (0 = none). */
int rpc_call_cq_mark(const struct rpc_call *call);

int rpc_server_create(struct rpc_ctx *ctx, const struct rpc_server_opts *opts,
                      struct rpc_server **ret);
/* Register before rpc_server_start(); path and req_desc must outlive the server. */
int rpc_server_add_method(struct rpc_server *s, const struct rpc_method *m);
/* Listen on addr ("127.0.0.1:20051", "[::1]:0", "unix:/run/stepd/w.sock"). Uses TLS
 * credentials when opts.tls was given. *ret_port (may be NULL) gets the bound port
 * (useful with port 0). Call before rpc_server_start(). */
int rpc_server_listen(struct rpc_server *s, const char *addr, int *ret_port);
int rpc_server_start(struct rpc_server *s);
/* Stop accepting new calls; in-flight ones continue. on_done runs (loop thread)
 * when every call has finished (use rpc_server_cancel_all() to force them). */
void rpc_server_shutdown(struct rpc_server *s, void (*on_done)(void *ud), void *ud);
/* Cancel every in-flight call (their cancel callbacks run). */
void rpc_server_cancel_all(struct rpc_server *s);
/* Only after on_done of rpc_server_shutdown has run. */
void rpc_server_destroy(struct rpc_server *s);

/* Per-call API (loop thread only). */
void rpc_call_on_cancel(struct rpc_call *call, rpc_cancel_fn fn, void *ud);
/* Queue one response message. -ENOBUFS: the per-call buffer cap is hit (slow
 * reader); -ECANCELED: the call is cancelled (the message is dropped). */
int rpc_call_send(struct rpc_call *call, const ProtobufCMessage *msg);
/* This call's cap on queued send bytes instead of the server's max_call_buffer_bytes
 * (a stream that multiplexes many requests needs more). */
void rpc_call_set_buffer_cap(struct rpc_call *call, size_t bytes);
/* Add a trailing metadata entry sent with the status (at most 4), e.g.
 * "grpc-retry-pushback-ms". Strings are copied. */
int rpc_call_add_trailer(struct rpc_call *call, const char *key, const char *value);
/* End the call: status plus message (may be NULL; printf-style). After all queued
 * messages are written the status is sent. The call must not be used afterwards. */
void rpc_call_finish(struct rpc_call *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* End the call at once with status, dropping queued messages (RST_STREAM carrying
 * the status): for a client that stopped reading, whose queued messages would never
 * let a normal status through. Same contract as rpc_call_finish(). */
void rpc_call_abort(struct rpc_call *call, int status, const char *msg);
/* Absolute deadline in rpc_now_ms() time; INT64_MAX when the client set none. */
int64_t rpc_call_deadline_ms(const struct rpc_call *call);
/* First value of request metadata key (lowercase), copied into buf; -ENOENT if absent. */
int rpc_call_metadata(const struct rpc_call *call, const char *key, char *buf, size_t len);
/* The call's transport peer as gRPC names it ("ipv4:127.0.0.1:40312", "ipv6:[::1]:5",
 * "unix:/run/stepd/public.sock"): one value per connection on TCP; every client of a unix
 * socket has the same one.  -ENOENT (buf "") when gRPC has none. */
int rpc_call_peer(const struct rpc_call *call, char *buf, size_t len);
/* Bytes queued for sending on this call (not yet written to the transport). */
size_t rpc_call_queued_bytes(const struct rpc_call *call);

/* Constant-time equality of two byte strings (time depends only on len(expected)). */
bool rpc_secret_equal(const char *expected, const char *given);

/* ------------------------------------------------------------------ client */

struct rpc_channel;
struct rpc_client_call;

struct rpc_channel_opts {
    const struct rpc_tls_files *tls;  /* NULL = plaintext; root_file verifies the server,
                                         cert/key present = client certificate (mTLS) */
    const char *api_key;              /* sent as "authorization: Bearer <key>" */
    int keepalive_time_ms;            /* 0 = 10 s (permit without calls) ; -1 = off */
    int keepalive_timeout_ms;         /* 0 = 5 s */
    int max_recv_msg_bytes;           /* 0 = 4 MiB */
    const char *ssl_target_name;      /* TLS name override (tests); NULL = from target */
    bool own_connection;              /* a connection of its own, even when another channel of
                                         the process has the same target and options */
};

int rpc_channel_create(struct rpc_ctx *ctx, const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **ret);
/* Outstanding calls must have delivered on_done (cancel them first). */
void rpc_channel_destroy(struct rpc_channel *ch);

typedef void (*rpc_client_msg_fn)(struct rpc_client_call *c, const ProtobufCMessage *msg, void *ud);
typedef void (*rpc_client_done_fn)(struct rpc_client_call *c, int status, const char *details,
                                   void *ud);

/* Start a unary or server-streaming call. deadline_ms is absolute (rpc_now_ms);
 * 0 or INT64_MAX = none. on_msg may be NULL. *ret (may be NULL) is valid until
 * on_done returns. The call is freed right after on_done. */
int rpc_client_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *resp_desc, int64_t deadline_ms,
                     rpc_client_msg_fn on_msg, rpc_client_done_fn on_done, void *ud,
                     struct rpc_client_call **ret);
/* Ask gRPC to cancel; on_done still runs exactly once (later, on the loop). */
void rpc_client_cancel(struct rpc_client_call *c);

#ifdef __cplusplus
}
#endif
