/* test-tok-parser.c - the streaming step3p5 reasoning/tool-call parser on a table of cases.
 *
 * Property: for every case the reasoning, content and tool calls (name + JSON arguments) are
 * the expected ones, and identical whether the text arrives whole, one byte at a time, in
 * 3-byte chunks, or token by token through the tokenizer and streaming detokenizer (special
 * tokens kept).  Every call's concatenated argument deltas parse as JSON, events of one call
 * carry one index, and no held-back text leaks (a split tag never shows up as content).
 *
 * usage: test-tok-parser TOKENIZER.json (the tiny model's; the per-token mode is skipped
 * with a note when the file does not exist)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "harness.h"
#include "parser.h"
#include "tokenizer.h"

static const char tools_json[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": "
    "{\"type\": \"integer\"}, \"metric\": {\"type\": \"boolean\"}}}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"calc\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"x\": {\"type\": \"number\"}, \"y\": {\"type\": \"number\"},"
    " \"op\": {\"type\": \"string\"}}}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"search\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"query\": {\"type\": \"string\"}, \"filters\": {\"type\": "
    "\"object\"}, \"tags\": {\"type\": \"array\"}, \"limit\": {\"type\": [\"integer\", "
    "\"null\"]}}}}},"
    " {\"name\": \"noargs\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}]";

struct pcase {
    const char *name;
    bool reasoning;
    bool tools;
    const char *input;
    const char *want_reasoning;
    const char *want_content;
    const char *want_calls;     /* "name ARGS\n" per call */
};

#define CALL_W "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
               "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"

