/* moe.c - routed experts of one MoE layer, grouped by expert (docs/MODEL.md §2.5 steps 6).
 *
 * out[t] += Σ_k weights[t,k] · down_e(swiglu(gate_e·x_t, up_e·x_t)) over the pairs (t, k)
 * whose expert e = ids[t,k] is local (expert_first <= e < expert_first + n_local).
 * The pairs are sorted by expert (counting sort, token order kept); each expert's
 * tokens then run as small GEMMs, so a weight tile is decoded once per 4 tokens.
 *
 * Phases (the pool returns between them when every unit is done):
 *   0  the caller quantises the token rows once (MXFP4 fast path);
 *   1  units = (active expert, 32-aligned range of inter rows): gate and up rows,
 *      swiglu, and quantisation of those act blocks;
 *   2  units = ranges of hidden rows: down rows [a, b) of every active expert, added
 *      weighted into out[t][a..b) - a unit owns its columns of out, so no two threads
 *      write one float, and the scatter order is fixed (expert, then token order): the
 *      result does not depend on the thread count or on which thread ran what.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "log.h"
#include "cpu.h"

/* multiply-adds a unit should carry at least (see cpu_moe).  Every unit pays fixed
 * costs (a kernel call per expert it touches, the pool's claim and steal); at tiny-model
 * sizes (an expert-token is ~33 K multiply-adds per matrix) finer units cost more than
 * the balance they buy: on tiny-step, 2 threads, about one unit per thread instead of
 * 2-4 made the op 1.02x (1 token), 1.08x (4) and 1.09x (16 tokens) faster (medians of
 * 10).  Big models (an expert-token is millions) keep CPU_UNITS_PER_THREAD per thread. */
#define MOE_MIN_UNIT_WORK 1048576.0

struct moe_job {
    struct cpu_ctx *c;
    const struct moe_args *a;
    int n_pairs, max_m;
    int32_t *off;           /* [n_local + 1] pair offset per local expert */
    int32_t *tok;           /* [n_pairs] token of each pair */
    float *wt;              /* [n_pairs] routing weight */
    int32_t *pidx;          /* [n_pairs] 0..n_pairs-1 */
    float *act;             /* [n_pairs, inter] */
    bool x_fast, act_fast;  /* quantised inputs in use */
    struct cpu_qact qx, qact;
    float *tbuf;            /* per thread: [max_m, tcols] */
    int32_t *active;        /* [n_active] local experts with tokens */
    int n_active, p1;       /* phase 1: units per expert */
    int64_t tcols;
    float *rowbuf;          /* per thread: CPU_LOWP_BUF(max(hidden, inter)) floats: decoded
                             * rows (MXFP4 exact: one; FP8/NVFP4: a tile, or one in fp64) */
};

/* y[i*ldy + r - r0] for rows [r0, r1) of w over n activation rows picked by xidx. */
static void rows_run(const struct moe_job *j, const struct bweight *w, const float *x,
                     const struct cpu_qact *qa, bool fast, const int32_t *xidx, int n, float *y,
                     int64_t ldy, int64_t r0, int64_t r1, int ith)
{
    const int64_t rb = (int64_t)(j->a->hidden > j->a->inter ? j->a->hidden : j->a->inter);

    switch (w->fmt) {
    case WFMT_F32:
        cpu_matmul_f32_rows(w, x, xidx, n, y, ldy, r0, r1, j->c->have_avx2);
        break;
    case WFMT_BF16:
        cpu_matmul_bf16_rows(w, x, xidx, n, y, ldy, r0, r1, j->c->have_avx2, cpu_bf16_fast(j->c, w));
        break;
    case WFMT_MXFP4:
        if (fast)
            cpu_matmul_mxfp4_fast_rows(w, qa, xidx, n, y, ldy, r0, r1);
        else
            cpu_matmul_mxfp4_exact_rows(w, x, xidx, n, y, ldy, r0, r1, j->rowbuf + ith * CPU_LOWP_BUF(rb));
        break;
    case WFMT_FP8:
        cpu_matmul_fp8_rows(w, x, xidx, n, y, ldy, r0, r1, cpu_lowp_exact(j->c), j->rowbuf + ith * CPU_LOWP_BUF(rb));
        break;
    case WFMT_NVFP4:
        cpu_matmul_nvfp4_rows(w, x, xidx, n, y, ldy, r0, r1, cpu_lowp_exact(j->c), j->rowbuf + ith * CPU_LOWP_BUF(rb));
        break;
    default:
        BUG_ON(1);
    }
}

