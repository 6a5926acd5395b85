/* test-group-argmax.c - greedy tokens chosen on the backend in a 2-rank group (issue 38):
 * two forked ranks joined by the UCX comm, each with its vocab slice of the tiny
 * checkpoint's lm_head (CPU backend, exact MXFP4 path, FP32 KV); rank 0 runs the engine
 * over the lockstep wrapper (worker_bcast_forward_new), rank 1 the followers' step
 * (worker_follow_step) for every plan it receives.
 *   - greedy requests at K = 0 and K = 3 give the tokens of one unsharded rank (the same
 *     checkpoint in rank 0's process) and rank 0's model copies no logits
 *     (model_logits_host_bytes): each rank's slice is reduced to one (value, id) pair per
 *     row and the pairs are all-gathered;
 *   - a sampled request in the same group takes the logits path (rows copied) with the
 *     single rank's tokens;
 *   - sampled requests with a top_k (temperatures, min_p) at K = 0 take the sampled form:
 *     each rank reduces its slice to STEP_PLAN_TOPK_K pairs a row, the pairs are
 *     all-gathered and merged (model_topk_merge); the single rank's tokens for the same
 *     seeds, rank 0 copies pairs, not rows; one with a top_p (its row's softmax mass: not
 *     in a group) copies the rows, with the single rank's tokens;
 *   - rank 1 ran every kind of plan (plan.argmax, plan.topk, neither).
 * Exits 77 (skip) when the checkpoint is absent.
 *
 *   test-group-argmax MODEL_DIR
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine-rig.h"
#include "group.h"
#include "loader.h"
#include "model.h"
#include "worker.h"

#define MAX_SEQS 8
#define MAX_TOKENS 64
#define MAX_LEN 512
#define BS 16

static const char *dir;

struct rank {
    struct ckpt *ck;
    struct backend *be;
    struct forward *f;
};

static int hook_allreduce(void *ctx, float *buf, size_t n)
{
    return comm_allreduce_sum(ctx, buf, n);
}

static int hook_allgather(void *ctx, const float *in, float *out, size_t n)
{
    return comm_allgather(ctx, in, out, n * sizeof(float));
}

static int per_seq_blocks(void)
{
    return (MAX_LEN + 4 + BS - 1) / BS + 1;
}

/* The checkpoint as rank `rank` of `world` (c: the group's comm, NULL for one rank). */
static void open_rank(struct rank *r, int world, int rank, struct comm *c)
{
    struct ckpt_opts co = { .world_size = world, .rank = rank, .mtp_depth = 3 };
    struct backend_cfg bc = { .n_threads = 1, .mxfp4_exact = true };
    struct model_comm mc = { .ctx = c, .rank = rank, .world = world,
                             .allreduce_sum = hook_allreduce, .allgather = hook_allgather };
    int nb = per_seq_blocks() * MAX_SEQS;
    struct model_opts mo = {
        .max_tokens_per_step = MAX_TOKENS, .max_seqs = MAX_SEQS, .max_logit_rows = MAX_TOKENS,
        .block_size = BS, .n_blocks = { nb, nb }, .max_seq_len = MAX_LEN + 4, .kv_f32 = true,
        .draft_quant = MODEL_DRAFT_CHECKPOINT,
    };
    struct err_buf e = { "" };

    if (ckpt_open(dir, &co, &r->ck, &e) < 0 || backend_new("cpu", &bc, &r->be) < 0 ||
        model_forward_new(r->ck, r->be, c ? &mc : NULL, &mo, &r->f, &e) < 0)
        FAIL("rank %d of %d: %s", rank, world, e.msg);
}

static void close_rank(struct rank *r)
{
    r->f->ops->free(r->f);
    backend_free(r->be);
    ckpt_close(r->ck);
}

static struct step_plan_limits limits(int vocab)
{
    int nb = per_seq_blocks() * MAX_SEQS;

    return (struct step_plan_limits){
        .max_seqs = MAX_SEQS, .max_tokens = MAX_TOKENS, .vocab_size = vocab,
        .max_blocks = { nb, nb }, .max_positions = MAX_LEN + 4,
        .max_block_ids = MAX_SEQS * per_seq_blocks(), .block_size = BS, .max_mtp_depth = 3,
    };
}

