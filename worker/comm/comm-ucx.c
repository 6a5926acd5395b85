/* comm-ucx.c - collectives over UCP tag messages, host buffers.
 *
 * Wiring: one UCP context + worker per rank; one endpoint per peer, created from the
 * address the peer published (our header + its UCP worker address):
 *   - peers on another host (or in another network namespace: a "node" in the tests):
 *     UCP_ERR_HANDLING_MODE_PEER with an error handler, so a dead peer (closed TCP
 *     connection, keepalive) turns into an error on every pending operation, not a hang;
 *   - peers on this host: UCX 1.13's shared-memory transports have no peer-failure
 *     handling (PEER mode would silently push them onto TCP loopback), so these
 *     endpoints use mode NONE over shared memory and their liveness is checked by pid +
 *     start time while we wait on them (check_local_peers).  cma is left out of UCX_TLS
 *     because a zero-copy read from a dead peer aborts the process.  STEPD_UCX_SHM=0
 *     puts every peer on the PEER/TCP path.
 * Whoever aborts the group first tells every live peer with a reserved ABORT tag, so
 * ranks blocked on somebody else learn it at once rather than at their deadline.
 *
 * Matching: every collective takes the next sequence number; a message's tag is
 * (seq << 24) | (step << 8) | src_rank and receives match the full tag, so messages of
 * different steps or collectives can never be confused, whatever order they arrive in.
 *
 * Algorithms (all ranks end with bit-identical results, which the lockstep forward
 * needs: every rank must route every token the same way):
 *   allreduce_sum  recursive doubling for a power-of-two world and small buffers
 *                  (log2 N rounds; IEEE addition is commutative so both partners of a
 *                  round compute the same bits), otherwise ring reduce-scatter +
 *                  all-gather (each chunk summed by one rank, then copied);
 *   allgather      ring; broadcast  flat from the root; barrier  dissemination.
 *
 * Waiting: progress the worker in a loop, yielding the CPU after a short spin and
 * sleeping briefly once idle for a while (ranks may share cores), until every request
 * of the collective has completed, a request failed, a peer failed, or the deadline
 * passed.  Any failure cancels the collective's requests and aborts the communicator.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "clock.h"
#include "comm.h"
#include "err.h"
#include "log.h"

#define RD_MAX_BYTES (64u * 1024u)      /* recursive doubling up to this size */
#define ADDR_MAGIC 0x58435553u          /* "SUCX" little-endian: our address wrapper */
#define ABORT_TAG (0xffffffffffull << 24) /* reserved sequence number: "I aborted" notices */
#define KEEPALIVE_DEFAULT "2s"          /* UCX's 20 s default is too slow to notice a dead rank */

struct peer {
    struct ucx *u;
    int rank;
    ucp_ep_h ep;
    ucs_status_t failed;                /* UCS_OK, or what the error handler reported */
    bool local;                         /* same host: shared memory, no UCX peer errors */
    int pid;                            /* local peers: liveness by pid + start time */
    uint64_t start_time;
};

struct pending {
    void *req;
    int peer;
    bool is_recv;
    bool done;
    ucp_tag_recv_info_t info;
};

struct ucx {
    struct comm c;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_address_t *addr;
    size_t addr_len;
    void *addr_wire;                    /* header + UCX address, what comm_ucx_address hands out */
    size_t addr_wire_len;
    struct peer *peers;                 /* [world_size], peers[rank].ep == NULL */
    struct pending *pend;               /* [2 * world_size] */
    int n_pend;
    uint64_t seq;
    const char *op;                     /* current collective, for messages */
    int failed_peer;                    /* first peer reported by the error handler, -1 */
    ucs_status_t failed_status;
    int n_failed;                       /* peers reported by the error handler */
    /* abort notices: a persistent receive of any peer's ABORT message */
    void *abort_req;
    char abort_msg[200];
    struct pending abort_pd;
    float *tmp;                         /* ring receive scratch */
    size_t tmp_cap;                     /* floats */
    uint64_t next_liveness_usec;        /* next pid check of local peers */
};

/* What a rank publishes: this header, then its UCX worker address.  host_id identifies
 * "same machine, same pid/ipc namespaces, same network namespace": such peers talk over
 * shared memory (see connect), and their liveness is checked through pid + start time. */
struct addr_hdr {
    uint32_t magic;
    int32_t rank;
    int32_t world_size;
    uint32_t len;
    uint64_t host_id;
    int32_t pid;
    uint32_t reserved;
    uint64_t start_time;    /* /proc/<pid>/stat field 22 */
};

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;

    for (size_t i = 0; i < n; i++)
        h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

/* Start time of a process in clock ticks since boot (0 when it does not exist or is a
 * zombie). */
