/* test-mkmodel.c - stepd-mkmodel's checkpoints against the real layout and the loader.
 *
 *   test-mkmodel STEPD_MKMODEL STEPD_INSPECT EXPECTED_TSV TINY_MODEL_DIR
 *
 *   1. full width, 3 layers + 3 MTP, sparse, 4 shards: every tensor name, dtype and shape
 *      equal to the expected-tensor TSV's for the real layers it copies (0, 3, 4; MTP
 *      45..47), nothing more; the config as the real one for those layers; the loader
 *      plans it at world sizes 1 and 8 (36 experts a rank, MTP 3) and stepd-inspect
 *      --world-size 8 --mtp 1 says loadable; the holes take no disk;
 *   2. full width, 45 layers + 3 MTP, sparse: exactly the TSV's 73254 text tensors;
 *   3. full width, 1 layer (real layer 3, MoE/sliding) with data except the embedding,
 *      the heads and experts 2..287 (holes, read as zeros): the std of BF16 and MXFP4
 *      weights equal to the generator's targets, E8M0 scales at the two exponents around
 *      the target, every E2M1 code used, the router spreading random unit inputs over
 *      all 288 experts;
 *   4. narrow8, 3 layers + 1 MTP, 3 shards: names and dtypes of the TSV, the real head
 *      counts (q/k/v/g rows, o_proj columns as the TSV), loadable at world size 8 (4
 *      experts a rank), a few tens of MB; with --tokenizer TINY_MODEL_DIR its tokenizer
 *      files and special ids (BOS 0, EOS 5, 2);
 *   5. determinism: the same seed gives identical files (1 or 2 threads), another seed
 *      other shard bytes, another shard count the same tensor bytes;
 *   6. bad flags and an occupied --out are refused with a message.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckptw.h"
#include "config.h"
#include "file.h"
#include "harness.h"
#include "loader.h"
#include "mxfp4.h"
#include "safetensors.h"
#include "vision-tensors.h"

#define ROUTER_INPUTS 512

static const char *mkmodel, *inspect, *tiny;
static struct ckptw_tsv_row *tsv;
static size_t n_tsv;
static char *root;

struct tinfo {
    char name[200];
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
};

static int cmp_tinfo(const void *a, const void *b)
{
    return strcmp(((const struct tinfo *)a)->name, ((const struct tinfo *)b)->name);
}

static bool is_vision(const char *n)
{
    return strncmp(n, "vision_model.", 13) == 0 || strncmp(n, "vit_large_projector", 19) == 0;
}

/* run stepd-mkmodel with flags into root/sub; returns the directory (static buffer) */
static const char *make(const char *sub, const char *flags)
{
    static char dir[PATH_MAX];
    char cmd[8192], *out;

    snprintf(dir, sizeof(dir), "%s/%s", root, sub);
    snprintf(cmd, sizeof(cmd), "'%s' --out '%s' --force %s", mkmodel, dir, flags);
    if (test_run(cmd, &out) != 0)
        FAIL("%s:\n%s", cmd, out);
    printf("%s", out);
    free(out);
    return dir;
}

/* every tensor of every shard of dir (sorted), the number of shards, the disk bytes */
static struct tinfo *read_headers(const char *dir, size_t *ret_n, int *ret_shards, int64_t *ret_disk)
{
    struct tinfo *t = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    DIR *d = opendir(dir);
    struct err_buf e;

