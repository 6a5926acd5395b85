/* tok-cli.c - developer and cross-check tool for common/tok.
 *
 *   tok-cli corpus TOKENIZER OUT    write the test corpus (synth + kjv docs, random decode id
 *                                   sequences) for check_tokenizer.py
 *   tok-cli digest TOKENIZER        print the digest lines the equality test compares
 *   tok-cli encode TOKENIZER        encode stdin, print ids
 *   tok-cli decode TOKENIZER ID...  decode ids, print text
 *   tok-cli bench TOKENIZER         encode the corpus and print MB/s
 *   tok-cli chat CASES.json         render each chat-template case, print a JSON list
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "chat.h"
#include "corpus.h"
#include "tokcheck.h"
#include "tokenizer.h"

static double now_sec(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmd_corpus(const struct tokenizer *tok, const char *out)
{
    struct tokt_set set;
    FILE *f = fopen(out, "wb");
    int r;
    if (!f)
        return -errno;
    if ((r = tokt_set_build(&set, tok)) < 0) {
        fclose(f);
        return r;
    }
    for (size_t p = 0; p < TOKT_N_PARTS; p++)
        for (size_t i = 0; i < set.parts[p].n; i++) {
            fprintf(f, "doc %s %zu %zu\n", tokt_part_names[p], i, set.parts[p].docs[i].len);
            fwrite(set.parts[p].docs[i].text, 1, set.parts[p].docs[i].len, f);
            fputc('\n', f);
        }
    for (size_t i = 0; i < set.n_seqs; i++) {
        fprintf(f, "ids %zu %zu\n", i, set.seqs[i].n);
        for (size_t k = 0; k < set.seqs[i].n; k++)
            fprintf(f, "%s%d", k ? " " : "", set.seqs[i].ids[k]);
        fputc('\n', f);
    }
    tokt_set_done(&set);
    return fclose(f) ? -errno : 0;
}

static int cmd_digest(const struct tokenizer *tok)
{
    struct tokt_set set;
    char *lines = NULL;
    int r = tokt_set_build(&set, tok);
    if (r < 0)
        return r;
    r = tokt_set_digest(&set, tok, &lines);
    if (r == 0)
        fputs(lines, stdout);
    free(lines);
    tokt_set_done(&set);
    return r;
}

static int cmd_encode(const struct tokenizer *tok)
{
    char *buf = NULL;
    size_t n = 0, cap = 0, k;
    struct tok_ids ids = {0};
    struct err_buf e;
    int r;
    do {
        if (n + 65536 > cap) {
            cap = cap ? cap * 2 : 1 << 20;
            char *p = realloc(buf, cap);
            if (!p) {
                free(buf);
                return -ENOMEM;
            }
            buf = p;
        }
        k = fread(buf + n, 1, cap - n, stdin);
        n += k;
    } while (k > 0);
    r = tok_encode(tok, buf, n, TOK_ENCODE_SPECIAL, &ids, &e);
    if (r < 0)
        fprintf(stderr, "encode: %s\n", e.msg);
    for (size_t i = 0; r >= 0 && i < ids.n; i++)
        printf("%s%d", i ? " " : "", ids.ids[i]);
    if (r >= 0)
        printf("\n");
    tok_ids_done(&ids);
    free(buf);
    return r < 0 ? r : 0;
}

static int cmd_decode(const struct tokenizer *tok, int argc, char **argv)
{
    int32_t *ids = calloc((size_t) argc + 1, sizeof(*ids));
    char *text;
    int r;
    if (!ids)
        return -ENOMEM;
    for (int i = 0; i < argc; i++)
        ids[i] = (int32_t) strtol(argv[i], NULL, 10);
    r = tok_decode(tok, ids, (size_t) argc, false, &text, NULL);
    if (r == 0) {
        printf("%s\n", text);
        free(text);
    }
    free(ids);
    return r;
}

static int cmd_bench(const struct tokenizer *tok)
{
    struct tokt_set set;
    struct tok_ids ids = {0};
    size_t bytes = 0, n_ids = 0;
    int r = tokt_set_build(&set, tok);
    if (r < 0)
        return r;
    for (int pass = 0; pass < 2 && r >= 0; pass++) {
        /* pass 0 warms the word cache the way a long-running server's would be */
        double t0 = now_sec();
        bytes = n_ids = 0;
        for (size_t p = 0; p < TOKT_N_PARTS && r >= 0; p++)
            for (size_t i = 0; i < set.parts[p].n && r >= 0; i++) {
                ids.n = 0;
                r = tok_encode(tok, set.parts[p].docs[i].text, set.parts[p].docs[i].len,
                               TOK_ENCODE_SPECIAL, &ids, NULL);
                bytes += set.parts[p].docs[i].len;
                n_ids += ids.n;
            }
        double dt = now_sec() - t0;
        printf("stepd-tok %s: %zu bytes, %zu tokens in %.3f s = %.2f MB/s\n",
               pass ? "warm cache" : "cold cache", bytes, n_ids, dt, bytes / dt / 1e6);
    }
    tok_ids_done(&ids);
    tokt_set_done(&set);
    return r < 0 ? r : 0;
}

