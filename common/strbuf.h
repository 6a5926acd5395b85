/* strbuf.h - a growable NUL-terminated byte string (redis sds in spirit, plain struct).
 *
 * struct strbuf b = STRBUF_INIT; ... strbuf_add(&b, s, n); strbuf_printf(&b, ...);
 * strbuf_str(&b) is always a valid C string ("" before the first byte); strbuf_done frees.
 * Appends return 0 or -ENOMEM and leave the string as it was on failure; a failed append
 * also sets the sticky `oom`, so a renderer may append without checking each call and look
 * once at the end.
 */
#pragma once

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

struct strbuf {
    char *p;                        /* NULL until the first append */
    size_t len, cap;
    bool oom;                       /* an append failed (sticky until done/take) */
};

#define STRBUF_INIT { NULL, 0, 0, false }

void strbuf_done(struct strbuf *b);
void strbuf_reset(struct strbuf *b);            /* empty, keeps the memory */
int strbuf_add(struct strbuf *b, const char *s, size_t n);
int strbuf_adds(struct strbuf *b, const char *s);
int strbuf_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int strbuf_vprintf(struct strbuf *b, const char *fmt, va_list ap);
/* The string (borrowed: valid until the next append or done). */
const char *strbuf_str(const struct strbuf *b);
/* The malloc'd string, handed over (NULL on -ENOMEM for an empty one); b is reset. */
char *strbuf_take(struct strbuf *b);
