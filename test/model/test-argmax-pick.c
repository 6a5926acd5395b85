/* test-argmax-pick.c - the rule rank 0 of a vocab-sharded group picks each greedy row's token
 * by (model_argmax_pick, issue 38): from one (value, global id) pair per rank, the choice
 * sampler_argmax makes over the whole row.
 *   - the cases by hand: equal values across ranks (the lower id, whichever rank comes
 *     first), a NaN in one rank, an all-NaN row (0), -0.0 against +0.0 (equal: the lower
 *     id), -inf, a larger value at a higher id;
 *   - rows of 64 with ties, NaN, signed zeros and infinities split into 2, 4 and 8 slices:
 *     each slice reduced by the CPU backend's argmax (k = 1, with its value) as a rank does,
 *     the pick equals sampler_argmax of the whole row;
 *   - the sampled form's merge (model_topk_merge): the same rows, each slice reduced to its
 *     k best (k 1, 3, 16, 64: more than a slice holds), merged: the CPU backend's top-k of
 *     the whole row, ids and values bit for bit; and the host's top-k (sampler_top_k, a
 *     group's fallback) equals it too. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "harness.h"
#include "model.h"
#include "sampler.h"

static int32_t pick2(float v0, int32_t i0, float v1, int32_t i1)
{
    const float v[2] = { v0, v1 };
    const int32_t id[2] = { i0, i1 };

    return model_argmax_pick(v, id, 2);
}

static void test_cases(void)
{
    const float nan = NAN, inf = INFINITY;

    /* equal values on two ranks: the lower id, in either order */
    ASSERT_EQ(pick2(1.5f, 3, 1.5f, 40), 3);
    ASSERT_EQ(pick2(1.5f, 40, 1.5f, 3), 3);
    /* a larger value wins at any id */
    ASSERT_EQ(pick2(1.0f, 3, 2.0f, 40), 40);
    ASSERT_EQ(pick2(2.0f, 40, 1.0f, 3), 40);
    /* NaN in one rank is never chosen, whatever its id or place */
    ASSERT_EQ(pick2(nan, 0, -5.0f, 33), 33);
    ASSERT_EQ(pick2(-5.0f, 33, nan, 1), 33);
    /* an all-NaN row: 0, as sampler_argmax answers */
    ASSERT_EQ(pick2(nan, 7, nan, 40), 0);
    {
        const float v[4] = { nan, nan, nan, nan };
        const int32_t id[4] = { 5, 21, 37, 53 };

        ASSERT_EQ(model_argmax_pick(v, id, 4), 0);
    }
    /* -0.0 equals +0.0: the lower id, in either order and either sign */
    ASSERT_EQ(pick2(-0.0f, 9, 0.0f, 30), 9);
    ASSERT_EQ(pick2(0.0f, 30, -0.0f, 9), 9);
    ASSERT_EQ(pick2(0.0f, 9, -0.0f, 30), 9);
    /* -inf is a value like any other (above NaN) */
    ASSERT_EQ(pick2(nan, 2, -inf, 17), 17);
    ASSERT_EQ(pick2(-inf, 17, -inf, 4), 4);
    ASSERT_EQ(pick2(inf, 60, 3.0f, 1), 60);
    /* three ranks: a tie between the last two behind a NaN */
    {
        const float v[3] = { nan, 0.25f, 0.25f };
        const int32_t id[3] = { 0, 50, 20 };

        ASSERT_EQ(model_argmax_pick(v, id, 3), 20);
    }
}

