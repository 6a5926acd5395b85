/* threads.c - the CPU backend's persistent worker pool.
 *
 * Two ways to use it:
 *  - cpu_pool_for(): the ops' way.  The caller cuts the op into a few coarse units per
 *    thread (contiguous row ranges, in order) and deals them out as one contiguous
 *    segment per thread: thread t owns units [n*t/nth, n*(t+1)/nth), so in every op and
 *    every step a thread streams the same rows of the same weights (they stay in its
 *    core's cache).  A thread claims its own units from the front of its segment with a
 *    CAS on a word only it normally touches; when its segment is empty it steals from
 *    the back of the others'.  The caller returns as soon as every unit is DONE - not
 *    when every thread has checked in - so a worker whose core is busy with someone
 *    else's job simply takes fewer units (or none: the caller does them all), and a
 *    worker that wakes late finds the segments of a finished run empty and touches
 *    nothing of it (or claims units of the current run, which is as good as any thread).
 *  - cpu_pool_run() / cpu_pool_run_n() + cpu_pool_barrier(): fn runs once per thread
 *    and all of them must take part (used by the bandwidth probe and tests).
 *
 * Waiting.  Waking a sleeping thread costs the waker 15-45 us in this VM (futex
 * syscall, IPI, the halted vCPU's wake-up): more than most ops of a small model take.
 * So an idle worker spins for LINGER_NS after its last unit before it sleeps on a futex
 * (a forward step's ~60 ops, and back-to-back steps, then pay no wake-up at all), for
 * BUSY_IDLE_NS between cpu_pool_busy_begin() and cpu_pool_busy_end() (the backend's
 * graph_begin/graph_end around one forward step; begin also wakes sleepers at once).
 * The spin is pause-only for BUSY_PAUSE_NS, then calls sched_yield() each round, so a
 * busy neighbour core, or a second process of ours on the same cores, never meets a
 * spin storm: it gets its share of the core, and the caller simply does more units
 * itself.  Wake-ups and completion signals make a futex syscall only when somebody
 * actually sleeps (a sleeper count, checked Dekker style with seq_cst on both sides).
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "err.h"
#include "cpu.h"

#define SPIN_ITERS 200              /* run/barrier paths: ~5-30 us of pause, then futex */
#define BUSY_PAUSE_NS 50000         /* idle worker: pause-only spin, then with sched_yield */
#define LINGER_NS 1000000           /* idle worker: sleep after this long without work */
#define BUSY_IDLE_NS 2000000        /* the same in busy mode */
#define DONE_SPIN_NS 100000         /* caller: spin this long for others' units, then sleep */

struct cpu_pool;

struct pool_worker {
    struct cpu_pool *pool;
    int ith;
    pthread_t th;
};

/* One segment of a for-run: units [front, back) not claimed yet (front in the high
 * half).  One per thread, each on its own cache line. */
struct pool_seg {
    alignas(64) _Atomic uint64_t w;
};

struct cpu_pool {
    int n;                              /* threads including the caller */
    int active;                         /* threads taking part (caller's copy, for barriers) */
    int busy_depth;                     /* caller's copy of busy */
    struct pool_worker *workers;        /* n - 1 */
    struct pool_seg *seg;               /* n */
    cpu_task_fn fn;
    void *arg;
    _Atomic bool stop;
    /* written by the caller once per run, read by spinning workers: one line */
    alignas(64) _Atomic uint32_t gen;   /* run word: seq << 8 | FOR_BIT? | threads taking part */
    _Atomic int busy;                   /* > 0: workers spin between runs */
    _Atomic int for_n;                  /* units of the current for-run */
    cpu_unit_fn for_fn;
    void *for_arg;
    /* written by workers going to sleep */
    alignas(64) _Atomic int sleepers;   /* workers asleep (or about to be) on gen */
    /* completion of a for-run */
    alignas(64) _Atomic uint32_t done;  /* units finished (published per thread and run) */
    _Atomic uint32_t caller_sleeping;   /* the caller sleeps on done */
    /* cpu_pool_run */
    alignas(64) _Atomic int pending;    /* workers still running this generation */
    _Atomic uint32_t run_done;          /* 1 when pending reached 0 */
    _Atomic int bar_count;
    _Atomic uint32_t bar_gen;
};

