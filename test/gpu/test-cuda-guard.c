/* test-cuda-guard.c - the CUDA backend's and the NCCL communicator's host-side decisions
 * (kernels/cuda/step-guard.h, worker/comm/nccl-settle.h) against fakes, on every machine
 * (suite 'kernels': no GPU, no CUDA headers).
 *
 *  - NCCL: a fake non-blocking communicator answers ncclInProgress to the call and to the
 *    first polls; dependent work may start only once its state is ncclSuccess; errors,
 *    the (injected) deadline and an abort from another thread end the poll;
 *  - device: a fake per-thread current device (a new thread starts on 0, as in CUDA); a
 *    backend on device 2 called from a second thread launches on device 2;
 *  - graphs: a fake workspace that grows and moves between steps; a replayed graph never
 *    reads an address that was freed;
 *  - padding: a bucket-8 graph captured with 8 real rows, replayed with 5, routes the 3
 *    padding rows nowhere;
 *  - block ids: a released block in the part a layer reads fails the step; the 45 layers
 *    of a step scan the tables once per (table, window, pool);
 *  - GEMM: a cuBLASLt heuristic miss runs the plain kernel, one warning per backend. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "nccl-settle.h"
#include "step-guard.h"

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

/* ---- the device of the calling thread ---- */

static _Thread_local int cur_dev;       /* CUDA: a new thread starts on device 0 */
static _Thread_local int thread_no;
static struct { int thread, dev; } dev_log[16];
static int n_dev_log;
static pthread_mutex_t dev_mu = PTHREAD_MUTEX_INITIALIZER;

static int fake_get(int *dev)
{
    *dev = cur_dev;
    return 0;
}

static int fake_set(int dev)
{
    pthread_mutex_lock(&dev_mu);
    if (n_dev_log < 16) {
        dev_log[n_dev_log].thread = thread_no;
        dev_log[n_dev_log].dev = dev;
        n_dev_log++;
    }
    pthread_mutex_unlock(&dev_mu);
    cur_dev = dev;
    return 0;
}

static const struct sg_dev_ops fake_dev = { fake_get, fake_set };

/* a backend entry point: the guard, then a "launch" that records where it ran */
static int entry_launch(int backend_dev)
{
    ASSERT_OK(sg_use_device(&fake_dev, backend_dev));
    return cur_dev;
}

static void *engine_thread(void *arg)
{
    static int launched[2];

    thread_no = 2;
    launched[0] = entry_launch(*(int *)arg);
    launched[1] = entry_launch(*(int *)arg);
    return launched;
}

static void test_device_per_thread(void)
{
    int dev = 2;
    pthread_t t;
    void *ret;

    thread_no = 1;                      /* the worker thread: init */
    ASSERT_EQ(entry_launch(dev), 2);
    ASSERT_EQ(pthread_create(&t, NULL, engine_thread, &dev), 0);
    ASSERT_EQ(pthread_join(t, &ret), 0);
    ASSERT_EQ(((int *)ret)[0], 2);      /* not device 0 */
    ASSERT_EQ(((int *)ret)[1], 2);
    ASSERT_EQ(n_dev_log, 2);            /* once per thread, not per call */
    ASSERT_EQ(dev_log[0].thread, 1);
    ASSERT_EQ(dev_log[0].dev, 2);
    ASSERT_EQ(dev_log[1].thread, 2);
    ASSERT_EQ(dev_log[1].dev, 2);
    printf("device: a second thread's launches run on the backend's device 2\n");
}

/* ---- graphs and the workspace ---- */

static void test_graph_epoch(void)
{
    /* a workspace of "generation" g is valid until it grows; a graph remembers the
     * generation it was captured with and must never be replayed over an older one */
    uint32_t mem_epoch = 0, graph_epoch = 0;
    int ws_gen = 0, graph_ws = -1, captures = 0, replays = 0, gens = 0, last_gen = -1;
    bool have = false;
    unsigned rng = 12345;

    for (int step = 0; step < 200; step++) {
        rng = rng * 1103515245u + 12345u;
        if ((rng >> 16) % 7 == 0) {     /* an op grows the workspace between steps */
            ws_gen++;
            mem_epoch++;
        }
        gens += ws_gen != last_gen;
        last_gen = ws_gen;
        switch (sg_graph_lookup(have, graph_epoch, mem_epoch)) {
        case SG_GRAPH_REPLAY:
            ASSERT_EQ(graph_ws, ws_gen);    /* the addresses it captured are live */
            replays++;
            break;
        case SG_GRAPH_RECAPTURE:
            have = false;
            /* fall through */
        case SG_GRAPH_CAPTURE:
            ASSERT_TRUE(!have);
            have = true;
            graph_ws = ws_gen;
            graph_epoch = mem_epoch;
            captures++;
            break;
        }
    }
    ASSERT_EQ(captures, gens);          /* once per workspace generation */
    ASSERT_TRUE(ws_gen > 5);
    ASSERT_EQ(replays, 200 - captures);
    printf("graphs: %d captures for %d workspace moves, %d replays, none over freed memory\n",
           captures, ws_gen, replays);
}

/* ---- padding ---- */

/* the router's padding rule (router.cu): rows at or past *n_real route nowhere */
static void route(int rows, const int32_t *n_real, int32_t *ids)
{
    for (int t = 0; t < rows; t++)
        ids[t] = n_real && t >= *n_real ? -1 : 100 + t;
}

