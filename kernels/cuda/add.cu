// add.cu - residual add y += x.
#include "common.cuh"
#include "cuda.h"

static __global__ void add_kernel(float *y, const float *x, size_t n)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const size_t idx = (size_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n)
        y[idx] += x[idx];
}

int kcuda_add(struct backend *be, float *y, const float *x, size_t n)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (n == 0)
        return 0;
    cuda_launch(c, add_kernel, cuda_blocks(n, 256), 256, 0, y, x, n);
    return CUDA_LAUNCH_CHECK();
}
