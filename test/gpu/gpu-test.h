/* gpu-test.h - what the device tests of test/gpu share (test-cuda-ops, test-cuda-vision):
 * the random inputs (xorshift over rng, seeded by each test and printed to replay a run) and
 * device buffers of the backend under test (gpu): copies of host data, and buffers of NaNs
 * (all bits set) for outputs an op must write completely. */
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "harness.h"

static struct backend *gpu;
static uint64_t rng;

/* uniform in [-1, 1) */
static inline float frand(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static inline float *rnd(size_t n, float scale)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    ASSERT_TRUE(p);
    for (size_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

/* device copy of bytes of host memory */
static inline void *dup_dev(const void *h, size_t bytes)
{
    void *d;
    ASSERT_OK(backend_buf_alloc(gpu, bytes ? bytes : 1, 256, &d));
    if (bytes)
        ASSERT_OK(backend_upload(gpu, d, h, bytes));
    return d;
}

/* a device buffer of NaNs (all bits set) */
static inline void *poisoned(size_t bytes)
{
    void *d, *h = malloc(bytes ? bytes : 1);
    ASSERT_TRUE(h);
    memset(h, 0xFF, bytes);
    d = dup_dev(h, bytes);
    ASSERT_OK(backend_sync(gpu));
    free(h);
    return d;
}
