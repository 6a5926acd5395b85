// norm.cu - Gemma RMSNorm y = x * rsqrt(mean(x^2) + eps) * (1 + w), one block per row, for
// the op (FP32 in and out, y may alias x) and for the fused halves (BF16 and/or FP32 out);
// the SwiGLU of a fused [gate | up] projection.
#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"

static inline __device__ float norm_w(int f32, const void *w, int i)
{
    return f32 ? ((const float *) w)[i] : bf16_to_f32(((const uint16_t *) w)[i]);
}

static __global__ void rmsnorm_kernel(const float *x, int f32, const void *w, int dim, float eps,
                                      float *y32, bf16 *y16)
{
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] * r * (1.0f + norm_w(f32, w, i));
        if (y32)
            y32[row * dim + i] = v;
        if (y16)
            y16[row * dim + i] = __float2bfloat16_rn(v);
    }
}

int kcu_rmsnorm(struct cuda_ctx *c, const float *x, const struct bweight *w, int rows, int dim,
                float eps, bf16 *y16, float *y32)
{
    const void *d;
    const uint8_t *s;
    if (cuda_weight_dev(w, &d, &s) < 0 || (w->fmt != WFMT_BF16 && w->fmt != WFMT_F32))
        return -EINVAL;
    if (rows == 0)
        return 0;
    rmsnorm_kernel<<<rows, dim >= 1024 ? 256 : 128, 0, c->stream>>>(x, w->fmt == WFMT_F32, d, dim,
                                                                     eps, y32, y16);
    return CUDA_LAUNCH_CHECK();
}

int kcuda_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                  float eps, float *y)
{
    return kcu_rmsnorm(cuda_ctx_of(be), x, w, rows, dim, eps, NULL, y);
}

static __global__ void swiglu_fused_kernel(const bf16 *gu, int64_t rows, int inter, float limit,
                                           bf16 *out)
{
    const int64_t idx = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * inter)
        return;
    const int64_t r = idx / inter;
    const int j = (int) (idx % inter);
    const float g = __bfloat162float(gu[r * 2 * inter + j]);
    const float u = __bfloat162float(gu[r * 2 * inter + inter + j]);
    out[idx] = __float2bfloat16_rn(swiglu1(g, u, limit));
}

int kcu_swiglu_fused(struct cuda_ctx *c, const bf16 *gu, int rows, int inter, float limit,
                     bf16 *out)
{
    const size_t n = (size_t) rows * inter;
    if (n == 0)
        return 0;
    swiglu_fused_kernel<<<cuda_blocks(n, 256), 256, 0, c->stream>>>(gu, rows, inter, limit, out);
    return CUDA_LAUNCH_CHECK();
}
