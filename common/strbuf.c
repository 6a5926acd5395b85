/* strbuf.c - see strbuf.h. */
#include "strbuf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void strbuf_done(struct strbuf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
    b->oom = false;
}

void strbuf_reset(struct strbuf *b)
{
    b->len = 0;
    if (b->p)
        b->p[0] = '\0';
}

static int reserve(struct strbuf *b, size_t extra)
{
    size_t need = b->len + extra + 1, nc;
    char *np;

    if (need <= b->cap)
        return 0;
    if (need < b->len)
        goto out_oom;               /* overflow */
    nc = b->cap ? b->cap : 64;
    while (nc < need)
        nc *= 2;
    np = realloc(b->p, nc);
    if (!np)
        goto out_oom;
    b->p = np;
    b->cap = nc;
    return 0;
out_oom:
    b->oom = true;
    return -ENOMEM;
}

int strbuf_add(struct strbuf *b, const char *s, size_t n)
{
    if (reserve(b, n) < 0)
        return -ENOMEM;
    if (n)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

int strbuf_adds(struct strbuf *b, const char *s)
{
    return strbuf_add(b, s, strlen(s));
}

int strbuf_vprintf(struct strbuf *b, const char *fmt, va_list ap)
{
    va_list aq;
    int n;

    va_copy(aq, ap);
    n = vsnprintf(NULL, 0, fmt, aq);
    va_end(aq);
    if (n < 0)
        return -EINVAL;
    if (reserve(b, (size_t)n) < 0)
        return -ENOMEM;
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    b->len += (size_t)n;
    return 0;
}

int strbuf_printf(struct strbuf *b, const char *fmt, ...)
{
    va_list ap;
    int r;

    va_start(ap, fmt);
    r = strbuf_vprintf(b, fmt, ap);
    va_end(ap);
    return r;
}

const char *strbuf_str(const struct strbuf *b)
{
    return b->p ? b->p : "";
}

char *strbuf_take(struct strbuf *b)
{
    char *p = b->p ? b->p : strdup("");

    b->p = NULL;
    b->len = b->cap = 0;
    b->oom = false;
    return p;
}
