/* test-engine.c - the engine on the mock forward.
 *
 * Properties checked (each test ends with the KV accounting invariant: every block free,
 * nothing alive):
 *   - greedy output equals an independent reference computed from the mock's logits;
 *   - greedy output with K = 1, 2, 3 equals K = 0, for single requests and for a batch of
 *     mixed lengths (chunked prefill, sliding-window release) arriving at different steps;
 *   - batch invariance: 8 identical greedy requests at once equal a solo run;
 *   - aborts mid-prefill, mid-decode and with drafts pending free everything in one step;
 *   - deadline expiry in the queue; priorities (ordering and priority preemption);
 *   - preemption by recompute under KV pressure gives the unpressured output;
 *   - stop conditions: EOS, stop ids, ignore_eos, min_tokens, max_tokens, max_model_len;
 *   - sampled requests: seeded reproducibility across batch compositions, and with
 *     speculation the emitted tokens follow the target distribution (chi-square);
 *   - request validation names the field; bounded queue; the engine thread; on_plan;
 *   - prefix cache: with every block digest forced to the same value, prefixes that
 *     differ in one block never share it (the whole key is compared) and output stays
 *     the reference (the mock's rows hash the whole history there); cache_salt isolates
 *     tenants with the same prompt; a request preempted by recompute resumes from its
 *     own cached blocks; under the default (adaptive) draft policy a conversation reuses
 *     its previous turns though the policy drafted nothing on most of their steps;
 *   - a sliding pool sized by kvplan_compute (the window, not the length) serves 16
 *     concurrent sequences past the window with drafts, without a preemption.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chisq.h"
#include "engine.h"
#include "harness.h"
#include "kvplan.h"
#include "mock.h"

#define MAXTOK 1024

struct coll {
    int32_t toks[MAXTOK];
    int n;
    int n_calls;
    bool finished;
    enum engine_finish why;
    int32_t stop_token;
    int n_preempted;
    int n_cached;
    struct spec_stats mtp;
    struct engine_timings tm;
    char msg[160];
    pthread_mutex_t *lock;
    pthread_cond_t *cond;
    int *n_done;
};

static void on_out(void *ud, const struct engine_output *o)
{
    struct coll *c = ud;
    if (c->lock)
        pthread_mutex_lock(c->lock);
    ASSERT_TRUE(!c->finished);
    ASSERT_TRUE(c->n + o->n_tokens <= MAXTOK);
    memcpy(c->toks + c->n, o->tokens, (size_t) o->n_tokens * sizeof(int32_t));
    c->n += o->n_tokens;
    ASSERT_EQ(o->n_completion, c->n);
    c->n_calls++;
    c->mtp = o->mtp;
    c->n_cached = o->n_cached;
    if (o->finished) {
        c->finished = true;
        c->why = o->finish;
        c->stop_token = o->stop_token;
        c->n_preempted = o->n_preempted;
        c->tm = o->timings;
        snprintf(c->msg, sizeof(c->msg), "%s", o->message ? o->message : "");
        if (c->n_done)
            (*c->n_done)++;
        if (c->cond)
            pthread_cond_broadcast(c->cond);
    }
    if (c->lock)
        pthread_mutex_unlock(c->lock);
}

struct rig {
    struct forward *f;
    struct engine *e;
};

static void rig_open(struct rig *g, const struct mock_config *mc, const struct engine_config *ec)
{
    struct err_buf err = { { 0 } };
    ASSERT_OK(mock_forward_new(mc, &g->f));
    int r = engine_new(g->f, ec, &g->e, &err);
    if (r < 0)
        FAIL("engine_new: %s", err.msg);
}

static void rig_close(struct rig *g)
{
    ASSERT_OK(engine_check(g->e));
    struct engine_loads l;
    engine_get_loads(g->e, &l);
    ASSERT_EQ(l.n_alive, 0);
    ASSERT_EQ(l.kv_blocks_used, 0);
    engine_free(g->e);
    g->f->ops->free(g->f);
}

static void mock_defaults(struct mock_config *mc)
{
    mock_config_init(mc);
    mc->max_seqs = 32;
    mc->max_tokens_per_step = 256;
    mc->n_blocks[KV_GROUP_FULL] = 512;
    mc->n_blocks[KV_GROUP_SLIDING] = 512;
    mc->mtp_accuracy = 0.7f;
}

static void engine_defaults(struct engine_config *ec, int k)
{
    engine_config_init(ec);
    ec->max_num_batched_tokens = 48;
    ec->max_num_seqs = 16;
    ec->max_model_len = 1024;
    ec->sliding_window = 32;
    ec->num_speculative_tokens = k;
    ec->spec_policy = SPEC_POLICY_FIXED;    /* these tests pin the MTP mechanics at K */
}

static void make_prompt(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++)
        p[i] = (int32_t) ((i * 37 + salt * 101 + 11) % 250);
}

/* q initialised (engine_request_init) for id: prompt[0, n), up to max_tokens */
static void req_init(struct engine_request *q, const char *id, const int32_t *prompt, int n,
                     int max_tokens)
{
    engine_request_init(q);
    q->id = id;
    q->prompt = prompt;
    q->n_prompt = n;
    q->max_tokens = max_tokens;
}

static void submit_salted(struct rig *g, const char *id, const int32_t *prompt, int n,
                          int max_tokens, int k, const char *salt, struct coll *c)
{
    struct engine_request q;
    struct err_buf err = { { 0 } };
    req_init(&q, id, prompt, n, max_tokens);
    q.num_speculative_tokens = k;
    q.cache_salt = salt;
    int r = engine_submit(g->e, &q, on_out, c, &err);
    if (r < 0)
        FAIL("submit %s: %s", id, err.msg);
}

static void submit(struct rig *g, const char *id, const int32_t *prompt, int n, int max_tokens,
                   int k, struct coll *c)
{
    submit_salted(g, id, prompt, n, max_tokens, k, NULL, c);
}

/* Greedy continuation computed directly from the mock's logits function. */
static void reference(struct forward *f, const int32_t *prompt, int n, int max_tokens, int32_t *out)
{
    int32_t seq[2048];
    float row[1024];
    memcpy(seq, prompt, (size_t) n * sizeof(int32_t));
    for (int t = 0; t < max_tokens; t++) {
        mock_forward_row(f, seq, n + t, row);
        int best = 0;
        for (int v = 1; v < f->vocab_size; v++)
            if (row[v] > row[best])
                best = v;
        seq[n + t] = best;
        out[t] = best;
    }
}

static void assert_same(const struct coll *a, const int32_t *b, int n)
{
    ASSERT_EQ(a->n, n);
    for (int i = 0; i < n; i++)
        if (a->toks[i] != b[i])
            FAIL("token %d differs: %d vs %d", i, a->toks[i], b[i]);
}

/* --- greedy correctness and K-equivalence --- */

