/* bench-kernels.c - CPU kernel benchmarks from DRAM, in one run (not in the default suite).
 *
 *   meson test -C build --suite bench --verbose      or      build/test/bench/bench-kernels
 *   STEPD_BENCH_MB=1536 (arena size, >> L3), STEPD_BENCH_REPS=7
 *
 * Prints, for 1 and 2 threads: a read-bandwidth probe (AVX2 loads over the arena), MXFP4
 * GEMV (fast int8 path; exact path for reference) on expert- and projection-shaped
 * matrices, BF16 GEMV (4096x4096, 4096x11264), a 4-token GEMM, and the MoE layer time
 * for 8 active Step-size experts (1280x4096 gate/up, 4096x1280 down) drawn at random
 * from a pool of >= 64 in memory.  Every figure is the median of REPS sweeps; each sweep
 * cycles through every matrix that fits in the arena, so weights come from DRAM.
 * "% of bw" is the median over reps of (kernel GB/s) / (probe GB/s), where every rep runs
 * the probe right before the kernel sweep with the same thread count, so load changes on
 * a shared machine hit both sides of each ratio.
 * With 1 thread it also prints the tiny model's BF16 shapes (4096x256 lm_head, 768x256,
 * 256x768) at 1, 4 and 16 tokens on the AVX-512 kernel ("old") and on AMX-BF16 (both the
 * exact path's kernels: cpu_bf16_fast_off; bench-bf16 times the BF16 fast path), side by
 * side in one sweep, over enough copies to fill ~24 MiB (the tiny checkpoint's size, so
 * the weights come from L3/DRAM as in a forward step), and the tiny model's MXFP4 expert
 * shapes (128x256 gate/up, 256x128 down) at 1, 4 and 16 tokens on the 4-row ("old") and
 * 16-row ("new") int8 kernels the same way, and the tiny model's MoE layer at 1, 4 and 16
 * tokens on each.  "cpu" is process CPU time / (wall x
 * threads): how much of the cores the run actually got.
 * First, with 1 thread, FP8 and NVFP4 beside MXFP4 on a [1280, 4096] expert at decode batch
 * 1, 4, 16 and 64 with realistic routing and at 4 and 16 tokens on one expert (the
 * fp32-activation kernels, the dispatch in use (FP8: with the FP16 form off, and on it where
 * the host has AVX512-FP16) and, at level amx, FP8 on the AMX tiles;
 * 256 MiB of copies each, 3 interleaved rounds; beside each "% of bw" the same share with
 * process CPU time on both sides, which the time slices a loaded host takes away do not
 * move); STEPD_BENCH_FORMATS_ONLY=1 stops after that table, STEPD_BENCH_NO_F32=1 leaves out
 * the fp32-activation sides.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "benchlib.h"
#include "bw-probe.h"
#include "cpu.h"

static uint8_t *arena;
static size_t arena_bytes;
static int reps = 7;

/* process CPU seconds (all threads): cpu / (wall * threads) = the share of the cores we
 * actually got, to judge how loaded the shared machine was during a figure */
static double cpu_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double last_share;
static double last_ratio;           /* median over reps of (kernel GB/s / probe GB/s), each
                                     * rep running the probe right before the kernel sweep */
static double last_ratio_cpu;       /* the same with process CPU time for both (bench_routed):
                                     * time slices lost to other processes count on neither side */
static struct cpu_pool *bw_pool;

/* ---- bandwidth probe (bw-probe.h) ---- */
static double bench_bw(struct cpu_pool *pool)
{
    double gbs[32], sh[32];

    for (int r = 0; r < reps; r++) {
        double t = bench_now(), c = cpu_now();
        gbs[r] = bw_probe_once(pool, arena, arena_bytes);
        t = bench_now() - t;
        sh[r] = (cpu_now() - c) / t;
    }
    last_share = bench_median(sh, reps);
    return bench_median(gbs, reps);
}

static double bw_once(void)
{
    return bw_probe_once(bw_pool, arena, arena_bytes);
}

/* ---- GEMV over matrices carved from the arena ---- */
struct mats {
    int count;
    struct bweight *w;
    struct cpu_mxfp4 *m;
    size_t bytes_each;
};

static size_t mxfp4_bytes(int64_t rows, int64_t cols)
{
    int64_t ntile = (rows + 3) / 4, npair = (cols / 32 + 1) / 2;

    return (size_t)(ntile * npair * (128 + 8) + 64 + 63) & ~(size_t)63;
}

/* Realistic contents matter: denormal scale products cost microcode assists on some
 * CPUs.  BF16 view: values +-[0.125, 0.25).  MXFP4 view: any nibbles, E8M0 bytes in
 * [118, 129] (weights ~ 2^-9 .. 6*2^2), as a real checkpoint has. */
static bool arena_is_bf16;

static void arena_fill_bf16(void)
{
    for (size_t i = 0; i < arena_bytes; i += 2) {
        uint16_t v = (uint16_t)(((i * 2654435761u) >> 7) & 0x807f) | 0x3e00;
        memcpy(arena + i, &v, 2);
    }
    arena_is_bf16 = true;
}

