/* ctl.c - the worker's client of the coordinator's control service
 * (proto/control.proto, stepd.ctl.v1.Control) over the rpc/ library's client.
 *
 * A thread of its own runs a libuv loop with an rpc context: it owns the channel (TLS and
 * the control key from rpc_channel_opts), the Session stream and the ReportState calls;
 * the rank's threads only talk to it through the lock and `wake`.  The session: a
 * RegisterRequest out, ControlEvents in.  The first Rendezvous is handed to
 * worker_ctl_open() (which waits for it with the rendezvous deadline).
 *
 * The rank outlives its coordinator: when the session ends without an order (the
 * coordinator was killed or restarted, the connection broke) the rank keeps its weights,
 * KV and group, counts the loss (worker_ctl_poll: rank 0 fails its in-flight requests
 * then) and dials again with capped exponential backoff (100 ms doubling to 2 s, reset
 * once registered).  Once in a group it registers with the group's epoch (serving_epoch),
 * its state and, on rank 0, the engine's capacity, so that a restarted coordinator
 * re-adopts the group without a rendezvous.  Two events are orders: GroupAbort (the group
 * re-forms: after the rendezvous worker_ctl_poll reports it and the registration's
 * on_group_abort hook runs at once on this thread, to interrupt a collective that waits
 * on a peer - a follower sits in a receive without a deadline; the rank then registers
 * afresh with a new control client, keeping its weights) and Shutdown (worker_ctl_poll
 * reports it; rank 0 stops the group).  Before the rendezvous a refusal that dialling
 * again cannot fix (a bad argument, a wrong key) ends worker_ctl_open() with the
 * coordinator's message.
 * Protobuf-c names stay in this file.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "clock.h"
#include "control.pb-c.h"
#include "log.h"
#include "rpc.h"
#include "worker.h"

#define CTL_SESSION "/stepd.ctl.v1.Control/Session"
#define CTL_REPORT "/stepd.ctl.v1.Control/ReportState"
#define CTL_MAX_MSG (4 * 1024 * 1024)
#define BACKOFF_FIRST_MS 100
#define BACKOFF_MAX_MS 2000
#define REPORT_TIMEOUT_MS 5000

/* A ReportState handed to the loop thread.  The caller waits for done (bounded); the
 * loop's reference and the caller's are counted (refs, under the ctl's lock): the last
 * one to let go frees it. */
struct report {
    struct report *next;
    struct worker_ctl *c;
    int refs;
    int state;
    float progress;
    char message[512];
    bool done;
    int rc;
};

struct worker_ctl {
    /* set at open, read-only afterwards */
    char *target;
    char *group, *device, *engine_address, *control_key;
    void *peer_address;
    size_t peer_address_len;
    unsigned char nccl_id[128];
    size_t nccl_id_len;
    int rank, world_size;
    uint64_t incarnation;
    struct rpc_tls_files tls;
    bool use_tls;
    char *tls_strs[3];
    char hostname[64];
    void (*on_group_abort)(void *ud);
    void *abort_ud;
    /* loop thread */
    pthread_t thread;
    bool thread_started;
    uv_loop_t loop;
    uv_async_t wake;
    uv_timer_t redial;
    struct rpc_ctx *rpc;
    struct rpc_channel *ch;
    struct rpc_client_call *session;    /* the open Session call, NULL between sessions */
    unsigned backoff_ms;
    bool closing_loop;
    /* shared, under lock */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool registered;                    /* the current session got Registered */
    bool have_rdv;                      /* a Rendezvous came (peers) */
    bool rdv_taken;                     /* worker_ctl_open took the peers */
    bool ended;                         /* for good: refused before the rendezvous, or the loop failed */
    bool shutdown;                      /* the coordinator sent Shutdown */
    bool aborted;                       /* in a group, told it re-forms (GroupAbort) */
    bool quit;                          /* worker_ctl_free: stop the loop */
    bool in_group;                      /* the rendezvous is done: the rank belongs to a group */
    unsigned n_lost;                    /* sessions lost after the rendezvous */
    bool ever_registered;               /* some session got Registered */
    unsigned n_dial_failed;             /* sessions that ended before registering, none ever */
    char last_failure[256];             /* the last of those: status and reason */
    uint64_t epoch;                     /* the group's epoch (rendezvous) */
    int state;                          /* last reported (1 loading, 2 ready, 3 failed), 0 none */
    struct worker_ctl_engine eng;       /* rank 0, with READY */
    char session_id[128];
    char reason[512];
    struct worker_peers peers;
    struct report *pending;             /* reports for the loop thread to start, in order */
};

