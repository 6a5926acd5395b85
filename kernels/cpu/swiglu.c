/* swiglu.c - out = min(silu(gate), L) * clamp(up, -L, L), or silu(gate) * up when L = 0
 * (docs/MODEL.md §2.4: silu first, then the upper clamp).  out may alias gate or up.
 * Element-wise, so it splits over the pool in contiguous ranges when it is big enough
 * (prefill, batched decode); every element is computed the same way on any thread. */
#include <stdlib.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

void cpu_swiglu_rows_scalar(const float *gate, const float *up, float *out, int64_t n,
                            float limit)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = cpu_swiglu1(gate[i], up[i], limit);
}

#if defined(__x86_64__)
/* cpu_swiglu1 on 16 lanes, the same operations in the same order: the clamps as
 * blends that let NaN pass through, vexp16 for vexp1 (vexp.h), an exact division. */
CPU_FN_AVX512 static void swiglu_rows_avx512(const float *gate,
                                                                   const float *up, float *out,
                                                                   int64_t n, float limit)
{
    const __m512 lo = _mm512_set1_ps(VEXP_MIN), hi = _mm512_set1_ps(VEXP_MAX);
    const __m512 one = _mm512_set1_ps(1.0f), L = _mm512_set1_ps(limit);
    const __m512 nL = _mm512_set1_ps(-limit);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    int64_t i = 0;

    for (; i + 16 <= n; i += 16) {
        __m512 u = _mm512_loadu_ps(gate + i), w = _mm512_loadu_ps(up + i);
        /* x = -u; x < lo ? lo : x; x > hi ? hi : x  (NaN x stays NaN, as in the scalar) */
        __m512 x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(u), sign));
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), x, lo);
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), x, hi);
        __m512 s = _mm512_div_ps(u, _mm512_add_ps(one, vexp16(x)));

        if (limit > 0.0f) {
            /* s < L ? s : L  (NaN s -> L);  w < -L ? -L : (w > L ? L : w)  (NaN w stays) */
            s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, L, _CMP_LT_OQ), L, s);
            w = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(w, nL, _CMP_LT_OQ),
                                     _mm512_mask_blend_ps(_mm512_cmp_ps_mask(w, L, _CMP_GT_OQ),
                                                          w, L), nL);
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, w));
    }
    cpu_swiglu_rows_scalar(gate + i, up + i, out + i, n - i, limit);
}
#endif

void cpu_swiglu_rows(const float *gate, const float *up, float *out, int64_t n, float limit)
{
#if defined(__x86_64__)
    if (cpu_isa_has(CPU_ISA_AVX512)) {
        swiglu_rows_avx512(gate, up, out, n, limit);
        return;
    }
#endif
    cpu_swiglu_rows_scalar(gate, up, out, n, limit);
}

/* multiply-add equivalents of one element (vector exp polynomial and division) */
#define SWIGLU_WORK 16.0

struct swiglu_job {
    const float *gate, *up;
    float *out;
    size_t total;
    float limit;
};

static void swiglu_unit(void *arg, int unit, int n_units, int ith)
{
    const struct swiglu_job *j = arg;
    int64_t i0, i1;

    (void)ith;
    cpu_split((int64_t)j->total, 16, unit, n_units, &i0, &i1);
    cpu_swiglu_rows(j->gate + i0, j->up + i0, j->out + i0, i1 - i0, j->limit);
}

int cpu_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
               float limit, float *out)
{
    struct cpu_ctx *c = cpu_ctx(be);
    struct swiglu_job j = { gate, up, out, (size_t)n * (size_t)dim, limit };
    int nth = cpu_threads_for(c, SWIGLU_WORK * (double)j.total);

    cpu_pool_for(c->pool, swiglu_unit, &j, nth > 1 ? nth * CPU_UNITS_PER_THREAD : 1, nth);
    return 0;
}
