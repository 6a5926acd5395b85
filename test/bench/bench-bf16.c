/* bench-bf16.c - the BF16 GEMMs of a full-width step from DRAM: the exact kernels ("old":
 * AMX three-part tiles, or the AVX-512 FP32 tiles where the CPU has no AMX) against the BF16
 * fast path ("new": AMX one-part tiles, or vdpbf16ps), in one run, 1 thread (not in the
 * default suite).
 *
 *   build/test/bench/bench-bf16                 (AMX where the CPU has it)
 *   STEPD_CPU_NO_AMX=1 build/test/bench/bench-bf16   (vdpbf16ps on AVX-512 BF16)
 *   STEPD_BENCH_MB=512 (copies of each shape, >> L2; cycled so weights come from DRAM/L3),
 *   STEPD_BENCH_REPS=5, STEPD_BENCH_ROWS=128 (rows of every shape instead of 4096, with
 *   STEPD_BENCH_MB=1: one copy in L2, the kernels' in-cache rate)
 *
 * For 4096x4096 (an attention projection) and 4096x11264 (a dense MLP's down projection)
 * at 16 and 64 tokens: one sweep = one matmul per copy; old and new alternate per rep (the
 * fast path switched by cpu_bf16_fast_off on the same fast-path context), so load changes
 * on a shared host hit both.  Prints GFLOP/s per CPU-second (2 · rows · cols · n per
 * matmul over the process CPU time: time slices lost to other processes do not count),
 * the median and the range over reps, and new/old of the medians.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "benchlib.h"
#include "cpu.h"

static double cpu_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* one sweep over the copies: GFLOP per CPU-second */
static double sweep(struct backend *be, struct bweight *w, int count, const float *x, int n, float *y)
{
    double t0 = cpu_now();

    for (int i = 0; i < count; i++)
        if (backend_matmul(be, &w[i], x, n, y) < 0)
            abort();
    return 2.0 * (double)w[0].rows * (double)w[0].cols * n * count / (cpu_now() - t0) * 1e-9;
}

int main(void)
{
    static const int64_t shapes[][2] = { { 4096, 4096 }, { 4096, 11264 } };
    static const int ns[] = { 16, 64 };
    const char *e = getenv("STEPD_BENCH_MB");
    size_t mb = e && atoi(e) > 0 ? (size_t)atoi(e) : 512;
    int reps = getenv("STEPD_BENCH_REPS") ? atoi(getenv("STEPD_BENCH_REPS")) : 5;
    struct backend_cfg cfg = { .n_threads = 1, .mxfp4_exact = false };
    struct backend *be;
    uint8_t *arena;

    reps = reps < 1 ? 1 : (reps > 64 ? 64 : reps);
    if (backend_new("cpu", &cfg, &be) < 0 || !(arena = malloc((mb << 20) + (64 << 20))))
        return 1;
    for (size_t k = 0; k < ((mb << 20) + (64 << 20)) / 2; k++)     /* BF16 in [-1, 1) (no NaN, no denormal) */
        ((uint16_t *)arena)[k] = (uint16_t)(0x3c00 + (k * 2654435761u >> 7) % 0x300) |
                                 (uint16_t)((k & 1) << 15);
    printf("bench-bf16: level %s, 1 thread, %zu MiB of copies per shape, median [min, max] of %d "
           "reps, GFLOP/s per CPU-second\n", cpu_isa_name(cpu_isa()), mb, reps);
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        const int64_t rows = getenv("STEPD_BENCH_ROWS") && atoi(getenv("STEPD_BENCH_ROWS")) >= 16
                             ? atoi(getenv("STEPD_BENCH_ROWS")) : shapes[s][0], cols = shapes[s][1];
        const size_t each = (size_t)(rows * cols * 2);
        const int count = (int)((mb << 20) / each) > 0 ? (int)((mb << 20) / each) : 1;
        struct bweight *w = calloc((size_t)count, sizeof(*w));
        float *x = malloc(sizeof(float) * 64 * cols), *y = malloc(sizeof(float) * 64 * rows);

        for (int i = 0; i < count; i++)
            w[i] = (struct bweight){ .fmt = WFMT_BF16, .rows = rows, .cols = cols, .data = arena + i * each };
        for (int64_t k = 0; k < 64 * cols; k++)
            x[k] = (float)((k * 7919) % 2001 - 1000) * 1e-3f;
        printf("  %lldx%lld (%d copies): old = %s, new = %s\n", (long long)rows, (long long)cols, count,
               cpu_bf16_use_amx(&w[0]) ? "AMX 3-part tiles" : "AVX-512 FP32 FMA",
               cpu_bf16_use_amx(&w[0]) ? "AMX 1-part tiles"
               : cpu_bf16_dp_fits(&w[0]) ? "vdpbf16ps" : "(no BF16 fast kernel: = old)");
        for (size_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++) {
            double g[2][64], med[2], lo[2], hi[2];

            for (int side = 0; side < 2; side++) {      /* warm-up */
                cpu_bf16_fast_off = side == 0;
                sweep(be, w, count < 2 ? count : 2, x, ns[a], y);
            }
            for (int r = 0; r < reps; r++)
                for (int side = 0; side < 2; side++) {
                    cpu_bf16_fast_off = side == 0;
                    g[side][r] = sweep(be, w, count, x, ns[a], y);
                }
            for (int side = 0; side < 2; side++) {
                med[side] = bench_median(g[side], reps);    /* sorts */
                lo[side] = g[side][0];
                hi[side] = g[side][reps - 1];
            }
            printf("    n=%2d  old %6.1f [%6.1f, %6.1f]  new %6.1f [%6.1f, %6.1f]  new/old %5.2fx\n", ns[a],
                   med[0], lo[0], hi[0], med[1], lo[1], hi[1], med[1] / med[0]);
        }
        cpu_bf16_fast_off = 0;
        free(w);
        free(x);
        free(y);
    }
    backend_free(be);
    free(arena);
    return 0;
}
