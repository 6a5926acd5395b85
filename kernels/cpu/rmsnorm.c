/* rmsnorm.c - Gemma RMSNorm, y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 (MODEL.md §2.1).
 * rows of dim values each; per-head norms pass rows = n_tok * n_heads, dim = head_dim.
 * The sum of squares is accumulated in fp64 so the result does not depend on dim's size. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "cpu.h"

int cpu_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                float eps, float *y)
{
    float g[dim];

    if (w->fmt != WFMT_F32 && w->fmt != WFMT_BF16)
        return -EINVAL;
    if (!(eps >= 0.0f))
        return -EINVAL;
    for (int j = 0; j < dim; j++)
        g[j] = 1.0f + cpu_weight_get(w, 0, j);  /* rows*cols == dim: flat index */
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * dim;
        float *yr = y + (int64_t)r * dim;
        double l4[4] = { 0 }, ss;
        float inv;
        int j = 0;

        /* 4 independent fp64 lanes (vectorised; a single chain is latency-bound) */
        for (; j + 4 <= dim; j += 4)
            for (int k = 0; k < 4; k++)
                l4[k] += (double)xr[j + k] * xr[j + k];
        for (; j < dim; j++)
            l4[0] += (double)xr[j] * xr[j];
        ss = (l4[0] + l4[2]) + (l4[1] + l4[3]);
        inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
        for (j = 0; j < dim; j++)
            yr[j] = xr[j] * inv * g[j];
    }
    return 0;
}
