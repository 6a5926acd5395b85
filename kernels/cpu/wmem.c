/* wmem.c - memory for the CPU backend's repacked weights, in 2 MiB-aligned chunks that
 * the kernel is asked to back with transparent huge pages (MADV_HUGEPAGE).
 *
 * Why: the matmul kernels stream weights; with 4 KiB pages a pass over a few MiB of
 * them walks thousands of pages and misses the TLB all along.  Measured on the tiny
 * model (bench-engine, 6 runs interleaved with the build before, 2-core VM with THP in
 * "madvise" mode): batch-1 K=3 decode 4991 -> 5470 tok/s median (+9.6 %: the MTP drafts
 * and the verify step's experts are MXFP4), K=0 3231 -> 3343 (within the noise).  The
 * bytes are the same, only the pages under them.  BF16 weights stay where the loader
 * mapped them (the checkpoint file): putting them here too would copy them.
 *
 * Allocations are carved from the current chunk (64-byte aligned) and never move; a
 * chunk is unmapped when its last allocation is freed (so a model that is released
 * gives all of its memory back, and one that prepares and releases weights over and
 * over does not grow).  Process-wide: every CPU backend shares the chunks.  An allocation bigger than a chunk gets a chunk of its own.  Where
 * madvise fails (THP "never", old kernels) the chunk simply stays on normal pages.
 * Under AddressSanitizer every allocation is a plain posix_memalign, so that the
 * kernels' reads stay checked. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "log.h"
#include "cpu.h"

#if defined(__SANITIZE_ADDRESS__)
#define WMEM_PLAIN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define WMEM_PLAIN 1
#endif
#endif

#define WMEM_HUGE ((size_t)2 << 20)
#define WMEM_CHUNK ((size_t)4 << 20)
#define WMEM_ALIGN ((size_t)64)

struct cpu_wchunk {
    char *base;             /* 2 MiB aligned */
    void *map;              /* what mmap returned, and its length */
    size_t map_len;
    size_t size, used;
    size_t live;            /* allocations not yet freed */
    bool plain;             /* one posix_memalign block (sanitiser builds) */
};

static pthread_mutex_t wmem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct cpu_wchunk *wmem_cur;        /* the chunk new allocations come from */
static size_t wmem_chunks, wmem_bytes;     /* mapped, for cpu_wmem_stats */

static struct cpu_wchunk *chunk_new(size_t size)
{
    struct cpu_wchunk *c = calloc(1, sizeof(*c));

    if (!c)
        return NULL;
    size = (size + WMEM_HUGE - 1) & ~(WMEM_HUGE - 1);
    c->map_len = size + WMEM_HUGE;          /* room to align the base */
    c->map = mmap(NULL, c->map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (c->map == MAP_FAILED) {
        free(c);
        return NULL;
    }
    c->base = (char *)(((uintptr_t)c->map + WMEM_HUGE - 1) & ~(uintptr_t)(WMEM_HUGE - 1));
    c->size = size;
#ifdef MADV_HUGEPAGE
    if (madvise(c->base, size, MADV_HUGEPAGE) != 0)
        log_debug("cpu wmem: madvise(MADV_HUGEPAGE) failed (errno %d): normal pages", errno);
#endif
    wmem_chunks++;
    wmem_bytes += c->map_len;
    return c;
}

static void chunk_unmap(struct cpu_wchunk *c)
{
    wmem_chunks--;
    wmem_bytes -= c->map_len;
    munmap(c->map, c->map_len);
    free(c);
}

void *cpu_wmem_alloc(size_t n, struct cpu_wchunk **ret_chunk)
{
    struct cpu_wchunk *c;
    void *p;

    *ret_chunk = NULL;
    if (n == 0)
        n = 1;
    n = (n + WMEM_ALIGN - 1) & ~(WMEM_ALIGN - 1);
#ifdef WMEM_PLAIN
    c = calloc(1, sizeof(*c));
    if (!c || posix_memalign(&p, WMEM_ALIGN, n) != 0) {
        free(c);
        return NULL;
    }
    c->plain = true;
    c->base = p;
    c->live = 1;
    *ret_chunk = c;
    return p;
#else
    pthread_mutex_lock(&wmem_mu);
    c = wmem_cur;
    if (!c || c->size - c->used < n) {
        if (n > WMEM_CHUNK / 2) {
            /* a big one: a chunk of its own, the current one stays current */
            c = chunk_new(n);
        } else {
            c = chunk_new(WMEM_CHUNK);
            if (c)
                wmem_cur = c;       /* the old one goes when its last allocation does */
        }
        if (!c) {
            pthread_mutex_unlock(&wmem_mu);
            return NULL;
        }
    }
    p = c->base + c->used;
    c->used += n;
    c->live++;
    pthread_mutex_unlock(&wmem_mu);
    *ret_chunk = c;
    return p;
#endif
}

void cpu_wmem_free(struct cpu_wchunk *c)
{
    if (!c)
        return;
    if (c->plain) {
        free(c->base);
        free(c);
        return;
    }
    pthread_mutex_lock(&wmem_mu);
    if (--c->live == 0) {
        if (c == wmem_cur)
            wmem_cur = NULL;
        chunk_unmap(c);
    }
    pthread_mutex_unlock(&wmem_mu);
}

void cpu_wmem_stats(size_t *ret_chunks, size_t *ret_bytes)
{
    pthread_mutex_lock(&wmem_mu);
    *ret_chunks = wmem_chunks;
    *ret_bytes = wmem_bytes;
    pthread_mutex_unlock(&wmem_mu);
}