static uint64_t proc_start_time(int pid)
{
    char path[64], buf[1024], *p;
    unsigned long long st = 0;
    FILE *f;
    size_t n;

    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    f = fopen(path, "r");
    if (!f)
        return 0;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    p = strrchr(buf, ')');      /* comm may contain spaces */
    if (!p)
        return 0;
    char state = 0;

    /* fields after comm: state(3) ... starttime(22); a zombie is as gone as a dead one */
    if (sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
                      "%*d %llu", &state, &st) != 2 || state == 'Z' || state == 'X')
        return 0;
    return st;
}

/* Same boot, same hostname, same pid, ipc and network namespaces. */
static uint64_t host_id_get(void)
{
    static const char *const files[] = { "/proc/sys/kernel/random/boot_id" };
    static const char *const ns[] = { "/proc/self/ns/pid", "/proc/self/ns/ipc", "/proc/self/ns/net" };
    uint64_t h = 1469598103934665603ull;
    char buf[256];

    if (gethostname(buf, sizeof(buf) - 1) == 0) {
        buf[sizeof(buf) - 1] = 0;
        h = fnv1a(h, buf, strlen(buf));
    }
    for (size_t i = 0; i < ARRAY_SIZE(files); i++) {
        FILE *f = fopen(files[i], "r");

        if (f) {
            size_t n = fread(buf, 1, sizeof(buf), f);

            h = fnv1a(h, buf, n);
            fclose(f);
        }
    }
    for (size_t i = 0; i < ARRAY_SIZE(ns); i++) {
        ssize_t n = readlink(ns[i], buf, sizeof(buf));

        if (n > 0)
            h = fnv1a(h, buf, (size_t)n);
    }
    return h;
}

static int err_from_ucs(ucs_status_t s)
{
    switch (s) {
    case UCS_OK: return 0;
    case UCS_INPROGRESS: return -EINPROGRESS;
    case UCS_ERR_NO_MEMORY: return -ENOMEM;
    case UCS_ERR_INVALID_PARAM: return -EINVAL;
    case UCS_ERR_UNREACHABLE: return -EHOSTUNREACH;
    case UCS_ERR_INVALID_ADDR: return -EADDRNOTAVAIL;
    case UCS_ERR_MESSAGE_TRUNCATED: return -EMSGSIZE;
    case UCS_ERR_NO_DEVICE: return -ENODEV;
    case UCS_ERR_BUSY: return -EBUSY;
    case UCS_ERR_CANCELED: return -ECANCELED;
    case UCS_ERR_TIMED_OUT: return -ETIMEDOUT;
    case UCS_ERR_UNSUPPORTED: case UCS_ERR_NOT_IMPLEMENTED: return -EOPNOTSUPP;
    case UCS_ERR_REJECTED: return -ECONNREFUSED;
    case UCS_ERR_NOT_CONNECTED: return -ENOTCONN;
    case UCS_ERR_CONNECTION_RESET: return -ECONNRESET;
    case UCS_ERR_NO_RESOURCE: return -EAGAIN;
    default:
        if (UCS_IS_ENDPOINT_ERROR(s))
            return s == UCS_ERR_ENDPOINT_TIMEOUT ? -ETIMEDOUT : -ECONNRESET;
        if (UCS_IS_LINK_ERROR(s))
            return -ENETDOWN;
        return -EIO;
    }
}

/* Statuses that mean "the peer or the connection to it is gone" (-ECONNRESET), as
 * opposed to our own deadline (-ETIMEDOUT) or a local problem. */
static bool peer_lost(ucs_status_t s)
{
    return s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_NOT_CONNECTED ||
           s == UCS_ERR_UNREACHABLE || s == UCS_ERR_REJECTED || UCS_IS_ENDPOINT_ERROR(s) ||
           UCS_IS_LINK_ERROR(s);
}

static struct ucx *to_ucx(struct comm *c)
{
    return (struct ucx *)c;
}

static uint64_t now_usec(void)
{
    return (uint64_t)clk_now_us();
}

static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    struct peer *p = arg;
    struct ucx *u = p->u;

    /* Only record: never free inside our own callback; the waiter aborts. */
    if (p->failed == UCS_OK) {
        p->failed = status;
        u->n_failed++;
    }
    if (u->failed_peer < 0) {
        u->failed_peer = p->rank;
        u->failed_status = status;
    }
}

/* ---- request bookkeeping -------------------------------------------------------- */

static uint64_t make_tag(uint64_t seq, int step, int src)
{
    return (seq << 24) | ((uint64_t)(step & 0xffff) << 8) | (uint64_t)(src & 0xff);
}

