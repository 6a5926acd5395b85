/* util.c - byte buffers, hashing and UTF-8 helpers for the text pipeline.
 *
 * tok__utf8_lossy() replaces each maximal invalid subpart with one U+FFFD (Unicode 15 §3.9,
 * "U+FFFD substitution of maximal subparts"), which is what Rust's String::from_utf8_lossy
 * and therefore the tokenizers library do; the detokenizer relies on that equality.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int tok__buf_reserve(struct tok_buf *b, size_t extra)
{
    size_t want = b->n + extra + 1;
    if (want <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < want)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return -ENOMEM;
    b->p = p;
    b->cap = cap;
    return 0;
}

int tok__buf_put(struct tok_buf *b, const void *src, size_t n)
{
    int r = tok__buf_reserve(b, n);
    if (r < 0)
        return r;
    if (n)
        memcpy(b->p + b->n, src, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

int tok__buf_putc(struct tok_buf *b, char c)
{
    return tok__buf_put(b, &c, 1);
}

int tok__buf_puts(struct tok_buf *b, const char *s)
{
    return tok__buf_put(b, s, strlen(s));
}

int tok__buf_printf(struct tok_buf *b, const char *fmt, ...)
{
    va_list ap;
    char small[128];

    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0)
        return -EINVAL;
    if ((size_t) n < sizeof(small))
        return tok__buf_put(b, small, (size_t) n);
    int r = tok__buf_reserve(b, (size_t) n);
    if (r < 0)
        return r;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t) n + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t) n;
    return 0;
}

void tok__buf_done(struct tok_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

void *tok__grow(void *p, size_t *cap, size_t elem)
{
    size_t n = *cap ? *cap * 2 : 64;
    void *q = realloc(p, n * elem);
    if (q)
        *cap = n;
    return q;
}

int tok__ids_push(struct tok_ids *ids, int32_t id)
{
    if (ids->n == ids->cap) {
        int32_t *p = tok__grow(ids->ids, &ids->cap, sizeof(*p));
        if (!p)
            return -ENOMEM;
        ids->ids = p;
    }
    ids->ids[ids->n++] = id;
    return 0;
}

void tok_ids_done(struct tok_ids *ids)
{
    if (!ids)
        return;
    free(ids->ids);
    ids->ids = NULL;
    ids->n = ids->cap = 0;
}

/* FNV-1a, 64 bit, with a final avalanche so that low bits index tables well. */
uint64_t tok__hash(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/* Length of a valid UTF-8 sequence starting at s (n bytes available), 0 if invalid or
 * truncated; *ret_max is the length of the maximal subpart when invalid (>= 1). */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t *ret_max)
{
    unsigned c = s[0];
    size_t need;
    unsigned lo = 0x80, hi = 0xbf;

    *ret_max = 1;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        need = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else
        return 0;
    for (size_t i = 1; i < need; i++) {
        if (i >= n)
            return 0;
        unsigned d = s[i];
        if (d < (i == 1 ? lo : 0x80) || d > (i == 1 ? hi : 0xbf))
            return 0;
        *ret_max = i + 1;
    }
    return need;
}

size_t tok_utf8_valid_prefix(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *) s;
    size_t i = 0, mx;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t k = utf8_seq(u + i, n - i, &mx);
        if (!k)
            break;
        i += k;
    }
    return i;
}

size_t tok__utf8_incomplete_tail(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *) s;
    size_t mx;
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        size_t p = n - k;
        if ((u[p] & 0xc0) == 0x80)
            continue;
        if (u[p] < 0xc0)
            return 0;
        /* a lead byte: incomplete iff every byte after it is a valid continuation */
        if (utf8_seq(u + p, k, &mx) == 0 && mx == k)
            return k;
        return 0;
    }
    return 0;
}

int tok__utf8_next(const char *s, size_t n, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *) s;
    if (u[0] < 0x80 || n < 2) {
        *cp = u[0];
        return 1;
    }
    if (u[0] < 0xe0) {
        *cp = ((uint32_t)(u[0] & 0x1f) << 6) | (u[1] & 0x3f);
        return 2;
    }
    if (u[0] < 0xf0 || n < 4) {
        *cp = ((uint32_t)(u[0] & 0x0f) << 12) | ((uint32_t)(u[1] & 0x3f) << 6) | (u[2] & 0x3f);
        return 3;
    }
    *cp = ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3f) << 12) |
          ((uint32_t)(u[2] & 0x3f) << 6) | (u[3] & 0x3f);
    return 4;
}

int tok__utf8_put(char *dst, uint32_t cp)
{
    unsigned char *d = (unsigned char *) dst;
    if (cp < 0x80) {
        d[0] = (unsigned char) cp;
        return 1;
    }
    if (cp < 0x800) {
        d[0] = (unsigned char)(0xc0 | (cp >> 6));
        d[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (unsigned char)(0xe0 | (cp >> 12));
        d[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        d[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    d[0] = (unsigned char)(0xf0 | (cp >> 18));
    d[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    d[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    d[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

int tok__utf8_lossy(struct tok_buf *b, const char *src, size_t n)
{
    const unsigned char *u = (const unsigned char *) src;
    size_t i = 0, start = 0, mx;
    int r = tok__buf_reserve(b, n);
    if (r < 0)
        return r;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t k = utf8_seq(u + i, n - i, &mx);
        if (k) {
            i += k;
            continue;
        }
        if ((r = tok__buf_put(b, src + start, i - start)) < 0 ||
            (r = tok__buf_put(b, "\xef\xbf\xbd", 3)) < 0)
            return r;
        i += mx;
        start = i;
    }
    return tok__buf_put(b, src + start, n - start);
}
