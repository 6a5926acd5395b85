/* test-tok-gen.c - the per-request output pipeline (ids -> detok -> stop strings -> parsers).
 *
 * Properties: a stop string ends the request with finish STOP and its index, text before it
 * is delivered and nothing after; a stop id ends it with finish EOS and is never shown;
 * with the parsers on, reasoning / content / tool-call events come out of token ids and
 * special tokens other than the parser tags are hidden; tok_gen_finish() reports LENGTH and
 * releases held text (an unfinished character becomes U+FFFD); pushing after the end is
 * refused.
 *
 * usage: test-tok-gen TINY_TOKENIZER.json
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"
#include "harness.h"

struct out {
    char text[6][4096];     /* per event kind */
    int n_start, n_end;
};

static int on_ev(void *ud, const struct tok_ev *ev)
{
    struct out *o = ud;
    strncat(o->text[ev->kind], ev->text, ev->len);
    o->n_start += ev->kind == TOK_EV_TOOL_START;
    o->n_end += ev->kind == TOK_EV_TOOL_END;
    return 0;
}

/* Run text (encoded with special tokens) plus extra ids through a gen; returns push's
 * last status. */
static int run(const struct tokenizer *tok, const struct tok_gen_opts *o, const char *text,
               const int32_t *extra, size_t n_extra, bool finish, struct out *out,
               struct tok_gen **ret)
{
    struct tok_ids ids = {0};
    struct tok_gen *g;
    int r = 0;
    memset(out, 0, sizeof(*out));
    ASSERT_OK(tok_gen_new(tok, o, &g));
    ASSERT_OK(tok_encode(tok, text, strlen(text), TOK_ENCODE_SPECIAL, &ids, NULL));
    if (n_extra) {
        ids.ids = realloc(ids.ids, (ids.n + n_extra) * sizeof(int32_t));
        ASSERT_TRUE(ids.ids);
        memcpy(ids.ids + ids.n, extra, n_extra * sizeof(int32_t));
        ids.n += n_extra;
        ids.cap = ids.n;
    }
    for (size_t i = 0; i < ids.n && r == 0; i++)
        r = tok_gen_push(g, ids.ids[i], on_ev, out);
    ASSERT_OK(r);
    if (finish)
        ASSERT_OK(tok_gen_finish(g, on_ev, out));
    tok_ids_done(&ids);
    *ret = g;
    return r;
}

static const int32_t eos[] = { 2 };     /* <|im_end|> */