static int post_send(struct ucx *u, int peer, const void *buf, size_t len, int step)
{
    ucp_request_param_t prm = { .op_attr_mask = 0 };
    ucs_status_ptr_t st;
    struct pending *pd;

    BUG_ON(u->n_pend >= 2 * u->c.world_size);
    st = ucp_tag_send_nbx(u->peers[peer].ep, buf, len, make_tag(u->seq, step, u->c.rank), &prm);
    if (UCS_PTR_IS_ERR(st))
        return comm__fail(&u->c, peer_lost(UCS_PTR_STATUS(st)) ? -ECONNRESET
                                                               : err_from_ucs(UCS_PTR_STATUS(st)),
                          "%s: send to rank %d failed: %s", u->op, peer,
                          ucs_status_string(UCS_PTR_STATUS(st)));
    u->c.n_bytes_sent += len;
    pd = &u->pend[u->n_pend++];
    *pd = (struct pending){ .req = st, .peer = peer, .is_recv = false, .done = st == NULL };
    return 0;
}

/* UCX 1.13 leaves recv_info.tag_info unfilled when a receive matches an unexpected
 * message at once, so receives are posted with NO_IMM_CMPL and the length is taken from
 * the completion callback, which always gets it. */
static void recv_done_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info,
                         void *user_data)
{
    struct pending *pd = user_data;

    if (status == UCS_OK && info)
        pd->info = *info;
}

static int post_recv(struct ucx *u, int peer, void *buf, size_t cap, int step)
{
    struct pending *pd;
    ucs_status_ptr_t st;

    BUG_ON(u->n_pend >= 2 * u->c.world_size);
    pd = &u->pend[u->n_pend];
    *pd = (struct pending){ .peer = peer, .is_recv = true };
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .recv_info.tag_info = &pd->info,
        .cb.recv = recv_done_cb,
        .user_data = pd,
    };
    st = ucp_tag_recv_nbx(u->worker, buf, cap, make_tag(u->seq, step, peer), UINT64_MAX, &prm);
    if (UCS_PTR_IS_ERR(st))
        return comm__fail(&u->c, err_from_ucs(UCS_PTR_STATUS(st)),
                          "%s: receive from rank %d failed: %s", u->op, peer,
                          ucs_status_string(UCS_PTR_STATUS(st)));
    pd->req = st;
    pd->done = st == NULL;
    u->n_pend++;
    return 0;
}

/* Cancel and free whatever is still in flight (error path). */
static void cancel_pending(struct ucx *u)
{
    int i;

    for (i = 0; i < u->n_pend; i++) {
        struct pending *pd = &u->pend[i];

        if (pd->req && !pd->done) {
            ucp_request_cancel(u->worker, pd->req);
            pd->done = true;
        }
        if (pd->req) {
            ucp_request_free(pd->req);
            pd->req = NULL;
        }
    }
    u->n_pend = 0;
}

/* Local (shared-memory) peers have no UCX peer-failure detection: check that the
 * processes we wait on still exist, at most every 10 ms. */
static void check_local_peers(struct ucx *u)
{
    uint64_t now = now_usec();

    if (now < u->next_liveness_usec)
        return;
    u->next_liveness_usec = now + 10000;
    for (int i = 0; i < u->n_pend; i++) {
        struct peer *p = &u->peers[u->pend[i].peer];

        if (u->pend[i].done || !p->local || p->failed != UCS_OK)
            continue;
        if (proc_start_time(p->pid) != p->start_time) {
            p->failed = UCS_ERR_CONNECTION_RESET;
            u->n_failed++;
            if (u->failed_peer < 0) {
                u->failed_peer = p->rank;
                u->failed_status = p->failed;
            }
        }
    }
}

/* The first failed peer that an unfinished request of this step involves, or -1. */
static int waits_on_failed(const struct ucx *u)
{
    if (!u->n_failed)
        return -1;
    for (int i = 0; i < u->n_pend; i++)
        if (!u->pend[i].done && u->peers[u->pend[i].peer].failed != UCS_OK)
            return u->pend[i].peer;
    return -1;
}

/* A peer that aborted the group told us so (its last act before closing). */
static bool abort_noticed(struct ucx *u, int *ret_rank)
{
    if (!u->abort_req || ucp_request_check_status(u->abort_req) == UCS_INPROGRESS)
        return false;
    *ret_rank = (int)(u->abort_pd.info.sender_tag & 0xff);
    return true;
}

/* Wait for every pending request of the current step, or fail and abort.  A peer that
 * failed matters only while we still wait on it: a rank that finished its part of the
 * last collective and exited is not an error. */
