/* kv.h - the paged KV block manager of rank 0 with its prefix cache (ids only; the
 * forward owns the memory).
 *
 * Two block groups (enum kv_group in plan.h): FULL layers keep every block of a
 * sequence, SLIDING layers (and the MTP layers) keep only the blocks that intersect the
 * attention window of the lowest position still to be computed; older sliding blocks are
 * released at once.  Logical block b of a sequence covers positions
 * [b*block_size, (b+1)*block_size); a released sliding block reads -1 in the table.
 *
 * Prefix cache (kv_pool_config.prefix_cache): once every position of a block is computed
 * (kv_seq_commit) it is keyed by a SHA-256 chain over the token ids of the whole prefix
 * it ends, d_0 = SHA-256(root, tokens of block 0), d_b = SHA-256(d_{b-1}, tokens of
 * block b), where root = kv_prefix_root(deployment salt, request cache_salt).  FULL
 * blocks are indexed by digest; the SLIDING block of the same chain position is attached
 * to the indexed FULL block, so a sliding block is only ever reused where its window
 * contents are identical.  A hit compares the whole key, never the digest alone: the
 * digest, the block's own tokens and its parent (the chain's previous block by id and
 * generation, or the root for block 0), so by induction the whole prefix.  A new
 * sequence (kv_seq_begin) walks the chain to its first uncached block and holds what it
 * reuses; released blocks stay cached (no reference, least recently released first in
 * line) and are evicted only when a fresh block is needed and no plain free one is left,
 * so -ENOSPC (and with it any preemption) means free + cached blocks are exhausted.
 * Block states per group: FREE (never keyed or evicted), CACHED (keyed, no reference),
 * HELD (one reference per slot table entry; keyed or not).  Invariant: free + cached +
 * held == total, and at idle held == 0.  Blocks at or after a slot's first position
 * still to compute are held by that slot alone and unkeyed (kv_seq_writable): no write
 * of the trunk ever lands in a shared block.
 *
 * MTP layers: their KV at position t of layer j was computed from the tokens up to
 * t + j + 1 and is final only where the writer ran the layer there with known tokens
 * (no draft among its inputs).  kv_seq_commit records per block how many leading MTP
 * layers hold final KV for all of its positions (for the groups of
 * kv_pool_config.mtp_group); a sequence that drafts K tokens reuses a prefix only where
 * every block its MTP layers read holds K, and only up to K tokens short of the chain it
 * verified, so the MTP layers' KV it inherits equals that of its own fresh prefill;
 * a sequence whose output does not depend on its drafts (or only in realisation, not in
 * distribution) may instead reuse the trunk's
 * prefix alone, its MTP layers then read what the blocks hold (holes, as after a step
 * that skipped them) and it learns how far their KV is final for it.
 * Not thread-safe: the engine thread owns the pool.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "plan.h"
#include "prefix.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KV_DIGEST_BYTES PREFIX_DIGEST_BYTES

struct kv_pool;

struct kv_pool_config {
    int block_size;               /* tokens per block (> 0) */
    int n_blocks[_KV_GROUP_MAX];  /* blocks per group (> 0) */
    int sliding_window;           /* keys a sliding layer sees incl. its own; 0 = no release */
    int max_seqs;                 /* slots 0 .. max_seqs-1 */
    int max_seq_len;              /* longest sequence in tokens (sizes the tables) */
    bool prefix_cache;            /* key computed blocks and keep released ones for reuse */
    bool mtp_group[_KV_GROUP_MAX];/* groups that hold MTP layers' KV */
    int test_digest_cut_bits;     /* tests only: zero the last N bits of every block digest
                                     (0..256) to force collisions; 0 in service */
};

/* Create a pool.  Returns 0 and *ret, -EINVAL on a bad config, -ENOMEM. */
int kv_pool_new(const struct kv_pool_config *cfg, struct kv_pool **ret);
void kv_pool_free(struct kv_pool *kv);

/* The chain root of a request: SHA-256 over a version tag, the deployment salt and the
 * request's cache_salt (n bytes; NULL or 0 = none).  Requests share cached blocks only
 * when their roots are equal. */
void kv_prefix_root(const uint8_t deploy_salt[KV_DIGEST_BYTES], const char *cache_salt, size_t n,
                    uint8_t ret_root[KV_DIGEST_BYTES]);

