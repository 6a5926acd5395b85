/* test-engine-argmax.c - the engine chooses greedy tokens where the logits are (forward.h,
 * step_argmax / mtp_step_argmax), on the REAL tiny checkpoint (models/tiny-step, CPU
 * backend, one thread: the MTP layers run whole, so their greedy form runs too):
 *   - greedy requests at K = 0 and K = 3 (mixed prompt lengths, a chunked prefill, arriving
 *     at different steps): no byte of logits copied to the host (model_logits_host_bytes),
 *     the tokens those of the logits path (the same model with its greedy forms hidden from
 *     the engine, which copies every row), drafts verified and accepted at K = 3;
 *   - the steps whose rows a processor needs take the logits path, with the logits path's
 *     tokens: a greedy request with logprobs, one with a repetition penalty, a sampled one,
 *     and a mixed batch (greedy and sampled: the whole step's rows are copied, the greedy
 *     request's tokens stay its solo run's).
 * With "topk" after the model directory, sampled steps take each row's top-k candidates
 * (forward.h, step_topk; kernels/cpu/argmax.c, the CUDA kernel's oracle):
 *   - a batch of sampled requests with seeds, mixing temperature, top_k (up to 64), top_p
 *     and min_p, with a greedy one, at K = 0 and K = 3: every request's tokens are those of
 *     the logits path (step_topk hidden from the engine too, which copies every row), and
 *     the steps copied k (value, id) pairs a row (and the row's softmax mass where a top_p
 *     asks for it) instead of the rows; at K = 3 the sampled requests' verify steps (drafts:
 *     rejection sampling reads whole distributions) copy their rows;
 *   - fields the candidates cannot honour keep the logits path: a repetition penalty, a
 *     top_k over the limit, logprobs copy the rows, with the logits path's tokens.
 * Exits 77 (skip) when the checkpoint is absent. */
#include "engine-rig.h"
#include "model-rig.h"

static struct model_rig rig;
static struct model *model;
static struct forward_ops plain_ops;    /* the model's ops without the greedy and sampled forms */
static struct forward plain;

/* A prompt of n tokens made from salt (one of 16 buffers) */
static const int32_t *make_prompt(int n, int salt, int vocab)
{
    static int32_t buf[16][128];
    static int next;
    int32_t *p = buf[next++ % 16];

    BUG_ON(n > 128);
    for (int i = 0; i < n; i++)
        p[i] = (int32_t) ((i * 131 + salt * 977 + 7) % vocab);
    return p;
}

/* The requests q[0 .. n) on forward f at K = k (rig_run); returns the bytes of logits the
 * model copied to the host meanwhile. */
static uint64_t run(struct forward *f, int k, const struct rig_req *q, int n, struct rig_out *out)
{
    struct engine_config ec;
    uint64_t b0 = model_logits_host_bytes(model);

    rig_engine_config(&ec, 64, 8, 512, rig.cfg->sliding_window, k);
    ec.spec_policy = SPEC_POLICY_FIXED;
    struct engine *e = rig_engine_new(f, &ec);
    rig_run(e, q, n, out);
    rig_engine_close(e, NULL);
    return model_logits_host_bytes(model) - b0;
}

/* q on the engine with the greedy forms and on the logits path: the same tokens; the bytes
 * copied by each into *ret_argmax, *ret_logits; the drafts accepted with the greedy forms. */
static uint64_t both(int k, const struct rig_req *q, int n, uint64_t *ret_argmax,
                     uint64_t *ret_logits)
{
    static struct rig_out a[8], b[8];
    uint64_t accepted = 0;

    *ret_argmax = run(rig.f, k, q, n, a);
    *ret_logits = run(&plain, k, q, n, b);
    for (int i = 0; i < n; i++) {
        rig_same(&a[i], &b[i], "greedy forms vs logits path");
        accepted += a[i].mtp.n_accepted;
    }
    return accepted;
}

static void test_greedy(void)
{
    const int V = rig.f->vocab_size;
    const struct rig_req q[] = {
        { .prompt = make_prompt(3, 1, V), .n_prompt = 3, .max_tokens = 24 },
        { .prompt = make_prompt(17, 2, V), .n_prompt = 17, .max_tokens = 32 },
        { .prompt = make_prompt(90, 3, V), .n_prompt = 90, .max_tokens = 20, .at_step = 2 },
    };
    uint64_t ba, bl;

    for (int k = 0; k <= 3; k += 3) {
        uint64_t acc = both(k, q, 3, &ba, &bl);
        printf("greedy, K = %d: %llu bytes of logits to the host (logits path: %llu), "
               "%llu drafts accepted\n", k, (unsigned long long) ba, (unsigned long long) bl,
               (unsigned long long) acc);
        ASSERT_EQ(ba, 0);
        ASSERT_TRUE(bl > 0);
        if (k)
            ASSERT_TRUE(acc > 0);
    }
}

