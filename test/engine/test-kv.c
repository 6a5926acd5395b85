/* test-kv.c - the paged KV block manager: blocks cover exactly the positions asked for,
 * sliding blocks that fall out of the window go back to the pool at once, allocation is
 * all-or-nothing under pressure, and the accounting invariant holds after every call.
 * The prefix cache: a chain hit reuses exactly the blocks of the same prefix and always
 * leaves the last token to compute; the whole key is compared (prefixes forced to the
 * same digest never share, different roots never share); released blocks stay cached
 * and are evicted least recently released first, the chain's tail before its head,
 * before any allocation fails; sliding blocks are reused only with their whole window;
 * MTP-drafting sequences reuse only MTP-final blocks and stop short of the verified
 * chain by their depth; free + cached == total whenever nothing is held. */
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

/* ---------------------------------------------------------------- prefix cache -- */

static const uint8_t SALT[KV_DIGEST_BYTES] = { 7, 7, 7 };

static struct kv_pool *cache_pool(int bs, int nf, int ns, int window, int seqs, int len, int cut,
                                  bool mtp_sliding)
{
    struct kv_pool_config c = {
        .block_size = bs, .n_blocks = { nf, ns }, .sliding_window = window,
        .max_seqs = seqs, .max_seq_len = len, .prefix_cache = true,
        .mtp_group = { false, mtp_sliding }, .test_digest_cut_bits = cut,
    };
    struct kv_pool *kv = NULL;
    ASSERT_OK(kv_pool_new(&c, &kv));
    return kv;
}

static void root_of(const char *salt, uint8_t root[KV_DIGEST_BYTES])
{
    kv_prefix_root(SALT, salt, salt ? strlen(salt) : 0, root);
}

static uint8_t root[KV_DIGEST_BYTES];     /* the chains' root without a cache salt (main) */

/* run a whole sequence in slot: begin, grow over n tokens in chunks, commit each chunk
 * (MTP layers final up to the chunk end minus j + 1 when n_mtp > 0); returns the reuse */
static int32_t run_seq(struct kv_pool *kv, int slot, const uint8_t *root, const int32_t *tok,
                       int32_t n, int chunk, int n_mtp)
{
    int32_t cached = kv_seq_begin(kv, slot, root, tok, n, n_mtp, NULL);
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_TRUE(cached < n);
    ASSERT_TRUE(kv_seq_writable(kv, slot, cached));
    for (int32_t p = cached; p < n;) {
        int32_t e = p + chunk < n ? p + chunk : n;
        ASSERT_OK(kv_seq_grow(kv, slot, p, e));
        ASSERT_TRUE(kv_seq_writable(kv, slot, p));
        int32_t fin[3];
        for (int j = 0; j < n_mtp; j++)
            fin[j] = e - j - 1;
        kv_seq_commit(kv, slot, tok, e, fin, n_mtp);
        ASSERT_OK(kv_pool_check(kv));
        p = e;
    }
    return cached;
}

/* a[i] = mul * i + add for i < n */
static void seq_fill(int32_t *a, int n, int mul, int add)
{
    for (int i = 0; i < n; i++)
        a[i] = mul * i + add;
}

/* what kv_seq_begin reuses of a[0, n) for slot (MTP depth), the slot released again */
static int reuse_of(struct kv_pool *kv, int slot, const uint8_t *root, const int32_t *a, int n,
                    int depth)
{
    int r = kv_seq_begin(kv, slot, root, a, n, depth, NULL);
    kv_seq_release(kv, slot);
    return r;
}

static void idle_balanced(const struct kv_pool *kv)
{
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_TRUE(kv_pool_idle(kv));
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        ASSERT_EQ(kv_pool_held_count(kv, g), 0);
        ASSERT_EQ(kv_pool_free_count(kv, g) + kv_pool_cached_count(kv, g), kv_pool_total(kv, g));
    }
}

/* the idle balance (idle_balanced), then free */
static void pool_done(struct kv_pool *kv)
{
    idle_balanced(kv);
    kv_pool_free(kv);
}

