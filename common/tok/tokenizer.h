/* tokenizer.h - Hugging Face tokenizer.json byte-level BPE in C, and the streaming text side.
 *
 * A struct tokenizer is loaded once from a tokenizer.json file and is then read-only and safe
 * to share between threads (its word cache has its own lock).  Supported file features:
 *   model        BPE (vocab, merges as "a b" strings or [a, b] pairs, ignore_merges, unk_token)
 *   normalizer   null, NFC, NFD, NFKC, NFKD (ICU, limited to the Unicode 9.0 repertoire like
 *                the tokenizers library), Prepend, Replace (string), Sequence
 *   pre_tokenizer ByteLevel (GPT-2 regex when use_regex), Split (regex read from the file,
 *                behaviours Isolated/Removed/MergedWithPrevious/MergedWithNext/Contiguous),
 *                Sequence of those
 *   decoder      ByteLevel
 *   post_processor TemplateProcessing (single), ByteLevel, null
 *   added_tokens special and normal, matched before BPE (leftmost-longest), lstrip/rstrip,
 *                single_word (ASCII word characters)
 * Anything else is refused at load time with a message naming it (-ENOTSUP).
 *
 * Encoding follows the `tokenizers` library step for step: non-normalized added tokens are
 * split out of the raw text, the rest is normalized, normalized added tokens are split out,
 * the pre-tokenizer cuts words, each word is byte-mapped and merged by BPE rank.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tokenizer;

/* Load path (a tokenizer.json).  On failure returns a negative errno and, if e is non-NULL,
 * a sentence naming the file and the problem.  *ret_tok is written only on success. */
int tok_load(const char *path, struct tokenizer **ret_tok, struct err_buf *e);
/* Same from a JSON document in memory (len bytes, need not be NUL-terminated). */
int tok_load_json(const char *json, size_t len, struct tokenizer **ret_tok, struct err_buf *e);
void tok_free(struct tokenizer *tok);

enum tok_encode_flags {
    TOK_ENCODE_SPECIAL = 1 << 0,     /* match special added tokens in the text (else plain text) */
    TOK_ENCODE_ADD_SPECIAL = 1 << 1, /* apply the post-processor template (BOS etc.) */
    TOK_ENCODE_ADD_BOS = 1 << 2,     /* prepend tok_bos_id() unless the ids already start with
                                      * it (e.g. a rendered chat prompt carries BOS as text) */
};

/* The post-processor template's ids (TemplateProcessing "single") before the text
 * (after = false) or after it: what TOK_ENCODE_ADD_SPECIAL adds; their count, *ret valid
 * while tok lives. */
size_t tok_template_ids(const struct tokenizer *tok, bool after, const int32_t **ret);

/* Growable id array owned by the caller: init with {0}, free with tok_ids_done(). */
struct tok_ids {
    int32_t *ids;
    size_t n;
    size_t cap;
};
void tok_ids_done(struct tok_ids *ids);

/* Encode len bytes of UTF-8 text, appending ids to out.  Returns the number of ids appended,
 * -EILSEQ (with e) if text is not valid UTF-8, -ENOMEM.  Thread-safe. */
int tok_encode(const struct tokenizer *tok, const char *text, size_t len, unsigned flags,
               struct tok_ids *out, struct err_buf *e);

/* Decode n ids to UTF-8 (invalid byte sequences become U+FFFD, as the tokenizers library does).
 * Returns a malloc'd NUL-terminated string in *ret_text and its length in *ret_len (may be
 * NULL).  -EINVAL if an id is out of range. */
int tok_decode(const struct tokenizer *tok, const int32_t *ids, size_t n, bool skip_special,
               char **ret_text, size_t *ret_len);