static void test_greedy_reference(void)
{
    for (int k = 0; k <= 3; k++) {
        struct mock_config mc;
        struct engine_config ec;
        mock_defaults(&mc);
        engine_defaults(&ec, k);
        struct rig g;
        rig_open(&g, &mc, &ec);
        int32_t prompt[20], ref[40];
        make_prompt(prompt, 20, 1);
        reference(g.f, prompt, 20, 40, ref);
        struct coll c = { 0 };
        submit(&g, "a", prompt, 20, 40, -1, &c);
        ASSERT_OK(engine_run_until_idle(g.e));
        ASSERT_TRUE(c.finished);
        ASSERT_EQ(c.why, ENGINE_FINISH_LENGTH);
        assert_same(&c, ref, 40);
        if (k > 0) {
            ASSERT_TRUE(c.mtp.n_drafts > 0);
            ASSERT_TRUE(c.mtp.n_accepted > 0);
            ASSERT_TRUE(c.mtp.n_accepted < c.mtp.n_draft_tokens);
            ASSERT_EQ(c.mtp.n_draft_tokens <= (uint64_t) k * c.mtp.n_drafts, 1);
            /* fewer verification steps than tokens */
            ASSERT_TRUE(c.n_calls < 40);
        } else {
            ASSERT_EQ(c.mtp.n_drafts, 0);
        }
        rig_close(&g);
    }
}

#define NMIX 6
static const int mix_len[NMIX] = { 1, 5, 40, 100, 7, 300 };
static const int mix_out[NMIX] = { 30, 20, 60, 25, 50, 40 };

static void run_mixed(int k, struct coll *c, uint64_t *ret_drafts)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, k);
    struct rig g;
    rig_open(&g, &mc, &ec);
    static int32_t prompts[NMIX][300];
    char ids[NMIX][8];
    for (int i = 0; i < NMIX; i++) {
        make_prompt(prompts[i], mix_len[i], i + 3);
        snprintf(ids[i], sizeof(ids[i]), "m%d", i);
    }
    /* arrivals at steps 0, 0, 2, 3, 7, 9 */
    static const int at[NMIX] = { 0, 0, 2, 3, 7, 9 };
    int next = 0;
    for (int step = 0; next < NMIX || step < 2000; step++) {
        while (next < NMIX && at[next] <= step) {
            submit(&g, ids[next], prompts[next], mix_len[next], mix_out[next], -1, &c[next]);
            next++;
        }
        ASSERT_OK(engine_step(g.e));
        ASSERT_OK(engine_check(g.e));
        struct engine_loads l;
        engine_get_loads(g.e, &l);
        if (next == NMIX && l.n_alive == 0)
            break;
    }
    uint64_t drafts = 0;
    for (int i = 0; i < NMIX; i++) {
        ASSERT_TRUE(c[i].finished);
        ASSERT_EQ(c[i].why, ENGINE_FINISH_LENGTH);
        int32_t ref[64];
        reference(g.f, prompts[i], mix_len[i], mix_out[i], ref);
        assert_same(&c[i], ref, mix_out[i]);
        drafts += c[i].mtp.n_draft_tokens;
    }
    *ret_drafts = drafts;
    rig_close(&g);
}

static void test_spec_equivalence_mixed(void)
{
    static struct coll base[NMIX], other[NMIX];
    uint64_t drafts;
    memset(base, 0, sizeof(base));
    run_mixed(0, base, &drafts);
    ASSERT_EQ(drafts, 0);
    for (int k = 1; k <= 3; k++) {
        memset(other, 0, sizeof(other));
        run_mixed(k, other, &drafts);
        ASSERT_TRUE(drafts > 0);
        for (int i = 0; i < NMIX; i++)
            assert_same(&other[i], base[i].toks, base[i].n);
    }
}

static void test_batch_invariance(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 2);
    int32_t prompt[33];
    make_prompt(prompt, 33, 9);
    struct coll solo = { 0 };
    static struct coll many[8];
    memset(many, 0, sizeof(many));
    struct rig g;
    rig_open(&g, &mc, &ec);
    submit(&g, "solo", prompt, 33, 50, -1, &solo);
    ASSERT_OK(engine_run_until_idle(g.e));
    rig_close(&g);
    rig_open(&g, &mc, &ec);
    for (int i = 0; i < 8; i++) {
        char id[8];
        snprintf(id, sizeof(id), "b%d", i);
        submit(&g, id, prompt, 33, 50, -1, &many[i]);
    }
    ASSERT_OK(engine_run_until_idle(g.e));
    struct mock_stats ms;
    mock_forward_stats(g.f, &ms);
    ASSERT_TRUE(ms.max_seqs_in_step >= 8);
    for (int i = 0; i < 8; i++)
        assert_same(&many[i], solo.toks, solo.n);
    rig_close(&g);
}

/* --- aborts, deadlines, priorities --- */

static void test_aborts(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 3);
    ec.max_num_batched_tokens = 16;
    mc.mtp_accuracy = 1.0f;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[200];
    make_prompt(prompt, 200, 4);
    struct coll pre = { 0 }, dec = { 0 }, ver = { 0 }, other = { 0 };
    submit(&g, "prefill", prompt, 200, 10, 0, &pre);
    submit(&g, "other", prompt, 3, 200, 0, &other);
    ASSERT_OK(engine_step(g.e));
    ASSERT_OK(engine_step(g.e));
    const char *ids1[] = { "prefill", "nope" };
    ASSERT_EQ(engine_abort(g.e, ids1, 2), 1);
    ASSERT_TRUE(engine_step(g.e) >= 0);
    ASSERT_TRUE(pre.finished);
    ASSERT_EQ(pre.why, ENGINE_FINISH_ABORT);
    ASSERT_EQ(pre.n, 0);
    ASSERT_OK(engine_check(g.e));
    /* mid-decode (no speculation) */
    submit(&g, "decode", prompt, 5, 100, 0, &dec);
    for (int i = 0; i < 6; i++)
        ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(dec.n > 0 && !dec.finished);
    const char *ids2[] = { "decode" };
    ASSERT_EQ(engine_abort(g.e, ids2, 1), 1);
    ASSERT_TRUE(engine_step(g.e) >= 0);
    ASSERT_EQ(dec.why, ENGINE_FINISH_ABORT);
    /* with drafts pending verification (K = 3, perfect drafts) */
    submit(&g, "verify", prompt, 5, 100, 3, &ver);
    for (int i = 0; i < 4; i++)
        ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(ver.n > 0 && !ver.finished && ver.mtp.n_drafts > 0);
    const char *ids3[] = { "verify", "other" };
    ASSERT_EQ(engine_abort(g.e, ids3, 2), 2);
    ASSERT_TRUE(engine_step(g.e) >= 0);
    ASSERT_EQ(ver.why, ENGINE_FINISH_ABORT);
    ASSERT_EQ(other.why, ENGINE_FINISH_ABORT);
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    ASSERT_EQ(l.n_alive, 0);
    ASSERT_EQ(l.kv_blocks_used, 0);
    rig_close(&g);
}

/* deadlines on simulated time (engine_config.clock): a step takes none of it, the test
 * moves it past a deadline */
