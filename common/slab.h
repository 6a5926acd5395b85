/* slab.h - one allocation for the arrays an object sizes once, when it is made.
 *
 * The owner lists its arrays: where each pointer lives, the element size and the count.
 * The arrays are laid out one after the other, each starting at a SLAB_ALIGN boundary, in
 * one zeroed allocation, and every pointer is set; one free() releases them all.  A failure
 * (the sizes overflow, or no memory) sets nothing, so there is no partly allocated state to
 * undo.  Two forms:
 *
 *   - slab_new: the object itself heads the block.  The parts' pointers live in a template
 *     of the object (a local the caller fills); the template is copied to the head of the
 *     block and the pointers are set there, so the object and its arrays are one free():
 *
 *         struct sampler t = { .vocab = n };
 *         const struct slab_part parts[] = { SLAB_PART(t.x, n), SLAB_PART(t.idx, n) };
 *         return slab_new(&t, sizeof(t), parts, SLAB_N(parts), ret);   ... free(s);
 *
 *   - slab_alloc: the arrays only, for an object made earlier; the pointers are set where
 *     the parts say and the block is freed on its own.
 *
 * A part of count 0 gets NULL (as an array that was never allocated would).
 */
#pragma once

#include <stddef.h>

#define SLAB_ALIGN 64               /* a cache line: no two arrays share one */

struct slab_part {
    void *slot;                     /* a T **: where the array's address is stored */
    size_t size;                    /* sizeof(T) */
    size_t count;                   /* elements */
};

#define SLAB_PART(ptr, n) { .slot = &(ptr), .size = sizeof(*(ptr)), .count = (size_t)(n) }
#define SLAB_N(parts) (sizeof(parts) / sizeof((parts)[0]))

/* Bytes the parts take, alignment padding included: 0, or -EOVERFLOW where a count times
 * its size (or the sum) does not fit in a size_t. */
int slab_size(const struct slab_part *parts, size_t n_parts, size_t *ret_bytes);

/* One zeroed, SLAB_ALIGN-aligned block for the parts; sets each part's pointer and
 * *ret_mem (NULL where every part is empty).  0, -EOVERFLOW (the sizes do not fit) or
 * -ENOMEM; on failure no pointer is set. */
int slab_alloc(const struct slab_part *parts, size_t n_parts, void **ret_mem);

/* One SLAB_ALIGN-aligned block holding a copy of the head_size bytes at head, then the
 * parts (zeroed), whose slots must be pointers inside head: the copy's pointers are set to
 * the arrays, the template's are left alone.  ret is a T ** (T the head's type): it gets
 * the block.  0, -EINVAL (a slot outside the head), -EOVERFLOW or -ENOMEM; on failure
 * *ret is not set. */
int slab_new(const void *head, size_t head_size, const struct slab_part *parts, size_t n_parts,
             void *ret);
