/* loadwatch.c - see loadwatch.h. */
#include "loadwatch.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "clock.h"
#include "loader.h"
#include "log.h"
#include "progress.h"

struct load_watch {
    struct load_watch_opts o;
    bool tty_line;                  /* a line is on the terminal, not yet ended */
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
    if (lw->o.report)
        lw->o.report(lw->o.ctx, total > 0 ? (float)done / (float)total : 0.0f, msg);
    if (lw->o.tty) {
        fprintf(stderr, "\r%s\033[K", msg);
        lw->tty_line = true;
    } else if (now >= lw->next_log_ms) {
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

int load_watch_start(const struct load_watch_opts *o, struct load_watch **ret)
{
    struct load_watch *lw = calloc(1, sizeof(*lw));
    int r;

    if (!lw)
        return -ENOMEM;
    lw->o = *o;
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
    if (lw->tty_line)
        fputc('\n', stderr);
    pthread_cond_destroy(&lw->cond);
    pthread_mutex_destroy(&lw->lock);
    free(lw);
}
