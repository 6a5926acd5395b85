/* swiglu.c - out = min(silu(gate), L) * clamp(up, -L, L), or silu(gate) * up when L = 0
 * (MODEL.md §2.4: silu first, then the upper clamp).  out may alias gate or up.
 * Element-wise, so it splits over the pool in contiguous ranges when it is big enough
 * (prefill, batched decode); every element is computed the same way on any thread. */
#include "cpu.h"

/* multiply-add equivalents of one element (an expf and a division: ~3 ns) */
#define SWIGLU_WORK 64.0

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
    for (int64_t i = i0; i < i1; i++)
        j->out[i] = cpu_swiglu1(j->gate[i], j->up[i], j->limit);
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
