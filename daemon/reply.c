/* reply.c - the life of a generation behind one HTTP answer (reply.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord-int.h"
#include "http.h"
#include "log.h"
#include "reply.h"

static void reply_done_check(struct reply *g);

static void reply_freed(uv_handle_t *h)
{
    struct reply *g = h->data;

    if (g->ops->free_ud)
        g->ops->free_ud(g->ud);
    free(g->ch);
    free(g);
}

static void reply_free(struct reply *g)
{
    if (g->freeing)
        return;
    g->freeing = true;
    if (g->hr)
        http_req_on_close(g->hr, NULL, NULL);
    g->hr = NULL;
    uv_timer_stop(&g->timer);
    uv_close((uv_handle_t *)&g->timer, reply_freed);
}

/* Cancel every choice still running (an entry point: the timer, the client's close). */
static void reply_cancel_all(struct reply *g)
{
    g->busy = true;
    for (uint32_t i = 0; i < g->n; i++) {
        struct req *r = g->ch[i].r;

        if (r)
            req_client_cancel(r);   /* its end op runs: ch[i].r = NULL */
    }
    g->busy = false;
    reply_done_check(g);
}

static void reply_timer_cb(uv_timer_t *t)
{
    struct reply *g = t->data;

    g->cancel_pending = false;
    reply_cancel_all(g);
}

static void reply_on_close(struct http_req *hr, bool completed, void *ud)
{
    struct reply *g = ud;

    (void)hr;
    g->hr = NULL;
    if (!completed && g->live)
        log_req_info(g->id, "client closed the connection: cancelling");
    reply_cancel_all(g);
}

/* One choice failed: the others are cancelled, later (never from inside req.c). */
static void reply_fail(struct reply *g, int status, const char *msg)
{
    if (!g->failed) {
        g->failed = true;
        g->fail_status = status;
        snprintf(g->fail_msg, sizeof(g->fail_msg), "%s", msg);
    }
    if (g->live && !g->cancel_pending && !g->freeing) {
        g->cancel_pending = true;
        uv_timer_start(&g->timer, reply_timer_cb, 0, 0);
    }
}

static int reply_write(struct reply *g, struct strbuf *b)
{
    if (b->oom)
        return -ENOMEM;
    if (!b->len)
        return 0;
    return g->hr ? http_stream_write(g->hr, b->p, b->len) : -ECANCELED;
}

/* The headers and the door's first events (once). */
static int stream_begin(struct reply *g)
{
    struct strbuf b = STRBUF_INIT;
    int e;

    if (g->started)
        return 0;
    g->started = true;
    if ((e = http_stream_start(g->hr, 200, "text/event-stream")) < 0)
        return e;
    if (g->ops->begin)
        g->ops->begin(g, &b);
    e = reply_write(g, &b);
    strbuf_done(&b);
    return e;
}

/* Every choice has ended: give the answer (once), then let go. */
static void reply_done_check(struct reply *g)
{
    if (g->live || g->busy || g->freeing)
        return;
    if (g->hr && !g->answered) {
        g->answered = true;
        if (g->stream && g->started) {
            struct strbuf b = STRBUF_INIT;

            if (g->failed)
                g->ops->fail_event(g, &b);
            else
                g->ops->end(g, &b);
            if (reply_write(g, &b) == 0)
                http_stream_end(g->hr);
            else
                http_req_abort(g->hr);
            strbuf_done(&b);
        } else if (g->failed) {
            g->ops->error(g, g->fail_status, g->fail_msg);
        } else if (g->stream) {
            /* every choice ended without output before the stream began */
            if (stream_begin(g) == 0) {
                g->answered = false;
                reply_done_check(g);
                return;
            }
            http_req_abort(g->hr);
        } else {
            g->ops->whole(g);
        }
        if (!g->failed && g->ops->completed)
            g->ops->completed(g);
    }
    reply_free(g);
}

/* ------------------------------------------------------------------ the client ops */

