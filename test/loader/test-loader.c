/* test-loader.c - the checkpoint loader against tiny checkpoints in the real
 * naming scheme written by ckptw: sharded MXFP4 experts, MTP with and without
 * optional KV scales / zero points, missing / mismatched / unknown tensors,
 * both name spellings, flat and nested configs, --mtp-model, the TP/EP slices of
 * every rank, and the index path-escape cases (docs/RELIABILITY.md C3). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckptw.h"
#include "harness.h"
#include "loader.h"
#include "mxfp4.h"
#include "safetensors.h"

static char *root;

static char *mkdir_case(const char *name)
{
    char *p;
    if (asprintf(&p, "%s/%s", root, name) < 0)
        abort();
    mkdir(p, 0755);
    return p;
}

/* what the KV cache reads: every kind, so that the tests see what the loader plans */
static unsigned kv_params = CKPT_KV_PARAMS_ALL;

static int open_ckpt(const char *dir, int ws, int rank, int K, const char *mtp_dir, struct ckpt **c,
                     struct err_buf *e, char **report)
{
    struct ckpt_opts o = { .world_size = ws, .rank = rank, .mtp_depth = K, .mtp_dir = mtp_dir,
                           .ret_report = report, .kv_params = kv_params };
    return ckpt_open(dir, &o, c, e);
}

static float bf16_at(const struct tview *v, int64_t i)
{
    uint16_t h;
    memcpy(&h, (const unsigned char *) v->data + 2 * i, 2);
    return ckptw_bf16_to_f32(h);
}

/* Property: a 3-shard checkpoint with MXFP4 experts spread over the shards, MTP
 * layers carrying per-head k/v scales and zero points, loads for N=1 and returns
 * the exact bytes the writer stored (dense BF16 and MXFP4 decode). */
static void test_full_load(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview v;
    struct ckpt_plan_stats st;
    char *dir = mkdir_case("full");
    float scales[8];

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.kv_scales = CKPTW_OPT_PER_HEAD;
    o.zero_points = CKPTW_OPT_PER_HEAD;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 2);
    ASSERT_EQ(ckpt_config(c)->n_layers, 4);
    ASSERT_EQ(ckpt_config(c)->quant, QUANT_MXFP4);
    ASSERT_STREQ(ckpt_warnings(c), "");

    /* experts of layer 2 and 3 live in different shards */
    {
        char p1[512];
        struct sft_file *f;
        int shards_with_experts = 0;
        for (int s = 1; s <= 3; s++) {
            const struct sft_header *h;
            bool any = false;
            snprintf(p1, sizeof(p1), "%s/model-%05d-of-00003.safetensors", dir, s);
            ASSERT_OK(sft_open(p1, SFT_OPEN_HEADERS_ONLY, &f, &e));
            h = sft_file_header(f);
            for (size_t i = 0; i < h->n_tensors; i++)
                any |= strstr(h->tensors[i].name, ".moe.experts.") != NULL;
            shards_with_experts += any;
            sft_close(f);
        }
        ASSERT_LE(2, shards_with_experts);
    }

    ASSERT_OK(ckpt_get(c, "model.layers.0.self_attn.q_proj.weight", &v));
    ASSERT_EQ(v.dtype, DTYPE_BF16);
    ASSERT_EQ(v.shape[0], 8 * 16);
    ASSERT_EQ(v.shape[1], 64);
    for (int64_t i = 0; i < 100; i++)
        ASSERT_EQ(bf16_at(&v, i), ckptw_bf16_to_f32(ckptw_f32_to_bf16(
            ckptw_random_value(1, "model.layers.0.self_attn.q_proj.weight", i, 0.05f))));

    /* MXFP4 expert: decodes to the quantised writer values */
    {
        struct tview pk, sc;
        float row[64], ref[64], q[64];
        uint8_t rp[32], rs[2];
        ASSERT_OK(ckpt_get(c, "model.layers.3.moe.experts.15.up_proj.weight_packed", &pk));
        ASSERT_OK(ckpt_get(c, "model.layers.3.moe.experts.15.up_proj.weight_scale", &sc));
        ASSERT_EQ(pk.dtype, DTYPE_U8);
        ASSERT_EQ(pk.shape[0], 64);
        ASSERT_EQ(pk.shape[1], 32);
        ASSERT_EQ(sc.shape[1], 2);
        ASSERT_OK(mxfp4_row_decode((const uint8_t *) pk.data + 5 * 32, (const uint8_t *) sc.data + 5 * 2, 64, row));
        for (int i = 0; i < 64; i++)
            ref[i] = ckptw_random_value(1, "model.layers.3.moe.experts.15.up_proj.weight", 5 * 64 + i, 0.05f);
        ASSERT_OK(mxfp4_row_quantize(ref, 64, rp, rs));
        ASSERT_OK(mxfp4_row_decode(rp, rs, 64, q));
        for (int i = 0; i < 64; i++) {
            ASSERT_EQ(row[i], q[i]);
            ASSERT_NEAR(row[i], ref[i], 0.05f / 4 + 1e-6);
        }
    }

    /* optional parameters: per-head values loaded, absent ones defaulted */
    ASSERT_EQ(ckpt_get_optional(c, "model.layers.4.self_attn.k_scale", 1.0f, scales, 8), 1);
    ASSERT_EQ(scales[3], 1.0f + 0.125f * 3);
    ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.v_zero_point", 0.0f, scales, 8), 1);
    ASSERT_EQ(scales[7], 7.0f);
    ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.q_scale", 1.0f, scales, 8), 0);
    ASSERT_EQ(scales[0], 1.0f);
    ASSERT_ERR(ckpt_get(c, "model.layers.1.self_attn.prob_scale", &v), -ENOENT);

    /* MTP tensors with their own head */
    ASSERT_OK(ckpt_get(c, "model.layers.5.transformer.shared_head.output.weight", &v));
    ASSERT_EQ(v.shape[0], 256);
    ASSERT_ERR(ckpt_get(c, "model.layers.6.enorm.weight", &v), -ENOENT);

    ckpt_plan_stats(c, &st);
    ASSERT_EQ(st.expert_first, 0);
    ASSERT_EQ(st.expert_count, 16);
    /* 3 globals + 4 layers x 9 attention/norm + 2 dense x 3 + 2 MoE x (5 + 16 experts x 6)
     * + 2 MTP x (9 + 3 + 5) + 4 optional per layer x 6 */
    ASSERT_EQ(st.n_tensors, 3 + 4 * 9 + 2 * 3 + 2 * (5 + 96) + 2 * (9 + 3 + 5) + 4 * 6);
    ckpt_close(c);
    free(dir);
}

