// cuda_bf16.h (emulator shim): BF16 storage types and the conversions the kernels use,
// rounding as the hardware does (round to nearest even; NaN stays NaN).
#pragma once

#include "cuemu.h"

struct __attribute__((aligned(2))) __nv_bfloat16 {
    uint16_t __x;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

static inline float __bfloat162float(__nv_bfloat16 b)
{
    return __uint_as_float((uint32_t) b.__x << 16);
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    uint32_t u = __float_as_uint(f);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        r.__x = (uint16_t) ((u >> 16) | 0x40);
    else
        r.__x = (uint16_t) ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return r;
}
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
static inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi)
{
    return { __float2bfloat16_rn(lo), __float2bfloat16_rn(hi) };
}
static inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
static inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
static inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { return { __low2float(v), __high2float(v) }; }
// one rounding of the exact product (an FP32 product of two BF16 values is exact)
static inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b)
{
    return { __float2bfloat16_rn(__bfloat162float(a.x) * __bfloat162float(b.x)),
             __float2bfloat16_rn(__bfloat162float(a.y) * __bfloat162float(b.y)) };
}