static void mats_make(struct mats *ms, enum wfmt fmt, int64_t rows, int64_t cols, int max)
{
    if (fmt == WFMT_BF16 && !arena_is_bf16)
        arena_fill_bf16();
    size_t each = fmt == WFMT_MXFP4 ? mxfp4_bytes(rows, cols) : ((size_t)(rows * cols * 2 + 63) & ~(size_t)63);
    int n = (int)(arena_bytes / each);

    if (max && n > max)
        n = max;
    ms->count = n;
    ms->bytes_each = each;
    ms->w = calloc((size_t)n, sizeof(*ms->w));
    ms->m = calloc((size_t)n, sizeof(*ms->m));
    for (int i = 0; i < n; i++) {
        uint8_t *base = arena + (size_t)i * each;

        ms->w[i] = (struct bweight){ .fmt = fmt, .rows = rows, .cols = cols, .data = base };
        if (fmt == WFMT_MXFP4) {
            struct cpu_mxfp4 *m = &ms->m[i];

            m->rows = rows;
            m->cols = cols;
            m->nblk = cols / 32;
            m->npair = (m->nblk + 1) / 2;
            m->ntile = (rows + 3) / 4;
            m->qs = base;
            m->sc = base + m->ntile * m->npair * 128;
            ms->w[i].priv = m;
            ms->w[i].scale = m->sc;
            for (int64_t k = 0; k < m->ntile * m->npair * 8; k++)
                m->sc[k] = (uint8_t)(118 + (k * 7) % 12);
            arena_is_bf16 = false;
        }
    }
}

/* FP8 ([rows, cols] E4M3, F32 scales per 128x128) and NVFP4 (nibbles, E4M3 per 16, F32
 * global) copies of one shape, up to max_mb MiB of them (>> L3), carved from the arena: the
 * codes are the arena's bytes, the scales set to realistic values (no NaN, no denormal).
 * be: each copy prepared as the loader prepares it (NVFP4 at levels vnni, avx2: repacked by
 * cpu_nvfp4_prepare, and the repacked stream, the same bytes, moved back into the copy's
 * place in the arena, so that it is read from the same kind of pages as MXFP4's copies,
 * which the arena also holds: wmem's huge pages would flatter it); NULL: left as on disk. */
static void lowp_mats_make(struct mats *ms, enum wfmt fmt, int64_t rows, int64_t cols, size_t max_mb,
                           struct backend *be)
{
    size_t data = fmt == WFMT_FP8 ? (size_t)(rows * cols) : (size_t)(rows * cols / 2);
    size_t sc = fmt == WFMT_FP8 ? (size_t)(rows / 128 * (cols / 128) * 4) : (size_t)(rows * cols / 16);
    size_t each = (data + sc + 63) & ~(size_t)63, lim = (max_mb << 20) / each;
    int n = (int)(arena_bytes / each < lim ? arena_bytes / each : lim);

    ms->count = n;
    ms->bytes_each = data + sc;
    ms->w = calloc((size_t)n, sizeof(*ms->w));
    ms->m = NULL;
    for (int i = 0; i < n; i++) {
        uint8_t *base = arena + (size_t)i * each;

        ms->w[i] = (struct bweight){ .fmt = fmt, .rows = rows, .cols = cols, .data = base, .scale = base + data,
                                     .blk_rows = 128, .blk_cols = 128, .gscale = 1.0f / 448 };
        for (size_t k = 0; k < sc; k += fmt == WFMT_FP8 ? 4 : 1) {
            float f = 0x1p-8f * (float)(1 + k % 7);
            if (fmt == WFMT_FP8)
                memcpy(base + data + k, &f, 4);
            else
                base[data + k] = (uint8_t)(0x30 + (k * 5) % 16);    /* E4M3 0.5 .. 1.875 */
        }
        if (be && backend_weight_prepare(be, &ms->w[i]) < 0)
            abort();
        if (ms->w[i].priv && fmt == WFMT_NVFP4) {
            struct cpu_nvfp4 *m = ms->w[i].priv;
            size_t pk = (size_t)(((rows + NVFP4_GROUP_ROWS - 1) / NVFP4_GROUP_ROWS) * m->group_bytes);

            if (pk > each)
                abort();
            memcpy(base, m->pk, pk);
            cpu_wmem_free(m->mem);
            m->mem = NULL;
            m->pk = base;
        }
    }
    arena_is_bf16 = false;
}

static void mats_free(struct mats *ms)
{
    for (int i = 0; i < ms->count; i++)
        if (ms->w[i].fmt == WFMT_NVFP4)
            cpu_nvfp4_release(&ms->w[i]);
    free(ms->w);
    free(ms->m);
}

/* median seconds per matrix over sweeps in which matrix i multiplies cnt[i] tokens (each
 * reads its weights once); last_ratio as bench_gemv */
