/* test-threads.c - the CPU backend's worker pool: every run executes each ith exactly
 * once and returns only after all finished; barriers separate phases; cpu_pool_for runs
 * every unit exactly once and returns only when all are done, also when one thread is
 * slow (sleeps inside a unit) - the others take over the remaining units; more threads
 * than cores (oversubscription, as with a busy neighbour) still completes. */
#include <stdatomic.h>
#include <time.h>

#include "kref.h"
#include "cpu.h"

struct job {
    int nth_seen;
    _Atomic int hits[8];
    int phase_a[8], phase_b[8];
    struct cpu_pool *pool;
    int round;
};

static void task(void *arg, int ith, int nth)
{
    struct job *j = arg;

    if (ith == 0)
        j->nth_seen = nth;
    atomic_fetch_add(&j->hits[ith], 1);
    j->phase_a[ith] = j->round;
    cpu_pool_barrier(j->pool);
    /* after the barrier every thread's phase-a write is visible */
    for (int i = 0; i < nth; i++)
        ASSERT_EQ(j->phase_a[i], j->round);
    cpu_pool_barrier(j->pool);
    j->phase_b[ith] = j->round;
}

struct for_job {
    _Atomic int count[256];
    _Atomic int by_thread[8];
    int slow_ith;
};

static void unit_fn(void *arg, int unit, int n_units, int ith)
{
    struct for_job *j = arg;

    ASSERT_TRUE(unit >= 0 && unit < n_units && ith >= 0 && ith < 8);
    if (ith == j->slow_ith) {
        struct timespec ts = { 0, 2000000 };    /* a descheduled core, 2 ms */
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&j->count[unit], 1);
    atomic_fetch_add(&j->by_thread[ith], 1);
}

static void test_for(void)
{
    for (int n = 1; n <= 4; n++) {
        struct cpu_pool *pool;

        ASSERT_OK(cpu_pool_new(n, &pool));
        for (int rep = 0; rep < 400; rep++) {
            static struct for_job j;
            int units = 1 + rep % 37, maxt = 1 + rep % 5;

            memset(&j, 0, sizeof(j));
            j.slow_ith = rep % 50 == 7 ? 1 : -1;
            cpu_pool_for(pool, unit_fn, &j, units, maxt);
            for (int u = 0; u < units; u++)
                ASSERT_EQ(atomic_load(&j.count[u]), 1);     /* all done, once, on return */
            for (int u = units; u < 256; u++)
                ASSERT_EQ(atomic_load(&j.count[u]), 0);
            if (j.slow_ith == 1 && n > 1 && units > 8)
                ASSERT_LT(atomic_load(&j.by_thread[1]), units);  /* others took over */
        }
        cpu_pool_free(pool);
    }
}

int main(void)
{
    test_for();
    for (int n = 1; n <= 5; n++) {
        struct job j = { 0 };

        ASSERT_OK(cpu_pool_new(n, &j.pool));
        ASSERT_EQ(cpu_pool_size(j.pool), n);
        for (j.round = 1; j.round <= (n <= 2 ? 3000 : 300); j.round++) {
            cpu_pool_run(j.pool, task, &j);
            ASSERT_EQ(j.nth_seen, n);
            for (int i = 0; i < n; i++) {
                ASSERT_EQ(atomic_load(&j.hits[i]), j.round);
                ASSERT_EQ(j.phase_b[i], j.round);   /* run returned after all finished */
            }
        }
        /* runs with fewer threads than the pool: only ith < k take part, barriers count k */
        for (int k = 1; k <= n; k++) {
            int before[8];

            for (int i = 0; i < n; i++)
                before[i] = atomic_load(&j.hits[i]);
            for (int rep = 0; rep < 200; rep++, j.round++) {
                cpu_pool_run_n(j.pool, task, &j, k);
                ASSERT_EQ(j.nth_seen, k);
                for (int i = 0; i < k; i++)
                    ASSERT_EQ(j.phase_b[i], j.round);
            }
            for (int i = 0; i < n; i++)
                ASSERT_EQ(atomic_load(&j.hits[i]) - before[i], i < k ? 200 : 0);
        }
        cpu_pool_free(j.pool);
    }
    ASSERT_ERR(cpu_pool_new(0, &(struct cpu_pool *){ NULL }), -EINVAL);
    printf("threads: all checks passed\n");
    return 0;
}