/* Property: MTP layers load with and without k/v zero points and scalar scales
 * (the optional-parameter rule), in the same checkpoint layout. */
static void test_mtp_optional_variants(void)
{
    static const struct { enum ckptw_optional sc, zp; bool trunk, mtp; } cases[] = {
        { CKPTW_OPT_NONE, CKPTW_OPT_NONE, false, false },
        { CKPTW_OPT_SCALAR, CKPTW_OPT_NONE, false, true },
        { CKPTW_OPT_NONE, CKPTW_OPT_SCALAR, false, true },
        { CKPTW_OPT_PER_HEAD, CKPTW_OPT_SCALAR, true, false },
        { CKPTW_OPT_SCALAR, CKPTW_OPT_PER_HEAD, true, true },
    };
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        struct model_config cfg;
        struct ckptw_opts o;
        struct err_buf e = { "" };
        struct ckpt *c;
        char name[32], *dir;
        float out[8];

        snprintf(name, sizeof(name), "mtpopt%zu", i);
        dir = mkdir_case(name);
        ckptw_config_tiny(&cfg);
        ckptw_opts_default(&o);
        o.n_shards = 2;
        o.kv_scales = cases[i].sc;
        o.zero_points = cases[i].zp;
        o.optional_trunk = cases[i].trunk;
        o.optional_mtp = cases[i].mtp;
        ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
        for (int ws = 1; ws <= 8; ws *= 2)
            for (int r = 0; r < ws; r++) {
                if (open_ckpt(dir, ws, r, 2, NULL, &c, &e, NULL) < 0)
                    FAIL("case %zu ws %d rank %d: %s", i, ws, r, e.msg);
                ASSERT_EQ(ckpt_mtp_depth(c), 2);
                /* scalar broadcasts; per-head gives this rank's slice */
                ASSERT_TRUE(ckpt_get_optional(c, "model.layers.1.self_attn.k_scale", 1.0f, out, 8 / ws) >= 0);
                if (cases[i].sc == CKPTW_OPT_PER_HEAD && cases[i].trunk)
                    ASSERT_EQ(out[0], 1.0f + 0.125f * (float) (r * 8 / ws));
                else
                    ASSERT_EQ(out[0], 1.0f);
                if (r == 0)
                    ASSERT_TRUE(ckpt_get_optional(c, "model.layers.4.self_attn.v_zero_point", 0.0f, out, 8) >= 0);
                ckpt_close(c);
            }
        free(dir);
    }
}

/* Property: missing required tensors produce ONE error listing every one of them
 * (and nothing is opened); wrong dtype/shape are listed with their shard. */
static void test_missing_and_mismatch(void)
{
    static const char *const omit[] = {
        "model.layers.0.self_attn.k_proj.weight", "model.layers.2.moe.experts.7.down_proj.weight_scale",
        "model.norm.weight", "model.layers.5.eh_proj.weight", NULL,
    };
    struct ckptw_override ov[] = {
        { "model.layers.1.self_attn.o_proj.weight", DTYPE_F16, 2, { 64, 256 } },
        { "model.layers.3.moe.gate.weight", DTYPE_BF16, 2, { 15, 64 } },
    };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c = NULL;
    char *dir = mkdir_case("missing"), *report = NULL;

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.omit = omit;
    o.overrides = ov;
    o.n_overrides = 2;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_ERR(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, &report), -ENOENT);
    ASSERT_TRUE(c == NULL);
    ASSERT_CONTAINS(e.msg, "5 problems");
    ASSERT_TRUE(report != NULL);
    for (int i = 0; omit[i + 1]; i++) {
        ASSERT_CONTAINS(e.msg, omit[i]);
        ASSERT_CONTAINS(report, omit[i]);
    }
    /* a missing MTP tensor costs speculation, not the load: not a problem */
    ASSERT_TRUE(strstr(report, "layers.5.eh_proj") == NULL);
    ASSERT_CONTAINS(report, "mismatch: model.layers.1.self_attn.o_proj.weight in ");
    ASSERT_CONTAINS(report, ".safetensors: F16 [64,256], expected BF16 [64,256]");
    ASSERT_CONTAINS(report, "mismatch: model.layers.3.moe.gate.weight");
    ASSERT_CONTAINS(report, "BF16 [15,64], expected BF16 [16,64]");
    free(report);

    /* rank 1 of 2 does not hold expert 7: its own problems only */
    ASSERT_ERR(open_ckpt(dir, 2, 1, 2, NULL, &c, &e, NULL), -ENOENT);
    ASSERT_TRUE(strstr(e.msg, "experts.7.") == NULL);
    ASSERT_TRUE(strstr(e.msg, "layers.5.eh_proj") == NULL);   /* MTP is rank 0's */
    ASSERT_CONTAINS(e.msg, "model.layers.0.self_attn.k_proj.weight");
    free(dir);
}

/* Property: unknown extra tensors are warnings naming them, not errors. */
static void test_unknown_warning(void)
{
    static const char *const extra[] = { "model.layers.0.self_attn.rotary_emb.inv_freq",
                                         "vision_model.conv1.weight", "model.layers.1.mlp.gate_proj.input_scale", NULL };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    char *dir = mkdir_case("unknown");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.extra = extra;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 0, NULL, &c, &e, NULL));
    ASSERT_CONTAINS(ckpt_warnings(c), "unknown tensor model.layers.0.self_attn.rotary_emb.inv_freq");
    ASSERT_CONTAINS(ckpt_warnings(c), "unknown tensor model.layers.1.mlp.gate_proj.input_scale");
    ASSERT_CONTAINS(ckpt_warnings(c), "1 vision tensors ignored");
    ckpt_close(c);
    free(dir);
}

/* Property: MTP requested but absent, or partly present -> warning and depth 0 (the trunk
 * is served), the partial case listing every missing MTP tensor. */
