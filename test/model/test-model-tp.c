/* test-model-tp.c - the sharding seams: the forward on W ranks (threads of this process,
 * each with its own loader slice, backend and model, joined by an in-process struct
 * model_comm) gives rank 0 the same logits as one rank, for prefill, chunked prefill and
 * decode steps; MTP runs on rank 0 only and matches too.
 *
 *   test-model-tp MODEL_DIR|gen:VARIANT [W=2]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"
#include "harness.h"
#include "kvplan.h"
#include "model.h"

#define BS 16
#define MAXW 4
#define TOL 1e-4        /* exact path; partial sums over ranks add in another order */

struct shared {
    int world;
    pthread_barrier_t bar;
    const float *ptr[MAXW];
    float *tmp[MAXW];
    size_t cap;
};

struct rank_ctx {
    struct shared *sh;
    int rank;
};

static int tp_allreduce(void *ctx, float *buf, size_t n)
{
    struct rank_ctx *c = ctx;
    struct shared *sh = c->sh;

    if (n > sh->cap)
        return -E2BIG;
    sh->ptr[c->rank] = buf;
    pthread_barrier_wait(&sh->bar);
    for (size_t i = 0; i < n; i++) {
        float s = 0;
        for (int r = 0; r < sh->world; r++)
            s += sh->ptr[r][i];
        sh->tmp[c->rank][i] = s;
    }
    pthread_barrier_wait(&sh->bar);
    memcpy(buf, sh->tmp[c->rank], n * sizeof(float));
    return 0;
}

static int tp_allgather(void *ctx, const float *in, float *out, size_t n)
{
    struct rank_ctx *c = ctx;
    struct shared *sh = c->sh;

    sh->ptr[c->rank] = in;
    pthread_barrier_wait(&sh->bar);
    for (int r = 0; r < sh->world; r++)
        memcpy(out + (size_t)r * n, sh->ptr[r], n * sizeof(float));
    pthread_barrier_wait(&sh->bar);
    return 0;
}

/* The scripted run: steps of (pos0, n) over one sequence, logits of the last token,
 * MTP after every step on rank 0. */
static const int steps[][2] = {{0, 40}, {40, 33}, {73, 1}, {74, 1}, {75, 7}, {82, 1}};
#define NSTEPS ((int)(sizeof(steps) / sizeof(steps[0])))

struct run {
    const char *dir;
    int world, rank, K, V;
    struct rank_ctx rc;
    const int32_t *X;
    float *logits;      /* [NSTEPS, V] (rank 0) */
    float *drafts;      /* [NSTEPS, K, V] (rank 0) */
    int rc_status;
    char err[1200];
};

static void *run_rank(void *arg)
{
    struct run *r = arg;
    struct err_buf e = {{0}};
    struct ckpt *ck = NULL;
    struct backend *be = NULL;
    struct model *m = NULL;
    struct ckpt_opts co = {.world_size = r->world, .rank = r->rank, .mtp_depth = r->K};
    struct backend_cfg bc = {.n_threads = 1, .mxfp4_exact = true};
    struct model_comm comm = {.ctx = &r->rc, .rank = r->rank, .world = r->world,
                              .allreduce_sum = tp_allreduce, .allgather = tp_allgather};
    /* FP32 KV: TOL bounds the order of the partial sums, which BF16 storage would round
     * into whole BF16 steps */
    struct model_opts mo = {.max_tokens_per_step = 64, .max_seqs = 2, .block_size = BS,
                            .n_blocks = {8, 8}, .max_seq_len = 128, .kv_f32 = true};
    int32_t blocks[8] = {3, 0, 7, 1, 6, 2, 5, 4};
    float *tmp = NULL;

    r->rc_status = -1;
    if (ckpt_open(r->dir, &co, &ck, &e) < 0 || backend_new("cpu", &bc, &be) < 0 ||
        model_new(ck, be, r->world > 1 ? &comm : NULL, &mo, &m, &e) < 0) {
        snprintf(r->err, sizeof(r->err), "rank %d: %s", r->rank, e.msg);
        goto out;
    }
    /* stepd-inspect's memory plan (kvplan.c) predicts this rank's buffers exactly */
    {
        int64_t act, kv, bpt[2];
        model_reserved_bytes(m, &act, &kv);
        kvplan_bytes_per_token(ckpt_config(ck), r->world, r->rank, r->K, 4, bpt);
        int64_t want = kvplan_workspace_bytes(ckpt_config(ck), r->world, r->rank, r->K, 64, 2, 8);
        if (act != want || kv != (bpt[0] + bpt[1]) * BS * 8) {
            snprintf(r->err, sizeof(r->err), "rank %d: reserved %lld activation + %lld KV bytes, "
                     "kvplan says %lld + %lld", r->rank, (long long)act, (long long)kv,
                     (long long)want, (long long)((bpt[0] + bpt[1]) * BS * 8));
            goto out;
        }
    }
    tmp = malloc(sizeof(float) * (size_t)r->V);
    for (int s = 0; s < NSTEPS; s++) {
        int pos0 = steps[s][0], n = steps[s][1];
        struct step_seq sq = {.slot = 1, .pos0 = pos0, .n_tokens = n, .n_logits = 1, .tok_off = 0,
                              .n_blocks = (pos0 + n + BS - 1) / BS, .block_off = {0, 0},
                              .mtp_depth = r->K};
        struct step_plan p = {.step_id = (uint64_t)s + 1, .n_seqs = 1, .n_tokens = n, .seqs = &sq,
                              .tokens = (int32_t *)r->X + pos0,
                              .n_block_ids = {sq.n_blocks, sq.n_blocks},
                              .blocks = {blocks, blocks}};
        float *out = r->rank == 0 ? r->logits + (size_t)s * r->V : tmp;
        if (model_step(m, &p, out) < 0) {
            snprintf(r->err, sizeof(r->err), "rank %d step %d: %s", r->rank, s, model_last_error(m));
            goto out;
        }
        for (int k = 0; k < model_n_mtp(m); k++) {
            int32_t nvld = n, tin = r->X[pos0 + n + k];
            if (model_mtp_step(m, k, &p, &nvld, &tin,
                               r->drafts + ((size_t)s * r->K + k) * r->V) < 0) {
                snprintf(r->err, sizeof(r->err), "rank %d mtp %d: %s", r->rank, k,
                         model_last_error(m));
                goto out;
            }
        }
        if (r->rank != 0 && model_n_mtp(m) != 0) {
            snprintf(r->err, sizeof(r->err), "rank %d holds MTP layers", r->rank);
            goto out;
        }
    }
    r->rc_status = 0;
out:
    free(tmp);
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
    return NULL;
}

