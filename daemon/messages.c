/* messages.c - Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.
 *
 * The body becomes the same struct request as chat completions (system as the system message;
 * text, thinking, tool_use and tool_result blocks as chat messages, reasoning and tool calls;
 * tools with input_schema as function tools), served by door.c; the door's items are the
 * answer's content blocks (thinking, text, tool_use), streamed as Anthropic's events
 * (message_start, content_block_start/delta/stop, message_delta, message_stop, ping) or
 * answered whole.  Errors are Anthropic's {"type": "error", "error": {"type", "message"}},
 * the message naming the field ("messages.0.content.1.type: ..."), those http.c answers
 * itself for these paths too (messages_error_body, the routes' error_body).  The model always
 * reasons: its reasoning comes back as thinking blocks unless thinking is {"type":
 * "disabled"}; an enabled thinking budget picks the template's reasoning effort (up to 4096
 * tokens low, up to 16384 medium, above high).  Loop thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "coord-int.h"
#include "door.h"
#include "doors.h"
#include "http.h"
#include "json.h"
#include "log.h"
#include "media.h"
#include "openai.h"
#include "reply.h"

/* The field names validation uses in its messages. */
static const char *const *names(void)
{
    static const char *t[_RN_MAX];

    return door_names(t, "messages", "thinking.budget_tokens", "max_tokens", "stop_sequences");
}

/* ------------------------------------------------------------------ errors */