static const struct pcase cases[] = {
    { "reasoning-then-content", true, true, "Let me think.\n</think>\nThe answer is 4.",
      "Let me think.", "The answer is 4.", "" },
    { "leading-think-tag", true, true, "<think>\nhmm\n</think>\n\nHi", "\nhmm", "\nHi", "" },
    { "no-think-close-all-reasoning", true, true, "still thinking... <tool", "still thinking... <tool",
      "", "" },
    { "reasoning-off", false, true, "plain answer </think> stays", "", "plain answer </think> stays",
      "" },
    { "only-one-newline-dropped", true, false, "a\n\n</think>\n\nb", "a\n", "\nb", "" },
    { "call-after-reasoning", true, true, "check weather\n</think>\n\n" CALL_W, "check weather",
      "\n", "get_weather {\"city\": \"Paris\", \"days\": 3}\n" },
    { "content-then-call", true, true, "r</think>\nSure.\n" CALL_W, "r", "Sure.\n",
      "get_weather {\"city\": \"Paris\", \"days\": 3}\n" },
    { "two-calls-whitespace-dropped", false, true, CALL_W "\n\n" CALL_W "\n", "", "",
      "get_weather {\"city\": \"Paris\", \"days\": 3}\nget_weather {\"city\": \"Paris\", \"days\": 3}\n" },
    { "call-inside-think", true, true, "I should call it.\n" CALL_W "\n</think>\nDone.",
      "I should call it.", "Done.", "get_weather {\"city\": \"Paris\", \"days\": 3}\n" },
    { "malformed-no-function", false, true, "<tool_call>\nnot a function</tool_call> ok", "",
      "<tool_call>\nnot a function</tool_call> ok", "" },
    { "partial-tag-at-end", false, true, "text <tool_ca", "", "text <tool_ca", "" },
    { "open-tag-then-eof", false, true, "x<tool_call>\n", "", "x<tool_call>\n", "" },
    { "bad-function-name", false, true, "<tool_call>\n<function=a\nb>\n</function></tool_call>", "",
      "<tool_call>\n<function=a\nb>\n</function></tool_call>", "" },
    { "truncated-mid-parameter", false, true,
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer", "", "",
      "get_weather {\"city\": \"Ber\"}\n" },
    { "missing-parameter-close", false, true,
      "<tool_call>\n<function=calc>\n<parameter=x>\n1.5\n<parameter=y>\n2\n</function>\n</tool_call>",
      "", "", "calc {\"x\": 1.5, \"y\": 2}\n" },
    { "number-conversions", false, true,
      "<tool_call>\n<function=calc>\n<parameter=x>\n1e3\n</parameter>\n<parameter=y>\n-0.25\n"
      "</parameter>\n<parameter=op>\n7\n</parameter>\n</function>\n</tool_call>", "", "",
      "calc {\"x\": 1000, \"y\": -0.25, \"op\": \"7\"}\n" },
    { "integer-invalid-stays-string", false, true,
      "<tool_call>\n<function=get_weather>\n<parameter=days>\nseven\n</parameter>\n</function>\n"
      "</tool_call>", "", "", "get_weather {\"days\": \"seven\"}\n" },
    { "boolean-conversions", false, true,
      "<tool_call>\n<function=get_weather>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n"
      "</tool_call><tool_call>\n<function=get_weather>\n<parameter=metric>\nyes\n</parameter>\n"
      "</function>\n</tool_call>", "", "",
      "get_weather {\"metric\": true}\nget_weather {\"metric\": false}\n" },
    { "object-and-array", false, true,
      "<tool_call>\n<function=search>\n<parameter=filters>\n{\"lang\": \"en\", \"n\": [1, 2.5]}\n"
      "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>",
      "", "", "search {\"filters\": {\"lang\": \"en\", \"n\": [1, 2.5]}, \"tags\": [\"a\", \"b\"]}\n" },
    { "array-invalid-json-is-string", false, true,
      "<tool_call>\n<function=search>\n<parameter=tags>\n[a, b\n</parameter>\n</function>\n"
      "</tool_call>", "", "", "search {\"tags\": \"[a, b\"}\n" },
    { "null-value", false, true,
      "<tool_call>\n<function=search>\n<parameter=query>\nNULL\n</parameter>\n<parameter=limit>\n"
      "5\n</parameter>\n</function>\n</tool_call>", "", "",
      "search {\"query\": null, \"limit\": 5}\n" },
    { "unknown-param-and-function", false, true,
      "<tool_call>\n<function=mystery>\n<parameter=n>\n42\n</parameter>\n</function>\n"
      "</tool_call>", "", "", "mystery {\"n\": \"42\"}\n" },
    { "multiline-and-escapes", false, true,
      "<tool_call>\n<function=search>\n<parameter=query>\nline1\n\"q\" \\ tab\there\nline3\n"
      "</parameter>\n</function>\n</tool_call>", "", "",
      "search {\"query\": \"line1\\n\\\"q\\\" \\\\ tab\\there\\nline3\"}\n" },
    { "non-ascii-value", true, true,
      "\xe6\x80\x9d\xe8\x80\x83</think>\n<tool_call>\n<function=search>\n<parameter=query>\n"
      "\xe5\xa4\xa9\xe6\xb0\x94 \xf0\x9f\x8c\xa7\n</parameter>\n</function>\n</tool_call>",
      "\xe6\x80\x9d\xe8\x80\x83", "",
      "search {\"query\": \"\xe5\xa4\xa9\xe6\xb0\x94 \xf0\x9f\x8c\xa7\"}\n" },
    { "junk-before-call-close", false, true,
      "<tool_call>\n<function=noargs>\n</function>\noops</tool_call>", "", "oops</tool_call>",
      "noargs {}\n" },
    { "text-after-call", false, true, CALL_W "\nDone.", "", "\nDone.",
      "get_weather {\"city\": \"Paris\", \"days\": 3}\n" },
    { "think-close-in-content-is-text", true, true, "r</think>\nsee </think> here", "r",
      "see </think> here", "" },
    { "empty-arguments", false, true,
      "<tool_call>\n<function=noargs>\n</function>\n</tool_call>", "", "", "noargs {}\n" },
    { "think-prefix-not-tag", true, true, "<thi is not a tag</think>x", "<thi is not a tag", "x", "" },
    { "tools-off-call-is-text", false, false, CALL_W, "", CALL_W, "" },
    { "reasoning-trailing-newline-eof", true, true, "abc\n", "abc\n", "", "" },
    { "two-functions-one-block", false, true,
      "<tool_call>\n<function=noargs>\n</function>\n<function=calc>\n<parameter=x>\n2\n"
      "</parameter>\n</function>\n</tool_call>", "", "", "noargs {}\ncalc {\"x\": 2}\n" },
    { "junk-inside-body", false, true,
      "<tool_call>\n<function=calc>\n<parameter=x>\n1\n</parameter>\nhello</function>", "",
      "hello</function>", "calc {\"x\": 1}\n" },
    { "nullable-integer", false, true,
      "<tool_call>\n<function=search>\n<parameter=limit>\n12\n</parameter>\n</function>\n"
      "</tool_call>", "", "", "search {\"limit\": 12}\n" },
    { "lt-signs-in-content", false, true, "a < b and <b>bold</b> <tool_x>", "",
      "a < b and <b>bold</b> <tool_x>", "" },
    { "empty-output", true, true, "", "", "", "" },
};

