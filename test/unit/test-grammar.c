/* test-grammar.c - the llguidance binding on the tiny model's vocabulary: tokens drawn at
 * random among those each mask allows spell a reply the constraint accepts (regex, choice,
 * JSON schema with required fields, enum and bounds); a forbidden token is refused and
 * leaves the state; rollback restores an earlier mask; a matcher started after </think>
 * allows everything until that token; bad schemas, regexes and grammars fail with the
 * engine's message; masks prefetched on the engine's thread equal those computed at the draw.
 * Skips (77) when llguidance is not installed. */
#include <errno.h>
#include <jansson.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "harness.h"
#include "tokenizer.h"

#define VOCAB 4096
#define EOS 2
#define THINK_END 4

static struct grammar_vocab *gv;
static struct tokenizer *tok;

static uint64_t rng = 88172645463325252ull;

static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t) (rng >> 11);
}

static int count_allowed(const uint32_t *m)
{
    int n = 0;
    for (int t = 0; t < VOCAB; t++)
        n += grammar_mask_has(m, t);
    return n;
}

/* Draw allowed tokens (EOS only once the mask allows nothing else or by chance after 8
 * tokens) until EOS; the decoded text into buf. */
static void generate(struct grammar_matcher *m, char *buf, size_t len)
{
    int32_t ids[512];
    int n = 0;

    for (;;) {
        const uint32_t *mask = grammar_matcher_mask(m);
        ASSERT_TRUE(mask != NULL);
        int k = count_allowed(mask);
        ASSERT_TRUE(k > 0);
        bool eos_ok = grammar_mask_has(mask, EOS);
        if (eos_ok && (k == 1 || (n > 8 && next_rand() % 4 == 0)))
            break;
        int pick = (int) (next_rand() % (uint32_t) (eos_ok ? k - 1 : k)), t = 0;
        for (;; t++) {
            if (!grammar_mask_has(mask, t) || t == EOS)
                continue;
            if (pick-- == 0)
                break;
        }
        ASSERT_OK(grammar_matcher_accept(m, t));
        ids[n++] = t;
        ASSERT_TRUE(n < 512);
    }
    char *text = NULL;
    size_t tl = 0;
    ASSERT_OK(tok_decode(tok, ids, (size_t) n, false, &text, &tl));
    ASSERT_TRUE(tl < len);
    memcpy(buf, text, tl);
    buf[tl] = 0;
    free(text);
}

static void matches(const char *re, const char *s)
{
    regex_t rx;
    ASSERT_EQ(regcomp(&rx, re, REG_EXTENDED | REG_NOSUB), 0);
    if (regexec(&rx, s, 0, NULL, 0))
        FAIL("\"%s\" does not match %s", s, re);
    regfree(&rx);
}

static void check_bad(const char *kind, const char *text, const char *want)
{
    struct err_buf eb;
    struct grammar_matcher *m = NULL;
    fprintf(stderr, "bad %s: %s\n", kind, text);
    ASSERT_ERR(grammar_check(gv, kind, text, &eb), -EINVAL);
    if (want)
        ASSERT_CONTAINS(eb.msg, want);
    ASSERT_TRUE(strchr(eb.msg, '\n') == NULL);
    fprintf(stderr, "  -> %s\n", eb.msg);
    ASSERT_ERR(grammar_matcher_new(gv, kind, text, -1, &m, &eb), -EINVAL);
}

