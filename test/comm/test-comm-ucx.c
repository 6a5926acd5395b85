/* test-comm-ucx.c - UCX collectives on N = 2, 3, 4 forked ranks against a serial
 * reference: odd sizes on both sides of the recursive-doubling / ring switch, every
 * root, variable-length broadcast, the step-plan broadcast, bit-identical results on all
 * ranks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "comm.h"
#include "group.h"
#include "harness.h"

static float ival(int rank, size_t i)
{
    /* small integers: sums are exact in FP32 whatever the order */
    return (float)((int)((rank * 7919u + i * 104729u) % 201u) - 100);
}

static float rval(int rank, size_t i)
{
    uint64_t x = (uint64_t)rank * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + 1;

    x ^= x >> 31;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 29;
    return (float)((double)(x >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

static uint64_t fnv(const void *p, size_t n)
{
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ull;

    for (size_t i = 0; i < n; i++)
        h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

static void check_identical(struct comm *c, const void *buf, size_t n)
{
    uint64_t h = fnv(buf, n), all[16];

    ASSERT_OK(comm_allgather(c, &h, all, sizeof(h)));
    for (int r = 0; r < c->world_size; r++)
        if (all[r] != h)
            FAIL("rank %d's result differs from rank %d's", r, c->rank);
}

static const size_t sizes[] = { 1, 2, 3, 7, 1000, 1023, 16384, 16385, 65537, 262147 };

static void t_allreduce(struct comm *c)
{
    int n = c->world_size;

    for (size_t k = 0; k < ARRAY_SIZE(sizes); k++) {
        size_t cnt = sizes[k];
        float *buf = malloc(cnt * sizeof(float));

        ASSERT_TRUE(buf);
        for (size_t i = 0; i < cnt; i++)
            buf[i] = ival(c->rank, i);
        ASSERT_OK(comm_allreduce_sum(c, buf, cnt));
        for (size_t i = 0; i < cnt; i++) {
            float ref = 0;

            for (int r = 0; r < n; r++)
                ref += ival(r, i);
            if (buf[i] != ref)
                FAIL("N=%d count=%zu: buf[%zu] = %g, expected %g", n, cnt, i, buf[i], ref);
        }
        /* non-integer data: within rounding of the double sum, identical on all ranks */
        for (size_t i = 0; i < cnt; i++)
            buf[i] = rval(c->rank, i);
        ASSERT_OK(comm_allreduce_sum(c, buf, cnt));
        for (size_t i = 0; i < cnt; i++) {
            double ref = 0;

            for (int r = 0; r < n; r++)
                ref += rval(r, i);
            ASSERT_NEAR(buf[i], ref, 1e-5);
        }
        check_identical(c, buf, cnt * sizeof(float));
        free(buf);
    }
}

static void t_allgather(struct comm *c)
{
    static const size_t nb[] = { 1, 5, 4099, 100003 };
    int n = c->world_size;

    for (size_t k = 0; k < ARRAY_SIZE(nb); k++) {
        unsigned char *send = malloc(nb[k]), *recv = malloc(nb[k] * (size_t)n);

        ASSERT_TRUE(send && recv);
        for (size_t i = 0; i < nb[k]; i++)
            send[i] = (unsigned char)(c->rank * 31 + i * 7);
        ASSERT_OK(comm_allgather(c, send, recv, nb[k]));
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < nb[k]; i++)
                if (recv[(size_t)r * nb[k] + i] != (unsigned char)(r * 31 + i * 7))
                    FAIL("allgather N=%d nbytes=%zu: block %d byte %zu wrong", n, nb[k], r, i);
        /* in place: send aliases recv + rank * nbytes */
        memset(recv, 0, nb[k] * (size_t)n);
        memcpy(recv + (size_t)c->rank * nb[k], send, nb[k]);
        ASSERT_OK(comm_allgather(c, recv + (size_t)c->rank * nb[k], recv, nb[k]));
        for (int r = 0; r < n; r++)
            ASSERT_EQ(recv[(size_t)r * nb[k] + nb[k] - 1], (unsigned char)(r * 31 + (nb[k] - 1) * 7));
        free(send);
        free(recv);
    }
}

static void t_broadcast(struct comm *c)
{
    static const size_t nb[] = { 1, 13, 100003 };

    for (int root = 0; root < c->world_size; root++)
        for (size_t k = 0; k < ARRAY_SIZE(nb); k++) {
            unsigned char *buf = calloc(1, nb[k]);

            ASSERT_TRUE(buf);
            if (c->rank == root)
                for (size_t i = 0; i < nb[k]; i++)
                    buf[i] = (unsigned char)(root + i);
            ASSERT_OK(comm_broadcast(c, buf, nb[k], root));
            for (size_t i = 0; i < nb[k]; i++)
                ASSERT_EQ(buf[i], (unsigned char)(root + i));
            free(buf);
        }
    /* variable length: receivers learn the length */
    for (size_t len = 0; len < 3000; len += 997) {
        unsigned char buf[4096] = { 0 };
        size_t got = len;

        if (c->rank == 0)
            memset(buf, 0xa5, len);
        ASSERT_OK(comm_broadcast_var(c, buf, &got, sizeof(buf), 0));
        ASSERT_EQ(got, len);
        for (size_t i = 0; i < len; i++)
            ASSERT_EQ(buf[i], 0xa5);
    }
}

static void t_plan(struct comm *c)
{
    struct step_seq seqs[3] = {
        { .slot = 4, .pos0 = 0, .n_tokens = 5, .n_logits = 1, .tok_off = 0, .n_blocks = 1,
          .block_off = { 0, 0 }, .mtp_depth = 3 },
        { .slot = 0, .pos0 = 37, .n_tokens = 1, .n_logits = 1, .tok_off = 5, .n_blocks = 3,
          .block_off = { 1, 1 }, .mtp_depth = 0 },
        { .slot = 2, .pos0 = 16, .n_tokens = 4, .n_logits = 4, .tok_off = 6, .n_blocks = 2,
          .block_off = { 4, 4 }, .mtp_depth = 2 },
    };
    int32_t toks[10] = { 1, 2, 3, 4, 5, 99, 7, 8, 9, 10 };
    int32_t full[6] = { 0, 1, 2, 3, 4, 5 }, sl[6] = { 0, -1, 6, 7, 8, 9 };
    struct step_plan p = { .step_id = 77, .n_seqs = 3, .n_tokens = 10, .seqs = seqs, .tokens = toks,
                           .n_block_ids = { 6, 6 }, .blocks = { full, sl } };
    struct step_plan_limits lim = { .max_seqs = 8, .max_tokens = 64, .vocab_size = 128,
                                    .max_blocks = { 16, 16 }, .max_positions = 256,
                                    .max_block_ids = 64, .block_size = 16, .max_mtp_depth = 3 };
    size_t cap = step_plan_max_packed_size(&lim);
    void *scratch = malloc(cap);
    struct step_plan_buf b;
    struct err_buf e = { "" };
    int kind = 0;

    ASSERT_TRUE(scratch);
    step_plan_buf_init(&b);
    for (int it = 0; it < 3; it++) {
        p.step_id = 77 + (uint64_t)it;
        if (c->rank == 0) {
            ASSERT_OK(comm_plan_send(c, &p, scratch, cap));
            continue;
        }
        int r = comm_plan_recv(c, scratch, cap, &lim, &b, &kind, &e);
        if (r < 0)
            FAIL("plan recv: %s", e.msg);
        ASSERT_EQ(kind, PLAN_MSG_STEP);
        ASSERT_EQ(b.plan.step_id, 77 + it);
        ASSERT_EQ(b.plan.n_seqs, 3);
        ASSERT_TRUE(memcmp(b.plan.seqs, seqs, sizeof(seqs)) == 0);
        ASSERT_TRUE(memcmp(b.plan.tokens, toks, sizeof(toks)) == 0);
        ASSERT_TRUE(memcmp(b.plan.blocks[1], sl, sizeof(sl)) == 0);
    }
    if (c->rank == 0) {
        ASSERT_OK(comm_plan_send_stop(c, scratch, cap));
    } else {
        ASSERT_OK(comm_plan_recv(c, scratch, cap, &lim, &b, &kind, &e));
        ASSERT_EQ(kind, PLAN_MSG_STOP);
    }
    step_plan_buf_done(&b);
    free(scratch);
}

static int rank_main(struct comm *c, void *arg)
{
    ASSERT_STREQ(c->ops->name, "ucx");
    t_allreduce(c);
    t_allgather(c);
    t_broadcast(c);
    t_plan(c);
    ASSERT_OK(comm_barrier(c));
    ASSERT_EQ(c->error, 0);
    return 0;
}

int main(void)
{
    static const int ns[] = { 2, 3, 4 };

    for (size_t k = 0; k < ARRAY_SIZE(ns); k++) {
        struct group_ctl g;
        double t0 = group_now_msec();

        ASSERT_OK(group_run(ns[k], 30000, rank_main, NULL, NULL, 120000, &g));
        for (int r = 0; r < ns[k]; r++)
            if (!WIFEXITED(g.status[r]) || WEXITSTATUS(g.status[r]) != 0)
                FAIL("N=%d: rank %d ended with status 0x%x", ns[k], r, g.status[r]);
        printf("N=%d: all collectives match the serial reference (%.0f ms)\n", ns[k],
               group_now_msec() - t0);
    }
    return 0;
}
