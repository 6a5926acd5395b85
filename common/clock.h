/* clock.h - the monotonic clock in the units its callers count in (header only). */
#pragma once

#include <stdint.h>
#include <time.h>

static inline int64_t clk_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t clk_now_us(void)
{
    return clk_now_ns() / 1000;
}

static inline int64_t clk_now_ms(void)
{
    return clk_now_ns() / 1000000;
}

static inline double clk_now_s(void)
{
    return (double)clk_now_ns() * 1e-9;
}

/* The CLOCK_REALTIME time ms from now: the deadline of a pthread_cond_timedwait(). */
static inline struct timespec clk_realtime_in_ms(int64_t ms)
{
    struct timespec ts;

    if (ms < 0)
        ms = 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}
