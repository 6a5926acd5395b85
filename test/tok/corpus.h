/* corpus.h - the deterministic tokenizer test corpus, shared by the tests, tok-cli and the
 * python cross-check (which reads the corpus tok-cli writes, so both sides see the same bytes).
 *
 * Part "synth": documents generated from a fixed seed: English-like prose, code, CJK, emoji
 * (ZWJ, skin tones, flags), odd Unicode (combining marks, zero-width and bidi controls, NEL,
 * line/paragraph separators, compatibility characters, supplementary planes, C0 controls),
 * long whitespace runs, digit runs, and every added token of the tokenizer plus near misses.
 * Part "kjv": the King James Bible, Genesis to Leviticus, from the bible-kjv package
 * (`bible -l80 Ge1:1-Le27:34`), cut into ~4 KiB documents at line ends.
 * Digests: FNV-1a 64 over the ids as little-endian int32.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

struct tokt_doc {
    char *text;
    size_t len;
};

struct tokt_corpus {
    struct tokt_doc *docs;
    size_t n;
    size_t cap;
    size_t total_bytes;
};

#define TOKT_SYNTH_SEED 0x5eed7a11c0ffee01ull
#define TOKT_KJV_CMD "bible -l80 Ge1:1-Le27:34 2>/dev/null"

/* Build target_bytes (approximately) of synthetic documents.  specials: the added-token
 * strings to sprinkle in (may be NULL). 0 or -ENOMEM. */
int tokt_corpus_synth(struct tokt_corpus *c, uint64_t seed, size_t target_bytes,
                      const char *const *specials, size_t n_specials);
/* Append the KJV documents; -ENOENT if the bible program is missing or prints nothing. */
int tokt_corpus_kjv(struct tokt_corpus *c);
void tokt_corpus_done(struct tokt_corpus *c);

uint64_t tokt_fnv64_ids(const int32_t *ids, size_t n);

/* splitmix64 */
static inline uint64_t tokt_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
