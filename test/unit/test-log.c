/* test-log.c - one log call is one line: control characters and DEL in the message and
 * in the request id come out as \xNN (a client's "x\n<3>stepd: forged" cannot start a
 * journal line of its own), the priority prefix is there when stderr is the journal
 * ($JOURNAL_STREAM = its device:inode) and absent otherwise (a terminal, a file, another
 * stream's JOURNAL_STREAM), the request tag is there, and an overlong message is cut,
 * still ending in exactly one newline. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* log_init() as a program under systemd calls it: with stderr already what it is */
static void init_journal(void)
{
    struct stat st;
    char js[64];

    ASSERT_TRUE(fstat(STDERR_FILENO, &st) == 0);
    snprintf(js, sizeof(js), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    setenv("JOURNAL_STREAM", js, 1);
    log_init("stepd", "g0/r1");
}

static void emit_plain(void)
{
    unsetenv("JOURNAL_STREAM");
    log_init("stepd", "g0/r1");
    log_warn("plain %d", 1);
}

static void emit_other_stream(void)
{
    setenv("JOURNAL_STREAM", "1:2", 1);     /* stdout's, say: not stderr */
    log_init("stepd", "g0/r1");
    log_warn("other %d", 2);
    unsetenv("JOURNAL_STREAM");
}

static void emit_journal_warn(void)
{
    init_journal();
    log_warn("journal %d", 3);
    unsetenv("JOURNAL_STREAM");
}

static void emit_forged(void)
{
    init_journal();
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
    out = capture(emit_plain);
    ASSERT_STREQ(out, "stepd[g0/r1]: plain 1\n");
    out = capture(emit_other_stream);
    ASSERT_STREQ(out, "stepd[g0/r1]: other 2\n");
    out = capture(emit_journal_warn);
    ASSERT_STREQ(out, "<4>stepd[g0/r1]: journal 3\n");
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
