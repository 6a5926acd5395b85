/* golden-model.h - open a checkpoint the way the golden tests compare it with the PyTorch
 * reference (test-golden, test-image-golden): one rank, every MTP layer, the CPU backend on
 * 2 threads, one sequence of max_len tokens.  The exact path keeps FP32 KV and exact MXFP4
 * (1e-3 is below BF16 storage's rounding); the fast path runs the service defaults (BF16 KV). */
#pragma once

#include <jansson.h>
#include <math.h>
#include <stdio.h>

#include "harness.h"
#include "model.h"

static inline void golden_model_open(const char *dir, bool exact, int max_len, int bs,
                                     struct ckpt **ck, struct backend **be, struct model **m)
{
    struct err_buf e = {{0}};
    struct model_config pc;
    char cpath[4096];

    snprintf(cpath, sizeof(cpath), "%s/config.json", dir);
    if (model_config_load(cpath, &pc, &e) < 0)
        FAIL("%s", e.msg);
    struct ckpt_opts co = {.world_size = 1, .rank = 0, .mtp_depth = pc.n_mtp_layers};
    if (ckpt_open(dir, &co, ck, &e) < 0)
        FAIL("%s: %s", dir, e.msg);
    struct backend_cfg bc = {.n_threads = 2, .mxfp4_exact = exact};
    ASSERT_OK(backend_new("cpu", &bc, be));
    struct model_opts mo = {.max_tokens_per_step = max_len, .max_seqs = 1, .max_logit_rows = max_len,
                            .block_size = bs, .n_blocks = {max_len / bs, max_len / bs},
                            .max_seq_len = max_len, .kv_f32 = exact};
    if (model_new(*ck, *be, NULL, &mo, m, &e) < 0)
        FAIL("model_new: %s", e.msg);
}

/* A plan of one sequence (slot 0): n tokens from pos0, n_logits logit rows, its blocks the
 * first ones of blocks (bs tokens each; the caller's table holds 0, 1, ...). */
static inline void golden_plan_one(struct step_plan *p, struct step_seq *s, int32_t *blocks, int bs, int32_t *toks,
                                   int pos0, int n, int n_logits)
{
    static uint64_t id;
    *s = (struct step_seq){.slot = 0, .pos0 = pos0, .n_tokens = n, .n_logits = n_logits,
                           .n_blocks = (pos0 + n + bs - 1) / bs};
    *p = (struct step_plan){.step_id = ++id, .n_seqs = 1, .n_tokens = n, .seqs = s, .tokens = toks,
                            .n_block_ids = {s->n_blocks, s->n_blocks}, .blocks = {blocks, blocks}};
}

/* max |a[i] - vals[i]| over a row of V logits against a golden's JSON array of V numbers */
static inline double golden_row_diff(const float *a, json_t *vals, int V)
{
    double d = 0;
    ASSERT_EQ((int)json_array_size(vals), V);
    for (int i = 0; i < V; i++)
        d = fmax(d, fabs((double)a[i] - json_number_value(json_array_get(vals, (size_t)i))));
    return d;
}
