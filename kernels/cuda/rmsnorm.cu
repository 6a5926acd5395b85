// rmsnorm.cu - Gemma RMSNorm y = x * rsqrt(mean(x^2) + eps) * (1 + w), one block per row.
#include "common.cuh"
#include "cuda.h"

static __global__ void rmsnorm_kernel(const float *x, int fmt, const void *w, int dim, float eps, float *y)
{
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        y[row * dim + i] = xr[i] * r * (1.0f + weight_at(fmt, w, NULL, dim, 0, i));
}

int kcuda_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                  float eps, float *y)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const void *d;
    const uint8_t *s;
    if (cuda_weight_dev(w, &d, &s) < 0 || w->fmt == WFMT_MXFP4)
        return -EINVAL;
    if (rows == 0)
        return 0;
    rmsnorm_kernel<<<rows, 128, 0, c->stream>>>(x, w->fmt, d, dim, eps, y);
    return CUDA_LAUNCH_CHECK();
}
