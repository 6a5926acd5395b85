/* err.c - error strings, error buffers and the assertion handler. */
#include "err.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *err_str(int err)
{
    static __thread char buf[64];
    int e = err < 0 ? -err : err;
    if (e == 0)
        return "success";
    /* strerror_r (GNU) may or may not use buf */
    return strerror_r(e, buf, sizeof(buf));
}

int err_set(struct err_buf *e, int code, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}

void err_prefix(struct err_buf *e, const char *fmt, ...)
{
    char pre[512], old[sizeof(e->msg)];
    va_list ap;

    if (!e)
        return;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof(pre), fmt, ap);
    va_end(ap);
    memcpy(old, e->msg, sizeof(old));
    snprintf(e->msg, sizeof(e->msg), "%.500s: %.1000s", pre, old);
}

void err__assert_fail(const char *expr, const char *file, int line, const char *func)
{
    fprintf(stderr, "<2>assertion failed: %s at %s:%d (%s)\n", expr, file, line, func);
    fflush(stderr);
    abort();
}
