/* test-image-step.c - image embeddings through the forward's embedding step (issue 40):
 * the tiny checkpoint's vision tower encodes views, the plan carries the rows
 * (step_plan.img_emb) and the trunk takes them at the image tokens.
 *
 *   test-image-step MODEL_DIR
 *
 *   - a prompt with one 728² view (169 <im_patch> tokens between <im_start>/<im_end>):
 *     logits with the image differ from the same tokens with another image and from the
 *     tokens alone (the rows reach the model);
 *   - chunked prefill (chunks cut inside the image tokens, each plan carrying its own rows)
 *     gives the one-shot logits (the cursor hands rows on in order);
 *   - a plan whose row indices go past its rows fails with a sentence.
 * Exits 77 (skip) without the checkpoint.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "model-rig.h"
#include "vision.h"

#define BS 16
#define MAXLEN 256
#define IM_PATCH 4000
#define IM_START 4001
#define IM_END 4002

static struct model *m;
static int V;
static int32_t blocks[MAXLEN / BS];

static void plan_one(struct step_plan *p, struct step_seq *s, int32_t *toks, int pos0, int n,
                     int n_logits)
{
    static uint64_t id;
    *s = (struct step_seq){.slot = 0, .pos0 = pos0, .n_tokens = n, .n_logits = n_logits,
                           .n_blocks = (pos0 + n + BS - 1) / BS};
    *p = (struct step_plan){.step_id = ++id, .n_seqs = 1, .n_tokens = n, .seqs = s, .tokens = toks,
                            .n_block_ids = {s->n_blocks, s->n_blocks}, .blocks = {blocks, blocks}};
}

static double max_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++)
        d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

static int32_t rows[MAXLEN];     /* per token its image row (the k-th <im_patch>: row k) or -1 */

/* one-shot prefill of toks[0 .. n) with image rows emb (NULL: none), logits of the last */
static void prefill(int32_t *toks, int n, const float *emb, int n_emb, float *logits)
{
    struct step_plan p;
    struct step_seq s;

    plan_one(&p, &s, toks, 0, n, 1);
    p.img_emb = emb;
    p.img_row = emb ? rows : NULL;
    p.n_img_emb = n_emb;
    ASSERT_OK(model_step(m, &p, logits));
}

