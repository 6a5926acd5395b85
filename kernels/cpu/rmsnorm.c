/* rmsnorm.c - Gemma RMSNorm, y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 (docs/MODEL.md §2.1).
 * rows of dim values each; per-head norms pass rows = n_tok * n_heads, dim = head_dim.
 * The sum of squares is accumulated in fp64 so the result does not depend on dim's size.
 * Rows split over the pool when there are enough of them (prefill). */
#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

/* multiply-add equivalents of one element (fp64 square-accumulate, scale: ~0.6 ns) */
#define RMSNORM_WORK 16.0

struct rmsnorm_job {
    const float *x, *g;
    float *y;
    int rows, dim;
    float eps;
    bool avx2;
};

/* Sum of squares of one row: 4 independent fp64 lanes (lane l takes k = l mod 4, in
 * order), folded (l0 + l2) + (l1 + l3).  A float's square is exact in fp64, so the AVX2
 * form (4 lanes in one register, fused multiply-add) rounds exactly like the scalar one. */
static inline double row_ss_scalar(const float *xr, int dim)
{
    double l4[4] = { 0 };
    int k = 0;

    for (; k + 4 <= dim; k += 4)
        for (int l = 0; l < 4; l++)
            l4[l] += (double)xr[k + l] * xr[k + l];
    for (; k < dim; k++)
        l4[0] += (double)xr[k] * xr[k];
    return (l4[0] + l4[2]) + (l4[1] + l4[3]);
}

#if defined(__x86_64__)
CPU_FN_AVX2 static double row_ss_avx2(const float *xr, int dim)
{
    __m256d acc = _mm256_setzero_pd();
    double l4[4];
    int k = 0;

    for (; k + 4 <= dim; k += 4) {
        __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(xr + k));

        acc = _mm256_fmadd_pd(v, v, acc);
    }
    _mm256_storeu_pd(l4, acc);
    for (; k < dim; k++)
        l4[0] += (double)xr[k] * xr[k];
    return (l4[0] + l4[2]) + (l4[1] + l4[3]);
}
#endif

static inline double row_ss(const float *xr, int dim, bool avx2)
{
#if defined(__x86_64__)
    if (avx2)
        return row_ss_avx2(xr, dim);
#else
    (void)avx2;
#endif
    return row_ss_scalar(xr, dim);
}

#define RMS_BATCH 8

static void rmsnorm_rows(const struct rmsnorm_job *j, int r0, int r1)
{
    const int dim = j->dim;

    /* RMS_BATCH rows at a time: their sums first, then the 1/sqrt of all of them in one
     * loop the compiler vectorises (sqrt and division are correctly rounded either way,
     * so every row gets the same bits as alone), then the scaling - short rows (per-head
     * norms, dim 32) were bound by each row's dependent sqrt + division */
    for (int rb = r0; rb < r1; rb += RMS_BATCH) {
        const int nb = r1 - rb < RMS_BATCH ? r1 - rb : RMS_BATCH;
        double ss[RMS_BATCH];
        float inv[RMS_BATCH];

        for (int i = 0; i < nb; i++)
            ss[i] = row_ss(j->x + (int64_t)(rb + i) * dim, dim, j->avx2);
        for (int i = 0; i < nb; i++)
            inv[i] = (float)(1.0 / sqrt(ss[i] / dim + (double)j->eps));
        for (int i = 0; i < nb; i++) {
            const float *xr = j->x + (int64_t)(rb + i) * dim;
            float *yr = j->y + (int64_t)(rb + i) * dim;

            for (int k = 0; k < dim; k++)
                yr[k] = xr[k] * inv[i] * j->g[k];
        }
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
    struct rmsnorm_job j = { x, g, y, rows, dim, eps, c->have_avx2 };
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
