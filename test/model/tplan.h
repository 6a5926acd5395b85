/* tplan.h - step-plan building blocks shared by the model tests (header-only).
 *
 * The including file defines BS (block size), MAXLEN (positions per sequence), NSEQ (slots)
 * and TPLAN_SEED (the xorshift seed of rnd() below) before including this.  Provides per-slot block tables
 * over distinct, shuffled physical blocks and a plan under construction (struct tplan);
 * each test adds runs with its own tp_add().
 */
#pragma once

#include <string.h>

#include "plan.h"

static uint64_t rng_state = TPLAN_SEED;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

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

/* Add a run of seq `slot` at pos0 (n tokens, logits for the last n_logits).  Sliding-group
 * blocks lying wholly below position release_below are released (-1), as the engine's pool
 * does; pass 0 to keep every block. */
static void tp_add_run(struct tplan *tp, int slot, int pos0, const int32_t *toks, int n,
                       int n_logits, int mtp_depth, int release_below)
{
    struct step_seq *s = &tp->seqs[tp->p.n_seqs++];
    int nb = (pos0 + n + BS - 1) / BS;

    s->slot = slot;
    s->pos0 = pos0;
    s->n_tokens = n;
    s->n_logits = n_logits;
    s->tok_off = tp->p.n_tokens;
    s->n_blocks = nb;
    s->mtp_depth = mtp_depth;
    memcpy(tp->tokens + tp->p.n_tokens, toks, sizeof(int32_t) * (size_t)n);
    tp->p.n_tokens += n;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        s->block_off[g] = tp->p.n_block_ids[g];
        for (int b = 0; b < nb; b++) {
            int32_t id = table[g][slot][b];
            if (g == KV_GROUP_SLIDING && (b + 1) * BS - 1 < release_below)
                id = -1;
            tp->blocks[g][tp->p.n_block_ids[g]++] = id;
        }
    }
}
