/* group.h - run a function on N forked ranks joined by a UCX comm (tests, benchmarks).
 *
 * group_run() forks N children.  Each creates its UCX comm, sends its worker address to
 * the parent over a pipe, receives every rank's address back, connects, runs
 * fn(comm, arg) and exits with its return value (0 ok, 1..125 failure).  The parent
 * collects the exit statuses into status[] (the raw wait status) and returns 0, or
 * -ETIMEDOUT when some child has not exited within limit_msec (they are then SIGKILLed).
 * Children are created before any UCX state exists in the parent.
 * hook, when non-NULL, runs in the parent once all ranks are wired (pids known), for
 * fault injection.
 */
#pragma once

#include <sys/types.h>

#include "comm.h"

struct group_ctl {
    int n;
    pid_t pid[16];
    int status[16];
    double exit_msec[16];   /* time from hook return (or wiring) to the child's exit */
};

typedef int (*group_fn)(struct comm *c, void *arg);
typedef void (*group_hook)(struct group_ctl *g, void *arg);

int group_run(int n, int timeout_msec, group_fn fn, void *arg, group_hook hook, int limit_msec,
              struct group_ctl *g);
/* Wall-clock milliseconds (monotonic). */
double group_now_msec(void);
