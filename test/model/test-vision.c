/* test-vision.c - the vision encoder (worker/model/vision.c) against the numpy reference
 * (tools/reference/vision_ref.py) on the bundled tiny model's tower, and the loader's
 * vision plan.
 *
 *   test-vision golden MODEL_DIR GOLDEN_DIR   (GOLDEN_DIR: vision_ref.py goldens output)
 *   test-vision loader MODEL_DIR
 *   test-vision splice
 *
 * golden: for each of the 4 images, all its views (728 global + 504 crops) in ONE call; every
 * stage (patch embed, block 0, ViT, downsampler 1/2, projector) of every view within
 * TOL_STAGE * max|ref| (max-abs) of the fp64 reference; then all 4 images' 11 views in one
 * call give the same embeddings as the per-image calls (batching over views and images).
 * splice: vision_splice over two prefill chunks, and its -ERANGE case.
 * loader: the plan holds the tower (51 tensors of the tiny model) on rank 0, none with
 * skip_vision (the warning says so) or on rank 1 of 2; headers-only stats agree; a bad
 * vision_config (activation, CLS token, heads, mlp_ratio against the file's shapes) or index
 * fails the open with one message naming it, while images off still opens the text.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "harness.h"
#include "loader.h"
#include "vision.h"

/* fp32 activations with BF16 weights (upcast exactly, as the reference) vs fp64: the error
 * is fp32 accumulation order only (measured max 3.4e-7 relative, see docs/ARCHITECTURE.md);
 * AMX-BF16 hosts round activations entering BF16 GEMMs to BF16 (2^-9 relative) */
#define TOL_STAGE 1e-5
#define TOL_STAGE_BF16_ACT 3e-2
/* the same views batched differently: row sums do not depend on the batch */
#define TOL_BATCH 1e-6

static const char *stage_name[_VISION_STAGES] = {"patch_embed", "block0", "vit", "ds1", "ds2", "proj"};

struct gold {
    const char *dir;
    json_t *man;
    int image;          /* image of the current call */
    double tol, worst[_VISION_STAGES];
    int checked;
};

static float *read_f32(const char *dir, const char *file, size_t n)
{
    char path[4096];
    float *x = malloc(n * sizeof(float));
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, file);
    f = fopen(path, "rb");
    if (!f || !x || fread(x, sizeof(float), n, f) != n)
        FAIL("cannot read %zu floats from %s", n, path);
    fclose(f);
    return x;
}

static void check_stage(void *arg, enum vision_stage st, int view, const float *x, int rows, int cols)
{
    struct gold *g = arg;
    json_t *img = json_array_get(json_object_get(g->man, "images"), (size_t) g->image);
    json_t *rec = json_object_get(json_array_get(json_object_get(img, "views"), (size_t) view), stage_name[st]);
    json_t *shape = json_object_get(rec, "shape");
    double max_ref = 0, max_d = 0;
    float *ref;

    ASSERT_TRUE(rec != NULL);
    ASSERT_EQ(json_integer_value(json_array_get(shape, 0)), rows);
    ASSERT_EQ(json_integer_value(json_array_get(shape, 1)), cols);
    ref = read_f32(g->dir, json_string_value(json_object_get(rec, "file")), (size_t) rows * cols);
    for (size_t i = 0; i < (size_t) rows * cols; i++) {
        double d = fabs((double) x[i] - ref[i]);
        ASSERT_TRUE(isfinite(x[i]));
        max_ref = fabs(ref[i]) > max_ref ? fabs(ref[i]) : max_ref;
        max_d = d > max_d ? d : max_d;
    }
    free(ref);
    ASSERT_TRUE(max_ref > 0.1);         /* a live activation, not a zero tensor */
    if (max_d / max_ref > g->worst[st])
        g->worst[st] = max_d / max_ref;
    if (max_d > g->tol * max_ref)
        FAIL("image %d view %d stage %s: max |diff| %.3g > %.1g x max |ref| %.3g", g->image, view,
             stage_name[st], max_d, g->tol, max_ref);
    g->checked++;
}

