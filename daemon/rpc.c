/* rpc.c - gRPC C-core glue: CQ thread -> uv_async -> loop thread. See rpc.h. */
#include "rpc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "err.h"
#include "log.h"

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

/* ------------------------------------------------------------------ helpers */

static const char *const status_names[] = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *rpc_status_name(int status)
{
    if (status < 0 || (size_t)status >= sizeof(status_names) / sizeof(status_names[0]))
        return "UNKNOWN_STATUS";
    return status_names[status];
}

int64_t rpc_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t rpc_now_ms(void)
{
    gpr_timespec t = gpr_now(GPR_CLOCK_MONOTONIC);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static gpr_timespec deadline_from_ms(int64_t ms)
{
    if (ms <= 0 || ms == INT64_MAX)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    gpr_timespec t;
    t.tv_sec = ms / 1000;
    t.tv_nsec = (int32_t)((ms % 1000) * 1000000);
    t.clock_type = GPR_CLOCK_MONOTONIC;
    return t;
}

static int64_t deadline_to_ms(gpr_timespec t)
{
    if (gpr_time_cmp(t, gpr_inf_future(t.clock_type)) == 0)
        return INT64_MAX;
    t = gpr_convert_clock_type(t, GPR_CLOCK_MONOTONIC);
    if (t.tv_sec > INT64_MAX / 1000 - 1)
        return INT64_MAX;
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

bool rpc_secret_equal(const char *expected, const char *given)
{
    size_t le = strlen(expected), lg = strlen(given);
    volatile unsigned char diff = (unsigned char)(le != lg);
    for (size_t i = 0; i < le; i++) {
        unsigned char g = i < lg ? (unsigned char)given[i] : 0;
        diff |= (unsigned char)expected[i] ^ g;
    }
    return diff == 0;
}

static int read_file(const char *path, char **ret)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int r = 0;

    if (!f)
        return -errno;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            if (cap > (16u << 20)) {
                r = -EFBIG;
                goto cleanup;
            }
            char *n = realloc(buf, cap);
            if (!n) {
                r = -ENOMEM;
                goto cleanup;
            }
            buf = n;
        }
        size_t got = fread(buf + len, 1, 4096, f);
        len += got;
        if (got < 4096) {
            if (ferror(f))
                r = -EIO;
            break;
        }
    }
cleanup:
    fclose(f);
    if (r < 0) {
        free(buf);
        return r;
    }
    buf[len] = '\0';
    *ret = buf;
    return 0;
}

/* Decode a byte buffer into a protobuf-c message (NULL on failure). */
static ProtobufCMessage *bb_decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc)
{
    grpc_byte_buffer_reader rd;
    ProtobufCMessage *m;

    /* the usual case (one uncompressed slice): unpack in place, no copy */
    if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
        bb->data.raw.slice_buffer.count == 1) {
        const grpc_slice *s = &bb->data.raw.slice_buffer.slices[0];
        return protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(*s), GRPC_SLICE_START_PTR(*s));
    }
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    m = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

static grpc_byte_buffer *bb_encode(const ProtobufCMessage *msg, size_t *ret_len)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    if (ret_len)
        *ret_len = len;
    return bb;
}

/* Strict UTF-8 check (no overlongs, no surrogates, <= U+10FFFF). */
static bool utf8_valid(const unsigned char *s)
{
    while (*s) {
        unsigned c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int n;
        unsigned cp;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
        else return false;
        for (int i = 1; i <= n; i++) {
            if ((s[i] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i] & 0x3F);
        }
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        s += n + 1;
    }
    return true;
}

/* Walk every string field of m (recursively); proto3 requires valid UTF-8, which
 * protobuf-c does not check. On failure writes the field path into path. */
static bool msg_strings_valid(const ProtobufCMessage *m, char *path, size_t plen, int depth)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    size_t base = strlen(path);

    if (depth > 64)
        return false;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *p = (const char *)m + f->offset;
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t cse = *(const uint32_t *)((const char *)m + f->quantifier_offset);
            if (cse != f->id)
                continue;
        }
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
            void *const *arr = *(void *const *const *)p;
            for (size_t k = 0; k < n; k++) {
                snprintf(path + base, plen - base, "%s%s[%zu]", base ? "." : "", f->name, k);
                if (f->type == PROTOBUF_C_TYPE_STRING) {
                    if (arr[k] && !utf8_valid(arr[k]))
                        return false;
                } else if (arr[k] && !msg_strings_valid(arr[k], path, plen, depth + 1)) {
                    return false;
                }
            }
        } else {
            const void *v = *(const void *const *)p;
            if (!v)
                continue;
            snprintf(path + base, plen - base, "%s%s", base ? "." : "", f->name);
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                if (!utf8_valid(v))
                    return false;
            } else if (!msg_strings_valid(v, path, plen, depth + 1)) {
                return false;
            }
        }
        path[base] = '\0';
    }
    return true;
}

/* ------------------------------------------------------------------ context */

static void ctx_drain(struct rpc_ctx *ctx);
static void sender_stop(struct rpc_ctx *ctx);
static bool ctx_dispatch_direct(struct rpc_ctx *ctx, struct rpc_op *op, bool ok, int64_t t_us);

/* rpc_ctx_run: how long the CQ thread may keep running callbacks itself without once
 * finding the CQ empty (waiting in grpc_completion_queue_next). Past that it only
 * queues (cheap) until it waits again: the loop thread takes over the backlog, and
 * this thread gets back to polling, i.e. to reading new calls off the sockets and
 * answering cq_hooks (gRPC returns queued completions without polling the fds). */
#define DIRECT_BUDGET_US 500
/* a grpc_completion_queue_next() that took longer than this waited for work */
#define CQ_IDLE_US 30
/* event-queue entries kept across idle periods (rpc_ctx_compact) */
#define EVQ_KEEP 256

/* A CQ thread's event: -1 the queue is shut down, 0 nothing left to do (no
 * completion, or its cq_fn handled it on this thread), 1 *ret is for the loop. */
static int cq_event_take(grpc_event ev, struct rpc_op **ret)
{
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
        return -1;
    if (ev.type != GRPC_OP_COMPLETE)
        return 0;
    *ret = ev.tag;
    return (*ret)->cq_fn && (*ret)->cq_fn(ret, ev.success != 0) ? 0 : 1;
}

/* Queue an event for the loop thread (and wake it when the queue was empty). */
static void ctx_queue(struct rpc_ctx *ctx, struct rpc_op *op, bool ok, int64_t t_us)
{
    pthread_mutex_lock(&ctx->mu);
    bool wake = ctx->q_len == 0;
    if (ctx->q_len == ctx->q_cap) {
        size_t ncap = ctx->q_cap ? ctx->q_cap * 2 : EVQ_KEEP;
        struct rpc_event *n = realloc(ctx->q, ncap * sizeof(*n));
        /* A tag cannot be dropped (each one owns resources). */
        BUG_ON(!n);
        ctx->q = n;
        ctx->q_cap = ncap;
    }
    ctx->q[ctx->q_len].op = op;
    ctx->q[ctx->q_len].ok = ok;
    ctx->q[ctx->q_len].t_us = t_us;
    ctx->q_len++;
    pthread_mutex_unlock(&ctx->mu);
    atomic_fetch_add_explicit(&ctx->n_queued, 1, memory_order_relaxed);
    if (wake)
        uv_async_send(&ctx->async);
}

