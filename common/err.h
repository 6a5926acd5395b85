/* err.h - the project's one error currency and its always-on assertions.
 *
 * Functions return int: 0 ok, >0 a count where documented, <0 a negative errno.
 * Foreign status codes (CUDA, NCCL, UCX, gRPC, protobuf-c) are translated once,
 * beside their library, by err_from_<lib>() helpers that return a negative errno.
 * ASSERT/BUG_ON guard invariants and programmer misuse, never input; they stay on
 * in release builds.
 */
#pragma once

#include <errno.h>
#include <stddef.h>
#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Human-readable text for a negative (or positive) errno value. Thread-safe. */
const char *err_str(int err);

/* Message buffer carried by parsers and loaders so that the caller, who decides
 * what to log, gets one precise sentence ("model-00001.safetensors: tensor
 * 'x': shape [2,3] does not match ...").  err_msg is always NUL-terminated. */
struct err_buf {
    char msg[1024];
};

/* printf into e (if non-NULL) and return code (a negative errno). */
int err_set(struct err_buf *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefix the existing message with "fmt: ". */
void err_prefix(struct err_buf *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

void err__assert_fail(const char *expr, const char *file, int line, const char *func)
    __attribute__((noreturn));

#define ASSERT(x) \
    do { if (__builtin_expect(!(x), 0)) err__assert_fail(#x, __FILE__, __LINE__, __func__); } while (0)
#define BUG_ON(x) \
    do { if (__builtin_expect(!!(x), 0)) err__assert_fail("BUG_ON(" #x ")", __FILE__, __LINE__, __func__); } while (0)

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#ifdef __cplusplus
}
#endif
