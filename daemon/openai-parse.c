/* openai-parse.c - the OpenAI door's requests: a chat or text completion's JSON body
 * becomes the door-neutral struct request (request.h) with the field names as the client
 * wrote them (the name tables), every field read, inert or refused by the field rules
 * (never silently ignored); why a body is not JSON, and which model names are served.
 * Loop thread only. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "coord-int.h"
#include "json.h"
#include "media.h"
#include "openai-int.h"
#include "openai.h"
#include "strbuf.h"

/* ------------------------------------------------------------------ field names */

/* The two APIs name every field alike but the prompt (PROMPT: RN_TEXT, RN_MESSAGES,
 * RN_TOKEN_IDS, RN_INPUT), the number of top logprobs (LOGPROBS) and the output cap (MAXT:
 * a chat may name it max_completion_tokens). */
#define OPENAI_NAMES(PROMPT, LOGPROBS, MAXT) {                 \
    [RN_REQUEST_ID] = "request_id",                             \
    [RN_MODEL] = "model",                                       \
    [RN_TEXT] = PROMPT,                                         \
    [RN_MESSAGES] = PROMPT,                                     \
    [RN_TOOLS] = "tools",                                       \
    [RN_CHAT_TEMPLATE_KWARGS] = "chat_template_kwargs",         \
    [RN_REASONING_EFFORT] = "reasoning_effort",                 \
    [RN_TOKEN_IDS] = PROMPT,                                    \
    [RN_TEMPERATURE] = "temperature",                           \
    [RN_TOP_P] = "top_p",                                       \
    [RN_TOP_K] = "top_k",                                       \
    [RN_MIN_P] = "min_p",                                       \
    [RN_REPETITION_PENALTY] = "repetition_penalty",             \
    [RN_PRESENCE_PENALTY] = "presence_penalty",                 \
    [RN_FREQUENCY_PENALTY] = "frequency_penalty",               \
    [RN_MAX_TOKENS] = MAXT,                                     \
    [RN_MIN_TOKENS] = "min_tokens",                             \
    [RN_SEED] = "seed",                                         \
    [RN_LOGPROBS] = LOGPROBS,                                   \
    [RN_N] = "n",                                               \
    [RN_STOP] = "stop",                                         \
    [RN_STOP_TOKEN_IDS] = "stop_token_ids",                     \
    [RN_LOGIT_BIAS] = "logit_bias",                             \
    [RN_NUM_SPECULATIVE_TOKENS] = "num_speculative_tokens",     \
    [RN_CACHE_SALT] = "cache_salt",                             \
    [RN_TOOL_CHOICE] = "tool_choice",                           \
    [RN_INPUT] = PROMPT,                                        \
}

const char *const names_chat[_RN_MAX] = OPENAI_NAMES("messages", "top_logprobs", "max_tokens");
/* a chat that gave max_completion_tokens: its errors name that field */
static const char *const names_chat_mct[_RN_MAX] = OPENAI_NAMES("messages", "top_logprobs", "max_completion_tokens");
const char *const names_completion[_RN_MAX] = OPENAI_NAMES("prompt", "logprobs", "max_tokens");

#undef OPENAI_NAMES

/* ------------------------------------------------------------------ requests from JSON */

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* A field: absent or null is unset (0); 1 with the value; -EINVAL naming the field. */
static int get_num(const json_t *o, const char *key, double *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_number(j))
        BAD("%s: must be a number (got %s)", key, json_type_describe(j));
    *v = json_number_value(j);
    return 1;
}

static int get_int(const json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_integer(j))
        BAD("%s: must be an integer (got %s)", key, json_type_describe(j));
    *v = json_integer_value(j);
    if (*v < lo || *v > hi)
        BAD("%s: must be in [%" PRId64 ", %" PRId64 "] (got %" PRId64 ")", key, lo, hi, *v);
    return 1;
}

int openai_get_bool(const json_t *o, const char *key, bool *v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_boolean(j))
        BAD("%s: must be true or false (got %s)", key, json_type_describe(j));
    *v = json_is_true(j);
    return 1;
}

int openai_get_str(const json_t *o, const char *key, const char **v, char *msg, size_t len)
{
    const json_t *j = json_object_get(o, key);

    if (!j || json_is_null(j))
        return 0;
    if (!json_is_string(j))
        BAD("%s: must be a string (got %s)", key, json_type_describe(j));
    *v = json_string_value(j);
    return 1;
}

/* The text of a message's content: a string, or an array of text parts (joined by "\n").
 * With images (the chat door, whose image parts media_chat_images took), each image_url part
 * is one "<im_patch>" where it stands, as the model's template renders an image part (no
 * separator on either side); req.c expands it into the image's token layout. */
