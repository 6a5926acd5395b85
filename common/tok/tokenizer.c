/* tokenizer.c - tokenizer.json loading, token tables, encode/decode entry points.
 *
 * Loading reads the whole file with jansson, checks every field this file understands and
 * refuses the ones it does not (so that a silently different tokenization can never happen),
 * then builds: the id table with each token's decoded bytes, a string->id hash, the merge
 * hash (pair of ids -> rank and merged id) and the added-token list sorted for matching.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <unicode/unorm2.h>
#include <unicode/uset.h>

#include "file.h"
#include "internal.h"

/* GPT-2 bytes_to_unicode(): printable bytes map to themselves, the others to 256 + n. */
const uint16_t tok__byte_to_cp[256] = {
#define R(a) (a)
    256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 266, 267, 268, 269, 270, 271,
    272, 273, 274, 275, 276, 277, 278, 279, 280, 281, 282, 283, 284, 285, 286, 287,
    288, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
    48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63,
    64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79,
    80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95,
    96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111,
    112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 289,
    290, 291, 292, 293, 294, 295, 296, 297, 298, 299, 300, 301, 302, 303, 304, 305,
    306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317, 318, 319, 320, 321,
    322, 161, 162, 163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 323, 174, 175,
    176, 177, 178, 179, 180, 181, 182, 183, 184, 185, 186, 187, 188, 189, 190, 191,
    192, 193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203, 204, 205, 206, 207,
    208, 209, 210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220, 221, 222, 223,
    224, 225, 226, 227, 228, 229, 230, 231, 232, 233, 234, 235, 236, 237, 238, 239,
    240, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 251, 252, 253, 254, 255,
#undef R
};

int tok__cp_to_byte(uint32_t cp)
{
    static int16_t inv[324];
    static int ready;
    if (!__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) {
        int16_t tmp[324];
        for (int i = 0; i < 324; i++)
            tmp[i] = -1;
        for (int b = 0; b < 256; b++)
            tmp[tok__byte_to_cp[b]] = (int16_t) b;
        memcpy(inv, tmp, sizeof(inv));
        __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
    }
    return cp < 324 ? inv[cp] : -1;
}

/* --- hash tables ---------------------------------------------------------------------------- */

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

int32_t tok__str_lookup(const struct tokenizer *tok, const char *s, size_t n)
{
    size_t i = tok__hash(s, n) & tok->str_mask;
    for (;;) {
        int32_t v = tok->str_slots[i];
        if (!v)
            return -ENOENT;
        const struct tok_token *t = &tok->tokens[v - 1];
        if (t->len == n && memcmp(t->str, s, n) == 0)
            return v - 1;
        i = (i + 1) & tok->str_mask;
    }
}

/* Insert id under its string unless that string is already present (first one wins). */
static void str_insert(struct tokenizer *tok, int32_t id)
{
    const struct tok_token *t = &tok->tokens[id];
    size_t i = tok__hash(t->str, t->len) & tok->str_mask;
    for (;;) {
        int32_t v = tok->str_slots[i];
        if (!v) {
            tok->str_slots[i] = id + 1;
            return;
        }
        const struct tok_token *o = &tok->tokens[v - 1];
        if (o->len == t->len && memcmp(o->str, t->str, t->len) == 0)
            return;
        i = (i + 1) & tok->str_mask;
    }
}

static inline uint64_t pair_key(int32_t a, int32_t b)
{
    return ((uint64_t)(uint32_t) a << 32) | (uint32_t) b;
}

static inline size_t pair_slot(uint64_t key, size_t mask)
{
    key ^= key >> 31;
    key *= 0x9e3779b97f4a7c15ull;
    key ^= key >> 29;
    return (size_t) key & mask;
}

int32_t tok__merge_lookup(const struct tokenizer *tok, int32_t a, int32_t b, int32_t *ret_merged)
{
    uint64_t key = pair_key(a, b);
    size_t i = pair_slot(key, tok->merge_mask);
    for (;;) {
        const struct tok_merge_slot *s = &tok->merges[i];
        if (s->rank < 0)
            return -1;
        if (s->key == key) {
            *ret_merged = s->merged;
            return s->rank;
        }
        i = (i + 1) & tok->merge_mask;
    }
}

/* --- loading -------------------------------------------------------------------------------- */

/* The decoder's view of a token: each char mapped back through the byte map; a token with a
 * char outside the map is taken as its own UTF-8 bytes (tokenizers' ByteLevel decoder). */
static int token_set_bytes(struct tok_token *t)
{
    char *b = malloc(t->len + 1);
    size_t n = 0;
    if (!b)
        return -ENOMEM;
    for (size_t i = 0; i < t->len;) {
        uint32_t cp;
        i += (size_t) tok__utf8_next(t->str + i, t->len - i, &cp);
        int byte = tok__cp_to_byte(cp);
        if (byte < 0) {
            free(b);
            t->bytes = t->str;
            t->n_bytes = t->len;
            return 0;
        }
        b[n++] = (char) byte;
    }
    b[n] = '\0';
    t->bytes = b;
    t->n_bytes = (uint32_t) n;
    return 0;
}