static double bench_routed(struct backend *be, const struct mats *ms, const int *cnt, int max_n)
{
    float *x = malloc(sizeof(float) * max_n * ms->w[0].cols), *y = malloc(sizeof(float) * max_n * ms->w[0].rows);
    double t[32], sh[32], ratio[32], ratio_cpu[32];

    for (int64_t i = 0; i < max_n * ms->w[0].cols; i++)
        x[i] = sinf((float)i);
    backend_matmul(be, &ms->w[0], x, cnt[0], y);
    for (int r = 0; r < reps; r++) {
        const double cb = cpu_now(), bw = bw_once(), t0 = bench_now(), c0 = cpu_now();

        for (int i = 0; i < ms->count; i++)
            if (backend_matmul(be, &ms->w[i], x, cnt[i], y) < 0)
                abort();
        t[r] = (bench_now() - t0) / ms->count;
        sh[r] = (cpu_now() - c0) / (t[r] * ms->count);
        ratio[r] = ms->bytes_each / t[r] / 1e9 / bw;
        ratio_cpu[r] = (double)ms->bytes_each * ms->count / (cpu_now() - c0) / ((double)arena_bytes / (c0 - cb));
    }
    free(x);
    free(y);
    last_share = bench_median(sh, reps);
    last_ratio = bench_median(ratio, reps);
    last_ratio_cpu = bench_median(ratio_cpu, reps);
    return bench_median(t, reps);
}

/* median seconds per matmul call with n tokens */
static double bench_gemv(struct backend *be, const struct mats *ms, int n)
{
    const int count = ms->count > 0 ? ms->count : 1;
    int *cnt = malloc(sizeof(int) * (size_t)count);
    double s;

    for (int i = 0; i < count; i++)
        cnt[i] = n;
    s = bench_routed(be, ms, cnt, n);
    free(cnt);
    return s;
}

static void report(const char *what, int nth, double sec, int64_t rows, int64_t cols, size_t bytes,
                   double bw, int n)
{
    double gbs = bytes / sec / 1e9;

    (void)bw;
    printf("  %-38s %dT %9.1f us %6.2f Gweight/s %6.2f GB/s %5.1f %% of bw  cpu %3.0f %%\n", what,
           nth, sec * 1e6, (double)rows * cols * n / sec / 1e9, gbs, 100.0 * last_ratio,
           100.0 * last_share / nth);
}

/* ---- MoE layer ---- */
static double bench_moe(struct backend *be, const struct mats *ms, int n_tok, int *ret_pool)
{
    enum { HID = 4096, INTER = 1280, TOPK = 8, MAXT = 16 };
    int pool = ms->count / 3;
    struct moe_expert *ex = calloc((size_t)pool, sizeof(*ex));
    static float x[MAXT * HID], out[MAXT * HID], w[MAXT * TOPK];
    static int32_t ids[MAXT * TOPK];
    double t[32], sh[32], ratio[32];
    uint64_t s = 12345;

    for (int e = 0; e < pool; e++) {
        ex[e].gate = ms->w[3 * e];
        ex[e].up = ms->w[3 * e + 1];
        ex[e].down = ms->w[3 * e + 2];
    }
    for (int i = 0; i < MAXT * HID; i++)
        x[i] = sinf((float)i);
    for (int r = 0; r < reps; r++) {
        double acc = 0, cacc = 0, bw = bw_once();
        int layers = 40;

        for (int l = 0; l < layers; l++) {
            struct moe_args a = { .x = x, .out = out, .n_tok = n_tok, .hidden = HID, .inter = INTER,
                                  .top_k = TOPK, .ids = ids, .weights = w, .experts = ex,
                                  .expert_first = 0, .n_local = pool, .limit = 7.0f };
            for (int k = 0; k < n_tok * TOPK; k++) {
                bool dup;
                int t0 = k / TOPK * TOPK;
                do {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    ids[k] = (int32_t)((s >> 33) % (uint64_t)pool);
                    dup = false;
                    for (int j = t0; j < k; j++)
                        dup |= ids[j] == ids[k];
                } while (dup);
                w[k] = 0.125f;
            }
            memset(out, 0, sizeof(out));
            double t0 = bench_now(), c0 = cpu_now();
            if (backend_moe(be, &a) < 0)
                abort();
            acc += bench_now() - t0;
            cacc += cpu_now() - c0;
        }
        t[r] = acc / layers;
        sh[r] = cacc / acc;
        ratio[r] = 8.0 * 3 * (1280.0 * 4096 * 17 / 32) / t[r] / 1e9 / bw;
    }
    last_share = bench_median(sh, reps);
    last_ratio = bench_median(ratio, reps);
    free(ex);
    *ret_pool = pool;
    return bench_median(t, reps);
}

/* ---- tiny-model BF16 shapes: AVX-512 vs AMX, side by side ---- */
static double sweep_once(struct backend *be, const struct mats *ms, const float *x, int n, float *y)
{
    double t0 = bench_now();

    for (int i = 0; i < ms->count; i++)
        if (backend_matmul(be, &ms->w[i], x, n, y) < 0)
            abort();
    return (bench_now() - t0) / ms->count;
}