static int reply_chunk(struct req *r, const struct chunk *ch)
{
    struct reply_choice *c = r->client;
    struct reply *g = c->g;
    struct strbuf b = STRBUF_INIT;
    int e = 0;

    if (g->stream && !g->hr)
        return 0;           /* the client is gone: its cancel is on its way */
    if (ch->has_usage && !g->prompt_tokens)
        g->prompt_tokens = ch->prompt_tokens;
    if (g->stream)
        e = stream_begin(g);
    if (!e)
        e = g->ops->chunk(g, c->index, ch, &b);
    if (!e && g->stream)
        e = reply_write(g, &b);
    strbuf_done(&b);
    if (e == -ENOBUFS) {
        char msg[160];

        snprintf(msg, sizeof(msg), "client is not reading its stream (%zu bytes buffered, cap reached)",
                 g->co->o.max_call_buffer_bytes);
        c->r = NULL;
        c->ended = true;
        g->live--;
        g->failed = true;
        req_client_detach(r, RPC_RESOURCE_EXHAUSTED, msg);
        http_req_abort(g->hr);      /* the other choices end with the connection */
        return e;
    }
    return e == -ENOMEM ? e : 0;
}

static void reply_final(struct req *r, const struct chunk_final *f)
{
    struct reply_choice *c = r->client;
    struct reply *g = c->g;

    g->ops->final(g, c->index, f);
    c->r = NULL;
    c->ended = true;
    g->live--;
    if (g->stream && g->hr && !g->failed && g->ops->final_event) {
        struct strbuf b = STRBUF_INIT;

        if (stream_begin(g) == 0) {
            g->ops->final_event(g, c->index, &b);
            if (reply_write(g, &b) < 0)
                http_req_abort(g->hr);
        }
        strbuf_done(&b);
    }
    reply_done_check(g);
}

static void reply_end(struct req *r, int status, int retry_ms, const char *msg)
{
    struct reply_choice *c = r->client;
    struct reply *g = c->g;

    (void)retry_ms;
    c->r = NULL;
    c->ended = true;
    g->live--;
    reply_fail(g, status, msg);
    reply_done_check(g);
}

static void reply_watch(struct req *r)
{
    struct reply_choice *c = r->client;

    c->r = r;
}

static const struct req_client_ops reply_req_ops = {
    .chunk = reply_chunk, .final = reply_final, .end = reply_end, .watch = reply_watch,
};

struct reply *reply_new(struct coord *co, struct http_req *hr, uint32_t n, bool stream, const struct reply_ops *ops,
                        void *ud)
{
    struct reply *g = calloc(1, sizeof(*g));

    if (g && !(g->ch = calloc(n, sizeof(*g->ch)))) {
        free(g);
        g = NULL;
    }
    if (!g)
        return NULL;
    g->co = co;
    g->hr = hr;
    g->ops = ops;
    g->ud = ud;
    g->stream = stream;
    g->n = g->live = n;
    g->created = (int64_t)time(NULL);
    for (uint32_t i = 0; i < n; i++) {
        g->ch[i].g = g;
        g->ch[i].index = i;
    }
    return g;
}

void reply_start(struct reply *g, struct request *in, const char *id_prefix)
{
    struct coord *co = g->co;
    struct req_caller caller = { 0 };
    void **clients = calloc(g->n, sizeof(*clients));
    int64_t deadline;

    uv_timer_init(&co->loop, &g->timer);
    g->timer.data = g;
    snprintf(g->model, sizeof(g->model), "%s", in->model);
    if (!in->id[0])
        req_id_assign(in->id, sizeof(in->id));
    snprintf(g->id, sizeof(g->id), "%s%s", id_prefix, in->id);
    if (!clients) {
        request_free(in);
        g->live = 0;
        reply_fail(g, RPC_INTERNAL, "out of memory");
        reply_done_check(g);
        return;
    }
    for (uint32_t i = 0; i < g->n; i++)
        clients[i] = &g->ch[i];
    http_req_on_close(g->hr, reply_on_close, g);
    caller.keyed = http_req_keyed(g->hr, &caller.key_hash);
    snprintf(caller.peer, sizeof(caller.peer), "%s", http_req_peer(g->hr));
    deadline = co->o.request_timeout_ms ? rpc_now_ms() + co->o.request_timeout_ms : INT64_MAX;
    g->busy = true;
    req_submit(co, in, &(struct req_origin){ .ops = &reply_req_ops, .clients = clients, .n = g->n,
                                             .deadline_ms = deadline, .caller = &caller });
    g->busy = false;
    free(clients);
    if (g->live && co->o.request_timeout_ms && !g->cancel_pending) {
        /* from now, not from the loop's cached time: the timer must not fire before the
         * deadline (reply_timer_cb would read it as the client's cancel) */
        uv_update_time(&co->loop);
        uv_timer_start(&g->timer, reply_timer_cb, co->o.request_timeout_ms + 1, 0);
    }
    reply_done_check(g);
}