static void test_mtp_absent_partial(void)
{
    static const char *const omit[] = { "model.layers.4.hnorm.weight",
                                        "model.layers.5.transformer.shared_head.norm.weight", NULL };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    char *dir = mkdir_case("mtpabsent"), *dir2 = mkdir_case("mtppartial");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.write_mtp = false;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 0);
    ASSERT_CONTAINS(ckpt_warnings(c), "MTP requested (K=2) but none of the");
    ASSERT_CONTAINS(ckpt_warnings(c), "serving without speculation");
    ckpt_close(c);
    /* every rank agrees on the depth */
    ASSERT_OK(open_ckpt(dir, 2, 1, 2, NULL, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 0);
    ckpt_close(c);

    ckptw_opts_default(&o);
    o.omit = omit;
    ASSERT_OK(ckptw_write(dir2, &cfg, &o, &e));
    for (int ws = 1; ws <= 2; ws++) {
        ASSERT_OK(open_ckpt(dir2, ws, ws - 1, 2, NULL, &c, &e, NULL));
        ASSERT_EQ(ckpt_mtp_depth(c), 0);
        ASSERT_CONTAINS(ckpt_warnings(c), "MTP requested (K=2) but 2 of the 34 tensors of layers 4..5 are missing");
        ASSERT_CONTAINS(ckpt_warnings(c), "serving without speculation (the trunk only)");
        ASSERT_CONTAINS(ckpt_warnings(c), "MTP tensor missing: model.layers.4.hnorm.weight");
        ASSERT_CONTAINS(ckpt_warnings(c), "MTP tensor missing: model.layers.5.transformer.shared_head.norm.weight");
        /* the trunk is planned, no MTP tensor is */
        struct tview v;
        ASSERT_ERR(ckpt_get(c, "model.layers.4.enorm.weight", &v), -ENOENT);
        ASSERT_OK(ckpt_get(c, "model.norm.weight", &v));
        ckpt_close(c);
    }
    /* K=1 only needs layer 4 */
    ASSERT_OK(open_ckpt(dir2, 1, 0, 1, NULL, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 0);
    ASSERT_TRUE(strstr(ckpt_warnings(c), "layers.5.") == NULL);
    ckpt_close(c);
    /* K=0 does not look at MTP at all */
    ASSERT_OK(open_ckpt(dir2, 1, 0, 0, NULL, &c, &e, NULL));
    ASSERT_STREQ(ckpt_warnings(c), "");
    ckpt_close(c);
    ASSERT_ERR(open_ckpt(dir2, 1, 0, 3, NULL, &c, &e, NULL), -EINVAL);
    ASSERT_CONTAINS(e.msg, "num_nextn_predict_layers = 2");
    free(dir);
    free(dir2);
}

/* Property: MTP from a separate --mtp-model directory; the flat config layout and
 * the model.language_model.* spelling load the same tensors. */
static void test_mtp_dir_and_spellings(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview v;
    char *dir = mkdir_case("trunk"), *mdir = mkdir_case("mtpdir"), *ldir = mkdir_case("lmprefix");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.mtp_dir = mdir;
    o.nested = false;
    o.kv_scales = CKPTW_OPT_SCALAR;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 0);   /* no MTP in the trunk directory */
    ASSERT_TRUE(!ckpt_config(c)->nested);
    ckpt_close(c);
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, mdir, &c, &e, NULL));
    ASSERT_EQ(ckpt_mtp_depth(c), 2);
    ASSERT_OK(ckpt_get(c, "model.layers.5.eh_proj.weight", &v));
    ASSERT_EQ(v.shape[1], 128);
    ckpt_close(c);

    ckptw_opts_default(&o);
    o.language_model_prefix = true;
    o.single_file = true;
    o.n_shards = 1;
    ASSERT_OK(ckptw_write(ldir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(ldir, 2, 0, 2, NULL, &c, &e, NULL));
    ASSERT_OK(ckpt_get(c, "model.layers.4.self_attn.q_proj.weight", &v));
    ASSERT_OK(ckpt_get(c, "model.language_model.layers.4.self_attn.q_proj.weight", &v));
    ASSERT_OK(ckpt_get(c, "model.embed_tokens.weight", &v));
    ASSERT_OK(ckpt_get(c, "lm_head.weight", &v));
    ASSERT_EQ(v.shape[0], 128);   /* vocab slice */
    ckpt_close(c);
    free(dir);
    free(mdir);
    free(ldir);
}

/* Property: for N in {2,4,8} each rank gets exactly its head rows of q/k/v/g, its
 * columns of o_proj and dense/shared down, its rows of gate/up and lm_head, its
 * contiguous experts; MTP only on rank 0; the slices tile the full tensors. */
static void test_slices(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *full, *c;
    char *dir = mkdir_case("slices");
    static const char *const rows[] = { "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                        "model.layers.0.self_attn.g_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                        "model.layers.2.share_expert.gate_proj.weight", "lm_head.weight" };
    static const char *const cols[] = { "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                                        "model.layers.3.share_expert.down_proj.weight" };

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &full, &e, NULL));
    for (int ws = 2; ws <= 8; ws *= 2) {
        int64_t total_bytes = 0, total_experts = 0;
        for (int r = 0; r < ws; r++) {
            struct ckpt_plan_stats st;
            struct tview f, s;
            int first, count;
            ASSERT_OK(open_ckpt(dir, ws, r, 2, NULL, &c, &e, NULL));
            ckpt_expert_range(c, &first, &count);
            ASSERT_EQ(first, r * 16 / ws);
            ASSERT_EQ(count, 16 / ws);
            total_experts += count;
            ASSERT_EQ(ckpt_get(c, "model.layers.2.moe.experts.0.gate_proj.weight_packed", &s), r == 0 ? 0 : -ENOENT);
            ASSERT_EQ(ckpt_get(c, "model.layers.4.enorm.weight", &s), r == 0 ? 0 : -ENOENT);
            ASSERT_OK(ckpt_get(c, "model.layers.3.moe.gate.weight", &s));
            ASSERT_EQ(s.shape[0], 16);   /* router replicated */
            for (size_t i = 0; i < ARRAY_SIZE(rows); i++) {
                ASSERT_OK(ckpt_get(full, rows[i], &f));
                ASSERT_OK(ckpt_get(c, rows[i], &s));
                ASSERT_EQ(s.shape[0] * ws, f.shape[0]);
                ASSERT_EQ(s.shape[1], f.shape[1]);
                ASSERT_TRUE(memcmp(s.data, (const char *) f.data + s.nbytes * (size_t) r, s.nbytes) == 0);
            }
            for (size_t i = 0; i < ARRAY_SIZE(cols); i++) {
                int64_t w;
                ASSERT_OK(ckpt_get(full, cols[i], &f));
                ASSERT_OK(ckpt_get(c, cols[i], &s));
                w = s.shape[1];
                ASSERT_EQ(w * ws, f.shape[1]);
                for (int64_t row = 0; row < f.shape[0]; row++)
                    ASSERT_TRUE(memcmp((const char *) s.data + row * w * 2,
                                       (const char *) f.data + (row * f.shape[1] + r * w) * 2, (size_t) w * 2) == 0);
            }
            ckpt_plan_stats(c, &st);
            total_bytes += st.bytes;
            ckpt_close(c);
        }
        ASSERT_EQ(total_experts, 16);
        (void) total_bytes;
    }
    ckpt_close(full);
    free(dir);
}

