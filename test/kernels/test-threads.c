/* test-threads.c - the CPU backend's worker pool: every run executes each ith exactly
 * once and returns only after all finished; barriers separate phases; cpu_pool_for runs
 * every unit exactly once and returns only when all are done, also when one thread is
 * slow (stops inside its first unit until another has taken one of its units over: an
 * event, so it holds on any load) - the others take over the remaining units; more threads
 * than cores (oversubscription, as with a busy neighbour) still completes.  Busy mode
 * (cpu_pool_busy_begin/end, nesting) keeps all of that, also across idle gaps long enough
 * for the workers to fall asleep, and a pool is freed cleanly in the middle of it.
 * Thread t of nth first runs its own segment [n*t/nth, n*(t+1)/nth) in order.  The ops
 * split by size give the same bits on 1, 2 and 3 threads; cpu_threads_for() does not
 * wake a sleeping worker for small ops until enough work ran on the caller alone. */
#include <pthread.h>
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
    _Atomic int last_own[8];        /* last unit thread t ran from its own segment, + 1 */
    int slow_ith;
    int nth;                        /* threads of the run (segment bounds) */
    _Atomic int slow_held;          /* the slow thread stopped in its first own unit */
    _Atomic int stolen;             /* units of its segment that other threads ran */
    _Atomic int slow_timed_out;     /* nobody took one over within 10 s */
};

/* The slow thread (a descheduled core) stops in its first unit until another thread has
 * taken a unit of its segment over: an event, not a sleep, so on any load the others must
 * steal for the run to go on (10 s: a pool that never steals). */
static void slow_hold(struct for_job *j)
{
    for (int i = 0; i < 100000 && !atomic_load(&j->stolen); i++) {
        struct timespec ts = { 0, 100000 };
        nanosleep(&ts, NULL);
    }
    if (!atomic_load(&j->stolen))
        atomic_store(&j->slow_timed_out, 1);
}

static void unit_fn(void *arg, int unit, int n_units, int ith)
{
    struct for_job *j = arg;

    ASSERT_TRUE(unit >= 0 && unit < n_units && ith >= 0 && ith < 8);
    if (j->slow_ith >= 0 && j->slow_ith < j->nth) {
        int lo = n_units * j->slow_ith / j->nth, hi = n_units * (j->slow_ith + 1) / j->nth;
        bool own = unit >= lo && unit < hi;
        if (own && ith == j->slow_ith && hi - lo >= 2 && !atomic_exchange(&j->slow_held, 1))
            slow_hold(j);
        else if (own && ith != j->slow_ith)
            atomic_fetch_add(&j->stolen, 1);
    }
    if (ith < j->nth && unit >= n_units * ith / j->nth && unit < n_units * (ith + 1) / j->nth) {
        /* own segment: front to back, in order */
        ASSERT_LT(atomic_load(&j->last_own[ith]), unit + 1);
        atomic_store(&j->last_own[ith], unit + 1);
    }
    atomic_fetch_add(&j->count[unit], 1);
    atomic_fetch_add(&j->by_thread[ith], 1);
}

static void test_for(bool busy)
{
    for (int n = 1; n <= 4; n++) {
        struct cpu_pool *pool;

        ASSERT_OK(cpu_pool_new(n, &pool));
        if (busy) {
            cpu_pool_busy_begin(pool);
            cpu_pool_busy_begin(pool);      /* nests */
            cpu_pool_busy_end(pool);
            ASSERT_TRUE(cpu_pool_busy(pool) == (n > 1));
        }
        for (int rep = 0; rep < 400; rep++) {
            static struct for_job j;
            int units = 1 + rep % 37, maxt = 1 + rep % 5;

            memset(&j, 0, sizeof(j));
            j.slow_ith = rep % 50 == 7 ? 1 : -1;
            j.nth = maxt < n ? maxt : n;
            j.nth = j.nth < units ? j.nth : units;
            if (busy && rep % 100 == 99) {
                /* an idle gap past the workers' spin: they sleep and must be woken */
                struct timespec ts = { 0, 3000000 };
                nanosleep(&ts, NULL);
            }
            cpu_pool_for(pool, unit_fn, &j, units, maxt);
            for (int u = 0; u < units; u++)
                ASSERT_EQ(atomic_load(&j.count[u]), 1);     /* all done, once, on return */
            for (int u = units; u < 256; u++)
                ASSERT_EQ(atomic_load(&j.count[u]), 0);
            if (j.slow_ith == 1 && n > 1 && units > 8)
                ASSERT_LT(atomic_load(&j.by_thread[1]), units);  /* others took over */
            if (atomic_load(&j.slow_held))
                ASSERT_TRUE(!atomic_load(&j.slow_timed_out) && atomic_load(&j.stolen) > 0);
        }
        if (busy)
            cpu_pool_busy_end(pool);
        ASSERT_TRUE(!cpu_pool_busy(pool));
        cpu_pool_busy_end(pool);            /* unbalanced end: ignored */
        ASSERT_TRUE(!cpu_pool_busy(pool));
        cpu_pool_free(pool);
    }
}