/* ------------------------------------------------------------------ loop thread */

static void session_start(struct worker_ctl *c);

static void ctl_signal(struct worker_ctl *c)
{
    pthread_cond_broadcast(&c->cond);
}

/* A Rendezvous: untrusted, sizes and indices checked before use.  Lock held. */
static int take_rendezvous(struct worker_ctl *c, const Stepd__Ctl__V1__Rendezvous *rv)
{
    struct worker_peers p = { 0 };

    if (rv->world_size != (uint32_t)c->world_size || rv->n_peers != (size_t)c->world_size) {
        snprintf(c->reason, sizeof(c->reason), "rendezvous for world %u with %zu peers, this rank "
                 "expects %d", rv->world_size, rv->n_peers, c->world_size);
        return -EBADMSG;
    }
    if (rv->nccl_unique_id.len > sizeof(p.nccl_id)) {
        snprintf(c->reason, sizeof(c->reason), "rendezvous: NCCL id of %zu bytes", rv->nccl_unique_id.len);
        return -EBADMSG;
    }
    p.world_size = c->world_size;
    p.epoch = rv->epoch;
    if (rv->nccl_unique_id.len)     /* empty (NULL data) for CPU groups */
        memcpy(p.nccl_id, rv->nccl_unique_id.data, rv->nccl_unique_id.len);
    p.nccl_id_len = rv->nccl_unique_id.len;
    for (size_t i = 0; i < rv->n_peers; i++) {
        const Stepd__Ctl__V1__PeerInfo *pi = rv->peers[i];

        if (pi->rank >= (uint32_t)c->world_size || p.addr[pi->rank] || pi->peer_address.len > 64 * 1024) {
            snprintf(c->reason, sizeof(c->reason), "rendezvous: bad peer entry %zu (rank %u, %zu address "
                     "bytes)", i, pi->rank, pi->peer_address.len);
            worker_peers_done(&p);
            return -EBADMSG;
        }
        p.addr[pi->rank] = malloc(pi->peer_address.len ? pi->peer_address.len : 1);
        if (!p.addr[pi->rank]) {
            snprintf(c->reason, sizeof(c->reason), "rendezvous: out of memory");
            worker_peers_done(&p);
            return -ENOMEM;
        }
        if (pi->peer_address.len)
            memcpy(p.addr[pi->rank], pi->peer_address.data, pi->peer_address.len);
        p.len[pi->rank] = pi->peer_address.len;
    }
    c->peers = p;
    c->have_rdv = true;
    c->in_group = true;
    c->epoch = rv->epoch;
    return 0;
}

/* The group this rank belongs to is gone (GroupAbort, or a rendezvous it cannot take part
 * in): before the rendezvous worker_ctl_open() fails; after it the rank leaves the group
 * (worker_ctl_poll says so) and the hook interrupts whatever collective waits on it. */
static void group_lost(struct worker_ctl *c)
{
    pthread_mutex_lock(&c->lock);
    bool in_group = c->in_group;
    if (in_group)
        c->aborted = true;
    else
        c->ended = true;
    ctl_signal(c);
    pthread_mutex_unlock(&c->lock);
    if (in_group) {
        log_warn("%s: leaving the group to register again", c->reason);
        if (c->on_group_abort)
            c->on_group_abort(c->abort_ud);
    }
}

