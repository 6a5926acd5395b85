/* safetensors.c - see safetensors.h for the format and every check. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>


struct sft_file {
    char *path;
    struct sft_header hdr;
    uint64_t size;                    /* file size in bytes */
    const unsigned char *map;         /* whole file, or NULL (headers only) */
};

/* ------------------------------------------------------------------------ */
/* pre-scan: UTF-8, NUL, nesting depth and key count before jansson allocates */

static int utf8_seq_len(const unsigned char *s, size_t left)
{
    unsigned char c = s[0];
    int n;
    uint32_t cp;

    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF)
        n = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4)
        n = 4, cp = c & 0x07;
    else
        return -1;
    if ((size_t) n > left)
        return -1;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return -1;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return -1;
    return n;
}

static int header_prescan(const char *text, size_t len, const char *fname, size_t *ret_keys,
                          struct err_buf *e)
{
    const unsigned char *s = (const unsigned char *) text;
    bool in_str = false, esc = false;
    int depth = 0;
    size_t keys = 0;

    if (len == 0 || s[0] != '{')
        return err_set(e, -EBADMSG, "%s: header does not start with '{'", fname);
    for (size_t i = 0; i < len;) {
        unsigned char c = s[i];
        int n;

        if (c == 0)
            return err_set(e, -EILSEQ, "%s: header contains a NUL byte at offset %zu", fname, i);
        n = utf8_seq_len(s + i, len - i);
        if (n < 0)
            return err_set(e, -EILSEQ, "%s: header is not valid UTF-8 at offset %zu", fname, i);
        if (in_str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > SFT_DEPTH_MAX)
                return err_set(e, -E2BIG, "%s: header nests deeper than %d levels", fname,
                               SFT_DEPTH_MAX);
        } else if (c == '}' || c == ']') {
            depth--;
        } else if (c == ':' && depth == 1) {
            if (++keys > SFT_TENSORS_MAX + 1)
                return err_set(e, -E2BIG, "%s: header has more than %d entries", fname,
                               SFT_TENSORS_MAX);
        }
        i += (size_t) n;
    }
    *ret_keys = keys;
    return 0;
}

/* ------------------------------------------------------------------------ */

/* Check one tensor name against the naming rules (safetensors.h); returns 0 or -EINVAL with
 * the reason in e ("tensor name is empty", ...). */
static int sft_name_check(const char *name, size_t len, struct err_buf *e)
{
    if (len == 0)
        return err_set(e, -EINVAL, "tensor name is empty");
    if (len > SFT_NAME_MAX)
        return err_set(e, -E2BIG, "tensor name of %zu bytes is longer than %d", len, SFT_NAME_MAX);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char) name[i];
        if (c <= 0x20 || c >= 0x7f || c == '/' || c == '\\')
            return err_set(e, -EINVAL, "tensor name '%.64s' has a forbidden byte 0x%02x at %zu",
                           name, c, i);
        if (c == '.' && i + 1 < len && name[i + 1] == '.')
            return err_set(e, -EINVAL, "tensor name '%.64s' contains \"..\"", name);
    }
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const struct sft_tensor *) a)->name, ((const struct sft_tensor *) b)->name);
}

