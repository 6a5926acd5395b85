/* fuzz-tok.c - libFuzzer target for the tokenizer, detokenizer, stop strings, parsers and
 * chat template; also a corpus replayer (built without libFuzzer, run by `meson test`).
 *
 * The first input byte picks the component, the rest is its input.  Besides "no crash, no
 * leak" (ASan/LSan under -Dfuzz=true) each mode checks its invariant and aborts if broken:
 *   0 encode/decode: decode(encode(text)) == text for valid UTF-8 (the tiny tokenizer has no
 *     normalizer), -EILSEQ for anything else
 *   1 detokenizer: stream deltas concatenated == one-shot decode, every delta valid UTF-8
 *   2 parser: fed in input-chosen chunk sizes; every finished call's arguments are a JSON
 *     object; feeding whole gives the same reasoning/content/calls
 *   3 stop strings: output never contains the stop string
 *   4 chat template: any JSON renders or fails cleanly
 *   5 tokenizer.json loader: any document loads or fails with a message
 *   6 output pipeline: ids -> detok -> stop strings -> parsers; tool arguments stay JSON
 * Work per input is linear in its size (inputs are capped at 64 KiB).
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chat.h"
#include "gen.h"
#include "parser.h"
#include "tokenizer.h"

#ifndef TOK_FUZZ_TOKENIZER
#error "define TOK_FUZZ_TOKENIZER to the tiny model's tokenizer.json"
#endif

#define CHECK(x) do { if (!(x)) { fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #x, \
                                          __FILE__, __LINE__); abort(); } } while (0)

static struct tokenizer *tok;

static void fuzz_encode(const char *s, size_t n)
{
    struct tok_ids ids = {0};
    int r = tok_encode(tok, s, n, TOK_ENCODE_SPECIAL, &ids, NULL);
    if (tok_utf8_valid_prefix(s, n) != n) {
        CHECK(r == -EILSEQ);
        return;
    }
    CHECK(r >= 0);
    char *text;
    size_t len;
    CHECK(tok_decode(tok, ids.ids, ids.n, false, &text, &len) == 0);
    CHECK(len == n && memcmp(text, s, n) == 0);
    free(text);
    tok_ids_done(&ids);
}

static void fuzz_detok(const unsigned char *s, size_t n)
{
    size_t V = tok_vocab_size(tok), k = n / 2;
    int32_t *ids = malloc((k + 1) * sizeof(*ids));
    struct tok_stream st;
    char *want, *got = malloc(1);
    size_t want_len, got_len = 0;
    CHECK(ids && got);
    for (size_t i = 0; i < k; i++)
        ids[i] = (int32_t)(((size_t) s[2 * i] << 8 | s[2 * i + 1]) % V);
    CHECK(tok_decode(tok, ids, k, n & 1, &want, &want_len) == 0);
    tok_stream_init(&st, tok, n & 1);
    for (size_t i = 0; i <= k; i++) {
        const char *d;
        size_t dn;
        CHECK((i < k ? tok_stream_push(&st, ids[i], &d, &dn) : tok_stream_finish(&st, &d, &dn)) == 0);
        if (i < k)
            CHECK(tok_utf8_valid_prefix(d, dn) == dn);
        got = realloc(got, got_len + dn + 1);
        CHECK(got);
        memcpy(got + got_len, d, dn);
        got_len += dn;
    }
    CHECK(got_len == want_len && memcmp(got, want, got_len) == 0);
    tok_stream_done(&st);
    free(want);
    free(got);
    free(ids);
}

struct acc {
    char *text[3];  /* reasoning, content, calls transcript */
    size_t n[3];
    char *args;
    size_t na;
};

static void put(char **b, size_t *n, const char *s, size_t len)
{
    *b = realloc(*b, *n + len + 1);
    CHECK(*b);
    memcpy(*b + *n, s, len);
    *n += len;
    (*b)[*n] = '\0';
}

