/* harness.h - assertion macros for tests (after libuv's test/task.h).
 *
 * Each failing check prints file:line and both sides, then aborts, so meson reports
 * the test as failed.  A test that needs hardware it does not have exits 77 (skip).
 */
#pragma once

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#define TEST_SKIP 77

#define FAIL(...) \
    do { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); \
         fputc('\n', stderr); abort(); } while (0)

#define ASSERT_TRUE(x) do { if (!(x)) FAIL("%s", #x); } while (0)
#define ASSERT_EQ(a, b) do { long long _a = (long long)(a), _b = (long long)(b); \
    if (_a != _b) FAIL("%s == %s (%lld vs %lld)", #a, #b, _a, _b); } while (0)
#define ASSERT_NE(a, b) do { long long _a = (long long)(a), _b = (long long)(b); \
    if (_a == _b) FAIL("%s != %s (both %lld)", #a, #b, _a); } while (0)
#define ASSERT_LT(a, b) do { double _a = (double)(a), _b = (double)(b); \
    if (!(_a < _b)) FAIL("%s < %s (%g vs %g)", #a, #b, _a, _b); } while (0)
#define ASSERT_LE(a, b) do { double _a = (double)(a), _b = (double)(b); \
    if (!(_a <= _b)) FAIL("%s <= %s (%g vs %g)", #a, #b, _a, _b); } while (0)
#define ASSERT_OK(r) do { long long _r = (long long)(r); \
    if (_r < 0) FAIL("%s returned %lld (%s)", #r, _r, strerror((int) -_r)); } while (0)
#define ASSERT_ERR(r, code) do { long long _r = (long long)(r); \
    if (_r != (code)) FAIL("%s returned %lld, expected %s (%d)", #r, _r, #code, (int)(code)); } while (0)
#define ASSERT_STREQ(a, b) do { const char *_a = (a), *_b = (b); \
    if (!_a || !_b || strcmp(_a, _b) != 0) FAIL("%s == %s (\"%s\" vs \"%s\")", #a, #b, \
        _a ? _a : "(null)", _b ? _b : "(null)"); } while (0)
#define ASSERT_CONTAINS(hay, needle) do { const char *_h = (hay), *_n = (needle); \
    if (!_h || !strstr(_h, _n)) FAIL("\"%s\" does not contain \"%s\"", _h ? _h : "(null)", _n); } while (0)
#define ASSERT_NEAR(a, b, tol) do { double _a = (double)(a), _b = (double)(b); \
    if (!(fabs(_a - _b) <= (tol))) FAIL("|%s - %s| <= %g (%.9g vs %.9g)", #a, #b, (double)(tol), _a, _b); } while (0)

/* Run cmd with sh, stderr merged into stdout: *out receives the output (malloc'd, the
 * caller frees); returns the exit status.  Fails the test when cmd did not exit. */
static inline int test_run(const char *cmd, char **out)
{
    char full[8192], buf[4096];
    size_t len = 0, cap = 0;
    FILE *p;
    int st;

    snprintf(full, sizeof(full), "%s 2>&1", cmd);
    p = popen(full, "r");
    ASSERT_TRUE(p != NULL);
    *out = NULL;
    while (fgets(buf, sizeof(buf), p)) {
        size_t n = strlen(buf);
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            *out = (char *)realloc(*out, cap);
            ASSERT_TRUE(*out != NULL);
        }
        memcpy(*out + len, buf, n + 1);
        len += n;
    }
    if (!*out)
        *out = strdup("");
    st = pclose(p);
    ASSERT_TRUE(WIFEXITED(st));
    return WEXITSTATUS(st);
}

/* The first index of the largest of x[0 .. n) (greedy decoding in the model tests). */
static inline int harness_argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}
