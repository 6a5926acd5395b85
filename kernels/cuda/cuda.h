/* cuda.h - extern "C" entry points of the CUDA backend's ops and fused halves (one .cu file
 * per op, exact.cu for the FP32 op path, block.cu for the halves).  Plain C.  Each
 * kcuda_<op> validates nothing beyond what the backend_<op> wrapper already asserted;
 * see common.cuh for which pointers are device and which are host.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

int kcuda_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out);
int kcuda_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                  float eps, float *y);
int kcuda_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y);
int kcuda_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
               const int32_t *pos, const struct rope_freqs *f);
int kcuda_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                   int n_tok, const int32_t *slots);
int kcuda_attention(struct backend *be, const struct attn_args *a);
int kcuda_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads, int head_dim);
int kcuda_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
                 float limit, float *out);
int kcuda_router(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
                 int top_k, bool renorm, float scale, int32_t *ids, float *weights);
int kcuda_moe(struct backend *be, const struct moe_args *a);
int kcuda_add(struct backend *be, float *y, const float *x, size_t n);
int kcuda_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
                 float *vals);
int kcuda_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                     const float *temps, double *sums);

/* the FP32 op path (backend_cfg.mxfp4_exact) */
int kcuda_matmul_exact(struct backend *be, const struct bweight *w, const float *x, int n, float *y);
int kcuda_moe_exact(struct backend *be, const struct moe_args *a);
int kcuda_attention_exact(struct backend *be, const struct attn_args *a, const int32_t *dstart,
                          const int32_t *dpos0, const int32_t *dtab, const int32_t *doff);

/* the vision encoder's ops (vision.cu; kernels/vision-dev.h), given by native("vision") */
struct vision_dev_ops;
const struct vision_dev_ops *kcuda_vision_ops(void);

/* the fused halves */
int kcuda_attn_prepare(struct backend *be, struct attn_weights *w);
void kcuda_attn_release(struct backend *be, struct attn_weights *w);
int kcuda_ffn_prepare(struct backend *be, struct ffn_weights *w);
void kcuda_ffn_release(struct backend *be, struct ffn_weights *w);
int kcuda_attn_block(struct backend *be, const struct attn_block_args *a);
int kcuda_ffn_block(struct backend *be, const struct ffn_block_args *a);

#ifdef __cplusplus
}
#endif
