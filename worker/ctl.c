/* ctl.c - the worker's client of the coordinator's control service
 * (proto/control.proto, stepd.ctl.v1.Control) on gRPC core.
 *
 * One Session stream per worker life: RegisterRequest out, ControlEvents in.  A thread
 * owns the stream's completion queue: it records Registered, hands the first Rendezvous
 * to worker_ctl_open() (which waits for it with the rendezvous deadline), answers
 * nothing to heartbeats, and when the session ends - the coordinator is gone, or it sent
 * GroupAbort - it logs the reason and _exit()s the process with WORKER_EXIT_RENDEZVOUS:
 * collectives cannot survive a lost peer and the rank must re-register (supervision
 * restarts it).  Shutdown only raises a flag that the rank-0 serve loop polls.
 * Protobuf-c names stay in this file.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "control.pb-c.h"
#include "log.h"
#include "worker.h"

#define CTL_SESSION "/stepd.ctl.v1.Control/Session"
#define CTL_REPORT "/stepd.ctl.v1.Control/ReportState"
#define CTL_MAX_MSG (4 * 1024 * 1024)

enum { TAG_START = 1, TAG_RECV = 2, TAG_STATUS = 3 };

struct worker_ctl {
    grpc_channel *ch;
    grpc_completion_queue *cq;
    grpc_call *call;
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    /* stream state, under lock */
    bool registered, have_rdv, ended, shutdown;
    char session_id[128];
    char reason[512];
    struct worker_peers peers;
    int world_size;
    /* batch buffers */
    grpc_metadata_array md_initial, md_trailing;
    grpc_byte_buffer *recv_buf;
    grpc_status_code status;
    grpc_slice status_details;
    atomic_bool closing;
    char *auth;                     /* "Bearer KEY" or NULL */
    grpc_metadata md;
};

static int recv_next(struct worker_ctl *c)
{
    grpc_op op = { .op = GRPC_OP_RECV_MESSAGE };

    op.data.recv_message.recv_message = &c->recv_buf;
    return grpc_call_start_batch(c->call, &op, 1, (void *)(intptr_t)TAG_RECV, NULL) == GRPC_CALL_OK
               ? 0 : -EIO;
}

/* Parse one ControlEvent; returns false when the session must end. */
static bool handle_event(struct worker_ctl *c, const uint8_t *data, size_t len)
{
    Stepd__Ctl__V1__ControlEvent *ev = stepd__ctl__v1__control_event__unpack(NULL, len, data);
    bool keep = true;

    if (!ev) {
        snprintf(c->reason, sizeof(c->reason), "undecodable control event (%zu bytes)", len);
        return false;
    }
    pthread_mutex_lock(&c->lock);
    switch (ev->event_case) {
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_REGISTERED:
        c->registered = true;
        snprintf(c->session_id, sizeof(c->session_id), "%s",
                 ev->registered->session_id ? ev->registered->session_id : "");
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_RENDEZVOUS: {
        const Stepd__Ctl__V1__Rendezvous *rv = ev->rendezvous;

        if (c->have_rdv)
            break;
        /* untrusted: sizes and indices checked before use */
        if (rv->world_size != (uint32_t)c->world_size || rv->n_peers != (size_t)c->world_size) {
            snprintf(c->reason, sizeof(c->reason), "rendezvous for world %u with %zu peers, "
                     "this rank expects %d", rv->world_size, rv->n_peers, c->world_size);
            keep = false;
            break;
        }
        if (rv->nccl_unique_id.len > sizeof(c->peers.nccl_id)) {
            snprintf(c->reason, sizeof(c->reason), "rendezvous: NCCL id of %zu bytes",
                     rv->nccl_unique_id.len);
            keep = false;
            break;
        }
        c->peers.world_size = c->world_size;
        c->peers.epoch = rv->epoch;
        if (rv->nccl_unique_id.len)     /* empty (NULL data) for CPU groups */
            memcpy(c->peers.nccl_id, rv->nccl_unique_id.data, rv->nccl_unique_id.len);
        c->peers.nccl_id_len = rv->nccl_unique_id.len;
        for (size_t i = 0; i < rv->n_peers && keep; i++) {
            const Stepd__Ctl__V1__PeerInfo *p = rv->peers[i];

            if (p->rank >= (uint32_t)c->world_size || c->peers.addr[p->rank] ||
                p->peer_address.len > 64 * 1024) {
                snprintf(c->reason, sizeof(c->reason), "rendezvous: bad peer entry %zu (rank %u, "
                         "%zu address bytes)", i, p->rank, p->peer_address.len);
                keep = false;
                break;
            }
            c->peers.addr[p->rank] = malloc(p->peer_address.len ? p->peer_address.len : 1);
            if (!c->peers.addr[p->rank]) {
                keep = false;
                break;
            }
            if (p->peer_address.len)
                memcpy(c->peers.addr[p->rank], p->peer_address.data, p->peer_address.len);
            c->peers.len[p->rank] = p->peer_address.len;
        }
        if (keep)
            c->have_rdv = true;
        break;
    }
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_HEARTBEAT:
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_GROUP_ABORT:
        snprintf(c->reason, sizeof(c->reason), "group abort (epoch %llu): %s",
                 (unsigned long long)ev->group_abort->epoch,
                 ev->group_abort->reason ? ev->group_abort->reason : "");
        keep = false;
        break;
    case STEPD__CTL__V1__CONTROL_EVENT__EVENT_SHUTDOWN:
        c->shutdown = true;
        snprintf(c->reason, sizeof(c->reason), "shutdown: %s",
                 ev->shutdown->reason ? ev->shutdown->reason : "");
        break;
    default:
        break;
    }
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    stepd__ctl__v1__control_event__free_unpacked(ev, NULL);
    return keep;
}

