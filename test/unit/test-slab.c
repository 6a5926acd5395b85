/* test-slab.c - slab: every array starts SLAB_ALIGN-aligned, zeroed, after the end of the one
 * before (writing each whole array disturbs no other), a count of 0 gives NULL and nothing at
 * all gives no block; a count times size, its rounding or the sum that overflows a size_t is
 * refused with -EOVERFLOW and a block that cannot be had with -ENOMEM, setting no pointer.
 * slab_new: the object heads the block, a copy of its template with the pointers set there
 * (the template's left alone), its arrays after it; a slot outside the template is -EINVAL. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "slab.h"

/* A sanitizer build must hand back NULL for the impossible request, not abort on it. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
    return "allocator_may_return_null=1";
}

static bool all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++)
        if (b[i])
            return false;
    return true;
}

static void test_layout(void)
{
    struct {
        float *f;
        uint8_t *u;
        double *d;
        int32_t *none;
        uint8_t (*digest)[32];
    } o;
    void *sentinel = &o;
    const size_t n_f = 3, n_u = 65, n_d = 17, n_digest = 5;
    void *mem = sentinel;

    o.none = sentinel;
    const struct slab_part parts[] = {
        SLAB_PART(o.f, n_f), SLAB_PART(o.u, n_u), SLAB_PART(o.d, n_d),
        SLAB_PART(o.none, 0), SLAB_PART(o.digest, n_digest),
    };
    size_t bytes;

    ASSERT_OK(slab_size(parts, SLAB_N(parts), &bytes));
    /* 12 -> 64, 65 -> 128, 136 -> 192, 0, 160 -> 192 */
    ASSERT_EQ(bytes, 64 + 128 + 192 + 192);
    ASSERT_OK(slab_alloc(parts, SLAB_N(parts), &mem));
    ASSERT_TRUE(mem != NULL && mem != sentinel);
    ASSERT_TRUE(o.none == NULL);
    ASSERT_TRUE((void *)o.f == mem);
    ASSERT_EQ((uintptr_t)o.f % SLAB_ALIGN, 0);
    ASSERT_EQ((uintptr_t)o.u % SLAB_ALIGN, 0);
    ASSERT_EQ((uintptr_t)o.d % SLAB_ALIGN, 0);
    ASSERT_EQ((uintptr_t)o.digest % SLAB_ALIGN, 0);
    ASSERT_TRUE((char *)o.u >= (char *)(o.f + n_f));
    ASSERT_TRUE((char *)o.d >= (char *)(o.u + n_u));
    ASSERT_TRUE((char *)o.digest >= (char *)(o.d + n_d));
    ASSERT_TRUE((char *)(o.digest + n_digest) <= (char *)mem + bytes);
    ASSERT_TRUE(all_zero(mem, bytes));
    /* each array is its own: filling one leaves the others zero */
    memset(o.u, 0xab, n_u);
    ASSERT_TRUE(all_zero(o.f, n_f * sizeof(*o.f)));
    ASSERT_TRUE(all_zero(o.d, n_d * sizeof(*o.d)));
    for (size_t i = 0; i < n_f; i++)
        o.f[i] = 1.5f;
    for (size_t i = 0; i < n_d; i++)
        o.d[i] = -2.0;
    memset(o.digest, 0xcd, n_digest * sizeof(*o.digest));
    for (size_t i = 0; i < n_u; i++)
        ASSERT_EQ(o.u[i], 0xab);
    ASSERT_TRUE(o.f[n_f - 1] == 1.5f && o.d[0] == -2.0 && o.d[n_d - 1] == -2.0);
    free(mem);
}

static void test_empty(void)
{
    int32_t *a = (int32_t *)&a, *b = (int32_t *)&b;
    void *mem = &mem;
    const struct slab_part parts[] = { SLAB_PART(a, 0), SLAB_PART(b, 0) };
    size_t bytes = 1;

    ASSERT_OK(slab_size(parts, SLAB_N(parts), &bytes));
    ASSERT_EQ(bytes, 0);
    ASSERT_OK(slab_alloc(parts, SLAB_N(parts), &mem));
    ASSERT_TRUE(mem == NULL && a == NULL && b == NULL);
    ASSERT_OK(slab_alloc(NULL, 0, &mem));
    ASSERT_TRUE(mem == NULL);
}

/* parts that cannot be had: the call fails with want and sets no pointer */
static void refused(const struct slab_part *parts, size_t n, int want)
{
    void *mem = &mem;
    size_t bytes = 7;

    if (want == -EOVERFLOW) {
        ASSERT_ERR(slab_size(parts, n, &bytes), -EOVERFLOW);
        ASSERT_EQ(bytes, 7);
    }
    ASSERT_ERR(slab_alloc(parts, n, &mem), want);
    ASSERT_TRUE(mem == &mem);
}

