/* test-cuda-guard.c - the NCCL communicator's host-side decisions
 * (worker/comm/nccl-settle.h) against fakes, on every machine (suite 'kernels': no GPU,
 * no CUDA headers).
 *
 *  - NCCL: a fake non-blocking communicator answers ncclInProgress to the call and to the
 *    first polls; dependent work may start only once its state is ncclSuccess; errors,
 *    the (injected) deadline and an abort from another thread end the poll. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nccl-settle.h"

/* ---- NCCL ---- */

struct fake_comm {
    int in_progress_polls;      /* polls that still answer ncclInProgress */
    int error_after;            /* > 0: the poll after that many answers this error */
    int error;
    int polls, pauses;
    uint64_t clock_usec;        /* injected: each pause advances it */
    atomic_bool aborting;
    atomic_int polling;         /* the poller has started */
};

static int fake_state(void *ctx, int *st)
{
    struct fake_comm *f = ctx;

    if (atomic_load(&f->aborting))
        return -ECANCELED;
    atomic_store(&f->polling, 1);
    f->polls++;
    if (f->error_after > 0 && f->polls >= f->error_after) {
        *st = f->error;
        return 0;
    }
    if (f->in_progress_polls < 0) {         /* never settles */
        *st = NS_IN_PROGRESS;
        return 0;
    }
    *st = f->in_progress_polls > 0 ? NS_IN_PROGRESS : NS_SUCCESS;
    if (f->in_progress_polls > 0)
        f->in_progress_polls--;
    return 0;
}

static uint64_t fake_now(void *ctx)
{
    return ((struct fake_comm *)ctx)->clock_usec;
}

static void fake_pause(void *ctx)
{
    struct fake_comm *f = ctx;

    f->pauses++;
    f->clock_usec += 1000;
    sched_yield();
}

static void test_nccl_in_progress(void)
{
    struct fake_comm f = { .in_progress_polls = 3 };
    const struct nccl_settle s = { fake_state, fake_now, fake_pause, &f, 0 };
    int st = -1;

    /* the call answers ncclInProgress: not enqueued yet; the comm settles after 3 polls */
    ASSERT_OK(nccl_settle(&s, NS_IN_PROGRESS, &st));
    ASSERT_EQ(st, NS_SUCCESS);
    ASSERT_EQ(f.polls, 4);
    ASSERT_EQ(f.in_progress_polls, 0);  /* dependent work starts only now */
    /* ncclSuccess from the call: one look at the async state, no pause */
    f = (struct fake_comm){ 0 };
    ASSERT_OK(nccl_settle(&s, NS_SUCCESS, &st));
    ASSERT_EQ(f.polls, 1);
    ASSERT_EQ(f.pauses, 0);
    /* an error from the call: no poll */
    f = (struct fake_comm){ 0 };
    ASSERT_ERR(nccl_settle(&s, 5 /* ncclInvalidUsage */, &st), -EPROTO);
    ASSERT_EQ(st, 5);
    ASSERT_EQ(f.polls, 0);
    /* the communicator fails while in progress (ncclRemoteError) */
    f = (struct fake_comm){ .in_progress_polls = -1, .error_after = 3, .error = 6 };
    ASSERT_ERR(nccl_settle(&s, NS_IN_PROGRESS, &st), -EPROTO);
    ASSERT_EQ(st, 6);
    ASSERT_EQ(f.polls, 3);
    printf("nccl: ncclInProgress polled to ncclSuccess before dependent work; errors end it\n");
}

static void test_nccl_deadline(void)
{
    struct fake_comm f = { .in_progress_polls = -1, .clock_usec = 100 };
    const struct nccl_settle s = { fake_state, fake_now, fake_pause, &f, 100 + 5000 };
    int st;

    ASSERT_ERR(nccl_settle(&s, NS_IN_PROGRESS, &st), -ETIMEDOUT);
    ASSERT_EQ(f.pauses, 5);             /* 1000 us of injected time per pause */
    printf("nccl: a communicator stuck in progress times out at its deadline\n");
}

static void *settle_thread(void *arg)
{
    struct fake_comm *f = arg;
    const struct nccl_settle s = { fake_state, fake_now, fake_pause, f, 0 };
    static int r;
    int st;

    r = nccl_settle(&s, NS_IN_PROGRESS, &st);
    return &r;
}

static void test_nccl_abort_other_thread(void)
{
    struct fake_comm f = { .in_progress_polls = -1 };
    pthread_t t;
    void *ret;

    ASSERT_EQ(pthread_create(&t, NULL, settle_thread, &f), 0);
    while (!atomic_load(&f.polling))
        sched_yield();
    atomic_store(&f.aborting, true);    /* the watchdog's / owner's comm_abort */
    ASSERT_EQ(pthread_join(t, &ret), 0);
    ASSERT_ERR(*(int *)ret, -ECANCELED);
    printf("nccl: an abort from another thread ends a poll without a deadline\n");
}

int main(void)
{
    test_nccl_in_progress();
    test_nccl_deadline();
    test_nccl_abort_other_thread();
    printf("NCCL host-side guards hold\n");
    return 0;
}
