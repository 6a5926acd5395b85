/* argmax.c - the largest k values of each row with their indices (backend.h,
 * backend_argmax): the oracle of the CUDA kernel (kernels/cuda/argmax.cu), which chooses
 * the same places by the same comparisons.
 *
 * Place j holds the best element that comes after place j-1 in the order "larger value
 * first, then lower index" (-0.0 == +0.0, so they tie on the index); NaN is never a
 * candidate.  k = 1 is sampler_argmax (worker/engine/sampler.c) exactly: the lowest index of
 * the maximum, 0 for a row without a non-NaN element. */
#include <math.h>

#include "cpu.h"

/* The best element after (pv, pi) in the order above (the first place: pi < 0), -1 when
 * none is left: the first index of the largest candidate. */
static int row_next(const float *x, int n, float pv, int pi)
{
    int b = -1;

    for (int i = 0; i < n; i++) {
        float v = x[i];
        if (isnan(v) || (pi >= 0 && (v > pv || (v == pv && i <= pi))))
            continue;
        if (b < 0 || v > x[b])
            b = i;
    }
    return b;
}

int cpu_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
               float *vals)
{
    (void)be;
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * n;
        int32_t *id = ids + (size_t)r * k;
        float *val = vals ? vals + (size_t)r * k : NULL;
        int b = row_next(row, n, 0.0f, -1);

        for (int j = 0; j < k; j++) {
            if (j > 0)
                b = b < 0 ? -1 : row_next(row, n, row[id[j - 1]], id[j - 1]);
            id[j] = b < 0 && j == 0 ? 0 : b;
            if (val)
                val[j] = b < 0 ? NAN : row[b];
        }
    }
    return 0;
}

/* backend_row_expsum: the sampler's sum of weights (worker/engine/sampler.c, sampler_probs),
 * the same expf of the same float quotient added in double in the same order. */
int cpu_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                   const float *temps, double *sums)
{
    (void)be;
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * n;
        const float m = mx[r], t = temps[r];
        double sum = 0.0;

        for (int i = 0; t > 0.0f && i < n; i++)
            sum += expf((row[i] - m) / t);
        sums[r] = sum;
    }
    return 0;
}
