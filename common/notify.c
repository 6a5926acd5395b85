/* notify.c - see notify.h. */
#include "notify.h"

#include <stdarg.h>
#include <stdio.h>

#include "stepd-config.h"

#ifdef HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

static int notify_send(const char *state)
{
#ifdef HAVE_SYSTEMD
    return sd_notify(0, state);
#else
    (void) state;
    return 0;
#endif
}

int notify_ready(void) { return notify_send("READY=1"); }
int notify_stopping(void) { return notify_send("STOPPING=1"); }
int notify_watchdog(void) { return notify_send("WATCHDOG=1"); }

int notify_status(const char *fmt, ...)
{
    char buf[8 + 256 + 1] = "STATUS=";
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf + 7, sizeof(buf) - 7, fmt, ap);
    va_end(ap);
    return notify_send(buf);
}

uint64_t notify_watchdog_usec(void)
{
#ifdef HAVE_SYSTEMD
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) > 0)
        return usec;
#endif
    return 0;
}

bool notify_available(void)
{
#ifdef HAVE_SYSTEMD
    return true;
#else
    return false;
#endif
}