static int ensure_tokens(struct tokenizer *tok, size_t n_tokens)
{
    if (n_tokens <= tok->n_tokens)
        return 0;
    struct tok_token *t = realloc(tok->tokens, n_tokens * sizeof(*t));
    if (!t)
        return -ENOMEM;
    memset(t + tok->n_tokens, 0, (n_tokens - tok->n_tokens) * sizeof(*t));
    tok->tokens = t;
    tok->n_tokens = n_tokens;
    return 0;
}

static int set_token(struct tokenizer *tok, int32_t id, const char *s, size_t len,
                     struct err_buf *e)
{
    struct tok_token *t = &tok->tokens[id];
    if (t->present) {
        if (t->len == len && memcmp(t->str, s, len) == 0)
            return 0;
        return err_set(e, -EINVAL, "id %d is given to both '%s' and '%.*s'", id, t->str,
                       (int) len, s);
    }
    if (tok_utf8_valid_prefix(s, len) != len)
        return err_set(e, -EILSEQ, "token with id %d is not valid UTF-8", id);
    t->str = malloc(len + 1);
    if (!t->str)
        return -ENOMEM;
    memcpy(t->str, s, len);
    t->str[len] = '\0';
    t->len = (uint32_t) len;
    t->present = true;
    return token_set_bytes(t);
}

static int load_vocab(struct tokenizer *tok, json_t *vocab, struct err_buf *e)
{
    const char *key;
    json_t *val;
    int64_t max_id = -1;
    int r;

    if (!json_is_object(vocab))
        return err_set(e, -EINVAL, "model.vocab is not an object");
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) > INT32_MAX - 1)
            return err_set(e, -EINVAL, "model.vocab['%s'] is not a valid id", key);
        if (json_integer_value(val) > max_id)
            max_id = json_integer_value(val);
    }
    if ((r = ensure_tokens(tok, (size_t)(max_id + 1))) < 0)
        return r;
    json_object_foreach(vocab, key, val) {
        r = set_token(tok, (int32_t) json_integer_value(val), key, strlen(key), e);
        if (r < 0)
            return r;
    }
    return 0;
}

static int merge_insert(struct tokenizer *tok, int32_t a, int32_t b, int32_t rank, int32_t m)
{
    uint64_t key = pair_key(a, b);
    size_t i = pair_slot(key, tok->merge_mask);
    for (;;) {
        struct tok_merge_slot *s = &tok->merges[i];
        if (s->rank < 0) {
            s->key = key;
            s->rank = rank;
            s->merged = m;
            return 0;
        }
        if (s->key == key)
            return 0;       /* a repeated merge keeps its first (best) rank */
        i = (i + 1) & tok->merge_mask;
    }
}

static int load_merges(struct tokenizer *tok, json_t *merges, struct err_buf *e)
{
    size_t n = json_is_array(merges) ? json_array_size(merges) : 0;
    char tmp[1024];

    if (!json_is_array(merges))
        return err_set(e, -EINVAL, "model.merges is not an array");
    tok->merge_mask = pow2_at_least(n * 2 + 1) - 1;
    tok->merges = malloc((tok->merge_mask + 1) * sizeof(*tok->merges));
    if (!tok->merges)
        return -ENOMEM;
    for (size_t i = 0; i <= tok->merge_mask; i++)
        tok->merges[i].rank = -1;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(merges, i);
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' '))
                return err_set(e, -EINVAL, "model.merges[%zu] '%s' is not two tokens "
                               "separated by one space", i, s);
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            la = strlen(a);
            lb = strlen(b);
        } else
            return err_set(e, -EINVAL, "model.merges[%zu] is neither \"a b\" nor [a, b]", i);
        char *cat = la + lb < sizeof(tmp) ? tmp : malloc(la + lb);
        if (!cat)
            return -ENOMEM;
        int32_t ia = tok__str_lookup(tok, a, la), ib = tok__str_lookup(tok, b, lb);
        memcpy(cat, a, la);
        memcpy(cat + la, b, lb);
        int32_t im = tok__str_lookup(tok, cat, la + lb);
        if (cat != tmp)
            free(cat);
        if (ia < 0 || ib < 0 || im < 0)
            return err_set(e, -EINVAL, "model.merges[%zu] '%.*s' + '%.*s': %s not in the "
                           "vocab", i, (int) la, a, (int) lb, b,
                           ia < 0 ? "left token" : ib < 0 ? "right token" : "merged token");
        int r = merge_insert(tok, ia, ib, (int32_t) i, im);
        if (r < 0)
            return r;
    }
    return 0;
}