static void *ctl_thread(void *arg)
{
    struct worker_ctl *c = arg;
    bool fatal = false;

    for (;;) {
        grpc_event ev = grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);

        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        switch ((intptr_t)ev.tag) {
        case TAG_START:
            if (!ev.success) {
                snprintf(c->reason, sizeof(c->reason), "cannot open the control session");
                fatal = true;
            }
            break;
        case TAG_RECV:
            if (!ev.success || !c->recv_buf) {
                break;  /* stream ended: TAG_STATUS says why */
            } else {
                grpc_byte_buffer_reader rd;
                grpc_slice s;
                bool keep;

                grpc_byte_buffer_reader_init(&rd, c->recv_buf);
                s = grpc_byte_buffer_reader_readall(&rd);
                grpc_byte_buffer_reader_destroy(&rd);
                grpc_byte_buffer_destroy(c->recv_buf);
                c->recv_buf = NULL;
                keep = handle_event(c, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s));
                grpc_slice_unref(s);
                if (!keep) {
                    fatal = true;
                    grpc_call_cancel(c->call, NULL);
                } else if (recv_next(c) < 0) {
                    fatal = true;
                }
            }
            break;
        case TAG_STATUS: {
            char *det = grpc_slice_to_c_string(c->status_details);

            pthread_mutex_lock(&c->lock);
            if (!c->reason[0])
                snprintf(c->reason, sizeof(c->reason), "control session ended: status %d: %s",
                         (int)c->status, det);
            c->ended = true;
            pthread_cond_broadcast(&c->cond);
            pthread_mutex_unlock(&c->lock);
            gpr_free(det);
            fatal = true;
            break;
        }
        }
        if (fatal && !atomic_load(&c->closing)) {
            pthread_mutex_lock(&c->lock);
            bool before_rdv = !c->have_rdv;
            c->ended = true;
            pthread_cond_broadcast(&c->cond);
            pthread_mutex_unlock(&c->lock);
            if (!before_rdv && !c->shutdown) {
                /* after rendezvous the rank is part of a group that no longer exists */
                log_error("%s; exiting so that the group re-forms", c->reason);
                _exit(WORKER_EXIT_RENDEZVOUS);
            }
        }
        if ((intptr_t)ev.tag == TAG_STATUS)
            break;      /* the stream is over; free() drains what is left in the queue */
    }
    return NULL;
}

