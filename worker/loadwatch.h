/* loadwatch.h - a rank's load progress, where a person waits for it: a thread that, once a
 * second while the shard loads, reads the loader's byte count (ckpt_load_progress: the
 * bytes of this rank's tensors the model has read in) and reports "loading: 3.1 GB of
 * 9.4 GB (33%), 775 MB/s, ETA 8 s" to the coordinator (ReportState LOADING with the
 * fraction: `stepctl groups`, GET /healthz, stepd serve's STATUS=), to the service manager
 * (STATUS=) and, every LOAD_WATCH_LOG_MS, to the log.  The thread is stopped before the
 * rank reports READY, so no LOADING report can follow it.
 */
#pragma once

#include <stdint.h>

struct ckpt;
struct worker_ctl;
struct worker_health;
struct load_watch;

#define LOAD_WATCH_REPORT_MS 1000
#define LOAD_WATCH_LOG_MS 5000

/* ctl and h may be NULL (no coordinator, no health thread).  who: "group g0 rank 1 of 2". */
int load_watch_start(struct worker_ctl *ctl, struct worker_health *h, const char *who,
                     struct load_watch **ret);
/* The checkpoint being loaded (once ckpt_open() has planned it); it must stay open until
 * load_watch_stop(). */
void load_watch_set(struct load_watch *lw, struct ckpt *ck);
/* Stop and join the thread (lw may be NULL). */
void load_watch_stop(struct load_watch *lw);
