/* fuzz-config.c - libFuzzer target: config.json parser; accepted configs are
 * internally consistent. */
#include <stdint.h>

#include "config.h"
#include "err.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct model_config c;
    struct err_buf e;

    if (model_config_parse((const char *) data, size, "fuzz", &c, &e) == 0) {
        BUG_ON(c.n_layers_total != c.n_layers + c.n_mtp_layers || c.n_layers_total > MODEL_MAX_LAYERS);
        for (int i = 0; i < c.n_layers_total; i++)
            BUG_ON(c.layers[i].n_heads <= 0 || c.layers[i].n_heads % c.layers[i].n_kv_heads ||
                   c.layers[i].rotary_dims > c.layers[i].head_dim);
    }
    return 0;
}