/* Raw bytes of one token as the decoder produces them (no UTF-8 repair); NULL if out of range. */
const char *tok_id_bytes(const struct tokenizer *tok, int32_t id, size_t *ret_len);
/* Token string as written in the file (vocab key or added-token content). */
const char *tok_id_to_token(const struct tokenizer *tok, int32_t id);
/* Id of a token string (vocab key or added-token content), -ENOENT if none. */
int32_t tok_token_to_id(const struct tokenizer *tok, const char *token);
/* Id of an added token whose content is s (special or not), -ENOENT if none. */
int32_t tok_added_id(const struct tokenizer *tok, const char *s);
bool tok_id_is_special(const struct tokenizer *tok, int32_t id);
/* True for ids listed in added_tokens (special or not). */
bool tok_id_is_added(const struct tokenizer *tok, int32_t id);
/* One more than the largest id (vocab and added tokens). */
size_t tok_vocab_size(const struct tokenizer *tok);
/* BOS id: the first special token of a TemplateProcessing post-processor, else the id set by
 * tok_bos_set(), else -ENOENT. */
int32_t tok_bos_id(const struct tokenizer *tok);
void tok_bos_set(struct tokenizer *tok, int32_t id);

/* --- streaming detokenizer --------------------------------------------------------------- */

/* Incremental detokenization with the prefix/read-offset technique: every delta is a run of
 * complete UTF-8 characters that no later token can change; the concatenation of all deltas
 * plus tok_stream_finish() equals tok_decode() of all ids.  Caller-embedded; one per request. */
struct tok_stream {
    /* private */
    const struct tokenizer *tok;
    bool skip_special;
    struct tok_ids ids;
    size_t prefix_offset;   /* start of the window re-decoded each step */
    size_t read_offset;     /* ids before this have been emitted */
    char *out;              /* delta buffer, reused */
    size_t out_cap;
};
void tok_stream_init(struct tok_stream *s, const struct tokenizer *tok, bool skip_special);
void tok_stream_done(struct tok_stream *s);
/* Push one id.  On success *ret_delta points to ret_len bytes of new text (possibly 0) valid
 * until the next call.  -EINVAL on a bad id, -ENOMEM. */
int tok_stream_push(struct tok_stream *s, int32_t id, const char **ret_delta, size_t *ret_len);
/* Emit whatever is held back (an incomplete character becomes U+FFFD). */
int tok_stream_finish(struct tok_stream *s, const char **ret_delta, size_t *ret_len);

/* --- stop strings ------------------------------------------------------------------------ */

enum tok_finish {
    TOK_FINISH_NONE = 0,
    TOK_FINISH_STOP,        /* a stop string matched */
    TOK_FINISH_LENGTH,      /* set by callers, not here */
    TOK_FINISH_EOS,         /* set by callers on a stop token id */
};

/* Applies stop strings to a text stream: text that could still be the start of a stop string
 * is held back, text from the first match on is never emitted (unless include_stop).
 * Caller-embedded; one per request. */
struct tok_stop {
    /* read-only after a match */
    enum tok_finish finish;
    int matched;            /* index of the stop string that matched, -1 none */
    /* private */
    char **stops;
    size_t n_stops;
    size_t max_len;
    bool include_stop;
    char *held;
    size_t n_held;
    char *out;
    size_t out_cap;
};
/* Copies the n stop strings (empty strings are refused: -EINVAL). */
int tok_stop_init(struct tok_stop *st, const char *const *stops, size_t n, bool include_stop);
void tok_stop_done(struct tok_stop *st);
/* Feed a text delta; *ret_out/ret_len is the text to emit (valid until the next call).
 * Returns 1 when a stop string matched (st->finish == TOK_FINISH_STOP; further input is
 * ignored), 0 otherwise, -ENOMEM. */
int tok_stop_feed(struct tok_stop *st, const char *text, size_t len, const char **ret_out,
                  size_t *ret_len);
/* End of stream: release held-back text. */
int tok_stop_finish(struct tok_stop *st, const char **ret_out, size_t *ret_len);

/* --- UTF-8 helpers shared by the text pipeline -------------------------------------------- */

/* Length of the longest prefix of s[0..n) that is valid UTF-8 (RFC 3629, no surrogates). */
size_t tok_utf8_valid_prefix(const char *s, size_t n);

#ifdef __cplusplus
}
#endif
