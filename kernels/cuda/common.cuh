// common.cuh - shared internals of the CUDA backend plugin (not a public header).
//
// Pointer conventions of the CUDA backend (documented in kernels/cuda/cuda.h):
//  - activations, KV pools, logits, router outputs (ids/weights) and every buffer from
//    buf_alloc are DEVICE pointers;
//  - small index arrays that the model builds from the step plan on the host (token ids
//    for embed, positions for rope, slots for kv_store, the attention sequence tables and
//    block tables, rope inv_freq tables) are HOST pointers: the backend stages them into a
//    device scratch area on its stream (stream order makes reuse of the area safe).
//  - weights: bweight.data/scale are host (loader mmap) until weight_prepare() uploads
//    them; afterwards bweight.priv points to a struct cuda_weight with device copies.
#pragma once

#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>

#include "backend.h"

struct cuda_weight {
    void *data;             // device copy of bweight.data
    uint8_t *scale;         // device copy of bweight.scale (MXFP4) or NULL
};

struct cuda_ctx {
    int device;
    cudaStream_t stream;
    // staging area for host index arrays (see above)
    char *stage;
    size_t stage_size, stage_used;
    // device table of local expert weight pointers for moe (rebuilt when experts change)
    const struct moe_expert *moe_cached;
    int moe_cached_n;
    void **moe_ptrs;        // device: [n_local][6] = gate.data, gate.scale, up.data, up.scale, down.data, down.scale
    float *moe_act;         // device scratch [n_tok * top_k * inter]
    size_t moe_act_size;
};

static inline struct cuda_ctx *cuda_ctx_of(struct backend *be)
{
    return (struct cuda_ctx *) be->ctx;
}

// The one translation point for cudaError_t -> negative errno.
int err_from_cuda(cudaError_t e);

// Stage n bytes of host memory into the device scratch area; returns the device pointer
// (NULL on failure).  Call cuda_stage_reset() at the start of each op.
void cuda_stage_reset(struct cuda_ctx *c);
void *cuda_stage(struct cuda_ctx *c, const void *host, size_t n);

static inline __device__ float bf16_to_f32(uint16_t b)
{
    return __uint_as_float(((uint32_t) b) << 16);
}

// E2M1 magnitude table, docs/MODEL.md §5.1
static __device__ __constant__ float k_e2m1[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

// Weight element (o, i) of a [rows, cols] matrix in any supported format.
static inline __device__ float weight_at(int fmt, const void *data, const uint8_t *scale,
                                         int64_t cols, int64_t o, int64_t i)
{
    if (fmt == WFMT_F32)
        return ((const float *) data)[o * cols + i];
    if (fmt == WFMT_BF16)
        return bf16_to_f32(((const uint16_t *) data)[o * cols + i]);
    const uint8_t b = ((const uint8_t *) data)[o * (cols / 2) + i / 2];
    const int code = (i & 1) ? (b >> 4) : (b & 0xF);
    const int e = scale[o * (cols / 32) + i / 32];
    return ldexpf(k_e2m1[code], e - 127);
}

static inline __device__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static inline __device__ float block_sum(float v, float *shared32)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0)
        shared32[wid] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nw) ? shared32[threadIdx.x] : 0.0f;
    if (wid == 0)
        v = warp_sum(v);
    if (threadIdx.x == 0)
        shared32[0] = v;
    __syncthreads();
    v = shared32[0];
    __syncthreads();
    return v;
}

#define CUDA_LAUNCH_CHECK() err_from_cuda(cudaGetLastError())

// Device copies of a prepared weight; -EINVAL when weight_prepare() was not called.
static inline int cuda_weight_dev(const struct bweight *w, const void **ret_data, const uint8_t **ret_scale)
{
    const struct cuda_weight *cw = (const struct cuda_weight *) w->priv;
    if (!cw || !cw->data)
        return -EINVAL;
    *ret_data = cw->data;
    *ret_scale = cw->scale;
    return 0;
}

static inline unsigned cuda_blocks(size_t n, unsigned threads)
{
    return (unsigned) ((n + threads - 1) / threads);
}
