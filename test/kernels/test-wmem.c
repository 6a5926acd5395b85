/* test-wmem.c - the CPU backend's weight memory (wmem.c): allocations are 64-byte
 * aligned, never overlap and keep their bytes while others come and go; small ones share
 * 2 MiB-aligned chunks, a big one gets its own; every chunk is unmapped when its last
 * allocation is freed (nothing left mapped at the end); the chunks are advised for huge
 * pages where the kernel allows it (checked in /proc/self/smaps when THP is available);
 * MXFP4 weights prepared and released over and over leave nothing behind; the backend's
 * buffers of 2 MiB or more (KV caches) are 2 MiB-aligned and advised for huge pages too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "backend.h"
#include "cpu.h"

#define N_SMALL 300

/* "hg" in the VmFlags of the mapping that holds p (MADV_HUGEPAGE), -1 if unknown */
static int advised_huge(const void *p)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int in = 0, r = -1;

    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;

        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
            continue;
        }
        if (in && strncmp(line, "VmFlags:", 8) == 0) {
            r = strstr(line, " hg") != NULL;
            break;
        }
    }
    fclose(f);
    return r;
}

static bool thp_allowed(void)
{
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char buf[128] = "";

    if (!f)
        return false;
    if (!fgets(buf, sizeof(buf), f))
        buf[0] = 0;
    fclose(f);
    return strstr(buf, "[never]") == NULL && buf[0] != 0;
}

int main(void)
{
    struct cpu_wchunk *ch[N_SMALL], *big_ch;
    unsigned char *p[N_SMALL], *big;
    size_t sz[N_SMALL], chunks, bytes;

    cpu_wmem_stats(&chunks, &bytes);
    ASSERT_EQ(chunks, 0);

    /* many small ones (16 KiB - 100 KiB, like the tiny model's expert repacks) */
    for (int i = 0; i < N_SMALL; i++) {
        sz[i] = 16384 + (size_t)(i * 7919 % 90000);
        p[i] = cpu_wmem_alloc(sz[i], &ch[i]);
        ASSERT_TRUE(p[i] != NULL && ch[i] != NULL);
        ASSERT_EQ((uintptr_t)p[i] % 64, 0);
        memset(p[i], i & 0xff, sz[i]);
    }
    cpu_wmem_stats(&chunks, &bytes);
#if !defined(__SANITIZE_ADDRESS__)
    /* ~17 MiB in 4 MiB chunks: a handful, not one per allocation */
    ASSERT_TRUE(chunks >= 4 && chunks <= 8);
    if (thp_allowed())
        ASSERT_EQ(advised_huge(p[0]), 1);
#endif
    /* a big one (its own chunk) */
    big = cpu_wmem_alloc((size_t)9 << 20, &big_ch);
    ASSERT_TRUE(big != NULL);
    ASSERT_EQ((uintptr_t)big % 64, 0);
    memset(big, 0xa5, (size_t)9 << 20);
    /* free every other small one, then check the rest kept their bytes */
    for (int i = 0; i < N_SMALL; i += 2)
        cpu_wmem_free(ch[i]);
    for (int i = 1; i < N_SMALL; i += 2)
        for (size_t k = 0; k < sz[i]; k += 977)
            ASSERT_EQ(p[i][k], i & 0xff);
    for (size_t k = 0; k < ((size_t)9 << 20); k += 4099)
        ASSERT_EQ(big[k], 0xa5);
    /* no two live allocations overlap */
    for (int i = 1; i < N_SMALL; i += 2)
        for (int j = i + 2; j < N_SMALL; j += 2)
            ASSERT_TRUE(p[i] + sz[i] <= p[j] || p[j] + sz[j] <= p[i]);
    for (int i = 1; i < N_SMALL; i += 2)
        cpu_wmem_free(ch[i]);
    cpu_wmem_free(big_ch);
    cpu_wmem_stats(&chunks, &bytes);
    ASSERT_EQ(chunks, 0);
    ASSERT_EQ(bytes, 0);

    /* MXFP4 weights prepared and released over and over: nothing accumulates */
    {
        struct backend *be;
        struct backend_cfg cfg = { .n_threads = 1 };
        static uint8_t qs[256 * 128], sc[256 * 8];
        struct bweight w;

        ASSERT_OK(backend_new("cpu", &cfg, &be));
        for (size_t i = 0; i < sizeof(qs); i++)
            qs[i] = (uint8_t)(i * 37);
        for (size_t i = 0; i < sizeof(sc); i++)
            sc[i] = (uint8_t)(120 + i % 8);
        for (int round = 0; round < 200; round++) {
            w = (struct bweight){ .fmt = WFMT_MXFP4, .rows = 256, .cols = 256, .data = qs, .scale = sc };
            ASSERT_OK(backend_weight_prepare(be, &w));
            backend_weight_release(be, &w);
        }
        cpu_wmem_stats(&chunks, &bytes);
        ASSERT_EQ(chunks, 0);
        backend_free(be);
    }

    /* backend buffers of 2 MiB or more (KV caches) are 2 MiB-aligned and advised for huge
     * pages, keep their bytes and free cleanly; a small one stays as asked */
    {
        struct backend *be;
        struct backend_cfg cfg = { .n_threads = 1 };
        const size_t nb = (size_t)6 << 20;
        unsigned char *kvb, *small;

        ASSERT_OK(backend_new("cpu", &cfg, &be));
        ASSERT_OK(backend_buf_alloc(be, nb, 64, (void **)&kvb));
        ASSERT_OK(backend_buf_alloc(be, 4096, 64, (void **)&small));
        ASSERT_EQ((uintptr_t)kvb % ((uintptr_t)2 << 20), 0);
        ASSERT_EQ((uintptr_t)small % 64, 0);
        if (thp_allowed())
            ASSERT_EQ(advised_huge(kvb), 1);
        for (size_t i = 0; i < nb; i += 4096)
            kvb[i] = (unsigned char)(i >> 12);
        memset(small, 0x5a, 4096);
        for (size_t i = 0; i < nb; i += 4096)
            ASSERT_EQ(kvb[i], (unsigned char)(i >> 12));
        backend_buf_free(be, kvb);
        backend_buf_free(be, small);
        backend_free(be);
    }
    return 0;
}
