/* bench-dense.c - BF16 matmul throughput per token at 1/4/16 tokens (one thread), on the
 * tiny model's shapes (lm_head 4096x256, MLP 768x256 and 256x768).  Prints the best of
 * many repetitions (a noisy shared box), GMAC/s and the per-token cost relative to one
 * token; no thresholds.  STEPD_CPU_NO_AVX512=1 / STEPD_CPU_NO_AVX2=1 select the other
 * kernels for comparison.
 *
 *   bench-dense [reps=200]
 */
#include <time.h>

#include "kref.h"

static double now_sec(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    static const int64_t shapes[][2] = { { 4096, 256 }, { 768, 256 }, { 256, 768 } };
    static const int ns[] = { 1, 4, 16 };
    int reps = argc > 1 ? atoi(argv[1]) : 200;
    struct backend *be = kref_backend(1, false);

    if (reps < 1) {
        fprintf(stderr, "usage: bench-dense [reps >= 1]\n");
        return 2;
    }
    krng_seed(7);
    printf("bf16 matmul, 1 thread, best of %d\n", reps);
    for (size_t s = 0; s < ARRAY_SIZE(shapes); s++) {
        struct bweight w = kref_bf16_new(shapes[s][0], shapes[s][1], 1.0f);
        float *x = malloc(sizeof(float) * 16 * shapes[s][1]);
        float *y = malloc(sizeof(float) * 16 * shapes[s][0]);
        double per_tok1 = 0;

        ASSERT_TRUE(x && y);
        krng_fill(x, (size_t)(16 * shapes[s][1]), 1.0f);
        ASSERT_OK(backend_weight_prepare(be, &w));
        for (size_t k = 0; k < ARRAY_SIZE(ns); k++) {
            double best = 1e30;

            for (int r = 0; r < reps; r++) {
                double t0 = now_sec();

                ASSERT_OK(backend_matmul(be, &w, x, ns[k], y));
                t0 = now_sec() - t0;
                best = t0 < best ? t0 : best;
            }
            if (ns[k] == 1)
                per_tok1 = best;
            printf("  %5lldx%-4lld n=%2d: %8.1f us  %6.1f GMAC/s  per token x%.3f of n=1\n",
                   (long long)shapes[s][0], (long long)shapes[s][1], ns[k], best * 1e6,
                   (double)shapes[s][0] * shapes[s][1] * ns[k] / best * 1e-9,
                   best / ns[k] / per_tok1);
        }
        kref_weight_free(&w);
        free(x);
        free(y);
    }
    backend_free(be);
    return 0;
}
