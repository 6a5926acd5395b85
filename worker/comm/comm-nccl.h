/* comm-nccl.h - the NCCL struct comm (device buffers), built only with CUDA.
 *
 * Buffers passed to its collectives are DEVICE pointers on the communicator's device.
 * The step-plan broadcast stays on the host path (a UCX or single comm beside this one),
 * so broadcast_var returns -EOPNOTSUPP here.  libnccl.so.2 is opened with dlopen() when
 * the first communicator is made ($STEPD_NCCL_LIB names another file): binaries that link
 * this never need NCCL unless a group asks for it.  The CUDA plugin links this file and
 * exports it to the worker as stepd_comm_nccl_api() (struct comm_nccl_api below), so
 * stepd-worker itself links no CUDA library.
 *
 * Two modes:
 *   own stream (stream NULL): every collective is enqueued and then polled with
 *     ncclCommGetAsyncError + cudaStreamQuery until done, an async error, or the deadline;
 *   compute stream (a backend's stream): collectives are enqueued in stream order with the
 *     model's kernels and return once the communicator's state is ncclSuccess (a call
 *     that answers ncclInProgress is not yet enqueued, nccl-settle.h), without waiting for
 *     the stream (CUDA graphs may capture them).  busy_since_usec is set at the first collective of a step and
 *     comm_nccl_step_done(), after the step's sync, checks for an async error and clears
 *     it: a collective stuck past its deadline is the watchdog's (comm_watchdog_start).
 * Failure model (docs/RELIABILITY.md §1.2, B5): the communicator is non-blocking
 * (config.blocking = 0); a failure calls ncclCommAbort() and sets a sticky error: the
 * worker exits non-zero and the group re-forms.  If the abort itself never returns, the
 * caller's watchdog _exit()s.  comm_abort() from another thread stops a poll in progress.
 */
#pragma once

#include <stddef.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define COMM_NCCL_ID_BYTES 128

/* Rank 0: a fresh unique id (COMM_NCCL_ID_BYTES bytes) to hand out through rendezvous. */
int comm_nccl_unique_id(void *ret_id, size_t len);
/* Number of CUDA devices visible (0 when no driver or no device). */
int comm_nccl_device_count(void);
/* Join the communicator on CUDA device `device`.  id is rank 0's unique id; stream: the
 * compute stream to enqueue on (a cudaStream_t), or NULL for a stream of its own. */
int comm_nccl_new(int rank, int world_size, int device, const void *id, size_t id_len,
                  int timeout_msec, void *stream, struct comm **ret);
/* After a step's collectives have completed (the stream was synchronised): the async
 * error, if any (the comm is then aborted), and the step's busy mark cleared. */
int comm_nccl_step_done(struct comm *c);

/* What the CUDA plugin exports (symbol STEPD_COMM_NCCL_API, see backend_plugin_symbol). */
struct comm_nccl_api {
    int (*unique_id)(void *ret_id, size_t len);
    int (*device_count)(void);
    int (*create)(int rank, int world_size, int device, const void *id, size_t id_len,
                  int timeout_msec, void *stream, struct comm **ret);
    int (*step_done)(struct comm *c);
};
#define STEPD_COMM_NCCL_API "stepd_comm_nccl_api"
const struct comm_nccl_api *stepd_comm_nccl_api(void);

#ifdef __cplusplus
}
#endif