static int content_text(const json_t *c, size_t mi, bool images, char **ret, char *msg, size_t len)
{
    struct strbuf b = STRBUF_INIT;
    bool sep = false;
    size_t k;
    json_t *part;

    if (json_is_string(c)) {
        *ret = strdup(json_string_value(c));
        return *ret ? 0 : -ENOMEM;
    }
    if (!json_is_array(c))
        BAD("messages[%zu].content: must be a string or an array of content parts (got %s)", mi,
            json_type_describe(c));
    json_array_foreach(c, k, part) {
        const json_t *t = json_object_get(part, "type"), *text = json_object_get(part, "text");
        const char *type = json_is_string(t) ? json_string_value(t) : NULL;

        if (!json_is_object(part) || !type) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu]: must be a content part object with a \"type\"", mi, k);
        }
        if (images && !strcmp(type, "image_url")) {
            strbuf_adds(&b, MEDIA_IMAGE_PLACEHOLDER);
            sep = false;
            continue;
        }
        if (strcmp(type, "text")) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu].type: \"%.32s\" parts are not supported (this server serves a "
                "text-only model: text parts only)", mi, k, type);
        }
        if (!json_is_string(text)) {
            strbuf_done(&b);
            BAD("messages[%zu].content[%zu].text: must be a string", mi, k);
        }
        if (sep && b.len)       /* as before images: no newline after an empty text */
            strbuf_add(&b, "\n", 1);
        strbuf_adds(&b, json_string_value(text));
        sep = true;
    }
    if (b.oom)
        return -ENOMEM;
    *ret = b.p ? strbuf_take(&b) : strdup("");
    return *ret ? 0 : -ENOMEM;
}

/* An OpenAI tool call of the history as the template takes it: arguments parsed. */
static int tool_call_conv(const json_t *tc, size_t mi, size_t k, json_t **ret, char *msg, size_t len)
{
    const json_t *fn = json_object_get(tc, "function");
    const json_t *id = json_object_get(tc, "id"), *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    const json_t *args = json_is_object(fn) ? json_object_get(fn, "arguments") : NULL;
    json_t *a;
    json_error_t je;

    if (!json_is_object(tc) || !json_is_object(fn))
        BAD("messages[%zu].tool_calls[%zu]: must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
            "\"arguments\"}}", mi, k);
    if (!json_is_string(name) || !json_string_length(name))
        BAD("messages[%zu].tool_calls[%zu].function.name: must be a non-empty string", mi, k);
    if (id && !json_is_null(id) && !json_is_string(id))
        BAD("messages[%zu].tool_calls[%zu].id: must be a string", mi, k);
    if (!args || json_is_null(args)) {
        a = json_object();
    } else if (json_is_string(args)) {
        a = json_string_length(args) ? json_loads(json_string_value(args), JSON_REJECT_DUPLICATES, &je)
                                     : json_object();
        if (!a)
            BAD("messages[%zu].tool_calls[%zu].function.arguments: not valid JSON (%s)", mi, k, je.text);
    } else {
        a = json_incref((json_t *)args);
    }
    if (!json_is_object(a)) {
        json_decref(a);
        BAD("messages[%zu].tool_calls[%zu].function.arguments: must be a JSON object", mi, k);
    }
    *ret = json_pack("{s:s, s:s, s:{s:O, s:o}}", "id", json_is_string(id) ? json_string_value(id) : "",
                     "type", "function", "function", "name", name, "arguments", a);
    return *ret ? 0 : -ENOMEM;
}

/* OpenAI messages as the request's chat JSON (roles are checked by validate.c). */
int openai_messages_conv(const json_t *ms, bool images, json_t **ret, char *msg, size_t len)
{
    json_t *out, *m;
    size_t i;
    int r = 0;

    if (!ms)
        BAD("messages: required");
    if (!json_is_array(ms))
        BAD("messages: must be an array of messages (got %s)", json_type_describe(ms));
    if (!(out = json_array()))
        return -ENOMEM;
    json_array_foreach(ms, i, m) {
        const json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        const json_t *tcs = json_object_get(m, "tool_calls");
        const char *rk[] = { "reasoning_content", "reasoning", "name", "tool_call_id" };
        json_t *o;

        if (!json_is_object(m)) {
            json_decref(out);
            BAD("messages[%zu]: must be an object (got %s)", i, json_type_describe(m));
        }
        if (!json_is_string(role)) {
            json_decref(out);
            BAD("messages[%zu].role: must be a string", i);
        }
        o = json_object();
        r = o && json_array_append_new(out, o) == 0 ? 0 : -ENOMEM;
        if (!r)
            r = json_object_set_new(o, "role", json_string(!strcmp(json_string_value(role), "developer")
                                                          ? "system" : json_string_value(role)));
        if (!r && content && !json_is_null(content)) {
            char *text = NULL;

            r = content_text(content, i, images, &text, msg, len);
            if (!r)
                r = json_object_set_new(o, "content", json_string(text)) ? -ENOMEM : 0;
            free(text);
        }
        for (size_t k = 0; !r && k < 4; k++) {
            const json_t *v = json_object_get(m, rk[k]);

            if (!v || json_is_null(v))
                continue;
            if (!json_is_string(v)) {
                snprintf(msg, len, "messages[%zu].%s: must be a string", i, rk[k]);
                r = -EINVAL;
                break;
            }
            r = json_object_set(o, k == 1 ? "reasoning_content" : rk[k], (json_t *)v) ? -ENOMEM : 0;
        }
        if (!r && tcs && !json_is_null(tcs)) {
            json_t *arr = json_array(), *tc;
            size_t k;

            if (!json_is_array(tcs)) {
                json_decref(arr);
                snprintf(msg, len, "messages[%zu].tool_calls: must be an array", i);
                r = -EINVAL;
            } else if (!arr || json_object_set_new(o, "tool_calls", arr)) {
                r = -ENOMEM;
            }
            json_array_foreach(tcs, k, tc) {
                json_t *c = NULL;

                if (r || (r = tool_call_conv(tc, i, k, &c, msg, len)) < 0)
                    break;
                if (json_array_append_new(arr, c)) {
                    r = -ENOMEM;
                    break;
                }
            }
        }
        if (r) {
            json_decref(out);
            if (r == -ENOMEM)
                snprintf(msg, len, "out of memory");
            return r;
        }
    }
    *ret = out;
    return 0;
}