#define GEN_FOR_BIT 0x80u
#define GEN_COUNT_MASK 0x7fu

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void)
{
    return (uint64_t)clk_now_ns();
}

/* Wait until *addr != val: bounded spin, then futex sleep (run/barrier paths). */
static void wait_change(_Atomic uint32_t *addr, uint32_t val)
{
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(addr, memory_order_acquire) != val)
            return;
        cpu_relax();
    }
    while (atomic_load_explicit(addr, memory_order_acquire) == val)
        futex_wait(addr, val);
}

/* A worker's wait for the next run word after `seen`; returns it. */
static uint32_t worker_wait(struct cpu_pool *pool, uint32_t seen)
{
    uint64_t t0 = 0;
    uint32_t g;

    for (;;) {
        uint64_t t;

        for (int k = 0; k < 64; k++) {
            g = atomic_load_explicit(&pool->gen, memory_order_acquire);
            if (g != seen)
                return g;
            cpu_relax();
        }
        t = now_ns();
        if (!t0)
            t0 = t;
        if (t - t0 > (atomic_load_explicit(&pool->busy, memory_order_relaxed) > 0 ?
                      BUSY_IDLE_NS : LINGER_NS))
            break;
        if (t - t0 > BUSY_PAUSE_NS)
            sched_yield();
    }
    /* sleep: announce first, then re-check (the caller stores gen, then reads sleepers) */
    atomic_fetch_add_explicit(&pool->sleepers, 1, memory_order_seq_cst);
    while ((g = atomic_load_explicit(&pool->gen, memory_order_seq_cst)) == seen)
        futex_wait(&pool->gen, seen);
    atomic_fetch_sub_explicit(&pool->sleepers, 1, memory_order_relaxed);
    return g;
}

/* Publish a new run word and wake the workers that sleep (no syscall when none does). */
static void pool_publish(struct cpu_pool *pool, uint32_t flags_count)
{
    uint32_t g = atomic_load_explicit(&pool->gen, memory_order_relaxed);

    atomic_store_explicit(&pool->gen, ((g >> 8) + 1) << 8 | flags_count, memory_order_seq_cst);
    if (atomic_load_explicit(&pool->sleepers, memory_order_seq_cst) > 0)
        futex_wake(&pool->gen);
}

#define SEG_PACK(front, back) ((uint64_t)(front) << 32 | (uint32_t)(back))

/* Claim the first unclaimed unit of segment s (own) or the last one (steal); -1 if empty. */
static int seg_claim(struct pool_seg *s, bool steal)
{
    uint64_t v = atomic_load_explicit(&s->w, memory_order_relaxed);

    for (;;) {
        uint32_t f = (uint32_t)(v >> 32), b = (uint32_t)v;

        if (f >= b)
            return -1;
        if (atomic_compare_exchange_weak_explicit(&s->w, &v,
                                                  steal ? SEG_PACK(f, b - 1) : SEG_PACK(f + 1, b),
                                                  memory_order_acquire, memory_order_relaxed))
            return (int)(steal ? b - 1 : f);
    }
}

/* Run units of the current for-run, own segment first, until none is left; then publish
 * the count.  A run cannot end (nor fn/arg/n change) while a thread holds claimed units it
 * has not published, so they are read after the claims. */
