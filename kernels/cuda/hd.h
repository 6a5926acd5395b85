/* hd.h - what the host/device headers of the CUDA backend share: the HD qualifier and
 * the byte permute (PTX prmt) they are written with.
 *
 * The headers mx4.h, moe-plan.h, flash.h and graph-pad.h hold the parts of the kernels
 * that are arithmetic on indices and bytes.  nvcc compiles them into the kernels; the C
 * compiler compiles the same functions into test/gpu/test-cuda-host.c, which checks them
 * against the CPU backend on every machine (no GPU needed).  Plain C: no CUDA headers,
 * no C++ unless __CUDACC__.
 */
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD static inline
#endif

/* prmt.b32 d, a, b, c (default mode): the 8 bytes of {b, a} are indexed 0..3 (a) and 4..7
 * (b); byte k of d is selected by nibble k of c: bits 0-2 the index, bit 3 set = the sign
 * bit (bit 7) of the selected byte replicated over all 8 bits.  Only c[15:0] is read.
 * (Not __byte_perm(): that one ignores bit 3, and the compiler masks the selector.) */
HD uint32_t hd_prmt(uint32_t a, uint32_t b, uint32_t c)
{
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    uint64_t src = ((uint64_t)b << 32) | a;
    uint32_t d = 0;

    for (int k = 0; k < 4; k++) {
        uint32_t sel = (c >> (4 * k)) & 0xF;
        uint32_t byte = (uint32_t)(src >> (8 * (sel & 7))) & 0xFF;

        if (sel & 8)
            byte = (byte & 0x80) ? 0xFF : 0x00;
        d |= byte << (8 * k);
    }
    return d;
#endif
}

/* Part `part` of n_parts of [0, total) in units of `align` (the last part takes the
 * remainder; parts past the end are empty): the split-K partition of a GEMM's reduction
 * and the split-context partition of flash-decoding. */
HD void hd_split(int64_t total, int64_t align, int n_parts, int part, int64_t *lo, int64_t *hi)
{
    int64_t units = (total + align - 1) / align;
    int64_t per = (units + n_parts - 1) / n_parts;
    int64_t a = (int64_t)part * per * align, b = a + per * align;

    *lo = a < total ? a : total;
    *hi = b < total ? b : total;
}
