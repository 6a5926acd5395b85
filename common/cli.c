/* cli.c - see cli.h. */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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

int cli_parse_bytes(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *ret,
                    struct err_buf *e)
{
    static const struct {
        const char *name;
        double mult;
    } units[] = {
        { "", 1 }, { "b", 1 },
        { "k", 1e3 }, { "kb", 1e3 }, { "m", 1e6 }, { "mb", 1e6 },
        { "g", 1e9 }, { "gb", 1e9 }, { "t", 1e12 }, { "tb", 1e12 },
        { "ki", 1024.0 }, { "kib", 1024.0 }, { "mi", 1048576.0 }, { "mib", 1048576.0 },
        { "gi", 1073741824.0 }, { "gib", 1073741824.0 },
        { "ti", 1099511627776.0 }, { "tib", 1099511627776.0 },
    };
    char *end;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (!errno && end != s && isdigit((unsigned char) *s) && isfinite(v)) {
        for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
            if (strcasecmp(end, units[i].name) != 0)
                continue;
            double b = floor(v * units[i].mult);
            if ((units[i].mult == 1 && b != v) || b < (double) lo || b > (double) hi)
                break;
            *ret = (int64_t) b;
            return 0;
        }
    }
    return err_set(e, -EINVAL, "%s '%s': expected a byte count in [%lld, %lld] (suffix K, M, G, "
                   "T or KiB, MiB, GiB, TiB)", flag, s, (long long) lo, (long long) hi);
}

int cli_parse_fraction(const char *flag, const char *s, double lo, double hi, double *ret,
                       struct err_buf *e)
{
    char *end;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || *end || !(v > lo && v <= hi))
        return err_set(e, -EINVAL, "%s '%s': expected a number in (%g, %g]", flag, s, lo, hi);
    *ret = v;
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

int cli_parse_kv_dtype(const char *flag, const char *s, bool *ret_f32, struct err_buf *e)
{
    if (strcmp(s, "auto") == 0 || strcmp(s, "bf16") == 0 || strcmp(s, "bfloat16") == 0) {
        *ret_f32 = false;
        return 0;
    }
    if (strcmp(s, "fp32") == 0 || strcmp(s, "float32") == 0) {
        *ret_f32 = true;
        return 0;
    }
    return err_set(e, -EINVAL, "%s '%s': stepd stores the KV cache as auto (bf16) or fp32", flag, s);
}