static void pool_for_work(struct cpu_pool *pool, int ith)
{
    uint32_t cnt = 0, n_total = 0;

    for (;;) {
        int u = seg_claim(&pool->seg[ith], false);

        for (int k = 1; u < 0 && k < pool->n; k++)
            u = seg_claim(&pool->seg[(ith + k) % pool->n], true);
        if (u < 0)
            break;
        n_total = (uint32_t)atomic_load_explicit(&pool->for_n, memory_order_relaxed);
        pool->for_fn(pool->for_arg, u, (int)n_total, ith);
        cnt++;
    }
    if (!cnt)
        return;
    if (atomic_fetch_add_explicit(&pool->done, cnt, memory_order_seq_cst) + cnt == n_total &&
        atomic_load_explicit(&pool->caller_sleeping, memory_order_seq_cst))
        futex_wake(&pool->done);
}

static void *worker_main(void *p)
{
    struct pool_worker *wk = p;
    struct cpu_pool *pool = wk->pool;
    uint32_t seen = 0;

    for (;;) {
        int active;

        seen = worker_wait(pool, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            break;
        /* the thread count travels in the run word itself, so a worker that wakes late
         * never mixes one run's count with another run's function; count 0 is a nudge
         * (busy mode began: start spinning) */
        active = (int)(seen & GEN_COUNT_MASK);
        if (seen & GEN_FOR_BIT) {
            if (wk->ith < active)
                pool_for_work(pool, wk->ith);
            continue;
        }
        if (wk->ith >= active)
            continue;           /* not part of this run: the caller does not wait for us */
        pool->fn(pool->arg, wk->ith, active);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            atomic_store_explicit(&pool->run_done, 1, memory_order_release);
            futex_wake(&pool->run_done);
        }
    }
    return NULL;
}

int cpu_pool_new(int n_threads, struct cpu_pool **ret)
{
    struct cpu_pool *pool;
    int r;

    ASSERT(ret);
    *ret = NULL;
    if (n_threads < 1 || n_threads > 127)
        return -EINVAL;
    if (posix_memalign((void **)&pool, 64, sizeof(*pool)) != 0)
        return -ENOMEM;
    memset(pool, 0, sizeof(*pool));
    if (posix_memalign((void **)&pool->seg, 64, sizeof(*pool->seg) * (size_t)n_threads) != 0) {
        free(pool);
        return -ENOMEM;
    }
    memset(pool->seg, 0, sizeof(*pool->seg) * (size_t)n_threads);
    pool->n = 1;
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof(*pool->workers));
        if (!pool->workers) {
            free(pool->seg);
            free(pool);
            return -ENOMEM;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        struct pool_worker *wk = &pool->workers[i - 1];

        wk->pool = pool;
        wk->ith = i;
        r = pthread_create(&wk->th, NULL, worker_main, wk);
        if (r != 0) {
            cpu_pool_free(pool);
            return -r;
        }
        pool->n++;
    }
    *ret = pool;
    return 0;
}

void cpu_pool_free(struct cpu_pool *pool)
{
    if (!pool)
        return;
    atomic_store_explicit(&pool->busy, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->stop, true, memory_order_release);
    atomic_fetch_add_explicit(&pool->gen, 256, memory_order_seq_cst);
    futex_wake(&pool->gen);
    for (int i = 1; i < pool->n; i++)
        pthread_join(pool->workers[i - 1].th, NULL);
    free(pool->workers);
    free(pool->seg);
    free(pool);
}

int cpu_pool_size(const struct cpu_pool *pool)
{
    return pool ? pool->n : 1;
}

void cpu_pool_busy_begin(struct cpu_pool *pool)
{
    if (!pool || pool->n == 1)
        return;
    if (pool->busy_depth++ > 0)
        return;
    atomic_store_explicit(&pool->busy, 1, memory_order_relaxed);
    /* a nudge (a run word for no thread): spinning workers restart their idle clock,
     * sleeping ones wake now rather than on the first parallel op */
    pool_publish(pool, 0);
}