static int wait_pending(struct ucx *u, uint64_t deadline_usec)
{
    unsigned idle = 0;
    uint64_t idle_since = 0;
    int i, left, r;

    for (;;) {
        left = 0;
        for (i = 0; i < u->n_pend; i++) {
            struct pending *pd = &u->pend[i];
            ucs_status_t s;

            if (pd->done)
                continue;
            s = ucp_request_check_status(pd->req);
            if (s == UCS_INPROGRESS) {
                left++;
                continue;
            }
            pd->done = true;
            if (s != UCS_OK) {
                if (s == UCS_ERR_MESSAGE_TRUNCATED)
                    r = comm__fail(&u->c, -EMSGSIZE, "%s: message from rank %d larger than the"
                                   " receive buffer", u->op, pd->peer);
                else if (u->peers[pd->peer].failed != UCS_OK)
                    r = comm__fail(&u->c, -ECONNRESET, "%s: peer rank %d failed: %s", u->op,
                                   pd->peer, ucs_status_string(u->peers[pd->peer].failed));
                else if (peer_lost(s))
                    r = comm__fail(&u->c, -ECONNRESET, "%s: %s rank %d failed, peer lost: %s",
                                   u->op, pd->is_recv ? "receive from" : "send to", pd->peer,
                                   ucs_status_string(s));
                else
                    r = comm__fail(&u->c, err_from_ucs(s), "%s: %s rank %d failed: %s", u->op,
                                   pd->is_recv ? "receive from" : "send to", pd->peer,
                                   ucs_status_string(s));
                goto out_abort;
            }
        }
        if (!left)
            break;
        int bad = waits_on_failed(u), who;

        if (bad >= 0) {
            /* its last messages may already be queued: drain before giving up */
            if (ucp_worker_progress(u->worker))
                continue;
            if (u->peers[bad].local)
                r = comm__fail(&u->c, -ECONNRESET, "%s: peer rank %d (pid %d) is gone", u->op,
                               bad, u->peers[bad].pid);
            else
                r = comm__fail(&u->c, -ECONNRESET, "%s: peer rank %d failed: %s", u->op, bad,
                               ucs_status_string(u->peers[bad].failed));
            goto out_abort;
        }
        if (abort_noticed(u, &who)) {
            u->abort_msg[sizeof(u->abort_msg) - 1] = 0;
            r = comm__fail(&u->c, -ECONNRESET, "%s: rank %d aborted the group: %.*s", u->op, who,
                           (int)u->abort_pd.info.length, u->abort_msg);
            goto out_abort;
        }
        if (ucp_worker_progress(u->worker)) {
            idle = 0;
            continue;
        }
        if (++idle < 64)
            continue;
        if (atomic_load(&u->c.interrupted)) {
            r = comm__fail(&u->c, -ECANCELED, "%s: interrupted: the group is re-forming", u->op);
            goto out_abort;
        }
        check_local_peers(u);
        uint64_t now = now_usec();
        if (deadline_usec && now >= deadline_usec) {
            int late = -1;

            for (i = 0; i < u->n_pend; i++)
                if (!u->pend[i].done && u->pend[i].is_recv) {
                    late = u->pend[i].peer;
                    break;
                }
            if (late >= 0)
                r = comm__fail(&u->c, -ETIMEDOUT, "%s: timed out after %d ms waiting for rank %d",
                               u->op, u->c.timeout_msec, late);
            else
                r = comm__fail(&u->c, -ETIMEDOUT, "%s: timed out after %d ms sending", u->op,
                               u->c.timeout_msec);
            goto out_abort;
        }
        if (idle == 64)
            idle_since = now;
        if (now - idle_since > 2000) {
            struct timespec ts = { 0, 20000 };

            nanosleep(&ts, NULL);
        } else {
            sched_yield();
        }
    }
    for (i = 0; i < u->n_pend; i++)
        if (u->pend[i].req)
            ucp_request_free(u->pend[i].req);
    u->n_pend = 0;
    return 0;

out_abort:
    cancel_pending(u);
    u->c.ops->abort(&u->c);
    return r;
}

static uint64_t op_begin(struct ucx *u, const char *op)
{
    u->op = op;
    u->seq++;
    u->n_pend = 0;
    return u->c.timeout_msec > 0 ? now_usec() + (uint64_t)u->c.timeout_msec * 1000u : 0;
}

/* ---- collectives ----------------------------------------------------------------- */

static int ensure_tmp(struct ucx *u, size_t count)
{
    float *t;

    if (count <= u->tmp_cap)
        return 0;
    t = realloc(u->tmp, count * sizeof(float));
    if (!t)
        return comm__fail(&u->c, -ENOMEM, "%s: out of memory for %zu bytes of scratch", u->op,
                          count * sizeof(float));
    u->tmp = t;
    u->tmp_cap = count;
    return 0;
}

static void chunk_of(size_t count, int n, int i, size_t *off, size_t *len)
{
    size_t base = count / (size_t)n, extra = count % (size_t)n;

    *off = (size_t)i * base + ((size_t)i < extra ? (size_t)i : extra);
    *len = base + ((size_t)i < extra ? 1 : 0);
}