static void test_deadline_in_queue(void)
{
    struct mock_config mc;
    struct engine_config ec;
    struct clk_sim sim = { .us = 1000000 };
    mock_defaults(&mc);
    engine_defaults(&ec, 0);
    ec.max_num_seqs = 1;
    ec.clock = clk_sim_src(&sim);
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[8];
    make_prompt(prompt, 8, 5);
    struct coll a = { 0 }, b = { 0 };
    submit(&g, "a", prompt, 8, 30, -1, &a);
    struct engine_request q;
    req_init(&q, "b", prompt, 8, 5);
    q.deadline_usec = sim.us + 100000;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &b, NULL));
    ASSERT_OK(engine_step(g.e));
    clk_sim_advance_us(&sim, 99999);
    ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(!b.finished);
    clk_sim_advance_us(&sim, 1);
    ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(b.finished);
    ASSERT_EQ(b.why, ENGINE_FINISH_DEADLINE);
    ASSERT_EQ(b.n, 0);
    ASSERT_CONTAINS(b.msg, "queue");
    ASSERT_OK(engine_check(g.e));
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(a.why, ENGINE_FINISH_LENGTH);
    ASSERT_EQ(a.n, 30);
    /* a deadline that passes while running ends the request with what it has */
    struct coll c = { 0 };
    q.id = "c";
    q.max_tokens = 500;
    q.deadline_usec = sim.us + 100000;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &c, NULL));
    for (int i = 0; i < 3; i++)
        ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(c.n > 0 && !c.finished);
    clk_sim_advance_us(&sim, 100000);
    ASSERT_TRUE(engine_step(g.e) >= 0);
    ASSERT_EQ(c.why, ENGINE_FINISH_DEADLINE);
    ASSERT_CONTAINS(c.msg, "running");
    ASSERT_TRUE(c.n >= 3 && c.n < 500);
    ASSERT_OK(engine_check(g.e));
    rig_close(&g);
}

static void test_priorities(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 0);
    ec.max_num_seqs = 1;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[8], ref[20];
    make_prompt(prompt, 8, 6);
    reference(g.f, prompt, 8, 20, ref);
    struct coll lo = { 0 }, hi = { 0 };
    struct engine_request q;
    req_init(&q, "lo", prompt, 8, 20);
    q.priority = 5;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &lo, NULL));
    q.id = "hi";
    q.priority = 0;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &hi, NULL));
    /* both queued before the first step: "hi" runs first */
    while (!hi.finished)
        ASSERT_OK(engine_step(g.e));
    ASSERT_EQ(lo.n, 0);
    ASSERT_OK(engine_run_until_idle(g.e));
    assert_same(&lo, ref, 20);
    /* priority preemption: "lo" running, "hi" arrives with no free slot */
    memset(&lo, 0, sizeof(lo));
    memset(&hi, 0, sizeof(hi));
    q.id = "lo";
    q.priority = 5;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &lo, NULL));
    for (int i = 0; i < 5; i++)
        ASSERT_OK(engine_step(g.e));
    ASSERT_TRUE(lo.n > 0);
    q.id = "hi";
    q.priority = 0;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &hi, NULL));
    int lo_before = lo.n;
    while (!hi.finished)
        ASSERT_OK(engine_step(g.e));
    ASSERT_EQ(lo.n, lo_before);      /* lo made no progress while hi ran */
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(lo.n_preempted, 1);
    assert_same(&lo, ref, 20);
    assert_same(&hi, ref, 20);
    rig_close(&g);
}

/* --- preemption under KV pressure --- */

static void run_pressure(int full_blocks, int k, struct coll *c, uint64_t *ret_preempt)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    mc.n_blocks[KV_GROUP_FULL] = full_blocks;
    mc.n_blocks[KV_GROUP_SLIDING] = full_blocks;
    engine_defaults(&ec, k);
    ec.max_model_len = 128;
    ec.max_num_batched_tokens = 64;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[6][30];
    for (int i = 0; i < 6; i++) {
        char id[8];
        snprintf(id, sizeof(id), "p%d", i);
        make_prompt(prompt[i], 30, 20 + i);
        submit(&g, id, prompt[i], 30, 70, -1, &c[i]);
    }
    while (1) {
        int n = engine_step(g.e);
        ASSERT_TRUE(n >= 0);
        ASSERT_OK(engine_check(g.e));
        struct engine_loads l;
        engine_get_loads(g.e, &l);
        if (!l.n_alive)
            break;
    }
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    *ret_preempt = l.n_preemptions;
    for (int i = 0; i < 6; i++) {
        int32_t ref[70];
        reference(g.f, prompt[i], 30, 70, ref);
        assert_same(&c[i], ref, 70);
    }
    rig_close(&g);
}

static void test_preemption(void)
{
    for (int k = 0; k <= 2; k += 2) {
        static struct coll rich[6], tight[6];
        memset(rich, 0, sizeof(rich));
        memset(tight, 0, sizeof(tight));
        uint64_t p_rich, p_tight;
        run_pressure(256, k, rich, &p_rich);
        run_pressure(12, k, tight, &p_tight);   /* 6 x 100 tokens need 42 blocks of 16 */
        ASSERT_EQ(p_rich, 0);
        ASSERT_TRUE(p_tight > 0);
        int preempted = 0;
        for (int i = 0; i < 6; i++) {
            assert_same(&tight[i], rich[i].toks, rich[i].n);
            preempted += tight[i].n_preempted > 0;
        }
        ASSERT_TRUE(preempted > 0);
    }
}

/* --- stop conditions --- */

static void test_stops(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 2);
    int32_t prompt[10], ref[40];
    make_prompt(prompt, 10, 7);
    struct rig g;
    /* EOS from the config: the token at output position 5 */
    {
        struct forward *f;
        ASSERT_OK(mock_forward_new(&mc, &f));
        reference(f, prompt, 10, 40, ref);
        f->ops->free(f);
    }
    int first5 = 5;
    for (int i = 0; i < 5; i++)
        if (ref[i] == ref[5])
            first5 = i;
    ec.eos_ids[0] = ref[5];
    ec.n_eos = 1;
    rig_open(&g, &mc, &ec);
    struct coll c1 = { 0 }, c2 = { 0 }, c3 = { 0 }, c4 = { 0 }, c5 = { 0 };
    submit(&g, "eos", prompt, 10, 40, -1, &c1);
    struct engine_request q;
    req_init(&q, "ignore", prompt, 10, 40);
    q.ignore_eos = true;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &c2, NULL));
    q.id = "stopid";
    q.ignore_eos = true;
    int32_t stop_ids[2] = { 255, ref[8] };
    q.stop_token_ids = stop_ids;
    q.n_stop_token_ids = 2;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &c3, NULL));
    q.id = "mintok";
    q.ignore_eos = false;
    q.n_stop_token_ids = 0;
    q.min_tokens = first5 + 2;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &c4, NULL));
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(c1.why, ENGINE_FINISH_STOP);
    ASSERT_EQ(c1.stop_token, ref[5]);
    assert_same(&c1, ref, first5 + 1);
    ASSERT_EQ(c2.why, ENGINE_FINISH_LENGTH);
    assert_same(&c2, ref, 40);
    ASSERT_EQ(c3.why, ENGINE_FINISH_STOP);
    ASSERT_EQ(c3.stop_token, ref[8]);
    ASSERT_TRUE(c3.n <= 9);
    ASSERT_TRUE(c4.n > first5 + 1);
    for (int i = 0; i < first5 + 2; i++)       /* EOS is masked before min_tokens */
        ASSERT_NE(c4.toks[i], ref[5]);
    if (c4.why == ENGINE_FINISH_STOP)
        ASSERT_EQ(c4.toks[c4.n - 1], ref[5]);
    ASSERT_OK(engine_check(g.e));
    rig_close(&g);
    /* max_model_len: prompt 120 of 128 leaves 8 tokens */
    ec.n_eos = 0;
    ec.max_model_len = 128;
    rig_open(&g, &mc, &ec);
    int32_t longp[120];
    make_prompt(longp, 120, 8);
    submit(&g, "len", longp, 120, 0, -1, &c5);
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(c5.why, ENGINE_FINISH_LENGTH);
    ASSERT_EQ(c5.n, 8);
    ASSERT_TRUE(c5.tm.first_token_s > 0 && c5.tm.e2e_s >= c5.tm.first_token_s);
    rig_close(&g);
}