struct tiny_shape {
    const char *name;
    int64_t rows, cols;
};

/* Old vs new kernel on tiny shapes at 1, 4 and 16 tokens, 1 thread, the weights of ~24 MiB of
 * copies cycled: *off = 1 (old) and 0 (new) interleaved per rep, a warm-up before each side.
 * line: the printf format of a result (shape name, n, copies, old us, new us, old/new,
 * per-token old and new us). */
static void tiny_ab(struct backend *be, enum wfmt fmt, const struct tiny_shape *sh, size_t n_sh,
                    int *off, const char *line)
{
    static const int ns[] = { 1, 4, 16 };

    for (size_t s = 0; s < n_sh; s++) {
        struct mats ms;
        size_t bytes = fmt == WFMT_MXFP4 ? mxfp4_bytes(sh[s].rows, sh[s].cols)
                                         : (size_t)(sh[s].rows * sh[s].cols * 2);
        int max = (int)((24u << 20) / bytes);

        mats_make(&ms, fmt, sh[s].rows, sh[s].cols, max);
        for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]); k++) {
            const int n = ns[k];
            float *x = malloc(sizeof(float) * n * sh[s].cols), *y = malloc(sizeof(float) * n * sh[s].rows);
            double t_old[32], t_new[32], ratio[32], m_old, m_new;

            for (int64_t i = 0; i < n * sh[s].cols; i++)
                x[i] = sinf((float)i);
            for (int r = 0; r < reps; r++) {
                *off = 1;
                sweep_once(be, &ms, x, n, y);       /* warm-up of this side's code path */
                t_old[r] = sweep_once(be, &ms, x, n, y);
                *off = 0;
                sweep_once(be, &ms, x, n, y);
                t_new[r] = sweep_once(be, &ms, x, n, y);
                ratio[r] = t_old[r] / t_new[r];
            }
            m_old = bench_median(t_old, reps);
            m_new = bench_median(t_new, reps);
            printf(line, sh[s].name, n, ms.count, m_old * 1e6, m_new * 1e6, bench_median(ratio, reps),
                   m_old * 1e6 / n, m_new * 1e6 / n);
            free(x);
            free(y);
        }
        mats_free(&ms);
    }
    *off = 0;
}

/* The old/new comparisons on the tiny model's shapes (tiny_ab), each where its new kernel runs:
 * BF16 with AMX vs AVX-512, the MXFP4 expert shapes with the 16-row vs the 4-row kernel. */
static void bench_tiny_kernels(struct backend *be)
{
    static const struct tiny_shape bf16_sh[] = {
        { "4096x256", 4096, 256 }, { "768x256", 768, 256 }, { "256x768", 256, 768 },
        { "128x256", 128, 256 },
    }, mxfp4_sh[] = {
        { "128x256", 128, 256 }, { "256x128", 256, 128 },
    };
    const struct {
        bool ok;
        const char *skipped, *head, *line;
        enum wfmt fmt;
        const struct tiny_shape *sh;
        size_t n_sh;
        int *off;
    } ab[] = {
        { cpu_amx_bf16_ok(), "tiny bf16 shapes: AMX-BF16",
          "  tiny bf16 shapes, 1 thread, ~24 MiB of copies, median of %d (old = AVX-512, amx = "
          "AMX-BF16; interleaved per rep):\n",
          "  bf16 %-9s n=%2d x%-3d old %8.1f us  amx %8.1f us  old/amx %5.2fx  "
          "(per token: old %6.1f, amx %6.1f us)\n",
          WFMT_BF16, bf16_sh, sizeof(bf16_sh) / sizeof(bf16_sh[0]), &cpu_amx_off },
        { cpu_mxfp4_row_align(NULL) == 16, "tiny mxfp4 shapes: 16-row kernel",
          "  tiny mxfp4 expert shapes, 1 thread, ~24 MiB of copies, median of %d (old = 4-row "
          "kernel, new = 16-row; interleaved per rep):\n",
          "  mxfp4 tiny expert %-8s n=%2d x%-4d old %7.2f us  new %7.2f us  old/new %5.2fx  "
          "(per token: old %6.2f, new %6.2f us)\n",
          WFMT_MXFP4, mxfp4_sh, sizeof(mxfp4_sh) / sizeof(mxfp4_sh[0]), &cpu_mxfp4_t16_off },
    };

    for (size_t i = 0; i < sizeof(ab) / sizeof(ab[0]); i++) {
        if (!ab[i].ok) {
            printf("  %s not available here (or switched off), skipped\n", ab[i].skipped);
            continue;
        }
        printf(ab[i].head, reps);
        cpu_bf16_fast_off = ab[i].fmt == WFMT_BF16;     /* the exact kernels, AVX-512 vs AMX */
        tiny_ab(be, ab[i].fmt, ab[i].sh, ab[i].n_sh, ab[i].off, ab[i].line);
        cpu_bf16_fast_off = 0;
    }
}

