/* structured.c - structured output at the doors (docs/OPERATIONS.md §14): each door's fields
 * become one constraint on the request (request.so_kind/so_text, the field named in
 * so_field), which the coordinator compiles with the grammar engine (common/grammar.h) before
 * any work: an invalid schema, regex or grammar is refused (400 / INVALID_ARGUMENT) naming
 * the field with the engine's message.  The engine of the worker group draws every output
 * token under it (worker/engine/spec.c); with the reasoning parser the constraint starts
 * after </think>.
 *
 * Fields: OpenAI response_format {"type": "json_object"} and {"type": "json_schema",
 * "json_schema": {"schema": ..., "strict": ...}}; vLLM structured_outputs {json, regex,
 * choice, grammar, json_object} and the older guided_json, guided_regex, guided_choice,
 * guided_grammar; the gRPC door's GenerateRequest.structured_output.  Choice is served as a
 * regex of the escaped alternatives; grammar is llguidance's Lark dialect.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "grammar.h"
#include "log.h"
#include "pb-util.h"
#include "sha256.h"
#include "strbuf.h"

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

int request_set_structured(struct request *in, const char *field, const char *kind,
                           const char *text, char *msg, size_t len)
{
    if (in->so_kind)
        BAD("%s: one structured-output constraint per request (%s is set too)", field,
            in->so_field);
    free(in->so_text);
    in->so_kind = kind;
    in->so_field = field;
    if (!(in->so_text = strdup(text ? text : "")))
        BAD("out of memory");
    return 0;
}

/* A regex matching exactly one of the strings (a JSON array of strings, non-empty). */
static int choice_regex(const json_t *arr, const char *field, struct strbuf *sb, char *msg, size_t len)
{
    size_t i;
    const json_t *v;

    if (!json_is_array(arr) || json_array_size(arr) == 0)
        BAD("%s: must be a non-empty array of strings", field);
    strbuf_adds(sb, "(?:");
    json_array_foreach(arr, i, v) {
        if (!json_is_string(v))
            BAD("%s[%zu]: must be a string", field, i);
        if (i)
            strbuf_adds(sb, "|");
        for (const char *p = json_string_value(v); *p; p++) {
            if (strchr("\\.+*?()|[]{}^$#&-~", *p))
                strbuf_add(sb, "\\", 1);
            strbuf_add(sb, p, 1);
        }
    }
    strbuf_adds(sb, ")");
    return 0;
}

/* A schema given as a JSON object or as its text. */
static int set_schema(struct request *in, const char *field, const json_t *v, char *msg, size_t len)
{
    char *text;
    int r;

    if (json_is_string(v))
        return request_set_structured(in, field, "json_schema", json_string_value(v), msg, len);
    if (!json_is_object(v) && !json_is_boolean(v))
        BAD("%s: must be a JSON schema (an object)", field);
    if (!(text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY)))
        BAD("out of memory");
    r = request_set_structured(in, field, "json_schema", text, msg, len);
    free(text);
    return r;
}

static int set_string(struct request *in, const char *field, const char *kind, const json_t *v,
                      char *msg, size_t len)
{
    if (!json_is_string(v))
        BAD("%s: must be a string", field);
    return request_set_structured(in, field, kind, json_string_value(v), msg, len);
}

static int set_choice(struct request *in, const char *field, const json_t *v, char *msg, size_t len)
{
    struct strbuf sb = STRBUF_INIT;
    int r = choice_regex(v, field, &sb, msg, len);

    if (r == 0)
        r = request_set_structured(in, field, "regex", strbuf_str(&sb), msg, len);
    strbuf_done(&sb);
    return r;
}

/* One vLLM-style set of keys (json, regex, choice, grammar, json_object): key[i] in obj,
 * named field[i] in messages; key[4] may be NULL. */
static int vllm_keys(const json_t *obj, struct request *in, const char *const key[5],
                     const char *const field[5], char *msg, size_t len)
{
    const json_t *v;
    int r = 0;

    for (int i = 0; i < 5 && r == 0; i++) {
        if (!key[i] || !(v = json_object_get(obj, key[i])) || json_is_null(v))
            continue;
        switch (i) {
        case 0: r = set_schema(in, field[i], v, msg, len); break;
        case 1: r = set_string(in, field[i], "regex", v, msg, len); break;
        case 2: r = set_choice(in, field[i], v, msg, len); break;
        case 3: r = set_string(in, field[i], "lark", v, msg, len); break;
        default:
            if (!json_is_boolean(v))
                BAD("%s: must be true or false", field[i]);
            if (json_is_true(v))
                r = request_set_structured(in, field[i], "json_object", "", msg, len);
        }
    }
    return r;
}