static int pack_register(const struct worker_ctl_register *reg, grpc_byte_buffer **ret)
{
    Stepd__Ctl__V1__RegisterRequest rq = STEPD__CTL__V1__REGISTER_REQUEST__INIT;
    char host[256] = "";
    grpc_slice s;
    size_t n;

    gethostname(host, sizeof(host) - 1);
    rq.group = (char *)reg->group;
    rq.rank = (uint32_t)reg->rank;
    rq.world_size = (uint32_t)reg->world_size;
    rq.device = (char *)reg->device;
    rq.peer_address.data = (uint8_t *)reg->peer_address;
    rq.peer_address.len = reg->peer_address_len;
    rq.engine_address = (char *)(reg->engine_address ? reg->engine_address : "");
    rq.nccl_unique_id.data = (uint8_t *)reg->nccl_id;
    rq.nccl_unique_id.len = reg->nccl_id ? reg->nccl_id_len : 0;
    rq.pid = (uint32_t)getpid();
    rq.hostname = host;
    rq.incarnation = (uint64_t)time(NULL) << 20 ^ (uint64_t)getpid();
    n = stepd__ctl__v1__register_request__get_packed_size(&rq);
    s = grpc_slice_malloc(n);
    stepd__ctl__v1__register_request__pack(&rq, GRPC_SLICE_START_PTR(s));
    *ret = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return 0;
}

int worker_ctl_open(const char *target, const struct worker_ctl_register *reg, int timeout_msec,
                    struct worker_ctl **ret, struct worker_peers *peers, struct err_buf *e)
{
    struct worker_ctl *c;
    grpc_channel_credentials *creds;
    grpc_byte_buffer *msg = NULL;
    grpc_op ops[4];
    gpr_timespec until;
    int r = 0;

    grpc_init();
    c = calloc(1, sizeof(*c));
    if (!c)
        return err_set(e, -ENOMEM, "out of memory");
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    c->world_size = reg->world_size;
    if (reg->control_key && reg->control_key[0]) {
        size_t n = strlen(reg->control_key) + 8;

        c->auth = malloc(n);
        if (!c->auth) {
            free(c);
            return err_set(e, -ENOMEM, "out of memory");
        }
        snprintf(c->auth, n, "Bearer %s", reg->control_key);
        c->md.key = grpc_slice_from_static_string("authorization");
        c->md.value = grpc_slice_from_static_string(c->auth);
    }
    grpc_metadata_array_init(&c->md_initial);
    grpc_metadata_array_init(&c->md_trailing);
    creds = grpc_insecure_credentials_create();
    grpc_arg args[1] = { { .type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                           .value.integer = CTL_MAX_MSG } };
    grpc_channel_args cargs = { .num_args = 1, .args = args };
    c->ch = grpc_channel_create(target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    c->cq = grpc_completion_queue_create_for_next(NULL);
    c->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq,
                                       grpc_slice_from_static_string(CTL_SESSION), NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (!c->ch || !c->cq || !c->call) {
        r = err_set(e, -ENOMEM, "cannot create a gRPC call to %s", target);
        goto out_free;
    }
    pack_register(reg, &msg);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].flags = GRPC_INITIAL_METADATA_WAIT_FOR_READY;
    if (c->auth) {
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &c->md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = msg;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->md_initial;
    if (grpc_call_start_batch(c->call, ops, 4, (void *)(intptr_t)TAG_START, NULL) != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(msg);
        r = err_set(e, -EIO, "cannot start the control session with %s", target);
        goto out_free;
    }
    grpc_byte_buffer_destroy(msg);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &c->md_trailing;
    ops[0].data.recv_status_on_client.status = &c->status;
    ops[0].data.recv_status_on_client.status_details = &c->status_details;
    if (grpc_call_start_batch(c->call, ops, 1, (void *)(intptr_t)TAG_STATUS, NULL) != GRPC_CALL_OK ||
        recv_next(c) < 0) {
        r = err_set(e, -EIO, "cannot start the control session with %s", target);
        goto out_free;
    }
    if (pthread_create(&c->thread, NULL, ctl_thread, c) != 0) {
        r = err_set(e, -EAGAIN, "cannot start the control thread");
        goto out_free;
    }
    c->thread_started = true;

    /* wait for the group's rendezvous */
    until = gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(timeout_msec, GPR_TIMESPAN));
    pthread_mutex_lock(&c->lock);
    while (!c->have_rdv && !c->ended) {
        struct timespec ts = { until.tv_sec, until.tv_nsec };

        if (pthread_cond_timedwait(&c->cond, &c->lock, &ts) == ETIMEDOUT)
            break;
    }
    if (c->have_rdv) {
        *peers = c->peers;
        memset(&c->peers, 0, sizeof(c->peers));
    } else if (c->ended) {
        r = err_set(e, -ECONNREFUSED, "coordinator %s: %s", target, c->reason);
    } else {
        r = err_set(e, -ETIMEDOUT, "rendezvous of group %s timed out after %d ms at %s (%s): "
                    "the coordinator did not complete the group; see its log for the missing "
                    "ranks", reg->group, timeout_msec, target,
                    c->registered ? "registered" : "never registered");
    }
    pthread_mutex_unlock(&c->lock);
    if (r < 0)
        goto out_free;
    *ret = c;
    return 0;

out_free:
    worker_ctl_free(c);
    return r;
}

