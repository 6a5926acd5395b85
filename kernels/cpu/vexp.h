/* vexp.h - the exp polynomial of the CPU kernels, written once per ISA level.
 *
 * Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial, 2^n built in
 * the exponent bits; under 1 ulp on [-87.3, 88].  The argument must already lie in
 * [-87.3, 88]: each caller clamps it, or masks out what lies below, as it needs (SwiGLU's
 * sigmoid clamps both ways, attention's softmax gives 0 below -87.3).  The scalar form
 * takes fmaf where the vector forms take an FMA, in the same order, so an element gets
 * the same bits whichever form computes it: a tail gives what a full vector would, and
 * the AVX2 and AVX-512 paths of a kernel agree (test-ops, test-attention check that).
 */
#pragma once

#include <stdint.h>

#include "cpu-features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define VEXP_LOG2E 1.44269504088896341f
#define VEXP_LN2_HI 0.693359375f        /* ln 2 = VEXP_LN2_HI - VEXP_LN2_LO */
#define VEXP_LN2_LO 2.12194440e-4f
#define VEXP_P0 1.9875691500e-4f
#define VEXP_P1 1.3981999507e-3f
#define VEXP_P2 8.3334519073e-3f
#define VEXP_P3 4.1665795894e-2f
#define VEXP_P4 1.6666665459e-1f
#define VEXP_P5 5.0000001201e-1f
#define VEXP_MIN (-87.3f)                 /* the lowest argument (results near FLT_MIN) */
#define VEXP_MAX 88.0f

/* exp(x) for x in [VEXP_MIN, VEXP_MAX]; a NaN x gives NaN */
static inline float vexp1(float x)
{
    const float fn = __builtin_floorf(__builtin_fmaf(x, VEXP_LOG2E, 0.5f));
    const float r = __builtin_fmaf(fn, VEXP_LN2_LO, __builtin_fmaf(-fn, VEXP_LN2_HI, x));
    const float rr = r * r;
    float p = __builtin_fmaf(VEXP_P0, r, VEXP_P1), two_n;
    uint32_t bits;

    p = __builtin_fmaf(p, r, VEXP_P2);
    p = __builtin_fmaf(p, r, VEXP_P3);
    p = __builtin_fmaf(p, r, VEXP_P4);
    p = __builtin_fmaf(p, r, VEXP_P5);
    p = __builtin_fmaf(p, rr, r) + 1.0f;
    bits = ((uint32_t)(int32_t)fn + 127u) << 23;   /* NaN x: garbage, and p's NaN wins */
    __builtin_memcpy(&two_n, &bits, sizeof(two_n));
    return p * two_n;
}

#if defined(__x86_64__)
/* vexp1 on 8 lanes */
__attribute__((target(CPU_TARGET_AVX2), always_inline)) static inline __m256 vexp8(__m256 x)
{
    const __m256 fn = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(VEXP_LOG2E),
                                                      _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_fmadd_ps(fn, _mm256_set1_ps(VEXP_LN2_LO),
                                     _mm256_fnmadd_ps(fn, _mm256_set1_ps(VEXP_LN2_HI), x));
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(VEXP_P0), r, _mm256_set1_ps(VEXP_P1));

    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P5));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)),
                                23)));
}

/* vexp1 on 16 lanes */
__attribute__((target(CPU_TARGET_AVX512), always_inline)) static inline __m512 vexp16(__m512 x)
{
    const __m512 fn = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(VEXP_LOG2E), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(fn, _mm512_set1_ps(VEXP_LN2_LO),
                                     _mm512_fnmadd_ps(fn, _mm512_set1_ps(VEXP_LN2_HI), x));
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(VEXP_P0), r, _mm512_set1_ps(VEXP_P1));

    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_add_epi32(_mm512_cvttps_epi32(fn), _mm512_set1_epi32(127)),
                                23)));
}
#endif
