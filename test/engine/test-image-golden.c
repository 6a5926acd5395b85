/* test-image-golden.c - the image splice against the PyTorch reference's goldens.
 *
 *   test-image-golden GOLDEN_JSON MODEL_DIR [exact|fast]
 *
 * The text goldens (test/data/golden/tiny-step.json, tools/reference/make_goldens.py) give
 * the reference's logits and greedy continuation of a token sequence.  Here positions
 * [SPAN0, SPAN1) of the longest case become <im_patch> tokens whose image rows are the
 * embedding rows of the ids they replace (read from the checkpoint): the embedding step's
 * splice must then reproduce the reference exactly as if the ids were there.  Checked: the
 * logits at the golden positions after a one-shot prefill and after a prefill chunked
 * through the image span (each chunk carrying its own rows), and the 32-token greedy
 * continuation (exact path: identical; fast path: identical up to the first position whose
 * reference top-2 margin is below 2 x TOL_FAST, as test-golden).  On either path the
 * image-row run must also equal the run of the ids themselves: logits within 1e-5 (exact) /
 * 1e-3 (fast) and the 32 greedy tokens identical; so must the MTP layer's draft logits
 * (its inputs at the image positions are the rows, as vLLM's MTP takes the target's
 * spliced input embeddings).  Tolerances (max-abs over
 * a logit row) as test-golden: exact 1e-3, fast 5e-2.  Exits 77 without the golden file.
 * The vision encoder itself is checked against vision_ref.py by vision-tiny-golden.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/golden-model.h"
#include "harness.h"
#include "model.h"

#define TOL_EXACT 1e-3
#define TOL_FAST 5e-2
#define BS 16
#define MAXLEN 256
#define IM_PATCH 4000
#define SPAN0 8
#define SPAN1 72
#define NGREEDY 32

static struct model *m;
static int V, H;
static int32_t blocks[MAXLEN / BS];

static void plan_one(struct step_plan *p, struct step_seq *s, int32_t *toks, int pos0, int n, int n_logits)
{
    golden_plan_one(p, s, blocks, BS, toks, pos0, n, n_logits);
}

static double row_diff(const float *a, json_t *vals)
{
    return golden_row_diff(a, vals, V);
}

static int argmax(const float *x)
{
    return harness_argmax(x, V);
}

/* seq[T ..] = first (argmax of last), then NGREEDY - 1 more greedy tokens, one per step */
static void greedy(int32_t *seq, int T, const float *last, float *lg)
{
    struct step_plan p;
    struct step_seq s;

    seq[T] = argmax(last);
    for (int g = 0; g + 1 < NGREEDY; g++) {
        plan_one(&p, &s, seq + T + g, T + g, 1, 1);
        ASSERT_OK(model_step(m, &p, lg));
        seq[T + g + 1] = argmax(lg);
    }
}