/* The tiny model's MoE layer (16 experts, 128x256 gate/up, 256x128 down, top-4) at 1, 4
 * and 16 tokens, 1 thread, old vs new kernel interleaved per rep; the experts of as many
 * layers as fill ~24 MiB, cycled, random routing (distinct experts per token). */
static void bench_tiny_moe(struct backend *be)
{
    enum { HID = 256, INTER = 128, NEXP = 16, TOPK = 4, MAXT = 16 };
    static const int ns[] = { 1, 4, 16 };
    static float x[MAXT * HID], out[MAXT * HID], wt[MAXT * TOPK];
    static int32_t ids[MAXT * TOPK];
    struct mats ms;
    struct moe_expert *ex;
    int layers;
    const uint64_t s = 99;

    mats_make(&ms, WFMT_MXFP4, INTER, HID, (int)((24u << 20) / mxfp4_bytes(INTER, HID)));
    layers = ms.count / (3 * NEXP);
    if (layers < 1) {
        mats_free(&ms);
        return;
    }
    /* every third matrix becomes a 256x128 down projection (same repacked size) */
    for (int k = 2; k < ms.count; k += 3) {
        struct cpu_mxfp4 *m = &ms.m[k];

        m->rows = HID; m->cols = INTER; m->nblk = INTER / 32; m->npair = (m->nblk + 1) / 2;
        m->ntile = HID / 4;
        m->sc = m->qs + m->ntile * m->npair * 128;
        ms.w[k].rows = HID;
        ms.w[k].cols = INTER;
        ms.w[k].scale = m->sc;
    }
    ex = calloc((size_t)layers * NEXP, sizeof(*ex));
    for (int e = 0; e < layers * NEXP; e++) {
        ex[e].gate = ms.w[3 * e];
        ex[e].up = ms.w[3 * e + 1];
        ex[e].down = ms.w[3 * e + 2];
    }
    for (int i = 0; i < MAXT * HID; i++)
        x[i] = sinf((float)i);
    for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]); k++) {
        const int n = ns[k];
        double t_old[32], t_new[32], ratio[32], m_old, m_new;

        for (int r = 0; r < reps; r++) {
            double acc[2] = { 0, 0 };

            /* whole sweeps per side (each layer's experts cold for both), the side that
             * goes first alternating per rep; the same routing for both sides */
            for (int o = 0; o < 2; o++) {
                const int side = (o + r) % 2;
                uint64_t rs = s + (uint64_t)r;
                double t0;

                cpu_mxfp4_t16_off = side == 0;
                t0 = bench_now();
                for (int l = 0; l < layers; l++) {
                    struct moe_args a = { .x = x, .out = out, .n_tok = n, .hidden = HID,
                                          .inter = INTER, .top_k = TOPK, .ids = ids, .weights = wt,
                                          .experts = ex + l * NEXP, .expert_first = 0,
                                          .n_local = NEXP, .limit = 7.0f };
                    double tr = bench_now();

                    for (int q = 0; q < n * TOPK; q++) {
                        bool dup;

                        do {
                            rs = rs * 6364136223846793005ull + 1442695040888963407ull;
                            ids[q] = (int32_t)((rs >> 33) % NEXP);
                            dup = false;
                            for (int j = q / TOPK * TOPK; j < q; j++)
                                dup |= ids[j] == ids[q];
                        } while (dup);
                        wt[q] = 0.25f;
                    }
                    t0 += bench_now() - tr;   /* routing set-up not timed */
                    if (backend_moe(be, &a) < 0)
                        abort();
                }
                acc[side] = bench_now() - t0;
            }
            t_old[r] = acc[0] / layers;
            t_new[r] = acc[1] / layers;
            ratio[r] = t_old[r] / t_new[r];
        }
        m_old = bench_median(t_old, reps);
        m_new = bench_median(t_new, reps);
        printf("  moe tiny layer (16 x 128x256/256x128, top-4) n=%2d x%-3d old %7.2f us  new %7.2f us  "
               "old/new %5.2fx\n", n, layers, m_old * 1e6, m_new * 1e6, bench_median(ratio, reps));
    }
    cpu_mxfp4_t16_off = 0;
    free(ex);
    mats_free(&ms);
}

/* Tokens per routed expert at decode batch B: B tokens x top-8 distinct experts drawn
 * uniformly from 288 (Step-3.7-Flash's router; the tiny model's measured spread is not
 * used here), the counts of the experts reached, in expert order, one routing after
 * another until cnt[0..n) is filled.  Expected distinct experts per layer: 288 (1 -
 * (280/288)^B) = 8, 30.7, 104.5, 240.6 at B = 1, 4, 16, 64 (the rule of B x 8 independent
 * draws, 288 (1 - (287/288)^(8B)), gives 8, 30.4, 103.5, 239.3). */