static uint32_t rnd(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* A row of n values from few distinct ones, so that ties within and across slices are
 * common; some NaN, signed zeros and infinities; sometimes nearly all NaN. */
static void make_row(float *x, int n, uint32_t *s)
{
    static const float pool[] = { -0.0f, 0.0f, 1.0f, 1.0f, 2.5f, -3.0f, -INFINITY, INFINITY,
                                  NAN, NAN };
    int mode = (int)(rnd(s) % 8);

    for (int i = 0; i < n; i++) {
        int k = (int)(rnd(s) % (mode == 0 ? 2u : mode == 1 ? 10u : 8u));

        x[i] = mode == 0 ? (k ? NAN : pool[rnd(s) % 8]) :
               mode == 2 && k == 7 ? -INFINITY : pool[k];
        if (mode == 3 && x[i] == INFINITY)
            x[i] = 2.5f;
    }
    if (mode == 0 && rnd(s) % 3 == 0)
        for (int i = 0; i < n; i++)
            x[i] = NAN;
}

static void test_random(void)
{
    enum { N = 64, ROWS = 4000 };
    struct backend_cfg bc = { .n_threads = 1 };
    struct backend *be;
    static float x[N];
    uint32_t s = 12345;
    int n_nan = 0, n_tie = 0;

    ASSERT_OK(backend_new("cpu", &bc, &be));
    for (int it = 0; it < ROWS; it++) {
        int W = 2 << (it % 3), Vl = N / W;
        float v[8];
        int32_t id[8], want, got;

        make_row(x, N, &s);
        for (int w = 0; w < W; w++) {
            ASSERT_OK(backend_argmax(be, x + w * Vl, 1, Vl, 1, &id[w], &v[w]));
            id[w] += w * Vl;
        }
        want = sampler_argmax(x, N);
        got = model_argmax_pick(v, id, W);
        if (got != want)
            FAIL("row %d over %d slices: picked %d (%g), sampler_argmax %d (%g)", it, W, got,
                 (double)x[got], want, (double)x[want]);
        n_nan += isnan(x[want]);
        for (int w = 0; w < W; w++)
            n_tie += !isnan(v[w]) && v[w] == x[want] && id[w] != want;
    }
    printf("%d rows split over 2, 4 and 8 slices: the pick is sampler_argmax's (%d all-NaN "
           "rows, %d slices tied with the chosen value at a higher id)\n", ROWS, n_nan, n_tie);
    ASSERT_TRUE(n_nan > 0 && n_tie > 0);
    backend_free(be);
}

static void test_merge(void)
{
    enum { N = 64, ROWS = 3000, KM = 64 };
    static const int ks[] = { 1, 3, 16, 64 };
    struct backend_cfg bc = { .n_threads = 1 };
    struct backend *be;
    static float x[N], v[8 * KM], want_v[KM], got_v[KM], host_v[KM];
    static int32_t id[8 * KM], want[KM], got[KM], host[KM];
    uint32_t s = 777;
    int n_short = 0;

    ASSERT_OK(backend_new("cpu", &bc, &be));
    for (int it = 0; it < ROWS; it++) {
        int W = 2 << (it % 3), Vl = N / W, k = ks[(it / 3) % 4];
        int ke = k < Vl ? k : Vl;       /* a slice has at most Vl places */

        make_row(x, N, &s);
        for (int w = 0; w < W; w++) {
            ASSERT_OK(backend_argmax(be, x + w * Vl, 1, Vl, ke, &id[w * ke], &v[w * ke]));
            for (int j = 0; j < ke; j++)
                id[w * ke + j] = id[w * ke + j] < 0 ? -1 : id[w * ke + j] + w * Vl;
        }
        ASSERT_OK(backend_argmax(be, x, 1, N, k, want, want_v));
        model_topk_merge(v, id, W, ke, k, got, got_v);
        sampler_top_k(x, N, k, host, host_v);
        for (int j = 0; j < k; j++) {
            bool same_v = memcmp(&got_v[j], &want_v[j], 4) == 0 ||
                          (isnan(got_v[j]) && isnan(want_v[j]));
            bool host_v_ok = memcmp(&host_v[j], &want_v[j], 4) == 0 ||
                             (isnan(host_v[j]) && isnan(want_v[j]));
            if (got[j] != want[j] || !same_v)
                FAIL("row %d over %d slices, top-%d place %d: merged %d (%g), whole row %d (%g)",
                     it, W, k, j, got[j], (double)got_v[j], want[j], (double)want_v[j]);
            if (host[j] != want[j] || !host_v_ok)
                FAIL("row %d top-%d place %d: host %d (%g), backend %d (%g)", it, k, j, host[j],
                     (double)host_v[j], want[j], (double)want_v[j]);
        }
        n_short += want[k - 1] < 0;
    }
    printf("%d rows over 2, 4 and 8 slices, top-1/3/16/64: the merge is the whole row's top-k "
           "(%d rows with fewer candidates than k)\n", ROWS, n_short);
    ASSERT_TRUE(n_short > 0);
    backend_free(be);
}

int main(void)
{
    test_cases();
    test_random();
    test_merge();
    printf("ok\n");
    return 0;
}