static const int32_t *make_prompt(int n, int salt, int vocab)
{
    static int32_t buf[8][128];
    static int next;
    int32_t *p = buf[next++ % 8];

    for (int i = 0; i < n; i++)
        p[i] = (int32_t)((i * 131 + salt * 977 + 7) % vocab);
    return p;
}

/* q[0 .. n) on f at K = k; the bytes of logits model m copied meanwhile */
static uint64_t run(struct forward *f, struct model *m, int k, const struct rig_req *q, int n,
                    struct rig_out *out)
{
    struct engine_config ec;
    uint64_t b0 = model_logits_host_bytes(m);

    rig_engine_config(&ec, MAX_TOKENS, MAX_SEQS, MAX_LEN, 0, k);
    ec.spec_policy = SPEC_POLICY_FIXED;
    struct engine *e = rig_engine_new(f, &ec);
    rig_run(e, q, n, out);
    rig_engine_close(e, NULL);
    return model_logits_host_bytes(m) - b0;
}

static int rank0(struct comm *c)
{
    struct rank one, grp;
    struct forward *lock;
    struct step_plan_limits lim;
    static struct rig_out a[4], b[4];

    open_rank(&one, 1, 0, NULL);
    open_rank(&grp, 2, 0, c);
    const int V = one.f->vocab_size;
    lim = limits(V);
    ASSERT_OK(worker_bcast_forward_new(grp.f, c, step_plan_max_packed_size(&lim), &lock));
    ASSERT_TRUE(lock->ops->step_argmax && lock->ops->mtp_step_argmax);
    struct model *mg = model_from_forward(grp.f), *m1 = model_from_forward(one.f);

    const struct rig_req greedy[] = {
        { .prompt = make_prompt(3, 1, V), .n_prompt = 3, .max_tokens = 16 },
        { .prompt = make_prompt(17, 2, V), .n_prompt = 17, .max_tokens = 20 },
        { .prompt = make_prompt(80, 3, V), .n_prompt = 80, .max_tokens = 12, .at_step = 2 },
    };
    for (int k = 0; k <= 3; k += 3) {
        uint64_t b1 = run(one.f, m1, k, greedy, 3, a), b2 = run(lock, mg, k, greedy, 3, b);
        uint64_t acc = 0;

        for (int i = 0; i < 3; i++) {
            rig_same(&a[i], &b[i], "greedy: 2-rank group vs one rank");
            acc += b[i].mtp.n_accepted;
        }
        printf("greedy, K = %d: the group's rank 0 copied %llu bytes of logits (one rank: "
               "%llu), %llu drafts accepted\n", k, (unsigned long long)b2,
               (unsigned long long)b1, (unsigned long long)acc);
        ASSERT_EQ(b2, 0);
        if (k)
            ASSERT_TRUE(acc > 0);
    }
    const struct rig_req smp = { .prompt = make_prompt(12, 4, V), .n_prompt = 12,
                                 .max_tokens = 16, .temperature = 0.8f, .seed = 7 };
    uint64_t b1 = run(one.f, m1, 3, &smp, 1, a), b2 = run(lock, mg, 3, &smp, 1, b);

    printf("sampled, K = 3: the group's rank 0 copied %llu bytes of logits (one rank: %llu)\n",
           (unsigned long long)b2, (unsigned long long)b1);
    ASSERT_TRUE(b2 > 0);
    rig_same(&a[0], &b[0], "sampled: 2-rank group vs one rank");

    const struct rig_req topk[] = {
        { .prompt = make_prompt(6, 5, V), .n_prompt = 6, .max_tokens = 16,
          .temperature = 0.9f, .top_k = 40, .seed = 31 },
        { .prompt = make_prompt(10, 6, V), .n_prompt = 10, .max_tokens = 14,
          .temperature = 1.3f, .top_k = 64, .min_p = 0.05f, .seed = 32 },
        { .prompt = make_prompt(4, 7, V), .n_prompt = 4, .max_tokens = 12 },
    };
    b1 = run(one.f, m1, 0, topk, 3, a);
    b2 = run(lock, mg, 0, topk, 3, b);
    for (int i = 0; i < 3; i++)
        rig_same(&a[i], &b[i], "top-k sampled: 2-rank group vs one rank");
    printf("top-k sampled, K = 0: the group's rank 0 copied %llu bytes (candidates), one rank "
           "%llu (its rows would be %llu)\n", (unsigned long long)b2, (unsigned long long)b1,
           (unsigned long long)(16 + 14 + 12) * (unsigned long long)V * 4);
    ASSERT_TRUE(b2 > 0 && b2 * 10 < (uint64_t)(16 + 14 + 12) * (uint64_t)V * 4);
    const struct rig_req topp = { .prompt = make_prompt(8, 8, V), .n_prompt = 8,
                                  .max_tokens = 10, .temperature = 0.7f, .top_k = 20,
                                  .top_p = 0.8f, .seed = 33 };
    b1 = run(one.f, m1, 0, &topp, 1, a);
    b2 = run(lock, mg, 0, &topp, 1, b);
    rig_same(&a[0], &b[0], "top-k/top-p sampled: 2-rank group vs one rank");
    printf("top-k and top-p sampled, K = 0: the group's rank 0 copied %llu bytes (rows), one "
           "rank %llu (candidates and sums)\n", (unsigned long long)b2, (unsigned long long)b1);
    ASSERT_EQ(b2, (uint64_t)10 * (uint64_t)V * 4);
    ASSERT_EQ(b1, (uint64_t)10 * (20 * 8 + 8));

    size_t cap = step_plan_max_packed_size(&lim);
    void *stop = malloc(cap);

    ASSERT_TRUE(stop != NULL);
    ASSERT_OK(comm_plan_send_stop(c, stop, cap));
    free(stop);
    lock->ops->free(lock);
    close_rank(&grp);
    close_rank(&one);
    return 0;
}

