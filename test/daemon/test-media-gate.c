/* test-media-gate.c - the test-only decode gate (media.h: MEDIA_TEST_DECODE_GATE_ENV) is
 * read from the environment once per process, at the first decode: that decode reads its
 * byte from the FIFO the variable names then, and so does a later decode after the variable
 * names another FIFO (production decodes read no environment).  Each FIFO is held open for
 * writing here, a byte written before each decode, so a decode never blocks; which FIFO
 * still holds its byte afterwards says which one the gate read. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "harness.h"
#include "media.h"

/* One decode of bytes that are no image: the gate runs first, then the decode fails. */
static void decode(void)
{
    struct image_limits lim = media_conf.lim;
    struct image_prep p;
    struct err_buf e = {{0}};
    bool prepped;

    ASSERT_TRUE(media_image_prepare("not an image", 12, &lim, NULL, &p, &prepped, &e) < 0);
    ASSERT_TRUE(!prepped);
}

/* Whether fd's FIFO still holds a byte (read back: it is left empty). */
static bool holds_byte(int fd)
{
    char c;
    ssize_t n = read(fd, &c, 1);

    if (n < 0)
        ASSERT_EQ(errno, EAGAIN);
    return n == 1;
}

int main(void)
{
    char dir[] = "/tmp/test-media-gate-XXXXXX", a[64], b[64];
    int fa, fb;

    ASSERT_TRUE(mkdtemp(dir));
    snprintf(a, sizeof(a), "%s/a", dir);
    snprintf(b, sizeof(b), "%s/b", dir);
    ASSERT_OK(mkfifo(a, 0600));
    ASSERT_OK(mkfifo(b, 0600));
    /* O_RDWR: the FIFO has a writer, so the gate's open does not wait; our reads never block */
    ASSERT_TRUE((fa = open(a, O_RDWR | O_NONBLOCK)) >= 0);
    ASSERT_TRUE((fb = open(b, O_RDWR | O_NONBLOCK)) >= 0);

    /* the first decode resolves the gate: it reads a's byte */
    ASSERT_OK(setenv(MEDIA_TEST_DECODE_GATE_ENV, a, 1));
    ASSERT_EQ(write(fa, "x", 1), 1);
    decode();
    ASSERT_TRUE(!holds_byte(fa));

    /* the variable changed after that has no effect: the gate still reads a, never b */
    ASSERT_OK(setenv(MEDIA_TEST_DECODE_GATE_ENV, b, 1));
    ASSERT_EQ(write(fa, "x", 1), 1);
    ASSERT_EQ(write(fb, "x", 1), 1);
    decode();
    if (!holds_byte(fb))
        FAIL("a decode read the gate the variable named after the first decode");
    ASSERT_TRUE(!holds_byte(fa));

    /* unset too: the gate stays */
    ASSERT_OK(unsetenv(MEDIA_TEST_DECODE_GATE_ENV));
    ASSERT_EQ(write(fa, "x", 1), 1);
    decode();
    ASSERT_TRUE(!holds_byte(fa));

    close(fa);
    close(fb);
    unlink(a);
    unlink(b);
    rmdir(dir);
    printf("the decode gate is read once per process, at the first decode\n");
    return 0;
}
