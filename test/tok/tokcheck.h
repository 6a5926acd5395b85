/* tokcheck.h - the tokenizer equality check set: corpus parts, random id sequences and the
 * digest lines that test-tok-equality compares with the committed expected files and that
 * check_tokenizer.py recomputes with the tokenizers library.
 *
 * Digest lines ("part index count fnv64hex"):
 *   synth I N H        ids of synth doc I, special tokens parsed
 *   synth-plain I N H  same doc with special-token parsing off (every 4th doc)
 *   kjv I N H          ids of KJV doc I
 *   decode I N H       N bytes of UTF-8 from decoding random id sequence I, H over the bytes
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "corpus.h"
#include "tokenizer.h"

enum { TOKT_PART_SYNTH, TOKT_PART_KJV, TOKT_N_PARTS };
extern const char *const tokt_part_names[TOKT_N_PARTS];

#define TOKT_SYNTH_BYTES (1024u * 1024u)
#define TOKT_N_SEQS 400

struct tokt_set {
    struct tokt_corpus parts[TOKT_N_PARTS];
    struct tok_ids seqs[TOKT_N_SEQS];
    size_t n_seqs;
    int kjv_status;         /* 0, or -ENOENT when the bible program is missing */
};

int tokt_set_build(struct tokt_set *set, const struct tokenizer *tok);
void tokt_set_done(struct tokt_set *set);
/* All digest lines in one malloc'd string. */
int tokt_set_digest(const struct tokt_set *set, const struct tokenizer *tok, char **ret_lines);
uint64_t tokt_fnv64_bytes(const void *p, size_t n);