int door_structured_openai(const json_t *body, struct request *in, char *msg, size_t len)
{
    static const char *const so_keys[5] = { "json", "regex", "choice", "grammar", "json_object" };
    static const char *const so_names[5] = {
        "structured_outputs.json", "structured_outputs.regex", "structured_outputs.choice",
        "structured_outputs.grammar", "structured_outputs.json_object",
    };
    static const char *const guided[5] = {
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", NULL,
    };
    const json_t *j, *v;
    int r;

    if ((j = json_object_get(body, "response_format")) && !json_is_null(j)) {
        const json_t *t = json_object_get(j, "type");
        const char *type = json_string_value(t);

        if (!json_is_object(j) || !type)
            BAD("response_format: must be an object with a \"type\"");
        if (!strcmp(type, "json_object")) {
            if ((r = request_set_structured(in, "response_format", "json_object", "", msg, len)) < 0)
                return r;
        } else if (!strcmp(type, "json_schema")) {
            const json_t *js = json_object_get(j, "json_schema");
            if (!json_is_object(js))
                BAD("response_format.json_schema: must be an object with a \"schema\"");
            v = json_object_get(js, "schema");
            if (!v || json_is_null(v))
                BAD("response_format.json_schema.schema: required");
            if ((v = json_object_get(js, "strict")) && !json_is_null(v) && !json_is_boolean(v))
                BAD("response_format.json_schema.strict: must be true or false");
            /* strict or not, the reply follows the schema: the grammar engine enforces it */
            if ((r = set_schema(in, "response_format.json_schema.schema", json_object_get(js, "schema"),
                                msg, len)) < 0)
                return r;
        } else if (strcmp(type, "text")) {
            BAD("response_format.type: must be \"text\", \"json_object\" or \"json_schema\" "
                "(got \"%.32s\")", type);
        }
    }
    if ((j = json_object_get(body, "structured_outputs")) && !json_is_null(j)) {
        if (!json_is_object(j))
            BAD("structured_outputs: must be an object");
        const char *k;
        json_object_foreach((json_t *) j, k, v) {
            if (strcmp(k, "json") && strcmp(k, "regex") && strcmp(k, "choice") &&
                strcmp(k, "grammar") && strcmp(k, "json_object") && !json_is_null(v))
                BAD("structured_outputs.%.64s: not supported (json, regex, choice, grammar and "
                    "json_object are)", k);
        }
        if ((r = vllm_keys(j, in, so_keys, so_names, msg, len)) < 0)
            return r;
    }
    if ((r = vllm_keys(body, in, guided, guided, msg, len)) < 0)
        return r;
    if ((v = json_object_get(body, "guided_decoding_backend")) && !json_is_null(v)) {
        const char *b = json_string_value(v);
        if (!b || (strcmp(b, "auto") && strcmp(b, "guidance") && strcmp(b, "llguidance")))
            BAD("guided_decoding_backend: only \"guidance\" (llguidance) is served");
    }
    if ((v = json_object_get(body, "guided_whitespace_pattern")) && !json_is_null(v))
        BAD("guided_whitespace_pattern: not supported (JSON output is compact)");
    return 0;
}

/* The coordinator's vocabulary for checking constraints, built at the first one. */
static int vocab_get(struct coord *co, const struct grammar_vocab **ret, char *msg, size_t len)
{
    struct err_buf eb;
    int32_t eos[COORD_MAX_EOS];
    int n_eos = 0, r;

    if (co->gv) {
        *ret = co->gv;
        return 0;
    }
    if (!co->o.tokenizer_path || !co->o.tokenizer_path[0])
        BAD("structured output needs the tokenizer (--tokenizer)");
    for (size_t i = 0; i < co->model.n_eos && i < 9; i++)
        eos[n_eos++] = co->model.eos[i];
    if (!n_eos) {
        int32_t id = tok_added_id(co->tok, "<|im_end|>");
        eos[n_eos++] = id >= 0 ? id : 0;
    }
    uint32_t vocab = coord_vocab_size(co);
    if (!vocab)
        vocab = (uint32_t) tok_vocab_size(co->tok);
    r = grammar_vocab_new(co->o.tokenizer_path, (int) vocab, eos, n_eos, &co->gv, &eb);
    if (r < 0) {
        snprintf(msg, len, "%s", eb.msg);
        return r;
    }
    log_info("structured output: grammar vocabulary of %u ids from %s", vocab, co->o.tokenizer_path);
    *ret = co->gv;
    return 0;
}

/* Compiling runs on the loop (about 1 ms for a schema, 43 ms for a 55 KB one: PERFORMANCE.md
 * §11), so the digests of the last 64 constraints that compiled are kept: agents send the same
 * schema again and again, and a known one is not compiled twice. */
