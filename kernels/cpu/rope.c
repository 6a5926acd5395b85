/* rope.c - NeoX (half-split) rotary embedding on the first R dims of every head, and the
 * inv_freq table builder with llama3 scaling (docs/MODEL.md §2.3 step 4).
 * phi = pos * f_i is formed in fp32 (as the reference's fp32 cos/sin cache is), cos/sin
 * of that phi are taken in fp64 and rounded once. */
#include <errno.h>
#include <math.h>

#include "log.h"
#include "cpu.h"

int backend_rope_freqs_fill(float *inv_freq, int rotary_dims, double theta,
                            const struct rope_llama3 *l3)
{
    if (!inv_freq || rotary_dims <= 0 || rotary_dims % 2 || !(theta > 1.0))
        return -EINVAL;
    if (l3 && (!(l3->factor > 0.0) || !(l3->high_freq_factor > l3->low_freq_factor) ||
               !(l3->low_freq_factor > 0.0) || !(l3->original_max_pos > 0.0)))
        return -EINVAL;
    for (int i = 0; i < rotary_dims / 2; i++) {
        double f = pow(theta, -2.0 * i / rotary_dims);

        if (l3) {
            double lambda = 2.0 * M_PI / f;
            double lo_wl = l3->original_max_pos / l3->low_freq_factor;   /* L0 / lf */
            double hi_wl = l3->original_max_pos / l3->high_freq_factor;  /* L0 / hf */

            if (lambda < hi_wl) {
                /* high frequency: unchanged */
            } else if (lambda > lo_wl) {
                f = f / l3->factor;
            } else {
                double mu = (l3->original_max_pos / lambda - l3->low_freq_factor) /
                            (l3->high_freq_factor - l3->low_freq_factor);
                f = (1.0 - mu) * f / l3->factor + mu * f;
            }
        }
        inv_freq[i] = (float)f;
    }
    return 0;
}

int cpu_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
             const int32_t *pos, const struct rope_freqs *f)
{
    const int half = f->rotary_dims / 2;
    float cs[half], sn[half];

    for (int t = 0; t < n_tok; t++) {
        if (pos[t] < 0) {
            log_debug("rope: negative position %d at token %d", pos[t], t);
            return -EINVAL;
        }
        for (int i = 0; i < half; i++) {
            float phi = (float)pos[t] * f->inv_freq[i];

            cs[i] = (float)cos((double)phi);
            sn[i] = (float)sin((double)phi);
        }
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + ((int64_t)t * n_heads + h) * head_dim;

            for (int i = 0; i < half; i++) {
                float a = xh[i], b = xh[i + half];

                xh[i] = a * cs[i] - b * sn[i];
                xh[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
    return 0;
}
