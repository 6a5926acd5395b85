/* test-tok-stream.c - streaming detokenizer and stop strings.
 *
 * Properties:
 *  - for random id sequences (biased towards single-byte tokens so that UTF-8 characters are
 *    split across tokens, plus special tokens), the concatenated deltas of tok_stream plus
 *    its finish equal a one-shot tok_decode(), with and without skip_special;
 *  - every delta before finish is valid UTF-8 (no character is ever split) and ends at a
 *    point no later token changes (checked by the equality above, delta by delta);
 *  - stop strings: matched across delta boundaries, the stop text and everything after it
 *    never emitted (or included when asked), the earliest match wins, held-back text is
 *    released at the end of the stream, finish reason STOP and the matched index reported.
 *
 * usage: test-tok-stream TOKENIZER.json
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "corpus.h"
#include "harness.h"
#include "tokenizer.h"

static void round_trip(const struct tokenizer *tok, uint64_t seed, int n_seqs)
{
    uint64_t s = seed;
    size_t V = tok_vocab_size(tok);
    int32_t bytes[256];
    int nb = 0;
    for (int32_t id = 0; (size_t) id < V && nb < 256; id++) {
        size_t len;
        if (tok_id_bytes(tok, id, &len) && len == 1)
            bytes[nb++] = id;
    }
    ASSERT_LE(200, nb);
    for (int q = 0; q < n_seqs; q++) {
        int32_t ids[96];
        size_t n = 1 + tokt_rand(&s) % 96;
        bool skip = q & 1;
        for (size_t i = 0; i < n; i++) {
            uint64_t k = tokt_rand(&s) % 10;
            ids[i] = k < 5 ? bytes[tokt_rand(&s) % (uint64_t) nb] : k < 6 ? (int32_t)(tokt_rand(&s) % 10)
                                                                          : (int32_t)(tokt_rand(&s) % V);
        }
        char *want, *got = NULL;
        size_t want_len, got_len = 0;
        ASSERT_OK(tok_decode(tok, ids, n, skip, &want, &want_len));
        struct tok_stream st;
        tok_stream_init(&st, tok, skip);
        for (size_t i = 0; i <= n; i++) {
            const char *d;
            size_t dn;
            if (i < n) {
                ASSERT_OK(tok_stream_push(&st, ids[i], &d, &dn));
                ASSERT_EQ(tok_utf8_valid_prefix(d, dn), dn);
            } else
                ASSERT_OK(tok_stream_finish(&st, &d, &dn));
            got = realloc(got, got_len + dn + 1);
            memcpy(got + got_len, d, dn);
            got_len += dn;
            /* what was emitted so far is a prefix of the one-shot text */
            ASSERT_LE(got_len, want_len);
            ASSERT_TRUE(memcmp(got, want, got_len) == 0);
        }
        ASSERT_EQ(got_len, want_len);
        tok_stream_done(&st);
        free(want);
        free(got);
    }
    struct tok_stream st;
    const char *d;
    size_t dn;
    tok_stream_init(&st, tok, false);
    ASSERT_ERR(tok_stream_push(&st, (int32_t) V + 5, &d, &dn), -EINVAL);
    tok_stream_done(&st);
}

struct stop_case {
    const char *stops[3];
    bool include;
    const char *chunks[8];
    const char *want;
    int matched;
};

static const struct stop_case stop_cases[] = {
    { { "STOP" }, false, { "hello ST", "O", "P world" }, "hello ", 0 },
    { { "STOP" }, true, { "hello ST", "O", "P world" }, "hello STOP", 0 },
    { { "STOP" }, false, { "ST", "ART and S", "TO", "NE" }, "START and STONE", -1 },
    { { "\n\n", "###" }, false, { "a\n", "b##", "#c" }, "a\nb", 1 },
    { { "bc", "abc" }, false, { "xab", "cd" }, "x", 1 },
    { { "<|im_end|>" }, false, { "done<|im", "_end", "|>junk" }, "done", 0 },
    { { "aaa" }, false, { "aa", "aa" }, "", 0 },
    { { "zz" }, false, { "z" }, "z", -1 },
    { { "\xe4\xb8\x96\xe7\x95\x8c" }, false, { "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96", "\xe7\x95\x8c!" },
      "\xe4\xbd\xa0\xe5\xa5\xbd", 0 },
    { { "end" }, false, { "the end", " is near" }, "the ", 0 },
};

static void stops(void)
{
    for (size_t i = 0; i < ARRAY_SIZE(stop_cases); i++) {
        const struct stop_case *c = &stop_cases[i];
        struct tok_stop st;
        size_t ns = 0;
        char out[256] = "";
        while (ns < 3 && c->stops[ns])
            ns++;
        ASSERT_OK(tok_stop_init(&st, c->stops, ns, c->include));
        int r = 0;
        for (size_t k = 0; k < 8 && c->chunks[k]; k++) {
            const char *o;
            size_t on;
            r = tok_stop_feed(&st, c->chunks[k], strlen(c->chunks[k]), &o, &on);
            ASSERT_OK(r);
            strncat(out, o, on);
            /* nothing emitted may contain a stop string (unless included at the end) */
            if (!c->include)
                for (size_t j = 0; j < ns; j++)
                    ASSERT_TRUE(strstr(out, c->stops[j]) == NULL);
        }
        const char *o;
        size_t on;
        ASSERT_OK(tok_stop_finish(&st, &o, &on));
        strncat(out, o, on);
        if (strcmp(out, c->want))
            FAIL("stop case %zu: got '%s', want '%s'", i, out, c->want);
        ASSERT_EQ(st.matched, c->matched);
        ASSERT_EQ(st.finish, c->matched >= 0 ? TOK_FINISH_STOP : TOK_FINISH_NONE);
        tok_stop_done(&st);
    }
    struct tok_stop st;
    ASSERT_ERR(tok_stop_init(&st, (const char *[]){ "" }, 1, false), -EINVAL);
    /* no stop strings: pass-through */
    ASSERT_OK(tok_stop_init(&st, NULL, 0, false));
    const char *o;
    size_t on;
    ASSERT_OK(tok_stop_feed(&st, "abc", 3, &o, &on));
    ASSERT_EQ(on, 3);
    tok_stop_done(&st);
}

int main(int argc, char **argv)
{
    struct tokenizer *tok;
    struct err_buf e;
    if (argc != 2)
        FAIL("usage: %s TOKENIZER.json", argv[0]);
    if (tok_load(argv[1], &tok, &e) < 0)
        FAIL("%s", e.msg);
    round_trip(tok, 1234, 2000);
    stops();
    printf("2000 random streams round-tripped, %zu stop-string cases passed\n",
           ARRAY_SIZE(stop_cases));
    tok_free(tok);
    return 0;
}
