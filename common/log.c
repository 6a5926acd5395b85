/* log.c - see log.h. */
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static char log_role[32] = "stepd";
static char log_tag[48];
static enum log_level log_level = LOG_LEVEL_INFO;

int log_level_parse(const char *s, enum log_level *ret)
{
    static const struct { const char *name; enum log_level lvl; } map[] = {
        { "error", LOG_LEVEL_ERROR }, { "warn", LOG_LEVEL_WARN }, { "warning", LOG_LEVEL_WARN },
        { "notice", LOG_LEVEL_NOTICE }, { "info", LOG_LEVEL_INFO }, { "debug", LOG_LEVEL_DEBUG },
    };
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (s && strcasecmp(s, map[i].name) == 0) {
            *ret = map[i].lvl;
            return 0;
        }
    return -22; /* -EINVAL */
}

void log_init(const char *role, const char *tag)
{
    enum log_level lvl;

    snprintf(log_role, sizeof(log_role), "%s", role ? role : "stepd");
    snprintf(log_tag, sizeof(log_tag), "%s", tag ? tag : "");
    if (log_level_parse(getenv("STEPD_LOG_LEVEL"), &lvl) == 0)
        log_level = lvl;
}

void log_set_level(enum log_level lvl) { log_level = lvl; }
enum log_level log_get_level(void) { return log_level; }

void log_emitv(enum log_level lvl, const char *req_id, const char *fmt, va_list ap)
{
    char line[4096];
    int n;

    if (lvl > log_level)
        return;
    n = snprintf(line, sizeof(line), "<%d>%s%s%s%s%s: ", (int) lvl, log_role,
                 log_tag[0] ? "[" : "", log_tag, log_tag[0] ? "]" : "",
                 req_id ? "" : "");
    if (req_id && n < (int) sizeof(line))
        n += snprintf(line + n, sizeof(line) - n, "req=%s: ", req_id);
    if (n < (int) sizeof(line))
        n += vsnprintf(line + n, sizeof(line) - n, fmt, ap);
    if (n >= (int) sizeof(line) - 1)
        n = sizeof(line) - 2;
    line[n++] = '\n';
    (void) !write(STDERR_FILENO, line, n);
}

void log_emit(enum log_level lvl, const char *req_id, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_emitv(lvl, req_id, fmt, ap);
    va_end(ap);
}