/* Abort the operation in progress: cancel what is pending and abort the communicator
 * (sticky error, the worker exits).  Returns r. */
static int op_fail(struct ucx *u, int r)
{
    if (u->n_pend)
        cancel_pending(u);
    u->c.ops->abort(&u->c);
    return r;
}

/* One step of a collective: receive rlen bytes from `from` into rbuf while sending slen
 * bytes of sbuf to `to` (a zero length skips that side; both ends agree on lengths), then
 * wait for both.  Any failure aborts the communicator (op_fail). */
static int exchange(struct ucx *u, int from, void *rbuf, size_t rlen, int to, const void *sbuf,
                    size_t slen, int tag, uint64_t deadline)
{
    int r = 0;

    if (rlen)
        r = post_recv(u, from, rbuf, rlen, tag);
    if (r == 0 && slen)
        r = post_send(u, to, sbuf, slen, tag);
    if (r < 0)
        return op_fail(u, r);
    return wait_pending(u, deadline);   /* aborts by itself on failure */
}

static int allreduce_rd(struct ucx *u, float *buf, size_t count, uint64_t deadline)
{
    int n = u->c.world_size, me = u->c.rank, step = 0, mask, r;
    size_t i;

    r = ensure_tmp(u, count);
    if (r < 0)
        return r;
    for (mask = 1; mask < n; mask <<= 1, step++) {
        int peer = me ^ mask;

        r = exchange(u, peer, u->tmp, count * sizeof(float), peer, buf, count * sizeof(float),
                     step, deadline);
        if (r < 0)
            return r;
        for (i = 0; i < count; i++)
            buf[i] += u->tmp[i];
    }
    return 0;
}

static int allreduce_ring(struct ucx *u, float *buf, size_t count, uint64_t deadline)
{
    int n = u->c.world_size, me = u->c.rank, s, r;
    int right = (me + 1) % n, left = (me - 1 + n) % n;
    size_t off, len, roff, rlen, i;

    r = ensure_tmp(u, count / (size_t)n + 1);
    if (r < 0)
        return r;
    /* reduce-scatter: after n-1 steps rank me owns the full sum of chunk me+1 */
    for (s = 0; s < n - 1; s++) {
        int sc = ((me - s) % n + n) % n, rc = ((me - s - 1) % n + n) % n;

        chunk_of(count, n, sc, &off, &len);
        chunk_of(count, n, rc, &roff, &rlen);
        r = exchange(u, left, u->tmp, rlen * sizeof(float), right, buf + off, len * sizeof(float),
                     s, deadline);
        if (r < 0)
            return r;
        for (i = 0; i < rlen; i++)
            buf[roff + i] += u->tmp[i];
    }
    /* all-gather of the summed chunks */
    for (s = 0; s < n - 1; s++) {
        int sc = ((me + 1 - s) % n + n) % n, rc = ((me - s) % n + n) % n;

        chunk_of(count, n, sc, &off, &len);
        chunk_of(count, n, rc, &roff, &rlen);
        r = exchange(u, left, buf + roff, rlen * sizeof(float), right, buf + off,
                     len * sizeof(float), n + s, deadline);
        if (r < 0)
            return r;
    }
    return 0;
}

static int ucx_allreduce_sum(struct comm *c, float *buf, size_t count)
{
    struct ucx *u = to_ucx(c);
    uint64_t deadline = op_begin(u, "allreduce");
    int n = c->world_size;

    if (n == 1)
        return 0;
    if ((n & (n - 1)) == 0 && count * sizeof(float) <= RD_MAX_BYTES)
        return allreduce_rd(u, buf, count, deadline);
    return allreduce_ring(u, buf, count, deadline);
}

static int ucx_allgather(struct comm *c, const void *send, void *recv, size_t nbytes)
{
    struct ucx *u = to_ucx(c);
    uint64_t deadline = op_begin(u, "allgather");
    int n = c->world_size, me = c->rank, s, r;
    int right = (me + 1) % n, left = (me - 1 + n) % n;
    char *out = recv;

    if ((const char *)send != out + (size_t)me * nbytes)
        memmove(out + (size_t)me * nbytes, send, nbytes);
    for (s = 0; s < n - 1; s++) {
        int sb = ((me - s) % n + n) % n, rb = ((me - s - 1) % n + n) % n;

        r = exchange(u, left, out + (size_t)rb * nbytes, nbytes, right, out + (size_t)sb * nbytes,
                     nbytes, s, deadline);
        if (r < 0)
            return r;
    }
    return 0;
}