static void moe_phase1(void *arg, int unit, int n_units, int ith)
{
    struct moe_job *j = arg;
    const struct moe_args *a = j->a;
    const int e = j->active[unit / j->p1];
    const struct moe_expert *ex = &a->experts[e];
    const int m = j->off[e + 1] - j->off[e];
    float *tb = j->tbuf + (int64_t)ith * j->max_m * j->tcols;
    float *act = j->act + (int64_t)j->off[e] * a->inter;
    int64_t r0, r1;

    cpu_split(a->inter, 32, unit % j->p1, j->p1, &r0, &r1);
    if (r0 >= r1)
        return;
    rows_run(j, &ex->gate, a->x, &j->qx, j->x_fast, j->tok + j->off[e], m, act + r0, a->inter,
             r0, r1, ith);
    rows_run(j, &ex->up, a->x, &j->qx, j->x_fast, j->tok + j->off[e], m, tb, r1 - r0, r0, r1, ith);
    for (int i = 0; i < m; i++) {
        float *g = act + (int64_t)i * a->inter + r0;
        const float *u = tb + (int64_t)i * (r1 - r0);

        cpu_swiglu_rows(g, u, g, r1 - r0, a->limit);
        if (j->act_fast)
            cpu_qact_quantize(&j->qact, j->off[e] + i, act + (int64_t)i * a->inter, r0 / 32,
                              (r1 + 31) / 32);
    }
}

static void moe_phase2(void *arg, int unit, int n_units, int ith)
{
    struct moe_job *j = arg;
    const struct moe_args *a = j->a;
    float *tb = j->tbuf + (int64_t)ith * j->max_m * j->tcols;
    int64_t r0, r1;

    cpu_split(a->hidden, 16, unit, n_units, &r0, &r1);
    if (r0 >= r1)
        return;
    for (int k = 0; k < j->n_active; k++) {
        int e = j->active[k], m = j->off[e + 1] - j->off[e];

        rows_run(j, &a->experts[e].down, j->act, &j->qact, j->act_fast, j->pidx + j->off[e], m,
                 tb, r1 - r0, r0, r1, ith);
        for (int i = 0; i < m; i++) {
            int p = j->off[e] + i;
            float *o = a->out + (int64_t)j->tok[p] * a->hidden + r0;
            const float *d = tb + (int64_t)i * (r1 - r0);
            float w = j->wt[p];

            for (int64_t c = 0; c < r1 - r0; c++)
                o[c] += w * d[c];
        }
    }
}

static bool expert_ok(const struct moe_args *a, const struct moe_expert *ex)
{
    const struct bweight *g = &ex->gate, *u = &ex->up, *d = &ex->down;

    return g->rows == a->inter && g->cols == a->hidden && u->rows == a->inter &&
           u->cols == a->hidden && d->rows == a->hidden && d->cols == a->inter &&
           u->fmt == g->fmt && (g->data || g->priv) && (u->data || u->priv) &&
           (d->data || d->priv);
}

