/* test-model-split.c - split trunk steps (model_step runs a batch of sequences as two
 * per-core parts, backend_split_run) give bit for bit the logits of the same steps run
 * whole, on a 2-thread CPU backend: trunk logits of every step and the MTP drafts that
 * follow them, over a schedule of mixed prefill chunks, decodes and verify runs with rejected
 * drafts (the MTP layers then re-run positions) of up to 16 sequences that joins, leaves
 * and crosses the sliding window.  Also: the split really happened
 * (model_split_steps), never with no_split, and never for a step below the split size; a
 * single sequence (prefill chunk, verify runs of 4) splits inside its run.  A third model
 * runs its MTP layers as per-core halves (mtp_tp_run): trunk logits bit for bit, drafts
 * within a bound (the order of the o_proj / down_proj sums differs).  Its last depth runs
 * as a tail (only each run's last row past the KV store, model_mtp_tails): its drafts
 * equal bit for bit those of a fourth model that runs every row (no_mtp_tail), and the
 * next step's drafts too (the KV the tail stored is the same).
 *
 *   test-model-split MODEL_DIR [exact|fast]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gen.h"
#include "harness.h"
#include "model.h"

#define BS 16
#define MAXLEN 160
#define NSEQ 16

#define TPLAN_SEED 0x2545f4914f6cdd1dull

#include "tplan.h"

static int V, K, window;
static struct model *mt;            /* MTP layers as per-core halves (compared with a bound) */
static struct model *mn;            /* mt without the tail (compared bit for bit) */
static double tol_tp, worst_tp;
static float *lt, *ln;

/* Run one plan on both models and compare the trunk logits and K MTP depths bit for bit. */
static int trunk_splits, mtp_splits;

static void step_both(struct model *a, struct model *b, struct tplan *tp, const int32_t *valid,
                      const int32_t *next, float *la, float *lb, const char *what)
{
    int rows = 0;
    uint64_t c0 = model_split_steps(a), c1;

    for (int i = 0; i < tp->p.n_seqs; i++)
        rows += tp->seqs[i].n_logits;
    ASSERT_OK(model_step(a, &tp->p, la));
    ASSERT_OK(model_step(b, &tp->p, lb));
    ASSERT_OK(model_step(mt, &tp->p, lt));
    ASSERT_OK(model_step(mn, &tp->p, ln));
    if (memcmp(la, lb, sizeof(float) * (size_t)rows * V) != 0)
        FAIL("%s: trunk logits differ between split and whole steps", what);
    if (memcmp(la, lt, sizeof(float) * (size_t)rows * V) != 0)
        FAIL("%s: trunk logits differ with MTP halves", what);
    c1 = model_split_steps(a);
    ASSERT_TRUE(c1 - c0 <= 1);
    trunk_splits += (int)(c1 - c0);
    if (tp->p.n_tokens < 4)
        ASSERT_EQ(c1, c0);          /* below the split size: the step ran whole */
    for (int k = 0; k < K; k++) {
        int32_t nv[NSEQ], tin[NSEQ];

        for (int i = 0; i < tp->p.n_seqs; i++) {
            nv[i] = valid[i];
            tin[i] = next[i * 4 + k];
        }
        ASSERT_OK(model_mtp_step(a, k, &tp->p, nv, tin, la));
        ASSERT_OK(model_mtp_step(b, k, &tp->p, nv, tin, lb));
        ASSERT_OK(model_mtp_step(mt, k, &tp->p, nv, tin, lt));
        ASSERT_OK(model_mtp_step(mn, k, &tp->p, nv, tin, ln));
        if (memcmp(lt, ln, sizeof(float) * (size_t)tp->p.n_seqs * V) != 0)
            FAIL("%s: MTP depth %d logits differ between the tail and every row", what, k);
        if (memcmp(la, lb, sizeof(float) * (size_t)tp->p.n_seqs * V) != 0)
            FAIL("%s: MTP depth %d logits differ between split and whole steps", what, k);
        /* halves: the same drafts up to the order of the o_proj / down_proj sums */
        for (size_t i = 0; i < (size_t)tp->p.n_seqs * V; i++) {
            double d = fabs((double)la[i] - lt[i]);
            if (d > tol_tp)
                FAIL("%s: MTP depth %d logit %zu: halves %g vs whole %g", what, k, i, lt[i], la[i]);
            worst_tp = d > worst_tp ? d : worst_tp;
        }
    }
    mtp_splits += (int)(model_split_steps(a) - c1);
}

