/* embed.c - token embedding lookup: out[i] = table[ids[i]] as fp32 (MODEL.md §2.2). */
#include <errno.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

int cpu_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out)
{
    const int64_t dim = table->cols;

    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= table->rows) {
            log_debug("embed: token id %d at %d outside vocabulary [0, %lld)", ids[i], i,
                      (long long)table->rows);
            return -EINVAL;
        }
    }
    for (int i = 0; i < n; i++) {
        float *o = out + (int64_t)i * dim;

        if (table->fmt == WFMT_F32) {
            memcpy(o, (const float *)table->data + (int64_t)ids[i] * dim, dim * sizeof(float));
        } else if (table->fmt == WFMT_BF16) {
            const uint8_t *src = (const uint8_t *)table->data + (int64_t)ids[i] * dim * 2;
            for (int64_t j = 0; j < dim; j++) {
                uint16_t h;
                memcpy(&h, src + 2 * j, 2);
                o[j] = cpu_bf16_to_f32(h);
            }
        } else {
            cpu_weight_row(table, ids[i], o);
        }
    }
    return 0;
}
