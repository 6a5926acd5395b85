/* parser.c - streaming step3p5 reasoning and tool-call parser (see parser.h).
 *
 * All input is appended to one pending buffer; run() consumes from its front as far as the
 * text is certain and returns to wait for more otherwise.  "Certain" means: no tag can start
 * in the emitted part (a suffix that is a proper prefix of a tag is held), a newline that may
 * precede </think> is held, and a tool-call element is only acted on once it is complete.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"
#include "parser.h"

static const char TAG_THINK_OPEN[] = "<think>";
static const char TAG_THINK_CLOSE[] = "</think>";
static const char TAG_CALL_OPEN[] = "<tool_call>";
static const char TAG_CALL_CLOSE[] = "</tool_call>";
static const char TAG_FUNC_OPEN[] = "<function=";
static const char TAG_FUNC_CLOSE[] = "</function>";
static const char TAG_PARAM_OPEN[] = "<parameter=";
static const char TAG_PARAM_CLOSE[] = "</parameter>";

#define LEN(tag) (sizeof(tag) - 1)
#define NAME_MAX_LEN 256

enum pstate {
    P_REASONING,
    P_CONTENT,
    P_TOOL_OPEN,        /* after <tool_call>, waiting for <function=NAME> */
    P_TOOL_BODY,        /* parameters until </function> */
    P_TOOL_CLOSE,       /* after </function>, waiting for </tool_call> */
};

struct tok_parser {
    struct tok_parser_opts o;
    enum pstate st;
    struct tok_buf buf;         /* pending input; buf.p[pos..n) not consumed */
    size_t pos;
    bool at_start;              /* a leading <think> is still possible */
    bool drop_nl;               /* drop one leading newline of what follows */
    bool implicit_close;        /* reasoning ended by <tool_call>: drop one later </think> */
    bool after_tool;            /* whitespace after a call is not content */
    bool think_closed;
    bool reasoning_ended;
    bool open_from_tag;         /* P_TOOL_OPEN entered through a <tool_call> tag */
    bool args_closed;
    size_t value_scanned;       /* bytes of a pending parameter value already searched */
    int n_calls;                /* completed or current call index */
    int n_args;
    char fname[NAME_MAX_LEN + 1];
};

int tok_parser_new(const struct tok_parser_opts *o, struct tok_parser **ret)
{
    struct tok_parser *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->o = *o;
    p->st = o->reasoning ? P_REASONING : P_CONTENT;
    p->at_start = o->reasoning;
    *ret = p;
    return 0;
}

void tok_parser_free(struct tok_parser *p)
{
    if (!p)
        return;
    tok__buf_done(&p->buf);
    free(p);
}

/* The unparsed input (the buffer is NULL until the first bytes arrive). */
static const char *cur(const struct tok_parser *p)
{
    return p->buf.p ? p->buf.p + p->pos : "";
}

static int emit(struct tok_parser *p, enum tok_ev_kind kind, const char *s, size_t n,
                tok_ev_cb cb, void *ud)
{
    if (!n && (kind == TOK_EV_REASONING || kind == TOK_EV_CONTENT || kind == TOK_EV_TOOL_ARGS))
        return 0;
    struct tok_ev ev = {
        .kind = kind,
        .tool_index = kind >= TOK_EV_TOOL_START ? p->n_calls : -1,
        .text = s,
        .len = n,
    };
    return cb(ud, &ev);
}

static bool has_prefix(const char *s, size_t n, const char *tag, size_t lt)
{
    return n >= lt && memcmp(s, tag, lt) == 0;
}

/* s[0..n) is a proper prefix of tag */
static bool partial(const char *s, size_t n, const char *tag, size_t lt)
{
    return n < lt && memcmp(s, tag, n) == 0;
}

/* Function and parameter names: no tag characters, no control characters. */
static bool name_char(char c)
{
    return c != '>' && c != '<' && (unsigned char) c >= 0x20;
}

static size_t ws_len(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r'))
        i++;
    return i;
}

/* Earliest occurrence of any tag: index into tags or -1; *ret_at its offset.  Without a
 * match, *ret_hold is the longest suffix that is a proper prefix of some tag. */
