/* json.c - see json.h. The one place jansson errors are translated. */
#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "file.h"

int json_parse_text(const char *buf, size_t len, const char *name, json_t **ret, struct err_buf *e)
{
    json_error_t jerr;
    json_t *root;

    *ret = NULL;
    root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return err_set(e, -EBADMSG, "%s: invalid JSON at line %d, column %d: %s", name, jerr.line,
                       jerr.column, jerr.text);
    *ret = root;
    return 0;
}

int json_parse_file(const char *path, size_t max_bytes, json_t **ret, struct err_buf *e)
{
    char *buf;
    size_t len;
    int r = file_read_all(path, max_bytes, FILE_REGULAR, &buf, &len);

    *ret = NULL;
    if (r == -EFBIG)
        return err_set(e, r, "%s: more than the %zu bytes allowed", path, max_bytes);
    if (r == -EBADF)
        return err_set(e, -EINVAL, "%s: not a regular file", path);
    if (r < 0)
        return err_set(e, r, "%s: cannot open: %s", path, err_str(r));
    r = json_parse_text(buf, len, path, ret, e);
    free(buf);
    return r;
}

const char *json_type_describe(const json_t *j)
{
    if (!j)
        return "nothing";
    switch (json_typeof(j)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    }
    return "an unknown value";
}

const char *json_path_join(char *buf, size_t size, const char *path, const char *key)
{
    if (path && path[0])
        snprintf(buf, size, "%s.%s", path, key);
    else
        snprintf(buf, size, "%s", key);
    return buf;
}

/* Common prologue: fetch key; absent -> 0 or -ENOENT. */
static int fetch(const json_t *obj, const char *path, const char *key, int flags, json_t **ret,
                 struct err_buf *e)
{
    char p[256];
    json_t *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;

    *ret = v;
    if (v)
        return 1;
    if (flags & JSON_GET_REQUIRED)
        return err_set(e, -ENOENT, "%s: required field is missing",
                       json_path_join(p, sizeof(p), path, key));
    return 0;
}

static int wrong_type(const char *path, const char *key, const char *want, const json_t *v,
                      struct err_buf *e)
{
    char p[256];
    return err_set(e, -EINVAL, "%s: expected %s, got %s", json_path_join(p, sizeof(p), path, key),
                   want, json_type_describe(v));
}

int json_get_int(const json_t *obj, const char *path, const char *key, int flags,
                 int64_t min, int64_t max, int64_t *ret, struct err_buf *e)
{
    char p[256];
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);
    int64_t x;

    if (r <= 0)
        return r;
    if (!json_is_integer(v))
        return wrong_type(path, key, "an integer", v, e);
    x = json_integer_value(v);
    if (x < min || x > max)
        return err_set(e, -EINVAL, "%s: %lld is out of range [%lld, %lld]",
                       json_path_join(p, sizeof(p), path, key), (long long) x, (long long) min,
                       (long long) max);
    *ret = x;
    return 1;
}

int json_get_i32(const json_t *obj, const char *path, const char *key, int flags,
                 int min, int max, int *ret, struct err_buf *e)
{
    int64_t x;
    int r = json_get_int(obj, path, key, flags, min, max, &x, e);
    if (r == 1)
        *ret = (int) x;
    return r;
}

int json_get_num(const json_t *obj, const char *path, const char *key, int flags, double *ret,
                 struct err_buf *e)
{
    char p[256];
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);

    if (r <= 0)
        return r;
    if (!json_is_number(v))
        return wrong_type(path, key, "a number", v, e);
    if (!isfinite(json_number_value(v)))
        return err_set(e, -EINVAL, "%s: not a finite number", json_path_join(p, sizeof(p), path, key));
    *ret = json_number_value(v);
    return 1;
}

int json_get_bool(const json_t *obj, const char *path, const char *key, int flags, bool *ret,
                  struct err_buf *e)
{
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);

    if (r <= 0)
        return r;
    if (!json_is_boolean(v))
        return wrong_type(path, key, "true or false", v, e);
    *ret = json_is_true(v);
    return 1;
}

int json_get_str(const json_t *obj, const char *path, const char *key, int flags, const char **ret,
                 struct err_buf *e)
{
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);

    if (r <= 0)
        return r;
    if (!json_is_string(v))
        return wrong_type(path, key, "a string", v, e);
    *ret = json_string_value(v);
    return 1;
}

int json_get_obj(const json_t *obj, const char *path, const char *key, int flags, json_t **ret,
                 struct err_buf *e)
{
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);

    if (r <= 0)
        return r;
    if (!json_is_object(v))
        return wrong_type(path, key, "an object", v, e);
    *ret = v;
    return 1;
}

int json_get_arr(const json_t *obj, const char *path, const char *key, int flags, json_t **ret,
                 struct err_buf *e)
{
    json_t *v;
    int r = fetch(obj, path, key, flags, &v, e);

    if (r <= 0)
        return r;
    if (!json_is_array(v))
        return wrong_type(path, key, "an array", v, e);
    *ret = v;
    return 1;
}
