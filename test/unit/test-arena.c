/* test-arena.c - bump allocator: alignment, capacity, reset, peak. */
#include <errno.h>
#include <stdint.h>

#include "arena.h"
#include "harness.h"

int main(void)
{
    struct arena a;
    void *p, *q;

    ASSERT_ERR(arena_init(&a, 0), -EINVAL);
    ASSERT_OK(arena_init(&a, 1024));
    p = arena_alloc(&a, 3, 1);
    q = arena_alloc(&a, 8, 64);
    ASSERT_TRUE(p && q);
    ASSERT_EQ((uintptr_t) q % 64, 0);
    ASSERT_EQ(a.used_bytes, 72);
    ASSERT_TRUE(arena_alloc(&a, 1024, 1) == NULL);   /* does not fit */
    ASSERT_TRUE(arena_alloc(&a, SIZE_MAX, 1) == NULL);
    ASSERT_TRUE(arena_alloc(&a, 952, 1) != NULL);    /* exactly fills */
    ASSERT_TRUE(arena_alloc(&a, 1, 1) == NULL);
    arena_reset(&a);
    ASSERT_EQ(a.used_bytes, 0);
    ASSERT_EQ(a.peak_bytes, 1024);
    ASSERT_TRUE(arena_alloc(&a, 16, 16) == p);
    arena_done(&a);
    ASSERT_TRUE(arena_alloc(&a, 1, 1) == NULL);
    return 0;
}