static int find_tags(const char *s, size_t n, const char *const *tags, size_t nt,
                     size_t *ret_at, size_t *ret_hold)
{
    int best = -1;
    size_t at = n, hold = 0;
    for (size_t t = 0; t < nt && n; t++) {
        const char *hit = memmem(s, n, tags[t], strlen(tags[t]));
        if (hit && (size_t)(hit - s) < at) {
            at = (size_t)(hit - s);
            best = (int) t;
        }
    }
    if (best < 0)
        for (size_t t = 0; t < nt; t++) {
            size_t lt = strlen(tags[t]);
            for (size_t k = (lt - 1 < n ? lt - 1 : n); k > hold; k--)
                if (memcmp(s + n - k, tags[t], k) == 0) {
                    hold = k;
                    break;
                }
        }
    *ret_at = at;
    *ret_hold = hold;
    return best;
}

/* --- schema conversion (vLLM qwen3coder/step3p5 _convert_param_value) ----------------------- */

static const char *param_type(const struct tok_parser *p, const char *param)
{
    const json_t *tools = p->o.tools_json;
    for (size_t i = 0; json_is_array(tools) && i < json_array_size(tools); i++) {
        const json_t *t = json_array_get(tools, i), *fn = json_object_get(t, "function");
        if (fn)
            t = fn;
        const char *name = json_string_value(json_object_get(t, "name"));
        if (!name || strcmp(name, p->fname) != 0)
            continue;
        const json_t *prop = json_object_get(
            json_object_get(json_object_get(t, "parameters"), "properties"), param);
        const json_t *type = json_object_get(prop, "type");
        if (json_is_array(type))        /* ["integer", "null"]: the first non-null type */
            for (size_t k = 0; k < json_array_size(type); k++) {
                const char *ty = json_string_value(json_array_get(type, k));
                if (ty && strcmp(ty, "null") != 0)
                    return ty;
            }
        if (!prop)
            return NULL;
        return json_is_string(type) ? json_string_value(type) : "string";
    }
    return NULL;
}

static bool starts_ci(const char *s, const char *pre)
{
    return strncasecmp(s, pre, strlen(pre)) == 0;
}

/* Append the JSON text of value (n bytes) converted to the schema type. */
static int convert_value(struct tok_parser *p, const char *param, const char *v, size_t n,
                         struct tok_buf *out)
{
    char *tmp = malloc(n + 1), *end;
    const char *type = param_type(p, param);
    int r;

    if (!tmp)
        return -ENOMEM;
    memcpy(tmp, v, n);
    tmp[n] = '\0';
    if (memchr(v, '\0', n))            /* never a number, bool or null */
        goto as_string;
    if (!strcasecmp(tmp, "null")) {
        r = tok__buf_puts(out, "null");
        goto out;
    }
    if (!type || !strcasecmp(type, "string") || !strcasecmp(type, "str") ||
        !strcasecmp(type, "text") || !strcasecmp(type, "varchar") ||
        !strcasecmp(type, "char") || !strcasecmp(type, "enum"))
        goto as_string;
    if (starts_ci(type, "int") || starts_ci(type, "uint") || starts_ci(type, "long") ||
        starts_ci(type, "short") || starts_ci(type, "unsigned")) {
        errno = 0;
        long long x = strtoll(tmp, &end, 10);
        if (end != tmp && !errno && !end[ws_len(end, strlen(end))]) {
            r = tok__buf_printf(out, "%lld", x);
            goto out;
        }
        goto as_string;
    }
    if (starts_ci(type, "num") || starts_ci(type, "float")) {
        double x = strtod(tmp, &end);
        if (end != tmp && !end[ws_len(end, strlen(end))] && isfinite(x)) {
            if (x == floor(x) && fabs(x) < 1e300)
                r = tok__buf_printf(out, "%.0f", x);
            else
                r = tok__py_float(out, x);
            goto out;
        }
        goto as_string;
    }
    if (!strcasecmp(type, "boolean") || !strcasecmp(type, "bool") ||
        !strcasecmp(type, "binary")) {
        r = tok__buf_puts(out, !strcasecmp(tmp, "true") ? "true" : "false");
        goto out;
    }
    if (!strcasecmp(type, "object") || !strcasecmp(type, "array") ||
        !strcasecmp(type, "arr") || starts_ci(type, "dict") || starts_ci(type, "list")) {
        json_t *j = json_loadb(v, n, JSON_DECODE_ANY, NULL);
        if (j) {
            r = tok__py_dump(out, j);
            json_decref(j);
            goto out;
        }
    }
as_string:
    r = tok__py_json_string(out, v, n);
out:
    free(tmp);
    return r;
}