static void test_prefix_hit(void)
{
    struct kv_pool *kv = cache_pool(4, 32, 32, 0, 3, 128, 0, false);
    int32_t a[24], b[24];
    int n;
    for (int i = 0; i < 24; i++)
        a[i] = b[i] = 100 + i;
    b[14] = 7;                                     /* differs in block 3 */
    ASSERT_EQ(run_seq(kv, 0, root, a, 20, 8, 0), 0);
    int32_t ta[5];
    memcpy(ta, kv_seq_table(kv, 0, KV_GROUP_FULL, &n), sizeof(ta));
    kv_seq_release(kv, 0);
    idle_balanced(kv);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 5);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_SLIDING), 5);
    /* same 20 tokens: 4 blocks back, the last token is always computed */
    ASSERT_EQ(kv_seq_begin(kv, 1, root, a, 20, 0, NULL), 16);
    const int32_t *t = kv_seq_table(kv, 1, KV_GROUP_FULL, &n);
    ASSERT_EQ(n, 4);
    for (int i = 0; i < 4; i++)
        ASSERT_EQ(t[i], ta[i]);
    ASSERT_TRUE(kv_seq_writable(kv, 1, 16));
    ASSERT_TRUE(!kv_seq_writable(kv, 1, 15));      /* the cached blocks are not its own */
    ASSERT_OK(kv_seq_grow(kv, 1, 16, 21));
    ASSERT_OK(kv_pool_check(kv));
    /* a prefix that differs in block 3 shares blocks 0..2 only, while slot 1 holds them */
    ASSERT_EQ(kv_seq_begin(kv, 2, root, b, 24, 0, NULL), 12);
    t = kv_seq_table(kv, 2, KV_GROUP_FULL, &n);
    ASSERT_EQ(n, 3);
    ASSERT_EQ(t[2], ta[2]);
    ASSERT_OK(kv_pool_check(kv));
    /* another salt shares nothing */
    uint8_t other[KV_DIGEST_BYTES];
    root_of("tenant-b", other);
    kv_seq_release(kv, 2);
    ASSERT_EQ(kv_seq_begin(kv, 2, other, a, 20, 0, NULL), 0);
    ASSERT_EQ(kv_seq_begin(kv, 2, NULL, a, 20, 0, NULL), 0);      /* no root: no lookup */
    /* with the cache off nothing is kept */
    kv_seq_release(kv, 1);
    kv_seq_release(kv, 2);
    pool_done(kv);
    kv = pool(4, 32, 32, 0, 2, 128);
    ASSERT_EQ(run_seq(kv, 0, root, a, 20, 8, 0), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 0);
    ASSERT_EQ(kv_seq_begin(kv, 0, root, a, 20, 0, NULL), 0);
    pool_done(kv);
}

/* every digest cut to zero: only the whole key tells prefixes apart */
static void test_forced_collisions(void)
{
    struct kv_pool *kv = cache_pool(4, 64, 64, 0, 4, 128, 256, false);
    uint8_t other[KV_DIGEST_BYTES];
    int32_t p1[12], p2[12], p3[12];
    int n;
    root_of("tenant-b", other);
    /* p1, p2: different block 0, the same blocks 1 and 2; p3: p1 with block 1 changed */
    for (int i = 0; i < 12; i++)
        p1[i] = p2[i] = p3[i] = 50 + i;
    p2[1] = 9;
    p3[5] = 9;
    ASSERT_EQ(run_seq(kv, 0, root, p1, 12, 12, 0), 0);
    ASSERT_EQ(run_seq(kv, 1, root, p2, 12, 12, 0), 0);      /* nothing of p1 fits */
    ASSERT_EQ(run_seq(kv, 2, root, p3, 12, 12, 0), 4);      /* block 0 of p1 only */
    ASSERT_EQ(run_seq(kv, 3, other, p1, 12, 12, 0), 0);     /* same tokens, other salt */
    int32_t t[4][3];
    for (int s = 0; s < 4; s++)
        memcpy(t[s], kv_seq_table(kv, s, KV_GROUP_FULL, &n), sizeof(t[s]));
    ASSERT_EQ(t[2][0], t[0][0]);
    for (int b = 0; b < 3; b++) {
        ASSERT_NE(t[1][b], t[0][b]);
        ASSERT_NE(t[3][b], t[0][b]);
        ASSERT_NE(t[3][b], t[1][b]);
    }
    ASSERT_NE(t[2][1], t[0][1]);
    for (int s = 0; s < 4; s++)
        kv_seq_release(kv, s);
    idle_balanced(kv);
    /* each prefix finds its own chain (12 cached blocks, all in one bucket) */
    const int32_t *want[4] = { t[0], t[1], t[2], t[3] };
    const int32_t *prm[4] = { p1, p2, p3, p1 };
    for (int s = 0; s < 4; s++) {
        ASSERT_EQ(kv_seq_begin(kv, s, s == 3 ? other : root, prm[s], 12, 0, NULL), 8);
        const int32_t *got = kv_seq_table(kv, s, KV_GROUP_FULL, &n);
        ASSERT_EQ(n, 2);
        ASSERT_EQ(got[0], want[s][0]);
        ASSERT_EQ(got[1], want[s][1]);
    }
    ASSERT_OK(kv_pool_check(kv));
    for (int s = 0; s < 4; s++)
        kv_seq_release(kv, s);
    pool_done(kv);
}

