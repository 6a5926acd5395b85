/* test-engine-model.c - the engine on the REAL tiny checkpoint (models/tiny-step, CPU):
 *   - greedy output with K = 1, 2, 3 equals K = 0 for single requests;
 *   - the same for a batch of mixed prompt lengths (chunked prefill, sliding window)
 *     arriving at different steps;
 *   - batch invariance: 8 identical greedy requests at once equal a solo run;
 *   - the KV accounting invariant holds after each run;
 *   - the draft vocabulary (engine_config.draft_vocab): installed once the engine has
 *     emitted 8 N tokens, greedy outputs before and after equal K = 0's, drafts still
 *     accepted; a size that is not a multiple of 64 refused.
 * With argv[2] = "mxfp4" the same, with the MTP drafts computed from MXFP4 copies. 
 * Exits 77 (skip) when the checkpoint is absent. */
#include "engine-rig.h"
#include "model-rig.h"

static const char *model_dir;
static struct model_rig rig;

static void engine_cfg(struct engine_config *ec, int k)
{
    rig_engine_config(ec, 64, 8, 512, rig.cfg->sliding_window, k);
    ec->spec_policy = SPEC_POLICY_FIXED;    /* the MTP mechanics at exactly K drafts */
    for (int i = 0; i < rig.cfg->n_eos && i < ENGINE_MAX_EOS; i++)
        ec->eos_ids[ec->n_eos++] = rig.cfg->eos_token_ids[i];
}

static struct engine *open_engine(int k)
{
    struct engine_config ec;
    engine_cfg(&ec, k);
    return rig_engine_new(rig.f, &ec);
}

static void submit(struct engine *e, const char *id, const int32_t *p, int n, int max_tokens,
                   struct rig_out *c)
{
    struct rig_req s = { .prompt = p, .n_prompt = n, .max_tokens = max_tokens };
    rig_submit(e, id, &s, c);
}

static void make_prompt(int32_t *p, int n, int salt, int vocab)
{
    for (int i = 0; i < n; i++)
        p[i] = (int32_t) ((i * 131 + salt * 977 + 7) % vocab);
}

#define NMIX 5
static const int mix_len[NMIX] = { 3, 17, 90, 150, 40 };
static const int mix_out[NMIX] = { 40, 64, 30, 48, 56 };
static const int mix_at[NMIX] = { 0, 0, 3, 5, 9 };

static void run_mixed(int k, struct rig_out *c, uint64_t *ret_accepted)
{
    struct engine *e = open_engine(k);
    static int32_t prompts[NMIX][160];
    struct rig_req s[NMIX];
    for (int i = 0; i < NMIX; i++) {
        make_prompt(prompts[i], mix_len[i], i + 1, rig.f->vocab_size);
        s[i] = (struct rig_req) { prompts[i], mix_len[i], mix_out[i], mix_at[i] };
    }
    rig_run(e, s, NMIX, c);
    *ret_accepted = 0;
    for (int i = 0; i < NMIX; i++)
        *ret_accepted += c[i].mtp.n_accepted;
    rig_engine_close(e, NULL);
}

static void test_single(void)
{
    int32_t prompt[24];
    make_prompt(prompt, 24, 9, rig.f->vocab_size);
    static struct rig_out base, other;
    memset(&base, 0, sizeof(base));
    struct engine *e = open_engine(0);
    submit(e, "solo", prompt, 24, 96, &base);
    ASSERT_OK(engine_run_until_idle(e));
    rig_engine_close(e, NULL);
    for (int k = 1; k <= 3; k++) {
        memset(&other, 0, sizeof(other));
        e = open_engine(k);
        submit(e, "solo", prompt, 24, 96, &other);
        ASSERT_OK(engine_run_until_idle(e));
        rig_engine_close(e, NULL);
        printf("single K=%d: drafts %llu accepted %llu\n", k,
               (unsigned long long) other.mtp.n_draft_tokens, (unsigned long long) other.mtp.n_accepted);
        ASSERT_TRUE(other.mtp.n_draft_tokens > 0);
        ASSERT_TRUE(other.mtp.n_accepted > 0);      /* the drafts are worth something */
        rig_same(&other, &base, "single K vs K=0");
    }
}