static int load_model(struct tokenizer *tok, json_t *model, struct err_buf *e)
{
    json_t *v;
    int r;

    if (!json_is_object(model))
        return err_set(e, -EINVAL, "'model' is missing");
    v = json_object_get(model, "type");
    if (v && (!json_is_string(v) || strcmp(json_string_value(v), "BPE") != 0))
        return err_set(e, -ENOTSUP, "model type '%s' is not supported (only BPE)",
                       json_is_string(v) ? json_string_value(v) : "?");
    if ((v = json_object_get(model, "dropout")) && !json_is_null(v) &&
        !(json_is_number(v) && json_number_value(v) == 0.0))
        return err_set(e, -ENOTSUP, "BPE dropout is not supported");
    if ((v = json_object_get(model, "continuing_subword_prefix")) && !json_is_null(v) &&
        !(json_is_string(v) && !*json_string_value(v)))
        return err_set(e, -ENOTSUP, "BPE continuing_subword_prefix is not supported");
    if ((v = json_object_get(model, "end_of_word_suffix")) && !json_is_null(v) &&
        !(json_is_string(v) && !*json_string_value(v)))
        return err_set(e, -ENOTSUP, "BPE end_of_word_suffix is not supported");
    if ((v = json_object_get(model, "byte_fallback")) && json_is_true(v))
        return err_set(e, -ENOTSUP, "BPE byte_fallback is not supported");
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    if ((r = load_vocab(tok, json_object_get(model, "vocab"), e)) < 0)
        return r;
    return 0;
}

static int load_added(struct tokenizer *tok, json_t *arr, struct err_buf *e)
{
    size_t n;
    int r;

    if (!arr || json_is_null(arr))
        return 0;
    if (!json_is_array(arr))
        return err_set(e, -EINVAL, "added_tokens is not an array");
    n = json_array_size(arr);
    for (size_t i = 0; i < n; i++) {
        json_t *a = json_array_get(arr, i), *id = json_object_get(a, "id"),
               *c = json_object_get(a, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) > INT32_MAX - 1 || !json_is_string(c) ||
            !*json_string_value(c))
            return err_set(e, -EINVAL, "added_tokens[%zu] needs an integer id and a non-empty "
                           "content", i);
        if ((r = ensure_tokens(tok, (size_t) json_integer_value(id) + 1)) < 0)
            return r;
    }
    tok->added = calloc(n ? n : 1, sizeof(*tok->added));
    if (!tok->added)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        json_t *a = json_array_get(arr, i);
        int32_t id = (int32_t) json_integer_value(json_object_get(a, "id"));
        const char *c = json_string_value(json_object_get(a, "content"));
        if ((r = set_token(tok, id, c, strlen(c), e)) < 0)
            return r;
        struct tok_token *t = &tok->tokens[id];
        struct tok_added *ad = &tok->added[tok->n_added++];
        t->added = true;
        t->special = json_is_true(json_object_get(a, "special"));
        ad->id = id;
        ad->content = t->str;
        ad->len = t->len;
        ad->special = t->special;
        /* the library's default for a missing flag is "normalized unless special" */
        json_t *nv = json_object_get(a, "normalized");
        ad->normalized = nv ? json_is_true(nv) : !t->special;
        ad->lstrip = json_is_true(json_object_get(a, "lstrip"));
        ad->rstrip = json_is_true(json_object_get(a, "rstrip"));
        ad->single_word = json_is_true(json_object_get(a, "single_word"));
        tok->added_first[(unsigned char) c[0]] = true;
        if (ad->normalized)
            tok->has_normalized_added = true;
    }
    return 0;
}

static int cmp_added(const void *pa, const void *pb)
{
    const struct tok_added *a = pa, *b = pb;
    unsigned char fa = (unsigned char) a->content[0], fb = (unsigned char) b->content[0];
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int load_norm_one(struct tokenizer *tok, json_t *n, struct err_buf *e);

static int load_normalizer(struct tokenizer *tok, json_t *n, struct err_buf *e)
{
    const char *type;

    if (!n || json_is_null(n))
        return 0;
    type = json_string_value(json_object_get(n, "type"));
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return err_set(e, -EINVAL, "normalizer Sequence without 'normalizers'");
        for (size_t i = 0; i < json_array_size(list); i++) {
            int r = load_normalizer(tok, json_array_get(list, i), e);
            if (r < 0)
                return r;
        }
        return 0;
    }
    return load_norm_one(tok, n, e);
}