static int golden(const char *model, const char *gdir)
{
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct backend_cfg bc = {.n_threads = 2};
    struct err_buf e = {{0}};
    struct ckpt *ck;
    struct backend *be;
    struct vision *v;
    struct gold g = {.dir = gdir};
    char path[4096];
    json_error_t je;
    uint8_t *pix;
    long npix;
    FILE *f;
    struct vision_view all[64];
    float *outs[8], *big;
    int n_all = 0, tok_all = 0, tok_img[8];
    const char *isa = getenv("STEPD_CPU_ISA");

    snprintf(path, sizeof(path), "%s/manifest.json", gdir);
    g.man = json_load_file(path, 0, &je);
    ASSERT_TRUE(g.man != NULL);
    snprintf(path, sizeof(path), "%s/views.u8", gdir);
    f = fopen(path, "rb");
    ASSERT_TRUE(f != NULL);
    fseek(f, 0, SEEK_END);
    npix = ftell(f);
    fseek(f, 0, SEEK_SET);
    pix = malloc((size_t) npix);
    ASSERT_TRUE(pix && fread(pix, 1, (size_t) npix, f) == (size_t) npix);
    fclose(f);

    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_OK(backend_new("cpu", &bc, &be));
    if (vision_new(ck, be, &v, &e) < 0)
        FAIL("%s", e.msg);
    /* AMX-BF16 rounds the activations of BF16 GEMMs; elsewhere fp32 throughout */
    g.tol = isa && strcmp(isa, "amx") == 0 ? TOL_STAGE_BF16_ACT : TOL_STAGE;
    if (!isa && system("grep -q amx_bf16 /proc/cpuinfo") == 0)
        g.tol = TOL_STAGE_BF16_ACT;

    size_t off = 0;
    json_t *imgs = json_object_get(g.man, "images");
    ASSERT_EQ(json_array_size(imgs), 4);
    for (size_t i = 0; i < json_array_size(imgs); i++) {
        json_t *vs = json_object_get(json_array_get(imgs, i), "views");
        struct vision_view views[8];
        int n = (int) json_array_size(vs), tok = 0;

        ASSERT_TRUE(n >= 1 && n <= 8);
        for (int j = 0; j < n; j++) {
            int size = (int) json_integer_value(json_object_get(json_array_get(vs, (size_t) j), "size"));
            views[j].rgb = pix + off;
            views[j].size = size;
            off += (size_t) size * size * 3;
            ASSERT_TRUE(off <= (size_t) npix);
            tok += vision_view_tokens(v, size);
            all[n_all++] = views[j];
        }
        ASSERT_EQ(vision_view_tokens(v, 728), 169);
        ASSERT_EQ(vision_view_tokens(v, 504), 81);
        tok_img[i] = tok;
        tok_all += tok;
        outs[i] = malloc((size_t) tok * vision_cfg(v)->text_hidden * sizeof(float));
        g.image = (int) i;
        if (vision_encode(v, views, n, outs[i], check_stage, &g, &e) < 0)
            FAIL("%s", e.msg);
    }
    ASSERT_EQ(g.checked, 6 * n_all);
    printf("stages checked: %d (4 images, %d views); worst max|diff|/max|ref|:", g.checked, n_all);
    for (int s = 0; s < _VISION_STAGES; s++)
        printf(" %s %.2e", stage_name[s], g.worst[s]);
    printf(" (tol %.0e)\n", g.tol);

    /* every view of every image in one call: the same embeddings */
    big = malloc((size_t) tok_all * vision_cfg(v)->text_hidden * sizeof(float));
    if (vision_encode(v, all, n_all, big, NULL, NULL, &e) < 0)
        FAIL("%s", e.msg);
    {
        size_t o2 = 0, H = (size_t) vision_cfg(v)->text_hidden;
        double md = 0;
        for (int i = 0; i < 4; i++) {
            for (size_t k = 0; k < (size_t) tok_img[i] * H; k++) {
                double d = fabs((double) big[o2 + k] - outs[i][k]);
                md = d > md ? d : md;
            }
            o2 += (size_t) tok_img[i] * H;
            free(outs[i]);
        }
        printf("all views in one call vs per image: max |diff| %.2e\n", md);
        ASSERT_LE(md, TOL_BATCH);
    }
    /* one thread (heads one after the other, no parts) gives the same embeddings as two
     * (heads split over the cores, backend_split_run) */
    {
        struct backend_cfg bc1 = {.n_threads = 1};
        struct backend *be1;
        struct vision *v1;
        float *one = malloc((size_t) tok_all * vision_cfg(v)->text_hidden * sizeof(float));
        double md = 0;

        ASSERT_OK(backend_new("cpu", &bc1, &be1));
        if (vision_new(ck, be1, &v1, &e) < 0)
            FAIL("%s", e.msg);
        if (vision_encode(v1, all, n_all, one, NULL, NULL, &e) < 0)
            FAIL("%s", e.msg);
        for (size_t k = 0; k < (size_t) tok_all * vision_cfg(v)->text_hidden; k++)
            md = fabs((double) one[k] - big[k]) > md ? fabs((double) one[k] - big[k]) : md;
        printf("1 thread vs 2 threads: max |diff| %.2e\n", md);
        ASSERT_LE(md, TOL_BATCH);
        free(one);
        vision_free(v1);
        backend_free(be1);
    }
    /* bad views: named, nothing encoded */
    {
        struct vision_view bad = {.rgb = pix, .size = 500};
        ASSERT_ERR(vision_encode(v, &bad, 1, big, NULL, NULL, &e), -EINVAL);
        ASSERT_CONTAINS(e.msg, "view 0: side 500");
        bad.size = 742;
        ASSERT_ERR(vision_encode(v, &bad, 1, big, NULL, NULL, &e), -EINVAL);
    }
    free(big);
    free(pix);
    vision_free(v);
    backend_free(be);
    ckpt_close(ck);
    json_decref(g.man);
    return 0;
}