static void routed_counts(int B, int *cnt, int n)
{
    enum { NEXP = 288, TOPK = 8 };
    uint64_t rs = 777 + (uint64_t)B;
    int k = 0;

    while (k < n) {
        int per[NEXP] = { 0 };

        for (int t = 0; t < B; t++) {
            int ids[TOPK];
            for (int q = 0; q < TOPK; q++) {
                bool dup;
                do {
                    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
                    ids[q] = (int)((rs >> 33) % NEXP);
                    dup = false;
                    for (int j = 0; j < q; j++)
                        dup |= ids[j] == ids[q];
                } while (dup);
                per[ids[q]]++;
            }
        }
        for (int e = 0; e < NEXP && k < n; e++)
            if (per[e])
                cnt[k++] = per[e];
    }
}

/* The sides of the formats' comparison: MXFP4; FP8 on the fp32-activation kernels
 * (cpu_lowp_vnni_off: the AVX-512 tiles, or the AVX2 dispatch), as dispatched without the
 * FP16 form ("fp8 new": vdpbf16ps at level vnni with AVX512-BF16; cpu_fp8_fp16_off), on the
 * FP16 form where the host has AVX512-FP16 (the dispatch there) and, at level amx, on the
 * AMX tiles (cpu_fp8_amx_on); NVFP4 on the fp32-activation kernels and as dispatched (the
 * int8 path at level vnni).  STEPD_BENCH_NO_F32=1 skips the fp32-activation sides. */
enum { NSIDE = 7, SIDE_F8_F32 = 1, SIDE_F8_NEW, SIDE_F8_FP16, SIDE_F8_AMX, SIDE_NV_F32, SIDE_NV_NEW };
static const char *const side_names[NSIDE] = { "mxfp4",   "fp8 f32",   "fp8 new",  "fp8 fp16",
                                               "fp8 amx", "nvfp4 f32", "nvfp4 new" };
static int fp8_amx_was, fp8_fp16_was;

static bool side_skipped(int side)
{
    return ((side == SIDE_F8_F32 || side == SIDE_NV_F32) && getenv("STEPD_BENCH_NO_F32")) ||
           (side == SIDE_F8_AMX && !cpu_isa_has(CPU_ISA_AMX)) || (side == SIDE_F8_FP16 && !cpu_avx512fp16());
}

/* side's [rows, cols] copies, up to max_mb MiB of them, and its kernel switches set
 * (side_reset puts them back) */
static void side_make(struct backend *be, struct mats *ms, int side, int64_t rows, int64_t cols, size_t max_mb)
{
    if (side == 0)
        mats_make(ms, WFMT_MXFP4, rows, cols, (int)((max_mb << 20) / mxfp4_bytes(rows, cols)));
    else
        lowp_mats_make(ms, side <= SIDE_F8_AMX ? WFMT_FP8 : WFMT_NVFP4, rows, cols, max_mb,
                       side == SIDE_NV_NEW ? be : NULL);
    cpu_lowp_vnni_off = side == SIDE_F8_F32 || side == SIDE_NV_F32;
    cpu_fp8_amx_on = side == SIDE_F8_AMX ? 1 : side == SIDE_F8_NEW || side == SIDE_F8_FP16 ? 0 : fp8_amx_was;
    cpu_fp8_fp16_off = side == SIDE_F8_NEW ? 1 : side == SIDE_F8_FP16 ? 0 : fp8_fp16_was;
}

static void side_reset(void)
{
    cpu_lowp_vnni_off = 0;
    cpu_fp8_amx_on = fp8_amx_was;
    cpu_fp8_fp16_off = fp8_fp16_was;
}

/* The formats' compute cost where DRAM is not the limit: process CPU ns per weight and
 * token on one [128, 4096] matrix that stays in L2, the least of 5 x 50 calls, for the
 * sides of bench_lowp_formats.  CPU time, not wall time, so the time slices a loaded host
 * takes away do not count; a side whose cost exceeds its DRAM budget cannot reach MXFP4's
 * share of the bandwidth whatever the memory does. */
static void bench_lowp_incache(struct backend *be, const char *const *names)
{
    enum { ROWS = 128, COLS = 4096, CALLS = 50 };
    static const int ns[] = { 1, 2, 4, 16 };
    float *x = malloc(sizeof(float) * 16 * COLS), *y = malloc(sizeof(float) * 16 * ROWS);

    for (int i = 0; i < 16 * COLS; i++)
        x[i] = sinf((float)i);
    printf("  in cache [128,4096], CPU ns per weight and token (least of 5):\n");
    for (int side = 0; side < NSIDE; side++) {
        struct mats ms;

        if (side_skipped(side))
            continue;
        side_make(be, &ms, side, ROWS, COLS, 1);
        printf("  %-10s", names[side]);
        for (int k = 0; k < 4; k++) {
            double best = 1e9;

            for (int r = 0; r < 5; r++) {
                double c0 = cpu_now();
                for (int i = 0; i < CALLS; i++)
                    if (backend_matmul(be, &ms.w[0], x, ns[k], y) < 0)
                        abort();
                c0 = (cpu_now() - c0) / CALLS;
                best = c0 < best ? c0 : best;
            }
            printf("  n=%-2d %.4f", ns[k], best * 1e9 / ((double)ROWS * COLS * ns[k]));
        }
        printf("\n");
        mats_free(&ms);
    }
    side_reset();
    free(x);
    free(y);
}