static int load_norm_one(struct tokenizer *tok, json_t *n, struct err_buf *e)
{
    const char *type = json_string_value(json_object_get(n, "type"));
    struct tok_norm nm = {0};
    UErrorCode uerr = U_ZERO_ERROR;

    if (!type)
        return err_set(e, -EINVAL, "normalizer without a type");
    if (!strcmp(type, "NFC"))
        nm.kind = TOK_NORM_NFC, nm.icu = unorm2_getNFCInstance(&uerr);
    else if (!strcmp(type, "NFD"))
        nm.kind = TOK_NORM_NFD, nm.icu = unorm2_getNFDInstance(&uerr);
    else if (!strcmp(type, "NFKC"))
        nm.kind = TOK_NORM_NFKC, nm.icu = unorm2_getNFKCInstance(&uerr);
    else if (!strcmp(type, "NFKD"))
        nm.kind = TOK_NORM_NFKD, nm.icu = unorm2_getNFKDInstance(&uerr);
    else if (!strcmp(type, "Prepend") && json_is_string(json_object_get(n, "prepend"))) {
        nm.kind = TOK_NORM_PREPEND;
        nm.a = strdup(json_string_value(json_object_get(n, "prepend")));
    } else if (!strcmp(type, "Replace") &&
               json_is_string(json_object_get(json_object_get(n, "pattern"), "String")) &&
               json_is_string(json_object_get(n, "content"))) {
        nm.kind = TOK_NORM_REPLACE;
        nm.a = strdup(json_string_value(json_object_get(json_object_get(n, "pattern"),
                                                        "String")));
        nm.b = strdup(json_string_value(json_object_get(n, "content")));
        if (nm.a && !*nm.a) {
            free(nm.a);
            free(nm.b);
            return err_set(e, -EINVAL, "normalizer Replace with an empty pattern");
        }
    } else
        return err_set(e, -ENOTSUP, "normalizer '%s' is not supported", type);
    if (nm.icu && U_SUCCESS(uerr)) {
        /* The tokenizers library normalizes with Unicode 9.0 tables: later characters are
         * left alone there, so restrict ICU (current Unicode) to the 9.0 repertoire. */
        static const UChar age_pat[] = u"[:age=9.0:]";
        USet *set = uset_openPattern(age_pat, -1, &uerr);
        UNormalizer2 *f = U_SUCCESS(uerr) ? unorm2_openFiltered(nm.icu, set, &uerr) : NULL;
        if (!f)
            uset_close(set);
        nm.icu = f;
        nm.icu_set = set;
    }
    if (U_FAILURE(uerr))
        return err_set(e, -EIO, "ICU normalizer %s: %s", type, u_errorName(uerr));
    if ((nm.kind == TOK_NORM_PREPEND && !nm.a) || (nm.kind == TOK_NORM_REPLACE && (!nm.a || !nm.b))) {
        free(nm.a);
        free(nm.b);
        return -ENOMEM;
    }
    struct tok_norm *p = realloc(tok->norms, (tok->n_norms + 1) * sizeof(*p));
    if (!p) {
        free(nm.a);
        free(nm.b);
        return -ENOMEM;
    }
    tok->norms = p;
    tok->norms[tok->n_norms++] = nm;
    return 0;
}

/* The regex ByteLevel uses when use_regex is true: part of ByteLevel's definition in the
 * tokenizers library (byte_level.rs), not something tokenizer.json carries. */
static const char gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int compile_regex(const char *pat, pcre2_code **ret, struct err_buf *e)
{
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) pat, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &code, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return err_set(e, -EINVAL, "pre-tokenizer regex '%s' at offset %zu: %s", pat,
                       (size_t) off, (const char *) msg);
    }
    (void) pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* interpreter fallback if no JIT */
    *ret = re;
    return 0;
}

static int add_pre(struct tokenizer *tok, struct tok_pre *p)
{
    struct tok_pre *n = realloc(tok->pres, (tok->n_pres + 1) * sizeof(*n));
    if (!n) {
        pcre2_code_free(p->re);
        return -ENOMEM;
    }
    tok->pres = n;
    tok->pres[tok->n_pres++] = *p;
    return 0;
}

