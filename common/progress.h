/* progress.h - what a person waiting for a long load reads: bytes done of total, the
 * throughput since the start and the time left at that rate, from byte counts and elapsed
 * times the caller measures (no clock in here: the tests give the times).
 *
 *   progress_line():  "3.1 of 9.4 GB (33%), 812 MB/s, ETA 8 s"
 *   progress_done():  "9.4 GB in 10.2 s (921 MB/s)"
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* done of total bytes after elapsed_ms: the line above into buf (truncated to n).  The rate
 * is done / elapsed; before any byte or any time, "ETA ?" (no rate yet). */
void progress_line(char *buf, size_t n, int64_t done, int64_t total, int64_t elapsed_ms);
/* The finished load: bytes, duration and average rate. */
void progress_done(char *buf, size_t n, int64_t bytes, int64_t elapsed_ms);

#ifdef __cplusplus
}
#endif
