/* health.c - a rank's liveness and readiness for systemd and HTTP probes (see health.h).
 *
 * One thread owns the listener and the notifications: every tick (a quarter of the
 * watchdog interval, at most 1 s) it judges the rank alive or not from what the loops
 * published (atomics: last beat, waiting flag, phase) and from the process's own CPU time
 * and RSS while loading, then pings the watchdog / extends the start timeout when alive,
 * and answers the probes that arrived.  The loops never block on it.
 */
#include "health.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"
#include "notify.h"

struct worker_health {
    pthread_t thread;
    bool thread_on;
    int lfd;                        /* HTTP listener, -1 without */
    int port;
    int wake[2];                    /* pipe: stop */
    _Atomic int phase;
    _Atomic int64_t last_beat_ms;
    _Atomic bool waiting;
    _Atomic bool ready_sent;
    pthread_mutex_t lock;           /* status */
    char status[256];
    /* thread-only: load progress */
    int64_t last_progress_ms;
    long long last_cpu_us, last_rss_pages;
};

static const char *phase_name(int p)
{
    switch (p) {
    case WORKER_PHASE_STARTING: return "starting";
    case WORKER_PHASE_RENDEZVOUS: return "rendezvous";
    case WORKER_PHASE_LOADING: return "loading";
    case WORKER_PHASE_READY: return "ready";
    case WORKER_PHASE_STOPPING: return "stopping";
    case WORKER_PHASE_FAILED: return "failed";
    }
    return "?";
}

/* CPU time (user + system) of the process in µs and its resident pages */
static void sample_progress(long long *cpu_us, long long *rss_pages)
{
    struct rusage ru;
    long long size = 0, res = 0;
    FILE *f;

    *cpu_us = 0;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        *cpu_us = (long long)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec +
                  (long long)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec;
    *rss_pages = 0;
    f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%lld %lld", &size, &res) == 2)
            *rss_pages = res;
        fclose(f);
    }
}

static bool judge_alive(struct worker_health *h, int64_t now)
{
    int p = atomic_load(&h->phase);

    switch (p) {
    case WORKER_PHASE_STARTING:
    case WORKER_PHASE_RENDEZVOUS:   /* bounded by --rendezvous-timeout */
    case WORKER_PHASE_STOPPING:     /* bounded by the supervisor's stop timeout */
        return true;
    case WORKER_PHASE_LOADING: {
        long long cpu, rss;

        sample_progress(&cpu, &rss);
        if (cpu != h->last_cpu_us || rss != h->last_rss_pages || h->last_progress_ms == 0) {
            h->last_cpu_us = cpu;
            h->last_rss_pages = rss;
            h->last_progress_ms = now;
        }
        return now - h->last_progress_ms < WORKER_HEALTH_LOAD_STALL_MS;
    }
    case WORKER_PHASE_READY:
        return atomic_load(&h->waiting) ||
               now - atomic_load(&h->last_beat_ms) < WORKER_HEALTH_STEP_STALL_MS;
    default:
        return false;
    }
}

/* ---- HTTP probes ---------------------------------------------------------------- */

static void respond(int fd, int code, const char *body)
{
    char buf[512];
    int n = snprintf(buf, sizeof(buf),
                     "HTTP/1.0 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
                     "Cache-Control: no-store\r\nConnection: close\r\n\r\n%s",
                     code, code == 200 ? "OK" : code == 404 ? "Not Found" : code == 405 ?
                     "Method Not Allowed" : "Service Unavailable", strlen(body), body);

    if (n > 0 && write(fd, buf, (size_t)n < sizeof(buf) ? (size_t)n : sizeof(buf) - 1) < 0)
        log_debug("health probe: write: %s", strerror(errno));
}

static void serve_one(struct worker_health *h, int fd, bool alive)
{
    struct pollfd pf = { .fd = fd, .events = POLLIN };
    char req[1024], body[320], status[256];
    size_t got = 0;
    int64_t end = clk_now_ms() + 1000;

    /* the request line is all we need; a client that does not send it within 1 s is dropped */
    while (got < sizeof(req) - 1 && !memchr(req, '\n', got)) {
        int64_t left = end - clk_now_ms();
        ssize_t n;

        if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
            return;
        n = read(fd, req + got, sizeof(req) - 1 - got);
        if (n <= 0)
            return;
        got += (size_t)n;
    }
    req[got] = '\0';
    pthread_mutex_lock(&h->lock);
    snprintf(status, sizeof(status), "%s", h->status);
    pthread_mutex_unlock(&h->lock);
    int p = atomic_load(&h->phase);
    bool ready = p == WORKER_PHASE_READY && alive;

    if (strncmp(req, "GET /livez ", 11) == 0 || strncmp(req, "GET /livez?", 11) == 0) {
        snprintf(body, sizeof(body), "%s: %s; %s\n", alive ? "alive" : "stuck", phase_name(p), status);
        respond(fd, alive ? 200 : 503, body);
    } else if (strncmp(req, "GET /readyz ", 12) == 0 || strncmp(req, "GET /readyz?", 12) == 0) {
        snprintf(body, sizeof(body), "%s: %s; %s\n", ready ? "ready" : "not ready", phase_name(p), status);
        respond(fd, ready ? 200 : 503, body);
    } else if (strncmp(req, "GET ", 4) == 0) {
        respond(fd, 404, "unknown path: GET /livez or GET /readyz\n");
    } else {
        respond(fd, 405, "only GET\n");
    }
}