    ASSERT_TRUE(d != NULL);
    *ret_shards = 0;
    *ret_disk = 0;
    while ((de = readdir(d))) {
        char path[PATH_MAX];
        struct sft_file *f;
        const struct sft_header *h;
        struct stat st;

        if (strncmp(de->d_name, "model-", 6) != 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        if (sft_open(path, SFT_OPEN_HEADERS_ONLY, &f, &e) < 0)
            FAIL("%s", e.msg);
        ASSERT_OK(stat(path, &st));
        *ret_disk += (int64_t)st.st_blocks * 512;
        h = sft_file_header(f);
        for (size_t i = 0; i < h->n_tensors; i++) {
            if (n == cap) {
                cap = cap ? cap * 2 : 1024;
                t = realloc(t, cap * sizeof(*t));
                ASSERT_TRUE(t != NULL);
            }
            snprintf(t[n].name, sizeof(t[n].name), "%s", h->tensors[i].name);
            t[n].dtype = h->tensors[i].dtype;
            t[n].ndim = h->tensors[i].ndim;
            memcpy(t[n].shape, h->tensors[i].shape, sizeof(t[n].shape));
            n++;
        }
        sft_close(f);
        (*ret_shards)++;
    }
    closedir(d);
    qsort(t, n, sizeof(*t), cmp_tinfo);
    *ret_n = n;
    return t;
}

/* The TSV's tensors for generated layers copying real layers map[0..L), MTP layers 45..,
 * experts 0..E-1 */
static struct tinfo *expected(const int *map, int L, int D, int E, size_t *ret_n)
{
    struct tinfo *t = calloc(n_tsv * 2 + 1, sizeof(*t));
    size_t n = 0;