static int cmp_tensor_off(const void *a, const void *b)
{
    const struct sft_tensor *x = *(const struct sft_tensor * const *) a;
    const struct sft_tensor *y = *(const struct sft_tensor * const *) b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* A strict, allocation-bounded JSON reader for the header grammar only:
 *   { "__metadata__": {str: str, ...}?, "<name>": {"dtype": str, "shape": [int...],
 *     "data_offsets": [int, int]}, ... }
 * (jansson is 3-4x slower on the 73 921-tensor headers of the full model and
 * allocates per node; this reader allocates one name per tensor.)  Syntax errors
 * read "invalid JSON at offset N: ...". */

struct jp {
    const char *s;
    size_t n, i;
    const char *fname;
    struct err_buf *e;
};

static void jp_ws(struct jp *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

static int jp_syntax(struct jp *p, const char *what)
{
    return err_set(p->e, -EBADMSG, "%s: invalid JSON at offset %zu: %s", p->fname, p->i, what);
}

/* after the top-level value: nothing but white space, else the syntax error `what` */
static int jp_end(struct jp *p, const char *what)
{
    jp_ws(p);
    return p->i == p->n ? 0 : jp_syntax(p, what);
}

static int jp_expect(struct jp *p, char c)
{
    char msg[32];
    jp_ws(p);
    if (p->i < p->n && p->s[p->i] == c) {
        p->i++;
        return 0;
    }
    if (p->i >= p->n)
        return jp_syntax(p, "unexpected end of header");
    snprintf(msg, sizeof(msg), "expected '%c'", c);
    return jp_syntax(p, msg);
}

/* type of the value at p->i, for messages */
/* The members of an object or the elements of an array, after its opening character:
 *     bool first = true;
 *     while ((r = jp_next(p, '}', &first)) > 0)
 *         parse one member;
 * 1: another one follows (its separating comma and the blanks around it consumed); 0: the
 * closing character was next (consumed); <0: neither a comma nor the closing character. */
static int jp_next(struct jp *p, char close, bool *first)
{
    jp_ws(p);
    if (*first) {
        *first = false;
        if (p->i < p->n && p->s[p->i] == close) {
            p->i++;
            return 0;
        }
        return 1;
    }
    if (p->i < p->n && p->s[p->i] == ',') {
        p->i++;
        jp_ws(p);
        return 1;
    }
    return jp_expect(p, close);
}

static const char *jp_describe(struct jp *p)
{
    size_t i;
    jp_ws(p);
    if (p->i >= p->n)
        return "nothing";
    switch (p->s[p->i]) {
    case '{': return "an object";
    case '[': return "an array";
    case '"': return "a string";
    case 't': return "true";
    case 'f': return "false";
    case 'n': return "null";
    }
    {
        size_t d0 = p->i + (p->s[p->i] == '-');
        for (i = d0; i < p->n && p->s[i] >= '0' && p->s[i] <= '9'; i++)
            ;
        if (i == d0)
            return "an invalid token";   /* no digit (also a lone '-' at the end) */
        if (i < p->n && (p->s[i] == '.' || p->s[i] == 'e' || p->s[i] == 'E'))
            return "a real number";
        return "an integer";
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int jp_hex4(struct jp *p, uint32_t *ret)
{
    uint32_t v = 0;
    if (p->n - p->i < 4)
        return jp_syntax(p, "truncated \\u escape");
    for (int k = 0; k < 4; k++) {
        int h = hexval(p->s[p->i + (size_t) k]);
        if (h < 0)
            return jp_syntax(p, "bad \\u escape");
        v = v << 4 | (uint32_t) h;
    }
    p->i += 4;
    *ret = v;
    return 0;
}

/* String at p->i -> malloc'd UTF-8 (NUL-terminated, no NULs inside). */
static int jp_string(struct jp *p, char **ret, size_t *ret_len)
{
    size_t start, end, o = 0;
    char *out;
    int r;

    *ret = NULL;
    jp_ws(p);
    if (p->i >= p->n || p->s[p->i] != '"')
        return jp_syntax(p, "expected a string");
    start = ++p->i;
    for (end = start; end < p->n && p->s[end] != '"'; end++)
        if (p->s[end] == '\\')
            end++;
    if (end >= p->n)
        return jp_syntax(p, "unterminated string");
    out = malloc(end - start + 1);   /* decoded text is never longer than its escaped form */
    if (!out)
        return err_set(p->e, -ENOMEM, "%s: out of memory", p->fname);
    while (p->i < end) {
        unsigned char c = (unsigned char) p->s[p->i];
        if (c < 0x20) {
            r = jp_syntax(p, "control character in string");
            goto fail;
        }
        if (c != '\\') {
            out[o++] = (char) c;
            p->i++;
            continue;
        }
        p->i++;
        switch (p->s[p->i++]) {
        case '"': out[o++] = '"'; break;
        case '\\': out[o++] = '\\'; break;
        case '/': out[o++] = '/'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if ((r = jp_hex4(p, &cp)) < 0)
                goto fail;
            if (cp >= 0xDC00 && cp <= 0xDFFF) {
                r = jp_syntax(p, "lone low surrogate in \\u escape");
                goto fail;
            }
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (p->i + 2 > end || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') {
                    r = jp_syntax(p, "lone high surrogate in \\u escape");
                    goto fail;
                }
                p->i += 2;
                if ((r = jp_hex4(p, &lo)) < 0)
                    goto fail;
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    r = jp_syntax(p, "bad surrogate pair in \\u escape");
                    goto fail;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            if (cp == 0) {
                r = jp_syntax(p, "\\u0000 is not allowed");
                goto fail;
            }
            if (cp < 0x80) {
                out[o++] = (char) cp;
            } else if (cp < 0x800) {
                out[o++] = (char) (0xC0 | cp >> 6);
                out[o++] = (char) (0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                out[o++] = (char) (0xE0 | cp >> 12);
                out[o++] = (char) (0x80 | ((cp >> 6) & 0x3F));
                out[o++] = (char) (0x80 | (cp & 0x3F));
            } else {
                out[o++] = (char) (0xF0 | cp >> 18);
                out[o++] = (char) (0x80 | ((cp >> 12) & 0x3F));
                out[o++] = (char) (0x80 | ((cp >> 6) & 0x3F));
                out[o++] = (char) (0x80 | (cp & 0x3F));
            }
            break;
        }
        default:
            p->i--;
            r = jp_syntax(p, "bad escape in string");
            goto fail;
        }
    }
    p->i = end + 1;
    out[o] = 0;
    *ret = out;
    if (ret_len)
        *ret_len = o;
    return 0;
fail:
    free(out);
    return r;
}

/* Integer at p->i.  Returns 0 and *ret, or a negative errno; reals, other
 * types, negatives and values above INT64_MAX are refused naming what/idx. */
static int jp_u64(struct jp *p, const char *name, const char *what, size_t idx, uint64_t *ret)
{
    const char *t = jp_describe(p);
    bool neg = false;
    uint64_t v = 0;

    if (strcmp(t, "an integer") != 0)
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': %s[%zu] must be an integer, got %s", p->fname, name,
                       what, idx, t);
    /* jp_describe guaranteed at least one digit after an optional '-' */
    if (p->s[p->i] == '-') {
        neg = true;
        p->i++;
    }
    BUG_ON(p->i >= p->n);
    if (p->s[p->i] == '0' && p->i + 1 < p->n && p->s[p->i + 1] >= '0' && p->s[p->i + 1] <= '9')
        return jp_syntax(p, "leading zero in a number");
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        unsigned d = (unsigned) (p->s[p->i] - '0');
        if (v > ((uint64_t) INT64_MAX - d) / 10)
            return err_set(p->e, -EBADMSG, "%s: tensor '%s': %s[%zu]: too big integer (above 2^63-1)", p->fname,
                           name, what, idx);
        v = v * 10 + d;
        p->i++;
    }
    if (neg && v)
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': %s[%zu] is negative (-%llu)", p->fname, name, what,
                       idx, (unsigned long long) v);
    *ret = v;
    return 0;
}

static int jp_u64_array(struct jp *p, const char *name, const char *what, size_t max_len, uint64_t *out,
                        size_t *ret_len)
{
    bool first = true;
    size_t k = 0;
    int r;

    jp_ws(p);
    if (p->i >= p->n || p->s[p->i] != '[')
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': %s must be an array, got %s", p->fname, name, what,
                       jp_describe(p));
    p->i++;
    while ((r = jp_next(p, ']', &first)) > 0) {
        uint64_t v = 0;

        r = jp_u64(p, name, what, k, &v);
        if (r < 0)
            return r;
        if (k < max_len)
            out[k] = v;
        k++;
    }
    if (r < 0)
        return r;
    if (k > max_len)
        return err_set(p->e, -E2BIG, "%s: tensor '%s': %s has %zu entries, at most %zu allowed", p->fname, name,
                       what, k, max_len);
    *ret_len = k;
    return 0;
}

