/* corpus.c - deterministic tokenizer corpus (see corpus.h). */
#include "corpus.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strbuf.h"

static int sb_cp(struct strbuf *b, uint32_t cp)
{
    char u[4];
    int n;
    if (cp < 0x80)
        u[0] = (char) cp, n = 1;
    else if (cp < 0x800)
        u[0] = (char)(0xc0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3f)), n = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xe0 | (cp >> 12)), u[1] = (char)(0x80 | ((cp >> 6) & 0x3f)),
        u[2] = (char)(0x80 | (cp & 0x3f)), n = 3;
    else
        u[0] = (char)(0xf0 | (cp >> 18)), u[1] = (char)(0x80 | ((cp >> 12) & 0x3f)),
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f)), u[3] = (char)(0x80 | (cp & 0x3f)), n = 4;
    return strbuf_add(b, u, (size_t) n);
}

static uint32_t rnd(uint64_t *s, uint32_t n)
{
    return (uint32_t)(tokt_rand(s) % n);
}

static const char *const words[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "I", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "tokenizer", "serving", "daemon", "latency", "throughput", "expert", "mixture",
    "quantization", "attention", "don't", "it's", "we're", "they've", "I'm", "you'll",
    "he'd", "O'Neil", "naïve", "café", "résumé", "façade", "Zürich", "straße", "São",
    "Ελληνικά", "русский", "язык", "العربية", "עברית", "हिन्दी", "ไทย", "Tiếng", "Việt",
    "GPU", "CUDA", "MXFP4", "BF16", "JSON", "HTTP/2", "e.g.", "i.e.", "U.S.A.", "Dr.",
    "well-known", "state-of-the-art", "co-operate", "snake_case", "camelCase", "PascalCase",
};

static const char *const punct[] = { ".", ",", ";", ":", "!", "?", "...", " -", " --", "\u2014",
    "\u2026", "\"", "'", "(", ")", "[", "]", "\u00ab", "\u00bb", "\u201c", "\u201d" };

static int gen_prose(struct strbuf *b, uint64_t *s)
{
    int r = 0;
    unsigned n = 20 + rnd(s, 200);
    bool cap = true;
    for (unsigned i = 0; i < n && !r; i++) {
        const char *w = words[rnd(s, sizeof(words) / sizeof(words[0]))];
        if (i)
            r = strbuf_adds(b, " ");
        if (!r && cap && w[0] >= 'a' && w[0] <= 'z') {
            char c = (char)(w[0] - 32);
            r = strbuf_add(b, &c, 1);
            if (!r)
                r = strbuf_adds(b, w + 1);
        } else if (!r)
            r = strbuf_adds(b, w);
        cap = false;
        if (!r && rnd(s, 8) == 0) {
            r = strbuf_adds(b, punct[rnd(s, sizeof(punct) / sizeof(punct[0]))]);
            cap = rnd(s, 2);
        }
        if (!r && rnd(s, 20) == 0) {
            char num[64];
            switch (rnd(s, 5)) {
            case 0: snprintf(num, sizeof(num), " %u", rnd(s, 10)); break;
            case 1: snprintf(num, sizeof(num), " %u,%03u", rnd(s, 1000), rnd(s, 1000)); break;
            case 2: snprintf(num, sizeof(num), " %u.%u%%", rnd(s, 100), rnd(s, 100)); break;
            case 3: snprintf(num, sizeof(num), " 1234567890123%u", rnd(s, 1000)); break;
            default: snprintf(num, sizeof(num), " 20%02u-%02u-%02u", rnd(s, 30), 1 + rnd(s, 12),
                              1 + rnd(s, 28));
            }
            r = strbuf_adds(b, num);
        }
    }
    if (!r)
        r = strbuf_adds(b, rnd(s, 3) ? ".\n" : ".\n\n");
    return r;
}

static const char *const code[] = {
    "int main(int argc, char **argv)\n{\n    return argc > 1 ? 0 : -EINVAL;\n}\n",
    "def encode(self, text: str) -> list[int]:\n    \"\"\"Encode text.\"\"\"\n    return [self.vocab[t] for t in text.split()]\n",
    "for (size_t i = 0; i < n; i++) {\n\tif (a[i] != b[i])\n\t\tgoto out;\n}\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3, \"unit\": null}}\n",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son' ORDER BY id DESC;\n",
    "x = [i ** 2 for i in range(10) if i % 3 == 0]  # squares\n",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n",
    "fn main() { let v: Vec<u8> = vec![0xff; 16]; println!(\"{:?}\", v); }\n",
    "if __name__ == \"__main__\":\r\n    main()\r\n",
    "<div class=\"row\"><a href=\"https://example.com/?q=1&r=2\">link</a></div>\n",
    "$ ./configure --prefix=/usr && make -j2 && sudo make install 2>&1 | tee log\n",
    "    \t  mixed   indentation\t\t\n",
    "a+=b;c-=d;e*=f;g/=h;i%=j;k<<=1;l>>=2;m&&=n||o;p!==q;r===s;t=>u;\n",
    "0x7fffffff 0b1010 1e-9 3.14159 6.022e23 -0.0 1_000_000 12345678901234567890\n",
};

