/* test-affinity.c - the prefix-affinity table: its keys are the prefix chain (common/
 * prefix.h, the engines' KV-block keys: block b's key is the first 8 bytes of d_b, salted by
 * cache_salt, equal for equal prefixes and different after the first differing block);
 * find returns the group of the DEEPEST recorded key that the caller accepts (skipping
 * groups it refuses) with its depth; note moves a prefix to its new group; the table keeps
 * at most its capacity, evicting the least recently used keys (a found key is refreshed). */
#include <string.h>

#include "affinity.h"
#include "harness.h"
#include "prefix.h"

static uint64_t refused;

static bool usable(uint64_t g, void *ctx)
{
    (void)ctx;
    return g != refused;
}

int main(void)
{
    int32_t p[64], q[64];
    uint64_t kp[8], kq[8], ks[8];
    uint8_t d[PREFIX_DIGEST_BYTES];
    static const uint8_t zero[PREFIX_DIGEST_BYTES];
    struct affinity *a;
    size_t depth, n;

    for (int i = 0; i < 64; i++)
        p[i] = q[i] = 1000 + i;
    q[40] = 7;                                  /* q differs from p in block 2 (of 16) */
    ASSERT_EQ(affinity_chain(p, 64, 16, "", kp, 8), 4);
    ASSERT_EQ(affinity_chain(q, 63, 16, "", kq, 8), 3);   /* full blocks only */
    ASSERT_EQ(affinity_chain(p, 64, 16, "tenant", ks, 8), 4);
    /* the chain is prefix.h's, as the engine computes it */
    prefix_root(zero, "", 0, d);
    for (int b = 0; b < 4; b++) {
        uint64_t k;

        prefix_block_digest(d, p + 16 * b, 16, d);
        memcpy(&k, d, sizeof(k));
        ASSERT_TRUE(k == kp[b]);
    }
    ASSERT_TRUE(kp[0] == kq[0] && kp[1] == kq[1] && kp[2] != kq[2]);
    for (int b = 0; b < 4; b++)
        ASSERT_TRUE(ks[b] != kp[b]);            /* cache_salt isolates */

    ASSERT_OK(affinity_new(0, &a));
    ASSERT_TRUE(a == NULL);                     /* off */
    ASSERT_EQ(affinity_find(NULL, kp, 4, usable, NULL, &depth), 0);
    ASSERT_OK(affinity_new(6, &a));
    affinity_note(a, kp, 4, 11);                /* group 11 served p */
    ASSERT_EQ(affinity_find(a, kq, 3, usable, NULL, &depth), 11);
    ASSERT_EQ(depth, 2);                        /* q shares p's first two blocks */
    affinity_note(a, kq, 3, 22);                /* q went to 22: its blocks 0-1 move there */
    ASSERT_EQ(affinity_find(a, kp, 4, usable, NULL, &depth), 11);
    ASSERT_EQ(depth, 4);
    refused = 11;                               /* 11 cannot take it: the deepest usable */
    ASSERT_EQ(affinity_find(a, kp, 4, usable, NULL, &depth), 22);
    ASSERT_EQ(depth, 2);
    refused = 0;
    ASSERT_EQ(affinity_size(a), 5);             /* kp 0..3 and kq[2] */
    /* capacity 6: two more keys evict one, the least recently used: kp[2] (noted first of
     * all; the finds refreshed kp[3] and kp[1], the notes kp[0] and kq[2]; a refused hit
     * refreshes nothing) */
    affinity_note(a, ks, 2, 33);
    ASSERT_EQ(affinity_size(a), 6);
    ASSERT_EQ(affinity_find(a, &kp[2], 1, usable, NULL, &depth), 0);
    n = 0;
    for (int b = 0; b < 4; b++)
        n += affinity_find(a, &kp[b], 1, usable, NULL, &depth) != 0;
    n += affinity_find(a, &kq[2], 1, usable, NULL, &depth) != 0;
    n += affinity_find(a, ks, 2, usable, NULL, &depth) == 33;
    ASSERT_EQ(n, 5);
    affinity_free(a);
    printf("affinity: ok\n");
    return 0;
}