int worker_ctl_report(struct worker_ctl *c, int state, float progress, const char *message,
                      int kv_blocks_total)
{
    Stepd__Ctl__V1__StateReport rq = STEPD__CTL__V1__STATE_REPORT__INIT;
    grpc_completion_queue *cq;
    grpc_byte_buffer *msg, *reply = NULL;
    grpc_metadata_array md0, md1;
    grpc_status_code st = GRPC_STATUS_UNKNOWN;
    grpc_slice details, s;
    grpc_call *call;
    grpc_op ops[6];
    int r = 0;

    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    rq.session_id = c->session_id;
    pthread_mutex_unlock(&c->lock);
    rq.state = (Stepd__Ctl__V1__RankState)state;
    rq.load_progress = progress;
    rq.message = (char *)(message ? message : "");
    rq.kv_blocks_total = (uint32_t)(kv_blocks_total > 0 ? kv_blocks_total : 0);
    s = grpc_slice_malloc(stepd__ctl__v1__state_report__get_packed_size(&rq));
    stepd__ctl__v1__state_report__pack(&rq, GRPC_SLICE_START_PTR(s));
    msg = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    cq = grpc_completion_queue_create_for_pluck(NULL);
    call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                    grpc_slice_from_static_string(CTL_REPORT), NULL,
                                    gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                                 gpr_time_from_millis(5000, GPR_TIMESPAN)), NULL);
    grpc_metadata_array_init(&md0);
    grpc_metadata_array_init(&md1);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->auth) {
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &c->md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = msg;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &md0;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &reply;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &md1;
    ops[5].data.recv_status_on_client.status = &st;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, (void *)1, NULL) != GRPC_CALL_OK) {
        r = -EIO;
    } else {
        grpc_completion_queue_pluck(cq, (void *)1, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (st != GRPC_STATUS_OK) {
            char *d = grpc_slice_to_c_string(details);

            log_warn("ReportState: status %d: %s", (int)st, d);
            gpr_free(d);
            r = -EIO;
        }
        grpc_slice_unref(details);
    }
    if (reply)
        grpc_byte_buffer_destroy(reply);
    grpc_byte_buffer_destroy(msg);
    grpc_metadata_array_destroy(&md0);
    grpc_metadata_array_destroy(&md1);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN)
        ;
    grpc_completion_queue_destroy(cq);
    return r;
}

int worker_ctl_poll(struct worker_ctl *c, struct err_buf *e)
{
    int r;

    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    r = c->ended || c->shutdown;
    if (r)
        err_set(e, -ECONNRESET, "%s", c->reason);
    pthread_mutex_unlock(&c->lock);
    return r;
}

void worker_ctl_free(struct worker_ctl *c)
{
    if (!c)
        return;
    atomic_store(&c->closing, true);
    if (c->call)
        grpc_call_cancel(c->call, NULL);
    if (c->thread_started) {
        /* the thread leaves on TAG_STATUS of the cancelled call */
        pthread_join(c->thread, NULL);
    }
    if (c->call)
        grpc_call_unref(c->call);
    if (c->cq) {
        grpc_completion_queue_shutdown(c->cq);
        while (grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
        grpc_completion_queue_destroy(c->cq);
    }
    if (c->recv_buf)
        grpc_byte_buffer_destroy(c->recv_buf);
    grpc_metadata_array_destroy(&c->md_initial);
    grpc_metadata_array_destroy(&c->md_trailing);
    grpc_slice_unref(c->status_details);
    if (c->ch)
        grpc_channel_destroy(c->ch);
    worker_peers_done(&c->peers);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->lock);
    free(c->auth);
    free(c);
    grpc_shutdown();
}