static void test_mixed(void)
{
    static struct rig_out base[NMIX], other[NMIX];
    uint64_t acc;
    memset(base, 0, sizeof(base));
    run_mixed(0, base, &acc);
    for (int k = 1; k <= 3; k++) {
        memset(other, 0, sizeof(other));
        run_mixed(k, other, &acc);
        printf("mixed K=%d: accepted %llu\n", k, (unsigned long long) acc);
        for (int i = 0; i < NMIX; i++)
            rig_same(&other[i], &base[i], "mixed K vs K=0");
    }
}

static void test_batch_invariance(void)
{
    int32_t prompt[30];
    make_prompt(prompt, 30, 4, rig.f->vocab_size);
    static struct rig_out solo, many[8];
    memset(&solo, 0, sizeof(solo));
    memset(many, 0, sizeof(many));
    struct engine *e = open_engine(2);
    submit(e, "solo", prompt, 30, 64, &solo);
    ASSERT_OK(engine_run_until_idle(e));
    for (int i = 0; i < 8; i++) {
        char id[8];
        snprintf(id, sizeof(id), "b%d", i);
        submit(e, id, prompt, 30, 64, &many[i]);
    }
    ASSERT_OK(engine_run_until_idle(e));
    rig_engine_close(e, NULL);
    for (int i = 0; i < 8; i++)
        rig_same(&many[i], &solo, "batch of 8 vs solo");
}

/* sampled requests (temperature 0.8, top-p 0.95, seeded) with K = 2: the same tokens
 * solo and in a batch of 4 */
static void test_sampled_reproducible(void)
{
    int32_t prompt[16];
    make_prompt(prompt, 16, 12, rig.f->vocab_size);
    static struct rig_out solo[4], many[4];
    memset(solo, 0, sizeof(solo));
    memset(many, 0, sizeof(many));
    struct engine *e = open_engine(2);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 4; i++) {
            char id[16];
            struct rig_req q = { .prompt = prompt, .n_prompt = 16, .max_tokens = 48,
                                 .temperature = 0.8f, .top_p = 0.95f,
                                 .seed = 1000 + (uint64_t) i };
            snprintf(id, sizeof(id), "s%d-%d", pass, i);
            rig_submit(e, id, &q, pass ? &many[i] : &solo[i]);
            if (!pass)
                ASSERT_OK(engine_run_until_idle(e));
        }
        ASSERT_OK(engine_run_until_idle(e));
    }
    rig_engine_close(e, NULL);
    for (int i = 0; i < 4; i++)
        rig_same(&many[i], &solo[i], "sampled batch vs solo");
    ASSERT_TRUE(memcmp(solo[0].toks, solo[1].toks, 48 * sizeof(int32_t)) != 0);
}

/* The draft vocabulary: DV_REQS greedy requests of DV_OUT tokens each, K = 0 against K = 3
 * with draft_vocab DV_N (installed after 8 DV_N output tokens, about a third of the way) */
