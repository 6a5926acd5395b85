// lowp.cu - the release formats beside MXFP4 on the CUDA backend (docs/GPU.md "Weight
// formats"): block-scaled FP8 (WFMT_FP8: E4M3 codes, an F32 scale per blk_rows x blk_cols
// block) and NVFP4 (WFMT_NVFP4: MXFP4's E2M1 nibbles, an E4M3 scale per 16 in-features and
// an F32 global scale).  FP8 stays on the device as on disk; NVFP4 is repacked at load
// into MXFP4's tiles (mx4.h nv4_*, never up-converted), whose routed experts run on the
// tensor cores in mx4_gemm (moe.cu) on the fast path.  The kernels here decode them in
// registers: E4M3 and E2M1 to FP32 exactly (lowp.h), the products and sums in FP32 with
// FP32 activations, one warp per output row: FP8's matmul below FP8_MMA_MIN_TOKENS tokens
// and its routed experts on the FP32 op path (c->exact) or where the tensor path cannot
// take their scale blocks (from FP8_MMA_MIN_TOKENS tokens, and for the experts otherwise,
// FP8 runs on the tensor cores: fp8mma.cu); the op path's table is staged per call
// (kcu_lowp_moe), the fused FFN half's built once at prepare (block.cu); NVFP4's matmul,
// and NVFP4's experts on the FP32 op path (backend_cfg.mxfp4_exact).
#include <math.h>
#include <stdlib.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"

// tokens a warp carries against one weight row (its loads shared by them; lowp.h's
// FP8_MMA_MIN_TOKENS follows it)
#define LOWP_NT 4
#define LOWP_WARPS 8

// ---- prepare (FP8): the bytes as on disk, uploaded ----

static size_t lowp_scale_bytes(const struct bweight *w)
{
    return (size_t) (w->rows / w->blk_rows) * (size_t) (w->cols / w->blk_cols) * 4;
}

int kcu_lowp_prepare(struct cuda_ctx *c, struct bweight *w)
{
    size_t nd, ns;
    int r;

    // 4 codes per load, a load never straddling a scale block
    if (w->fmt != WFMT_FP8 || w->blk_rows <= 0 || w->blk_cols <= 0 || w->rows % w->blk_rows ||
        w->cols % w->blk_cols || w->blk_cols % 4)
        return -EINVAL;
    nd = (size_t) w->rows * w->cols;
    if (!w->scale)
        return -EINVAL;
    ns = lowp_scale_bytes(w);
    struct cuda_weight *cw = (struct cuda_weight *) calloc(1, sizeof(*cw));
    if (!cw)
        return -ENOMEM;
    r = err_from_cuda(cudaMalloc(&cw->data, nd));
    if (r == 0)
        r = err_from_cuda(cudaMalloc((void **) &cw->scale, ns));
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(cw->data, w->data, nd, cudaMemcpyHostToDevice, c->stream));
    if (r == 0)
        r = err_from_cuda(cudaMemcpyAsync(cw->scale, w->scale, ns, cudaMemcpyHostToDevice, c->stream));
    if (r == 0)
        r = err_from_cuda(cudaStreamSynchronize(c->stream));
    if (r < 0) {
        cudaFree(cw->data);
        cudaFree(cw->scale);
        free(cw);
        return r;
    }
    w->priv = cw;
    return 0;
}

static int lowp_desc(const struct bweight *w, struct lowp_w *d)
{
    const struct cuda_weight *cw = (const struct cuda_weight *) w->priv;
    if (!cw || !cw->data || !lowp_fmt(w->fmt))
        return -EINVAL;
    d->data = (const uint8_t *) cw->data;
    d->scale = cw->scale;
    d->cols = w->cols;
    d->fmt = w->fmt;
    d->blk_rows = w->blk_rows;
    d->blk_cols = w->blk_cols;
    d->gscale = w->gscale;
    return 0;
}

// ---- matmul: y[n, rows] = x[n, cols] · Wᵀ ----

static __global__ void lowp_matmul_kernel(struct lowp_w w, int64_t rows, const float *x, int n,
                                          float *y)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const int64_t chunks = (n + LOWP_NT - 1) / LOWP_NT;
    if (warp >= rows * chunks)
        return;
    const int64_t o = warp % rows;
    const int t0 = (int) (warp / rows) * LOWP_NT;
    const int nt = n - t0 < LOWP_NT ? n - t0 : LOWP_NT;
    float acc[LOWP_NT];
    lowp_row_dot<LOWP_NT>(&w, o, x + (int64_t) t0 * w.cols, w.cols, nt, lane, acc);
    if (lane == 0)
        for (int t = 0; t < nt; t++)
            y[(int64_t) (t0 + t) * rows + o] = acc[t];
}