static const char *error_type(unsigned status)
{
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

static json_t *error_json(unsigned status, const char *msg)
{
    return json_pack("{s:s, s:{s:s, s:s}}", "type", "error", "error", "type", error_type(status), "message", msg);
}

char *messages_error_body(unsigned status, const char *param, const char *msg)
{
    json_t *o = error_json(status, msg);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;

    (void)param;                    /* Anthropic's errors name the field in the message */
    json_decref(o);
    return s;
}

static void respond_error(struct http_req *hr, unsigned status, const char *msg)
{
    char *s = messages_error_body(status, NULL, msg);
    static const char *const retry[] = { "Retry-After", "1", NULL };

    if (s)
        http_respond(hr, status, "application/json", s, strlen(s), status == 429 || status == 503 ? retry : NULL);
    else
        http_respond(hr, 500, "application/json", "{}", 2, NULL);
    free(s);
}

static void m_error(struct http_req *hr, int rpc, const char *msg)
{
    respond_error(hr, http_status_of(rpc), msg);
}

/* ------------------------------------------------------------------ rendering */

struct msg_ud {
    bool thinking;              /* reasoning returned as thinking blocks */
    bool stream;
};

static bool shown(const struct door_gen *g, size_t i)
{
    const struct msg_ud *u = g->ud;

    return g->items[i].kind != DOOR_REASONING || u->thinking;
}

/* Item i's index among the content blocks. */
static int block_index(const struct door_gen *g, size_t i)
{
    int n = 0;

    for (size_t k = 0; k < i; k++)
        n += shown(g, k);
    return n;
}

static bool has_calls(const struct door_gen *g)
{
    for (size_t i = 0; i < g->n_items; i++)
        if (g->items[i].kind == DOOR_CALL)
            return true;
    return false;
}

static json_t *stop_reason(const struct door_gen *g)
{
    if (g->finish == DOOR_FINISH_LENGTH)
        return json_string("max_tokens");
    if (g->stop_str)
        return json_string("stop_sequence");
    return json_string(has_calls(g) ? "tool_use" : "end_turn");
}

static json_t *usage_json(const struct door_gen *g)
{
    uint32_t cached = g->cached_tokens < g->prompt_tokens ? g->cached_tokens : g->prompt_tokens;

    return json_pack("{s:i, s:i, s:i, s:i}", "input_tokens", (int)(g->prompt_tokens - cached),
                     "cache_creation_input_tokens", 0, "cache_read_input_tokens", (int)cached,
                     "output_tokens", (int)g->completion_tokens);
}

/* Item i as a content block (done: whole; else as content_block_start has it). */
static json_t *block_json(const struct door_gen *g, size_t i, bool done)
{
    const struct door_item *it = &g->items[i];
    const char *t = done && it->text.p ? it->text.p : "";

    switch (it->kind) {
    case DOOR_REASONING:
        return json_pack("{s:s, s:s, s:s}", "type", "thinking", "thinking", t, "signature", "");
    case DOOR_TEXT:
        return json_pack("{s:s, s:s}", "type", "text", "text", t);
    case DOOR_CALL:
        return json_pack("{s:s, s:s, s:s, s:o}", "type", "tool_use", "id", it->call_id, "name",
                         it->name ? it->name : "", "input", done ? door_call_args(it) : json_object());
    }
    return NULL;
}

static json_t *message_json(const struct door_gen *g, bool done)
{
    json_t *content = json_array();

    for (size_t i = 0; done && i < g->n_items; i++)
        if (shown(g, i))
            json_array_append_new(content, block_json(g, i, true));
    return json_pack("{s:s, s:s, s:s, s:s, s:o, s:o, s:o, s:o}", "id", g->rp->id, "type", "message", "role", "assistant",
                     "model", g->rp->model, "content", content, "stop_reason", done ? stop_reason(g) : json_null(),
                     "stop_sequence", done && g->stop_str ? json_string(g->stop_str) : json_null(),
                     "usage", usage_json(g));
}

static void m_begin(struct door_gen *g, struct strbuf *b)
{
    door_event(b, "message_start", json_pack("{s:o}", "message", message_json(g, false)));
    door_event(b, "ping", json_object());
}

static void m_item_open(struct door_gen *g, size_t i, struct strbuf *b)
{
    if (shown(g, i))
        door_event(b, "content_block_start", json_pack("{s:i, s:o}", "index", block_index(g, i), "content_block",
                                                  block_json(g, i, false)));
}

static void m_item_delta(struct door_gen *g, size_t i, const char *s, size_t n, struct strbuf *b)
{
    static const char *const kind[][2] = {
        [DOOR_REASONING] = { "thinking_delta", "thinking" },
        [DOOR_TEXT] = { "text_delta", "text" },
        [DOOR_CALL] = { "input_json_delta", "partial_json" },
    };
    enum door_item_kind k = g->items[i].kind;

    if (shown(g, i))
        door_event(b, "content_block_delta", json_pack("{s:i, s:{s:s, s:s%}}", "index", block_index(g, i), "delta",
                                                  "type", kind[k][0], kind[k][1], s, n));
}

static void m_item_close(struct door_gen *g, size_t i, struct strbuf *b)
{
    if (!shown(g, i))
        return;
    if (g->items[i].kind == DOOR_REASONING)
        door_event(b, "content_block_delta", json_pack("{s:i, s:{s:s, s:s}}", "index", block_index(g, i), "delta",
                                                  "type", "signature_delta", "signature", ""));
    door_event(b, "content_block_stop", json_pack("{s:i}", "index", block_index(g, i)));
}

static void m_end(struct door_gen *g, struct strbuf *b)
{
    door_event(b, "message_delta", json_pack("{s:{s:o, s:o}, s:o}", "delta", "stop_reason", stop_reason(g),
                                        "stop_sequence", g->stop_str ? json_string(g->stop_str) : json_null(),
                                        "usage", usage_json(g)));
    door_event(b, "message_stop", json_object());
}

static void m_fail_event(struct door_gen *g, struct strbuf *b)
{
    json_t *o = error_json(http_status_of(g->rp->fail_status), g->rp->fail_msg);

    json_object_del(o, "type");
    door_event(b, "error", o);
}

static json_t *m_whole(struct door_gen *g)
{
    return message_json(g, true);
}

static const struct door_ops msg_ops = {
    .begin = m_begin, .item_open = m_item_open, .item_delta = m_item_delta, .item_close = m_item_close,
    .end = m_end, .fail_event = m_fail_event, .whole = m_whole, .error = m_error, .free_ud = free,
};

/* ------------------------------------------------------------------ requests */

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* An image block's source as an OpenAI image_url object: base64 data as a data URL of its
 * media_type, a url source as the chat door takes an image_url URL. */
static int image_conv(const json_t *blk, const char *at, json_t **ret, char *msg, size_t len)
{
    static const char *const types[] = { "image/png", "image/jpeg", "image/webp", "image/gif" };
    const json_t *src = json_object_get(blk, "source"), *t = json_object_get(src, "type");
    const char *ts = json_is_string(t) ? json_string_value(t) : "";

    if (!json_is_object(src))
        BAD("%s.source: required, {\"type\": \"base64\", \"media_type\", \"data\"} or {\"type\": \"url\", \"url\"}",
            at);
    if (!strcmp(ts, "base64")) {
        const json_t *mt = json_object_get(src, "media_type"), *data = json_object_get(src, "data");
        struct strbuf b = STRBUF_INIT;
        bool ok = false;

        for (size_t k = 0; json_is_string(mt) && k < 4; k++)
            ok |= !strcmp(json_string_value(mt), types[k]);
        if (!ok)
            BAD("%s.source.media_type: must be \"image/png\", \"image/jpeg\", \"image/webp\" or \"image/gif\" "
                "(got %s%.40s%s)", at, json_is_string(mt) ? "\"" : "", json_is_string(mt) ? json_string_value(mt) :
                json_type_describe(mt), json_is_string(mt) ? "\"" : "");
        if (!json_is_string(data))
            BAD("%s.source.data: required, the image as base64", at);
        strbuf_printf(&b, "data:%s;base64,", json_string_value(mt));
        strbuf_add(&b, json_string_value(data), json_string_length(data));
        *ret = b.oom ? NULL : json_pack("{s:s%}", "url", b.p, b.len);
        strbuf_done(&b);
    } else if (!strcmp(ts, "url")) {
        const json_t *url = json_object_get(src, "url");

        if (!json_is_string(url))
            BAD("%s.source.url: required, a string", at);
        *ret = json_pack("{s:O}", "url", url);
    } else {
        BAD("%s.source.type: must be \"base64\" or \"url\"%s", at,
            !strcmp(ts, "file") ? " (file sources need the Files API, which this server does not have)" : "");
    }
    return *ret ? 0 : -ENOMEM;
}

static const char *const text_types[] = { "text", NULL }, *const media_types[] = { "document", NULL };
static const struct door_parts block_parts = {
    .dotted = true, .text_types = text_types, .media_types = media_types, .image_type = "image",
    .image = image_conv, .image_where = "user messages and tool_result content",
};

/* Blocks' text: a string, or text blocks joined by "\n" (system, tool_result content); with
 * im, image blocks too (tool_result content). */
static int blocks_text(const json_t *c, const char *path, struct door_images *im, struct strbuf *b, char *msg,
                       size_t len)
{
    return door_parts_text(c, path, &block_parts, im, b, msg, len);
}

/* One message's blocks onto out as chat messages: the assistant's as one message (thinking
 * -> reasoning_content, text -> content, tool_use -> tool_calls); the user's as a user
 * message for its text and a tool message per tool_result, in their order. */
static int message_conv(const json_t *m, size_t i, json_t *out, struct door_images *im, char *msg, size_t len)
{
    const json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content"), *blk;
    struct strbuf text = STRBUF_INIT, thinking = STRBUF_INIT;
    json_t *calls;
    bool asst, sep = true;      /* sep: a newline before the next text (none right after an image) */
    size_t k;
    int r = 0;

    if (!json_is_object(m))
        BAD("messages.%zu: must be an object (got %s)", i, json_type_describe(m));
    if (!json_is_string(role) || (strcmp(json_string_value(role), "user") &&
                                  strcmp(json_string_value(role), "assistant")))
        BAD("messages.%zu.role: must be \"user\" or \"assistant\"", i);
    if (!content)
        BAD("messages.%zu.content: required", i);
    asst = !strcmp(json_string_value(role), "assistant");
    if (json_is_string(content))
        return json_array_append_new(out, json_pack("{s:O, s:O}", "role", role, "content", content)) ? -ENOMEM : 0;
    if (!json_is_array(content))
        BAD("messages.%zu.content: must be a string or an array of content blocks (got %s)", i,
            json_type_describe(content));
    if (!(calls = json_array()))
        return -ENOMEM;
#define FAIL(...) do { snprintf(msg, len, __VA_ARGS__); r = -EINVAL; goto out; } while (0)
    json_array_foreach(content, k, blk) {
        const json_t *t = json_object_get(blk, "type");
        const char *type = json_is_string(t) ? json_string_value(t) : NULL;

        if (!json_is_object(blk) || !type)
            FAIL("messages.%zu.content.%zu: must be a content block object with a \"type\"", i, k);
        if (!strcmp(type, "text")) {
            const json_t *tx = json_object_get(blk, "text");

            if (!json_is_string(tx))
                FAIL("messages.%zu.content.%zu.text: must be a string", i, k);
            if (sep && text.len)
                strbuf_add(&text, "\n", 1);
            strbuf_add(&text, json_string_value(tx), json_string_length(tx));
            sep = true;
        } else if (!strcmp(type, "image") && !asst) {
            json_t *iu = NULL;
            char at[96];

            /* as the chat door's image_url part: the placeholder where it stands */
            snprintf(at, sizeof(at), "messages.%zu.content.%zu", i, k);
            if ((r = image_conv(blk, at, &iu, msg, len)) < 0 || (r = door_image_add(im, at, iu)) < 0)
                goto out;
            strbuf_adds(&text, MEDIA_IMAGE_PLACEHOLDER);
            sep = false;
        } else if (!strcmp(type, "thinking") && asst) {
            const json_t *tx = json_object_get(blk, "thinking");

            if (!json_is_string(tx))
                FAIL("messages.%zu.content.%zu.thinking: must be a string", i, k);
            strbuf_add(&thinking, json_string_value(tx), json_string_length(tx));
        } else if (!strcmp(type, "tool_use") && asst) {
            const json_t *id = json_object_get(blk, "id"), *name = json_object_get(blk, "name");
            const json_t *input = json_object_get(blk, "input");

            if (!json_is_string(id) || !json_string_length(id))
                FAIL("messages.%zu.content.%zu.id: must be a non-empty string", i, k);
            if (!json_is_string(name) || !json_string_length(name))
                FAIL("messages.%zu.content.%zu.name: must be a non-empty string", i, k);
            if (!json_is_object(input))
                FAIL("messages.%zu.content.%zu.input: must be an object", i, k);
            if (json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", id, "type", "function",
                                                       "function", "name", name, "arguments", input))) {
                r = -ENOMEM;
                goto out;
            }
        } else if (!strcmp(type, "tool_result") && !asst) {
            const json_t *id = json_object_get(blk, "tool_use_id"), *c = json_object_get(blk, "content");
            struct strbuf res = STRBUF_INIT;
            char path[96];

            if (!json_is_string(id) || !json_string_length(id))
                FAIL("messages.%zu.content.%zu.tool_use_id: must be a non-empty string", i, k);
            snprintf(path, sizeof(path), "messages.%zu.content.%zu.content", i, k);
            if (json_is_true(json_object_get(blk, "is_error")))
                strbuf_adds(&res, "Error: ");
            if (c && !json_is_null(c) && (r = blocks_text(c, path, im, &res, msg, len)) < 0) {
                strbuf_done(&res);
                goto out;
            }
            if (text.len) {
                /* text before the result: its own user turn, in order */
                r = json_array_append_new(out, json_pack("{s:s, s:s%}", "role", "user", "content", text.p,
                                                         text.len)) ? -ENOMEM : 0;
                strbuf_reset(&text);
            }
            sep = true;
            if (!r && json_array_append_new(out, json_pack("{s:s, s:O, s:s%}", "role", "tool", "tool_call_id", id,
                                                           "content", res.p ? res.p : "", res.len)))
                r = -ENOMEM;
            strbuf_done(&res);
            if (r)
                goto out;
        } else if (!strcmp(type, "image")) {
            FAIL("messages.%zu.content.%zu.type: \"image\" blocks are taken in %s only", i, k,
                 block_parts.image_where);
        } else if (!strcmp(type, "document")) {
            FAIL("messages.%zu.content.%zu.type: \"document\" blocks are not supported (this server takes text and "
                 "image blocks only)", i, k);
        } else {
            FAIL("messages.%zu.content.%zu.type: \"%.32s\" blocks are not accepted in %s messages", i, k, type,
                 asst ? "assistant" : "user");
        }
    }
    if (asst) {
        json_t *a = json_pack("{s:s, s:s%}", "role", "assistant", "content", text.p ? text.p : "", text.len);

        if (a && thinking.len)
            json_object_set_new(a, "reasoning_content", json_stringn(thinking.p, thinking.len));
        if (a && json_array_size(calls))
            json_object_set(a, "tool_calls", calls);
        r = a && json_array_append_new(out, a) == 0 ? 0 : -ENOMEM;
    } else if (text.len || json_array_size(content) == 0) {
        r = json_array_append_new(out, json_pack("{s:s, s:s%}", "role", "user", "content", text.p ? text.p : "",
                                                 text.len)) ? -ENOMEM : 0;
    }