/* released blocks are cached until space is needed; the least recently released go
 * first, a chain's tail before its head; nothing fails while cached blocks remain */
static void test_lru_eviction(void)
{
    struct kv_pool *kv = cache_pool(4, 8, 8, 0, 2, 64, 0, false);
    int32_t a[33], b[32], c[32];        /* a: 32 tokens from a + 1 below */
    for (int i = 0; i < 32; i++) {
        a[i] = i;
        b[i] = 1000 + i;
        c[i] = 2000 + i;
    }
    a[32] = 32;
    ASSERT_EQ(run_seq(kv, 0, root, a, 16, 16, 0), 0);     /* 4 blocks */
    kv_seq_release(kv, 0);
    ASSERT_EQ(run_seq(kv, 0, root, b, 16, 16, 0), 0);     /* 4 more: pool full */
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_pool_free_count(kv, KV_GROUP_FULL), 0);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 8);
    /* 2 blocks for c evict a's last two blocks (released first, tail first) */
    ASSERT_EQ(run_seq(kv, 0, root, c, 8, 8, 0), 0);
    ASSERT_EQ(kv_pool_evictions(kv), 2);      /* their sliding blocks are dropped with them */
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_SLIDING), 6);
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_seq_begin(kv, 0, root, a, 16, 0, NULL), 8);    /* a keeps blocks 0 and 1 */
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_seq_begin(kv, 0, root, b, 16, 0, NULL), 12);   /* b intact */
    kv_seq_release(kv, 0);
    idle_balanced(kv);
    /* a sequence of the whole pool evicts everything rather than failing */
    ASSERT_EQ(run_seq(kv, 1, root, a + 1, 32, 32, 0), 0);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 0);
    kv_seq_release(kv, 1);
    pool_done(kv);
}