/* --- validation and queue bound --- */

static void test_validation(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 1);
    ec.max_num_seqs = 1;
    ec.max_waiting = 2;
    ec.max_model_len = 64;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[70];
    make_prompt(prompt, 70, 1);
    struct coll c = { 0 };
    struct engine_request q;
    struct err_buf err;
    req_init(&q, "x", prompt, 4, 0);
    prompt[2] = 256;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "token_ids[2]");
    prompt[2] = -1;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    prompt[2] = 3;
    q.n_prompt = 0;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "empty");
    q.n_prompt = 64;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "max_model_len");
    q.n_prompt = 4;
    q.sampling.top_p = 1.5f;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "sampling_params.top_p");
    q.sampling.top_p = 1.0f;
    q.num_speculative_tokens = 4;
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "num_speculative_tokens");
    q.num_speculative_tokens = -1;
    q.id = "";
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "request_id");
    q.id = "bad\nid";
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
    static struct coll cs[4];
    memset(cs, 0, sizeof(cs));
    q.id = "q0";
    ASSERT_OK(engine_submit(g.e, &q, on_out, &cs[0], &err));
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &cs[1], &err), -EEXIST);
    q.id = "q1";
    ASSERT_OK(engine_submit(g.e, &q, on_out, &cs[1], &err));
    q.id = "q2";
    ASSERT_OK(engine_submit(g.e, &q, on_out, &cs[2], &err));
    /* capacity: max_num_seqs 1 + max_waiting 2 alive at once */
    q.id = "q3";
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &cs[3], &err), -EAGAIN);
    ASSERT_CONTAINS(err.msg, "queue is full");
    struct engine_loads ld;
    engine_get_loads(g.e, &ld);
    ASSERT_EQ(ld.max_num_seqs + ld.max_waiting, 3);
    ASSERT_OK(engine_run_until_idle(g.e));  /* all done: room again */
    ASSERT_OK(engine_submit(g.e, &q, on_out, &cs[3], &err));
    ASSERT_OK(engine_run_until_idle(g.e));
    for (int i = 0; i < 4; i++)
        ASSERT_EQ(cs[i].why, ENGINE_FINISH_LENGTH);
    rig_close(&g);

    /* bad engine configs name the option */
    struct forward *f;
    struct engine *e;
    ASSERT_OK(mock_forward_new(&mc, &f));
    engine_defaults(&ec, 1);
    ec.max_num_batched_tokens = 100000;
    ASSERT_ERR(engine_new(f, &ec, &e, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "--max-num-batched-tokens");
    engine_defaults(&ec, 1);
    ec.max_model_len = 1 << 20;
    ASSERT_ERR(engine_new(f, &ec, &e, &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "--max-model-len");
    engine_defaults(&ec, 5);
    ASSERT_ERR(engine_new(f, &ec, &e, &err), -EINVAL);
    f->ops->free(f);
}

/* --- sampled requests --- */

static void run_sampled(int k, int n_req, int max_tokens, uint64_t seed0, int vocab,
                        struct coll *c, bool staggered)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    mc.vocab_size = vocab;
    mc.logit_scale = 3.0f;
    mc.mtp_accuracy = 0.5f;
    engine_defaults(&ec, k);
    ec.max_waiting = 4096;
    ec.max_num_seqs = 32;
    ec.max_num_batched_tokens = 128;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[3] = { 1, 2, 3 };
    for (int i = 0; i < n_req; i++) {
        struct engine_request q;
        char id[16];
        snprintf(id, sizeof(id), "s%d", i);
        req_init(&q, id, prompt, 3, max_tokens);
        q.sampling.temperature = 1.0f;
        q.sampling.seed = seed0 + (uint64_t) i;
        ASSERT_OK(engine_submit(g.e, &q, on_out, &c[i], NULL));
        if (staggered)
            ASSERT_TRUE(engine_step(g.e) >= 0);
    }
    ASSERT_OK(engine_run_until_idle(g.e));
    rig_close(&g);
}

static void test_sampled_reproducible(void)
{
    static struct coll a[8], b[8];
    memset(a, 0, sizeof(a));
    memset(b, 0, sizeof(b));
    run_sampled(2, 8, 30, 77, 256, a, false);
    run_sampled(2, 8, 30, 77, 256, b, true);
    int differ = 0;
    for (int i = 0; i < 8; i++) {
        assert_same(&b[i], a[i].toks, a[i].n);
        differ += i > 0 && memcmp(a[i].toks, a[0].toks, sizeof(int32_t) * 30) != 0;
    }
    ASSERT_TRUE(differ > 0);
}

/* Exact marginal of output positions 1 and 2 for prompt {1,2,3} at temperature 1. */
static void exact_marginals(int vocab, double *m1, double *m2)
{
    struct mock_config mc;
    mock_defaults(&mc);
    mc.vocab_size = vocab;
    mc.logit_scale = 3.0f;
    struct forward *f;
    struct sampler *s;
    ASSERT_OK(mock_forward_new(&mc, &f));
    ASSERT_OK(sampler_new(vocab, &s));
    struct sampling_params sp;
    sampling_params_init(&sp);
    sp.temperature = 1.0f;
    float row[64], p0[64], p1[64], p2[64];
    int32_t seq[6] = { 1, 2, 3 };
    memset(m1, 0, sizeof(double) * (size_t) vocab);
    memset(m2, 0, sizeof(double) * (size_t) vocab);
    mock_forward_row(f, seq, 3, row);
    sampler_probs(s, &sp, NULL, row, p0);
    for (int a = 0; a < vocab; a++) {
        seq[3] = a;
        mock_forward_row(f, seq, 4, row);
        sampler_probs(s, &sp, NULL, row, p1);
        for (int b = 0; b < vocab; b++) {
            double pab = (double) p0[a] * p1[b];
            m1[b] += pab;
            seq[4] = b;
            mock_forward_row(f, seq, 5, row);
            sampler_probs(s, &sp, NULL, row, p2);
            for (int t = 0; t < vocab; t++)
                m2[t] += pab * p2[t];
        }
    }
    sampler_free(s);
    f->ops->free(f);
}

