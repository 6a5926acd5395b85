/* gen.h - the per-request output pipeline: ids -> text deltas -> stop strings -> parsers.
 *
 * One struct tok_gen per generation request (not thread-safe; the owner's thread only).
 * Each generated id goes through: stop ids (end the request, the id is not shown) ->
 * streaming detokenizer -> stop strings (cut before the match) -> the step3p5 reasoning and
 * tool-call parsers when enabled, else plain TOK_EV_CONTENT deltas.  With a parser, special
 * tokens are hidden except the parser's own tags (<think>, </think>, <tool_call>,
 * </tool_call>), which the parser consumes; without one, skip_special decides.  With
 * text_events every delta also comes as TOK_EV_TEXT before its parsed events.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "parser.h"
#include "tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tok_gen_opts {
    bool skip_special;              /* without a parser: hide special tokens */
    const char *const *stops;       /* stop strings (copied) */
    size_t n_stops;
    bool include_stop;              /* keep the matched stop string in the output */
    const int32_t *stop_ids;        /* e.g. EOS ids; copied.  Leave out EOS for ignore_eos */
    size_t n_stop_ids;
    struct tok_parser_opts parser;  /* .reasoning / .tools; tools_json must outlive the gen */
    bool text_events;               /* also TOK_EV_TEXT: each text delta after the stop strings,
                                       before the parsers (what a raw-text field shows) */
};

struct tok_gen;

/* -EINVAL for an empty stop string, -ENOMEM. */
int tok_gen_new(const struct tokenizer *tok, const struct tok_gen_opts *o, struct tok_gen **ret);
void tok_gen_free(struct tok_gen *g);
/* Push one generated id; events go to cb.  Returns 1 when the request is finished
 * (tok_gen_finish_reason() tells why; the pipeline is already flushed), 0 to continue,
 * -EINVAL for an id outside the vocabulary, -EALREADY after the end, or cb's error. */
int tok_gen_push(struct tok_gen *g, int32_t id, tok_ev_cb cb, void *ud);
/* Output the prompt already holds (it opened a tool call for the model): fed to the parsers
 * as if generated, before the first id; their events go to cb. */
int tok_gen_prime(struct tok_gen *g, const char *text, size_t len, tok_ev_cb cb, void *ud);
/* The request ends for another reason (length, abort): flush held text and close parsers. */
int tok_gen_finish(struct tok_gen *g, tok_ev_cb cb, void *ud);
/* TOK_FINISH_NONE while running; STOP (stop string, index in *ret_index), EOS (stop id, the
 * id in *ret_index), or LENGTH after tok_gen_finish(). */
enum tok_finish tok_gen_finish_reason(const struct tok_gen *g, int *ret_index);

#ifdef __cplusplus
}
#endif
