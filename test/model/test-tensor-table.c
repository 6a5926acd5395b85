/* test-tensor-table.c - the loader's expected list and what the model reads are one set
 * (common/tensors.c, the one tensor table both walk).
 *
 *   test-tensor-table TINY_MODEL_DIR
 *
 * 1. Plan against reads, for every rank at world sizes 1, 2 and 8, on the tiny config of
 *    tools/ckptw.c and on the full-width Step-3.7-Flash config (MXFP4 experts, 3 MTP
 *    layers; written as a sparse file, opened headers-only: no data is read): the names the
 *    loader plans for the rank (ckpt_plan_dump) are exactly the names the model reads
 *    (model_new's globals and load_layer's walk of the table, with this rank's experts and
 *    MTP depth, each linear module in its format), and each planned slice has the shape the
 *    model expects on that rank.
 *    The linear rows are quantization_config's modules (config.c), by name and by layer.
 * 2. A real load (models/tiny-step and the tiny config, on the CPU backend): model_new
 *    reads every byte the loader planned (ckpt_load_progress: done == total).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "ckptw.h"
#include "harness.h"
#include "loader.h"
#include "model.h"
#include "vision.h"
#include "tensors.h"

/* a set of "name rows|cols|full len" strings */
struct names {
    char **v;
    size_t n, cap;
};

static void names_add(struct names *s, const char *name, const char *slice, long long len)
{
    char buf[300];

    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 1024;
        s->v = realloc(s->v, s->cap * sizeof(*s->v));
        ASSERT_TRUE(s->v != NULL);
    }
    snprintf(buf, sizeof(buf), "%s %s %lld", name, slice, len);
    s->v[s->n] = strdup(buf);
    ASSERT_TRUE(s->v[s->n] != NULL);
    s->n++;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void names_free(struct names *s)
{
    for (size_t i = 0; i < s->n; i++)
        free(s->v[i]);
    free(s->v);
    memset(s, 0, sizeof(*s));
}

/* the plan: "name dtype [shape] rows[off:end] bytes" -> "name rows end-off" ("full": dim 0) */
static void plan_names(struct ckpt *c, struct names *s)
{
    char *buf = NULL, *line, *save;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    ASSERT_TRUE(f != NULL);
    ckpt_plan_dump(c, f);
    fclose(f);
    for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char name[256], dtype[32], shape[64], slice[64];
        long long d0 = 0, off, end;

        ASSERT_EQ(sscanf(line, "%255s %31s %63s %63s", name, dtype, shape, slice), 4);
        if (strncmp(slice, "full", 4) == 0) {
            if (sscanf(shape, "[%lld", &d0) != 1)
                d0 = 0;                     /* a scalar: [] */
            names_add(s, name, "full", d0);
        } else {
            ASSERT_EQ(sscanf(slice + 4, "[%lld:%lld]", &off, &end), 2);
            slice[4] = '\0';
            names_add(s, name, slice, end - off);
        }
    }
    free(buf);
}

struct reads {
    struct names *s;
    const struct model_config *cfg;
    int world;
};

/* one tensor as the model reads it: its stored parts in the module's format, with the
 * extent of the split dimension on this rank */
static int read_one(void *ctx, const struct tensor_ref *t)
{
    struct reads *x = ctx;
    const char *slice = x->world == 1 || t->split == TENSOR_WHOLE ? "full"
                        : t->split == TENSOR_ROWS ? "rows" : "cols";
    int dim = t->split == TENSOR_COLS && x->world > 1 ? 1 : 0;
    struct tensor_part parts[TENSOR_MAX_PARTS];
    char name[256];
    int n;

    if (t->spec->dtype != TENSOR_DT_LINEAR) {
        names_add(x->s, t->name, slice, t->shape[dim]);
        return 0;
    }
    n = tensor_linear_parts(t->quant, t->shape[0], t->shape[1], x->cfg->quant_block_rows,
                            x->cfg->quant_group_size, parts);
    ASSERT_TRUE(n > 0);
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof(name), "%s%s", t->name, parts[i].suffix);
        names_add(x->s, name, parts[i].ndim ? slice : "full", parts[i].ndim ? parts[i].shape[dim] : 0);
    }
    return 0;
}

