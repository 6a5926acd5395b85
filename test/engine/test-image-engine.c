/* test-image-engine.c - requests with images through the engine on the REAL tiny
 * checkpoint and its vision tower (issue 40; CPU, one rank):
 *   - the same tokens with two different images: no shared KV (n_cached 0 for the second,
 *     prefix cache on) and different greedy outputs;
 *   - the first image again: the whole prompt but the last token comes from the prefix
 *     cache, the encoder is not run again (image_cache_hits, image_encodes); so does the
 *     next turn (prompt + answer + new text, same image) up to the answer's last block;
 *   - a prefill chunked through the image tokens (16-token steps) gives the greedy output
 *     of one 256-token step; K = 3 equals K = 0 on the image prompt, also chunked, where
 *     the chunks' MTP fills take the image rows of the prompt tokens after them;
 *   - an image whose hash claims another image's content: its own rows, no shared KV;
 *   - refusals: a token count that disagrees with the views, a view the encoder cannot
 *     take, an engine without an encoder; the engine keeps serving afterwards;
 *   - the encoder batched over requests (a counting wrapper around the encoder): views
 *     encoded together give the rows of each view alone bit for bit; two requests with
 *     different images new in one step -> one call with both, the outputs of separate
 *     runs; the same image in both -> one encode and one hit; the view cap
 *     (image_batch_views) splits a step's images over calls; a call that fails is
 *     re-run image by image, so only the request whose image fails alone ends with the
 *     encoder's error and the others run.
 * Exits 77 (skip) when the checkpoint is absent.
 */
#include <math.h>

#include "engine-rig.h"
#include "model-rig.h"
#include "sha256.h"
#include "vision.h"

#define IM_PATCH 4000
#define IM_START 4001
#define IM_END 4002
#define SIDE 728
#define NGEN 24

static struct model_rig rig;
static struct vision *vis;
static int H;

static int view_tokens(void *ctx, const struct engine_view *v)
{
    return v->width != v->height ? -EINVAL : vision_view_tokens(ctx, v->width);
}

/* the encoder calls seen: how many, the views of the last ones; fail_multi: the next
 * call of several views fails; a view whose first pixel is POISON always fails */
static int n_calls, call_views[8], fail_multi;
static const uint8_t POISON[3] = {1, 2, 3};

static int encode(void *ctx, const struct engine_view *v, int n, float *out, struct err_buf *e)
{
    struct vision_view vv[4];
    if (n > 4)
        return err_set(e, -E2BIG, "%d views", n);
    call_views[n_calls++ % 8] = n;
    if (n > 1 && fail_multi) {
        fail_multi = 0;
        return err_set(e, -ENOMEM, "out of memory for %d views", n);
    }
    for (int i = 0; i < n; i++) {
        if (memcmp(v[i].rgb, POISON, 3) == 0)
            return err_set(e, -EIO, "view %d is poisoned", i);
        vv[i] = (struct vision_view){v[i].rgb, v[i].width};
    }
    return vision_encode(ctx, vv, n, out, NULL, NULL, e);
}

static struct engine_vision ev;

/* plans seen with a prompt chunk's MTP fill taking an image row (img_row_next) */
static int n_fill_rows;

static int audit_plan(void *ctx, const struct step_plan *p)
{
    (void)ctx;
    for (int i = 0; p && p->img_row_next && i < p->n_seqs * STEP_PLAN_IMG_NEXT; i++)
        if (p->img_row_next[i] >= 0) {
            ASSERT_TRUE(p->img_row_next[i] < p->n_img_emb);
            n_fill_rows++;
        }
    return 0;
}

static struct engine *open_engine(bool vision, int max_tokens, int k)
{
    struct engine_config ec;
    rig_engine_config(&ec, max_tokens, 4, 512, rig.cfg->sliding_window, k);
    ec.spec_policy = SPEC_POLICY_FIXED;
    ec.vision = vision ? &ev : NULL;
    ec.on_plan = audit_plan;
    return rig_engine_new(rig.f, &ec);
}

static uint8_t px[3][SIDE * SIDE * 3];     /* image A, image B, A poisoned (POISON) */
static struct engine_view views[3];
static struct engine_image images[3];
static int32_t prompt[256];
static int n_prompt;

