/* test-mkmodel-scale.c - the weight scaling of stepd-mkmodel's checkpoints, measured by a
 * forward of the independent double-precision oracle (naive.c) over the narrow8 preset
 * (the real head counts and head dim; the full width does not fit the oracle's doubles).
 *
 *   test-mkmodel-scale STEPD_MKMODEL
 *
 * For narrow8 with 3 layers (real layers 0, 3, 4: dense/full, MoE/sliding, MoE/full) + 1
 * MTP layer, and with 6 layers (the real prefix 0..5, so a smaller per-layer scale), over
 * N_TOK random tokens:
 *   - the residual stream's rms after the embedding and after every trunk layer, and the
 *     MTP layer's output rms, lie in [RMS_LO, RMS_HI] (the generator aims at 1 rising to
 *     at most sqrt(1.5) = 1.22 over the trunk);
 *   - every MoE layer spreads its tokens over the experts: each expert gets between
 *     MIN_SHARE and MAX_SHARE of the positions (top-8 of 32: 25 % each when uniform);
 *   - the logits are finite with a std in [0.5, 2] (lm_head reads a normalised input).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckptw.h"
#include "harness.h"
#include "loader.h"
#include "naive.h"

#define N_TOK 128
#define RMS_LO 0.85
#define RMS_HI 1.35
#define MAX_SHARE 0.50      /* of the positions: twice the uniform share */
#define MIN_SHARE 0.0625    /* a quarter of it */

static const char *mkmodel;

static void check_model(const char *flags, int n_layers)
{
    struct ckpt_opts co = { .world_size = 1, .mtp_depth = 1 };
    struct naive_trace tr;
    struct err_buf e = { "" };
    const struct model_config *cfg;
    struct ckpt *ck;
    struct naive *nv;
    char *dir = ckptw_tmpdir("test-mkmodel-scale"), cmd[8192];
    int32_t x[N_TOK + 1], ids[N_TOK];
    double *hid, *h2, *logits, ss, s, mean;
    uint32_t rnd = 12345;
    int V, H;

    ASSERT_TRUE(dir != NULL);
    snprintf(cmd, sizeof(cmd), "'%s' --out '%s' --force --preset narrow8 --mtp 1 %s > /dev/null", mkmodel,
             dir, flags);
    ASSERT_EQ(system(cmd), 0);
    if (ckpt_open(dir, &co, &ck, &e) < 0)
        FAIL("%s: %s", dir, e.msg);
    cfg = ckpt_config(ck);
    ASSERT_EQ(cfg->n_layers, n_layers);
    V = cfg->vocab_size;
    H = cfg->hidden_size;
    nv = naive_new(ck);
    ASSERT_TRUE(nv != NULL);
    tr.resid_rms = calloc((size_t)n_layers + 1, sizeof(double));
    tr.expert_tokens = calloc((size_t)n_layers * cfg->n_experts, sizeof(int));
    hid = malloc(sizeof(double) * N_TOK * H);
    h2 = malloc(sizeof(double) * N_TOK * H);
    logits = malloc(sizeof(double) * N_TOK * V);
    ASSERT_TRUE(tr.resid_rms && tr.expert_tokens && hid && h2 && logits);
    for (int i = 0; i <= N_TOK; i++) {
        rnd = rnd * 1664525u + 1013904223u;
        x[i] = (int32_t)((rnd >> 8) % (uint32_t)V);
    }

    naive_trace = &tr;
    naive_trunk(nv, x, N_TOK, hid, logits);
    naive_trace = NULL;

    printf("%s: residual rms", flags);
    for (int l = 0; l <= n_layers; l++)
        printf(" %s%.3f", l ? "" : "embed ", tr.resid_rms[l]);
    printf("\n");
    for (int l = 0; l <= n_layers; l++) {
        ASSERT_LE(RMS_LO, tr.resid_rms[l]);
        ASSERT_LE(tr.resid_rms[l], RMS_HI);
    }
    for (int l = 0; l < n_layers; l++) {
        int lo = N_TOK, hi = 0, sum = 0;
        if (!cfg->layers[l].is_moe)
            continue;
        for (int ex = 0; ex < cfg->n_experts; ex++) {
            int c = tr.expert_tokens[l * cfg->n_experts + ex];
            lo = c < lo ? c : lo;
            hi = c > hi ? c : hi;
            sum += c;
        }
        printf("layer %d (MoE): %d experts, tokens per expert %d..%d of %d (uniform %.0f)\n", l,
               cfg->n_experts, lo, hi, N_TOK, (double)N_TOK * cfg->top_k / cfg->n_experts);
        ASSERT_EQ(sum, N_TOK * cfg->top_k);
        ASSERT_LE(MIN_SHARE * N_TOK, lo);
        ASSERT_LE(hi, MAX_SHARE * N_TOK);
    }
    ss = mean = 0;
    for (int i = 0; i < N_TOK * V; i++) {
        ASSERT_TRUE(isfinite(logits[i]));
        mean += logits[i];
        ss += logits[i] * logits[i];
    }
    mean /= (double)N_TOK * V;
    s = sqrt(ss / ((double)N_TOK * V) - mean * mean);
    printf("logits: mean %.3f std %.3f\n", mean, s);
    ASSERT_LE(0.5, s);
    ASSERT_LE(s, 2.0);

    /* MTP depth 0: ids shifted by one, g = the trunk's pre-norm hidden */
    for (int i = 0; i < N_TOK; i++)
        ids[i] = x[i + 1];
    naive_mtp(nv, 0, ids, hid, N_TOK, h2, NULL);
    ss = 0;
    for (int i = 0; i < N_TOK * H; i++)
        ss += h2[i] * h2[i];
    s = sqrt(ss / ((double)N_TOK * H));
    printf("MTP layer output rms %.3f\n", s);
    ASSERT_LE(RMS_LO, s);
    ASSERT_LE(s, RMS_HI);

    free(tr.resid_rms);
    free(tr.expert_tokens);
    free(hid);
    free(h2);
    free(logits);
    naive_free(nv);
    ckpt_close(ck);
    ckptw_rmtree(dir);
    free(dir);
}

int main(int argc, char **argv)
{
    ASSERT_TRUE(argc == 2);
    setvbuf(stdout, NULL, _IOLBF, 0);
    mkmodel = argv[1];
    check_model("--seed 3", 3);
    check_model("--layers 6", 6);
    printf("ok\n");
    return 0;
}