/* rpc_method.own_cq: the window over which the second CQ's thread judges whether the
 * main CQ thread gets a CPU when it needs one (the longest it waits between looks),
 * and the share of that window the main one may wait for a CPU before this one polls
 * the sockets too.  Measured with bench_coord.py (2 cores): 100 streams at 5 ms/token
 * keep the main CQ thread's run-queue wait under ~20 %, 1000 streams put it at 20-70 %;
 * above the line readiness Checks waited up to 50-160 ms for it to read them. */
#define PCQ_WINDOW_MS 10
#define PCQ_HOT_PCT 20

static gpr_timespec deadline_in_ms(int ms)
{
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* Time the main CQ thread has waited for a CPU while runnable, in ns (schedstat's
 * run_delay), or -1 when the kernel does not say. */
static int64_t cq_run_delay_ns(int fd)
{
    char buf[96];
    unsigned long long run, delay;
    ssize_t n = fd >= 0 ? pread(fd, buf, sizeof(buf) - 1, 0) : -1;

    if (n <= 0)
        return -1;
    buf[n] = 0;
    if (sscanf(buf, "%llu %llu", &run, &delay) != 2)
        return -1;
    return (int64_t)delay;
}

/* The second CQ's thread (rpc_method.own_cq): cq_hooks here, the rest to the loop.
 * While the main CQ thread waits for a CPU (PCQ_HOT_PCT) it also polls the sockets, in
 * 1 ms turns between which it takes pcq's events; otherwise it only waits for them.
 * Mostly asleep, it is the thread the scheduler runs first when the cores are busy. */
static void *pcq_thread_main(void *arg)
{
    struct rpc_ctx *ctx = arg;
    char path[64];
    bool hot = false;
    int tid;

    while (!(tid = atomic_load_explicit(&ctx->cq_tid, memory_order_acquire)))
        usleep(100);            /* the main CQ thread has just been started */
    snprintf(path, sizeof(path), "/proc/self/task/%d/schedstat", tid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int64_t t0 = rpc_now_us(), b0 = cq_run_delay_ns(fd);
    unsigned turns0 = atomic_load_explicit(&ctx->cq_turns, memory_order_relaxed);

    for (;;) {
        int64_t now = rpc_now_us();
        if (now - t0 >= PCQ_WINDOW_MS * 1000) {
            int64_t b = cq_run_delay_ns(fd);
            unsigned turns = atomic_load_explicit(&ctx->cq_turns, memory_order_relaxed);
            /* waits for a CPU (ns / 10 = us * 100), or has been held outside
             * grpc_completion_queue_next for the whole window (a long callback) */
            hot = (b >= 0 && b0 >= 0 && (b - b0) / 10 > PCQ_HOT_PCT * (now - t0)) ||
                  (turns == turns0 && !atomic_load_explicit(&ctx->cq_inside, memory_order_relaxed));
            t0 = now;
            b0 = b;
            turns0 = turns;
        }
        if (hot)
            (void)grpc_completion_queue_next(ctx->poll_cq, deadline_in_ms(1), NULL);
        grpc_event ev = grpc_completion_queue_next(ctx->pcq, hot ? gpr_inf_past(GPR_CLOCK_MONOTONIC)
                                                                 : deadline_in_ms(PCQ_WINDOW_MS), NULL);
        struct rpc_op *op;
        int k = cq_event_take(ev, &op);
        if (k < 0)
            break;
        if (k > 0)
            ctx_queue(ctx, op, ev.success != 0, rpc_now_us());
    }
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void *cq_thread_main(void *arg)
{
    struct rpc_ctx *ctx = arg;
    int64_t busy_since = 0;

    atomic_store_explicit(&ctx->cq_tid, (int)syscall(SYS_gettid), memory_order_release);

    for (;;) {
        int64_t t_wait = rpc_now_us();
        atomic_store_explicit(&ctx->cq_inside, true, memory_order_relaxed);
        grpc_event ev = grpc_completion_queue_next(ctx->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        atomic_store_explicit(&ctx->cq_inside, false, memory_order_relaxed);
        atomic_fetch_add_explicit(&ctx->cq_turns, 1, memory_order_relaxed);
        int64_t t_us = rpc_now_us();
        if (t_us - t_wait > CQ_IDLE_US)
            busy_since = t_us;
        struct rpc_op *op;
        int k = cq_event_take(ev, &op);
        if (k < 0)
            break;
        if (k == 0)
            continue;
        if (op->direct && t_us - busy_since < DIRECT_BUDGET_US &&
            ctx_dispatch_direct(ctx, op, ev.success != 0, t_us))
            continue;
        ctx_queue(ctx, op, ev.success != 0, t_us);
    }
    return NULL;
}

/* CQ thread: run the event's loop callback here when the loop thread is parked in
 * poll() (rpc_ctx_run): saves the queue, the uv_async wake-up and two thread switches
 * per event. Only while nothing is queued: under load (the loop is busy or events
 * wait in the queue) events go through the queue as usual, so the loop thread shares
 * the work and the CQ thread keeps taking new calls (cq_hook answers) instead of
 * working through a backlog; this thread is the only producer of the main CQ's events,
 * so none of them can be queued while it runs the event, and their order is kept (the
 * second CQ's thread may queue its calls' events meanwhile: other calls). False: queue
 * it. */
static bool ctx_dispatch_direct(struct rpc_ctx *ctx, struct rpc_op *op, bool ok, int64_t t_us)
{
    uv_loop_t *loop = ctx->loop;

    if (!atomic_load_explicit(&ctx->direct, memory_order_relaxed) ||
        atomic_load_explicit(&ctx->loop_wants, memory_order_acquire))
        return false;
    pthread_mutex_lock(&ctx->mu);
    bool empty = ctx->q_len == 0;
    pthread_mutex_unlock(&ctx->mu);
    if (!empty)
        return false;
    if (pthread_mutex_trylock(&ctx->loop_mu) != 0)
        return false;
    if (!atomic_load_explicit(&ctx->direct, memory_order_relaxed)) {
        pthread_mutex_unlock(&ctx->loop_mu);
        return false;
    }
    /* the loop thread waits in poll() and touches nothing of the loop: callbacks may
     * use libuv freely; uv_now() is brought up to date for timers they start */
    uv_update_time(loop);
    ctx->cur_event_us = t_us;
    op->fn(op, ok);
    atomic_fetch_add_explicit(&ctx->n_direct, 1, memory_order_relaxed);
    /* Wake the loop when the callback gave it work its poll() does not wait for: a
     * timer due before the poll's timeout, a handle to close, a new I/O watcher (only
     * registered with epoll inside uv_run), uv_stop(). */
    int t = uv_backend_timeout(loop);
    bool wake = loop->watcher_queue[0] != (void *)&loop->watcher_queue ||
                (t >= 0 && uv_now(loop) + (uint64_t)t < ctx->poll_deadline);
    pthread_mutex_unlock(&ctx->loop_mu);
    if (wake) {
        atomic_fetch_add_explicit(&ctx->n_wakes, 1, memory_order_relaxed);
        uv_async_send(&ctx->async);
    }
    return true;
}

static void ctx_drain(struct rpc_ctx *ctx)
{
    for (;;) {
        pthread_mutex_lock(&ctx->mu);
        size_t n = ctx->q_len;
        if (n == 0) {
            pthread_mutex_unlock(&ctx->mu);
            return;
        }
        /* swap buffers */
        struct rpc_event *full = ctx->q;
        size_t full_cap = ctx->q_cap;
        ctx->q = ctx->work;
        ctx->q_cap = ctx->work_cap;
        ctx->q_len = 0;
        ctx->work = full;
        ctx->work_cap = full_cap;
        pthread_mutex_unlock(&ctx->mu);
        for (size_t i = 0; i < n; i++) {
            ctx->cur_event_us = ctx->work[i].t_us;
            ctx->work[i].op->fn(ctx->work[i].op, ctx->work[i].ok);
        }
    }
}

static void ctx_async_cb(uv_async_t *h)
{
    ctx_drain(h->data);
}

int rpc_ctx_create(uv_loop_t *loop, struct rpc_ctx **ret)
{
    struct rpc_ctx *ctx = calloc(1, sizeof(*ctx));
    int r;

    if (!ctx)
        return -ENOMEM;
    grpc_init();
    ctx->loop = loop;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_mutex_init(&ctx->loop_mu, NULL);
    r = uv_async_init(loop, &ctx->async, ctx_async_cb);
    if (r < 0)
        goto fail;
    ctx->async.data = ctx;
    ctx->cq = grpc_completion_queue_create_for_next(NULL);
    r = -pthread_create(&ctx->thread, NULL, cq_thread_main, ctx);
    if (r < 0) {
        grpc_completion_queue_destroy(ctx->cq);
        uv_close((uv_handle_t *)&ctx->async, NULL);
        uv_run(loop, UV_RUN_NOWAIT);
        goto fail;
    }
    ctx->thread_started = true;
    *ret = ctx;
    return 0;
fail:
    pthread_mutex_destroy(&ctx->mu);
    pthread_mutex_destroy(&ctx->loop_mu);
    free(ctx);
    grpc_shutdown();
    return r;
}

static void ctx_free(struct rpc_ctx *ctx)
{
    free(ctx->q);
    free(ctx->work);
    pthread_mutex_destroy(&ctx->mu);
    pthread_mutex_destroy(&ctx->loop_mu);
    free(ctx);
}

static void ctx_closed(uv_handle_t *h)
{
    struct rpc_ctx *ctx = h->data;

    if (ctx->in_run) {
        ctx->dead = true;       /* rpc_ctx_run frees it once it is off the lock */
        return;
    }
    ctx_free(ctx);
}

void rpc_ctx_destroy(struct rpc_ctx *ctx)
{
    if (!ctx)
        return;
    /* called on the loop thread, so under loop_mu inside rpc_ctx_run: from here the
     * CQ thread queues every event (it never waits for loop_mu, so the join below
     * cannot deadlock) */
    BUG_ON(ctx->thread_started && pthread_equal(pthread_self(), ctx->thread));
    BUG_ON(ctx->pthread_started && pthread_equal(pthread_self(), ctx->pthread));
    atomic_store_explicit(&ctx->direct, false, memory_order_relaxed);
    grpc_completion_queue_shutdown(ctx->cq);
    pthread_join(ctx->thread, NULL);
    if (ctx->pthread_started) {
        grpc_completion_queue_shutdown(ctx->pcq);
        pthread_join(ctx->pthread, NULL);
        grpc_completion_queue_shutdown(ctx->poll_cq);
        while (grpc_completion_queue_next(ctx->poll_cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
    }
    ctx_drain(ctx);
    sender_stop(ctx);
    grpc_completion_queue_destroy(ctx->cq);
    if (ctx->pthread_started) {
        grpc_completion_queue_destroy(ctx->pcq);
        grpc_completion_queue_destroy(ctx->poll_cq);
    }
    if (ctx->live_calls)
        log_warn("rpc: context destroyed with %zu live calls", ctx->live_calls);
    log_debug("rpc: completion events: %" PRIu64 " run on a CQ thread, %" PRIu64 " queued for the loop, %" PRIu64
              " loop wake-ups; %" PRIu64 " held sends in %" PRIu64 " batches, %" PRIu64 " started by the sender thread",
              (uint64_t)ctx->n_direct, (uint64_t)ctx->n_queued, (uint64_t)ctx->n_wakes, (uint64_t)ctx->n_corked_sends,
              (uint64_t)ctx->n_corked_batches, (uint64_t)ctx->n_sender_sends);
    uv_close((uv_handle_t *)&ctx->async, ctx_closed);
    grpc_shutdown();
}

int rpc_ctx_run(struct rpc_ctx *ctx)
{
    uv_loop_t *loop = ctx->loop;
    int alive = 1;

    if (ctx->in_run)
        return -EBUSY;
    pthread_mutex_lock(&ctx->loop_mu);
    ctx->in_run = true;
    atomic_store_explicit(&ctx->direct, true, memory_order_relaxed);
    for (;;) {
        alive = uv_run(loop, UV_RUN_NOWAIT);
        if (!alive || ctx->dead)
            break;
        int timeout = uv_backend_timeout(loop);
        if (timeout == 0)
            continue;
        ctx->poll_deadline = timeout < 0 ? UINT64_MAX : uv_now(loop) + (uint64_t)timeout;
        pthread_mutex_unlock(&ctx->loop_mu);
        /* the backend (epoll) fd is readable when any of the loop's watchers is ready;
         * the CQ thread may run callbacks meanwhile and wakes us (uv_async) when they
         * left the loop work this poll() would not wake for */
        struct pollfd pfd = { .fd = uv_backend_fd(loop), .events = POLLIN };
        int pr = poll(&pfd, 1, timeout);
        if (pr < 0 && errno != EINTR) {
            log_error("rpc: poll on the event loop failed: %s", strerror(errno));
            BUG_ON(1);
        }
        /* the CQ thread dispatches nothing new while we wait for the lock */
        atomic_store_explicit(&ctx->loop_wants, true, memory_order_release);
        pthread_mutex_lock(&ctx->loop_mu);
        atomic_store_explicit(&ctx->loop_wants, false, memory_order_release);
    }
    atomic_store_explicit(&ctx->direct, false, memory_order_relaxed);
    ctx->in_run = false;
    pthread_mutex_unlock(&ctx->loop_mu);
    if (ctx->dead) {
        ctx_free(ctx);
        /* anything the program still has open on the loop runs the usual way */
        if (alive)
            uv_run(loop, UV_RUN_DEFAULT);
    }
    return 0;
}

void rpc_ctx_compact(struct rpc_ctx *ctx)
{
    /* work is the loop thread's (ctx_drain), or the CQ thread's under loop_mu */
    if (ctx->work_cap > EVQ_KEEP) {
        free(ctx->work);
        ctx->work = NULL;
        ctx->work_cap = 0;
    }
    pthread_mutex_lock(&ctx->mu);
    if (ctx->q_len == 0 && ctx->q_cap > EVQ_KEEP) {
        free(ctx->q);
        ctx->q = NULL;
        ctx->q_cap = 0;
    }
    pthread_mutex_unlock(&ctx->mu);
}

void rpc_ctx_stats(const struct rpc_ctx *ctx, struct rpc_ctx_stats *ret)
{
    ret->direct = atomic_load_explicit(&ctx->n_direct, memory_order_relaxed);
    ret->queued = atomic_load_explicit(&ctx->n_queued, memory_order_relaxed);
    ret->wakes = atomic_load_explicit(&ctx->n_wakes, memory_order_relaxed);
    ret->corked_batches = atomic_load_explicit(&ctx->n_corked_batches, memory_order_relaxed);
    ret->corked_sends = atomic_load_explicit(&ctx->n_corked_sends, memory_order_relaxed);
    ret->sender_sends = atomic_load_explicit(&ctx->n_sender_sends, memory_order_relaxed);
}

size_t rpc_ctx_live_calls(const struct rpc_ctx *ctx)
{
    return ctx->live_calls;
}

int64_t rpc_ctx_event_us(const struct rpc_ctx *ctx)
{
    return ctx->cur_event_us;
}

/* ------------------------------------------------------------------ server */

/* Request slots. Each grpc_server_request_*call() tag is a slot that lives as long as
 * the server: when a call arrives, its data moves into a struct rpc_call allocated
 * then (freed when the call ends) and the slot goes back to its pool. A pool asks
 * gRPC again for calls only once half of its slots are back, and then for all of
 * them at once. Both keep the memory that stays allocated between loads compact:
 * a call request allocated one at a time in the middle of a load (ours, and gRPC's
 * own record of it) lands wherever the heap has a hole, and the few hundred of them
 * still waiting when the load ends each keep a page of the freed load in RSS
 * (RELIABILITY A1: RSS back to within 5 % after idle). */
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

static void call_pump(struct rpc_call *c);
static bool sender_defer_unref(struct rpc_ctx *ctx, grpc_call *gc);
static void call_send_failed(struct rpc_call *c, grpc_call_error e);
static int pend_add(struct rpc_ctx *ctx, struct rpc_call *c, unsigned what);
static void call_on_new(struct rpc_op *op, bool ok);
static void slot_put(struct rpc_slot *sl);

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
    if (c->call && !sender_defer_unref(s->ctx, c->call))
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

/* What a send batch of a call carries (call_pump decides, call_send_ops builds it). */
enum { SEND_MD = 1, SEND_MSG = 2, SEND_STATUS = 4 };

/* The ops of a send batch, from the call's fields: c->cur_send and the status do not
 * change while the send is in flight (send_in_flight), so the sender thread may build
 * them too (rpc_ctx_uncork). */
static size_t call_send_ops(struct rpc_call *c, unsigned what, grpc_op ops[3])
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
    if (c->s->ctx->corked && pend_add(c->s->ctx, c, what) == 0)
        return;
    grpc_op ops[3];
    size_t n = call_send_ops(c, what, ops);
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

/* ------------------------------------------------------------------ cork */

/* Why: each grpc_call_start_batch() made outside gRPC's own threads runs the HTTP/2
 * transport's write at once, one sendmsg() per message: relaying an engine's output
 * batch of ~90 tokens to 90 client streams then takes ~90 sendmsg() calls in a row
 * (~5.5 us each with the reader's wake-up), and the last stream's token waits for all
 * of them.  Corked sends are started at uncork by two threads at once, this one and
 * the sender thread, taking entries from one index: calls that share a connection
 * meet in its transport's lock, where one thread's write carries the other's queued
 * frames too (fewer, larger writes), and the streams on other connections are written
 * in parallel.  Only sends are held (server calls' messages and statuses); everything
 * else starts as before.  Measured (bench_coord.py cost: 100 streams, 5 ms per token,
 * 2 cores): added delivery p99 1.1-1.4 ms with one thread, 0.4-0.7 ms with two. */

/* fewer held sends than this are started by this thread alone (a hand-off costs a
 * wake-up of the sender thread, ~10-50 us on a busy machine) */
#define CORK_SPLIT_MIN 8
/* recycled lists kept (16 bytes per held send; one is filled while at most two more are
 * being started or wait for the sender thread) */
#define HELD_KEEP 2

static struct rpc_held *held_get(struct rpc_ctx *ctx)
{
    struct rpc_held *h = NULL;

    if (ctx->sthread_started) {
        pthread_mutex_lock(&ctx->s_mu);
        if ((h = ctx->s_free)) {
            ctx->s_free = h->free_next;
            ctx->s_n_free--;
        }
        pthread_mutex_unlock(&ctx->s_mu);
    }
    if (!h)
        h = calloc(1, sizeof(*h));
    if (h)
        h->len = 0;
    return h;
}

/* One taker is done with h: the last one recycles it (any thread). */
static void held_put(struct rpc_ctx *ctx, struct rpc_held *h)
{
    if (atomic_fetch_sub_explicit(&h->takers, 1, memory_order_acq_rel) != 1)
        return;
    if (ctx->sthread_started) {
        pthread_mutex_lock(&ctx->s_mu);
        bool keep = ctx->s_n_free < HELD_KEEP;
        if (keep) {
            h->free_next = ctx->s_free;
            ctx->s_free = h;
            ctx->s_n_free++;
        }
        pthread_mutex_unlock(&ctx->s_mu);
        if (keep)
            return;
    }
    free(h->v);
    free(h);
}

static void held_free_all(struct rpc_held *h)
{
    while (h) {
        struct rpc_held *n = h->free_next;
        free(h->v);
        free(h);
        h = n;
    }
}

static int pend_add(struct rpc_ctx *ctx, struct rpc_call *c, unsigned what)
{
    struct rpc_held *h = ctx->held;

    if (!h && !(h = ctx->held = held_get(ctx)))
        return -ENOMEM;         /* the caller starts this one itself */
    if (h->len == h->cap) {
        size_t ncap = h->cap ? 2 * h->cap : 64;
        struct rpc_pending *nv = realloc(h->v, ncap * sizeof(*nv));
        if (!nv)
            return -ENOMEM;
        h->v = nv;
        h->cap = ncap;
    }
    h->v[h->len].c = c;
    h->v[h->len].what = what;
    h->len++;
    return 0;
}

/* Start held sends until none is left (either thread; h->v and h->len do not change
 * while h has takers).  A send gRPC refuses to start is handed to the loop as a send
 * that failed (call_on_send, not ok): the call is cancelled and released there. */
static size_t held_run(struct rpc_ctx *ctx, struct rpc_held *h, bool sender)
{
    size_t done = 0;

    for (;;) {
        size_t i = atomic_fetch_add_explicit(&h->next, 1, memory_order_relaxed);
        if (i >= h->len)
            return done;
        struct rpc_call *c = h->v[i].c;
        grpc_call *gc = c->call;
        grpc_op ops[3];
        size_t n = call_send_ops(c, h->v[i].what, ops);
        if (sender) {
            pthread_mutex_lock(&ctx->s_mu);
            ctx->s_cur = gc;
            pthread_mutex_unlock(&ctx->s_mu);
        }
        grpc_call_error e = grpc_call_start_batch(gc, ops, n, &c->op_send, NULL);
        if (e != GRPC_CALL_OK) {            /* (no completion: c is still there) */
            log_error("rpc: %s: start_batch(send) failed: %d", c->method_name, (int)e);
            ctx_queue(ctx, &c->op_send, false, rpc_now_us());
        }
        if (sender) {
            /* the send may have completed meanwhile and its call been released
             * (sender_defer_unref): the last reference is dropped here */
            pthread_mutex_lock(&ctx->s_mu);
            grpc_call *unref = ctx->s_unref;
            ctx->s_cur = ctx->s_unref = NULL;
            pthread_mutex_unlock(&ctx->s_mu);
            if (unref)
                grpc_call_unref(unref);
        }
        done++;
    }
}

/* call_free (loop): a call's send can complete, and the call be released, while the
 * sender thread is still inside the grpc_call_start_batch() that started it; the
 * grpc_call is then unreferenced by the sender thread once that returns (gRPC's calls
 * are thread-compatible for unref). True: deferred. */
static bool sender_defer_unref(struct rpc_ctx *ctx, grpc_call *gc)
{
    bool defer = false;

    if (!ctx->sthread_started)
        return false;
    pthread_mutex_lock(&ctx->s_mu);
    if (ctx->s_cur == gc) {
        ctx->s_unref = gc;
        defer = true;
    }
    pthread_mutex_unlock(&ctx->s_mu);
    return defer;
}

static void *sender_main(void *arg)
{
    struct rpc_ctx *ctx = arg;

    pthread_mutex_lock(&ctx->s_mu);
    for (;;) {
        while (!ctx->s_work && !ctx->s_quit)
            pthread_cond_wait(&ctx->s_cv, &ctx->s_mu);
        if (ctx->s_quit)
            break;
        struct rpc_held *h = ctx->s_work;
        ctx->s_work = NULL;
        pthread_mutex_unlock(&ctx->s_mu);
        size_t k = held_run(ctx, h, true);
        atomic_fetch_add_explicit(&ctx->n_sender_sends, k, memory_order_relaxed);
        held_put(ctx, h);
        pthread_mutex_lock(&ctx->s_mu);
    }
    pthread_mutex_unlock(&ctx->s_mu);
    return NULL;
}

static bool sender_start(struct rpc_ctx *ctx)
{
    if (ctx->sthread_started)
        return true;
    pthread_mutex_init(&ctx->s_mu, NULL);
    pthread_cond_init(&ctx->s_cv, NULL);
    int r = pthread_create(&ctx->sthread, NULL, sender_main, ctx);
    if (r != 0) {
        log_warn("rpc: cannot start the sender thread (%s): held sends start on one thread", strerror(r));
        pthread_mutex_destroy(&ctx->s_mu);
        pthread_cond_destroy(&ctx->s_cv);
        return false;
    }
    pthread_setname_np(ctx->sthread, "rpc-sender");
    ctx->sthread_started = true;
    return true;
}

/* rpc_ctx_destroy, after the CQ threads stopped: nothing is corked or being started */
static void sender_stop(struct rpc_ctx *ctx)
{
    if (ctx->held) {
        free(ctx->held->v);
        free(ctx->held);
        ctx->held = NULL;
    }
    if (!ctx->sthread_started)
        return;
    pthread_mutex_lock(&ctx->s_mu);
    ctx->s_quit = true;
    pthread_cond_signal(&ctx->s_cv);
    pthread_mutex_unlock(&ctx->s_mu);
    pthread_join(ctx->sthread, NULL);
    if (ctx->s_work)
        held_put(ctx, ctx->s_work);     /* (already run by the loop thread) */
    held_free_all(ctx->s_free);
    pthread_mutex_destroy(&ctx->s_mu);
    pthread_cond_destroy(&ctx->s_cv);
    ctx->sthread_started = false;
}

int rpc_ctx_set_sender(struct rpc_ctx *ctx, bool on)
{
    ctx->sender = on && sender_start(ctx);
    return on && !ctx->sender ? -EAGAIN : 0;
}

void rpc_ctx_cork(struct rpc_ctx *ctx)
{
    ctx->corked++;
}

void rpc_ctx_uncork(struct rpc_ctx *ctx)
{
    struct rpc_held *h = ctx->held, *old = NULL;

    BUG_ON(ctx->corked <= 0);
    if (--ctx->corked > 0 || !h || h->len == 0)
        return;
    ctx->held = NULL;
    atomic_store_explicit(&h->next, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&ctx->n_corked_batches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&ctx->n_corked_sends, h->len, memory_order_relaxed);
    if (h->len >= CORK_SPLIT_MIN && ctx->sender) {
        atomic_store_explicit(&h->takers, 2, memory_order_relaxed);
        pthread_mutex_lock(&ctx->s_mu);
        old = ctx->s_work;              /* one the sender has not woken up for */
        ctx->s_work = h;
        pthread_cond_signal(&ctx->s_cv);
        pthread_mutex_unlock(&ctx->s_mu);
        if (old)
            held_put(ctx, old);         /* its sends were all started here */
    } else {
        atomic_store_explicit(&h->takers, 1, memory_order_relaxed);
    }
    /* never waits for the sender thread: one preempted in the middle of a send would
     * hold the loop for a time slice (seen as 2-3 ms stalls at 100 streams) */
    held_run(ctx, h, false);
    held_put(ctx, h);
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
    grpc_byte_buffer *bb = bb_encode(msg, &len);
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

bool rpc_call_cancelled(const struct rpc_call *c)
{
    return c->cancelled;
}

int64_t rpc_call_deadline_ms(const struct rpc_call *c)
{
    return deadline_to_ms(c->deadline);
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

void rpc_call_peer(const struct rpc_call *c, char *buf, size_t len)
{
    char *p = grpc_call_get_peer(c->call);
    snprintf(buf, len, "%s", p ? p : "?");
    gpr_free(p);
}

const char *rpc_call_method(const struct rpc_call *c)
{
    return c->method_name;
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
    slot_put(sl);
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
        slot_put(sl);
        return c;
    }
    log_error("rpc: out of memory taking a new call");
    grpc_call_cancel_with_status(sl->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
    slot_drop(sl);
    return NULL;
}

/* Loop thread: a slot's tag came back. */
static void slot_on_new(struct rpc_op *op, bool ok)
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
        call_end_early(c, RPC_UNAUTHENTICATED, "missing or invalid API key");
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
        c->req = bb_decode(c->payload, c->rm->m.req_desc);
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        if (!c->req) {
            call_end_early(c, RPC_INVALID_ARGUMENT, "request is not a valid %s message", c->rm->m.req_desc->name);
            return;
        }
        char path[256] = "";
        if (!msg_strings_valid(c->req, path, sizeof(path), 0)) {
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
static bool slot_new_cq(struct rpc_op **opp, bool ok)
{
    struct rpc_slot *sl = (struct rpc_slot *)((char *)*opp - offsetof(struct rpc_slot, op));

    if (!ok || !sl->call || !sl->rm || !sl->rm->m.cq_hook)
        return false;                  /* slot_on_new on the loop */
    struct rpc_call *c = slot_take(sl);
    if (!c)
        return true;
    *opp = &c->op_new;                 /* from here on the loop takes the call, not the slot */
    /* what the loop would answer first is left to the loop */
    if (!call_authorized(c) || deadline_to_ms(c->deadline) <= rpc_now_ms() || (!c->payload && !c->req))
        return false;
    /* once answered, c is not ours any more (the reply's completion frees it) */
    if (c->rm->m.cq_hook(c, c->rm->m.ud))
        return true;
    BUG_ON(c->cq_replied);
    return false;
}

int64_t rpc_cq_deadline_ms(const struct rpc_call *c)
{
    return deadline_to_ms(c->deadline);
}

const ProtobufCMessage *rpc_cq_request(struct rpc_call *c)
{
    char path[256] = "";

    if (c->cq_decoded)
        return c->req;
    if (!c->payload)
        return NULL;
    ProtobufCMessage *m = bb_decode(c->payload, c->rm->m.req_desc);
    if (!m)
        return NULL;
    if (!msg_strings_valid(m, path, sizeof(path), 0)) {
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
        c->cur_send = bb_encode(resp, NULL);
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
static int slot_request(struct rpc_slot *sl)
{
    struct rpc_server *s = sl->s;
    struct reg_method *rm = sl->rm;
    grpc_call_error e;

    sl->call = NULL;
    sl->payload = NULL;
    grpc_metadata_array_init(&sl->md);
    if (rm) {
        grpc_completion_queue *cq = rm->m.own_cq ? s->ctx->pcq : s->ctx->cq;
        e = grpc_server_request_registered_call(s->srv, rm->handle, &sl->call, &sl->deadline, &sl->md,
                                                rm->m.req_desc ? &sl->payload : NULL, cq, cq, &sl->op);
    } else {
        grpc_call_details_init(&sl->details);
        e = grpc_server_request_call(s->srv, &sl->call, &sl->details, &sl->md, s->ctx->cq, s->ctx->cq,
                                     &sl->op);
    }
    if (e != GRPC_CALL_OK) {
        log_error("rpc: request_call failed: %d", (int)e);
        grpc_metadata_array_destroy(&sl->md);
        if (!rm)
            grpc_call_details_destroy(&sl->details);
        return -EIO;
    }
    s->requested++;
    return 0;
}

/* Request every free slot of the pool once half of them are free (req_mu held). */
static void pool_refill_locked(struct rpc_server *s, struct slot_pool *p)
{
    if (s->shutting_down || p->n - p->n_free > p->n / 2)
        return;
    while (p->free) {
        struct rpc_slot *sl = p->free;
        if (slot_request(sl) < 0)
            break;
        p->free = sl->next;
        p->n_free--;
    }
}

/* Give a slot whose tag came back to its pool (either thread). */
static void slot_put(struct rpc_slot *sl)
{
    struct rpc_server *s = sl->s;
    struct slot_pool *p = sl->pool;

    sl->call = NULL;
    sl->payload = NULL;
    pthread_mutex_lock(&s->req_mu);
    sl->next = p->free;
    p->free = sl;
    p->n_free++;
    pool_refill_locked(s, p);
    pthread_mutex_unlock(&s->req_mu);
    s->requested--;                    /* last: rpc_server_destroy waits for 0 */
}

static int pool_start(struct rpc_server *s, struct slot_pool *p, struct reg_method *rm, int n)
{
    p->slots = calloc((size_t)n, sizeof(*p->slots));
    if (!p->slots)
        return -ENOMEM;
    p->n = n;
    for (int i = n - 1; i >= 0; i--) {
        struct rpc_slot *sl = &p->slots[i];
        sl->s = s;
        sl->rm = rm;
        sl->pool = p;
        sl->op.fn = slot_on_new;
        if (rm && rm->m.cq_hook)
            sl->op.cq_fn = slot_new_cq;
        sl->next = p->free;
        p->free = sl;
        p->n_free++;
    }
    pthread_mutex_lock(&s->req_mu);
    pool_refill_locked(s, p);
    pthread_mutex_unlock(&s->req_mu);
    return 0;
}

int rpc_server_create(struct rpc_ctx *ctx, const struct rpc_server_opts *opts, struct rpc_server **ret)
{
    struct rpc_server *s = calloc(1, sizeof(*s));
    char *cert = NULL, *key = NULL, *root = NULL;
    int r = 0;

    if (!s)
        return -ENOMEM;
    s->ctx = ctx;
    pthread_mutex_init(&s->req_mu, NULL);
    if (opts)
        s->opts = *opts;
#define DEF(f, v) if (s->opts.f <= 0) s->opts.f = (v)
    DEF(max_recv_msg_bytes, 4 << 20);
    DEF(max_concurrent_streams, 1024);
    DEF(max_metadata_bytes, 16 << 10);
    DEF(keepalive_time_ms, 60000);
    DEF(keepalive_timeout_ms, 20000);
    DEF(min_ping_interval_ms, 10000);
    DEF(max_ping_strikes, 2);
    DEF(requests_per_method, 8);
#undef DEF
    if (s->opts.max_call_buffer_bytes == 0)
        s->opts.max_call_buffer_bytes = 1 << 20;
    if (opts && opts->api_key && opts->api_key[0]) {
        s->api_key = strdup(opts->api_key);
        if (!s->api_key) {
            r = -ENOMEM;
            goto fail;
        }
    }
    s->opts.api_key = NULL;
    s->opts.tls = NULL;

    if (opts && opts->tls) {
        const struct rpc_tls_files *t = opts->tls;
        if (!t->cert_file || !t->key_file) {
            log_error("rpc: TLS needs both a certificate and a key file");
            r = -EINVAL;
            goto fail;
        }
        if (t->require_client_cert && !t->root_file) {
            log_error("rpc: requiring client certificates needs a CA bundle (--tls-client-ca); "
                      "without it gRPC would silently skip client verification");
            r = -EINVAL;
            goto fail;
        }
        if ((r = read_file(t->cert_file, &cert)) < 0) {
            log_error("rpc: %s: %s", t->cert_file, strerror(-r));
            goto fail;
        }
        if ((r = read_file(t->key_file, &key)) < 0) {
            log_error("rpc: %s: %s", t->key_file, strerror(-r));
            goto fail;
        }
        if (t->root_file && (r = read_file(t->root_file, &root)) < 0) {
            log_error("rpc: %s: %s", t->root_file, strerror(-r));
            goto fail;
        }
        grpc_ssl_pem_key_cert_pair pair = { .private_key = key, .cert_chain = cert };
        s->creds = grpc_ssl_server_credentials_create_ex(
            root, &pair, 1,
            t->require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
        if (!s->creds) {
            log_error("rpc: could not create TLS server credentials from %s / %s", t->cert_file,
                      t->key_file);
            r = -EINVAL;
            goto fail;
        }
    } else {
        s->creds = grpc_insecure_server_credentials_create();
    }

    grpc_arg args[] = {
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, { .integer = s->opts.max_recv_msg_bytes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, { .integer = -1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS, { .integer = s->opts.max_concurrent_streams } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_METADATA_SIZE, { .integer = s->opts.max_metadata_bytes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, { .integer = s->opts.keepalive_time_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, { .integer = s->opts.keepalive_timeout_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
          { .integer = s->opts.min_ping_interval_ms } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PING_STRIKES, { .integer = s->opts.max_ping_strikes } },
        { GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, { .integer = 0 } },
    };
    grpc_channel_args ca = { .num_args = sizeof(args) / sizeof(args[0]), .args = args };
    s->srv = grpc_server_create(&ca, NULL);
    grpc_server_register_completion_queue(s->srv, ctx->cq, NULL);
    *ret = s;
    r = 0;
    goto cleanup;
fail:
    if (s->creds)
        grpc_server_credentials_release(s->creds);
    free(s->api_key);
    pthread_mutex_destroy(&s->req_mu);
    free(s);
cleanup:
    free(cert);
    if (key) {
        memset(key, 0, strlen(key));
        free(key);
    }
    free(root);
    return r;
}

int rpc_server_add_method(struct rpc_server *s, const struct rpc_method *m)
{
    if (s->started || !m->path || !m->req_desc || !m->handler || (m->own_cq && !m->cq_hook))
        return -EINVAL;
    if (m->own_cq && !s->ctx->pthread_started) {
        struct rpc_ctx *ctx = s->ctx;
        grpc_completion_queue_attributes np = { GRPC_CQ_CURRENT_VERSION, GRPC_CQ_NEXT, GRPC_CQ_NON_POLLING, NULL };
        int r;

        ctx->pcq = grpc_completion_queue_create(grpc_completion_queue_factory_lookup(&np), &np, NULL);
        ctx->poll_cq = grpc_completion_queue_create_for_next(NULL);
        r = -pthread_create(&ctx->pthread, NULL, pcq_thread_main, ctx);
        if (r < 0) {
            grpc_completion_queue_destroy(ctx->pcq);
            grpc_completion_queue_destroy(ctx->poll_cq);
            ctx->pcq = ctx->poll_cq = NULL;
            return r;
        }
        ctx->pthread_started = true;
    }
    if (m->own_cq && !s->pcq_registered) {
        /* poll_cq too: with a poller that keeps fds per pollset (not epoll1), it must be
         * one of the server's pollsets to see its connections */
        grpc_server_register_completion_queue(s->srv, s->ctx->pcq, NULL);
        grpc_server_register_completion_queue(s->srv, s->ctx->poll_cq, NULL);
        s->pcq_registered = true;
    }
    struct reg_method *n = realloc(s->methods, (s->n_methods + 1) * sizeof(*n));
    if (!n)
        return -ENOMEM;
    s->methods = n;
    /* realloc moved the array: pointers into it are taken only after start */
    struct reg_method *rm = &s->methods[s->n_methods++];
    memset(rm, 0, sizeof(*rm));
    rm->m = *m;
    rm->s = s;
    rm->handle = grpc_server_register_method(s->srv, m->path, NULL,
                                             GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!rm->handle) {
        s->n_methods--;
        return -EEXIST;
    }
    return 0;
}

int rpc_server_listen(struct rpc_server *s, const char *addr, int *ret_port)
{
    if (s->started)
        return -EINVAL;
    int port = grpc_server_add_http2_port(s->srv, addr, s->creds);
    if (port <= 0) {
        log_error("rpc: cannot listen on %s (address in use, bad address or permission)", addr);
        return -EADDRINUSE;
    }
    if (ret_port)
        *ret_port = port;
    return 0;
}

int rpc_server_start(struct rpc_server *s)
{
    if (s->started)
        return -EINVAL;
    grpc_server_start(s->srv);
    s->started = true;
    for (size_t i = 0; i < s->n_methods; i++) {
        int n = s->methods[i].m.requests > 0 ? s->methods[i].m.requests : s->opts.requests_per_method;
        if (pool_start(s, &s->methods[i].pool, &s->methods[i], n) < 0)
            return -ENOMEM;
    }
    /* unregistered methods -> UNIMPLEMENTED */
    return pool_start(s, &s->unreg_pool, NULL, 1);
}

static void server_on_shutdown(struct rpc_op *op, bool ok)
{
    struct rpc_server *s = (struct rpc_server *)((char *)op - offsetof(struct rpc_server, shutdown_op));
    s->shutdown_done = true;
    if (s->on_shutdown)
        s->on_shutdown(s->shutdown_ud);
}

void rpc_server_shutdown(struct rpc_server *s, void (*on_done)(void *ud), void *ud)
{
    if (s->shutting_down)
        return;
    pthread_mutex_lock(&s->req_mu);
    s->shutting_down = true;
    pthread_mutex_unlock(&s->req_mu);
    s->on_shutdown = on_done;
    s->shutdown_ud = ud;
    s->shutdown_op.fn = server_on_shutdown;
    grpc_server_shutdown_and_notify(s->srv, s->ctx->cq, &s->shutdown_op);
}

void rpc_server_cancel_all(struct rpc_server *s)
{
    grpc_server_cancel_all_calls(s->srv);
}

void rpc_server_destroy(struct rpc_server *s)
{
    if (!s)
        return;
    if (!s->shutting_down || !s->shutdown_done) {
        log_error("rpc: rpc_server_destroy before shutdown completed");
        abort();
    }
    /* the loop below waits for the CQ threads: never run it there (rpc_ctx_run) */
    BUG_ON(pthread_equal(pthread_self(), s->ctx->thread));
    BUG_ON(s->ctx->pthread_started && pthread_equal(pthread_self(), s->ctx->pthread));
    grpc_server_destroy(s->srv);
    /* Unused request tags come back failed on the CQ; process them now so their
     * memory is released before the server object goes away. */
    while (s->requested) {
        ctx_drain(s->ctx);
        if (s->requested)
            sched_yield();
    }
    grpc_server_credentials_release(s->creds);
    for (size_t i = 0; i < s->n_methods; i++)
        free(s->methods[i].pool.slots);
    free(s->unreg_pool.slots);
    free(s->methods);
    if (s->api_key) {
        memset(s->api_key, 0, strlen(s->api_key));
        free(s->api_key);
    }
    pthread_mutex_destroy(&s->req_mu);
    free(s);
}

/* ------------------------------------------------------------------ client */

struct rpc_channel {
    struct rpc_ctx *ctx;
    grpc_channel *ch;
    char *target;
    char *auth;                 /* "Bearer <key>" or NULL */
    size_t live;
};

struct rpc_client_call {
    struct rpc_channel *ch;
    grpc_call *call;
    const ProtobufCMessageDescriptor *resp_desc;
    rpc_client_msg_fn on_msg;
    rpc_client_done_fn on_done;
    void *ud;
    struct rpc_op op_start, op_recv, op_status;
    grpc_metadata_array init_md, trail_md;
    grpc_byte_buffer *send_buf, *recv_buf;
    grpc_status_code status;
    grpc_slice details;
    grpc_metadata auth_md;
    bool start_pending, recv_pending, status_pending, bad_response, has_auth_md;
    bool status_posted;     /* RECV_STATUS asked for (once the messages have ended) */
};

int rpc_channel_create(struct rpc_ctx *ctx, const char *target, const struct rpc_channel_opts *opts,
                       struct rpc_channel **ret)
{
    struct rpc_channel *ch = calloc(1, sizeof(*ch));
    grpc_channel_credentials *creds = NULL;
    char *cert = NULL, *key = NULL, *root = NULL;
    struct rpc_channel_opts o = { 0 };
    int r = 0;

    if (!ch)
        return -ENOMEM;
    if (opts)
        o = *opts;
    ch->ctx = ctx;
    ch->target = strdup(target);
    if (!ch->target) {
        r = -ENOMEM;
        goto fail;
    }
    if (o.api_key && o.api_key[0]) {
        if (asprintf(&ch->auth, "Bearer %s", o.api_key) < 0) {
            ch->auth = NULL;
            r = -ENOMEM;
            goto fail;
        }
    }
    if (o.tls) {
        if (o.tls->root_file && (r = read_file(o.tls->root_file, &root)) < 0) {
            log_error("rpc: %s: %s", o.tls->root_file, strerror(-r));
            goto fail;
        }
        if (o.tls->cert_file && (r = read_file(o.tls->cert_file, &cert)) < 0) {
            log_error("rpc: %s: %s", o.tls->cert_file, strerror(-r));
            goto fail;
        }
        if (o.tls->key_file && (r = read_file(o.tls->key_file, &key)) < 0) {
            log_error("rpc: %s: %s", o.tls->key_file, strerror(-r));
            goto fail;
        }
        grpc_ssl_pem_key_cert_pair pair = { .private_key = key, .cert_chain = cert };
        creds = grpc_ssl_credentials_create(root, (cert && key) ? &pair : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (!creds) {
        r = -EINVAL;
        goto fail;
    }
    int ka = o.keepalive_time_ms == 0 ? 10000 : o.keepalive_time_ms < 0 ? INT32_MAX : o.keepalive_time_ms;
    grpc_arg args[8];
    size_t na = 0;
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, { .integer = ka } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             { .integer = o.keepalive_timeout_ms > 0 ? o.keepalive_timeout_ms : 5000 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             { .integer = o.keepalive_time_ms < 0 ? 0 : 1 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, { .integer = 0 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                             { .integer = o.max_recv_msg_bytes > 0 ? o.max_recv_msg_bytes : 4 << 20 } };
    args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_RETRIES, { .integer = 0 } };
    if (o.ssl_target_name)
        args[na++] = (grpc_arg){ GRPC_ARG_STRING, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                                 { .string = (char *)o.ssl_target_name } };
    if (o.own_connection)
        args[na++] = (grpc_arg){ GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, { .integer = 1 } };
    grpc_channel_args ca = { .num_args = na, .args = args };
    ch->ch = grpc_channel_create(target, creds, &ca);
    grpc_channel_credentials_release(creds);
    if (!ch->ch) {
        r = -EINVAL;
        goto fail;
    }
    *ret = ch;
    r = 0;
    goto cleanup;
fail:
    free(ch->target);
    free(ch->auth);
    free(ch);
cleanup:
    free(cert);
    free(key);
    free(root);
    return r;
}

void rpc_channel_destroy(struct rpc_channel *ch)
{
    if (!ch)
        return;
    if (ch->live)
        log_warn("rpc: channel %s destroyed with %zu live calls", ch->target, ch->live);
    grpc_channel_destroy(ch->ch);
    free(ch->target);
    free(ch->auth);
    free(ch);
}

const char *rpc_channel_target(const struct rpc_channel *ch)
{
    return ch->target;
}

static void client_maybe_done(struct rpc_client_call *c)
{
    char details[1024];

    if (c->start_pending || c->recv_pending || c->status_pending || !c->status_posted)
        return;
    snprintf(details, sizeof(details), "%.*s", (int)GRPC_SLICE_LENGTH(c->details),
             (const char *)GRPC_SLICE_START_PTR(c->details));
    int st = (int)c->status;
    if (c->bad_response && st == RPC_OK)
        st = RPC_INTERNAL;
    /* the call no longer counts as live: on_done may destroy the channel */
    c->ch->live--;
    c->ch->ctx->live_calls--;
    c->ch = NULL;
    c->on_done(c, st, details, c->ud);
    grpc_slice_unref(c->details);
    grpc_metadata_array_destroy(&c->init_md);
    grpc_metadata_array_destroy(&c->trail_md);
    if (c->has_auth_md) {
        grpc_slice_unref(c->auth_md.key);
        grpc_slice_unref(c->auth_md.value);
    }
    grpc_call_unref(c->call);
    free(c);
}

/* The status is asked for only once the messages have ended (a read returned none, or
 * the call was cancelled): a RECV_STATUS posted with the call would be one more tag
 * outstanding on the CQ for the call's whole life, and a libgrpc built without NDEBUG
 * (Debian's) scans every outstanding tag on each completion. */
static void client_post_status(struct rpc_client_call *c)
{
    grpc_op op;

    if (c->status_posted)
        return;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &c->trail_md;
    op.data.recv_status_on_client.status = &c->status;
    op.data.recv_status_on_client.status_details = &c->details;
    c->status_posted = true;
    c->status_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->call, &op, 1, &c->op_status, NULL);
    BUG_ON(e != GRPC_CALL_OK);
}

static void client_start_recv(struct rpc_client_call *c)
{
    grpc_op op;

    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    c->recv_pending = true;
    if (grpc_call_start_batch(c->call, &op, 1, &c->op_recv, NULL) != GRPC_CALL_OK) {
        c->recv_pending = false;
        client_post_status(c);
    }
}

static void client_on_recv(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_recv));

    c->recv_pending = false;
    if (ok && c->recv_buf) {
        ProtobufCMessage *m = bb_decode(c->recv_buf, c->resp_desc);
        grpc_byte_buffer_destroy(c->recv_buf);
        c->recv_buf = NULL;
        if (!m) {
            c->bad_response = true;
            grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL,
                                         "response could not be decoded", NULL);
            client_post_status(c);
        } else {
            /* the next read is posted before the message is forwarded: gRPC can take
             * the next one in meanwhile (its completion runs after this callback) */
            client_start_recv(c);
            if (c->on_msg)
                c->on_msg(c, m, c->ud);
            protobuf_c_message_free_unpacked(m, NULL);
        }
    } else {
        if (c->recv_buf) {
            grpc_byte_buffer_destroy(c->recv_buf);
            c->recv_buf = NULL;
        }
        client_post_status(c);      /* the messages have ended */
    }
    client_maybe_done(c);
}

static void client_on_start(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_start));
    c->start_pending = false;
    if (c->send_buf) {
        grpc_byte_buffer_destroy(c->send_buf);
        c->send_buf = NULL;
    }
    client_maybe_done(c);
}

static void client_on_status(struct rpc_op *op, bool ok)
{
    struct rpc_client_call *c = (struct rpc_client_call *)((char *)op - offsetof(struct rpc_client_call, op_status));
    c->status_pending = false;
    client_maybe_done(c);
}

int rpc_client_start(struct rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                     const ProtobufCMessageDescriptor *resp_desc, int64_t deadline_ms,
                     rpc_client_msg_fn on_msg, rpc_client_done_fn on_done, void *ud,
                     struct rpc_client_call **ret)
{
    struct rpc_client_call *c;
    grpc_op ops[4];
    size_t n = 0;

    if (!on_done || !req || !resp_desc)
        return -EINVAL;
    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->ch = ch;
    c->resp_desc = resp_desc;
    c->on_msg = on_msg;
    c->on_done = on_done;
    c->ud = ud;
    c->op_start.fn = client_on_start;
    c->op_recv.fn = client_on_recv;
    c->op_recv.direct = true;
    c->op_status.fn = client_on_status;
    grpc_metadata_array_init(&c->init_md);
    grpc_metadata_array_init(&c->trail_md);
    c->details = grpc_empty_slice();
    grpc_slice m = grpc_slice_from_copied_string(method);
    c->call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, ch->ctx->cq, m, NULL,
                                       deadline_from_ms(deadline_ms), NULL);
    grpc_slice_unref(m);
    if (!c->call) {
        grpc_metadata_array_destroy(&c->init_md);
        grpc_metadata_array_destroy(&c->trail_md);
        free(c);
        return -EIO;
    }
    c->send_buf = bb_encode(req, NULL);
    memset(ops, 0, sizeof(ops));
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (ch->auth) {
        c->auth_md.key = grpc_slice_from_static_string("authorization");
        c->auth_md.value = grpc_slice_from_copied_string(ch->auth);
        ops[n].data.send_initial_metadata.count = 1;
        ops[n].data.send_initial_metadata.metadata = &c->auth_md;
        c->has_auth_md = true;
    }
    n++;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_buf;
    n++;
    ops[n].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    n++;
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n].data.recv_initial_metadata.recv_initial_metadata = &c->init_md;
    n++;
    ch->live++;
    ch->ctx->live_calls++;
    c->start_pending = true;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->op_start, NULL);
    BUG_ON(e != GRPC_CALL_OK);
    client_start_recv(c);
    if (ret)
        *ret = c;
    return 0;
}

void rpc_client_cancel(struct rpc_client_call *c)
{
    grpc_call_cancel(c->call, NULL);
}

bool rpc_addr_is_loopback(const char *addr)
{
    char host[256];
    const char *p;
    size_t n;

    if (strncmp(addr, "unix:", 5) == 0 || strncmp(addr, "unix-abstract:", 14) == 0)
        return true;
    if (addr[0] == '[') {
        p = strchr(addr, ']');
        if (!p)
            return false;
        n = (size_t)(p - addr - 1);
        if (n >= sizeof(host))
            return false;
        memcpy(host, addr + 1, n);
    } else {
        p = strrchr(addr, ':');
        n = p ? (size_t)(p - addr) : strlen(addr);
        if (n >= sizeof(host))
            return false;
        memcpy(host, addr, n);
    }
    host[n] = '\0';
    if (strcmp(host, "localhost") == 0)
        return true;
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1)
        return memcmp(&a6, &in6addr_loopback, sizeof(a6)) == 0;
    return false;
}
