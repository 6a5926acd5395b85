// block.cu - the two fused halves of a decoder layer (backend.h attn_block / ffn_block):
// BF16 activations between their kernels, FP32 residual stream at the interface.
//
// attention half (3-4 kernels + 2 GEMMs):
//   rmsnorm(x) -> a (BF16);  [q | k | v | g] = a · W_qkvg (one cuBLASLt GEMM over the
//   fused weight);  qkv_prep: q/k norm, RoPE, k/v to the cache;  attention (flash) with
//   the sigmoid gate on output;  x += att · W_oᵀ (cuBLASLt, beta = 1 into x) or out = ...
// FFN half, dense:  rmsnorm -> a;  [gate | up] = a · W_gu;  swiglu;  x += act · W_downᵀ
//   (up to KCU_GU_ROWS rows the gate+up projection and SwiGLU are one kernel, norm.cu).
// FFN half, MoE:    rmsnorm -> a (BF16 for the experts, FP32 for the router as the
//   checkpoint asks, need_fp32_gate);  router: logits = a32 · W_routerᵀ and the top-k in
//   one kernel up to KCU_ROUTER_GEMV_ROWS rows, else an FP32 GEMM and the router kernel;
//   shared expert as the dense MLP into x (or out);  routed experts added in: MXFP4 and
//   NVFP4 on tensor cores (moe.cu) and FP8 on tensor cores (fp8mma.cu: gate+up, down with
//   the combine in its epilogue up to KCU_ROUTER_GEMV_ROWS rows) from the BF16
//   activations; FP8 whose scale blocks the tensor path cannot take one warp per output
//   element (lowp.cu) from the FP32 ones.
//
// prepare fuses the parts' device copies (QKV + gate rows, gate + up rows) into one
// buffer that the parts then borrow, uploads the rotary table and router bias, and builds
// the layer's table of expert pointers (MXFP4, NVFP4) or descriptors (FP8): done once at
// load for every layer, so that nothing a step launches stages a table (graph capture).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"

struct attn_priv {
    bf16 *qkvg;                 // [rq + rk + rv + rg, hidden]
    int rq, rk, rv, rg;
    float *inv_freq;            // device [rotary / 2]
    int rotary;
};

struct ffn_priv {
    bf16 *gu;                   // [2 * inter, hidden] or NULL
    float *router32;            // device FP32 router, owned unless the checkpoint's is F32
    bool router_owned;
    float *bias;                // device [n_experts] or NULL
    const uint8_t **tab;        // device [6][n_local] expert pointers (MXFP4, NVFP4 experts)
    bool nvfp4;                 // tab holds NVFP4 tiles (mx4.h nv4_*)
    struct lowp_w *ltab;        // device [3][n_local] descriptors (FP8 experts)
    int fp8_br, fp8_bc;         // > 0: FP8 experts on tensor cores, their scale blocks
};

static bool is_bf16(const struct bweight *w)
{
    return w && w->fmt == WFMT_BF16 && w->priv;
}

static bool is_norm(const struct bweight *w)
{
    return w && (w->fmt == WFMT_BF16 || w->fmt == WFMT_F32) && w->priv;
}

// Rows of parts[] (BF16, same cols) copied into one new buffer; the parts then borrow it.
static int fuse_rows(struct cuda_ctx *c, struct bweight *const *parts, int n, bf16 **ret)
{
    size_t rows = 0, off = 0;
    const int64_t cols = parts[0]->cols;
    bf16 *f = NULL;

    for (int i = 0; i < n; i++) {
        if (!is_bf16(parts[i]) || parts[i]->cols != cols)
            return -ENOTSUP;
        rows += (size_t) parts[i]->rows;
    }
    CU_TRY(cudaMalloc((void **) &f, rows * cols * sizeof(bf16)));
    for (int i = 0; i < n; i++) {
        struct cuda_weight *cw = (struct cuda_weight *) parts[i]->priv;
        const size_t bytes = (size_t) parts[i]->rows * cols * sizeof(bf16);
        int r = err_from_cuda(cudaMemcpyAsync(f + off, cw->data, bytes, cudaMemcpyDeviceToDevice,
                                              c->stream));
        if (r < 0) {
            cudaStreamSynchronize(c->stream);
            cudaFree(f);
            return r;
        }
        off += (size_t) parts[i]->rows * cols;
    }
    CU_TRY(cudaStreamSynchronize(c->stream));
    off = 0;
    for (int i = 0; i < n; i++) {
        struct cuda_weight *cw = (struct cuda_weight *) parts[i]->priv;
        if (!cw->borrowed)
            cudaFree(cw->data);
        cw->data = f + off;
        cw->borrowed = true;
        off += (size_t) parts[i]->rows * cols;
    }
    *ret = f;
    return 0;
}