int coord_structured_check(struct coord *co, const struct request *in, char *msg, size_t len)
{
    const struct grammar_vocab *gv;
    struct err_buf eb;
    struct sha256 h;
    uint8_t d[SHA256_BYTES];
    unsigned n = co->so_ok_n < 64 ? co->so_ok_n : 64;
    int r;

    if (!in->so_kind)
        return 0;
    co->m.so_requests++;
    if ((r = vocab_get(co, &gv, msg, len)) < 0)
        return r == -ENOENT || r == -ENOEXEC ? -EOPNOTSUPP : -EINVAL;
    sha256_init(&h);
    sha256_update(&h, in->so_kind, strlen(in->so_kind) + 1);
    sha256_update(&h, in->so_text, strlen(in->so_text));
    sha256_final(&h, d);
    for (unsigned i = 0; i < n; i++)
        if (!memcmp(co->so_ok[i], d, sizeof(d)))
            return 0;
    co->m.so_compiles++;
    if (grammar_check(gv, in->so_kind, in->so_text, &eb) < 0)
        BAD("%s: %s", in->so_field, eb.msg);
    memcpy(co->so_ok[co->so_ok_n++ % 64], d, sizeof(d));
    return 0;
}

int request_structured_from_proto(const Stepd__V1__StructuredOutput *so, struct request *in,
                                  char *msg, size_t len)
{
    static const char field[] = "structured_output.text";
    const char *k = so ? so->kind : NULL, *text = so && so->text ? so->text : "";

    if (!k || !k[0])
        return 0;
    if (PB_HAS(so, start_token))
        BAD("structured_output.start_token: set by the coordinator only");
    if (!strcmp(k, "json_schema"))
        return request_set_structured(in, field, "json_schema", text, msg, len);
    if (!strcmp(k, "json_object"))
        return request_set_structured(in, field, "json_object", "", msg, len);
    if (!strcmp(k, "regex"))
        return request_set_structured(in, field, "regex", text, msg, len);
    if (!strcmp(k, "grammar"))
        return request_set_structured(in, field, "lark", text, msg, len);
    if (!strcmp(k, "choice")) {
        json_error_t je;
        json_t *arr = json_loads(text, JSON_DECODE_ANY, &je);
        int r;
        if (!arr)
            BAD("%s: choice needs a JSON array of strings (%s)", field, je.text);
        r = set_choice(in, field, arr, msg, len);
        json_decref(arr);
        return r;
    }
    BAD("structured_output.kind: \"%.32s\" is not one of json_schema, json_object, regex, "
        "choice, grammar", k);
}

/* --- tool calls ------------------------------------------------------------------------------ */

/* A Lark string literal of s (JSON's escapes, which the dialect reads). */
static void lark_lit(struct strbuf *g, const char *s)
{
    json_t *j = json_string(s);
    char *t = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    strbuf_adds(g, t ? t : "\"\"");
    free(t);
    json_decref(j);
}

/* The value of one parameter as the chat template writes it (daemon/chat.c, MODEL.md §7): a
 * string raw, on one line without '<' (enum: one of its strings), anything else as JSON
 * following the property's schema. */
