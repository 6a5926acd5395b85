/* gate.c - head-wise attention output gate: o[t, h, :] *= sigmoid(g[t, h]) (docs/MODEL.md §2.3.6).
 * o is [n_tok, n_heads, head_dim], g is [n_tok, n_heads]. */
#include <math.h>

#include "cpu.h"

int cpu_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads, int head_dim)
{
    for (int64_t th = 0; th < (int64_t)n_tok * n_heads; th++) {
        float s = 1.0f / (1.0f + expf(-g[th]));
        float *oh = o + th * head_dim;

        for (int d = 0; d < head_dim; d++)
            oh[d] *= s;
    }
    return 0;
}