/* FP8 and NVFP4 beside MXFP4 on a [1280, 4096] expert projection: GB/s of weight bytes, %
 * of the read bandwidth probed in each rep, and that share as a fraction of MXFP4's.
 * FP8/NVFP4 "f32" = the fp32-activation kernels (the AVX-512 tiles where the host has
 * them, else the AVX2 dispatch; cpu_lowp_vnni_off) and "new" = as dispatched (NVFP4 on the
 * int8 path at levels vnni and avx2).  Rows "B=": decode batch B with realistic routing (routed_counts: each copy
 * multiplies the tokens its expert got, 1-3 mostly); rows "n=": every token on one expert
 * (the dense worst case).  "cpu time": the share with process CPU time in place of wall
 * time for both the probe and the sweep (stalls on memory count, time slices lost to other
 * processes do not).  Rounds interleave every side; each figure is the median over the
 * rounds of the sweeps' medians. */
static void bench_lowp_formats(struct backend *be)
{
    enum { ROUNDS = 3, ROWS = 1280, COLS = 4096, NCASE = 6 };
    static const int cases[NCASE] = { 1, 4, 16, 64, -4, -16 };     /* B (routed), -n (dense) */
    double gbs[NCASE][NSIDE][ROUNDS], pct[NCASE][NSIDE][ROUNDS], pcpu[NCASE][NSIDE][ROUNDS];

    fp8_amx_was = cpu_fp8_amx_on;
    fp8_fp16_was = cpu_fp8_fp16_off;
    printf("  expert [1280,4096] per format, 1 thread, ISA %s, %d rounds interleaved (medians)\n",
           cpu_isa_name(cpu_isa()), ROUNDS);
    for (int r = 0; r < ROUNDS; r++)
        for (int side = 0; side < NSIDE; side++) {
            struct mats ms;

            if (side_skipped(side))
                continue;
            side_make(be, &ms, side, ROWS, COLS, 256);
            int *cnt = malloc(sizeof(int) * (size_t)ms.count);
            for (int k = 0; k < NCASE; k++) {
                double s;
                if (cases[k] > 0) {
                    int mx = 0;
                    routed_counts(cases[k], cnt, ms.count);
                    for (int i = 0; i < ms.count; i++)
                        mx = cnt[i] > mx ? cnt[i] : mx;
                    s = bench_routed(be, &ms, cnt, mx);
                } else {
                    s = bench_gemv(be, &ms, -cases[k]);
                }
                gbs[k][side][r] = ms.bytes_each / s / 1e9;
                pct[k][side][r] = 100.0 * last_ratio;
                pcpu[k][side][r] = 100.0 * last_ratio_cpu;
            }
            free(cnt);
            mats_free(&ms);
        }
    side_reset();
    for (int k = 0; k < NCASE; k++)
        for (int side = 0; side < NSIDE; side++) {
            if (side_skipped(side))
                continue;
            double g = bench_median(gbs[k][side], ROUNDS), p = bench_median(pct[k][side], ROUNDS);
            double p0 = bench_median(pct[k][0], ROUNDS);
            double c = bench_median(pcpu[k][side], ROUNDS), c0 = bench_median(pcpu[k][0], ROUNDS);

            printf("  %-10s %s=%2d %7.2f GB/s %5.1f %% of bw  x%.2f of mxfp4's share  cpu time %5.1f %% x%.2f\n",
                   side_names[side], cases[k] > 0 ? "B" : "n", abs(cases[k]), g, p, p / p0, c, c / c0);
        }
    bench_lowp_incache(be, side_names);
}

/* The batch-1 GEMV figure of one shape over as many copies as the arena holds (*ms, for the
 * caller to use further and free); false when not one fits (nothing to free). */
static bool gemv_shape(struct backend *be, struct mats *ms, enum wfmt fmt, const char *name,
                       int64_t rows, int64_t cols, int nth, double bw)
{
    mats_make(ms, fmt, rows, cols, 0);
    if (ms->count == 0) {
        mats_free(ms);
        return false;
    }
    report(name, nth, bench_gemv(be, ms, 1), rows, cols, ms->bytes_each, bw, 1);
    return true;
}

