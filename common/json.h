/* json.h - thin helpers over jansson: strict parsing and typed getters whose
 * errors name the JSON path of the bad field.
 *
 * Parsing always uses JSON_REJECT_DUPLICATES (a duplicated key is an error, never
 * "last one wins").  Getters take the path of the containing object ("" for the
 * root, "text_config", "quantization_config.config_groups.group_0") and the key,
 * and write messages such as "text_config.hidden_size: expected an integer, got
 * a string".  Return convention of the getters: 1 found and stored, 0 absent and
 * optional (ret untouched), <0 negative errno (-EINVAL wrong type or range,
 * -ENOENT absent but required).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

enum json_get_flags {
    JSON_GET_OPTIONAL = 0,
    JSON_GET_REQUIRED = 1 << 0,
};

/* Parse len bytes (need not be NUL-terminated).  name is used in messages:
 * "name: line 3, column 5: duplicate object key".  -EBADMSG on bad JSON. */
int json_parse_text(const char *buf, size_t len, const char *name, json_t **ret, struct err_buf *e);
/* Read and parse a file of at most max_bytes (-EFBIG above).  Errors name path. */
int json_parse_file(const char *path, size_t max_bytes, json_t **ret, struct err_buf *e);

/* "a string", "an integer", ... for messages. */
const char *json_type_describe(const json_t *j);
/* Join path and key into buf ("key" when path is empty); returns buf. */
const char *json_path_join(char *buf, size_t size, const char *path, const char *key);

int json_get_int(const json_t *obj, const char *path, const char *key, int flags,
                 int64_t min, int64_t max, int64_t *ret, struct err_buf *e);
/* Like json_get_int into an int (min/max must lie inside int). */
int json_get_i32(const json_t *obj, const char *path, const char *key, int flags,
                 int min, int max, int *ret, struct err_buf *e);
/* A number: integer or real, finite. */
int json_get_num(const json_t *obj, const char *path, const char *key, int flags, double *ret,
                 struct err_buf *e);
int json_get_bool(const json_t *obj, const char *path, const char *key, int flags, bool *ret,
                  struct err_buf *e);
/* Borrowed string (lives as long as obj). */
int json_get_str(const json_t *obj, const char *path, const char *key, int flags, const char **ret,
                 struct err_buf *e);
/* Borrowed object / array. */
int json_get_obj(const json_t *obj, const char *path, const char *key, int flags, json_t **ret,
                 struct err_buf *e);
int json_get_arr(const json_t *obj, const char *path, const char *key, int flags, json_t **ret,
                 struct err_buf *e);

#ifdef __cplusplus
}
#endif