/* Oversubscribed busy mode: three pools of 3 threads on this (2-core) machine, driven by
 * three callers at once, all spinning between runs: every run completes with every unit
 * once (the spin yields; a worker that never gets the core is simply not waited for). */
struct over_arg {
    struct cpu_pool *pool;
    int runs;
};

static void *over_main(void *p)
{
    struct over_arg *o = p;
    static _Thread_local struct for_job j;

    cpu_pool_busy_begin(o->pool);
    for (int rep = 0; rep < o->runs; rep++) {
        int units = 1 + rep % 29;

        memset(&j, 0, sizeof(j));
        j.slow_ith = -1;
        j.nth = units < 3 ? units : 3;
        cpu_pool_for(o->pool, unit_fn, &j, units, 3);
        for (int u = 0; u < units; u++)
            ASSERT_EQ(atomic_load(&j.count[u]), 1);
    }
    cpu_pool_busy_end(o->pool);
    return NULL;
}

static void test_oversubscribed(void)
{
    pthread_t th[3];
    struct over_arg o[3];

    for (int i = 0; i < 3; i++) {
        o[i].runs = 2000;
        ASSERT_OK(cpu_pool_new(3, &o[i].pool));
        ASSERT_EQ(pthread_create(&th[i], NULL, over_main, &o[i]), 0);
    }
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(pthread_join(th[i], NULL), 0);
        cpu_pool_free(o[i].pool);
    }
}

/* Freeing a pool whose workers spin in busy mode (or sleep) ends them cleanly. */
static void test_free_busy(void)
{
    for (int rep = 0; rep < 50; rep++) {
        struct cpu_pool *pool;
        static struct for_job j;

        ASSERT_OK(cpu_pool_new(2 + rep % 3, &pool));
        cpu_pool_busy_begin(pool);
        memset(&j, 0, sizeof(j));
        j.slow_ith = -1;
        j.nth = 2 + rep % 3;
        if (rep % 2)
            cpu_pool_for(pool, unit_fn, &j, 16, 8);
        cpu_pool_free(pool);                /* still in busy mode */
    }
}

/* The ops this pool splits by size (rmsnorm, swiglu, embed, attention) give the same bits
 * on 1, 2 and 3 threads, split at every size (STEPD_CPU_MIN_WORK=0) and inside
 * graph_begin/graph_end; attention over a prefill run longer than one query block, a
 * decode and a verify run in one batch. */
/* big enough that every thread gets units even when it starts late */
enum { INV_RN = 2049, INV_DIM = 96, INV_SWN = 61, INV_SWD = 4099, INV_EMB = 1023, INV_ED = 64 };
enum { A_NH = 6, A_NKV = 2, A_HD = 32, A_BS = 16, A_NB = 32, A_NTOK = 200 + 1 + 4 };

struct inv_out {
    float rn[INV_RN * INV_DIM], sw[INV_SWN * INV_SWD], emb[INV_EMB * INV_ED];
    float att[A_NTOK * A_NH * A_HD];
};

static void inv_run(int th, bool bracket, struct inv_out *o)
{
    struct backend *be = kref_backend(th, false);
    static float x[INV_RN * INV_DIM], g[INV_SWN * INV_SWD], u[INV_SWN * INV_SWD];
    static float q[A_NTOK * A_NH * A_HD], k[A_NTOK * A_NKV * A_HD], v[A_NTOK * A_NKV * A_HD];
    static float kc[A_NB * A_BS * A_NKV * A_HD], vc[A_NB * A_BS * A_NKV * A_HD];
    struct bweight nw, tab;
    int32_t ids[INV_EMB], slots[A_NTOK], table[A_NB];
    /* seq 0: prefill of 200 at 0; seq 1: decode at 70; seq 2: verify of 4 at 30 */
    const int32_t start[4] = { 0, 200, 201, 205 }, pos0[3] = { 0, 70, 30 }, toff[3] = { 0, 13, 18 };
    struct kv_layer kv = { .k = kc, .v = vc, .dtype_f32 = 1, .n_blocks = A_NB,
                           .block_size = A_BS, .n_kv_heads = A_NKV, .head_dim = A_HD };
    struct attn_args a = {
        .q = q, .out = o->att, .n_tok = A_NTOK, .n_heads = A_NH, .n_kv_heads = A_NKV,
        .head_dim = A_HD, .scale = 0.2f, .window = 0, .kv = &kv, .n_seqs = 3,
        .seq_tok_start = start, .seq_pos0 = pos0, .block_tables = table, .block_table_off = toff,
    };

    krng_seed(99);
    nw = kref_f32_new(1, INV_DIM, 0.5f);
    tab = kref_bf16_new(50, INV_ED, 1.0f);
    krng_fill(x, INV_RN * INV_DIM, 2.0f);
    krng_fill(g, ARRAY_SIZE(g), 4.0f);
    krng_fill(u, ARRAY_SIZE(u), 4.0f);
    krng_fill(q, ARRAY_SIZE(q), 1.5f);
    krng_fill(k, ARRAY_SIZE(k), 1.5f);
    krng_fill(v, ARRAY_SIZE(v), 1.0f);
    krng_fill(kc, ARRAY_SIZE(kc), 1.5f);    /* keys before each run: arbitrary history */
    krng_fill(vc, ARRAY_SIZE(vc), 1.0f);
    for (int i = 0; i < INV_EMB; i++)
        ids[i] = (i * 7) % 50;
    for (int b = 0; b < A_NB; b++)
        table[b] = (b * 5 + 3) % A_NB;      /* a permutation: every block id once */
    for (int s = 0; s < 3; s++)
        for (int i = start[s]; i < start[s + 1]; i++) {
            int p = pos0[s] + i - start[s];
            slots[i] = table[toff[s] + p / A_BS] * A_BS + p % A_BS;
        }
    if (bracket)
        ASSERT_OK(backend_graph_begin(be));
    ASSERT_OK(backend_rmsnorm(be, x, &nw, INV_RN, INV_DIM, 1e-5f, o->rn));
    ASSERT_OK(backend_swiglu(be, g, u, INV_SWN, INV_SWD, 2.5f, o->sw));
    ASSERT_OK(backend_embed(be, &tab, ids, INV_EMB, o->emb));
    ASSERT_OK(backend_kv_store(be, &kv, k, v, A_NTOK, slots));
    ASSERT_OK(backend_attention(be, &a));
    if (bracket)
        ASSERT_OK(backend_graph_end(be));
    kref_weight_free(&nw);
    kref_weight_free(&tab);
    backend_free(be);
}

