/* comm.c - struct comm wrappers: argument checks, the sticky error, then the vtable.
 * Also the step-plan broadcast (pack on rank 0, broadcast_var, unpack elsewhere). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
    return 0;
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
    return c->ops->allreduce_sum(c, buf, count);
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
    return c->ops->allgather(c, send, recv, nbytes);
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
    return c->ops->broadcast(c, buf, nbytes, root);
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
    return c->ops->broadcast_var(c, buf, len, cap, root);
}

int comm_barrier(struct comm *c)
{
    int r = check_live(c);

    if (r < 0)
        return r;
    c->n_ops++;
    return c->ops->barrier(c);
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