/* N = 3000 sampled requests (seeds 1000..3999), vocab 16: tokens 2 and 3 of each output
 * (produced by verification when K > 0) must match the exact marginals; chi-square
 * p-value > 0.001 for K = 0 and K = 3. */
static void test_sampled_spec_distribution(void)
{
    enum { N = 3000, VOC = 16 };
    double m1[VOC], m2[VOC];
    exact_marginals(VOC, m1, m2);
    static struct coll c[N];
    for (int k = 0; k <= 3; k += 3) {
        memset(c, 0, sizeof(c));
        run_sampled(k, N, 3, 1000, VOC, c, false);
        long o1[VOC] = { 0 }, o2[VOC] = { 0 };
        uint64_t acc = 0;
        for (int i = 0; i < N; i++) {
            ASSERT_EQ(c[i].n, 3);
            o1[c[i].toks[1]]++;
            o2[c[i].toks[2]]++;
            acc += c[i].mtp.n_accepted;
        }
        double e1[VOC], e2[VOC];
        for (int v = 0; v < VOC; v++) {
            e1[v] = N * m1[v];
            e2[v] = N * m2[v];
        }
        int df1, df2;
        double x1 = chisq_stat(o1, e1, VOC, &df1), x2 = chisq_stat(o2, e2, VOC, &df2);
        double p1 = chisq_pvalue(x1, df1), p2 = chisq_pvalue(x2, df2);
        printf("K=%d: token1 chi2=%.2f df=%d p=%.4f; token2 chi2=%.2f df=%d p=%.4f; accepted %llu\n",
               k, x1, df1, p1, x2, df2, p2, (unsigned long long) acc);
        ASSERT_TRUE(p1 > 0.001);
        ASSERT_TRUE(p2 > 0.001);
        if (k > 0)
            ASSERT_TRUE(acc > N / 4);
    }
}

/* --- thread mode and hooks --- */

/* Holds the engine thread in its step `at` (the on_plan hook) until the test thread has
 * done what it must do while the engine is mid-run: an event, not a sleep. */
struct step_gate {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t at;
    bool reached, released;
};

static int gate_on_plan(void *ctx, const struct step_plan *p)
{
    struct step_gate *sg = ctx;
    if (p->step_id != sg->at)
        return 0;
    pthread_mutex_lock(&sg->lock);
    sg->reached = true;
    pthread_cond_broadcast(&sg->cond);
    while (!sg->released)
        pthread_cond_wait(&sg->cond, &sg->lock);
    pthread_mutex_unlock(&sg->lock);
    return 0;
}

static void test_thread(void)
{
    struct mock_config mc;
    struct engine_config ec;
    static struct step_gate sg = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 20,
                                   false, false };
    mock_defaults(&mc);
    engine_defaults(&ec, 2);
    ec.on_plan = gate_on_plan;
    ec.on_plan_ctx = &sg;
    struct rig g;
    rig_open(&g, &mc, &ec);
    ASSERT_OK(engine_start(g.e));
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    int done = 0;
    static struct coll c[10];
    memset(c, 0, sizeof(c));
    int32_t prompt[12], ref[60];
    make_prompt(prompt, 12, 2);
    reference(g.f, prompt, 12, 60, ref);
    for (int i = 0; i < 10; i++) {
        char id[8];
        snprintf(id, sizeof(id), "t%d", i);
        c[i].lock = &lock;
        c[i].cond = &cond;
        c[i].n_done = &done;
        submit(&g, id, prompt, 12, i == 3 ? 450 : 60, -1, &c[i]);
    }
    /* abort one while the engine is held in its step 20 (t3 needs >= 150 steps) */
    pthread_mutex_lock(&sg.lock);
    while (!sg.reached)
        pthread_cond_wait(&sg.cond, &sg.lock);
    pthread_mutex_unlock(&sg.lock);
    const char *ids[] = { "t3" };
    ASSERT_EQ(engine_abort(g.e, ids, 1), 1);
    pthread_mutex_lock(&sg.lock);
    sg.released = true;
    pthread_cond_broadcast(&sg.cond);
    pthread_mutex_unlock(&sg.lock);
    pthread_mutex_lock(&lock);
    while (done < 10)
        pthread_cond_wait(&cond, &lock);
    pthread_mutex_unlock(&lock);
    engine_stop(g.e);
    for (int i = 0; i < 10; i++) {
        if (i == 3) {
            ASSERT_EQ(c[i].why, ENGINE_FINISH_ABORT);
            continue;
        }
        assert_same(&c[i], ref, 60);
    }
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    ASSERT_TRUE(l.n_steps > 0);
    ASSERT_TRUE(l.mean_accept_len > 1.0);
    rig_close(&g);
}

struct hook {
    int calls;
    int fail_at;
    int max_seqs;
};

static int on_plan(void *ctx, const struct step_plan *p)
{
    struct hook *h = ctx;
    h->calls++;
    if (p->n_seqs > h->max_seqs)
        h->max_seqs = p->n_seqs;
    return h->calls == h->fail_at ? -EPIPE : 0;
}

struct plan_audit {
    int budget;
    int max_tokens;
    int mixed_steps;       /* steps with a prefill chunk and a decode together */
    int chunks;            /* runs that stop short of the known tokens (no logits) */
};

static int audit_plan(void *ctx, const struct step_plan *p)
{
    struct plan_audit *a = ctx;
    int32_t sum = 0;
    bool chunk = false, decode = false;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        sum += s->n_tokens;
        ASSERT_TRUE(s->n_tokens > 0 && s->n_logits <= s->n_tokens);
        ASSERT_EQ(s->n_blocks, (s->pos0 + s->n_tokens + 15) / 16);
        chunk |= s->n_logits == 0;
        a->chunks += s->n_logits == 0;
        decode |= s->n_logits >= 1 && s->pos0 > 0 && s->n_tokens <= 4;
    }
    ASSERT_EQ(sum, p->n_tokens);
    ASSERT_LE(p->n_tokens, a->budget);
    if (p->n_tokens > a->max_tokens)
        a->max_tokens = p->n_tokens;
    a->mixed_steps += chunk && decode;
    return 0;
}

/* Chunked prefill: a long prompt arriving while others decode is cut into chunks that
 * share each step's token budget with the decodes, never exceeding it. */
static void test_chunked_prefill_mixes(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 1);
    struct plan_audit a = { .budget = ec.max_num_batched_tokens };
    ec.on_plan = audit_plan;
    ec.on_plan_ctx = &a;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t small[5], big[400], ref[30];
    make_prompt(small, 5, 30);
    make_prompt(big, 400, 31);
    struct coll c1 = { 0 }, c2 = { 0 }, c3 = { 0 };
    submit(&g, "d1", small, 5, 60, -1, &c1);
    submit(&g, "d2", small, 4, 60, -1, &c2);
    for (int i = 0; i < 3; i++)
        ASSERT_OK(engine_step(g.e));
    submit(&g, "big", big, 400, 30, -1, &c3);
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_TRUE(a.chunks >= 400 / ec.max_num_batched_tokens);
    ASSERT_TRUE(a.mixed_steps > 0);
    ASSERT_EQ(a.max_tokens, ec.max_num_batched_tokens);
    reference(g.f, big, 400, 30, ref);
    assert_same(&c3, ref, 30);
    rig_close(&g);
}

