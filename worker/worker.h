/* worker.h - the stepd-worker process: one rank of a worker group (docs/ARCHITECTURE.md §1).
 *
 * Life of a rank:
 *   1. rendezvous: create this rank's UCX worker, publish its address and collect every
 *      rank's address, either through the coordinator's control service
 *      (--coordinator, stepd.ctl.v1.Control/Session, worker/ctl.c) or through a shared
 *      directory (--rendezvous-dir: one file per rank, for single-host tests and
 *      network-namespace "nodes" that share a file system).  A rank that never joins
 *      ends the rendezvous after --rendezvous-timeout with an error naming it;
 *   2. connect the communicator (struct comm; world size 1: the single comm);
 *   3. load this rank's shard (ckpt_open with world size and rank) and build the model
 *      with the comm as its collective hooks (or the mock forward with --mock);
 *   4. rank 0 runs the engine over a forward that broadcasts every step plan to ranks
 *      1..N-1 before computing it; ranks 1..N-1 receive plans and run the same forward
 *      step in lockstep until a STOP message or an error.
 * Any comm failure (dead peer, collective deadline) aborts the communicator; rank 0's
 * in-flight requests finish with an error and every rank exits non-zero (WORKER_EXIT_*)
 * so that supervision restarts it and the group re-forms.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "err.h"
#include "forward.h"
#include "rpc.h"
#include "specconf.h"

#ifdef __cplusplus
extern "C" {
#endif

enum worker_exit {
    WORKER_EXIT_OK = 0,
    WORKER_EXIT_FAILURE = 1,        /* start-up or internal error */
    WORKER_EXIT_USAGE = 2,
    WORKER_EXIT_RENDEZVOUS = 3,     /* rendezvous failed or timed out */
    WORKER_EXIT_COMM = 4,           /* collective failed: peer gone or deadline */
};

struct worker_opts {
    const char *coordinator;        /* control service address (host:port or unix:path) */
    const char *rendezvous_dir;     /* file rendezvous instead of the coordinator */
    const char *group;              /* [A-Za-z0-9._-]{1,64} */
    int rank, world_size;
    const char *device;             /* "cpu" or "cuda:N" */
    const char *model_dir, *mtp_dir;
    int threads;
    bool exact;                     /* exact MXFP4 path on CPU */
    bool mock;                      /* mock forward (no weights) */
    struct spec_config spec;        /* --speculative-config (or --mtp K), kept whole */
    int max_seqs, max_batched_tokens, max_model_len, kv_blocks, block_size;
    bool allow_long_max_model_len;  /* max_model_len above the model's max_position_embeddings */
    /* KV cache (kvplan.h): per-rank budget in bytes (0 = on CPU max_seqs sequences of
     * max_model_len, at most 90 % of the available memory; on a device the share of
     * gpu_memory_utilization left after weights and activations); kv_blocks > 0 overrides
     * the full-attention pool's blocks */
    int64_t kv_cache_memory;
    double gpu_memory_utilization;  /* (0, 1], default 0.9 */
    bool kv_f32;                    /* --kv-cache-dtype fp32 (default bf16) */
    bool no_prefix_cache;           /* --no-enable-prefix-caching */
    const char *prefix_cache_salt;  /* --prefix-cache-salt (NULL: random per start) */
    int rendezvous_timeout_msec;
    int collective_timeout_msec;
    int load_timeout_msec;          /* how long ranks wait for each other to finish loading */
    /* rank 0 offline drivers (tests, benchmarks): */
    const char *generate_file;      /* one request per line: comma-separated prompt ids */
    int max_tokens;                 /* per request, --generate */
    const char *output_file;        /* where --generate writes "i: ids" lines (default stdout) */
    const char *logits_file;        /* --dump-logits: one prefill step, all positions' logits */
    const char *prompt_ids;         /* prompt of --dump-logits */
    int step_delay_msec;            /* rank 0: sleep before each step (fault tests) */
    const char *report_file;        /* per-rank JSON line: rank, planned bytes, RSS */
    const char *engine_listen;      /* rank 0: where stepd.v1.Engine listens (registered) */
    bool insecure_listen;           /* allow a non-loopback engine_listen (no authentication) */
    /* the cluster key: "authorization: Bearer" to the control service, and what rank 0's
     * engine service requires of its callers; NULL only with insecure_control */
    const char *control_key;
    bool insecure_control;          /* register and serve the engine without a key */
    const char *health_listen;      /* HTTP GET /livez, /readyz (probes), or NULL */
    struct rpc_tls_files control_tls;   /* TLS to the control service (root_file: the CA) */
    int max_waiting;                /* rank 0: the engine's waiting queue; 0 = from the KV blocks */
    bool logprobs_processed;        /* --logprobs-mode processed_logprobs */
};

void worker_opts_init(struct worker_opts *o);
/* Run the rank; returns the process exit code (enum worker_exit). */
int worker_run(const struct worker_opts *o);

/* ---- rendezvous ------------------------------------------------------------------- */
/* The result of a rendezvous: every rank's peer address (owned). */
struct worker_peers {
    int world_size;
    void *addr[256];
    size_t len[256];
    uint64_t epoch;
    unsigned char nccl_id[128];     /* rank 0's ncclUniqueId from the rendezvous (coordinator) */
    size_t nccl_id_len;             /* 0 when the group does not use NCCL */
};
void worker_peers_done(struct worker_peers *p);