static void on_event(struct rpc_client_call *call, const ProtobufCMessage *msg, void *ud)
{
    struct worker_ctl *c = ud;
    const Stepd__Ctl__V1__ControlEvent *ev = (const void *)msg;
    bool lost = false;

    pthread_mutex_lock(&c->lock);
    switch (ev->event_case) {
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED:
        c->registered = true;
        c->ever_registered = true;
        c->backoff_ms = BACKOFF_FIRST_MS;
        snprintf(c->session_id, sizeof(c->session_id), "%s", ev->registered->session_id);
        if (c->in_group)
            log_notice("control session %s open again: still serving group %s (epoch %llu)",
                       c->session_id, c->group, (unsigned long long)c->epoch);
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_RENDEZVOUS:
        if (c->in_group) {
            /* the coordinator formed a new group without this rank's */
            if (ev->rendezvous->epoch != c->epoch) {
                snprintf(c->reason, sizeof(c->reason), "rendezvous for epoch %llu while serving epoch %llu",
                         (unsigned long long)ev->rendezvous->epoch, (unsigned long long)c->epoch);
                lost = true;
            }
            break;
        }
        if (take_rendezvous(c, ev->rendezvous) < 0)
            lost = true;
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_HEARTBEAT:
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT:
        snprintf(c->reason, sizeof(c->reason), "group abort (epoch %llu): %s",
                 (unsigned long long)ev->group_abort->epoch, ev->group_abort->reason);
        lost = true;
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_SHUTDOWN:
        c->shutdown = true;
        snprintf(c->reason, sizeof(c->reason), "shutdown: %s", ev->shutdown->reason);
        break;
    default:
        break;
    }
    ctl_signal(c);
    pthread_mutex_unlock(&c->lock);
    if (lost) {
        rpc_client_cancel(call);
        group_lost(c);
    }
}

/* Statuses after which dialling again cannot help (before the rendezvous). */
static bool status_final(int st)
{
    return st == RPC_INVALID_ARGUMENT || st == RPC_FAILED_PRECONDITION || st == RPC_UNAUTHENTICATED ||
           st == RPC_PERMISSION_DENIED || st == RPC_UNIMPLEMENTED;
}

static void redial_cb(uv_timer_t *t)
{
    session_start(t->data);
}

static void on_session_done(struct rpc_client_call *call, int status, const char *details, void *ud)
{
    struct worker_ctl *c = ud;
    unsigned delay;

    c->session = NULL;
    pthread_mutex_lock(&c->lock);
    bool quit = c->quit || c->ended || c->shutdown || c->aborted;
    bool was_registered = c->registered;
    c->registered = false;
    c->session_id[0] = '\0';
    if (!quit && !c->in_group && status_final(status)) {
        snprintf(c->reason, sizeof(c->reason), "control session refused: %s: %s", rpc_status_name(status),
                 details);
        c->ended = true;
        quit = true;
    }
    if (!quit && !was_registered && !c->ever_registered) {
        /* never reached the coordinator: say so at once (and every 10th time), not only at
         * the rendezvous deadline; "connection refused" means nothing listens there */
        c->n_dial_failed++;
        snprintf(c->last_failure, sizeof(c->last_failure), "%s: %s", rpc_status_name(status),
                 strcasestr(details, "connection refused") ? "connection refused" : details);
        if (c->n_dial_failed % 10 == 1)
            log_warn("coordinator %s: %s%s; dialling again (%u attempt%s so far)", c->target,
                     c->last_failure, strcasestr(details, "connection refused")
                         ? " (nothing listens there: is it the coordinator's --control-listen?)" : "",
                     c->n_dial_failed, c->n_dial_failed == 1 ? "" : "s");
    }
    if (!quit && c->in_group && was_registered) {
        c->n_lost++;
        log_warn("control session lost (%s: %s): keeping the weights, KV and group %s (epoch %llu); "
                 "dialling the coordinator again", rpc_status_name(status), details, c->group,
                 (unsigned long long)c->epoch);
    }
    ctl_signal(c);
    pthread_mutex_unlock(&c->lock);
    if (quit)
        return;
    delay = c->backoff_ms;
    c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : c->backoff_ms * 2;
    log_debug("control session ended (%s: %s); dialling again in %u ms", rpc_status_name(status), details,
              delay);
    uv_timer_start(&c->redial, redial_cb, delay, 0);
}

/* Rank 0 once READY: the engine's capacity and KV blocks for a message (lock held); NULL
 * otherwise. */
static Stepd__Ctl__V1__EngineLimits *engine_limits(const struct worker_ctl *c, Stepd__Ctl__V1__EngineLimits *lim,
                                                   uint32_t *ret_kv)
{
    if (c->rank != 0 || c->state != 2)
        return NULL;
    lim->max_num_seqs = (uint32_t)c->eng.max_num_seqs;
    lim->max_waiting = (uint32_t)c->eng.max_waiting;
    *ret_kv = (uint32_t)c->eng.kv_blocks_total;
    return lim;
}

