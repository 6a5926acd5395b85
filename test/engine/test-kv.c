/* test-kv.c - the paged KV block manager: blocks cover exactly the positions asked for,
 * sliding blocks that fall out of the window go back to the pool at once, allocation is
 * all-or-nothing under pressure, and the accounting invariant holds after every call. */
#include <errno.h>

#include "harness.h"
#include "kv.h"

static struct kv_pool *pool(int bs, int nf, int ns, int window, int seqs, int len)
{
    struct kv_pool_config c = {
        .block_size = bs, .n_blocks = { nf, ns }, .sliding_window = window,
        .max_seqs = seqs, .max_seq_len = len,
    };
    struct kv_pool *kv = NULL;
    ASSERT_OK(kv_pool_new(&c, &kv));
    return kv;
}

static void test_bad_config(void)
{
    struct kv_pool_config c = { .block_size = 0, .n_blocks = { 4, 4 }, .max_seqs = 1, .max_seq_len = 8 };
    struct kv_pool *kv = NULL;
    ASSERT_ERR(kv_pool_new(&c, &kv), -EINVAL);
    c.block_size = 4;
    c.n_blocks[1] = 0;
    ASSERT_ERR(kv_pool_new(&c, &kv), -EINVAL);
    c.n_blocks[1] = 4;
    c.sliding_window = -1;
    ASSERT_ERR(kv_pool_new(&c, &kv), -EINVAL);
}

static void test_grow_release(void)
{
    struct kv_pool *kv = pool(16, 8, 8, 0, 2, 128);
    ASSERT_TRUE(kv_pool_idle(kv));
    ASSERT_OK(kv_seq_grow(kv, 0, 0, 17));          /* positions 0..16 -> 2 blocks */
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_FULL), 2);
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 2);
    ASSERT_EQ(kv_pool_free_count(kv, KV_GROUP_FULL), 6);
    int n;
    const int32_t *t = kv_seq_table(kv, 0, KV_GROUP_FULL, &n);
    ASSERT_EQ(n, 2);
    ASSERT_TRUE(t[0] >= 0 && t[1] >= 0 && t[0] != t[1]);
    ASSERT_OK(kv_seq_grow(kv, 0, 17, 32));         /* still 2 blocks */
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_FULL), 2);
    ASSERT_OK(kv_seq_grow(kv, 1, 0, 40));          /* 3 blocks for slot 1 */
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_EQ(kv_pool_free_count(kv, KV_GROUP_FULL), 3);
    ASSERT_NEAR(kv_pool_usage(kv), 10.0 / 16.0, 1e-9);
    kv_seq_release(kv, 0);
    kv_seq_release(kv, 1);
    kv_seq_release(kv, 1);                         /* idempotent */
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_TRUE(kv_pool_idle(kv));
    ASSERT_ERR(kv_seq_grow(kv, 0, 0, 129), -E2BIG);
    ASSERT_ERR(kv_seq_grow(kv, 5, 0, 1), -EINVAL);
    kv_pool_free(kv);
}

static void test_all_or_nothing(void)
{
    struct kv_pool *kv = pool(4, 4, 4, 0, 2, 64);
    ASSERT_OK(kv_seq_grow(kv, 0, 0, 12));          /* 3 of 4 */
    int need[_KV_GROUP_MAX];
    kv_seq_need(kv, 1, 0, 8, need);
    ASSERT_EQ(need[KV_GROUP_FULL], 2);
    ASSERT_ERR(kv_seq_grow(kv, 1, 0, 8), -ENOSPC);
    ASSERT_EQ(kv_seq_held(kv, 1, KV_GROUP_FULL), 0);   /* nothing half-allocated */
    ASSERT_EQ(kv_pool_free_count(kv, KV_GROUP_FULL), 1);
    ASSERT_OK(kv_seq_grow(kv, 1, 0, 4));
    ASSERT_OK(kv_pool_check(kv));
    kv_seq_release(kv, 0);
    kv_seq_release(kv, 1);
    ASSERT_TRUE(kv_pool_idle(kv));
    kv_pool_free(kv);
}

/* window 8, block 4: computing position p needs keys p-7 .. p */
static void test_sliding_release(void)
{
    struct kv_pool *kv = pool(4, 64, 64, 8, 1, 256);
    ASSERT_OK(kv_seq_grow(kv, 0, 0, 20));          /* prefill 0..19: 5 blocks */
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 5);
    /* decode position 20: keys 13..20 -> blocks 3..5; blocks 0..2 released */
    ASSERT_OK(kv_seq_grow(kv, 0, 20, 21));
    int n;
    const int32_t *t = kv_seq_table(kv, 0, KV_GROUP_SLIDING, &n);
    ASSERT_EQ(n, 6);
    ASSERT_EQ(t[0], -1);
    ASSERT_EQ(t[1], -1);
    ASSERT_EQ(t[2], -1);
    ASSERT_TRUE(t[3] >= 0 && t[4] >= 0 && t[5] >= 0);
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 3);
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_FULL), 6);
    ASSERT_OK(kv_pool_check(kv));
    /* a long decode holds a bounded number of sliding blocks */
    for (int p = 21; p < 200; p++) {
        ASSERT_OK(kv_seq_grow(kv, 0, p, p + 1));
        ASSERT_LE(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 4);
    }
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_FULL), 50);
    ASSERT_OK(kv_pool_check(kv));
    /* a big jump (prefill chunk far ahead) never allocates blocks already out of the window */
    kv_seq_release(kv, 0);
    ASSERT_OK(kv_seq_grow(kv, 0, 0, 4));
    ASSERT_OK(kv_seq_grow(kv, 0, 100, 104));
    t = kv_seq_table(kv, 0, KV_GROUP_SLIDING, &n);
    ASSERT_EQ(n, 26);
    ASSERT_EQ(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 3);   /* blocks 23..25 */
    ASSERT_OK(kv_pool_check(kv));
    kv_seq_release(kv, 0);
    ASSERT_TRUE(kv_pool_idle(kv));
    kv_pool_free(kv);
}

/* the sliding pool can be much smaller than the full one */
static void test_sliding_need_reuses_released(void)
{
    struct kv_pool *kv = pool(4, 64, 3, 4, 1, 256);
    for (int p = 0; p < 100; p++) {
        int need[_KV_GROUP_MAX];
        kv_seq_need(kv, 0, p, p + 1, need);
        ASSERT_LE(need[KV_GROUP_SLIDING], kv_pool_free_count(kv, KV_GROUP_SLIDING));
        ASSERT_OK(kv_seq_grow(kv, 0, p, p + 1));
    }
    ASSERT_OK(kv_pool_check(kv));
    kv_seq_release(kv, 0);
    ASSERT_TRUE(kv_pool_idle(kv));
    kv_pool_free(kv);
}

int main(void)
{
    test_bad_config();
    test_grow_release();
    test_all_or_nothing();
    test_sliding_release();
    test_sliding_need_reuses_released();
    printf("kv: ok\n");
    return 0;
}