    ASSERT_TRUE(t != NULL);
    for (size_t i = 0; i < n_tsv; i++) {
        const char *nm = tsv[i].name, *rest;
        int real;

        if (is_vision(nm))
            continue;
        if (sscanf(nm, "model.layers.%d.", &real) != 1) {
            snprintf(t[n].name, sizeof(t[n].name), "%s", nm);
            t[n].dtype = tsv[i].dtype;
            t[n].ndim = tsv[i].ndim;
            memcpy(t[n].shape, tsv[i].shape, sizeof(t[n].shape));
            n++;
            continue;
        }
        rest = strchr(nm + 13, '.');
        if (strstr(nm, ".moe.experts.") && atoi(strstr(nm, ".moe.experts.") + 13) >= E)
            continue;
        for (int g = 0; g < L + D; g++) {
            int want = g < L ? map[g] : 45 + (g - L);
            if (want != real)
                continue;
            if (n >= n_tsv * 2)
                FAIL("more expected tensors than the TSV holds twice");
            snprintf(t[n].name, sizeof(t[n].name), "model.layers.%d%s", g, rest);
            t[n].dtype = tsv[i].dtype;
            t[n].ndim = tsv[i].ndim;
            memcpy(t[n].shape, tsv[i].shape, sizeof(t[n].shape));
            n++;
        }
    }
    qsort(t, n, sizeof(*t), cmp_tinfo);
    *ret_n = n;
    return t;
}

static bool head_dim_tensor(const char *n)
{
    return strstr(n, ".self_attn.q_proj.") || strstr(n, ".self_attn.k_proj.") ||
           strstr(n, ".self_attn.v_proj.") || strstr(n, ".self_attn.g_proj.") ||
           strstr(n, ".self_attn.o_proj.") || strstr(n, "_norm.weight") != NULL;
}

/* exact: dtype and shape equal; else dtype equal and the head-derived dims equal */
static void compare(const struct tinfo *got, size_t n_got, const struct tinfo *want, size_t n_want,
                    bool exact)
{
    size_t i = 0, j = 0, bad = 0;

    while (i < n_got || j < n_want) {
        int c = i == n_got ? 1 : j == n_want ? -1 : strcmp(got[i].name, want[j].name);
        if (c < 0) {
            if (bad++ < 10)
                fprintf(stderr, "unexpected tensor %s\n", got[i].name);
            i++;
            continue;
        }
        if (c > 0) {
            if (bad++ < 10)
                fprintf(stderr, "missing tensor %s\n", want[j].name);
            j++;
            continue;
        }
        if (got[i].dtype != want[j].dtype || got[i].ndim != want[j].ndim ||
            (exact && memcmp(got[i].shape, want[j].shape, sizeof(got[i].shape)) != 0)) {
            if (bad++ < 10)
                fprintf(stderr, "%s: %s [%lld,%lld], expected %s [%lld,%lld]\n", got[i].name,
                        dtype_name(got[i].dtype), (long long)got[i].shape[0], (long long)got[i].shape[1],
                        dtype_name(want[j].dtype), (long long)want[j].shape[0], (long long)want[j].shape[1]);
        } else if (!exact && head_dim_tensor(got[i].name)) {
            /* q/k/v/g rows and q/k norm lengths: heads x head_dim; o_proj columns */
            int d = strstr(got[i].name, ".o_proj.") ? 1 : 0;
            if (got[i].shape[d] != want[j].shape[d] && bad++ < 10)
                fprintf(stderr, "%s: dim %d is %lld, the real model has %lld\n", got[i].name, d,
                        (long long)got[i].shape[d], (long long)want[j].shape[d]);
        }
        i++;
        j++;
    }
    if (bad)
        FAIL("%zu differences from the expected layout", bad);
}

static int same_file(const char *a, const char *b, const char *name);

static void plan_all_ranks(const char *dir, int ws, int mtp, int experts_per_rank)
{
    int64_t experts = 0;

    for (int r = 0; r < ws; r++) {
        struct ckpt_opts o = { .world_size = ws, .rank = r, .mtp_depth = mtp, .headers_only = true };
        struct ckpt_plan_stats st;
        struct err_buf e;
        struct ckpt *c;
        if (ckpt_open(dir, &o, &c, &e) < 0)
            FAIL("world %d rank %d: %s", ws, r, e.msg);
        ckpt_plan_stats(c, &st);
        ASSERT_EQ(st.expert_count, experts_per_rank);
        ASSERT_EQ(st.expert_first, r * experts_per_rank);
        ASSERT_EQ(ckpt_mtp_depth(c), mtp);
        experts += st.expert_count;
        ckpt_close(c);
    }
    ASSERT_EQ(experts, (int64_t)experts_per_rank * ws);
}

static void inspect_ok(const char *dir)
{
    char cmd[4096], *out;

    snprintf(cmd, sizeof(cmd), "'%s' '%s' --world-size 8 --mtp 1", inspect, dir);
    if (test_run(cmd, &out) != 0)
        FAIL("%s:\n%s", cmd, out);
    ASSERT_CONTAINS(out, "rank 7/8: ok:");
    ASSERT_CONTAINS(out, "loadable");
    free(out);
}

static void test_full_sparse(void)
{
    static const int map[3] = { 0, 3, 4 };
    struct tinfo *got, *want;
    size_t n_got, n_want;
    int shards;
    int64_t disk;
    struct model_config c;
    struct err_buf e;
    char path[PATH_MAX];
    const char *dir = make("full3", "--mtp 3 --sparse all --shards 4");

    got = read_headers(dir, &n_got, &shards, &disk);
    want = expected(map, 3, 3, 288, &n_want);
    ASSERT_EQ(shards, 4);
    compare(got, n_got, want, n_want, true);
    printf("full width, 3 layers + 3 MTP: %zu tensors as the TSV's real layers 0, 3, 4, 45..47; %.1f kB on disk\n",
           n_got, (double)disk / 1e3);
    ASSERT_LT(disk, 4 << 20);
    free(got);
    free(want);

    snprintf(path, sizeof(path), "%s/config.json", dir);
    if (model_config_load(path, &c, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_TRUE(c.nested);
    ASSERT_STREQ(c.model_type, "step3p7");
    ASSERT_EQ(c.quant, QUANT_MXFP4);
    ASSERT_EQ(c.n_layers, 3);
    ASSERT_EQ(c.n_mtp_layers, 3);
    ASSERT_EQ(c.vocab_size, 128896);
    ASSERT_EQ(c.sliding_window, 512);
    ASSERT_EQ(c.router_scaling_factor, 3.0);
    ASSERT_TRUE(c.use_router_bias && c.use_qk_norm && c.use_head_wise_attn_gate && !c.tie_word_embeddings);
    for (int l = 0; l < 6; l++) {
        const struct layer_config *L = &c.layers[l];
        bool full = l == 0 || l == 2;
        ASSERT_EQ(L->kind, full ? LAYER_KIND_FULL : LAYER_KIND_SLIDING);
        ASSERT_EQ(L->n_heads, full ? 64 : 96);
        ASSERT_EQ(L->n_kv_heads, 8);
        ASSERT_EQ(L->rotary_dims, full ? 64 : 128);
        ASSERT_EQ(L->rope_theta, full ? 5e6 : 1e4);
        ASSERT_EQ(L->rope_llama3, full);
        ASSERT_EQ(L->is_moe, l == 1 || l == 2);
        ASSERT_EQ(L->is_mtp, l >= 3);
        ASSERT_EQ(L->swiglu_limit, 0);
    }
    ASSERT_EQ(c.n_eos, 3);
    ASSERT_EQ(c.eos_token_ids[2], 128007);

    plan_all_ranks(dir, 1, 3, 288);
    plan_all_ranks(dir, 8, 3, 36);
    inspect_ok(dir);
    ckptw_rmtree(dir);
}

static void test_full_real_layout(void)
{
    int map[45];
    struct tinfo *got, *want;
    size_t n_got, n_want;
    int shards;
    int64_t disk;
    const char *dir = make("full45", "--layers 45 --mtp 3 --sparse all");

    for (int i = 0; i < 45; i++)
        map[i] = i;
    got = read_headers(dir, &n_got, &shards, &disk);
    want = expected(map, 45, 3, 288, &n_want);
    ASSERT_EQ(n_want, 73254);
    compare(got, n_got, want, n_want, true);
    printf("full width, 45 layers + 3 MTP: the TSV's %zu text tensors exactly, %d shards\n", n_got, shards);
    plan_all_ranks(dir, 8, 3, 36);
    free(got);
    free(want);
    ckptw_rmtree(dir);
}

static void bf16_stats(struct ckpt *c, const char *name, double *ret_mean, double *ret_std)
{
    struct tview v;
    double s = 0, ss = 0;
    int64_t n;

    ASSERT_OK(ckpt_get(c, name, &v));
    n = tview_numel(&v);
    for (int64_t i = 0; i < n; i++) {
        double x;
        if (v.dtype == DTYPE_F32) {
            float f;
            memcpy(&f, (const char *)v.data + 4 * i, 4);
            x = f;
        } else {
            uint16_t h;
            memcpy(&h, (const char *)v.data + 2 * i, 2);
            x = ckptw_bf16_to_f32(h);
        }
        ASSERT_TRUE(isfinite(x));
        s += x;
        ss += x * x;
    }
    *ret_mean = s / (double)n;
    *ret_std = sqrt(ss / (double)n - *ret_mean * *ret_mean);
}

/* decoded std of an MXFP4 expert matrix; scale-byte and code histograms */
static double mxfp4_std(struct ckpt *c, const char *base, int *scale_hist, int *code_hist)
{
    struct tview p, s;
    char n[256];
    double ss = 0;
    float *row;
    int64_t rows, k;

    snprintf(n, sizeof(n), "%s.weight_packed", base);
    ASSERT_OK(ckpt_get(c, n, &p));
    snprintf(n, sizeof(n), "%s.weight_scale", base);
    ASSERT_OK(ckpt_get(c, n, &s));
    rows = p.shape[0];
    k = p.shape[1] * 2;
    row = malloc(sizeof(float) * (size_t)k);
    ASSERT_TRUE(row != NULL);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *pr = (const uint8_t *)p.data + r * (k / 2), *sr = (const uint8_t *)s.data + r * (k / 32);
        ASSERT_OK(mxfp4_row_decode(pr, sr, k, row));
        for (int64_t i = 0; i < k; i++)
            ss += (double)row[i] * row[i];
        for (int64_t i = 0; scale_hist && i < k / 32; i++)
            scale_hist[sr[i]]++;
        for (int64_t i = 0; code_hist && i < k / 2; i++) {
            code_hist[pr[i] & 15]++;
            code_hist[pr[i] >> 4]++;
        }
    }
    free(row);
    return sqrt(ss / ((double)rows * k));
}

static void test_full_data(void)
{
    const double H = 4096, t2 = 0.5 / 2;   /* 1 layer: each of 2 sub-layers adds 0.25 */
    struct ckpt_opts o = { .world_size = 1 };
    int scales[256] = { 0 }, codes[16] = { 0 }, used = 0, lo = 255, hi = 0, zero_codes;
    int hits[288] = { 0 }, hmin = 1 << 30, hmax = 0;
    struct err_buf e;
    struct ckpt *c;
    struct tview v;
    double mean, sd, d;
    uint32_t rnd = 99;
    const char *dir = make("full1", "--layers 1 --seed 9 --sparse embed,heads,experts-from:2");

    if (ckpt_open(dir, &o, &c, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_EQ(ckpt_config(c)->layers[0].kind, LAYER_KIND_SLIDING);
    ASSERT_TRUE(ckpt_config(c)->layers[0].is_moe);

    bf16_stats(c, "model.layers.0.self_attn.q_proj.weight", &mean, &sd);
    printf("q_proj std %.5f (target %.5f), mean %.2g\n", sd, 1 / sqrt(H), mean);
    ASSERT_NEAR(sd, 1 / sqrt(H), 0.01 / sqrt(H));
    ASSERT_LT(fabs(mean), 1e-4);
    bf16_stats(c, "model.layers.0.self_attn.o_proj.weight", &mean, &sd);
    d = sqrt(t2 / (96 * 128 * 0.29327));
    printf("o_proj std %.6f (target %.6f)\n", sd, d);
    ASSERT_NEAR(sd, d, 0.01 * d);
    bf16_stats(c, "model.layers.0.share_expert.down_proj.weight", &mean, &sd);
    d = sqrt(t2 / 2 / (1280 * 0.35531));
    ASSERT_NEAR(sd, d, 0.01 * d);
    bf16_stats(c, "model.layers.0.input_layernorm.weight", &mean, &sd);
    printf("input_layernorm (Gemma 1+w) mean %.4f std %.4f\n", mean, sd);
    ASSERT_LT(fabs(mean), 0.002);
    ASSERT_NEAR(sd, 0.02, 0.002);
    bf16_stats(c, "model.layers.0.moe.router_bias", &mean, &sd);
    ASSERT_NEAR(sd, 0.01, 0.003);

    /* experts: decoded std at the target, two adjacent scale exponents, all codes used */
    sd = mxfp4_std(c, "model.layers.0.moe.experts.0.gate_proj", scales, codes);
    printf("expert 0 gate_proj std %.5f (target %.5f)\n", sd, 1 / sqrt(H));
    ASSERT_NEAR(sd, 1 / sqrt(H), 0.01 / sqrt(H));
    d = sqrt(t2 / 2 * 8 / 9.0 / (1280 * 0.35531));
    sd = mxfp4_std(c, "model.layers.0.moe.experts.1.down_proj", NULL, NULL);
    printf("expert 1 down_proj std %.6f (target %.6f)\n", sd, d);
    ASSERT_NEAR(sd, d, 0.01 * d);
    for (int b = 0; b < 256; b++)
        if (scales[b]) {
            used++;
            lo = b < lo ? b : lo;
            hi = b > hi ? b : hi;
        }
    printf("expert 0 gate_proj E8M0 scale bytes %d..%d (2^%d..2^%d)\n", lo, hi, lo - 127, hi - 127);
    ASSERT_TRUE(used == 2 && hi == lo + 1);
    ASSERT_TRUE(lo >= 115 && hi <= 125);
    zero_codes = codes[0] + codes[8];
    for (int k = 0; k < 16; k++)
        ASSERT_LT(0, codes[k]);
    ASSERT_NEAR((double)zero_codes / (1280.0 * 4096), 0.1, 0.03);
    /* holes read as zeros */
    ASSERT_OK(ckpt_get(c, "model.layers.0.moe.experts.2.up_proj.weight_scale", &v));
    for (int64_t i = 0; i < (int64_t)v.nbytes; i++)
        ASSERT_EQ(((const uint8_t *)v.data)[i], 0);
    ASSERT_OK(ckpt_get(c, "model.embed_tokens.weight", &v));
    for (int64_t i = 0; i < 4096 * 2; i++)
        ASSERT_EQ(((const uint8_t *)v.data)[i], 0);

    /* the router over random unit-rms inputs: all experts used, none dominant */
    ASSERT_OK(ckpt_get(c, "model.layers.0.moe.gate.weight", &v));
    {
        struct tview bv;
        float bias[288], x[4096], *w = malloc(sizeof(float) * 288 * 4096);
        ASSERT_TRUE(w != NULL);
        for (size_t i = 0; i < 288 * 4096; i++) {
            uint16_t h;
            memcpy(&h, (const char *)v.data + 2 * i, 2);
            w[i] = ckptw_bf16_to_f32(h);
        }
        ASSERT_OK(ckpt_get(c, "model.layers.0.moe.router_bias", &bv));
        memcpy(bias, bv.data, sizeof(bias));
        for (int t = 0; t < ROUTER_INPUTS; t++) {
            double sc[288];
            bool taken[288] = { false };
            for (int i = 0; i < 4096; i++) {
                double u1, u2;
                rnd = rnd * 1664525u + 1013904223u;
                u1 = ((rnd >> 8) + 0.5) / 16777216.0;
                rnd = rnd * 1664525u + 1013904223u;
                u2 = (rnd >> 8) / 16777216.0;
                x[i] = (float)(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2));
            }
            for (int ex = 0; ex < 288; ex++) {
                float z = 0;
                for (int i = 0; i < 4096; i++)
                    z += w[(size_t)ex * 4096 + i] * x[i];
                sc[ex] = 1 / (1 + exp(-z)) + bias[ex];
            }
            for (int k = 0; k < 8; k++) {
                int best = -1;
                for (int ex = 0; ex < 288; ex++)
                    if (!taken[ex] && (best < 0 || sc[ex] > sc[best]))
                        best = ex;
                taken[best] = true;
                hits[best]++;
            }
        }
        free(w);
        for (int ex = 0; ex < 288; ex++) {
            hmin = hits[ex] < hmin ? hits[ex] : hmin;
            hmax = hits[ex] > hmax ? hits[ex] : hmax;
        }
        printf("router, %d random unit inputs, top-8 of 288: tokens per expert %d..%d (uniform %.1f)\n",
               ROUTER_INPUTS, hmin, hmax, ROUTER_INPUTS * 8 / 288.0);
        ASSERT_LE(1, hmin);
        ASSERT_LE(hmax, 3 * ROUTER_INPUTS * 8 / 288);
    }
    ckpt_close(c);
    plan_all_ranks(dir, 8, 0, 36);
    ckptw_rmtree(dir);
}

static void test_narrow(void)
{
    static const int map[3] = { 0, 3, 4 };
    struct tinfo *got, *want;
    size_t n_got, n_want;
    int shards;
    int64_t disk;
    struct ckpt_opts o = { .world_size = 1, .mtp_depth = 1, .headers_only = true };
    struct ckpt_plan_stats st;
    struct err_buf e;
    struct ckpt *c;
    char flags[PATH_MAX + 100];
    const char *dir;

    snprintf(flags, sizeof(flags), "--preset narrow8 --mtp 1 --shards 3 --tokenizer '%s'", tiny);
    dir = make("narrow", flags);

    got = read_headers(dir, &n_got, &shards, &disk);
    want = expected(map, 3, 1, 32, &n_want);
    ASSERT_EQ(shards, 3);
    compare(got, n_got, want, n_want, false);
    if (ckpt_open(dir, &o, &c, &e) < 0)
        FAIL("%s", e.msg);
    ckpt_plan_stats(c, &st);
    printf("narrow8, 3 layers + 1 MTP: %zu tensors (names, dtypes and head dims of the TSV), %.1f MB\n",
           n_got, (double)st.bytes / 1e6);
    ASSERT_LT(5e6, st.bytes);
    ASSERT_LT(st.bytes, 100e6);
    ASSERT_EQ(ckpt_config(c)->n_heads_full, 64);
    ASSERT_EQ(ckpt_config(c)->n_heads_sliding, 96);
    ASSERT_EQ(ckpt_config(c)->n_kv_heads, 8);
    ASSERT_EQ(ckpt_config(c)->n_experts % 8, 0);
    ASSERT_EQ(ckpt_config(c)->bos_token_id, 0);
    ASSERT_EQ(ckpt_config(c)->n_eos, 2);
    ASSERT_EQ(ckpt_config(c)->eos_token_ids[0], 5);
    ASSERT_EQ(ckpt_config(c)->eos_token_ids[1], 2);
    ASSERT_TRUE(same_file(dir, tiny, "tokenizer.json"));
    ASSERT_TRUE(same_file(dir, tiny, "tokenizer_config.json"));
    ckpt_close(c);
    plan_all_ranks(dir, 8, 1, 4);
    inspect_ok(dir);
    free(got);
    free(want);
    ckptw_rmtree(dir);
}

/* 1 when files a/name and b/name are identical */
static int same_file(const char *a, const char *b, const char *name)
{
    char pa[PATH_MAX], pb[PATH_MAX], *x, *y;
    size_t nx, ny;
    int r;

    snprintf(pa, sizeof(pa), "%s/%s", a, name);
    snprintf(pb, sizeof(pb), "%s/%s", b, name);
    ASSERT_OK(file_read_all(pa, 1u << 30, 0, &x, &nx));
    ASSERT_OK(file_read_all(pb, 1u << 30, 0, &y, &ny));
    r = nx == ny && memcmp(x, y, nx) == 0;
    free(x);
    free(y);
    return r;
}

static void test_determinism(void)
{
    static const char *const files[] = { "config.json", "model.safetensors.index.json",
                                         "model-00001-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors",
                                         "model-00003-of-00003.safetensors" };
    char a[PATH_MAX], b[PATH_MAX], d1[PATH_MAX];
    struct ckpt_opts o = { .world_size = 1, .mtp_depth = 1 };
    struct ckpt *ca, *cb;
    struct err_buf e;
    int differ = 0;

    snprintf(a, sizeof(a), "%s", make("seed7a", "--preset narrow8 --mtp 1 --shards 3 --seed 7 --threads 1"));
    snprintf(b, sizeof(b), "%s", make("seed7b", "--preset narrow8 --mtp 1 --shards 3 --seed 7 --threads 2"));
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
        if (!same_file(a, b, files[i]))
            FAIL("seed 7: %s differs between two runs", files[i]);
    make("seed7b", "--preset narrow8 --mtp 1 --shards 3 --seed 8");
    ASSERT_TRUE(same_file(a, b, "config.json"));
    ASSERT_TRUE(same_file(a, b, "model.safetensors.index.json"));
    for (size_t i = 2; i < sizeof(files) / sizeof(files[0]); i++)
        differ += !same_file(a, b, files[i]);
    ASSERT_EQ(differ, 3);
    printf("seed 7 twice (1 and 2 threads): identical files; seed 8: every shard differs\n");

    /* one shard instead of three: the same bytes for every tensor */
    snprintf(d1, sizeof(d1), "%s", make("seed7one", "--preset narrow8 --mtp 1 --shards 1 --seed 7"));
    if (ckpt_open(a, &o, &ca, &e) < 0 || ckpt_open(d1, &o, &cb, &e) < 0)
        FAIL("%s", e.msg);
    {
        struct tinfo *t;
        size_t n;
        int shards;
        int64_t disk;
        t = read_headers(a, &n, &shards, &disk);
        for (size_t i = 0; i < n; i++) {
            struct tview va, vb;
            ASSERT_OK(ckpt_get(ca, t[i].name, &va));
            ASSERT_OK(ckpt_get(cb, t[i].name, &vb));
            ASSERT_EQ(va.nbytes, vb.nbytes);
            if (memcmp(va.data, vb.data, va.nbytes) != 0)
                FAIL("%s: bytes depend on the shard split", t[i].name);
        }
        printf("seed 7, 1 shard vs 3: the same bytes in all %zu tensors\n", n);
        free(t);
    }
    ckpt_close(ca);
    ckpt_close(cb);
    ckptw_rmtree(a);
    ckptw_rmtree(b);
    ckptw_rmtree(d1);
}

static void test_bad_input(void)
{
    static const struct { const char *flags; int status; const char *msg; } cases[] = {
        { "--preset tiny", 2, "--preset 'tiny': expected full or narrow8" },
        { "--real-layers 3,45", 2, "--real-layers '45'" },
        { "--layers 2 --real-layers 3", 2, "not both" },
        { "--shards 2 --shard-size 1M", 2, "not both" },
        { "--sparse weights", 2, "--sparse 'weights'" },
        { "--shard-size 3T", 2, "--shard-size '3T'" },
        { "--mtp 4", 2, "--mtp '4'" },
        { "--preset narrow8 --force --hidden 100", 1, "divisible by 32" },
        { "--preset narrow8 --force --top-k 40", 1, "--top-k 40 is more than the 32 experts" },
        { "--preset narrow8", 1, "already holds checkpoint files" },
    };
    char cmd[8192], *out;
    const char *dir = make("occupied", "--preset narrow8");

    snprintf(cmd, sizeof(cmd), "'%s' --preset narrow8", mkmodel);
    ASSERT_EQ(test_run(cmd, &out), 2);
    ASSERT_CONTAINS(out, "--out DIR is required");
    free(out);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(cmd, sizeof(cmd), "'%s' --out '%s' %s", mkmodel, dir, cases[i].flags);
        ASSERT_EQ(test_run(cmd, &out), cases[i].status);
        ASSERT_CONTAINS(out, cases[i].msg);
        free(out);
    }
    ckptw_rmtree(dir);
}

/* --vision L: the full-width tower beside the text, planned by the loader on rank 0 */
static void test_vision(void)
{
    const char *dir = make("vision", "--preset narrow8 --layers 1 --vision 2 --sparse all --threads 1");
    struct ckpt_opts o = { .world_size = 1, .rank = 0, .headers_only = true };
    struct ckpt_plan_stats st;
    const struct vision_config *vc;
    struct err_buf e = { "" };
    struct ckpt *c;

    if (ckpt_open(dir, &o, &c, &e) < 0)
        FAIL("%s", e.msg);
    vc = ckpt_vision(c);
    ASSERT_TRUE(vc != NULL);
    ASSERT_EQ(vc->width, 1536);
    ASSERT_EQ(vc->layers, 2);
    ASSERT_EQ(vc->inter, 8960);
    ASSERT_EQ(vc->text_hidden, 256);
    ckpt_plan_stats(c, &st);
    ASSERT_EQ(st.vision_tensors, 4 + 14 * 2 + 5);
    /* conv1, position table, 2 blocks, downsamplers, projector [256, 6144]: BF16 bytes */
    ASSERT_EQ(st.vision_bytes, 2 * (1536LL * 3 * 14 * 14 + 2704LL * 1536 + 2 * 1536 +
                                    2 * (4608LL * 1536 + 4608 + 1536LL * 1536 + 1536 * 8 + 8960LL * 1536 + 8960 +
                                         1536LL * 8960) +
                                    3072LL * 1536 * 9 + 3072 + 6144LL * 3072 * 9 + 6144 + 256LL * 6144));
    ckpt_close(c);
}

int main(int argc, char **argv)
{
    struct err_buf e;

    ASSERT_TRUE(argc == 5);
    setvbuf(stdout, NULL, _IOLBF, 0);
    mkmodel = argv[1];
    inspect = argv[2];
    tiny = argv[4];
    if (ckptw_tsv_read(argv[3], &tsv, &n_tsv, &e) < 0)
        FAIL("%s", e.msg);
    root = ckptw_tmpdir("test-mkmodel");
    ASSERT_TRUE(root != NULL);

    test_full_sparse();
    test_full_real_layout();
    test_full_data();
    test_narrow();
    test_determinism();
    test_bad_input();
    test_vision();

    ckptw_rmtree(root);
    free(root);
    ckptw_tsv_free(tsv, n_tsv);
    printf("ok\n");
    return 0;
}
