/* grammar.h - constrained decoding (structured output) through llguidance.
 *
 * The grammar engine is llguidance's C API (docs/OPERATIONS.md §14): the shared library the
 * `llguidance` PyPI wheel ships (llguidance/_lib.abi3.so, no dependency beyond libc), opened
 * with dlopen() on first use, so a process that never sees a constrained request neither
 * needs nor loads it.  Search order: $STEPD_LLGUIDANCE (the .so itself), then the wheel in
 * the source tree's .venv (tools/dev/install-deps.sh), then "libllguidance.so" on the
 * loader's path.
 *
 * A grammar_vocab is the model's vocabulary as the engine sees it (built from the model's
 * tokenizer.json, padded to the model's vocab size); a grammar_matcher is one sequence's
 * state.  Constraint kinds: "json_schema" (a JSON schema text), "json_object" (any JSON
 * object), "regex" (Rust regex syntax), "lark" (llguidance's Lark dialect).
 *
 * A matcher may start inactive: with start_after >= 0 every token is free until the token
 * start_after has been accepted (the end of the reasoning, </think>); the next token is the
 * first one constrained.  Threads: a vocab is immutable and shared; a matcher belongs to one
 * thread at a time (a prefetch lends it to the engine's thread until the next call).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GRAMMAR_MAX_TEXT (1u << 20)   /* bytes of one schema, regex or grammar */

struct grammar_vocab;
struct grammar_matcher;

/* Open the library once (thread-safe).  0, or -ENOENT/-ENOEXEC with a sentence in err
 * ("structured output needs llguidance: ...").  Later calls return the first result. */
int grammar_lib_open(struct err_buf *err);

/* Vocabulary from a HuggingFace tokenizer.json (path) with n_vocab ids (>= the file's; ids
 * past it are never allowed); eos[0..n_eos) end a sequence (n_eos >= 1). */
int grammar_vocab_new(const char *tokenizer_json, int n_vocab, const int32_t *eos, int n_eos,
                      struct grammar_vocab **ret, struct err_buf *err);
void grammar_vocab_free(struct grammar_vocab *v);

/* Compile kind/text without keeping it: 0, or -EINVAL with the engine's one-line message. */
int grammar_check(const struct grammar_vocab *v, const char *kind, const char *text,
                  struct err_buf *err);

int grammar_matcher_new(const struct grammar_vocab *v, const char *kind, const char *text,
                        int32_t start_after, struct grammar_matcher **ret, struct err_buf *err);
void grammar_matcher_free(struct grammar_matcher *m);

/* The allowed-token bitmask of the current state (bit t of word t/32), n_vocab bits, or NULL
 * while the matcher is inactive (every token allowed).  Computed at most once per state. */
const uint32_t *grammar_matcher_mask(struct grammar_matcher *m);
/* Start computing the current state's mask on the grammar engine's thread (one per process,
 * started at the first call), so that it is ready when grammar_matcher_mask() asks: called
 * after a step's tokens are accepted, it overlaps the next forward.  Every other call on the
 * matcher first waits for (or cancels) it.  No-op when inactive or already computed. */
void grammar_matcher_prefetch(struct grammar_matcher *m);
/* Advance by one sampled token.  -EINVAL when the grammar forbids it (the matcher stays
 * in its state). */
int grammar_matcher_accept(struct grammar_matcher *m, int32_t tok);
/* Undo the last n accepted tokens (n <= the tokens accepted since creation). */
int grammar_matcher_rollback(struct grammar_matcher *m, int n);
/* Words of a mask over n_vocab tokens. */
static inline size_t grammar_mask_words(int n_vocab)
{
    return ((size_t) n_vocab + 31) / 32;
}
static inline bool grammar_mask_has(const uint32_t *mask, int32_t tok)
{
    return (mask[(uint32_t) tok >> 5] >> ((uint32_t) tok & 31)) & 1u;
}

#ifdef __cplusplus
}
#endif
