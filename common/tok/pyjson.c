/* pyjson.c - JSON text exactly as Python's json.dumps(ensure_ascii=False) writes it.
 *
 * Chat templates and the tool-call parser must produce the bytes the Python stacks produce:
 * separators ", " and ": ", keys in insertion order (jansson >= 2.14 keeps it), non-ASCII
 * characters raw, control characters as \uXXXX except \b \f \n \r \t, and floats as
 * repr(float): the shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16, else
 * d.ddde+XX with at least two exponent digits.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "internal.h"

int tok__py_float(struct tok_buf *b, double x)
{
    char tmp[40], digits[24];
    int prec, exp10 = 0, nd = 0;

    if (isnan(x))
        return tok__buf_puts(b, "NaN");
    if (isinf(x))
        return tok__buf_puts(b, x < 0 ? "-Infinity" : "Infinity");
    if (x == 0)
        return tok__buf_puts(b, signbit(x) ? "-0.0" : "0.0");
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, x);
        if (strtod(tmp, NULL) == x)
            break;
    }
    /* tmp = [-]d[.ddd]e[+-]XX */
    const char *p = tmp;
    int r;
    if (*p == '-') {
        if ((r = tok__buf_putc(b, '-')) < 0)
            return r;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = '\0';
    exp10 = atoi(p + 1);
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 >= 0) {
            for (int i = 0; i <= exp10; i++)
                if ((r = tok__buf_putc(b, i < nd ? digits[i] : '0')) < 0)
                    return r;
            if ((r = tok__buf_putc(b, '.')) < 0)
                return r;
            if (nd > exp10 + 1)
                return tok__buf_puts(b, digits + exp10 + 1);
            return tok__buf_putc(b, '0');
        }
        if ((r = tok__buf_puts(b, "0.")) < 0)
            return r;
        for (int i = 0; i < -exp10 - 1; i++)
            if ((r = tok__buf_putc(b, '0')) < 0)
                return r;
        return tok__buf_puts(b, digits);
    }
    if ((r = tok__buf_putc(b, digits[0])) < 0)
        return r;
    if (nd > 1 && ((r = tok__buf_putc(b, '.')) < 0 || (r = tok__buf_puts(b, digits + 1)) < 0))
        return r;
    return tok__buf_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
}

static int json_string_valid(struct tok_buf *b, const char *s, size_t n);

/* Invalid UTF-8 (possible only from raw input, never from the detokenizer) becomes U+FFFD,
 * as decoding to a Python str would have made it, so the output is always valid JSON. */
int tok__py_json_string(struct tok_buf *b, const char *s, size_t n)
{
    if (tok_utf8_valid_prefix(s, n) == n)
        return json_string_valid(b, s, n);
    struct tok_buf fixed = {0};
    int r = tok__utf8_lossy(&fixed, s, n);
    if (r >= 0)
        r = json_string_valid(b, fixed.p, fixed.n);
    tok__buf_done(&fixed);
    return r;
}

static int json_string_valid(struct tok_buf *b, const char *s, size_t n)
{
    int r = tok__buf_putc(b, '"');
    size_t start = 0;
    for (size_t i = 0; i < n && r >= 0; i++) {
        unsigned char c = (unsigned char) s[i];
        const char *esc = NULL;
        char u[8];
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20) {
            snprintf(u, sizeof(u), "\\u%04x", c);
            esc = u;
        }
        if (!esc)
            continue;
        r = tok__buf_put(b, s + start, i - start);
        if (r >= 0)
            r = tok__buf_puts(b, esc);
        start = i + 1;
    }
    if (r >= 0)
        r = tok__buf_put(b, s + start, n - start);
    if (r >= 0)
        r = tok__buf_putc(b, '"');
    return r;
}

int tok__py_dump(struct tok_buf *b, const json_t *v)
{
    int r = 0;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *key;
        json_t *val;
        bool first = true;
        if ((r = tok__buf_putc(b, '{')) < 0)
            return r;
        json_object_foreach((json_t *) v, key, val) {
            if ((!first && (r = tok__buf_puts(b, ", ")) < 0) ||
                (r = tok__py_json_string(b, key, strlen(key))) < 0 ||
                (r = tok__buf_puts(b, ": ")) < 0 || (r = tok__py_dump(b, val)) < 0)
                return r;
            first = false;
        }
        return tok__buf_putc(b, '}');
    }
    case JSON_ARRAY:
        if ((r = tok__buf_putc(b, '[')) < 0)
            return r;
        for (size_t i = 0; i < json_array_size(v); i++)
            if ((i && (r = tok__buf_puts(b, ", ")) < 0) ||
                (r = tok__py_dump(b, json_array_get(v, i))) < 0)
                return r;
        return tok__buf_putc(b, ']');
    case JSON_STRING:
        return tok__py_json_string(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        return tok__buf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    case JSON_REAL:
        return tok__py_float(b, json_real_value(v));
    case JSON_TRUE:
        return tok__buf_puts(b, "true");
    case JSON_FALSE:
        return tok__buf_puts(b, "false");
    case JSON_NULL:
        return tok__buf_puts(b, "null");
    }
    return -EINVAL;
}

/* Python str() of a scalar; containers fall back to their JSON text. */
int tok__py_str(struct tok_buf *b, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_STRING:
        return tok__buf_put(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        return tok__buf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    case JSON_REAL:
        return tok__py_float(b, json_real_value(v));
    case JSON_TRUE:
        return tok__buf_puts(b, "True");
    case JSON_FALSE:
        return tok__buf_puts(b, "False");
    case JSON_NULL:
        return tok__buf_puts(b, "None");
    default:
        return tok__py_dump(b, v);
    }
}

int tok_json_dumps_py(const json_t *v, char **ret_text)
{
    struct tok_buf b = {0};
    int r = tok__py_dump(&b, v);
    if (r < 0) {
        tok__buf_done(&b);
        return r;
    }
    *ret_text = b.p;
    return 0;
}
