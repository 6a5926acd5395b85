/* test-plan-wire.c - step-plan pack/unpack: round trip, and the receiver's checks on
 * untrusted bytes (docs/RELIABILITY.md C11): every truncation, every single-byte corruption
 * and every rule below is an error with a message, never a crash or an accepted plan
 * that breaks the limits. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "harness.h"

static struct step_seq seqs[2];
static int32_t toks[6], full[4], sl[4];
static struct step_plan P;
static const struct step_plan_limits LIM = {
    .max_seqs = 8, .max_tokens = 32, .vocab_size = 100, .max_blocks = { 10, 10 },
    .max_positions = 128, .max_block_ids = 16, .block_size = 16, .max_mtp_depth = 3,
    .img_width = 3,
};
/* the image section (issue 40): 3 rows of width 3; tokens 1, 2 and seq 0's MTP fill at
 * depth 1 take them */
static float emb[9];
static int32_t irow[6], inext[2 * STEP_PLAN_IMG_NEXT];

static void with_images(void)
{
    int32_t r[6] = { -1, 0, 1, -1, -1, -1 };
    int32_t nx[2 * STEP_PLAN_IMG_NEXT] = { -1, 2, -1, -1, -1, -1, -1, -1 };

    for (int i = 0; i < 9; i++)
        emb[i] = (float)i * 0.25f - 1.0f;
    emb[4] = -0.0f;
    memcpy(irow, r, sizeof(r));
    memcpy(inext, nx, sizeof(nx));
    P.img_emb = emb;
    P.img_row = irow;
    P.img_row_next = inext;
    P.n_img_emb = 3;
    P.img_width = 3;
}

static void reset(void)
{
    seqs[0] = (struct step_seq){ .slot = 3, .pos0 = 0, .n_tokens = 4, .n_logits = 1, .tok_off = 0,
                                 .n_blocks = 1, .block_off = { 0, 0 }, .mtp_depth = 3 };
    seqs[1] = (struct step_seq){ .slot = 5, .pos0 = 40, .n_tokens = 2, .n_logits = 2, .tok_off = 4,
                                 .n_blocks = 3, .block_off = { 1, 1 }, .mtp_depth = 1,
                                 .flags = STEP_SEQ_NEW };
    int32_t t[6] = { 1, 2, 3, 4, 98, 0 }, f[4] = { 0, 1, 2, 3 }, s[4] = { 0, -1, 5, 9 };

    memcpy(toks, t, sizeof(t));
    memcpy(full, f, sizeof(f));
    memcpy(sl, s, sizeof(s));
    P = (struct step_plan){ .step_id = 0x1122334455667788ull, .n_seqs = 2, .n_tokens = 6,
                            .seqs = seqs, .tokens = toks, .n_block_ids = { 4, 4 },
                            .blocks = { full, sl } };
}

/* pack the current P and unpack it; returns unpack's result */
static int roundtrip(struct step_plan_buf *b, struct err_buf *e)
{
    unsigned char buf[1024];
    int kind = 0, n = step_plan_pack(&P, buf, sizeof(buf));

    ASSERT_OK(n);
    ASSERT_EQ((size_t)n, step_plan_packed_size(&P));
    return step_plan_unpack(buf, (size_t)n, &LIM, b, &kind, e);
}

#define EXPECT_REJECT(mutation, code, words) do { \
        struct err_buf _e = { "" }; \
        reset(); \
        mutation; \
        ASSERT_ERR(roundtrip(&b, &_e), code); \
        ASSERT_CONTAINS(_e.msg, words); \
    } while (0)

/* Every truncation of buf[n] is rejected; every single-byte corruption is rejected with a
 * message, or accepted only with every offset, id and image index inside the limits. */
