/* progress.c - see progress.h. */
#include "progress.h"

#include <stdio.h>

/* bytes in the unit a person reads (B, kB, MB, GB: decimal, as disks and rates are counted). */
static void progress_bytes(char *buf, size_t n, double b)
{
    if (b >= 1e9)
        snprintf(buf, n, "%.1f GB", b / 1e9);
    else if (b >= 1e6)
        snprintf(buf, n, "%.0f MB", b / 1e6);
    else if (b >= 1e3)
        snprintf(buf, n, "%.0f kB", b / 1e3);
    else
        snprintf(buf, n, "%.0f B", b);
}

/* seconds as "8 s", "2 min 5 s", "1 h 3 min" */
static void fmt_secs(char *buf, size_t n, double s)
{
    long long t = (long long)(s + 0.5);

    if (t < 60)
        snprintf(buf, n, "%lld s", t);
    else if (t < 3600)
        snprintf(buf, n, "%lld min %lld s", t / 60, t % 60);
    else
        snprintf(buf, n, "%lld h %lld min", t / 3600, t / 60 % 60);
}

void progress_line(char *buf, size_t n, int64_t done, int64_t total, int64_t elapsed_ms)
{
    char d[32], t[32], r[32], eta[32];
    double pct = total > 0 ? 100.0 * (double)done / (double)total : 0.0;

    progress_bytes(d, sizeof(d), (double)done);
    progress_bytes(t, sizeof(t), (double)total);
    if (done <= 0 || elapsed_ms <= 0) {
        snprintf(buf, n, "%s of %s (%.0f%%), ETA ?", d, t, pct);
        return;
    }
    double rate = (double)done * 1000.0 / (double)elapsed_ms;     /* bytes per second */

    progress_bytes(r, sizeof(r), rate);
    fmt_secs(eta, sizeof(eta), done >= total ? 0.0 : (double)(total - done) / rate);
    snprintf(buf, n, "%s of %s (%.0f%%), %s/s, ETA %s", d, t, pct, r, eta);
}

void progress_done(char *buf, size_t n, int64_t bytes, int64_t elapsed_ms)
{
    char b[32], r[32];

    progress_bytes(b, sizeof(b), (double)bytes);
    if (elapsed_ms <= 0) {
        snprintf(buf, n, "%s in 0.0 s", b);
        return;
    }
    progress_bytes(r, sizeof(r), (double)bytes * 1000.0 / (double)elapsed_ms);
    snprintf(buf, n, "%s in %.1f s (%s/s)", b, (double)elapsed_ms / 1000.0, r);
}
