/* tensor.c - dtype table (safetensors spellings and element widths). */
#include "tensor.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "mxfp4.h"

static const struct {
    const char *name;
    int bits;
} dtype_table[_DTYPE_MAX] = {
    [DTYPE_INVALID] = { "INVALID", 0 },
    [DTYPE_BOOL] = { "BOOL", 8 },
    [DTYPE_U8] = { "U8", 8 },
    [DTYPE_I8] = { "I8", 8 },
    [DTYPE_F8_E5M2] = { "F8_E5M2", 8 },
    [DTYPE_F8_E4M3] = { "F8_E4M3", 8 },
    [DTYPE_I16] = { "I16", 16 },
    [DTYPE_U16] = { "U16", 16 },
    [DTYPE_F16] = { "F16", 16 },
    [DTYPE_BF16] = { "BF16", 16 },
    [DTYPE_I32] = { "I32", 32 },
    [DTYPE_U32] = { "U32", 32 },
    [DTYPE_F32] = { "F32", 32 },
    [DTYPE_F64] = { "F64", 64 },
    [DTYPE_I64] = { "I64", 64 },
    [DTYPE_U64] = { "U64", 64 },
    [DTYPE_F8_E8M0] = { "F8_E8M0", 8 },
    [DTYPE_F4] = { "F4", 4 },
    [DTYPE_F6_E2M3] = { "F6_E2M3", 6 },
    [DTYPE_F6_E3M2] = { "F6_E3M2", 6 },
    [DTYPE_C64] = { "C64", 64 },
};

int dtype_bits(enum dtype t)
{
    if ((int) t <= DTYPE_INVALID || t >= _DTYPE_MAX)
        return 0;
    return dtype_table[t].bits;
}

const char *dtype_name(enum dtype t)
{
    if ((int) t < 0 || t >= _DTYPE_MAX)
        return "INVALID";
    return dtype_table[t].name;
}

enum dtype dtype_parse(const char *s)
{
    if (!s)
        return DTYPE_INVALID;
    for (int t = DTYPE_INVALID + 1; t < _DTYPE_MAX; t++)
        if (strcmp(s, dtype_table[t].name) == 0)
            return (enum dtype) t;
    return DTYPE_INVALID;
}

/* ------------------------------------------------------------------------ */
/* FP8 E4M3 and NVFP4 (docs/MODEL.md §5) */

float fp8_e4m3_value(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v;

    if (e == 15 && m == 7)
        return NAN;
    v = e ? ldexpf(1.0f + (float) m / 8.0f, e - 7) : ldexpf((float) m, -9);
    return (b & 0x80) ? -v : v;
}

uint8_t fp8_e4m3_nearest(float x)
{
    float a = fabsf(x);
    uint8_t s = signbit(x) ? 0x80 : 0, lo = 0, hi = 126;

    if (isnan(x))
        return 0x7f;
    if (a >= FP8_E4M3_MAX)
        return s | 126;
    /* codes 0..126 increase with their value: the last code <= a, then its neighbour */
    while (lo < hi) {
        uint8_t mid = (uint8_t) ((lo + hi + 1) / 2);
        if (fp8_e4m3_value(mid) <= a)
            lo = mid;
        else
            hi = (uint8_t) (mid - 1);
    }
    if (lo < 126) {
        float dl = a - fp8_e4m3_value(lo), du = fp8_e4m3_value((uint8_t) (lo + 1)) - a;
        if (du < dl || (du == dl && (lo & 1)))
            lo++;
    }
    return s | lo;
}

int fp8_block_quantize(const float *w, int64_t rows, int64_t cols, int br, int bc, uint8_t *codes,
                       float *scale_inv)
{
    if (br <= 0 || bc <= 0 || rows % br || cols % bc)
        return -EINVAL;
    for (int64_t bi = 0; bi < rows / br; bi++) {
        for (int64_t bj = 0; bj < cols / bc; bj++) {
            float amax = 0.0f, s;
            for (int64_t i = bi * br; i < (bi + 1) * br; i++)
                for (int64_t j = bj * bc; j < (bj + 1) * bc; j++) {
                    float v = w[i * cols + j];
                    if (!isfinite(v))
                        return -EINVAL;
                    amax = fmaxf(amax, fabsf(v));
                }
            s = amax > 0.0f ? amax / FP8_E4M3_MAX : 1.0f;
            scale_inv[bi * (cols / bc) + bj] = s;
            for (int64_t i = bi * br; i < (bi + 1) * br; i++)
                for (int64_t j = bj * bc; j < (bj + 1) * bc; j++)
                    codes[i * cols + j] = fp8_e4m3_nearest(w[i * cols + j] / s);
        }
    }
    return 0;
}

float nvfp4_global_scale(const float *w, int64_t n)
{
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(w[i]))
            amax = fmaxf(amax, fabsf(w[i]));
    return amax > 0.0f ? amax / (6.0f * FP8_E4M3_MAX) : 1.0f;
}

int nvfp4_row_quantize(const float *in, int64_t k, float scale_2, uint8_t *packed, uint8_t *scale)
{
    if (k <= 0 || k % NVFP4_GROUP || !(scale_2 > 0.0f) || !isfinite(scale_2))
        return -EINVAL;
    for (int64_t g = 0; g < k / NVFP4_GROUP; g++) {
        const float *x = in + g * NVFP4_GROUP;
        float amax = 0.0f, eff;
        for (int j = 0; j < NVFP4_GROUP; j++) {
            if (!isfinite(x[j]))
                return -EINVAL;
            amax = fmaxf(amax, fabsf(x[j]));
        }
        scale[g] = fp8_e4m3_nearest(amax / 6.0f / scale_2);
        eff = fp8_e4m3_value(scale[g]) * scale_2;
        for (int j = 0; j < NVFP4_GROUP / 2; j++) {
            unsigned c[2];
            for (int h = 0; h < 2; h++) {
                float v = x[2 * j + h];
                c[h] = eff > 0.0f ? mxfp4_e2m1_nearest(fminf(fabsf(v) / eff, 6.0f)) | (v < 0 ? 8u : 0u) : 0u;
            }
            packed[g * (NVFP4_GROUP / 2) + j] = (uint8_t) (c[0] | (c[1] << 4));
        }
    }
    return 0;
}

int nvfp4_row_decode(const uint8_t *packed, const uint8_t *scale, float scale_2, int64_t k, float *out)
{
    if (k <= 0 || k % NVFP4_GROUP)
        return -EINVAL;
    for (int64_t g = 0; g < k / NVFP4_GROUP; g++) {
        float s = fp8_e4m3_value(scale[g]) * scale_2;
        if (isnan(s))
            return -EBADMSG;
        for (int j = 0; j < NVFP4_GROUP / 2; j++) {
            uint8_t b = packed[g * (NVFP4_GROUP / 2) + j];
            out[g * NVFP4_GROUP + 2 * j] = mxfp4_e2m1_value(b & 0xF) * s;
            out[g * NVFP4_GROUP + 2 * j + 1] = mxfp4_e2m1_value(b >> 4) * s;
        }
    }
    return 0;
}