struct result {
    char *reasoning, *content, *calls;
    size_t nr, nc, nk;
    char *args;             /* current call's argument text */
    size_t na;
    int cur_index;
    bool in_call;
};

static void append(char **s, size_t *n, const char *t, size_t len)
{
    *s = realloc(*s, *n + len + 1);
    ASSERT_TRUE(*s);
    memcpy(*s + *n, t, len);
    *n += len;
    (*s)[*n] = '\0';
}

static int on_event(void *ud, const struct tok_ev *ev)
{
    struct result *res = ud;
    switch (ev->kind) {
    case TOK_EV_REASONING:
        ASSERT_TRUE(!res->in_call);
        append(&res->reasoning, &res->nr, ev->text, ev->len);
        break;
    case TOK_EV_CONTENT:
        ASSERT_TRUE(!res->in_call);
        append(&res->content, &res->nc, ev->text, ev->len);
        break;
    case TOK_EV_TOOL_START:
        ASSERT_TRUE(!res->in_call);
        ASSERT_EQ(ev->tool_index, res->cur_index + 1);
        res->cur_index = ev->tool_index;
        res->in_call = true;
        res->na = 0;
        append(&res->calls, &res->nk, ev->text, ev->len);
        append(&res->calls, &res->nk, " ", 1);
        break;
    case TOK_EV_TOOL_ARGS:
        ASSERT_TRUE(res->in_call);
        ASSERT_EQ(ev->tool_index, res->cur_index);
        append(&res->args, &res->na, ev->text, ev->len);
        append(&res->calls, &res->nk, ev->text, ev->len);
        break;
    case TOK_EV_TOOL_END: {
        ASSERT_TRUE(res->in_call);
        ASSERT_EQ(ev->tool_index, res->cur_index);
        json_error_t je;
        json_t *j = json_loadb(res->args ? res->args : "", res->na, 0, &je);
        if (!j)
            FAIL("arguments are not JSON: %s (%s)", res->args ? res->args : "", je.text);
        ASSERT_TRUE(json_is_object(j));
        json_decref(j);
        append(&res->calls, &res->nk, "\n", 1);
        res->in_call = false;
        break;
    }
    case TOK_EV_TEXT:
        FAIL("the parser emitted a raw-text event");
    }
    return 0;
}

static void result_free(struct result *r)
{
    free(r->reasoning);
    free(r->content);
    free(r->calls);
    free(r->args);
}

static void check(const struct pcase *c, struct result *res, const char *mode)
{
    const char *rs = res->reasoning ? res->reasoning : "";
    const char *cs = res->content ? res->content : "";
    const char *ks = res->calls ? res->calls : "";
    if (strcmp(rs, c->want_reasoning) || strcmp(cs, c->want_content) || strcmp(ks, c->want_calls))
        FAIL("case %s (%s):\n  reasoning %s\n  want      %s\n  content   %s\n  want      %s\n"
             "  calls     %s\n  want      %s", c->name, mode, rs, c->want_reasoning, cs,
             c->want_content, ks, c->want_calls);
    ASSERT_TRUE(!res->in_call);
}

static struct tok_parser *parser_for(const struct pcase *c, const json_t *tools)
{
    struct tok_parser *p;
    struct tok_parser_opts o = { .reasoning = c->reasoning, .tools = c->tools, .tools_json = tools };
    ASSERT_OK(tok_parser_new(&o, &p));
    return p;
}

