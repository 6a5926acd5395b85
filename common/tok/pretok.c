/* pretok.c - normalizers and pre-tokenizers: text between added tokens -> words -> BPE.
 *
 * A piece is an (offset, length) in one scratch buffer, so that ByteLevel's add_prefix_space
 * can give a piece a leading space by appending a copy.  Each pre-tokenizer step maps the
 * piece list to a new one; the regex always sees one piece as its whole subject (lookaheads
 * such as \s+(?!\S) stop at the piece end, as in the tokenizers library).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "internal.h"

/* --- normalizers --------------------------------------------------------------------------- */

static int icu_normalize(const UNormalizer2 *nz, struct tok_buf *b)
{
    UErrorCode err = U_ZERO_ERROR;
    int32_t n16 = 0, nn = 0, n8 = 0;
    UChar *src = NULL, *dst = NULL;
    int r = -EINVAL;

    if (b->n > (size_t) INT32_MAX / 4)
        return -E2BIG;
    src = malloc((b->n + 1) * sizeof(UChar));
    if (!src)
        return -ENOMEM;
    u_strFromUTF8(src, (int32_t) b->n + 1, &n16, b->p, (int32_t) b->n, &err);
    if (U_FAILURE(err))
        goto out;
    /* NFKC can grow text up to 18x per code unit (U+FDFA); ask ICU for the size first */
    nn = unorm2_normalize(nz, src, n16, NULL, 0, &err);
    if (err != U_BUFFER_OVERFLOW_ERROR && U_FAILURE(err))
        goto out;
    err = U_ZERO_ERROR;
    dst = malloc(((size_t) nn + 1) * sizeof(UChar));
    if (!dst) {
        r = -ENOMEM;
        goto out;
    }
    unorm2_normalize(nz, src, n16, dst, nn + 1, &err);
    if (U_FAILURE(err))
        goto out;
    u_strToUTF8(NULL, 0, &n8, dst, nn, &err);
    if (err != U_BUFFER_OVERFLOW_ERROR && U_FAILURE(err))
        goto out;
    err = U_ZERO_ERROR;
    b->n = 0;
    if ((r = tok__buf_reserve(b, (size_t) n8)) < 0)
        goto out;
    u_strToUTF8(b->p, n8 + 1, &n8, dst, nn, &err);
    if (U_FAILURE(err)) {
        r = -EINVAL;
        goto out;
    }
    b->n = (size_t) n8;
    b->p[b->n] = '\0';
    r = 0;
out:
    free(src);
    free(dst);
    return r;
}

static int replace_all(struct tok_buf *b, const char *pat, const char *with)
{
    struct tok_buf o = {0};
    size_t lp = strlen(pat), i = 0;
    int r = 0;
    while (i < b->n && r == 0) {
        const char *hit = memmem(b->p + i, b->n - i, pat, lp);
        if (!hit) {
            r = tok__buf_put(&o, b->p + i, b->n - i);
            break;
        }
        r = tok__buf_put(&o, b->p + i, (size_t)(hit - (b->p + i)));
        if (!r)
            r = tok__buf_puts(&o, with);
        i = (size_t)(hit - b->p) + lp;
    }
    if (r == 0) {
        tok__buf_done(b);
        *b = o;
        if (!b->p)
            r = tok__buf_reserve(b, 0);
    } else
        tok__buf_done(&o);
    return r;
}

int tok__normalize(const struct tokenizer *tok, const char *s, size_t n, struct tok_buf *out)
{
    int r;
    out->n = 0;
    if ((r = tok__buf_put(out, s, n)) < 0)
        return r;
    for (size_t i = 0; i < tok->n_norms; i++) {
        const struct tok_norm *nm = &tok->norms[i];
        switch (nm->kind) {
        case TOK_NORM_NFC:
        case TOK_NORM_NFD:
        case TOK_NORM_NFKC:
        case TOK_NORM_NFKD:
            r = icu_normalize(nm->icu, out);
            break;
        case TOK_NORM_PREPEND:
            if (out->n) {
                struct tok_buf p = {0};
                r = tok__buf_puts(&p, nm->a);
                if (!r)
                    r = tok__buf_put(&p, out->p, out->n);
                tok__buf_done(out);
                *out = p;
            }
            break;
        case TOK_NORM_REPLACE:
            r = replace_all(out, nm->a, nm->b);
            break;
        }
        if (r < 0)
            return r;
    }
    return 0;
}

/* --- pre-tokenizers ------------------------------------------------------------------------ */

struct piece {
    size_t off;
    size_t len;
};

struct pieces {
    struct piece *p;
    size_t n;
    size_t cap;
};

static int pieces_push(struct pieces *ps, size_t off, size_t len)
{
    if (!len)
        return 0;
    if (ps->n == ps->cap) {
        struct piece *p = tok__grow(ps->p, &ps->cap, sizeof(*p));
        if (!p)
            return -ENOMEM;
        ps->p = p;
    }
    ps->p[ps->n++] = (struct piece){ off, len };
    return 0;
}

struct seg {
    size_t a, b;
    bool match;
};

struct segs {
    struct seg *s;
    size_t n, cap;
};

static int segs_push(struct segs *v, size_t a, size_t b, bool match)
{
    if (v->n == v->cap) {
        struct seg *s = tok__grow(v->s, &v->cap, sizeof(*s));
        if (!s)
            return -ENOMEM;
        v->s = s;
    }
    v->s[v->n++] = (struct seg){ a, b, match };
    return 0;
}