/* A copy of the tiny model in the working directory (shards hard-linked where possible; the
 * loader refuses symlinks out of the model directory) with config.json or the index edited
 * by sed; ckpt_open must fail with a message containing want. */
static void expect_open_error(const char *model, const char *file, const char *from, const char *to,
                              const char *want, bool text_ok)
{
    char dir[] = "test-vision-bad.XXXXXX", cmd[8192], *abs = realpath(model, NULL);
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct err_buf e = {{0}};
    struct ckpt *ck;
    int r;

    ASSERT_TRUE(mkdtemp(dir) != NULL && abs != NULL);
    snprintf(cmd, sizeof(cmd), "for f in '%s'/*; do cp -l \"$f\" '%s'/ 2>/dev/null || cp \"$f\" '%s'/; done && rm '%s/%s' && "
             "sed 's|%s|%s|' '%s/%s' > '%s/%s'", abs, dir, dir, dir, file, from, to, abs, file, dir, file);
    free(abs);
    ASSERT_EQ(system(cmd), 0);
    r = ckpt_open(dir, &o, &ck, &e);
    if (r >= 0)
        FAIL("%s with %s -> %s: opened", file, from, to);
    ASSERT_CONTAINS(e.msg, want);
    printf("  %s: %s\n", to, e.msg);
    /* images off: the text serves whatever the tower's config */
    if (text_ok) {
        o.skip_vision = true;
        if (ckpt_open(dir, &o, &ck, &e) < 0)
            FAIL("%s with images off: %s", to, e.msg);
        ckpt_close(ck);
    }
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    ASSERT_EQ(system(cmd), 0);
}

/* bad towers: one clear error naming the field or the tensor */
static void bad_checkpoints(const char *model)
{
    expect_open_error(model, "config.json", "\"quick_gelu\"", "\"gelu\"",
                      "vision_config.hidden_act: \"gelu\" is not supported (quick_gelu)", true);
    expect_open_error(model, "config.json", "\"use_cls_token\": false", "\"use_cls_token\": true",
                      "vision_config.use_cls_token: true is not supported", true);
    expect_open_error(model, "config.json", "\"heads\": 2", "\"heads\": 3",
                      "width 32 must split into 3 heads", true);
    /* mlp_ratio 2.0: c_fc [64, 32] expected, the file has [80, 32] */
    expect_open_error(model, "config.json", "\"mlp_ratio\": 2.5", "\"mlp_ratio\": 2.0",
                      "mismatch: vision_model.transformer.resblocks.0.mlp.c_fc.weight", true);
    /* a tower tensor the index does not name: missing (the shard's own copy is then an
     * index/shard disagreement, a structural error of its own) */
    expect_open_error(model, "model.safetensors.index.json", "\"vision_model.ln_pre.bias\"",
                      "\"vision_model.ln_pre.bias_renamed\"", "vision_model.ln_pre.bias", false);
}

