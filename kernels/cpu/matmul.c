/* matmul.c - the matmul op: y[n, rows] = x[n, cols] · Wᵀ for every weight format, in ONE
 * parallel region: rows are cut into CPU_UNITS_PER_THREAD coarse contiguous ranges per
 * thread (tile-aligned) that the pool's threads claim in order.  On the MXFP4 fast path
 * the caller quantises the activations first (once per token, microseconds); on the
 * AMX-BF16 path it packs them into tile layout once, for all threads, and on the BF16
 * fast path (cpu_bf16_fast) rounds them to BF16 once (the AMX one-part tiles, or BF16 rows
 * for the vdpbf16ps kernel). */
#include <errno.h>

#include "err.h"
#include "cpu.h"

struct matmul_job {
    struct cpu_ctx *c;
    const struct bweight *w;
    const float *x;
    int n;
    float *y;
    int64_t ldy, r0, r1;    /* rows [r0, r1) into y[i * ldy + (r - r0)] */
    bool fast;              /* MXFP4: the int8 path; BF16: the BF16 fast path */
    const void *amx_x;      /* BF16 on AMX: activations packed once (cpu_amx_act_pack) */
    const void *dp_x;       /* BF16 fast path by vdpbf16ps: BF16 rows (cpu_bf16_act_pack) */
    struct cpu_qact qa;
    float *rowbuf;          /* exact path: nth x cols */
};

static void matmul_unit(void *arg, int unit, int n_units, int ith)
{
    struct matmul_job *j = arg;
    const struct bweight *w = j->w;
    int64_t r0, r1;

    cpu_split(j->r1 - j->r0, w->fmt == WFMT_MXFP4 ? cpu_mxfp4_row_align(w) : 16, unit, n_units, &r0, &r1);
    if (r0 >= r1)
        return;
    float *y = j->y + r0;   /* rows relative to j->r0 here; absolute below */
    r0 += j->r0;
    r1 += j->r0;
    switch (w->fmt) {
    case WFMT_F32:
        cpu_matmul_f32_rows(w, j->x, NULL, j->n, y, j->ldy, r0, r1,
                            j->c->have_avx2);
        break;
    case WFMT_BF16:
        if (j->amx_x) {
            cpu_matmul_bf16_amx_rows(w, j->amx_x, j->n, y, j->ldy, r0, r1, j->fast);
            break;
        }
        if (j->dp_x) {
            cpu_matmul_bf16_dp_rows(w, j->dp_x, j->n, y, j->ldy, r0, r1);
            break;
        }
        cpu_matmul_bf16_rows(w, j->x, NULL, j->n, y, j->ldy, r0, r1, j->c->have_avx2, j->fast);
        break;
    case WFMT_MXFP4:
        if (j->fast)
            cpu_matmul_mxfp4_fast_rows(w, &j->qa, NULL, j->n, y, j->ldy, r0, r1);
        else
            cpu_matmul_mxfp4_exact_rows(w, j->x, NULL, j->n, y, j->ldy, r0, r1,
                                        j->rowbuf + (int64_t)ith * w->cols);
        break;
    case WFMT_FP8:
        cpu_matmul_fp8_rows(w, j->x, NULL, j->n, y, j->ldy, r0, r1, cpu_lowp_exact(j->c),
                            j->rowbuf + (int64_t)ith * CPU_LOWP_BUF(w->cols));
        break;
    case WFMT_NVFP4:
        cpu_matmul_nvfp4_rows(w, j->x, NULL, j->n, y, j->ldy, r0, r1, cpu_lowp_exact(j->c),
                              j->rowbuf + (int64_t)ith * CPU_LOWP_BUF(w->cols));
        break;
    default:
        BUG_ON(1);
    }
}

int cpu_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    return cpu_matmul_rows(be, w, x, n, y, w->rows, 0, w->rows);
}

/* The AMX activation pack over the pool: unit u packs items [u N / U, (u + 1) N / U) */
struct amx_pack_job {
    void *buf;
    const float *x;
    int n, items;
    int64_t cols;
    bool fast;
};