int main(int argc, char **argv)
{
    char path[4096], out[4096];
    struct err_buf eb;
    struct grammar_matcher *m;
    int32_t eos = EOS;

    ASSERT_TRUE(argc == 2);
    if (grammar_lib_open(&eb) < 0) {
        fprintf(stderr, "skip: %s\n", eb.msg);
        return TEST_SKIP;
    }
    snprintf(path, sizeof(path), "%s/tokenizer.json", argv[1]);
    ASSERT_OK(tok_load(path, &tok, &eb));
    ASSERT_OK(grammar_vocab_new(path, VOCAB, &eos, 1, &gv, &eb));

    /* regex and choice: every random walk spells a match */
    for (int i = 0; i < 20; i++) {
        ASSERT_OK(grammar_matcher_new(gv, "regex", "[0-9]{3}-(ab|cd)", -1, &m, &eb));
        generate(m, out, sizeof(out));
        matches("^[0-9]{3}-(ab|cd)$", out);
        grammar_matcher_free(m);
        ASSERT_OK(grammar_matcher_new(gv, "regex", "(red|green|blue sky)", -1, &m, &eb));
        generate(m, out, sizeof(out));
        matches("^(red|green|blue sky)$", out);
        grammar_matcher_free(m);
    }

    /* JSON schema: parses, has the required keys, enum and bounds hold */
    const char *schema = "{\"type\":\"object\",\"properties\":{"
        "\"n\":{\"type\":\"integer\",\"minimum\":3,\"maximum\":7},"
        "\"c\":{\"enum\":[\"x\",\"y\"]},"
        "\"l\":{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"maxItems\":3}},"
        "\"required\":[\"n\",\"c\",\"l\"],\"additionalProperties\":false}";
    for (int i = 0; i < 20; i++) {
        ASSERT_OK(grammar_matcher_new(gv, "json_schema", schema, -1, &m, &eb));
        generate(m, out, sizeof(out));
        json_error_t je;
        json_t *j = json_loads(out, 0, &je);
        if (!j)
            FAIL("not JSON: %s (%s)", out, je.text);
        json_int_t n = json_integer_value(json_object_get(j, "n"));
        ASSERT_TRUE(n >= 3 && n <= 7);
        const char *c = json_string_value(json_object_get(j, "c"));
        ASSERT_TRUE(c && (!strcmp(c, "x") || !strcmp(c, "y")));
        ASSERT_TRUE(json_array_size(json_object_get(j, "l")) <= 3);
        json_decref(j);
        grammar_matcher_free(m);
    }

    /* forbidden token refused; rollback restores the first mask */
    ASSERT_OK(grammar_matcher_new(gv, "json_object", "", -1, &m, &eb));
    uint32_t first[VOCAB / 32];
    memcpy(first, grammar_matcher_mask(m), sizeof(first));
    int32_t brace = -1, letter = -1;
    for (int t = 0; t < VOCAB; t++) {
        size_t bl;
        const char *b = tok_id_bytes(tok, t, &bl);
        if (b && bl == 1 && b[0] == '{')
            brace = t;
        if (b && bl == 1 && b[0] == 'q')
            letter = t;
    }
    ASSERT_TRUE(brace >= 0 && letter >= 0);
    ASSERT_TRUE(!grammar_mask_has(first, letter));
    ASSERT_ERR(grammar_matcher_accept(m, letter), -EINVAL);
    ASSERT_TRUE(memcmp(first, grammar_matcher_mask(m), sizeof(first)) == 0);
    ASSERT_OK(grammar_matcher_accept(m, brace));
    ASSERT_TRUE(memcmp(first, grammar_matcher_mask(m), sizeof(first)) != 0);
    ASSERT_OK(grammar_matcher_rollback(m, 1));
    ASSERT_TRUE(memcmp(first, grammar_matcher_mask(m), sizeof(first)) == 0);
    ASSERT_ERR(grammar_matcher_rollback(m, 1), -EINVAL);
    grammar_matcher_free(m);

    /* gated by </think>: free before, constrained from the next token, inactive again after
     * a rollback past it */
    ASSERT_OK(grammar_matcher_new(gv, "json_object", "", THINK_END, &m, &eb));
    ASSERT_TRUE(grammar_matcher_mask(m) == NULL);
    ASSERT_OK(grammar_matcher_accept(m, letter));
    ASSERT_TRUE(grammar_matcher_mask(m) == NULL);
    ASSERT_OK(grammar_matcher_accept(m, THINK_END));
    ASSERT_TRUE(grammar_matcher_mask(m) != NULL);
    ASSERT_TRUE(memcmp(first, grammar_matcher_mask(m), sizeof(first)) == 0);
    ASSERT_ERR(grammar_matcher_accept(m, letter), -EINVAL);
    ASSERT_OK(grammar_matcher_accept(m, brace));
    ASSERT_OK(grammar_matcher_rollback(m, 2));
    ASSERT_TRUE(grammar_matcher_mask(m) == NULL);
    grammar_matcher_free(m);

    /* prefetch (the engine's thread): the same masks as computed at the draw; accept,
     * rollback and free right after a prefetch wait for it or cancel it */
    for (int w = 0; w < 5; w++) {
        struct grammar_matcher *a, *b;
        ASSERT_OK(grammar_matcher_new(gv, "json_schema", schema, -1, &a, &eb));
        ASSERT_OK(grammar_matcher_new(gv, "json_schema", schema, -1, &b, &eb));
        for (int step = 0; step < 60; step++) {
            grammar_matcher_prefetch(b);
            if (step % 7 == 3) {                /* take it back at once, then again */
                ASSERT_OK(grammar_matcher_rollback(b, 0));
                grammar_matcher_prefetch(b);
            }
            const uint32_t *ma = grammar_matcher_mask(a), *mb = grammar_matcher_mask(b);
            ASSERT_TRUE(memcmp(ma, mb, sizeof(first)) == 0);
            int k = count_allowed(ma), t = 0;
            if (k == 0 || (k == 1 && grammar_mask_has(ma, EOS)))
                break;
            for (int pick = (int) (next_rand() % (uint32_t) k);; t++)
                if (grammar_mask_has(ma, t) && t != EOS && pick-- == 0)
                    break;
            ASSERT_OK(grammar_matcher_accept(a, t));
            ASSERT_OK(grammar_matcher_accept(b, t));
            if (step % 5 == 4) {
                grammar_matcher_prefetch(b);
                ASSERT_OK(grammar_matcher_rollback(a, 1));
                ASSERT_OK(grammar_matcher_rollback(b, 1));
                ASSERT_OK(grammar_matcher_accept(a, t));
                ASSERT_OK(grammar_matcher_accept(b, t));
            }
        }
        grammar_matcher_prefetch(b);
        grammar_matcher_free(b);
        grammar_matcher_free(a);
    }

    /* malformed input: the engine's message, one line */
    check_bad("json_schema", "{\"type\": \"object\"", NULL);
    check_bad("json_schema", "{\"type\": \"frobnicate\"}", NULL);
    check_bad("json_schema", "{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 1}", NULL);
    check_bad("regex", "(unclosed", NULL);
    check_bad("regex", "a{5,2}", NULL);
    check_bad("lark", "start: undefined_rule", NULL);
    check_bad("lark", "start: (\"a\"", NULL);
    ASSERT_OK(grammar_check(gv, "lark", "start: \"yes\" | \"no\"", &eb));

    grammar_vocab_free(gv);
    tok_free(tok);
    printf("ok\n");
    return 0;
}