int main(void)
{
    const char *e = getenv("STEPD_BENCH_MB");
    size_t mb = e ? strtoul(e, NULL, 10) : 1536;
    struct { const char *name; int64_t rows, cols; } mx[] = {
        { "mxfp4 expert gate/up 1280x4096", 1280, 4096 },
        { "mxfp4 expert down 4096x1280", 4096, 1280 },
        { "mxfp4 proj 4096x4096", 4096, 4096 },
        { "mxfp4 proj 8192x4096", 8192, 4096 },
    }, bf[] = {
        { "bf16 4096x4096", 4096, 4096 },
        { "bf16 4096x11264", 4096, 11264 },
    };

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (getenv("STEPD_BENCH_REPS"))
        reps = atoi(getenv("STEPD_BENCH_REPS"));
    if (reps < 1 || reps > 31)
        reps = 7;
    arena_bytes = mb << 20;
    arena = aligned_alloc(4096, arena_bytes);
    if (!arena) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mb);
        return 1;
    }
    arena_fill_bf16();
    printf("bench-kernels: arena %zu MiB, %d reps (medians)\n", mb, reps);

    for (int nth = 1; nth <= 2; nth++) {
        struct backend_cfg cfg = { .n_threads = nth };
        struct backend *be, *bx;
        struct cpu_pool *pool;
        double bw;

        if (backend_new("cpu", &cfg, &be) < 0 || cpu_pool_new(nth, &pool) < 0)
            return 1;
        cfg.mxfp4_exact = true;
        if (backend_new("cpu", &cfg, &bx) < 0)
            return 1;
        bw_pool = pool;
        bw = bench_bw(pool);
        printf("threads %d: read bandwidth %.2f GB/s  cpu %3.0f %%\n", nth, bw, 100.0 * last_share / nth);
        if (nth == 1) {
            bench_lowp_formats(be);
            if (getenv("STEPD_BENCH_FORMATS_ONLY")) {
                cpu_pool_free(pool);
                backend_free(be);
                backend_free(bx);
                free(arena);
                return 0;
            }
            bench_tiny_kernels(be);
            bench_tiny_moe(be);
        }
        for (size_t i = 0; i < sizeof(mx) / sizeof(mx[0]); i++) {
            struct mats ms;
            double s;

            if (!gemv_shape(be, &ms, WFMT_MXFP4, mx[i].name, mx[i].rows, mx[i].cols, nth, bw))
                continue;
            if (i == 0) {
                char name[64];

                snprintf(name, sizeof(name), "%s x4 tok", mx[i].name);
                s = bench_gemv(be, &ms, 4);
                report(name, nth, s, mx[i].rows, mx[i].cols, ms.bytes_each, bw, 4);
                ms.count = ms.count > 24 ? 24 : ms.count;    /* exact path is slow: fewer */
                snprintf(name, sizeof(name), "%s EXACT", mx[i].name);
                s = bench_gemv(bx, &ms, 1);
                report(name, nth, s, mx[i].rows, mx[i].cols, ms.bytes_each, bw, 1);
            }
            mats_free(&ms);
        }
        for (size_t i = 0; i < sizeof(bf) / sizeof(bf[0]); i++) {
            struct mats ms;

            if (!gemv_shape(be, &ms, WFMT_BF16, bf[i].name, bf[i].rows, bf[i].cols, nth, bw))
                continue;
            if (i == 0) {
                double s = bench_gemv(be, &ms, 4);
                report("bf16 4096x4096 x4 tok", nth, s, bf[i].rows, bf[i].cols, ms.bytes_each, bw, 4);
            }
            mats_free(&ms);
        }
        {
            struct mats ms;
            int npool;
            double s, bytes;

            /* experts as consecutive (gate 1280x4096, up 1280x4096, down 4096x1280); both
             * shapes have the same repacked size, so one carving serves all three */
            mats_make(&ms, WFMT_MXFP4, 1280, 4096, 0);
            if (ms.count < 24) {
                mats_free(&ms);
                goto next;
            }
            for (int k = 2; k < ms.count; k += 3) {
                struct cpu_mxfp4 *m = &ms.m[k];

                m->rows = 4096; m->cols = 1280; m->nblk = 40; m->npair = 20; m->ntile = 1024;
                m->sc = m->qs + m->ntile * m->npair * 128;
                ms.w[k].rows = 4096;
                ms.w[k].cols = 1280;
                ms.w[k].scale = m->sc;
            }
            s = bench_moe(be, &ms, 1, &npool);
            bytes = 8.0 * 3 * (1280.0 * 4096 * 17 / 32);
            printf("  %-38s %dT %9.1f us %6.2f GB/s %5.1f %% of bw  cpu %3.0f %%  (8 of %d experts)\n",
                   "moe layer, 8 active, 1 token", nth, s * 1e6, bytes / s / 1e9,
                   100.0 * last_ratio, 100.0 * last_share / nth, npool);
            s = bench_moe(be, &ms, 4, &npool);
            printf("  %-38s %dT %9.1f us  (%.1f us/token; up to 32 experts touched)  cpu %3.0f %%\n",
                   "moe layer, 4 tokens x top-8", nth, s * 1e6, s * 1e6 / 4, 100.0 * last_share / nth);
            mats_free(&ms);
        }
next:
        cpu_pool_free(pool);
        backend_free(be);
        backend_free(bx);
    }
    free(arena);
    return 0;
}
