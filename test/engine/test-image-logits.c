/* test-image-logits.c - the whole tiny model on image prompts against the numpy reference
 * (issue 40): the image path composed end to end (preprocessing, the vision encoder, the
 * splice, the text trunk) against test/data/golden/tiny-step-images.json, which
 * tools/reference/step_np.py image-goldens makes from image_ref.py (views, token layout),
 * vision_ref.py (the encoder) and step_np.py (the trunk, checked against step_ref.py's text
 * goldens by reference-np-text).
 *
 *   test-image-logits GOLDEN_JSON MODEL_DIR [exact|fast]
 *
 * The 4 images are synthesised here with the same formula as step_np.synth_image (sizes,
 * aspect ratios and crop grids in the golden: two global-only, one with 2 x 2 crops of 504,
 * one with 3 x 1 crops of 240); each goes through image_prep() (its token layout must equal
 * the golden prompt's at the image's position) and vision_encode() (crops, then the global
 * view), and the rows ride the plan (img_emb/img_row) as the engine's plan_images() puts
 * them.  Checked: the encoder output (each view's mean row over its tokens: 2e-3, 5e-2 with
 * BF16 activations; the per-stage check is vision-tiny-golden's), the logits at the golden
 * positions after a one-shot prefill and after a prefill chunked inside two images, the
 * 32-token greedy continuation.  Tolerances (max-abs
 * over a logit row): exact path (FP32 KV, exact MXFP4) 2e-3, fast path (the service defaults:
 * BF16 KV) 5e-2; greedy tokens all 32 identical on the exact path, on the fast path up to
 * the first step whose reference top-2 margin is below 2 x 5e-2 (as test-golden).  The exact
 * budget is twice test-golden's because image_prep()'s views may differ from the
 * reference's by one level (test_image.py's tolerance): measured 7.5e-4 on these images,
 * 4e-5 when the reference is fed the C views.  On an AMX-BF16 host (or STEPD_CPU_ISA=amx)
 * the encoder's GEMMs round activations to BF16 (vision-tiny-golden), so the exact path
 * takes the fast path's tolerances.  Exits 77 without the golden file.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/golden-model.h"
#include "harness.h"
#include "image.h"
#include "model.h"
#include "vision.h"

#define TOL_EXACT 2e-3
#define TOL_FAST 5e-2
#define TOL_ENC 2e-3
#define TOL_ENC_BF16 5e-2
#define BS 16
#define MAXLEN 1408
#define NGREEDY 32
#define NIMG 4

static struct model *m;
static int V;
static int32_t blocks[MAXLEN / BS];

static void plan_one(struct step_plan *p, struct step_seq *s, int32_t *toks, int pos0, int n, int n_logits)
{
    golden_plan_one(p, s, blocks, BS, toks, pos0, n, n_logits);
}

/* step_np.synth_image: gradients, a disc and a hashed texture, uint8 RGB rows */
static uint8_t *synth_image(int w, int h, int seed)
{
    uint8_t *out = malloc((size_t)w * h * 3);
    int64_t cx = (int64_t)w * (seed + 1) / 7, cy = (int64_t)h * (seed + 2) / 9, r = (w < h ? w : h) / 3;

    for (int64_t y = 0; y < h; y++)
        for (int64_t x = 0; x < w; x++) {
            int disc = (x - cx) * (x - cx) + (y - cy) * (y - cy) < r * r;
            for (int64_t c = 0; c < 3; c++) {
                int64_t hsh = (x * 73 + y * 151 + c * 29 + seed * 97) ^ ((x * y + seed) >> 3);
                int64_t v = (x * (c + 1) * 255 / w + y * (3 - c) * 255 / (3 * h) + (hsh & 31) + seed * 50) & 255;
                out[((size_t)y * w + x) * 3 + c] = (uint8_t)(disc ? 255 - v / 2 : v);
            }
        }
    return out;
}

static int jint(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    if (!json_is_integer(v))
        FAIL("golden: no integer \"%s\"", k);
    return (int)json_integer_value(v);
}

static double row_diff(const float *a, json_t *vals)
{
    return golden_row_diff(a, vals, V);
}

static double golden_diff(const float *all, json_t *glog)
{
    double d = 0;
    size_t i;
    json_t *x;
    json_array_foreach(glog, i, x)
        d = fmax(d, row_diff(all + (size_t)jint(x, "pos") * V, json_object_get(x, "values")));
    return d;
}

