/* reply.h - the life of a generation behind one HTTP answer, shared by every HTTP door
 * (chat and text completions: openai-render.c; Responses and Messages: door.c).
 *
 * reply_start() serves a request through req_submit() as n choices (n requests sharing
 * the prompt) and is their client side (struct req_client_ops): it starts the stream, hands
 * each chunk and final to the door's ops to render or keep, cancels every choice when the
 * client goes away or the deadline passes (and the others, later, when one fails), and
 * once every choice has ended gives the answer exactly once: the stream's last events, an
 * error in the door's shape, or the whole answer.
 *
 * Lifetime of a reply: from reply_new until every choice has ended and the answer is
 * handed to http.c, or the client went away and every choice was cancelled; freed through
 * its timer's close (the timer carries the request's deadline and the deferred
 * cancellation of the other choices when one fails), the door's ud with it (free_ud).
 * Loop thread only. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "chunk.h"
#include "strbuf.h"

struct coord;
struct http_req;
struct reply;
struct request;

/* What a door renders.  i: the choice.  Streaming hooks append their events to b. */
struct reply_ops {
    /* streaming: after the headers, the first events (NULL: none) */
    void (*begin)(struct reply *g, struct strbuf *b);
    /* a chunk of choice i: streaming, its events onto b; else kept for the whole answer.
     * 0 or -ENOMEM */
    int (*chunk)(struct reply *g, uint32_t i, const struct chunk *ch, struct strbuf *b);
    /* choice i's final: kept */
    void (*final)(struct reply *g, uint32_t i, const struct chunk_final *f);
    /* streaming (NULL: none): choice i's closing events, sent as it ends */
    void (*final_event)(struct reply *g, uint32_t i, struct strbuf *b);
    /* streaming: after every choice's final, the stream's last events */
    void (*end)(struct reply *g, struct strbuf *b);
    /* streaming: a failure after the stream started (g->fail_status, g->fail_msg) */
    void (*fail_event)(struct reply *g, struct strbuf *b);
    /* not streaming: the whole answer, given to g->hr */
    void (*whole)(struct reply *g);
    /* an error answer to g->hr in the door's shape (rpc: enum rpc_status) */
    void (*error)(struct reply *g, int rpc, const char *msg);
    /* the answer was given and no choice failed (NULL: nothing) */
    void (*completed)(struct reply *g);
    /* the door's ud is let go (NULL: nothing) */
    void (*free_ud)(void *ud);
};

struct reply_choice {
    struct reply *g;
    uint32_t index;
    struct req *r;                  /* watched (admitted) and not yet ended */
    bool ended;
};

struct reply {
    struct coord *co;
    struct http_req *hr;            /* NULL once the client is gone or the answer is given */
    const struct reply_ops *ops;
    void *ud;                       /* the door's */
    bool stream;
    bool started;                   /* streaming: the headers and begin's events are sent */
    bool failed, busy, answered, freeing, cancel_pending;
    int fail_status;                /* enum rpc_status of the first choice that failed */
    char fail_msg[768];
    char id[160];                   /* the answer's id: the door's prefix and the request id */
    char model[160];
    int64_t created;                /* seconds since the epoch */
    uint32_t n, live;               /* choices, and those not yet ended */
    uint32_t prompt_tokens;         /* as the first chunk with usage said (0 until then) */
    struct reply_choice *ch;
    uv_timer_t timer;
};

/* A reply to hr of n choices, streamed or not, rendered by the door's ops (ud: the door's,
 * handed over: let go through free_ud from reply_start on); NULL: out of memory. */
struct reply *reply_new(struct coord *co, struct http_req *hr, uint32_t n, bool stream, const struct reply_ops *ops,
                        void *ud);
/* Serve in (owned from here) for g: the answer's id is id_prefix and the request id (one
 * assigned when in has none).  g is the request's from here (freed when answered). */
void reply_start(struct reply *g, struct request *in, const char *id_prefix);
