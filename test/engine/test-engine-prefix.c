/* test-engine-prefix.c - the prefix cache on the REAL tiny checkpoint (models/tiny-step,
 * CPU): greedy outputs with the cache on equal those with it off, token for token, for
 *   - 64 requests sharing a 2k-token prefix (16 at a time; every request after the first
 *     reuses the whole shared prefix);
 *   - a 10-turn conversation replayed turn by turn (each turn reuses the previous turns,
 *     generated tokens included);
 *   - prefixes longer than the sliding window, requests arriving while others still
 *     compute the same prefix;
 *   - reuse after partial eviction (a pool too small to keep everything: the chain's tail
 *     goes first, the head is reused);
 *   - MTP K = 3, a client's seed under the fixed policy (the MTP layers' KV inherited
 *     from the cache equals a fresh prefill's: the drafts, the acceptance counts and the
 *     seed's tokens are the same as with the cache off, and no repair is missed);
 * and after every run the KV accounting invariant: nothing held, free + cached == total.
 * Exits 77 (skip) when the checkpoint is absent. */
#include "engine-rig.h"
#include "model-rig.h"

#define MAXREQ 64

static struct model_rig big, small;

static struct engine *open_engine(struct model_rig *rig, bool cache, int k, int max_len)
{
    struct engine_config ec;
    rig_engine_config(&ec, 256, 16, max_len, rig->cfg->sliding_window, k);
    ec.spec_policy = SPEC_POLICY_FIXED;     /* on and off compare their drafts: exactly K */
    ec.enable_prefix_caching = cache;
    return rig_engine_new(rig->f, &ec);
}

/* Run n requests, each submitted at its step; returns the loads at idle. */
static void run(struct model_rig *rig, bool cache, int k, int max_len, const struct rig_req *s,
                int n, struct rig_out *res, struct engine_loads *ret)
{
    struct engine *e = open_engine(rig, cache, k, max_len);
    rig_run(e, s, n, res);
    rig_engine_close(e, ret);
}

static void same(const struct rig_out *a, const struct rig_out *b, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        char w[128];
        snprintf(w, sizeof(w), "%s: request %d with the cache on", what, i);
        rig_same(&a[i], &b[i], w);
    }
}

static void submit(struct engine *e, int i, const struct rig_req *s, struct rig_out *r)
{
    char id[16];
    snprintf(id, sizeof(id), "r%d", i);
    rig_submit(e, id, s, r);
}

static int vocab;

static void fill(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++)
        p[i] = (int32_t) (((int64_t) i * 389 + (int64_t) salt * 7919 + 11) % vocab);
}

static struct rig_out on[MAXREQ], off[MAXREQ];

/* 64 requests: a 2048-token system prompt + 8 tokens of their own, 16 at a time */
static void test_shared_2k(void)
{
    enum { N = 64, P = 2048, U = 8 };
    static int32_t prompts[N][P + U];
    struct rig_req s[N];
    struct engine_loads lon, loff;
    for (int i = 0; i < N; i++) {
        fill(prompts[i], P, 1);
        fill(prompts[i] + P, U, 100 + i);
        s[i] = (struct rig_req) { prompts[i], P + U, 8, i < 16 ? 0 : 40 + i };
    }
    run(&big, false, 0, 2200, s, N, off, &loff);
    run(&big, true, 0, 2200, s, N, on, &lon);
    same(on, off, N, "shared 2k prefix");
    int reused = 0;
    for (int i = 0; i < N; i++)
        reused += on[i].n_cached == P;
    printf("shared 2k prefix: %d of %d requests reused all %d prefix tokens; prefix cache "
           "queries %llu hits %llu (off: %llu hits), steps %llu vs %llu off, %d blocks cached "
           "at idle\n", reused, N, P, (unsigned long long) lon.prefix_queries,
           (unsigned long long) lon.prefix_hits, (unsigned long long) loff.prefix_hits,
           (unsigned long long) lon.n_steps, (unsigned long long) loff.n_steps,
           lon.kv_blocks_cached);
    ASSERT_EQ(loff.prefix_hits, 0);
    ASSERT_EQ(loff.kv_blocks_cached, 0);
    ASSERT_EQ(on[0].n_cached, 0);
    ASSERT_TRUE(reused >= N - 16);          /* all but (at most) the first wave */
    ASSERT_TRUE(lon.prefix_hits >= (uint64_t) (N - 16) * P);
    ASSERT_TRUE(lon.n_steps < loff.n_steps);
}