// A fused buffer handed back to the parts that borrow it: the first part (where it starts)
// owns it from now on, freed with the weights.  A layer whose other half cannot be fused
// (-ENOTSUP) is released at once and keeps using its weights in the op script.
static void fused_return(bf16 *f, struct bweight *const *parts, int n)
{
    for (int i = 0; f && i < n; i++) {
        struct cuda_weight *cw = parts[i] ? (struct cuda_weight *) parts[i]->priv : NULL;
        if (cw && cw->data == f)
            cw->borrowed = false;
    }
}

int kcuda_attn_prepare(struct backend *be, struct attn_weights *w)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    struct bweight *parts[4] = { w->wq, w->wk, w->wv, w->wg };
    const int n = w->wg ? 4 : 3;
    int r;

    if (c->exact || !is_norm(w->in_norm) || !is_bf16(w->wo) || (w->q_norm && !is_norm(w->q_norm)) ||
        (w->k_norm && !is_norm(w->k_norm)))
        return -ENOTSUP;
    for (int i = 0; i < n; i++)
        if (!is_bf16(parts[i]))
            return -ENOTSUP;
    struct attn_priv *p = (struct attn_priv *) calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->rq = (int) w->wq->rows;
    p->rk = (int) w->wk->rows;
    p->rv = (int) w->wv->rows;
    p->rg = w->wg ? (int) w->wg->rows : 0;
    r = fuse_rows(c, parts, n, &p->qkvg);
    if (r == 0 && w->freqs && w->freqs->rotary_dims > 0) {
        p->rotary = w->freqs->rotary_dims;
        const size_t b = sizeof(float) * (p->rotary / 2);
        r = err_from_cuda(cudaMalloc((void **) &p->inv_freq, b));
        if (r == 0)
            r = err_from_cuda(cudaMemcpy(p->inv_freq, w->freqs->inv_freq, b, cudaMemcpyHostToDevice));
    }
    if (r < 0) {
        cudaFree(p->inv_freq);
        free(p);        // a fused buffer stays with the parts (released with them)
        return r;
    }
    w->priv = p;
    return 0;
}

void kcuda_attn_release(struct backend *be, struct attn_weights *w)
{
    struct attn_priv *p = (struct attn_priv *) w->priv;
    if (!p)
        return;
    (void) cuda_ctx_of(be);     // free on the backend's device
    struct bweight *parts[4] = { w->wq, w->wk, w->wv, w->wg };
    fused_return(p->qkvg, parts, 4);
    cudaFree(p->inv_freq);
    free(p);
    w->priv = NULL;
}

static __global__ void bf16_to_f32_kernel(const bf16 *x, float *y, size_t n)
{
    const size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = __bfloat162float(x[i]);
}

