/* notify.h - readiness, status and watchdog notifications to the service manager
 * (systemd's sd_notify protocol, spoken directly: no libsystemd).
 *
 * When $NOTIFY_SOCKET is unset every call is a no-op returning 0.  Return values: 0 (no
 * manager), 1 (sent), or a negative errno.  Any thread.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int notify_ready(void);
int notify_stopping(void);
int notify_watchdog(void);
/* STATUS=<text>; text is truncated to 256 bytes, newlines become spaces. */
int notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* EXTEND_TIMEOUT_USEC=<usec>: start-up (or stop) may take that much longer from now. */
int notify_extend_timeout(uint64_t usec);
/* Watchdog interval from $WATCHDOG_USEC when $WATCHDOG_PID is unset or this process
 * (0 when the manager asked for none). */
uint64_t notify_watchdog_usec(void);

#ifdef __cplusplus
}
#endif
