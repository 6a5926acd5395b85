/* test-mtp-repair.c - rejected speculative drafts leave no trace in the MTP layers' KV.
 *
 *   test-mtp-repair MODEL_DIR|gen:VARIANT
 *
 * Drives the forward protocol (worker/forward.h) directly, as the engine does: two
 * sequences in one plan, chunked prefill with the MTP chain over the chunks, then verify
 * steps [x, d1 .. dK] whose drafts are partly wrong (accept counts vary 0 .. K), the MTP
 * chain after every step fed with the true sampled token and the next step's drafts (so
 * MTP layer k >= 1 writes its last k positions from drafts that the next step rejects).
 * After every step the draft logits of every depth are compared with those of a fresh
 * slot that prefilled the accepted history from scratch (never saw a rejected draft) and
 * ran the chain with the same tok_in: they must agree within TOL (exact MXFP4 path, CPU).
 * Later one slot restarts a different sequence from position 0 (preemption by recompute /
 * slot reuse) and is checked the same way.  Sliding blocks are released as the engine's
 * KV pool does (window + n_mtp positions kept, worker/engine/kv.c).
 *
 * The same plans run on a second model built with mtp_no_repair: there the comparison
 * must FAIL (max diff above STALE_MIN), which shows the scenario does leave stale MTP KV
 * without the repair and that this test detects it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gen.h"
#include "harness.h"
#include "model.h"

#define TOL 1e-5
#define STALE_MIN 1e-4
#define BS 8
#define MAXLEN 160
#define NSEQ 4

static const struct model_config *cfg;
static int V, K;

#define TPLAN_SEED 0x2545f4914f6cdd1dull

#include "tplan.h"

/* Sliding blocks wholly below (pos0 - window - K + 1) are released (-1), as the engine's
 * pool does with its MTP margin. */
static void tp_add(struct tplan *tp, int slot, int pos0, const int32_t *toks, int n, int n_logits,
                   int mtp_depth)
{
    tp_add_run(tp, slot, pos0, toks, n, n_logits, mtp_depth, pos0 - cfg->sliding_window - K + 1);
}

/* One sequence being decoded speculatively in a slot. */
struct sq {
    int slot, ref_slot;
    const int32_t *X;       /* the true tokens (what verification accepts) */
    int pos;                /* tokens accepted so far = next run's pos0 */
    int32_t run[1 + 3];     /* next verify run: X[pos], d1 .. dK */
    int acc;                /* drafts of `run` the next verify accepts */
};

/* Drafts for the run at pos: the first acc right, then a wrong one, then random. */
static void sq_draft(struct sq *q)
{
    q->acc = (int)(rnd() % (uint32_t)(K + 1));
    q->run[0] = q->X[q->pos];
    for (int j = 1; j <= K; j++) {
        int32_t x = q->X[q->pos + j];
        if (j <= q->acc)
            q->run[j] = x;
        else if (j == q->acc + 1)
            q->run[j] = (x + 1 + (int32_t)(rnd() % (uint32_t)(V - 1))) % V;
        else
            q->run[j] = (int32_t)(rnd() % (uint32_t)V);
    }
}

struct cmp {
    double worst;           /* max |draft logit - fresh| over every step and depth */
    double depth[3];        /* the same per depth */
};

/* The MTP chain of a plan; tin[i][k] = tok_in of seq i at depth k; logits [n, K, V]. */
static void chain(struct model *m, const struct tplan *tp, const int32_t *nvld, int32_t tin[][3],
                  float *lg)
{
    float *buf = malloc(sizeof(float) * (size_t)tp->p.n_seqs * V);
    int32_t t[NSEQ];
    for (int k = 0; k < K; k++) {
        for (int i = 0; i < tp->p.n_seqs; i++)
            t[i] = tin[i][k];
        ASSERT_OK(model_mtp_step(m, k, &tp->p, nvld, t, buf));
        for (int i = 0; i < tp->p.n_seqs; i++)
            memcpy(lg + ((size_t)i * K + k) * V, buf + (size_t)i * V, sizeof(float) * (size_t)V);
    }
    free(buf);
}