static void test_padding(void)
{
    int32_t hdr[1], ids[8];
    bool mask;

    /* capture: a decode step of bucket 8 that fills it (8 real rows) */
    hdr[0] = 8;
    mask = sg_mask_padding(true, 8, 8);
    route(8, mask ? hdr : NULL, ids);
    for (int t = 0; t < 8; t++)
        ASSERT_EQ(ids[t], 100 + t);
    /* replay of the same graph (the decision is baked in) with 5 real rows */
    hdr[0] = 5;
    route(8, mask ? hdr : NULL, ids);
    for (int t = 0; t < 8; t++)
        ASSERT_EQ(ids[t], t < 5 ? 100 + t : -1);
    /* the op path outside a step area passes no count (no padding there) */
    ASSERT_TRUE(!sg_mask_padding(false, 8, 8));
    ASSERT_TRUE(!sg_mask_padding(true, 8, 3));
    printf("padding: a graph captured full masks the padding rows of later replays\n");
}

/* ---- block ids ---- */

static void test_blocks(void)
{
    /* block size 16; seq 0: positions 0..40 (3 blocks), seq 1: positions 0..40 with its
     * first block released (a sliding layer's window of 16 no longer reads it) */
    const int32_t tables[] = { 5, 6, 7, -1, 9, 10 }, off[] = { 0, 3 };
    const int32_t start[] = { 0, 1, 2 }, pos0[] = { 40, 40 };
    struct sg_blocks_memo m = { 0 };
    int seq = -1, max_tab = 0;

    ASSERT_ERR(sg_blocks_check(tables, off, start, pos0, 2, 0, 16, 64, &max_tab, &seq), -EINVAL);
    ASSERT_EQ(seq, 1);
    ASSERT_OK(sg_blocks_check(tables, off, start, pos0, 2, 16, 16, 64, &max_tab, &seq));
    ASSERT_EQ(max_tab, 6);
    ASSERT_ERR(sg_blocks_check(tables, off, start, pos0, 2, 16, 16, 10, NULL, &seq), -EINVAL);
    /* a verify run of 4 tokens at 44..47: the first query's window (29..44) reaches block 1,
     * the last one's (32..47) not; the kernel reads from 29 */
    {
        const int32_t t2[] = { -1, -1, 9 }, o2[] = { 0 }, s2[] = { 0, 4 }, p2[] = { 44 };
        const int32_t t3[] = { -1, 8, 9 };

        ASSERT_ERR(sg_blocks_check(t2, o2, s2, p2, 1, 16, 16, 64, NULL, &seq), -EINVAL);
        ASSERT_OK(sg_blocks_check(t3, o2, s2, p2, 1, 16, 16, 64, &max_tab, &seq));
        ASSERT_EQ(max_tab, 3);
    }
    /* a step of 45 layers, full and sliding alternating: two scans, every layer answered */
    for (int step = 0; step < 2; step++) {
        sg_blocks_reset(&m);
        for (int layer = 0; layer < 45; layer++) {
            const int window = layer % 2 ? 16 : 0;
            const int r = sg_blocks_once(&m, tables, off, start, pos0, 2, window, 16, 64, &seq);

            ASSERT_EQ(r, window ? 0 : -EINVAL);
        }
        ASSERT_EQ(m.scans, 2u * (step + 1));
    }
    printf("blocks: a released block read by a layer fails the step; 2 scans per 45-layer step\n");
}

/* ---- GEMM algorithm ---- */

struct fake_lt {
    int r, found, warnings;
};

static int fake_heuristic(void *ctx, int *found)
{
    struct fake_lt *f = ctx;

    *found = f->found;
    return f->r;
}

static void fake_warn(void *ctx)
{
    ((struct fake_lt *)ctx)->warnings++;
}

static void test_gemm_fallback(void)
{
    struct fake_lt f = { 0 };
    const struct sg_gemm_ops ops = { fake_heuristic, fake_warn, &f };
    bool warned = false, plain = false;

    f.found = 1;
    ASSERT_OK(sg_gemm_pick(&ops, &warned, &plain));
    ASSERT_TRUE(!plain);
    f.found = 0;                        /* a miss: no algorithm */
    ASSERT_OK(sg_gemm_pick(&ops, &warned, &plain));
    ASSERT_TRUE(plain);
    f.r = -ENOTSUP;                     /* CUBLAS_STATUS_NOT_SUPPORTED */
    plain = false;
    ASSERT_OK(sg_gemm_pick(&ops, &warned, &plain));
    ASSERT_TRUE(plain);
    ASSERT_EQ(f.warnings, 1);           /* one warning for the backend */
    f.r = -ENOMEM;
    ASSERT_ERR(sg_gemm_pick(&ops, &warned, &plain), -ENOMEM);
    printf("gemm: a heuristic miss runs the plain kernel with one warning\n");
}

int main(void)
{
    test_nccl_in_progress();
    test_nccl_deadline();
    test_nccl_abort_other_thread();
    test_device_per_thread();
    test_graph_epoch();
    test_padding();
    test_blocks();
    test_gemm_fallback();
    printf("CUDA backend and NCCL host-side guards hold\n");
    return 0;
}