/* submit prompt with image `which` (-1: none); returns engine_submit's code, err filled */
static int submit(struct engine *e, const char *id, int which, int k, struct rig_out *out,
                  struct err_buf *err)
{
    struct engine_request q;
    engine_request_init(&q);
    q.id = id;
    q.prompt = prompt;
    q.n_prompt = n_prompt;
    q.max_tokens = NGEN;
    q.ignore_eos = true;
    q.num_speculative_tokens = k;
    if (which >= 0) {
        q.images = &images[which];
        q.n_images = 1;
    }
    memset(out, 0, sizeof(*out));
    return engine_submit(e, &q, rig_on_out, out, err);
}

static void run_one(struct engine *e, const char *id, int which, int k, struct rig_out *out)
{
    struct err_buf err = {{0}};
    if (submit(e, id, which, k, out, &err) < 0)
        FAIL("submit %s: %s", id, err.msg);
    ASSERT_OK(engine_run_until_idle(e));
    ASSERT_TRUE(out->finished && out->why == ENGINE_FINISH_LENGTH && out->n == NGEN);
}

static bool same_toks(const struct rig_out *a, const struct rig_out *b)
{
    return a->n == b->n && memcmp(a->toks, b->toks, sizeof(int32_t) * (size_t)a->n) == 0;
}

/* a request of a pair submitted before one step: its output and final message */
struct pair_out {
    struct rig_out o;
    char msg[256];
};

static void on_pair_out(void *ud, const struct engine_output *o)
{
    struct pair_out *p = ud;
    rig_on_out(&p->o, o);
    if (o->finished)
        snprintf(p->msg, sizeof(p->msg), "%s", o->message ? o->message : "");
}

/* requests with image ia and image ib submitted together, run on a new engine (at most
 * batch_views views an encoder call, cache entries); returns the encoder calls they took */
static int run_pair(int batch_views, int cache, int ia, int ib, struct pair_out out[2],
                    struct engine_loads *l)
{
    struct engine_config ec;
    rig_engine_config(&ec, 256, 4, 512, rig.cfg->sliding_window, 0);
    ec.vision = &ev;
    ec.image_batch_views = batch_views;
    ec.image_cache_entries = cache;
    struct engine *e = rig_engine_new(rig.f, &ec);
    int which[2] = {ia, ib}, calls = n_calls;
    for (int i = 0; i < 2; i++) {
        struct engine_request q;
        struct err_buf err = {{0}};
        engine_request_init(&q);
        q.id = i ? "pair1" : "pair0";
        q.prompt = prompt;
        q.n_prompt = n_prompt;
        q.max_tokens = NGEN;
        q.ignore_eos = true;
        q.images = &images[which[i]];
        q.n_images = 1;
        memset(&out[i], 0, sizeof(out[i]));
        if (engine_submit(e, &q, on_pair_out, &out[i], &err) < 0)
            FAIL("submit pair%d: %s", i, err.msg);
    }
    ASSERT_OK(engine_run_until_idle(e));
    engine_get_loads(e, l);
    rig_engine_close(e, NULL);
    return n_calls - calls;
}

/* vision_encode of views [0, n) together and each alone: the rows bit for bit */
static void check_rows_independent(const struct engine_view *v, int n)
{
    int rows = 0, off = 0;
    struct vision_view vv[4];
    struct err_buf err = {{0}};
    for (int i = 0; i < n; i++) {
        vv[i] = (struct vision_view){v[i].rgb, v[i].width};
        rows += vision_view_tokens(vis, v[i].width);
    }
    float *all = malloc(sizeof(float) * (size_t)rows * H), *one = malloc(sizeof(float) * (size_t)rows * H);
    ASSERT_TRUE(all && one);
    if (vision_encode(vis, vv, n, all, NULL, NULL, &err) < 0)
        FAIL("vision_encode: %s", err.msg);
    for (int i = 0; i < n; i++) {
        int t = vision_view_tokens(vis, v[i].width);
        float md = 0;
        if (vision_encode(vis, &vv[i], 1, one, NULL, NULL, &err) < 0)
            FAIL("vision_encode: %s", err.msg);
        for (size_t k = 0; k < (size_t)t * H; k++)
            md = fmaxf(md, fabsf(one[k] - all[(size_t)off * H + k]));
        printf("view %d (%dx%d) of %d together vs alone: max |diff| %g\n", i, v[i].width, v[i].height, n,
               md);
        ASSERT_TRUE(memcmp(one, all + (size_t)off * H, sizeof(float) * (size_t)t * H) == 0);
        off += t;
    }
    free(all);
    free(one);
}

