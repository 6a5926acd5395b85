/* test-json.c - JSON helpers: duplicates rejected, typed getters name the path. */
#include <errno.h>

#include "harness.h"
#include "json.h"

int main(void)
{
    struct err_buf e;
    json_t *j, *o;
    int64_t i64;
    int i;
    double d;
    bool b;
    const char *s;
    const char *txt = "{\"a\": 1, \"b\": {\"c\": \"x\", \"r\": 2.5, \"t\": true, \"l\": [1]}}";

    ASSERT_ERR(json_parse_text("{\"a\":1,\"a\":2}", 13, "dup.json", &j, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "dup.json: invalid JSON at line 1");
    ASSERT_CONTAINS(e.msg, "duplicate object key");
    ASSERT_ERR(json_parse_text("{", 1, "t.json", &j, &e), -EBADMSG);
    ASSERT_OK(json_parse_text(txt, strlen(txt), "t.json", &j, &e));

    ASSERT_EQ(json_get_int(j, "", "a", JSON_GET_REQUIRED, 0, 10, &i64, &e), 1);
    ASSERT_EQ(i64, 1);
    ASSERT_ERR(json_get_int(j, "", "a", JSON_GET_REQUIRED, 2, 10, &i64, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "a: 1 is out of range [2, 10]");
    ASSERT_EQ(json_get_i32(j, "", "zz", JSON_GET_OPTIONAL, 0, 1, &i, &e), 0);
    ASSERT_ERR(json_get_i32(j, "", "zz", JSON_GET_REQUIRED, 0, 1, &i, &e), -ENOENT);
    ASSERT_STREQ(e.msg, "zz: required field is missing");
    ASSERT_EQ(json_get_obj(j, "", "b", JSON_GET_REQUIRED, &o, &e), 1);
    ASSERT_ERR(json_get_int(o, "b", "c", JSON_GET_REQUIRED, 0, 1, &i64, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "b.c: expected an integer, got a string");
    ASSERT_ERR(json_get_int(o, "b", "r", JSON_GET_REQUIRED, 0, 10, &i64, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "b.r: expected an integer, got a real number");
    ASSERT_EQ(json_get_num(o, "b", "r", JSON_GET_REQUIRED, &d, &e), 1);
    ASSERT_EQ(d, 2.5);
    ASSERT_EQ(json_get_bool(o, "b", "t", JSON_GET_REQUIRED, &b, &e), 1);
    ASSERT_TRUE(b);
    ASSERT_ERR(json_get_bool(o, "b", "c", JSON_GET_REQUIRED, &b, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "b.c: expected true or false, got a string");
    ASSERT_EQ(json_get_str(o, "b", "c", JSON_GET_REQUIRED, &s, &e), 1);
    ASSERT_STREQ(s, "x");
    ASSERT_EQ(json_get_arr(o, "b", "l", JSON_GET_REQUIRED, &o, &e), 1);
    ASSERT_ERR(json_get_arr(j, "", "a", JSON_GET_REQUIRED, &o, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "a: expected an array, got an integer");
    json_decref(j);

    ASSERT_ERR(json_parse_file("/nonexistent/x.json", 100, &j, &e), -ENOENT);
    ASSERT_CONTAINS(e.msg, "/nonexistent/x.json: cannot open");
    ASSERT_ERR(json_parse_file("/proc/self", 100, &j, &e), -EINVAL);
    return 0;
}