#undef FAIL
out:
    strbuf_done(&text);
    strbuf_done(&thinking);
    json_decref(calls);
    return r;
}

static int tools_conv(const json_t *tools, struct request *in, char *msg, size_t len)
{
    json_t *t;
    size_t i;

    if (!tools || json_is_null(tools))
        return 0;
    if (!json_is_array(tools))
        BAD("tools: must be an array of tools (got %s)", json_type_describe(tools));
    if (!(in->tools = json_array()))
        return -ENOMEM;
    json_array_foreach(tools, i, t) {
        const json_t *type = json_object_get(t, "type"), *name = json_object_get(t, "name");
        const json_t *desc = json_object_get(t, "description"), *schema = json_object_get(t, "input_schema");
        json_t *fn;

        if (!json_is_object(t))
            BAD("tools.%zu: must be a tool object", i);
        if (type && !json_is_null(type) && (!json_is_string(type) || strcmp(json_string_value(type), "custom")))
            BAD("tools.%zu.type: \"%.32s\" tools are not supported (custom tools with an input_schema only)", i,
                json_is_string(type) ? json_string_value(type) : "?");
        if (!json_is_string(name) || !json_string_length(name))
            BAD("tools.%zu.name: must be a non-empty string", i);
        if (desc && !json_is_string(desc))
            BAD("tools.%zu.description: must be a string", i);
        if (!json_is_object(schema))
            BAD("tools.%zu.input_schema: required (a JSON schema object)", i);
        fn = json_pack("{s:O, s:O}", "name", name, "parameters", schema);
        if (fn && desc)
            json_object_set(fn, "description", (json_t *)desc);
        if (json_array_append_new(in->tools, json_pack("{s:s, s:o}", "type", "function", "function", fn)))
            return -ENOMEM;
    }
    return 0;
}

