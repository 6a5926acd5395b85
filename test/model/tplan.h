/* tplan.h - step-plan building blocks shared by the model tests (header-only).
 *
 * The including file defines BS (block size), MAXLEN (positions per sequence), NSEQ (slots)
 * and a `static uint32_t rnd(void)` before including this.  Provides per-slot block tables
 * over distinct, shuffled physical blocks and a plan under construction (struct tplan);
 * each test adds runs with its own tp_add().
 */
#pragma once

#include <string.h>

#include "plan.h"

#define NBLK (NSEQ * MAXLEN / BS)

/* block tables: per group, per slot, logical -> physical, distinct physical blocks */
static int32_t table[_KV_GROUP_MAX][NSEQ][MAXLEN / BS];

static void tables_shuffle(void)
{
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        int32_t perm[NBLK];
        for (int i = 0; i < NBLK; i++)
            perm[i] = i;
        for (int i = NBLK - 1; i > 0; i--) {
            int j = (int)(rnd() % (uint32_t)(i + 1));
            int32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int s = 0; s < NSEQ; s++)
            for (int b = 0; b < MAXLEN / BS; b++)
                table[g][s][b] = perm[s * (MAXLEN / BS) + b];
    }
}

/* One plan under construction. */
struct tplan {
    struct step_plan p;
    struct step_seq seqs[NSEQ];
    int32_t tokens[MAXLEN * NSEQ];
    int32_t blocks[_KV_GROUP_MAX][NSEQ * MAXLEN / BS];
};

static void tp_init(struct tplan *tp)
{
    static uint64_t step_id;
    memset(tp, 0, sizeof(*tp));
    tp->p.step_id = ++step_id;
    tp->p.seqs = tp->seqs;
    tp->p.tokens = tp->tokens;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        tp->p.blocks[g] = tp->blocks[g];
}