int main(int argc, char **argv)
{
    struct ckpt *ck;
    struct backend *be;

    if (argc < 3)
        FAIL("usage: test-image-golden GOLDEN_JSON MODEL_DIR [exact|fast]");
    if (access(argv[1], R_OK) != 0) {
        printf("SKIP: no golden file %s\n", argv[1]);
        return 77;
    }
    bool exact = argc < 4 || strcmp(argv[3], "fast") != 0;
    double tol = exact ? TOL_EXACT : TOL_FAST;
    json_error_t je;
    json_t *root = json_load_file(argv[1], 0, &je);
    if (!root)
        FAIL("%s: %s", argv[1], je.text);
    golden_model_open(argv[2], exact, MAXLEN, BS, &ck, &be, &m);
    V = ckpt_config(ck)->vocab_size;
    H = ckpt_config(ck)->hidden_size;
    for (int b = 0; b < MAXLEN / BS; b++)
        blocks[b] = (b * 7 + 3) % (MAXLEN / BS);

    /* the longest case */
    json_t *cases = json_object_get(root, "cases"), *c = NULL, *x;
    size_t i;
    json_array_foreach(cases, i, x)
        if (!c || json_array_size(json_object_get(x, "ids")) > json_array_size(json_object_get(c, "ids")))
            c = x;
    json_t *jids = json_object_get(c, "ids"), *jg = json_object_get(c, "greedy"),
           *jm = json_object_get(c, "greedy_margin"), *glog = json_object_get(c, "logits");
    int T = (int)json_array_size(jids);
    ASSERT_TRUE(T > SPAN1 && T + NGREEDY <= MAXLEN && json_array_size(jg) >= NGREEDY);
    int32_t ids[MAXLEN], toks[MAXLEN], rows[MAXLEN];
    for (int t = 0; t < T; t++)
        ids[t] = (int32_t)json_integer_value(json_array_get(jids, (size_t)t));

    /* the image rows: embedding rows of the replaced ids, straight from the checkpoint */
    struct tview ev;
    ASSERT_OK(ckpt_get(ck, "model.embed_tokens.weight", &ev));
    ASSERT_TRUE(ev.ndim == 2 && ev.shape[1] == H && (ev.dtype == DTYPE_BF16 || ev.dtype == DTYPE_F32));
    float *emb = malloc(sizeof(float) * (size_t)(SPAN1 - SPAN0) * H);
    for (int t = SPAN0; t < SPAN1; t++)
        for (int j = 0; j < H; j++) {
            size_t at = (size_t)ids[t] * H + j;
            float f;
            if (ev.dtype == DTYPE_BF16) {
                uint16_t b16;
                uint32_t u;
                memcpy(&b16, (const uint8_t *)ev.data + 2 * at, 2);
                u = (uint32_t)b16 << 16;
                memcpy(&f, &u, 4);
            } else {
                memcpy(&f, (const uint8_t *)ev.data + 4 * at, 4);
            }
            emb[(size_t)(t - SPAN0) * H + j] = f;
        }
    for (int t = 0; t < T; t++) {
        bool img = t >= SPAN0 && t < SPAN1;
        toks[t] = img ? IM_PATCH : ids[t];
        rows[t] = img ? t - SPAN0 : -1;
    }

    printf("%s, case %s: %d tokens, positions %d..%d as image rows, %s path\n", argv[1],
           json_string_value(json_object_get(c, "name")), T, SPAN0, SPAN1 - 1, exact ? "exact" : "fast");
    float *all = malloc(sizeof(float) * (size_t)T * V), *lg = malloc(sizeof(float) * (size_t)V);
    struct step_plan p;
    struct step_seq s;

    /* 1. one-shot */
    plan_one(&p, &s, toks, 0, T, T);
    p.img_emb = emb;
    p.img_row = rows;
    p.n_img_emb = SPAN1 - SPAN0;
    ASSERT_OK(model_step(m, &p, all));
    double d1 = 0;
    json_array_foreach(glog, i, x) {
        int pos = (int)json_integer_value(json_object_get(x, "pos"));
        double d = row_diff(all + (size_t)pos * V, json_object_get(x, "values"));
        d1 = fmax(d1, d);
    }
    printf("one-shot: max|d| %.3g over %zu golden rows (tolerance %g)\n", d1, json_array_size(glog), tol);
    ASSERT_TRUE(d1 <= tol);

    /* 2. chunks cut inside the image span, then the greedy continuation */
    static const int cuts[] = {0, 30, 50};
    double d2 = 0;
    for (int k = 0; k < 3; k++) {
        int a = cuts[k], b = k < 2 ? cuts[k + 1] : T, lo = a > SPAN0 ? a : SPAN0, hi = b < SPAN1 ? b : SPAN1;
        int32_t crow[MAXLEN];
        for (int t = a; t < b; t++)
            crow[t - a] = rows[t] >= 0 ? rows[t] - (lo - SPAN0) : -1;
        plan_one(&p, &s, toks + a, a, b - a, b - a);
        if (hi > lo) {
            p.img_emb = emb + (size_t)(lo - SPAN0) * H;
            p.img_row = crow;
            p.n_img_emb = hi - lo;
        }
        ASSERT_OK(model_step(m, &p, all + (size_t)a * V));
    }
    json_array_foreach(glog, i, x) {
        int pos = (int)json_integer_value(json_object_get(x, "pos"));
        d2 = fmax(d2, row_diff(all + (size_t)pos * V, json_object_get(x, "values")));
    }
    printf("chunked at 30, 50: max|d| %.3g\n", d2);
    ASSERT_TRUE(d2 <= tol);

    /* greedy after the chunked prefill; and the same with the ids themselves (no image
     * rows) on this path, whose output the splice must reproduce token for token */
    int32_t seq[MAXLEN], seq_t[MAXLEN];
    memcpy(seq, toks, sizeof(int32_t) * (size_t)T);
    memcpy(seq_t, ids, sizeof(int32_t) * (size_t)T);
    greedy(seq, T, all + (size_t)(T - 1) * V, lg);
    float *all_t = malloc(sizeof(float) * (size_t)T * V);
    plan_one(&p, &s, seq_t, 0, T, T);
    ASSERT_OK(model_step(m, &p, all_t));
    double dt = 0;
    for (size_t k = 0; k < (size_t)T * V; k++)
        dt = fmax(dt, fabs((double)all[k] - all_t[k]));
    greedy(seq_t, T, all_t + (size_t)(T - 1) * V, lg);
    free(all_t);
    printf("image rows vs the ids on this path: logits max|d| %.3g, greedy %s\n", dt,
           memcmp(seq + T, seq_t + T, sizeof(int32_t) * NGREEDY) ? "differs" : "identical");
    ASSERT_TRUE(dt <= (exact ? 1e-5 : 1e-3));
    ASSERT_TRUE(memcmp(seq + T, seq_t + T, sizeof(int32_t) * NGREEDY) == 0);

    /* against the reference: exact path all 32; fast path up to the first near-tie (the
     * reference's top-2 margin below 2 x TOL_FAST), as test-golden */
    int checked = NGREEDY;
    for (int g = 0; !exact && g < NGREEDY; g++)
        if (json_number_value(json_array_get(jm, (size_t)g)) < 2 * TOL_FAST) {
            checked = g;
            break;
        }
    int prefix = 0;
    while (prefix < NGREEDY && seq[T + prefix] == (int32_t)json_integer_value(json_array_get(jg, (size_t)prefix)))
        prefix++;
    printf("greedy vs the reference: first %d of %d tokens identical (%d required)\n", prefix, NGREEDY, checked);
    ASSERT_TRUE(prefix >= checked);

    /* the MTP layers: depth 0 after the one-shot prefill takes, at positions 7..70, the
     * ids 8..71, so with the image rows its draft logits equal those of the ids only when
     * the MTP input splices the rows too */
    float *dl[2];
    for (int pass = 0; pass < 2; pass++) {
        int32_t nv = T, tok_in = seq[T];
        dl[pass] = malloc(sizeof(float) * (size_t)V);
        plan_one(&p, &s, pass ? ids : toks, 0, T, 1);
        s.mtp_depth = 1;
        if (!pass) {
            p.img_emb = emb;
            p.img_row = rows;
            p.n_img_emb = SPAN1 - SPAN0;
        }
        ASSERT_OK(model_step(m, &p, lg));
        ASSERT_OK(model_mtp_step(m, 0, &p, &nv, &tok_in, dl[pass]));
    }
    double dm = 0;
    for (int k = 0; k < V; k++)
        dm = fmax(dm, fabs((double)dl[0][k] - dl[1][k]));
    printf("MTP depth 0 draft logits, image rows vs the ids: max|d| %.3g\n", dm);
    ASSERT_TRUE(dm <= (exact ? 1e-5 : 1e-3));
    /* ... and after a prefill chunked at 30 and 50 with the MTP fills of each chunk (tok_in:
     * the next prompt token, an image token at both cuts: its row via img_row_next) */
    for (int pass = 0; pass < 2; pass++) {
        for (int ch = 0; ch < 3; ch++) {          /* the cuts of step 2 */
            int a = cuts[ch], b = ch < 2 ? cuts[ch + 1] : T;
            int32_t crow[MAXLEN], next[STEP_PLAN_IMG_NEXT] = {-1, -1, -1, -1}, nv = b - a;
            int32_t tok_in = b < T ? (pass ? ids : toks)[b] : seq[T];
            int lo = a > SPAN0 ? a : SPAN0, hi = b + 1 < SPAN1 ? b + 1 : SPAN1;  /* rows [lo, hi) */
            plan_one(&p, &s, (pass ? ids : toks) + a, a, b - a, 1);
            s.mtp_depth = 1;
            if (!pass && hi > lo) {
                for (int t = a; t < b; t++)
                    crow[t - a] = rows[t] >= 0 ? rows[t] - (lo - SPAN0) : -1;
                if (b < T && rows[b] >= 0)
                    next[0] = rows[b] - (lo - SPAN0);
                p.img_emb = emb + (size_t)(lo - SPAN0) * H;
                p.img_row = crow;
                p.img_row_next = next;
                p.n_img_emb = hi - lo;
            }
            ASSERT_OK(model_step(m, &p, lg));
            ASSERT_OK(model_mtp_step(m, 0, &p, &nv, &tok_in, dl[pass]));
        }
    }
    dm = 0;
    for (int k = 0; k < V; k++)
        dm = fmax(dm, fabs((double)dl[0][k] - dl[1][k]));
    printf("MTP after chunks with fills, image rows vs the ids: max|d| %.3g\n", dm);
    ASSERT_TRUE(dm <= (exact ? 1e-5 : 1e-3));
    free(dl[0]);
    free(dl[1]);

    free(all);
    free(lg);
    free(emb);
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
    json_decref(root);
    printf("test-image-golden: ok\n");
    return 0;
}