static void every_damage(const unsigned char *buf, int n, struct step_plan_buf *b, const char *what)
{
    unsigned char bad[1024];
    struct err_buf e = { "" };
    int kind, accepted = 0, rejected = 0;

    for (int len = 0; len < n; len++)
        if (step_plan_unpack(buf, (size_t)len, &LIM, b, &kind, &e) >= 0)
            FAIL("truncated %s of %d of %d bytes accepted", what, len, n);
    for (int pos = 0; pos < n; pos++)
        for (int v = 0; v < 256; v += 17) {
            const struct step_plan *p = &b->plan;

            memcpy(bad, buf, (size_t)n);
            if (bad[pos] == v)
                continue;
            bad[pos] = (unsigned char)v;
            if (step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e) < 0) {
                ASSERT_TRUE(e.msg[0] != 0);
                rejected++;
                continue;
            }
            accepted++;
            ASSERT_EQ(kind, PLAN_MSG_STEP);
            for (int i = 0; i < p->n_seqs; i++) {
                const struct step_seq *s = &p->seqs[i];

                ASSERT_TRUE(s->slot >= 0 && s->slot < LIM.max_seqs);
                ASSERT_TRUE(s->tok_off >= 0 && s->tok_off + s->n_tokens <= p->n_tokens);
                for (int g = 0; g < 2; g++)
                    ASSERT_TRUE(s->block_off[g] >= 0 &&
                                s->block_off[g] + s->n_blocks <= p->n_block_ids[g]);
            }
            for (int i = 0; i < p->n_tokens; i++)
                ASSERT_TRUE(p->tokens[i] >= 0 && p->tokens[i] < LIM.vocab_size);
            ASSERT_TRUE(!p->img_row || (p->img_width == LIM.img_width && p->n_img_emb >= 1));
            for (int i = 0; p->img_row && i < p->n_tokens; i++)
                ASSERT_TRUE(p->img_row[i] >= -1 && p->img_row[i] < p->n_img_emb);
            for (int i = 0; p->img_row_next && i < p->n_seqs * STEP_PLAN_IMG_NEXT; i++)
                ASSERT_TRUE(p->img_row_next[i] >= -1 && p->img_row_next[i] < p->n_img_emb);
        }
    printf("%s corruptions: %d rejected, %d accepted within limits\n", what, rejected, accepted);
    ASSERT_TRUE(rejected > 0);
}