static int bcast(struct ucx *u, void *buf, size_t *len, size_t cap, int root, bool var)
{
    uint64_t deadline = op_begin(u, var ? "broadcast_var" : "broadcast");
    int n = u->c.world_size, me = u->c.rank, i, r = 0;

    if (me == root) {
        for (i = 0; i < n && r == 0; i++)
            if (i != me)
                r = post_send(u, i, buf, *len, 0);
    } else {
        r = post_recv(u, root, buf, cap, 0);
    }
    if (r < 0)
        return op_fail(u, r);
    r = wait_pending(u, deadline);
    if (r < 0)
        return r;
    if (me != root) {
        /* the recv info was captured by wait_pending before the request was freed */
        size_t got = u->pend[0].info.length;

        if (!var && got != *len)
            return comm__fail(&u->c, -EBADMSG, "broadcast: got %zu bytes from rank %d, expected %zu",
                              got, root, *len);
        *len = got;
    }
    return 0;
}

static int ucx_broadcast(struct comm *c, void *buf, size_t nbytes, int root)
{
    size_t len = nbytes;

    return bcast(to_ucx(c), buf, &len, nbytes, root, false);
}

static int ucx_broadcast_var(struct comm *c, void *buf, size_t *len, size_t cap, int root)
{
    return bcast(to_ucx(c), buf, len, cap, root, true);
}

static int ucx_barrier(struct comm *c)
{
    struct ucx *u = to_ucx(c);
    uint64_t deadline = op_begin(u, "barrier");
    int n = c->world_size, me = c->rank, k, step = 0, r;
    char out = 0, in = 0;

    for (k = 1; k < n; k <<= 1, step++) {
        r = exchange(u, (me - k + n) % n, &in, 1, (me + k) % n, &out, 1, step, deadline);
        if (r < 0)
            return r;
    }
    return 0;
}

/* ---- life cycle ------------------------------------------------------------------ */

/* Close every endpoint: flushed (outstanding sends delivered) when the comm is healthy,
 * forced after an error.  Bounded either way. */
static void close_eps(struct ucx *u, bool force)
{
    int i;

    if (!u->peers)
        return;
    for (i = 0; i < u->c.world_size; i++) {
        struct peer *p = &u->peers[i];
        /* A forced close is only defined for peer-error-handling endpoints, and closing a
         * local one towards a peer that already went away (failed, or simply finished
         * first) only logs flush errors: local endpoints are left to ucp_worker_destroy(),
         * which releases them without talking to the peer. */
        bool hard = force && !p->local;

        if (p->local)
            continue;
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
            .flags = hard ? UCP_EP_CLOSE_FLAG_FORCE : 0,
        };
        ucs_status_ptr_t st;
        uint64_t until;

        if (!p->ep)
            continue;
        st = ucp_ep_close_nbx(p->ep, &prm);
        p->ep = NULL;
        if (st == NULL || UCS_PTR_IS_ERR(st))
            continue;
        until = now_usec() + (hard ? 1000000u : 5000000u);
        while (ucp_request_check_status(st) == UCS_INPROGRESS && now_usec() < until)
            ucp_worker_progress(u->worker);
        ucp_request_free(st);
    }
}

/* Tell every live peer that this rank aborted the group (best effort, bounded), so that
 * ranks blocked in a collective on someone else learn it at once instead of at their
 * deadline. */
static void notify_abort(struct ucx *u)
{
    void *reqs[256];
    int n = 0, i;
    size_t len = strnlen(u->c.error_msg, sizeof(u->abort_msg) - 1);
    uint64_t until;

    if (!u->peers)
        return;
    for (i = 0; i < u->c.world_size && n < 256; i++) {
        struct peer *p = &u->peers[i];
        ucp_request_param_t prm = { .op_attr_mask = 0 };
        ucs_status_ptr_t st;

        if (!p->ep || p->failed != UCS_OK)
            continue;
        st = ucp_tag_send_nbx(p->ep, u->c.error_msg, len, ABORT_TAG | (uint64_t)u->c.rank, &prm);
        if (st && !UCS_PTR_IS_ERR(st))
            reqs[n++] = st;
    }
    until = now_usec() + 200000u;
    for (;;) {
        int left = 0;

        for (i = 0; i < n; i++)
            if (reqs[i] && ucp_request_check_status(reqs[i]) != UCS_INPROGRESS) {
                ucp_request_free(reqs[i]);
                reqs[i] = NULL;
            } else if (reqs[i]) {
                left++;
            }
        if (!left || now_usec() >= until)
            break;
        ucp_worker_progress(u->worker);
    }
    for (i = 0; i < n; i++)
        if (reqs[i]) {
            ucp_request_cancel(u->worker, reqs[i]);
            ucp_request_free(reqs[i]);
        }
}

static void cancel_abort_recv(struct ucx *u)
{
    if (!u->abort_req)
        return;
    if (ucp_request_check_status(u->abort_req) == UCS_INPROGRESS)
        ucp_request_cancel(u->worker, u->abort_req);
    ucp_request_free(u->abort_req);
    u->abort_req = NULL;
}

