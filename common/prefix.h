/* prefix.h - the prefix chain: the keys by which a prompt's leading blocks are known.
 *
 * root = SHA-256("stepd prefix cache v1", deployment salt, len(cache_salt), cache_salt);
 * d_0 = SHA-256(root, little-endian token ids of block 0), d_b = SHA-256(d_{b-1}, block b).
 * The engine keys its cached KV blocks by it (worker/engine/kv.c: two prompts share a block
 * only when their whole prefixes and salts are equal) and the coordinator routes by it
 * (daemon/affinity.c: a request goes to the group that holds its longest prefix).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define PREFIX_DIGEST_BYTES 32

void prefix_root(const uint8_t deploy_salt[PREFIX_DIGEST_BYTES], const char *cache_salt, size_t n,
                 uint8_t ret_root[PREFIX_DIGEST_BYTES]);
/* d = SHA-256(prev, the n token ids of one block, little-endian). */
void prefix_block_digest(const uint8_t prev[PREFIX_DIGEST_BYTES], const int32_t *tokens, int n,
                         uint8_t ret[PREFIX_DIGEST_BYTES]);
