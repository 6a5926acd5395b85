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