/* A plan with image rows: version 2, the rows bit for bit, every rule of the section. */
static void test_images(struct step_plan_buf *b)
{
    unsigned char buf[1024], bad[1024];
    struct step_plan_limits noimg = LIM, wide = LIM, few = LIM;
    struct err_buf e = { "" };
    int kind, n;

    reset();
    with_images();
    ASSERT_OK(roundtrip(b, &e));
    ASSERT_EQ(b->plan.n_img_emb, 3);
    ASSERT_EQ(b->plan.img_width, 3);
    ASSERT_TRUE(memcmp(b->plan.img_emb, emb, sizeof(emb)) == 0);      /* -0.0 kept too */
    ASSERT_TRUE(memcmp(b->plan.img_row, irow, sizeof(irow)) == 0);
    ASSERT_TRUE(memcmp(b->plan.img_row_next, inext, sizeof(inext)) == 0);
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_EQ(n, 48 + 4 * (2 * 10 + 6 + 4 + 4) + 4 * (6 + 8 + 9));
    ASSERT_EQ(buf[4], 2);
    ASSERT_TRUE(step_plan_max_packed_size(&LIM) >= (size_t)n);
    /* without img_row_next */
    P.img_row_next = NULL;
    ASSERT_OK(roundtrip(b, &e));
    ASSERT_TRUE(b->plan.img_row_next == NULL && b->plan.n_img_emb == 3);
    /* the next text plan through the same buffer carries no stale rows */
    reset();
    ASSERT_OK(roundtrip(b, &e));
    ASSERT_TRUE(!b->plan.img_emb && !b->plan.img_row && !b->plan.img_row_next && !b->plan.n_img_emb);
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_EQ(buf[4], 1);           /* a text plan is written as before images */
    ASSERT_EQ(n, 36 + 4 * (2 * 10 + 6 + 4 + 4));

    /* sender side */
    reset();
    with_images();
    P.img_emb = NULL;
    ASSERT_ERR(step_plan_pack(&P, buf, sizeof(buf)), -EINVAL);
    with_images();
    P.img_width = 0;
    ASSERT_ERR(step_plan_pack(&P, buf, sizeof(buf)), -EINVAL);
    with_images();
    P.n_img_emb = 0;
    ASSERT_ERR(step_plan_pack(&P, buf, sizeof(buf)), -EINVAL);
    reset();
    P.img_row_next = inext;         /* next rows without the rows */
    ASSERT_ERR(step_plan_pack(&P, buf, sizeof(buf)), -EINVAL);
    with_images();
    ASSERT_ERR(step_plan_pack(&P, buf, 200), -EMSGSIZE);

    /* receiver rules */
#define EXPECT_IMG_REJECT(mutation, lim, code, words) do { \
        struct err_buf _e = { "" }; \
        reset(); \
        with_images(); \
        mutation; \
        n = step_plan_pack(&P, buf, sizeof(buf)); \
        ASSERT_OK(n); \
        ASSERT_ERR(step_plan_unpack(buf, (size_t)n, lim, b, &kind, &_e), code); \
        ASSERT_CONTAINS(_e.msg, words); \
    } while (0)
    noimg.img_width = 0;
    wide.img_width = 4;
    few.max_img_rows = 2;
    EXPECT_IMG_REJECT((void)0, &noimg, -EPROTO, "does not take");
    EXPECT_IMG_REJECT((void)0, &wide, -ERANGE, "width 3, this rank's hidden size is 4");
    EXPECT_IMG_REJECT((void)0, &few, -ERANGE, "3 image rows");
    EXPECT_IMG_REJECT(irow[2] = 3, &LIM, -EBADMSG, "token 2 takes image row 3 of 3");
    EXPECT_IMG_REJECT(irow[0] = -2, &LIM, -EBADMSG, "token 0 takes image row -2");
    EXPECT_IMG_REJECT(inext[5] = 7, &LIM, -EBADMSG, "seq 1: MTP input 1 takes image row 7");
    EXPECT_IMG_REJECT(inext[0] = INT32_MIN, &LIM, -EBADMSG, "seq 0: MTP input 0");
    /* more rows than tokens + seqs x STEP_PLAN_IMG_NEXT could use */
    {
        static float many[3 * 15];

        EXPECT_IMG_REJECT((P.img_emb = many, P.n_img_emb = 15), &LIM, -ERANGE, "15 image rows");
    }
    /* header fields of the image section */
    reset();
    with_images();
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_OK(n);
    memcpy(bad, buf, (size_t)n);
    bad[44] |= 2;                                                   /* unknown image flag */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "image flags 0x3");
    memcpy(bad, buf, (size_t)n);
    bad[44] = 0;                                                    /* next rows not declared */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "body bytes");
    memcpy(bad, buf, (size_t)n);
    bad[36] = 0;                                                    /* n_img_emb 0 */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -ERANGE);
    memcpy(bad, buf, (size_t)n);
    bad[36] = 0xff, bad[37] = 0xff, bad[38] = 0xff, bad[39] = 0x7f; /* n_img_emb INT32_MAX */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -ERANGE);
    memcpy(bad, buf, (size_t)n);
    bad[41] = 0x80;                                                 /* width 32771 */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -ERANGE);
    memcpy(bad, buf, (size_t)n);
    bad[6] = PLAN_MSG_STOP;                                         /* a STOP with image rows */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -EBADMSG);
    ASSERT_ERR(step_plan_unpack(buf, 40, &LIM, b, &kind, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "header of a plan with image rows");
    memcpy(bad, buf, (size_t)n);
    bad[n] = 0;                     /* one byte more */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n + 1, &LIM, b, &kind, &e), -EBADMSG);
    every_damage(buf, n, b, "image plan");
}

/* The greedy form (issue 38): plan.argmax goes as the kind STEP_ARGMAX and comes back set;
 * the bytes are the plain plan's but for the kind; a plan without it is written as before. */
