/* chat.c - the Step-3.7 chat template (see chat.h), statement for statement.
 *
 * Each block below names the template lines it mirrors.  Python string semantics used by the
 * template (str.split, rstrip('\n'), lstrip('\n'), `in`) are spelled out in small helpers.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "chat.h"
#include "internal.h"

static const char tools_preamble[] =
    "# Tools\n\nYou have access to the following functions in JSONSchema format:\n\n<tools>";
static const char tools_epilogue[] =
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...>\n...\n</function> block must be nested within <tool_call>\n...\n"
    "</tool_call> XML tags\n- Required parameters MUST be specified\n</IMPORTANT><|im_end|>\n";

static const char *str_field(const json_t *obj, const char *key)
{
    return json_string_value(json_object_get(obj, key));
}

static const char *role_of(const json_t *m)
{
    const char *r = str_field(m, "role");
    return r ? r : "";
}

/* macro render_message_content(message) */
static int render_content(const json_t *m, struct tok_buf *b, size_t idx, struct err_buf *e)
{
    const json_t *c = json_object_get(m, "content");
    int r = 0;

    if (!c || json_is_null(c))
        return 0;
    if (json_is_string(c))
        return tok__buf_put(b, json_string_value(c), json_string_length(c));
    if (json_is_object(c)) {
        const json_t *v = json_object_get(c, "value");
        if (!v)
            v = json_object_get(c, "text");
        if (!v)
            return 0;
        if (json_is_object(v) || json_is_array(v))
            return err_set(e, -EINVAL, "messages[%zu].content text is not a scalar", idx);
        return tok__py_str(b, v);
    }
    if (json_is_array(c)) {
        bool sep = false;
        for (size_t i = 0; i < json_array_size(c) && r >= 0; i++) {
            const json_t *it = json_array_get(c, i);
            const char *type = str_field(it, "type");
            if (type && !strcmp(type, "text")) {
                const json_t *v = json_object_get(it, "value");
                if (!v)
                    v = json_object_get(it, "text");
                if (sep)
                    r = tok__buf_putc(b, ' ');
                if (r >= 0 && v && (json_is_object(v) || json_is_array(v)))
                    r = err_set(e, -EINVAL, "messages[%zu].content[%zu] text is not a scalar",
                                idx, i);
                else if (r >= 0 && v)
                    r = tok__py_str(b, v);
                sep = true;
            } else if (type && !strcmp(type, "image")) {
                r = tok__buf_puts(b, "<im_patch>");
                sep = false;
            }
        }
    }
    return r;
}

static bool starts_with(const struct tok_buf *b, const char *p)
{
    size_t n = strlen(p);
    return b->n >= n && memcmp(b->p, p, n) == 0;
}

static bool ends_with(const struct tok_buf *b, const char *p)
{
    size_t n = strlen(p);
    return b->n >= n && memcmp(b->p + b->n - n, p, n) == 0;
}

/* {%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %} and
 * the reversed loop: the last user message that is not a pure tool_response wrapper. */
static int last_query_index(const json_t *msgs, long *ret, struct err_buf *e)
{
    size_t n = json_array_size(msgs);
    *ret = (long) n - 1;
    for (size_t k = n; k-- > 0;) {
        const json_t *m = json_array_get(msgs, k);
        struct tok_buf c = {0};
        if (strcmp(role_of(m), "user") != 0)
            continue;
        int r = render_content(m, &c, k, e);
        bool wrapped = r >= 0 && starts_with(&c, "<tool_response>") &&
                       ends_with(&c, "</tool_response>");
        tok__buf_done(&c);
        if (r < 0)
            return r;
        if (!wrapped) {
            *ret = (long) k;
            return 0;
        }
    }
    return 0;
}

static int render_system_header(const json_t *msgs, const json_t *tools,
                                const struct tok_chat_opts *o, struct tok_buf *b,
                                struct err_buf *e)
{
    const json_t *m0 = json_array_get(msgs, 0);
    bool first_system = !strcmp(role_of(m0), "system");
    int r = 0;

