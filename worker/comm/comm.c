/* comm.c - struct comm wrappers: argument checks, the sticky error, then the vtable.
 * Also the step-plan broadcast (pack on rank 0, broadcast_var, unpack elsewhere). */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "comm.h"
#include "err.h"
#include "log.h"

int comm__fail(struct comm *c, int err, const char *fmt, ...)
{
    va_list ap;

    ASSERT(err < 0);
    if (c->error)
        return c->error;
    c->error = err;
    va_start(ap, fmt);
    vsnprintf(c->error_msg, sizeof(c->error_msg), fmt, ap);
    va_end(ap);
    return err;
}

static int check_live(struct comm *c)
{
    ASSERT(c && c->ops);
    if (c->error)
        return -ECANCELED;
    if (atomic_load(&c->interrupted)) {
        comm__fail(c, -ECANCELED, "interrupted: the group is re-forming");
        c->ops->abort(c);
        return -ECANCELED;
    }
    return 0;
}

void comm_interrupt(struct comm *c)
{
    if (c)
        atomic_store(&c->interrupted, true);
}

static uint64_t now_usec(const struct comm *c)
{
    return (uint64_t)clk_src_now_us(&c->clock);
}

/* Mark a collective running (only when it has a deadline the watchdog can hold it to). */
static void busy_begin(struct comm *c)
{
    if (c->timeout_msec > 0)
        atomic_store(&c->busy_since_usec, now_usec(c));
}

static int busy_end(struct comm *c, int r)
{
    atomic_store(&c->busy_since_usec, 0);
    return r;
}

struct comm_watchdog {
    struct comm *c;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    int grace_msec, exit_code;
};

static void *watchdog_main(void *arg)
{
    struct comm_watchdog *w = arg;
    char msg[160];

    pthread_mutex_lock(&w->lock);
    while (!w->stop) {
        struct timespec ts = clk_realtime_in_ms(200);
        uint64_t since, limit;

        pthread_cond_timedwait(&w->cond, &w->lock, &ts);
        since = atomic_load(&w->c->busy_since_usec);
        limit = (uint64_t)(w->c->timeout_msec > 0 ? w->c->timeout_msec : 0) * 1000u +
                (uint64_t)w->grace_msec * 1000u;
        if (since && now_usec(w->c) - since > limit) {
            /* async-signal-safe path only: the comm thread may hold any lock */
            int n = snprintf(msg, sizeof(msg), "<2>comm watchdog: a collective has run for more "
                             "than its %d ms deadline + %d ms; exiting\n", w->c->timeout_msec,
                             w->grace_msec);
            if (n > 0 && write(2, msg, (size_t)n) < 0)
                n = 0;
            _exit(w->exit_code);
        }
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

int comm_watchdog_start(struct comm *c, int grace_msec, int exit_code)
{
    struct comm_watchdog *w;

    if (c->watchdog)
        return -EALREADY;
    w = calloc(1, sizeof(*w));
    if (!w)
        return -ENOMEM;
    w->c = c;
    w->grace_msec = grace_msec;
    w->exit_code = exit_code;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->cond, NULL);
    if (pthread_create(&w->thread, NULL, watchdog_main, w) != 0) {
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->lock);
        free(w);
        return -EAGAIN;
    }
    c->watchdog = w;
    return 0;
}

static void watchdog_stop(struct comm *c)
{
    struct comm_watchdog *w = c->watchdog;

    if (!w)
        return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
    free(w);
    c->watchdog = NULL;
}

int comm_allreduce_sum(struct comm *c, float *buf, size_t count)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    BUG_ON(count && !buf);
    if (count == 0)
        return 0;
    c->n_ops++;
    busy_begin(c);
    return busy_end(c, c->ops->allreduce_sum(c, buf, count));
}

int comm_allgather(struct comm *c, const void *send, void *recv, size_t nbytes)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    BUG_ON(nbytes && (!send || !recv));
    if (nbytes == 0)
        return 0;
    c->n_ops++;
    busy_begin(c);
    return busy_end(c, c->ops->allgather(c, send, recv, nbytes));
}

int comm_broadcast(struct comm *c, void *buf, size_t nbytes, int root)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    BUG_ON(root < 0 || root >= c->world_size);
    BUG_ON(nbytes && !buf);
    if (nbytes == 0)
        return 0;
    c->n_ops++;
    busy_begin(c);
    return busy_end(c, c->ops->broadcast(c, buf, nbytes, root));
}

int comm_broadcast_var(struct comm *c, void *buf, size_t *len, size_t cap, int root)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    BUG_ON(root < 0 || root >= c->world_size);
    BUG_ON(!buf || !len);
    if (c->rank == root && *len > cap)
        return -EMSGSIZE;
    c->n_ops++;
    busy_begin(c);
    return busy_end(c, c->ops->broadcast_var(c, buf, len, cap, root));
}

int comm_barrier(struct comm *c)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    c->n_ops++;
    busy_begin(c);
    return busy_end(c, c->ops->barrier(c));
}

void comm_abort(struct comm *c)
{
    if (!c)
        return;
    if (!c->error)
        comm__fail(c, -ECANCELED, "communicator aborted by its owner");
    c->ops->abort(c);
}

void comm_free(struct comm *c)
{
    if (!c)
        return;
    watchdog_stop(c);
    c->ops->free(c);
}

const char *comm_last_error(const struct comm *c)
{
    return c ? c->error_msg : "";
}

/* ---- step-plan broadcast --------------------------------------------------------- */

int comm_plan_send(struct comm *c, const struct step_plan *p, void *scratch, size_t cap)
{
    size_t len;
    int n;

    BUG_ON(c->rank != 0);
    n = step_plan_pack(p, scratch, cap);
    if (n < 0)
        return n;
    len = (size_t)n;
    return comm_broadcast_var(c, scratch, &len, cap, 0);
}

int comm_plan_send_stop(struct comm *c, void *scratch, size_t cap)
{
    size_t len;
    int n;

    BUG_ON(c->rank != 0);
    n = step_plan_pack_stop(scratch, cap);
    if (n < 0)
        return n;
    len = (size_t)n;
    return comm_broadcast_var(c, scratch, &len, cap, 0);
}

int comm_plan_recv(struct comm *c, void *scratch, size_t cap, const struct step_plan_limits *lim,
                   struct step_plan_buf *b, int *ret_kind, struct err_buf *e)
{
    size_t len = 0;
    int r;

    BUG_ON(c->rank == 0);
    r = comm_broadcast_var(c, scratch, &len, cap, 0);
    if (r < 0)
        return err_set(e, r, "step-plan broadcast: %s",
                       c->error_msg[0] ? c->error_msg : err_str(r));
    return step_plan_unpack(scratch, len, lim, b, ret_kind, e);
}