/* what model_new and load_layer read on this rank */
static void model_reads(struct ckpt *c, int world, int rank, struct names *s)
{
    const struct model_config *cfg = ckpt_config(c);
    struct reads x = { s, cfg, world };
    int first, count, n_mtp = rank == 0 ? ckpt_mtp_depth(c) : 0;

    ASSERT_TRUE(!cfg->tie_word_embeddings);
    ASSERT_OK(tensor_global_each(cfg, world, read_one, &x));
    ckpt_expert_range(c, &first, &count);
    for (int l = 0; l < cfg->n_layers + n_mtp; l++)
        ASSERT_OK(tensor_layer_each(cfg, l, world, first, count, read_one, &x));
}

static void same_sets(const char *what, int world, int rank, struct names *a, struct names *b)
{
    size_t i = 0, j = 0;
    int bad = 0;

    qsort(a->v, a->n, sizeof(*a->v), cmp_str);
    qsort(b->v, b->n, sizeof(*b->v), cmp_str);
    while (i < a->n || j < b->n) {
        int d = i == a->n ? 1 : j == b->n ? -1 : strcmp(a->v[i], b->v[j]);

        if (d && bad++ < 10)
            fprintf(stderr, "%s N=%d rank %d: %s %s\n", what, world, rank,
                    d < 0 ? "planned, never read:" : "read, not planned:", d < 0 ? a->v[i] : b->v[j]);
        i += d <= 0;
        j += d >= 0;
    }
    if (bad)
        FAIL("%s N=%d rank %d: %d differences between the loader's plan (%zu) and the model's reads (%zu)",
             what, world, rank, bad, a->n, b->n);
}

static void check_plans(const char *what, const char *dir, int mtp_depth)
{
    static const int worlds[] = { 1, 2, 8 };
    struct err_buf e = { { 0 } };

    for (size_t k = 0; k < ARRAY_SIZE(worlds); k++) {
        int ws = worlds[k];
        size_t total = 0;

        for (int r = 0; r < ws; r++) {
            struct ckpt_opts o = { .world_size = ws, .rank = r, .mtp_depth = r == 0 ? mtp_depth : 0,
                                   .headers_only = true };
            struct names plan = { 0 }, reads = { 0 };
            struct ckpt *c;

            if (ckpt_open(dir, &o, &c, &e) < 0)
                FAIL("%s N=%d rank %d: %s", what, ws, r, e.msg);
            ASSERT_EQ(ckpt_mtp_depth(c), o.mtp_depth);
            plan_names(c, &plan);
            model_reads(c, ws, r, &reads);
            same_sets(what, ws, r, &plan, &reads);
            total += plan.n;
            names_free(&plan);
            names_free(&reads);
            ckpt_close(c);
        }
        printf("%s: N=%d, every rank: the loader's plan == the model's reads (%zu tensors over %d ranks)\n",
               what, ws, total, ws);
    }
}

/* the linear rows name and place their modules as quantization_config does (config.c's
 * quant_module_name, model_config_has_module: the names a format's exclusion lists match) */
static void check_modules(const char *what, const struct model_config *c)
{
    int n = 0;

    for (const struct tensor_spec *t = tensor_table; t->name; t++) {
        char a[160], b[160];

        if (t->quant_module < 0)
            continue;
        quant_module_name((enum quant_module)t->quant_module, 7, a, sizeof(a));
        snprintf(b, sizeof(b), t->name, 7);
        ASSERT_STREQ(b, a);
        for (int l = 0; l < c->n_layers_total; l++)
            ASSERT_EQ(tensor_in_layer(c, l, t), model_config_has_module(c, l, (enum quant_module)t->quant_module));
        n++;
    }
    ASSERT_EQ(n, _QMOD_MAX);
    printf("%s: the table's %d linear modules are quantization_config's\n", what, n);
}