int main(int argc, char **argv)
{
    struct model_rig rig;
    struct vision *vis;
    struct err_buf err = {{0}};
    static const int nb[2] = {0, 0};

    if (argc < 2)
        FAIL("usage: test-image-step MODEL_DIR");
    model_rig_open_or_exit(&rig, argv[1], 1, 2, MAXLEN, MAXLEN, nb, MODEL_DRAFT_CHECKPOINT);
    m = model_from_forward(rig.f);
    V = rig.f->vocab_size;
    for (int i = 0; i < MAXLEN / BS; i++)
        blocks[i] = i;
    if (vision_new(rig.ck, rig.be, &vis, &err) < 0)
        FAIL("vision_new: %s", err.msg);
    int H = vision_cfg(vis)->text_hidden, side = 728, nt = vision_view_tokens(vis, side);
    ASSERT_EQ(nt, 169);

    /* two images: a gradient and its mirror */
    uint8_t *rgb[2];
    float *emb[2];
    for (int k = 0; k < 2; k++) {
        rgb[k] = malloc((size_t)side * side * 3);
        emb[k] = malloc(sizeof(float) * (size_t)nt * H);
        for (int y = 0; y < side; y++)
            for (int x = 0; x < side; x++)
                for (int c = 0; c < 3; c++)
                    rgb[k][((size_t)y * side + x) * 3 + c] =
                        (uint8_t)(k ? (255 - x * 255 / side + c * 40) : (y * 255 / side + c * 70));
        struct vision_view vv = {rgb[k], side};
        if (vision_encode(vis, &vv, 1, emb[k], NULL, NULL, &err) < 0)
            FAIL("vision_encode: %s", err.msg);
    }

    /* text, <im_start>, 169 x <im_patch>, <im_end>, text */
    int32_t toks[MAXLEN];
    int n = 0;
    static const int32_t pre[] = {1, 812, 95, 240}, post[] = {33, 517, 61};
    for (size_t i = 0; i < sizeof(pre) / sizeof(*pre); i++)
        toks[n++] = pre[i];
    toks[n++] = IM_START;
    for (int i = 0; i < nt; i++)
        toks[n++] = IM_PATCH;
    toks[n++] = IM_END;
    for (size_t i = 0; i < sizeof(post) / sizeof(*post); i++)
        toks[n++] = post[i];
    for (int t = 0, k = 0; t < n; t++)
        rows[t] = toks[t] == IM_PATCH ? k++ : -1;

    float *la = malloc(sizeof(float) * V), *lb = malloc(sizeof(float) * V),
          *lt = malloc(sizeof(float) * V), *lc = malloc(sizeof(float) * V);
    prefill(toks, n, emb[0], nt, la);
    prefill(toks, n, emb[1], nt, lb);
    prefill(toks, n, NULL, 0, lt);
    double dab = max_diff(la, lb, V), dat = max_diff(la, lt, V);
    printf("image A vs image B: max|d| %.4g; image A vs no image: %.4g\n", dab, dat);
    ASSERT_TRUE(dab > 1e-3 && dat > 1e-3);

    /* chunked: chunks cut inside the image tokens; each plan carries the rows of its own
     * image tokens */
    static const int cuts[] = {0, 9, 100, 171, 0};
    int n_cuts = 4, used = 0;
    double dch = 0;
    for (int c = 0; c < n_cuts; c++) {
        int a = cuts[c], b = c + 1 < n_cuts ? cuts[c + 1] : n, k = 0;
        struct step_plan p;
        struct step_seq s;
        for (int t = a; t < b; t++)
            k += toks[t] == IM_PATCH;
        int32_t crow[MAXLEN];
        for (int t = a; t < b; t++)
            crow[t - a] = rows[t] >= 0 ? rows[t] - used : -1;
        plan_one(&p, &s, toks + a, a, b - a, b == n);
        p.img_emb = k ? emb[0] + (size_t)used * H : NULL;
        p.img_row = k ? crow : NULL;
        p.n_img_emb = k;
        used += k;
        ASSERT_OK(model_step(m, &p, lc));
    }
    ASSERT_EQ(used, nt);
    dch = max_diff(la, lc, V);
    printf("chunked vs one-shot: max|d| %.3g\n", dch);
    ASSERT_TRUE(dch < 1e-3);

    /* a row index past the plan's rows, rows without their index or of another width:
     * refused, named */
    {
        struct step_plan p;
        struct step_seq s;
        plan_one(&p, &s, toks, 0, n, 1);
        p.img_emb = emb[0];
        p.img_row = rows;
        p.n_img_emb = nt - 1;
        ASSERT_ERR(model_step(m, &p, lc), -EINVAL);
        ASSERT_TRUE(strstr(model_last_error(m), "image row 168 of 168") != NULL);
        printf("bad row refused: %s\n", model_last_error(m));
        p.n_img_emb = nt;
        p.img_row = NULL;
        ASSERT_ERR(model_step(m, &p, lc), -EINVAL);
        printf("mismatch refused: %s\n", model_last_error(m));
        /* rows of another width (a plan from the wire says how wide its rows are) */
        p.img_row = rows;
        p.img_width = H + 1;
        ASSERT_ERR(model_step(m, &p, lc), -EINVAL);
        ASSERT_TRUE(strstr(model_last_error(m), "width") != NULL);
        printf("width refused: %s\n", model_last_error(m));
    }

    for (int k = 0; k < 2; k++) {
        free(rgb[k]);
        free(emb[k]);
    }
    free(la);
    free(lb);
    free(lt);
    free(lc);
    vision_free(vis);
    model_rig_close(&rig);
    printf("test-image-step: ok\n");
    return 0;
}
