/* kv.h - the paged KV block manager of rank 0 (ids only; the forward owns the memory).
 *
 * Two block groups (enum kv_group in plan.h): FULL layers keep every block of a
 * sequence, SLIDING layers (and the MTP layers) keep only the blocks that intersect the
 * attention window of the lowest position still to be computed; older sliding blocks go
 * back to the pool at once.  Logical block b of a sequence covers positions
 * [b*block_size, (b+1)*block_size); a released sliding block reads -1 in the table.
 * Every block has exactly one owner (a slot), so the invariant is simple: free blocks of
 * a group + blocks held by all slots == total, and at idle free == total.
 * Not thread-safe: the engine thread owns the pool.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "plan.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kv_pool;

struct kv_pool_config {
    int block_size;               /* tokens per block (> 0) */
    int n_blocks[_KV_GROUP_MAX];  /* blocks per group (> 0) */
    int sliding_window;           /* keys a sliding layer sees incl. its own; 0 = no release */
    int max_seqs;                 /* slots 0 .. max_seqs-1 */
    int max_seq_len;              /* longest sequence in tokens (sizes the tables) */
};

/* Create a pool.  Returns 0 and *ret, -EINVAL on a bad config, -ENOMEM. */
int kv_pool_new(const struct kv_pool_config *cfg, struct kv_pool **ret);
void kv_pool_free(struct kv_pool *kv);

/* New blocks slot would need, per group, so that positions 0 .. n_pos-1 are covered when
 * the lowest position still to be computed is pos_lo (sliding blocks wholly below
 * pos_lo - window + 1 are not needed).  Writes ret_need[_KV_GROUP_MAX]. */
void kv_seq_need(const struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos,
                 int ret_need[_KV_GROUP_MAX]);
/* Release sliding blocks no longer needed for pos_lo, then allocate what is missing to
 * cover 0 .. n_pos-1.  All or nothing: returns -ENOSPC (nothing allocated) when a group
 * lacks free blocks, -E2BIG when n_pos exceeds max_seq_len, else 0. */
int kv_seq_grow(struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos);
/* Return every block of slot to the pool (no-op for an empty slot). */
void kv_seq_release(struct kv_pool *kv, int slot);

/* The slot's table for group g: *ret_n logical blocks, entries are block ids or -1. */
const int32_t *kv_seq_table(const struct kv_pool *kv, int slot, enum kv_group g, int *ret_n);
/* Blocks the slot holds in group g. */
int kv_seq_held(const struct kv_pool *kv, int slot, enum kv_group g);

int kv_pool_block_size(const struct kv_pool *kv);
int kv_pool_total(const struct kv_pool *kv, enum kv_group g);
int kv_pool_free_count(const struct kv_pool *kv, enum kv_group g);
/* Fraction of blocks in use over both groups, in [0, 1]. */
double kv_pool_usage(const struct kv_pool *kv);
/* Check internal consistency (every block owned once or free, counts agree).  Returns 0
 * or -EUCLEAN. */
int kv_pool_check(const struct kv_pool *kv);
/* True when nothing is held: free == total in every group. */
bool kv_pool_idle(const struct kv_pool *kv);

#ifdef __cplusplus
}
#endif