static int load_pre(struct tokenizer *tok, json_t *p, struct err_buf *e)
{
    const char *type;
    struct tok_pre pre = {0};
    int r;

    if (!p || json_is_null(p))
        return 0;
    type = json_string_value(json_object_get(p, "type"));
    if (!type)
        return err_set(e, -EINVAL, "pre_tokenizer without a type");
    if (!strcmp(type, "Sequence")) {
        json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return err_set(e, -EINVAL, "pre_tokenizer Sequence without 'pretokenizers'");
        for (size_t i = 0; i < json_array_size(list); i++)
            if ((r = load_pre(tok, json_array_get(list, i), e)) < 0)
                return r;
        return 0;
    }
    if (!strcmp(type, "ByteLevel")) {
        json_t *ur = json_object_get(p, "use_regex");
        pre.kind = TOK_PRE_BYTELEVEL;
        pre.add_prefix_space = json_is_true(json_object_get(p, "add_prefix_space"));
        if (!ur || json_is_true(ur))
            if ((r = compile_regex(gpt2_regex, &pre.re, e)) < 0)
                return r;
        return add_pre(tok, &pre);
    }
    if (!strcmp(type, "Split")) {
        json_t *pat = json_object_get(p, "pattern");
        const char *beh = json_string_value(json_object_get(p, "behavior"));
        pre.kind = TOK_PRE_SPLIT;
        if (json_is_true(json_object_get(p, "invert")))
            return err_set(e, -ENOTSUP, "pre_tokenizer Split with invert=true is not supported");
        if (!beh || !strcmp(beh, "Isolated"))
            pre.behavior = TOK_SPLIT_ISOLATED;
        else if (!strcmp(beh, "Removed"))
            pre.behavior = TOK_SPLIT_REMOVED;
        else if (!strcmp(beh, "MergedWithPrevious"))
            pre.behavior = TOK_SPLIT_MERGED_PREV;
        else if (!strcmp(beh, "MergedWithNext"))
            pre.behavior = TOK_SPLIT_MERGED_NEXT;
        else if (!strcmp(beh, "Contiguous"))
            pre.behavior = TOK_SPLIT_CONTIGUOUS;
        else
            return err_set(e, -ENOTSUP, "Split behavior '%s' is not supported", beh);
        if (json_is_string(json_object_get(pat, "Regex"))) {
            r = compile_regex(json_string_value(json_object_get(pat, "Regex")), &pre.re, e);
        } else if (json_is_string(json_object_get(pat, "String"))) {
            /* a literal string: quote it for PCRE2 */
            const char *s = json_string_value(json_object_get(pat, "String"));
            struct tok_buf q = {0};
            r = tok__buf_puts(&q, "\\Q");
            if (!r)
                r = tok__buf_puts(&q, s);
            if (!r)
                r = tok__buf_puts(&q, "\\E");
            if (!r && !*s)
                r = err_set(e, -EINVAL, "Split with an empty string pattern");
            if (!r)
                r = compile_regex(q.p, &pre.re, e);
            tok__buf_done(&q);
        } else
            r = err_set(e, -EINVAL, "Split pattern is neither Regex nor String");
        if (r < 0)
            return r;
        return add_pre(tok, &pre);
    }
    return err_set(e, -ENOTSUP, "pre_tokenizer '%s' is not supported", type);
}

static int load_decoder(json_t *d, struct err_buf *e)
{
    const char *type;
    if (!d || json_is_null(d))
        return err_set(e, -ENOTSUP, "a tokenizer without a decoder is not supported (only "
                       "ByteLevel)");
    type = json_string_value(json_object_get(d, "type"));
    if (type && !strcmp(type, "ByteLevel"))
        return 0;
    return err_set(e, -ENOTSUP, "decoder '%s' is not supported (only ByteLevel)",
                   type ? type : "?");
}

static int post_ids(struct tokenizer *tok, json_t *list, bool *seen_a, int32_t **pre,
                    size_t *n_pre, int32_t **post, size_t *n_post, struct err_buf *e)
{
    *pre = calloc(json_array_size(list) + 1, sizeof(int32_t));
    *post = calloc(json_array_size(list) + 1, sizeof(int32_t));
    if (!*pre || !*post)
        return -ENOMEM;
    for (size_t i = 0; i < json_array_size(list); i++) {
        json_t *it = json_array_get(list, i), *sp = json_object_get(it, "SpecialToken");
        if (json_object_get(it, "Sequence")) {
            *seen_a = true;
            continue;
        }
        const char *name = json_string_value(json_object_get(sp, "id"));
        int32_t id = name ? tok__str_lookup(tok, name, strlen(name)) : -ENOENT;
        if (id < 0)
            return err_set(e, -EINVAL, "post_processor special token '%s' is not a token",
                           name ? name : "?");
        if (*seen_a)
            (*post)[(*n_post)++] = id;
        else
            (*pre)[(*n_pre)++] = id;
    }
    return 0;
}

static int load_post(struct tokenizer *tok, json_t *p, struct err_buf *e)
{
    const char *type;
    bool seen_a = false;

    if (!p || json_is_null(p))
        return 0;
    type = json_string_value(json_object_get(p, "type"));
    if (type && !strcmp(type, "ByteLevel"))
        return 0;
    if (type && !strcmp(type, "TemplateProcessing") &&
        json_is_array(json_object_get(p, "single"))) {
        int r = post_ids(tok, json_object_get(p, "single"), &seen_a, &tok->post_pre,
                         &tok->n_post_pre, &tok->post_post, &tok->n_post_post, e);
        if (r < 0)
            return r;
        if (tok->n_post_pre)
            tok->bos_id = tok->post_pre[0];
        return 0;
    }
    return err_set(e, -ENOTSUP, "post_processor '%s' is not supported", type ? type : "?");
}

