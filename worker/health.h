/* health.h - a rank's liveness and readiness, told to its supervisor: the service manager
 * (sd_notify: READY, WATCHDOG, EXTEND_TIMEOUT_USEC, STATUS, STOPPING) and, with
 * --health-listen, HTTP probes (GET /livez, GET /readyz; Kubernetes).
 *
 * The rank's loops say how they are doing (worker_health_beat from the step loops and the
 * rank-0 idle loop, worker_health_wait around the follower's wait for the next plan); one
 * thread turns that into WATCHDOG=1 pings and probe answers, so a rank blocked for good in
 * a step stops both, while a rank idle between steps (a legitimate wait without a deadline)
 * keeps both.  While loading, progress is the process's CPU time or resident memory
 * moving: each tick that saw progress extends the start timeout (EXTEND_TIMEOUT_USEC) and
 * pings the watchdog; a load stalled for WORKER_HEALTH_LOAD_STALL_MS does neither.
 * READY=1 is sent once, when the rank has loaded its weights and its group has formed.
 * Every function is safe from any thread; all are no-ops on a NULL handle.
 */
#pragma once

#include <stdbool.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* a load that moves neither CPU time nor RSS for this long is declared stuck */
#define WORKER_HEALTH_LOAD_STALL_MS (5 * 60 * 1000)
/* a step (or rank 0's engine with work) that has not advanced for this long is stuck */
#define WORKER_HEALTH_STEP_STALL_MS 30000

enum worker_phase {
    WORKER_PHASE_STARTING,
    WORKER_PHASE_RENDEZVOUS,        /* waiting for the other ranks */
    WORKER_PHASE_LOADING,           /* loading the shard, then the group's shape barrier */
    WORKER_PHASE_READY,             /* serving (rank 0) or following plans */
    WORKER_PHASE_STOPPING,
    WORKER_PHASE_FAILED,
};

struct worker_health;

/* Start the reporting thread.  listen: NULL or "" for no HTTP listener, else
 * "host:port" / "[v6]:port" (port 0 binds any free port; the bound port is logged). */
int worker_health_start(const char *listen, struct worker_health **ret, struct err_buf *e);
/* Stop the thread, close the listener, free h. */
void worker_health_stop(struct worker_health *h);
/* Enter a phase; status is the STATUS= line (and the probes' body).  READY sends READY=1
 * (once), STOPPING sends STOPPING=1. */
void worker_health_phase(struct worker_health *h, enum worker_phase p, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The rank's loop made progress (a step ran, or rank 0's idle loop found the engine well). */
void worker_health_beat(struct worker_health *h);
/* The follower enters (true) or leaves (false) its wait for the next step plan. */
void worker_health_wait(struct worker_health *h, bool waiting);
/* The bound HTTP port (0 without a listener). */
int worker_health_port(const struct worker_health *h);

#ifdef __cplusplus
}
#endif