/* Randomised churn under KV pressure: arrivals with random lengths, K, priorities and
 * sampling, random aborts and deadlines.  After every step the pool is consistent; every
 * request gets exactly one final; at the end everything is free. */
static void test_churn(void)
{
    enum { NREQ = 120 };
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    mc.n_blocks[KV_GROUP_FULL] = 40;
    mc.n_blocks[KV_GROUP_SLIDING] = 24;
    engine_defaults(&ec, 2);
    ec.max_model_len = 300;
    ec.max_num_seqs = 8;
    ec.max_waiting = 16;
    ec.sliding_window = 32;
    struct rig g;
    rig_open(&g, &mc, &ec);
    static struct coll c[NREQ];
    static int32_t prompts[NREQ][200];
    static int plen[NREQ];
    static bool greedy[NREQ];
    memset(c, 0, sizeof(c));
    uint64_t z = 12345;
    int submitted = 0, rejected = 0;
    for (int step = 0; step < 20000; step++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        unsigned r = (unsigned) (z >> 33);
        if (submitted < NREQ && r % 3 == 0) {
            int i = submitted++;
            int n = 1 + (int) (r / 7 % 180);
            make_prompt(prompts[i], n, i);
            struct engine_request q;
            char id[16];
            snprintf(id, sizeof(id), "z%d", i);
            req_init(&q, id, prompts[i], n, 1 + (int) (r / 11 % 90));
            q.priority = (int) (r / 13 % 3);
            q.num_speculative_tokens = (int) (r / 17 % 4);
            plen[i] = n;
            greedy[i] = !(r / 19 % 2);
            if (r / 19 % 2) {
                q.sampling.temperature = 0.8f;
                q.sampling.top_p = 0.9f;
                q.sampling.seed = r;
            }
            if (r / 23 % 10 == 0)
                q.deadline_usec = engine_now_usec() + (int64_t) (r / 29 % 3000);
            int rc = engine_submit(g.e, &q, on_out, &c[i], NULL);
            if (rc == -EAGAIN) {
                rejected++;
                c[i].finished = true;
            } else {
                ASSERT_OK(rc);
            }
        }
        if (submitted > 0 && r % 17 == 0) {
            char id[16];
            snprintf(id, sizeof(id), "z%d", (int) (r / 5 % (unsigned) submitted));
            const char *ids[1] = { id };
            (void) engine_abort(g.e, ids, 1);
        }
        ASSERT_TRUE(engine_step(g.e) >= 0);
        ASSERT_OK(engine_check(g.e));
        struct engine_loads l;
        engine_get_loads(g.e, &l);
        if (submitted == NREQ && !l.n_alive)
            break;
    }
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    ASSERT_EQ(l.n_alive, 0);
    int why[_ENGINE_FINISH_MAX] = { 0 };
    int checked = 0;
    for (int i = 0; i < NREQ; i++) {
        ASSERT_TRUE(c[i].finished);
        why[c[i].why]++;
        if (greedy[i] && c[i].n > 0) {
            /* whatever happened (preemption, chunking, drafts), greedy tokens are exact */
            static int32_t ref[128];
            reference(g.f, prompts[i], plen[i], c[i].n, ref);
            assert_same(&c[i], ref, c[i].n);
            checked++;
        }
    }
    ASSERT_TRUE(checked > 10);
    printf("churn: %d requests: stop %d length %d abort %d deadline %d rejected %d; "
           "%llu preemptions\n", NREQ, why[ENGINE_FINISH_STOP], why[ENGINE_FINISH_LENGTH],
           why[ENGINE_FINISH_ABORT], why[ENGINE_FINISH_DEADLINE], rejected,
           (unsigned long long) l.n_preemptions);
    ASSERT_TRUE(l.n_preemptions > 0);
    ASSERT_TRUE(why[ENGINE_FINISH_ABORT] > 0);
    ASSERT_EQ(why[ENGINE_FINISH_ERROR], 0);
    rig_close(&g);
}

struct reuse {
    struct engine *e;
    int32_t prompt[4];
    int finals;
};

static void on_reuse(void *ud, const struct engine_output *o)
{
    struct reuse *u = ud;
    if (!o->finished)
        return;
    if (++u->finals < 3) {
        /* the id is free again as soon as its final is seen */
        struct engine_request q;
        struct err_buf err;
        req_init(&q, o->id, u->prompt, 4, 5);
        if (engine_submit(u->e, &q, on_reuse, u, &err) < 0)
            FAIL("resubmit from the final callback: %s", err.msg);
    }
}

static void test_id_reuse_in_callback(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 1);
    struct rig g;
    rig_open(&g, &mc, &ec);
    struct reuse u = { .e = g.e, .prompt = { 1, 2, 3, 4 } };
    struct engine_request q;
    req_init(&q, "same", u.prompt, 4, 5);
    ASSERT_OK(engine_submit(g.e, &q, on_reuse, &u, NULL));
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(u.finals, 3);
    rig_close(&g);
}

static void test_on_plan_hook(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    engine_defaults(&ec, 1);
    struct hook h = { .fail_at = 5 };
    ec.on_plan = on_plan;
    ec.on_plan_ctx = &h;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t prompt[4] = { 1, 2, 3, 4 };
    struct coll a = { 0 }, b = { 0 }, c = { 0 };
    submit(&g, "a", prompt, 4, 50, -1, &a);
    submit(&g, "b", prompt, 4, 50, -1, &b);
    int r = 0;
    for (int i = 0; i < 10 && r >= 0; i++)
        r = engine_step(g.e);
    ASSERT_ERR(r, -EPIPE);
    ASSERT_EQ(h.calls, 5);
    ASSERT_EQ(h.max_seqs, 2);
    ASSERT_EQ(a.why, ENGINE_FINISH_ERROR);
    ASSERT_CONTAINS(a.msg, "broadcast");
    ASSERT_EQ(b.why, ENGINE_FINISH_ERROR);
    struct err_buf err;
    struct engine_request q;
    req_init(&q, "c", prompt, 4, 0);
    ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -ESHUTDOWN);
    rig_close(&g);
}

/* --- prefix cache --- */

/* run one request to completion; checks it against the reference, returns its reuse */
static int run_one(struct rig *g, const char *id, const int32_t *prompt, int n, const char *salt)
{
    struct coll c = { 0 };
    int32_t ref[24];
    submit_salted(g, id, prompt, n, 24, -1, salt, &c);
    ASSERT_OK(engine_run_until_idle(g->e));
    ASSERT_OK(engine_check(g->e));
    reference(g->f, prompt, n, 24, ref);
    assert_same(&c, ref, 24);
    return c.n_cached;
}

