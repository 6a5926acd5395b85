/* sha256.h - SHA-256 (FIPS 180-4), incremental, no dependencies.
 *
 * The prefix cache keys KV blocks by a SHA-256 chain over token ids (worker/engine/kv.h):
 * a collision-resistant digest, so that no crafted prompt can make two different
 * prefixes share a key.  Not constant-time (the inputs are not secrets).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHA256_BYTES 32

struct sha256 {
    uint32_t h[8];
    uint64_t n_bytes;       /* message length so far */
    uint8_t buf[64];        /* partial block */
    size_t n_buf;
};

void sha256_init(struct sha256 *s);
void sha256_update(struct sha256 *s, const void *data, size_t n);
/* Writes the digest; s must be initialised again before reuse. */
void sha256_final(struct sha256 *s, uint8_t out[SHA256_BYTES]);
/* One-shot digest of data[0..n). */
void sha256(const void *data, size_t n, uint8_t out[SHA256_BYTES]);

#ifdef __cplusplus
}
#endif