static void run_chunked(const struct pcase *c, const json_t *tools, size_t chunk)
{
    struct result res = { .cur_index = -1 };
    struct tok_parser *p = parser_for(c, tools);
    size_t n = strlen(c->input);
    for (size_t i = 0; i < n; i += chunk)
        ASSERT_OK(tok_parser_feed(p, c->input + i, (n - i < chunk ? n - i : chunk), on_event, &res));
    ASSERT_OK(tok_parser_finish(p, on_event, &res));
    char mode[32];
    snprintf(mode, sizeof(mode), "chunk %zu", chunk);
    check(c, &res, mode);
    tok_parser_free(p);
    result_free(&res);
}

static void run_tokens(const struct pcase *c, const json_t *tools, const struct tokenizer *tok)
{
    struct result res = { .cur_index = -1 };
    struct tok_parser *p = parser_for(c, tools);
    struct tok_ids ids = {0};
    struct tok_stream st;
    const char *d;
    size_t dn;

    ASSERT_OK(tok_encode(tok, c->input, strlen(c->input), TOK_ENCODE_SPECIAL, &ids, NULL));
    tok_stream_init(&st, tok, false);
    for (size_t i = 0; i < ids.n; i++) {
        ASSERT_OK(tok_stream_push(&st, ids.ids[i], &d, &dn));
        ASSERT_OK(tok_parser_feed(p, d, dn, on_event, &res));
    }
    ASSERT_OK(tok_stream_finish(&st, &d, &dn));
    ASSERT_OK(tok_parser_feed(p, d, dn, on_event, &res));
    ASSERT_OK(tok_parser_finish(p, on_event, &res));
    check(c, &res, "per token");
    tok_stream_done(&st);
    tok_ids_done(&ids);
    tok_parser_free(p);
    result_free(&res);
}

/* A 256 KiB parameter value streamed 4 bytes at a time arrives whole and in order (the
 * terminator search resumes where it stopped, so this stays linear). */
static void long_value(const json_t *tools)
{
    static const char head[] = "<tool_call>\n<function=search>\n<parameter=query>\n";
    static const char tail[] = "\n</parameter>\n</function>\n</tool_call>";
    size_t nv = 256 * 1024, n = strlen(head) + nv + strlen(tail);
    char *in = malloc(n + 1);
    ASSERT_TRUE(in);
    strcpy(in, head);
    for (size_t i = 0; i < nv; i++)
        in[strlen(head) + i] = (char)('a' + i % 26);
    strcpy(in + strlen(head) + nv, tail);
    struct pcase c = { "long-value", false, true, in, "", "", NULL };
    struct result res = { .cur_index = -1 };
    struct tok_parser *p = parser_for(&c, tools);
    for (size_t i = 0; i < n; i += 4)
        ASSERT_OK(tok_parser_feed(p, in + i, n - i < 4 ? n - i : 4, on_event, &res));
    ASSERT_OK(tok_parser_finish(p, on_event, &res));
    ASSERT_EQ(res.na, nv + strlen("{\"query\": \"\"}"));
    ASSERT_TRUE(memcmp(res.args + strlen("{\"query\": \""), in + strlen(head), nv) == 0);
    tok_parser_free(p);
    result_free(&res);
    free(in);
}

int main(int argc, char **argv)
{
    struct tokenizer *tok = NULL;
    struct err_buf e;
    json_t *tools = json_loads(tools_json, 0, NULL);
    size_t n_cases = sizeof(cases) / sizeof(cases[0]);

    ASSERT_TRUE(tools);
    ASSERT_LE(30, n_cases);
    if (argc > 1 && tok_load(argv[1], &tok, &e) < 0)
        fprintf(stderr, "note: %s; per-token mode skipped\n", e.msg);
    for (size_t i = 0; i < n_cases; i++) {
        size_t n = strlen(cases[i].input);
        run_chunked(&cases[i], tools, n ? n : 1);
        run_chunked(&cases[i], tools, 1);
        run_chunked(&cases[i], tools, 3);
        if (tok)
            run_tokens(&cases[i], tools, tok);
    }
    long_value(tools);
    printf("%zu parser cases x %d feeding modes and a 256 KiB streamed value passed\n", n_cases,
           tok ? 4 : 3);
    tok_free(tok);
    json_decref(tools);
    return 0;
}