static int cmp_cstr(const void *a, const void *b)
{
    return strcmp(*(char * const *) a, *(char * const *) b);
}

static int jp_metadata(struct jp *p, struct sft_header *h)
{
    char **keys = NULL;
    bool first = true;
    size_t nk = 0;
    int r;

    jp_ws(p);
    if (p->i >= p->n || p->s[p->i] != '{')
        return err_set(p->e, -EBADMSG, "%s: __metadata__ must be an object, got %s", p->fname, jp_describe(p));
    p->i++;
    keys = calloc(SFT_METADATA_MAX + 1, sizeof(*keys));
    if (!keys)
        return err_set(p->e, -ENOMEM, "%s: out of memory", p->fname);
    while ((r = jp_next(p, '}', &first)) > 0) {
        char *k = NULL, *v = NULL;
        if (nk == SFT_METADATA_MAX) {
            r = err_set(p->e, -E2BIG, "%s: __metadata__ has more than %d entries", p->fname, SFT_METADATA_MAX);
            goto out;
        }
        r = jp_string(p, &k, NULL);
        if (r < 0)
            goto out;
        keys[nk++] = k;
        r = jp_expect(p, ':');
        if (r < 0)
            goto out;
        jp_ws(p);
        if (p->i >= p->n || p->s[p->i] != '"') {
            r = err_set(p->e, -EBADMSG, "%s: __metadata__.%.64s must be a string, got %s", p->fname, k,
                        jp_describe(p));
            goto out;
        }
        r = jp_string(p, &v, NULL);
        free(v);
        if (r < 0)
            goto out;
    }
    if (r < 0)
        goto out;
    qsort(keys, nk, sizeof(*keys), cmp_cstr);
    for (size_t i = 1; i < nk; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0) {
            r = err_set(p->e, -EBADMSG, "%s: __metadata__: duplicate key '%.64s'", p->fname, keys[i]);
            goto out;
        }
    h->n_metadata = nk;
    r = 0;
out:
    for (size_t i = 0; i < nk; i++)
        free(keys[i]);
    free(keys);
    return r;
}

