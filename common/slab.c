/* slab.c - one zeroed, aligned allocation for a set of fixed-size arrays, optionally headed
 * by the object that owns them (see slab.h).  Every offset and the total are multiples of
 * SLAB_ALIGN, so each array starts aligned and the block's size is valid for aligned_alloc.
 */
#include "slab.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* n rounded up to a multiple of SLAB_ALIGN; false where that overflows */
static bool round_up(size_t n, size_t *ret)
{
    size_t r;

    if (__builtin_add_overflow(n, (size_t)SLAB_ALIGN - 1, &r))
        return false;
    *ret = r & ~((size_t)SLAB_ALIGN - 1);
    return true;
}

int slab_size(const struct slab_part *parts, size_t n_parts, size_t *ret_bytes)
{
    size_t total = 0;

    for (size_t i = 0; i < n_parts; i++) {
        size_t bytes;

        if (__builtin_mul_overflow(parts[i].count, parts[i].size, &bytes) ||
            !round_up(bytes, &bytes) || __builtin_add_overflow(total, bytes, &total))
            return -EOVERFLOW;
    }
    *ret_bytes = total;
    return 0;
}

/* A zeroed block of head (rounded up) plus the parts' bytes; *ret_off: where the parts
 * start.  NULL with *ret_mem where the block would be empty. */
static int block_alloc(size_t head, const struct slab_part *parts, size_t n_parts,
                       char **ret_mem, size_t *ret_off)
{
    size_t arrays, total;
    char *mem = NULL;
    int r = slab_size(parts, n_parts, &arrays);

    if (r < 0)
        return r;
    if (!round_up(head, &head) || __builtin_add_overflow(head, arrays, &total))
        return -EOVERFLOW;
    if (total > 0) {
        mem = aligned_alloc(SLAB_ALIGN, total);
        if (!mem)
            return -ENOMEM;
        memset(mem, 0, total);
    }
    *ret_mem = mem;
    *ret_off = head;
    return 0;
}

/* Point each part's slot at its array, the arrays laid out from mem + off.  With a head,
 * the slots are inside it and the pointers set are those at the same offsets in copy. */
static void place(char *mem, size_t off, const struct slab_part *parts, size_t n_parts,
                  const void *head, char *copy)
{
    for (size_t i = 0; i < n_parts; i++) {
        size_t bytes = parts[i].count * parts[i].size;
        void *p = bytes ? mem + off : NULL;
        void *slot = head ? copy + ((uintptr_t)parts[i].slot - (uintptr_t)head) : parts[i].slot;

        /* the slot is a T *; every object pointer has void *'s representation here */
        memcpy(slot, &p, sizeof(p));
        round_up(bytes, &bytes);
        off += bytes;
    }
}

int slab_alloc(const struct slab_part *parts, size_t n_parts, void **ret_mem)
{
    char *mem;
    size_t off;
    int r = block_alloc(0, parts, n_parts, &mem, &off);

    if (r < 0)
        return r;
    place(mem, off, parts, n_parts, NULL, NULL);
    *ret_mem = mem;
    return 0;
}

int slab_new(const void *head, size_t head_size, const struct slab_part *parts, size_t n_parts,
             void *ret)
{
    uintptr_t lo = (uintptr_t)head;
    char *mem;
    size_t off;
    int r;

    if (!head || head_size < sizeof(void *))
        return -EINVAL;
    for (size_t i = 0; i < n_parts; i++) {
        uintptr_t at = (uintptr_t)parts[i].slot;

        if (at < lo || at - lo > head_size - sizeof(void *))
            return -EINVAL;
    }
    r = block_alloc(head_size, parts, n_parts, &mem, &off);
    if (r < 0)
        return r;
    memcpy(mem, head, head_size);
    place(mem, off, parts, n_parts, head, mem);
    memcpy(ret, &mem, sizeof(mem));
    return 0;
}