static int gen_code(struct strbuf *b, uint64_t *s)
{
    int r = 0;
    unsigned n = 1 + rnd(s, 6);
    for (unsigned i = 0; i < n && !r; i++)
        r = strbuf_adds(b, code[rnd(s, sizeof(code) / sizeof(code[0]))]);
    return r;
}

static int gen_cjk(struct strbuf *b, uint64_t *s)
{
    static const uint32_t punct_cjk[] = { 0x3001, 0x3002, 0xff0c, 0xff01, 0xff1f, 0x300c, 0x300d,
                                          0x3000, 0xff08, 0xff09 };
    int r = 0;
    unsigned n = 10 + rnd(s, 120);
    for (unsigned i = 0; i < n && !r; i++) {
        switch (rnd(s, 10)) {
        case 0: case 1: case 2: case 3: r = sb_cp(b, 0x4e00 + rnd(s, 0x9fa5 - 0x4e00)); break;
        case 4: r = sb_cp(b, 0x3041 + rnd(s, 0x56)); break;            /* hiragana */
        case 5: r = sb_cp(b, 0x30a1 + rnd(s, 0x59)); break;            /* katakana */
        case 6: r = sb_cp(b, 0xac00 + rnd(s, 0xd7a3 - 0xac00)); break; /* hangul */
        case 7: r = sb_cp(b, punct_cjk[rnd(s, 10)]); break;
        case 8: r = strbuf_adds(b, rnd(s, 2) ? " abc" : "123"); break;
        default: r = sb_cp(b, 0xff10 + rnd(s, 10)); break;             /* full-width digits */
        }
    }
    if (!r)
        r = strbuf_adds(b, "\n");
    return r;
}

static int gen_emoji(struct strbuf *b, uint64_t *s)
{
    int r = 0;
    unsigned n = 3 + rnd(s, 30);
    for (unsigned i = 0; i < n && !r; i++) {
        switch (rnd(s, 7)) {
        case 0: r = sb_cp(b, 0x1f600 + rnd(s, 0x50)); break;
        case 1: r = sb_cp(b, 0x1f300 + rnd(s, 0x100)); break;
        case 2:                              /* skin tone */
            r = sb_cp(b, 0x1f44b);
            if (!r)
                r = sb_cp(b, 0x1f3fb + rnd(s, 5));
            break;
        case 3: r = strbuf_adds(b, "\U0001F468\u200D\U0001F469\u200D\U0001F467"); break; /* ZWJ */
        case 4:                              /* flag */
            r = sb_cp(b, 0x1f1e6 + rnd(s, 26));
            if (!r)
                r = sb_cp(b, 0x1f1e6 + rnd(s, 26));
            break;
        case 5: r = strbuf_adds(b, "\u2764\ufe0f"); break;
        default: r = strbuf_adds(b, rnd(s, 2) ? " " : " and "); break;
        }
    }
    if (!r)
        r = strbuf_adds(b, "\n");
    return r;
}

static int gen_odd(struct strbuf *b, uint64_t *s)
{
    static const uint32_t odd[] = {
        0x0301, 0x0308, 0x0327, 0x200b, 0x200c, 0x200d, 0x2060, 0xfeff, 0x202a, 0x202b,
        0x202e, 0x200e, 0x200f, 0x0085, 0x00a0, 0x2028, 0x2029, 0x3000, 0x2009, 0x202f,
        0xe000, 0xf8ff, 0xfffd, 0xfffc, 0x00ad, 0x034f, 0x0001, 0x001b, 0x007f, 0x0000,
        0xfb01, 0xff21, 0xff41, 0x2460, 0x338f, 0x00bd, 0x2163, 0x1d400, 0x1d7d8, 0x10348,
        0x0627, 0x0644, 0x05d0, 0x05e9, 0x0e01, 0x0915, 0x094d, 0x0bcd, 0x1100, 0x1161,
        0x00c5, 0x212b, 0x2126, 0x03a9, 0x1e9e, 0x0130, 0x0131, 0x01c4, 0x1f82, 0x2075,
        0x00b2, 0x2082, 0x2152, 0x3250, 0x32ff, 0xfe30, 0xff5e, 0xffe3, 0x1f100, 0x2100,
    };
    int r = 0;
    unsigned n = 5 + rnd(s, 60);
    for (unsigned i = 0; i < n && !r; i++) {
        if (rnd(s, 3) == 0)
            r = strbuf_adds(b, words[rnd(s, sizeof(words) / sizeof(words[0]))]);
        else
            r = sb_cp(b, odd[rnd(s, sizeof(odd) / sizeof(odd[0]))]);
        if (!r && rnd(s, 4) == 0)
            r = strbuf_adds(b, " ");
    }
    if (!r)
        r = strbuf_adds(b, "\n");
    return r;
}

