/* bench-comm.c - host collectives over UCX (not in the default test run).
 *
 * Prints, for N = 2 and 4 forked ranks on this machine:
 *   - all-reduce (FP32 sum) latency for 4 KiB .. 16 MiB, with algorithm bandwidth
 *     (bytes / time) and bus bandwidth (2 (N-1)/N bytes / time, the NCCL-tests figure),
 *     next to the point-to-point tag bandwidth `ucx_perftest -t tag_bw` measures on the
 *     same machine in the same run, and their ratio (best of 3 for both: every side
 *     busy-polls, so on a loaded 2-core machine single runs mostly measure the scheduler);
 *   - the per-step cost of the step-plan broadcast: a lockstep step modelled as
 *     "1-float all-reduce" with and without the plan broadcast before it, for plans of
 *     1, 16, 64 and 256 decode sequences (pack + send + receive + validate + unpack);
 *   - the cost of an image's rows on the plan (issue 40): a prefill plan of one image's
 *     tokens (169 for the 728x728 view + 4 x 81 for 504x504 crops = 493 rows) at the tiny
 *     model's width (256) and Step-3.7-Flash's (4096, FP32: 8.1 MB), against the same plan
 *     without the rows; what rank 0 pays to hand the encoder's output to the group instead
 *     of every rank encoding.
 * Usage: bench-comm [--quick | --images]   (env: UCX_NET_DEVICES=lo as for the tests;
 *        --images: the image-row plans alone, N = 2)
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm.h"
#include "group.h"
#include "harness.h"

static int quick;
static double perftest_mbps[8];     /* by size index */
static const size_t sizes[] = { 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216 };

/* run ucx_perftest server + client on loopback; returns MB/s (1e6 bytes/s) or -1 */
static double perftest_bw(size_t bytes)
{
    char cmd[512], line[512];
    double bw = -1;
    int port = 20000 + (int)(getpid() % 20000);
    FILE *f;
    pid_t srv;

    fflush(NULL);
    srv = fork();
    if (srv == 0) {
        char p[16];

        snprintf(p, sizeof(p), "%d", port);
        freopen("/dev/null", "w", stdout);
        freopen("/dev/null", "w", stderr);
        execlp("ucx_perftest", "ucx_perftest", "-p", p, (char *)NULL);
        _exit(127);
    }
    usleep(300 * 1000);
    snprintf(cmd, sizeof(cmd), "ucx_perftest 127.0.0.1 -p %d -t tag_bw -s %zu -n %d 2>&1", port,
             bytes, bytes >= 4194304 ? 100 : bytes >= 262144 ? 500 : 5000);
    f = popen(cmd, "r");
    while (f && fgets(line, sizeof(line), f)) {
        double it, p50, avg, ovl, bwa, bwo;

        if (sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &ovl, &bwa, &bwo) == 6)
            bw = bwo * 1.048576;    /* ucx_perftest prints MiB/s */
    }
    if (f)
        pclose(f);
    kill(srv, SIGKILL);
    waitpid(srv, NULL, 0);
    return bw;
}

static int bench_allreduce(struct comm *c, void *arg)
{
    int n = c->world_size;

    if (c->rank == 0) {
        printf("\nall-reduce, N=%d (FP32 sum, host buffers, UCX)\n", n);
        printf("%10s %8s %12s %12s %12s %14s %8s\n", "bytes", "iters", "usec/op", "algbw MB/s",
               "busbw MB/s", "perftest MB/s", "ratio");
    }
    for (size_t k = 0; k < ARRAY_SIZE(sizes); k++) {
        size_t cnt = sizes[k] / sizeof(float);
        float *buf = calloc(cnt, sizeof(float));
        int iters = (int)(128u * 1024 * 1024 / sizes[k]);

        if (iters > 300)
            iters = 300;
        if (iters < 5)
            iters = 5;
        if (quick)
            iters = iters / 10 + 2;
        ASSERT_TRUE(buf);
        for (int i = 0; i < 3; i++)
            ASSERT_OK(comm_allreduce_sum(c, buf, cnt));
        /* best of 3 batches (same reason as for ucx_perftest) */
        double us = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            ASSERT_OK(comm_barrier(c));
            double t0 = group_now_msec();
            for (int i = 0; i < iters; i++)
                ASSERT_OK(comm_allreduce_sum(c, buf, cnt));
            ASSERT_OK(comm_barrier(c));
            double t = (group_now_msec() - t0) * 1e3 / iters;
            if (t < us)
                us = t;
        }
        if (c->rank == 0) {
            double alg = sizes[k] / us, bus = alg * 2.0 * (n - 1) / n;

            printf("%10zu %8d %12.1f %12.1f %12.1f %14.1f %8.2f\n", sizes[k], iters, us, alg, bus,
                   perftest_mbps[k], perftest_mbps[k] > 0 ? bus / perftest_mbps[k] : 0.0);
        }
        free(buf);
    }
    return 0;
}

