/* group.c - fork N ranks and wire them with a UCX comm through pipes to the parent. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "group.h"

double group_now_msec(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;

    while (n) {
        ssize_t w = write(fd, c, n);

        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -EIO;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;

    while (n) {
        ssize_t r = read(fd, c, n);

        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -EIO;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static void child(int rank, int n, int timeout_msec, int up, int down, group_fn fn, void *arg)
{
    const void *addrs[16];
    size_t lens[16];
    struct comm *c = NULL;
    const void *a;
    size_t alen;
    uint32_t l32;
    int r, i;

    r = comm_ucx_new(rank, n, timeout_msec, &c);
    if (r < 0) {
        fprintf(stderr, "rank %d: comm_ucx_new: %s\n", rank, strerror(-r));
        _exit(120);
    }
    comm_ucx_address(c, &a, &alen);
    l32 = (uint32_t)alen;
    if (write_all(up, &l32, 4) < 0 || write_all(up, a, alen) < 0)
        _exit(121);
    for (i = 0; i < n; i++) {
        void *buf;

        if (read_all(down, &l32, 4) < 0)
            _exit(122);
        buf = malloc(l32);
        if (!buf || read_all(down, buf, l32) < 0)
            _exit(122);
        addrs[i] = buf;
        lens[i] = l32;
    }
    r = comm_ucx_connect(c, addrs, lens);
    if (r < 0) {
        fprintf(stderr, "rank %d: connect: %s (%s)\n", rank, strerror(-r), comm_last_error(c));
        _exit(123);
    }
    /* tell the parent we are wired */
    if (write_all(up, "W", 1) < 0)
        _exit(121);
    r = fn(c, arg);
    fflush(NULL);
    comm_free(c);
    for (i = 0; i < n; i++)
        free((void *)addrs[i]);
    _exit(r);
}

int group_run(int n, int timeout_msec, group_fn fn, void *arg, group_hook hook, int limit_msec,
              struct group_ctl *g)
{
    int up[16][2], down[16][2], i, j, left, ret = 0;
    void *addr[16] = { 0 };
    uint32_t len[16];
    double t0, deadline;

    if (n < 1 || n > 16)
        return -EINVAL;
    memset(g, 0, sizeof(*g));
    g->n = n;
    fflush(NULL);
    for (i = 0; i < n; i++) {
        if (pipe(up[i]) < 0 || pipe(down[i]) < 0)
            return -errno;
        g->pid[i] = fork();
        if (g->pid[i] < 0)
            return -errno;
        if (g->pid[i] == 0) {
            for (j = 0; j < i; j++) {
                close(up[j][0]);
                close(down[j][1]);
            }
            close(up[i][0]);
            close(down[i][1]);
            child(i, n, timeout_msec, up[i][1], down[i][0], fn, arg);
        }
        close(up[i][1]);
        close(down[i][0]);
    }
    for (i = 0; i < n; i++) {
        if (read_all(up[i][0], &len[i], 4) < 0 || !(addr[i] = malloc(len[i])) ||
            read_all(up[i][0], addr[i], len[i]) < 0) {
            ret = -EIO;
            goto out_kill;
        }
    }
    for (i = 0; i < n; i++)
        for (j = 0; j < n; j++)
            if (write_all(down[i][1], &len[j], 4) < 0 || write_all(down[i][1], addr[j], len[j]) < 0) {
                ret = -EIO;
                goto out_kill;
            }
    for (i = 0; i < n; i++) {
        char w;

        if (read_all(up[i][0], &w, 1) < 0) {
            ret = -EIO;
            goto out_kill;
        }
    }
    if (hook)
        hook(g, arg);
    t0 = group_now_msec();
    deadline = t0 + limit_msec;
    left = n;
    while (left) {
        for (i = 0; i < n; i++) {
            int st;

            if (!g->pid[i])
                continue;
            if (waitpid(g->pid[i], &st, WNOHANG) == g->pid[i]) {
                g->status[i] = st;
                g->exit_msec[i] = group_now_msec() - t0;
                g->pid[i] = 0;
                left--;
            }
        }
        if (!left)
            break;
        if (group_now_msec() > deadline) {
            ret = -ETIMEDOUT;
            goto out_kill;
        }
        usleep(2000);
    }
    goto out;

out_kill:
    for (i = 0; i < n; i++)
        if (g->pid[i] > 0) {
            int st;

            kill(g->pid[i], SIGKILL);
            waitpid(g->pid[i], &st, 0);
            g->status[i] = st;
            g->pid[i] = 0;
        }
out:
    for (i = 0; i < n; i++) {
        free(addr[i]);
        close(up[i][0]);
        close(down[i][1]);
    }
    return ret;
}
