/* internal.h - structures shared by the files of common/tok (not a public header). */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer.h"

/* --- small growable byte buffer ---------------------------------------------------------- */

struct tok_buf {
    char *p;
    size_t n;
    size_t cap;
};
int tok__buf_reserve(struct tok_buf *b, size_t extra);
int tok__buf_put(struct tok_buf *b, const void *src, size_t n);
int tok__buf_putc(struct tok_buf *b, char c);
int tok__buf_puts(struct tok_buf *b, const char *s);
int tok__buf_printf(struct tok_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void tok__buf_done(struct tok_buf *b);

/* p (an array of *cap elements of elem bytes) reallocated to twice *cap (64 from none), *cap
 * updated; NULL when out of memory (p and *cap unchanged). */
void *tok__grow(void *p, size_t *cap, size_t elem);
int tok__ids_push(struct tok_ids *ids, int32_t id);

uint64_t tok__hash(const void *p, size_t n);
/* Decode one UTF-8 char of valid input at s (n > 0); returns its length, code point in *cp. */
int tok__utf8_next(const char *s, size_t n, uint32_t *cp);
int tok__utf8_put(char *dst, uint32_t cp);
/* Number of trailing bytes of s that are a valid but unfinished UTF-8 sequence (0..3). */
size_t tok__utf8_incomplete_tail(const char *s, size_t n);
/* Raw decoder bytes of ids (no UTF-8 repair) appended to out; -EINVAL on a bad id. */
int tok__decode_raw(const struct tokenizer *tok, const int32_t *ids, size_t n,
                    bool skip_special, struct tok_buf *out);
int tok__decode_buf(const struct tokenizer *tok, const int32_t *ids, size_t n,
                    bool skip_special, struct tok_buf *out);
/* Append src as UTF-8 with maximal invalid subparts replaced by U+FFFD. */
int tok__utf8_lossy(struct tok_buf *b, const char *src, size_t n);

/* --- the tokenizer ------------------------------------------------------------------------ */

struct tok_token {
    char *str;          /* as in the file (vocab key / added content), NUL-terminated */
    uint32_t len;
    char *bytes;        /* what the ByteLevel decoder makes of it (points into str when same) */
    uint32_t n_bytes;
    bool present;       /* id used by vocab or an added token */
    bool added;
    bool special;
};

struct tok_added {
    int32_t id;
    const char *content;    /* borrows tokens[id].str */
    uint32_t len;
    bool special;
    bool normalized;
    bool lstrip;
    bool rstrip;
    bool single_word;
};

enum tok_norm_kind {
    TOK_NORM_NFC,
    TOK_NORM_NFD,
    TOK_NORM_NFKC,
    TOK_NORM_NFKD,
    TOK_NORM_PREPEND,
    TOK_NORM_REPLACE,
};

struct tok_norm {
    enum tok_norm_kind kind;
    char *a;            /* prepend text / replace pattern */
    char *b;            /* replace content */
    const void *icu;    /* UNormalizer2 *, filtered to Unicode 9.0 (owned with icu_set) */
    void *icu_set;      /* USet * */
};

enum tok_pre_kind {
    TOK_PRE_SPLIT,
    TOK_PRE_BYTELEVEL,
};

enum tok_split_behavior {
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_MERGED_PREV,
    TOK_SPLIT_MERGED_NEXT,
    TOK_SPLIT_CONTIGUOUS,
};

struct tok_pre {
    enum tok_pre_kind kind;
    pcre2_code *re;             /* Split regex, or the GPT-2 regex for ByteLevel use_regex */
    enum tok_split_behavior behavior;
    bool add_prefix_space;      /* ByteLevel */
};

struct tok_merge_slot {
    uint64_t key;               /* (left << 32) | right */
    int32_t rank;               /* -1: empty */
    int32_t merged;
};

struct tok_cache_entry {
    uint64_t hash;
    uint32_t len;
    uint32_t n_ids;
    int32_t *ids;               /* points after the word */
    char word[];
};

struct tokenizer {
    struct tok_token *tokens;   /* indexed by id, n_tokens entries */
    size_t n_tokens;
    int32_t *str_slots;         /* open addressing over token strings: id+1, 0 empty */
    size_t str_mask;

    struct tok_added *added;    /* sorted by first byte, then longest first */
    size_t n_added;
    bool added_first[256];      /* some added token starts with this byte */
    bool has_normalized_added;

    struct tok_norm *norms;
    size_t n_norms;
    struct tok_pre *pres;
    size_t n_pres;

    int32_t byte_id[256];       /* id of the single-byte token, -1 if absent */
    struct tok_merge_slot *merges;
    size_t merge_mask;
    bool ignore_merges;
    int32_t unk_id;             /* -1 none */

    int32_t *post_pre;          /* TemplateProcessing ids before $A */
    size_t n_post_pre;
    int32_t *post_post;         /* and after */
    size_t n_post_post;
    int32_t bos_id;

    pthread_mutex_t cache_lock;
    struct tok_cache_entry **cache;
    size_t cache_mask;
    size_t cache_used;
};

/* lookups */
int32_t tok__str_lookup(const struct tokenizer *tok, const char *s, size_t n);
int32_t tok__merge_lookup(const struct tokenizer *tok, int32_t a, int32_t b, int32_t *ret_merged);

/* bpe.c: encode one pre-tokenized word (raw bytes) and append the ids. */
int tok__bpe_word(const struct tokenizer *tok, const char *w, size_t n, struct tok_ids *out);
void tok__cache_clear(struct tokenizer *tok);

/* pretok.c */
int tok__normalize(const struct tokenizer *tok, const char *s, size_t n, struct tok_buf *out);
int tok__pretokenize_encode(const struct tokenizer *tok, const char *s, size_t n,
                            struct tok_ids *out);
/* GPT-2 byte <-> unicode map */
extern const uint16_t tok__byte_to_cp[256];
int tok__cp_to_byte(uint32_t cp);

/* pyjson.c: Python-compatible JSON text (see chat.h) */
struct json_t;
int tok__py_float(struct tok_buf *b, double x);
int tok__py_json_string(struct tok_buf *b, const char *s, size_t n);
int tok__py_dump(struct tok_buf *b, const struct json_t *v);
int tok__py_str(struct tok_buf *b, const struct json_t *v);
