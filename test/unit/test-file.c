/* test-file.c - file_read_all reads a file whole (also one that grows past its first
 * buffer, and /proc entries whose size stat reports as 0), NUL-terminates it, refuses
 * one over the cap (-EFBIG), a missing one (-ENOENT), with FILE_REGULAR a directory (a
 * symlink to a file is fine) and with FILE_NOFOLLOW a symlink; file_read_secret takes the first line without trailing blanks or CR and
 * refuses an empty one (-ENODATA). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "file.h"
#include "harness.h"

static void write_file(const char *path, const char *s, size_t n)
{
    FILE *f = fopen(path, "wb");

    ASSERT_TRUE(f != NULL);
    ASSERT_EQ(fwrite(s, 1, n, f), n);
    fclose(f);
}

int main(void)
{
    char dir[] = "/tmp/stepd-test-file-XXXXXX", path[256], link[256], *buf, *big;
    size_t n;

    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(path, sizeof(path), "%s/f", dir);
    snprintf(link, sizeof(link), "%s/l", dir);
    big = malloc(100000);
    for (size_t i = 0; i < 100000; i++)
        big[i] = (char)('a' + i % 26);
    write_file(path, big, 100000);
    ASSERT_OK(file_read_all(path, 100000, FILE_REGULAR, &buf, &n));
    ASSERT_EQ(n, 100000);
    ASSERT_TRUE(memcmp(buf, big, n) == 0 && buf[n] == 0);
    free(buf);
    ASSERT_ERR(file_read_all(path, 99999, 0, &buf, &n), -EFBIG);
    ASSERT_OK(symlink(path, link));
    ASSERT_OK(file_read_all(link, 100000, 0, &buf, NULL));
    free(buf);
    ASSERT_OK(file_read_all(link, 100000, FILE_REGULAR, &buf, NULL));   /* a link to a file */
    free(buf);
    ASSERT_ERR(file_read_all(link, 100000, FILE_NOFOLLOW, &buf, &n), -ELOOP);
    ASSERT_ERR(file_read_all(dir, 100000, FILE_REGULAR, &buf, &n), -EBADF);
    ASSERT_OK(file_read_all("/proc/self/stat", 4096, 0, &buf, &n));
    ASSERT_TRUE(n > 10 && strlen(buf) == n);
    free(buf);

    write_file(path, "s3cr3t \r\nsecond line\n", 21);
    ASSERT_OK(file_read_secret(path, &buf));
    ASSERT_STREQ(buf, "s3cr3t");
    free(buf);
    write_file(path, " \r\n", 3);
    ASSERT_ERR(file_read_secret(path, &buf), -ENODATA);
    unlink(link);
    unlink(path);
    ASSERT_ERR(file_read_all(path, 10, 0, &buf, &n), -ENOENT);
    rmdir(dir);
    free(big);
    printf("file: ok\n");
    return 0;
}
