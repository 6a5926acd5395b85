/* loadwatch.c - see loadwatch.h. */
#include "loadwatch.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "clock.h"
#include "health.h"
#include "loader.h"
#include "log.h"
#include "progress.h"
#include "worker.h"

struct load_watch {
    struct worker_ctl *ctl;
    struct worker_health *h;
    char who[96];
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    _Atomic(struct ckpt *) ck;
    int64_t t0_ms, next_log_ms;
};

static void report(struct load_watch *lw, struct ckpt *ck, int64_t now)
{
    char line[128], msg[160];
    int64_t done, total;

    ckpt_load_progress(ck, &done, &total);
    progress_line(line, sizeof(line), done, total, now - lw->t0_ms);
    snprintf(msg, sizeof(msg), "loading: %s", line);
    worker_health_phase(lw->h, WORKER_PHASE_LOADING, "loading: %s: %s", lw->who, line);
    if (lw->ctl)
        (void)worker_ctl_report(lw->ctl, 1, total > 0 ? (float)done / (float)total : 0.0f, msg,
                                NULL);
    if (now >= lw->next_log_ms) {
        log_info("%s", msg);
        lw->next_log_ms = now + LOAD_WATCH_LOG_MS;
    }
}

static void *watch_main(void *arg)
{
    struct load_watch *lw = arg;

    pthread_mutex_lock(&lw->lock);
    for (;;) {
        struct timespec ts = clk_realtime_in_ms(LOAD_WATCH_REPORT_MS);

        while (!lw->stop && pthread_cond_timedwait(&lw->cond, &lw->lock, &ts) != ETIMEDOUT)
            ;
        if (lw->stop)
            break;
        struct ckpt *ck = atomic_load(&lw->ck);

        if (!ck)
            continue;
        pthread_mutex_unlock(&lw->lock);
        report(lw, ck, clk_now_ms());
        pthread_mutex_lock(&lw->lock);
    }
    pthread_mutex_unlock(&lw->lock);
    return NULL;
}

int load_watch_start(struct worker_ctl *ctl, struct worker_health *h, const char *who,
                     struct load_watch **ret)
{
    struct load_watch *lw = calloc(1, sizeof(*lw));
    int r;

    if (!lw)
        return -ENOMEM;
    lw->ctl = ctl;
    lw->h = h;
    snprintf(lw->who, sizeof(lw->who), "%s", who);
    lw->t0_ms = clk_now_ms();
    lw->next_log_ms = lw->t0_ms + LOAD_WATCH_LOG_MS;
    pthread_mutex_init(&lw->lock, NULL);
    pthread_cond_init(&lw->cond, NULL);
    r = pthread_create(&lw->thread, NULL, watch_main, lw);
    if (r) {
        pthread_cond_destroy(&lw->cond);
        pthread_mutex_destroy(&lw->lock);
        free(lw);
        return -r;
    }
    *ret = lw;
    return 0;
}

void load_watch_set(struct load_watch *lw, struct ckpt *ck)
{
    if (lw)
        atomic_store(&lw->ck, ck);
}

void load_watch_stop(struct load_watch *lw)
{
    if (!lw)
        return;
    pthread_mutex_lock(&lw->lock);
    lw->stop = true;
    pthread_cond_signal(&lw->cond);
    pthread_mutex_unlock(&lw->lock);
    pthread_join(lw->thread, NULL);
    pthread_cond_destroy(&lw->cond);
    pthread_mutex_destroy(&lw->lock);
    free(lw);
}