static void amx_pack_unit(void *arg, int unit, int n_units, int ith)
{
    const struct amx_pack_job *p = arg;
    const int i0 = (int)((int64_t)p->items * unit / n_units), i1 = (int)((int64_t)p->items * (unit + 1) / n_units);

    (void)ith;
    cpu_amx_act_pack_blocks(p->buf, p->x, NULL, p->n, p->cols, p->fast, i0, i1);
}

int cpu_matmul_rows(struct backend *be, const struct bweight *w, const float *x, int n, float *y,
                    int64_t ldy, int64_t r0, int64_t r1)
{
    struct cpu_ctx *c = cpu_ctx(be);
    struct matmul_job j = { .c = c, .w = w, .x = x, .n = n, .y = y, .ldy = ldy, .r0 = r0, .r1 = r1 };
    const bool amx = c->have_avx2 && cpu_bf16_use_amx(w);
    /* AMX tiles do ~8x the multiply-adds of the vector kernels per cycle: weigh the work
     * accordingly, so small AMX matmuls are not split across threads (the split costs more
     * than it saves: measured on the tiny model's 128x256 .. 768x256) */
    const int nth = cpu_threads_for(c, (double)(r1 - r0) * w->cols * n / (amx ? 8.0 : 1.0));
    void *mem;

    if (n == 0)
        return 0;
    if (w->fmt == WFMT_BF16)
        j.fast = cpu_bf16_fast(c, w);
    if (amx) {
        mem = cpu_scratch(c, cpu_amx_act_bytes(n, w->cols, j.fast));
        if (!mem)
            return -ENOMEM;
        /* packed by the threads that run the matmul (a prompt's 256 tokens x 4096 columns:
         * ~0.4 ms, a third of a 128-row GEMM on one core; serial, it capped the 2-thread
         * speed of such a call at 1.1x) */
        struct amx_pack_job p = { .buf = mem, .x = x, .n = n, .items = cpu_amx_act_blocks(n, j.fast),
                                  .cols = w->cols, .fast = j.fast };

        /* one unit or one thread: cpu_pool_for runs it on this thread */
        cpu_pool_for(c->pool, amx_pack_unit, &p, p.items < nth ? p.items : nth, nth);
        j.amx_x = mem;
    } else if (j.fast && cpu_bf16_dp_fits(w)) {
        mem = cpu_scratch(c, cpu_bf16_act_bytes(n, w->cols));
        if (!mem)
            return -ENOMEM;
        cpu_bf16_act_pack(mem, x, NULL, n, w->cols);
        j.dp_x = mem;
    }
    if (w->fmt == WFMT_MXFP4) {
        j.fast = cpu_mxfp4_use_fast(c, w);
        if (j.fast) {
            mem = cpu_scratch(c, cpu_qact_bytes(n, w->cols));
            if (!mem)
                return -ENOMEM;
            cpu_qact_init(&j.qa, mem, n, w->cols);
            for (int i = 0; i < n; i++)
                cpu_qact_quantize(&j.qa, i, x + (int64_t)i * w->cols, 0, w->cols / 32);
        } else {
            j.rowbuf = cpu_scratch(c, (size_t)c->n_threads * w->cols * sizeof(float));
            if (!j.rowbuf)
                return -ENOMEM;
        }
    } else if (w->fmt == WFMT_FP8 || w->fmt == WFMT_NVFP4) {
        /* per thread: a tile of fp32 rows, or one fp64 row */
        j.rowbuf = cpu_scratch(c, (size_t)c->n_threads * (size_t)CPU_LOWP_BUF(w->cols) * sizeof(float));
        if (!j.rowbuf)
            return -ENOMEM;
    }
    {
        int64_t align = w->fmt == WFMT_MXFP4 ? cpu_mxfp4_row_align(w) : 16;
        int64_t max_units = (r1 - r0 + align - 1) / align;
        int units = nth * CPU_UNITS_PER_THREAD;

        units = units < max_units ? units : (int)max_units;
        cpu_pool_for(c->pool, matmul_unit, &j, nth > 1 ? units : 1, nth);
    }
    return 0;
}