/* Steps whose rows a processor reads: the logits path, the same tokens. */
static void test_needs_rows(void)
{
    const int V = rig.f->vocab_size;
    const int32_t *p1 = make_prompt(12, 1, V), *p2 = make_prompt(9, 2, V);
    const struct rig_req lp = { .prompt = p1, .n_prompt = 12, .max_tokens = 16, .logprobs = 3 };
    const struct rig_req pen = { .prompt = p1, .n_prompt = 12, .max_tokens = 16,
                                 .repetition_penalty = 1.3f };
    const struct rig_req smp = { .prompt = p1, .n_prompt = 12, .max_tokens = 16,
                                 .temperature = 0.8f, .seed = 7 };
    const struct rig_req mixed[] = {
        { .prompt = p1, .n_prompt = 12, .max_tokens = 16 },
        { .prompt = p2, .n_prompt = 9, .max_tokens = 16, .temperature = 0.8f, .seed = 8 },
    };
    static struct rig_out solo[2], mix[2];
    uint64_t ba, bl, bs;

    both(3, &lp, 1, &ba, &bl);
    printf("logprobs: %llu bytes (logits path: %llu)\n", (unsigned long long) ba,
           (unsigned long long) bl);
    ASSERT_TRUE(ba > 0);
    both(3, &pen, 1, &ba, &bl);
    printf("repetition penalty: %llu bytes (logits path: %llu)\n", (unsigned long long) ba,
           (unsigned long long) bl);
    ASSERT_TRUE(ba > 0);
    both(3, &smp, 1, &ba, &bl);
    printf("sampled: %llu bytes (logits path: %llu)\n", (unsigned long long) ba,
           (unsigned long long) bl);
    ASSERT_TRUE(ba > 0);
    /* a mixed batch: the greedy request's rows are copied too (more bytes than the sampled
     * one's alone, whose tokens and drafts are the same); its tokens are its solo run's */
    ba = run(rig.f, 3, mixed, 2, mix);
    ASSERT_EQ(run(rig.f, 3, mixed, 1, solo), 0);
    bs = run(rig.f, 3, mixed + 1, 1, solo + 1);
    printf("mixed batch: %llu bytes (the sampled request alone: %llu)\n",
           (unsigned long long) ba, (unsigned long long) bs);
    ASSERT_TRUE(ba > bs);
    rig_same(&mix[0], &solo[0], "greedy request in a mixed batch vs alone");
    rig_same(&mix[1], &solo[1], "sampled request in a mixed batch vs alone");
}

/* q with the candidates form (step_topk) and on the logits path: the same tokens for every
 * request; the bytes each copied into *ret_cands, *ret_logits. */
static void both_topk(int k, const struct rig_req *q, int n, uint64_t *ret_cands,
                      uint64_t *ret_logits)
{
    static struct rig_out a[8], b[8];

    *ret_cands = run(rig.f, k, q, n, a);
    *ret_logits = run(&plain, k, q, n, b);
    for (int i = 0; i < n; i++) {
        rig_same(&a[i], &b[i], "candidates vs logits path");
        ASSERT_TRUE(a[i].n > 0);
    }
}