int cpu_moe(struct backend *be, const struct moe_args *a)
{
    struct cpu_ctx *c = cpu_ctx(be);
    const int nth = cpu_pool_size(c->pool);    /* per-thread scratch for every pool thread */
    struct moe_job j = { .c = c, .a = a };
    int32_t *cnt = NULL;
    size_t sz_idx, sz_act, sz_qx = 0, sz_qa = 0, sz_t, sz_rb;
    uint8_t *mem;
    int r = 0;

    if (a->n_tok == 0 || a->n_local == 0)
        return 0;
    for (int e = 0; e < a->n_local; e++) {
        if (!expert_ok(a, &a->experts[e])) {
            log_debug("moe: local expert %d has shapes/formats that do not match hidden %d inter %d",
                      e, a->hidden, a->inter);
            return -EINVAL;
        }
    }
    cnt = calloc((size_t)a->n_local + 1, sizeof(*cnt));
    if (!cnt)
        return -ENOMEM;
    for (int64_t p = 0; p < (int64_t)a->n_tok * a->top_k; p++) {
        int e = a->ids[p] - a->expert_first;

        if (a->ids[p] < 0) {
            log_debug("moe: negative expert id %d", a->ids[p]);
            r = -EINVAL;
            goto out;
        }
        if (e >= 0 && e < a->n_local) {
            cnt[e + 1]++;
            j.n_pairs++;
        }
    }
    if (j.n_pairs == 0)
        goto out;
    for (int e = 0; e < a->n_local; e++) {
        j.max_m = cnt[e + 1] > j.max_m ? cnt[e + 1] : j.max_m;
        cnt[e + 1] += cnt[e];
    }

    j.x_fast = cpu_mxfp4_use_fast(c, &a->experts[0].gate);
    j.act_fast = cpu_mxfp4_use_fast(c, &a->experts[0].down);
    for (int e = 1; e < a->n_local; e++) {
        if (cpu_mxfp4_use_fast(c, &a->experts[e].gate) != j.x_fast ||
            cpu_mxfp4_use_fast(c, &a->experts[e].down) != j.act_fast) {
            log_debug("moe: local experts mix formats or prepared state");
            r = -EINVAL;
            goto out;
        }
    }
    /* a unit's row range never exceeds the whole dimension */
    j.tcols = a->inter > a->hidden ? a->inter : a->hidden;

    sz_idx = ((size_t)(a->n_local + 1) + 4 * (size_t)j.n_pairs) * 4 + 64;
    sz_act = (size_t)j.n_pairs * a->inter * 4 + 64;
    if (j.x_fast)
        sz_qx = cpu_qact_bytes(a->n_tok, a->hidden);
    if (j.act_fast)
        sz_qa = cpu_qact_bytes(j.n_pairs, a->inter);
    sz_t = (size_t)nth * j.max_m * j.tcols * 4 + 64;
    sz_rb = (size_t)nth * (size_t)CPU_LOWP_BUF(a->hidden > a->inter ? a->hidden : a->inter) * 4 + 64;
    /* + 64 per carved piece for alignment padding */
    mem = cpu_scratch(c, sz_idx + sz_act + sz_qx + sz_qa + sz_t + sz_rb + 16 * 64);
    if (!mem) {
        r = -ENOMEM;
        goto out;
    }
#define CARVE(ptr, bytes) do { (ptr) = (void *)mem; mem += ((bytes) + 63) & ~(size_t)63; } while (0)
    CARVE(j.off, ((size_t)a->n_local + 1) * 4);
    CARVE(j.tok, (size_t)j.n_pairs * 4);
    CARVE(j.wt, (size_t)j.n_pairs * 4);
    CARVE(j.pidx, (size_t)j.n_pairs * 4);
    CARVE(j.active, (size_t)(a->n_local < j.n_pairs ? a->n_local : j.n_pairs) * 4);
    CARVE(j.act, (size_t)j.n_pairs * a->inter * 4);
    if (j.x_fast) {
        cpu_qact_init(&j.qx, mem, a->n_tok, a->hidden);
        mem += sz_qx;
    }
    if (j.act_fast) {
        cpu_qact_init(&j.qact, mem, j.n_pairs, a->inter);
        mem += sz_qa;
    }
    CARVE(j.tbuf, (size_t)nth * j.max_m * j.tcols * 4);
    CARVE(j.rowbuf, (size_t)nth * (size_t)CPU_LOWP_BUF(a->hidden > a->inter ? a->hidden : a->inter) * 4);
#undef CARVE

    /* counting sort of the local pairs by expert, token order kept */
    memcpy(j.off, cnt, ((size_t)a->n_local + 1) * 4);
    for (int t = 0; t < a->n_tok; t++) {
        for (int k = 0; k < a->top_k; k++) {
            int64_t p = (int64_t)t * a->top_k + k;
            int e = a->ids[p] - a->expert_first;

            if (e < 0 || e >= a->n_local)
                continue;
            j.tok[cnt[e]] = t;
            j.wt[cnt[e]] = a->weights[p];
            cnt[e]++;
        }
    }
    for (int p = 0; p < j.n_pairs; p++)
        j.pidx[p] = p;
    for (int e = 0; e < a->n_local; e++)
        if (j.off[e + 1] > j.off[e])
            j.active[j.n_active++] = e;
    if (j.x_fast)
        for (int t = 0; t < a->n_tok; t++)
            cpu_qact_quantize(&j.qx, t, a->x + (int64_t)t * a->hidden, 0, a->hidden / 32);
    {
        int n_run = cpu_threads_for(c, 3.0 * a->hidden * a->inter * j.n_pairs);
        int want = n_run * CPU_UNITS_PER_THREAD;
        int64_t max_p1 = (a->inter + 31) / 32, max_u2 = (a->hidden + 15) / 16;
        /* no more units than MOE_MIN_UNIT_WORK each allows: every unit runs a kernel call
         * per expert, whose fixed cost dominates below that (decode: 1 token per expert) */
        int64_t by_work1 = (int64_t)(2.0 * a->hidden * a->inter * j.max_m / MOE_MIN_UNIT_WORK);
        int64_t by_work2 = (int64_t)(1.0 * a->hidden * a->inter * j.n_pairs / MOE_MIN_UNIT_WORK);
        /* phase 1 keeps at least one unit per thread (an expert splits when fewer
         * experts than threads are active), within the 32-row ranges there are */
        const int64_t min_p1 = (n_run + j.n_active - 1) / j.n_active, all_p1 = max_p1;
        int u2;

        max_p1 = by_work1 < max_p1 ? (by_work1 > min_p1 ? by_work1 : min_p1) : max_p1;
        max_p1 = max_p1 < all_p1 ? max_p1 : all_p1;
        max_u2 = by_work2 < max_u2 ? (by_work2 > n_run ? by_work2 : n_run) : max_u2;
        j.p1 = n_run > 1 ? (want + j.n_active - 1) / j.n_active : 1;
        j.p1 = j.p1 < max_p1 ? j.p1 : (int)max_p1;
        u2 = n_run > 1 ? (want < max_u2 ? want : (int)max_u2) : 1;
        cpu_pool_for(c->pool, moe_phase1, &j, j.n_active * j.p1, n_run);
        cpu_pool_for(c->pool, moe_phase2, &j, u2, n_run);
    }
out:
    free(cnt);
    return r;
}
