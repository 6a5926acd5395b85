/* test-threads.c - the CPU backend's worker pool: every run executes each ith exactly
 * once and returns only after all finished; barriers separate phases; more threads than
 * cores (oversubscription, as with a busy neighbour) still completes. */
#include <stdatomic.h>

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

int main(void)
{
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
