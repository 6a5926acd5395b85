/* file.c - see file.h. */
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int file_read_all(const char *path, size_t max, unsigned flags, char **ret, size_t *ret_len)
{
    size_t len = 0, cap = 0;
    char *buf = NULL, *nb;
    struct stat st;
    ssize_t got;
    int fd, r = 0;

    fd = open(path, O_RDONLY | O_CLOEXEC | ((flags & FILE_NOFOLLOW) ? O_NOFOLLOW : 0));
    if (fd < 0)
        return -errno;
    if ((flags & FILE_REGULAR) && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) {
        r = -EBADF;
        goto out_close;
    }
    for (;;) {
        if (len + 1 >= cap) {
            size_t nc = cap ? cap * 2 : 4096;

            if (cap > max + 1)
                nc = cap;
            if (nc > max + 2)
                nc = max + 2;
            nb = realloc(buf, nc);
            if (!nb) {
                r = -ENOMEM;
                goto out_close;
            }
            buf = nb;
            cap = nc;
        }
        got = read(fd, buf + len, cap - len - 1);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            r = -errno;
            goto out_close;
        }
        if (got == 0)
            break;
        len += (size_t)got;
        if (len > max) {
            r = -EFBIG;
            goto out_close;
        }
    }
    buf[len] = '\0';
    *ret = buf;
    buf = NULL;
    if (ret_len)
        *ret_len = len;
out_close:
    free(buf);
    close(fd);
    return r;
}

int file_read_secret(const char *path, char **ret)
{
    char *buf;
    size_t n;
    int r = file_read_all(path, 64 * 1024, 0, &buf, &n);

    if (r < 0)
        return r;
    n = strcspn(buf, "\n");
    while (n && (buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
        n--;
    if (n == 0) {
        r = -ENODATA;
    } else if (!(*ret = strndup(buf, n))) {
        r = -ENOMEM;
    }
    explicit_bzero(buf, strlen(buf));
    free(buf);
    return r;
}