static void test_topk_sampled(void)
{
    const int V = rig.f->vocab_size;
    const struct rig_req q[] = {
        { .prompt = make_prompt(5, 1, V), .n_prompt = 5, .max_tokens = 24,
          .temperature = 0.8f, .top_k = 40, .seed = 11 },
        { .prompt = make_prompt(17, 2, V), .n_prompt = 17, .max_tokens = 20,
          .temperature = 1.2f, .top_k = 50, .top_p = 0.9f, .seed = 12 },
        { .prompt = make_prompt(9, 3, V), .n_prompt = 9, .max_tokens = 20, .at_step = 2,
          .temperature = 0.6f, .top_k = 20, .min_p = 0.1f, .seed = 13 },
        { .prompt = make_prompt(3, 4, V), .n_prompt = 3, .max_tokens = 22,
          .temperature = 1.0f, .top_k = 64, .top_p = 0.8f, .min_p = 0.05f, .seed = 14 },
        { .prompt = make_prompt(7, 5, V), .n_prompt = 7, .max_tokens = 16 },     /* greedy */
        { .prompt = make_prompt(4, 6, V), .n_prompt = 4, .max_tokens = 18,
          .temperature = 2.0f, .top_k = 3, .seed = 15 },
    };
    const int n = (int) (sizeof(q) / sizeof(q[0]));
    uint64_t bc, bl;

    for (int k = 0; k <= 3; k += 3) {
        both_topk(k, q, n, &bc, &bl);
        printf("sampled batch, K = %d: %llu bytes to the host with candidates (logits path: "
               "%llu, %.1fx less)\n", k, (unsigned long long) bc, (unsigned long long) bl,
               (double) bl / (double) (bc ? bc : 1));
        ASSERT_TRUE(bc > 0);
        /* K = 3: only the steps where no sampled request verifies drafts (its first) */
        ASSERT_TRUE(k == 0 ? bc * 20 < bl : bc < bl);
    }
    /* one sampled row: the step copies top_k pairs and one sum, not the vocabulary row */
    both_topk(0, q + 1, 1, &bc, &bl);
    printf("one request (top_k 50, top_p 0.9): %llu bytes for %d rows (logits path %llu): "
           "%llu a row, %d a row at this vocabulary\n", (unsigned long long) bc,
           q[1].max_tokens, (unsigned long long) bl,
           (unsigned long long) (bc / (uint64_t) q[1].max_tokens), V * 4);
    ASSERT_EQ(bc, (uint64_t) q[1].max_tokens * (50 * 8 + 8));
    ASSERT_EQ(bl, (uint64_t) q[1].max_tokens * (uint64_t) V * 4);
}

/* Sampled, a field the candidates cannot honour: the rows are copied, the tokens the logits path's. */
static void test_topk_needs_rows(void)
{
    const int V = rig.f->vocab_size;
    const int32_t *p1 = make_prompt(12, 7, V);
    const struct rig_req pen = { .prompt = p1, .n_prompt = 12, .max_tokens = 16,
                                 .temperature = 0.9f, .top_k = 40, .seed = 21,
                                 .repetition_penalty = 1.3f };
    const struct rig_req big = { .prompt = p1, .n_prompt = 12, .max_tokens = 16,
                                 .temperature = 0.9f, .top_k = SAMPLER_CANDS_MAX + 1, .seed = 22 };
    const struct rig_req lp = { .prompt = p1, .n_prompt = 12, .max_tokens = 16,
                                .temperature = 0.9f, .top_k = 40, .seed = 23, .logprobs = 3 };
    uint64_t bc, bl;

    both_topk(0, &pen, 1, &bc, &bl);
    printf("repetition penalty: %llu bytes (logits path: %llu)\n", (unsigned long long) bc,
           (unsigned long long) bl);
    ASSERT_EQ(bc, bl);
    both_topk(0, &big, 1, &bc, &bl);
    printf("top_k %d: %llu bytes (logits path: %llu)\n", SAMPLER_CANDS_MAX + 1,
           (unsigned long long) bc, (unsigned long long) bl);
    ASSERT_EQ(bc, bl);
    both_topk(0, &lp, 1, &bc, &bl);
    printf("logprobs: %llu bytes (logits path: %llu)\n", (unsigned long long) bc,
           (unsigned long long) bl);
    ASSERT_EQ(bc, bl);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "models/tiny-step";

    setvbuf(stdout, NULL, _IOLBF, 0);
    static const int def[2] = { 0, 0 };

    model_rig_open_or_exit(&rig, dir, 1, 8, 64, 512, def, MODEL_DRAFT_CHECKPOINT);
    if (rig.f->n_mtp < 3) {
        printf("SKIP: %s has %d MTP layers\n", dir, rig.f->n_mtp);
        model_rig_close(&rig);
        return TEST_SKIP;
    }
    model = model_from_forward(rig.f);
    ASSERT_TRUE(model && rig.f->ops->step_argmax && rig.f->ops->mtp_step_argmax);
    plain_ops = *rig.f->ops;
    plain_ops.step_argmax = NULL;
    plain_ops.mtp_step_argmax = NULL;
    plain_ops.step_topk = NULL;
    plain = *rig.f;
    plain.ops = &plain_ops;
    if (argc > 2 && strcmp(argv[2], "topk") == 0) {
        ASSERT_TRUE(rig.f->ops->step_topk);
        test_topk_sampled();
        test_topk_needs_rows();
    } else {
        test_greedy();
        test_needs_rows();
    }
    model_rig_close(&rig);
    printf("engine-argmax: ok\n");
    return 0;
}
