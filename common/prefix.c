/* prefix.c - see prefix.h. */
#include "prefix.h"

#include "sha256.h"

void prefix_root(const uint8_t deploy_salt[PREFIX_DIGEST_BYTES], const char *cache_salt, size_t n,
                 uint8_t ret_root[PREFIX_DIGEST_BYTES])
{
    static const char tag[] = "stepd prefix cache v1";
    uint8_t len[4] = { (uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24) };
    struct sha256 s;

    sha256_init(&s);
    sha256_update(&s, tag, sizeof(tag));
    sha256_update(&s, deploy_salt, PREFIX_DIGEST_BYTES);
    sha256_update(&s, len, sizeof(len));
    if (cache_salt && n)
        sha256_update(&s, cache_salt, n);
    sha256_final(&s, ret_root);
}

void prefix_block_digest(const uint8_t prev[PREFIX_DIGEST_BYTES], const int32_t *tokens, int n,
                         uint8_t ret[PREFIX_DIGEST_BYTES])
{
    uint8_t buf[256];
    struct sha256 s;

    sha256_init(&s);
    sha256_update(&s, prev, PREFIX_DIGEST_BYTES);
    for (int i = 0; i < n;) {
        int k = 0;

        for (; i < n && k + 4 <= (int)sizeof(buf); i++, k += 4) {
            uint32_t t = (uint32_t)tokens[i];

            buf[k] = (uint8_t)t;
            buf[k + 1] = (uint8_t)(t >> 8);
            buf[k + 2] = (uint8_t)(t >> 16);
            buf[k + 3] = (uint8_t)(t >> 24);
        }
        sha256_update(&s, buf, (size_t)k);
    }
    sha256_final(&s, ret);
}
