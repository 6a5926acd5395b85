/* fuzz-header.c - libFuzzer target: safetensors length prefix + header parser
 * (docs/RELIABILITY.md C2).  The input is treated both as a whole file image
 * (sft_parse_mem) and as bare header text (sft_header_parse); accepted headers
 * must satisfy the reader's invariants. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "safetensors.h"

static void check(const struct sft_header *h)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < h->n_tensors; i++) {
        const struct sft_tensor *t = &h->tensors[i];
        BUG_ON(t->end < t->begin || t->end > h->data_len);
        BUG_ON(t->ndim < 0 || t->ndim > TENSOR_MAX_DIMS);
        BUG_ON(i && strcmp(h->tensors[i - 1].name, t->name) >= 0);
        BUG_ON(sft_header_find(h, t->name) != t);
        sum += t->end - t->begin;
    }
    BUG_ON(sum != h->data_len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct sft_header h;
    struct err_buf e;

    if (sft_parse_mem(data, size, "fuzz", &h, &e) == 0) {
        check(&h);
        sft_header_done(&h);
    }
    if (sft_header_parse((const char *) data, size, "fuzz", &h, &e) == 0) {
        check(&h);
        sft_header_done(&h);
    }
    return 0;
}