int main(int argc, char **argv)
{
    struct ckpt *ck;
    struct backend *be;
    struct vision *vis;
    struct err_buf e = {{0}};

    if (argc < 3)
        FAIL("usage: test-image-logits GOLDEN_JSON MODEL_DIR [exact|fast]");
    if (access(argv[1], R_OK) != 0) {
        printf("SKIP: no golden file %s\n", argv[1]);
        return 77;
    }
    bool exact = argc < 4 || strcmp(argv[3], "fast") != 0;
    const char *isa = getenv("STEPD_CPU_ISA");
    bool bf16_act = isa ? strcmp(isa, "amx") == 0 : system("grep -q amx_bf16 /proc/cpuinfo") == 0;
    bool tight = exact && !bf16_act;       /* the exact path's tolerances */
    double tol = tight ? TOL_EXACT : TOL_FAST;
    json_error_t je;
    json_t *root = json_load_file(argv[1], 0, &je);
    if (!root)
        FAIL("%s: %s", argv[1], je.text);
    golden_model_open(argv[2], exact, MAXLEN, BS, &ck, &be, &m);
    V = ckpt_config(ck)->vocab_size;
    for (int b = 0; b < MAXLEN / BS; b++)
        blocks[b] = (b * 7 + 3) % (MAXLEN / BS);
    if (vision_new(ck, be, &vis, &e) < 0)
        FAIL("vision_new: %s", e.msg);
    int H = vision_cfg(vis)->text_hidden;

    json_t *jids = json_object_get(root, "ids"), *jimg = json_object_get(root, "images"),
           *jtok = json_object_get(root, "image_tokens"), *glog = json_object_get(root, "logits"),
           *jg = json_object_get(root, "greedy"), *jm = json_object_get(root, "greedy_margin");
    int T = (int)json_array_size(jids);
    ASSERT_TRUE(T > 0 && T + NGREEDY <= MAXLEN && json_array_size(jimg) == NIMG);
    ASSERT_TRUE(json_array_size(jg) >= NGREEDY && json_array_size(jm) >= NGREEDY);
    struct image_token_ids ti = {.im_start = jint(jtok, "im_start"), .im_end = jint(jtok, "im_end"),
                                 .patch_start = jint(jtok, "patch_start"), .patch_end = jint(jtok, "patch_end"),
                                 .patch_newline = jint(jtok, "patch_newline"), .im_patch = jint(jtok, "im_patch")};
    int32_t *ids = malloc(sizeof(int32_t) * MAXLEN), *rows = malloc(sizeof(int32_t) * MAXLEN);
    for (int t = 0; t < T; t++)
        ids[t] = (int32_t)json_integer_value(json_array_get(jids, (size_t)t));

    /* the images: preprocessing, layout, encoder; rows in prompt order */
    float *emb = NULL;
    int n_emb = 0;
    double d_enc = 0;
    for (int k = 0; k < NIMG; k++) {
        json_t *ji = json_array_get(jimg, (size_t)k);
        int w = jint(ji, "width"), h = jint(ji, "height"), at = jint(ji, "token_position");
        struct image img = {.format = IMAGE_PNG, .w = (uint32_t)w, .h = (uint32_t)h,
                            .rgb = synth_image(w, h, jint(ji, "seed"))};
        struct image_prep ip;
        if (image_prep(&img, &ti, &ip, &e) < 0)
            FAIL("image_prep: %s", e.msg);
        printf("%s: %dx%d, window %u, %ux%u crops, %zu tokens at %d\n",
               json_string_value(json_object_get(ji, "name")), w, h, ip.window, ip.crops_x, ip.crops_y,
               ip.n_tokens, at);
        ASSERT_EQ((int)ip.n_tokens, jint(ji, "n_tokens"));
        ASSERT_EQ((int)ip.n_views, jint(ji, "n_views"));
        ASSERT_TRUE(at + (int)ip.n_tokens <= T);
        ASSERT_TRUE(memcmp(ip.tokens, ids + at, sizeof(int32_t) * ip.n_tokens) == 0);
        struct vision_view vv[16];
        int nt = 0;
        ASSERT_TRUE(ip.n_views <= 16);
        for (uint32_t v = 0; v < ip.n_views; v++) {
            vv[v] = (struct vision_view){ip.views[v].rgb, (int)ip.views[v].w};
            nt += vision_view_tokens(vis, vv[v].size);
        }
        emb = realloc(emb, sizeof(float) * (size_t)(n_emb + nt) * H);
        if (vision_encode(vis, vv, (int)ip.n_views, emb + (size_t)n_emb * H, NULL, NULL, &e) < 0)
            FAIL("vision_encode: %s", e.msg);
        /* the encoder output: each view's mean row against the reference's */
        json_t *jmean = json_object_get(ji, "view_mean_rows");
        ASSERT_EQ((int)json_array_size(jmean), (int)ip.n_views);
        for (uint32_t v = 0, r0 = (uint32_t)n_emb; v < ip.n_views; v++) {
            int n = vision_view_tokens(vis, vv[v].size);
            json_t *want = json_array_get(jmean, v);
            ASSERT_EQ((int)json_array_size(want), H);
            for (int j = 0; j < H; j++) {
                double mean = 0;
                for (int t = 0; t < n; t++)
                    mean += emb[(size_t)(r0 + t) * H + j];
                d_enc = fmax(d_enc, fabs(mean / n - json_number_value(json_array_get(want, (size_t)j))));
            }
            r0 += (uint32_t)n;
        }
        n_emb += nt;
        image_prep_done(&ip);
        free(img.rgb);
    }
    int n_img_tok = 0;
    for (int t = 0; t < T; t++)
        rows[t] = ids[t] == ti.im_patch ? n_img_tok++ : -1;
    ASSERT_EQ(n_img_tok, n_emb);
    double tol_enc = bf16_act ? TOL_ENC_BF16 : TOL_ENC;
    printf("encoder: per-view mean rows max|d| %.3g (tolerance %g)\n", d_enc, tol_enc);
    ASSERT_TRUE(d_enc <= tol_enc);
    printf("%s: %d tokens, %d image rows, %s path%s\n", argv[1], T, n_emb, exact ? "exact" : "fast",
           exact && !tight ? " (BF16 activations in the encoder: the fast path's tolerances)" : "");

    float *all = malloc(sizeof(float) * (size_t)T * V), *lg = malloc(sizeof(float) * (size_t)V);
    struct step_plan p;
    struct step_seq s;

    /* 1. one-shot prefill */
    plan_one(&p, &s, ids, 0, T, T);
    p.img_emb = emb;
    p.img_row = rows;
    p.n_img_emb = n_emb;
    ASSERT_OK(model_step(m, &p, all));
    double d1 = golden_diff(all, glog);
    printf("one-shot: max|d| %.3g over %zu golden rows (tolerance %g)\n", d1, json_array_size(glog), tol);
    ASSERT_TRUE(d1 <= tol);

    /* 2. chunks cut inside the second and the third image; each plan carries its rows */
    int cuts[] = {0, jint(json_array_get(jimg, 1), "token_position") + 60,
                  jint(json_array_get(jimg, 2), "token_position") + 200, T};
    for (int k = 0; k < 3; k++) {
        int a = cuts[k], b = cuts[k + 1], lo = -1, n = 0;
        int32_t crow[MAXLEN];
        for (int t = a; t < b; t++) {       /* a chunk's image rows are consecutive */
            if (rows[t] >= 0 && lo < 0)
                lo = rows[t];
            crow[t - a] = rows[t] >= 0 ? rows[t] - lo : -1;
            n += rows[t] >= 0;
        }
        plan_one(&p, &s, ids + a, a, b - a, b - a);
        if (n) {
            p.img_emb = emb + (size_t)lo * H;
            p.img_row = crow;
            p.n_img_emb = n;
        }
        ASSERT_OK(model_step(m, &p, all + (size_t)a * V));
    }
    double d2 = golden_diff(all, glog);
    printf("chunked at %d, %d: max|d| %.3g\n", cuts[1], cuts[2], d2);
    ASSERT_TRUE(d2 <= tol);

    /* 3. greedy: exact path all 32 tokens; fast path up to the reference's first near-tie */
    int32_t seq[MAXLEN];
    seq[0] = (int32_t)harness_argmax(all + (size_t)(T - 1) * V, V);
    for (int g = 0; g + 1 < NGREEDY; g++) {
        plan_one(&p, &s, seq + g, T + g, 1, 1);
        ASSERT_OK(model_step(m, &p, lg));
        seq[g + 1] = (int32_t)harness_argmax(lg, V);
    }
    int checked = NGREEDY;
    for (int g = 0; !tight && g < NGREEDY; g++)
        if (json_number_value(json_array_get(jm, (size_t)g)) < 2 * TOL_FAST) {
            checked = g;
            break;
        }
    int prefix = 0;
    while (prefix < NGREEDY && seq[prefix] == (int32_t)json_integer_value(json_array_get(jg, (size_t)prefix)))
        prefix++;
    printf("greedy vs the reference: first %d of %d tokens identical (%d required)\n", prefix, NGREEDY, checked);
    ASSERT_TRUE(prefix >= checked);

    free(all);
    free(lg);
    free(emb);
    free(ids);
    free(rows);
    vision_free(vis);
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
    json_decref(root);
    printf("test-image-logits: ok\n");
    return 0;
}
