/* validate.c - a struct request checked against the server's limits and the model, once,
 * before any tokenization: 0, or -EINVAL with one sentence in msg that names the field as
 * the client wrote it (the door's name table) and, where it helps, the value.  What can
 * only be checked after tokenization (prompt length in tokens) is checked in req.c.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "coord-int.h"

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)
#define N(f) (in->names[f])

static bool id_valid(const char *s)
{
    size_t n = strlen(s);

    if (n > 128)
        return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x21 || s[i] > 0x7e)
            return false;
    return true;
}

static bool blank(const char *s)
{
    for (; *s; s++)
        if (!isspace((unsigned char)*s))
            return false;
    return true;
}

/* OpenAI's function names: [A-Za-z0-9_.-]{1,64}. */
static bool fn_name_valid(const char *s)
{
    size_t n = strlen(s);

    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-' && s[i] != '.')
            return false;
    return true;
}

static int validate_sampling(const struct coord *co, const struct request *in, uint32_t vocab,
                             char *msg, size_t len)
{
    const struct coord_opts *o = &co->o;
    const struct request_sampling *sp = &in->sp;
    bool text_input = in->input == REQUEST_INPUT_TEXT || in->input == REQUEST_INPUT_CHAT ||
                      (in->text_output && co->tok);

    if (REQUEST_HAS(sp, RO_TEMPERATURE) && !(isfinite(sp->temperature) && sp->temperature >= 0.0f))
        BAD("%s: must be finite and >= 0 (got %g)", N(RN_TEMPERATURE), (double)sp->temperature);
    if (REQUEST_HAS(sp, RO_TEMPERATURE) && sp->temperature > 100.0f)
        BAD("%s: must be <= 100 (got %g)", N(RN_TEMPERATURE), (double)sp->temperature);
    if (REQUEST_HAS(sp, RO_TOP_P) && !(sp->top_p > 0.0f && sp->top_p <= 1.0f))
        BAD("%s: must be in (0, 1] (got %g)", N(RN_TOP_P), (double)sp->top_p);
    if (REQUEST_HAS(sp, RO_TOP_K) && sp->top_k < -1)
        BAD("%s: must be >= 1, or 0 or -1 for disabled (got %d)", N(RN_TOP_K), sp->top_k);
    if (REQUEST_HAS(sp, RO_TOP_K) && vocab && sp->top_k > 0 && (uint32_t)sp->top_k > vocab)
        BAD("%s: must be <= vocabulary size %u (got %d)", N(RN_TOP_K), vocab, sp->top_k);
    if (REQUEST_HAS(sp, RO_MIN_P) && !(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        BAD("%s: must be in [0, 1] (got %g)", N(RN_MIN_P), (double)sp->min_p);
    if (REQUEST_HAS(sp, RO_REPETITION_PENALTY) &&
        !(isfinite(sp->repetition_penalty) && sp->repetition_penalty > 0.0f &&
          sp->repetition_penalty <= 10.0f))
        BAD("%s: must be in (0, 10] (got %g)", N(RN_REPETITION_PENALTY),
            (double)sp->repetition_penalty);
    if (REQUEST_HAS(sp, RO_PRESENCE_PENALTY) &&
        !(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        BAD("%s: must be in [-2, 2] (got %g)", N(RN_PRESENCE_PENALTY), (double)sp->presence_penalty);
    if (REQUEST_HAS(sp, RO_FREQUENCY_PENALTY) &&
        !(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        BAD("%s: must be in [-2, 2] (got %g)", N(RN_FREQUENCY_PENALTY),
            (double)sp->frequency_penalty);
    if (REQUEST_HAS(sp, RO_MAX_TOKENS) && sp->max_tokens < 1)
        BAD("%s: must be >= 1 (got %" PRId64 ")", N(RN_MAX_TOKENS), sp->max_tokens);
    if (REQUEST_HAS(sp, RO_MAX_TOKENS) && sp->max_tokens > (int64_t)o->max_tokens_cap)
        BAD("%s: must be <= %u (got %" PRId64 ")", N(RN_MAX_TOKENS), o->max_tokens_cap,
            sp->max_tokens);
    if (REQUEST_HAS(sp, RO_MIN_TOKENS) && sp->min_tokens < 0)
        BAD("%s: must be >= 0 (got %" PRId64 ")", N(RN_MIN_TOKENS), sp->min_tokens);
    if (REQUEST_HAS(sp, RO_MIN_TOKENS)) {
        int64_t mx = REQUEST_HAS(sp, RO_MAX_TOKENS) ? sp->max_tokens : (int64_t)o->default_max_tokens;

        if (sp->min_tokens > mx)
            BAD("%s: must be <= max_tokens %" PRId64 " (got %" PRId64 ")", N(RN_MIN_TOKENS), mx,
                sp->min_tokens);
    }
    if (REQUEST_HAS(sp, RO_SEED) && sp->seed < 0)
        BAD("%s: must be in [0, 2^63) (got %" PRId64 ")", N(RN_SEED), sp->seed);
    if (REQUEST_HAS(sp, RO_LOGPROBS) && (sp->logprobs < 0 || (unsigned)sp->logprobs > o->max_logprobs))
        BAD("%s: must be in [0, %u] (got %d)", N(RN_LOGPROBS), o->max_logprobs, sp->logprobs);
    if (REQUEST_HAS(sp, RO_N) && sp->n != 1)
        BAD("%s: only 1 is served (got %d)", N(RN_N), sp->n);
    if (sp->n_stop > o->max_stop)
        BAD("%s: at most %u stop strings (got %zu)", N(RN_STOP), o->max_stop, sp->n_stop);
    for (size_t i = 0; i < sp->n_stop; i++) {
        size_t sl = strlen(sp->stop[i]);

        if (sl == 0)
            BAD("%s[%zu]: empty stop string", N(RN_STOP), i);
        if (sl > o->max_stop_len)
            BAD("%s[%zu]: longer than %u bytes (%zu)", N(RN_STOP), i, o->max_stop_len, sl);
    }
    if (sp->n_stop && !text_input)
        BAD("%s: stop strings need text or chat input (use stop_token_ids with token input)",
            N(RN_STOP));
    if (sp->n_stop_token_ids > o->max_stop_token_ids)
        BAD("%s: at most %u ids (got %zu)", N(RN_STOP_TOKEN_IDS), o->max_stop_token_ids,
            sp->n_stop_token_ids);
    for (size_t i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] < 0 || (vocab && (uint32_t)sp->stop_token_ids[i] >= vocab))
            BAD("%s[%zu]: %d is outside the vocabulary [0, %u)", N(RN_STOP_TOKEN_IDS), i,
                sp->stop_token_ids[i], vocab);
    if (sp->n_logit_bias > o->max_logit_bias)
        BAD("%s: at most %u entries (got %zu)", N(RN_LOGIT_BIAS), o->max_logit_bias,
            sp->n_logit_bias);
    for (size_t i = 0; i < sp->n_logit_bias; i++) {
        const struct request_logit_bias *e = &sp->logit_bias[i];

        if (e->id < 0 || (vocab && (uint32_t)e->id >= vocab))
            BAD("%s: key %d is outside the vocabulary [0, %u)", N(RN_LOGIT_BIAS), e->id, vocab);
        if (!(e->bias >= -100.0f && e->bias <= 100.0f))
            BAD("%s[%d]: must be in [-100, 100] (got %g)", N(RN_LOGIT_BIAS), e->id, (double)e->bias);
    }
    return 0;
}

static const char *str_of(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);

    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* The tool calls of assistant message mi (OpenAI shape: {id, type, function: {name,
 * arguments}}, arguments already parsed to an object). */
static int validate_tool_calls(const struct request *in, size_t mi, const json_t *tcs, char *msg,
                               size_t len)
{
    size_t k;
    json_t *tc;

    if (!json_is_array(tcs))
        BAD("%s[%zu].tool_calls: must be an array", N(RN_MESSAGES), mi);
    json_array_foreach(tcs, k, tc) {
        const json_t *fn = json_object_get(tc, "function");
        const char *name = json_is_object(fn) ? str_of(fn, "name") : NULL;

        if (!json_is_object(tc) || !json_is_object(fn))
            BAD("%s[%zu].tool_calls[%zu]: must be an object with a \"function\" object",
                N(RN_MESSAGES), mi, k);
        if (!name || !name[0])
            BAD("%s[%zu].tool_calls[%zu].name: required", N(RN_MESSAGES), mi, k);
        if (!json_is_object(json_object_get(fn, "arguments")))
            BAD("%s[%zu].tool_calls[%zu].arguments_json: must be a JSON object", N(RN_MESSAGES),
                mi, k);
    }
    return 0;
}

static int validate_messages(const struct coord *co, const struct request *in, char *msg, size_t len)
{
    size_t total = 0, i, n = json_array_size(in->messages);
    json_t *m;

    if (!json_is_array(in->messages) || n == 0)
        BAD("%s: at least one message is required", N(RN_MESSAGES));
    if (n > 4096)
        BAD("%s: at most 4096 messages (got %zu)", N(RN_MESSAGES), n);
    json_array_foreach(in->messages, i, m) {
        const char *role = str_of(m, "role"), *content = str_of(m, "content");
        const char *reasoning = str_of(m, "reasoning_content");
        const json_t *tcs = json_object_get(m, "tool_calls");

        if (!json_is_object(m))
            BAD("%s[%zu]: must be an object", N(RN_MESSAGES), i);
        if (!role || (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
                      strcmp(role, "tool")))
            BAD("%s[%zu].role: must be system, user, assistant or tool (got \"%.32s\")",
                N(RN_MESSAGES), i, role ? role : "");
        if (!content && json_object_get(m, "content") && !json_is_null(json_object_get(m, "content")))
            BAD("%s[%zu].content: must be a string", N(RN_MESSAGES), i);
        if (tcs && !json_is_null(tcs) && json_array_size(tcs)) {
            if (strcmp(role, "assistant"))
                BAD("%s[%zu].tool_calls: only assistant messages carry tool calls", N(RN_MESSAGES), i);
            if (validate_tool_calls(in, i, tcs, msg, len) < 0)
                return -EINVAL;
        }
        total += (content ? strlen(content) : 0) + (reasoning ? strlen(reasoning) : 0);
    }
    if (total > co->o.max_prompt_bytes)
        BAD("%s: %zu bytes of content, more than the %u byte cap", N(RN_MESSAGES), total,
            co->o.max_prompt_bytes);
    return 0;
}

/* ---- JSON Schema, structurally ---------------------------------------------------
 * No JSON Schema validator library is packaged for C, so a tool's parameters are held to
 * the meta-schema's structural rules (draft 2020-12, with draft-07's array "items",
 * "additionalItems" and "definitions"): every subschema an object or a boolean; "type" a
 * type name or an array of unique ones; the applicators' values schemas, arrays of schemas
 * or objects of schemas as the keyword takes; "required" and "dependentRequired" arrays of
 * unique strings; counts non-negative integers, bounds numbers, "multipleOf" > 0; "pattern"
 * and "patternProperties" keys regular expressions (PCRE2 compiles them); "enum" an array;
 * the annotations strings.  Other keywords are left alone, as JSON Schema does; nesting stops
 * at 32 levels.  sch_check returns NULL or what is wrong, with the JSON pointer in where. */

#define SCH_DEPTH 32

static const char *sch_check(const json_t *sc, char *where, size_t wn, size_t wl, int depth);

/* where[0..wl) + "/key" (JSON pointer escapes of '~' and '/'), the new length */
static size_t sch_push(char *where, size_t wn, size_t wl, const char *key)
{
    size_t o = wl;

    if (o + 1 < wn)
        where[o++] = '/';
    for (; *key && o + 2 < wn; key++) {
        if (*key == '~' || *key == '/') {
            where[o++] = '~';
            where[o++] = *key == '~' ? '0' : '1';
        } else {
            where[o++] = *key;
        }
    }
    where[o] = '\0';
    return o;
}

static bool sch_type_name(const json_t *t)
{
    static const char *const names[] = { "null", "boolean", "object", "array", "number", "string", "integer" };
    const char *v = json_string_value(t);

    for (size_t i = 0; v && i < sizeof(names) / sizeof(names[0]); i++)
        if (!strcmp(v, names[i]))
            return true;
    return false;
}

static bool sch_unique_strings(const json_t *a)
{
    size_t i, j;
    json_t *x;

    if (!json_is_array(a))
        return false;
    json_array_foreach(a, i, x) {
        if (!json_is_string(x))
            return false;
        for (j = 0; j < i; j++)
            if (json_equal(x, json_array_get(a, j)))
                return false;
    }
    return true;
}

static bool sch_regex_ok(const char *re)
{
    int err;
    PCRE2_SIZE off;
    pcre2_code *c = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_UTF, &err, &off, NULL);

    pcre2_code_free(c);
    return c != NULL;
}

static bool sch_in(const char *k, const char *const *list, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(k, list[i]))
            return true;
    return false;
}

static const char *sch_keyword(const char *k, const json_t *v, char *where, size_t wn, size_t wl, int depth)
{
    static const char *const one[] = { "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                                       "contains", "propertyNames", "not", "if", "then", "else",
                                       "additionalItems", "contentSchema" };
    static const char *const many[] = { "allOf", "anyOf", "oneOf", "prefixItems" };
    static const char *const named[] = { "properties", "patternProperties", "$defs", "definitions",
                                         "dependentSchemas" };
    static const char *const counts[] = { "minLength", "maxLength", "minItems", "maxItems", "minProperties",
                                          "maxProperties", "minContains", "maxContains" };
    static const char *const bounds[] = { "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" };
    static const char *const strs[] = { "title", "description", "$comment", "format", "$id", "$schema", "$ref",
                                        "$anchor", "$dynamicRef", "$dynamicAnchor", "contentEncoding",
                                        "contentMediaType" };
#define IN(list) sch_in(k, list, sizeof(list) / sizeof(list[0]))
    size_t i, l = sch_push(where, wn, wl, k);
    const char *key, *e;
    json_t *x;

    if (!strcmp(k, "type")) {
        if (sch_type_name(v))
            return NULL;
        if (!sch_unique_strings(v) || !json_array_size(v))
            return "must be a type name (null, boolean, object, array, number, string, integer) or an array "
                   "of unique ones";
        json_array_foreach(v, i, x)
            if (!sch_type_name(x))
                return "must be a type name (null, boolean, object, array, number, string, integer) or an "
                       "array of unique ones";
        return NULL;
    }
    if (!strcmp(k, "items"))        /* a schema, or (draft-07) an array of schemas */
        k = json_is_array(v) ? "allOf" : "not";
    if (IN(one))
        return sch_check(v, where, wn, l, depth + 1);
    if (IN(many)) {
        if (!json_is_array(v) || !json_array_size(v))
            return "must be a non-empty array of schemas";
        json_array_foreach(v, i, x) {
            char idx[24];

            snprintf(idx, sizeof(idx), "%zu", i);
            if ((e = sch_check(x, where, wn, sch_push(where, wn, l, idx), depth + 1)))
                return e;
        }
        return NULL;
    }
    if (IN(named)) {
        if (!json_is_object(v))
            return "must be an object of schemas";
        json_object_foreach((json_t *)v, key, x) {
            if (!strcmp(k, "patternProperties") && !sch_regex_ok(key)) {
                sch_push(where, wn, l, key);
                return "is not a regular expression";
            }
            if ((e = sch_check(x, where, wn, sch_push(where, wn, l, key), depth + 1)))
                return e;
        }
        return NULL;
    }
    if (!strcmp(k, "required"))
        return sch_unique_strings(v) ? NULL : "must be an array of unique strings";
    if (!strcmp(k, "dependentRequired")) {
        if (!json_is_object(v))
            return "must be an object of arrays of unique strings";
        json_object_foreach((json_t *)v, key, x)
            if (!sch_unique_strings(x)) {
                sch_push(where, wn, l, key);
                return "must be an array of unique strings";
            }
        return NULL;
    }
    if (IN(counts))
        return json_is_integer(v) && json_integer_value(v) >= 0 ? NULL : "must be a non-negative integer";
    if (IN(bounds))
        return json_is_number(v) ? NULL : "must be a number";
    if (!strcmp(k, "multipleOf"))
        return json_is_number(v) && json_number_value(v) > 0 ? NULL : "must be a number greater than 0";
    if (!strcmp(k, "pattern"))
        return !json_is_string(v) ? "must be a string" : sch_regex_ok(json_string_value(v)) ? NULL
               : "is not a regular expression";
    if (!strcmp(k, "enum") || !strcmp(k, "examples"))
        return json_is_array(v) ? NULL : "must be an array";
    if (!strcmp(k, "uniqueItems") || !strcmp(k, "readOnly") || !strcmp(k, "writeOnly") ||
        !strcmp(k, "deprecated"))
        return json_is_boolean(v) ? NULL : "must be true or false";
    if (IN(strs))
        return json_is_string(v) ? NULL : "must be a string";
    where[wl] = '\0';
    return NULL;    /* another keyword: an annotation JSON Schema ignores */
#undef IN
}

static const char *sch_check(const json_t *sc, char *where, size_t wn, size_t wl, int depth)
{
    const char *k, *e;
    json_t *v;

    if (depth > SCH_DEPTH)
        return "nests deeper than 32 schemas";
    if (json_is_boolean(sc))
        return NULL;
    if (!json_is_object(sc))
        return "must be a schema (an object or a boolean)";
    json_object_foreach((json_t *)sc, k, v)
        if ((e = sch_keyword(k, v, where, wn, wl, depth)))
            return e;
    where[wl] = '\0';
    return NULL;
}

/* OpenAI-style tool definitions: [{type: "function", function: {name, description?,
 * parameters?}}]; names as OpenAI allows them, and unique; parameters a JSON Schema
 * object (sch_check). */
static int validate_tools(const struct request *in, char *msg, size_t len)
{
    size_t i;
    json_t *t;

    if (!in->tools)
        return 0;
    if (!json_is_array(in->tools))
        BAD("%s: must be a JSON array of tool definitions", N(RN_TOOLS));
    if (json_array_size(in->tools) > 1024)
        BAD("%s: at most 1024 tools (got %zu)", N(RN_TOOLS), json_array_size(in->tools));
    json_array_foreach(in->tools, i, t) {
        const json_t *fn = json_object_get(t, "function");
        const char *type = str_of(t, "type"), *name = json_is_object(fn) ? str_of(fn, "name") : NULL;
        const json_t *params = json_is_object(fn) ? json_object_get(fn, "parameters") : NULL;
        const json_t *desc = json_is_object(fn) ? json_object_get(fn, "description") : NULL;

        if (!json_is_object(t) || !type || strcmp(type, "function") || !json_is_object(fn))
            BAD("%s[%zu]: must be {\"type\": \"function\", \"function\": {...}}", N(RN_TOOLS), i);
        if (!name || !fn_name_valid(name))
            BAD("%s[%zu].function.name: must be 1 to 64 letters, digits, '_', '-' or '.'",
                N(RN_TOOLS), i);
        if (params && !json_is_null(params) && !json_is_object(params))
            BAD("%s[%zu].function.parameters: must be a JSON Schema object", N(RN_TOOLS), i);
        if (params && json_is_object(params)) {
            char where[256] = "";
            const char *e = sch_check(params, where, sizeof(where), 0, 0);

            if (e)
                BAD("%s[%zu].function.parameters: not a valid JSON Schema: %s %s (tool \"%s\")", N(RN_TOOLS), i,
                    where[0] ? where : "the schema", e, name);
        }
        if (desc && !json_is_null(desc) && !json_is_string(desc))
            BAD("%s[%zu].function.description: must be a string", N(RN_TOOLS), i);
        for (size_t j = 0; j < i; j++) {
            const json_t *o = json_object_get(json_array_get(in->tools, j), "function");

            if (strcmp(str_of(o, "name"), name) == 0)
                BAD("%s[%zu].function.name: \"%s\" is defined twice", N(RN_TOOLS), i, name);
        }
    }
    return 0;
}

int request_validate_chat(const struct coord *co, const struct request *in, char *msg, size_t len)
{
    if (validate_messages(co, in, msg, len) < 0 || validate_tools(in, msg, len) < 0)
        return -EINVAL;
    if (in->chat_template_kwargs && !json_is_object(in->chat_template_kwargs))
        BAD("%s: must be a JSON object", N(RN_CHAT_TEMPLATE_KWARGS));
    if (in->reasoning_effort && strcmp(in->reasoning_effort, "low") &&
        strcmp(in->reasoning_effort, "medium") && strcmp(in->reasoning_effort, "high"))
        BAD("%s: must be low, medium or high (got \"%.32s\")", N(RN_REASONING_EFFORT),
            in->reasoning_effort);
    return 0;
}

/* The model asked for: one of the served names (--served-model-name aliases) or the
 * model's own name. */
static bool model_served(const struct coord *co, const char *model)
{
    if (!model[0])
        return true;
    if (co->model.known && strcmp(model, co->model.name) == 0)
        return true;
    for (size_t i = 0; i < co->o.n_model_aliases; i++)
        if (strcmp(model, co->o.model_aliases[i]) == 0)
            return true;
    return co->o.model_name && strcmp(model, co->o.model_name) == 0;
}

int request_validate(const struct coord *co, const struct request *in, char *msg, size_t len)
{
    uint32_t vocab = coord_vocab_size(co);
    uint32_t ctx = coord_max_model_len(co);

    if (!id_valid(in->id))
        BAD("%s: at most 128 printable ASCII characters without spaces", N(RN_REQUEST_ID));
    if (co->model.known && !model_served(co, in->model))
        BAD("%s: \"%.64s\" is not served here (serving \"%s\")", N(RN_MODEL), in->model,
            co->o.model_name ? co->o.model_name : co->model.name);
    switch (in->input) {
    case REQUEST_INPUT_TEXT:
        if (blank(in->text))
            BAD("%s: prompt is empty", N(RN_TEXT));
        if (strlen(in->text) > co->o.max_prompt_bytes)
            BAD("%s: %zu bytes, more than the %u byte cap", N(RN_TEXT), strlen(in->text),
                co->o.max_prompt_bytes);
        break;
    case REQUEST_INPUT_CHAT:
        if (request_validate_chat(co, in, msg, len) < 0)
            return -EINVAL;
        break;
    case REQUEST_INPUT_TOKENS: {
        uint32_t max_in = co->o.max_input_tokens ? co->o.max_input_tokens : ctx > 1 ? ctx - 1 : 0;

        if (in->n_token_ids == 0)
            BAD("%s: prompt is empty", N(RN_TOKEN_IDS));
        if (max_in && in->n_token_ids > max_in)
            BAD("%s: %zu tokens, more than max_input_tokens %u", N(RN_TOKEN_IDS), in->n_token_ids,
                max_in);
        for (size_t i = 0; i < in->n_token_ids; i++)
            if (in->token_ids[i] < 0 || (vocab && (uint32_t)in->token_ids[i] >= vocab))
                BAD("%s[%zu]: %d is outside the vocabulary [0, %u)", N(RN_TOKEN_IDS), i,
                    in->token_ids[i], vocab);
        break;
    }
    default:
        BAD("%s is required", N(RN_INPUT));
    }
    if (validate_sampling(co, in, vocab, msg, len) < 0)
        return -EINVAL;
    if (strlen(in->cache_salt) > 1024)
        BAD("%s: at most 1024 bytes (got %zu)", N(RN_CACHE_SALT), strlen(in->cache_salt));
    if (in->has_num_speculative_tokens &&
        (in->num_speculative_tokens < 0 || in->num_speculative_tokens > 3))
        BAD("%s: must be in [0, 3] (got %d)", N(RN_NUM_SPECULATIVE_TOKENS),
            in->num_speculative_tokens);
    if (in->input == REQUEST_INPUT_TOKENS && ctx) {
        int64_t mt = REQUEST_HAS(&in->sp, RO_MAX_TOKENS) ? in->sp.max_tokens : 1;

        if ((int64_t)in->n_token_ids + mt > (int64_t)ctx)
            BAD("%s: prompt (%zu tokens) + max_tokens (%" PRId64 ") exceeds the context length %u",
                N(RN_MAX_TOKENS), in->n_token_ids, mt, ctx);
    }
    return 0;
}
