/* rmsnorm.c - Gemma RMSNorm, y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 (MODEL.md §2.1).
 * rows of dim values each; per-head norms pass rows = n_tok * n_heads, dim = head_dim.
 * The sum of squares is accumulated in fp64 so the result does not depend on dim's size.
 * Rows split over the pool when there are enough of them (prefill). */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "cpu.h"

/* multiply-add equivalents of one element (fp64 square-accumulate, scale: ~0.6 ns) */
#define RMSNORM_WORK 16.0

struct rmsnorm_job {
    const float *x, *g;
    float *y;
    int rows, dim;
    float eps;
};

static void rmsnorm_rows(const struct rmsnorm_job *j, int r0, int r1)
{
    const int dim = j->dim;

    for (int r = r0; r < r1; r++) {
        const float *xr = j->x + (int64_t)r * dim;
        float *yr = j->y + (int64_t)r * dim;
        double l4[4] = { 0 }, ss;
        float inv;
        int k = 0;

        /* 4 independent fp64 lanes (vectorised; a single chain is latency-bound) */
        for (; k + 4 <= dim; k += 4)
            for (int l = 0; l < 4; l++)
                l4[l] += (double)xr[k + l] * xr[k + l];
        for (; k < dim; k++)
            l4[0] += (double)xr[k] * xr[k];
        ss = (l4[0] + l4[2]) + (l4[1] + l4[3]);
        inv = (float)(1.0 / sqrt(ss / dim + (double)j->eps));
        for (k = 0; k < dim; k++)
            yr[k] = xr[k] * inv * j->g[k];
    }
}

static void rmsnorm_unit(void *arg, int unit, int n_units, int ith)
{
    const struct rmsnorm_job *j = arg;
    int64_t r0, r1;

    (void)ith;
    cpu_split(j->rows, 1, unit, n_units, &r0, &r1);
    rmsnorm_rows(j, (int)r0, (int)r1);
}

int cpu_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                float eps, float *y)
{
    struct cpu_ctx *c = cpu_ctx(be);
    float g[dim];
    struct rmsnorm_job j = { x, g, y, rows, dim, eps };
    int nth, units;

    if (w->fmt != WFMT_F32 && w->fmt != WFMT_BF16)
        return -EINVAL;
    if (!(eps >= 0.0f))
        return -EINVAL;
    for (int k = 0; k < dim; k++)
        g[k] = 1.0f + cpu_weight_get(w, 0, k);  /* rows*cols == dim: flat index */
    /* rows are independent: any split gives the same bits */
    nth = cpu_threads_for(c, RMSNORM_WORK * (double)rows * dim);
    units = nth * CPU_UNITS_PER_THREAD < rows ? nth * CPU_UNITS_PER_THREAD : rows;
    cpu_pool_for(c->pool, rmsnorm_unit, &j, nth > 1 ? units : 1, nth);
    return 0;
}
