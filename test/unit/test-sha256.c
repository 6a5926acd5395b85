/* test-sha256.c - common/sha256.c against the FIPS 180-4 example vectors (NIST CSRC
 * "SHA256.pdf": "abc", the 448-bit two-block message, one million 'a'), the empty
 * message, and incremental updates split at every offset of a 3-block message. */
#include "harness.h"
#include "sha256.h"

static void hex(const uint8_t *d, char *out)
{
    for (int i = 0; i < SHA256_BYTES; i++)
        snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void check(const void *msg, size_t n, const char *want)
{
    uint8_t d[SHA256_BYTES];
    char h[2 * SHA256_BYTES + 1];
    sha256(msg, n, d);
    hex(d, h);
    ASSERT_STREQ(h, want);
}

int main(void)
{
    check("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    check("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    check("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 56,
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* one million 'a' in uneven pieces */
    struct sha256 s;
    uint8_t d[SHA256_BYTES], ref[SHA256_BYTES];
    char h[2 * SHA256_BYTES + 1];
    static char a[1000];
    memset(a, 'a', sizeof(a));
    sha256_init(&s);
    for (size_t done = 0, k = 1; done < 1000000; k = k * 7 % 997 + 1) {
        size_t n = 1000000 - done < k ? 1000000 - done : k;
        sha256_update(&s, a, n);
        done += n;
    }
    sha256_final(&s, d);
    hex(d, h);
    ASSERT_STREQ(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    /* every split point of a 150-byte message gives the one-shot digest */
    uint8_t msg[150];
    for (int i = 0; i < 150; i++)
        msg[i] = (uint8_t)(i * 37 + 11);
    sha256(msg, sizeof(msg), ref);
    for (size_t cut = 0; cut <= sizeof(msg); cut++) {
        sha256_init(&s);
        sha256_update(&s, msg, cut);
        sha256_update(&s, msg + cut, sizeof(msg) - cut);
        sha256_final(&s, d);
        ASSERT_TRUE(memcmp(d, ref, SHA256_BYTES) == 0);
    }
    printf("sha256: ok\n");
    return 0;
}