static void test_refused(void)
{
    int32_t *a = (int32_t *)&a;
    double *b = (double *)&b;
    uint8_t *c = (uint8_t *)&c;

    /* count times size */
    const struct slab_part mul[] = { SLAB_PART(a, 4), SLAB_PART(b, SIZE_MAX / 4) };
    refused(mul, SLAB_N(mul), -EOVERFLOW);
    /* a negative int count, as a size_t */
    int neg = -1;
    const struct slab_part negative[] = { SLAB_PART(a, neg) };
    refused(negative, SLAB_N(negative), -EOVERFLOW);
    /* rounding up to SLAB_ALIGN */
    const struct slab_part round[] = { SLAB_PART(c, SIZE_MAX - 3) };
    refused(round, SLAB_N(round), -EOVERFLOW);
    /* the sum: each fits, together they do not */
    const struct slab_part sum[] = { SLAB_PART(c, SIZE_MAX / 2), SLAB_PART(c, SIZE_MAX / 2) };
    refused(sum, SLAB_N(sum), -EOVERFLOW);
    /* no overflow, but far more than any machine has */
    const struct slab_part huge[] = { SLAB_PART(a, 1), SLAB_PART(c, SIZE_MAX / 4) };
    refused(huge, SLAB_N(huge), -ENOMEM);
    ASSERT_TRUE(a == (int32_t *)&a && b == (double *)&b && c == (uint8_t *)&c);
}

struct obj {
    int n;
    float *f;
    char name[13];
    int32_t *none;
    struct {
        double *d;
    } g[2];
    uint8_t *u;
};

static void test_new(void)
{
    struct obj t = { .n = 42, .name = "template" }, *o = NULL;
    const struct slab_part parts[] = {
        SLAB_PART(t.f, 3), SLAB_PART(t.none, 0), SLAB_PART(t.g[0].d, 9), SLAB_PART(t.g[1].d, 1),
        SLAB_PART(t.u, 200),
    };

    ASSERT_OK(slab_new(&t, sizeof(t), parts, SLAB_N(parts), &o));
    ASSERT_TRUE(o != NULL && o != &t);
    ASSERT_EQ((uintptr_t)o % SLAB_ALIGN, 0);
    /* the template is as it was; the copy has its scalars and new pointers */
    ASSERT_TRUE(!t.f && !t.none && !t.g[0].d && !t.g[1].d && !t.u);
    ASSERT_EQ(o->n, 42);
    ASSERT_STREQ(o->name, "template");
    ASSERT_TRUE(o->none == NULL);
    char *end = (char *)(o + 1);
    void *arrays[] = { o->f, o->g[0].d, o->g[1].d, o->u };
    size_t bytes[] = { 3 * sizeof(float), 9 * sizeof(double), sizeof(double), 200 };
    for (size_t i = 0; i < 4; i++) {
        ASSERT_TRUE(arrays[i] != NULL);
        ASSERT_EQ((uintptr_t)arrays[i] % SLAB_ALIGN, 0);
        ASSERT_TRUE((char *)arrays[i] >= end);
        ASSERT_TRUE(all_zero(arrays[i], bytes[i]));
        memset(arrays[i], 0x5a, bytes[i]);
        end = (char *)arrays[i] + bytes[i];
    }
    ASSERT_EQ(o->n, 42);
    ASSERT_STREQ(o->name, "template");
    free(o);

    /* a slot that is not inside the template */
    float *outside = NULL;
    const struct slab_part bad[] = { SLAB_PART(t.f, 1), SLAB_PART(outside, 1) };
    o = (struct obj *)&o;
    ASSERT_ERR(slab_new(&t, sizeof(t), bad, SLAB_N(bad), &o), -EINVAL);
    const struct slab_part past[] = { SLAB_PART(t.u, 1) };
    ASSERT_ERR(slab_new(&t, offsetof(struct obj, u), past, SLAB_N(past), &o), -EINVAL);
    /* sizes that do not fit: the arrays, or (last) the arrays fit but not with the head */
    const struct slab_part big[] = { SLAB_PART(t.f, SIZE_MAX / 2) };
    ASSERT_ERR(slab_new(&t, sizeof(t), big, SLAB_N(big), &o), -EOVERFLOW);
    const struct slab_part last[] = { SLAB_PART(t.u, SIZE_MAX - SLAB_ALIGN + 1) };
    ASSERT_ERR(slab_new(&t, sizeof(t), last, SLAB_N(last), &o), -EOVERFLOW);
    const struct slab_part huge[] = { SLAB_PART(t.u, SIZE_MAX / 4) };
    ASSERT_ERR(slab_new(&t, sizeof(t), huge, SLAB_N(huge), &o), -ENOMEM);
    ASSERT_TRUE(o == (struct obj *)&o);
    ASSERT_TRUE(!t.f && !t.u && !outside);
    /* a head alone */
    ASSERT_OK(slab_new(&t, sizeof(t), NULL, 0, &o));
    ASSERT_EQ(o->n, 42);
    ASSERT_TRUE(o->f == NULL);
    free(o);
}

int main(void)
{
    test_layout();
    test_empty();
    test_refused();
    test_new();
    printf("slab: ok\n");
    return 0;
}
