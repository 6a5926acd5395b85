/* parser.h - streaming step3p5 reasoning and tool-call parsers (vLLM `step3p5` semantics).
 *
 * Model output arrives as text deltas (from tok_stream with special tokens kept); the parser
 * turns them into events as soon as they are certain:
 *   reasoning   text before </think> (the prompt already opened <think>; a leading <think>
 *               is dropped); the newline right before and the one right after </think> are
 *               dropped
 *   content     everything else that is not a tool call
 *   tool calls  <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>...
 *               </function>\n</tool_call>: TOOL_START with the name, TOOL_ARGS deltas whose
 *               concatenation is json.dumps() of the arguments (values converted per the
 *               tool's JSON schema: string, integer, number, boolean, object/array, "null"),
 *               TOOL_END.  Several calls may follow each other.
 * Failure modes handled: a tag split across deltas (held back until certain, never leaked);
 * <tool_call> inside the reasoning (ends the reasoning, the call is parsed, a later stray
 * </think> is dropped); a malformed call before its <function=NAME> header is complete is
 * returned as content, never dropped; junk inside a started call ends the call and the junk is
 * content; a call cut off by the end of the stream is closed with what it has.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#ifdef __cplusplus
extern "C" {
#endif

enum tok_ev_kind {
    TOK_EV_REASONING,
    TOK_EV_CONTENT,
    TOK_EV_TOOL_START,      /* text = function name */
    TOK_EV_TOOL_ARGS,       /* text = JSON arguments delta */
    TOK_EV_TOOL_END,
    TOK_EV_TEXT,            /* tok_gen with text_events only: the raw text, before parsing */
};

struct tok_ev {
    enum tok_ev_kind kind;
    int tool_index;         /* 0-based call number for TOOL_* events, else -1 */
    const char *text;       /* borrowed for the duration of the callback */
    size_t len;
};

/* Return < 0 to stop parsing; that value is returned by feed/finish. */
typedef int (*tok_ev_cb)(void *userdata, const struct tok_ev *ev);

struct tok_parser_opts {
    bool reasoning;             /* run the reasoning parser (the prompt opened <think>) */
    bool tools;                 /* run the tool-call parser */
    const json_t *tools_json;   /* tool definitions (OpenAI style list) for the schema types;
                                 * borrowed, may be NULL (then every value stays a string) */
};

struct tok_parser;

/* -ENOMEM only. */
int tok_parser_new(const struct tok_parser_opts *o, struct tok_parser **ret);
void tok_parser_free(struct tok_parser *p);
/* Feed a delta (any split, even inside a UTF-8 character).  Events go to cb. */
int tok_parser_feed(struct tok_parser *p, const char *text, size_t len, tok_ev_cb cb, void *ud);
/* End of output: release held text, close an unfinished call. */
int tok_parser_finish(struct tok_parser *p, tok_ev_cb cb, void *ud);

#ifdef __cplusplus
}
#endif