/* 10 turns: turn t's prompt is turn t-1's prompt, its answer and 20 new tokens */
static void test_conversation(bool cache, struct rig_out *out, int *ret_cached)
{
    enum { TURNS = 10, NEW = 20, ANS = 24 };
    static int32_t conv[TURNS * (NEW + ANS)];
    struct engine *e = open_engine(&big, cache, 0, 2200);
    int n = 0;
    memset(out, 0, TURNS * sizeof(*out));
    for (int t = 0; t < TURNS; t++) {
        fill(conv + n, NEW, 500 + t);
        n += NEW;
        struct rig_req s = { conv, n, ANS, 0 };
        submit(e, t, &s, &out[t]);
        ASSERT_OK(engine_run_until_idle(e));
        ASSERT_TRUE(out[t].finished);
        ASSERT_EQ(out[t].n, ANS);
        memcpy(conv + n, out[t].toks, ANS * sizeof(int32_t));
        n += ANS;
        ret_cached[t] = out[t].n_cached;
        ASSERT_OK(engine_check(e));
    }
    rig_engine_close(e, NULL);
}

static void test_turns(void)
{
    int c_on[10], c_off[10];
    test_conversation(false, off, c_off);
    test_conversation(true, on, c_on);
    same(on, off, 10, "10-turn conversation");
    printf("conversation: cached tokens per turn:");
    for (int t = 0; t < 10; t++) {
        printf(" %d", c_on[t]);
        ASSERT_EQ(c_off[t], 0);
        /* everything before the turn's new tokens but the last partial block (and its
         * last token, always recomputed) comes from the cache */
        int prev = t * 44;
        if (t > 0)
            ASSERT_TRUE(c_on[t] >= (prev - 1) / 16 * 16);
    }
    printf("\n");
}

/* prefixes of 200 and 330 tokens (window 64), requests arriving while the first still
 * computes them, some whose prompt ends inside a shared block */
static void test_past_window(void)
{
    enum { N = 12 };
    static int32_t prompts[N][400];
    static const int lens[N] = { 210, 215, 200, 201, 340, 333, 331, 208, 350, 217, 199, 330 };
    struct rig_req s[N];
    struct engine_loads lon;
    ASSERT_TRUE(big.cfg->sliding_window > 0 && big.cfg->sliding_window < 199);
    for (int i = 0; i < N; i++) {
        fill(prompts[i], 200, 2);
        if (lens[i] > 330)
            fill(prompts[i] + 200, 130, 3);
        fill(prompts[i] + 200 + (lens[i] > 330 ? 130 : 0), 400 - 330, 30 + i);
        s[i] = (struct rig_req) { prompts[i], lens[i], 40, i < 4 ? 0 : 2 * i };
    }
    run(&big, false, 0, 2200, s, N, off, NULL);
    run(&big, true, 0, 2200, s, N, on, &lon);
    same(on, off, N, "prefixes past the sliding window");
    int hits = 0;
    for (int i = 0; i < N; i++)
        hits += on[i].n_cached >= 192;
    printf("past the window: %d of %d requests reused >= 192 tokens, %llu hit tokens\n", hits, N,
           (unsigned long long) lon.prefix_hits);
    ASSERT_TRUE(hits >= N / 2);
}

/* a pool of 80 full / 60 sliding blocks, one request at a time: a's 480-token prefix
 * loses its chain's tail to b and c (c needs 2 more full blocks than are free, its
 * sliding blocks evict a's oldest ones), a2 then reuses the head, whose window blocks are
 * the most recently released of a's; a finally reuses what a2 computed again */
static void test_partial_eviction(void)
{
    enum { N = 5 };
    static int32_t a[500], b[400], c[400], a2[500];
    struct rig_req s[N];
    struct engine_loads lon;
    fill(a, 480, 4);
    fill(a + 480, 10, 40);
    fill(b, 400, 5);
    fill(c, 400, 6);
    memcpy(a2, a, 480 * sizeof(int32_t));
    fill(a2 + 480, 12, 41);
    s[0] = (struct rig_req) { a, 490, 16, 0 };
    s[1] = (struct rig_req) { b, 400, 16, 0 };
    s[2] = (struct rig_req) { c, 400, 16, 0 };
    s[3] = (struct rig_req) { a2, 492, 16, 0 };
    s[4] = (struct rig_req) { a, 490, 16, 0 };
    for (int pass = 0; pass < 2; pass++) {
        bool cache = pass == 1;
        struct rig_out *res = cache ? on : off;
        struct engine *e = open_engine(&small, cache, 0, 600);
        memset(res, 0, N * sizeof(*res));
        for (int i = 0; i < N; i++) {
            submit(e, i, &s[i], &res[i]);
            ASSERT_OK(engine_run_until_idle(e));
            ASSERT_OK(engine_check(e));
        }
        rig_engine_close(e, &lon);
    }
    same(on, off, N, "reuse after partial eviction");
    printf("partial eviction: cached tokens %d %d %d %d %d, %llu blocks evicted\n", on[0].n_cached,
           on[1].n_cached, on[2].n_cached, on[3].n_cached, on[4].n_cached,
           (unsigned long long) lon.prefix_evictions);
    ASSERT_TRUE(lon.prefix_evictions > 0);
    ASSERT_TRUE(on[3].n_cached > 0 && on[3].n_cached < 480);    /* the head survived */
    ASSERT_TRUE(on[4].n_cached >= 480);     /* a2 recomputed and cached the prefix again */
}

