/* fuzz-plan-wire.c - libFuzzer target: the step-plan decoder on untrusted bytes
 * (docs/RELIABILITY.md C11).  Whatever the input, step_plan_unpack() either rejects it with a
 * message or returns a plan whose every offset and id lies inside the limits (image row
 * indices included); a plan it accepts packs back to the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"

static const struct step_plan_limits lim = {
    .max_seqs = 16, .max_tokens = 256, .vocab_size = 4096, .max_blocks = { 64, 64 },
    .max_positions = 1024, .max_block_ids = 512, .block_size = 16, .max_mtp_depth = 3,
    .img_width = 4,
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct step_plan_buf b;
    static unsigned char again[1 << 16];
    struct err_buf e = { "" };
    int kind = 0, r, n;

    r = step_plan_unpack(data, size, &lim, &b, &kind, &e);
    if (r < 0) {
        if (!e.msg[0])
            abort();
        return 0;
    }
    if (kind != PLAN_MSG_STEP)
        return 0;
    for (int i = 0; i < b.plan.n_seqs; i++) {
        const struct step_seq *s = &b.plan.seqs[i];

        if (s->slot < 0 || s->slot >= lim.max_seqs || s->tok_off < 0 ||
            s->tok_off + s->n_tokens > b.plan.n_tokens || s->n_logits > s->n_tokens)
            abort();
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            if (s->block_off[g] < 0 || s->block_off[g] + s->n_blocks > b.plan.n_block_ids[g])
                abort();
    }
    for (int i = 0; i < b.plan.n_tokens; i++)
        if (b.plan.tokens[i] < 0 || b.plan.tokens[i] >= lim.vocab_size)
            abort();
    /* the image section (issue 40): every index a row of the plan's, rows of our width */
    if (b.plan.img_row && (b.plan.n_img_emb < 1 || b.plan.img_width != lim.img_width || !b.plan.img_emb))
        abort();
    for (int i = 0; b.plan.img_row && i < b.plan.n_tokens; i++)
        if (b.plan.img_row[i] < -1 || b.plan.img_row[i] >= b.plan.n_img_emb)
            abort();
    for (int i = 0; b.plan.img_row_next && i < b.plan.n_seqs * STEP_PLAN_IMG_NEXT; i++)
        if (b.plan.img_row_next[i] < -1 || b.plan.img_row_next[i] >= b.plan.n_img_emb)
            abort();
    n = step_plan_pack(&b.plan, again, sizeof(again));
    if (n < 0 || (size_t)n != size || memcmp(again, data, size) != 0)
        abort();
    return 0;
}