static int rank1(struct comm *c)
{
    struct rank grp;
    struct step_plan_buf pb;
    struct step_plan_limits lim;
    struct err_buf e = { "" };
    int kind, n_argmax = 0, n_topk = 0, n_plain = 0;

    open_rank(&grp, 2, 1, c);
    lim = limits(grp.f->vocab_size);
    size_t cap = step_plan_max_packed_size(&lim);
    void *scratch = malloc(cap);
    float *logits = malloc(sizeof(float) * MAX_TOKENS * (size_t)grp.f->vocab_size);
    int32_t *ids = malloc(sizeof(int32_t) * MAX_TOKENS);

    ASSERT_TRUE(scratch && logits && ids);
    step_plan_buf_init(&pb);
    for (;;) {
        if (comm_plan_recv(c, scratch, cap, &lim, &pb, &kind, &e) < 0)
            FAIL("rank 1: %s", e.msg);
        if (kind == PLAN_MSG_STOP)
            break;
        if (worker_follow_step(grp.f, &pb.plan, logits, ids) < 0)
            FAIL("rank 1: step %llu: %s", (unsigned long long)pb.plan.step_id,
                 model_last_error(model_from_forward(grp.f)));
        if (pb.plan.argmax)
            n_argmax++;
        else if (pb.plan.topk)
            n_topk++;
        else
            n_plain++;
    }
    printf("rank 1: %d greedy steps, %d sampled (candidates) steps, %d logits steps\n",
           n_argmax, n_topk, n_plain);
    ASSERT_TRUE(n_argmax > 0 && n_topk > 0 && n_plain > 0);
    step_plan_buf_done(&pb);
    free(scratch);
    free(logits);
    free(ids);
    close_rank(&grp);
    return 0;
}

static int rank_main(struct comm *c, void *arg)
{
    (void)arg;
    setvbuf(stdout, NULL, _IOLBF, 0);
    return c->rank == 0 ? rank0(c) : rank1(c);
}

int main(int argc, char **argv)
{
    char path[4096];
    struct group_ctl g;

    dir = argc > 1 ? argv[1] : "models/tiny-step";
    snprintf(path, sizeof(path), "%s/config.json", dir);
    if (access(path, R_OK) != 0) {
        printf("SKIP: no checkpoint at %s\n", dir);
        return TEST_SKIP;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    ASSERT_OK(group_run(2, 30000, rank_main, NULL, NULL, 120000, &g));
    for (int r = 0; r < 2; r++)
        if (!WIFEXITED(g.status[r]) || WEXITSTATUS(g.status[r]) != 0)
            FAIL("rank %d ended with status 0x%x", r, g.status[r]);
    printf("2-rank group: greedy rows reduced on the ranks, the single rank's tokens\n");
    return 0;
}
