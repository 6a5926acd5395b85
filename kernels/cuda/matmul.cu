// matmul.cu - y[n, rows] = x[n, cols] · Wᵀ for F32, BF16 and MXFP4 (W4A32: the weight is
// decoded per element, E2M1·2^k is exact in FP32) weights.  One warp per (token, row):
// the GEMV shape of decode; prefill reuses it (a tensor-core GEMM is future work).
#include "common.cuh"
#include "cuda.h"

static __global__ void matmul_kernel(int fmt, const void *w, const uint8_t *scale, int64_t rows,
                                     int64_t cols, const float *x, int n, float *y)
{
    const int64_t warp = ((int64_t) blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= rows * n)
        return;
    const int64_t t = warp / rows, o = warp % rows;
    const float *xt = x + t * cols;
    float acc = 0.0f;
    if (fmt == WFMT_MXFP4) {
        // lane handles one 32-element block at a time: 16 packed bytes + 1 scale byte
        const uint8_t *wr = (const uint8_t *) w + o * (cols / 2);
        const uint8_t *sr = scale + o * (cols / 32);
        for (int64_t b = lane; b < cols / 32; b += 32) {
            const float sc = ldexpf(1.0f, (int) sr[b] - 127);
            float part = 0.0f;
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = wr[b * 16 + j];
                part += k_e2m1[byte & 0xF] * xt[b * 32 + 2 * j];
                part += k_e2m1[byte >> 4] * xt[b * 32 + 2 * j + 1];
            }
            acc += part * sc;
        }
    } else {
        for (int64_t i = lane; i < cols; i += 32)
            acc += weight_at(fmt, w, NULL, cols, o, i) * xt[i];
    }
    acc = warp_sum(acc);
    if (lane == 0)
        y[t * rows + o] = acc;
}

int kcuda_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const void *d;
    const uint8_t *s;
    if (cuda_weight_dev(w, &d, &s) < 0)
        return -EINVAL;
    if (n == 0 || w->rows == 0)
        return 0;
    const size_t threads = (size_t) w->rows * n * 32;
    matmul_kernel<<<cuda_blocks(threads, 256), 256, 0, c->stream>>>(w->fmt, d, s, w->rows, w->cols, x, n, y);
    return CUDA_LAUNCH_CHECK();
}