static int bench_plan(struct comm *c, void *arg)
{
    static const int nseqs[] = { 1, 16, 64, 256 };
    struct step_plan_limits lim = { .max_seqs = 256, .max_tokens = 4096, .vocab_size = 128000,
                                    .max_blocks = { 65536, 65536 }, .max_positions = 131072,
                                    .max_block_ids = 65536, .block_size = 16, .max_mtp_depth = 3 };
    size_t cap = step_plan_max_packed_size(&lim);
    void *scratch = malloc(cap);
    struct step_plan_buf b;
    struct err_buf e;
    int iters = quick ? 200 : 2000, kind;
    float one = 1;

    ASSERT_TRUE(scratch);
    step_plan_buf_init(&b);
    if (c->rank == 0) {
        printf("\nstep-plan broadcast, N=%d: per-step cost in lockstep (plan bcast + 1-float "
               "all-reduce vs the all-reduce alone)\n", c->world_size);
        printf("%8s %10s %14s %14s %14s\n", "seqs", "bytes", "usec/step", "usec alone",
               "overhead usec");
    }
    for (size_t k = 0; k < ARRAY_SIZE(nseqs); k++) {
        int S = nseqs[k], nb = 64;     /* 64 blocks x 16 = 1024 positions per sequence */
        struct step_seq *seqs = calloc((size_t)S, sizeof(*seqs));
        int32_t *toks = calloc((size_t)S, sizeof(int32_t));
        int32_t *bl = calloc((size_t)S * nb, sizeof(int32_t));

        ASSERT_TRUE(seqs && toks && bl);
        for (int s = 0; s < S; s++) {
            seqs[s] = (struct step_seq){ .slot = s, .pos0 = 1000, .n_tokens = 1, .n_logits = 1,
                                         .tok_off = s, .n_blocks = nb,
                                         .block_off = { s * nb, s * nb }, .mtp_depth = 0 };
            toks[s] = 1000 + s;
        }
        for (int i = 0; i < S * nb; i++)
            bl[i] = i;
        struct step_plan p = { .n_seqs = S, .n_tokens = S, .seqs = seqs, .tokens = toks,
                               .n_block_ids = { S * nb, S * nb }, .blocks = { bl, bl } };
        double t[2];

        for (int mode = 0; mode < 2; mode++) {
            ASSERT_OK(comm_barrier(c));
            double t0 = group_now_msec();

            for (int i = 0; i < iters; i++) {
                if (mode == 0) {
                    p.step_id = (uint64_t)i;
                    if (c->rank == 0) {
                        ASSERT_OK(comm_plan_send(c, &p, scratch, cap));
                    } else {
                        if (comm_plan_recv(c, scratch, cap, &lim, &b, &kind, &e) < 0)
                            FAIL("%s", e.msg);
                    }
                }
                ASSERT_OK(comm_allreduce_sum(c, &one, 1));
            }
            ASSERT_OK(comm_barrier(c));
            t[mode] = (group_now_msec() - t0) * 1e3 / iters;
        }
        if (c->rank == 0)
            printf("%8d %10zu %14.1f %14.1f %14.1f\n", S, step_plan_packed_size(&p), t[0], t[1],
                   t[0] - t[1]);
        free(seqs);
        free(toks);
        free(bl);
    }
    step_plan_buf_done(&b);
    free(scratch);
    return 0;
}

