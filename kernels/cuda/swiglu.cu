// swiglu.cu - SwiGLU with the silu-then-clamp limit of docs/MODEL.md §2.4:
// act = min(silu(u), L) * clamp(w, -L, L) when L > 0, else silu(u) * w.
#include "common.cuh"
#include "cuda.h"

static __global__ void swiglu_kernel(const float *gate, const float *up, int64_t n, float limit, float *out)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t idx = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n)
        out[idx] = swiglu1(gate[idx], up[idx], limit);
}

int kcuda_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
                 float limit, float *out)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t total = (int64_t) n * dim;
    if (total == 0)
        return 0;
    cuda_launch(c, swiglu_kernel, cuda_blocks(total, 256), 256, 0, gate, up, total, limit, out);
    return CUDA_LAUNCH_CHECK();
}
