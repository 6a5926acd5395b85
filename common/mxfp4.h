/* mxfp4.h - MXFP4 codec (compressed-tensors mxfp4-pack-quantized, docs/MODEL.md §5).
 *
 * A row of K in-features is stored as K/2 packed bytes (element 2j in the low
 * nibble, 2j+1 in the high nibble; E2M1 codes) and K/32 E8M0 scale bytes
 * (scale = 2^(byte-127)).  Scale byte 255 is NaN in OCP and never written by
 * qstream: decoding reports it as corrupt.  K must be a multiple of 32.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MXFP4_GROUP 32

/* Value of a 4-bit E2M1 code (0..15). */
float mxfp4_e2m1_value(unsigned code);
/* 2^(byte-127) for byte 0..254; NaN for 255. */
float mxfp4_e8m0_value(uint8_t byte);

/* Nearest E2M1 magnitude index (0..7) for a in [0, 6], ties to the even index. */
unsigned mxfp4_e2m1_nearest(float a);

/* Decode one row: packed[k/2], scale[k/32] -> out[k]. Returns 0, -EINVAL when k
 * is not a positive multiple of 32, -EBADMSG when a scale byte is 255. */
int mxfp4_row_decode(const uint8_t *packed, const uint8_t *scale, int64_t k, float *out);

/* Quantise one row of k floats (multiple of 32) to packed[k/2] + scale[k/32]:
 * per block the shared exponent floor(log2(amax/6)) (+1 when rounding would
 * saturate), round-to-nearest onto the E2M1 grid, blocks with amax < 1e-30 get
 * scale 2^-127 and zero codes. Returns 0 or -EINVAL. */
int mxfp4_row_quantize(const float *in, int64_t k, uint8_t *packed, uint8_t *scale);

#ifdef __cplusplus
}
#endif