static int tool_choice_conv(const json_t *tc, struct request *in, char *msg, size_t len)
{
    const json_t *t = json_object_get(tc, "type"), *name = json_object_get(tc, "name"), *dp;
    const char *s = json_is_string(t) ? json_string_value(t) : "";

    in->tool_choice = REQUEST_TOOLS_AUTO;
    if (!tc || json_is_null(tc))
        return 0;
    if (!json_is_object(tc))
        BAD("tool_choice: must be an object (got %s)", json_type_describe(tc));
    dp = json_object_get(tc, "disable_parallel_tool_use");
    if (dp && !json_is_null(dp) && !json_is_boolean(dp))
        BAD("tool_choice.disable_parallel_tool_use: must be a boolean (got %s)", json_type_describe(dp));
    /* true: at most one call, the output ends where a second starts */
    in->single_tool_call = json_is_true(dp);
    if (!strcmp(s, "none"))
        in->tool_choice = REQUEST_TOOLS_NONE;
    else if (!strcmp(s, "any"))
        in->tool_choice = REQUEST_TOOLS_REQUIRED;
    else if (!strcmp(s, "tool")) {
        if (!json_is_string(name))
            BAD("tool_choice.name: required with \"type\": \"tool\"");
        in->tool_choice = REQUEST_TOOLS_NAMED;
        if (!(in->tool_choice_name = strdup(json_string_value(name))))
            return -ENOMEM;
    } else if (strcmp(s, "auto"))
        BAD("tool_choice.type: must be \"auto\", \"any\", \"tool\" or \"none\"");
    return 0;
}