int kcuda_ffn_prepare(struct backend *be, struct ffn_weights *w)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    int r = 0;

    if (c->exact || !is_norm(w->post_norm))
        return -ENOTSUP;
    if (w->gate && (!is_bf16(w->gate) || !is_bf16(w->up) || !is_bf16(w->down)))
        return -ENOTSUP;
    if (w->router && (!w->router->priv || (w->router->fmt != WFMT_BF16 && w->router->fmt != WFMT_F32)))
        return -ENOTSUP;
    // the routed experts: all MXFP4 or all NVFP4 (moe.cu), or all FP8 (lowp.cu)
    const int efmt = w->router && w->n_local > 0 ? w->experts[0].gate.fmt : WFMT_MXFP4;
    const bool lowp = w->router && w->n_local > 0 && efmt == WFMT_FP8;
    for (int e = 0; w->router && e < w->n_local; e++) {
        const struct moe_expert *x = &w->experts[e];
        const bool ok = (efmt == WFMT_MXFP4 || efmt == WFMT_NVFP4 || efmt == WFMT_FP8) &&
                        x->gate.fmt == efmt && x->up.fmt == efmt && x->down.fmt == efmt;
        if (!ok || !x->gate.priv || !x->up.priv || !x->down.priv)
            return -ENOTSUP;
    }
    struct ffn_priv *p = (struct ffn_priv *) calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->nvfp4 = efmt == WFMT_NVFP4;
    if (w->gate) {
        struct bweight *gu[2] = { w->gate, w->up };
        r = fuse_rows(c, gu, 2, &p->gu);
    }
    if (r == 0 && w->router) {
        const struct cuda_weight *rw = (const struct cuda_weight *) w->router->priv;
        const size_t n = (size_t) w->router->rows * w->router->cols;
        if (w->router->fmt == WFMT_F32) {
            p->router32 = (float *) rw->data;
        } else {
            p->router_owned = true;
            r = err_from_cuda(cudaMalloc((void **) &p->router32, n * sizeof(float)));
            if (r == 0) {
                bf16_to_f32_kernel<<<cuda_blocks(n, 256), 256, 0, c->stream>>>(
                    (const bf16 *) rw->data, p->router32, n);
                r = CUDA_LAUNCH_CHECK();
            }
        }
        if (r == 0 && w->router_bias) {
            const size_t b = sizeof(float) * (size_t) w->n_experts;
            r = err_from_cuda(cudaMalloc((void **) &p->bias, b));
            if (r == 0)
                r = err_from_cuda(cudaMemcpy(p->bias, w->router_bias, b, cudaMemcpyHostToDevice));
        }
        if (r == 0 && lowp) {
            const size_t nt = 3 * (size_t) w->n_local;
            struct lowp_w *h = (struct lowp_w *) calloc(nt, sizeof(*h));
            r = h ? kcu_lowp_expert_table(w->experts, w->n_local, (int) w->router->cols,
                                          w->moe_inter, h)
                  : -ENOMEM;
            if (r == 0 && kcu_fp8_mma_ok(h, nt) && w->moe_inter % 16 == 0 &&
                w->router->cols % 16 == 0) {
                p->fp8_br = h[0].blk_rows;
                p->fp8_bc = h[0].blk_cols;
            }
            if (r == 0)
                r = err_from_cuda(cudaMalloc((void **) &p->ltab, nt * sizeof(*h)));
            if (r == 0)
                r = err_from_cuda(cudaMemcpy(p->ltab, h, nt * sizeof(*h), cudaMemcpyHostToDevice));
            free(h);
        } else if (r == 0 && w->n_local > 0) {
            const size_t nt = 6 * (size_t) w->n_local;
            const uint8_t **h = (const uint8_t **) malloc(nt * sizeof(void *));
            r = h ? 0 : -ENOMEM;
            if (h)
                kcu_expert_table(w->experts, w->n_local, h);
            if (r == 0)
                r = err_from_cuda(cudaMalloc((void **) &p->tab, nt * sizeof(void *)));
            if (r == 0)
                r = err_from_cuda(cudaMemcpy(p->tab, h, nt * sizeof(void *), cudaMemcpyHostToDevice));
            free(h);
        }
        if (r == 0)
            r = err_from_cuda(cudaStreamSynchronize(c->stream));
    }
    if (r < 0) {
        if (p->router_owned)
            cudaFree(p->router32);
        cudaFree(p->bias);
        cudaFree(p->tab);
        cudaFree(p->ltab);
        free(p);
        return r;
    }
    w->priv = p;
    return 0;
}

void kcuda_ffn_release(struct backend *be, struct ffn_weights *w)
{
    struct ffn_priv *p = (struct ffn_priv *) w->priv;
    if (!p)
        return;
    (void) cuda_ctx_of(be);     // free on the backend's device
    struct bweight *gu[2] = { w->gate, w->up };
    fused_return(p->gu, gu, 2);
    if (p->router_owned)
        cudaFree(p->router32);
    cudaFree(p->bias);
    cudaFree(p->tab);
    cudaFree(p->ltab);
    free(p);
    w->priv = NULL;
}

static const void *wdev(const struct bweight *w)
{
    return w ? ((const struct cuda_weight *) w->priv)->data : NULL;
}

static size_t a256(size_t n)
{
    return (n + 255) & ~(size_t) 255;
}