int main(int argc, char **argv)
{
    struct tokenizer *tok;
    struct err_buf e;
    struct tok_gen *g;
    struct out out;
    int idx;

    if (argc != 2 || tok_load(argv[1], &tok, &e) < 0)
        FAIL("usage: %s TINY_TOKENIZER.json", argv[0]);

    /* stop string across tokens; nothing after it */
    const char *stops[] = { "never", "STOP" };
    struct tok_gen_opts o = { .stops = stops, .n_stops = 2 };
    ASSERT_EQ(run(tok, &o, "Hello world. STOP here and more", NULL, 0, false, &out, &g), 1);
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "Hello world. ");
    ASSERT_EQ(tok_gen_finish_reason(g, &idx), TOK_FINISH_STOP);
    ASSERT_EQ(idx, 1);
    ASSERT_ERR(tok_gen_push(g, 100, on_ev, &out), -EALREADY);
    tok_gen_free(g);

    /* stop id: finish EOS, the id and what follows never shown */
    struct tok_gen_opts o2 = { .stop_ids = eos, .n_stop_ids = 1, .skip_special = true };
    ASSERT_EQ(run(tok, &o2, "abc<|im_end|>junk", NULL, 0, false, &out, &g), 1);
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "abc");
    ASSERT_EQ(tok_gen_finish_reason(g, &idx), TOK_FINISH_EOS);
    ASSERT_EQ(idx, 2);
    tok_gen_free(g);

    /* skip_special without a parser */
    struct tok_gen_opts o3 = { .skip_special = false };
    run(tok, &o3, "<|im_start|>x", NULL, 0, true, &out, &g);
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "<|im_start|>x");
    ASSERT_EQ(tok_gen_finish_reason(g, NULL), TOK_FINISH_LENGTH);
    tok_gen_free(g);
    o3.skip_special = true;
    run(tok, &o3, "<|im_start|>x", NULL, 0, true, &out, &g);
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "x");
    tok_gen_free(g);

    /* parsers from token ids: reasoning, content, a tool call; other specials hidden */
    struct tok_gen_opts o4 = { .stop_ids = eos, .n_stop_ids = 1,
                               .parser = { .reasoning = true, .tools = true } };
    ASSERT_EQ(run(tok, &o4, "I will look it up.\n</think>\nSure.<|im_start|>\n<tool_call>\n"
                  "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call><|im_end|>", NULL, 0, false, &out, &g), 1);
    ASSERT_STREQ(out.text[TOK_EV_REASONING], "I will look it up.");
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "Sure.\n");
    ASSERT_STREQ(out.text[TOK_EV_TOOL_START], "get_weather");
    ASSERT_STREQ(out.text[TOK_EV_TOOL_ARGS], "{\"city\": \"Paris\"}");
    ASSERT_EQ(out.n_start, 1);
    ASSERT_EQ(out.n_end, 1);
    ASSERT_EQ(tok_gen_finish_reason(g, NULL), TOK_FINISH_EOS);
    ASSERT_STREQ(out.text[TOK_EV_TEXT], "");
    tok_gen_free(g);

    /* text_events: the raw text after the stop strings, before the parsers (their tags in
     * it, other specials and the stop id not), alongside the same parsed events */
    o4.text_events = true;
    o4.stops = (const char *[]){ "Paris" };
    o4.n_stops = 1;
    ASSERT_EQ(run(tok, &o4, "I will look it up.\n</think>\nSure.<|im_start|>\n<tool_call>\n"
                  "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                  "</tool_call><|im_end|>", NULL, 0, false, &out, &g), 1);
    ASSERT_STREQ(out.text[TOK_EV_TEXT], "I will look it up.\n</think>\nSure.\n<tool_call>\n"
                 "<function=get_weather>\n<parameter=city>\n");
    ASSERT_STREQ(out.text[TOK_EV_REASONING], "I will look it up.");
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "Sure.\n");
    ASSERT_EQ(tok_gen_finish_reason(g, &idx), TOK_FINISH_STOP);
    tok_gen_free(g);

    /* length: held bytes of an unfinished character are released as U+FFFD */
    int32_t e4 = -1, b8 = -1;
    for (int32_t id = 0; (size_t) id < tok_vocab_size(tok); id++) {
        size_t len;
        const char *b = tok_id_bytes(tok, id, &len);
        if (b && len == 1 && (unsigned char) b[0] == 0xe4)
            e4 = id;
        if (b && len == 1 && (unsigned char) b[0] == 0xb8)
            b8 = id;
    }
    ASSERT_TRUE(e4 >= 0 && b8 >= 0);
    struct tok_gen_opts o5 = { 0 };
    run(tok, &o5, "ok ", (int32_t[]){ e4, b8 }, 2, false, &out, &g);
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "ok ");
    ASSERT_OK(tok_gen_finish(g, on_ev, &out));
    ASSERT_STREQ(out.text[TOK_EV_CONTENT], "ok \xef\xbf\xbd");
    ASSERT_EQ(tok_gen_finish_reason(g, NULL), TOK_FINISH_LENGTH);
    ASSERT_ERR(tok_gen_push(g, 100, on_ev, &out), -EALREADY);
    tok_gen_free(g);

    /* bad input */
    struct tok_gen_opts o6 = { .stops = (const char *[]){ "" }, .n_stops = 1 };
    ASSERT_ERR(tok_gen_new(tok, &o6, &g), -EINVAL);
    ASSERT_OK(tok_gen_new(tok, &o5, &g));
    ASSERT_ERR(tok_gen_push(g, 99999, on_ev, &out), -EINVAL);
    tok_gen_free(g);

    tok_free(tok);
    printf("output pipeline: stop strings, stop ids, special tokens, parsers, length passed\n");
    return 0;
}
