/* golden-model.h - open a checkpoint the way the golden tests compare it with the PyTorch
 * reference (test-golden, test-image-golden): one rank, every MTP layer, the CPU backend on
 * 2 threads, one sequence of max_len tokens.  The exact path keeps FP32 KV and exact MXFP4
 * (1e-3 is below BF16 storage's rounding); the fast path runs the service defaults (BF16 KV). */
#pragma once

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