/* Load progress counts bytes: 0 of the plan's bytes after open; each planned tensor adds
 * exactly the bytes of this rank's slice the first time ckpt_get() hands it out (rows,
 * columns, whole tensors), never twice; after every planned tensor, done == total. */
static void test_load_progress(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt_plan_stats st;
    struct ckpt *c;
    char *dir = mkdir_case("progress"), *plan = NULL, *line, *save = NULL;
    size_t plan_len = 0;
    int64_t done, total, expect = 0;
    int n = 0, cols = 0;
    FILE *f;

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 2, 1, 0, NULL, &c, &e, NULL));
    ckpt_plan_stats(c, &st);
    ckpt_load_progress(c, &done, &total);
    ASSERT_EQ(done, 0);
    ASSERT_EQ(total, st.bytes);
    ASSERT_TRUE(total > 0);
    f = open_memstream(&plan, &plan_len);
    ASSERT_TRUE(f != NULL);
    ckpt_plan_dump(c, f);
    fclose(f);
    for (line = strtok_r(plan, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char name[256], slice[64];
        long long bytes;
        struct tview v;

        ASSERT_EQ(sscanf(line, "%255s %*s %*s %63s %lld", name, slice, &bytes), 3);
        ASSERT_OK(ckpt_get(c, name, &v));
        expect += bytes;
        ckpt_load_progress(c, &done, &total);
        ASSERT_EQ(done, expect);
        ASSERT_EQ((long long)v.nbytes, bytes);
        ASSERT_OK(ckpt_get(c, name, &v));           /* again: not counted twice */
        ckpt_load_progress(c, &done, &total);
        ASSERT_EQ(done, expect);
        cols += strncmp(slice, "cols", 4) == 0;
        n++;
    }
    ASSERT_EQ(n, st.n_tensors);
    ASSERT_TRUE(cols > 0);                          /* column slices (copies) counted too */
    ASSERT_EQ(done, total);
    free(plan);
    ckpt_close(c);
    free(dir);
}

/* Property: a world size that does not divide the heads is refused, naming the field. */
static void test_not_divisible(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    char *dir = mkdir_case("nodiv");

    ckptw_config_tiny(&cfg);
    cfg.n_heads_sliding = 12;
    for (int i = 0; i < cfg.n_layers_total; i++)
        if (cfg.layers[i].kind == LAYER_KIND_SLIDING)
            cfg.layers[i].n_heads = 12;
    cfg.n_kv_heads = 4;
    for (int i = 0; i < cfg.n_layers_total; i++)
        cfg.layers[i].n_kv_heads = 4;
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 4, 3, 2, NULL, &c, &e, NULL));
    ckpt_close(c);
    ASSERT_ERR(open_ckpt(dir, 8, 0, 2, NULL, &c, &e, NULL), -EINVAL);
    ASSERT_CONTAINS(e.msg, "world size 8 does not divide attention_other_setting.num_attention_heads (sliding layers) = 12");
    ASSERT_CONTAINS(e.msg, "num_attention_groups (KV heads) = 4");
    ASSERT_ERR(open_ckpt(dir, 3, 0, 2, NULL, &c, &e, NULL), -EINVAL);
    ASSERT_CONTAINS(e.msg, "world size 3 is not 1, 2, 4 or 8");
    ASSERT_ERR(open_ckpt(dir, 2, 2, 2, NULL, &c, &e, NULL), -EINVAL);
    free(dir);
}

/* Property: an optional parameter of any shape with n_kv_heads values ([2,4] here)
 * is accepted and sliced per rank by KV head. */
static void test_optional_any_shape(void)
{
    struct ckptw_override ov[] = { { "model.layers.1.self_attn.k_scale", DTYPE_F32, 2, { 2, 4 } } };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview v;
    float out[8];
    char *dir = mkdir_case("optshape");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.kv_scales = CKPTW_OPT_PER_HEAD;
    o.overrides = ov;
    o.n_overrides = 1;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    for (int r = 0; r < 2; r++) {
        ASSERT_OK(open_ckpt(dir, 2, r, 2, NULL, &c, &e, NULL));
        ASSERT_OK(ckpt_get(c, "model.layers.1.self_attn.k_scale", &v));
        ASSERT_EQ(v.ndim, 1);
        ASSERT_EQ(v.shape[0], 4);
        ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.k_scale", 1.0f, out, 4), 1);
        ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.v_scale", 1.0f, out, 4), 1);
        ASSERT_EQ(out[0], 1.0f + 0.125f * (float) (4 * r));
        ckpt_close(c);
    }
    free(dir);
}

/* Property: the optional-parameter rule is by suffix, whatever the shape or dtype: a k_scale
 * of 3 elements, an I32 v_scale, a q_scale per query head and a prob_scale of any length all
 * load (nothing is checked against head counts; the reader, ckpt_get_optional, refuses what
 * it cannot use); a KV cache that reads none of them ignores them with one warning. */