static void test_prefix_collisions(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    mc.full_history = true;         /* a block of another history changes every row after it */
    engine_defaults(&ec, 0);
    ec.test_digest_cut_bits = 256;  /* every block digest is zero: all keys collide */
    struct rig g;
    rig_open(&g, &mc, &ec);
    /* p2 differs from p1 in block 0 only, p3 in block 1 only (blocks of 16) */
    int32_t p1[64], p2[64], p3[64];
    make_prompt(p1, 64, 3);
    memcpy(p2, p1, sizeof(p1));
    memcpy(p3, p1, sizeof(p1));
    p2[3] = (p2[3] + 1) % 250;
    p3[20] = (p3[20] + 1) % 250;
    ASSERT_EQ(run_one(&g, "p1", p1, 64, NULL), 0);
    ASSERT_EQ(run_one(&g, "p2", p2, 64, NULL), 0);     /* blocks 1..3 have p1's tokens */
    ASSERT_EQ(run_one(&g, "p3", p3, 64, NULL), 16);    /* block 0 of p1, nothing after */
    ASSERT_EQ(run_one(&g, "p1b", p1, 64, NULL), 48);   /* its own chain, last token computed */
    ASSERT_EQ(run_one(&g, "p2b", p2, 64, NULL), 48);
    ASSERT_EQ(run_one(&g, "p3b", p3, 64, NULL), 48);
    rig_close(&g);

    /* tenants: the same prompt under another cache_salt shares nothing */
    mock_defaults(&mc);
    mc.full_history = true;
    engine_defaults(&ec, 0);
    rig_open(&g, &mc, &ec);
    ASSERT_EQ(run_one(&g, "a1", p1, 64, "tenant-a"), 0);
    ASSERT_EQ(run_one(&g, "b1", p1, 64, "tenant-b"), 0);
    ASSERT_EQ(run_one(&g, "n1", p1, 64, NULL), 0);
    ASSERT_EQ(run_one(&g, "n2", p1, 64, ""), 48);       /* "" is no salt */
    ASSERT_EQ(run_one(&g, "a2", p1, 64, "tenant-a"), 48);
    ASSERT_EQ(run_one(&g, "b2", p1, 64, "tenant-b"), 48);
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    ASSERT_EQ(l.prefix_queries, 6 * 64);
    ASSERT_EQ(l.prefix_hits, 3 * 48);
    ASSERT_TRUE(l.kv_blocks_cached > 0);
    /* an over-long salt is refused, naming the field */
    {
        static char big[ENGINE_MAX_CACHE_SALT + 2];
        struct engine_request q;
        struct coll c = { 0 };
        struct err_buf err = { { 0 } };
        memset(big, 'x', sizeof(big) - 1);
        req_init(&q, "long", p1, 4, 0);
        q.cache_salt = big;
        ASSERT_ERR(engine_submit(g.e, &q, on_out, &c, &err), -EINVAL);
        ASSERT_CONTAINS(err.msg, "cache_salt");
    }
    rig_close(&g);

    /* with the cache off nothing is reused or kept */
    mock_defaults(&mc);
    engine_defaults(&ec, 0);
    ec.enable_prefix_caching = false;
    rig_open(&g, &mc, &ec);
    ASSERT_EQ(run_one(&g, "o1", p1, 64, NULL), 0);
    ASSERT_EQ(run_one(&g, "o2", p1, 64, NULL), 0);
    engine_get_loads(g.e, &l);
    ASSERT_EQ(l.kv_blocks_cached, 0);
    ASSERT_EQ(l.prefix_queries, 0);
    rig_close(&g);
}

/* a request preempted by a better-priority one resumes from its own committed blocks */
static void test_prefix_preemption(void)
{
    struct mock_config mc;
    struct engine_config ec;
    mock_defaults(&mc);
    mc.full_history = true;
    engine_defaults(&ec, 0);
    ec.max_num_seqs = 1;
    struct rig g;
    rig_open(&g, &mc, &ec);
    int32_t lo_p[100], hi_p[20], ref[60];
    make_prompt(lo_p, 100, 8);
    make_prompt(hi_p, 20, 9);
    struct coll lo = { 0 }, hi = { 0 };
    submit(&g, "lo", lo_p, 100, 60, -1, &lo);
    while (lo.n < 30)
        ASSERT_OK(engine_step(g.e));
    struct engine_request q;
    req_init(&q, "hi", hi_p, 20, 10);
    q.priority = -1;
    ASSERT_OK(engine_submit(g.e, &q, on_out, &hi, NULL));
    ASSERT_OK(engine_run_until_idle(g.e));
    ASSERT_EQ(lo.n_preempted, 1);
    reference(g.f, lo_p, 100, 60, ref);
    assert_same(&lo, ref, 60);
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    /* the resumed run reused its prompt and the output it had committed (>= 112 of 130) */
    ASSERT_TRUE(l.prefix_hits >= 112);
    rig_close(&g);
}

/* The prefix cache under speculative decoding, for each draft policy and request kind: a
 * 5-turn conversation (each turn's prompt is the previous one, its answer and 40 new
 * tokens) on a mock whose MTP layers keep KV in the sliding group and whose drafts cost
 * three trunk steps (simulated time: the adaptive policy soon drafts nothing, so the
 * blocks of those steps hold no MTP KV).  A run with the cache off replays the same
 * conversation.  Where the output does not depend on the drafts (greedy), or need only be
 * exact in distribution (sampled with a seed the worker drew: the rejection test), every
 * turn reuses >= 90 % of the previous turn's prompt under either policy (before, a
 * drafting sequence reused only blocks whose MTP KV was final: 0 tokens from the second
 * turn on under "adaptive" for greedy, 80 % on the second turn for the rest); greedy turns
 * equal the reference.  A client's seed reuses only blocks whose MTP KV is final and gives
 * the tokens of the run with the cache off (both policies keep sampled sequences at their
 * depth). */
enum conv_kind { CONV_GREEDY, CONV_SAMPLED, CONV_SEEDED };

