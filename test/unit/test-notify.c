/* test-notify.c - the notify protocol: a no-op without $NOTIFY_SOCKET; with a service
 * manager socket (a datagram socket of our own here, a path and an abstract name) READY=1,
 * STATUS= (one line), WATCHDOG=1, STOPPING=1 and EXTEND_TIMEOUT_USEC= arrive as sent;
 * WATCHDOG_USEC counts only for the process WATCHDOG_PID names. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "notify.h"

static void expect_msg(int fd, const char *want)
{
    char buf[512];
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
    ASSERT_TRUE(n > 0);
    buf[n] = 0;
    ASSERT_STREQ(buf, want);
}

int main(void)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    char dir[] = "/tmp/stepd-test-notify-XXXXXX";
    int fd;

    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    ASSERT_EQ(notify_ready(), 0);
    ASSERT_EQ(notify_status("loading %d%%", 50), 0);
    ASSERT_EQ(notify_watchdog_usec(), 0);
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/notify", dir);
    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ASSERT_TRUE(fd >= 0);
    ASSERT_OK(bind(fd, (struct sockaddr *) &sa, sizeof(sa)));
    setenv("NOTIFY_SOCKET", sa.sun_path, 1);
    ASSERT_EQ(notify_ready(), 1);
    expect_msg(fd, "READY=1");
    ASSERT_EQ(notify_status("loaded %d/%d shards", 3, 12), 1);
    expect_msg(fd, "STATUS=loaded 3/12 shards");
    ASSERT_EQ(notify_status("two\nlines"), 1);
    expect_msg(fd, "STATUS=two lines");
    ASSERT_EQ(notify_extend_timeout(90000000), 1);
    expect_msg(fd, "EXTEND_TIMEOUT_USEC=90000000");
    ASSERT_EQ(notify_watchdog(), 1);
    expect_msg(fd, "WATCHDOG=1");
    ASSERT_EQ(notify_stopping(), 1);
    expect_msg(fd, "STOPPING=1");
    {
        char pid[32];
        snprintf(pid, sizeof(pid), "%d", (int) getpid());
        setenv("WATCHDOG_PID", pid, 1);
        setenv("WATCHDOG_USEC", "3000000", 1);
        ASSERT_EQ(notify_watchdog_usec(), 3000000);
        snprintf(pid, sizeof(pid), "%d", (int) getpid() + 1);
        setenv("WATCHDOG_PID", pid, 1);
        ASSERT_EQ(notify_watchdog_usec(), 0);
        unsetenv("WATCHDOG_PID");
        setenv("WATCHDOG_USEC", "x", 1);
        ASSERT_EQ(notify_watchdog_usec(), 0);
    }
    {
        /* an abstract-namespace socket ("@name") */
        struct sockaddr_un ab = { .sun_family = AF_UNIX };
        char name[64];
        int afd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        size_t n = (size_t)snprintf(name, sizeof(name), "@stepd-test-notify-%d", (int) getpid());

        ASSERT_TRUE(afd >= 0);
        memcpy(ab.sun_path, name, n);
        ab.sun_path[0] = 0;
        ASSERT_OK(bind(afd, (struct sockaddr *) &ab, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)));
        setenv("NOTIFY_SOCKET", name, 1);
        ASSERT_EQ(notify_ready(), 1);
        expect_msg(afd, "READY=1");
        close(afd);
        setenv("NOTIFY_SOCKET", "relative/path", 1);
        ASSERT_ERR(notify_ready(), -EAFNOSUPPORT);
    }
    close(fd);
    unlink(sa.sun_path);
    rmdir(dir);
    return 0;
}
