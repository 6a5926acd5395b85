/* arena.c - see arena.h. */
#include "arena.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "err.h"

int arena_init(struct arena *a, size_t cap_bytes)
{
    a->base = NULL;
    a->cap_bytes = a->used_bytes = a->peak_bytes = 0;
    if (cap_bytes == 0)
        return -EINVAL;
    /* 4096-aligned so that any alignment up to a page holds for offsets */
    if (posix_memalign((void **) &a->base, 4096, cap_bytes) != 0) {
        a->base = NULL;
        return -ENOMEM;
    }
    a->cap_bytes = cap_bytes;
    return 0;
}

void *arena_alloc(struct arena *a, size_t size, size_t align)
{
    size_t off;

    ASSERT(align != 0 && (align & (align - 1)) == 0 && align <= 4096);
    if (!a->base)
        return NULL;
    off = (a->used_bytes + align - 1) & ~(align - 1);
    if (off < a->used_bytes || off > a->cap_bytes || size > a->cap_bytes - off)
        return NULL;
    a->used_bytes = off + size;
    if (a->used_bytes > a->peak_bytes)
        a->peak_bytes = a->used_bytes;
    return a->base + off;
}

void arena_reset(struct arena *a)
{
    a->used_bytes = 0;
}

void arena_done(struct arena *a)
{
    free(a->base);
    a->base = NULL;
    a->cap_bytes = a->used_bytes = 0;
}