static void test_optional_unvalidated(void)
{
    static const char *const extra[] = { "model.layers.1.self_attn.q_scale", "model.layers.2.self_attn.prob_scale",
                                         NULL };
    struct ckptw_override ov[] = {
        { "model.layers.1.self_attn.k_scale", DTYPE_F32, 1, { 3 } },
        { "model.layers.4.self_attn.v_scale", DTYPE_I32, 0, { 0 } },
        { "model.layers.1.self_attn.q_scale", DTYPE_F32, 1, { 16 } },
        { "model.layers.2.self_attn.prob_scale", DTYPE_BF16, 1, { 5 } },
    };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview v;
    float out[16];
    char *dir = mkdir_case("badopt");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.extra = extra;
    o.kv_scales = CKPTW_OPT_SCALAR;
    o.overrides = ov;
    o.n_overrides = 4;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    for (int ws = 1; ws <= 2; ws++) {
        if (open_ckpt(dir, ws, 0, 2, NULL, &c, &e, NULL) < 0)
            FAIL("world %d: %s", ws, e.msg);
        ASSERT_OK(ckpt_get(c, "model.layers.1.self_attn.k_scale", &v));
        ASSERT_EQ(v.shape[0], 3);               /* 3 values split by no one */
        ASSERT_ERR(ckpt_get_optional(c, "model.layers.1.self_attn.k_scale", 1.0f, out, 8 / ws), -EINVAL);
        ASSERT_ERR(ckpt_get_optional(c, "model.layers.4.self_attn.v_scale", 1.0f, out, 8), -EINVAL);
        ASSERT_OK(ckpt_get(c, "model.layers.1.self_attn.q_scale", &v));
        ASSERT_EQ(v.shape[0], 16 / ws);         /* per query head: this rank's heads */
        ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.q_scale", 1.0f, out, 16 / ws), 1);
        ASSERT_OK(ckpt_get(c, "model.layers.2.self_attn.prob_scale", &v));
        ASSERT_EQ(v.shape[0], 5);
        ckpt_close(c);
    }
    /* a KV cache that reads none: one summary warning, nothing planned */
    kv_params = 0;
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL));
    const char *w = ckpt_warnings(c);
    ASSERT_CONTAINS(w, " KV-quantisation parameters ignored: the KV cache does not use them (e.g. model.layers.");
    ASSERT_TRUE(strstr(strstr(w, "KV-quantisation") + 1, "KV-quantisation") == NULL);   /* one line */
    ASSERT_CONTAINS(w, "ignored: the KV cache does not use them");
    ASSERT_ERR(ckpt_get(c, "model.layers.1.self_attn.k_scale", &v), -ENOENT);
    ASSERT_EQ(ckpt_get_optional(c, "model.layers.1.self_attn.k_scale", 1.0f, out, 8), 0);
    ASSERT_EQ(out[0], 1.0f);
    ckpt_close(c);
    kv_params = CKPT_KV_PARAMS_ALL;
    free(dir);
}

/* ------------------------------------------------------------------------ */
/* C3: index cases */

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void write_tiny_shard(const char *path, const char *const *names)
{
    struct ckptw_tensor t[8];
    struct err_buf e;
    static const uint16_t data[8][4];
    size_t n = 0;
    for (; names[n]; n++) {
        t[n] = (struct ckptw_tensor) { .name = names[n], .dtype = DTYPE_BF16, .ndim = 1, .shape = { 4 }, .data = data[n] };
    }
    ASSERT_OK(ckptw_write_safetensors(path, t, n, false, &e));
}

/* Property: the index cannot point outside the model directory (../, absolute,
 * symlink out), a missing shard, a tensor in two shards, index entries missing
 * from their shard and shard tensors absent from the index are all refused with
 * a message naming the tensor and shard. */
static void test_index_c3(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    char *base = mkdir_case("c3"), *outside = mkdir_case("c3-outside"), path[PATH_MAX], cfgp[PATH_MAX];
    static const char *const ab[] = { "a.w", "b.w", NULL }, *const cd[] = { "c.w", "a.w", NULL };
    static const struct {
        const char *index;
        int err;
        const char *msg;
    } cases[] = {
        { "{\"weight_map\": {\"a.w\": \"../x.safetensors\"}}", -EACCES, "tensor 'a.w': shard '../x.safetensors' is not a plain file name" },
        { "{\"weight_map\": {\"a.w\": \"/etc/x.safetensors\"}}", -EACCES, "tensor 'a.w': shard '/etc/x.safetensors' is an absolute path" },
        { "{\"weight_map\": {\"a.w\": \"sub/x.safetensors\"}}", -EACCES, "is not a plain file name" },
        { "{\"weight_map\": {\"a.w\": \"x.bin\"}}", -EINVAL, "does not end in .safetensors" },
        { "{\"weight_map\": {\"a.w\": 3}}", -EBADMSG, "weight_map.a.w: expected a shard file name, got an integer" },
        { "{\"weight_map\": {\"a.w\": \"s1.safetensors\", \"a.w\": \"s2.safetensors\"}}", -EBADMSG, "duplicate" },
        { "{\"metadata\": {}}", -ENOENT, "weight_map: required field is missing" },
        { "{\"weight_map\": {\"a.w\": \"gone.safetensors\"}}", -ENOENT, "gone.safetensors: shard cannot be opened" },
        { "{\"weight_map\": {\"a.w\": \"link.safetensors\"}}", -EACCES, "outside the model directory" },
        { "{\"weight_map\": {\"a.w\": \"s1.safetensors\", \"b.w\": \"s1.safetensors\", \"c.w\": \"s2.safetensors\"}}", -EEXIST,
          "tensor 'a.w' is also present here, but model.safetensors.index.json maps it to s1.safetensors" },
        { "{\"weight_map\": {\"a.w\": \"s1.safetensors\", \"b.w\": \"s1.safetensors\", \"c.w\": \"s2.safetensors\", \"d.w\": \"s2.safetensors\"}}",
          -ENOENT, "tensor 'd.w' is listed in model.safetensors.index.json but missing from s2.safetensors" },
        { "{\"weight_map\": {\"a.w\": \"s1.safetensors\", \"c.w\": \"s2.safetensors\"}}", -EBADMSG,
          "s1.safetensors: tensor 'b.w' is not listed in model.safetensors.index.json" },
        { "[1, 2]", -EBADMSG, "must be a JSON object" },
    };

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    snprintf(path, sizeof(path), "%s/evil.safetensors", outside);
    write_tiny_shard(path, ab);
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        char name[32], *dir;
        snprintf(name, sizeof(name), "c3/case%zu", i);
        dir = mkdir_case(name);
        snprintf(cfgp, sizeof(cfgp), "%s/config.json", dir);
        ASSERT_OK(ckptw_write_config(cfgp, &cfg, true, false, &e));
        snprintf(path, sizeof(path), "%s/s1.safetensors", dir);
        write_tiny_shard(path, ab);
        snprintf(path, sizeof(path), "%s/s2.safetensors", dir);
        write_tiny_shard(path, cd);
        snprintf(path, sizeof(path), "%s/link.safetensors", dir);
        {
            char target[PATH_MAX];
            snprintf(target, sizeof(target), "%s/evil.safetensors", outside);
            ASSERT_OK(symlink(target, path));
        }
        snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
        write_file(path, cases[i].index);
        if (open_ckpt(dir, 1, 0, 0, NULL, &c, &e, NULL) != cases[i].err)
            FAIL("case %zu: expected %d, got: %s", i, cases[i].err, e.msg);
        ASSERT_CONTAINS(e.msg, cases[i].msg);
        free(dir);
    }
    free(base);
    free(outside);
}

