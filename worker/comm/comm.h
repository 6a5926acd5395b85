/* comm.h - collectives for one worker group (docs/ARCHITECTURE.md §1, §2, §7).
 *
 * A struct comm joins the N ranks of one group.  Three implementations sit behind one
 * vtable, in the ggml backend shape:
 *   single  world size 1: every collective is a no-op (or a copy);
 *   ucx     host buffers over UCP (shared memory within a node, TCP between nodes);
 *           recursive-doubling (small, power-of-two world) or ring all-reduce, ring
 *           all-gather, flat broadcast, dissemination barrier;
 *   nccl    device buffers (comm-nccl.c, built only with CUDA; see comm-nccl.h).
 *
 * Failure model (docs/RELIABILITY.md §1.2, row B5): every collective has a deadline
 * (comm.timeout_msec).  A collective that times out, or whose peer fails (UCX peer error
 * handler, closed endpoint), ABORTS the communicator: it returns a negative errno
 * (-ETIMEDOUT, -ECONNRESET, ...) and every later call returns -ECANCELED at once.  A
 * communicator cannot be repaired; the worker logs and exits non-zero so the whole group
 * re-forms.  comm_last_error() says in words what went wrong (which peer, which op).
 *
 * Collectives are called by every rank in the same order with the same sizes (the
 * step-plan broadcast keeps the ranks in lockstep).  None of them allocates in steady
 * state except to grow a scratch buffer the first time a larger size is seen.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "clock.h"
#include "err.h"
#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

struct comm;

struct comm_ops {
    const char *name;
    /* buf[count] += over all ranks, in place; every rank ends with the same sum. */
    int (*allreduce_sum)(struct comm *c, float *buf, size_t count);
    /* recv[r * nbytes .. (r+1) * nbytes) = rank r's send[0 .. nbytes); send may alias
     * recv + rank * nbytes. */
    int (*allgather)(struct comm *c, const void *send, void *recv, size_t nbytes);
    /* buf[0 .. nbytes) of rank root copied to every rank. */
    int (*broadcast)(struct comm *c, void *buf, size_t nbytes, int root);
    /* Variable-length broadcast: on root *len is the length to send; on the others buf
     * has room for cap bytes and *len receives the length sent (a longer message is an
     * error, -EMSGSIZE). */
    int (*broadcast_var)(struct comm *c, void *buf, size_t *len, size_t cap, int root);
    int (*barrier)(struct comm *c);
    /* Abort: cancel everything in flight; later calls fail with -ECANCELED.  Safe to call
     * more than once and from the error path of any collective. */
    void (*abort)(struct comm *c);
    void (*free)(struct comm *c);
};

struct comm {
    const struct comm_ops *ops;
    int rank;
    int world_size;
    int timeout_msec;       /* per collective; <= 0 means wait forever (tests only) */
    int error;              /* sticky: 0, or the negative errno that aborted the comm */
    char error_msg[256];    /* words for error: "peer rank 2 failed during allreduce: ..." */
    /* counters (read by stats and benchmarks) */
    uint64_t n_ops;
    uint64_t n_bytes_sent;
    /* usec on `clock` at which the running collective began, 0 when none (or when it
     * runs without a deadline); read by the watchdog thread */
    _Atomic uint64_t busy_since_usec;
    /* the time source of busy_since_usec and the watchdog (zeroed: CLOCK_MONOTONIC; tests
     * drive simulated time with it, common/clock.h) */
    struct clk_src clock;
    /* comm_interrupt() was called (any thread): the next wait fails with -ECANCELED */
    _Atomic bool interrupted;
    struct comm_watchdog *watchdog;
    void *impl;
};

/* Wrappers: argument checks (BUG_ON for misuse), the sticky error, then the vtable. */
int comm_allreduce_sum(struct comm *c, float *buf, size_t count);
int comm_allgather(struct comm *c, const void *send, void *recv, size_t nbytes);
int comm_broadcast(struct comm *c, void *buf, size_t nbytes, int root);
int comm_broadcast_var(struct comm *c, void *buf, size_t *len, size_t cap, int root);
int comm_barrier(struct comm *c);
void comm_abort(struct comm *c);
/* Any thread, async with the collectives: make the collective waiting now (or the next
 * one) fail with -ECANCELED and abort the communicator on its own thread, e.g. a
 * follower blocked without a deadline on the next step plan when the coordinator tells
 * the group to re-form.  Only sets a flag; NULL-safe. */
void comm_interrupt(struct comm *c);
/* NULL-safe. */
void comm_free(struct comm *c);
/* The message that explains c->error ("" when none). */
const char *comm_last_error(const struct comm *c);

/* Watchdog of the watchdog (docs/RELIABILITY.md B5): a thread that _exit()s the process with
 * exit_code when a collective has been running for longer than its own deadline plus
 * grace_msec, i.e. when the deadline/abort machinery itself is stuck (a transport call
 * that never returns).  Stopped by comm_free().  Returns 0 or -errno. */
int comm_watchdog_start(struct comm *c, int grace_msec, int exit_code);

