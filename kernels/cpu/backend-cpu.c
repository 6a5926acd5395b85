/* backend-cpu.c - the CPU backend: context, memory, capability, weights, ops table.
 * Every op lives in its own file beside this one (embed.c, rmsnorm.c, ...).
 *
 * Paths: MXFP4 runs the fast int8 kernel (VNNI where the CPU has AVX512-VNNI+VL, else
 * AVX2) unless backend_cfg.mxfp4_exact or the CPU lacks AVX2; BF16/F32 use the AVX-512F
 * tiles where the CPU has them, else AVX2; attention uses AVX2 where available.
 * The instruction set of every path comes from cpu-features.h (STEPD_CPU_ISA and the
 * STEPD_CPU_NO_* switches cap it).  Environment knobs: STEPD_CPU_MIN_WORK=<multiply-adds per
 * extra thread> (default 65536; 0 = split every op over all threads) and
 * STEPD_CPU_MIN_WORK_BUSY=<the same inside graph_begin/graph_end> (default MIN_WORK_BUSY
 * below, or STEPD_CPU_MIN_WORK when only that one is set).
 *
 * graph_begin/graph_end bracket one forward step (threads.c, busy mode): a sleeping worker
 * is woken at the start rather than by the first parallel op, the workers keep spinning
 * through the step however long its serial stretches are, and ops split at a lower work
 * threshold, since a split then costs a few cache-line transfers, never a wake-up.
 * Outside a bracket the workers also spin for a millisecond after their last unit.
 * n_threads 0 = the CPUs this process may run on (its affinity mask, e.g. under taskset
 * or a cgroup cpuset), else the online count.
 */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "err.h"
#include "log.h"
#include "cpu.h"

/* Multiply-adds per extra thread in busy mode.  On the tiny model (1- and 16-token
 * steps, 2 cores) 32K, 64K and 128K performed alike within noise; 32K lets 128-row
 * AVX-512 matmuls split, which gains 1.2x each. */
#define MIN_WORK_BUSY 32768.0

