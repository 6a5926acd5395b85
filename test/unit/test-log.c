/* test-log.c - one log call is one line: control characters and DEL in the message and
 * in the request id come out as \xNN (a client's "x\n<3>stepd: forged" cannot start a
 * journal line of its own), the priority prefix and the request tag are there, and an
 * overlong message is cut, still ending in exactly one newline. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "log.h"

static char *capture(void (*fn)(void))
{
    static char buf[16384];
    char path[] = "/tmp/stepd-test-log-XXXXXX";
    int fd = mkstemp(path), saved = dup(STDERR_FILENO);
    ssize_t n;

    ASSERT_TRUE(fd >= 0 && saved >= 0);
    ASSERT_TRUE(dup2(fd, STDERR_FILENO) >= 0);
    fn();
    ASSERT_TRUE(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    n = pread(fd, buf, sizeof(buf) - 1, 0);
    ASSERT_TRUE(n >= 0);
    buf[n] = 0;
    close(fd);
    unlink(path);
    return buf;
}

static void emit_forged(void)
{
    log_req_info("id\r\n<3>x", "rejected: model \"%s\"", "evil\n<3>stepd: forged\x7f\x01");
}

static void emit_long(void)
{
    static char big[8000];

    memset(big, 'a', sizeof(big) - 1);
    for (size_t i = 0; i < sizeof(big) - 1; i += 100)
        big[i] = '\n';
    log_info("%s", big);
}

int main(void)
{
    char *out;

    log_init("stepd", "g0/r1");
    out = capture(emit_forged);
    ASSERT_STREQ(out, "<6>stepd[g0/r1]: req=id\\x0d\\x0a<3>x: rejected: model "
                      "\"evil\\x0a<3>stepd: forged\\x7f\\x01\"\n");
    out = capture(emit_long);
    ASSERT_TRUE(strlen(out) > 1000 && strlen(out) < 4096);
    ASSERT_TRUE(strchr(out, '\n') == out + strlen(out) - 1);
    ASSERT_TRUE(strstr(out, "\\x0a") != NULL);
    printf("log: ok\n");
    return 0;
}
