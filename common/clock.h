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