#define DV_N 128
#define DV_REQS 32
#define DV_OUT 64
static void test_draft_vocab(void)
{
    static struct rig_out base[DV_REQS], other[DV_REQS];
    static int32_t prompts[DV_REQS][20];
    struct engine_config ec;
    struct engine *e;
    struct engine_loads l;
    struct err_buf err;
    uint64_t drafts[2] = { 0 }, acc[2] = { 0 };

    engine_cfg(&ec, 3);
    ec.draft_vocab = 100;
    ASSERT_ERR(engine_new(rig.f, &ec, &e, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "draft_vocab");
    memset(base, 0, sizeof(base));
    memset(other, 0, sizeof(other));
    for (int pass = 0; pass < 2; pass++) {
        engine_cfg(&ec, pass ? 3 : 0);
        ec.draft_vocab = pass ? DV_N : 0;
        e = rig_engine_new(rig.f, &ec);
        for (int i = 0; i < DV_REQS; i++) {
            char id[16];
            make_prompt(prompts[i], 20, 40 + i, rig.f->vocab_size);
            snprintf(id, sizeof(id), "dv%d", i);
            submit(e, id, prompts[i], 20, DV_OUT, pass ? &other[i] : &base[i]);
            ASSERT_OK(engine_run_until_idle(e));    /* one at a time: the install lands
                                                     * between requests */
            if (pass) {
                engine_get_loads(e, &l);
                drafts[l.draft_vocab > 0] += other[i].mtp.n_draft_tokens;
                acc[l.draft_vocab > 0] += other[i].mtp.n_accepted;
            }
        }
        if (pass) {
            /* sampled requests draft from the distribution over the draft vocabulary (the
             * other ids -inf): they run to their length and their drafts are accepted */
            static struct rig_out smp[4];
            uint64_t s_drafts = 0, s_acc = 0;
            memset(smp, 0, sizeof(smp));
            for (int i = 0; i < 4; i++) {
                char id[16];
                struct rig_req q = { .prompt = prompts[i], .n_prompt = 20, .max_tokens = DV_OUT,
                                     .temperature = 0.8f, .top_p = 0.95f,
                                     .seed = 77 + (uint64_t) i };
                snprintf(id, sizeof(id), "dvs%d", i);
                rig_submit(e, id, &q, &smp[i]);
            }
            ASSERT_OK(engine_run_until_idle(e));
            for (int i = 0; i < 4; i++) {
                ASSERT_TRUE(smp[i].finished);
                ASSERT_TRUE(smp[i].n > 0);
                for (int t = 0; t < smp[i].n; t++)
                    ASSERT_TRUE(smp[i].toks[t] >= 0 && smp[i].toks[t] < rig.f->vocab_size);
                s_drafts += smp[i].mtp.n_draft_tokens;
                s_acc += smp[i].mtp.n_accepted;
            }
            ASSERT_TRUE(s_drafts > 0 && s_acc > 0);
            printf("draft vocabulary, sampled (T 0.8, top-p 0.95): %llu of %llu drafts accepted\n",
                   (unsigned long long) s_acc, (unsigned long long) s_drafts);
        }
        engine_get_loads(e, &l);
        if (pass) {
            ASSERT_EQ(l.draft_vocab, DV_N);
            ASSERT_TRUE(l.draft_vocab_installs >= 1);
            ASSERT_TRUE(l.draft_vocab_cover > 0.0 && l.draft_vocab_cover <= 1.0);
        } else {
            ASSERT_EQ(l.draft_vocab, 0);
        }
        rig_engine_close(e, NULL);
    }
    for (int i = 0; i < DV_REQS; i++)
        rig_same(&other[i], &base[i], "draft vocabulary K=3 vs K=0");
    ASSERT_TRUE(drafts[0] > 0 && drafts[1] > 0);  /* requests before and after the install */
    ASSERT_TRUE(acc[1] > 0);
    printf("draft vocabulary %d of %d ids (%.1f %% of the output tokens counted): acceptance "
           "%.3f of %llu drafts before it, %.3f of %llu after; outputs equal K=0's\n", DV_N,
           rig.f->vocab_size, 100.0 * l.draft_vocab_cover, (double) acc[0] / (double) drafts[0],
           (unsigned long long) drafts[0], (double) acc[1] / (double) drafts[1],
           (unsigned long long) drafts[1]);
}

int main(int argc, char **argv)
{
    model_dir = argc > 1 ? argv[1] : "models/tiny-step";
    /* argv[2] "mxfp4": the MTP drafts run from MXFP4 re-quantised copies of their weights
     * (speculative config draft_quantization); outputs must stay identical to K = 0 */
    enum model_draft_quant dq = argc > 2 && strcmp(argv[2], "mxfp4") == 0
                                    ? MODEL_DRAFT_MXFP4 : MODEL_DRAFT_CHECKPOINT;
    static const int def[2] = { 0, 0 };
    model_rig_open_or_exit(&rig, model_dir, 1, 8, 64, 512, def, dq);
    if (rig.f->n_mtp < 3) {
        printf("SKIP: %s has %d MTP layers\n", model_dir, rig.f->n_mtp);
        model_rig_close(&rig);
        return TEST_SKIP;
    }
    test_single();
    test_mixed();
    test_batch_invariance();
    test_sampled_reproducible();
    test_draft_vocab();
    model_rig_close(&rig);
    printf("engine-model (%s drafts): ok\n", dq == MODEL_DRAFT_MXFP4 ? "MXFP4" : "checkpoint");
    return 0;
}
