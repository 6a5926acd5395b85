/* vision-dev.h - the vision encoder's elementwise, layout and attention ops on a backend's
 * own buffers (issue 40; docs/GPU.md "The vision encoder").  A backend whose buffers are
 * device memory gives this table from backend_native(be, "vision"); the encoder
 * (worker/model/vision.c) then keeps every activation on the device and calls these between
 * its backend_matmul GEMMs.  A backend that gives none (CPU) runs the host kernels of
 * vision-ops.h on host buffers.  Each op computes what its vops_ namesake computes (the CPU
 * oracle of test/gpu/test-cuda-vision.c), on the backend's stream, in FP32; every pointer
 * is a buffer of backend_buf_alloc unless said otherwise.  Returns 0 or a negative errno.
 */
#pragma once

#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct vision_dev_ops {
    /* y[rows, dim] = layernorm(x) * g + b (y may alias x) */
    int (*layernorm)(struct backend *be, const float *x, const float *g, const float *b, int64_t rows,
                     int dim, float eps, float *y);
    /* y[rows, dim] += b; then quick-GELU y / (1 + exp(-1.702 y)) when gelu */
    int (*bias_act)(struct backend *be, float *y, const float *b, int64_t rows, int dim, int gelu);
    /* LayerScale residual: h[rows, dim] += gamma * (y + b) (b NULL: + 0) */
    int (*scale_add)(struct backend *be, float *h, const float *gamma, const float *y, const float *b,
                     int64_t rows, int dim);
    /* 2-D RoPE of vops_rope2d on the g*g rows of x (row stride ld) */
    int (*rope2d)(struct backend *be, float *x, int g, int64_t ld, int heads, int head_dim, double theta);
    /* rgb: HOST [size, size, 3] u8 -> out [(size/P)^2, 3*P*P], normalised as vops_patchify */
    int (*patchify)(struct backend *be, const uint8_t *rgb, int size, int P, const float mean[3],
                    const float std[3], float *out);
    /* dst[g*g, C] (+)= bilinear resize of src[g0*g0, C] (vops_bilinear); add: dst += */
    int (*bilinear)(struct backend *be, const float *src, int g0, int g, int C, float *dst, int add);
    /* vops_im2col_s2: x[g*g, C] -> cols[s2(g)^2, 9*C] */
    int (*im2col_s2)(struct backend *be, const float *x, int g, int C, float *cols);
    /* Bidirectional attention of one view: qkv [n, 3*heads*head_dim] rows (RoPE applied),
     * o [n, heads*head_dim] = softmax(q kᵀ / sqrt(head_dim)) v per head */
    int (*attention)(struct backend *be, const float *qkv, int64_t n, int heads, int head_dim, float *o);
    /* The encoder's share of the backend's memory plan (at load, before or after
     * backend_reserve: the workspace only grows): the workspace for GEMM inputs of up to gemm_elems
     * FP32 elements (rows x k of the largest backend_matmul of a call) and the attention of
     * views of up to n_max tokens, heads x head_dim.  After it no op of a call within these
     * bounds grows the workspace.  *ws_bytes: the encoder's workspace need, set also when
     * the device cannot give it (-ENOMEM: the workspace keeps its size). */
    int (*reserve)(struct backend *be, int64_t gemm_elems, int64_t n_max, int heads, int head_dim,
                   size_t *ws_bytes);
    /* reserve's *ws_bytes for these bounds, nothing allocated (0 for bounds it refuses): the
     * need a plan names when the device cannot give its activations before reserve runs */
    size_t (*ws_need)(struct backend *be, int64_t gemm_elems, int64_t n_max, int heads, int head_dim);
};

#ifdef __cplusplus
}
#endif
