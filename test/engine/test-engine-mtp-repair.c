/* test-engine-mtp-repair.c - the engine drives the MTP "no trace" repair (worker/model/model.h)
 * on the REAL tiny checkpoint (models/tiny-step, CPU): greedy and sampled requests with
 * K = 3 (one with a per-request K = 1), prompts and outputs well past the sliding window
 * (so sliding blocks are released while drafts are rejected), arriving at different steps.
 * Afterwards the model must have re-run draft positions and missed none: every position
 * that a rejected draft may have touched got rewritten, including re-run queries whose
 * window reaches below the trunk's (the engine's KV pool keeps window + K positions).
 * Greedy output still equals K = 0.  Exits 77 (skip) when the checkpoint is absent.
 * (Equality of the repaired MTP caches with a fresh prefill is test/model/test-mtp-repair.) */
#include "engine-rig.h"
#include "model-rig.h"

#define NREQ 4

static struct model_rig rig;

static const int req_len[NREQ] = { 10, 70, 130, 33 };
static const int req_out[NREQ] = { 120, 90, 100, 110 };
static const int req_at[NREQ] = { 0, 2, 5, 9 };
static const bool req_sampled[NREQ] = { false, true, false, true };
static const int req_k[NREQ] = { -1, -1, -1, 1 };

static void run(int k, struct rig_out *c)
{
    struct engine_config ec;
    static int32_t prompts[NREQ][160];
    struct rig_req s[NREQ];
    int vocab = rig.f->vocab_size;

    rig_engine_config(&ec, 64, 8, 400, rig.cfg->sliding_window, k);
    ec.spec_policy = SPEC_POLICY_FIXED;     /* the repair needs the drafts of every step */
    struct engine *e = rig_engine_new(rig.f, &ec);
    for (int i = 0; i < NREQ; i++) {
        for (int t = 0; t < req_len[i]; t++)
            prompts[i][t] = (int32_t) ((t * 389 + i * 1013 + 5) % vocab);
        s[i] = (struct rig_req) { prompts[i], req_len[i], req_out[i], req_at[i],
                                  k > 0 ? req_k[i] + 1 : 0 };
        if (req_sampled[i]) {
            s[i].temperature = 1.0f;
            s[i].seed = 1234 + (uint64_t) i;
        }
    }
    rig_run(e, s, NREQ, c);
    rig_engine_close(e, NULL);
}

int main(int argc, char **argv)
{
    static struct rig_out base[NREQ], spec[NREQ];
    uint64_t rerun0, missed0, rerun, missed, drafts = 0, acc = 0;

    if (argc < 2)
        FAIL("usage: test-engine-mtp-repair MODEL_DIR");
    static const int def[2] = { 0, 0 };
    model_rig_open_or_exit(&rig, argv[1], 2, 8, 64, 400, def, MODEL_DRAFT_CHECKPOINT);
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