static int build_tables(struct tokenizer *tok, struct err_buf *e)
{
    tok->str_mask = pow2_at_least(tok->n_tokens * 2 + 1) - 1;
    tok->str_slots = calloc(tok->str_mask + 1, sizeof(int32_t));
    if (!tok->str_slots)
        return -ENOMEM;
    /* added tokens first so that their id wins a string clash, as in the library */
    for (size_t i = 0; i < tok->n_added; i++)
        str_insert(tok, tok->added[i].id);
    for (size_t id = 0; id < tok->n_tokens; id++)
        if (tok->tokens[id].present)
            str_insert(tok, (int32_t) id);
    for (int b = 0; b < 256; b++) {
        char s[4];
        int n = tok__utf8_put(s, tok__byte_to_cp[b]);
        tok->byte_id[b] = tok__str_lookup(tok, s, (size_t) n);
        if (tok->byte_id[b] < 0)
            tok->byte_id[b] = -1;
    }
    if (tok->n_added)
        qsort(tok->added, tok->n_added, sizeof(*tok->added), cmp_added);
    tok->cache_mask = (1u << 16) - 1;
    tok->cache = calloc(tok->cache_mask + 1, sizeof(*tok->cache));
    if (!tok->cache)
        return -ENOMEM;
    (void) e;
    return 0;
}

static int load_doc(struct tokenizer *tok, json_t *root, struct err_buf *e)
{
    json_t *model = json_object_get(root, "model"), *v;
    int r;

    if (!json_is_object(root))
        return err_set(e, -EINVAL, "top level is not an object");
    if ((r = load_model(tok, model, e)) < 0 ||
        (r = load_added(tok, json_object_get(root, "added_tokens"), e)) < 0 ||
        (r = build_tables(tok, e)) < 0 ||
        (r = load_merges(tok, json_object_get(model, "merges"), e)) < 0 ||
        (r = load_normalizer(tok, json_object_get(root, "normalizer"), e)) < 0 ||
        (r = load_pre(tok, json_object_get(root, "pre_tokenizer"), e)) < 0 ||
        (r = load_decoder(json_object_get(root, "decoder"), e)) < 0 ||
        (r = load_post(tok, json_object_get(root, "post_processor"), e)) < 0)
        return r;
    v = json_object_get(model, "unk_token");
    if (json_is_string(v)) {
        tok->unk_id = tok__str_lookup(tok, json_string_value(v), strlen(json_string_value(v)));
        if (tok->unk_id < 0)
            return err_set(e, -EINVAL, "unk_token '%s' is not in the vocab", json_string_value(v));
    }
    if ((v = json_object_get(root, "truncation")) && !json_is_null(v))
        return err_set(e, -ENOTSUP, "truncation settings are not supported");
    if ((v = json_object_get(root, "padding")) && !json_is_null(v))
        return err_set(e, -ENOTSUP, "padding settings are not supported");
    return 0;
}

static struct tokenizer *tok_alloc(void)
{
    struct tokenizer *tok = calloc(1, sizeof(*tok));
    if (!tok)
        return NULL;
    tok->unk_id = -1;
    tok->bos_id = -ENOENT;
    pthread_mutex_init(&tok->cache_lock, NULL);
    return tok;
}

int tok_load_json(const char *json, size_t len, struct tokenizer **ret_tok, struct err_buf *e)
{
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    struct tokenizer *tok;
    int r;

    if (!root)
        return err_set(e, -EINVAL, "JSON error at line %d column %d: %s", jerr.line,
                       jerr.column, jerr.text);
    tok = tok_alloc();
    if (!tok) {
        json_decref(root);
        return -ENOMEM;
    }
    r = load_doc(tok, root, e);
    json_decref(root);
    if (r < 0) {
        tok_free(tok);
        return r;
    }
    *ret_tok = tok;
    return 0;
}

int tok_load(const char *path, struct tokenizer **ret_tok, struct err_buf *e)
{
    char *buf;
    size_t size;
    int r = file_read_all(path, (size_t)1 << 30, 0, &buf, &size);

    if (r < 0)
        return err_set(e, r, "%s: %s", path, err_str(r));
    r = tok_load_json(buf, size, ret_tok, e);
    if (r < 0)
        err_prefix(e, "%s", path);
    free(buf);
    return r;
}