/* One prefill plan of n image tokens, with and without its rows of width w. */
static int bench_plan_images(struct comm *c, void *arg)
{
    static const int widths[] = { 256, 4096 };
    const int n = 493, iters = 20;
    struct step_plan_limits lim = { .max_seqs = 1, .max_tokens = n, .vocab_size = 128000,
                                    .max_blocks = { 64, 64 }, .max_positions = 4096,
                                    .max_block_ids = 64, .block_size = 16, .max_mtp_depth = 3 };
    struct step_plan_buf b;
    struct err_buf e;
    int kind;

    step_plan_buf_init(&b);
    if (c->rank == 0) {
        printf("\nimage rows on the step plan, N=%d: one prefill plan of %d image tokens, "
               "best of %d\n", c->world_size, n, iters);
        printf("%8s %12s %12s %14s %14s %10s\n", "width", "bytes", "bytes bare", "ms/plan",
               "ms bare", "MB/s");
    }
    for (size_t k = 0; k < ARRAY_SIZE(widths); k++) {
        int w = widths[k];
        size_t cap;
        struct step_seq seq = { .slot = 0, .pos0 = 0, .n_tokens = n, .n_logits = 1, .tok_off = 0,
                                .n_blocks = (n + 15) / 16 };
        int32_t *toks = calloc((size_t)n, sizeof(int32_t)), *rows = calloc((size_t)n, 4);
        int32_t bl[64];
        float *emb = calloc((size_t)n * (size_t)w, sizeof(float));
        void *scratch;
        double best[2] = { 1e30, 1e30 };

        lim.img_width = w;
        cap = step_plan_max_packed_size(&lim);
        scratch = malloc(cap);
        ASSERT_TRUE(toks && rows && emb && scratch);
        for (int i = 0; i < n; i++) {
            toks[i] = 5;
            rows[i] = i;
        }
        for (size_t i = 0; i < (size_t)n * (size_t)w; i++)
            emb[i] = (float)(i % 1000) * 1e-3f;
        for (int i = 0; i < 64; i++)
            bl[i] = i;
        struct step_plan p = { .n_seqs = 1, .n_tokens = n, .seqs = &seq, .tokens = toks,
                               .n_block_ids = { seq.n_blocks, seq.n_blocks }, .blocks = { bl, bl },
                               .img_emb = emb, .img_row = rows, .n_img_emb = n, .img_width = w };
        size_t bytes[2];

        for (int mode = 0; mode < 2; mode++) {
            if (mode == 1)
                p.img_emb = NULL, p.img_row = NULL, p.n_img_emb = 0, p.img_width = 0;
            bytes[mode] = step_plan_packed_size(&p);
            for (int i = 0; i < iters; i++) {
                ASSERT_OK(comm_barrier(c));
                double t0 = group_now_msec();

                if (c->rank == 0) {
                    ASSERT_OK(comm_plan_send(c, &p, scratch, cap));
                } else if (comm_plan_recv(c, scratch, cap, &lim, &b, &kind, &e) < 0) {
                    FAIL("%s", e.msg);
                }
                ASSERT_OK(comm_barrier(c));
                double t = group_now_msec() - t0;
                if (t < best[mode])
                    best[mode] = t;
            }
        }
        if (c->rank == 0)
            printf("%8d %12zu %12zu %14.3f %14.3f %10.1f\n", w, bytes[0], bytes[1], best[0],
                   best[1], (double)(bytes[0] - bytes[1]) / ((best[0] - best[1]) * 1e3));
        free(toks);
        free(rows);
        free(emb);
        free(scratch);
    }
    step_plan_buf_done(&b);
    return 0;
}

int main(int argc, char **argv)
{
    static const int ns[] = { 2, 4 };
    struct group_ctl g;

    quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    if (argc > 1 && strcmp(argv[1], "--images") == 0) {
        ASSERT_OK(group_run(2, 60000, bench_plan_images, NULL, NULL, 600000, &g));
        for (int r = 0; r < 2; r++)
            if (!WIFEXITED(g.status[r]) || WEXITSTATUS(g.status[r]) != 0)
                FAIL("rank %d failed", r);
        return 0;
    }
    printf("ucx_perftest -t tag_bw on 127.0.0.1 (point-to-point bandwidth, same run):\n");
    /* best of 3: both sides busy-poll, so on a shared 2-core machine single runs are
     * at the mercy of the scheduler */
    for (size_t k = 0; k < ARRAY_SIZE(sizes); k++) {
        for (int rep = 0; rep < (quick ? 1 : 3); rep++) {
            double bw = perftest_bw(sizes[k]);

            if (bw > perftest_mbps[k])
                perftest_mbps[k] = bw;
        }
        printf("  %10zu bytes: %.1f MB/s\n", sizes[k], perftest_mbps[k]);
    }
    for (size_t k = 0; k < ARRAY_SIZE(ns); k++) {
        fflush(stdout);
        ASSERT_OK(group_run(ns[k], 60000, bench_allreduce, NULL, NULL, 600000, &g));
        fflush(stdout);
        ASSERT_OK(group_run(ns[k], 60000, bench_plan, NULL, NULL, 600000, &g));
        for (int r = 0; r < ns[k]; r++)
            if (!WIFEXITED(g.status[r]) || WEXITSTATUS(g.status[r]) != 0)
                FAIL("rank %d failed", r);
    }
    return 0;
}
