/* swiglu.c - out = min(silu(gate), L) * clamp(up, -L, L), or silu(gate) * up when L = 0
 * (MODEL.md §2.4: silu first, then the upper clamp).  out may alias gate or up. */
#include "cpu.h"

int cpu_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
               float limit, float *out)
{
    size_t total = (size_t)n * (size_t)dim;

    for (size_t i = 0; i < total; i++)
        out[i] = cpu_swiglu1(gate[i], up[i], limit);
    return 0;
}