void tok_free(struct tokenizer *tok)
{
    if (!tok)
        return;
    for (size_t i = 0; i < tok->n_tokens; i++) {
        if (tok->tokens[i].bytes != tok->tokens[i].str)
            free(tok->tokens[i].bytes);
        free(tok->tokens[i].str);
    }
    free(tok->tokens);
    free(tok->str_slots);
    free(tok->added);
    for (size_t i = 0; i < tok->n_norms; i++) {
        if (tok->norms[i].icu_set) {
            unorm2_close((UNormalizer2 *) tok->norms[i].icu);
            uset_close((USet *) tok->norms[i].icu_set);
        }
        free(tok->norms[i].a);
        free(tok->norms[i].b);
    }
    free(tok->norms);
    for (size_t i = 0; i < tok->n_pres; i++)
        pcre2_code_free(tok->pres[i].re);
    free(tok->pres);
    free(tok->merges);
    free(tok->post_pre);
    free(tok->post_post);
    if (tok->cache) {
        tok__cache_clear(tok);
        free(tok->cache);
    }
    pthread_mutex_destroy(&tok->cache_lock);
    free(tok);
}

/* --- lookups ------------------------------------------------------------------------------ */

size_t tok_vocab_size(const struct tokenizer *tok)
{
    return tok->n_tokens;
}

const char *tok_id_to_token(const struct tokenizer *tok, int32_t id)
{
    if (id < 0 || (size_t) id >= tok->n_tokens || !tok->tokens[id].present)
        return NULL;
    return tok->tokens[id].str;
}

const char *tok_id_bytes(const struct tokenizer *tok, int32_t id, size_t *ret_len)
{
    if (id < 0 || (size_t) id >= tok->n_tokens || !tok->tokens[id].present)
        return NULL;
    if (ret_len)
        *ret_len = tok->tokens[id].n_bytes;
    return tok->tokens[id].bytes;
}

int32_t tok_token_to_id(const struct tokenizer *tok, const char *token)
{
    return tok__str_lookup(tok, token, strlen(token));
}

int32_t tok_added_id(const struct tokenizer *tok, const char *s)
{
    int32_t id = tok__str_lookup(tok, s, strlen(s));
    if (id < 0 || !tok->tokens[id].added)
        return -ENOENT;
    return id;
}

bool tok_id_is_special(const struct tokenizer *tok, int32_t id)
{
    return id >= 0 && (size_t) id < tok->n_tokens && tok->tokens[id].special;
}

bool tok_id_is_added(const struct tokenizer *tok, int32_t id)
{
    return id >= 0 && (size_t) id < tok->n_tokens && tok->tokens[id].added;
}

int32_t tok_bos_id(const struct tokenizer *tok)
{
    return tok->bos_id;
}

void tok_bos_set(struct tokenizer *tok, int32_t id)
{
    tok->bos_id = id;
}

/* --- encode ------------------------------------------------------------------------------- */

static bool is_ws(const char *s, size_t n, size_t *ret_len)
{
    uint32_t cp;
    int k = tok__utf8_next(s, n, &cp);
    *ret_len = (size_t) k;
    return (cp >= 9 && cp <= 13) || cp == ' ' || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000;
}

static bool is_word_byte(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           c == '_' || c >= 0x80;
}

/* Longest added token (of the wanted kind) matching at s[i..n); NULL if none. */
static const struct tok_added *match_added(const struct tokenizer *tok, const char *s, size_t i,
                                           size_t n, bool normalized, bool special_ok)
{
    unsigned char c = (unsigned char) s[i];
    size_t lo = 0, hi = tok->n_added;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((unsigned char) tok->added[mid].content[0] < c)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t k = lo; k < tok->n_added && (unsigned char) tok->added[k].content[0] == c; k++) {
        const struct tok_added *a = &tok->added[k];
        if (a->normalized != normalized || (a->special && !special_ok) || a->len > n - i ||
            memcmp(s + i, a->content, a->len) != 0)
            continue;
        if (a->single_word && ((i > 0 && is_word_byte((unsigned char) s[i - 1])) ||
                               (i + a->len < n && is_word_byte((unsigned char) s[i + a->len]))))
            continue;
        return a;
    }
    return NULL;
}

typedef int (*piece_fn)(const struct tokenizer *tok, const char *s, size_t n, unsigned flags,
                        struct tok_ids *out);

/* Split s into added tokens and the text between them; text goes to fn, tokens to out. */
static int split_added(const struct tokenizer *tok, const char *s, size_t n, bool normalized,
                       unsigned flags, piece_fn fn, struct tok_ids *out)
{
    size_t start = 0, i = 0;
    int r;
    bool special_ok = flags & TOK_ENCODE_SPECIAL;

    while (i < n) {
        const struct tok_added *a = NULL;
        if (tok->added_first[(unsigned char) s[i]])
            a = match_added(tok, s, i, n, normalized, special_ok);
        if (!a) {
            i++;
            continue;
        }
        size_t end = i + a->len, text_end = i, wl;
        if (a->lstrip)
            while (text_end > start) {
                size_t k = text_end - 1;
                while (k > start && ((unsigned char) s[k] & 0xc0) == 0x80)
                    k--;
                if (!is_ws(s + k, text_end - k, &wl))
                    break;
                text_end = k;
            }
        if (a->rstrip)
            while (end < n && is_ws(s + end, n - end, &wl))
                end += wl;
        if (text_end > start && (r = fn(tok, s + start, text_end - start, flags, out)) < 0)
            return r;
        if ((r = tok__ids_push(out, a->id)) < 0)
            return r;
        start = i = end;
    }
    if (n > start)
        return fn(tok, s + start, n - start, flags, out);
    return 0;
}

