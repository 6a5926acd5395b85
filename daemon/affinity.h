/* affinity.h - prefix-affine routing: which group last served each prompt prefix.
 *
 * A request's prompt is cut into blocks of `block` tokens and keyed by the prefix chain
 * (common/prefix.h: the same SHA-256 chain the engines key their cached KV blocks by,
 * salted by the request's cache_salt), 64 bits of each digest.  After a request is routed,
 * every full block of its prompt maps to its group; the next request that shares a prefix
 * finds the group that holds the longest part of it (the deepest key present), which has
 * those blocks in its prefix cache if they have not been evicted there since.  A bounded
 * table: the least recently used keys go first.  Loop thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct affinity;

/* At most max_entries keys (0: routing by prefix is off and affinity_new returns NULL in
 * *ret with 0). -ENOMEM. */
int affinity_new(uint32_t max_entries, struct affinity **ret);
void affinity_free(struct affinity *a);
/* Keys of the first full blocks of prompt (at most max); returns how many. */
size_t affinity_chain(const int32_t *prompt, size_t n, int block, const char *cache_salt,
                      uint64_t *keys, size_t max);
/* The group (its id) recorded for the deepest of keys[0..n) that usable() accepts, and that
 * key's depth (1-based) in *ret_depth; 0 when there is none.  A hit refreshes the key. */
uint64_t affinity_find(struct affinity *a, const uint64_t *keys, size_t n,
                       bool (*usable)(uint64_t group, void *ctx), void *ctx, size_t *ret_depth);
/* Record that group now holds keys[0..n). */
void affinity_note(struct affinity *a, const uint64_t *keys, size_t n, uint64_t group);
/* Keys held now (tests and metrics). */
uint32_t affinity_size(const struct affinity *a);
