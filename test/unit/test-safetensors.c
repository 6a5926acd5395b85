/* test-safetensors.c - the hostile-input safetensors reader (docs/RELIABILITY.md C1, C4).
 *
 * Table-driven: each malformed file is generated here, written to a temporary
 * file and opened with sft_open(); it must be rejected with its specific error
 * code and a message naming the file and (where there is one) the tensor.  The
 * same bytes go through sft_parse_mem() (the fuzz entry point) with the same
 * verdict.  Valid edge cases must be accepted.  C4: a shard truncated after
 * mapping kills a forked reader with SIGBUS (the documented policy), and the
 * mapping is read-only. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "safetensors.h"

struct buf {
    unsigned char *p;
    size_t len, cap;
};

static void put(struct buf *b, const void *d, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        ASSERT_TRUE(b->p != NULL);
    }
    memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void put_u64(struct buf *b, uint64_t v)
{
    unsigned char x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (unsigned char) (v >> (8 * i));
    put(b, x, 8);
}

#define N_FROM_HEADER UINT64_C(0x5a5a5a5a5a5a5a5a)   /* "use the header length" */

/* A file: length prefix (n, or the header length) + header + data_len zero bytes. */
static struct buf make(const char *hdr, size_t hdr_len, uint64_t data_len, uint64_t n)
{
    struct buf b = { 0 };
    static const unsigned char z[4096];
    put_u64(&b, n == N_FROM_HEADER ? hdr_len : n);
    put(&b, hdr, hdr_len);
    while (data_len) {
        size_t k = data_len > sizeof(z) ? sizeof(z) : (size_t) data_len;
        put(&b, z, k);
        data_len -= k;
    }
    return b;
}

static struct buf mk(const char *hdr, uint64_t data_len)
{
    return make(hdr, strlen(hdr), data_len, N_FROM_HEADER);
}

static char tmpdir[] = "/tmp/stepd-test-sft-XXXXXX";

static void write_buf(const char *path, const struct buf *b)
{
    FILE *f = fopen(path, "wb");
    ASSERT_TRUE(f != NULL);
    if (b->len)
        ASSERT_EQ(fwrite(b->p, 1, b->len, f), b->len);
    fclose(f);
}

/* Build a header with n copies of "\"tN\":0," (count cap) */
static char *many_keys(size_t n)
{
    size_t cap = n * 16 + 16, len = 0;
    char *s = malloc(cap);
    ASSERT_TRUE(s != NULL);
    len += (size_t) sprintf(s, "{");
    for (size_t i = 0; i < n; i++)
        len += (size_t) sprintf(s + len, "\"t%zu\":0,", i);
    s[len - 1] = '}';
    s[len] = 0;
    return s;
}

static char *deep(size_t depth)
{
    char *s = malloc(depth * 2 + 64);
    size_t len = 0;
    ASSERT_TRUE(s != NULL);
    len += (size_t) sprintf(s, "{\"a\":{\"dtype\":\"U8\",\"shape\":");
    for (size_t i = 0; i < depth; i++)
        s[len++] = '[';
    for (size_t i = 0; i < depth; i++)
        s[len++] = ']';
    len += (size_t) sprintf(s + len, ",\"data_offsets\":[0,0]}}");
    return s;
}

static char *long_name(size_t n)
{
    char *s = malloc(n + 128);
    size_t len;
    ASSERT_TRUE(s != NULL);
    len = (size_t) sprintf(s, "{\"");
    memset(s + len, 'x', n);
    len += n;
    sprintf(s + len, "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}");
    return s;
}

#define T(name_, dt_, shape_, off_) "\"" name_ "\":{\"dtype\":\"" dt_ "\",\"shape\":" shape_ ",\"data_offsets\":" off_ "}"

struct bad_case {
    const char *what;
    struct buf file;
    int err;
    const char *msg;      /* substring of the message */
    const char *tensor;   /* tensor that must be named, or NULL */
};

