// norm.cu - Gemma RMSNorm y = x * rsqrt(mean(x^2) + eps) * (1 + w), one block per row, for
// the op (FP32 in and out, y may alias x) and for the fused halves (BF16 and/or FP32 out);
// the SwiGLU of a fused [gate | up] projection, and for few rows that projection with the
// SwiGLU in its epilogue (kcu_gu_swiglu).
#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "mma.cuh"

static inline __device__ float norm_w(int f32, const void *w, int i)
{
    return f32 ? ((const float *) w)[i] : bf16_to_f32(((const uint16_t *) w)[i]);
}

static __global__ void rmsnorm_kernel(const float *x, int f32, const void *w, int dim, float eps,
                                      float *y32, bf16 *y16)
{
    PDL_WAIT();
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    PDL_TRIGGER();
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
    cuda_launch(c, rmsnorm_kernel, rows,
                dim >= 1024 ? 256 : 128, 0, x, w->fmt == WFMT_F32, d, dim, eps, y32, y16);
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
    PDL_WAIT();
    PDL_TRIGGER();
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
    cuda_launch(c, swiglu_fused_kernel, cuda_blocks(n, 256), 256, 0, gu, rows, inter, limit, out);
    return CUDA_LAUNCH_CHECK();
}

// sum over 8 BF16 pairs of two 16-byte words, FP32
static __device__ __forceinline__ float dot8_bf16(const uint4 &a, const uint4 &b)
{
    const uint32_t wa[4] = { a.x, a.y, a.z, a.w }, wb[4] = { b.x, b.y, b.z, b.w };
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
        s += __uint_as_float(wa[i] << 16) * __uint_as_float(wb[i] << 16) +
             __uint_as_float(wa[i] & 0xffff0000u) * __uint_as_float(wb[i] & 0xffff0000u);
    return s;
}

// act[t, j] = swiglu(gate[j] · x[t], up[j] · x[t]) from the FP32 sums: a warp per output
// column j (gate row j and up row inter + j of gu), lanes over k, 16 bytes a load; the
// block's tokens are 8 rows of x (blockIdx.y), each weight word used for all of them.
static __global__ void gu_swiglu_kernel(const bf16 *gu, const bf16 *x, int rows, int hidden,
                                        int inter, float limit, bf16 *act)
{
    PDL_WAIT();
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * KCU_GU_TOKENS, nt = min(KCU_GU_TOKENS, rows - t0);
    if (j >= inter)
        return;
    const bf16 *wg = gu + (int64_t) j * hidden, *wu = gu + (int64_t) (inter + j) * hidden;
    const bf16 *xb = x + (int64_t) t0 * hidden;
    float g[KCU_GU_TOKENS], u[KCU_GU_TOKENS];
#pragma unroll
    for (int t = 0; t < KCU_GU_TOKENS; t++)
        g[t] = u[t] = 0.0f;
    for (int k = lane * 8; k < hidden; k += 256) {
        const uint4 a = ldg16(wg + k), b = ldg16(wu + k);
#pragma unroll
        for (int t = 0; t < KCU_GU_TOKENS; t++) {
            if (t >= nt)
                break;
            const uint4 xv = *(const uint4 *) (xb + (int64_t) t * hidden + k);
            g[t] += dot8_bf16(a, xv);
            u[t] += dot8_bf16(b, xv);
        }
    }
    PDL_TRIGGER();
#pragma unroll
    for (int t = 0; t < KCU_GU_TOKENS; t++) {
        if (t >= nt)
            break;
        const float gs = warp_sum(g[t]), us = warp_sum(u[t]);
        if (lane == t)
            act[(int64_t) (t0 + t) * inter + j] = __float2bfloat16_rn(swiglu1(gs, us, limit));
    }
}

bool kcu_gu_swiglu_ok(int rows, int hidden)
{
    return rows > 0 && rows <= KCU_GU_ROWS && hidden % 8 == 0;
}

int kcu_gu_swiglu(struct cuda_ctx *c, const bf16 *gu, const bf16 *x, int rows, int hidden,
                  int inter, float limit, bf16 *act)
{
    const int warps = 4;

    if (!kcu_gu_swiglu_ok(rows, hidden))
        return -EINVAL;
    if (inter == 0)
        return 0;
    dim3 grid(cuda_blocks((size_t) inter, warps), (rows + KCU_GU_TOKENS - 1) / KCU_GU_TOKENS);
    cuda_launch(c, gu_swiglu_kernel, grid, warps * 32, 0, gu, x, rows, hidden, inter, limit, act);
    return CUDA_LAUNCH_CHECK();
}