    if (tools && json_array_size(tools)) {
        r = tok__buf_puts(b, "<|im_start|>system\n");
        if (r >= 0 && o->reasoning_effort)
            r = tok__buf_printf(b, "Reasoning: %s\n\n", o->reasoning_effort);
        if (r >= 0 && first_system) {
            r = render_content(m0, b, 0, e);
            if (r >= 0)
                r = tok__buf_puts(b, "\n\n");
        }
        if (r >= 0)
            r = tok__buf_puts(b, tools_preamble);
        for (size_t i = 0; i < json_array_size(tools) && r >= 0; i++) {
            r = tok__buf_putc(b, '\n');
            if (r >= 0)
                r = tok__py_dump(b, json_array_get(tools, i));
        }
        if (r >= 0)
            r = tok__buf_puts(b, tools_epilogue);
        return r;
    }
    if (first_system) {
        r = tok__buf_puts(b, "<|im_start|>system\n");
        if (r >= 0 && o->reasoning_effort)
            r = tok__buf_printf(b, "Reasoning: %s\n\n", o->reasoning_effort);
        if (r >= 0)
            r = render_content(m0, b, 0, e);
        if (r >= 0)
            r = tok__buf_puts(b, "<|im_end|>\n");
    } else if (o->reasoning_effort)
        r = tok__buf_printf(b, "<|im_start|>system\nReasoning: %s\n\n<|im_end|>\n",
                            o->reasoning_effort);
    return r;
}

static const char *find(const char *s, size_t n, const char *pat)
{
    return memmem(s, n, pat, strlen(pat));
}

static const char *find_last(const char *s, size_t n, const char *pat)
{
    size_t lp = strlen(pat);
    const char *last = NULL, *p = s;
    while ((p = memmem(p, n - (size_t)(p - s), pat, lp))) {
        last = p;
        p += lp;
    }
    return last;
}

/* reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n');
 * content = content.split('</think>')[-1].lstrip('\n') */
static int split_think(const struct tok_buf *c, struct tok_buf *reasoning, struct tok_buf *rest)
{
    const char *close = find(c->p, c->n, "</think>");
    const char *last_close = find_last(c->p, c->n, "</think>");
    const char *rs = c->p, *re = close;
    const char *open;
    int r;

    while (re > rs && re[-1] == '\n')
        re--;
    if ((open = find_last(rs, (size_t)(re - rs), "<think>")))
        rs = open + strlen("<think>");
    while (rs < re && *rs == '\n')
        rs++;
    if ((r = tok__buf_put(reasoning, rs, (size_t)(re - rs))) < 0)
        return r;
    const char *cs = last_close + strlen("</think>"), *ce = c->p + c->n;
    while (cs < ce && *cs == '\n')
        cs++;
    return tok__buf_put(rest, cs, (size_t)(ce - cs));
}

static int render_tool_calls(const json_t *m, struct tok_buf *b, size_t idx, struct err_buf *e)
{
    const json_t *calls = json_object_get(m, "tool_calls");
    int r = 0;

    if (!calls || json_is_null(calls) || (json_is_array(calls) && !json_array_size(calls)))
        return 0;
    if (!json_is_array(calls))
        return err_set(e, -EINVAL, "messages[%zu].tool_calls is not a list", idx);
    for (size_t i = 0; i < json_array_size(calls) && r >= 0; i++) {
        const json_t *tc = json_array_get(calls, i), *fn = json_object_get(tc, "function");
        if (fn)
            tc = fn;
        const char *name = str_field(tc, "name");
        if (!name)
            return err_set(e, -EINVAL, "messages[%zu].tool_calls[%zu] has no function name",
                           idx, i);
        if ((r = tok__buf_printf(b, "<tool_call>\n<function=%s>\n", name)) < 0)
            return r;
        const json_t *args = json_object_get(tc, "arguments");
        json_t *parsed = NULL;
        if (json_is_string(args)) {
            json_error_t je;
            parsed = json_loadb(json_string_value(args), json_string_length(args),
                                JSON_DECODE_ANY, &je);
            if (!parsed)
                return err_set(e, -EINVAL, "messages[%zu].tool_calls[%zu].arguments is not "
                               "valid JSON: %s", idx, i, je.text);
            args = parsed;
        }
        if (args && !json_is_object(args)) {
            json_decref(parsed);
            return err_set(e, -EINVAL, "messages[%zu].tool_calls[%zu].arguments is not an "
                           "object", idx, i);
        }
        const char *key;
        json_t *val;
        if (args)
            json_object_foreach((json_t *) args, key, val) {
                r = tok__buf_printf(b, "<parameter=%s>\n", key);
                if (r >= 0)
                    r = (json_is_object(val) || json_is_array(val)) ? tok__py_dump(b, val)
                                                                    : tok__py_str(b, val);
                if (r >= 0)
                    r = tok__buf_puts(b, "\n</parameter>\n");
                if (r < 0)
                    break;
            }
        json_decref(parsed);
        if (r >= 0)
            r = tok__buf_puts(b, "</function>\n</tool_call>");
    }
    return r;
}

static int render_assistant(const json_t *m, size_t idx, long last_query,
                            const struct tok_chat_opts *o, struct tok_buf *content,
                            struct tok_buf *b, struct err_buf *e)
{
    struct tok_buf reasoning = {0}, rest = {0};
    const struct tok_buf *body = content;
    const json_t *rc = json_object_get(m, "reasoning_content");
    int r = 0;

