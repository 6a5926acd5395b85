/* file.h - whole-file reads: configuration, keys, /proc entries, rendezvous files. */
#pragma once

#include <stddef.h>

enum file_flags {
    FILE_REGULAR = 1,       /* refuse anything but a regular file (-EBADF) */
    FILE_NOFOLLOW = 2,      /* refuse a symlink (-ELOOP) */
};

/* Read all of path, at most max bytes (-EFBIG beyond), into a malloc'd NUL-terminated
 * buffer (*ret; its length without the NUL in *ret_len if non-NULL).  Reads to EOF, so
 * files whose size stat cannot tell (/proc) work.  0 or a negative errno. */
int file_read_all(const char *path, size_t max, unsigned flags, char **ret, size_t *ret_len);
/* A secret (API key, control key) from a file: its first line with trailing blanks and
 * CR removed, malloc'd in *ret; -ENODATA when that is empty.  The read buffer is wiped. */
int file_read_secret(const char *path, char **ret);
