/* embed.c - token embedding lookup: out[i] = table[ids[i]] as fp32 (docs/MODEL.md §2.2). */
#include <errno.h>
#include <string.h>

#include "log.h"
#include "cpu.h"

/* multiply-add equivalents of one element (a BF16 widening store: ~1.5 ns; the MXFP4 path
 * is slower still) */
#define EMBED_WORK 48.0

struct embed_job {
    const struct bweight *table;
    const int32_t *ids;
    int n;
    float *out;
};

static void embed_unit(void *arg, int unit, int n_units, int ith)
{
    const struct embed_job *j = arg;
    const struct bweight *table = j->table;
    const int64_t dim = table->cols;
    int64_t i0, i1;

    (void)ith;
    cpu_split(j->n, 1, unit, n_units, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        float *o = j->out + i * dim;

        if (table->fmt == WFMT_F32) {
            memcpy(o, (const float *)table->data + (int64_t)j->ids[i] * dim, dim * sizeof(float));
        } else if (table->fmt == WFMT_BF16) {
            const uint8_t *src = (const uint8_t *)table->data + (int64_t)j->ids[i] * dim * 2;
            for (int64_t k = 0; k < dim; k++) {
                uint16_t h;
                memcpy(&h, src + 2 * k, 2);
                o[k] = cpu_bf16_to_f32(h);
            }
        } else {
            cpu_weight_row(table, j->ids[i], o);
        }
    }
}

int cpu_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out)
{
    struct cpu_ctx *c = cpu_ctx(be);
    struct embed_job j = { table, ids, n, out };
    int nth, units;

    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= table->rows) {
            log_debug("embed: token id %d at %d outside vocabulary [0, %lld)", ids[i], i,
                      (long long)table->rows);
            return -EINVAL;
        }
    }
    /* tokens are independent: split over the pool for long prompts */
    nth = cpu_threads_for(c, EMBED_WORK * (double)n * table->cols);
    units = nth * CPU_UNITS_PER_THREAD < n ? nth * CPU_UNITS_PER_THREAD : n;
    cpu_pool_for(c->pool, embed_unit, &j, nth > 1 ? units : 1, nth);
    return 0;
}