int main(int argc, char **argv)
{
    struct err_buf e = {{0}};
    static int32_t X[NSEQ][MAXLEN + 8];
    int pos[NSEQ] = {0};
    struct ckpt *ck;
    struct backend *be;
    struct model *ms, *mw;

    if (argc < 2)
        FAIL("usage: test-model-split MODEL_DIR [exact|fast]");
    bool exact = argc < 3 || strcmp(argv[2], "fast") != 0;
    char *gen_dir;
    if (gen_open(argv[1], &ck, &gen_dir) == TEST_SKIP)
        return TEST_SKIP;
    V = ckpt_config(ck)->vocab_size;
    K = ckpt_mtp_depth(ck);
    window = ckpt_config(ck)->sliding_window;

    struct backend_cfg bc = {.n_threads = 2, .mxfp4_exact = exact};
    ASSERT_OK(backend_new("cpu", &bc, &be));
    ASSERT_EQ(backend_split_width(be), 2);
    struct model_opts mo = {
        .max_tokens_per_step = 512, .max_seqs = NSEQ, .max_logit_rows = 512,
        .block_size = BS, .n_blocks = {NBLK, NBLK}, .max_seq_len = MAXLEN,
        /* exact path: FP32 KV, so that tol_tp bounds the order of the halves' sums, not
         * BF16 steps; the fast path runs the service default, BF16 KV */
        .kv_f32 = exact,
    };
    /* mt: the default (split steps, MTP layers as per-core halves); ms / mw: split / whole
     * steps with whole MTP layers, which must agree bit for bit */
    if (model_new(ck, be, NULL, &mo, &mt, &e) < 0)
        FAIL("model_new: %s", e.msg);
    ASSERT_TRUE(K == 0 || model_mtp_halves(mt));   /* the test models' MTP layers qualify */
    mo.no_mtp_tail = true;
    if (model_new(ck, be, NULL, &mo, &mn, &e) < 0)
        FAIL("model_new (no_mtp_tail): %s", e.msg);
    mo.no_mtp_tail = false;
    mo.no_mtp_tp = true;
    if (model_new(ck, be, NULL, &mo, &ms, &e) < 0)
        FAIL("model_new (no_mtp_tp): %s", e.msg);
    mo.no_split = true;
    if (model_new(ck, be, NULL, &mo, &mw, &e) < 0)
        FAIL("model_new (no_split, no_mtp_tp): %s", e.msg);

    for (int s = 0; s < NSEQ; s++)
        for (int i = 0; i < MAXLEN + 8; i++)
            X[s][i] = (int32_t)(rnd() % (uint32_t)V);
    tables_shuffle();
    float *la = malloc(sizeof(float) * 512 * (size_t)V), *lb = malloc(sizeof(float) * 512 * (size_t)V);
    lt = malloc(sizeof(float) * 512 * (size_t)V);
    ln = malloc(sizeof(float) * 512 * (size_t)V);
    ASSERT_TRUE(la && lb && lt && ln);
    tol_tp = exact ? 1e-4 : 2e-2;

    /* 40 steps: each live sequence either prefills a chunk (1-40 tokens, logits of the last
     * 1-3) or decodes (1 token, or 4 as a verify run); 4..16 sequences per step; a sequence
     * that reaches MAXLEN - 8 restarts from 0 (new request in the slot). */
    int small = 0;
    for (int st = 0; st < 40; st++) {
        struct tplan tp;
        int32_t next[NSEQ * 4], valid[NSEQ], toks[40];
        int want = 4 + (int)(rnd() % (NSEQ - 3)), n = 0;
        char what[64];

        tp_init(&tp);
        for (int s = 0; s < NSEQ && n < want; s++) {
            int slot = (st + s * 5) % NSEQ, len, nv;
            bool verify;

            if (pos[slot] >= MAXLEN - 48)
                pos[slot] = 0;
            verify = pos[slot] > 0 && rnd() % 4 == 0;
            len = verify ? 4 : (pos[slot] == 0 || rnd() % 5 == 0 ? 1 + (int)(rnd() % 40) : 1);
            /* a verify run keeps its first nv tokens; the rest are rejected drafts (ids
             * that differ from what the next step feeds at those positions) */
            nv = verify ? 1 + (int)(rnd() % 4) : len;
            memcpy(toks, X[slot] + pos[slot], sizeof(int32_t) * (size_t)len);
            for (int j = nv; j < len; j++)
                toks[j] = (toks[j] + 1 + (int32_t)(rnd() % 7)) % V;
            tp_add_run(&tp, slot, pos[slot], toks, len,
                       verify ? len : 1 + (len > 2) * (int)(rnd() % 3), K, pos[slot] - window + 1);
            valid[n] = nv;
            /* depth 0 takes the sampled token, deeper ones drafts: sometimes wrong ones,
             * which the next step's run contradicts (the MTP layers re-run them) */
            for (int k = 0; k < 4; k++)
                next[n * 4 + k] = (X[slot][pos[slot] + nv + k] +
                                   (k > 0 && rnd() % 3 == 0 ? 1 : 0)) % V;
            pos[slot] += nv;
            n++;
        }
        snprintf(what, sizeof(what), "step %d (%d seqs, %d tokens)", st, tp.p.n_seqs, tp.p.n_tokens);
        step_both(ms, mw, &tp, valid, next, la, lb, what);
        small += tp.p.n_tokens < 4;
    }
    /* one sequence alone: a prefill chunk, then verify runs of 4 (batch-1 speculative
     * decoding): the cut falls inside the run, part 1's first queries wait for part 0's
     * keys (struct split_sync) */
    {
        int slot = 3, inside = 0;

        pos[slot] = 0;
        for (int st = 0; st < 12; st++) {
            struct tplan tp;
            int32_t next[4], valid[1], toks[40];
            int len = st == 0 ? 37 : 4, nv = st == 0 ? len : 1 + (int)(rnd() % 4);
            int before = trunk_splits;

            tp_init(&tp);
            memcpy(toks, X[slot] + pos[slot], sizeof(int32_t) * (size_t)len);
            for (int j = nv; j < len; j++)
                toks[j] = (toks[j] + 1) % V;
            tp_add_run(&tp, slot, pos[slot], toks, len, st == 0 ? 1 : len, K,
                       pos[slot] - window + 1);
            valid[0] = nv;
            for (int k = 0; k < 4; k++)
                next[k] = (X[slot][pos[slot] + nv + k] + (k > 0 && rnd() % 3 == 0)) % V;
            pos[slot] += nv;
            step_both(ms, mw, &tp, valid, next, la, lb, st == 0 ? "1-seq prefill" : "1-seq verify");
            ASSERT_EQ(trunk_splits, before + 1);
            inside++;
        }
        printf("one sequence: a 37-token chunk and 11 verify runs of 4 split inside the run: "
               "bit-identical (%d steps)\n", inside);
    }
    /* 16 single-token decodes: the batch-16 decode step splits */
    {
        struct tplan tp;
        int32_t next[NSEQ * 4], valid[NSEQ];

        tp_init(&tp);
        for (int s = 0; s < NSEQ; s++) {
            valid[s] = 1;
            tp_add_run(&tp, s, pos[s], X[s] + pos[s], 1, 1, K, pos[s] - window + 1);
            for (int k = 0; k < 4; k++)
                next[s * 4 + k] = X[s][pos[s] + 1 + k];
        }
        int before = trunk_splits;
        step_both(ms, mw, &tp, valid, next, la, lb, "batch-16 decode");
        ASSERT_EQ(trunk_splits, before + 1);
    }
    ASSERT_EQ(model_split_steps(mw), 0);
    ASSERT_EQ(model_coop_mlps(mw), 0);
    const struct model_config *mc = model_config(ms);
    bool has_dense = false;
    for (int l = 0; l < mc->n_layers; l++)
        has_dense |= !mc->layers[l].is_moe && mc->intermediate_size % 64 == 0 && mc->hidden_size % 64 == 0;
    /* the verify runs of 4 (and any other split step of <= 4 tokens) computed their dense
     * MLPs with both parts (struct split_coop), still bit for bit */
    ASSERT_TRUE(!has_dense || model_coop_mlps(ms) > 0);
    ASSERT_TRUE(!model_mtp_halves(ms) && !model_mtp_halves(mw));
    ASSERT_TRUE(trunk_splits >= 20);
    ASSERT_TRUE(K == 0 || mtp_splits >= 20);
    uint64_t rerun = 0, missed = 0;
    model_mtp_repair_stats(ms, &rerun, &missed);
    ASSERT_TRUE(K < 2 || rerun > 0);
    printf("MTP positions re-run after rejected drafts: %llu\n", (unsigned long long)rerun);
    printf("%s path: 41 steps bit-identical split vs whole (trunk + %d MTP depths); split: %d "
           "trunk steps, %d MTP depths; %d steps below the split size ran whole; %llu dense MLPs "
           "run by both parts\n", exact ? "exact" : "fast", K, trunk_splits, mtp_splits, small,
           (unsigned long long)model_coop_mlps(ms));

    printf("MTP layers as per-core halves: drafts within %.3g of whole layers (bound %g)\n",
           worst_tp, tol_tp);
    /* every step ran all K depths, so the last one ran as a tail each time (none without) */
    ASSERT_TRUE(K == 0 || model_mtp_tails(mt) >= 40);
    ASSERT_EQ(model_mtp_tails(mn), 0);
    printf("last MTP depth as a tail: %llu times, drafts bit-identical to every row run\n",
           (unsigned long long)model_mtp_tails(mt));
    free(la);
    free(lb);
    free(lt);
    free(ln);
    model_free(mn);
    model_free(mt);
    model_free(ms);
    model_free(mw);
    backend_free(be);
    gen_close(ck, gen_dir);
    return 0;
}