int kcu_lowp_matmul(struct cuda_ctx *c, const struct bweight *w, const float *x, int n, float *y)
{
    struct lowp_w d;
    if (lowp_desc(w, &d) < 0)
        return -EINVAL;
    if (n == 0)
        return 0;
    // FP8 from FP8_MMA_MIN_TOKENS tokens on the tensor cores (BF16 activations), but on the
    // FP32 op path (c->exact)
    if (d.fmt == WFMT_FP8 && !c->exact && n >= FP8_MMA_MIN_TOKENS && w->rows % 16 == 0 &&
        kcu_fp8_mma_ok(&d, 1))
        return kcu_fp8_dense(c, &d, (int) w->rows, x, n, y);
    const size_t threads = (size_t) w->rows * ((n + LOWP_NT - 1) / LOWP_NT) * 32;
    cuda_launch(c, lowp_matmul_kernel, cuda_blocks(threads, 32 * LOWP_WARPS), 32 * LOWP_WARPS, 0,
                d, w->rows, x, n, y);
    return CUDA_LAUNCH_CHECK();
}

// ---- the routed experts: act = swiglu(gate·x, up·x) per (token, slot), out += Σ w·down·act ----

// the row product of moe_warp_run over a table [3][n_local] of descriptors (gate, up, down)
struct lowp_rd {
    const struct lowp_w *tab;
    int n_local;
    __device__ float operator()(int m, int e, int64_t row, const float *x, int64_t cols,
                                int lane) const
    {
        float acc;
        lowp_row_dot<1>(&tab[m * n_local + e], row, x, cols, 1, lane, &acc);
        return acc;
    }
};

int kcu_lowp_expert_table(const struct moe_expert *ex, int n_local, int hidden, int inter,
                          struct lowp_w *h)
{
    for (int e = 0; e < n_local; e++) {
        const struct moe_expert *x = &ex[e];
        if (x->gate.rows != inter || x->gate.cols != hidden || x->up.rows != inter ||
            x->up.cols != hidden || x->down.rows != hidden || x->down.cols != inter ||
            lowp_desc(&x->gate, &h[e]) < 0 || lowp_desc(&x->up, &h[n_local + e]) < 0 ||
            lowp_desc(&x->down, &h[2 * n_local + e]) < 0)
            return -EINVAL;
    }
    return 0;
}

int kcu_lowp_experts(struct cuda_ctx *c, const struct lowp_w *tab, const struct moe_warp_args *a)
{
    if (a->n_tok == 0 || a->n_local == 0)
        return 0;
    return moe_warp_run(c, lowp_rd{ tab, a->n_local }, *a, 32 * LOWP_WARPS);
}

int kcu_lowp_moe(struct cuda_ctx *c, const struct moe_args *a)
{
    const size_t nt = 3 * (size_t) a->n_local;
    struct lowp_w *h = (struct lowp_w *) calloc(nt, sizeof(*h));
    int r = h ? kcu_lowp_expert_table(a->experts, a->n_local, a->hidden, a->inter, h) : -ENOMEM;

    // FP8 on the tensor cores, but on the FP32 op path (c->exact)
    const bool mma = r == 0 && !c->exact && a->hidden % 16 == 0 && a->inter % 16 == 0 &&
                     kcu_fp8_mma_ok(h, nt);
    const size_t act_bytes = moe_warp_act_bytes(a->n_tok, a->top_k, a->inter);
    if (r == 0)
        r = cuda_ws_ensure(c, mma ? kcu_fp8_moe_ws(a->n_tok, a->top_k, a->hidden, a->inter,
                                                   a->n_local)
                                  : act_bytes);
    if (r < 0) {
        free(h);
        return r;
    }
    cuda_stage_reset(c);
    cuda_ws_reset(c);
    const struct lowp_w *dt = (const struct lowp_w *) cuda_stage(c, h, nt * sizeof(*h));
    const int br = h[0].blk_rows, bc = h[0].blk_cols;
    free(h);
    if (mma) {
        if (!dt)
            return -ENOMEM;
        const struct kcu_moe_args ma = { a->n_tok, a->top_k, a->hidden, a->inter,
                                         a->expert_first, a->n_local, a->limit, a->ids,
                                         a->weights, a->x, KDT_F32, a->out, NULL };
        return kcu_fp8_moe(c, dt, br, bc, &ma);
    }
    float *act = (float *) cuda_ws_take(c, act_bytes);
    if (!dt || !act)
        return -ENOMEM;
    const struct moe_warp_args ma = { a->x, a->n_tok, a->hidden, a->inter, a->top_k, a->ids,
                                      a->weights, a->expert_first, a->n_local, a->limit, act,
                                      a->out };
    return kcu_lowp_experts(c, dt, &ma);
}