static void ucx_abort(struct comm *c)
{
    struct ucx *u = to_ucx(c);
    int who;

    if (!c->error)
        comm__fail(c, -ECANCELED, "communicator aborted");
    cancel_pending(u);
    /* a rank that aborted because a peer told it to has nothing new to say */
    if (!abort_noticed(u, &who))
        notify_abort(u);
    cancel_abort_recv(u);
    close_eps(u, true);
}

static void ucx_free(struct comm *c)
{
    struct ucx *u = to_ucx(c);

    cancel_pending(u);
    cancel_abort_recv(u);
    close_eps(u, u->c.error != 0);
    if (u->addr)
        ucp_worker_release_address(u->worker, u->addr);
    if (u->worker)
        ucp_worker_destroy(u->worker);
    if (u->ctx)
        ucp_cleanup(u->ctx);
    free(u->addr_wire);
    free(u->peers);
    free(u->pend);
    free(u->tmp);
    free(u);
}

static const struct comm_ops ucx_ops = {
    .name = "ucx",
    .allreduce_sum = ucx_allreduce_sum,
    .allgather = ucx_allgather,
    .broadcast = ucx_broadcast,
    .broadcast_var = ucx_broadcast_var,
    .barrier = ucx_barrier,
    .abort = ucx_abort,
    .free = ucx_free,
};

static bool comm_is_ucx(const struct comm *c)
{
    return c && c->ops == &ucx_ops;
}

int comm_ucx_new(int rank, int world_size, int timeout_msec, struct comm **ret)
{
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_TAG,
    };
    ucp_worker_params_t wparams = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    ucp_config_t *config = NULL;
    struct addr_hdr hdr;
    struct ucx *u;
    ucs_status_t s;
    int r, i;

    if (world_size < 1 || world_size > 255 || rank < 0 || rank >= world_size)
        return -EINVAL;
    u = calloc(1, sizeof(*u));
    if (!u)
        return -ENOMEM;
    u->c.ops = &ucx_ops;
    u->c.rank = rank;
    u->c.world_size = world_size;
    u->c.timeout_msec = timeout_msec;
    u->failed_peer = -1;
    u->op = "setup";
    u->peers = calloc((size_t)world_size, sizeof(*u->peers));
    u->pend = calloc(2 * (size_t)world_size, sizeof(*u->pend));
    if (!u->peers || !u->pend) {
        r = -ENOMEM;
        goto out_free;
    }
    for (i = 0; i < world_size; i++) {
        u->peers[i].u = u;
        u->peers[i].rank = i;
    }
    s = ucp_config_read(NULL, NULL, &config);
    if (s != UCS_OK) {
        r = err_from_ucs(s);
        comm__fail(&u->c, r, "ucp_config_read: %s", ucs_status_string(s));
        goto out_free;
    }
    if (!getenv("UCX_KEEPALIVE_INTERVAL"))
        (void)ucp_config_modify(config, "KEEPALIVE_INTERVAL", KEEPALIVE_DEFAULT);
    /* Zero-copy cross-process reads (cma) abort the whole process when the peer dies
     * mid-transfer (no peer-failure handling on shared memory in UCX 1.13): leave cma out
     * unless the operator chose the transports.  (knem and xpmem, absent from Debian's
     * UCX, have the same property; naming absent transports here would only warn.) */
    if (!getenv("UCX_TLS"))
        (void)ucp_config_modify(config, "TLS", "^cma");
    /* UCX's TCP transport listens on every device it may use: on loopback only unless the
     * operator names the devices (UCX_NET_DEVICES, stepd-worker --comm-net-devices), as
     * every other listener of stepd binds loopback unless told otherwise */
    if (!getenv("UCX_NET_DEVICES"))
        (void)ucp_config_modify(config, "NET_DEVICES", "lo");
    s = ucp_init(&params, config, &u->ctx);
    ucp_config_release(config);
    if (s != UCS_OK) {
        r = err_from_ucs(s);
        goto out_free;
    }
    s = ucp_worker_create(u->ctx, &wparams, &u->worker);
    if (s != UCS_OK) {
        r = err_from_ucs(s);
        goto out_free;
    }
    s = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len);
    if (s != UCS_OK) {
        r = err_from_ucs(s);
        goto out_free;
    }
    hdr = (struct addr_hdr){ .magic = ADDR_MAGIC, .rank = rank, .world_size = world_size,
                             .len = (uint32_t)u->addr_len, .host_id = host_id_get(),
                             .pid = (int32_t)getpid(), .start_time = proc_start_time(getpid()) };
    u->addr_wire_len = sizeof(hdr) + u->addr_len;
    u->addr_wire = malloc(u->addr_wire_len);
    if (!u->addr_wire) {
        r = -ENOMEM;
        goto out_free;
    }
    memcpy(u->addr_wire, &hdr, sizeof(hdr));
    memcpy((char *)u->addr_wire + sizeof(hdr), u->addr, u->addr_len);
    *ret = &u->c;
    return 0;

