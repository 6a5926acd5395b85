/* bench-vision-batch.c - the vision encoder batched over images (issue 40; the engine's
 * encode_new, docs/PERFORMANCE.md "Vision encoder batched over requests"); suite bench,
 * not in the default run.
 *
 *   bench-vision-batch MODEL_DIR [--threads 1,2] [--views N] [--size S] [--reps N]
 *
 * For each thread count, in the same run on the same CPU backend: N (default 4) S x S
 * (default 504, a local crop) views of different synthetic images encoded one
 * vision_encode call each (as the engine did per image) and all in ONE call (as it does
 * for the images new in a step), alternating, the best of REPS (default 3) of each; and
 * the largest |difference| between the two outputs (0: batching changes no row).  Wall
 * time and the process's CPU time (steadier on a shared host) are both printed.
 * MODEL_DIR: the bundled tiny model, or one from stepd-mkmodel --vision L (full width).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "harness.h"
#include "loader.h"
#include "vision.h"

static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv)
{
    int threads[8] = {1, 2}, n_threads = 2, n = 4, size = 504, reps = 3;
    struct err_buf e = {{0}};

    if (argc < 2)
        FAIL("usage: bench-vision-batch MODEL_DIR [--threads 1,2] [--views N] [--size S] [--reps N]");
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) {
            const char *s = argv[i + 1];
            for (n_threads = 0; s && n_threads < 8; s = strchr(s, ','), s = s ? s + 1 : NULL)
                threads[n_threads++] = atoi(s);
        } else if (strcmp(argv[i], "--views") == 0) {
            n = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--size") == 0) {
            size = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--reps") == 0) {
            reps = atoi(argv[i + 1]);
        } else {
            FAIL("bench-vision-batch: unknown option %s", argv[i]);
        }
    }
    if (n < 1 || n > 16 || reps < 1 || n_threads < 1)
        FAIL("bench-vision-batch: --views 1..16, --reps >= 1, --threads a list");

    struct vision_view views[16];
    for (int i = 0; i < n; i++) {
        uint8_t *px = malloc((size_t) size * size * 3);
        ASSERT_TRUE(px != NULL);
        for (size_t k = 0; k < (size_t) size * size * 3; k++)
            px[k] = (uint8_t) (((k + 7919 * (size_t) i) * 2654435761u) >> 24);
        views[i] = (struct vision_view) {.rgb = px, .size = size};
    }
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct ckpt *ck;
    if (ckpt_open(argv[1], &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    printf("%-8s %-12s %-12s %-8s %-12s %-12s %-8s %s\n", "threads", "separate ms", "one call ms",
           "speedup", "sep. CPU ms", "one CPU ms", "speedup", "max |diff|");
    for (int ti = 0; ti < n_threads; ti++) {
        struct backend_cfg bc = {.n_threads = threads[ti]};
        struct backend *be;
        struct vision *v;
        double best_sep = 1e30, best_one = 1e30, cpu_sep = 1e30, cpu_one = 1e30, md = 0;

        ASSERT_OK(backend_new("cpu", &bc, &be));
        if (vision_new(ck, be, &v, &e) < 0)
            FAIL("%s", e.msg);
        int t = vision_view_tokens(v, size), H = vision_cfg(v)->text_hidden;
        if (t < 0)
            FAIL("bench-vision-batch: %d is not a view size this encoder takes", size);
        float *sep = malloc(sizeof(float) * (size_t) n * t * H), *one = malloc(sizeof(float) * (size_t) n * t * H);
        ASSERT_TRUE(sep && one);
        for (int r = 0; r < reps; r++) {
            double c0 = cpu_ms();
            int64_t t0 = clk_now_ns();
            for (int i = 0; i < n; i++)
                if (vision_encode(v, &views[i], 1, sep + (size_t) i * t * H, NULL, NULL, &e) < 0)
                    FAIL("%s", e.msg);
            int64_t t1 = clk_now_ns();
            double c1 = cpu_ms();
            if (vision_encode(v, views, n, one, NULL, NULL, &e) < 0)
                FAIL("%s", e.msg);
            int64_t t2 = clk_now_ns();
            double c2 = cpu_ms();
            cpu_sep = fmin(cpu_sep, c1 - c0);
            cpu_one = fmin(cpu_one, c2 - c1);
            best_sep = fmin(best_sep, (t1 - t0) / 1e6);
            best_one = fmin(best_one, (t2 - t1) / 1e6);
        }
        for (size_t k = 0; k < (size_t) n * t * H; k++)
            md = fmax(md, fabs((double) sep[k] - one[k]));
        printf("%-8d %-12.1f %-12.1f %-8.2f %-12.1f %-12.1f %-8.2f %g\n", threads[ti], best_sep, best_one,
               best_sep / best_one, cpu_sep, cpu_one, cpu_sep / cpu_one, md);
        printf("  (%d views of %dx%d, %d rows of %d each; width %d, %d blocks; best of %d)\n", n, size, size, t,
               H, vision_cfg(v)->width, vision_cfg(v)->layers, reps);
        free(sep);
        free(one);
        vision_free(v);
        backend_free(be);
    }
    ckpt_close(ck);
    for (int i = 0; i < n; i++)
        free((void *) views[i].rgb);
    return 0;
}