/* --- state machine -------------------------------------------------------------------------- */

static int close_args(struct tok_parser *p, tok_ev_cb cb, void *ud)
{
    if (p->args_closed)
        return 0;
    p->args_closed = true;
    return emit(p, TOK_EV_TOOL_ARGS, p->n_args ? "}" : "{}", p->n_args ? 1 : 2, cb, ud);
}

static int end_call(struct tok_parser *p, tok_ev_cb cb, void *ud)
{
    int r = close_args(p, cb, ud);
    if (r >= 0)
        r = emit(p, TOK_EV_TOOL_END, "", 0, cb, ud);
    p->n_calls++;
    p->st = P_CONTENT;
    p->after_tool = true;
    return r;
}

/* The call header never completed: what was taken as a call is plain content. */
static int not_a_call(struct tok_parser *p, size_t consumed, tok_ev_cb cb, void *ud)
{
    int r = 0;
    if (p->open_from_tag)
        r = emit(p, TOK_EV_CONTENT, TAG_CALL_OPEN, LEN(TAG_CALL_OPEN), cb, ud);
    if (r >= 0)
        r = emit(p, TOK_EV_CONTENT, cur(p), consumed, cb, ud);
    p->pos += consumed;
    p->st = P_CONTENT;
    p->after_tool = false;
    return r < 0 ? r : 1;
}

static void enter_call(struct tok_parser *p, size_t consumed)
{
    p->pos += consumed;
    p->st = P_TOOL_OPEN;
    p->open_from_tag = true;
}

/* Each step returns 1 to continue, 0 to wait for more input, < 0 on error. */
static int step_reasoning(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    const char *s = cur(p);
    size_t n = p->buf.n - p->pos, at, hold;
    const char *tags[2] = { TAG_THINK_CLOSE, TAG_CALL_OPEN };
    int r;

    if (p->at_start) {
        if (!final && partial(s, n, TAG_THINK_OPEN, LEN(TAG_THINK_OPEN)))
            return 0;
        p->at_start = false;
        if (has_prefix(s, n, TAG_THINK_OPEN, LEN(TAG_THINK_OPEN))) {
            p->pos += LEN(TAG_THINK_OPEN);
            return 1;
        }
    }
    int t = find_tags(s, n, tags, p->o.tools ? 2 : 1, &at, &hold);
    if (t >= 0) {
        size_t end = at > 0 && s[at - 1] == '\n' ? at - 1 : at;
        if ((r = emit(p, TOK_EV_REASONING, s, end, cb, ud)) < 0)
            return r;
        if (t == 0) {
            p->pos += at + LEN(TAG_THINK_CLOSE);
            p->st = P_CONTENT;
            p->drop_nl = true;
            p->think_closed = true;
        } else {
            p->implicit_close = true;
            p->think_closed = true;
            enter_call(p, at + LEN(TAG_CALL_OPEN));
        }
        return 1;
    }
    if (final)
        hold = 0;
    else if (n > hold && s[n - hold - 1] == '\n')
        hold++;
    r = emit(p, TOK_EV_REASONING, s, n - hold, cb, ud);
    p->pos += n - hold;
    return r < 0 ? r : 0;
}

static int step_content(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    const char *s = cur(p);
    size_t n = p->buf.n - p->pos, at, hold, nt = 0;
    const char *tags[2];
    int r;

    if (n && p->think_closed)
        p->reasoning_ended = true;
    if (p->drop_nl) {
        if (!n)
            return 0;
        p->drop_nl = false;
        if (s[0] == '\n')
            p->pos++;
        return 1;
    }
    if (p->after_tool) {
        size_t w = ws_len(s, n);
        if (w == n) {
            if (final)
                p->pos += n;                /* trailing whitespace after calls: dropped */
            return 0;
        }
        if (!final && (partial(s + w, n - w, TAG_CALL_OPEN, LEN(TAG_CALL_OPEN)) ||
                       (p->implicit_close &&
                        partial(s + w, n - w, TAG_THINK_CLOSE, LEN(TAG_THINK_CLOSE)))))
            return 0;
        if (has_prefix(s + w, n - w, TAG_CALL_OPEN, LEN(TAG_CALL_OPEN))) {
            enter_call(p, w + LEN(TAG_CALL_OPEN));
            return 1;
        }
        if (p->implicit_close && has_prefix(s + w, n - w, TAG_THINK_CLOSE, LEN(TAG_THINK_CLOSE))) {
            /* the stray </think> after calls made inside the reasoning */
            p->pos += w + LEN(TAG_THINK_CLOSE);
            p->implicit_close = false;
            p->drop_nl = true;
            return 1;
        }
        p->after_tool = false;
    }
    if (p->o.tools)
        tags[nt++] = TAG_CALL_OPEN;
    if (p->implicit_close)
        tags[nt++] = TAG_THINK_CLOSE;
    int t = find_tags(s, n, tags, nt, &at, &hold);
    if (t >= 0) {
        if ((r = emit(p, TOK_EV_CONTENT, s, at, cb, ud)) < 0)
            return r;
        if (tags[t] == TAG_CALL_OPEN) {
            enter_call(p, at + LEN(TAG_CALL_OPEN));
        } else {
            p->pos += at + LEN(TAG_THINK_CLOSE);
            p->implicit_close = false;
            p->drop_nl = true;
        }
        return 1;
    }
    if (final)
        hold = 0;
    r = emit(p, TOK_EV_CONTENT, s, n - hold, cb, ud);
    p->pos += n - hold;
    return r < 0 ? r : 0;
}