static void session_start(struct worker_ctl *c)
{
    Stepd__Ctl__V1__RegisterRequest rq = STEPD__CTL__V1__REGISTER_REQUEST__INIT;
    Stepd__Ctl__V1__EngineLimits lim = STEPD__CTL__V1__ENGINE_LIMITS__INIT;

    if (c->session)
        return;
    rq.group = c->group;
    rq.rank = (uint32_t)c->rank;
    rq.world_size = (uint32_t)c->world_size;
    rq.device = c->device;
    rq.peer_address.data = c->peer_address;
    rq.peer_address.len = c->peer_address_len;
    rq.engine_address = c->engine_address ? c->engine_address : "";
    rq.nccl_unique_id.data = c->nccl_id;
    rq.nccl_unique_id.len = c->nccl_id_len;
    rq.pid = (uint32_t)getpid();
    rq.hostname = c->hostname;
    rq.incarnation = c->incarnation;
    pthread_mutex_lock(&c->lock);
    if (c->in_group) {
        rq.serving_epoch = c->epoch;
        rq.ready = c->state == 2;
        rq.limits = engine_limits(c, &lim, &rq.kv_blocks_total);
    }
    pthread_mutex_unlock(&c->lock);
    if (rpc_client_start(c->ch, CTL_SESSION, &rq.base, &stepd__ctl__v1__control_event__descriptor, 0, on_event,
                         on_session_done, c, &c->session) < 0) {
        c->session = NULL;
        uv_timer_start(&c->redial, redial_cb, c->backoff_ms, 0);
    }
}

/* Lock held. */
static void report_unref(struct report *rp)
{
    if (--rp->refs == 0)
        free(rp);
}

static void report_end(struct report *rp, int rc)
{
    struct worker_ctl *c = rp->c;

    pthread_mutex_lock(&c->lock);
    rp->rc = rc;
    rp->done = true;
    ctl_signal(c);
    report_unref(rp);
    pthread_mutex_unlock(&c->lock);
}

static void on_report_done(struct rpc_client_call *call, int status, const char *details, void *ud)
{
    /* NOT_FOUND / UNAVAILABLE: the session ended meanwhile; the next registration says
     * the state itself */
    if (status != RPC_OK)
        log_warn("ReportState: %s: %s", rpc_status_name(status), details);
    report_end(ud, status == RPC_OK ? 0 : -EIO);
}

/* The loop's share of a report: start the call, or end it at once when no session is up
 * (the next registration carries the state). */
static void report_start(struct worker_ctl *c, struct report *rp)
{
    Stepd__Ctl__V1__StateReport rq = STEPD__CTL__V1__STATE_REPORT__INIT;
    Stepd__Ctl__V1__EngineLimits lim = STEPD__CTL__V1__ENGINE_LIMITS__INIT;
    char sid[128];

    pthread_mutex_lock(&c->lock);
    bool up = c->registered;
    snprintf(sid, sizeof(sid), "%s", c->session_id);
    if (rp->state == 2)
        rq.limits = engine_limits(c, &lim, &rq.kv_blocks_total);
    pthread_mutex_unlock(&c->lock);
    rq.session_id = sid;
    rq.state = (Stepd__Ctl__V1__RankState)rp->state;
    rq.load_progress = rp->progress;
    rq.message = rp->message;
    if (!up || rpc_client_start(c->ch, CTL_REPORT, &rq.base, &stepd__ctl__v1__state_ack__descriptor,
                                rpc_now_ms() + REPORT_TIMEOUT_MS, NULL, on_report_done, rp, NULL) < 0)
        report_end(rp, 0);
}

static void on_wake(uv_async_t *a)
{
    struct worker_ctl *c = a->data;

    pthread_mutex_lock(&c->lock);
    bool quit = c->quit;
    struct report *rp = c->pending;
    c->pending = NULL;
    pthread_mutex_unlock(&c->lock);
    while (rp) {
        struct report *next = rp->next;

        report_start(c, rp);
        rp = next;
    }
    if (quit && !c->closing_loop) {
        c->closing_loop = true;
        uv_timer_stop(&c->redial);
        if (c->session)
            rpc_client_cancel(c->session);
    }
}

static void close_cb(uv_handle_t *h)
{
}

