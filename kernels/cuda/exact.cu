// exact.cu - the FP32 op path of the CUDA backend (backend_cfg.mxfp4_exact): matmul, the
// routed experts and attention with FP32 activations, one warp per output element, the
// weights decoded per element (E2M1·2^k is exact in FP32).  Slow, simple, and the GPU's
// own oracle: a diagnostic for the tensor-core path (test/gpu compares both with the CPU).
#include <math.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "lowp.h"
#include "mx4.h"

// Weight element (o, i) of a [rows, cols] matrix as prepared (MXFP4: the mx4 tile layout,
// placed or not: mx4_matrix_placed).
static inline __device__ float weight_at(int fmt, const void *data, const uint8_t *scale,
                                         int64_t cols, int placed, int64_t o, int64_t i)
{
    if (fmt == WFMT_F32)
        return ((const float *) data)[o * cols + i];
    if (fmt == WFMT_BF16)
        return bf16_to_f32(((const uint16_t *) data)[o * cols + i]);
    int el;
    const int64_t off = mx4_word_offset(cols, o, i, &el);
    const int code = (int) mx4_code_as(*(const uint32_t *) ((const uint8_t *) data + off), el,
                                       placed);
    const int e = (int) mx4_scale_e8m0_as(scale[mx4_scale_offset(cols, o, i)], placed);
    return e == 0 ? 0.0f : ldexpf(k_e2m1[code], e - 127);
}

static inline __device__ float row_dot(int fmt, const void *w, const uint8_t *sc, int64_t rows,
                                       int64_t cols, int64_t o, const float *x, int lane)
{
    const int placed = fmt == WFMT_MXFP4 && mx4_matrix_placed(sc, rows, cols);
    float acc = 0.0f;
    for (int64_t i = lane; i < cols; i += 32)
        acc += weight_at(fmt, w, sc, cols, placed, o, i) * x[i];
    return warp_sum(acc);
}

static __global__ void matmul_exact_kernel(int fmt, const void *w, const uint8_t *scale,
                                           int64_t rows, int64_t cols, const float *x, int n,
                                           float *y)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= rows * n)
        return;
    const int64_t t = warp / rows, o = warp % rows;
    const float acc = row_dot(fmt, w, scale, rows, cols, o, x + t * cols, lane);
    if (lane == 0)
        y[t * rows + o] = acc;
}

int kcuda_matmul_exact(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const void *d;
    const uint8_t *s;
    if (cuda_weight_dev(w, &d, &s) < 0)
        return -EINVAL;
    if (n == 0)
        return 0;
    const size_t threads = (size_t) w->rows * n * 32;
    cuda_launch(c, matmul_exact_kernel, cuda_blocks(threads, 256), 256, 0, w->fmt, d, s, w->rows,
                w->cols, x, n, y);
    return CUDA_LAUNCH_CHECK();
}

// the row product of moe_warp_run over the table of kcu_expert_table: [6][n_local]
// (nibbles and scales of gate, up, down)
struct mx4_exact_rd {
    void *const *ptrs;
    int n_local, hidden, inter;
    __device__ float operator()(int m, int e, int64_t row, const float *x, int64_t cols,
                                int lane) const
    {
        return row_dot(WFMT_MXFP4, ptrs[2 * m * n_local + e],
                       (const uint8_t *) ptrs[(2 * m + 1) * n_local + e], m == 2 ? hidden : inter,
                       cols, row, x, lane);
    }
};