static int encode_normalized_piece(const struct tokenizer *tok, const char *s, size_t n,
                                   unsigned flags, struct tok_ids *out)
{
    return tok__pretokenize_encode(tok, s, n, out);
}

static int encode_raw_piece(const struct tokenizer *tok, const char *s, size_t n,
                            unsigned flags, struct tok_ids *out)
{
    struct tok_buf nb = {0};
    int r;

    if (!tok->n_norms) {
        if (!tok->has_normalized_added)
            return tok__pretokenize_encode(tok, s, n, out);
        return split_added(tok, s, n, true, flags, encode_normalized_piece, out);
    }
    if ((r = tok__normalize(tok, s, n, &nb)) < 0)
        goto out;
    if (tok->has_normalized_added)
        r = split_added(tok, nb.p, nb.n, true, flags, encode_normalized_piece, out);
    else
        r = tok__pretokenize_encode(tok, nb.p, nb.n, out);
out:
    tok__buf_done(&nb);
    return r;
}

size_t tok_template_ids(const struct tokenizer *tok, bool after, const int32_t **ret)
{
    *ret = after ? tok->post_post : tok->post_pre;
    return after ? tok->n_post_post : tok->n_post_pre;
}

int tok_encode(const struct tokenizer *tok, const char *text, size_t len, unsigned flags,
               struct tok_ids *out, struct err_buf *e)
{
    size_t n0 = out->n, valid = tok_utf8_valid_prefix(text, len);
    int r;

    if (valid != len)
        return err_set(e, -EILSEQ, "input is not valid UTF-8 at byte %zu", valid);
    if (flags & TOK_ENCODE_ADD_SPECIAL)
        for (size_t i = 0; i < tok->n_post_pre; i++)
            if ((r = tok__ids_push(out, tok->post_pre[i])) < 0)
                goto fail;
    r = split_added(tok, text, len, false, flags, encode_raw_piece, out);
    if (r < 0)
        goto fail;
    /* BOS unless the text or the template already starts with it (chat prompts carry it) */
    if ((flags & TOK_ENCODE_ADD_BOS) && tok->bos_id >= 0 &&
        !(out->n > n0 && out->ids[n0] == tok->bos_id)) {
        if ((r = tok__ids_push(out, tok->bos_id)) < 0)
            goto fail;
        memmove(out->ids + n0 + 1, out->ids + n0, (out->n - n0 - 1) * sizeof(int32_t));
        out->ids[n0] = tok->bos_id;
    }
    if (flags & TOK_ENCODE_ADD_SPECIAL)
        for (size_t i = 0; i < tok->n_post_post; i++)
            if ((r = tok__ids_push(out, tok->post_post[i])) < 0)
                goto fail;
    return (int)(out->n - n0);
fail:
    out->n = n0;
    return err_set(e, r, "encode: %s", err_str(r));
}

/* --- decode ------------------------------------------------------------------------------- */

int tok__decode_raw(const struct tokenizer *tok, const int32_t *ids, size_t n,
                    bool skip_special, struct tok_buf *out)
{
    int r;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || (size_t) id >= tok->n_tokens || !tok->tokens[id].present)
            return -EINVAL;
        const struct tok_token *t = &tok->tokens[id];
        if (skip_special && t->special)
            continue;
        if ((r = tok__buf_put(out, t->bytes, t->n_bytes)) < 0)
            return r;
    }
    return 0;
}

int tok__decode_buf(const struct tokenizer *tok, const int32_t *ids, size_t n,
                    bool skip_special, struct tok_buf *out)
{
    struct tok_buf raw = {0};
    int r = tok__decode_raw(tok, ids, n, skip_special, &raw);
    if (r == 0)
        r = tok__utf8_lossy(out, raw.p ? raw.p : "", raw.n);
    tok__buf_done(&raw);
    return r;
}

int tok_decode(const struct tokenizer *tok, const int32_t *ids, size_t n, bool skip_special,
               char **ret_text, size_t *ret_len)
{
    struct tok_buf b = {0};
    int r = tok__decode_buf(tok, ids, n, skip_special, &b);
    if (r == 0 && !b.p)
        r = tok__buf_reserve(&b, 0);
    if (r < 0) {
        tok__buf_done(&b);
        return r;
    }
    b.p[b.n] = '\0';
    *ret_text = b.p;
    if (ret_len)
        *ret_len = b.n;
    return 0;
}
