/* log.c - see log.h. */
#include "log.h"

#include <stdbool.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

static char log_role[32] = "stepd";
static char log_tag[48];
static enum log_level log_level = LOG_LEVEL_INFO;
static bool log_journal;        /* stderr is the journal: "<N>" priority prefixes */

/* systemd.exec(5): $JOURNAL_STREAM is "DEVICE:INODE" of the stream connected to the journal;
 * stderr is the journal when its fstat() matches (and not when a program redirected it). */
static bool stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    int n = 0;

    if (!js || sscanf(js, "%llu:%llu%n", &dev, &ino, &n) != 2 || js[n] != 0)
        return false;
    if (fstat(STDERR_FILENO, &st) != 0)
        return false;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

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
    log_journal = stderr_is_journal();
    if (log_level_parse(getenv("STEPD_LOG_LEVEL"), &lvl) == 0)
        log_level = lvl;
}

void log_set_level(enum log_level lvl) { log_level = lvl; }
enum log_level log_get_level(void) { return log_level; }

/* Append s to line[*n..cap) with every control byte (newlines included) and DEL written as
 * \xNN, so that no text - a client's request id, model name or role echoed in a message -
 * can end the line and forge another journal entry ("<3>stepd: ...").  Truncates. */
static void put_escaped(char *line, size_t cap, size_t *n, const char *s)
{
    static const char hex[] = "0123456789abcdef";

    for (; *s && *n + 5 < cap; s++) {
        unsigned char c = (unsigned char)*s;

        if (c < 0x20 || c == 0x7f) {
            line[(*n)++] = '\\';
            line[(*n)++] = 'x';
            line[(*n)++] = hex[c >> 4];
            line[(*n)++] = hex[c & 15];
        } else {
            line[(*n)++] = (char)c;
        }
    }
}

static void log_emitv(enum log_level lvl, const char *req_id, const char *fmt, va_list ap)
{
    char line[4096], msg[3072];
    size_t n;
    int k;

    if (lvl > log_level)
        return;
    n = 0;
    if (log_journal) {
        k = snprintf(line, sizeof(line), "<%d>", (int) lvl);
        n = k > 0 && (size_t)k < sizeof(line) ? (size_t)k : 0;
    }
    k = snprintf(line + n, sizeof(line) - n, "%s%s%s%s: ", log_role,
                 log_tag[0] ? "[" : "", log_tag, log_tag[0] ? "]" : "");
    n += k > 0 && (size_t)k < sizeof(line) - n ? (size_t)k : 0;
    if (req_id) {
        put_escaped(line, sizeof(line), &n, "req=");
        put_escaped(line, sizeof(line), &n, req_id);
        put_escaped(line, sizeof(line), &n, ": ");
    }
    vsnprintf(msg, sizeof(msg), fmt, ap);
    put_escaped(line, sizeof(line), &n, msg);
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
