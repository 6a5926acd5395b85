/* matmul.c - the matmul op: y[n, rows] = x[n, cols] · Wᵀ for every weight format, in ONE
 * parallel region: rows are split into one contiguous range per thread (tile-aligned),
 * and on the MXFP4 fast path each thread first quantises its share of the tokens. */
#include <errno.h>

#include "err.h"
#include "cpu.h"

struct matmul_job {
    struct cpu_ctx *c;
    const struct bweight *w;
    const float *x;
    int n;
    float *y;
    bool fast;
    struct cpu_qact qa;
    float *rowbuf;          /* exact path: nth x cols */
};

static void matmul_task(void *arg, int ith, int nth)
{
    struct matmul_job *j = arg;
    const struct bweight *w = j->w;
    int64_t r0, r1;

    cpu_split(w->rows, w->fmt == WFMT_MXFP4 ? MXFP4_TILE_ROWS : 16, ith, nth, &r0, &r1);
    if (j->fast) {
        int64_t i0, i1;

        cpu_split(j->n, 1, ith, nth, &i0, &i1);
        for (int64_t i = i0; i < i1; i++)
            cpu_qact_quantize(&j->qa, i, j->x + i * w->cols, 0, w->cols / 32);
        cpu_pool_barrier(j->c->pool);
    }
    if (r0 >= r1)
        return;
    switch (w->fmt) {
    case WFMT_F32:
        cpu_matmul_f32_rows(w, j->x, NULL, j->n, j->y + r0, w->rows, r0, r1);
        break;
    case WFMT_BF16:
        cpu_matmul_bf16_rows(w, j->x, NULL, j->n, j->y + r0, w->rows, r0, r1, j->c->have_avx2);
        break;
    case WFMT_MXFP4:
        if (j->fast)
            cpu_matmul_mxfp4_fast_rows(w, &j->qa, NULL, j->n, j->y + r0, w->rows, r0, r1);
        else
            cpu_matmul_mxfp4_exact_rows(w, j->x, NULL, j->n, j->y + r0, w->rows, r0, r1,
                                        j->rowbuf + (int64_t)ith * w->cols);
        break;
    default:
        BUG_ON(1);
    }
}

int cpu_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    struct cpu_ctx *c = cpu_ctx(be);
    struct matmul_job j = { .c = c, .w = w, .x = x, .n = n, .y = y };
    void *mem;

    if (n == 0)
        return 0;
    if (w->fmt == WFMT_MXFP4) {
        j.fast = cpu_mxfp4_use_fast(c, w);
        if (j.fast) {
            mem = cpu_scratch(c, cpu_qact_bytes(n, w->cols));
            if (!mem)
                return -ENOMEM;
            cpu_qact_init(&j.qa, mem, n, w->cols);
        } else {
            j.rowbuf = cpu_scratch(c, (size_t)c->n_threads * w->cols * sizeof(float));
            if (!j.rowbuf)
                return -ENOMEM;
        }
    }
    cpu_pool_run_n(c->pool, matmul_task, &j,
                   cpu_threads_for(c, (double)w->rows * w->cols * n));
    return 0;
}
