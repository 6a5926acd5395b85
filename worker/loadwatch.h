/* loadwatch.h - a load's progress, where a person waits for it: a thread that, once a
 * second while a checkpoint loads, reads the loader's byte count (ckpt_load_progress: the
 * bytes of this rank's tensors the model has read in) and hands "3.1 GB of 9.4 GB (33%),
 * 775 MB/s, ETA 8 s" to its caller's report function (stepd-worker: ReportState LOADING with
 * the fraction, for `stepctl groups`, GET /healthz and stepd serve's STATUS=, and its own
 * STATUS=); on a terminal (tty) it rewrites one line of stderr each second, elsewhere it
 * logs the line every LOAD_WATCH_LOG_MS.  stepd-worker stops the thread before it reports
 * READY, so no LOADING report can follow that.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

struct ckpt;
struct load_watch;

#define LOAD_WATCH_REPORT_MS 1000
#define LOAD_WATCH_LOG_MS 5000

struct load_watch_opts {
    /* called on the watch's thread once a second (may be NULL): fraction done and the line */
    void (*report)(void *ctx, float frac, const char *line);
    void *ctx;
    bool tty;               /* stderr is a terminal: one line rewritten in place */
};

int load_watch_start(const struct load_watch_opts *o, struct load_watch **ret);
/* The checkpoint being loaded (once ckpt_open() has planned it); it must stay open until
 * load_watch_stop(). */
void load_watch_set(struct load_watch *lw, struct ckpt *ck);
/* Stop and join the thread (lw may be NULL); on a terminal the line is ended. */
void load_watch_stop(struct load_watch *lw);
