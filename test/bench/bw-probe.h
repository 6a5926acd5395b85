/* bw-probe.h - the read-bandwidth probe of the CPU benchmarks (bench-kernels, bench-shapes).
 *
 * Every thread of a pool streams its contiguous share of an arena with 256-bit loads
 * (four independent XOR chains, no stores): the rate a kernel that only reads its weights
 * could reach on this machine, now.  The arena must be much larger than the last-level
 * cache and 32-byte aligned; the benchmarks run the probe right before each sweep of
 * kernels, with the same thread count, so a ratio to it cancels load changes on a shared
 * machine.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

struct bw_probe_job {
    const uint8_t *p;
    size_t n;
    double sink[128];
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void bw_probe_task(void *arg, int ith, int nth)
{
    struct bw_probe_job *j = arg;
    int64_t a, b;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;

    cpu_split((int64_t)(j->n / 128), 1, ith, nth, &a, &b);
    for (int64_t i = a; i < b; i++) {
        const __m256i *q = (const __m256i *)(j->p + i * 128);
        s0 = _mm256_xor_si256(s0, _mm256_load_si256(q));
        s1 = _mm256_xor_si256(s1, _mm256_load_si256(q + 1));
        s2 = _mm256_xor_si256(s2, _mm256_load_si256(q + 2));
        s3 = _mm256_xor_si256(s3, _mm256_load_si256(q + 3));
    }
    s0 = _mm256_xor_si256(_mm256_xor_si256(s0, s1), _mm256_xor_si256(s2, s3));
    j->sink[ith] = (double)_mm256_extract_epi32(s0, 0);
}
#else
static void bw_probe_task(void *arg, int ith, int nth)
{
    struct bw_probe_job *j = arg;
    int64_t a, b;
    uint64_t s = 0;

    cpu_split((int64_t)(j->n / 8), 1, ith, nth, &a, &b);
    for (int64_t i = a; i < b; i++)
        s ^= ((const uint64_t *)j->p)[i];
    j->sink[ith] = (double)s;
}
#endif

/* One pass over arena[0, bytes) with every thread of pool: GB/s. */
static inline double bw_probe_once(struct cpu_pool *pool, const uint8_t *arena, size_t bytes)
{
    struct bw_probe_job j = { .p = arena, .n = bytes };
    struct timespec t0, t1;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    cpu_pool_run(pool, bw_probe_task, &j);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)bytes / ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec)) / 1e9;
}