static int on_ev(void *ud, const struct tok_ev *ev)
{
    struct acc *a = ud;
    int k = ev->kind <= TOK_EV_CONTENT ? (int) ev->kind : 2;
    if (ev->kind == TOK_EV_TOOL_START)
        put(&a->text[2], &a->n[2], "\n", 1);
    put(&a->text[k], &a->n[k], ev->text, ev->len);
    if (ev->kind == TOK_EV_TOOL_START)
        a->na = 0;
    if (ev->kind == TOK_EV_TOOL_ARGS)
        put(&a->args, &a->na, ev->text, ev->len);
    if (ev->kind == TOK_EV_TOOL_END) {
        json_error_t je;
        json_t *j = json_loadb(a->args ? a->args : "", a->na,
                              JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &je);
        if (!j || !json_is_object(j))
            fprintf(stderr, "arguments '%.*s': %s\n", (int) a->na, a->args ? a->args : "",
                    je.text);
        CHECK(j && json_is_object(j));
        json_decref(j);
    }
    return 0;
}

static void acc_free(struct acc *a)
{
    for (int i = 0; i < 3; i++)
        free(a->text[i]);
    free(a->args);
}

static void fuzz_parser(const unsigned char *s, size_t n)
{
    static const char tools[] = "[{\"name\": \"f\", \"parameters\": {\"properties\": {\"i\": "
        "{\"type\": \"integer\"}, \"n\": {\"type\": \"number\"}, \"b\": {\"type\": \"boolean\"}, "
        "\"o\": {\"type\": \"object\"}}}}]";
    if (n < 2)
        return;
    json_t *tj = json_loads(tools, 0, NULL);
    struct tok_parser_opts o = { .reasoning = s[0] & 1, .tools = s[0] & 2, .tools_json = tj };
    struct acc a = {0}, b = {0};
    struct tok_parser *p, *q;
    unsigned step = 1 + s[1] % 7;
    const char *text = (const char *) s + 2;
    size_t len = n - 2;
    CHECK(tok_parser_new(&o, &p) == 0 && tok_parser_new(&o, &q) == 0);
    for (size_t i = 0; i < len; i += step)
        CHECK(tok_parser_feed(p, text + i, len - i < step ? len - i : step, on_ev, &a) == 0);
    CHECK(tok_parser_finish(p, on_ev, &a) == 0);
    CHECK(tok_parser_feed(q, text, len, on_ev, &b) == 0);
    CHECK(tok_parser_finish(q, on_ev, &b) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(a.n[i] == b.n[i] && (!a.n[i] || memcmp(a.text[i], b.text[i], a.n[i]) == 0));
    tok_parser_free(p);
    tok_parser_free(q);
    acc_free(&a);
    acc_free(&b);
    json_decref(tj);
}

static void fuzz_stop(const char *s, size_t n)
{
    if (n < 2)
        return;
    size_t ls = 1 + (unsigned char) s[0] % 8;
    if (ls > n - 1)
        ls = n - 1;
    char stop[16];
    memcpy(stop, s + 1, ls);
    stop[ls] = '\0';
    if (strlen(stop) != ls)
        return;
    const char *stops[1] = { stop };
    struct tok_stop st;
    CHECK(tok_stop_init(&st, stops, 1, false) == 0);
    char *out = NULL;
    size_t on = 0;
    for (size_t i = 1 + ls; i < n; i += 3) {
        const char *o;
        size_t k;
        CHECK(tok_stop_feed(&st, s + i, n - i < 3 ? n - i : 3, &o, &k) >= 0);
        put(&out, &on, o, k);
    }
    const char *o;
    size_t k;
    CHECK(tok_stop_finish(&st, &o, &k) == 0);
    put(&out, &on, o, k);
    CHECK(!out || !memmem(out, on, stop, ls));
    free(out);
    tok_stop_done(&st);
}

static void fuzz_chat(const char *s, size_t n)
{
    json_t *j = json_loadb(s, n, 0, NULL);
    if (!j)
        return;
    struct tok_chat_opts o = { .bos_token = "<s>", .reasoning_effort = (n & 1) ? "high" : NULL,
                               .add_generation_prompt = n & 2 };
    struct err_buf e;
    char *text;
    const json_t *msgs = json_is_object(j) ? json_object_get(j, "messages") : j;
    const json_t *tools = json_is_object(j) ? json_object_get(j, "tools") : NULL;
    if (tok_chat_render(msgs, tools, &o, &text, NULL, &e) == 0)
        free(text);
    json_decref(j);
}

static void fuzz_load(const char *s, size_t n)
{
    struct tokenizer *t;
    struct err_buf e;
    if (tok_load_json(s, n, &t, &e) == 0) {
        struct tok_ids ids = {0};
        (void) tok_encode(t, "hello world 123 \xe4\xb8\x96", 17, TOK_ENCODE_SPECIAL, &ids, NULL);
        tok_ids_done(&ids);
        tok_free(t);
    }
}

static void fuzz_gen(const unsigned char *s, size_t n)
{
    static const int32_t stop_ids[] = { 2 };
    static const char *const stops[] = { "</", "\n\n\n" };
    if (n < 1)
        return;
    struct tok_gen_opts o = {
        .skip_special = s[0] & 1, .stops = stops, .n_stops = (s[0] >> 1) & 1 ? 2 : 0,
        .stop_ids = stop_ids, .n_stop_ids = (s[0] >> 2) & 1,
        .parser = { .reasoning = (s[0] >> 3) & 1, .tools = (s[0] >> 4) & 1 },
    };
    struct tok_gen *g;
    struct acc a = {0};
    size_t V = tok_vocab_size(tok);
    int r = 0;
    CHECK(tok_gen_new(tok, &o, &g) == 0);
    for (size_t i = 1; i + 1 < n && r == 0; i += 2)
        r = tok_gen_push(g, (int32_t)(((size_t) s[i] << 8 | s[i + 1]) % V), on_ev, &a);
    CHECK(r >= 0);
    CHECK(tok_gen_finish(g, on_ev, &a) == 0);
    CHECK(tok_gen_finish_reason(g, NULL) != TOK_FINISH_NONE);
    tok_gen_free(g);
    acc_free(&a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!tok) {
        struct err_buf e;
        if (tok_load(TOK_FUZZ_TOKENIZER, &tok, &e) < 0) {
            fprintf(stderr, "%s\n", e.msg);
            abort();
        }
    }
    if (size < 1 || size > 65536)
        return 0;
    const char *s = (const char *) data + 1;
    size_t n = size - 1;
    switch (data[0] % 7) {
    case 0: fuzz_encode(s, n); break;
    case 1: fuzz_detok(data + 1, n); break;
    case 2: fuzz_parser(data + 1, n); break;
    case 3: fuzz_stop(s, n); break;
    case 4: fuzz_chat(s, n); break;
    case 5: fuzz_load(s, n); break;
    default: fuzz_gen(data + 1, n); break;
    }
    return 0;
}

#ifndef TOK_FUZZ_LIBFUZZER
/* Replay: every file of the corpus directories, plus deterministic mutations of each. */
static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf = malloc(65536 + 1);
    size_t n;
    if (!f || !buf) {
        free(buf);
        if (f)
            fclose(f);
        return -1;
    }
    n = fread(buf, 1, 65536, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    uint64_t x = 0x9e3779b97f4a7c15ull ^ n;
    for (int m = 0; m < 64 && n > 1; m++) {     /* byte flips, truncations, mode changes */
        unsigned char save;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t at = 1 + x % (n - 1);
        save = buf[at];
        buf[at] = (unsigned char)(x >> 32);
        LLVMFuzzerTestOneInput(buf, n);
        buf[at] = save;
        LLVMFuzzerTestOneInput(buf, at);
        save = buf[0];
        buf[0] = (unsigned char) m;
        LLVMFuzzerTestOneInput(buf, n);
        buf[0] = save;
    }
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int files = 0;
    for (int i = 1; i < argc; i++) {
        DIR *d = opendir(argv[i]);
        struct dirent *de;
        if (!d) {
            fprintf(stderr, "%s: cannot open\n", argv[i]);
            return 1;
        }
        while ((de = readdir(d))) {
            char path[4096];
            if (de->d_name[0] == '.')
                continue;
            snprintf(path, sizeof(path), "%s/%s", argv[i], de->d_name);
            if (replay_file(path) == 0)
                files++;
        }
        closedir(d);
    }
    tok_free(tok);
    printf("replayed %d corpus files (x 193 mutations each) without a failure\n", files);
    return files > 0 ? 0 : 1;
}
#endif
