/* tensor.h - dtypes and borrowed tensor views (value types shared by every layer). */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TENSOR_MAX_DIMS 8

enum dtype {
    DTYPE_INVALID = 0,
    DTYPE_BOOL, DTYPE_U8, DTYPE_I8, DTYPE_F8_E5M2, DTYPE_F8_E4M3, DTYPE_I16, DTYPE_U16,
    DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_U32, DTYPE_F32, DTYPE_F64, DTYPE_I64, DTYPE_U64,
    DTYPE_F8_E8M0, DTYPE_F4, DTYPE_F6_E2M3, DTYPE_F6_E3M2, DTYPE_C64,
    _DTYPE_MAX,
};

/* Bits per element (4 for F4, 6 for F6_*), 0 for DTYPE_INVALID. */
int dtype_bits(enum dtype t);
/* safetensors spelling ("BF16") <-> enum; dtype_parse returns DTYPE_INVALID if unknown. */
const char *dtype_name(enum dtype t);
enum dtype dtype_parse(const char *s);

/* FP8 E4M3 (the "fn" variant: bias 7, no infinities, 0x7f/0xff NaN, largest 448). */
#define FP8_E4M3_MAX 448.0f
float fp8_e4m3_value(uint8_t b);
/* The nearest E4M3 code to x (ties to the even code), saturating at +-448; NaN -> 0x7f. */
uint8_t fp8_e4m3_nearest(float x);

/* Block-scaled FP8 (the "fp8" checkpoints): w[rows x cols] in blocks of br x bc (both
 * dividing the shape) -> codes[rows x cols] and scale_inv[rows/br x cols/bc] with
 * w ~ fp8_e4m3_value(code) * scale_inv (scale_inv = block amax / 448, 1 for a zero
 * block).  -EINVAL if a block size does not divide the shape or w is not finite. */
int fp8_block_quantize(const float *w, int64_t rows, int64_t cols, int br, int bc, uint8_t *codes,
                       float *scale_inv);

/* NVFP4 (modelopt): E2M1 nibbles packed as MXFP4 (element 2j in the low nibble), one E4M3
 * scale per 16 elements of a row and one F32 global scale for the tensor:
 * w ~ e2m1(code) * fp8_e4m3_value(scale) * scale_2.  The global scale of w[n]: amax /
 * (6 * 448) (1 if w is all zero). */
#define NVFP4_GROUP 16
float nvfp4_global_scale(const float *w, int64_t n);
/* One row of k (a multiple of 16) elements under global scale scale_2 -> packed[k/2],
 * scale[k/16].  -EINVAL on a bad k or a non-finite value. */
int nvfp4_row_quantize(const float *in, int64_t k, float scale_2, uint8_t *packed, uint8_t *scale);
int nvfp4_row_decode(const uint8_t *packed, const uint8_t *scale, float scale_2, int64_t k, float *out);

/* A borrowed view of tensor data (mmap or a loader-owned buffer). Row-major. */
struct tview {
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    const void *data;       /* may be unaligned: read with memcpy or unaligned loads */
    size_t nbytes;
};

static inline int64_t tview_numel(const struct tview *v)
{
    int64_t n = 1;
    for (int i = 0; i < v->ndim; i++)
        n *= v->shape[i];
    return n;
}

#ifdef __cplusplus
}
#endif