static void test_argmax(struct step_plan_buf *b)
{
    unsigned char plain[1024], buf[1024], bad[1024];
    struct err_buf e = { "" };
    int kind, n, np;

    reset();
    np = step_plan_pack(&P, plain, sizeof(plain));
    ASSERT_OK(np);
    ASSERT_EQ(plain[6], PLAN_MSG_STEP);
    P.argmax = true;
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_EQ(n, np);
    ASSERT_EQ(buf[6], PLAN_MSG_STEP_ARGMAX);
    ASSERT_EQ(buf[7], 0);
    ASSERT_TRUE(memcmp(buf, plain, 6) == 0 && memcmp(buf + 8, plain + 8, (size_t)n - 8) == 0);
    kind = 0;
    ASSERT_OK(step_plan_unpack(buf, (size_t)n, &LIM, b, &kind, &e));
    ASSERT_EQ(kind, PLAN_MSG_STEP);
    ASSERT_TRUE(b->plan.argmax);
    ASSERT_TRUE(memcmp(b->plan.seqs, seqs, sizeof(seqs)) == 0);
    ASSERT_TRUE(memcmp(b->plan.tokens, toks, sizeof(toks)) == 0);
    /* the next plain plan through the same buffer is not greedy */
    ASSERT_OK(step_plan_unpack(plain, (size_t)np, &LIM, b, &kind, &e));
    ASSERT_EQ(kind, PLAN_MSG_STEP);
    ASSERT_TRUE(!b->plan.argmax);
    every_damage(buf, n, b, "greedy plan");
    /* with image rows: version 2, kind STEP_ARGMAX */
    with_images();
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_OK(n);
    ASSERT_EQ(buf[4], 2);
    ASSERT_EQ(buf[6], PLAN_MSG_STEP_ARGMAX);
    ASSERT_OK(step_plan_unpack(buf, (size_t)n, &LIM, b, &kind, &e));
    ASSERT_TRUE(b->plan.argmax && b->plan.n_img_emb == 3);
    ASSERT_TRUE(memcmp(b->plan.img_emb, emb, sizeof(emb)) == 0);
    /* the sampled form: plan.topk goes as the kind STEP_TOPK, the same bytes otherwise */
    reset();
    P.topk = true;
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_EQ(n, np);
    ASSERT_EQ(buf[6], PLAN_MSG_STEP_TOPK);
    ASSERT_TRUE(memcmp(buf, plain, 6) == 0 && memcmp(buf + 8, plain + 8, (size_t)n - 8) == 0);
    ASSERT_OK(step_plan_unpack(buf, (size_t)n, &LIM, b, &kind, &e));
    ASSERT_EQ(kind, PLAN_MSG_STEP);
    ASSERT_TRUE(b->plan.topk && !b->plan.argmax);
    ASSERT_OK(step_plan_unpack(plain, (size_t)np, &LIM, b, &kind, &e));
    ASSERT_TRUE(!b->plan.topk);
    every_damage(buf, n, b, "sampled plan");
    /* a kind past STEP_TOPK is unknown */
    memcpy(bad, buf, (size_t)n);
    bad[6] = PLAN_MSG_STEP_TOPK + 1;
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, b, &kind, &e), -EPROTO);
    ASSERT_CONTAINS(e.msg, "unknown message kind 5");
}

