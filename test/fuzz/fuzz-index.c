/* fuzz-index.c - libFuzzer target: model.safetensors.index.json parser (C2, C3):
 * accepted indexes hold only plain shard names, every tensor maps to one shard. */
#include <stdint.h>
#include <string.h>

#include "err.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct sft_index idx;
    struct err_buf e;

    if (sft_index_parse((const char *) data, size, "fuzz", &idx, &e) == 0) {
        for (size_t i = 0; i < idx.n; i++) {
            BUG_ON(idx.shard_of[i] < 0 || (size_t) idx.shard_of[i] >= idx.n_shards);
            BUG_ON(sft_index_find(&idx, idx.names[i]) != (long) i);
        }
        for (size_t i = 0; i < idx.n_shards; i++)
            BUG_ON(strchr(idx.shards[i], '/') || strcmp(idx.shards[i], "..") == 0);
        sft_index_done(&idx);
    }
    return 0;
}
