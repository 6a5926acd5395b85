/* test-comm-single.c - world size 1: identity collectives, the sticky abort. */
#include "comm.h"
#include "harness.h"

int main(void)
{
    struct comm *c;
    float v[3] = { 1, 2, 3 };
    int a = 7, b = 0;
    size_t len = 4;

    ASSERT_OK(comm_single_new(&c));
    ASSERT_EQ(c->world_size, 1);
    ASSERT_OK(comm_allreduce_sum(c, v, 3));
    ASSERT_EQ(v[2], 3);
    ASSERT_OK(comm_allgather(c, &a, &b, sizeof(a)));
    ASSERT_EQ(b, 7);
    ASSERT_OK(comm_broadcast(c, v, sizeof(v), 0));
    ASSERT_OK(comm_broadcast_var(c, v, &len, sizeof(v), 0));
    ASSERT_ERR(comm_broadcast_var(c, v, &(size_t){ 100 }, sizeof(v), 0), -EMSGSIZE);
    ASSERT_OK(comm_barrier(c));
    comm_abort(c);
    ASSERT_ERR(comm_allreduce_sum(c, v, 3), -ECANCELED);
    ASSERT_ERR(comm_barrier(c), -ECANCELED);
    ASSERT_CONTAINS(comm_last_error(c), "aborted");
    comm_free(c);
    comm_free(NULL);
    return 0;
}
