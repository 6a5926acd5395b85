/* nccl-settle.h - when a collective on a non-blocking NCCL communicator may be followed
 * by dependent work (comm-nccl.c).
 *
 * With config.blocking = 0 an NCCL call may return ncclInProgress: the operation is not
 * yet enqueued on the stream, and NCCL forbids issuing more work on the communicator (or
 * work that depends on it) until ncclCommGetAsyncError reports ncclSuccess.  So every
 * collective, in both stream modes, polls the state until it is no longer in progress;
 * the poll stops on an error, the deadline, or an abort from another thread (the state
 * callback answers -ECANCELED once comm-nccl.c's abort has begun or comm_interrupt() was
 * called; an interrupt then aborts the communicator on the polling thread).
 *
 * Plain C, no NCCL header: test/gpu/test-cuda-guard.c runs it against a fake communicator
 * on every machine.  comm-nccl.c asserts that the two values below are NCCL's. */
#pragma once

#include <errno.h>
#include <stdint.h>

#define NS_SUCCESS 0        /* ncclSuccess */
#define NS_IN_PROGRESS 7    /* ncclInProgress */

struct nccl_settle {
    /* ncclCommGetAsyncError: 0 and *st the state, or -ECANCELED when aborted */
    int (*state)(void *ctx, int *st);
    uint64_t (*now_usec)(void *ctx);
    void (*pause)(void *ctx);
    void *ctx;
    uint64_t deadline_usec; /* 0: none */
};

/* After a collective was issued with result `issued`: 0 once the communicator's state is
 * ncclSuccess; -ECANCELED (aborted), -ETIMEDOUT (deadline), or -EPROTO with *ret_st the
 * NCCL error (of the call or of the communicator). */
static inline int nccl_settle(const struct nccl_settle *s, int issued, int *ret_st)
{
    int st = issued;

    *ret_st = NS_SUCCESS;
    for (;;) {
        if (st != NS_SUCCESS && st != NS_IN_PROGRESS) {
            *ret_st = st;
            return -EPROTO;
        }
        if (s->deadline_usec && st == NS_IN_PROGRESS && s->now_usec(s->ctx) >= s->deadline_usec)
            return -ETIMEDOUT;
        if (st == NS_IN_PROGRESS)
            s->pause(s->ctx);
        const int r = s->state(s->ctx, &st);

        if (r < 0)
            return r;
        if (st == NS_SUCCESS)
            return 0;
    }
}
