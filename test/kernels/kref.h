/* kref.h - naive scalar references and helpers for the kernel tests (header-only, static).
 * Written from docs/MODEL.md directly, independent of kernels/cpu/. */
#pragma once

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "harness.h"

#ifndef ARRAY_SIZE
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#endif

static uint64_t krng_state = 0x9e3779b97f4a7c15ull;

static inline void krng_seed(uint64_t s)
{
    krng_state = s * 0x9e3779b97f4a7c15ull + 1;
}

static inline uint64_t krng_u64(void)
{
    uint64_t x = krng_state;

    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return krng_state = x;
}

/* uniform in [-1, 1) */
static inline float krng_f(void)
{
    return (float)((double)(krng_u64() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static inline void krng_fill(float *p, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        p[i] = amp * krng_f();
}

static inline float kbf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;

    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t kf32_to_bf16(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static const float kref_e2m1[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

/* W[o, i] per docs/MODEL.md §5.3 */
static inline float kref_mxfp4(const uint8_t *packed, const uint8_t *scale, int64_t cols,
                               int64_t o, int64_t i)
{
    uint8_t c = (packed[o * (cols / 2) + i / 2] >> (4 * (i % 2))) & 0xF;
    float v = kref_e2m1[c & 7] * ldexpf(1.0f, (int)scale[o * (cols / 32) + i / 32] - 127);

    return (c & 8) ? -v : v;
}

/* Random MXFP4 weight with scales in [e_lo, e_hi]; caller frees data/scale. */
static inline struct bweight kref_mxfp4_new(int64_t rows, int64_t cols, int e_lo, int e_hi)
{
    struct bweight w = { .fmt = WFMT_MXFP4, .rows = rows, .cols = cols };
    uint8_t *p = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 32));

    ASSERT_TRUE(p && s);
    for (int64_t i = 0; i < rows * cols / 2; i++)
        p[i] = (uint8_t)krng_u64();
    for (int64_t i = 0; i < rows * cols / 32; i++)
        s[i] = (uint8_t)(e_lo + (int)(krng_u64() % (uint64_t)(e_hi - e_lo + 1)));
    w.data = p;
    w.scale = s;
    return w;
}

/* A weight of fmt, rows x cols elements of elem bytes, not filled; *ret: its data. */
static inline struct bweight kref_w_new(enum wfmt fmt, int64_t rows, int64_t cols, size_t elem,
                                        void **ret)
{
    struct bweight w = { .fmt = fmt, .rows = rows, .cols = cols };

    *ret = malloc((size_t)(rows * cols) * elem);
    ASSERT_TRUE(*ret);
    w.data = *ret;
    return w;
}

static inline struct bweight kref_bf16_new(int64_t rows, int64_t cols, float amp)
{
    void *d;
    struct bweight w = kref_w_new(WFMT_BF16, rows, cols, 2, &d);
    uint16_t *p = d;

    for (int64_t i = 0; i < rows * cols; i++)
        p[i] = kf32_to_bf16(amp * krng_f());
    return w;
}

static inline struct bweight kref_f32_new(int64_t rows, int64_t cols, float amp)
{
    void *d;
    struct bweight w = kref_w_new(WFMT_F32, rows, cols, 4, &d);

    krng_fill(d, (size_t)(rows * cols), amp);
    return w;
}

static inline void kref_weight_free(struct bweight *w)
{
    free((void *)w->data);
    free((void *)w->scale);
    w->data = NULL;
    w->scale = NULL;
}

/* element (o, i) of any host weight as fp32, from the on-disk bytes */
static inline float kref_w(const struct bweight *w, int64_t o, int64_t i)
{
    switch (w->fmt) {
    case WFMT_F32: return ((const float *)w->data)[o * w->cols + i];
    case WFMT_BF16: return kbf16_to_f32(((const uint16_t *)w->data)[o * w->cols + i]);
    case WFMT_MXFP4: return kref_mxfp4(w->data, w->scale, w->cols, o, i);
    default: abort();
    }
}

/* y[n, rows] = x · Wᵀ in fp64 (sequential), plus Σ|w·x| per output for tolerances */
static inline void kref_matmul(const struct bweight *w, const float *x, int n, double *y, double *mag)
{
    for (int t = 0; t < n; t++) {
        for (int64_t o = 0; o < w->rows; o++) {
            double s = 0.0, m = 0.0;

            for (int64_t i = 0; i < w->cols; i++) {
                double p = (double)kref_w(w, o, i) * x[(int64_t)t * w->cols + i];

                s += p;
                m += fabs(p);
            }
            y[(int64_t)t * w->rows + o] = s;
            if (mag)
                mag[(int64_t)t * w->rows + o] = m;
        }
    }
}

static inline float kref_silu(float u)
{
    return (float)((double)u / (1.0 + exp(-(double)u)));
}

/* docs/MODEL.md §2.4 */
static inline float kref_swiglu(float u, float w, float limit)
{
    double s = kref_silu(u);

    if (limit > 0) {
        s = fmin(s, limit);
        w = fminf(fmaxf(w, -limit), limit);
    }
    return (float)(s * w);
}

static inline struct backend *kref_backend(int n_threads, bool exact)
{
    struct backend_cfg cfg = { .n_threads = n_threads, .mxfp4_exact = exact };
    struct backend *be = NULL;

    ASSERT_OK(backend_new("cpu", &cfg, &be));
    ASSERT_TRUE(be != NULL);
    return be;
}