/* sliding blocks: cached as the window moves on, reused only with a complete window */
static void test_sliding_prefix(void)
{
    struct kv_pool *kv = cache_pool(4, 64, 10, 8, 2, 256, 0, false);
    int32_t a[64], filler[32];
    int n;
    seq_fill(a, 64, 3, 1);
    seq_fill(filler, 32, 1, 5000);
    /* 40 tokens in chunks of 4: sliding blocks 0..6 are released (cached) on the way, in
     * that order, then 9, 8, 7 at the end: the LRU order is 0 1 2 3 4 5 6 9 8 7 */
    ASSERT_EQ(run_seq(kv, 0, root, a, 40, 4, 0), 0);
    ASSERT_LE(kv_seq_held(kv, 0, KV_GROUP_SLIDING), 4);
    int32_t sl[10];
    memcpy(sl, kv_seq_table(kv, 0, KV_GROUP_SLIDING, &n), sizeof(sl));
    ASSERT_EQ(sl[0], -1);
    kv_seq_release(kv, 0);
    idle_balanced(kv);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_SLIDING), 10);
    /* a 32-token prefill needs 8 sliding blocks and none is plain free: it evicts the 8
     * least recently released (0..6, then 9); the FULL blocks stay cached */
    ASSERT_EQ(run_seq(kv, 0, NULL, filler, 32, 32, 0), 0);
    ASSERT_EQ(kv_pool_evictions(kv), 8);
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 10);
    /* 41 tokens: at 40 the window (8) needs sliding blocks 8 and 9, and 9 is gone; at 36
     * it needs 7 and 8: reuse 36 */
    ASSERT_EQ(kv_seq_begin(kv, 1, root, a, 41, 0, NULL), 36);
    const int32_t *t = kv_seq_table(kv, 1, KV_GROUP_SLIDING, &n);
    ASSERT_EQ(n, 9);
    for (int b = 0; b < 7; b++)
        ASSERT_EQ(t[b], -1);
    ASSERT_EQ(t[7], sl[7]);
    ASSERT_EQ(t[8], sl[8]);
    ASSERT_EQ(kv_seq_held(kv, 1, KV_GROUP_SLIDING), 2);
    ASSERT_OK(kv_seq_grow(kv, 1, 36, 41));
    ASSERT_OK(kv_pool_check(kv));
    kv_seq_release(kv, 1);
    pool_done(kv);

    /* without evictions the whole chain: 40 tokens, window blocks 8 and 9 */
    kv = cache_pool(4, 64, 10, 8, 2, 256, 0, false);
    ASSERT_EQ(run_seq(kv, 0, root, a, 40, 4, 0), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_seq_begin(kv, 1, root, a, 41, 0, NULL), 40);
    t = kv_seq_table(kv, 1, KV_GROUP_SLIDING, &n);
    ASSERT_EQ(n, 10);
    ASSERT_EQ(t[7], -1);
    ASSERT_EQ(t[8], sl[8]);
    ASSERT_EQ(t[9], sl[9]);
    kv_seq_release(kv, 1);
    pool_done(kv);
}

/* MTP: a drafting sequence reuses only blocks whose MTP layers are final for its depth,
 * and stops short of the verified chain by its depth */