int kcuda_moe_exact(struct backend *be, const struct moe_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t nt = 6 * (size_t) a->n_local;
    const size_t act_bytes = moe_warp_act_bytes(a->n_tok, a->top_k, a->inter);
    const uint8_t **h = (const uint8_t **) calloc(nt, sizeof(void *));
    int r;

    if (!h)
        return -ENOMEM;
    kcu_expert_table(a->experts, a->n_local, h);
    r = cuda_ws_ensure(c, act_bytes);
    if (r < 0) {
        free(h);
        return r;
    }
    cuda_stage_reset(c);
    cuda_ws_reset(c);
    void *const *dp = (void *const *) cuda_stage(c, h, sizeof(void *) * nt);
    free(h);
    float *act = (float *) cuda_ws_take(c, act_bytes);
    if (!dp || !act)
        return -ENOMEM;
    const struct moe_warp_args ma = { a->x, a->n_tok, a->hidden, a->inter, a->top_k, a->ids,
                                      a->weights, a->expert_first, a->n_local, a->limit, act,
                                      a->out };
    return moe_warp_run(c, mx4_exact_rd{ dp, a->n_local, a->hidden, a->inter }, ma, 256);
}

// ---- attention: one block of threads per (query token, head), keys one at a time ----

static inline __device__ float kv_at(const void *pool, int f32, int64_t idx)
{
    return f32 ? ((const float *) pool)[idx] : bf16_to_f32(((const uint16_t *) pool)[idx]);
}

static __global__ void attention_exact_kernel(const float *q, float *out, int n_heads,
                                              int n_kv_heads, int head_dim, float scale,
                                              int window, const void *kc, const void *vc, int f32,
                                              int block_size, int n_seqs,
                                              const int32_t *tok_start, const int32_t *pos0,
                                              const int32_t *tables, const int32_t *table_off)
{
    PDL_WAIT();
    PDL_TRIGGER();
    __shared__ float red[32];
    const int tok = blockIdx.x, h = blockIdx.y;
    int s = 0;
    while (s + 1 < n_seqs && tok >= tok_start[s + 1])
        s++;
    const int64_t t = (int64_t) pos0[s] + (tok - tok_start[s]);
    const int64_t lo = (window > 0 && t - window + 1 > 0) ? t - window + 1 : 0;
    const int kvh = h / (n_heads / n_kv_heads);
    const float *qh = q + ((int64_t) tok * n_heads + h) * head_dim;
    const int32_t *table = tables + table_off[s];
    const int64_t row = (int64_t) n_kv_heads * head_dim;

    float m = -INFINITY, l = 0.0f;
    float acc[8];   // head_dim <= 8 * blockDim.x (blockDim.x = 32 -> head_dim <= 256)
    for (int j = 0; j < 8; j++)
        acc[j] = 0.0f;
    for (int64_t tau = lo; tau <= t; tau++) {
        const int32_t blk = table[tau / block_size];   // validated on the host
        const int64_t base = ((int64_t) blk * block_size + tau % block_size) * row +
                             (int64_t) kvh * head_dim;
        float d = 0.0f;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x)
            d += qh[i] * kv_at(kc, f32, base + i);
        d = block_sum(d, red) * scale;
        const float mn = fmaxf(m, d);
        const float corr = expf(m - mn), p = expf(d - mn);
        l = l * corr + p;
        for (int j = 0, i = threadIdx.x; i < head_dim; j++, i += blockDim.x)
            acc[j] = acc[j] * corr + p * kv_at(vc, f32, base + i);
        m = mn;
    }
    float *o = out + ((int64_t) tok * n_heads + h) * head_dim;
    for (int j = 0, i = threadIdx.x; i < head_dim; j++, i += blockDim.x)
        o[i] = acc[j] / l;
}

int kcuda_attention_exact(struct backend *be, const struct attn_args *a, const int32_t *dstart,
                          const int32_t *dpos0, const int32_t *dtab, const int32_t *doff)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (a->head_dim > 256)
        return -EINVAL;
    dim3 grid(a->n_tok, a->n_heads);
    cuda_launch(c, attention_exact_kernel, grid, 32, 0, a->q, a->out, a->n_heads, a->n_kv_heads,
                a->head_dim, a->scale, a->window, a->kv->k, a->kv->v, a->kv->dtype_f32,
                a->kv->block_size, a->n_seqs, dstart, dpos0, dtab, doff);
    return CUDA_LAUNCH_CHECK();
}
