// attention.cu - paged attention over the KV block pool: one block of threads per
// (query token, head).  Keys tau in [lo, t] (lo = 0 full causal, t - window + 1 sliding),
// looked up through the sequence's block table; online softmax in FP32; GQA with
// contiguous grouping (kv head = h / (n_heads / n_kv_heads)).  Threads split head_dim.
#include <math.h>

#include "common.cuh"
#include "cuda.h"

static inline __device__ float kv_at(const void *pool, int f32, int64_t idx)
{
    return f32 ? ((const float *) pool)[idx] : bf16_to_f32(((const uint16_t *) pool)[idx]);
}

static __global__ void attention_kernel(const float *q, float *out, int n_heads, int n_kv_heads,
                                        int head_dim, float scale, int window, const void *kc,
                                        const void *vc, int f32, int block_size, int n_seqs,
                                        const int32_t *tok_start, const int32_t *pos0,
                                        const int32_t *tables, const int32_t *table_off)
{
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
        const int64_t base = ((int64_t) blk * block_size + tau % block_size) * row + (int64_t) kvh * head_dim;
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

int kcuda_attention(struct backend *be, const struct attn_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 || a->head_dim > 256)
        return -EINVAL;
    if (a->n_tok == 0)
        return 0;
    int max_tab = 0;
    for (int s = 0; s < a->n_seqs; s++) {
        const int64_t last = a->seq_pos0[s] + (a->seq_tok_start[s + 1] - a->seq_tok_start[s]) - 1;
        const int end = a->block_table_off[s] + (int) (last / a->kv->block_size) + 1;
        if (end > max_tab)
            max_tab = end;
        for (int b = (int) ((a->window > 0 && last - a->window + 1 > 0 ? last - a->window + 1 : 0)
                            / a->kv->block_size);
             b <= last / a->kv->block_size; b++) {
            const int32_t id = a->block_tables[a->block_table_off[s] + b];
            if (id < 0 || id >= a->kv->n_blocks)
                return -EINVAL;     // a needed block is released or outside the pool
        }
    }
    cuda_stage_reset(c);
    const int32_t *dstart = (const int32_t *) cuda_stage(c, a->seq_tok_start, sizeof(int32_t) * (a->n_seqs + 1));
    const int32_t *dpos0 = (const int32_t *) cuda_stage(c, a->seq_pos0, sizeof(int32_t) * a->n_seqs);
    const int32_t *dtab = (const int32_t *) cuda_stage(c, a->block_tables, sizeof(int32_t) * max_tab);
    const int32_t *doff = (const int32_t *) cuda_stage(c, a->block_table_off, sizeof(int32_t) * a->n_seqs);
    if (!dstart || !dpos0 || !dtab || !doff)
        return -ENOMEM;
    dim3 grid(a->n_tok, a->n_heads);
    attention_kernel<<<grid, 32, 0, c->stream>>>(a->q, a->out, a->n_heads, a->n_kv_heads, a->head_dim,
                                                 a->scale, a->window, a->kv->k, a->kv->v,
                                                 a->kv->dtype_f32, a->kv->block_size, a->n_seqs,
                                                 dstart, dpos0, dtab, doff);
    return CUDA_LAUNCH_CHECK();
}
