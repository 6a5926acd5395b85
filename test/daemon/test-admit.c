/* test-admit.c - admission control: running cap, bounded queue, priority order,
 * FIFO among equal priorities, cancellation while queued, promotion on release. */
#include "harness.h"
#include "admit.h"

int main(void)
{
    struct admit b;
    struct admit_item it[10] = { 0 };

    admit_init(&b, 2, 3);
    ASSERT_EQ(admit_add(&b, &it[0]), ADMIT_RUN);
    ASSERT_EQ(admit_add(&b, &it[1]), ADMIT_RUN);
    it[2].priority = 5;
    it[3].priority = 1;
    it[4].priority = 5;
    ASSERT_EQ(admit_add(&b, &it[2]), ADMIT_QUEUED);
    ASSERT_EQ(admit_add(&b, &it[3]), ADMIT_QUEUED);
    ASSERT_EQ(admit_add(&b, &it[4]), ADMIT_QUEUED);
    ASSERT_EQ(admit_add(&b, &it[5]), ADMIT_FULL);   /* queue full: refused at once */
    ASSERT_EQ(b.running, 2);
    ASSERT_EQ(b.queued, 3);
    unsigned pr, pq;                                    /* what other threads read */
    admit_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 2);
    ASSERT_EQ(pq, 3);
    /* release promotes the lowest priority value first, then FIFO */
    ASSERT_TRUE(admit_release(&b, &it[0]) == &it[3]);
    ASSERT_TRUE(it[3].running && !it[3].queued);
    /* a cancelled queued item frees its queue place */
    admit_remove(&b, &it[2]);
    ASSERT_EQ(b.queued, 1);
    admit_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 2);
    ASSERT_EQ(pq, 1);
    ASSERT_EQ(admit_add(&b, &it[6]), ADMIT_QUEUED);  /* priority 0 < 5 */
    ASSERT_TRUE(admit_release(&b, &it[1]) == &it[6]);
    ASSERT_TRUE(admit_release(&b, &it[3]) == &it[4]);
    ASSERT_TRUE(admit_release(&b, &it[6]) == NULL);
    ASSERT_TRUE(admit_release(&b, &it[4]) == NULL);
    ASSERT_EQ(b.running, 0);
    ASSERT_EQ(b.queued, 0);
    admit_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 0);
    ASSERT_EQ(pq, 0);
    /* a new arrival never jumps a non-empty queue even when a slot is free */
    admit_init(&b, 1, 2);
    ASSERT_EQ(admit_add(&b, &it[0]), ADMIT_RUN);
    ASSERT_EQ(admit_add(&b, &it[1]), ADMIT_QUEUED);
    b.max_running = 2;                                    /* capacity grew */
    ASSERT_EQ(admit_add(&b, &it[2]), ADMIT_QUEUED);
    ASSERT_TRUE(admit_pop(&b) == &it[1]);
    ASSERT_TRUE(admit_pop(&b) == &it[2]);
    ASSERT_TRUE(admit_pop(&b) == NULL);
    admit_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 1);
    ASSERT_EQ(pq, 0);
    printf("test-admit: all checks passed\n");
    return 0;
}
