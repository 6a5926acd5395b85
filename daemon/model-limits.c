/* model-limits.c - what the served model allows, as the coordinator knows it: the
 * vocabulary's size and the longest context among the ready groups (validation, the
 * doors).  Loop thread only. */
#include <stdint.h>

#include "coord-int.h"
#include "tokenizer.h"

uint32_t coord_vocab_size(const struct coord *co)
{
    if (co->model.known && co->model.vocab_size)
        return co->model.vocab_size;
    if (co->tok)
        return (uint32_t)tok_vocab_size(co->tok);
    return co->o.fallback_vocab_size;
}

/* Groups may serve different context lengths: the longest among ready groups bounds
 * validation; routing then picks a group whose context holds the request. */
uint32_t coord_max_model_len(const struct coord *co)
{
    uint32_t best = 0;
    for (const struct group *g = co->groups; g; g = g->next)
        if (g->state == GROUP_READY && g->model.known && g->model.max_model_len > best)
            best = g->model.max_model_len;
    if (best)
        return best;
    return co->model.known ? co->model.max_model_len : 0;
}