/* Cut subject into alternating gap / match segments (tokenizers' Pattern::find_matches). */
static int find_matches(const pcre2_code *re, pcre2_match_data *md, const char *subj, size_t n,
                        struct segs *out)
{
    size_t start = 0, prev = 0;
    int r;
    out->n = 0;
    while (start <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR) subj, n, start, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0)
            return rc == PCRE2_ERROR_NOMEMORY ? -ENOMEM : -E2BIG;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t a = ov[0], b = ov[1];
        if (a == b) {
            uint32_t cp;
            if (a >= n)
                break;
            start = a + (size_t) tok__utf8_next(subj + a, n - a, &cp);
            continue;
        }
        if (a > prev && (r = segs_push(out, prev, a, false)) < 0)
            return r;
        if ((r = segs_push(out, a, b, true)) < 0)
            return r;
        prev = start = b;
    }
    if (prev < n && (r = segs_push(out, prev, n, false)) < 0)
        return r;
    return 0;
}

/* Apply a Split behaviour to the segments in place (tokenizers' NormalizedString::split). */
static void apply_behavior(enum tok_split_behavior beh, struct segs *v)
{
    size_t k = 0;
    bool prev_match = false;

    switch (beh) {
    case TOK_SPLIT_ISOLATED:
        return;
    case TOK_SPLIT_REMOVED:
        for (size_t i = 0; i < v->n; i++)
            if (!v->s[i].match)
                v->s[k++] = v->s[i];
        v->n = k;
        return;
    case TOK_SPLIT_MERGED_PREV:
    case TOK_SPLIT_CONTIGUOUS:
        /* merged with previous: a match joins the gap before it; contiguous: neighbours of
         * the same kind join */
        for (size_t i = 0; i < v->n; i++) {
            struct seg g = v->s[i];
            bool join = beh == TOK_SPLIT_CONTIGUOUS ? g.match == prev_match
                                                    : g.match && !prev_match;
            if (join && k > 0)
                v->s[k - 1].b = g.b;
            else
                v->s[k++] = g;
            prev_match = g.match;
        }
        v->n = k;
        return;
    case TOK_SPLIT_MERGED_NEXT:
        /* walk backwards, compacting towards the end, then shift down */
        k = v->n;
        for (size_t i = v->n; i-- > 0;) {
            struct seg g = v->s[i];
            if (g.match && !prev_match && k < v->n)
                v->s[k].a = g.a;
            else
                v->s[--k] = g;
            prev_match = g.match;
        }
        memmove(v->s, v->s + k, (v->n - k) * sizeof(*v->s));
        v->n -= k;
        return;
    }
}

struct pretok_ctx {
    struct tok_buf scratch;
    struct pieces a, b;
    struct segs segs;
    pcre2_match_data *md;
};

static int step_split(struct pretok_ctx *c, const struct tok_pre *pre, struct piece pc)
{
    int r = find_matches(pre->re, c->md, c->scratch.p + pc.off, pc.len, &c->segs);
    if (r < 0)
        return r;
    apply_behavior(pre->behavior, &c->segs);
    for (size_t i = 0; i < c->segs.n; i++)
        if ((r = pieces_push(&c->b, pc.off + c->segs.s[i].a,
                             c->segs.s[i].b - c->segs.s[i].a)) < 0)
            return r;
    return 0;
}

static int step_bytelevel(struct pretok_ctx *c, const struct tok_pre *pre, struct piece pc)
{
    int r;
    if (pre->add_prefix_space && c->scratch.p[pc.off] != ' ') {
        size_t off = c->scratch.n;
        /* reserve first: the copy's source lives in the same buffer */
        if ((r = tok__buf_reserve(&c->scratch, pc.len + 1)) < 0 ||
            (r = tok__buf_putc(&c->scratch, ' ')) < 0 ||
            (r = tok__buf_put(&c->scratch, c->scratch.p + pc.off, pc.len)) < 0)
            return r;
        pc = (struct piece){ off, pc.len + 1 };
    }
    if (!pre->re)
        return pieces_push(&c->b, pc.off, pc.len);
    return step_split(c, pre, pc);
}

int tok__pretokenize_encode(const struct tokenizer *tok, const char *s, size_t n,
                            struct tok_ids *out)
{
    struct pretok_ctx c = {0};
    int r;

    if (!n)
        return 0;
    if ((r = tok__buf_put(&c.scratch, s, n)) < 0 || (r = pieces_push(&c.a, 0, n)) < 0)
        goto out;
    c.md = pcre2_match_data_create(1, NULL);
    if (!c.md) {
        r = -ENOMEM;
        goto out;
    }
    for (size_t k = 0; k < tok->n_pres; k++) {
        const struct tok_pre *pre = &tok->pres[k];
        c.b.n = 0;
        for (size_t i = 0; i < c.a.n; i++) {
            r = pre->kind == TOK_PRE_SPLIT ? step_split(&c, pre, c.a.p[i])
                                           : step_bytelevel(&c, pre, c.a.p[i]);
            if (r < 0)
                goto out;
        }
        struct pieces t = c.a;
        c.a = c.b;
        c.b = t;
    }
    for (size_t i = 0; i < c.a.n; i++)
        if ((r = tok__bpe_word(tok, c.scratch.p + c.a.p[i].off, c.a.p[i].len, out)) < 0)
            goto out;
    r = 0;
out:
    pcre2_match_data_free(c.md);
    tok__buf_done(&c.scratch);
    free(c.a.p);
    free(c.b.p);
    free(c.segs.s);
    return r;
}