/* Fresh prefill of X[0..E) in ref slots, chain with tin; compare with lg (rows [n, K, V]). */
static void check_fresh(struct model *m, struct sq **qs, int n, int32_t tin[][3], const float *lg,
                        struct cmp *c, const char *what)
{
    struct tplan tp;
    int32_t nvld[NSEQ];
    float *tl = malloc(sizeof(float) * (size_t)n * V);
    float *ref = malloc(sizeof(float) * (size_t)n * K * V);

    tp_init(&tp);
    for (int i = 0; i < n; i++) {
        tp_add(&tp, qs[i]->ref_slot, 0, qs[i]->X, qs[i]->pos, 1, K);
        nvld[i] = qs[i]->pos;
    }
    ASSERT_OK(model_step(m, &tp.p, tl));
    chain(m, &tp, nvld, tin, ref);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < K; k++) {
            double d = 0;
            const float *a = lg + ((size_t)i * K + k) * V, *b = ref + ((size_t)i * K + k) * V;
            for (int v = 0; v < V; v++) {
                double x = fabs((double)a[v] - b[v]);
                d = x > d ? x : d;
            }
            if (d > c->worst)
                c->worst = d;
            if (d > c->depth[k])
                c->depth[k] = d;
            (void)what;
        }
    free(tl);
    free(ref);
}

/* Prefill chunks then `steps` verify steps for the sequences qs (pos 0 each), comparing
 * every step's draft logits with a fresh prefill of the accepted history. */
static void drive(struct model *m, struct sq **qs, int n, int steps, struct cmp *c, int *ret_acc,
                  int *ret_drafts)
{
    struct tplan tp;
    int32_t nvld[NSEQ], tin[NSEQ][3];
    float *tl = malloc(sizeof(float) * (size_t)(K + 1) * NSEQ * V);
    float *lg = malloc(sizeof(float) * (size_t)NSEQ * K * V);
    const int chunks[2][2] = {{13, 22}, {29, 9}};

    /* chunked prefill; a chunk that does not end the prompt gets the true prompt tokens */
    for (int ch = 0; ch < 2; ch++) {
        tp_init(&tp);
        for (int i = 0; i < n; i++) {
            struct sq *q = qs[i];
            int len = chunks[i % 2][ch];
            tp_add(&tp, q->slot, q->pos, q->X + q->pos, len, ch == 1 ? 1 : 0, K);
            nvld[i] = len;
            q->pos += len;
            if (ch == 1)
                sq_draft(q);
            for (int k = 0; k < K; k++)
                tin[i][k] = ch == 0 || k == 0 ? q->X[q->pos + k] : q->run[k];
        }
        ASSERT_OK(model_step(m, &tp.p, tl));
        chain(m, &tp, nvld, tin, lg);
        check_fresh(m, qs, n, tin, lg, c, "prefill");
    }
    for (int st = 0; st < steps; st++) {
        tp_init(&tp);
        for (int i = 0; i < n; i++)
            tp_add(&tp, qs[i]->slot, qs[i]->pos, qs[i]->run, 1 + K, 1 + K, K);
        ASSERT_OK(model_step(m, &tp.p, tl));
        for (int i = 0; i < n; i++) {
            struct sq *q = qs[i];
            nvld[i] = 1 + q->acc;
            *ret_acc += q->acc;
            *ret_drafts += K;
            q->pos += 1 + q->acc;
            ASSERT_TRUE(q->pos + 1 + K <= MAXLEN);
            sq_draft(q);        /* the chain proposes the next run's drafts */
            for (int k = 0; k < K; k++)
                tin[i][k] = q->run[k];
        }
        chain(m, &tp, nvld, tin, lg);
        check_fresh(m, qs, n, tin, lg, c, "verify");
    }
    free(tl);
    free(lg);
}

struct result {
    double worst_first, worst_restart, depth[3];
    uint64_t reruns, missed;
};

static void scenario(struct ckpt *ck, struct backend *be, bool no_repair, const int32_t X[3][MAXLEN],
                     struct result *res)
{
    struct err_buf e = {{0}};
    struct model *m;
    struct model_opts mo = {
        .max_tokens_per_step = MAXLEN * 2, .max_seqs = NSEQ, .max_logit_rows = MAXLEN,
        .block_size = BS, .n_blocks = {NBLK, NBLK}, .max_seq_len = MAXLEN,
        .mtp_no_repair = no_repair,
    };
    struct sq a = {.slot = 0, .ref_slot = 2, .X = X[0]}, b = {.slot = 1, .ref_slot = 3, .X = X[1]};
    struct sq *qs[2] = {&a, &b};
    struct cmp c1 = {0}, c2 = {0};
    int acc = 0, drafts = 0;