static int fill_norms(void *user, const char *name, int ndim, const int64_t *shape, float *out)
{
    size_t n = strlen(name);
    (void) user;
    if (n < 11 || strcmp(name + n - 11, "norm.weight") != 0)
        return 0;
    for (int64_t i = 0; i < shape[0]; i++)
        out[i] = 0.25f * (float) (i % 4);
    (void) ndim;
    return 1;
}

/* Property: given weights (fill callback) reach ckpt_get unchanged; the rest stay random. */
static void test_given_weights(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview v;
    char *dir = mkdir_case("given");

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.fill = fill_norms;
    o.seed = 7;
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL));
    ASSERT_OK(ckpt_get(c, "model.norm.weight", &v));
    for (int64_t i = 0; i < 64; i++)
        ASSERT_EQ(bf16_at(&v, i), 0.25f * (float) (i % 4));
    ASSERT_OK(ckpt_get(c, "model.layers.5.transformer.shared_head.norm.weight", &v));
    ASSERT_EQ(bf16_at(&v, 3), 0.75f);
    ASSERT_OK(ckpt_get(c, "model.layers.1.self_attn.v_proj.weight", &v));
    ASSERT_EQ(bf16_at(&v, 9), ckptw_bf16_to_f32(ckptw_f32_to_bf16(
        ckptw_random_value(7, "model.layers.1.self_attn.v_proj.weight", 9, 0.05f))));
    ckpt_close(c);
    free(dir);
}

/* Property: with tie_word_embeddings the vocab slice of lm_head comes from the
 * embedding; nothing is reported missing. */
static void test_tied_embeddings(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct tview emb, lm;
    char *dir = mkdir_case("tied");

    ckptw_config_tiny(&cfg);
    cfg.tie_word_embeddings = true;
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    ASSERT_OK(open_ckpt(dir, 2, 1, 0, NULL, &c, &e, NULL));
    ASSERT_TRUE(ckpt_config(c)->tie_word_embeddings);
    ASSERT_OK(ckpt_get(c, "model.embed_tokens.weight", &emb));
    ASSERT_OK(ckpt_get(c, "lm_head.weight", &lm));
    ASSERT_EQ(lm.shape[0], 128);
    ASSERT_TRUE(lm.data == (const char *) emb.data + 128 * 64 * 2);
    ckpt_close(c);
    free(dir);
}

/* Property: one damaged shard among three is reported alone (file named, cause
 * given), not as thousands of "missing" tensors. */
static void test_damaged_shard(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c;
    struct stat st;
    char *dir = mkdir_case("damaged"), path[PATH_MAX];

    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
    snprintf(path, sizeof(path), "%s/model-00002-of-00003.safetensors", dir);
    ASSERT_OK(stat(path, &st));
    ASSERT_OK(truncate(path, st.st_size - 1));
    ASSERT_ERR(open_ckpt(dir, 1, 0, 2, NULL, &c, &e, NULL), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "1 problem (world size 1, rank 0):");
    ASSERT_CONTAINS(e.msg, "model-00002-of-00003.safetensors: tensors need");
    ASSERT_CONTAINS(e.msg, "(truncated?)");
    free(dir);
}

/* ------------------------------------------------------------------------ */
/* formats (issue 43) */

/* the tiny config with its experts in q; FP8 in 32 x 32 blocks (the tiny widths are 64) */
static void tiny_in(struct model_config *cfg, enum quant_scheme q)
{
    ckptw_config_tiny(cfg);
    model_config_set_quant(cfg, q);
    if (q == QUANT_FP8)
        cfg->quant_block_rows = cfg->quant_group_size = 32;
}

static const char *const fmt_suffixes[_QUANT_MAX][4] = {
    [QUANT_NONE] = { ".weight" },
    [QUANT_MXFP4] = { ".weight_packed", ".weight_scale" },
    [QUANT_FP8] = { ".weight", ".weight_scale_inv" },
    [QUANT_NVFP4] = { ".weight", ".weight_scale", ".weight_scale_2" },
};

/* Property: in every format the routed experts load from one tensor per expert and from
 * the releases' stacked [n_experts, out, in] tensor per projection alike: every rank of
 * an expert-parallel group gets the same bytes for its own experts from both, as views
 * into the stacked tensor (expert e + 1's view starts one expert's bytes after e's), the
 * same per-rank byte plan, and no view of another rank's experts. */
static void test_formats_layouts(void)
{
    static const char *const pj[3] = { "gate_proj", "up_proj", "down_proj" };

    for (int q = 0; q < _QUANT_MAX; q++) {
        struct model_config cfg;
        struct ckptw_opts o;
        struct err_buf e = { "" };
        char name[32], *dir[2];

        tiny_in(&cfg, (enum quant_scheme) q);
        for (int st = 0; st < 2; st++) {
            snprintf(name, sizeof(name), "layout-%s-%d", quant_scheme_name((enum quant_scheme) q), st);
            dir[st] = mkdir_case(name);
            ckptw_opts_default(&o);
            o.stacked_experts = st;
            ASSERT_OK(ckptw_write(dir[st], &cfg, &o, &e));
        }
        for (int ws = 1; ws <= 4; ws *= 4) {
            for (int r = 0; r < ws; r += ws > 1 ? ws - 1 : 1) {
                struct ckpt *c[2];
                struct ckpt_plan_stats ps[2];
                int first, count;
                for (int st = 0; st < 2; st++) {
                    if (open_ckpt(dir[st], ws, r, 2, NULL, &c[st], &e, NULL) < 0)
                        FAIL("%s layout %d, ws %d rank %d: %s", quant_scheme_name((enum quant_scheme) q), st, ws, r, e.msg);
                    ckpt_plan_stats(c[st], &ps[st]);
                }
                ASSERT_EQ(ps[0].bytes, ps[1].bytes);
                ASSERT_EQ(ps[0].n_tensors, ps[1].n_tensors);
                ckpt_expert_range(c[1], &first, &count);
                for (int l = 2; l < 4; l++)
                    for (int k = 0; k < 3; k++)
                        for (int sfx = 0; fmt_suffixes[q][sfx]; sfx++) {
                            const void *prev = NULL;
                            for (int x = first; x < first + count; x++) {
                                struct tview a, b;
                                char n[160];
                                snprintf(n, sizeof(n), "model.layers.%d.moe.experts.%d.%s%s", l, x, pj[k], fmt_suffixes[q][sfx]);
                                ASSERT_OK(ckpt_get(c[0], n, &a));
                                ASSERT_OK(ckpt_get(c[1], n, &b));
                                ASSERT_EQ(a.dtype, b.dtype);
                                ASSERT_EQ(a.ndim, b.ndim);
                                for (int d = 0; d < a.ndim; d++)
                                    ASSERT_EQ(a.shape[d], b.shape[d]);
                                ASSERT_EQ(a.nbytes, b.nbytes);
                                ASSERT_TRUE(memcmp(a.data, b.data, a.nbytes) == 0);
                                if (prev)
                                    ASSERT_TRUE((const char *) b.data == (const char *) prev + b.nbytes);
                                prev = b.data;
                            }
                            if (ws > 1) {
                                struct tview b;
                                char n[160];
                                snprintf(n, sizeof(n), "model.layers.%d.moe.experts.%d.%s%s", l,
                                         (first + count) % cfg.n_experts, pj[k], fmt_suffixes[q][sfx]);
                                ASSERT_ERR(ckpt_get(c[1], n, &b), -ENOENT);
                            }
                        }
                ckpt_close(c[0]);
                ckpt_close(c[1]);
            }
        }
        free(dir[0]);
        free(dir[1]);
    }
}

