/* cli.c - see cli.h. */
#include "cli.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int cli_parse_int(const char *flag, const char *s, int lo, int hi, int *ret, struct err_buf *e)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return err_set(e, -EINVAL, "%s '%s': expected an integer in [%d, %d]", flag, s, lo, hi);
    *ret = (int) v;
    return 0;
}

int cli_parse_ids(const char *flag, const char *s, int vocab, int32_t **ret, int *ret_n,
                  struct err_buf *e)
{
    int n = 1, i = 0;
    int32_t *ids;

    while (*s == ' ')
        s++;
    if (!*s)
        return err_set(e, -EINVAL, "%s: empty list of token ids", flag);
    for (const char *p = s; *p; p++)
        n += *p == ',';
    ids = malloc(sizeof(*ids) * (size_t) n);
    if (!ids)
        return -ENOMEM;
    for (const char *p = s; i < n; i++) {
        char *end;
        long v;

        errno = 0;
        v = strtol(p, &end, 10);
        if (errno || end == p || (*end && *end != ',' && !(*end == '\n' && !end[1])) || v < 0 ||
            (vocab > 0 && v >= vocab)) {
            int len = (int) strcspn(p, ",\n");
            free(ids);
            if (vocab > 0)
                return err_set(e, -EINVAL, "%s: item %d ('%.*s') is not a token id in [0, %d)",
                               flag, i + 1, len > 40 ? 40 : len, p, vocab);
            return err_set(e, -EINVAL, "%s: item %d ('%.*s') is not a token id", flag, i + 1,
                           len > 40 ? 40 : len, p);
        }
        p = *end == ',' ? end + 1 : end;
        ids[i] = (int32_t) v;
    }
    *ret = ids;
    *ret_n = n;
    return 0;
}