/* the full-width config's layout as one sparse model.safetensors */
static void write_full_width(const char *dir, struct model_config *cfg)
{
    struct err_buf e = { { 0 } };
    struct ckptw_opts o;
    struct ckptw_entry *ents;
    struct ckptw_tensor *ts;
    char path[512];
    size_t n;

    ckptw_config_step37(cfg);
    ckptw_opts_default(&o);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    ASSERT_OK(ckptw_write_config(path, cfg, true, false, &e));
    ASSERT_OK(ckptw_layout(cfg, &o, &ents, &n));
    ts = calloc(n, sizeof(*ts));
    ASSERT_TRUE(ts != NULL);
    for (size_t i = 0; i < n; i++) {
        ts[i] = (struct ckptw_tensor){ .name = ents[i].name, .dtype = ents[i].dtype, .ndim = ents[i].ndim };
        memcpy(ts[i].shape, ents[i].shape, sizeof(ts[i].shape));
    }
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    if (ckptw_write_safetensors(path, ts, n, true, &e) < 0)
        FAIL("%s", e.msg);
    printf("full width: %zu tensors, %d + %d layers, %d experts, hidden %d (sparse, headers only)\n", n,
           cfg->n_layers, cfg->n_mtp_layers, cfg->n_experts, cfg->hidden_size);
    free(ts);
    free(ents);
}

/* model_new on the CPU backend reads every planned byte */
static void check_load(const char *what, const char *dir, int mtp_depth)
{
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = mtp_depth };
    struct backend_cfg bc = { .n_threads = 1 };
    struct err_buf e = { { 0 } };
    struct model_opts mo = { .max_tokens_per_step = 16, .max_seqs = 2, .block_size = 16,
                             .n_blocks = { 8, 8 }, .max_seq_len = 64, .no_split = true };
    struct ckpt *ck;
    struct backend *be;
    struct model *m;
    struct vision *v = NULL;
    int64_t done, total;

    if (ckpt_open(dir, &co, &ck, &e) < 0)
        FAIL("%s: %s", dir, e.msg);
    ASSERT_OK(backend_new("cpu", &bc, &be));
    ckpt_load_progress(ck, &done, &total);
    ASSERT_EQ(done, 0);
    if (model_new(ck, be, NULL, &mo, &m, &e) < 0)
        FAIL("%s: model: %s", what, e.msg);
    /* the vision tower (rank 0's share of the plan) is read by the encoder, as the worker does */
    if (ckpt_vision(ck) && vision_new(ck, be, &v, &e) < 0)
        FAIL("%s: vision: %s", what, e.msg);
    ckpt_load_progress(ck, &done, &total);
    printf("%s: the model read %lld of the %lld planned bytes (MTP depth %d)\n", what, (long long)done,
           (long long)total, ckpt_mtp_depth(ck));
    ASSERT_EQ(done, total);
    ASSERT_TRUE(total > 0);
    vision_free(v);
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
}

int main(int argc, char **argv)
{
    struct model_config tiny, full;
    struct err_buf e = { { 0 } };
    struct ckptw_opts o;
    char *tdir = ckptw_tmpdir("stepd-tensors-tiny"), *fdir = ckptw_tmpdir("stepd-tensors-full");

    if (argc < 2)
        FAIL("usage: test-tensor-table TINY_MODEL_DIR");
    ASSERT_TRUE(tdir && fdir);
    ckptw_config_tiny(&tiny);
    ckptw_opts_default(&o);
    ASSERT_OK(ckptw_write(tdir, &tiny, &o, &e));
    check_modules("tiny config", &tiny);
    check_plans("tiny config", tdir, tiny.n_mtp_layers);
    write_full_width(fdir, &full);
    check_modules("full width", &full);
    check_plans("full width", fdir, full.n_mtp_layers);
    check_load("tiny config", tdir, tiny.n_mtp_layers);
    check_load(argv[1], argv[1], 3);
    ckptw_rmtree(tdir);
    ckptw_rmtree(fdir);
    free(tdir);
    free(fdir);
    printf("tensor table: ok\n");
    return 0;
}
