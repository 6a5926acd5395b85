/* test-engine-mtp-repair.c - the engine drives the MTP "no trace" repair (worker/model.h)
 * on the REAL tiny checkpoint (models/tiny-step, CPU): greedy and sampled requests with
 * K = 3 (one with a per-request K = 1), prompts and outputs well past the sliding window
 * (so sliding blocks are released while drafts are rejected), arriving at different steps.
 * Afterwards the model must have re-run draft positions and missed none: every position
 * that a rejected draft may have touched got rewritten, including re-run queries whose
 * window reaches below the trunk's (the engine's KV pool keeps window + K positions).
 * Greedy output still equals K = 0.  Exits 77 (skip) when the checkpoint is absent.
 * (Equality of the repaired MTP caches with a fresh prefill is test/model/test-mtp-repair.) */
#include <stdlib.h>

#include "engine.h"
#include "harness.h"
#include "model-rig.h"

#define MAXTOK 256
#define NREQ 4

struct coll {
    int32_t toks[MAXTOK];
    int n;
    bool finished;
    struct spec_stats mtp;
};

static void on_out(void *ud, const struct engine_output *o)
{
    struct coll *c = ud;
    ASSERT_TRUE(c->n + o->n_tokens <= MAXTOK);
    memcpy(c->toks + c->n, o->tokens, (size_t) o->n_tokens * sizeof(int32_t));
    c->n += o->n_tokens;
    c->mtp = o->mtp;
    if (o->finished)
        c->finished = true;
}

static struct model_rig rig;

static const int req_len[NREQ] = { 10, 70, 130, 33 };
static const int req_out[NREQ] = { 120, 90, 100, 110 };
static const int req_at[NREQ] = { 0, 2, 5, 9 };
static const bool req_sampled[NREQ] = { false, true, false, true };
static const int req_k[NREQ] = { -1, -1, -1, 1 };

static void run(int k, struct coll *c)
{
    struct engine_config ec;
    struct err_buf err;
    struct engine *e;
    static int32_t prompts[NREQ][160];
    int vocab = rig.f->vocab_size, next = 0;

    engine_config_init(&ec);
    ec.max_num_batched_tokens = 64;
    ec.max_num_seqs = 8;
    ec.max_model_len = 400;
    ec.sliding_window = rig.cfg->sliding_window;
    ec.num_speculative_tokens = k;
    ec.spec_policy = SPEC_POLICY_FIXED;     /* the repair needs the drafts of every step */
    if (engine_new(rig.f, &ec, &e, &err) < 0)
        FAIL("engine_new: %s", err.msg);
    for (int i = 0; i < NREQ; i++)
        for (int t = 0; t < req_len[i]; t++)
            prompts[i][t] = (int32_t) ((t * 389 + i * 1013 + 5) % vocab);
    for (int step = 0; step < 100000; step++) {
        while (next < NREQ && req_at[next] <= step) {
            struct engine_request q;
            char id[16];
            snprintf(id, sizeof(id), "r%d", next);
            engine_request_init(&q);
            q.id = id;
            q.prompt = prompts[next];
            q.n_prompt = req_len[next];
            q.max_tokens = req_out[next];
            q.ignore_eos = true;
            if (k > 0)
                q.num_speculative_tokens = req_k[next];
            if (req_sampled[next]) {
                q.sampling.temperature = 1.0f;
                q.sampling.seed = 1234 + (uint64_t) next;
            }
            if (engine_submit(e, &q, on_out, &c[next], &err) < 0)
                FAIL("submit: %s", err.msg);
            next++;
        }
        ASSERT_TRUE(engine_step(e) >= 0);
        struct engine_loads l;
        engine_get_loads(e, &l);
        if (next == NREQ && !l.n_alive)
            break;
    }
    for (int i = 0; i < NREQ; i++) {
        ASSERT_TRUE(c[i].finished);
        ASSERT_EQ(c[i].n, req_out[i]);
    }
    ASSERT_OK(engine_check(e));
    struct engine_loads l;
    engine_get_loads(e, &l);
    ASSERT_EQ(l.kv_blocks_used, 0);
    engine_free(e);
}

int main(int argc, char **argv)
{
    struct err_buf e = { { 0 } };
    static struct coll base[NREQ], spec[NREQ];
    uint64_t rerun0, missed0, rerun, missed, drafts = 0, acc = 0;

    if (argc < 2)
        FAIL("usage: test-engine-mtp-repair MODEL_DIR");
    int rc = model_rig_open(&rig, argv[1], 2, 8, 64, 400, &e);
    if (rc == -ENOENT) {
        printf("checkpoint %s absent: skipped\n", argv[1]);
        return TEST_SKIP;
    }
    if (rc < 0)
        FAIL("model: %s", e.msg);
    struct model *m = model_from_forward(rig.f);
    ASSERT_TRUE(m != NULL);
    ASSERT_EQ(model_n_mtp(m), 3);
    ASSERT_TRUE(rig.cfg->sliding_window > 0 && rig.cfg->sliding_window < 130);

    run(0, base);
    model_mtp_repair_stats(m, &rerun0, &missed0);
    ASSERT_EQ(rerun0, 0);
    run(3, spec);
    model_mtp_repair_stats(m, &rerun, &missed);
    for (int i = 0; i < NREQ; i++) {
        drafts += spec[i].mtp.n_draft_tokens;
        acc += spec[i].mtp.n_accepted;
        if (req_sampled[i])
            continue;
        for (int t = 0; t < req_out[i]; t++)
            if (spec[i].toks[t] != base[i].toks[t])
                FAIL("greedy request %d: token %d differs with K = 3 (%d vs %d)", i, t,
                     spec[i].toks[t], base[i].toks[t]);
    }
    printf("K=3: %llu drafts, %llu accepted (%llu rejected); MTP positions re-run %llu, "
           "missed %llu\n", (unsigned long long) drafts, (unsigned long long) acc,
           (unsigned long long) (drafts - acc), (unsigned long long) rerun,
           (unsigned long long) missed);
    ASSERT_TRUE(drafts > acc);          /* some drafts were rejected */
    ASSERT_TRUE(rerun > 0);
    ASSERT_EQ(missed, 0);
    model_rig_close(&rig);
    return 0;
}
