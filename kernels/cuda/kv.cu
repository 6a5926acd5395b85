// kv.cu - write k and v rows of n_tok tokens into their physical cache slots
// (slot < 0: padding, not stored; FP32 or BF16 storage, round-to-nearest-even).
#include "common.cuh"
#include "cuda.h"

static __global__ void kv_store_kernel(void *kc, void *vc, int f32, const float *k, const float *v,
                                       int n_tok, int64_t row, const int32_t *slots)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int64_t idx = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t) n_tok * row)
        return;
    const int t = (int) (idx / row);
    const int64_t j = idx % row;
    const int32_t s = slots[t];
    if (s < 0)
        return;
    if (f32) {
        ((float *) kc)[s * row + j] = k[idx];
        ((float *) vc)[s * row + j] = v[idx];
    } else {
        ((uint16_t *) kc)[s * row + j] = f32_to_bf16(k[idx]);
        ((uint16_t *) vc)[s * row + j] = f32_to_bf16(v[idx]);
    }
}

int kcuda_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                   int n_tok, const int32_t *slots)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t row = (int64_t) kv->n_kv_heads * kv->head_dim;
    const int64_t n_slots = (int64_t) kv->n_blocks * kv->block_size;
    for (int i = 0; i < n_tok; i++)
        if (slots[i] >= n_slots)
            return -EINVAL;
    if (n_tok == 0)
        return 0;
    cuda_stage_reset(c);
    const int32_t *ds = cuda_index(c, slots, (size_t) n_tok);
    if (!ds)
        return -ENOMEM;
    const size_t n = (size_t) n_tok * row;
    cuda_launch(c, kv_store_kernel, cuda_blocks(n, 256), 256, 0,
                kv->k, kv->v, kv->dtype_f32, k, v, n_tok, row, ds);
    return CUDA_LAUNCH_CHECK();
}