    if (model_new(ck, be, NULL, &mo, &m, &e) < 0)
        FAIL("model_new: %s", e.msg);
    rng_state = 0x2545f4914f6cdd1dull;
    drive(m, qs, 2, 24, &c1, &acc, &drafts);
    /* slot 1 restarts another sequence from position 0 (preemption / slot reuse) */
    b.X = X[2];
    b.pos = 0;
    struct sq *qb[1] = {&b};
    drive(m, qb, 1, 12, &c2, &acc, &drafts);
    res->worst_first = c1.worst;
    res->worst_restart = c2.worst;
    for (int k = 0; k < K; k++)
        res->depth[k] = c1.depth[k] > c2.depth[k] ? c1.depth[k] : c2.depth[k];
    model_mtp_repair_stats(m, &res->reruns, &res->missed);
    printf("  repair %-3s: %d drafts, %d accepted (%.0f%%); positions re-run %llu (missed %llu); max|draft "
           "logit - fresh| %.3g (two sequences), %.3g (restarted slot)\n", no_repair ? "off" : "on",
           drafts, acc, 100.0 * acc / drafts, (unsigned long long)res->reruns, (unsigned long long)res->missed, c1.worst, c2.worst);
    for (int k = 0; k < K; k++)
        printf("    depth %d: max|draft logit - fresh| %.3g\n", k, res->depth[k]);
    model_free(m);
}

int main(int argc, char **argv)
{
    struct ckpt *ck;
    struct backend *be;
    int32_t X[3][MAXLEN];
    struct result on, off;

    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 2)
        FAIL("usage: test-mtp-repair MODEL_DIR|gen:VARIANT");
    char *gen_dir;
    if (gen_open(argv[1], &ck, &gen_dir) == TEST_SKIP)
        return TEST_SKIP;
    cfg = ckpt_config(ck);
    V = cfg->vocab_size;
    K = ckpt_mtp_depth(ck);
    ASSERT_TRUE(K >= 2 && K <= 3);          /* depth >= 1 is where drafts enter */
    ASSERT_TRUE(cfg->sliding_window > 0 && cfg->sliding_window < 100);

    struct backend_cfg bc = {.n_threads = 2, .mxfp4_exact = true};
    ASSERT_OK(backend_new("cpu", &bc, &be));
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < MAXLEN; i++)
            X[s][i] = (int32_t)(rnd() % (uint32_t)V);
    tables_shuffle();
    printf("%s: K=%d MTP layers, window %d, block %d, exact path\n", argv[1], K,
           cfg->sliding_window, BS);

    scenario(ck, be, true, (const int32_t (*)[MAXLEN])X, &off);
    scenario(ck, be, false, (const int32_t (*)[MAXLEN])X, &on);

    /* without the repair, rejected drafts stay in the MTP KV of depths >= 1 (depth 0's
     * inputs are never drafts): the check must see it */
    ASSERT_EQ(off.reruns, 0);
    if (off.depth[0] > TOL)
        FAIL("depth 0 differs from a fresh prefill even without drafts in its inputs: %g",
             off.depth[0]);
    if (off.worst_first <= STALE_MIN)
        FAIL("without the repair the drafts left no visible trace (max diff %g <= %g): the "
             "scenario does not test the repair", off.worst_first, STALE_MIN);
    if (on.worst_first > TOL || on.worst_restart > TOL)
        FAIL("MTP draft logits after rejected drafts differ from a fresh prefill: %g / %g > %g",
             on.worst_first, on.worst_restart, TOL);
    ASSERT_TRUE(on.reruns > 0);
    ASSERT_EQ(on.missed, 0);
    printf("repaired: every depth equals a fresh prefill of the accepted history within %g "
           "(max %.3g); unrepaired max %.3g\n", TOL,
           on.worst_first > on.worst_restart ? on.worst_first : on.worst_restart, off.worst_first);

    backend_free(be);
    gen_close(ck, gen_dir);
    return 0;
}
