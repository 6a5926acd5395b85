/* context.c - the rpc context: completion-queue threads, the hand-over of events to the
 * libuv loop thread, and the direct dispatch from the CQ thread (see rpc.h). */
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
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ------------------------------------------------------------------ context */

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
void rpc__ctx_queue(struct rpc_ctx *ctx, struct rpc_op *op, bool ok, int64_t t_us)
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
void *rpc__pcq_thread_main(void *arg)
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
            rpc__ctx_queue(ctx, op, ev.success != 0, rpc_now_us());
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
        rpc__ctx_queue(ctx, op, ev.success != 0, t_us);
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

void rpc__ctx_drain(struct rpc_ctx *ctx)
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
    rpc__ctx_drain(h->data);
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
    rpc__ctx_drain(ctx);
    rpc__sender_stop(ctx);
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
    /* work is the loop thread's (rpc__ctx_drain), or the CQ thread's under loop_mu */
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