/* K = 3, requests sampled with a client's seed under the fixed policy (the one kind whose
 * tokens depend on its drafts and must equal a run with the cache off, so it reuses only
 * blocks whose MTP KV is final; docs/ARCHITECTURE.md): 16 requests over a 304-token prefix
 * (19 blocks; they differ right after it, so the MTP KV of its last positions, which read
 * the tokens after them, must not be reused); the first one drafts nothing (per-request
 * K = 0), so its blocks hold no MTP KV and the next one replaces them; the rest arrive
 * while others still run */
static void test_mtp(void)
{
    enum { N = 16, P = 304 };
    static int32_t prompts[N][P + 20];
    struct rig_req s[N];
    struct engine_loads lon;
    struct model *m = model_from_forward(big.f);
    uint64_t rr0, miss0, rr1, miss1;
    for (int i = 0; i < N; i++) {
        fill(prompts[i], P, 7);
        fill(prompts[i] + P, 20, 70 + i);
        s[i] = (struct rig_req) { prompts[i], P + (i % 5) * 4 + 1, 48, i < 2 ? 30 * i : 40 + 3 * i,
                               i == 0 ? 1 : 0, 0.8f, 0.0f, 500 + (uint64_t) i };
    }
    model_mtp_repair_stats(m, &rr0, &miss0);
    run(&big, false, 3, 2200, s, N, off, NULL);
    run(&big, true, 3, 2200, s, N, on, &lon);
    model_mtp_repair_stats(m, &rr1, &miss1);
    same(on, off, N, "MTP K=3");
    uint64_t d_on = 0, a_on = 0, d_off = 0, a_off = 0;
    int hits = 0;
    for (int i = 0; i < N; i++) {
        d_on += on[i].mtp.n_draft_tokens;
        a_on += on[i].mtp.n_accepted;
        d_off += off[i].mtp.n_draft_tokens;
        a_off += off[i].mtp.n_accepted;
        hits += on[i].n_cached > 0;
        /* the inherited MTP KV equals a fresh prefill's: the same drafts, request by request */
        ASSERT_EQ(on[i].mtp.n_draft_tokens, off[i].mtp.n_draft_tokens);
        ASSERT_EQ(on[i].mtp.n_accepted, off[i].mtp.n_accepted);
    }
    printf("MTP K=3: %d of %d requests reused a prefix (%llu tokens; request 1 after the K=0 "
           "one: %d); drafts %llu accepted %llu (cache off: %llu, %llu); MTP repairs missed "
           "%llu, re-run %llu\n", hits, N, (unsigned long long) lon.prefix_hits, on[1].n_cached,
           (unsigned long long) d_on, (unsigned long long) a_on, (unsigned long long) d_off,
           (unsigned long long) a_off, (unsigned long long) (miss1 - miss0),
           (unsigned long long) (rr1 - rr0));
    ASSERT_EQ(on[1].n_cached, 0);           /* the K=0 request's blocks hold no MTP KV */
    ASSERT_TRUE(hits >= N - 4);
    for (int i = 2; i < N; i++)
        ASSERT_TRUE(on[i].n_cached <= P - 16);      /* K tokens short of the chain: a block */
    ASSERT_TRUE(a_on > 0 && d_on > a_on);
    ASSERT_EQ(miss1 - miss0, 0);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "models/tiny-step";
    static const int def[2] = { 0, 0 }, tight[2] = { 80, 60 };
    model_rig_open_or_exit(&big, dir, 2, 16, 256, 2200, def, MODEL_DRAFT_CHECKPOINT);
    model_rig_open_or_exit(&small, dir, 2, 16, 256, 600, tight, MODEL_DRAFT_CHECKPOINT);
    ASSERT_EQ(big.f->n_mtp, 3);
    vocab = big.f->vocab_size;
    test_shared_2k();
    test_turns();
    test_past_window();
    test_partial_eviction();
    test_mtp();
    model_rig_close(&small);
    model_rig_close(&big);
    printf("engine prefix cache: ok\n");
    return 0;
}
