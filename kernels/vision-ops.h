/* vision-ops.h - host kernels of the vision encoder (worker/model/vision.c, issue 40) that
 * the backend's ops do not cover: LayerNorm (with bias), quick-GELU, LayerScale residual,
 * bias rows, the stride-2 3x3 convolution as im2col (+ the backend's GEMM), 2-D RoPE,
 * row softmax, pixel normalisation into patches and the bilinear position-embedding
 * resample.  FP32, row-major, token-major activations [n_tok, dim]; plain loops the
 * compiler vectorises (the GEMMs around them dominate).  Semantics: docs/ARCHITECTURE.md
 * "Vision encoder".
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y = (x - mean) / sqrt(var + eps) * g + b per row (biased variance); y may alias x. */
void vops_layernorm(const float *x, const float *g, const float *b, int64_t rows, int dim, float eps,
                    float *y);
/* x = x * sigmoid(1.702 x) */
void vops_quick_gelu(float *x, size_t n);
/* y[r, :] += b */
void vops_bias_add(float *y, const float *b, int64_t rows, int dim);
/* h[r, :] += gamma * y[r, :] */
void vops_scale_add(float *h, const float *gamma, const float *y, int64_t rows, int dim);
/* Output side of a 3x3 stride-2 pad-1 convolution over a g x g grid: (g - 1) / 2 + 1. */
int vops_s2_side(int g);
/* x [g*g, C] (tokens row-major) -> cols [go*go, C*9], column (c*3 + ky)*3 + kx, zero
 * padding: the GEMM with a weight [O, C, 3, 3] viewed as [O, C*9] is the convolution. */
void vops_im2col_s2(const float *x, int g, int C, float *cols);
/* 2-D RoPE in place on x rows (n = g*g tokens, row stride ld floats, heads x head_dim from
 * column 0): pairs (2j, 2j+1); j < head_dim/4 turn by col * f_j, the others by
 * row * f_(j - head_dim/4), f_i = theta^(-4i/head_dim). */
void vops_rope2d(float *x, int g, int64_t ld, int heads, int head_dim, double theta);
/* s[r, :] = softmax(scale * s[r, :]) */
void vops_softmax_rows(float *s, int64_t rows, int64_t cols, float scale);
/* rgb [size, size, 3] uint8 -> out [g*g, 3*P*P] (g = size / P), value (v/255 - mean[c]) /
 * std[c], column (c*P + py)*P + px: the GEMM with conv1 [C, 3, P, P] is the patch embed. */
void vops_patchify(const uint8_t *rgb, int size, int P, const float mean[3], const float std[3],
                   float *out);
/* src [g0*g0, C] -> dst [g*g, C]: bilinear, align_corners=False (PyTorch), g0 == g copies. */
void vops_bilinear(const float *src, int g0, int g, int C, float *dst);

#ifdef __cplusplus
}
#endif