static int lark_value(struct strbuf *g, const json_t *prop)
{
    const char *type = json_string_value(json_object_get(prop, "type"));
    const json_t *en = json_object_get(prop, "enum");
    bool all_str = json_is_array(en) && json_array_size(en) > 0;
    size_t i;
    const json_t *v;

    json_array_foreach(en, i, v)
        all_str &= json_is_string(v) && strcmp(json_string_value(v), "null") != 0;
    if (all_str) {
        strbuf_adds(g, "(");
        json_array_foreach(en, i, v) {
            if (i)
                strbuf_adds(g, " | ");
            lark_lit(g, json_string_value(v));
        }
        strbuf_adds(g, ")");
        return 0;
    }
    if (type && !strcmp(type, "string") && !en) {
        strbuf_adds(g, "/[^<\\n]{1,200}/");
        return 0;
    }
    /* compact JSON, as for response_format (common/grammar.c); lenient: a keyword the grammar
     * engine cannot enforce (uniqueItems, ...) is left unenforced rather than refusing a
     * valid tool declaration (validate.c checks the schema itself; OPERATIONS.md §14) */
    json_t *cp = json_is_object(prop) ? json_deep_copy(prop) : json_object();
    if (cp && !json_object_get(cp, "x-guidance"))
        json_object_set_new(cp, "x-guidance", json_pack("{s:b,s:b}", "whitespace_flexible", 0, "lenient", 1));
    char *schema = cp ? json_dumps(cp, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    json_decref(cp);
    if (!schema)
        return -ENOMEM;
    strbuf_printf(g, "%%json %s", schema);
    free(schema);
    return 0;
}

/* Rule fI_args: the parameters of tools[i] and the end of the call (</tool_call>: the token
 * end_id, or its text when the tokenizer has none): each property in order, required ones
 * once, the others at most once. */
static int lark_function(struct strbuf *g, size_t fi, const json_t *fn, int32_t end_id, char *msg,
                         size_t len)
{
    const json_t *params = json_object_get(fn, "parameters");
    const json_t *props = json_object_get(params, "properties");
    const json_t *req = json_object_get(params, "required");
    const char *k;
    json_t *prop;
    size_t pi = 0;

    strbuf_printf(g, "f%zu_args:", fi);
    json_object_foreach((json_t *) props, k, prop) {
        bool required = false;
        size_t j;
        const json_t *r;
        json_array_foreach(req, j, r)
            required |= json_is_string(r) && !strcmp(json_string_value(r), k);
        strbuf_printf(g, " f%zu_p%zu%s", fi, pi++, required ? "" : "?");
    }
    strbuf_adds(g, " \"</function>\\n\" ");
    if (end_id >= 0)
        strbuf_printf(g, "<[%d]>\n", end_id);    /* the special token the model emits */
    else
        strbuf_adds(g, "\"</tool_call>\"\n");
    pi = 0;
    json_object_foreach((json_t *) props, k, prop) {
        char head[300];
        if (strlen(k) > 200 || strpbrk(k, "<>\n"))
            BAD("tools[%zu].function.parameters.properties: \"%.64s\" cannot be a parameter name", fi, k);
        snprintf(head, sizeof(head), "<parameter=%s>\n", k);
        strbuf_printf(g, "f%zu_p%zu: ", fi, pi++);
        lark_lit(g, head);
        strbuf_adds(g, " ");
        if (lark_value(g, prop) < 0)
            BAD("out of memory");
        strbuf_adds(g, " \"\\n</parameter>\\n\"\n");
    }
    return 0;
}

int door_tool_constraint(struct request *in, int32_t call_id, int32_t end_id, char *msg, size_t len)
{
    struct strbuf g = STRBUF_INIT;
    size_t i, n = 0;
    const json_t *t;
    bool forced = in->tool_choice == REQUEST_TOOLS_REQUIRED || in->tool_choice == REQUEST_TOOLS_NAMED;
    int r = 0;

    if (in->input != REQUEST_INPUT_CHAT || !json_is_array(in->tools) || !json_array_size(in->tools))
        return 0;
    if (!forced && (in->tool_choice != REQUEST_TOOLS_AUTO || in->so_kind || call_id < 0))
        return 0;           /* auto beside another constraint: the calls stay free */
    if (in->so_kind)
        BAD("%s: a required tool call cannot also follow %s", in->names[RN_TOOL_CHOICE], in->so_field);
    /* required/named: the prompt ends with "<tool_call>\n<function=" or with the named
     * function's opening tag (chat.c), and what follows is the name and the arguments; auto:
     * the text is free until the model emits <tool_call> (call_id), then each call is
     * constrained, and only another call or the end may follow one */
    if (forced)
        strbuf_adds(&g, "start:");
    else
        strbuf_printf(&g, "start: call (<[%d]> call)*\ncall: \"\\n<function=\" (", call_id);
    json_array_foreach(in->tools, i, t) {
        const json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn ? fn : t, "name"));
        if (!name)
            continue;
        if (in->tool_choice == REQUEST_TOOLS_NAMED && strcmp(name, in->tool_choice_name))
            continue;
        strbuf_adds(&g, n++ ? " | " : " ");
        if (in->tool_choice != REQUEST_TOOLS_NAMED) {
            char head[300];
            snprintf(head, sizeof(head), "%.256s>\n", name);
            lark_lit(&g, head);
            strbuf_adds(&g, " ");
        }
        strbuf_printf(&g, "f%zu_args", i);
    }
    strbuf_adds(&g, forced ? "\n" : " )\n");
    json_array_foreach(in->tools, i, t) {
        const json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn ? fn : t, "name"));
        if (!name || (in->tool_choice == REQUEST_TOOLS_NAMED && strcmp(name, in->tool_choice_name)))
            continue;
        if ((r = lark_function(&g, i, fn ? fn : t, end_id, msg, len)) < 0)
            break;
    }
    if (r == 0 && n == 0)
        r = -EINVAL, snprintf(msg, len, "%s: no function to call", in->names[RN_TOOL_CHOICE]);
    if (r == 0)
        r = request_set_structured(in, in->names[RN_TOOLS], "lark", strbuf_str(&g), msg, len);
    if (r == 0)
        in->so_start = forced ? -1 : call_id;
    strbuf_done(&g);
    return r;
}
