/* threads.c - the CPU backend's persistent worker pool.
 *
 * Two ways to use it:
 *  - cpu_pool_for(): the ops' way.  The caller cuts the op into a few coarse units per
 *    thread (contiguous row ranges, in order); every thread, the caller included, claims
 *    the next unit with one CAS on a word that carries the run's sequence number, and
 *    the caller returns as soon as every unit is DONE - not when every thread has
 *    checked in.  So a worker whose core is busy with someone else's job simply takes
 *    fewer units (or none: the caller does them all), and a worker that wakes late
 *    finds the word's sequence changed and touches nothing of the finished run.
 *  - cpu_pool_run() / cpu_pool_run_n() + cpu_pool_barrier(): fn runs once per thread
 *    and all of them must take part (used by the bandwidth probe and tests).
 * Waiters spin briefly (a few microseconds, enough to catch back-to-back ops without a
 * syscall) and then sleep on a futex: never a spin barrier that collapses when the
 * other core is busy.
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "err.h"
#include "cpu.h"

#define SPIN_ITERS 200      /* ~5-30 us depending on the cost of pause */

struct cpu_pool;

struct pool_worker {
    struct cpu_pool *pool;
    int ith;
    pthread_t th;
};

struct cpu_pool {
    int n;                              /* threads including the caller */
    int active;                         /* threads taking part (caller's copy, for barriers) */
    struct pool_worker *workers;        /* n - 1 */
    _Atomic uint32_t gen;               /* run word: seq << 8 | FOR_BIT? | threads taking part */
    _Atomic int pending;                /* workers still running this generation */
    _Atomic uint32_t done;              /* 1 when pending reached 0 */
    _Atomic bool stop;
    cpu_task_fn fn;
    void *arg;
    _Atomic int bar_count;
    _Atomic uint32_t bar_gen;
    /* cpu_pool_for */
    cpu_unit_fn for_fn;
    void *for_arg;
    _Atomic int for_n;                  /* units of the current for-run */
    _Atomic uint64_t claim;             /* for_seq << 32 | next unit */
    _Atomic int remaining;              /* units not finished */
    _Atomic uint32_t fin;               /* for_seq of the last finished run */
    uint32_t for_seq;
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

/* Wait until *addr != val: bounded spin, then futex sleep. */
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

/* Claim and run units of the current for-run until none is left. */
static void pool_for_work(struct cpu_pool *pool, int ith)
{
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool->claim, memory_order_acquire);
        uint32_t seq = (uint32_t)(v >> 32), u = (uint32_t)v;
        int n = atomic_load_explicit(&pool->for_n, memory_order_acquire);

        if ((int)u >= n)
            return;
        if (!atomic_compare_exchange_weak_explicit(&pool->claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        /* unit u of run seq is ours: the run cannot end (nor fn/arg/n change) before we
         * finish it, so they are read after the claim */
        n = atomic_load_explicit(&pool->for_n, memory_order_relaxed);
        pool->for_fn(pool->for_arg, (int)u, n, ith);
        if (atomic_fetch_sub_explicit(&pool->remaining, 1, memory_order_acq_rel) == 1) {
            atomic_store_explicit(&pool->fin, seq, memory_order_release);
            futex_wake(&pool->fin);
        }
    }
}

static void *worker_main(void *p)
{
    struct pool_worker *wk = p;
    struct cpu_pool *pool = wk->pool;
    uint32_t seen = 0;

    for (;;) {
        int active;

        wait_change(&pool->gen, seen);
        seen = atomic_load_explicit(&pool->gen, memory_order_acquire);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            break;
        /* the thread count travels in the run word itself, so a worker that wakes late
         * never mixes one run's count with another run's function */
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
            atomic_store_explicit(&pool->done, 1, memory_order_release);
            futex_wake(&pool->done);
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
    pool = calloc(1, sizeof(*pool));
    if (!pool)
        return -ENOMEM;
    pool->n = 1;
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof(*pool->workers));
        if (!pool->workers) {
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
    atomic_store_explicit(&pool->stop, true, memory_order_release);
    atomic_fetch_add_explicit(&pool->gen, 256, memory_order_acq_rel);
    futex_wake(&pool->gen);
    for (int i = 1; i < pool->n; i++)
        pthread_join(pool->workers[i - 1].th, NULL);
    free(pool->workers);
    free(pool);
}

int cpu_pool_size(const struct cpu_pool *pool)
{
    return pool ? pool->n : 1;
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
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->gen,
                          ((atomic_load_explicit(&pool->gen, memory_order_relaxed) >> 8) + 1) << 8 |
                          ((uint32_t)pool->active & GEN_COUNT_MASK), memory_order_release);
    futex_wake(&pool->gen);
    fn(arg, 0, pool->active);
    wait_change(&pool->done, 0);
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
    uint32_t seq, cur;
    int nth;

    ASSERT(fn && n_units >= 0);
    nth = pool ? pool->n : 1;
    nth = max_threads < nth ? max_threads : nth;
    if (nth <= 1 || n_units <= 1) {
        for (int u = 0; u < n_units; u++)
            fn(arg, u, n_units, 0);
        return;
    }
    seq = ++pool->for_seq;
    pool->for_fn = fn;
    pool->for_arg = arg;
    atomic_store_explicit(&pool->remaining, n_units, memory_order_relaxed);
    atomic_store_explicit(&pool->for_n, n_units, memory_order_relaxed);
    atomic_store_explicit(&pool->claim, (uint64_t)seq << 32, memory_order_release);
    atomic_store_explicit(&pool->gen,
                          ((atomic_load_explicit(&pool->gen, memory_order_relaxed) >> 8) + 1) << 8 |
                          GEN_FOR_BIT | ((uint32_t)nth & GEN_COUNT_MASK), memory_order_release);
    futex_wake(&pool->gen);
    pool_for_work(pool, 0);
    /* wait for units other threads still hold */
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&pool->fin, memory_order_acquire) == seq)
            return;
        cpu_relax();
    }
    while ((cur = atomic_load_explicit(&pool->fin, memory_order_acquire)) != seq)
        futex_wait(&pool->fin, cur);
}