/* CPUs this process may use: its affinity mask, else the online count. */
static int cpu_count_usable(void)
{
    cpu_set_t set;
    long online;

    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

static int cpu_init(struct backend *be, const struct backend_cfg *cfg)
{
    struct cpu_ctx *c;
    const char *mw;
    int n, r;

    c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    n = cfg->n_threads;
    if (n == 0)
        n = cpu_count_usable();
    if (n > 127)
        n = 127;            /* the pool's limit; more cores than that are not used */
    r = cpu_pool_new(n, &c->pool);
    if (r < 0) {
        free(c);
        return r;
    }
    c->n_threads = n;
    c->mxfp4_exact = cfg->mxfp4_exact;
    c->have_avx2 = cpu_isa_has(CPU_ISA_AVX2);
    /* below ~64K multiply-adds a futex round trip costs more than the second core gives */
    mw = getenv("STEPD_CPU_MIN_WORK");
    c->min_work = mw ? atof(mw) : 65536.0;
    if (getenv("STEPD_CPU_MIN_WORK_BUSY"))
        mw = getenv("STEPD_CPU_MIN_WORK_BUSY");
    c->min_work_busy = mw ? atof(mw) : MIN_WORK_BUSY;
    be->ctx = c;
    log_debug("cpu backend: %d threads, isa %s (host %s), mxfp4 %s", n, cpu_isa_name(cpu_isa()),
              cpu_isa_name(cpu_isa_host()),
              c->mxfp4_exact ? "exact" : (c->have_avx2 ? "int8 fast" : "exact (no avx2)"));
    return 0;
}

static void cpu_free(struct backend *be)
{
    struct cpu_ctx *c = cpu_ctx(be);

    if (!c)
        return;
    for (int i = 0; c->sub && i < c->n_threads; i++) {
        if (c->sub[i])
            cpu_free(c->sub[i]);
        free(c->sub[i]);
    }
    free(c->sub);
    cpu_pool_free(c->pool);
    free(c->scratch);
    free(c);
    be->ctx = NULL;
}

void *cpu_scratch(struct cpu_ctx *c, size_t n)
{
    void *p;

    if (n <= c->scratch_size)
        return c->scratch;
    n = (n + 4095) & ~(size_t)4095;
    if (posix_memalign(&p, 64, n) != 0)
        return NULL;
    free(c->scratch);
    c->scratch = p;
    c->scratch_size = n;
    return p;
}

/* Buffers of this size or more (a layer's KV cache above all) are aligned to it and advised
 * for transparent huge pages, as the weights are (wmem.c): attention reads a KV head's rows
 * a 2 KiB slot apart, and on 4 KiB pages its passes missed the TLB (docs/PERFORMANCE.md
 * §8.2: +13 % from DRAM). */
#define BUF_HUGE ((size_t)2 << 20)

static int cpu_buf_alloc(struct backend *be, size_t bytes, size_t align, void **ret)
{
    void *p;

    if (align < 64)
        align = 64;
    if (bytes >= BUF_HUGE && align < BUF_HUGE)
        align = BUF_HUGE;
    if (posix_memalign(&p, align, bytes ? bytes : 1) != 0)
        return -ENOMEM;
#ifdef MADV_HUGEPAGE
    if (bytes >= BUF_HUGE && madvise(p, bytes, MADV_HUGEPAGE) != 0)
        log_debug("cpu buf: madvise(MADV_HUGEPAGE) failed (errno %d): normal pages", errno);
#endif
    *ret = p;
    return 0;
}

static void cpu_buf_free(struct backend *be, void *p)
{
    free(p);
}

static int cpu_copy(struct backend *be, void *dst, const void *src, size_t n)
{
    if (n)
        memmove(dst, src, n);
    return 0;
}

static int cpu_sync(struct backend *be)
{
    return 0;
}

static int cpu_graph_begin(struct backend *be)
{
    cpu_pool_busy_begin(cpu_ctx(be)->pool);
    return 0;
}

static int cpu_graph_end(struct backend *be)
{
    cpu_pool_busy_end(cpu_ctx(be)->pool);
    return 0;
}

/* ---- split_run: whole parts of a step, one per core ----
 * On this kind of machine a cache line written by one core costs the other ~1-4 us per
 * few KB to read (measured in a 2-vCPU VM: 24 KB written by one core, read by the other
 * at 6 GB/s, vs 26 GB/s from L3), and the ops of a step hand their activations to each
 * other: an op split by rows pays that twice (inputs in, outputs back).  A part runs all
 * of a sequence group's ops on one core, so only the weights (read-only) are shared. */
/* Two parts on a 2-thread backend.  Wider pools keep splitting ops by rows: a part per
 * thread would leave a step's runs too short to cut that finely, and a part with several
 * threads would need pools inside the pool (measured only on 2 cores so far). */
static int cpu_split_width(struct backend *be)
{
    return cpu_ctx(be)->n_threads == 2 ? 2 : 1;
}

struct split_job {
    struct cpu_ctx *c;
    backend_part_fn fn;
    void *arg;
};

static void split_unit(void *arg, int unit, int n_units, int ith)
{
    struct split_job *j = arg;

    (void)n_units;
    j->fn(j->arg, unit, j->c->sub[ith]);
}

static void split_task(void *arg, int ith, int nth)
{
    struct split_job *j = arg;

    (void)nth;
    j->fn(j->arg, ith, j->c->sub[ith]);
}

static int cpu_split_run(struct backend *be, int n_parts, bool together, backend_part_fn fn,
                         void *arg)
{
    struct cpu_ctx *c = cpu_ctx(be);
    struct split_job j = { .c = c, .fn = fn, .arg = arg };

    if (!c->sub) {
        c->sub = calloc((size_t)c->n_threads, sizeof(*c->sub));
        if (!c->sub)
            return -ENOMEM;
    }
    for (int i = 0; i < c->n_threads; i++) {
        if (c->sub[i])
            continue;
        struct backend *s = calloc(1, sizeof(*s));
        struct backend_cfg cfg = { .n_threads = 1, .mxfp4_exact = c->mxfp4_exact };
        int r;

        if (!s)
            return -ENOMEM;
        s->ops = be->ops;
        r = cpu_init(s, &cfg);
        if (r < 0) {
            free(s);
            return r;
        }
        cpu_ctx(s)->have_avx2 = c->have_avx2;
        c->sub[i] = s;
    }
    if (together)       /* every thread runs its part once, all at the same time */
        cpu_pool_run_n(c->pool, split_task, &j, n_parts);
    else                /* thread t owns unit t (threads.c deals one segment per thread) */
        cpu_pool_for(c->pool, split_unit, &j, n_parts, n_parts);
    return 0;
}

static bool cpu_supports(struct backend *be, const char *op, enum wfmt fmt)
{
    static const char *const ops[] = {
        "embed", "rmsnorm", "matmul", "rope", "kv_store", "attention", "head_gate",
        "swiglu", "router", "moe", "add",
    };

    for (size_t i = 0; i < ARRAY_SIZE(ops); i++) {
        if (strcmp(op, ops[i]) != 0)
            continue;
        if (strcmp(op, "rmsnorm") == 0)
            return fmt == WFMT_F32 || fmt == WFMT_BF16;
        return true;
    }
    return false;
}

static int cpu_weight_prepare(struct backend *be, struct bweight *w)
{
    if (w->priv)
        return 0;               /* already prepared */
    if (w->fmt == WFMT_MXFP4)
        return cpu_mxfp4_prepare(w);
    if (w->fmt == WFMT_NVFP4)
        return cpu_nvfp4_prepare(w);
    if (w->fmt == WFMT_FP8)
        return cpu_lowp_check(w);   /* used in place */
    return 0;                   /* F32/BF16 are used in place */
}

static void cpu_weight_release(struct backend *be, struct bweight *w)
{
    if (w->fmt == WFMT_MXFP4)
        cpu_mxfp4_release(w);
    if (w->fmt == WFMT_NVFP4)
        cpu_nvfp4_release(w);
}

float cpu_weight_get(const struct bweight *w, int64_t row, int64_t col)
{
    const struct cpu_mxfp4 *m = w->priv;

    switch (w->fmt) {
    case WFMT_F32: {
        float f;
        memcpy(&f, (const char *)w->data + 4 * (row * w->cols + col), 4);
        return f;
    }
    case WFMT_BF16: {
        uint16_t h;
        memcpy(&h, (const char *)w->data + 2 * (row * w->cols + col), 2);
        return cpu_bf16_to_f32(h);
    }
    case WFMT_MXFP4:
        if (m) {
            int64_t t = row / MXFP4_TILE_ROWS, rr = row % MXFP4_TILE_ROWS;
            int64_t b = col / 32, p = b / 2, half = b % 2, j = col % 32;
            const uint8_t *qs = m->qs + ((t * m->npair + p) * MXFP4_TILE_ROWS + rr) * 32 + half * 16;
            uint8_t e = m->sc[(t * m->npair + p) * 2 * MXFP4_TILE_ROWS + half * MXFP4_TILE_ROWS + rr];
            return cpu_e2m1[(qs[j / 2] >> (4 * (j % 2))) & 15] * __builtin_ldexpf(1.0f, e - 127);
        } else {
            const uint8_t *qs = (const uint8_t *)w->data + row * (w->cols / 2);
            uint8_t e = w->scale[row * (w->cols / 32) + col / 32];
            return cpu_e2m1[(qs[col / 2] >> (4 * (col % 2))) & 15] * __builtin_ldexpf(1.0f, e - 127);
        }
    case WFMT_FP8:
        return cpu_fp8_get(w, row, col);
    case WFMT_NVFP4:
        return cpu_nvfp4_get(w, row, col);
    default:
        BUG_ON(1);
    }
    return 0.0f;
}

void cpu_weight_row(const struct bweight *w, int64_t row, float *out)
{
    for (int64_t j = 0; j < w->cols; j++)
        out[j] = cpu_weight_get(w, row, j);
}

const struct backend_ops backend_cpu_ops = {
    .name = "cpu",
    .init = cpu_init,
    .free = cpu_free,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
    .supports = cpu_supports,
    .weight_prepare = cpu_weight_prepare,
    .weight_release = cpu_weight_release,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .matmul_rows = cpu_matmul_rows,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .head_gate = cpu_head_gate,
    .swiglu = cpu_swiglu,
    .router = cpu_router,
    .moe = cpu_moe,
    .add = cpu_add,
    .argmax = cpu_argmax,
    .row_expsum = cpu_row_expsum,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .split_width = cpu_split_width,
    .split_run = cpu_split_run,
};