/* Tensor entry; takes ownership of name. */
static int jp_tensor(struct jp *p, char *name, size_t name_len, struct sft_tensor *t)
{
    uint64_t dims[TENSOR_MAX_DIMS], offs[2], numel = 1, bits;
    bool have_dt = false, have_shape = false, have_off = false, first = true;
    size_t nd = 0, no = 0;
    int r;

    t->name = name;
    r = sft_name_check(name, name_len, p->e);
    if (r < 0) {
        err_prefix(p->e, "%s", p->fname);
        return r;
    }
    jp_ws(p);
    if (p->i >= p->n || p->s[p->i] != '{')
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': entry must be an object, got %s", p->fname, name,
                       jp_describe(p));
    p->i++;
    while ((r = jp_next(p, '}', &first)) > 0) {
        char *k = NULL;
        r = jp_string(p, &k, NULL);
        if (r < 0)
            return r;
        r = jp_expect(p, ':');
        if (r < 0) {
            free(k);
            return r;
        }
        if (strcmp(k, "dtype") == 0 && !have_dt) {
            char *dt = NULL;
            jp_ws(p);
            if (p->i >= p->n || p->s[p->i] != '"')
                r = err_set(p->e, -EBADMSG, "%s: tensor '%s': dtype must be a string, got %s", p->fname,
                            name, jp_describe(p));
            else if ((r = jp_string(p, &dt, NULL)) == 0) {
                t->dtype = dtype_parse(dt);
                if (t->dtype == DTYPE_INVALID)
                    r = err_set(p->e, -EPROTONOSUPPORT, "%s: tensor '%s': unknown dtype '%.32s'", p->fname,
                                name, dt);
                free(dt);
            }
            have_dt = true;
        } else if (strcmp(k, "shape") == 0 && !have_shape) {
            r = jp_u64_array(p, name, "shape", TENSOR_MAX_DIMS, dims, &nd);
            have_shape = true;
        } else if (strcmp(k, "data_offsets") == 0 && !have_off) {
            r = jp_u64_array(p, name, "data_offsets", 2, offs, &no);
            have_off = true;
        } else if (strcmp(k, "dtype") == 0 || strcmp(k, "shape") == 0 || strcmp(k, "data_offsets") == 0) {
            r = err_set(p->e, -EBADMSG, "%s: tensor '%s': duplicate key '%s'", p->fname, name, k);
        } else {
            r = err_set(p->e, -EBADMSG, "%s: tensor '%s': unexpected key '%.64s'", p->fname, name, k);
        }
        free(k);
        if (r < 0)
            return r;
    }
    if (r < 0)
        return r;
    if (!have_dt || !have_shape || !have_off)
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': missing '%s'", p->fname, name,
                       !have_dt ? "dtype" : !have_shape ? "shape" : "data_offsets");
    if (no != 2)
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': data_offsets has %zu entries, expected 2", p->fname,
                       name, no);
    if (offs[1] < offs[0])
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': data_offsets end %llu is before begin %llu", p->fname,
                       name, (unsigned long long) offs[1], (unsigned long long) offs[0]);
    t->ndim = (int) nd;
    for (size_t i = 0; i < nd; i++) {
        t->shape[i] = (int64_t) dims[i];
        if (__builtin_mul_overflow(numel, dims[i], &numel))
            return err_set(p->e, -EOVERFLOW, "%s: tensor '%s': element count overflows 64 bits", p->fname, name);
    }
    if (numel > INT64_MAX || __builtin_mul_overflow(numel, (uint64_t) dtype_bits(t->dtype), &bits))
        return err_set(p->e, -EOVERFLOW, "%s: tensor '%s': byte size overflows 64 bits", p->fname, name);
    if (bits % 8)
        return err_set(p->e, -EBADMSG, "%s: tensor '%s': %llu elements of %s do not end on a byte boundary",
                       p->fname, name, (unsigned long long) numel, dtype_name(t->dtype));
    if (offs[1] - offs[0] != bits / 8)
        return err_set(p->e, -EBADMSG,
                       "%s: tensor '%s': data_offsets span %llu bytes but %s x %llu elements need %llu", p->fname,
                       name, (unsigned long long) (offs[1] - offs[0]), dtype_name(t->dtype),
                       (unsigned long long) numel, (unsigned long long) (bits / 8));
    t->begin = offs[0];
    t->end = offs[1];
    return 0;
}

int sft_header_parse(const char *text, size_t len, const char *fname, struct sft_header *ret,
                     struct err_buf *e)
{
    struct sft_header h = { 0 };
    struct sft_tensor **by_off = NULL;
    struct jp p = { .s = text, .n = len, .fname = fname, .e = e };
    size_t cap = 0;
    bool have_meta = false, first = true;
    int r;

    *ret = h;
    if (len > SFT_HEADER_MAX)
        return err_set(e, -E2BIG, "%s: header of %zu bytes exceeds %llu", fname, len, SFT_HEADER_MAX);
    r = header_prescan(text, len, fname, &cap, e);
    if (r < 0)
        return r;
    h.tensors = calloc(cap ? cap : 1, sizeof(*h.tensors));
    if (!h.tensors)
        return err_set(e, -ENOMEM, "%s: out of memory", fname);
    r = jp_expect(&p, '{');
    if (r < 0)
        goto out;
    while ((r = jp_next(&p, '}', &first)) > 0) {
        char *key = NULL;
        size_t kl;
        r = jp_string(&p, &key, &kl);
        if (r < 0)
            goto out;
        r = jp_expect(&p, ':');
        if (r < 0) {
            free(key);
            goto out;
        }
        if (strcmp(key, "__metadata__") == 0) {
            free(key);
            if (have_meta) {
                r = err_set(e, -EBADMSG, "%s: __metadata__ appears twice", fname);
                goto out;
            }
            have_meta = true;
            r = jp_metadata(&p, &h);
        } else {
            BUG_ON(h.n_tensors >= cap);
            r = jp_tensor(&p, key, kl, &h.tensors[h.n_tensors]);
            h.n_tensors++;   /* the name is owned by the header even on failure */
        }
        if (r < 0)
            goto out;
    }
    if (r == 0)
        r = jp_end(&p, "trailing characters after the header object");
    if (r < 0)
        goto out;
    if (h.n_tensors > SFT_TENSORS_MAX) {
        r = err_set(e, -E2BIG, "%s: %zu tensors, more than %d", fname, h.n_tensors, SFT_TENSORS_MAX);
        goto out;
    }