static void *health_main(void *arg)
{
    struct worker_health *h = arg;
    uint64_t wd = notify_watchdog_usec();
    int tick = wd ? (int)(wd / 4000) : 1000;

    if (tick > 1000)
        tick = 1000;
    if (tick < 20)
        tick = 20;
    if (wd)
        log_info("systemd watchdog: WATCHDOG=1 every %d ms (WatchdogSec %llu ms)", tick,
                 (unsigned long long)(wd / 1000));
    for (;;) {
        struct pollfd pf[2] = { { .fd = h->wake[0], .events = POLLIN }, { .fd = h->lfd, .events = POLLIN } };
        int n = poll(pf, h->lfd >= 0 ? 2 : 1, tick);
        int64_t now = clk_now_ms();
        bool alive = judge_alive(h, now);

        if (n > 0 && (pf[0].revents & (POLLIN | POLLHUP)))
            break;
        if (wd && alive)
            notify_watchdog();
        if (alive && atomic_load(&h->phase) == WORKER_PHASE_LOADING)
            /* from now: three ticks of headroom, at least 30 s, as long as the load moves */
            notify_extend_timeout(3ull * (uint64_t)tick * 1000 > 30000000 ? 3ull * (uint64_t)tick * 1000 : 30000000);
        if (n > 0 && h->lfd >= 0 && (pf[1].revents & POLLIN)) {
            int fd = accept4(h->lfd, NULL, NULL, SOCK_CLOEXEC);

            if (fd >= 0) {
                serve_one(h, fd, alive);
                close(fd);
            }
        }
    }
    return NULL;
}

static int listen_on(const char *addr, int *ret_fd, int *ret_port, struct err_buf *e)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE | AI_NUMERICSERV };
    struct addrinfo *ai = NULL;
    size_t hl;
    int fd, one = 1, r;

    if (!colon || !colon[1] || (size_t)(colon - addr) >= sizeof(host))
        return err_set(e, -EINVAL, "--health-listen '%s': expected HOST:PORT", addr);
    hl = (size_t)(colon - addr);
    memcpy(host, addr, hl);
    host[hl] = '\0';
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    r = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &ai);
    if (r != 0)
        return err_set(e, -EINVAL, "--health-listen '%s': %s", addr, gai_strerror(r));
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        r = -errno;
        freeaddrinfo(ai);
        return err_set(e, r, "--health-listen %s: socket: %s", addr, strerror(-r));
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 16) < 0) {
        r = -errno;
        freeaddrinfo(ai);
        close(fd);
        return err_set(e, r, "--health-listen %s: %s", addr, strerror(-r));
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    *ret_port = 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        char serv[16];
        if (getnameinfo((struct sockaddr *)&ss, sl, NULL, 0, serv, sizeof(serv), NI_NUMERICSERV) == 0)
            *ret_port = atoi(serv);
    }
    *ret_fd = fd;
    return 0;
}

int worker_health_start(const char *listen, struct worker_health **ret, struct err_buf *e)
{
    struct worker_health *h = calloc(1, sizeof(*h));
    int r;

    if (!h)
        return err_set(e, -ENOMEM, "out of memory");
    h->lfd = -1;
    h->wake[0] = h->wake[1] = -1;
    pthread_mutex_init(&h->lock, NULL);
    snprintf(h->status, sizeof(h->status), "starting");
    atomic_store(&h->last_beat_ms, clk_now_ms());
    if (listen && listen[0]) {
        r = listen_on(listen, &h->lfd, &h->port, e);
        if (r < 0)
            goto fail;
        log_info("health probes: GET /livez, GET /readyz on %s (port %d)", listen, h->port);
    }
    if (pipe2(h->wake, O_CLOEXEC) < 0) {
        r = err_set(e, -errno, "pipe: %s", strerror(errno));
        goto fail;
    }
    r = pthread_create(&h->thread, NULL, health_main, h);
    if (r != 0) {
        r = err_set(e, -r, "cannot start the health thread: %s", strerror(r));
        goto fail;
    }
    h->thread_on = true;
    *ret = h;
    return 0;
fail:
    worker_health_stop(h);
    return r;
}

void worker_health_stop(struct worker_health *h)
{
    if (!h)
        return;
    if (h->thread_on) {
        if (write(h->wake[1], "x", 1) < 0)
            log_warn("health thread: wake: %s", strerror(errno));
        pthread_join(h->thread, NULL);
    }
    if (h->lfd >= 0)
        close(h->lfd);
    if (h->wake[0] >= 0)
        close(h->wake[0]);
    if (h->wake[1] >= 0)
        close(h->wake[1]);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

void worker_health_phase(struct worker_health *h, enum worker_phase p, const char *fmt, ...)
{
    char status[256];
    va_list ap;

    if (!h)
        return;
    va_start(ap, fmt);
    vsnprintf(status, sizeof(status), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&h->lock);
    snprintf(h->status, sizeof(h->status), "%s", status);
    pthread_mutex_unlock(&h->lock);
    atomic_store(&h->last_beat_ms, clk_now_ms());
    atomic_store(&h->phase, (int)p);
    notify_status("%s", status);
    if (p == WORKER_PHASE_READY && !atomic_exchange(&h->ready_sent, true))
        notify_ready();
    else if (p == WORKER_PHASE_STOPPING)
        notify_stopping();
}

void worker_health_beat(struct worker_health *h)
{
    if (h)
        atomic_store_explicit(&h->last_beat_ms, clk_now_ms(), memory_order_relaxed);
}

void worker_health_wait(struct worker_health *h, bool waiting)
{
    if (!h)
        return;
    if (!waiting)
        atomic_store_explicit(&h->last_beat_ms, clk_now_ms(), memory_order_relaxed);
    atomic_store(&h->waiting, waiting);
}

int worker_health_port(const struct worker_health *h)
{
    return h ? h->port : 0;
}
