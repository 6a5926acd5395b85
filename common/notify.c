/* notify.c - the service manager's notification protocol, spoken directly (see notify.h).
 *
 * systemd's protocol (sd_notify(3)): one datagram of newline-separated VAR=value lines to
 * the AF_UNIX socket named by $NOTIFY_SOCKET, a file-system path or, with a leading '@',
 * an abstract-namespace name.  It is small and stable, so stepd needs no libsystemd and
 * no build variant: a build behaves the same whether or not the machine runs systemd.
 */
#include "notify.h"

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* One datagram of VAR=value lines, as given. */
static int notify_send(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    size_t n, len;
    ssize_t w;
    int fd, r = 1;

    if (!path || !*path)
        return 0;
    n = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || n >= sizeof(sa.sun_path))
        return -EAFNOSUPPORT;       /* e.g. vsock: addresses of newer managers */
    memcpy(sa.sun_path, path, n);
    if (path[0] == '@')
        sa.sun_path[0] = 0;         /* abstract namespace: no terminator counted */
    len = offsetof(struct sockaddr_un, sun_path) + n + (path[0] == '@' ? 0 : 1);
    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    w = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, (socklen_t)len);
    if (w < 0)
        r = -errno;
    close(fd);
    return r;
}

int notify_ready(void) { return notify_send("READY=1"); }
int notify_stopping(void) { return notify_send("STOPPING=1"); }
int notify_watchdog(void) { return notify_send("WATCHDOG=1"); }

int notify_status(const char *fmt, ...)
{
    char buf[8 + 256 + 1] = "STATUS=";
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf + 7, sizeof(buf) - 7, fmt, ap);
    va_end(ap);
    for (char *p = buf; *p; p++)
        if (*p == '\n')
            *p = ' ';               /* one line: a newline would start another variable */
    return notify_send(buf);
}

int notify_extend_timeout(uint64_t usec)
{
    char buf[64];

    snprintf(buf, sizeof(buf), "EXTEND_TIMEOUT_USEC=%llu", (unsigned long long)usec);
    return notify_send(buf);
}

uint64_t notify_watchdog_usec(void)
{
    const char *s = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
    unsigned long long v;
    char *end;

    if (!s || !*s)
        return 0;
    if (pid && *pid && strtol(pid, NULL, 10) != (long)getpid())
        return 0;                   /* meant for another process (e.g. our parent) */
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || *end || v == 0)
        return 0;
    return v;
}