    /* names are unique (the lookup table is sorted by name) */
    qsort(h.tensors, h.n_tensors, sizeof(*h.tensors), cmp_tensor_name);
    for (size_t i = 1; i < h.n_tensors; i++)
        if (strcmp(h.tensors[i - 1].name, h.tensors[i].name) == 0) {
            r = err_set(e, -EEXIST, "%s: tensor '%s' appears twice", fname, h.tensors[i].name);
            goto out;
        }

    /* contiguity: sorted by offsets the tensors must tile [0, data_len) */
    by_off = malloc((h.n_tensors ? h.n_tensors : 1) * sizeof(*by_off));
    if (!by_off) {
        r = err_set(e, -ENOMEM, "%s: out of memory", fname);
        goto out;
    }
    for (size_t i = 0; i < h.n_tensors; i++)
        by_off[i] = &h.tensors[i];
    qsort(by_off, h.n_tensors, sizeof(*by_off), cmp_tensor_off);
    for (size_t i = 0; i < h.n_tensors; i++) {
        uint64_t want = i ? by_off[i - 1]->end : 0;
        if (by_off[i]->begin != want) {
            if (by_off[i]->begin < want)
                r = err_set(e, -EBADMSG,
                            "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' (ends at %llu)",
                            fname, by_off[i]->name, (unsigned long long) by_off[i]->begin,
                            (unsigned long long) by_off[i]->end, by_off[i - 1]->name,
                            (unsigned long long) want);
            else
                r = err_set(e, -EBADMSG,
                            "%s: tensor '%s': data_offsets begin %llu leaves a gap after %llu",
                            fname, by_off[i]->name, (unsigned long long) by_off[i]->begin,
                            (unsigned long long) want);
            goto out;
        }
    }
    h.data_len = h.n_tensors ? by_off[h.n_tensors - 1]->end : 0;
    h.header_len = len;
    *ret = h;
    h.tensors = NULL;
    h.n_tensors = 0;
    r = 0;
out:
    free(by_off);
    sft_header_done(&h);
    return r;
}

void sft_header_done(struct sft_header *h)
{
    if (!h)
        return;
    for (size_t i = 0; i < h->n_tensors; i++)
        free(h->tensors[i].name);
    free(h->tensors);
    h->tensors = NULL;
    h->n_tensors = 0;
}

const struct sft_tensor *sft_header_find(const struct sft_header *h, const char *name)
{
    struct sft_tensor key = { .name = (char *) name };
    return bsearch(&key, h->tensors, h->n_tensors, sizeof(*h->tensors), cmp_tensor_name);
}

/* Length prefix checks shared by sft_parse_mem and sft_open. */
static int check_prefix(uint64_t n, uint64_t size, const char *fname, struct err_buf *e)
{
    uint64_t end;

    if (__builtin_add_overflow(n, (uint64_t) 8, &end))
        return err_set(e, -EOVERFLOW, "%s: header length %llu + 8 overflows", fname,
                       (unsigned long long) n);
    if (n == 0)
        return err_set(e, -EBADMSG, "%s: header length is 0", fname);
    if (n > SFT_HEADER_MAX)
        return err_set(e, -E2BIG, "%s: header length %llu exceeds the %llu-byte cap", fname,
                       (unsigned long long) n, SFT_HEADER_MAX);
    if (end > size)
        return err_set(e, -EBADMSG, "%s: header length %llu runs past the end of the %llu-byte file",
                       fname, (unsigned long long) n, (unsigned long long) size);
    return 0;
}

static int check_total(const struct sft_header *h, uint64_t size, const char *fname,
                       struct err_buf *e)
{
    uint64_t have = size - 8 - h->header_len;

    if (h->data_len > have)
        return err_set(e, -EBADMSG,
                       "%s: tensors need %llu data bytes but the file holds only %llu (truncated?)",
                       fname, (unsigned long long) h->data_len, (unsigned long long) have);
    if (h->data_len < have)
        return err_set(e, -EBADMSG,
                       "%s: %llu trailing bytes after the last tensor (file is larger than its header says)",
                       fname, (unsigned long long) (have - h->data_len));
    return 0;
}

static uint64_t le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

int sft_parse_mem(const void *buf, size_t size, const char *fname, struct sft_header *ret,
                  struct err_buf *e)
{
    const unsigned char *p = buf;
    uint64_t n;
    int r;

    memset(ret, 0, sizeof(*ret));
    if (size < 8)
        return err_set(e, -EBADMSG, "%s: file of %zu bytes is too small for the 8-byte header length",
                       fname, size);
    n = le64(p);
    r = check_prefix(n, size, fname, e);
    if (r < 0)
        return r;
    r = sft_header_parse((const char *) p + 8, (size_t) n, fname, ret, e);
    if (r < 0)
        return r;
    r = check_total(ret, size, fname, e);
    if (r < 0)
        sft_header_done(ret);
    return r;
}

