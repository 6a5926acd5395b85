/* notify.h - systemd readiness/status notifications (sd_notify).
 *
 * Thin wrappers over libsystemd's sd_notify(); when stepd is built without
 * libsystemd, or when $NOTIFY_SOCKET is unset, every call is a no-op returning 0.
 * Return values: 0 (not sent / no manager), 1 (sent), or a negative errno.
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
/* STATUS=<text>; text is truncated to 256 bytes. */
int notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Watchdog interval from $WATCHDOG_USEC (0 when the manager asked for none). */
uint64_t notify_watchdog_usec(void);
/* True when built with libsystemd. */
bool notify_available(void);

#ifdef __cplusplus
}
#endif