static void test_mtp_prefix(void)
{
    struct kv_pool *kv = cache_pool(4, 64, 64, 0, 2, 256, 0, true);
    int32_t a[40];
    seq_fill(a, 40, 11, 3);
    /* written without MTP: trunk reuse only */
    ASSERT_EQ(run_seq(kv, 0, root, a, 24, 8, 0), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(reuse_of(kv, 0, root, a, 24, 0), 20);
    ASSERT_EQ(reuse_of(kv, 0, root, a, 24, 2), 0);
    /* a sequence drafting 2 computes it again: its blocks replace the cached copies */
    ASSERT_EQ(run_seq(kv, 0, root, a, 24, 8, 2), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(reuse_of(kv, 0, root, a, 40, 2), 20);
    pool_done(kv);

    kv = cache_pool(4, 64, 64, 0, 2, 256, 0, true);
    /* written with 2 MTP layers final up to e - j - 1 (run_seq): blocks 0..4 hold 2 */
    ASSERT_EQ(run_seq(kv, 0, root, a, 24, 8, 2), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(reuse_of(kv, 0, root, a, 24, 0), 20);
    /* depth 2: the chain verifies 6 blocks but the MTP KV of position 23 read tokens 24, 25:
     * reuse 5 blocks at most, and block 5 holds only 0 final layers anyway */
    ASSERT_EQ(reuse_of(kv, 0, root, a, 40, 2), 20);
    /* depth 3 needs 3 final layers: none holds them */
    ASSERT_EQ(reuse_of(kv, 0, root, a, 40, 3), 0);
    /* a prompt that ends inside the chain: reuse at most up to 4 tokens before its end */
    ASSERT_EQ(reuse_of(kv, 0, root, a, 13, 2), 8);
    pool_done(kv);
}

/* what a sequence whose output does not depend on its drafts reuses of a[0, n) (the
 * trunk's prefix), and how far the MTP KV of `depth` layers is final for it */
static int trunk_reuse_of(struct kv_pool *kv, const int32_t *a, int n, int depth,
                          int32_t *ret_mtp_final)
{
    int r = kv_seq_begin(kv, 0, root, a, n, depth, ret_mtp_final);
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_TRUE(kv_seq_writable(kv, 0, r));
    kv_seq_release(kv, 0);
    return r;
}

/* MTP, trunk only: blocks written without MTP KV (a step whose policy drafted nothing)
 * are reused by a drafting sequence that may read holes, with no MTP KV final; blocks
 * with final MTP KV report it up to the strict reuse */
static void test_mtp_trunk_only(void)
{
    struct kv_pool *kv = cache_pool(4, 64, 64, 0, 2, 256, 0, true);
    int32_t a[40], fin = -1;
    seq_fill(a, 40, 13, 5);
    ASSERT_EQ(run_seq(kv, 0, root, a, 24, 8, 0), 0);
    kv_seq_release(kv, 0);
    ASSERT_EQ(trunk_reuse_of(kv, a, 24, 2, &fin), 20);
    ASSERT_EQ(fin, 0);
    ASSERT_EQ(trunk_reuse_of(kv, a, 40, 3, &fin), 24);  /* the whole chain, past the bound */
    ASSERT_EQ(fin, 0);
    ASSERT_EQ(reuse_of(kv, 0, root, a, 40, 2), 0);      /* strict: still nothing */
    pool_done(kv);

    kv = cache_pool(4, 64, 64, 0, 2, 256, 0, true);
    ASSERT_EQ(run_seq(kv, 0, root, a, 24, 8, 2), 0);     /* blocks 0..4 hold 2 final layers */
    kv_seq_release(kv, 0);
    ASSERT_EQ(trunk_reuse_of(kv, a, 40, 2, &fin), 24);
    ASSERT_EQ(fin, 20);
    ASSERT_EQ(trunk_reuse_of(kv, a, 40, 3, &fin), 24);
    ASSERT_EQ(fin, 0);
    ASSERT_EQ(trunk_reuse_of(kv, a, 13, 2, &fin), 12);
    ASSERT_EQ(fin, 8);
    ASSERT_EQ(trunk_reuse_of(kv, a, 40, 0, &fin), 24);
    ASSERT_EQ(fin, 24);
    pool_done(kv);
}

/* two slots hold the same cached blocks; an identical prefix computed twice at once is
 * indexed once, the second copy is freed on release */
static void test_shared_and_duplicates(void)
{
    struct kv_pool *kv = cache_pool(4, 32, 32, 0, 3, 128, 0, false);
    int32_t a[16];
    seq_fill(a, 16, 1, 40);
    ASSERT_EQ(kv_seq_begin(kv, 0, root, a, 16, 0, NULL), 0);
    ASSERT_EQ(kv_seq_begin(kv, 1, root, a, 16, 0, NULL), 0);
    ASSERT_OK(kv_seq_grow(kv, 0, 0, 16));
    ASSERT_OK(kv_seq_grow(kv, 1, 0, 16));
    kv_seq_commit(kv, 0, a, 16, NULL, 0);
    kv_seq_commit(kv, 1, a, 16, NULL, 0);
    ASSERT_OK(kv_pool_check(kv));
    ASSERT_EQ(kv_seq_begin(kv, 2, root, a, 16, 0, NULL), 12);
    ASSERT_EQ(kv_pool_held_count(kv, KV_GROUP_FULL), 8);     /* shared, not copied */
    kv_seq_release(kv, 0);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 1);   /* block 3 of slot 0 */
    kv_seq_release(kv, 1);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 1);   /* slot 1's copy is not kept */
    ASSERT_EQ(kv_pool_free_count(kv, KV_GROUP_FULL), 28);
    ASSERT_OK(kv_pool_check(kv));
    kv_seq_release(kv, 2);
    idle_balanced(kv);
    ASSERT_EQ(kv_pool_cached_count(kv, KV_GROUP_FULL), 4);
    kv_pool_free(kv);
}

int main(void)
{
    root_of(NULL, root);
    test_bad_config();
    test_grow_release();
    test_all_or_nothing();
    test_sliding_release();
    test_sliding_need_reuses_released();
    test_prefix_hit();
    test_forced_collisions();
    test_lru_eviction();
    test_sliding_prefix();
    test_mtp_prefix();
    test_mtp_trunk_only();
    test_shared_and_duplicates();
    printf("kv: ok\n");
    return 0;
}