/* Property: the FP8 and NVFP4 bytes the writer stores decode (codes x block or group
 * scales x global scale) to the weights they were made from, within the format's
 * rounding: E4M3 keeps 3 mantissa bits (|error| <= |w| / 16 + the subnormal step),
 * NVFP4 a half E2M1 step of the group plus the E4M3 rounding of the group scale. */
static void test_formats_decode(void)
{
    for (int q = QUANT_FP8; q <= QUANT_NVFP4; q++) {
        struct model_config cfg;
        struct ckptw_opts o;
        struct err_buf e = { "" };
        struct ckpt *c;
        struct tview w, s, g;
        char *dir = mkdir_case(q == QUANT_FP8 ? "decode-fp8" : "decode-nvfp4");
        const char *base = "model.layers.3.moe.experts.5.down_proj";
        char n[160], wn[160];
        double worst = 0;

        tiny_in(&cfg, (enum quant_scheme) q);
        ckptw_opts_default(&o);
        o.stacked_experts = q == QUANT_FP8;
        ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
        ASSERT_OK(open_ckpt(dir, 1, 0, 0, NULL, &c, &e, NULL));
        snprintf(n, sizeof(n), "%s.weight", base);
        ASSERT_OK(ckpt_get(c, n, &w));
        snprintf(n, sizeof(n), "%s.%s", base, q == QUANT_FP8 ? "weight_scale_inv" : "weight_scale");
        ASSERT_OK(ckpt_get(c, n, &s));
        snprintf(wn, sizeof(wn), "%s.weight", base);
        if (q == QUANT_FP8) {
            const int64_t rows = w.shape[0], cols = w.shape[1];
            ASSERT_EQ(w.dtype, DTYPE_F8_E4M3);
            ASSERT_EQ(s.shape[0], rows / 32);
            ASSERT_EQ(s.shape[1], cols / 32);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < cols; j++) {
                    float si, ref = ckptw_random_value(o.seed, wn, i * cols + j, o.init_scale);
                    memcpy(&si, (const char *) s.data + 4 * ((i / 32) * (cols / 32) + j / 32), 4);
                    double got = fp8_e4m3_value(((const uint8_t *) w.data)[i * cols + j]) * si;
                    double err = fabs(got - ref), tol = fabs(ref) / 16 + si * ldexp(1, -10);
                    if (err > tol)
                        FAIL("fp8 [%lld,%lld]: %g, expected %g", (long long) i, (long long) j, got, (double) ref);
                    worst = fmax(worst, err);
                }
        } else {
            const int64_t rows = w.shape[0], cols = w.shape[1] * 2;
            float gs;
            float *row = malloc((size_t) cols * sizeof(float));
            snprintf(n, sizeof(n), "%s.weight_scale_2", base);
            ASSERT_OK(ckpt_get(c, n, &g));
            ASSERT_EQ(g.dtype, DTYPE_F32);
            ASSERT_EQ(g.ndim, 0);
            ASSERT_EQ(s.dtype, DTYPE_F8_E4M3);
            memcpy(&gs, g.data, 4);
            for (int64_t i = 0; i < rows; i++) {
                ASSERT_OK(nvfp4_row_decode((const uint8_t *) w.data + i * cols / 2,
                                           (const uint8_t *) s.data + i * cols / 16, gs, cols, row));
                for (int64_t j = 0; j < cols; j++) {
                    float ref = ckptw_random_value(o.seed, wn, i * cols + j, o.init_scale), amax = 0;
                    double eff = fp8_e4m3_value(((const uint8_t *) s.data)[i * cols / 16 + j / 16]) * gs;
                    for (int t = 0; t < 16; t++)
                        amax = fmaxf(amax, fabsf(ckptw_random_value(o.seed, wn, i * cols + j / 16 * 16 + t, o.init_scale)));
                    double err = fabs(row[j] - ref), tol = eff + amax / 16;
                    if (err > tol)
                        FAIL("nvfp4 [%lld,%lld]: %g, expected %g", (long long) i, (long long) j, row[j], (double) ref);
                    worst = fmax(worst, err);
                }
            }
            free(row);
        }
        ASSERT_TRUE(worst > 0);   /* quantised, not a copy */
        ckpt_close(c);
        free(dir);
    }
}

/* Write cfg under o into a fresh case directory and open it at world size ws, which must
 * fail with err; returns the full problem report (caller frees). */
static int lines_in(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n + (s[-1] != '\n');
}

static char *problems_of(const char *name, const struct model_config *cfg, const struct ckptw_opts *o,
                         const struct model_config *claimed, int ws, int err)
{
    struct err_buf e = { "" };
    struct ckpt *c = NULL;
    char *dir = mkdir_case(name), *report = NULL;

    ASSERT_OK(ckptw_write(dir, cfg, o, &e));
    if (claimed) {
        /* the same files under another config.json */
        char p[512];
        snprintf(p, sizeof(p), "%s/config.json", dir);
        ASSERT_OK(ckptw_write_config(p, claimed, true, false, &e));
    }
    ASSERT_ERR(open_ckpt(dir, ws, ws - 1, 0, NULL, &c, &e, &report), err);
    ASSERT_TRUE(c == NULL && report != NULL);
    free(dir);
    return report;
}