int kcuda_attn_block(struct backend *be, const struct attn_block_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const struct attn_priv *p = (const struct attn_priv *) a->w->priv;
    const int H = a->hidden, hd = a->head_dim;
    const int q_dim = a->n_heads * hd, kv_dim = a->n_kv_heads * hd;
    const int ld = q_dim + 2 * kv_dim + (p ? p->rg : 0);
    int r;

    if (!p || p->rq != q_dim || p->rk != kv_dim || p->rv != kv_dim ||
        (p->rg && p->rg != a->n_heads) || !kcu_attention_ok(a->n_heads, a->n_kv_heads, hd))
        return -ENOTSUP;
    if (a->n_tok == 0)
        return 0;
    const int rows = cuda_rows(c, a->n_tok);
    struct step_arrays sa = {};
    const bool in_step = cuda_step_arrays(c, a->n_tok, a->n_seqs, a->pos, a->slots,
                                          a->seq_tok_start, a->seq_pos0, a->block_table_off,
                                          a->block_tables, &sa);

    r = cuda_ws_ensure(c, a256((size_t) rows * H * 2) + a256((size_t) rows * ld * 2) +
                          2 * a256((size_t) rows * q_dim * 2) +
                          kcu_attention_ws(c, rows + a->n_seqs, a->n_heads, hd));
    if (r < 0)
        return r;
    cuda_stage_reset(c);
    cuda_ws_reset(c);
    // a released block would be an illegal address in the kernel: checked on the host, once
    // per step for the step area's tables (each table, window and pool), else per call
    int bad_seq = -1, max_tab = 0;
    r = in_step ? sg_blocks_once(&c->blocks, a->block_tables, a->block_table_off,
                                 a->seq_tok_start, a->seq_pos0, a->n_seqs, a->window,
                                 a->kv->block_size, a->kv->n_blocks, &bad_seq)
                : sg_blocks_check(a->block_tables, a->block_table_off, a->seq_tok_start,
                                  a->seq_pos0, a->n_seqs, a->window, a->kv->block_size,
                                  a->kv->n_blocks, &max_tab, &bad_seq);
    if (r < 0) {
        fprintf(stderr, "stepd-cuda: attention: sequence %d reads a released or out-of-pool KV block\n",
                bad_seq);
        return r;
    }
    if (!in_step) {
        if (c->capturing)
            return -EINVAL;     // a graph reads only the step area
        int32_t *ht = (int32_t *) malloc(sizeof(int32_t) * 4 * (size_t) (a->n_tok + a->n_seqs));
        if (!ht)
            return -ENOMEM;
        sa.n_tiles = kcu_attention_tiles(a->seq_tok_start, a->n_seqs, ht);
        sa.tiles = (const int32_t *) cuda_stage(c, ht, sizeof(int32_t) * 4 * sa.n_tiles);
        free(ht);
        sa.pos = (const int32_t *) cuda_stage(c, a->pos, sizeof(int32_t) * a->n_tok);
        sa.slots = (const int32_t *) cuda_stage(c, a->slots, sizeof(int32_t) * a->n_tok);
        sa.seq_start = (const int32_t *) cuda_stage(c, a->seq_tok_start,
                                                    sizeof(int32_t) * (a->n_seqs + 1));
        sa.pos0 = (const int32_t *) cuda_stage(c, a->seq_pos0, sizeof(int32_t) * a->n_seqs);
        sa.boff = (const int32_t *) cuda_stage(c, a->block_table_off, sizeof(int32_t) * a->n_seqs);
        sa.tables = (const int32_t *) cuda_stage(c, a->block_tables, sizeof(int32_t) * max_tab);
        if (!sa.tiles || !sa.pos || !sa.slots || !sa.seq_start || !sa.pos0 || !sa.boff ||
            !sa.tables)
            return -ENOMEM;
    }

    bf16 *a16 = (bf16 *) cuda_ws_take(c, (size_t) rows * H * 2);
    bf16 *qkvg = (bf16 *) cuda_ws_take(c, (size_t) rows * ld * 2);
    bf16 *q16 = (bf16 *) cuda_ws_take(c, (size_t) rows * q_dim * 2);
    bf16 *att = (bf16 *) cuda_ws_take(c, (size_t) rows * q_dim * 2);
    if (!a16 || !qkvg || !q16 || !att)
        return -ENOMEM;
    r = kcu_rmsnorm(c, a->x, a->w->in_norm, rows, H, a->eps, a16, NULL);
    if (r == 0)
        r = kcu_gemm(c, rows, ld, H, p->qkvg, KDT_BF16, a16, H, qkvg, KDT_BF16, ld, false);
    if (r < 0)
        return r;
    struct kcu_qkv_args qa = {};
    qa.qkvg = qkvg;
    qa.n_rows = rows;
    qa.n_heads = a->n_heads;
    qa.n_kv_heads = a->n_kv_heads;
    qa.head_dim = hd;
    qa.ld = ld;
    qa.q_norm = wdev(a->w->q_norm);
    qa.k_norm = wdev(a->w->k_norm);
    qa.norm_f32 = a->w->q_norm ? a->w->q_norm->fmt == WFMT_F32
                               : a->w->k_norm ? a->w->k_norm->fmt == WFMT_F32 : 0;
    qa.eps = a->eps;
    qa.rotary = p->inv_freq ? p->rotary : 0;
    qa.inv_freq = p->inv_freq;
    qa.pos = sa.pos;
    qa.slots = sa.slots;
    qa.kv = a->kv;
    qa.q16 = q16;
    qa.att = att;           // zeroed by qkv_prep: rows no tile covers (padding) stay 0
    r = kcu_qkv_prep(c, &qa);
    if (r < 0)
        return r;
    struct kcu_attn_args fa = {};
    fa.q = q16;
    fa.qt = KDT_BF16;
    fa.out = att;
    fa.ot = KDT_BF16;
    fa.gate = p->rg ? qkvg + q_dim + 2 * kv_dim : NULL;
    fa.gate_ld = ld;
    fa.n_heads = a->n_heads;
    fa.n_kv_heads = a->n_kv_heads;
    fa.head_dim = hd;
    fa.window = a->window;
    fa.scale = a->scale;
    fa.kv = a->kv;
    fa.seq_start = sa.seq_start;
    fa.pos0 = sa.pos0;
    fa.tables = sa.tables;
    fa.table_shift = sa.table_shift;
    fa.boff = sa.boff;
    fa.tiles = sa.tiles;
    fa.n_tiles = sa.n_tiles;
    fa.n_tiles_real = sa.n_tiles_real;
    fa.n_tok = rows;
    r = kcu_attention(c, &fa);
    if (r < 0)
        return r;
    return kcu_gemm(c, rows, H, q_dim, wdev(a->w->wo), KDT_BF16, att, q_dim,
                    a->out ? a->out : a->x, KDT_F32, H, a->out == NULL);
}