out_free:
    ucx_free(&u->c);
    return r;
}

int comm_ucx_address(struct comm *c, const void **ret_addr, size_t *ret_len)
{
    struct ucx *u;

    if (!comm_is_ucx(c))
        return -EINVAL;
    u = to_ucx(c);
    *ret_addr = u->addr_wire;
    *ret_len = u->addr_wire_len;
    return 0;
}

int comm_ucx_connect(struct comm *c, const void *const *addrs, const size_t *lens)
{
    struct ucx *u;
    int i, r;

    if (!comm_is_ucx(c))
        return -EINVAL;
    u = to_ucx(c);
    if (c->error)
        return -ECANCELED;
    /* validate every wrapper first: nothing is created from a bad set */
    for (i = 0; i < c->world_size; i++) {
        struct addr_hdr h;

        if (i == c->rank)
            continue;
        if (!addrs[i] || lens[i] < sizeof(h))
            return comm__fail(c, -EBADMSG, "address of rank %d: %zu bytes, too short", i,
                              addrs[i] ? lens[i] : 0);
        memcpy(&h, addrs[i], sizeof(h));
        if (h.magic != ADDR_MAGIC)
            return comm__fail(c, -EBADMSG, "address of rank %d: not a stepd UCX address", i);
        if (h.rank != i || h.world_size != c->world_size)
            return comm__fail(c, -EBADMSG, "address of rank %d says rank %d of %d (expected %d of %d)",
                              i, h.rank, h.world_size, i, c->world_size);
        if ((size_t)h.len != lens[i] - sizeof(h) || h.len == 0)
            return comm__fail(c, -EBADMSG, "address of rank %d: length field %u, payload %zu",
                              i, h.len, lens[i] - sizeof(h));
    }
    /* Peers on this host (same boot, namespaces) use shared memory.  UCX 1.13's shared
     * memory transports support no peer-failure handling, so those endpoints are created
     * without it and their liveness is checked by pid (check_local_peers); endpoints to
     * other hosts use UCP_ERR_HANDLING_MODE_PEER (TCP).  STEPD_UCX_SHM=0 forces the
     * latter for everyone. */
    const char *shm_env = getenv("STEPD_UCX_SHM");
    bool allow_shm = !(shm_env && strcmp(shm_env, "0") == 0);
    struct addr_hdr mine;

    memcpy(&mine, u->addr_wire, sizeof(mine));
    for (i = 0; i < c->world_size; i++) {
        ucp_ep_params_t ep = {
            .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER,
            .err_mode = UCP_ERR_HANDLING_MODE_PEER,
            .err_handler = { .cb = peer_err_cb, .arg = &u->peers[i] },
        };
        struct addr_hdr h;
        ucs_status_t s;

        if (i == c->rank)
            continue;
        memcpy(&h, addrs[i], sizeof(h));
        if (allow_shm && h.host_id == mine.host_id && h.pid > 0 && h.start_time &&
            mine.start_time) {
            u->peers[i].local = true;
            u->peers[i].pid = h.pid;
            u->peers[i].start_time = h.start_time;
            ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
            ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        }
        ep.address = (const ucp_address_t *)((const char *)addrs[i] + sizeof(struct addr_hdr));
        s = ucp_ep_create(u->worker, &ep, &u->peers[i].ep);
        if (s != UCS_OK) {
            u->peers[i].ep = NULL;
            r = comm__fail(c, err_from_ucs(s), "cannot connect to rank %d: %s", i,
                           ucs_status_string(s));
            close_eps(u, true);
            return r;
        }
    }
    /* the persistent receive of abort notices from any peer */
    {
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FIELD_CALLBACK |
                            UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .recv_info.tag_info = &u->abort_pd.info,
            .cb.recv = recv_done_cb,
            .user_data = &u->abort_pd,
        };
        ucs_status_ptr_t st = ucp_tag_recv_nbx(u->worker, u->abort_msg, sizeof(u->abort_msg) - 1,
                                               ABORT_TAG, ~(uint64_t)0xff, &prm);

        if (UCS_PTR_IS_ERR(st)) {
            r = comm__fail(c, err_from_ucs(UCS_PTR_STATUS(st)), "cannot post the abort receive: %s",
                           ucs_status_string(UCS_PTR_STATUS(st)));
            close_eps(u, true);
            return r;
        }
        u->abort_req = st;
    }
    /* all ranks wired and reachable before anyone returns */
    return ucx_barrier(c);
}