/* Render each case of a check_template.py table; print the renderings as a JSON list. */
static int cmd_chat(const char *path)
{
    json_error_t je;
    json_t *cases = json_load_file(path, 0, &je), *out = json_array();
    int r = 0;
    if (!cases || !out) {
        fprintf(stderr, "%s: %s\n", path, cases ? "out of memory" : je.text);
        json_decref(cases);
        json_decref(out);
        return -EINVAL;
    }
    for (size_t i = 0; i < json_array_size(cases) && r == 0; i++) {
        json_t *c = json_array_get(cases, i);
        struct tok_chat_opts o = {
            .bos_token = json_object_get(c, "bos_token")
                             ? json_string_value(json_object_get(c, "bos_token"))
                             : "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>",
            .reasoning_effort = json_string_value(json_object_get(c, "reasoning_effort")),
            .add_generation_prompt = json_is_true(json_object_get(c, "add_generation_prompt")),
            .preserve_thinking = json_is_true(json_object_get(c, "preserve_thinking")),
        };
        char *text;
        size_t len;
        struct err_buf e;
        r = tok_chat_render(json_object_get(c, "messages"), json_object_get(c, "tools"), &o,
                            &text, &len, &e);
        if (r < 0) {
            fprintf(stderr, "case %zu: %s\n", i, e.msg);
            break;
        }
        json_array_append_new(out, json_stringn(text, len));
        free(text);
    }
    if (r == 0) {
        char *s = json_dumps(out, JSON_ENSURE_ASCII);
        puts(s ? s : "[]");
        free(s);
    }
    json_decref(cases);
    json_decref(out);
    return r;
}

int main(int argc, char **argv)
{
    struct tokenizer *tok;
    struct err_buf e;
    int r;

    if (argc == 3 && !strcmp(argv[1], "chat"))
        return cmd_chat(argv[2]) < 0 ? 1 : 0;
    if (argc < 3) {
        fprintf(stderr, "usage: %s corpus|digest|encode|decode|bench TOKENIZER [ARGS]\n", argv[0]);
        return 2;
    }
    if ((r = tok_load(argv[2], &tok, &e)) < 0) {
        fprintf(stderr, "%s\n", e.msg);
        return 1;
    }
    if (!strcmp(argv[1], "corpus") && argc == 4)
        r = cmd_corpus(tok, argv[3]);
    else if (!strcmp(argv[1], "digest"))
        r = cmd_digest(tok);
    else if (!strcmp(argv[1], "encode"))
        r = cmd_encode(tok);
    else if (!strcmp(argv[1], "decode"))
        r = cmd_decode(tok, argc - 3, argv + 3);
    else if (!strcmp(argv[1], "bench"))
        r = cmd_bench(tok);
    else {
        fprintf(stderr, "unknown command %s\n", argv[1]);
        r = -EINVAL;
    }
    tok_free(tok);
    if (r < 0)
        fprintf(stderr, "%s: %s\n", argv[1], err_str(r));
    return r < 0 ? 1 : 0;
}