static int gen_space(struct strbuf *b, uint64_t *s)
{
    static const char *const ws[] = { " ", "\t", "\n", "\r\n", "  ", "\u3000", "\u00a0" };
    int r = 0;
    unsigned n = 1 + rnd(s, 300);
    unsigned k = rnd(s, 4);
    for (unsigned i = 0; i < n && !r; i++)
        r = strbuf_adds(b, k == 0 ? ws[rnd(s, sizeof(ws) / sizeof(ws[0]))] : k == 1 ? " " : k == 2 ? "\n" : "\t");
    if (!r)
        r = strbuf_adds(b, rnd(s, 2) ? "x" : "");
    return r;
}

static int gen_special(struct strbuf *b, uint64_t *s, const char *const *sp, size_t nsp)
{
    int r;
    if (!nsp)
        return 0;
    const char *t = sp[rnd(s, (uint32_t) nsp)];
    switch (rnd(s, 4)) {
    case 0: return strbuf_adds(b, t);
    case 1: {                                /* near miss: a proper prefix, whole chars */
        size_t k = strlen(t) > 1 ? strlen(t) - 1 - rnd(s, (uint32_t) strlen(t) - 1) : 1;
        while (k > 1 && ((unsigned char) t[k] & 0xc0) == 0x80)
            k--;
        return strbuf_add(b, t, k);
    }
    case 2:                                  /* doubled, glued to text */
        r = strbuf_adds(b, "x");
        if (!r)
            r = strbuf_adds(b, t);
        if (!r)
            r = strbuf_adds(b, t);
        if (!r)
            r = strbuf_adds(b, "y ");
        return r;
    default:
        r = strbuf_adds(b, " ");
        if (!r)
            r = strbuf_adds(b, t);
        if (!r)
            r = strbuf_adds(b, "\n");
        return r;
    }
}

static int add_doc(struct tokt_corpus *c, char *text, size_t len)
{
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 64;
        struct tokt_doc *d = realloc(c->docs, cap * sizeof(*d));
        if (!d)
            return -ENOMEM;
        c->docs = d;
        c->cap = cap;
    }
    c->docs[c->n++] = (struct tokt_doc){ text, len };
    c->total_bytes += len;
    return 0;
}

int tokt_corpus_synth(struct tokt_corpus *c, uint64_t seed, size_t target_bytes,
                      const char *const *specials, size_t n_specials)
{
    uint64_t s = seed;
    size_t made = 0;
    int r = 0;
    while (made < target_bytes) {
        struct strbuf b = STRBUF_INIT;
        size_t want = 512 + rnd(&s, 6000);
        while (b.len < want && !r) {
            switch (rnd(&s, 10)) {
            case 0: case 1: case 2: r = gen_prose(&b, &s); break;
            case 3: case 4: r = gen_code(&b, &s); break;
            case 5: r = gen_cjk(&b, &s); break;
            case 6: r = gen_emoji(&b, &s); break;
            case 7: r = gen_odd(&b, &s); break;
            case 8: r = gen_space(&b, &s); break;
            default: r = gen_special(&b, &s, specials, n_specials); break;
            }
        }
        if (!r && !b.p)
            r = strbuf_adds(&b, "");
        if (r || (r = add_doc(c, b.p, b.len)) < 0) {
            strbuf_done(&b);
            return r;
        }
        made += b.len;
    }
    return 0;
}

int tokt_corpus_kjv(struct tokt_corpus *c)
{
    FILE *f = popen(TOKT_KJV_CMD, "r");
    struct strbuf all = STRBUF_INIT;
    char tmp[65536];
    size_t n;
    int r = 0;

    if (!f)
        return -ENOENT;
    while ((n = fread(tmp, 1, sizeof(tmp), f)) > 0)
        if ((r = strbuf_add(&all, tmp, n)) < 0)
            break;
    pclose(f);
    if (r < 0 || all.len == 0) {
        strbuf_done(&all);
        return r < 0 ? r : -ENOENT;
    }
    for (size_t i = 0; i < all.len && !r;) {
        size_t end = i + 4096 < all.len ? i + 4096 : all.len;
        while (end < all.len && all.p[end - 1] != '\n')
            end++;
        char *d = malloc(end - i + 1);
        if (!d) {
            r = -ENOMEM;
            break;
        }
        memcpy(d, all.p + i, end - i);
        d[end - i] = '\0';
        if ((r = add_doc(c, d, end - i)) < 0)
            free(d);
        i = end;
    }
    strbuf_done(&all);
    return r;
}

void tokt_corpus_done(struct tokt_corpus *c)
{
    for (size_t i = 0; i < c->n; i++)
        free(c->docs[i].text);
    free(c->docs);
    memset(c, 0, sizeof(*c));
}

uint64_t tokt_fnv64_ids(const int32_t *ids, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t) ids[i];
        for (int k = 0; k < 4; k++) {
            h ^= (v >> (8 * k)) & 0xff;
            h *= 0x100000001b3ull;
        }
    }
    return h;
}
