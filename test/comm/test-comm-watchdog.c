/* test-comm-watchdog.c - the watchdog of the watchdog (docs/RELIABILITY.md B5): a collective
 * stuck inside its transport past deadline + grace makes the process _exit() with the
 * given code; collectives that return in time, and waits without a deadline (an idle
 * follower waiting for the next step plan), never trigger it.  The collectives run on
 * simulated time (struct comm.clock): a stall moves it, so the outcome does not depend on
 * how fast a loaded machine runs the child. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "harness.h"

static int stall_msec;
static bool stuck;
static struct clk_sim sim = { .us = 1000000 };

/* The transport takes stall_msec of simulated time, then returns after half a second of
 * real time (two or three of the watchdog's checks, which must not fire: a watchdog that
 * would is given the chance), or never (stuck: only the watchdog ends the process). */
static int slow_allreduce(struct comm *c, float *buf, size_t count)
{
    struct timespec ts = { 0, 500000000L };

    clk_sim_advance_us(&sim, (int64_t)stall_msec * 1000);
    do {
        while (nanosleep(&ts, &ts) < 0)
            ;
        ts.tv_nsec = 500000000L;
    } while (stuck);
    return 0;
}

static void plain_free(struct comm *c)
{
    free(c);
}

static const struct comm_ops slow_ops = {
    .name = "slow",
    .allreduce_sum = slow_allreduce,
    .free = plain_free,
};

/* Run one collective that stalls for stall ms (then sticks for good when stick) under a
 * deadline of timeout ms and a watchdog grace of grace ms, in a child; returns its wait
 * status. */
static int run(int stall, bool stick, int timeout, int grace)
{
    pid_t pid = fork();
    int st;

    if (pid == 0) {
        struct comm *c = calloc(1, sizeof(*c));
        float v = 1;

        c->ops = &slow_ops;
        c->world_size = 2;
        c->timeout_msec = timeout;
        c->clock = clk_sim_src(&sim);
        stall_msec = stall;
        stuck = stick;
        if (comm_watchdog_start(c, grace, 42) < 0)
            _exit(3);
        comm_allreduce_sum(c, &v, 1);
        comm_free(c);
        _exit(0);
    }
    ASSERT_TRUE(pid > 0);
    for (int i = 0; i < 1000; i++) {       /* hang guard: 10 s */
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    FAIL("child still running after 10 s (stall %d, timeout %d, grace %d)", stall, timeout, grace);
}

int main(void)
{
    int st;

    st = run(501, true, 200, 300);      /* stuck past 200 + 300 ms */
    ASSERT_TRUE(WIFEXITED(st));
    ASSERT_EQ(WEXITSTATUS(st), 42);
    st = run(500, false, 200, 300);     /* returns in time (at the limit) */
    ASSERT_TRUE(WIFEXITED(st));
    ASSERT_EQ(WEXITSTATUS(st), 0);
    st = run(1200, false, 0, 300);      /* no deadline: waiting is not a failure */
    ASSERT_TRUE(WIFEXITED(st));
    ASSERT_EQ(WEXITSTATUS(st), 0);
    return 0;
}