static void test_ops_invariant(void)
{
    static struct inv_out o[2];

    setenv("STEPD_CPU_MIN_WORK", "0", 1);   /* split every op over all threads */
    inv_run(1, false, &o[0]);
    for (int th = 2; th <= 3; th++) {
        for (int bracket = 0; bracket <= 1; bracket++) {
            memset(&o[1], 0xff, sizeof(o[1]));     /* NaN: a skipped element shows */
            inv_run(th, bracket, &o[1]);
            ASSERT_TRUE(memcmp(o[0].rn, o[1].rn, sizeof(o[0].rn)) == 0);
            ASSERT_TRUE(memcmp(o[0].sw, o[1].sw, sizeof(o[0].sw)) == 0);
            ASSERT_TRUE(memcmp(o[0].emb, o[1].emb, sizeof(o[0].emb)) == 0);
            ASSERT_TRUE(memcmp(o[0].att, o[1].att, sizeof(o[0].att)) == 0);
        }
    }
    unsetenv("STEPD_CPU_MIN_WORK");
}

static bool wait_asleep(struct cpu_pool *pool, bool want)
{
    for (int i = 0; i < 5000; i++) {
        struct timespec ts = { 0, 1000000 };

        if (cpu_pool_asleep(pool) == want)
            return true;
        nanosleep(&ts, NULL);
    }
    return false;
}

/* The split decision: no wake-up of a sleeping worker for a small op, until as much work
 * has run on the caller alone as a wake-up costs; a big op always splits; busy mode wakes
 * the workers and lowers the threshold. */
static void test_threads_for(void)
{
    struct backend *be = kref_backend(2, false);
    struct cpu_ctx *c = cpu_ctx(be);
    double small = CPU_WAKE_WORK * 0.4;

    c->min_work = 65536;
    c->min_work_busy = 32768;
    ASSERT_EQ(cpu_threads_for(c, 65536), 1);            /* one thread's worth */
    ASSERT_TRUE(wait_asleep(c->pool, true));            /* idle: the worker sleeps */
    ASSERT_EQ(cpu_threads_for(c, small), 1);
    ASSERT_EQ(cpu_threads_for(c, small), 1);
    ASSERT_EQ(cpu_threads_for(c, small), 2);            /* enough run alone: wake it */
    ASSERT_EQ(cpu_threads_for(c, small), 1);            /* (it was not woken here) */
    ASSERT_EQ(cpu_threads_for(c, CPU_WAKE_WORK), 2);    /* big enough on its own */
    ASSERT_OK(backend_graph_begin(be));
    ASSERT_TRUE(wait_asleep(c->pool, false));           /* begin woke it */
    /* (it may doze off again after 2 ms idle if this thread is descheduled: do not let
     * the wake rule decide below) */
    c->alone_work = CPU_WAKE_WORK;
    ASSERT_EQ(cpu_threads_for(c, 40000), 1);
    c->alone_work = CPU_WAKE_WORK;
    ASSERT_EQ(cpu_threads_for(c, 70000), 2);            /* the busy threshold */
    ASSERT_OK(backend_graph_end(be));
    c->alone_work = CPU_WAKE_WORK;
    ASSERT_EQ(cpu_threads_for(c, 70000), 1);
    backend_free(be);
}

int main(void)
{
    test_ops_invariant();
    test_threads_for();
    test_for(false);
    test_for(true);
    test_oversubscribed();
    test_free_busy();
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