static void run_bad(const struct bad_case *c, int idx)
{
    char path[256];
    struct err_buf e = { "" };
    struct sft_file *f = NULL;
    struct sft_header h;
    int r;

    snprintf(path, sizeof(path), "%s/case-%02d.safetensors", tmpdir, idx);
    write_buf(path, &c->file);
    r = sft_open(path, 0, &f, &e);
    if (r != c->err)
        FAIL("case %d (%s): expected %d (%s), got %d: %s", idx, c->what, c->err, strerror(-c->err), r, e.msg);
    ASSERT_TRUE(f == NULL);
    if (!strstr(e.msg, c->msg) || !strstr(e.msg, path) || (c->tensor && !strstr(e.msg, c->tensor)))
        FAIL("case %d (%s): message \"%s\" lacks \"%s\" / the file / tensor '%s'", idx, c->what, e.msg,
             c->msg, c->tensor ? c->tensor : "");
    r = sft_parse_mem(c->file.p, c->file.len, "mem", &h, &e);
    if (r != c->err)
        FAIL("case %d (%s): sft_parse_mem gave %d: %s", idx, c->what, r, e.msg);
    unlink(path);
}

static void test_malformed(void)
{
    char *keys = many_keys(1000000), *dp = deep(100000), *d5 = deep(3), *ln = long_name(1 << 20);
    char nulhdr[] = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} \0 ";
    const char bad_utf8[] = "{\"\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    const char overlong[] = "{\"\xc0\x80\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    const char surrogate[] = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"__metadata__\":{\"x\":\"\xed\xa0\x80\"}}";
    struct bad_case cases[] = {
        /* 1. sizes */
        { "empty file", { NULL, 0, 0 }, -EBADMSG, "too small", NULL },
        { "1 byte", { (unsigned char *) "\x01", 1, 0 }, -EBADMSG, "too small", NULL },
        { "7 bytes", { (unsigned char *) "\x01\0\0\0\0\0\0", 7, 0 }, -EBADMSG, "too small", NULL },
        /* 2. N */
        { "N = 0", make("{}", 2, 0, 0), -EBADMSG, "header length is 0", NULL },
        { "N > file", make("{}", 2, 0, 3), -EBADMSG, "runs past the end", NULL },
        { "N = 2^64-1", make("{}", 2, 0, UINT64_MAX), -EOVERFLOW, "overflows", NULL },
        { "N = cap + 1", make("{}", 2, 0, SFT_HEADER_MAX + 1), -E2BIG, "exceeds the 100000000-byte cap", NULL },
        { "N = 2^63", make("{}", 2, 0, 1ull << 63), -E2BIG, "cap", NULL },
        /* 4. encoding */
        { "not UTF-8", make(bad_utf8, sizeof(bad_utf8) - 1, 1, N_FROM_HEADER), -EILSEQ, "not valid UTF-8", NULL },
        { "overlong UTF-8", make(overlong, sizeof(overlong) - 1, 1, N_FROM_HEADER), -EILSEQ, "not valid UTF-8", NULL },
        { "UTF-16 surrogate", make(surrogate, sizeof(surrogate) - 1, 1, N_FROM_HEADER), -EILSEQ, "not valid UTF-8", NULL },
        { "NUL in header", make(nulhdr, sizeof(nulhdr) - 1, 1, N_FROM_HEADER), -EILSEQ, "NUL byte", NULL },
        /* 5. start */
        { "leading space", mk(" {}", 0), -EBADMSG, "does not start with '{'", NULL },
        { "array header", mk("[]", 0), -EBADMSG, "does not start with '{'", NULL },
        /* 6. JSON */
        { "truncated JSON", mk("{\"a\":{\"dtype\":\"U8\"", 0), -EBADMSG, "invalid JSON", NULL },
        { "trailing garbage", mk("{} x", 0), -EBADMSG, "invalid JSON", NULL },
        { "two objects", mk("{}{}", 0), -EBADMSG, "invalid JSON", NULL },
        /* 7. caps */
        { "nested 10^5 deep", mk(dp, 0), -E2BIG, "nests deeper than 4", NULL },
        { "shape nested", mk(d5, 0), -E2BIG, "nests deeper than 4", NULL },
        { "10^6 tensors", mk(keys, 0), -E2BIG, "more than 262144 entries", NULL },
        { "duplicate key", mk("{" T("a", "U8", "[1]", "[0,1]") "," T("a", "U8", "[1]", "[1,2]") "}", 2), -EEXIST, "tensor 'a' appears twice", "a" },
        { "duplicate metadata key", mk("{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0), -EBADMSG, "__metadata__: duplicate key 'k'", NULL },
        { "duplicate field", mk("{\"w\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1), -EBADMSG, "duplicate key 'dtype'", "w" },
        { "lone surrogate escape", mk("{" T("a\\ud800", "U8", "[1]", "[0,1]") "}", 1), -EBADMSG, "lone high surrogate", NULL },
        { "lone minus at end (fuzz)", mk("{\"w\":{\"shape\":[-", 0), -EBADMSG, "shape[0] must be an integer, got an invalid token", "w" },
        { "leading zero", mk("{" T("w", "U8", "[01]", "[0,1]") "}", 1), -EBADMSG, "leading zero", NULL },
        /* 8. metadata */
        { "metadata value not string", mk("{\"__metadata__\":{\"format\":1}}", 0), -EBADMSG, "__metadata__.format must be a string", NULL },
        { "metadata nested", mk("{\"__metadata__\":{\"a\":{\"b\":\"c\"}}}", 0), -EBADMSG, "__metadata__.a must be a string", NULL },
        { "metadata not object", mk("{\"__metadata__\":\"x\"}", 0), -EBADMSG, "__metadata__ must be an object", NULL },
        /* 9. dtype */
        { "unknown dtype", mk("{" T("w", "Q4_K", "[1]", "[0,1]") "}", 1), -EPROTONOSUPPORT, "unknown dtype 'Q4_K'", "w" },
        { "dtype number", mk("{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", 1), -EBADMSG, "dtype must be a string", "w" },
        { "dtype missing", mk("{\"w\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1), -EBADMSG, "missing 'dtype'", "w" },
        /* 10. shape values */
        { "negative dim", mk("{" T("w", "U8", "[-1]", "[0,1]") "}", 1), -EBADMSG, "shape[0] is negative", "w" },
        { "float dim", mk("{" T("w", "U8", "[1.5]", "[0,1]") "}", 1), -EBADMSG, "shape[0] must be an integer, got a real number", "w" },
        { "string dim", mk("{" T("w", "U8", "[\"1\"]", "[0,1]") "}", 1), -EBADMSG, "shape[0] must be an integer, got a string", "w" },
        { "dim 2^64", mk("{" T("w", "U8", "[18446744073709551616]", "[0,1]") "}", 1), -EBADMSG, "too big integer", NULL },
        { "dim 2^63", mk("{" T("w", "U8", "[9223372036854775808]", "[0,1]") "}", 1), -EBADMSG, "too big integer", NULL },
        { "shape not array", mk("{" T("w", "U8", "7", "[0,1]") "}", 1), -EBADMSG, "shape must be an array, got an integer", "w" },
        /* 11. rank */
        { "rank 9", mk("{" T("w", "U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1), -E2BIG, "shape has 9 entries", "w" },
        { "rank 64", mk("{" T("w", "U8", "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1), -E2BIG, "shape has 64 entries", "w" },
        /* 12. products */
        { "[2, 2^63-1]", mk("{" T("w", "U8", "[2,9223372036854775807]", "[0,1]") "}", 1), -EOVERFLOW, "overflows", "w" },
        { "[2^32, 2^32]", mk("{" T("w", "U8", "[4294967296,4294967296]", "[0,1]") "}", 1), -EOVERFLOW, "element count overflows", "w" },
        { "bytes overflow", mk("{" T("w", "F64", "[4611686018427387904]", "[0,1]") "}", 1), -EOVERFLOW, "byte size overflows", "w" },
        /* 14. offsets */
        { "offsets 1 entry", mk("{" T("w", "U8", "[1]", "[1]") "}", 1), -EBADMSG, "data_offsets has 1 entries, expected 2", "w" },
        { "offsets 3 entries", mk("{" T("w", "U8", "[1]", "[0,1,2]") "}", 1), -E2BIG, "data_offsets has 3 entries", "w" },
        { "begin > end", mk("{" T("w", "U8", "[1]", "[1,0]") "}", 1), -EBADMSG, "is before begin", "w" },
        { "negative offset", mk("{" T("w", "U8", "[1]", "[-1,0]") "}", 1), -EBADMSG, "data_offsets[0] is negative", "w" },
        { "string offset", mk("{" T("w", "U8", "[1]", "[\"0\",1]") "}", 1), -EBADMSG, "data_offsets[0] must be an integer", "w" },
        { "bool offset", mk("{" T("w", "U8", "[1]", "[false,1]") "}", 1), -EBADMSG, "data_offsets[0] must be an integer, got false", "w" },
        { "gap", mk("{" T("a", "U8", "[1]", "[0,1]") "," T("b", "U8", "[1]", "[2,3]") "}", 3), -EBADMSG, "leaves a gap", "b" },
        { "first not at 0", mk("{" T("a", "U8", "[1]", "[1,2]") "}", 2), -EBADMSG, "leaves a gap after 0", "a" },
        { "overlap (P4)", mk("{" T("a", "U8", "[2]", "[0,2]") "," T("b", "U8", "[2]", "[1,3]") "}", 3), -EBADMSG, "overlap tensor 'a'", "b" },
        { "same bytes twice (P4)", mk("{" T("a", "U8", "[2]", "[0,2]") "," T("b", "U8", "[2]", "[0,2]") "}", 2), -EBADMSG, "overlap", NULL },
        { "offsets near 2^63", mk("{" T("a", "U8", "[1]", "[9223372036854775806,9223372036854775807]") "}", 1), -EBADMSG, "gap", "a" },
        /* 15, 16 */
        { "size mismatch", mk("{" T("w", "F32", "[2]", "[0,4]") "}", 4), -EBADMSG, "span 4 bytes but F32 x 2 elements need 8", "w" },
        { "F4 odd count", mk("{" T("w", "F4", "[3]", "[0,2]") "}", 2), -EBADMSG, "do not end on a byte boundary", "w" },
        { "F6 misaligned", mk("{" T("w", "F6_E2M3", "[3]", "[0,3]") "}", 3), -EBADMSG, "byte boundary", "w" },
        /* 17. buffer */
        { "missing data", mk("{" T("w", "U8", "[16]", "[0,16]") "}", 8), -EBADMSG, "need 16 data bytes but the file holds only 8", NULL },
        { "trailing bytes (polyglot)", mk("{" T("w", "U8", "[16]", "[0,16]") "}", 20), -EBADMSG, "4 trailing bytes", NULL },
        { "empty header, data", mk("{}", 5), -EBADMSG, "5 trailing bytes", NULL },
        /* 18. names */
        { "name 1 MB", mk(ln, 1), -E2BIG, "longer than 512", NULL },
        { "name with /..", mk("{" T("a/../b", "U8", "[1]", "[0,1]") "}", 1), -EINVAL, "forbidden byte", NULL },
        { "name with ..", mk("{" T("a..b", "U8", "[1]", "[0,1]") "}", 1), -EINVAL, "contains \"..\"", NULL },
        { "empty name", mk("{" T("", "U8", "[1]", "[0,1]") "}", 1), -EINVAL, "tensor name is empty", NULL },
        { "name with space", mk("{" T("a b", "U8", "[1]", "[0,1]") "}", 1), -EINVAL, "forbidden byte 0x20", NULL },
        { "name \\u0000", mk("{" T("a\\u0000b", "U8", "[1]", "[0,1]") "}", 1), -EBADMSG, "invalid JSON", NULL },
        { "name control", mk("{" T("a\\u0001", "U8", "[1]", "[0,1]") "}", 1), -EINVAL, "forbidden byte 0x01", NULL },
        /* structure */
        { "entry not object", mk("{\"w\":[1,2]}", 0), -EBADMSG, "entry must be an object, got an array", "w" },
        { "unexpected key", mk("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 1), -EBADMSG, "unexpected key 'x'", "w" },
        /* 19. sums wrapping 2^64 */
        { "offsets past 2^63", mk("{" T("a", "U8", "[1]", "[0,1]") "," T("b", "U8", "[1]", "[9223372036854775807,18446744073709551615]") "}", 0), -EBADMSG, "too big integer", "b" },
        { "huge tensor, tiny file", mk("{" T("a", "U8", "[1152921504606846975]", "[0,1152921504606846975]") "}", 0), -EBADMSG, "need 1152921504606846975 data bytes", NULL },
        { "huge tensor bytes overflow", mk("{" T("a", "U8", "[9223372036854775807]", "[0,9223372036854775807]") "}", 0), -EOVERFLOW, "byte size overflows", "a" },
    };

    ASSERT_LE(45, ARRAY_SIZE(cases));
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++)
        run_bad(&cases[i], (int) i);
    printf("C1: %zu malformed files rejected with their specific errors\n", ARRAY_SIZE(cases));
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++)
        if (cases[i].file.cap)
            free(cases[i].file.p);
    free(keys);
    free(dp);
    free(d5);
    free(ln);
}

/* Property: legal edge cases are accepted with the right views. */
static void test_valid(void)
{
    static const struct {
        const char *hdr;
        uint64_t data;
        size_t n;
    } ok[] = {
        { "{" T("a", "BF16", "[2,3]", "[0,12]") "," T("b", "U8", "[4]", "[12,16]") "}        ", 16, 2 },
        { "{" T("s", "F32", "[]", "[0,4]") "}", 4, 1 },
        { "{" T("z", "F32", "[0,4]", "[0,0]") "," T("y", "U8", "[1]", "[0,1]") "}", 1, 2 },
        { "{" T("b", "U8", "[1]", "[1,2]") "," T("a", "U8", "[1]", "[0,1]") "}", 2, 2 },
        { "{\"__metadata__\":{\"format\":\"pt\"}," T("a", "U8", "[1]", "[0,1]") "}", 1, 1 },
        { "{}", 0, 0 },
        { "{\"__metadata__\":{}}\n\t ", 0, 0 },
        { "{" T("f", "F4", "[2,3]", "[0,3]") "}", 3, 1 },
        { "{" T("model.language_model.layers.0.mlp.up_proj.weight_packed", "U8", "[1]", "[0,1]") "}", 1, 1 },
    };
    for (size_t i = 0; i < ARRAY_SIZE(ok); i++) {
        char path[256];
        struct buf b = mk(ok[i].hdr, ok[i].data);
        struct sft_file *f;
        struct err_buf e = { "" };
        snprintf(path, sizeof(path), "%s/ok-%zu.safetensors", tmpdir, i);
        write_buf(path, &b);
        if (sft_open(path, 0, &f, &e) < 0)
            FAIL("valid case %zu rejected: %s", i, e.msg);
        ASSERT_EQ(sft_file_header(f)->n_tensors, ok[i].n);
        sft_close(f);
        free(b.p);
    }
    {
        struct buf b = mk("{" T("a", "BF16", "[2,3]", "[0,12]") "," T("b", "U8", "[4]", "[12,16]") "}", 16);
        struct sft_file *f;
        struct tview v;
        struct err_buf e;
        char path[256];
        for (int i = 0; i < 16; i++)
            b.p[b.len - 16 + (size_t) i] = (unsigned char) i;
        snprintf(path, sizeof(path), "%s/view.safetensors", tmpdir);
        write_buf(path, &b);
        ASSERT_OK(sft_open(path, 0, &f, &e));
        sft_file_view(f, sft_header_find(sft_file_header(f), "b"), &v);
        ASSERT_EQ(v.dtype, DTYPE_U8);
        ASSERT_EQ(v.nbytes, 4);
        ASSERT_EQ(((const unsigned char *) v.data)[0], 12);
        ASSERT_TRUE(sft_header_find(sft_file_header(f), "c") == NULL);
        sft_close(f);
        ASSERT_OK(sft_open(path, SFT_OPEN_HEADERS_ONLY, &f, &e));
        sft_file_view(f, sft_header_find(sft_file_header(f), "a"), &v);
        ASSERT_TRUE(v.data == NULL);
        ASSERT_EQ(v.shape[1], 3);
        sft_close(f);
        free(b.p);
    }
}

/* The child dies of the fault itself (sanitizers install their own handlers). */
static void default_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &sa, NULL);
    sigaction(SIGSEGV, &sa, NULL);
}

/* Property (C4): the mapping is read-only and private; truncating the file after
 * mapping makes the reader die of SIGBUS (documented policy), checked in a child.
 * A directory or missing path is refused without mapping anything. */
static void test_mmap_policy(void)
{
    char path[256];
    struct buf b = mk("{" T("big", "U8", "[1048576]", "[0,1048576]") "}", 1048576);
    struct sft_file *f;
    struct err_buf e;
    struct tview v;
    pid_t pid;
    int st;

    snprintf(path, sizeof(path), "%s/trunc.safetensors", tmpdir);
    write_buf(path, &b);
    free(b.p);

    pid = fork();
    ASSERT_TRUE(pid >= 0);
    if (pid == 0) {
        volatile unsigned char x;
        default_signals();
        if (sft_open(path, 0, &f, &e) < 0)
            _exit(3);
        sft_file_view(f, sft_header_find(sft_file_header(f), "big"), &v);
        if (truncate(path, 100) < 0)
            _exit(4);
        x = ((const volatile unsigned char *) v.data)[v.nbytes - 1];   /* lost page */
        (void) x;
        _exit(0);
    }
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(st));
    ASSERT_EQ(WTERMSIG(st), SIGBUS);

    /* the truncated file is now refused up front */
    ASSERT_ERR(sft_open(path, 0, &f, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "but the file holds only");

    /* read-only mapping: a write faults */
    b = mk("{" T("w", "U8", "[8]", "[0,8]") "}", 8);
    write_buf(path, &b);
    free(b.p);
    pid = fork();
    ASSERT_TRUE(pid >= 0);
    if (pid == 0) {
        default_signals();
        if (sft_open(path, 0, &f, &e) < 0)
            _exit(3);
        sft_file_view(f, sft_header_find(sft_file_header(f), "w"), &v);
        ((volatile unsigned char *) v.data)[0] = 1;
        _exit(0);
    }
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(st));
    ASSERT_EQ(WTERMSIG(st), SIGSEGV);

    ASSERT_ERR(sft_open(tmpdir, 0, &f, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "not a regular file");
    snprintf(path, sizeof(path), "%s/nonexistent.safetensors", tmpdir);
    ASSERT_ERR(sft_open(path, 0, &f, &e), -ENOENT);
}

/* Property: index parser shapes (C3 at the parser level). */
static void test_index_parse(void)
{
    struct sft_index idx;
    struct err_buf e;
    const char *good = "{\"metadata\":{\"total_size\":1},\"weight_map\":{\"b\":\"s2.safetensors\",\"a\":\"s1.safetensors\",\"c\":\"s1.safetensors\"}}";
    ASSERT_OK(sft_index_parse(good, strlen(good), "idx", &idx, &e));
    ASSERT_EQ(idx.n, 3);
    ASSERT_EQ(idx.n_shards, 2);
    ASSERT_STREQ(idx.shards[idx.shard_of[sft_index_find(&idx, "b")]], "s2.safetensors");
    ASSERT_EQ(sft_index_find(&idx, "zz"), -1);
    sft_index_done(&idx);
    /* empty weight_map (found by fuzz-index: qsort on a NULL array) */
    ASSERT_OK(sft_index_parse("{\"weight_map\": {}}", 18, "idx", &idx, &e));
    ASSERT_EQ(idx.n, 0);
    sft_index_done(&idx);
    ASSERT_ERR(sft_index_parse("{\"weight_map\":{\"a\":\"..\"}}", strlen("{\"weight_map\":{\"a\":\"..\"}}"), "idx", &idx, &e), -EACCES);
    ASSERT_ERR(sft_index_parse("{\"weight_map\":[]}", strlen("{\"weight_map\":[]}"), "idx", &idx, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "weight_map: expected an object, got an array");
    ASSERT_ERR(sft_index_parse("{\"metadata\":3,\"weight_map\":{}}", strlen("{\"metadata\":3,\"weight_map\":{}}"), "idx", &idx, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "idx: metadata: expected an object");
}

int main(void)
{
    struct rusage ru;
    ASSERT_TRUE(mkdtemp(tmpdir) != NULL);
    test_malformed();
    test_valid();
    test_mmap_policy();
    test_index_parse();
    getrusage(RUSAGE_SELF, &ru);
    printf("peak RSS %ld KiB\n", ru.ru_maxrss);
    {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0)
            fprintf(stderr, "cleanup of %s failed\n", tmpdir);
    }
    return 0;
}