static int loader(const char *model)
{
    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct err_buf e = {{0}};
    struct ckpt_plan_stats ps, ps_text;
    struct ckpt *ck;
    struct tview t;

    /* images on: the tower is planned, its bytes counted, its tensors served whole */
    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_TRUE(ckpt_vision(ck) != NULL);
    ckpt_plan_stats(ck, &ps);
    ASSERT_EQ(ps.vision_tensors, 51);
    ASSERT_TRUE(ps.vision_bytes > 500000 && ps.vision_bytes < 530000);
    ASSERT_TRUE(strstr(ckpt_warnings(ck), "vision") == NULL);
    ASSERT_OK(ckpt_get(ck, "vision_model.vit_downsampler2.weight", &t));
    ASSERT_EQ(t.ndim, 4);
    ASSERT_EQ(t.shape[0], 128);
    ASSERT_OK(ckpt_get(ck, "model.vision_model.ln_pre.bias", &t));     /* both spellings */
    ASSERT_ERR(ckpt_get(ck, "vision_model.no_such.weight", &t), -ENOENT);
    {
        /* stepd-inspect --list: the tower's tensors, whole */
        char *dump = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&dump, &len);
        ASSERT_TRUE(f != NULL);
        ckpt_plan_dump(ck, f);
        fclose(f);
        ASSERT_CONTAINS(dump, "\nvision_model.vit_downsampler2.weight BF16 [128,64,3,3] full 147456 vision\n");
        ASSERT_CONTAINS(dump, "\nvit_large_projector.weight BF16 [256,128] full 65536 vision\n");
        free(dump);
    }
    ckpt_close(ck);

    /* images off: nothing of the tower, one warning */
    o.skip_vision = true;
    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_TRUE(ckpt_vision(ck) == NULL);
    ckpt_plan_stats(ck, &ps_text);
    ASSERT_EQ(ps_text.vision_tensors, 0);
    ASSERT_EQ(ps_text.n_tensors + 51, ps.n_tensors);
    ASSERT_EQ(ps_text.bytes + ps.vision_bytes, ps.bytes);
    ASSERT_CONTAINS(ckpt_warnings(ck), "51 vision tensors skipped");
    ASSERT_ERR(ckpt_get(ck, "vision_model.ln_pre.bias", &t), -ENOENT);
    ckpt_close(ck);

    /* rank 1 of 2: the encoder runs on rank 0 */
    o.skip_vision = false;
    o.world_size = 2;
    o.rank = 1;
    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    ASSERT_TRUE(ckpt_vision(ck) == NULL);
    ckpt_plan_stats(ck, &ps_text);
    ASSERT_EQ(ps_text.vision_tensors, 0);
    ckpt_close(ck);

    /* headers only (stepd-inspect): the same plan */
    o.world_size = 1;
    o.rank = 0;
    o.headers_only = true;
    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    ckpt_plan_stats(ck, &ps_text);
    ASSERT_EQ(ps_text.vision_bytes, ps.vision_bytes);
    ASSERT_ERR(ckpt_get(ck, "vision_model.ln_pre.bias", &t), -ENODATA);
    ckpt_close(ck);
    printf("loader: %lld vision tensors, %lld bytes on rank 0\n", (long long) ps.vision_tensors,
           (long long) ps.vision_bytes);
    bad_checkpoints(model);
    return 0;
}

/* vision_splice: image-token rows take the embeddings in order across two chunks */
static int splice(void)
{
    const int H = 3, IMG = 4000;
    const int32_t ids[7] = {1, IMG, IMG, 7, IMG, 2, IMG};
    float emb[4 * 3], x[7 * 3], x0[7 * 3];
    int cur = 0;

    for (int i = 0; i < 12; i++)
        emb[i] = 100.0f + (float) i;
    for (int i = 0; i < 21; i++)
        x[i] = x0[i] = (float) -i;
    ASSERT_EQ(vision_splice(ids, 4, IMG, emb, 4, &cur, x, H), 2);        /* chunk 1: tokens 0..3 */
    ASSERT_EQ(cur, 2);
    ASSERT_EQ(vision_splice(ids + 4, 3, IMG, emb, 4, &cur, x + 4 * H, H), 2);   /* chunk 2 */
    ASSERT_EQ(cur, 4);
    for (int t = 0, k = 0; t < 7; t++) {
        const float *want = ids[t] == IMG ? emb + k++ * H : x0 + t * H;
        ASSERT_TRUE(memcmp(x + t * H, want, H * sizeof(float)) == 0);
    }
    /* more image tokens than embeddings left: nothing written */
    memcpy(x, x0, sizeof(x));
    cur = 2;
    ASSERT_ERR(vision_splice(ids, 7, IMG, emb, 4, &cur, x, H), -ERANGE);
    ASSERT_EQ(cur, 2);
    ASSERT_TRUE(memcmp(x, x0, sizeof(x)) == 0);
    printf("splice: ok\n");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "golden") == 0)
        return golden(argv[2], argv[3]);
    if (argc == 2 && strcmp(argv[1], "splice") == 0)
        return splice();
    if (argc == 3 && strcmp(argv[1], "loader") == 0)
        return loader(argv[2]);
    fprintf(stderr, "usage: test-vision golden MODEL_DIR GOLDEN_DIR | loader MODEL_DIR\n");
    return 2;
}
