// gate.cu - head-wise attention gate: o[t, h, :] *= sigmoid(g[t, h]).
#include "common.cuh"
#include "cuda.h"

static __global__ void head_gate_kernel(float *o, const float *g, int64_t n, int head_dim)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t idx = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n)
        return;
    const float z = g[idx / head_dim];
    o[idx] *= 1.0f / (1.0f + expf(-z));
}

int kcuda_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads, int head_dim)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t n = (int64_t) n_tok * n_heads * head_dim;
    if (n == 0)
        return 0;
    cuda_launch(c, head_gate_kernel, cuda_blocks(n, 256), 256, 0, o, g, n, head_dim);
    return CUDA_LAUNCH_CHECK();
}