static const char *const known_fields[] = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "thinking", "metadata", "service_tier", NULL,
};

/* count: count_tokens's body (no max_tokens, no sampling). */
static int body_conv(struct coord *co, const json_t *body, bool count, struct request *in, struct msg_ud *u,
                     bool *stream, struct door_fetch *fx, char *msg, size_t len)
{
    struct err_buf eb;
    const char *s = NULL;
    const json_t *v;
    json_t *x;
    size_t i;
    int64_t n;
    int r;

    if ((r = door_fields_known(body, (const char *const *const[]){ known_fields, NULL }, msg, len)) < 0 ||
        (r = door_common_fields(body, in, stream, msg, len)) < 0)
        return r;
#define GET(fn, ...) do { if ((r = fn(body, "", __VA_ARGS__, &eb)) < 0) BAD("%.600s", eb.msg); } while (0)
    if (!count) {
        GET(json_get_int, "max_tokens", JSON_GET_REQUIRED, 1, INT32_MAX, &n);
        REQUEST_SET(&in->sp, RO_MAX_TOKENS, max_tokens, n);
        GET(json_get_int, "top_k", JSON_GET_OPTIONAL, INT32_MIN, INT32_MAX, &n);
        if (r)
            REQUEST_SET(&in->sp, RO_TOP_K, top_k, (int32_t)n);
        if ((v = json_object_get(body, "stop_sequences")) && !json_is_null(v)) {
            if (!json_is_array(v))
                BAD("stop_sequences: must be an array of strings (got %s)", json_type_describe(v));
            json_array_foreach(v, i, x) {
                if (!json_is_string(x) || !json_string_length(x))
                    BAD("stop_sequences.%zu: must be a non-empty string", i);
                if (request_add_stop(&in->sp, json_string_value(x), json_string_length(x)) < 0)
                    return -ENOMEM;
            }
        }
        if ((v = json_object_get(body, "metadata")) && !json_is_null(v) && !json_is_object(v))
            BAD("metadata: must be an object");
        GET(json_get_str, "service_tier", JSON_GET_OPTIONAL, &s);
    }
    u->thinking = true;
    if ((v = json_object_get(body, "thinking")) && !json_is_null(v)) {
        const json_t *t = json_object_get(v, "type");
        const char *ts = json_is_string(t) ? json_string_value(t) : "";

        if (!json_is_object(v))
            BAD("thinking: must be an object");
        if (!strcmp(ts, "enabled")) {
            if ((r = json_get_int(v, "thinking", "budget_tokens", JSON_GET_REQUIRED, 1024, INT32_MAX, &n, &eb)) < 0)
                BAD("%.600s", eb.msg);
            if (!count && REQUEST_HAS(&in->sp, RO_MAX_TOKENS) && n >= in->sp.max_tokens)
                BAD("thinking.budget_tokens: must be less than max_tokens (%" PRId64 ")", in->sp.max_tokens);
            if (!(in->reasoning_effort = strdup(n <= 4096 ? "low" : n <= 16384 ? "medium" : "high")))
                return -ENOMEM;
        } else if (!strcmp(ts, "disabled")) {
            u->thinking = false;
        } else {
            BAD("thinking.type: must be \"enabled\" or \"disabled\"");
        }
    }
    in->input = REQUEST_INPUT_CHAT;
    if (!(in->messages = json_array()))
        return -ENOMEM;
    if ((v = json_object_get(body, "system")) && !json_is_null(v)) {
        struct strbuf b = STRBUF_INIT;

        if ((r = blocks_text(v, "system", NULL, &b, msg, len)) < 0) {
            strbuf_done(&b);
            return r;
        }
        r = json_array_append_new(in->messages, json_pack("{s:s, s:s%}", "role", "system", "content",
                                                          b.p ? b.p : "", b.len));
        strbuf_done(&b);
        if (r)
            return -ENOMEM;
    }
    v = json_object_get(body, "messages");
    if (!v)
        BAD("messages: required");
    if (!json_is_array(v) || !json_array_size(v))
        BAD("messages: must be a non-empty array of messages");
    struct door_images im = { .url_field = ".source.url" };

    r = 0;
    json_array_foreach(v, i, x)
        if ((r = message_conv(x, i, in->messages, &im, msg, len)) < 0)
            break;
    if (r == 0)
        r = door_images_take(co, &im, fx, "messages", in, msg, len);
    door_images_done(&im);
    if (r < 0)
        return r;
    if ((r = tools_conv(json_object_get(body, "tools"), in, msg, len)) < 0 ||
        (r = tool_choice_conv(json_object_get(body, "tool_choice"), in, msg, len)) < 0 ||
        (r = door_tool_choice_check(co, in, "tool_choice", msg, len)) < 0)
        return r;
#undef GET
    in->continuous_usage_stats = true;      /* message_start's input_tokens */
    return 0;
}

