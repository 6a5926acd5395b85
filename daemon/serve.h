/* serve.h - `stepd serve MODEL_DIR`: the coordinator starts and supervises its own worker
 * ranks on this machine (docs/OPERATIONS.md §1).
 *
 * D groups ("g0".."g{D-1}") of N ranks each, every rank one `stepd-worker` child with the
 * flags a unit file would give it (systemd/stepd-worker@.service), registering with this
 * coordinator's control port.  A rank that exits while the coordinator is not stopping is
 * restarted after a capped exponential backoff, and its group re-forms; a rank that failed
 * restart_limit times in a row (without its group becoming ready in between), or that
 * exited with status 2 (bad flags: a restart cannot help), is not started again: its group
 * is given up, the other ranks of the group are stopped, and the reason shows in the log,
 * readiness (/healthz, the STATUS line), and Admin.GetGroups.  At shutdown the coordinator
 * tells every rank to stop (Shutdown on its session); ranks still running after
 * worker_stop_timeout_ms get SIGTERM, rank 0 of each group first, and SIGKILL after as long
 * again.  The workers' control key is a per-run random key (or the operator's), handed to
 * them in a file of a private runtime directory, never on a command line.
 * Loop thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct coord;
struct serve;

struct serve_opts {
    const char *model_dir;
    unsigned tensor_parallel;       /* ranks per group (1, 2, 4, 8) */
    unsigned data_parallel;         /* groups */
    const char *device;             /* "cpu" or "cuda" (rank r of group d: cuda:d*N+r) */
    const char *speculative_config; /* passed to every rank as --speculative-config */
    unsigned max_model_len, max_num_batched_tokens, max_num_seqs;   /* 0: worker default */
    double gpu_memory_utilization;  /* 0: unset */
    unsigned threads;               /* CPU threads per rank; 0: the CPUs shared out */
    const char *worker_binary;      /* NULL: stepd-worker beside stepd, else $PATH */
    const char *const *worker_args; /* extra flags for every rank */
    size_t n_worker_args;
    unsigned restart_limit;         /* failures in a row before a group is given up */
    unsigned backoff_ms, backoff_max_ms;
    unsigned worker_stop_timeout_ms;
    unsigned spec_log_interval_ms;  /* spec-decoding metrics in the log; 0 = off */
    const char *kv_cache_dtype;     /* "bf16", "fp32"; NULL: the worker's default */
    int64_t kv_cache_memory;        /* KV bytes per rank; 0: the worker's default */
    int prefix_caching;             /* -1: the worker's default (on), 0 off, 1 on */
    unsigned block_size;            /* 0: the worker's default */
    const char *quantization;       /* "mxfp4" or NULL */
    bool allow_long_max_model_len;  /* --max-model-len above max_position_embeddings */
};

void serve_opts_default(struct serve_opts *o);
/* Check the options and the model directory (config, load plan per rank; both logged) for
 * everything a rank would refuse (the speculative config, --max-model-len against the
 * model, the KV budget against one sequence, each rank's command line and device as
 * stepd-worker --check-device parses them), before any rank starts, make the
 * private runtime directory and the control key file.  *ret_key receives the
 * control key for the coordinator (malloc'd; the operator's when ctl_key is set). */
int serve_prepare(const struct serve_opts *o, const char *ctl_key, struct serve **ret, char **ret_key);
/* Start every rank (after coord_new: the control port is bound). */
int serve_start(struct serve *s, struct coord *co);
/* coord.c: the coordinator began shutting down: no more restarts; stop the ranks in order.
 * The process handles keep the loop alive until every rank has exited. */
void serve_shutdown(struct serve *s);
/* After the loop has ended: remove the runtime directory, free. */
void serve_free(struct serve *s);

/* For GetGroups: what the supervisor says of rank `rank` of group `group` (NULL if it
 * has nothing to say): "not restarted: ...", "restarting in 2.0 s ...". */
const char *serve_rank_message(const struct serve *s, const char *group, unsigned rank);
/* Why readiness is NOT_SERVING as far as the supervisor knows ("" when it knows nothing):
 * groups given up with their reason, groups starting. */
void serve_unready_reason(const struct serve *s, char *buf, size_t n);
/* A short summary for the service manager's STATUS line. */
void serve_status(const struct serve *s, char *buf, size_t n);
/* Readiness changed (coord_health_update) or the periodic tick: reset the failure counts
 * of groups that are ready, log "startup complete" and send READY=1 when the time comes. */
void serve_check(struct serve *s);