int main(int argc, char **argv)
{
    static const int nb[2] = {0, 0};
    struct err_buf err = {{0}};
    struct engine_loads l;
    struct rig_out a, b, a2, c, d, x;

    if (argc < 2)
        FAIL("usage: test-image-engine MODEL_DIR");
    model_rig_open_or_exit(&rig, argv[1], 1, 4, 256, 512, nb, MODEL_DRAFT_CHECKPOINT);
    if (vision_new(rig.ck, rig.be, &vis, &err) < 0)
        FAIL("vision_new: %s", err.msg);
    H = vision_cfg(vis)->text_hidden;
    ev = (struct engine_vision){.image_token_id = IM_PATCH, .hidden = H, .view_tokens = view_tokens,
                                .encode = encode, .ctx = vis};

    for (int k = 0; k < 2; k++) {
        for (int y = 0; y < SIDE; y++)
            for (int xx = 0; xx < SIDE; xx++)
                for (int ch = 0; ch < 3; ch++)
                    px[k][((size_t)y * SIDE + xx) * 3 + ch] =
                        (uint8_t)(k ? ((xx / 52 + y / 52) % 2) * 200 + ch * 20 : y * 255 / SIDE + ch * 70);
        views[k] = (struct engine_view){SIDE, SIDE, px[k]};
        images[k] = (struct engine_image){.views = &views[k], .n_views = 1};
        sha256(px[k], sizeof(px[k]), images[k].sha256);
    }
    memcpy(px[2], px[0], sizeof(px[0]));
    memcpy(px[2], POISON, sizeof(POISON));
    views[2] = (struct engine_view){SIDE, SIDE, px[2]};
    images[2] = (struct engine_image){.views = &views[2], .n_views = 1};
    sha256(px[2], sizeof(px[2]), images[2].sha256);
    static const int32_t pre[] = {1, 812, 95, 240}, post[] = {33, 517, 61};
    for (size_t i = 0; i < sizeof(pre) / sizeof(*pre); i++)
        prompt[n_prompt++] = pre[i];
    prompt[n_prompt++] = IM_START;
    for (int i = 0; i < vision_view_tokens(vis, SIDE); i++)
        prompt[n_prompt++] = IM_PATCH;
    prompt[n_prompt++] = IM_END;
    for (size_t i = 0; i < sizeof(post) / sizeof(*post); i++)
        prompt[n_prompt++] = post[i];

    /* 1. image A, image B (same tokens), image A again: one engine, cache on, K = 0 */
    struct engine *e = open_engine(true, 256, 0);
    run_one(e, "a", 0, 0, &a);
    run_one(e, "b", 1, 0, &b);
    run_one(e, "a2", 0, 0, &a2);
    engine_get_loads(e, &l);
    printf("image A: n_cached %d; image B: n_cached %d, same output as A: %s; A again: "
           "n_cached %d of %d, same output: %s; encodes %llu, cache hits %llu\n",
           a.n_cached, b.n_cached, same_toks(&a, &b) ? "yes" : "no", a2.n_cached, n_prompt,
           same_toks(&a, &a2) ? "yes" : "no", (unsigned long long)l.image_encodes,
           (unsigned long long)l.image_cache_hits);
    ASSERT_EQ(a.n_cached, 0);
    ASSERT_EQ(b.n_cached, 0);               /* same tokens, other image: no shared KV */
    ASSERT_TRUE(!same_toks(&a, &b));
    ASSERT_TRUE(a2.n_cached >= n_prompt - 16); /* the next turn: the prompt from the cache */
    ASSERT_TRUE(same_toks(&a, &a2));
    ASSERT_EQ(l.image_encodes, 2);
    ASSERT_EQ(l.image_cache_hits, 1);

    /* the next turn of the conversation: turn 1's prompt and answer, then new text, the
     * same image; its prefix (generated tokens included) comes from the cache, whole
     * blocks of 16 */
    int n1 = n_prompt;
    memcpy(prompt + n_prompt, a.toks, sizeof(int32_t) * NGEN);
    n_prompt += NGEN;
    prompt[n_prompt++] = 44;
    prompt[n_prompt++] = 55;
    prompt[n_prompt++] = 66;
    run_one(e, "t2", 0, 0, &c);
    engine_get_loads(e, &l);
    printf("turn 2 (%d tokens): n_cached %d; encodes %llu, cache hits %llu\n", n_prompt, c.n_cached,
           (unsigned long long)l.image_encodes, (unsigned long long)l.image_cache_hits);
    ASSERT_TRUE(c.n_cached >= (n1 + NGEN - 1) / 16 * 16);
    ASSERT_EQ(l.image_encodes, 2);
    ASSERT_EQ(l.image_cache_hits, 2);
    n_prompt = n1;

    /* image B's pixels under image A's hash: the engine's key covers the pixels, so it
     * takes neither A's rows nor A's KV (B's output, nothing cached, one more encode) */
    memcpy(images[1].sha256, images[0].sha256, 32);
    run_one(e, "liar", 1, 0, &x);
    engine_get_loads(e, &l);
    printf("B's pixels with A's hash: n_cached %d, B's output: %s, encodes %llu\n", x.n_cached,
           same_toks(&x, &b) ? "yes" : "no", (unsigned long long)l.image_encodes);
    ASSERT_EQ(x.n_cached, 0);
    ASSERT_TRUE(same_toks(&x, &b));
    ASSERT_EQ(l.image_encodes, 3);
    sha256(px[1], sizeof(px[1]), images[1].sha256);

    /* 2. refusals, then the engine still serves */
    int32_t keep = prompt[n_prompt - 1];
    prompt[n_prompt - 1] = IM_PATCH;        /* one image token too many */
    ASSERT_ERR(submit(e, "bad1", 0, 0, &x, &err), -EINVAL);
    printf("refused: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "170 image tokens") != NULL);
    prompt[n_prompt - 1] = keep;
    views[1].width = 700;
    ASSERT_ERR(submit(e, "bad2", 1, 0, &x, &err), -EINVAL);
    printf("refused: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "images[0].views[0]") != NULL);
    views[1].width = SIDE;
    run_one(e, "b2", 1, 0, &x);
    ASSERT_TRUE(same_toks(&x, &b));
    rig_engine_close(e, NULL);

    struct engine *t = open_engine(false, 256, 0);
    ASSERT_ERR(submit(t, "text", 0, 0, &x, &err), -EINVAL);
    printf("refused: %s\n", err.msg);
    ASSERT_TRUE(strstr(err.msg, "no vision encoder") != NULL);
    rig_engine_close(t, NULL);

    /* 3. chunked prefill (16-token steps) and K = 3, cache off: outputs equal */
    e = open_engine(true, 16, 0);
    run_one(e, "c", 0, 0, &c);
    rig_engine_close(e, NULL);
    printf("16-token chunks vs one step: same output: %s\n", same_toks(&a, &c) ? "yes" : "no");
    ASSERT_TRUE(same_toks(&a, &c));
    e = open_engine(true, 256, 3);
    run_one(e, "d", 0, 3, &d);
    engine_get_loads(e, &l);
    rig_engine_close(e, NULL);
    printf("K=3 vs K=0: same output: %s (drafts %llu, accepted %llu)\n", same_toks(&a, &d) ? "yes" : "no",
           (unsigned long long)l.mtp.n_draft_tokens, (unsigned long long)l.mtp.n_accepted);
    ASSERT_TRUE(same_toks(&a, &d));
    /* 16-token chunks with K = 3: the chunks' MTP fills inside the image take its rows
     * (169 image tokens from position 5: cuts at 16, 32, .., 160 each fill 3 image tokens) */
    n_fill_rows = 0;
    e = open_engine(true, 16, 3);
    run_one(e, "f", 0, 3, &x);
    rig_engine_close(e, NULL);
    printf("16-token chunks, K=3: same output: %s; MTP fill inputs taking image rows: %d\n",
           same_toks(&a, &x) ? "yes" : "no", n_fill_rows);
    ASSERT_TRUE(same_toks(&a, &x));
    ASSERT_EQ(n_fill_rows, 10 * 3);

    /* 4. the encoder batched over the requests new in a step.  Rows first: views of
     * different sizes together, each bit for bit its rows alone (attention is per view,
     * the GEMMs' rows independent of the batch) */
    static uint8_t crop[504 * 504 * 3];
    for (int y = 0; y < 504; y++)
        memcpy(crop + (size_t)y * 504 * 3, px[1] + (size_t)(y + 100) * SIDE * 3 + 3 * 60, 504 * 3);
    struct engine_view mixed[3] = {views[0], {504, 504, crop}, views[1]};
    check_rows_independent(mixed, 3);

    struct pair_out po[2];
    int calls = run_pair(8, 16, 0, 1, po, &l);
    printf("A and B in one step: %d encoder calls (%d views), outputs as run apart: %s %s; encodes "
           "%llu, hits %llu\n", calls, call_views[(n_calls - 1) % 8], same_toks(&po[0].o, &a) ? "yes" : "no",
           same_toks(&po[1].o, &b) ? "yes" : "no", (unsigned long long)l.image_encodes,
           (unsigned long long)l.image_cache_hits);
    ASSERT_EQ(calls, 1);
    ASSERT_EQ(call_views[(n_calls - 1) % 8], 2);
    ASSERT_TRUE(same_toks(&po[0].o, &a) && same_toks(&po[1].o, &b));
    ASSERT_EQ(l.image_encodes, 2);
    ASSERT_EQ(l.image_cache_hits, 0);

    /* cache off: the step itself shares the one encode */
    calls = run_pair(8, 0, 0, 0, po, &l);
    printf("A in both requests of one step, cache off: %d encoder calls (%d views); encodes %llu, hits %llu\n",
           calls, call_views[(n_calls - 1) % 8], (unsigned long long)l.image_encodes,
           (unsigned long long)l.image_cache_hits);
    ASSERT_EQ(calls, 1);
    ASSERT_EQ(call_views[(n_calls - 1) % 8], 1);
    ASSERT_TRUE(same_toks(&po[0].o, &a) && same_toks(&po[1].o, &a));
    ASSERT_EQ(l.image_encodes, 1);
    ASSERT_EQ(l.image_cache_hits, 1);

    /* one view a call: each image in its own call */
    calls = run_pair(1, 16, 0, 1, po, &l);
    printf("A and B, one view a call: %d encoder calls\n", calls);
    ASSERT_EQ(calls, 2);
    ASSERT_TRUE(same_toks(&po[0].o, &a) && same_toks(&po[1].o, &b));

    /* the call of both fails once: each image again alone, both requests run */
    fail_multi = 1;
    calls = run_pair(8, 16, 0, 1, po, &l);
    printf("the call of A and B fails once: %d encoder calls, outputs: %s %s, encodes %llu\n", calls,
           same_toks(&po[0].o, &a) ? "yes" : "no", same_toks(&po[1].o, &b) ? "yes" : "no",
           (unsigned long long)l.image_encodes);
    ASSERT_EQ(calls, 3);
    ASSERT_TRUE(same_toks(&po[0].o, &a) && same_toks(&po[1].o, &b));
    ASSERT_EQ(l.image_encodes, 2);

    /* an image the encoder always fails on, beside image A: only its request fails */
    calls = run_pair(8, 16, 2, 0, po, &l);
    printf("poisoned image beside A: %d encoder calls; poisoned: finish %d \"%s\"; A: %s\n", calls,
           po[0].o.why, po[0].msg, same_toks(&po[1].o, &a) ? "same output" : "other output");
    ASSERT_EQ(calls, 3);
    ASSERT_TRUE(po[0].o.finished && po[0].o.why == ENGINE_FINISH_ERROR && po[0].o.n == 0);
    ASSERT_TRUE(strstr(po[0].msg, "images[0]: the vision encoder failed: view 0 is poisoned") != NULL);
    ASSERT_TRUE(po[1].o.finished && po[1].o.why == ENGINE_FINISH_LENGTH && same_toks(&po[1].o, &a));
    ASSERT_EQ(l.image_encodes, 1);

    vision_free(vis);
    model_rig_close(&rig);
    printf("test-image-engine: ok\n");
    return 0;
}