static int conv(struct coord *co, const json_t *body, struct request *in, void *arg, struct door_fetch *fx,
                char *msg, size_t len)
{
    struct msg_ud *u = arg;

    return body_conv(co, body, false, in, u, &u->stream, fx, msg, len);
}

/* count_tokens': the prompt only */
static int count_conv(struct coord *co, const json_t *body, struct request *in, void *arg, struct door_fetch *fx,
                      char *msg, size_t len)
{
    struct msg_ud *u = arg;

    return body_conv(co, body, true, in, u, &u->stream, fx, msg, len);
}

static void *msg_ud_new(void)
{
    return calloc(1, sizeof(struct msg_ud));
}

static void msg_ready(struct coord *co, struct http_req *hr, struct request *in, void *ud)
{
    struct msg_ud *u = ud;

    door_submit(co, hr, in, u->stream, "msg_", &msg_ops, u);
}

void messages_create(struct http_req *hr, void *ud)
{
    static const struct door_serve serve = {
        .conv = conv, .ud_new = msg_ud_new, .ud_free = free, .ready = msg_ready, .error = m_error,
    };

    door_serve(ud, hr, names(), &serve);
}

/* The prompt's tokens, as the engine would receive them (coord_prompt_encode: each image its
 * token layout, as generation lays it out). */
static void count_ready(struct coord *co, struct http_req *hr, struct request *in, void *ud)
{
    struct tok_ids t = { 0 };
    uint32_t *pos = NULL;
    char msg[768] = "", out[64];
    int e;

    free(ud);
    e = request_validate_chat(co, in, msg, sizeof(msg));
    if (e >= 0)
        e = coord_prompt_encode(co, in, &t, &pos, msg, sizeof(msg));
    free(pos);
    request_free(in);
    if (e < 0) {
        respond_error(hr, e == -ENOMEM ? 500 : 400, msg);
        return;
    }
    snprintf(out, sizeof(out), "{\"input_tokens\":%zu}", t.n);
    tok_ids_done(&t);
    http_respond(hr, 200, "application/json", out, strlen(out), NULL);
}

void messages_count_tokens(struct http_req *hr, void *ud)
{
    static const struct door_serve serve = {
        .conv = count_conv, .ud_new = msg_ud_new, .ud_free = free, .ready = count_ready, .error = m_error,
    };
    struct coord *co = ud;

    if (!co->tok) {
        respond_error(hr, 503, "no tokenizer loaded (start stepd with --tokenizer)");
        return;
    }
    door_serve(co, hr, names(), &serve);
}