/* ------------------------------------------------------------------------ */

static int pread_all(int fd, void *buf, size_t n, off_t off)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(fd, (char *) buf + got, n - got, off + (off_t) got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        if (k == 0)
            return -EIO;
        got += (size_t) k;
    }
    return 0;
}

int sft_open(const char *path, int flags, struct sft_file **ret, struct err_buf *e)
{
    struct sft_file *f;
    unsigned char pre[8];
    struct stat st;
    char *text = NULL;
    uint64_t n;
    int fd, r;

    *ret = NULL;
    f = calloc(1, sizeof(*f));
    if (!f)
        return err_set(e, -ENOMEM, "%s: out of memory", path);
    f->path = strdup(path);
    if (!f->path) {
        free(f);
        return err_set(e, -ENOMEM, "%s: out of memory", path);
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        r = err_set(e, -errno, "%s: cannot open: %s", path, err_str(errno));
        goto out_free;
    }
    if (fstat(fd, &st) < 0) {
        r = err_set(e, -errno, "%s: cannot stat: %s", path, err_str(errno));
        goto out_close;
    }
    if (!S_ISREG(st.st_mode)) {
        r = err_set(e, -EINVAL, "%s: not a regular file", path);
        goto out_close;
    }
    f->size = (uint64_t) st.st_size;
    if (f->size < 8) {
        r = err_set(e, -EBADMSG, "%s: file of %llu bytes is too small for the 8-byte header length",
                    path, (unsigned long long) f->size);
        goto out_close;
    }
    r = pread_all(fd, pre, 8, 0);
    if (r < 0) {
        r = err_set(e, r, "%s: read failed: %s", path, err_str(r));
        goto out_close;
    }
    n = le64(pre);
    r = check_prefix(n, f->size, path, e);
    if (r < 0)
        goto out_close;
    text = malloc((size_t) n);   /* n <= SFT_HEADER_MAX and n + 8 <= file size */
    if (!text) {
        r = err_set(e, -ENOMEM, "%s: out of memory for a %llu-byte header", path,
                    (unsigned long long) n);
        goto out_close;
    }
    r = pread_all(fd, text, (size_t) n, 8);
    if (r < 0) {
        r = err_set(e, r, "%s: read failed: %s", path, err_str(r));
        goto out_close;
    }
    r = sft_header_parse(text, (size_t) n, path, &f->hdr, e);
    if (r < 0)
        goto out_close;
    r = check_total(&f->hdr, f->size, path, e);
    if (r < 0)
        goto out_close;
    if (!(flags & SFT_OPEN_HEADERS_ONLY)) {
        void *m = mmap(NULL, (size_t) f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            r = err_set(e, -errno, "%s: mmap failed: %s", path, err_str(errno));
            goto out_close;
        }
        f->map = m;
    }
    *ret = f;
    f = NULL;
    r = 0;
out_close:
    free(text);
    close(fd);
out_free:
    sft_close(f);
    return r;
}

void sft_close(struct sft_file *f)
{
    if (!f)
        return;
    if (f->map)
        munmap((void *) f->map, (size_t) f->size);
    sft_header_done(&f->hdr);
    free(f->path);
    free(f);
}

const struct sft_header *sft_file_header(const struct sft_file *f) { return &f->hdr; }
const char *sft_file_path(const struct sft_file *f) { return f->path; }

void sft_file_view(const struct sft_file *f, const struct sft_tensor *t, struct tview *ret)
{
    memset(ret, 0, sizeof(*ret));
    ret->dtype = t->dtype;
    ret->ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++)
        ret->shape[i] = t->shape[i];
    ret->nbytes = (size_t) (t->end - t->begin);
    ret->data = f->map ? f->map + 8 + f->hdr.header_len + t->begin : NULL;
}

/* ------------------------------------------------------------------------ */
/* index */

static int shard_name_check(const char *s, const char *fname, const char *tensor, struct err_buf *e)
{
    size_t len = strlen(s);
    static const char suffix[] = ".safetensors";

    if (len == 0 || len > 255)
        return err_set(e, -EINVAL, "%s: tensor '%s': shard name of %zu bytes", fname, tensor, len);
    if (s[0] == '/')
        return err_set(e, -EACCES, "%s: tensor '%s': shard '%.64s' is an absolute path", fname,
                       tensor, s);
    if (strchr(s, '/') || strchr(s, '\\') || strcmp(s, "..") == 0 || strcmp(s, ".") == 0)
        return err_set(e, -EACCES,
                       "%s: tensor '%s': shard '%.64s' is not a plain file name in the model directory",
                       fname, tensor, s);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char) s[i] < 0x20 || (unsigned char) s[i] == 0x7f)
            return err_set(e, -EINVAL, "%s: tensor '%s': shard name has a control byte", fname, tensor);
    if (len < sizeof(suffix) || strcmp(s + len - (sizeof(suffix) - 1), suffix) != 0)
        return err_set(e, -EINVAL, "%s: tensor '%s': shard '%.64s' does not end in .safetensors",
                       fname, tensor, s);
    return 0;
}

