/* comm-nccl.h - the NCCL struct comm (device buffers), built only with CUDA.
 *
 * Buffers passed to its collectives are DEVICE pointers on the communicator's device.
 * The step-plan broadcast stays on the host path (a UCX or single comm beside this one),
 * so broadcast_var returns -EOPNOTSUPP here.
 *
 * Failure model (docs/RELIABILITY.md §1.2, B5): the communicator is non-blocking
 * (config.blocking = 0); every collective is enqueued and then polled with
 * ncclCommGetAsyncError + cudaStreamQuery until done, an async error, or the deadline.
 * Then ncclCommAbort() and a sticky error: the worker exits non-zero and the group
 * re-forms.  If the abort itself never returns, the caller's watchdog _exit()s.
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
/* Join the communicator on CUDA device `device`.  id is rank 0's unique id. */
int comm_nccl_new(int rank, int world_size, int device, const void *id, size_t id_len,
                  int timeout_msec, struct comm **ret);

#ifdef __cplusplus
}
#endif