/* Helper for implementations: record the first failure (sticky) and format its text. */
int comm__fail(struct comm *c, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- single ---------------------------------------------------------------------- */
int comm_single_new(struct comm **ret);

/* ---- ucx (host buffers) ---------------------------------------------------------- */
/* Two-phase set-up so that the caller does the out-of-band exchange (coordinator
 * rendezvous, or a shared directory in tests):
 *   comm_ucx_new()         create the UCP context and worker of this rank;
 *   comm_ucx_address()     this rank's worker address (borrowed, valid until free);
 *   comm_ucx_connect()     endpoints to every other rank from their addresses (untrusted
 *                          bytes: a malformed address is an error, not a crash), then a
 *                          barrier so that a rank returns only when all ranks are wired.
 * Environment as usual for UCX (UCX_TLS, UCX_NET_DEVICES, ...). */
int comm_ucx_new(int rank, int world_size, int timeout_msec, struct comm **ret);
int comm_ucx_address(struct comm *c, const void **ret_addr, size_t *ret_len);
int comm_ucx_connect(struct comm *c, const void *const *addrs, const size_t *lens);

/* ---- step-plan wire format (plan-wire.c) ----------------------------------------- */
/* Message kinds carried by the step-plan broadcast. */
enum plan_msg {
    PLAN_MSG_STEP = 1,      /* a step plan follows: ranks run forward step() */
    PLAN_MSG_STOP = 2,      /* orderly shutdown of the group */
    PLAN_MSG_STEP_ARGMAX = 3,   /* on the wire only: a STEP whose plan has argmax set (ranks
                                   run forward step_argmax); unpacked as PLAN_MSG_STEP */
    PLAN_MSG_STEP_TOPK = 4,     /* on the wire only: a STEP whose plan has topk set (ranks run
                                   forward step_topk, STEP_PLAN_TOPK_K); unpacked as STEP */
    _PLAN_MSG_MAX,
};

/* Bytes step_plan_pack() needs for p. */
size_t step_plan_packed_size(const struct step_plan *p);
/* Serialise p into buf[cap] (little-endian, versioned header, CRC-free: the transport is
 * reliable; validation is structural).  Returns the length, or -EMSGSIZE when cap is
 * too small, -EINVAL when p itself is inconsistent. */
int step_plan_pack(const struct step_plan *p, void *buf, size_t cap);
/* Pack a bare STOP message. */
int step_plan_pack_stop(void *buf, size_t cap);

/* Storage for unpacked plans: arrays grow to the largest plan seen and are reused. */
struct step_plan_buf {
    struct step_plan plan;
    size_t cap_seqs, cap_tokens, cap_blocks[_KV_GROUP_MAX], cap_seen;
    uint8_t *seen;          /* slot bitmap for the duplicate check */
    float *img_emb;         /* a plan's image section (plan.img_* point here) */
    int32_t *img_row, *img_row_next;
    size_t cap_img_emb, cap_img_row, cap_img_row_next;
};
void step_plan_buf_init(struct step_plan_buf *b);
void step_plan_buf_done(struct step_plan_buf *b);

/* Limits a receiver enforces on top of the structural checks (0 = no limit). */
struct step_plan_limits {
    int32_t max_seqs;           /* slot < max_seqs, n_seqs <= max_seqs */
    int32_t max_tokens;         /* n_tokens <= max_tokens */
    int32_t vocab_size;         /* every token id < vocab_size */
    int32_t max_blocks[_KV_GROUP_MAX]; /* block ids < max_blocks[g] (-1 allowed for sliding) */
    int32_t max_positions;      /* pos0 + n_tokens <= max_positions */
    int32_t max_block_ids;      /* n_block_ids[g] <= max_block_ids (table entries per group) */
    int32_t block_size;         /* n_blocks * block_size must cover pos0 + n_tokens */
    int32_t max_mtp_depth;      /* mtp_depth <= max_mtp_depth (0: up to STEP_PLAN_MAX_MTP) */
    int32_t img_width;          /* image rows are this wide (the text hidden); 0: a plan with
                                   image rows is refused (this rank takes none) */
    int32_t max_img_rows;       /* n_img_emb <= max_img_rows (0: n_tokens + n_seqs x
                                   STEP_PLAN_IMG_NEXT, the most a plan can use) */
};
/* Hard limits of the wire format itself, whatever lim says. */
#define STEP_PLAN_MAX_SEQS (1 << 16)
#define STEP_PLAN_MAX_TOKENS (1 << 24)
#define STEP_PLAN_MAX_BLOCK_IDS (1 << 24)
#define STEP_PLAN_MAX_MTP 8
#define STEP_PLAN_MAX_IMG_ROWS (1 << 24)
#define STEP_PLAN_MAX_IMG_WIDTH (1 << 16)

/* Parse buf[len] as untrusted bytes.  *ret_kind is PLAN_MSG_STEP or PLAN_MSG_STOP; for STEP
 * the plan is in b->plan (pointers into b; plan.argmax set when the wire kind was
 * PLAN_MSG_STEP_ARGMAX).  Every count, offset and id is checked against len and lim;
 * errors are -EBADMSG (malformed), -EPROTO (unknown version/kind), -ERANGE (a value beyond
 * lim), with the reason in e. */
int step_plan_unpack(const void *buf, size_t len, const struct step_plan_limits *lim,
                     struct step_plan_buf *b, int *ret_kind, struct err_buf *e);

/* ---- step-plan broadcast ----------------------------------------------------------- */
/* Rank 0 packs and broadcasts; ranks > 0 receive, unpack and validate.  scratch[cap]
 * is the wire buffer (same cap on every rank). */
int comm_plan_send(struct comm *c, const struct step_plan *p, void *scratch, size_t cap);
int comm_plan_send_stop(struct comm *c, void *scratch, size_t cap);
int comm_plan_recv(struct comm *c, void *scratch, size_t cap, const struct step_plan_limits *lim,
                   struct step_plan_buf *b, int *ret_kind, struct err_buf *e);
/* Upper bound on the packed size of any plan within lim. */
size_t step_plan_max_packed_size(const struct step_plan_limits *lim);

#ifdef __cplusplus
}
#endif