/* Property: format problems are listed with every other problem, each naming the tensor
 * and what was expected: a missing scale, scales of the wrong dtype (per expert and
 * stacked, the stacked one once), an FP8 block size that does not divide a shape, and
 * block scales that would not split over the ranks. */
static void test_formats_bad_input(void)
{
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e = { "" };
    struct ckpt *c = NULL;
    char *report, *dir;

    /* FP8, stacked: a missing stacked scale, a stacked scale of the wrong dtype */
    {
        static const char *const omit[] = { "model.layers.2.moe.up_proj.weight_scale_inv", NULL };
        struct ckptw_override ov[] = {
            { "model.layers.3.moe.down_proj.weight_scale_inv", DTYPE_BF16, 3, { 16, 2, 2 } },
            { "model.layers.1.self_attn.q_proj.weight", DTYPE_BF16, 2, { 256, 64 } },
        };
        tiny_in(&cfg, QUANT_FP8);
        cfg.layers[1].qfmt[QMOD_Q] = QUANT_FP8;   /* a dense FP8 module stored as BF16 */
        ckptw_opts_default(&o);
        o.stacked_experts = true;
        o.omit = omit;
        o.overrides = ov;
        o.n_overrides = 2;
        report = problems_of("bad-fp8", &cfg, &o, NULL, 1, -EINVAL);
        ASSERT_CONTAINS(report, "missing: model.layers.2.moe.experts.0.up_proj.weight_scale_inv (F32 [2,2], or "
                        "model.layers.2.moe.up_proj.weight_scale_inv stacked [16, ...])");
        ASSERT_CONTAINS(report, "mismatch: model.layers.3.moe.down_proj.weight_scale_inv in ");
        ASSERT_CONTAINS(report, "BF16 [16,2,2], expected F32 [16,2,2]");
        ASSERT_TRUE(strstr(strstr(report, "mismatch: model.layers.3.moe.down_proj") + 1, "mismatch: model.layers.3.moe.down_proj") == NULL);
        ASSERT_CONTAINS(report, "mismatch: model.layers.1.self_attn.q_proj.weight in ");
        ASSERT_CONTAINS(report, "BF16 [256,64], expected F8_E4M3 [256,64]");
        free(report);
    }
    /* FP8 whose 128 x 128 blocks do not divide the tiny widths (64): one line per module,
     * the experts' once per layer and projection kind */
    {
        struct model_config c128;
        tiny_in(&cfg, QUANT_FP8);
        c128 = cfg;
        c128.quant_block_rows = c128.quant_group_size = 128;
        ckptw_opts_default(&o);
        report = problems_of("bad-fp8-block", &cfg, &o, &c128, 1, -EINVAL);
        ASSERT_CONTAINS(report, "model.layers.2.moe.experts.0.gate_proj: FP8 weight_block_size [128, 128] does not divide its shape [64, 64]");
        ASSERT_TRUE(strstr(report, "model.layers.2.moe.experts.1.gate_proj: FP8") == NULL);
        free(report);
    }
    /* NVFP4: group scales stored as U8, the global scale missing, listed together */
    {
        static const char *const omit[] = { "model.layers.3.moe.experts.9.gate_proj.weight_scale_2", NULL };
        struct ckptw_override ov[] = {
            { "model.layers.2.moe.experts.4.up_proj.weight_scale", DTYPE_U8, 2, { 64, 4 } },
        };
        tiny_in(&cfg, QUANT_NVFP4);
        ckptw_opts_default(&o);
        o.omit = omit;
        o.overrides = ov;
        o.n_overrides = 1;
        report = problems_of("bad-nvfp4", &cfg, &o, NULL, 1, -EINVAL);
        ASSERT_EQ(lines_in(report), 2);
        ASSERT_CONTAINS(report, "missing: model.layers.3.moe.experts.9.gate_proj.weight_scale_2 (F32 [], or "
                        "model.layers.3.moe.gate_proj.weight_scale_2 stacked [16, ...])");
        ASSERT_CONTAINS(report, "mismatch: model.layers.2.moe.experts.4.up_proj.weight_scale in ");
        ASSERT_CONTAINS(report, "U8 [64,4], expected F8_E4M3 [64,4]");
        free(report);
    }
    /* FP8 dense modules in 32-row blocks: 8 ranks would cut the k_proj's 4 block rows */
    {
        tiny_in(&cfg, QUANT_FP8);
        cfg.layers[0].qfmt[QMOD_K] = QUANT_FP8;
        ckptw_opts_default(&o);
        report = problems_of("bad-fp8-split", &cfg, &o, NULL, 8, -EINVAL);
        ASSERT_CONTAINS(report, "model.layers.0.self_attn.k_proj.weight_scale_inv: its rows (4) do not split over world size 8");
        ASSERT_EQ(lines_in(report), 1);
        free(report);
    }
    /* NVFP4 input_scale (W4A4 activation scales) is named in the warnings, not planned */
    {
        static const char *const extra[] = { "model.layers.2.moe.experts.0.up_proj.input_scale", NULL };
        dir = mkdir_case("nvfp4-input-scale");
        tiny_in(&cfg, QUANT_NVFP4);
        ckptw_opts_default(&o);
        o.extra = extra;
        ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
        ASSERT_OK(open_ckpt(dir, 1, 0, 0, NULL, &c, &e, NULL));
        ASSERT_CONTAINS(ckpt_warnings(c), "1 NVFP4 input_scale tensors ignored: activations are not quantised (W4A16)");
        ckpt_close(c);
        free(dir);
    }
}

int main(void)
{
    root = ckptw_tmpdir("stepd-test-loader");
    ASSERT_TRUE(root != NULL);
    test_full_load();
    test_mtp_optional_variants();
    test_missing_and_mismatch();
    test_unknown_warning();
    test_mtp_absent_partial();
    test_mtp_dir_and_spellings();
    test_slices();
    test_not_divisible();
    test_optional_unvalidated();
    test_optional_any_shape();
    test_index_c3();
    test_damaged_shard();
    test_given_weights();
    test_tied_embeddings();
    test_load_progress();
    test_formats_layouts();
    test_formats_decode();
    test_formats_bad_input();
    if (!getenv("STEPD_KEEP_TMP"))
        ckptw_rmtree(root);
    free(root);
    printf("test-loader: all passed\n");
    return 0;
}