void cpu_pool_busy_end(struct cpu_pool *pool)
{
    if (!pool || pool->n == 1 || pool->busy_depth == 0)
        return;
    if (--pool->busy_depth == 0)
        atomic_store_explicit(&pool->busy, 0, memory_order_relaxed);
}

bool cpu_pool_busy(const struct cpu_pool *pool)
{
    return pool && pool->busy_depth > 0;
}

bool cpu_pool_asleep(struct cpu_pool *pool)
{
    return pool && atomic_load_explicit(&pool->sleepers, memory_order_relaxed) > 0;
}

void cpu_pool_run(struct cpu_pool *pool, cpu_task_fn fn, void *arg)
{
    cpu_pool_run_n(pool, fn, arg, pool ? pool->n : 1);
}

void cpu_pool_run_n(struct cpu_pool *pool, cpu_task_fn fn, void *arg, int n)
{
    ASSERT(fn);
    if (!pool || pool->n == 1 || n <= 1) {
        if (pool)
            pool->active = 1;
        fn(arg, 0, 1);
        return;
    }
    pool->active = n < pool->n ? n : pool->n;
    pool->fn = fn;
    pool->arg = arg;
    atomic_store_explicit(&pool->pending, pool->active - 1, memory_order_relaxed);
    atomic_store_explicit(&pool->run_done, 0, memory_order_relaxed);
    pool_publish(pool, (uint32_t)pool->active & GEN_COUNT_MASK);
    fn(arg, 0, pool->active);
    wait_change(&pool->run_done, 0);
}

void cpu_pool_barrier(struct cpu_pool *pool)
{
    uint32_t g;

    if (!pool || pool->active <= 1)
        return;
    g = atomic_load_explicit(&pool->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) == pool->active - 1) {
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool->bar_gen, 1, memory_order_acq_rel);
        futex_wake(&pool->bar_gen);
        return;
    }
    wait_change(&pool->bar_gen, g);
}

void cpu_pool_for(struct cpu_pool *pool, cpu_unit_fn fn, void *arg, int n_units, int max_threads)
{
    uint32_t v, n = (uint32_t)n_units;
    uint64_t t0 = 0;
    int nth;

    ASSERT(fn && n_units >= 0);
    nth = pool ? pool->n : 1;
    nth = max_threads < nth ? max_threads : nth;
    if (nth <= 1 || n_units <= 1) {
        for (int u = 0; u < n_units; u++)
            fn(arg, u, n_units, 0);
        return;
    }
    nth = nth < n_units ? nth : n_units;
    pool->for_fn = fn;
    pool->for_arg = arg;
    atomic_store_explicit(&pool->for_n, n_units, memory_order_relaxed);
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    /* every segment is empty here (the previous run claimed all its units); deal this
     * run's units out (release: a claim sees fn, arg, n and done above) */
    for (int t = 0; t < nth; t++)
        atomic_store_explicit(&pool->seg[t].w,
                              SEG_PACK((uint64_t)n * t / nth, (uint64_t)n * (t + 1) / nth),
                              memory_order_release);
    pool_publish(pool, GEN_FOR_BIT | ((uint32_t)nth & GEN_COUNT_MASK));
    pool_for_work(pool, 0);
    /* wait for units other threads still hold: spin, then sleep */
    for (int i = 0;; i++) {
        if (atomic_load_explicit(&pool->done, memory_order_acquire) == n)
            return;
        cpu_relax();
        if ((i & 63) == 63) {
            uint64_t t = now_ns();

            if (!t0)
                t0 = t;
            else if (t - t0 > DONE_SPIN_NS)
                break;
        }
    }
    atomic_store_explicit(&pool->caller_sleeping, 1, memory_order_seq_cst);
    while ((v = atomic_load_explicit(&pool->done, memory_order_seq_cst)) != n)
        futex_wait(&pool->done, v);
    atomic_store_explicit(&pool->caller_sleeping, 0, memory_order_relaxed);
}
