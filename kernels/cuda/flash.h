/* flash.h - the softmax arithmetic of the CUDA attention kernels (attention.cu): the
 * online update over key tiles, the split of a context across thread blocks
 * (flash-decoding) and the merge of their partial softmaxes.
 *
 * Scores are kept in the log2 domain: s = (q . k) * scale * log2(e), so that every
 * exponential is an exp2.  A partial result over a set of keys is (m, l, o[d]):
 * m = max s (-inf when the set is empty or fully masked), l = sum 2^(s - m),
 * o = sum 2^(s - m) v.  The final output is o / l of the merge of all parts.
 */
#pragma once

#include <math.h>
#include <stdint.h>

#include "hd.h"

#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_KEY_TILE 64       /* keys per tile; context splits are multiples of it */
#define FLASH_MAX_SPLITS 64

/* 2^(s - m), 0 for a masked score or an empty running max. */
HD float flash_p(float s, float m)
{
    return (s == -INFINITY || m == -INFINITY) ? 0.0f : exp2f(s - m);
}

/* The factor that rescales (l, o) accumulated under max m_old to the new max m_new. */
HD float flash_rescale(float m_old, float m_new)
{
    return m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
}

/* Keys [lo, hi) of split `split` of n_splits over the context [klo, khi) (tile-aligned
 * from klo). */
HD void flash_split_range(int64_t klo, int64_t khi, int n_splits, int split, int64_t *lo,
                          int64_t *hi)
{
    int64_t a, b;

    hd_split(khi - klo, FLASH_KEY_TILE, n_splits, split, &a, &b);
    *lo = klo + a;
    *hi = klo + b;
}

/* Splits a launch uses for `blocks` (sequence, KV head) pairs on `sms` multiprocessors:
 * about two blocks per multiprocessor, at most FLASH_MAX_SPLITS, at least 1. */
HD int flash_n_splits(int blocks, int sms)
{
    int n = blocks > 0 ? (2 * sms + blocks - 1) / blocks : 1;

    return n < 1 ? 1 : n > FLASH_MAX_SPLITS ? FLASH_MAX_SPLITS : n;
}

/* Keys a run of queries at positions [p_first, p_last] reads: [klo, khi).  window 0 =
 * full causal; else query t sees t - window + 1 .. t (docs/MODEL.md §2.3 step 5). */
HD void flash_key_range(int64_t p_first, int64_t p_last, int window, int64_t *klo, int64_t *khi)
{
    int64_t lo = window > 0 ? p_first - window + 1 : 0;

    *klo = lo > 0 ? lo : 0;
    *khi = p_last + 1;
}

/* Whether the query at position t attends to the key at position tau. */
HD int flash_key_ok(int64_t tau, int64_t t, int window)
{
    return tau <= t && (window <= 0 || tau > t - window);
}

/* Merge coefficients of n parts: out = sum_i coef[i] * o_i, coef[i] = 2^(m_i - M) / L,
 * M = max m_i, L = sum 2^(m_i - M) l_i.  All parts empty: every coef 0 (output 0). */
HD void flash_merge_coef(int n, const float *m, const float *l, int64_t stride, float *coef)
{
    float mx = -INFINITY, sum = 0.0f;

    for (int i = 0; i < n; i++)
        mx = m[i * stride] > mx ? m[i * stride] : mx;
    for (int i = 0; i < n; i++) {
        coef[i] = flash_rescale(m[i * stride], mx);
        sum += coef[i] * l[i * stride];
    }
    for (int i = 0; i < n; i++)
        coef[i] = sum > 0.0f ? coef[i] / sum : 0.0f;
}
