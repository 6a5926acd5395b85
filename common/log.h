/* log.h - leveled logging to stderr, with journald "<N>" priority prefixes when stderr is
 * the journal ($JOURNAL_STREAM names stderr's device:inode, as systemd sets it; decided by
 * log_init()), without them on a terminal, a file or a pipe.
 *
 * Every line carries the process role and rank set by log_init() and, when given,
 * a request id: "<6>stepd-worker[g0/r1] req=abc: message" in the journal,
 * "stepd-worker[g0/r1] req=abc: message" elsewhere.  Lines are written with
 * one write(2) so concurrent threads never interleave.  Control characters (newlines
 * included) and DEL in the request id and the message are written as \xNN, so a line
 * never carries text that a journal would read as a line of its own: client-supplied
 * strings may be logged as they are.  common/ and kernels/ log at debug only; decisions
 * are logged where they are made.
 */
#pragma once

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

enum log_level {
    LOG_LEVEL_ERROR = 3,
    LOG_LEVEL_WARN = 4,
    LOG_LEVEL_NOTICE = 5,
    LOG_LEVEL_INFO = 6,
    LOG_LEVEL_DEBUG = 7,
};

/* role: "stepd", "stepd-worker", ...; tag: e.g. "g0/r1" or NULL. Not thread-safe;
 * call once at start-up (after any redirection of stderr: it checks $JOURNAL_STREAM). Level from $STEPD_LOG_LEVEL (error|warn|info|debug) if set. */
void log_init(const char *role, const char *tag);
void log_set_level(enum log_level lvl);
enum log_level log_get_level(void);
/* Parse "error", "warn", "info", "debug"; returns -EINVAL on anything else. */
int log_level_parse(const char *s, enum log_level *ret);

void log_emit(enum log_level lvl, const char *req_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define log_error(...) log_emit(LOG_LEVEL_ERROR, NULL, __VA_ARGS__)
#define log_warn(...) log_emit(LOG_LEVEL_WARN, NULL, __VA_ARGS__)
#define log_notice(...) log_emit(LOG_LEVEL_NOTICE, NULL, __VA_ARGS__)
#define log_info(...) log_emit(LOG_LEVEL_INFO, NULL, __VA_ARGS__)
#define log_debug(...) \
    do { if (log_get_level() >= LOG_LEVEL_DEBUG) log_emit(LOG_LEVEL_DEBUG, NULL, __VA_ARGS__); } while (0)
/* request-scoped variants */
#define log_req_error(id, ...) log_emit(LOG_LEVEL_ERROR, (id), __VA_ARGS__)
#define log_req_warn(id, ...) log_emit(LOG_LEVEL_WARN, (id), __VA_ARGS__)
#define log_req_info(id, ...) log_emit(LOG_LEVEL_INFO, (id), __VA_ARGS__)
#define log_req_debug(id, ...) \
    do { if (log_get_level() >= LOG_LEVEL_DEBUG) log_emit(LOG_LEVEL_DEBUG, (id), __VA_ARGS__); } while (0)

#ifdef __cplusplus
}
#endif