/* Skip any JSON value (index metadata), at most 64 levels deep. */
static int jp_skip(struct jp *p, int depth)
{
    int r;

    if (depth > 64)
        return err_set(p->e, -E2BIG, "%s: JSON nests deeper than 64 levels at offset %zu", p->fname, p->i);
    jp_ws(p);
    if (p->i >= p->n)
        return jp_syntax(p, "unexpected end");
    switch (p->s[p->i]) {
    case '"': {
        char *x = NULL;
        r = jp_string(p, &x, NULL);
        free(x);
        return r;
    }
    case '{':
    case '[': {
        char close = p->s[p->i] == '{' ? '}' : ']';
        bool obj = close == '}', first = true;
        p->i++;
        while ((r = jp_next(p, close, &first)) > 0) {
            if (obj) {
                char *k = NULL;
                r = jp_string(p, &k, NULL);
                free(k);
                if (r < 0)
                    return r;
                r = jp_expect(p, ':');
                if (r < 0)
                    return r;
            }
            r = jp_skip(p, depth + 1);
            if (r < 0)
                return r;
        }
        return r;
    }
    }
    if (p->n - p->i >= 4 && memcmp(p->s + p->i, "true", 4) == 0) {
        p->i += 4;
        return 0;
    }
    if (p->n - p->i >= 5 && memcmp(p->s + p->i, "false", 5) == 0) {
        p->i += 5;
        return 0;
    }
    if (p->n - p->i >= 4 && memcmp(p->s + p->i, "null", 4) == 0) {
        p->i += 4;
        return 0;
    }
    {
        size_t i0 = p->i, d = 0;
        if (p->s[p->i] == '-')
            p->i++;
        while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9')
            p->i++, d++;
        if (d && p->i < p->n && p->s[p->i] == '.') {
            p->i++;
            for (d = 0; p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9'; d++)
                p->i++;
        }
        if (d && p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
            p->i++;
            if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-'))
                p->i++;
            for (d = 0; p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9'; d++)
                p->i++;
        }
        if (!d) {
            p->i = i0;
            return jp_syntax(p, "invalid value");
        }
    }
    return 0;
}

static int utf8_check(const char *text, size_t len, const char *fname, struct err_buf *e)
{
    for (size_t i = 0; i < len;) {
        int n;
        if (text[i] == 0)
            return err_set(e, -EILSEQ, "%s: NUL byte at offset %zu", fname, i);
        n = utf8_seq_len((const unsigned char *) text + i, len - i);
        if (n < 0)
            return err_set(e, -EILSEQ, "%s: not valid UTF-8 at offset %zu", fname, i);
        i += (size_t) n;
    }
    return 0;
}

struct idx_pair {
    char *name;
    char *shard;
};

static int cmp_pair(const void *a, const void *b)
{
    return strcmp(((const struct idx_pair *) a)->name, ((const struct idx_pair *) b)->name);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char * const *) a, *(char * const *) b);
}

static int index_weight_map(struct jp *p, struct idx_pair **ret_pairs, size_t *ret_n)
{
    struct idx_pair *pairs = NULL;
    size_t n = 0, cap = 0;
    bool first = true;
    int r;

    jp_ws(p);
    if (p->i >= p->n || p->s[p->i] != '{')
        return err_set(p->e, -EINVAL, "%s: weight_map: expected an object, got %s", p->fname, jp_describe(p));
    p->i++;
    while ((r = jp_next(p, '}', &first)) > 0) {
        char *k = NULL, *v = NULL;
        size_t kl;
        if (n == SFT_TENSORS_MAX) {
            r = err_set(p->e, -E2BIG, "%s: weight_map has more than %d entries", p->fname, SFT_TENSORS_MAX);
            goto fail;
        }
        r = jp_string(p, &k, &kl);
        if (r < 0)
            goto fail;
        if ((r = jp_expect(p, ':')) < 0 || (r = sft_name_check(k, kl, p->e)) < 0) {
            if (r != -EBADMSG)
                err_prefix(p->e, "%s: weight_map", p->fname);
            free(k);
            goto fail;
        }
        jp_ws(p);
        if (p->i >= p->n || p->s[p->i] != '"') {
            r = err_set(p->e, -EBADMSG, "%s: weight_map.%s: expected a shard file name, got %s", p->fname, k,
                        jp_describe(p));
            free(k);
            goto fail;
        }
        r = jp_string(p, &v, NULL);
        if (r == 0)
            r = shard_name_check(v, p->fname, k, p->e);
        if (r == 0 && n == cap) {
            struct idx_pair *np = realloc(pairs, (cap = cap ? cap * 2 : 256) * sizeof(*np));
            if (!np)
                r = err_set(p->e, -ENOMEM, "%s: out of memory", p->fname);
            else
                pairs = np;
        }
        if (r < 0) {
            free(k);
            free(v);
            goto fail;
        }
        pairs[n].name = k;
        pairs[n].shard = v;
        n++;
    }
    if (r < 0)
        goto fail;
    *ret_pairs = pairs;
    *ret_n = n;
    return 0;
fail:
    for (size_t i = 0; i < n; i++) {
        free(pairs[i].name);
        free(pairs[i].shard);
    }
    free(pairs);
    return r;
}

