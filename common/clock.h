/* clock.h - the monotonic clock in the units its callers count in (header only). */
#pragma once

#include <stdatomic.h>
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

/* A time source handed to code that measures time, so that its tests drive simulated time
 * instead of sleeping (no test asserts what a real clock measured).
 * A zeroed one (now_us NULL) is the monotonic clock. */
struct clk_src {
    int64_t (*now_us)(void *ctx);
    void *ctx;
};

static inline int64_t clk_src_now_us(const struct clk_src *c)
{
    return c && c->now_us ? c->now_us(c->ctx) : clk_now_us();
}

/* A simulated clock: time moves only when its owner advances it (clk_sim_advance_us); any
 * thread may read it (a watchdog thread while a test advances it). */
struct clk_sim {
    _Atomic int64_t us;
};

static inline int64_t clk_sim_now_us(void *ctx)
{
    return atomic_load(&((struct clk_sim *)ctx)->us);
}

/* The clk_src that reads sim. */
static inline struct clk_src clk_sim_src(struct clk_sim *sim)
{
    return (struct clk_src){ .now_us = clk_sim_now_us, .ctx = sim };
}

static inline void clk_sim_advance_us(struct clk_sim *sim, int64_t us)
{
    if (us > 0)
        atomic_fetch_add(&sim->us, us);
}
