/* tokcheck.c - see tokcheck.h. */
#include "tokcheck.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const tokt_part_names[TOKT_N_PARTS] = { "synth", "kjv" };

uint64_t tokt_fnv64_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int build_seqs(struct tokt_set *set, const struct tokenizer *tok)
{
    uint64_t s = TOKT_SYNTH_SEED ^ 0xdec0de;
    size_t V = tok_vocab_size(tok);
    int32_t byte_ids[256], n_byte = 0;

    for (int32_t id = 0; (size_t) id < V && n_byte < 256; id++) {
        size_t len;
        if (tok_id_bytes(tok, id, &len) && len == 1 && !tok_id_is_added(tok, id))
            byte_ids[n_byte++] = id;
    }
    for (size_t i = 0; i < TOKT_N_SEQS; i++) {
        size_t n = 1 + tokt_rand(&s) % 40;
        struct tok_ids *q = &set->seqs[i];
        while (q->n < n) {
            int32_t id;
            uint64_t k = tokt_rand(&s) % 8;
            if (k < 3 && n_byte)
                id = byte_ids[tokt_rand(&s) % (uint64_t) n_byte];
            else
                id = (int32_t)(tokt_rand(&s) % V);
            if (!tok_id_bytes(tok, id, NULL))
                continue;
            if (q->n == q->cap) {
                size_t cap = q->cap ? q->cap * 2 : 16;
                int32_t *p = realloc(q->ids, cap * sizeof(*p));
                if (!p)
                    return -ENOMEM;
                q->ids = p;
                q->cap = cap;
            }
            q->ids[q->n++] = id;
        }
        set->n_seqs = i + 1;
    }
    return 0;
}

int tokt_set_build(struct tokt_set *set, const struct tokenizer *tok)
{
    const char **specials;
    size_t n_sp = 0, V = tok_vocab_size(tok);
    int r;

    memset(set, 0, sizeof(*set));
    specials = calloc(V + 1, sizeof(*specials));
    if (!specials)
        return -ENOMEM;
    for (int32_t id = 0; (size_t) id < V; id++)
        if (tok_id_is_added(tok, id))
            specials[n_sp++] = tok_id_to_token(tok, id);
    r = tokt_corpus_synth(&set->parts[TOKT_PART_SYNTH], TOKT_SYNTH_SEED, TOKT_SYNTH_BYTES,
                          specials, n_sp);
    free(specials);
    if (r < 0)
        goto fail;
    set->kjv_status = tokt_corpus_kjv(&set->parts[TOKT_PART_KJV]);
    if (set->kjv_status < 0 && set->kjv_status != -ENOENT) {
        r = set->kjv_status;
        goto fail;
    }
    if ((r = build_seqs(set, tok)) < 0)
        goto fail;
    return 0;
fail:
    tokt_set_done(set);
    return r;
}

void tokt_set_done(struct tokt_set *set)
{
    for (size_t p = 0; p < TOKT_N_PARTS; p++)
        tokt_corpus_done(&set->parts[p]);
    for (size_t i = 0; i < TOKT_N_SEQS; i++)
        tok_ids_done(&set->seqs[i]);
    set->n_seqs = 0;
}

static int appendf(char **buf, size_t *n, size_t *cap, const char *fmt, const char *part,
                   size_t i, size_t cnt, uint64_t h)
{
    if (*n + 128 > *cap) {
        size_t c = *cap ? *cap * 2 : 65536;
        char *p = realloc(*buf, c);
        if (!p)
            return -ENOMEM;
        *buf = p;
        *cap = c;
    }
    *n += (size_t) snprintf(*buf + *n, *cap - *n, fmt, part, i, cnt, (unsigned long long) h);
    return 0;
}

int tokt_set_digest(const struct tokt_set *set, const struct tokenizer *tok, char **ret_lines)
{
    static const char fmt[] = "%s %zu %zu %016llx\n";
    char *buf = NULL;
    size_t n = 0, cap = 0;
    struct tok_ids ids = {0};
    struct err_buf e;
    int r = 0;

    for (size_t p = 0; p < TOKT_N_PARTS && r >= 0; p++)
        for (size_t i = 0; i < set->parts[p].n && r >= 0; i++) {
            const struct tokt_doc *d = &set->parts[p].docs[i];
            for (int plain = 0; plain < 2 && r >= 0; plain++) {
                if (plain && (p != TOKT_PART_SYNTH || i % 4))
                    continue;
                ids.n = 0;
                r = tok_encode(tok, d->text, d->len, plain ? 0 : TOK_ENCODE_SPECIAL, &ids, &e);
                if (r >= 0)
                    r = appendf(&buf, &n, &cap, fmt, plain ? "synth-plain" : tokt_part_names[p],
                                i, ids.n, tokt_fnv64_ids(ids.ids, ids.n));
            }
        }
    for (size_t i = 0; i < set->n_seqs && r >= 0; i++) {
        char *text;
        size_t len;
        r = tok_decode(tok, set->seqs[i].ids, set->seqs[i].n, false, &text, &len);
        if (r < 0)
            break;
        r = appendf(&buf, &n, &cap, fmt, "decode", i, len, tokt_fnv64_bytes(text, len));
        free(text);
    }
    tok_ids_done(&ids);
    if (r < 0) {
        free(buf);
        return r;
    }
    *ret_lines = buf;
    return 0;
}