static int stops_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *st = json_object_get(body, "stop"), *v;
    size_t i;

    if (!st || json_is_null(st))
        return 0;
    if (json_is_string(st))
        return request_add_stop(&in->sp, json_string_value(st), json_string_length(st));
    if (!json_is_array(st))
        BAD("stop: must be a string or an array of strings (got %s)", json_type_describe(st));
    if (json_array_size(st) > 1024)
        BAD("stop: at most %u stop strings (got %zu)", 1024u, json_array_size(st));
    json_array_foreach(st, i, v) {
        if (!json_is_string(v))
            BAD("stop[%zu]: must be a string (got %s)", i, json_type_describe(v));
        if (request_add_stop(&in->sp, json_string_value(v), json_string_length(v)) < 0)
            return -ENOMEM;
    }
    return 0;
}

int openai_ids_conv(const json_t *a, const char *key, int32_t **ret, size_t *n, size_t max, char *msg, size_t len)
{
    const json_t *v;
    size_t i;

    if (!json_is_array(a))
        BAD("%s: must be an array of token ids (got %s)", key, json_type_describe(a));
    if (json_array_size(a) > max)
        BAD("%s: at most %zu ids (got %zu)", key, max, json_array_size(a));
    *ret = malloc((json_array_size(a) ? json_array_size(a) : 1) * sizeof(int32_t));
    if (!*ret)
        return -ENOMEM;
    *n = 0;
    json_array_foreach(a, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            free(*ret);
            *ret = NULL;
            BAD("%s[%zu]: must be a token id (a non-negative integer)", key, i);
        }
        (*ret)[(*n)++] = (int32_t)json_integer_value(v);
    }
    return 0;
}

static int logit_bias_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *lb = json_object_get(body, "logit_bias"), *v;
    const char *key;

    if (!lb || json_is_null(lb))
        return 0;
    if (!json_is_object(lb))
        BAD("logit_bias: must be an object of token id -> bias (got %s)", json_type_describe(lb));
    if (json_object_size(lb) > 1024)
        BAD("logit_bias: at most 1024 entries (got %zu)", json_object_size(lb));
    json_object_foreach((json_t *)lb, key, v) {
        char *end;
        long id = strtol(key, &end, 10);

        if (end == key || *end || id < 0 || id > INT32_MAX)
            BAD("logit_bias: key \"%.32s\" is not a token id", key);
        if (!json_is_number(v))
            BAD("logit_bias[%ld]: must be a number (got %s)", id, json_type_describe(v));
        if (request_add_logit_bias(&in->sp, (int32_t)id, (float)json_number_value(v)) < 0)
            return -ENOMEM;
    }
    return 0;
}

