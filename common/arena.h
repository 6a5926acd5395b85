/* arena.h - bump allocator: init / alloc / reset / done.
 *
 * One malloc'd block of fixed capacity; arena_alloc() hands out aligned pieces
 * and never frees them individually; arena_reset() makes the whole block
 * reusable (per-step scratch).  Not thread-safe: one owner.
 */
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct arena {
    unsigned char *base;      /* owned block, NULL after arena_done() */
    size_t cap_bytes;         /* capacity of base */
    size_t used_bytes;        /* bytes handed out since the last reset (incl. padding) */
    size_t peak_bytes;        /* high-water mark of used_bytes */
};

/* Reserve cap_bytes. Returns 0 or -ENOMEM; -EINVAL for cap_bytes == 0. */
int arena_init(struct arena *a, size_t cap_bytes);
/* size bytes aligned to align (a power of two, <= 4096); NULL when full. */
void *arena_alloc(struct arena *a, size_t size, size_t align);
void arena_reset(struct arena *a);
void arena_done(struct arena *a);

#ifdef __cplusplus
}
#endif
