/* gen.h - random test checkpoints for the model tests, written with ckptw (test/loader).
 *
 *   clamp        ckptw's tiny config (window 8, MXFP4 experts, 2 MTP layers) with weights
 *                large enough and SwiGLU limits small enough that the clamps bind;
 *   dense-tied   BF16 experts (no quantization), tied embeddings, no router bias, no
 *                renormalisation, flat Step-3.5 config with trunk-only per-layer lists;
 *   fp8, nvfp4, bf16-stacked
 *                the tiny config with its routed experts as the FP8 release (block-scaled,
 *                32 x 32 blocks, stacked [E, out, in]), NVFP4 (modelopt, per expert) and the
 *                BF16 release (stacked) store them;
 *   fp8-all, nvfp4-all
 *                every linear module of the trunk and lm_head in the format but the router
 *                (and FP8's g_proj); MTP layers BF16.
 *
 * gen_model("gen:VARIANT") returns a malloc'd temporary directory (remove it with
 * ckptw_rmtree) or aborts the test; any other string is returned as NULL. */
#pragma once

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptw.h"
#include "harness.h"
#include "loader.h"

static inline char *gen_model(const char *spec)
{
    struct model_config gc;
    struct ckptw_opts wo;
    struct err_buf e = {{0}};
    char *dir;

    if (strncmp(spec, "gen:", 4) != 0)
        return NULL;
    ckptw_config_tiny(&gc);
    ckptw_opts_default(&wo);
    if (strcmp(spec + 4, "clamp") == 0) {
        wo.init_scale = 0.3f;
        for (int l = 2; l < gc.n_layers_total; l++) {
            gc.layers[l].swiglu_limit = gc.layers[l].is_moe ? 0.02f : 0.0f;
            gc.layers[l].swiglu_limit_shared = 0.05f;
        }
    } else if (strcmp(spec + 4, "dense-tied") == 0) {
        gc.quant = QUANT_NONE;
        gc.tie_word_embeddings = true;
        gc.use_router_bias = false;
        gc.norm_expert_weight = false;
        wo.nested = false;
        wo.lists_trunk_only = true;
        wo.n_shards = 1;
        wo.init_scale = 0.2f;
    } else if (strcmp(spec + 4, "fp8") == 0 || strcmp(spec + 4, "nvfp4") == 0 ||
               strcmp(spec + 4, "bf16-stacked") == 0) {
        /* the releases' formats: FP8 (32 x 32 blocks: the tiny widths are 64) and BF16 with
         * stacked experts, NVFP4 per expert */
        bool fp8 = spec[4] == 'f', nv = spec[4] == 'n';
        model_config_set_quant(&gc, fp8 ? QUANT_FP8 : nv ? QUANT_NVFP4 : QUANT_NONE);
        if (fp8)
            gc.quant_block_rows = gc.quant_group_size = 32;
        wo.stacked_experts = !nv;
    } else if (strcmp(spec + 4, "fp8-all") == 0 || strcmp(spec + 4, "nvfp4-all") == 0) {
        /* every linear module of the trunk and lm_head in the format but the router and, for
         * FP8 (16 x 16 blocks), the head-wise gate (8 rows on full layers); the MTP layers
         * stay BF16 as in every release (the draft split takes BF16/MXFP4 only) */
        bool fp8 = spec[4] == 'f';
        model_config_set_quant(&gc, fp8 ? QUANT_FP8 : QUANT_NVFP4);
        if (fp8)
            gc.quant_block_rows = gc.quant_group_size = 16;
        for (int l = 0; l < gc.n_layers; l++)
            for (int m = 0; m < _QMOD_MAX; m++)
                if (model_config_has_module(&gc, l, (enum quant_module)m) && m != QMOD_ROUTER && (!fp8 || m != QMOD_G))
                    gc.layers[l].qfmt[m] = (uint8_t)gc.quant;
        gc.lm_head_qfmt = (uint8_t)gc.quant;
        wo.stacked_experts = fp8;
    } else {
        FAIL("unknown test model variant %s", spec);
    }
    dir = ckptw_tmpdir("test-model");
    if (!dir)
        FAIL("ckptw_tmpdir failed");
    if (ckptw_write(dir, &gc, &wo, &e) < 0)
        FAIL("ckptw_write %s: %s", spec, e.msg);
    return dir;
}

/* Open spec (a checkpoint directory or gen:VARIANT) with every MTP layer its config has,
 * world 1.  *ret_gen_dir: the temporary directory to ckptw_rmtree/free when done, or NULL.
 * Returns 0, or TEST_SKIP (for the caller to return) when a checkpoint directory is absent;
 * aborts the test on any other problem. */
static inline int gen_open(const char *spec, struct ckpt **ret, char **ret_gen_dir)
{
    struct err_buf e = {{0}};
    struct model_config pc;
    char cpath[4096];
    char *gen_dir = gen_model(spec);
    const char *dir = gen_dir ? gen_dir : spec;

    *ret_gen_dir = gen_dir;
    if (!gen_dir && access(dir, R_OK) != 0) {
        printf("checkpoint %s absent: skipped\n", dir);
        return TEST_SKIP;
    }
    snprintf(cpath, sizeof(cpath), "%s/config.json", dir);
    if (model_config_load(cpath, &pc, &e) < 0)
        FAIL("%s", e.msg);
    struct ckpt_opts co = {.world_size = 1, .rank = 0, .mtp_depth = pc.n_mtp_layers};
    if (ckpt_open(dir, &co, ret, &e) < 0)
        FAIL("ckpt_open %s: %s", dir, e.msg);
    return 0;
}

/* Remove the temporary directory gen_open made (gen_dir may be NULL) and free its name. */
static inline void gen_remove(char *gen_dir)
{
    if (gen_dir) {
        ckptw_rmtree(gen_dir);
        free(gen_dir);
    }
}

/* gen_open's undo: close the checkpoint, then gen_remove. */
static inline void gen_close(struct ckpt *ck, char *gen_dir)
{
    ckpt_close(ck);
    gen_remove(gen_dir);
}
