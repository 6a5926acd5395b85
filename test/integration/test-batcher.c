/* test-batcher.c - admission control: running cap, bounded queue, priority order,
 * FIFO among equal priorities, cancellation while queued, promotion on release. */
#include "harness.h"
#include "batcher.h"

int main(void)
{
    struct batcher b;
    struct batch_item it[10] = { 0 };

    batch_init(&b, 2, 3);
    ASSERT_EQ(batch_admit(&b, &it[0]), BATCH_RUN);
    ASSERT_EQ(batch_admit(&b, &it[1]), BATCH_RUN);
    it[2].priority = 5;
    it[3].priority = 1;
    it[4].priority = 5;
    ASSERT_EQ(batch_admit(&b, &it[2]), BATCH_QUEUED);
    ASSERT_EQ(batch_admit(&b, &it[3]), BATCH_QUEUED);
    ASSERT_EQ(batch_admit(&b, &it[4]), BATCH_QUEUED);
    ASSERT_EQ(batch_admit(&b, &it[5]), BATCH_FULL);   /* queue full: refused at once */
    ASSERT_EQ(b.running, 2);
    ASSERT_EQ(b.queued, 3);
    unsigned pr, pq;                                    /* what other threads read */
    batch_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 2);
    ASSERT_EQ(pq, 3);
    /* release promotes the lowest priority value first, then FIFO */
    ASSERT_TRUE(batch_release(&b, &it[0]) == &it[3]);
    ASSERT_TRUE(it[3].running && !it[3].queued);
    /* a cancelled queued item frees its queue place */
    batch_remove(&b, &it[2]);
    ASSERT_EQ(b.queued, 1);
    batch_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 2);
    ASSERT_EQ(pq, 1);
    ASSERT_EQ(batch_admit(&b, &it[6]), BATCH_QUEUED);  /* priority 0 < 5 */
    ASSERT_TRUE(batch_release(&b, &it[1]) == &it[6]);
    ASSERT_TRUE(batch_release(&b, &it[3]) == &it[4]);
    ASSERT_TRUE(batch_release(&b, &it[6]) == NULL);
    ASSERT_TRUE(batch_release(&b, &it[4]) == NULL);
    ASSERT_EQ(b.running, 0);
    ASSERT_EQ(b.queued, 0);
    batch_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 0);
    ASSERT_EQ(pq, 0);
    /* a new arrival never jumps a non-empty queue even when a slot is free */
    batch_init(&b, 1, 2);
    ASSERT_EQ(batch_admit(&b, &it[0]), BATCH_RUN);
    ASSERT_EQ(batch_admit(&b, &it[1]), BATCH_QUEUED);
    b.max_running = 2;                                    /* capacity grew */
    ASSERT_EQ(batch_admit(&b, &it[2]), BATCH_QUEUED);
    ASSERT_TRUE(batch_pop(&b) == &it[1]);
    ASSERT_TRUE(batch_pop(&b) == &it[2]);
    ASSERT_TRUE(batch_pop(&b) == NULL);
    batch_published(&b, &pr, &pq);
    ASSERT_EQ(pr, 1);
    ASSERT_EQ(pq, 0);
    printf("test-batcher: all checks passed\n");
    return 0;
}
