/* router.c - sigmoid router with selection-only bias (docs/MODEL.md §2.5):
 * s = sigmoid(z); choose the top_k of s + bias (ties: lower expert id first); weights are
 * s of the chosen experts, renormalised to sum 1 when renorm, then multiplied by scale.
 * ids/weights are [n_tok, top_k], ordered by decreasing selection score. */
#include <errno.h>
#include <math.h>

#include "cpu.h"

int cpu_router(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
               int top_k, bool renorm, float scale, int32_t *ids, float *weights)
{
    float s[n_exp], c[n_exp];

    for (int t = 0; t < n_tok; t++) {
        const float *z = logits + (int64_t)t * n_exp;
        int32_t *id = ids + (int64_t)t * top_k;
        float *wt = weights + (int64_t)t * top_k;
        double sum = 0.0;

        for (int e = 0; e < n_exp; e++) {
            if (isnan(z[e]))
                return -EINVAL;
            s[e] = 1.0f / (1.0f + expf(-z[e]));
            c[e] = s[e] + (bias ? bias[e] : 0.0f);
        }
        /* top_k is small (8): repeated selection keeps ties in id order */
        for (int k = 0; k < top_k; k++) {
            int best = -1;

            for (int e = 0; e < n_exp; e++) {
                bool taken = false;

                for (int j = 0; j < k && !taken; j++)
                    taken = id[j] == e;
                if (taken)
                    continue;
                if (best < 0 || c[e] > c[best])
                    best = e;
            }
            id[k] = best;
            wt[k] = s[best];
            sum += s[best];
        }
        for (int k = 0; k < top_k; k++) {
            float v = wt[k];

            if (renorm)
                v = (float)(v / sum);
            wt[k] = v * scale;
        }
    }
    return 0;
}