int main(void)
{
    unsigned char buf[1024], bad[1024];
    struct step_plan_buf b;
    struct err_buf e = { "" };
    int kind, n;

    step_plan_buf_init(&b);
    reset();
    ASSERT_OK(roundtrip(&b, &e));
    ASSERT_EQ(b.plan.step_id, 0x1122334455667788ull);
    ASSERT_EQ(b.plan.n_seqs, 2);
    ASSERT_TRUE(memcmp(b.plan.seqs, seqs, sizeof(seqs)) == 0);
    ASSERT_TRUE(memcmp(b.plan.tokens, toks, sizeof(toks)) == 0);
    ASSERT_TRUE(memcmp(b.plan.blocks[0], full, sizeof(full)) == 0);
    ASSERT_TRUE(memcmp(b.plan.blocks[1], sl, sizeof(sl)) == 0);

    /* empty plan and STOP */
    {
        struct step_plan empty = { .step_id = 5 };

        n = step_plan_pack(&empty, buf, sizeof(buf));
        ASSERT_OK(n);
        ASSERT_OK(step_plan_unpack(buf, (size_t)n, &LIM, &b, &kind, &e));
        ASSERT_EQ(kind, PLAN_MSG_STEP);
        ASSERT_EQ(b.plan.n_seqs, 0);
        n = step_plan_pack_stop(buf, sizeof(buf));
        ASSERT_OK(n);
        ASSERT_OK(step_plan_unpack(buf, (size_t)n, &LIM, &b, &kind, &e));
        ASSERT_EQ(kind, PLAN_MSG_STOP);
    }
    /* sender side */
    reset();
    ASSERT_ERR(step_plan_pack(&P, buf, 40), -EMSGSIZE);
    P.n_seqs = -1;
    ASSERT_ERR(step_plan_pack(&P, buf, sizeof(buf)), -EINVAL);

    /* receiver rules */
    EXPECT_REJECT(seqs[1].slot = 8, -ERANGE, "slot 8");
    EXPECT_REJECT(seqs[1].slot = -2, -ERANGE, "slot -2");
    EXPECT_REJECT(seqs[1].slot = 3, -EBADMSG, "appears twice");
    EXPECT_REJECT(seqs[0].n_tokens = 0, -EBADMSG, "n_tokens 0");
    EXPECT_REJECT(seqs[0].pos0 = -1, -EBADMSG, "pos0 -1");
    EXPECT_REJECT(seqs[1].pos0 = 127, -ERANGE, "exceed 128");
    EXPECT_REJECT(seqs[1].n_logits = 3, -EBADMSG, "n_logits 3");
    EXPECT_REJECT(seqs[1].tok_off = 5, -EBADMSG, "outside 6");
    EXPECT_REJECT(seqs[1].tok_off = INT32_MAX, -EBADMSG, "outside 6");
    EXPECT_REJECT((seqs[0].n_tokens = 2, seqs[0].n_logits = 1), -EBADMSG, "runs hold 4 tokens");
    EXPECT_REJECT(seqs[1].n_blocks = 2, -EBADMSG, "do not cover");
    EXPECT_REJECT(seqs[1].block_off[1] = 2, -EBADMSG, "group 1 table");
    EXPECT_REJECT(seqs[1].block_off[0] = -1, -EBADMSG, "group 0 table");
    EXPECT_REJECT(seqs[0].mtp_depth = 4, -ERANGE, "mtp_depth 4");
    EXPECT_REJECT(seqs[0].flags = 2, -EBADMSG, "unknown flags 0x2");
    EXPECT_REJECT(seqs[1].flags = INT32_MIN | STEP_SEQ_NEW, -EBADMSG, "unknown flags");
    EXPECT_REJECT(toks[2] = 100, -ERANGE, "outside vocabulary");
    EXPECT_REJECT(toks[2] = -1, -ERANGE, "outside vocabulary");
    EXPECT_REJECT(full[1] = -1, -ERANGE, "group 0 block");
    EXPECT_REJECT(sl[3] = 10, -ERANGE, "group 1 block");
    EXPECT_REJECT(sl[3] = -2, -ERANGE, "group 1 block");

    /* header fields */
    reset();
    n = step_plan_pack(&P, buf, sizeof(buf));
    ASSERT_OK(n);
    memcpy(bad, buf, (size_t)n);
    bad[0] ^= 1;
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "magic");
    memcpy(bad, buf, (size_t)n);
    bad[4] = 3;
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -EPROTO);
    ASSERT_CONTAINS(e.msg, "version 3");
    memcpy(bad, buf, (size_t)n);
    bad[4] = 2;                     /* a text plan's bytes read as one with image rows */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -EBADMSG);
    memcpy(bad, buf, (size_t)n);
    bad[6] = 9;
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -EPROTO);
    memcpy(bad, buf, (size_t)n);
    bad[20] = 0xff, bad[21] = 0xff, bad[22] = 0xff, bad[23] = 0x7f;   /* n_seqs = INT32_MAX */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -ERANGE);
    memcpy(bad, buf, (size_t)n);
    bad[24] = 7;                                                     /* n_tokens 6 -> 7 */
    ASSERT_ERR(step_plan_unpack(bad, (size_t)n, &LIM, &b, &kind, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "body bytes");

    every_damage(buf, n, &b, "text plan");

    /* random garbage of every length */
    srand(1);
    for (int it = 0; it < 20000; it++) {
        size_t len = (size_t)(rand() % 200);

        for (size_t i = 0; i < len; i++)
            bad[i] = (unsigned char)rand();
        if (len >= 8 && (it & 1)) {     /* give half of them a valid magic/version/kind */
            memcpy(bad, buf, 8);
        }
        (void)step_plan_unpack(bad, len, &LIM, &b, &kind, &e);
    }
    /* the bound on the wire buffer */
    ASSERT_TRUE(step_plan_max_packed_size(&LIM) >= step_plan_packed_size(&P));

    test_images(&b);
    test_argmax(&b);
    step_plan_buf_done(&b);
    return 0;
}