int kcuda_ffn_block(struct backend *be, const struct ffn_block_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const struct ffn_weights *w = a->w;
    const struct ffn_priv *p = (const struct ffn_priv *) w->priv;
    const int H = a->hidden, I = w->gate ? w->inter : 0;
    const bool moe = w->router != NULL, lowp = p && p->ltab, fp8 = lowp && p->fp8_bc > 0;
    const int E = moe ? w->n_experts : 0, K = moe ? a->top_k : 0;
    int r;

    if (!p || (w->gate && !p->gu) || (moe && !p->router32))
        return -ENOTSUP;
    if (a->n_tok == 0)
        return 0;
    const int rows = cuda_rows(c, a->n_tok);
    // graph padding: rows past the step's real tokens route nowhere; decided for every
    // launch, not by the rows of the capturing step (a graph captured full is replayed
    // with padding)
    const int32_t *n_real = sg_mask_padding(c->map.valid, c->map.n_tok, a->n_tok) ? c->sd.hdr
                                                                                  : NULL;
    float *y = a->out ? a->out : a->x;
    const bool acc = a->out == NULL;

    r = cuda_ws_ensure(c, a256((size_t) rows * H * 2) + a256((size_t) rows * H * 4) +
                          a256((size_t) rows * 2 * I * 2) + a256((size_t) rows * I * 2) +
                          a256((size_t) rows * E * 4) + 2 * a256((size_t) rows * K * 4) +
                          (fp8 ? kcu_fp8_moe_ws(rows, K, H, w->moe_inter, w->n_local)
                           : lowp ? a256(moe_warp_act_bytes(rows, K, w->moe_inter))
                           : moe ? kcu_moe_ws(rows, K, H, w->moe_inter, w->n_local) : 0));
    if (r < 0)
        return r;
    cuda_ws_reset(c);
    bf16 *a16 = (bf16 *) cuda_ws_take(c, (size_t) rows * H * 2);
    float *a32 = moe ? (float *) cuda_ws_take(c, (size_t) rows * H * 4) : NULL;
    if (!a16 || (moe && !a32))
        return -ENOMEM;
    r = kcu_rmsnorm(c, a->x, w->post_norm, rows, H, a->eps, a16, a32);
    if (r < 0)
        return r;
    int32_t *ids = NULL;
    float *wts = NULL;
    struct moe_plan_args plan = {};
    const bool routed = moe && w->n_local > 0;
    if (moe) {
        ids = (int32_t *) cuda_ws_take(c, (size_t) rows * K * 4);
        wts = (float *) cuda_ws_take(c, (size_t) rows * K * 4);
        if (!ids || !wts)
            return -ENOMEM;
        if (rows <= KCU_ROUTER_GEMV_ROWS && kcu_moe_plan_smem(w->n_local) <= 48 * 1024) {
            // decode: GEMV, selection and the MoE plan in one kernel
            if (routed && (!lowp || fp8)) {
                const struct kcu_moe_args pa_for = { rows, K, H, w->moe_inter, w->expert_first,
                                                     w->n_local, 0.0f, ids };
                r = kcu_moe_plan_take(c, &pa_for, &plan);
                if (r < 0)
                    return r;
            }
            r = kcu_router_gemv(c, a32, p->router32, H, p->bias, rows, n_real, E, K, a->renorm,
                                a->route_scale, ids, wts, plan.n_slots > 0 ? &plan : NULL);
        } else {
            float *logits = (float *) cuda_ws_take(c, (size_t) rows * E * 4);
            if (!logits)
                return -ENOMEM;
            r = kcu_gemm(c, rows, E, H, p->router32, KDT_F32, a32, H, logits, KDT_F32, E, false);
            if (r == 0)
                r = kcu_router(c, logits, p->bias, rows, n_real, E, K, a->renorm,
                               a->route_scale, ids, wts);
        }
        if (r < 0)
            return r;
    }
    if (w->gate) {
        bf16 *gu = (bf16 *) cuda_ws_take(c, (size_t) rows * 2 * I * 2);
        bf16 *act = (bf16 *) cuda_ws_take(c, (size_t) rows * I * 2);
        if (!gu || !act)
            return -ENOMEM;
        if (kcu_gu_swiglu_ok(rows, H)) {
            // decode: the gate+up projection with SwiGLU in its epilogue, one node
            r = kcu_gu_swiglu(c, p->gu, a16, rows, H, I, a->limit_dense, act);
        } else {
            r = kcu_gemm(c, rows, 2 * I, H, p->gu, KDT_BF16, a16, H, gu, KDT_BF16, 2 * I, false);
            if (r == 0)
                r = kcu_swiglu_fused(c, gu, rows, I, a->limit_dense, act);
        }
        if (r == 0)
            r = kcu_gemm(c, rows, H, I, wdev(w->down), KDT_BF16, act, I, y, KDT_F32, H, acc);
        if (r < 0)
            return r;
    } else if (!acc) {
        r = err_from_cuda(cudaMemsetAsync(y, 0, (size_t) rows * H * 4, c->stream));
        if (r < 0)
            return r;
    }
    if (!routed)
        return 0;
    if (fp8) {
        // BF16 activations as MXFP4's
        const struct kcu_moe_args ma = { rows, K, H, w->moe_inter, w->expert_first,
                                         w->n_local, a->limit_routed, ids, wts, a16, KDT_BF16,
                                         y, plan.n_slots > 0 ? &plan : NULL };
        return kcu_fp8_moe(c, p->ltab, p->fp8_br, p->fp8_bc, &ma);
    }
    if (lowp) {
        // FP32 activations as the op path's: the router's a32
        float *act = (float *) cuda_ws_take(c, moe_warp_act_bytes(rows, K, w->moe_inter));
        if (!act)
            return -ENOMEM;
        const struct moe_warp_args la = { a32, rows, H, w->moe_inter, K, ids, wts,
                                          w->expert_first, w->n_local, a->limit_routed, act, y };
        return kcu_lowp_experts(c, p->ltab, &la);
    }
    const struct kcu_moe_w mw = { p->tab, p->tab + w->n_local, p->tab + 2 * w->n_local,
                                  p->tab + 3 * w->n_local, p->tab + 4 * w->n_local,
                                  p->tab + 5 * w->n_local, p->nvfp4 };
    const struct kcu_moe_args ma = { rows, K, H, w->moe_inter, w->expert_first, w->n_local,
                                     a->limit_routed, ids, wts, a16, KDT_BF16, y,
                                     plan.n_slots > 0 ? &plan : NULL };
    return kcu_moe(c, &mw, &ma);
}