int sft_index_parse(const char *text, size_t len, const char *fname, struct sft_index *ret,
                    struct err_buf *e)
{
    struct sft_index idx = { 0 };
    struct idx_pair *pairs = NULL;
    struct jp p = { .s = text, .n = len, .fname = fname, .e = e };
    bool have_meta = false, have_wm = false, first = true;
    size_t n = 0, ns = 0;
    int r;

    memset(ret, 0, sizeof(*ret));
    if (len > SFT_INDEX_MAX)
        return err_set(e, -E2BIG, "%s: %zu bytes, more than %u", fname, len, SFT_INDEX_MAX);
    r = utf8_check(text, len, fname, e);
    if (r < 0)
        return r;
    jp_ws(&p);
    if (p.i >= p.n || p.s[p.i] != '{')
        return err_set(e, -EBADMSG, "%s: must be a JSON object, got %s", fname, jp_describe(&p));
    p.i++;
    while ((r = jp_next(&p, '}', &first)) > 0) {
        char *k = NULL;
        r = jp_string(&p, &k, NULL);
        if (r < 0)
            goto out;
        r = jp_expect(&p, ':');
        if (r == 0 && strcmp(k, "weight_map") == 0) {
            if (have_wm)
                r = err_set(e, -EBADMSG, "%s: weight_map: duplicate key", fname);
            else
                r = index_weight_map(&p, &pairs, &n);
            have_wm = true;
        } else if (r == 0 && strcmp(k, "metadata") == 0) {
            /* never trusted (total_size is stale in qstream output): shape check only */
            jp_ws(&p);
            if (have_meta)
                r = err_set(e, -EBADMSG, "%s: metadata: duplicate key", fname);
            else if (p.i >= p.n || p.s[p.i] != '{')
                r = err_set(e, -EINVAL, "%s: metadata: expected an object, got %s", fname, jp_describe(&p));
            else
                r = jp_skip(&p, 1);
            have_meta = true;
        } else if (r == 0) {
            r = jp_skip(&p, 1);
        }
        free(k);
        if (r < 0)
            goto out;
    }
    if (r == 0)
        r = jp_end(&p, "trailing characters after the index object");
    if (r < 0)
        goto out;
    if (!have_wm) {
        r = err_set(e, -ENOENT, "%s: weight_map: required field is missing", fname);
        goto out;
    }
    if (n)
        qsort(pairs, n, sizeof(*pairs), cmp_pair);
    for (size_t i = 1; i < n; i++)
        if (strcmp(pairs[i - 1].name, pairs[i].name) == 0) {
            r = err_set(e, -EBADMSG, "%s: weight_map: duplicate tensor '%s'", fname, pairs[i].name);
            goto out;
        }
    idx.names = calloc(n + 1, sizeof(char *));
    idx.shard_of = calloc(n + 1, sizeof(int));
    idx.shards = calloc(n + 1, sizeof(char *));
    if (!idx.names || !idx.shard_of || !idx.shards) {
        r = err_set(e, -ENOMEM, "%s: out of memory", fname);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        idx.shards[i] = pairs[i].shard;
    qsort(idx.shards, n, sizeof(char *), cmp_str);
    for (size_t i = 0; i < n; i++)
        if (i == 0 || strcmp(idx.shards[i], idx.shards[ns - 1]) != 0)
            idx.shards[ns++] = idx.shards[i];
    for (size_t i = 0; i < n; i++) {
        char **hit = bsearch(&pairs[i].shard, idx.shards, ns, sizeof(char *), cmp_str);
        BUG_ON(!hit);
        idx.shard_of[i] = (int) (hit - idx.shards);
        idx.names[i] = pairs[i].name;
        pairs[i].name = NULL;
    }
    /* keep one copy of each shard name; free the other duplicates */
    for (size_t i = 0; i < ns; i++)
        idx.shards[i] = strdup(idx.shards[i]);
    for (size_t i = 0; i < ns; i++)
        if (!idx.shards[i]) {
            r = err_set(e, -ENOMEM, "%s: out of memory", fname);
            idx.n = n;
            idx.n_shards = ns;
            goto out;
        }
    idx.n = n;
    idx.n_shards = ns;
    *ret = idx;
    memset(&idx, 0, sizeof(idx));
    r = 0;
out:
    sft_index_done(&idx);
    for (size_t i = 0; i < n; i++) {
        free(pairs[i].name);
        free(pairs[i].shard);
    }
    free(pairs);
    return r;
}

void sft_index_done(struct sft_index *idx)
{
    if (!idx)
        return;
    for (size_t i = 0; i < idx->n; i++)
        free(idx->names[i]);
    for (size_t i = 0; i < idx->n_shards; i++)
        free(idx->shards[i]);
    free(idx->names);
    free(idx->shard_of);
    free(idx->shards);
    memset(idx, 0, sizeof(*idx));
}

long sft_index_find(const struct sft_index *idx, const char *name)
{
    char **hit = bsearch(&name, idx->names, idx->n, sizeof(char *), cmp_str);
    return hit ? (long) (hit - idx->names) : -1;
}
