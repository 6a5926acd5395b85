// embed.cu - token embedding: out[t, :] = E[ids[t], :] (BF16 or F32 table -> FP32).
#include "common.cuh"
#include "cuda.h"

static __global__ void embed_kernel(int f32, const void *table, int64_t cols, const int32_t *ids,
                                    float *out)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int t = blockIdx.x;
    const int64_t row = ids[t];
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        out[(int64_t) t * cols + i] = f32 ? ((const float *) table)[row * cols + i]
                                          : bf16_to_f32(((const uint16_t *) table)[row * cols + i]);
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
    const int rows = cuda_rows(c, n);       // padded graph rows read id 0
    const int32_t *dids = cuda_index(c, ids, (size_t) rows);
    if (!dids)
        return -ENOMEM;
    cuda_launch(c, embed_kernel, rows, 256, 0, table->fmt == WFMT_F32, d, table->cols, dids, out);
    return CUDA_LAUNCH_CHECK();
}