int main(int argc, char **argv)
{
    int W = argc > 2 ? atoi(argv[2]) : 2;
    struct err_buf e = {{0}};
    struct ckpt *ck;
    struct ckpt_opts co = {.world_size = 1, .mtp_depth = 3};
    int32_t X[128];
    struct run base = {0}, runs[MAXW] = {{0}};
    struct shared sh = {.world = W};
    pthread_t th[MAXW];

    if (argc < 2 || W < 2 || W > MAXW)
        FAIL("usage: test-model-tp MODEL_DIR|gen:VARIANT [W in 2..%d]", MAXW);
    char *gen_dir = gen_model(argv[1]);
    const char *dir = gen_dir ? gen_dir : argv[1];
    struct model_config pc;
    char cpath[4096];
    snprintf(cpath, sizeof(cpath), "%s/config.json", dir);
    if (model_config_load(cpath, &pc, &e) < 0)
        FAIL("%s", e.msg);
    co.mtp_depth = pc.n_mtp_layers;
    if (ckpt_open(dir, &co, &ck, &e) < 0)
        FAIL("%s", e.msg);
    int V = ckpt_config(ck)->vocab_size, K = ckpt_mtp_depth(ck);
    int H = ckpt_config(ck)->hidden_size;
    ckpt_close(ck);
    for (int i = 0; i < 128; i++)
        X[i] = (int32_t)((i * 2654435761u + 17) % (uint32_t)V);

    /* one rank */
    base = (struct run){.dir = dir, .world = 1, .rank = 0, .K = K, .V = V, .X = X};
    base.logits = calloc((size_t)NSTEPS * V, sizeof(float));
    base.drafts = calloc((size_t)NSTEPS * (K ? K : 1) * V, sizeof(float));
    run_rank(&base);
    if (base.rc_status)
        FAIL("%s", base.err);

    /* W ranks */
    sh.cap = (size_t)64 * H;
    pthread_barrier_init(&sh.bar, NULL, (unsigned)W);
    for (int r = 0; r < W; r++) {
        sh.tmp[r] = malloc(sizeof(float) * sh.cap);
        runs[r] = (struct run){.dir = dir, .world = W, .rank = r, .K = K, .V = V, .X = X,
                               .rc = {.sh = &sh, .rank = r}};
        runs[r].logits = calloc((size_t)NSTEPS * V, sizeof(float));
        runs[r].drafts = calloc((size_t)NSTEPS * (K ? K : 1) * V, sizeof(float));
    }
    for (int r = 0; r < W; r++)
        ASSERT_EQ(pthread_create(&th[r], NULL, run_rank, &runs[r]), 0);
    for (int r = 0; r < W; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < W; r++)
        if (runs[r].rc_status)
            FAIL("%s", runs[r].err);

    double worst = 0, worst_m = 0;
    for (int s = 0; s < NSTEPS; s++) {
        for (int i = 0; i < V; i++) {
            double d = fabs(base.logits[(size_t)s * V + i] - runs[0].logits[(size_t)s * V + i]);
            worst = d > worst ? d : worst;
        }
        for (int k = 0; k < K; k++)
            for (int i = 0; i < V; i++) {
                size_t o = ((size_t)s * K + k) * V + i;
                double d = fabs(base.drafts[o] - runs[0].drafts[o]);
                worst_m = d > worst_m ? d : worst_m;
            }
    }
    printf("world %d vs world 1 over %d steps: trunk max|dlogit| %.3g, MTP (rank 0, K=%d) %.3g "
           "(tolerance %g)\n", W, NSTEPS, worst, K, worst_m, TOL);
    ASSERT_LE(worst, TOL);
    ASSERT_LE(worst_m, TOL);
    for (int r = 0; r < W; r++) {
        free(sh.tmp[r]);
        free(runs[r].logits);
        free(runs[r].drafts);
    }
    free(base.logits);
    free(base.drafts);
    pthread_barrier_destroy(&sh.bar);
    gen_remove(gen_dir);
    return 0;
}