/* File rendezvous in dir: write this rank's address as "<group>.rank-<R>", wait until
 * every rank's file exists or timeout_msec passes (-ETIMEDOUT; e names the missing
 * ranks).  Addresses are untrusted bytes: size-capped, and validated by the comm. */
int worker_rendezvous_dir(const char *dir, const char *group, int rank, int world_size,
                          const void *addr, size_t len, int timeout_msec,
                          struct worker_peers *ret, struct err_buf *e);
/* Remove this rank's file (after the comm is connected). */
void worker_rendezvous_dir_clean(const char *dir, const char *group, int rank);

/* ---- control-service client (ctl.c) -------------------------------------------------- */
struct worker_ctl;
struct worker_ctl_register {
    const char *group;
    int rank, world_size;
    const char *device;
    const void *peer_address;
    size_t peer_address_len;
    const char *engine_address;     /* rank 0 */
    const char *control_key;        /* sent as "authorization: Bearer KEY", or NULL */
    const void *nccl_id;            /* rank 0 with NCCL: ncclUniqueId bytes (128) */
    size_t nccl_id_len;
    const struct rpc_tls_files *tls;    /* NULL = plaintext; root_file verifies the coordinator */
    /* in a group, on GroupAbort: run on the control thread (e.g. comm_interrupt), or NULL.
     * The hook may run until worker_ctl_free() returns: abort_ud must outlive the client
     * (free the client first; RELIABILITY.md 1.4) */
    void (*on_group_abort)(void *ud);
    void *abort_ud;
};
/* Rank 0's engine as it reports it when READY (and again in every later registration). */
struct worker_ctl_engine {
    int kv_blocks_total;
    int max_num_seqs, max_waiting;  /* capacity: max_num_seqs + max_waiting requests at once */
};
/* Dial the coordinator (again, with backoff, while it is not there), open the Session
 * stream and wait (timeout_msec) for the Rendezvous event of the group.  On timeout the
 * error names the deadline; a refusal names the coordinator's reason.  From then on the
 * client keeps a session open for the life of the rank: a lost one is dialled again,
 * registering with the group's epoch so that a restarted coordinator re-adopts the group
 * (ctl.c); a GroupAbort makes the rank leave the group (worker_ctl_poll() 2, and the
 * registration's on_group_abort hook). */
int worker_ctl_open(const char *target, const struct worker_ctl_register *reg, int timeout_msec,
                    struct worker_ctl **ret, struct worker_peers *peers, struct err_buf *e);
/* ReportState(LOADING/READY/FAILED). state: 1 loading, 2 ready, 3 failed; eng (rank 0,
 * READY) or NULL.  Waits up to 5 s for the answer; without a session the state goes with
 * the next registration (0). */
int worker_ctl_report(struct worker_ctl *c, int state, float progress, const char *message,
                      const struct worker_ctl_engine *eng);
/* Non-blocking: 1 when the session has ended for good (Shutdown, or a refusal), 2 when the
 * coordinator told the group to re-form (GroupAbort, or a rendezvous of another epoch:
 * the rank registers again with a new client), with the reason in e; 0 otherwise.  *ret_lost (may be NULL): sessions lost so far after the
 * rendezvous (each one dialled again): rank 0 fails its in-flight requests on a new one. */
int worker_ctl_poll(struct worker_ctl *c, unsigned *ret_lost, struct err_buf *e);
/* End the session and join the control thread: no hook runs after it returns. */
void worker_ctl_free(struct worker_ctl *c);

/* ---- lockstep forwards (lockstep.c) ------------------------------------------------ */
/* Wrap inner (borrowed) so that every trunk step first broadcasts its plan over c (rank 0):
 * step() as a plain plan, step_argmax() (inner's greedy form, -ENOTSUP without one) with
 * plan.argmax set, so that the other ranks run the greedy form too (worker_follow_step):
 * a vocab-sharded trunk meets in the all-gather of each row's argmax pairs.  mtp_step,
 * mtp_step_argmax and set_draft_vocab are rank 0's only and pass through.  free() frees the
 * wrapper only. */
int worker_bcast_forward_new(struct forward *inner, struct comm *c, size_t plan_cap,
                             struct forward **ret);
/* Wrap inner (owned: free() frees both) so that every trunk step (either form) ends with
 * nccl->step_done(dcomm) (a CUDA group's NCCL comm, every rank). */
struct comm_nccl_api;
int worker_nccl_forward_new(struct forward *inner, const struct comm_nccl_api *nccl,
                            struct comm *dcomm, struct forward **ret);
/* A follower's step for plan p received from rank 0: the greedy form into ids [rows] when
 * p->argmax and f has it, the sampled form (STEP_PLAN_TOPK_K candidates a row, into its own
 * buffers) when p->topk and f has it, else (or when it answers -ENOTSUP before running
 * anything, as rank 0's does then) step() into logits [rows, vocab]. */
int worker_follow_step(struct forward *f, const struct step_plan *p, float *logits, int32_t *ids);

#ifdef __cplusplus
}
#endif