    if (json_is_string(rc))
        r = tok__buf_put(&reasoning, json_string_value(rc), json_string_length(rc));
    else if (content->n && find(content->p, content->n, "</think>")) {
        r = split_think(content, &reasoning, &rest);
        body = &rest;
    }
    if (r >= 0 && ((long) idx > last_query || o->preserve_thinking)) {
        r = tok__buf_puts(b, "<|im_start|>assistant\n<think>\n");
        if (r >= 0)
            r = tok__buf_put(b, reasoning.p, reasoning.n);
        if (r >= 0)
            r = tok__buf_puts(b, "\n</think>\n");
    } else if (r >= 0)
        r = tok__buf_puts(b, "<|im_start|>assistant\n");
    if (r >= 0)
        r = tok__buf_put(b, body->p, body->n);
    if (r >= 0)
        r = render_tool_calls(m, b, idx, e);
    if (r >= 0)
        r = tok__buf_puts(b, "<|im_end|>\n");
    tok__buf_done(&reasoning);
    tok__buf_done(&rest);
    return r;
}

static int render_message(const json_t *msgs, size_t i, long last_query,
                          const struct tok_chat_opts *o, struct tok_buf *b, struct err_buf *e)
{
    const json_t *m = json_array_get(msgs, i);
    const char *role = role_of(m);
    size_t n = json_array_size(msgs);
    struct tok_buf content = {0};
    int r;

    if (!json_is_object(m))
        return err_set(e, -EINVAL, "messages[%zu] is not an object", i);
    if ((r = render_content(m, &content, i, e)) < 0)
        goto out;
    if (!content.p && (r = tok__buf_reserve(&content, 0)) < 0)
        goto out;
    if (!strcmp(role, "user") || (!strcmp(role, "system") && i > 0)) {
        const char *name = str_field(m, "name");
        const char *role_name = (!strcmp(role, "system") && name && !strcmp(name, "observation"))
                                    ? "observation" : role;
        r = tok__buf_printf(b, "<|im_start|>%s\n", role_name);
        if (r >= 0)
            r = tok__buf_put(b, content.p, content.n);
        if (r >= 0)
            r = tok__buf_puts(b, "<|im_end|>\n");
    } else if (!strcmp(role, "assistant")) {
        r = render_assistant(m, i, last_query, o, &content, b, e);
    } else if (!strcmp(role, "tool")) {
        if (i == 0 || strcmp(role_of(json_array_get(msgs, i - 1)), "tool") != 0)
            r = tok__buf_puts(b, "<|im_start|>tool_response\n");
        if (r >= 0)
            r = tok__buf_puts(b, "<tool_response>");
        if (r >= 0)
            r = tok__buf_put(b, content.p, content.n);
        if (r >= 0)
            r = tok__buf_puts(b, "</tool_response>");
        if (r >= 0 && (i + 1 == n || strcmp(role_of(json_array_get(msgs, i + 1)), "tool") != 0))
            r = tok__buf_puts(b, "<|im_end|>\n");
    }
out:
    tok__buf_done(&content);
    return r;
}

int tok_chat_render(const json_t *messages, const json_t *tools, const struct tok_chat_opts *o,
                    char **ret_text, size_t *ret_len, struct err_buf *e)
{
    static const struct tok_chat_opts defaults = {0};
    struct tok_buf b = {0};
    long last_query;
    int r;

    if (!o)
        o = &defaults;
    if (!json_is_array(messages) || !json_array_size(messages))
        return err_set(e, -EINVAL, "messages must be a non-empty list");
    if (tools && !json_is_null(tools) && !json_is_array(tools))
        return err_set(e, -EINVAL, "tools must be a list");
    if (tools && json_is_null(tools))
        tools = NULL;
    for (size_t i = 0; i < json_array_size(messages); i++)
        if (!json_is_object(json_array_get(messages, i)))
            return err_set(e, -EINVAL, "messages[%zu] is not an object", i);
    r = tok__buf_puts(&b, o->bos_token ? o->bos_token : "");
    if (r >= 0)
        r = render_system_header(messages, tools, o, &b, e);
    if (r >= 0)
        r = last_query_index(messages, &last_query, e);
    for (size_t i = 0; r >= 0 && i < json_array_size(messages); i++)
        r = render_message(messages, i, last_query, o, &b, e);
    if (r >= 0 && o->add_generation_prompt)
        r = tok__buf_puts(&b, "<|im_start|>assistant\n<think>\n");
    if (r < 0) {
        tok__buf_done(&b);
        return r;
    }
    *ret_text = b.p;
    if (ret_len)
        *ret_len = b.n;
    return 0;
}