static int step_tool_open(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    const char *s = cur(p);
    size_t n = p->buf.n - p->pos, w = ws_len(s, n);
    const char *rest = s + w;
    size_t m = n - w;

    if (!m || partial(rest, m, TAG_FUNC_OPEN, LEN(TAG_FUNC_OPEN)))
        return final ? not_a_call(p, n, cb, ud) : 0;
    if (!has_prefix(rest, m, TAG_FUNC_OPEN, LEN(TAG_FUNC_OPEN)))
        return not_a_call(p, w, cb, ud);
    const char *name = rest + LEN(TAG_FUNC_OPEN);
    size_t avail = m - LEN(TAG_FUNC_OPEN), k = 0;
    while (k < avail && name_char(name[k]) && k <= NAME_MAX_LEN)
        k++;
    if (k == avail && !final && k <= NAME_MAX_LEN)
        return 0;
    if (k == avail || name[k] != '>' || k == 0 || k > NAME_MAX_LEN)
        return not_a_call(p, w, cb, ud);
    memcpy(p->fname, name, k);
    p->fname[k] = '\0';
    p->pos += w + LEN(TAG_FUNC_OPEN) + k + 1;
    p->st = P_TOOL_BODY;
    p->n_args = 0;
    p->args_closed = false;
    int r = emit(p, TOK_EV_TOOL_START, p->fname, k, cb, ud);
    return r < 0 ? r : 1;
}

static int emit_param(struct tok_parser *p, const char *name, size_t ln, const char *v,
                      size_t lv, tok_ev_cb cb, void *ud)
{
    struct tok_buf b = {0};
    char pname[NAME_MAX_LEN + 1];
    int r;

    if (lv && v[0] == '\n')
        v++, lv--;
    if (lv && v[lv - 1] == '\n')
        lv--;
    memcpy(pname, name, ln);
    pname[ln] = '\0';
    r = tok__buf_puts(&b, p->n_args ? ", " : "{");
    if (r >= 0)
        r = tok__py_json_string(&b, pname, ln);
    if (r >= 0)
        r = tok__buf_puts(&b, ": ");
    if (r >= 0)
        r = convert_value(p, pname, v, lv, &b);
    if (r >= 0)
        r = emit(p, TOK_EV_TOOL_ARGS, b.p, b.n, cb, ud);
    p->n_args++;
    tok__buf_done(&b);
    return r;
}

