/* kv.c - write k and v of n_tok tokens into their physical cache slots.
 * k, v are [n_tok, n_kv_heads, head_dim] fp32; slot s = block_id * block_size + offset.
 * A negative slot means "do not store" (padding tokens); a slot past the pool is -EINVAL. */
#include <errno.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

int cpu_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                 int n_tok, const int32_t *slots)
{
    const int64_t row = (int64_t)kv->n_kv_heads * kv->head_dim;
    const int64_t n_slots = (int64_t)kv->n_blocks * kv->block_size;

    for (int i = 0; i < n_tok; i++) {
        if (slots[i] >= n_slots) {
            log_debug("kv_store: slot %d of token %d outside the pool of %lld slots", slots[i], i,
                      (long long)n_slots);
            return -EINVAL;
        }
    }
    for (int i = 0; i < n_tok; i++) {
        const float *ks = k + i * row, *vs = v + i * row;

        if (slots[i] < 0)
            continue;
        if (kv->dtype_f32) {
            memcpy((float *)kv->k + slots[i] * row, ks, row * sizeof(float));
            memcpy((float *)kv->v + slots[i] * row, vs, row * sizeof(float));
        } else {
            uint16_t *kd = (uint16_t *)kv->k + slots[i] * row;
            uint16_t *vd = (uint16_t *)kv->v + slots[i] * row;

            for (int64_t j = 0; j < row; j++) {
                kd[j] = cpu_f32_to_bf16(ks[j]);
                vd[j] = cpu_f32_to_bf16(vs[j]);
            }
        }
    }
    return 0;
}
