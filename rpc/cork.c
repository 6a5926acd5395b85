/* cork.c - held sends: rpc_ctx_cork() / rpc_ctx_uncork() and the sender thread. */
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

int rpc__pend_add(struct rpc_ctx *ctx, struct rpc_call *c, unsigned what)
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
 * that failed (call.c's call_on_send, not ok): the call is cancelled and released there. */
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
        size_t n = rpc__call_send_ops(c, h->v[i].what, ops);
        if (sender) {
            pthread_mutex_lock(&ctx->s_mu);
            ctx->s_cur = gc;
            pthread_mutex_unlock(&ctx->s_mu);
        }
        grpc_call_error e = grpc_call_start_batch(gc, ops, n, &c->op_send, NULL);
        if (e != GRPC_CALL_OK) {            /* (no completion: c is still there) */
            log_error("rpc: %s: start_batch(send) failed: %d", c->method_name, (int)e);
            rpc__ctx_queue(ctx, &c->op_send, false, rpc_now_us());
        }
        if (sender) {
            /* the send may have completed meanwhile and its call been released
             * (rpc__sender_defer_unref): the last reference is dropped here */
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

/* call.c's call_free (loop): a call's send can complete, and the call be released, while the
 * sender thread is still inside the grpc_call_start_batch() that started it; the
 * grpc_call is then unreferenced by the sender thread once that returns (gRPC's calls
 * are thread-compatible for unref). True: deferred. */
bool rpc__sender_defer_unref(struct rpc_ctx *ctx, grpc_call *gc)
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
void rpc__sender_stop(struct rpc_ctx *ctx)
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

