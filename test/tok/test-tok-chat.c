/* test-tok-chat.c - the Step-3.7 chat template in C against jinja2 renderings.
 *
 * Property: for every conversation of data/chat_cases.json (>= 20: roles system/user/
 * assistant/tool, reasoning_effort, tools as JSON schemas, tool calls with object and string
 * arguments, multi-step tool use, content parts with images, preserve_thinking, unknown
 * roles, Unicode and Python-style float formatting), tok_chat_render() returns byte for byte
 * the "expected" text that check_template.py rendered with jinja2 from
 * data/step37_chat_template.jinja.  Bad input is refused with a message naming the field.
 *
 * usage: test-tok-chat CASES.json
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chat.h"
#include "harness.h"

static const char bos[] = "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>";

static void expect_error(const char *messages, const char *tools, const char *needle)
{
    json_t *m = json_loads(messages, 0, NULL), *t = tools ? json_loads(tools, 0, NULL) : NULL;
    struct err_buf e = { "" };
    char *text = NULL;
    ASSERT_TRUE(m);
    ASSERT_ERR(tok_chat_render(m, t, NULL, &text, NULL, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, needle);
    ASSERT_TRUE(text == NULL);
    json_decref(m);
    json_decref(t);
}

int main(int argc, char **argv)
{
    json_error_t je;
    json_t *cases;
    size_t i, n_ok = 0;
    json_t *c;

    if (argc != 2)
        FAIL("usage: %s CASES.json", argv[0]);
    if (!(cases = json_load_file(argv[1], 0, &je)))
        FAIL("%s: %s", argv[1], je.text);
    ASSERT_LE(20, json_array_size(cases));
    json_array_foreach(cases, i, c) {
        const char *want = json_string_value(json_object_get(c, "expected"));
        const char *name = json_string_value(json_object_get(c, "name"));
        struct tok_chat_opts o = {
            .bos_token = json_object_get(c, "bos_token")
                             ? json_string_value(json_object_get(c, "bos_token")) : bos,
            .reasoning_effort = json_string_value(json_object_get(c, "reasoning_effort")),
            .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
            .preserve_thinking = json_is_true(json_object_get(c, "preserve_thinking")),
        };
        struct err_buf e;
        char *text;
        size_t len;
        if (!want)
            FAIL("case %s has no expected text (run check_template.py --write)", name);
        if (tok_chat_render(json_object_get(c, "messages"), json_object_get(c, "tools"), &o,
                            &text, &len, &e) < 0)
            FAIL("case %s: %s", name, e.msg);
        if (len != strlen(want) || memcmp(text, want, len) != 0) {
            size_t k = 0;
            while (k < len && text[k] == want[k])
                k++;
            FAIL("case %s differs at byte %zu:\n  C:     %.80s\n  jinja: %.80s", name, k,
                 text + (k > 20 ? k - 20 : 0), want + (k > 20 ? k - 20 : 0));
        }
        free(text);
        n_ok++;
    }
    json_decref(cases);

    expect_error("[]", NULL, "non-empty list");
    expect_error("[1]", NULL, "messages[0] is not an object");
    expect_error("[{\"role\": \"user\", \"content\": \"x\"}]", "{}", "tools must be a list");
    expect_error("[{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
                 "\"tool_calls\": [{\"function\": {\"arguments\": {}}}]}]", NULL,
                 "messages[1].tool_calls[0] has no function name");
    expect_error("[{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
                 "\"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"{bad\"}}]}]",
                 NULL, "arguments is not valid JSON");
    expect_error("[{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
                 "\"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"[1]\"}}]}]",
                 NULL, "arguments is not an object");
    expect_error("[{\"role\": \"assistant\", \"tool_calls\": 5}]", NULL, "tool_calls is not a list");

    /* Python float formatting used by tojson */
    static const struct { const char *json; const char *py; } floats[] = {
        { "[0.1]", "[0.1]" }, { "[1e16]", "[1e+16]" }, { "[1e15]", "[1000000000000000.0]" },
        { "[1e-05]", "[1e-05]" }, { "[0.0001]", "[0.0001]" }, { "[2.5e-300]", "[2.5e-300]" },
        { "[-0.0]", "[-0.0]" }, { "[123456.789]", "[123456.789]" },
        { "[1.7976931348623157e308]", "[1.7976931348623157e+308]" },
        { "[{\"a\": \"\\u0001\\\"\\\\\\/\", \"b\": null}]", "[{\"a\": \"\\u0001\\\"\\\\/\", \"b\": null}]" },
    };
    for (i = 0; i < ARRAY_SIZE(floats); i++) {
        json_t *v = json_loads(floats[i].json, 0, NULL);
        char *s;
        ASSERT_TRUE(v);
        ASSERT_OK(tok_json_dumps_py(v, &s));
        ASSERT_STREQ(s, floats[i].py);
        free(s);
        json_decref(v);
    }
    printf("%zu chat-template conversations match jinja2 byte for byte\n", n_ok);
    return 0;
}