static int step_tool_body(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    const char *s = cur(p);
    size_t n = p->buf.n - p->pos, w = ws_len(s, n), m = n - w, at, hold;
    const char *rest = s + w;
    const char *ends[3] = { TAG_PARAM_CLOSE, TAG_PARAM_OPEN, TAG_FUNC_CLOSE };
    int r;

    if (has_prefix(rest, m, TAG_FUNC_CLOSE, LEN(TAG_FUNC_CLOSE))) {
        p->pos += w + LEN(TAG_FUNC_CLOSE);
        p->st = P_TOOL_CLOSE;
        r = close_args(p, cb, ud);
        return r < 0 ? r : 1;
    }
    if (has_prefix(rest, m, TAG_PARAM_OPEN, LEN(TAG_PARAM_OPEN))) {
        const char *name = rest + LEN(TAG_PARAM_OPEN);
        size_t avail = m - LEN(TAG_PARAM_OPEN), k = 0;
        while (k < avail && name_char(name[k]) && k <= NAME_MAX_LEN)
            k++;
        if (k == avail && !final && k <= NAME_MAX_LEN)
            return 0;
        if (k < avail && name[k] == '>' && k > 0 && k <= NAME_MAX_LEN) {
            const char *v = name + k + 1;
            size_t lv = avail - k - 1;
            /* resume the terminator search where the last one stopped (long values stream in
             * many deltas); back off by the longest terminator so none is missed */
            size_t skip = p->value_scanned > LEN(TAG_PARAM_CLOSE) ?
                          p->value_scanned - LEN(TAG_PARAM_CLOSE) : 0;
            int t = find_tags(v + skip, lv - skip, ends, 3, &at, &hold);
            at += skip;
            if (t < 0 && !final) {
                p->value_scanned = lv;
                return 0;
            }
            p->value_scanned = 0;
            if ((r = emit_param(p, name, k, v, t < 0 ? lv : at, cb, ud)) < 0)
                return r;
            p->pos += (size_t)(v - s) + (t < 0 ? lv : at) + (t == 0 ? LEN(TAG_PARAM_CLOSE) : 0);
            return 1;
        }
        /* a broken parameter tag: junk, handled below */
    } else if (!final && (!m || partial(rest, m, TAG_PARAM_OPEN, LEN(TAG_PARAM_OPEN)) ||
                          partial(rest, m, TAG_FUNC_CLOSE, LEN(TAG_FUNC_CLOSE))))
        return 0;
    /* junk or end of stream inside the call: close it; the rest is content */
    p->pos += w;
    r = end_call(p, cb, ud);
    p->after_tool = false;
    return r < 0 ? r : 1;
}

static int step_tool_close(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    const char *s = cur(p);
    size_t n = p->buf.n - p->pos, w = ws_len(s, n), m = n - w;
    const char *rest = s + w;
    int r;

    if (has_prefix(rest, m, TAG_CALL_CLOSE, LEN(TAG_CALL_CLOSE))) {
        p->pos += w + LEN(TAG_CALL_CLOSE);
        r = end_call(p, cb, ud);
        return r < 0 ? r : 1;
    }
    if (has_prefix(rest, m, TAG_FUNC_OPEN, LEN(TAG_FUNC_OPEN))) {
        /* a second <function=...> inside the same <tool_call>: a new call */
        p->pos += w;
        r = end_call(p, cb, ud);
        p->st = P_TOOL_OPEN;
        p->open_from_tag = false;
        return r < 0 ? r : 1;
    }
    if (!final && (!m || partial(rest, m, TAG_CALL_CLOSE, LEN(TAG_CALL_CLOSE)) ||
                   partial(rest, m, TAG_FUNC_OPEN, LEN(TAG_FUNC_OPEN))))
        return 0;
    p->pos += w;
    r = end_call(p, cb, ud);
    if (m)
        p->after_tool = false;
    return r < 0 ? r : 1;
}

static int run(struct tok_parser *p, bool final, tok_ev_cb cb, void *ud)
{
    int r;
    do {
        switch (p->st) {
        case P_REASONING:
            r = step_reasoning(p, final, cb, ud);
            break;
        case P_CONTENT:
            r = step_content(p, final, cb, ud);
            break;
        case P_TOOL_OPEN:
            r = step_tool_open(p, final, cb, ud);
            break;
        case P_TOOL_BODY:
            r = step_tool_body(p, final, cb, ud);
            break;
        default:
            r = step_tool_close(p, final, cb, ud);
            break;
        }
    } while (r > 0);
    /* compact the consumed prefix */
    if (p->pos) {
        memmove(p->buf.p, p->buf.p + p->pos, p->buf.n - p->pos);
        p->buf.n -= p->pos;
        p->buf.p[p->buf.n] = '\0';
        p->pos = 0;
    }
    return r;
}

int tok_parser_feed(struct tok_parser *p, const char *text, size_t len, tok_ev_cb cb, void *ud)
{
    int r = tok__buf_put(&p->buf, text, len);
    if (r < 0)
        return r;
    return run(p, false, cb, ud);
}

int tok_parser_finish(struct tok_parser *p, tok_ev_cb cb, void *ud)
{
    int r = run(p, true, cb, ud);
    return r < 0 ? r : 0;
}
