/* test-comm-fault.c - failure handling of the UCX comm (docs/RELIABILITY.md B5):
 *   1. a rank SIGKILLed in the middle of a stream of all-reduces: every survivor's
 *      collective fails (peer failure or deadline), the comm is aborted, later calls
 *      fail at once with -ECANCELED; the time to exit is printed;
 *   2. a rank that never enters the collective: the others time out with -ETIMEDOUT and
 *      a message naming the missing rank;
 *   3. a variable-length broadcast longer than the receiver's buffer: -EMSGSIZE;
 *   4. malformed peer addresses: rejected before any endpoint is created. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm.h"
#include "group.h"
#include "harness.h"

#define EXIT_COLLECTIVE_FAILED 3      /* peer failure reported (-ECONNRESET) */
#define EXIT_COLLECTIVE_TIMED_OUT 4   /* our own deadline (-ETIMEDOUT) */

static int killed_rank;

static int loop_until_error(struct comm *c, void *arg)
{
    size_t n = 256 * 1024;
    float *buf = calloc(n, sizeof(float));
    int r;

    ASSERT_TRUE(buf);
    for (;;) {
        r = comm_allreduce_sum(c, buf, n);
        if (r < 0)
            break;
    }
    fprintf(stderr, "rank %d: collective failed: %s (%s)\n", c->rank, err_str(r), comm_last_error(c));
    ASSERT_TRUE(c->error < 0);
    ASSERT_ERR(comm_allreduce_sum(c, buf, n), -ECANCELED);
    ASSERT_ERR(comm_barrier(c), -ECANCELED);
    free(buf);
    return r == -ECONNRESET ? EXIT_COLLECTIVE_FAILED : EXIT_COLLECTIVE_TIMED_OUT;
}

static void kill_one(struct group_ctl *g, void *arg)
{
    usleep(300 * 1000);
    kill(g->pid[killed_rank], SIGKILL);
}

static void t_killed_rank(int n, int victim, int timeout_msec)
{
    struct group_ctl g;

    killed_rank = victim;
    ASSERT_OK(group_run(n, timeout_msec, loop_until_error, NULL, kill_one, 60000, &g));
    for (int r = 0; r < n; r++) {
        if (r == victim) {
            ASSERT_TRUE(WIFSIGNALED(g.status[r]) && WTERMSIG(g.status[r]) == SIGKILL);
            continue;
        }
        /* with a long deadline the failure must come from UCX's peer detection */
        if (!WIFEXITED(g.status[r]) ||
            !(WEXITSTATUS(g.status[r]) == EXIT_COLLECTIVE_FAILED ||
              (timeout_msec < 5000 && WEXITSTATUS(g.status[r]) == EXIT_COLLECTIVE_TIMED_OUT)))
            FAIL("N=%d: survivor rank %d ended with status 0x%x", n, r, g.status[r]);
        printf("N=%d, rank %d killed, collective timeout %d ms: rank %d exited %.0f ms after the kill\n",
               n, victim, timeout_msec, r, g.exit_msec[r]);
    }
}

/* Rank 1 stays alive without calling the collective until rank 0's has ended (it creates
 * the file arg names then): an event, not a sleep, so rank 0's deadline (300 ms) always
 * passes first, whatever the load (30 s: a hang guard). */
static int never_joins(struct comm *c, void *arg)
{
    const char *done = arg;
    float v[4] = { 1, 2, 3, 4 };
    int r;

    if (c->rank == 1) {
        for (int i = 0; i < 3000 && access(done, F_OK) != 0; i++)
            usleep(10000);
        return access(done, F_OK) == 0 ? 0 : 1;
    }
    r = comm_allreduce_sum(c, v, 4);
    fclose(fopen(done, "w"));
    ASSERT_ERR(r, -ETIMEDOUT);
    ASSERT_CONTAINS(comm_last_error(c), "rank 1");
    ASSERT_CONTAINS(comm_last_error(c), "timed out");
    fprintf(stderr, "rank %d: %s\n", c->rank, comm_last_error(c));
    return EXIT_COLLECTIVE_FAILED;
}

static int owner_aborts(struct comm *c, void *arg)
{
    float v[1000] = { 0 };
    int r;

    if (c->rank == 1) {
        usleep(100 * 1000);
        comm_abort(c);      /* e.g. its checkpoint failed to load */
        return 0;
    }
    r = comm_allreduce_sum(c, v, 1000);
    ASSERT_ERR(r, -ECONNRESET);
    ASSERT_CONTAINS(comm_last_error(c), "rank 1 aborted the group");
    return EXIT_COLLECTIVE_FAILED;
}