static void *ctl_thread(void *arg)
{
    struct worker_ctl *c = arg;

    session_start(c);
    /* runs until worker_ctl_free: then the session is cancelled and the loop drained */
    while (!c->closing_loop || c->session || rpc_ctx_live_calls(c->rpc) > 0)
        uv_run(&c->loop, UV_RUN_ONCE);
    rpc_channel_destroy(c->ch);
    c->ch = NULL;
    rpc_ctx_destroy(c->rpc);
    c->rpc = NULL;
    uv_close((uv_handle_t *)&c->wake, close_cb);
    uv_close((uv_handle_t *)&c->redial, close_cb);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    return NULL;
}

/* ------------------------------------------------------------------ API */

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

static void ctl_free_fields(struct worker_ctl *c)
{
    free(c->target);
    free(c->group);
    free(c->device);
    free(c->engine_address);
    free(c->control_key);
    free(c->peer_address);
    for (int i = 0; i < 3; i++)
        free(c->tls_strs[i]);
    worker_peers_done(&c->peers);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

int worker_ctl_open(const char *target, const struct worker_ctl_register *reg, int timeout_msec,
                    struct worker_ctl **ret, struct worker_peers *peers, struct err_buf *e)
{
    struct worker_ctl *c = calloc(1, sizeof(*c));
    struct rpc_channel_opts co = { .max_recv_msg_bytes = CTL_MAX_MSG, .keepalive_time_ms = 10000 };
    int64_t until = clk_now_ms() + timeout_msec;
    int r = 0;

    if (!c)
        return err_set(e, -ENOMEM, "out of memory");
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    c->rank = reg->rank;
    c->world_size = reg->world_size;
    c->target = strdup(target);
    c->group = strdup(reg->group);
    c->device = strdup(reg->device);
    c->engine_address = dup_or_null(reg->engine_address);
    c->control_key = dup_or_null(reg->control_key);
    c->on_group_abort = reg->on_group_abort;
    c->abort_ud = reg->abort_ud;
    if (reg->peer_address_len) {
        c->peer_address = malloc(reg->peer_address_len);
        if (c->peer_address)
            memcpy(c->peer_address, reg->peer_address, reg->peer_address_len);
        c->peer_address_len = reg->peer_address_len;
    }
    if (reg->nccl_id && reg->nccl_id_len <= sizeof(c->nccl_id)) {
        memcpy(c->nccl_id, reg->nccl_id, reg->nccl_id_len);
        c->nccl_id_len = reg->nccl_id_len;
    }
    if (reg->tls) {
        c->tls_strs[0] = dup_or_null(reg->tls->cert_file);
        c->tls_strs[1] = dup_or_null(reg->tls->key_file);
        c->tls_strs[2] = dup_or_null(reg->tls->root_file);
        c->tls = (struct rpc_tls_files){ .cert_file = c->tls_strs[0], .key_file = c->tls_strs[1],
                                         .root_file = c->tls_strs[2] };
        c->use_tls = true;
    }
    if (!c->target || !c->group || !c->device || (reg->engine_address && !c->engine_address) ||
        (reg->control_key && !c->control_key) || (reg->peer_address_len && !c->peer_address)) {
        ctl_free_fields(c);
        return err_set(e, -ENOMEM, "out of memory");
    }
    gethostname(c->hostname, sizeof(c->hostname) - 1);
    /* one value for the life of the process: a restarted process is a new incarnation */
    c->incarnation = (uint64_t)time(NULL) << 20 ^ (uint64_t)getpid();
    c->backoff_ms = BACKOFF_FIRST_MS;
    co.api_key = c->control_key;
    co.tls = c->use_tls ? &c->tls : NULL;
    if ((r = uv_loop_init(&c->loop)) < 0) {
        ctl_free_fields(c);
        return err_set(e, -EIO, "control client: uv_loop_init: %s", uv_strerror(r));
    }
    uv_async_init(&c->loop, &c->wake, on_wake);
    c->wake.data = c;
    uv_timer_init(&c->loop, &c->redial);
    c->redial.data = c;
    if ((r = rpc_ctx_create(&c->loop, &c->rpc)) < 0) {
        r = err_set(e, r, "control client: cannot create the gRPC context: %s", err_str(r));
        goto fail_loop;
    }
    if ((r = rpc_channel_create(c->rpc, target, &co, &c->ch)) < 0) {
        r = err_set(e, r, "control client: cannot create a channel to %s%s", target,
                    c->use_tls ? " (TLS files unreadable?)" : "");
        rpc_ctx_destroy(c->rpc);
        goto fail_loop;
    }
    if ((r = -pthread_create(&c->thread, NULL, ctl_thread, c)) < 0) {
        r = err_set(e, r, "cannot start the control thread");
        rpc_channel_destroy(c->ch);
        rpc_ctx_destroy(c->rpc);
        goto fail_loop;
    }
    c->thread_started = true;

    /* wait for the group's rendezvous */
    pthread_mutex_lock(&c->lock);
    while (!c->have_rdv && !c->ended) {
        int64_t left = until - clk_now_ms();
        struct timespec ts = clk_realtime_in_ms(left);

        if (left <= 0)
            break;
        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
    }
    if (c->have_rdv) {
        *peers = c->peers;
        memset(&c->peers, 0, sizeof(c->peers));
        c->rdv_taken = true;
    } else if (c->ended) {
        r = err_set(e, -ECONNREFUSED, "coordinator %s: %s", target, c->reason);
    } else {
        r = err_set(e, -ETIMEDOUT, "rendezvous of group %s timed out after %d ms at %s (%s): the "
                    "coordinator did not complete the group; see its log for the missing ranks",
                    reg->group, timeout_msec, target, c->registered ? "registered" : "never registered");
        if (!c->ever_registered && c->n_dial_failed)
            r = err_set(e, -ETIMEDOUT, "rendezvous of group %s timed out after %d ms: the coordinator "
                        "%s was never reached (%u attempts, the last: %s)", reg->group, timeout_msec,
                        target, c->n_dial_failed, c->last_failure);
    }
    pthread_mutex_unlock(&c->lock);
    if (r < 0) {
        worker_ctl_free(c);
        return r;
    }
    *ret = c;
    return 0;

fail_loop:
    uv_close((uv_handle_t *)&c->wake, close_cb);
    uv_close((uv_handle_t *)&c->redial, close_cb);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    (void)uv_loop_close(&c->loop);
    ctl_free_fields(c);
    return r;
}

int worker_ctl_report(struct worker_ctl *c, int state, float progress, const char *message,
                      const struct worker_ctl_engine *eng)
{
    struct report *rp, **pp;
    int64_t until;
    int rc;

    if (!c)
        return 0;
    rp = calloc(1, sizeof(*rp));
    if (!rp)
        return -ENOMEM;
    rp->c = c;
    rp->refs = 2;
    rp->state = state;
    rp->progress = progress;
    snprintf(rp->message, sizeof(rp->message), "%s", message ? message : "");
    pthread_mutex_lock(&c->lock);
    /* recorded first: a registration after a lost session carries it */
    c->state = state;
    if (eng)
        c->eng = *eng;
    for (pp = &c->pending; *pp; pp = &(*pp)->next)
        ;
    *pp = rp;
    pthread_mutex_unlock(&c->lock);
    uv_async_send(&c->wake);
    until = clk_now_ms() + REPORT_TIMEOUT_MS;
    pthread_mutex_lock(&c->lock);
    while (!rp->done && clk_now_ms() < until) {
        struct timespec ts = clk_realtime_in_ms(until - clk_now_ms());

        pthread_cond_timedwait(&c->cond, &c->lock, &ts);
    }
    rc = rp->done ? rp->rc : -ETIMEDOUT;
    report_unref(rp);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int worker_ctl_poll(struct worker_ctl *c, unsigned *ret_lost, struct err_buf *e)
{
    int r;

    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    r = c->aborted ? 2 : c->ended || c->shutdown;
    if (r)
        err_set(e, -ECONNRESET, "%s", c->reason);
    if (ret_lost)
        *ret_lost = c->n_lost;
    pthread_mutex_unlock(&c->lock);
    return r;
}

void worker_ctl_free(struct worker_ctl *c)
{
    if (!c)
        return;
    if (c->thread_started) {
        pthread_mutex_lock(&c->lock);
        c->quit = true;
        pthread_mutex_unlock(&c->lock);
        uv_async_send(&c->wake);
        pthread_join(c->thread, NULL);
        (void)uv_loop_close(&c->loop);
    }
    ctl_free_fields(c);
}
