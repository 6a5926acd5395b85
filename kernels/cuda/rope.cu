// rope.cu - NeoX (half-split) rotary embedding on the first R dims of every head.
#include "common.cuh"
#include "cuda.h"

static __global__ void rope_kernel(float *x, int n_tok, int n_heads, int head_dim, const int32_t *pos,
                                   int rdims, const float *inv_freq)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int half = rdims / 2;
    const int64_t idx = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t) n_tok * n_heads * half)
        return;
    const int i = idx % half;
    const int64_t th = idx / half;            // token * n_heads + head
    const int t = (int) (th / n_heads);
    float *v = x + th * head_dim;
    const float phi = (float) pos[t] * inv_freq[i];
    float sn, cs;
    sincosf(phi, &sn, &cs);
    const float a = v[i], b = v[i + half];
    v[i] = a * cs - b * sn;
    v[i + half] = b * cs + a * sn;
}

int kcuda_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
               const int32_t *pos, const struct rope_freqs *f)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (f->rotary_dims <= 0 || f->rotary_dims > head_dim || (f->rotary_dims & 1))
        return -EINVAL;
    if (n_tok == 0)
        return 0;
    cuda_stage_reset(c);
    const int32_t *dpos = cuda_index(c, pos, (size_t) n_tok);
    const float *dfreq = (const float *) cuda_stage(c, f->inv_freq, sizeof(float) * (f->rotary_dims / 2));
    if (!dpos || !dfreq)
        return -ENOMEM;
    const size_t n = (size_t) n_tok * n_heads * (f->rotary_dims / 2);
    cuda_launch(c, rope_kernel, cuda_blocks(n, 256), 256, 0, x, n_tok, n_heads, head_dim, dpos,
                f->rotary_dims, dfreq);
    return CUDA_LAUNCH_CHECK();
}