static int tool_choice_conv(const json_t *body, struct request *in, char *msg, size_t len)
{
    const json_t *tc = json_object_get(body, "tool_choice");
    bool have_tools = in->tools && json_array_size(in->tools);
    int r;

    in->tool_choice = have_tools ? REQUEST_TOOLS_AUTO : REQUEST_TOOLS_NONE;
    if (!tc || json_is_null(tc))
        return 0;
    if ((r = request_tool_choice_string(tc, "{\"type\": \"function\", \"function\": {\"name\": ...}}", in, msg,
                                        len)) < 0)
        return r;
    if (r > 0) {
        if (in->tool_choice == REQUEST_TOOLS_AUTO && !have_tools)
            in->tool_choice = REQUEST_TOOLS_NONE;
    } else if (json_is_object(tc)) {
        const json_t *fn = json_object_get(tc, "function");
        const json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;

        if (!json_is_string(name))
            BAD("tool_choice.function.name: required (a named tool choice)");
        in->tool_choice = REQUEST_TOOLS_NAMED;
        if (!(in->tool_choice_name = strdup(json_string_value(name))))
            return -ENOMEM;
    } else {
        BAD("tool_choice: must be a string or an object (got %s)", json_type_describe(tc));
    }
    if ((in->tool_choice == REQUEST_TOOLS_REQUIRED || in->tool_choice == REQUEST_TOOLS_NAMED) && !have_tools)
        BAD("tool_choice: \"%s\" needs tools", in->tool_choice == REQUEST_TOOLS_REQUIRED ? "required"
                                                                                         : in->tool_choice_name);
    if (in->tool_choice == REQUEST_TOOLS_NAMED) {
        size_t i;
        const json_t *t;
        bool found = false;

        json_array_foreach(in->tools, i, t) {
            const json_t *f = json_object_get(t, "function");
            const json_t *n = json_is_object(f) ? json_object_get(f, "name") : NULL;

            found |= json_is_string(n) && !strcmp(json_string_value(n), in->tool_choice_name);
        }
        if (!found)
            BAD("tool_choice.function.name: \"%.64s\" is not one of the tools", in->tool_choice_name);
        if (strspn(in->tool_choice_name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.") !=
            strlen(in->tool_choice_name))
            BAD("tool_choice.function.name: not a valid function name");
    }
    return 0;
}

/* Every field a client may send to /v1/chat/completions or /v1/completions (OpenAI's and
 * vLLM's ChatCompletionRequest / CompletionRequest), and what stepd does with it
 * (docs/OPERATIONS.md §12 has the same table).  A field that would change the output is
 * read by body_conv or refused with a 400 naming it; one that cannot change the output is
 * accepted and left unread; a field of neither list is refused, never ignored. */
enum field_use {
    FU_READ,                /* body_conv reads it (and refuses what it cannot do) */
    FU_INERT,               /* cannot change the output */
    FU_REFUSED,             /* refused with any value but null */
    FU_REFUSED_SET,         /* refused unless null, false or empty ("", [], {}) */
    FU_REFUSED_UNSET,       /* refused unless null or true */
    FU_TEXT_ONLY,           /* refused unless null or ["text"] */
};

#define FD_CHAT 1u
#define FD_COMPLETIONS 2u
#define FD_BOTH 3u

struct field_rule {
    const char *name;
    unsigned doors;
    enum field_use use;
    const char *why;        /* refused: what stepd lacks */
};

#define NO_SO "structural tags are not supported (response_format, structured_outputs and guided_* are)"
static const struct field_rule field_rules[] = {
    /* read */
    { "model", FD_BOTH, FU_READ, NULL },
    { "messages", FD_CHAT, FU_READ, NULL },
    { "prompt", FD_COMPLETIONS, FU_READ, NULL },
    { "request_id", FD_BOTH, FU_READ, NULL },
    { "tools", FD_CHAT, FU_READ, NULL },
    { "tool_choice", FD_CHAT, FU_READ, NULL },
    { "parallel_tool_calls", FD_CHAT, FU_READ, NULL },
    { "chat_template_kwargs", FD_CHAT, FU_READ, NULL },
    { "reasoning_effort", FD_CHAT, FU_READ, NULL },
    { "add_generation_prompt", FD_CHAT, FU_READ, NULL },
    { "logprobs", FD_BOTH, FU_READ, NULL },
    { "top_logprobs", FD_CHAT, FU_READ, NULL },
    { "echo", FD_COMPLETIONS, FU_READ, NULL },
    { "best_of", FD_COMPLETIONS, FU_READ, NULL },
    { "suffix", FD_COMPLETIONS, FU_READ, NULL },
    { "response_format", FD_BOTH, FU_READ, NULL },
    /* structured output (daemon/structured.c) */
    { "structured_outputs", FD_BOTH, FU_READ, NULL },
    { "guided_json", FD_BOTH, FU_READ, NULL },
    { "guided_regex", FD_BOTH, FU_READ, NULL },
    { "guided_choice", FD_BOTH, FU_READ, NULL },
    { "guided_grammar", FD_BOTH, FU_READ, NULL },
    { "guided_decoding_backend", FD_BOTH, FU_READ, NULL },
    { "guided_whitespace_pattern", FD_BOTH, FU_READ, NULL },
    { "temperature", FD_BOTH, FU_READ, NULL },
    { "top_p", FD_BOTH, FU_READ, NULL },
    { "top_k", FD_BOTH, FU_READ, NULL },
    { "min_p", FD_BOTH, FU_READ, NULL },
    { "presence_penalty", FD_BOTH, FU_READ, NULL },
    { "frequency_penalty", FD_BOTH, FU_READ, NULL },
    { "repetition_penalty", FD_BOTH, FU_READ, NULL },
    { "max_tokens", FD_BOTH, FU_READ, NULL },
    { "max_completion_tokens", FD_BOTH, FU_READ, NULL },
    { "min_tokens", FD_BOTH, FU_READ, NULL },
    { "seed", FD_BOTH, FU_READ, NULL },
    { "ignore_eos", FD_BOTH, FU_READ, NULL },
    { "skip_special_tokens", FD_BOTH, FU_READ, NULL },
    { "include_stop_str_in_output", FD_BOTH, FU_READ, NULL },
    { "stop", FD_BOTH, FU_READ, NULL },
    { "stop_token_ids", FD_BOTH, FU_READ, NULL },
    { "logit_bias", FD_BOTH, FU_READ, NULL },
    { "n", FD_BOTH, FU_READ, NULL },
    { "priority", FD_BOTH, FU_READ, NULL },
    { "num_speculative_tokens", FD_BOTH, FU_READ, NULL },
    { "cache_salt", FD_BOTH, FU_READ, NULL },
    { "stream", FD_BOTH, FU_READ, NULL },
    { "stream_options", FD_BOTH, FU_READ, NULL },
    { "return_token_ids", FD_BOTH, FU_READ, NULL },
    { "user", FD_BOTH, FU_READ, NULL },
    /* cannot change the output */
    { "metadata", FD_BOTH, FU_INERT, NULL },
    { "store", FD_BOTH, FU_INERT, NULL },
    { "service_tier", FD_BOTH, FU_INERT, NULL },
    { "session_id", FD_BOTH, FU_INERT, NULL },
    { "prediction", FD_CHAT, FU_INERT, NULL },
    { "stream_interval", FD_BOTH, FU_INERT, NULL },
    { "length_penalty", FD_BOTH, FU_INERT, NULL },
    { "truncation_side", FD_BOTH, FU_INERT, NULL },
    { "mm_processor_kwargs", FD_BOTH, FU_REFUSED_SET, "Step-3.7's image processor has one policy (no kwargs)" },
    { "media_io_kwargs", FD_CHAT, FU_REFUSED_SET, "images are data URLs or fetched URLs (no loader kwargs)" },
    { "return_token_offsets", FD_BOTH, FU_INERT, NULL },
    { "return_mm_kwargs", FD_BOTH, FU_INERT, NULL },
    { "routed_experts_prompt_start", FD_BOTH, FU_INERT, NULL },
    /* would change the output: refused until supported */
    { "structural_tag", FD_BOTH, FU_REFUSED, NO_SO },
    { "prompt_logprobs", FD_BOTH, FU_REFUSED, "prompt logprobs are not supported" },
    { "logprob_token_ids", FD_BOTH, FU_REFUSED, "logprobs of chosen token ids are not supported" },
    { "truncate_prompt_tokens", FD_BOTH, FU_REFUSED, "prompts are never truncated" },
    { "thinking_token_budget", FD_BOTH, FU_REFUSED, "a reasoning budget is not supported" },
    { "repetition_detection", FD_BOTH, FU_REFUSED, "repetition detection is not supported" },
    { "kv_transfer_params", FD_BOTH, FU_REFUSED, "disaggregated KV transfer is not supported" },
    { "ec_transfer_params", FD_BOTH, FU_REFUSED, "disaggregated encoder-cache transfer is not supported" },
    { "chat_template", FD_CHAT, FU_REFUSED, "the model's own chat template is the only one" },
    { "documents", FD_CHAT, FU_REFUSED, "the chat template has no documents" },
    { "prompt_embeds", FD_COMPLETIONS, FU_REFUSED, "prompt embeddings are not supported" },
    { "functions", FD_CHAT, FU_REFUSED, "the legacy function-calling fields are not supported, tools are" },
    { "function_call", FD_CHAT, FU_REFUSED, "the legacy function-calling fields are not supported, tool_choice is" },
    { "audio", FD_CHAT, FU_REFUSED, "audio output is not supported" },
    { "web_search_options", FD_CHAT, FU_REFUSED, "web search is not supported" },
    { "verbosity", FD_CHAT, FU_REFUSED, "verbosity is not supported" },
    { "use_beam_search", FD_BOTH, FU_REFUSED_SET, "beam search is not supported" },
    { "allowed_token_ids", FD_BOTH, FU_REFUSED_SET, "restricting the vocabulary is not supported" },
    { "bad_words", FD_BOTH, FU_REFUSED_SET, "bad words are not supported" },
    { "logits_processors", FD_BOTH, FU_REFUSED_SET, "logits processors are not supported" },
    { "vllm_xargs", FD_BOTH, FU_REFUSED_SET, "vLLM extension arguments are not supported" },
    { "watermarking", FD_BOTH, FU_REFUSED_SET, "watermarking is not supported" },
    { "return_tokens_as_token_ids", FD_BOTH, FU_REFUSED_SET, "logprob tokens are always strings" },
    { "return_prompt_text", FD_BOTH, FU_REFUSED_SET, "the rendered prompt is not returned, POST /tokenize gives it" },
    { "echo", FD_CHAT, FU_REFUSED_SET, "the answer never repeats the last message" },
    { "continue_final_message", FD_CHAT, FU_REFUSED_SET, "continuing the final message is not supported" },
    { "add_special_tokens", FD_CHAT, FU_REFUSED_SET, "the chat template places the special tokens" },
    { "add_special_tokens", FD_COMPLETIONS, FU_REFUSED_UNSET, "a text prompt always starts with BOS" },
    { "include_reasoning", FD_CHAT, FU_REFUSED_UNSET, "the reasoning is always returned, in reasoning_content" },
    { "spaces_between_special_tokens", FD_BOTH, FU_REFUSED_UNSET, "the detokenizer adds no spaces" },
    { "modalities", FD_CHAT, FU_TEXT_ONLY, "text is the only output" },
};
#undef NO_SO

static bool json_is_unset(const json_t *v)
{
    return json_is_null(v) || json_is_false(v) || (json_is_string(v) && !json_string_length(v)) ||
           (json_is_array(v) && !json_array_size(v)) || (json_is_object(v) && !json_object_size(v));
}

/* Every key of body against field_rules: 0, or -EINVAL naming the first one refused. */
static int fields_check(const json_t *body, bool chat, char *msg, size_t len)
{
    unsigned door = chat ? FD_CHAT : FD_COMPLETIONS;
    const char *key;
    json_t *v;

    json_object_foreach((json_t *)body, key, v) {
        const struct field_rule *f = NULL;
        bool other_door = false;

        for (size_t i = 0; i < sizeof(field_rules) / sizeof(field_rules[0]) && !f; i++) {
            if (strcmp(field_rules[i].name, key))
                continue;
            if (field_rules[i].doors & door)
                f = &field_rules[i];
            else
                other_door = true;
        }
        if (!f && other_door)
            BAD("%.64s: not a field of %s", key, chat ? "/v1/chat/completions" : "/v1/completions");
        if (!f)
            BAD("%.64s: not a request field stepd knows (refused rather than ignored; docs/OPERATIONS.md "
                "§12 lists them)", key);
        switch (f->use) {
        case FU_READ:
        case FU_INERT:
            break;
        case FU_REFUSED:
            if (!json_is_null(v))
                BAD("%s: %s", key, f->why);
            break;
        case FU_REFUSED_SET:
            if (!json_is_unset(v))
                BAD("%s: %s (only null, false or empty)", key, f->why);
            break;
        case FU_REFUSED_UNSET:
            if (!json_is_null(v) && !json_is_true(v))
                BAD("%s: only true: %s", key, f->why);
            break;
        case FU_TEXT_ONLY:
            if (!json_is_null(v) && !(json_is_array(v) && json_array_size(v) == 1 &&
                                      json_is_string(json_array_get(v, 0)) &&
                                      !strcmp(json_string_value(json_array_get(v, 0)), "text")))
                BAD("%s: only [\"text\"]: %s", key, f->why);
            break;
        }
    }
    return 0;
}

/* The request's fields (OpenAI's, vLLM's extensions, stepd's num_speculative_tokens) onto in. */
int openai_body_conv(const struct coord *co, const json_t *body, bool chat, struct request *in,
                     struct oai_opts *x, char *msg, size_t len)
{
    struct request_sampling *sp = &in->sp;
    const json_t *so, *j;
    const char *s = NULL;
    double d;
    int64_t v;
    bool bv;
    int r;

    if (!json_is_object(body))
        BAD("the request body must be a JSON object (got %s)", json_type_describe(body));
    if ((r = fields_check(body, chat, msg, len)) < 0)
        return r;
    if ((r = openai_get_str(body, "model", &x->model, msg, len)) < 0)
        return r;
    if (!x->model)
        BAD("model: required (one of the names of GET /v1/models)");
    free(in->model);
    if (!(in->model = strdup(x->model)))
        return -ENOMEM;
    if ((r = openai_get_str(body, "request_id", &s, msg, len)) < 0)
        return r;
    if (s) {
        if (strlen(s) > 128)
            BAD("request_id: at most 128 printable ASCII characters without spaces");
        snprintf(in->id, sizeof(in->id), "%s", s);
    }
    if (chat) {
        in->input = REQUEST_INPUT_CHAT;
        /* images in (daemon/media.c): each image_url part checked, decoded, preprocessed */
        if ((r = media_chat_images(json_object_get(body, "messages"), co->tok, wpool_serves_images(co),
                                     x->fetched, in, msg, len)) < 0)
            return r;
        if ((r = openai_messages_conv(json_object_get(body, "messages"), in->n_images > 0, &in->messages, msg, len)) < 0)
            return r;
        j = json_object_get(body, "tools");
        if (j && !json_is_null(j)) {
            if (!json_is_array(j))
                BAD("tools: must be an array of tool definitions (got %s)", json_type_describe(j));
            in->tools = json_incref((json_t *)j);
        }
        if ((r = tool_choice_conv(body, in, msg, len)) < 0)
            return r;
        if ((r = openai_get_bool(body, "parallel_tool_calls", &bv, msg, len)) < 0)
            return r;
        if (r)
            in->single_tool_call = !bv;
        if ((in->tool_choice == REQUEST_TOOLS_AUTO || in->tool_choice == REQUEST_TOOLS_REQUIRED ||
             in->tool_choice == REQUEST_TOOLS_NAMED) && !co->o.tool_parser)
            BAD("tool_choice: tool calls need the tool-call parser (stepd runs without it: --tool-call-parser "
                "none)");
        j = json_object_get(body, "chat_template_kwargs");
        if (j && !json_is_null(j))
            in->chat_template_kwargs = json_incref((json_t *)j);
        if ((r = openai_get_str(body, "reasoning_effort", &s, msg, len)) < 0)
            return r;
        if (r && !(in->reasoning_effort = strdup(s)))
            return -ENOMEM;
        if ((r = openai_get_bool(body, "add_generation_prompt", &bv, msg, len)) < 0)
            return r;
        if (r)
            in->add_generation_prompt = bv;
        if ((r = openai_get_bool(body, "logprobs", &x->logprobs, msg, len)) < 0 ||
            (r = get_int(body, "top_logprobs", 0, 20, &v, msg, len)) < 0)
            return r;
        if (r && !x->logprobs)
            BAD("top_logprobs: needs \"logprobs\": true");
        if (x->logprobs)
            REQUEST_SET(sp, RO_LOGPROBS, logprobs, r ? (int32_t)v : 0);
    } else {
        const json_t *p = json_object_get(body, "prompt");

        if (!p || json_is_null(p))
            BAD("prompt: required");
        if (json_is_array(p) && json_array_size(p) == 1 &&
            (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
            p = json_array_get(p, 0);       /* a batch of one */
        if (json_is_string(p)) {
            in->input = REQUEST_INPUT_TEXT;
            if (!(in->text = strdup(json_string_value(p))))
                return -ENOMEM;
            if (strlen(in->text) != json_string_length(p))
                BAD("prompt: must not contain NUL characters");
        } else if (json_is_array(p) && (json_array_size(p) == 0 || json_is_integer(json_array_get(p, 0)))) {
            in->input = REQUEST_INPUT_TOKENS;
            in->text_output = true;
            if ((r = openai_ids_conv(p, "prompt", &in->token_ids, &in->n_token_ids, 1u << 24, msg, len)) < 0)
                return r;
        } else if (json_is_array(p)) {
            BAD("prompt: one prompt per request (a string or an array of token ids; got %zu prompts)",
                json_array_size(p));
        } else {
            BAD("prompt: must be a string or an array of token ids (got %s)", json_type_describe(p));
        }
        if ((r = get_int(body, "logprobs", 0, 20, &v, msg, len)) < 0)
            return r;
        if (r) {
            x->logprobs = true;
            REQUEST_SET(sp, RO_LOGPROBS, logprobs, (int32_t)v);
        }
        if ((r = openai_get_bool(body, "echo", &bv, msg, len)) < 0)
            return r;
        if (r && bv)
            BAD("echo: not supported (the answer never repeats the prompt)");
        if ((r = get_int(body, "best_of", 1, 1, &v, msg, len)) < 0)
            return r;
        if ((j = json_object_get(body, "suffix")) && !json_is_null(j))
            BAD("suffix: not supported");
    }
    if ((r = door_structured_openai(body, in, msg, len)) < 0)
        return r;
    /* sampling */
#define NUM(key, o, f) do { \
        if ((r = get_num(body, key, &d, msg, len)) < 0) \
            return r; \
        if (r) \
            REQUEST_SET(sp, o, f, (float)d); \
    } while (0)
    NUM("temperature", RO_TEMPERATURE, temperature);
    NUM("top_p", RO_TOP_P, top_p);
    NUM("min_p", RO_MIN_P, min_p);
    NUM("presence_penalty", RO_PRESENCE_PENALTY, presence_penalty);
    NUM("frequency_penalty", RO_FREQUENCY_PENALTY, frequency_penalty);
    NUM("repetition_penalty", RO_REPETITION_PENALTY, repetition_penalty);
#undef NUM
    if ((r = get_int(body, "top_k", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_TOP_K, top_k, (int32_t)v);
    if ((r = get_int(body, "max_completion_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r) {
        if (in->names == names_chat)
            in->names = names_chat_mct;
        REQUEST_SET(sp, RO_MAX_TOKENS, max_tokens, v);
    } else if ((r = get_int(body, "max_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0) {
        return r;
    } else if (r) {
        REQUEST_SET(sp, RO_MAX_TOKENS, max_tokens, v);
    }
    if ((r = get_int(body, "min_tokens", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_MIN_TOKENS, min_tokens, v);
    if ((r = get_int(body, "seed", INT64_MIN, INT64_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_SEED, seed, v);
    if ((r = openai_get_bool(body, "ignore_eos", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_IGNORE_EOS, ignore_eos, bv);
    if ((r = openai_get_bool(body, "skip_special_tokens", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_SKIP_SPECIAL_TOKENS, skip_special_tokens, bv);
    if ((r = openai_get_bool(body, "include_stop_str_in_output", &bv, msg, len)) < 0)
        return r;
    if (r)
        REQUEST_SET(sp, RO_INCLUDE_STOP_STR, include_stop_str, bv);
    if ((r = stops_conv(body, in, msg, len)) < 0 || (r = logit_bias_conv(body, in, msg, len)) < 0)
        return r;
    if ((j = json_object_get(body, "stop_token_ids")) && !json_is_null(j)) {
        int32_t *ids = NULL;
        size_t n = 0;

        if ((r = openai_ids_conv(j, "stop_token_ids", &ids, &n, 1024, msg, len)) < 0)
            return r;
        for (size_t i = 0; i < n && r == 0; i++)
            r = request_add_stop_id(sp, ids[i]);
        free(ids);
        if (r < 0)
            return r;
    }
    x->n = 1;
    if ((r = get_int(body, "n", INT32_MIN, INT32_MAX, &x->n, msg, len)) < 0)
        return r;
    if (x->n < 1 || x->n > co->o.max_n)
        BAD("n: must be in [1, %u] (got %" PRId64 "; the server's --max-n)", co->o.max_n, x->n);
    if ((r = get_int(body, "priority", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r)
        in->priority = (int32_t)v;
    if ((r = get_int(body, "num_speculative_tokens", INT32_MIN, INT32_MAX, &v, msg, len)) < 0)
        return r;
    if (r) {
        in->has_num_speculative_tokens = true;
        in->num_speculative_tokens = (int32_t)v;
    }
    if ((r = openai_get_str(body, "cache_salt", &s, msg, len)) < 0)
        return r;
    if (r) {
        free(in->cache_salt);
        if (!(in->cache_salt = strdup(s)))
            return -ENOMEM;
    }
    if ((r = openai_get_str(body, "user", &s, msg, len)) < 0)
        return r;
    if ((r = openai_get_bool(body, "stream", &x->stream, msg, len)) < 0 ||
        (r = openai_get_bool(body, "return_token_ids", &x->return_ids, msg, len)) < 0)
        return r;
    in->include_token_ids = x->return_ids;
    if ((so = json_object_get(body, "stream_options")) && !json_is_null(so)) {
        if (!json_is_object(so))
            BAD("stream_options: must be an object (got %s)", json_type_describe(so));
        if (!x->stream)
            BAD("stream_options: only with \"stream\": true");
        if ((r = openai_get_bool(so, "include_usage", &x->include_usage, msg, len)) < 0 ||
            (r = openai_get_bool(so, "continuous_usage_stats", &x->continuous_usage, msg, len)) < 0)
            return r;
        in->continuous_usage_stats = x->continuous_usage;
    }
    return 0;
}

/* The path ("messages[0].content") of the value the parser was in at byte pos of body, or ""
 * at the top level: a scan that follows only strings, objects and arrays (the body is
 * well-formed up to pos, or the parser would have stopped earlier). */
static void json_path_at(const char *b, size_t pos, char *out, size_t n)
{
    struct { bool arr; size_t idx; char key[48]; } st[12];
    int depth = 0;                  /* open containers */
    bool in_str = false, esc = false, is_key = false, want_key = false;
    size_t kstart = 0, o = 0;

    for (size_t i = 0; i < pos; i++) {
        char ch = b[i];
        int d = depth - 1;

        if (in_str) {
            if (esc) {
                esc = false;
            } else if (ch == '\\') {
                esc = true;
            } else if (ch == '"') {
                in_str = false;
                if (is_key && d >= 0 && d < 12)
                    snprintf(st[d].key, sizeof(st[d].key), "%.*s", (int)(i - kstart), b + kstart);
            }
            continue;
        }
        switch (ch) {
        case '"':
            in_str = true;
            is_key = want_key;
            want_key = false;
            kstart = i + 1;
            break;
        case '{':
        case '[':
            if (depth < 12)
                st[depth] = (typeof(st[0])){ .arr = ch == '[' };
            depth++;
            want_key = ch == '{';
            break;
        case '}':
        case ']':
            depth -= depth > 0;
            break;
        case ',':
            if (d >= 0 && d < 12 && st[d].arr)
                st[d].idx++;
            else
                want_key = true;
            break;
        }
    }
    out[0] = '\0';
    for (int d = 0; d < depth && d < 12 && o < n; d++) {
        if (st[d].arr)
            o += (size_t)snprintf(out + o, n - o, "[%zu]", st[d].idx);
        else if (st[d].key[0])
            o += (size_t)snprintf(out + o, n - o, "%s%s", d ? "." : "", st[d].key);
    }
    if (o >= n || strcspn(out, ": ") != strlen(out))
        out[0] = '\0';             /* too long, or not a name param_of can take */
}

/* A body that is not JSON: where, and, when the bad token is a NaN or an infinity, an integer
 * past 64 bits or an escaped NUL, which field holds it. */
void bad_json(const char *body, size_t blen, const json_error_t *je, char *msg, size_t len)
{
    size_t pos = je->position > 0 && (size_t)je->position <= blen ? (size_t)je->position : 0;
    size_t at = pos;
    char path[160];
    bool big = strstr(je->text, "too big") != NULL, nul = strstr(je->text, "\\u0000") != NULL;

    if (big || nul) {
        json_path_at(body, pos, path, sizeof(path));
        if (path[0]) {
            snprintf(msg, len, "%s: %s", path, big ? "an integer past 64 bits (JSON numbers here are at most "
                     "2^63-1 in magnitude)" : "a NUL character (\\u0000) is not allowed");
            return;
        }
    }

    /* jansson's position is just past the token it could not take: back to its start */
    while (at > 0 && strchr("NaIfinty-", body[at - 1]))
        at--;
    if (!strncmp(body + at, "NaN", 3) || !strncmp(body + at, "Infinity", 8) || !strncmp(body + at, "-Infinity", 9)) {
        /* the key before it: "key" : value */
        size_t e = at;

        while (e > 0 && strchr(" \t\r\n:", body[e - 1]))
            e--;
        if (e > 0 && body[e - 1] == '"') {
            size_t b = e - 1;

            while (b > 0 && body[b - 1] != '"')
                b--;
            if (b > 0 && e - 1 - b < 64) {
                snprintf(msg, len, "%.*s: must be a finite number (JSON has no %.*s)", (int)(e - 1 - b), body + b,
                         body[at] == 'N' ? 3 : body[at] == 'I' ? 8 : 9, body + at);
                return;
            }
        }
    }
    snprintf(msg, len, "the request body is not valid JSON: %s (line %d, column %d)", je->text, je->line,
             je->column);
}

bool model_known(const struct coord *co, const char *name)
{
    if (co->o.model_name && !strcmp(name, co->o.model_name))
        return true;
    for (size_t i = 0; i < co->o.n_model_aliases; i++)
        if (!strcmp(name, co->o.model_aliases[i]))
            return true;
    return co->model.known && !strcmp(name, co->model.name);
}