/* Start a new sequence in slot (which must hold nothing) over tokens[0 .. n_tokens): with
 * the prefix cache on and root non-NULL, hold the longest cached prefix that leaves at
 * least one token to compute and that a sequence drafting mtp_depth tokens may use (see
 * above), and remember root so that kv_seq_commit keys the blocks the slot computes.
 * ret_mtp_final NULL: the MTP layers' KV must be final wherever the prefix is reused (a
 * sequence whose drafts must equal those of its own fresh prefill).  Non-NULL: the trunk's
 * longest cached prefix is reused whatever its MTP KV (a sequence whose output does not
 * depend on its drafts, or only in realisation, not in distribution), and *ret_mtp_final gets the tokens below which the KV of
 * the first mtp_depth MTP layers is final for it (the reuse above with the MTP bound; at
 * most the return value).  Returns the tokens reused (a multiple of block_size; 0 when
 * nothing matches, the cache is off or root is NULL); kv_seq_grow from there. */
int32_t kv_seq_begin(struct kv_pool *kv, int slot, const uint8_t *root, const int32_t *tokens,
                     int32_t n_tokens, int mtp_depth, int32_t *ret_mtp_final);
/* The slot's KV is final at positions < n_computed (tokens[0 .. n_computed) known), and
 * that of MTP layer j < n_mtp at positions < mtp_final[j]: key the blocks that became
 * complete, index each unless an identical one is indexed already, and record the MTP
 * layers final in the blocks the slot computed.  No-op for a slot started without root. */
void kv_seq_commit(struct kv_pool *kv, int slot, const int32_t *tokens, int32_t n_computed,
                   const int32_t *mtp_final, int n_mtp);

/* New blocks slot would need, per group, so that positions 0 .. n_pos-1 are covered when
 * the lowest position still to be computed is pos_lo (sliding blocks wholly below
 * pos_lo - window + 1 are not needed), net of the blocks the slot releases on the way
 * that no other slot holds.  Writes ret_need[_KV_GROUP_MAX]. */
void kv_seq_need(const struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos,
                 int ret_need[_KV_GROUP_MAX]);
/* Release sliding blocks no longer needed for pos_lo, then allocate what is missing to
 * cover 0 .. n_pos-1 (plain free blocks first, then evicting cached ones, least recently
 * released first).  All or nothing: returns -ENOSPC (nothing allocated) when a group
 * lacks free + cached blocks, -E2BIG when n_pos exceeds max_seq_len, else 0. */
int kv_seq_grow(struct kv_pool *kv, int slot, int32_t pos_lo, int32_t n_pos);
/* Drop every block of slot (cached ones stay cached, the chain's last blocks first in line
 * for eviction); no-op for an empty slot. */
void kv_seq_release(struct kv_pool *kv, int slot);

/* The slot's table for group g: *ret_n logical blocks, entries are block ids or -1. */
const int32_t *kv_seq_table(const struct kv_pool *kv, int slot, enum kv_group g, int *ret_n);
/* Blocks the slot holds in group g. */
int kv_seq_held(const struct kv_pool *kv, int slot, enum kv_group g);
/* True when every block the slot holds at or after position pos's block, in both groups,
 * is held by the slot alone and unkeyed (where a step may write). */
bool kv_seq_writable(const struct kv_pool *kv, int slot, int32_t pos);

int kv_pool_total(const struct kv_pool *kv, enum kv_group g);
/* Blocks of group g by state: plain free, cached (keyed, no reference), held.  free +
 * cached can be handed out; free + cached + held == total. */
int kv_pool_free_count(const struct kv_pool *kv, enum kv_group g);
int kv_pool_cached_count(const struct kv_pool *kv, enum kv_group g);
int kv_pool_held_count(const struct kv_pool *kv, enum kv_group g);
/* Fraction of blocks held over both groups, in [0, 1]. */
double kv_pool_usage(const struct kv_pool *kv);

/* Cached blocks evicted to make room, both groups, since kv_pool_new. */
uint64_t kv_pool_evictions(const struct kv_pool *kv);

/* Check internal consistency: every block in exactly one state, reference counts equal the
 * table entries, the index and the sliding attachments agree, no two indexed blocks with
 * the same key.  Returns 0 or -EUCLEAN. */
int kv_pool_check(const struct kv_pool *kv);
/* True when nothing is held: free + cached == total in every group. */
bool kv_pool_idle(const struct kv_pool *kv);

#ifdef __cplusplus
}
#endif
