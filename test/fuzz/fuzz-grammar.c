/* fuzz-grammar.c - libFuzzer target: the schema-to-grammar path of structured output
 * (common/grammar.c over llguidance) on the tiny model's vocabulary.  The first byte picks
 * the kind (json_schema, json_object, regex, lark), the rest is the constraint's text.  A
 * constraint grammar_check accepts must also compile into a matcher whose first mask is
 * computable, and one it refuses must be refused with a one-line message; matchers that
 * compile are walked a few tokens (the lowest allowed id each step) and rolled back.
 * Without llguidance every input is a no-op. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "grammar.h"

#ifndef FUZZ_TOKENIZER
#define FUZZ_TOKENIZER ""
#endif

#define VOCAB 4096

static struct grammar_vocab *vocab(void)
{
    static struct grammar_vocab *gv;
    static int tried;
    struct err_buf e;
    int32_t eos = 2;

    if (!tried) {
        tried = 1;
        if (grammar_vocab_new(FUZZ_TOKENIZER, VOCAB, &eos, 1, &gv, &e) < 0)
            gv = NULL;
    }
    return gv;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const kinds[] = { "json_schema", "json_object", "regex", "lark" };
    struct grammar_vocab *gv = vocab();
    struct grammar_matcher *m;
    struct err_buf e;

    if (!gv || size < 1 || size > 4096)
        return 0;
    char *text = malloc(size);
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    const char *kind = kinds[data[0] % 4];
    int ok = grammar_check(gv, kind, text, &e) == 0;
    if (!ok)
        BUG_ON(!e.msg[0] || strchr(e.msg, '\n'));
    int made = grammar_matcher_new(gv, kind, text, data[0] & 0x80 ? 4 : -1, &m, &e) == 0;
    if (made) {
        int n = 0;
        for (int step = 0; step < 8; step++) {
            const uint32_t *mask = grammar_matcher_mask(m);
            int32_t t = 0;
            if (mask)
                while (t < VOCAB && !grammar_mask_has(mask, t))
                    t++;
            if (t >= VOCAB || grammar_matcher_accept(m, t) < 0)
                break;
            n++;
        }
        BUG_ON(grammar_matcher_rollback(m, n) < 0);
        grammar_matcher_free(m);
    }
    free(text);
    return 0;
}