static int too_long(struct comm *c, void *arg)
{
    char buf[256] = { 0 };
    size_t len = 200;
    int r;

    if (c->rank == 0) {
        r = comm_broadcast_var(c, buf, &len, sizeof(buf), 0);
        ASSERT_OK(r);
        return 0;
    }
    r = comm_broadcast_var(c, buf, &len, 100, 0);
    ASSERT_ERR(r, -EMSGSIZE);
    ASSERT_CONTAINS(comm_last_error(c), "larger than");
    return EXIT_COLLECTIVE_FAILED;
}

static void t_bad_addresses(void)
{
    struct comm *c;
    const void *mine;
    size_t mine_len;
    char junk[64];
    const void *addrs[2];
    size_t lens[2];

    ASSERT_OK(comm_ucx_new(0, 2, 1000, &c));
    ASSERT_OK(comm_ucx_address(c, &mine, &mine_len));
    memset(junk, 0x41, sizeof(junk));
    addrs[0] = mine;
    lens[0] = mine_len;
    addrs[1] = junk;
    lens[1] = 3;
    ASSERT_ERR(comm_ucx_connect(c, addrs, lens), -EBADMSG);
    ASSERT_CONTAINS(comm_last_error(c), "rank 1");
    comm_free(c);

    ASSERT_OK(comm_ucx_new(0, 2, 1000, &c));
    ASSERT_OK(comm_ucx_address(c, &mine, &mine_len));
    addrs[0] = mine;
    lens[0] = mine_len;
    addrs[1] = junk;
    lens[1] = sizeof(junk);
    ASSERT_ERR(comm_ucx_connect(c, addrs, lens), -EBADMSG);
    ASSERT_CONTAINS(comm_last_error(c), "not a stepd UCX address");
    comm_free(c);

    /* rank 0's own address offered as rank 1's */
    ASSERT_OK(comm_ucx_new(0, 2, 1000, &c));
    ASSERT_OK(comm_ucx_address(c, &mine, &mine_len));
    addrs[0] = mine;
    lens[0] = mine_len;
    addrs[1] = mine;
    lens[1] = mine_len;
    ASSERT_ERR(comm_ucx_connect(c, addrs, lens), -EBADMSG);
    ASSERT_CONTAINS(comm_last_error(c), "says rank 0");
    comm_free(c);
}

int main(void)
{
    struct group_ctl g;
    char done[256];

    t_bad_addresses();

    /* a generous deadline: the survivors must learn of the death from UCX itself */
    t_killed_rank(2, 1, 20000);
    t_killed_rank(3, 2, 20000);
    t_killed_rank(4, 1, 20000);
    /* a short deadline bounds the exit even where a transport detects death late */
    t_killed_rank(4, 0, 1000);

    snprintf(done, sizeof(done), "%s/test-comm-fault.%d.done",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    unlink(done);
    ASSERT_OK(group_run(2, 300, never_joins, done, NULL, 40000, &g));
    unlink(done);
    ASSERT_TRUE(WIFEXITED(g.status[0]) && WEXITSTATUS(g.status[0]) == EXIT_COLLECTIVE_FAILED);
    ASSERT_TRUE(WIFEXITED(g.status[1]) && WEXITSTATUS(g.status[1]) == 0);
    printf("never-joining rank: rank 0 timed out after %.0f ms\n", g.exit_msec[0]);

    /* an abort is announced: the others fail at once, not at their 20 s deadline */
    ASSERT_OK(group_run(3, 20000, owner_aborts, NULL, NULL, 30000, &g));
    ASSERT_TRUE(WIFEXITED(g.status[1]) && WEXITSTATUS(g.status[1]) == 0);
    for (int r = 0; r < 3; r += 2) {
        ASSERT_TRUE(WIFEXITED(g.status[r]) && WEXITSTATUS(g.status[r]) == EXIT_COLLECTIVE_FAILED);
        ASSERT_LT(g.exit_msec[r], 15000);   /* hang guard, far below the deadline */
        printf("rank 1 aborted: rank %d exited after %.0f ms\n", r, g.exit_msec[r]);
    }

    ASSERT_OK(group_run(2, 5000, too_long, NULL, NULL, 30000, &g));
    ASSERT_TRUE(WIFEXITED(g.status[0]) && WEXITSTATUS(g.status[0]) == 0);
    ASSERT_TRUE(WIFEXITED(g.status[1]) && WEXITSTATUS(g.status[1]) == EXIT_COLLECTIVE_FAILED);
    return 0;
}
