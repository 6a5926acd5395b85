// embed.cu - token embedding: out[t, :] = E[ids[t], :] (BF16 or F32 table -> FP32).
#include "common.cuh"
#include "cuda.h"

static __global__ void embed_kernel(int fmt, const void *table, int64_t cols, const int32_t *ids,
                                    int n, float *out)
{
    const int t = blockIdx.x;
    const int64_t row = ids[t];
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        out[(int64_t) t * cols + i] = weight_at(fmt, table, NULL, cols, row, i);
}

int kcuda_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const void *d;
    const uint8_t *s;
    int r = cuda_weight_dev(table, &d, &s);
    if (r < 0 || table->fmt == WFMT_MXFP4)
        return -EINVAL;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= table->rows)
            return -ERANGE;
    if (n == 0)
        return 0;
    cuda_stage_reset(c);
    const int32_t *dids = (const int32_t *) cuda_stage(c, ids, sizeof(int32_t) * n);
    if (!dids)
        return -ENOMEM;
    embed_kernel<<<n, 256, 0, c->stream>>>(table->fmt, d, table->cols, dids, n, out);
    return CUDA_LAUNCH_CHECK();
}