static void prefix_conversation(enum spec_draft_policy policy, enum conv_kind kind, bool expect_hits)
{
    enum { TURNS = 5, NEW = 40, ANS = 24 };
    static int32_t conv[2][TURNS * (NEW + ANS)];
    static struct coll c[2][TURNS];
    int32_t ref[ANS];
    int hits_min = 1 << 30;
    for (int pass = 0; pass < 2; pass++) {
        struct clk_sim sim = { .us = 1000000 };
        struct mock_config mc;
        struct engine_config ec;
        struct rig g;
        bool cache = pass == 0;
        int n = 0;
        uint64_t no_drafts = 0, steps = 0;
        int short_turns = 0;            /* turns reusing under 90 % of the previous prompt */
        mock_defaults(&mc);
        mc.full_history = true;         /* a reused block of another history shows */
        mc.mtp_kv_groups = 1u << KV_GROUP_SLIDING;
        mc.clock = &sim;
        mc.step_usec = 1000;
        mc.token_usec = 10;
        mc.mtp_usec = 3000;
        engine_defaults(&ec, 3);
        ec.spec_policy = policy;
        ec.clock = clk_sim_src(&sim);
        ec.enable_prefix_caching = cache;
        rig_open(&g, &mc, &ec);
        memset(c[pass], 0, sizeof(c[pass]));
        for (int t = 0; t < TURNS; t++) {
            char id[16];
            struct engine_request q;
            struct err_buf err = { { 0 } };
            make_prompt(conv[pass] + n, NEW, 40 + t);
            n += NEW;
            snprintf(id, sizeof(id), "turn%d", t);
            req_init(&q, id, conv[pass], n, ANS);
            q.ignore_eos = true;
            if (kind != CONV_GREEDY) {
                q.sampling.temperature = 0.8f;
                q.sampling.seed = 1000 + (uint64_t) t;
                q.seed_random = kind == CONV_SAMPLED;
            }
            if (engine_submit(g.e, &q, on_out, &c[pass][t], &err) < 0)
                FAIL("submit %s: %s", id, err.msg);
            ASSERT_OK(engine_run_until_idle(g.e));
            ASSERT_OK(engine_check(g.e));
            ASSERT_EQ(c[pass][t].n, ANS);
            if (kind == CONV_GREEDY) {
                reference(g.f, conv[pass], n, ANS, ref);
                assert_same(&c[pass][t], ref, ANS);
            }
            if (!cache) {
                ASSERT_EQ(c[pass][t].n_cached, 0);
            } else if (t > 0) {
                int pct = c[pass][t].n_cached * 100 / (n - NEW - ANS);
                hits_min = pct < hits_min ? pct : hits_min;
                short_turns += c[pass][t].n_cached * 10 < (n - NEW - ANS) * 9;
            }
            memcpy(conv[pass] + n, c[pass][t].toks, ANS * sizeof(int32_t));
            n += ANS;
            for (int k = 0; k <= SPEC_MAX_K; k++)
                steps += c[pass][t].mtp.steps_by_drafts[k];
            no_drafts += c[pass][t].mtp.steps_by_drafts[0];
        }
        printf("prefix cache %s, %s policy, %s: %llu of %llu decode steps without drafts, "
               "cached tokens per turn %d %d %d %d %d\n", cache ? "on" : "off",
               policy == SPEC_POLICY_FIXED ? "fixed" : "adaptive",
               kind == CONV_GREEDY ? "greedy" : kind == CONV_SAMPLED ? "sampled" : "client seed",
               (unsigned long long) no_drafts, (unsigned long long) steps, c[pass][0].n_cached,
               c[pass][1].n_cached, c[pass][2].n_cached, c[pass][3].n_cached,
               c[pass][4].n_cached);
        fflush(stdout);
        /* the case in question under "adaptive": steps that drafted nothing (greedy: most
         * of them, not only each turn's first) */
        if (policy == SPEC_POLICY_ADAPTIVE)
            ASSERT_TRUE(kind == CONV_GREEDY ? no_drafts * 2 >= steps : no_drafts > 0);
        if (expect_hits)
            ASSERT_EQ(short_turns, 0);
        rig_close(&g);
    }
    printf("  least reuse of a previous prompt: %d %%\n", hits_min);
    if (kind != CONV_SAMPLED)
        for (int t = 0; t < TURNS; t++)
            for (int i = 0; i < ANS; i++)
                ASSERT_EQ(c[0][t].toks[i], c[1][t].toks[i]);
}

static void test_prefix_spec(void)
{
    prefix_conversation(SPEC_POLICY_ADAPTIVE, CONV_GREEDY, true);
    prefix_conversation(SPEC_POLICY_ADAPTIVE, CONV_SAMPLED, true);
    prefix_conversation(SPEC_POLICY_ADAPTIVE, CONV_SEEDED, false);
    prefix_conversation(SPEC_POLICY_FIXED, CONV_GREEDY, true);
    prefix_conversation(SPEC_POLICY_FIXED, CONV_SAMPLED, true);
    prefix_conversation(SPEC_POLICY_FIXED, CONV_SEEDED, false);
}

/* the sliding pool of kvplan.h (16 sequences x window 32 + 3, 48 tokens a step) holds 16
 * sequences decoding with 3 drafts far past the window: no preemption, reference output */
static void test_sliding_pool_sized(void)
{
    struct mock_config mc;
    struct engine_config ec;
    struct kvplan_req q = {
        .block_size = 16, .max_num_seqs = 16, .max_model_len = 1024, .max_batched_tokens = 48,
        .sliding_window = 32, .mtp_margin = 3, .bytes_per_token = { 1, 1 },
    };
    struct kvplan p;
    struct err_buf e;
    ASSERT_OK(kvplan_compute(&q, -1, &p, &e));
    mock_defaults(&mc);
    mc.n_blocks[KV_GROUP_FULL] = p.n_blocks[KVPLAN_FULL];
    mc.n_blocks[KV_GROUP_SLIDING] = p.n_blocks[KVPLAN_SLIDING];
    mc.mtp_accuracy = 0.9f;
    engine_defaults(&ec, 3);
    ASSERT_EQ(ec.max_num_seqs, q.max_num_seqs);
    ASSERT_EQ(ec.max_num_batched_tokens, q.max_batched_tokens);
    ASSERT_EQ(ec.sliding_window, q.sliding_window);
    struct rig g;
    rig_open(&g, &mc, &ec);
    static int32_t prompts[16][100];
    static struct coll c[16];
    memset(c, 0, sizeof(c));
    for (int i = 0; i < 16; i++) {
        char id[8];
        snprintf(id, sizeof(id), "w%d", i);
        make_prompt(prompts[i], 100, 40 + i);
        submit(&g, id, prompts[i], 100, 150, -1, &c[i]);
    }
    ASSERT_OK(engine_run_until_idle(g.e));
    struct engine_loads l;
    engine_get_loads(g.e, &l);
    printf("sliding pool of %d blocks (full %d): %llu preemptions\n", p.n_blocks[KVPLAN_SLIDING],
           p.n_blocks[KVPLAN_FULL], (unsigned long long) l.n_preemptions);
    ASSERT_EQ(l.n_preemptions, 0);
    for (int i = 0; i < 16; i++) {
        int32_t ref[150];
        reference(g.f, prompts[i], 100, 150, ref);
        assert_same(&c[i], ref, 150);
    }
    rig_close(&g);
}

int main(void)
{
    test_greedy_reference();
    test_spec_equivalence_mixed();
    test_batch_invariance();
    test_aborts();
    test_deadline_in_queue();
    test_priorities();
    test_preemption();
    test_stops();
    test_validation();
    test_sampled_reproducible();
    test_sampled_spec_distribution();
    test_thread();
    test_chunked_prefill_mixes();
    test_churn();
    test_id_reuse_in_callback();
    test_on_plan_hook();
    test_prefix_collisions();
    test_prefix_preemption();
    test_prefix_spec();
    test_sliding_pool_sized();
    printf("engine: ok\n");
    return 0;
}
